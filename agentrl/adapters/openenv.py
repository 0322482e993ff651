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
truncation); a ``null`` reward is 0.0. ``GET /schema`` gives the action's JSON schema, which says
how the model acts (:mod:`agentrl.adapters.openenv_actions`):

- **tool calls** (MCP-style envs such as openenv-core's ``echo_env``, whose action is
  ``CallToolAction``): after reset the episode lists the env's tools (a ``list_tools`` step) and
  offers them to the model as ``tools``; each parsed tool call becomes a ``call_tool`` step and is
  answered by a ``tool`` message (rewards of a turn's calls add up; ``done`` ends the episode). A
  reply without a tool call is an invalid action the model reads (or, with
  ``text_ends_episode=True``, ends the episode as in :class:`~agentrl.ToolEnv`).
- **one field**: the reply fills the action's single field, a string as is, an enum (``$ref``\\ s
  followed; the value named case-insensitively), an integer, number or boolean parsed from it.

An observation with nothing in it (``{}``: MCP envs keep their reset message in the dropped
``metadata``) is not shown as ``'{}'``: the first message is then the task row's prompt, or the
env's description from ``GET /metadata`` and how to act.

**Served agentrl envs** (``agentrl env-serve``; the ``agentrl`` marker of ``/metadata``) are played as
in process (:func:`~agentrl.adapters.openenv_actions.served_step`): the env's tools, ``tool_parser`` and
``max_turns`` (known when the env is built), its chat messages with their roles, its ``truncated``. A
task row of its own (``--prompt-data``) travels with the reset; ``tasks()``'s seed rows send the seed.

Failures: an unreachable server, a closed session, a timeout or a server-side exception raise
:class:`OpenEnvError`, which fails the sample (the model never sees it). A step the server rejects
as invalid for the action schema (``VALIDATION_ERROR``), or a reply ``action_from_text`` rejects
with :class:`~agentrl.adapters.InvalidAction`, is the model's mistake: it reads the error and the
env is not stepped. A server at its session limit (``CAPACITY_REACHED``; ``max_concurrent_envs``
defaults to 1) is retried until ``capacity_wait`` seconds have passed.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Callable, Iterator
from typing import Any

import aiohttp

from agentrl.adapters.base import InvalidAction, seed_prompt
from agentrl.adapters.openenv_actions import (
    ServedEnv,
    ServedTool,
    ServerTool,
    action_mapping,
    chat_prompt,
    invalid_step,
    is_tool_call_schema,
    served_env,
    served_reset_data,
    served_result,
    served_step,
    tool_result_text,
    validation_summary,
)
from agentrl.adapters.openenv_probe import API_KEY_ENV, auth_headers, probe_server, session_urls, start_probe
from agentrl.adapters.openenv_probe import SERVER_INFO as _server_info
from agentrl.env import Env, StepResult
from agentrl.parsing import format_tool_error, unique_call_ids
from agentrl.tool import Tool, ToolError, find_tool
from agentrl.types import Action, Message, ToolCall

log = logging.getLogger(__name__)

_MAX_MESSAGE_BYTES = 100 * 1024 * 1024  # openenv's own client allows 100 MB (screenshots, DOM dumps)
_BLANK = ("", "{}", "[]", "null", '""')
_warned_parser: set[str] = set()  # servers whose tool_parser differed from a run's (warned once)


class OpenEnvError(RuntimeError):
    """The OpenEnv server failed (unreachable, closed the session, timed out, raised); the message says what to check."""


class _AtCapacity(Exception):
    pass


def text_field(action_schema: dict[str, Any]) -> str:
    """The field of an OpenEnv action schema that takes the model's text (see
    :func:`~agentrl.adapters.openenv_actions.action_mapping`); ValueError when there is no single one."""
    return action_mapping(action_schema).field


def default_observation_text(observation: dict[str, Any]) -> str:
    """An observation as text: a single field as its value (strings as is), several as a JSON object."""
    if len(observation) == 1:
        (value,) = observation.values()
        return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
    return json.dumps(observation, ensure_ascii=False)


