"""One OpenEnv ``/ws`` session playing agentrl episodes: the wire models and the message handling.

The protocol is described in :mod:`agentrl.adapters.openenv_server`, which accepts the connections
and owns what sessions share (the env factory, the task list, the session limit). Here: a client
message in, the reply out; each ``reset`` builds a fresh env, each ``step`` turns the action into
the env's :class:`~agentrl.Action` as the rollout loop does (tool calls parsed with the env's
``tool_parser``, call ids unique in the episode), and any failure of the env ends its episode with
an ``EXECUTION_ERROR`` reply, never the server.

What a client sends is data: a message of any shape (invalid UTF-8, 5,000 levels deep) is an
``INVALID_JSON`` reply (:func:`agentrl.http_guard.parse_json`; a large one is parsed in a worker thread),
and the server never reads a host file a client could name: a picture in an observation given as a
``file://`` URL is shown only when the server's own task rows name that URL (:attr:`SessionHost.image_files`);
any other ends the episode (an env hands over its own pictures as PIL images or ``data:`` URLs).
"""

from __future__ import annotations

import asyncio
import json
import logging
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol
from urllib.parse import urlparse

from pydantic import BaseModel, ConfigDict, Field, StrictInt, ValidationError

from agentrl.adapters.gymnasium import json_safe
from agentrl.env import Env, call_env, check_reset, check_step
from agentrl.http_guard import INLINE_PARSE_BYTES, BadRequest, parse_json
from agentrl.images import ImageError, count_images, normalize
from agentrl.parsing import OpenAIToolCallsParser, get_parser, unique_call_ids
from agentrl.rollout.episode import release_episode
from agentrl.types import Action, ToolCall

log = logging.getLogger(__name__)

DEFAULT_STEP_TIMEOUT = 60.0
"""Seconds a ``reset``/``step`` may take when the env sets no ``step_timeout`` (the rollout's default)."""


# -- the wire models (validation and the /schema answer) ------------------------------------------


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class FunctionCall(_Strict):
    name: str = Field(description="the tool's name")
    arguments: str | dict[str, Any] = Field(default="{}", description="JSON object, as a string or an object")


class ToolCallModel(_Strict):
    """One call in OpenAI's ``tool_calls`` shape."""

    id: str = ""
    type: Literal["function"] = "function"
    function: FunctionCall


class TurnAction(_Strict):
    """The assistant turn: its text, and the tool calls when the client already has them apart."""

    text: str = Field(description="the assistant's reply; tool calls in it are parsed with the env's tool_parser")
    tool_calls: list[ToolCallModel] | None = Field(
        default=None, description="OpenAI-style tool calls; when given, the text is not parsed for calls"
    )
    metadata: dict[str, Any] = Field(default_factory=dict)


class ListToolsAction(_Strict):
    type: Literal["list_tools"]
    metadata: dict[str, Any] = Field(default_factory=dict)


class CallToolAction(_Strict):
    type: Literal["call_tool"]
    tool_name: str
    arguments: dict[str, Any] = Field(default_factory=dict)
    metadata: dict[str, Any] = Field(default_factory=dict)


class ServedObservation(BaseModel):
    """What a step shows (schema only; ``done``/``reward`` travel beside it, as OpenEnv sends them)."""

    messages: list[dict[str, Any]] = Field(description="the env's chat messages (user / tool / system turns)")
    info: dict[str, Any] = Field(default_factory=dict, description="the env's info, JSON-safe")
    truncated: bool = Field(default=False, description="a limit (max_turns, the env's own) ended the episode")
    tool_name: str | None = Field(default=None, description="call_tool actions: the tool called")
    result: str | None = Field(default=None, description="call_tool actions: the tool's answer")
    done: bool = False
    reward: float | None = None


