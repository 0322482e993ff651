"""What an agent sends: the ``/v1/chat/completions`` body, validated, and the refusals it can earn.

Bodies are validated with pydantic: a bad field is a 422 naming it (``messages.0.role: ...``), and
parameters the proxy cannot honour (``n > 1``, ``stop``, ``logprobs``, a forced ``tool_choice``,
``parallel_tool_calls: false``, ...) are refused, not silently ignored, because an agent that asked
for them would otherwise act on a reply it did not ask for. ``stream`` (with ``stream_options``
``include_usage``) is honoured: the turn comes as server-sent events, in one chunk
(:class:`~agentrl.proxy.replies.Streamed`), as LangChain's and the Agents SDK's streaming modes ask. ``temperature``,
``top_p``, ``max_tokens`` and ``seed`` are accepted and recorded (:meth:`ChatRequest.record`) but the
run's sampling flags apply: the rollout log-probs must be those of the policy the trainer optimises.
``user``, ``metadata`` and ``store`` change nothing about the answer; they are recorded with the turn
(the proxy stores nothing beyond the sample). Every body is read by :func:`agentrl.http_guard.parse_json`:
invalid JSON, invalid UTF-8 and nesting deeper than :data:`~agentrl.http_guard.MAX_DEPTH` are a 400 with
the reason, never a ``RecursionError`` further in.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Annotated, Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from agentrl.http_guard import BadRequest, parse_json
from agentrl.types import Message

__all__ = [
    "ChatMessageIn",
    "ChatRequest",
    "EndRequest",
    "OpenRequest",
    "Refusal",
    "StreamOptions",
    "parse_end",
    "parse_open",
    "parse_request",
    "validation_message",
]

Text = Annotated[str, Field(strict=True)]
_M = TypeVar("_M", bound=BaseModel)


@dataclass
class Refusal:
    """An HTTP error answer to a request (OpenAI's error shape, so clients raise their usual errors)."""

    status: int
    message: str
    param: str | None = None

    def body(self) -> dict[str, Any]:
        kind = "invalid_request_error" if self.status < 500 else "server_error"
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": None}}


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class ToolCallFunction(_Strict):
    name: Annotated[str, Field(strict=True, min_length=1)]
    arguments: Text


class ToolCallIn(_Strict):
    """A tool call echoed back in history. ``index`` is the position a streamed delta carried; clients
    that build their turns from streamed chunks (verifiers' chat program) echo it, and it says nothing
    the call's place in the list does not, so it is checked and dropped."""

    id: Text
    type: Literal["function"] = "function"
    function: ToolCallFunction
    index: int | None = Field(default=None, ge=0, exclude=True)


class TextPart(_Strict):
    type: Literal["text"]
    text: Text


_ECHOED = ("annotations", "audio", "function_call", "reasoning_content")
"""Keys an ``openai`` client echoes on assistant messages it got back; dropped when empty."""


class ChatMessageIn(BaseModel):
    """One request message (OpenAI's shape). ``developer`` is rendered as ``system``.

    An assistant message's ``refusal`` (OpenAI's field for a declined answer; the proxy's replies say
    ``null``) is rendered as its content when it has none, since chat templates know no such field; a
    message with both is refused.
    """

    model_config = ConfigDict(extra="allow", allow_inf_nan=False)
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Text | list[TextPart] | None = None
    name: Text | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: Text | None = None
    refusal: Text | None = None

    @field_validator("content")
    @classmethod
    def _text(cls, v: Any) -> Any:
        return "".join(p.text for p in v) if isinstance(v, list) else v

    def as_message(self) -> Message:
        """The message as the chat template renders it; ValueError for what it cannot render."""
        for key, value in (self.model_extra or {}).items():
            if key not in _ECHOED or value:
                raise ValueError(f"unsupported message field {key!r}")
        if self.content is None and self.role != "assistant":
            raise ValueError(f"a {self.role} message needs content")
        msg: dict[str, Any] = {"role": "system" if self.role == "developer" else self.role}
        if self.refusal is not None and self.role != "assistant":
            raise ValueError(f"a {self.role} message has no refusal (only assistant messages do)")
        if self.refusal and self.content:  # a template renders one text: neither may be dropped silently
            raise ValueError("an assistant message with both content and a refusal (the template renders one text)")
        msg["content"] = self.content or self.refusal or ""
        if self.tool_calls:
            msg["tool_calls"] = [c.model_dump() for c in self.tool_calls]
        for key in ("name", "tool_call_id"):
            if getattr(self, key) is not None:
                msg[key] = getattr(self, key)
        return msg  # type: ignore[return-value]


class FunctionSpec(_Strict):
    name: Annotated[str, Field(strict=True, min_length=1)]
    description: Text | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolSpec(_Strict):
    type: Literal["function"]
    function: FunctionSpec


def _only(name: str, allowed: tuple[Any, ...], why: str) -> Any:
    """A validator refusing every value of ``name`` but ``allowed`` (refused, never silently ignored)."""

    def check(v: Any) -> Any:
        if not any(v is a or (v == a and type(v) is type(a)) for a in allowed):
            raise ValueError(f"{name}={v!r} is not supported: {why}")
        return v

    return field_validator(name)(check)


class StreamOptions(_Strict):
    """``stream_options``: ``include_usage`` adds the usage chunk (:class:`~agentrl.proxy.replies.Streamed`).
    ``include_obfuscation`` (OpenAI pads chunks against length side channels) may be false or absent:
    the proxy's chunks carry no padding, so asking for it is refused rather than ignored."""

    include_usage: bool | None = None
    include_obfuscation: bool | None = None

    _obfuscation = _only("include_obfuscation", (None, False), "the proxy's chunks carry no obfuscation padding")


class ChatRequest(_Strict):
    """The ``/v1/chat/completions`` body the proxy serves. Unknown fields are refused (422 naming them)."""

    model: Text | None = None
    messages: Annotated[list[ChatMessageIn], Field(min_length=1)]
    tools: list[ToolSpec] | None = None
    tool_choice: Literal["auto"] | None = None
    parallel_tool_calls: bool | None = None
    temperature: Annotated[float, Field(ge=0, le=2)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    seed: int | None = None
    n: int | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    stop: None = None
    logprobs: bool | None = None
    top_logprobs: None = None
    frequency_penalty: Literal[0] | None = None
    presence_penalty: Literal[0] | None = None
    response_format: dict[Literal["type"], Literal["text"]] | None = None
    user: Text | None = None
    metadata: dict[str, Any] | None = None
    store: bool | None = None

    _n = _only("n", (None, 1), "the proxy records one sample per request")
    _lp = _only("logprobs", (None, False), "log-probs are recorded in the sample, not returned")
    _ptc = _only(
        "parallel_tool_calls",
        (None, True),
        "the policy may write several tool calls in one turn, and the proxy answers with the turn it generated",
    )

    @model_validator(mode="after")
    def _streamed(self) -> ChatRequest:
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed with stream: true (as OpenAI's API says)")
        return self

    def record(self) -> dict[str, Any]:
        """What the request asked that the answer does not follow, kept with its turn (``env_infos``):
        the sampling it asked for (the run's sampling flags apply), ``user``, ``metadata``, ``store``."""
        keys = (
            "model",
            "temperature",
            "top_p",
            "max_tokens",
            "max_completion_tokens",
            "seed",
            "user",
            "metadata",
            "store",
        )
        return {k: getattr(self, k) for k in keys if getattr(self, k) is not None}


class EndRequest(_Strict):
    """The ``POST /s/TOKEN/end`` body: the agent is done. ``reward``: the episode's (finite; only for a session of
    ``agentrl proxy``); ``output``: the agent's final output (any JSON), what ``reward()`` gets as ``output``."""

    reward: float | None = None
    output: Any = None

    @field_validator("reward", mode="before")
    @classmethod
    def _number(cls, v: Any) -> Any:
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v)):
            raise ValueError(f"must be a finite number, not {v!r}")
        return v


class OpenRequest(_Strict):
    """The ``POST /sessions`` body of ``agentrl proxy`` (empty: ``{}``). ``name``: the session's id in its
    samples (``metadata.task.session``) and log lines, unique among the sessions the server remembers
    (default: a random one). It is a label, not a credential: the session's token is what reaches it."""

    name: Annotated[str, Field(strict=True, pattern=r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,127}$")] | None = None


def parse_end(raw: bytes) -> EndRequest | Refusal:
    """An ``/end`` body (empty: ``{}``) validated, or the refusal (400 not a JSON object, 422 naming the field)."""
    return _validated(EndRequest, raw)


def parse_open(raw: bytes) -> OpenRequest | Refusal:
    """A ``/sessions`` body (empty: ``{}``) validated, or the refusal (400 not a JSON object, 422 naming the field)."""
    return _validated(OpenRequest, raw)


def _validated(model: type[_M], raw: bytes) -> _M | Refusal:
    body = json_object(raw, empty_ok=True)
    if isinstance(body, Refusal):
        return body
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        loc = exc.errors()[0]["loc"] if exc.errors() else ()
        return Refusal(422, validation_message(exc), ".".join(str(x) for x in loc) or None)


def validation_message(exc: ValidationError) -> str:
    """``messages.0.role: Input should be ...; n: Value error, n=2 is not supported: ...``."""
    return "; ".join(f"{'.'.join(str(x) for x in e['loc']) or 'body'}: {e['msg']}" for e in exc.errors())


def json_object(raw: bytes, *, empty_ok: bool = False) -> dict[str, Any] | Refusal:
    """The body as a JSON object (``{}`` for an empty one when ``empty_ok``), or the 400 saying why not
    (not JSON, not UTF-8, nested deeper than :data:`~agentrl.http_guard.MAX_DEPTH`)."""
    try:
        body = parse_json(raw or b"{}" if empty_ok else raw, what="the body")
    except BadRequest as exc:
        return Refusal(exc.status, str(exc))
    if not isinstance(body, dict):
        return Refusal(400, "the body must be a JSON object")
    return body


def parse_request(raw: bytes) -> tuple[ChatRequest, list[Message], list[dict[str, Any]]] | Refusal:
    """A request body as (the validated request, its messages as the template renders them, its tools),
    or the refusal (400 not a JSON object, 422 naming the first bad field)."""
    body = json_object(raw)
    if isinstance(body, Refusal):
        return body
    try:
        req = ChatRequest.model_validate(body)
    except ValidationError as exc:
        loc = exc.errors()[0]["loc"] if exc.errors() else ()
        return Refusal(422, validation_message(exc), ".".join(str(x) for x in loc) or None)
    messages = []
    for i, m in enumerate(req.messages):
        try:
            messages.append(m.as_message())
        except ValueError as exc:
            return Refusal(422, f"messages.{i}: {exc}", f"messages.{i}")
    return req, messages, [t.model_dump(exclude_none=True) for t in req.tools or []]
