"""What the agent gets back (an OpenAI ``ChatCompletion``, or its stream), and how its next request is read against it.

The reply's ``content`` is the turn's text without the tool-call markup, stripped by the same format
the episode loop parsed the calls with (:func:`reply_content`). The agent sends the reply back in
its next request, re-serialised by its own client: :func:`same_history` compares that echo by
meaning (tool-call arguments as parsed JSON, absent/``None``/``""`` content alike), so an agent that
writes JSON compactly (``JSON.stringify``, ``separators=(",", ":")``) still extends its episode
instead of starting a new segment every turn.

A request with ``stream: true`` (LangChain's ``astream`` and LangGraph's ``stream_mode="messages"``,
the Agents SDK's ``run_streamed``) gets the same completion as server-sent events (:class:`Streamed`):
the whole turn in one chunk, since the proxy answers only once the turn is generated and recorded.
"""

from __future__ import annotations

import json
import secrets
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from agentrl.http_guard import json_bytes
from agentrl.parsing import PARSERS, get_parser
from agentrl.proxy.requests import ChatRequest
from agentrl.types import Action, Message

__all__ = ["Streamed", "completion", "reply_content", "same_history"]


def completion(request: ChatRequest, action: Action, message: Message) -> dict[str, Any]:
    """The OpenAI ``ChatCompletion`` answering ``request`` with the assistant ``message``.

    ``usage`` is the turn as the engine saw it: ``prompt_tokens`` the tokens it read before sampling
    (:attr:`Action.prompt_length <agentrl.types.Action>`: the episode's ledger, which keeps the tokens
    the episode sampled where a re-rendering of the request's messages would differ), ``completion_tokens`` the tokens it
    sampled (stop token included). It is ``None`` (as OpenAI's schema allows) for a turn no engine
    sampled (a scripted :func:`~agentrl.rollout.scripted.play`), rather than reported wrong.
    """
    calls = message.get("tool_calls") or []
    finish = "length" if action.finish_reason == "length" else "tool_calls" if calls else "stop"
    out: dict[str, Any] = {
        "role": "assistant",
        "content": message["content"] if not calls else message["content"] or None,
        "refusal": None,
    }
    if calls:
        out["tool_calls"] = calls
    usage = None
    if action.prompt_length is not None:
        p, n = action.prompt_length, len(action.token_ids)
        usage = {"prompt_tokens": p, "completion_tokens": n, "total_tokens": p + n}
    return {
        "id": f"chatcmpl-{secrets.token_hex(12)}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": request.model or "agentrl-policy",
        "system_fingerprint": None,
        "choices": [{"index": 0, "message": out, "finish_reason": finish, "logprobs": None}],
        "usage": usage,
    }


@dataclass
class Streamed:
    """A completion the agent asked to have streamed (``stream: true``), as OpenAI's server-sent events.

    Chunks: the message (role, content, every tool call with its ``index``), then ``finish_reason``, then,
    when ``include_usage`` (``stream_options``), a chunk with ``usage`` and no choices; then ``[DONE]``.
    A client that joins the deltas gets exactly :attr:`completion`'s message, so its echo in the next
    request extends the conversation as a non-streamed reply's does.
    """

    completion: dict[str, Any]
    include_usage: bool = False

    def events(self) -> Iterator[str]:
        """The ``data: ...`` lines of the stream, each ending its event."""
        c = self.completion
        head = {k: c[k] for k in ("id", "created", "model", "system_fingerprint")}
        head["object"] = "chat.completion.chunk"
        extra = {"usage": None} if self.include_usage else {}
        choice, message = c["choices"][0], c["choices"][0]["message"]
        delta = {"role": "assistant", "content": message["content"], "refusal": None}
        if message.get("tool_calls"):
            delta["tool_calls"] = [{"index": i, **tc} for i, tc in enumerate(message["tool_calls"])]
        for part, finish in ((delta, None), ({}, choice["finish_reason"])):
            body = {"index": 0, "delta": part, "finish_reason": finish, "logprobs": None}
            yield _event({**head, "choices": [body], **extra})
        if self.include_usage and c.get("usage") is not None:
            yield _event({**head, "choices": [], "usage": c["usage"]})
        yield "data: [DONE]\n\n"


def _event(chunk: dict[str, Any]) -> str:
    return f"data: {json_bytes(chunk).decode()}\n\n"  # a lone surrogate the model wrote goes as its JSON escape


def reply_content(action: Action, parser: str) -> str:
    """The turn's text as the reply's ``content``: without the markup of its tool calls.

    The episode loop parsed the calls with the run's ``--tool-parser`` or else the env's; the action does
    not say which, so the format is the one whose parse of the text gives exactly the action's calls
    (``parser`` tried first). A turn without calls, with a call the parser could not read (the agent
    gets the whole text to see what went wrong), or whose calls no format reproduces (a chat-completions
    engine returned them apart from the text) keeps its text as it is.
    """
    if not action.tool_calls or action.errors:
        return action.text
    wanted = [(c.name, c.arguments) for c in action.tool_calls]
    for name in dict.fromkeys((parser, *PARSERS)):
        content, calls, errors = get_parser(name).parse(action.text)
        if not errors and [(c.name, c.arguments) for c in calls] == wanted:
            return content
    return action.text


def same_history(echoed: list[Message], ours: list[Message]) -> bool:
    """Whether the agent's messages are ours, as its client re-serialised them."""
    return len(echoed) == len(ours) and all(_canonical(a) == _canonical(b) for a, b in zip(echoed, ours))


def _canonical(message: Message) -> dict[str, Any]:
    m: dict[str, Any] = {k: v for k, v in message.items() if v is not None}
    m["content"] = m.get("content") or ""
    calls = m.pop("tool_calls", None) or []
    if calls:
        m["tool_calls"] = [_call(c) for c in calls]
    return m


def _call(call: dict[str, Any]) -> tuple[Any, ...]:
    fn = call.get("function") or {}
    args = fn.get("arguments")
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            pass  # not JSON: compared as written
    return call.get("id"), call.get("type") or "function", fn.get("name"), args