class SessionHost(Protocol):
    """What a session needs from its server (:class:`agentrl.adapters.openenv_server.EnvServer`).

    ``image_files``: the ``file://`` URLs the server's own task rows name (the operator's pictures; an
    observation may show those and no other host file). ``sandbox_pool``: where the envs it builds take
    their sandbox (set on each env that has none of its own; None: the process's default pool)."""

    factory: Callable[[], Env]
    step_timeout: float
    tools: list[dict[str, Any]]
    image_files: frozenset[str]
    sandbox_pool: Any

    def task_for(self, seed: int | None, row: dict[str, Any]) -> dict[str, Any]: ...

    def json_rpc(self, request: Any, episode: Episode | None = None) -> dict[str, Any]: ...


class SessionState(BaseModel):
    episode_id: str | None = None
    step_count: int = 0
    done: bool = False


class ResetData(BaseModel):
    model_config = ConfigDict(extra="allow")  # the rest is the task row
    seed: StrictInt | None = None
    episode_id: str | None = Field(default=None, max_length=255)


class _Message(_Strict):
    type: str
    data: dict[str, Any] = Field(default_factory=dict)


class Failed(Exception):
    """The request fails with an OpenEnv error ``code``; the session goes on."""

    def __init__(self, code: str, message: str, **extra: Any) -> None:
        super().__init__(message)
        self.code, self.extra = code, extra


def validation_error(exc: ValidationError) -> Failed:
    errors = json.loads(exc.json(include_url=False, include_input=False))
    where = "; ".join(f"{'.'.join(map(str, e['loc'])) or 'message'}: {e['msg']}" for e in errors)
    return Failed("VALIDATION_ERROR", f"Invalid message: {where}", errors=errors)


def openenv_tool(spec: dict[str, Any]) -> dict[str, Any]:
    """An OpenAI tool spec as OpenEnv's / MCP's tool entry (both schema key spellings)."""
    fn = spec.get("function", spec)
    params = fn.get("parameters") or {"type": "object", "properties": {}}
    return {"name": fn.get("name", ""), "description": fn.get("description", ""), "input_schema": params}


# -- one episode, one session ---------------------------------------------------------------------


@dataclass
class Episode:
    env: Env
    episode_id: str
    step_timeout: float
    max_turns: int | None
    turns: int = 0
    done: bool = False
    closed: bool = False
    seen_ids: set[str] = field(default_factory=set)


