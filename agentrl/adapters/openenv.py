"""An OpenEnv server as an agentrl :class:`~agentrl.Env`, over plain WebSocket JSON (no openenv import).

OpenEnv (openenv-core) serves an ``Environment`` with ``create_app(env_factory, ActionCls,
ObservationCls, max_concurrent_envs=N)``. Its HTTP ``POST /reset`` and ``POST /step`` are
*stateless*: each request builds a fresh environment and closes it after answering, so a
multi-step episode cannot run over them. Episodes live on the WebSocket ``/ws``: each connection
is a session with its own environment instance, which is how concurrent episodes stay isolated.
:class:`OpenEnvEnv` therefore holds one ``/ws`` connection per episode and speaks its messages:

- client -> server: ``{"type": "reset", "data": {"seed": ..., **reset_kwargs}}``,
  ``{"type": "step", "data": <action fields>}``, ``{"type": "close"}``;
- server -> client: ``{"type": "observation", "data": {"observation": {...}, "reward": float|null,
  "done": bool}}`` or ``{"type": "error", "data": {"message": ..., "code": ...}}``.

The observation dict holds the Observation model's fields except ``reward``, ``done`` and
``metadata`` (which the server drops). ``done`` maps to ``terminated`` (OpenEnv has no separate
truncation); a ``null`` reward is 0.0. ``GET /schema`` gives the action's JSON schema, from which
the default ``action_from_text`` picks the one string field the model's reply goes into.

Failures: an unreachable server, a closed session, a timeout or a server-side exception raise
:class:`OpenEnvError`, which fails the sample (the model never sees it). A step the server rejects
as invalid for the action schema (``VALIDATION_ERROR``), or a reply ``action_from_text`` rejects
with :class:`~agentrl.adapters.InvalidAction`, is the model's mistake: it reads the error and the
env is not stepped. A server at its session limit (``CAPACITY_REACHED``; ``max_concurrent_envs``
defaults to 1) is retried until ``capacity_wait`` seconds have passed.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import aiohttp

from agentrl.adapters import InvalidAction
from agentrl.env import Env, StepResult
from agentrl.types import Action, Message

_MAX_MESSAGE_BYTES = 100 * 1024 * 1024  # openenv's own client allows 100 MB (screenshots, DOM dumps)
_action_fields: dict[str, str] = {}  # base URL -> the action field that takes the text (from /schema)


class OpenEnvError(RuntimeError):
    """The OpenEnv server failed (unreachable, closed the session, timed out, raised); the message says what to check."""


class _AtCapacity(Exception):
    pass


def session_urls(base_url: str) -> tuple[str, str]:
    """``(http_base, ws_url)`` for a server address; ``http(s)://`` and ``ws(s)://`` are both accepted."""
    parts = urlsplit(base_url if "://" in base_url else f"http://{base_url}")
    schemes = {"http": ("http", "ws"), "https": ("https", "wss"), "ws": ("http", "ws"), "wss": ("https", "wss")}
    if parts.scheme not in schemes or not parts.hostname:
        raise ValueError(f"OpenEnv server address {base_url!r}: expected http://HOST:PORT (or https://, ws://, wss://)")
    http, ws = schemes[parts.scheme]
    path = parts.path.rstrip("/")
    return urlunsplit((http, parts.netloc, path, "", "")), urlunsplit((ws, parts.netloc, path + "/ws", "", ""))


def _is_string(prop: dict[str, Any]) -> bool:
    return prop.get("type") == "string" or any(p.get("type") == "string" for p in prop.get("anyOf", ()))


def text_field(action_schema: dict[str, Any]) -> str:
    """The field of an OpenEnv action schema that takes the model's text: the only required string
    field, or (with nothing required) the only string field besides ``metadata``; else ValueError."""
    props = action_schema.get("properties", {})
    required = [k for k in action_schema.get("required", []) if k != "metadata"]
    candidates = required if required else [k for k in props if k != "metadata"]
    strings = [k for k in candidates if _is_string(props.get(k, {}))]
    if len(candidates) == 1 and len(strings) == 1:
        return strings[0]
    raise ValueError(
        f"cannot tell which action field takes the model's text (fields {sorted(props)}, required "
        f"{required}): pass OpenEnvEnv(..., action_from_text=lambda text: {{'<field>': text, ...}})"
    )


def default_observation_text(observation: dict[str, Any]) -> str:
    """An observation as text: a single field as its value (strings as is), several as a JSON object."""
    if len(observation) == 1:
        (value,) = observation.values()
        return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
    return json.dumps(observation, ensure_ascii=False)