class OpenEnvEnv(Env):
    """One episode on an OpenEnv server: its own ``/ws`` session (so its own environment instance).

    How the model acts follows the server's action schema (see the module docstring): tool calls
    for MCP-style envs (``tools`` is then the env's tools, listed after reset), else the reply in the
    action's single field. ``action_from_text(text) -> dict`` overrides that with your own mapping
    (raise :class:`~agentrl.adapters.InvalidAction` for a reply to redo);
    ``observation_to_text(observation) -> str`` writes the user message (default
    :func:`default_observation_text`). ``timeout`` bounds each answer from the server;
    ``connect_timeout`` the WebSocket handshake; ``capacity_wait`` how long a full server is retried.
    Both default below ``--env-step-timeout`` (60 s) so their errors, which name the cause, are the
    ones a failed sample reports. ``reset`` sends the task row's ``seed`` (else the episode seed) and the row's ``options`` dict
    as reset keyword arguments. The step's ``info`` carries the raw observation dict.
    ``action_schema`` is the server's action schema once reset has read it (``check-env`` compares
    it with ``tools``). ``api_key`` is sent as ``Authorization: Bearer KEY`` on every request (a server
    started with ``agentrl env-serve --api-key-file``); None: ``$AGENTRL_ENV_SERVE_API_KEY`` when set.
    ``served`` describes a served agentrl env (None for other servers); it is
    played natively unless ``action_from_text`` or ``observation_to_text`` is given.

    The server's ``/schema`` and ``/metadata`` are read once per process (``load_env`` does it before
    any episode), so a served env's tools, ``tool_parser`` and ``max_turns`` are known when the env is
    built; ``server_info`` (the action schema and ``/metadata``) is what ``load_env`` read, which its
    factory passes to every env it builds, so envs built in other processes (Ray's rollout workers)
    know them too. An env built inside a running event loop with neither never waits for the server there: the
    read runs as a task of that loop (shared by the envs built meanwhile) and ``reset`` awaits it, so those
    first episodes learn a served env's settings at reset (the server still ends them at its
    ``max_turns``, and calls parsed with another parser travel as ``tool_calls``).
    """

    def __init__(
        self,
        base_url: str,
        *,
        action_from_text: Callable[[str], dict[str, Any]] | None = None,
        observation_to_text: Callable[[dict[str, Any]], str] | None = None,
        system_prompt: str | None = None,
        text_ends_episode: bool = False,
        timeout: float = 45.0,
        connect_timeout: float = 10.0,
        capacity_wait: float = 45.0,
        server_info: tuple[dict[str, Any], dict[str, Any]] | None = None,
        api_key: str | None = None,
    ) -> None:
        self.base_url = base_url
        self.http_url, self.ws_url = session_urls(base_url)
        self._api_key = api_key
        self._headers = auth_headers(api_key)  # None: $AGENTRL_ENV_SERVE_API_KEY, read now
        self.action_from_text = action_from_text
        self.observation_to_text = observation_to_text or default_observation_text
        self.system_prompt = system_prompt
        self.text_ends_episode = text_ends_episode
        self.timeout, self.connect_timeout, self.capacity_wait = timeout, connect_timeout, capacity_wait
        self.action_schema: dict[str, Any] | None = None
        self.tools: list[Tool] = []
        self.served: ServedEnv | None = None
        self._custom = action_from_text is not None or observation_to_text is not None
        self._turns = 0  # a served env's turns and call ids, counted as the server counts them
        self._seen: set[str] = set()
        self._tool_calls = False  # the action is a tool call (MCP-style env)
        self._hint: str | None = None
        self._http: aiohttp.ClientSession | None = None
        self._ws: aiohttp.ClientWebSocketResponse | None = None
        self._lock = asyncio.Lock()  # one exchange at a time on the session's socket
        self._probe: asyncio.Task[dict[str, Any]] | None = None
        if server_info is not None:  # read by load_env in the driver (the factory carries it to Ray workers)
            _server_info.setdefault(self.http_url, server_info)
        if self.http_url not in _server_info:  # once per process: tools and max_turns are known before reset
            try:
                asyncio.get_running_loop()
            except RuntimeError:  # no loop to stall: read the server now
                with contextlib.suppress(ValueError):  # a down server is reported by reset, as a failed sample
                    probe_server(base_url, timeout=min(connect_timeout, 5.0), api_key=api_key)
            else:  # inside a loop (the rollout's): a task of the loop, awaited by reset
                self._probe = start_probe(base_url, timeout, api_key)
        if self.http_url in _server_info:
            self._use_metadata(_server_info[self.http_url][1])

    # -- the Env verbs ---------------------------------------------------------------------------

    async def reset(self, *, seed: int | None = None, options: dict | None = None) -> tuple[list[Message], dict]:
        task = options or {}
        schema, metadata = await self._server_info()
        self.action_schema = schema
        if self.served is None:
            self._use_metadata(metadata)
        if self.served is not None:
            return await self._served_reset(task, task["seed"] if task.get("seed") is not None else seed)
        if self.action_from_text is None:
            self._tool_calls = is_tool_call_schema(schema)
            if not self._tool_calls:
                try:
                    mapping = action_mapping(schema)
                except ValueError as exc:
                    raise OpenEnvError(f"the OpenEnv server at {self.http_url}: {exc}") from None
                self.action_from_text, self._hint = mapping, mapping.hint()
        data = dict(task.get("options") or {})
        seed = task["seed"] if task.get("seed") is not None else seed
        if seed is not None:
            data.setdefault("seed", int(seed))
        result = await self._reset_with_capacity_wait({"type": "reset", "data": data})
        if self._tool_calls:
            await self._list_tools()
        messages: list[Message] = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        first = self._message(result)
        text = str(first["content"])  # observation_to_text's: always a string
        if text.strip() in _BLANK and chat_prompt(task.get("prompt")):
            messages.extend(dict(m) for m in task["prompt"])  # type: ignore[misc]
        elif text.strip() in _BLANK:
            first["content"] = self._blank_prompt(task, seed, metadata)
            messages.append(first)
        else:
            if self._hint and self.system_prompt is None:
                first["content"] = f"{text}\n\n{self._hint}"
            messages.append(first)
        return messages, {"observation": result.get("observation", {})}

    async def step(self, action: Action) -> StepResult:
        if self._ws is None or (self.action_from_text is None and not self._tool_calls and self.served is None):
            raise RuntimeError("OpenEnvEnv.step() before reset()")
        if self.served is not None:
            return await self._served_step(self.served, action)
        if self._tool_calls and self.action_from_text is None:
            return await self._tool_step(action)
        assert self.action_from_text is not None
        try:
            payload = self.action_from_text(action.text)
        except InvalidAction as exc:
            return invalid_step(str(exc))
        reply = await self._exchange({"type": "step", "data": payload}, "step")
        if reply.get("type") == "error" and (reply.get("data") or {}).get("code") == "VALIDATION_ERROR":
            return invalid_step(validation_summary(reply["data"]))
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

    # -- served agentrl envs: the env's own conversation -------------------------------------------

    def _use_metadata(self, metadata: dict[str, Any]) -> None:
        """Play a served agentrl env natively: its tools, tool parser and turn limit (see the module docstring)."""
        with self._faults():
            served = served_env(metadata)
        if served is None or self._custom:
            return
        self.served, self.tool_parser, self.max_turns = served, served.tool_parser, served.max_turns
        self.tools = [ServedTool(spec, self.call_tool) for spec in served.tool_specs]

    async def _served_reset(self, task: dict[str, Any], seed: int | None) -> tuple[list[Message], dict]:
        data = served_reset_data(task, seed, seed_prompt("openenv", self.base_url, task.get("seed")))
        result = await self._reset_with_capacity_wait({"type": "reset", "data": data})
        self._turns, self._seen = 0, set()
        with self._faults():
            messages, *_, info = served_result(result, "reset", {})
        if self.system_prompt:
            messages.insert(0, {"role": "system", "content": self.system_prompt})
        return messages, info

    async def _served_step(self, served: ServedEnv, action: Action) -> StepResult:
        with self._faults():
            payload, ids = served_step(action, served.tool_parser, self._turns, self._seen)
        if "tool_calls" in payload and self.http_url not in _warned_parser:
            _warned_parser.add(self.http_url)
            log.warning(
                "%s parses tool calls as %r, unlike this run: its calls go as tool_calls",
                self.http_url,
                served.tool_parser,
            )
        result = self._observation(await self._exchange({"type": "step", "data": payload}, "step"), "step")
        self._turns += 1
        with self._faults():
            return served_result(result, "step", ids)

    @contextlib.contextmanager
    def _faults(self) -> Iterator[None]:
        """What the server sent is wrong (a ValueError naming the field): the OpenEnvError that fails the sample."""
        try:
            yield
        except ValueError as exc:
            raise OpenEnvError(f"the OpenEnv server at {self.http_url}: {exc}") from None

    # -- MCP-style envs: tools and tool calls ------------------------------------------------------

    async def _list_tools(self) -> None:
        result = self._observation(
            await self._exchange({"type": "step", "data": {"type": "list_tools"}}, "list_tools"), "list_tools"
        )
        specs = result.get("observation", {}).get("tools")
        if not isinstance(specs, list) or not specs:
            raise OpenEnvError(
                f"the OpenEnv server at {self.http_url} takes tool calls (its action is {self.action_schema_title}) "
                f"but its list_tools step listed no tools: {str(result)[:200]}"
            )
        try:
            self.tools = [ServerTool(spec, self.call_tool) for spec in specs]
        except ValueError as exc:
            raise OpenEnvError(f"the OpenEnv server at {self.http_url}: {exc}") from None

    @property
    def action_schema_title(self) -> str:
        return str((self.action_schema or {}).get("title", "a tool call"))

    async def call_tool(self, name: str, arguments: dict[str, Any]) -> tuple[str, bool]:
        """Run one ``call_tool`` step in this episode's session; ``(text for the model, is_error)``."""
        text, failed, _, _, _ = await self._call_server_tool(name, arguments)
        return text, failed

    async def _call_server_tool(self, name: str, arguments: dict[str, Any]) -> tuple[str, bool, float, bool, dict]:
        data = {"type": "call_tool", "tool_name": name, "arguments": arguments}
        reply = await self._exchange({"type": "step", "data": data}, "step")
        if reply.get("type") == "error" and (reply.get("data") or {}).get("code") == "VALIDATION_ERROR":
            return f"Error: {validation_summary(reply['data'])}", True, 0.0, False, {}
        result = self._observation(reply, "step")
        if self.served is not None:  # a served env counts a call_tool step as a turn and numbers its call
            unique_call_ids([ToolCall(name, arguments, "call_0")], self._turns, self._seen)
            self._turns += 1
        observation = result.get("observation", {})
        text, failed = tool_result_text(observation)
        return text, failed, float(result.get("reward") or 0.0), bool(result.get("done", False)), observation

    async def _tool_step(self, action: Action) -> StepResult:
        """A turn of an MCP-style env: its calls run in order as call-tool steps, each answered."""
        if not action.tool_calls and not action.errors:
            if self.text_ends_episode:
                return [], 0.0, True, False, {"final_text": True}
            names = ", ".join(t.name for t in self.tools)
            return invalid_step(f"this environment is played with tool calls: call one of its tools ({names})")
        messages: list[Message] = []
        reward, done, observations = 0.0, False, []
        for call in action.tool_calls:
            if done:
                text = "Error: not run: the episode ended at an earlier call of this turn"
            else:
                text, step_reward, done, observation = await self._checked_call(call)
                reward += step_reward
                observations.append(observation)
            messages.append({"role": "tool", "name": call.name, "tool_call_id": call.id, "content": text})
        for err in action.errors:
            messages.append({"role": "tool", "tool_call_id": err.id, "content": format_tool_error(err)})
        return messages, reward, done, False, {"observations": observations, "tool_errors": len(action.errors)}

    async def _checked_call(self, call: ToolCall) -> tuple[str, float, bool, dict]:
        tool = find_tool(self.tools, call.name)
        if tool is None:
            known = ", ".join(t.name for t in self.tools)
            return f"Error: unknown tool '{call.name}'. Available tools: {known}.", 0.0, False, {}
        try:
            arguments = tool.validate(call.arguments)
        except ToolError as exc:
            return f"Error: {exc}", 0.0, False, {}
        text, _, reward, done, observation = await self._call_server_tool(call.name, arguments)
        return text, reward, done, observation

    # -- the protocol ----------------------------------------------------------------------------

    def _message(self, result: dict[str, Any]) -> Message:
        text = self.observation_to_text(result.get("observation", {}))
        if not isinstance(text, str):
            raise TypeError(f"observation_to_text returned {type(text).__name__}, expected str")
        return {"role": "user", "content": text}

    def _blank_prompt(self, task: dict[str, Any], seed: int | None, metadata: dict[str, Any]) -> str:
        """The first message when the env's observation is empty: the task's own prompt (a list of chat
        messages, verl's layout, is used as the first messages instead: :func:`_chat_prompt`), or the
        env's description (``/metadata``) and how to act."""
        prompt = task.get("prompt")
        if isinstance(prompt, str) and prompt.strip() and prompt != seed_prompt("openenv", self.base_url, seed):
            return prompt
        about = str(metadata.get("description") or metadata.get("name") or f"The environment at {self.http_url}")
        if self.tools:
            how = "Act by calling its tools (" + ", ".join(t.name for t in self.tools) + ")."
        else:
            how = self._hint or "Reply with your action."
        return f"{about.rstrip('.')}. {how}"

    def _session(self) -> aiohttp.ClientSession:
        if self._http is None:  # made here, inside the running loop that will use it
            self._http = aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=self.timeout, connect=self.connect_timeout), headers=self._headers
            )
        return self._http

    async def _server_info(self) -> tuple[dict[str, Any], dict[str, Any]]:
        """The server's action schema and ``/metadata``, read once per server address and process.

        Not cached yet: the probe the constructor started (or a new one, shared with the episodes
        waiting for the same server) runs as a task of the loop while the loop goes on; one that fails
        caches nothing (see :func:`~agentrl.adapters.openenv_probe.start_probe`) and fails this sample.
        An env built on another loop than the one resetting it cannot await that loop's probe: it asks anew.
        """
        if self.http_url not in _server_info:
            probe, self._probe = self._probe, None
            if probe is None or probe.done() or probe.get_loop() is not asyncio.get_running_loop():
                probe = start_probe(self.base_url, self.timeout, self._api_key)  # none yet, failed, or another loop's
            try:
                await asyncio.shield(probe)  # an episode cancelled meanwhile leaves the shared probe running
            except ValueError as exc:
                raise OpenEnvError(str(exc)) from None
        return _server_info[self.http_url]

    async def _connect(self) -> None:
        try:
            self._ws = await self._session().ws_connect(self.ws_url, max_msg_size=_MAX_MESSAGE_BYTES, autoping=True)
        except aiohttp.WSServerHandshakeError as exc:
            if exc.status in (401, 403):
                raise OpenEnvError(
                    f"{self.ws_url} refused the WebSocket session (HTTP {exc.status}): the server wants an API "
                    f"key, or refused the one sent; set ${API_KEY_ENV} to the server's key"
                ) from None
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
        async with self._lock:  # a reply belongs to the message just sent: one exchange at a time
            return await self._exchange_unlocked(message, what)

    async def _exchange_unlocked(self, message: dict[str, Any], what: str) -> dict[str, Any]:
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
                detail += f": {validation_summary(data)}"
            raise OpenEnvError(f"the OpenEnv server failed {what} ({data.get('code', 'UNKNOWN')}): {detail}")
        if reply.get("type") != "observation" or not isinstance(data.get("observation"), dict):
            raise OpenEnvError(f"the OpenEnv server answered {what} with {str(reply)[:200]}, expected an observation")
        return data