class Session:
    """One WebSocket connection: at most one live episode, played one message at a time."""

    def __init__(self, server: SessionHost) -> None:
        self.server = server
        self.episode: Episode | None = None

    async def handle(self, raw: str | bytes) -> dict[str, Any] | None:
        """The reply to one client message (None: the client asked to close)."""
        try:
            try:
                if len(raw) <= INLINE_PARSE_BYTES:
                    msg = parse_json(raw, what="message")
                else:  # a big message is parsed in a worker thread: the other sessions go on meanwhile
                    msg = await asyncio.to_thread(parse_json, raw, what="message")
            except BadRequest as exc:
                raise Failed("INVALID_JSON", f"Invalid JSON: {exc}") from None
            if not isinstance(msg, dict):
                raise Failed("VALIDATION_ERROR", f"a message is a JSON object with a 'type', got {type(msg).__name__}")
            kind = msg.get("type")
            if kind not in ("reset", "step", "state", "close", "mcp"):
                raise Failed(
                    "UNKNOWN_TYPE", f"Unknown message type: {kind!r} (expected reset, step, state, close or mcp)"
                )
            try:
                data = _Message.model_validate(msg).data
            except ValidationError as exc:
                raise validation_error(exc) from None
            if kind == "close":
                return None
            if kind == "mcp":
                return {"type": "mcp", "data": self.server.json_rpc(data, self.episode)}
            if kind == "state":
                ep = self.episode
                state = (
                    SessionState(episode_id=ep.episode_id, step_count=ep.turns, done=ep.done) if ep else SessionState()
                )
                return {"type": "state", "data": state.model_dump()}
            result = await (self.reset(data) if kind == "reset" else self.step(data))
            return {"type": "observation", "data": json_safe(result)}
        except Failed as exc:
            return {"type": "error", "data": {"message": str(exc), "code": exc.code, **exc.extra}}

    async def reset(self, data: dict[str, Any]) -> dict[str, Any]:
        try:
            req = ResetData.model_validate(data)
        except ValidationError as exc:
            raise validation_error(exc) from None
        task = self.server.task_for(req.seed, dict(req.model_extra or {}))
        await self.end_episode()
        try:
            env = self.server.factory()
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # SystemExit from user code too: this reset fails, not the session
            raise Failed("FACTORY_ERROR", f"building the env failed: {type(exc).__name__}: {exc}") from None
        if self.server.sandbox_pool is not None and getattr(env, "sandbox_pool", None) is None:
            env.sandbox_pool = self.server.sandbox_pool
        timeout = getattr(env, "step_timeout", None) or self.server.step_timeout
        episode = Episode(env, req.episode_id or uuid.uuid4().hex, timeout, getattr(env, "max_turns", None))
        self.episode = episode
        obs, info = await self._call("reset", check_reset, env.reset, seed=req.seed, options=task)
        obs = await self._json_safe(obs)
        return {"observation": {"messages": obs, "info": info, "truncated": False}, "reward": None, "done": False}

    async def step(self, data: dict[str, Any]) -> dict[str, Any]:
        if data.get("type") == "list_tools":
            self._parse(ListToolsAction, data)
            tools = self.episode.env.tool_schemas() if self.episode else self.server.tools
            return {"observation": {"tools": [openenv_tool(t) for t in tools]}, "reward": None, "done": False}
        ep = self.episode
        if ep is None:
            raise Failed("EXECUTION_ERROR", "no episode in this session: send reset first")
        if ep.done:
            raise Failed("EXECUTION_ERROR", "the episode is over (done): send reset to start another")
        call_tool = data.get("type") == "call_tool"
        action = self._action(data, ep)
        messages, reward, terminated, truncated, info = await self._call("step", check_step, ep.env.step, action)
        messages = await self._json_safe(messages)
        ep.turns += 1
        if not (terminated or truncated) and ep.max_turns and ep.turns >= ep.max_turns:
            truncated = True  # the rollout loop's own limit, applied here so every client gets it
        ep.done = terminated or truncated
        observation: dict[str, Any] = {"messages": messages, "info": info, "truncated": truncated}
        if call_tool:
            answer = [m for m in messages if m.get("tool_call_id") == action.tool_calls[0].id]
            observation.update(tool_name=action.tool_calls[0].name, result=answer[0]["content"] if answer else None)
        if ep.done:
            await self.end_episode(keep_state=True)
        return {"observation": observation, "reward": reward, "done": ep.done}

    def _action(self, data: dict[str, Any], ep: Episode) -> Action:
        """The step's data as the env's :class:`Action`, call ids unique in the episode as in a rollout."""
        if data.get("type") == "call_tool":
            call = self._parse(CallToolAction, data)
            action = Action(text="", tool_calls=[ToolCall(call.tool_name, call.arguments, "call_0")])
        else:
            turn = self._parse(TurnAction, data)
            if turn.tool_calls is not None:
                message = {"content": turn.text, "tool_calls": [c.model_dump() for c in turn.tool_calls]}
                _, calls, errors = OpenAIToolCallsParser().parse_message(message)
            else:
                _, calls, errors = get_parser(getattr(ep.env, "tool_parser", "hermes")).parse(turn.text)
            action = Action(text=turn.text, tool_calls=calls, errors=errors)
        unique_call_ids((*action.tool_calls, *action.errors), ep.turns, ep.seen_ids)
        return action

    @staticmethod
    def _parse(model: type[BaseModel], data: dict[str, Any]) -> Any:
        try:
            return model.model_validate(data)
        except ValidationError as exc:
            raise validation_error(exc) from None

    async def _call(self, verb: str, check: Callable[[Any], Any], fn: Callable[..., Any], *args: Any, **kw: Any) -> Any:
        """Run an env verb under the episode's timeout; any failure ends the episode, never the server."""
        ep = self.episode
        assert ep is not None
        try:
            async with asyncio.timeout(ep.step_timeout):
                return check(await call_env(fn, *args, **kw))
        except TimeoutError:
            why = f"{verb}() took longer than {ep.step_timeout:g}s"
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # SystemExit from user code too: it fails this episode only
            why = f"{verb}() raised {type(exc).__name__}: {exc}"
        log.warning("episode %s failed: %s", ep.episode_id, why)
        await self.end_episode()
        raise Failed("EXECUTION_ERROR", f"the env failed, episode over: {why}")

    async def _json_safe(self, messages: list[Any]) -> list[Any]:
        """Messages whose pictures (PIL images from a Python env) travel as data-URL image parts (JSON can carry
        them), encoded in a worker thread; a picture that cannot be used ends the episode, as a bad return.

        A ``file://`` picture is read only when the server's task rows name that URL: anything else could
        come from the client (a row sent with the reset, an action, a tool's argument), and a served env
        must not show a client the host's files."""
        try:
            if not count_images(messages):
                return messages
            files = list(file_urls(messages))
            named = [url for url in files if url not in self.server.image_files]
            if named:
                raise ImageError(
                    f"its observation shows the host file {named[0][:200]!r}, which the server's task rows do "
                    "not name: a served env reads no file a client could name; hand over the picture as a PIL "
                    "image or a data: URL"
                )
            return (await asyncio.to_thread(normalize, messages, files=bool(files)))[0]
        except ImageError as exc:
            await self.end_episode()
            raise Failed("EXECUTION_ERROR", f"the env failed, episode over: {exc}") from None

    async def end_episode(self, keep_state: bool = False) -> None:
        """Close the episode's env (once) and give back its sandbox; errors are logged, not raised."""
        ep = self.episode
        if ep is None or ep.closed:
            return
        ep.closed = True
        meta: dict[str, Any] = {}
        try:
            await call_env(ep.env.close)
        except asyncio.CancelledError:
            raise
        except BaseException as exc:
            meta["close_error"] = f"{type(exc).__name__}: {exc}"
        await release_episode(ep.env, meta)
        if meta:
            log.warning("episode %s: close failed: %s", ep.episode_id, meta["close_error"])
        if not keep_state:
            self.episode = None