class OpenEnvEnv(Env):
    """One episode on an OpenEnv server: its own ``/ws`` session (so its own environment instance).

    ``action_from_text(text) -> dict`` builds the step's action fields from the assistant's reply
    (default: the reply in the schema's single string field, see :func:`text_field`);
    ``observation_to_text(observation) -> str`` writes the user message (default
    :func:`default_observation_text`). ``timeout`` bounds each answer from the server;
    ``connect_timeout`` the WebSocket handshake; ``capacity_wait`` how long a full server is retried.
    Both default below ``--env-step-timeout`` (60 s) so their errors, which name the cause, are the
    ones a failed sample reports. ``reset`` sends the task row's ``seed`` (else the episode seed) and the row's ``options`` dict
    as reset keyword arguments. The step's ``info`` carries the raw observation dict.
    """

    def __init__(
        self,
        base_url: str,
        *,
        action_from_text: Callable[[str], dict[str, Any]] | None = None,
        observation_to_text: Callable[[dict[str, Any]], str] | None = None,
        system_prompt: str | None = None,
        timeout: float = 45.0,
        connect_timeout: float = 10.0,
        capacity_wait: float = 45.0,
    ) -> None:
        self.http_url, self.ws_url = session_urls(base_url)
        self.action_from_text = action_from_text
        self.observation_to_text = observation_to_text or default_observation_text
        self.system_prompt = system_prompt
        self.timeout, self.connect_timeout, self.capacity_wait = timeout, connect_timeout, capacity_wait
        self._http: aiohttp.ClientSession | None = None
        self._ws: aiohttp.ClientWebSocketResponse | None = None

    # -- the Env verbs ---------------------------------------------------------------------------

    async def reset(self, *, seed: int | None = None, options: dict | None = None) -> tuple[list[Message], dict]:
        task = options or {}
        if self.action_from_text is None:
            field = await self._action_field()
            self.action_from_text = lambda text: {field: text}
        data = dict(task.get("options") or {})
        seed = task["seed"] if task.get("seed") is not None else seed
        if seed is not None:
            data.setdefault("seed", int(seed))
        result = await self._reset_with_capacity_wait({"type": "reset", "data": data})
        messages: list[Message] = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        messages.append(self._message(result))
        return messages, {"observation": result.get("observation", {})}

    async def step(self, action: Action) -> StepResult:
        if self._ws is None or self.action_from_text is None:
            raise RuntimeError("OpenEnvEnv.step() before reset()")
        try:
            payload = self.action_from_text(action.text)
        except InvalidAction as exc:
            return (
                [{"role": "user", "content": f"Invalid action: {exc}"}],
                0.0,
                False,
                False,
                {"invalid_action": str(exc)},
            )
        reply = await self._exchange({"type": "step", "data": payload}, "step")
        if reply.get("type") == "error" and (reply.get("data") or {}).get("code") == "VALIDATION_ERROR":
            why = _validation_summary(reply["data"])
            return [{"role": "user", "content": f"Invalid action: {why}"}], 0.0, False, False, {"invalid_action": why}
        result = self._observation(reply, "step")
        reward = result.get("reward")
        info = {"observation": result.get("observation", {})}
        return [self._message(result)], float(reward or 0.0), bool(result.get("done", False)), False, info

    async def close(self) -> None:
        """End the session (the server closes this episode's environment) and the connection."""
        ws, http, self._ws, self._http = self._ws, self._http, None, None
        if ws is not None and not ws.closed:
            try:
                await ws.send_str(json.dumps({"type": "close"}))
                # the server closes its environment, then the socket: wait for that, so a closed
                # episode holds no server slot when close() returns
                await asyncio.wait_for(ws.receive(), min(self.timeout, 10.0))
            except (TimeoutError, ConnectionError, aiohttp.ClientError):
                pass  # the server is gone or slow: nothing more to wait for
            await ws.close()
        if http is not None:
            await http.close()

    # -- the protocol ----------------------------------------------------------------------------

    def _message(self, result: dict[str, Any]) -> Message:
        text = self.observation_to_text(result.get("observation", {}))
        if not isinstance(text, str):
            raise TypeError(f"observation_to_text returned {type(text).__name__}, expected str")
        return {"role": "user", "content": text}

    def _session(self) -> aiohttp.ClientSession:
        if self._http is None:  # made here, inside the running loop that will use it
            self._http = aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=self.timeout, connect=self.connect_timeout)
            )
        return self._http

    async def _action_field(self) -> str:
        if self.http_url not in _action_fields:
            try:
                async with self._session().get(f"{self.http_url}/schema") as resp:
                    if resp.status != 200:
                        raise OpenEnvError(
                            f"GET {self.http_url}/schema answered HTTP {resp.status}: is this an OpenEnv server?"
                        )
                    schema = await resp.json()
            except (TimeoutError, aiohttp.ClientError, OSError) as exc:
                raise OpenEnvError(
                    f"cannot reach the OpenEnv server at {self.http_url}: {type(exc).__name__}: {exc}. "
                    "Is it running (uvicorn ... --port N), and is the address right?"
                ) from None
            _action_fields[self.http_url] = text_field(schema.get("action", {}))
        return _action_fields[self.http_url]

    async def _connect(self) -> None:
        try:
            self._ws = await self._session().ws_connect(self.ws_url, max_msg_size=_MAX_MESSAGE_BYTES, autoping=True)
        except aiohttp.WSServerHandshakeError as exc:
            raise OpenEnvError(
                f"{self.ws_url} refused the WebSocket session (HTTP {exc.status}): the server is not an "
                "OpenEnv server with the /ws session endpoint (openenv-core >= 0.2)"
            ) from None
        except (TimeoutError, aiohttp.ClientError, OSError) as exc:
            raise OpenEnvError(
                f"cannot reach the OpenEnv server at {self.ws_url}: {type(exc).__name__}: {exc}. "
                "Is it running (uvicorn ... --port N), and is the address right?"
            ) from None

    async def _reset_with_capacity_wait(self, message: dict[str, Any]) -> dict[str, Any]:
        deadline, delay = time.monotonic() + self.capacity_wait, 0.05
        while True:
            if self._ws is None:
                await self._connect()
            try:
                return self._observation(await self._exchange(message, "reset"), "reset")
            except _AtCapacity as full:
                await self.close()  # the server closed this connection; try a new one when a slot frees
                if time.monotonic() + delay > deadline:
                    raise OpenEnvError(
                        f"the OpenEnv server at {self.http_url} stayed at its session limit for "
                        f"{self.capacity_wait:g}s ({full}): start it with create_app(..., max_concurrent_envs=N) "
                        "for N >= the rollout concurrency, or lower --rollout-concurrency"
                    ) from None
                await asyncio.sleep(delay)
                delay = min(delay * 2, 1.0)

    async def _exchange(self, message: dict[str, Any], what: str) -> dict[str, Any]:
        """Send one message and return the server's reply (an observation or an error) as a dict."""
        assert self._ws is not None
        try:
            await self._ws.send_str(json.dumps(message))
        except (ConnectionError, aiohttp.ClientError):
            pass  # the server closed the socket; it may have said why first (read below)
        try:
            msg = await asyncio.wait_for(self._ws.receive(), self.timeout)
        except TimeoutError:
            raise OpenEnvError(
                f"the OpenEnv server at {self.ws_url} did not answer {what} within {self.timeout:g}s"
            ) from None
        if msg.type in (aiohttp.WSMsgType.TEXT, aiohttp.WSMsgType.BINARY):
            try:
                reply = json.loads(msg.data)
            except ValueError:
                raise OpenEnvError(
                    f"the OpenEnv server answered {what} with non-JSON: {str(msg.data)[:200]!r}"
                ) from None
            if isinstance(reply, dict):
                return reply
            raise OpenEnvError(f"the OpenEnv server answered {what} with {type(reply).__name__}, expected an object")
        code = self._ws.close_code
        raise OpenEnvError(
            f"the OpenEnv server at {self.ws_url} closed the session during {what} "
            f"(WebSocket {msg.type.name.lower()}, code {code}): did it stop or restart?"
        )

    def _observation(self, reply: dict[str, Any], what: str) -> dict[str, Any]:
        data = reply.get("data") or {}
        if reply.get("type") == "error":
            if data.get("code") == "CAPACITY_REACHED":
                raise _AtCapacity(f"{data.get('active_sessions')}/{data.get('max_sessions')} sessions")
            detail = data.get("message", "no message")
            if data.get("errors"):
                detail += f": {_validation_summary(data)}"
            raise OpenEnvError(f"the OpenEnv server failed {what} ({data.get('code', 'UNKNOWN')}): {detail}")
        if reply.get("type") != "observation" or not isinstance(data.get("observation"), dict):
            raise OpenEnvError(f"the OpenEnv server answered {what} with {str(reply)[:200]}, expected an observation")
        return data


def _validation_summary(data: dict[str, Any]) -> str:
    """Pydantic's errors as one line a model can act on: ``word: String should have at most 1000 characters``."""
    parts = []
    for err in data.get("errors") or ():
        where = ".".join(str(p) for p in err.get("loc", ())) or "action"
        parts.append(f"{where}: {err.get('msg', 'invalid')}")
    return "; ".join(parts) or str(data.get("message", "invalid action"))