def file_urls(messages: Sequence[Mapping[str, Any]]) -> Iterator[str]:
    """The ``file://`` URLs of the image parts of ``messages`` (the parts :func:`agentrl.images.normalize`
    decodes: ``image_url`` parts and ``image`` parts given by URL)."""
    for m in messages:
        content = m.get("content")
        for part in content if isinstance(content, list) else ():
            if not isinstance(part, dict):
                continue
            if part.get("type") == "image_url":
                spec = part.get("image_url")
                src = spec.get("url") if isinstance(spec, dict) else spec
            else:
                src = part.get("image", part.get("url")) if part.get("type") == "image" else None
            if isinstance(src, str) and not src.startswith("data:") and urlparse(src).scheme == "file":
                yield src


def named_files(rows: Sequence[Any]) -> frozenset[str]:
    """Every ``file://`` URL a string of ``rows`` holds, at any depth: the pictures a server's task rows name."""
    found: set[str] = set()
    todo: list[Any] = list(rows)
    while todo:
        value = todo.pop()
        if isinstance(value, dict):
            todo.extend(value.values())
        elif isinstance(value, list | tuple):
            todo.extend(value)
        elif isinstance(value, str) and not value.startswith("data:") and urlparse(value).scheme == "file":
            found.add(value)
    return frozenset(found)
