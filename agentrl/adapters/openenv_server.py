"""Any agentrl env served over OpenEnv's protocol: ``agentrl env-serve --env M:C --port P``.

The other direction of :mod:`agentrl.adapters.openenv` (which *drives* an OpenEnv server as an
agentrl env): here an agentrl :class:`~agentrl.Env` is the server, so OpenEnv clients
(``GenericEnvClient``, ``MCPToolClient``, TRL's OpenEnv rollouts) and agentrl's own ``openenv:``
adapter on another host can play it. It lives beside the client because both speak one protocol,
that of openenv-core 0.3.0's ``create_app`` (without importing openenv, which agentrl does not need):

- ``GET /health`` ``{"status": "healthy"}``; ``GET /metadata`` OpenEnv's fields (name, description,
  ...) plus ``tools`` (the env's OpenAI tool specs), ``max_turns`` and ``tool_parser``;
  ``agentrl`` (``{"protocol", "version", "tool_parser", "max_turns"}``: the marker by which agentrl's
  ``openenv:`` adapter knows it plays an agentrl env, see :data:`AGENTRL_PROTOCOL`);
  ``GET /schema`` ``{"action", "observation", "state"}`` JSON schemas; ``POST /mcp`` JSON-RPC with
  ``tools/list``. This is OpenEnv's *production* mode: no stateless ``POST /reset``/``/step``,
  because an agentrl episode cannot be split over fresh env instances.
- ``/ws``: one session per connection, messages ``{"type": "reset"|"step"|"state"|"close"|"mcp",
  "data": ...}``; replies ``{"type": "observation", "data": {"observation", "reward", "done"}}``,
  ``{"type": "state", ...}`` or ``{"type": "error", "data": {"message", "code"[, "errors"]}}`` with
  OpenEnv's codes: INVALID_JSON, UNKNOWN_TYPE, VALIDATION_ERROR (``errors``: pydantic's list, each
  with the ``loc`` of the bad field), EXECUTION_ERROR (the env raised or broke its contract),
  FACTORY_ERROR, CAPACITY_REACHED (``active_sessions``/``max_sessions``; then the socket closes).

Episodes. Each ``reset`` builds a fresh env from the factory (agentrl's rule: one env per episode)
and closes the previous one; the env is closed when the episode ends, at the next reset, and when
the client disconnects. ``reset`` data: ``seed`` and ``episode_id`` (OpenEnv's), and optionally the
task row itself as the other keys (with a ``prompt``; ``label`` and the rest as the env reads
them). Without a ``prompt`` the server picks the row from its task list (``--prompt-data`` or the
env's ``tasks()``): row ``seed % len(tasks)``, or the next in turn when no seed is sent, so agentrl's
``openenv:`` adapter (which sends ``{"seed": i}``) plays row ``i``, as an in-process run does; the
other keys sent (reset options such as ``{"difficulty": "hard"}``, which OpenEnv clients send as
reset keyword arguments and openenv-core's own server drops when its reset does not take them) are
added to that row, so the env reads them where it reads the row's fields. An option may not use the
name of a field of the server's task rows (any row's, or ``label``) unless it sends that row's own
value: the rows are protected from accidental or silent overrides (a ``label`` sent with a seed would
quietly change the answer the episode is scored against), and the rule is the same for every seed.
Such a reset is refused with a VALIDATION_ERROR naming the key, and the turn of a reset without a
seed is not used up. A client that wants a task of its own sends a whole row with a ``prompt``,
which is visible as such.

The action is the assistant turn, ``{"text": str, "tool_calls": [OpenAI tool calls] | null}``:
``text`` is the only required string, so a client that knows nothing else (the ``openenv:``
adapter) sends the model's reply there and the server parses tool calls from it with the env's
``tool_parser``, exactly as the rollout loop does; a client whose model API returns structured
calls sends them in ``tool_calls`` instead. OpenEnv's MCP-style actions work too:
``{"type": "list_tools"}`` (any time) and ``{"type": "call_tool", "tool_name", "arguments"}`` (a
turn made of that one call). The observation is ``{"messages": [chat messages], "info": {...},
"truncated": bool}`` (``info`` made JSON-safe; a ``call_tool`` turn adds ``tool_name`` and
``result``); ``done`` is terminated or truncated, and the server ends an episode at the env's
``max_turns`` as the rollout loop does. An env that raises, times out or breaks the contract fails
its episode with an EXECUTION_ERROR to that client; the server and other sessions go on.
Envs with ``roles`` are refused (one agent per session). ``rewrite_history`` is not applied: the
client keeps the conversation.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import FastAPI, Request, WebSocket

from agentrl.adapters.openenv_actions import AGENTRL_PROTOCOL
from agentrl.adapters.openenv_session import (
    DEFAULT_STEP_TIMEOUT,
    Episode,
    Failed,
    ServedObservation,
    Session,
    SessionState,
    TurnAction,
    openenv_tool,
)
from agentrl.env import Env, call_env

log = logging.getLogger(__name__)

SERVER_KEYS = frozenset({"label"})
"""Fields reset options may never change on a server's task row, even one without them (the task's answer)."""


# -- the server -----------------------------------------------------------------------------------


class EnvServer:
    """Serves episodes of one env factory; :meth:`app` is the ASGI app (FastAPI).

    Args:
        factory: builds one env per episode (what :func:`agentrl.load_env` returns).
        tasks: rows a reset without its own row plays (``--prompt-data`` or the env's ``tasks()``).
        max_sessions: WebSocket sessions at once; one more is answered CAPACITY_REACHED and closed.
        step_timeout: seconds a reset/step may take when the env sets no ``step_timeout``.
        name: shown in ``/metadata`` (default: the env class's name).
    """

    def __init__(
        self,
        factory: Callable[[], Env],
        *,
        tasks: list[dict[str, Any]] | None = None,
        max_sessions: int = 8,
        step_timeout: float = DEFAULT_STEP_TIMEOUT,
        name: str | None = None,
    ) -> None:
        if max_sessions < 1:
            raise ValueError(f"max_sessions must be at least 1, got {max_sessions}")
        self.factory, self.tasks, self.max_sessions = factory, tasks, max_sessions
        self.step_timeout, self.name = step_timeout, name
        self.active = 0
        self.tools: list[dict[str, Any]] = []
        self.info: dict[str, Any] = {}
        self._next_task = 0  # the row a reset without a seed plays (moved on by a reset that plays it)
        self._task_keys = SERVER_KEYS.union(*(row.keys() for row in tasks or ()))

    def task_for(self, seed: int | None, extra: dict[str, Any]) -> dict[str, Any]:
        """The task row a reset plays: the one it sent (``extra`` with a ``prompt``), else the server's
        row for its seed with ``extra``'s keys (reset options, as OpenEnv clients send them) added.

        The server's rows are protected from accidental or silent overrides: an option named as a field
        of any of the rows (or ``label``, :data:`SERVER_KEYS`) is refused with a VALIDATION_ERROR naming
        it unless it is the played row's own value, so one option is accepted or refused alike for every
        seed. A client that wants its own task sends a whole row (with a ``prompt``), visible as such."""
        if "prompt" in extra:
            return {"label": None, **extra}
        if not self.tasks:
            raise Failed(
                "VALIDATION_ERROR",
                "this server has no task list (start it with --prompt-data FILE, or serve an env with tasks()): "
                "send the task row in the reset data, e.g. {'seed': 0, 'prompt': ..., 'label': ...}",
                errors=[{"loc": ["prompt"], "msg": "Field required", "type": "missing"}],
            )
        index = (self._next_task if seed is None else seed) % len(self.tasks)
        row, missing = self.tasks[index], object()
        fixed = [key for key in extra if key in self._task_keys and row.get(key, missing) != extra[key]]
        if fixed:
            raise Failed(
                "VALIDATION_ERROR",
                f"reset data sets {', '.join(map(repr, fixed))}, a field of the server's task rows, to a value "
                f"other than task row {index}'s: the server's rows (their label, the answer, included) are kept "
                "from overrides; send reset options under other names, or send a whole task row with a 'prompt' "
                "to play a task of your own",
                errors=[
                    {"loc": [key], "msg": "a field of the server's task rows", "type": "task_field"} for key in fixed
                ],
            )
        if seed is None:  # the turn moves on only once the reset data is valid
            self._next_task += 1
        return {**row, **extra}

    async def describe(self) -> None:
        """Read the env's tools and limits from one instance (built, never reset, closed); once.

        Refuses envs with ``roles``. Called when the app starts; call it first to fail before binding a port.
        """
        if self.info:
            return
        env = self.factory()
        try:
            if getattr(env, "roles", ()):
                raise ValueError(
                    f"{type(env).__name__} has roles {list(env.roles)}: OpenEnv sessions have one agent, "
                    "so multi-role envs cannot be served"
                )
            self.tools = list(env.tool_schemas())
            doc = (type(env).__doc__ or "").strip().split("\n\n")[0]
            self.info = {
                "name": self.name or type(env).__name__,
                "description": " ".join(doc.split()) or f"agentrl env {type(env).__name__}",
                "max_turns": getattr(env, "max_turns", None),
                "tool_parser": getattr(env, "tool_parser", "hermes"),
            }
        finally:
            await call_env(env.close)

    def metadata(self) -> dict[str, Any]:
        return {
            **{k: self.info.get(k) for k in ("name", "description")},
            "readme_content": None,
            "version": _version(),
            "author": None,
            "documentation_url": None,
            "tools": self.tools,
            "max_turns": self.info.get("max_turns"),
            "tool_parser": self.info.get("tool_parser"),
            "num_tasks": len(self.tasks or ()),
            # the marker agentrl's openenv: adapter recognises a served agentrl env by (see AGENTRL_PROTOCOL)
            "agentrl": {
                "protocol": AGENTRL_PROTOCOL,
                "version": _version(),
                "tool_parser": self.info.get("tool_parser"),
                "max_turns": self.info.get("max_turns"),
            },
        }

    def json_rpc(self, request: Any, episode: Episode | None = None) -> dict[str, Any]:
        """OpenEnv's ``/mcp`` subset: ``tools/list``. Tools run inside an episode (a ``call_tool`` step)."""
        rid = request.get("id") if isinstance(request, dict) else None
        if (
            not isinstance(request, dict)
            or request.get("jsonrpc") != "2.0"
            or not isinstance(request.get("method"), str)
        ):
            return {"jsonrpc": "2.0", "id": rid, "error": {"code": -32600, "message": "Invalid Request", "data": None}}
        if request["method"] == "tools/list":
            tools = episode.env.tool_schemas() if episode else self.tools
            listed = [{**(t := openenv_tool(s)), "inputSchema": t["input_schema"]} for s in tools]
            return {"jsonrpc": "2.0", "id": rid, "result": {"tools": listed}}
        return {
            "jsonrpc": "2.0",
            "id": rid,
            "error": {
                "code": -32601,
                "message": f"Method not found: {request['method']!r}. An agentrl env runs its tools inside an "
                "episode: open /ws, reset, then step {'type': 'call_tool', 'tool_name': ..., 'arguments': ...}",
                "data": None,
            },
        }

    async def session(self, ws: WebSocket) -> None:
        """One ``/ws`` connection, from accept to close (its env closed before the slot frees)."""
        await ws.accept()
        if self.active >= self.max_sessions:
            data = {
                "message": f"Server at capacity ({self.active}/{self.max_sessions} sessions); retry later",
                "code": "CAPACITY_REACHED",
                "active_sessions": self.active,
                "max_sessions": self.max_sessions,
            }
            await ws.send_text(json.dumps({"type": "error", "data": data}))
            await ws.close()
            return
        self.active += 1
        session = Session(self)
        try:
            while True:
                msg = await ws.receive()
                if msg["type"] == "websocket.disconnect":
                    break
                reply = await session.handle(msg.get("text") or msg.get("bytes") or b"")
                if reply is None:
                    break
                await ws.send_text(json.dumps(reply))
        except Exception as exc:  # the client went away mid-send, or a bug here: this session only
            log.debug("session ended: %r", exc)
        finally:
            await session.end_episode()
            self.active -= 1
            with contextlib.suppress(Exception):
                await ws.close()

    def app(self) -> FastAPI:
        """The ASGI app: ``/health``, ``/metadata``, ``/schema``, ``/mcp`` and the ``/ws`` sessions."""

        @contextlib.asynccontextmanager
        async def lifespan(_: FastAPI) -> AsyncIterator[None]:
            from agentrl.sandbox import close_default_pool

            await self.describe()
            try:
                yield
            finally:
                await close_default_pool()

        app = FastAPI(title="agentrl env-serve", version=_version(), lifespan=lifespan)
        app.get("/health")(lambda: {"status": "healthy"})
        app.get("/metadata")(self.metadata)

        @app.get("/schema")
        def schema() -> dict[str, Any]:
            action = TurnAction.model_json_schema()
            action["description"] = (
                "The assistant turn. Also accepted: {'type': 'list_tools'} and "
                "{'type': 'call_tool', 'tool_name': ..., 'arguments': {...}} (OpenEnv's MCP actions)."
            )
            return {
                "action": action,
                "observation": ServedObservation.model_json_schema(),
                "state": SessionState.model_json_schema(),
            }

        @app.post("/mcp")
        async def mcp(request: Request) -> dict[str, Any]:
            try:
                body = json.loads(await request.body())
            except ValueError:
                return {"jsonrpc": "2.0", "id": None, "error": {"code": -32700, "message": "Parse error", "data": None}}
            return self.json_rpc(body)

        app.websocket("/ws")(self.session)
        return app


def _version() -> str:
    from agentrl import __version__

    return __version__


def build_server(
    env: str | Callable[[], Env],
    *,
    prompt_data: str | None = None,
    input_key: str = "prompt",
    label_key: str = "label",
    max_sessions: int = 8,
    step_timeout: float = DEFAULT_STEP_TIMEOUT,
) -> EnvServer:
    """An :class:`EnvServer` for an env spec (anything :func:`agentrl.load_env` takes) or factory.

    Task rows come from ``prompt_data`` when given, else the env's own ``tasks()``, else none (then
    every reset must carry its row). A bad spec or file raises here, before any port is bound.
    """
    from agentrl.data import task_rows
    from agentrl.registry import load_env

    factory = load_env(env) if isinstance(env, str) else env
    tasks = None
    if prompt_data or getattr(factory, "tasks", None) is not None:
        tasks = task_rows(factory, prompt_data, input_key=input_key, label_key=label_key, env_name=str(env))
    return EnvServer(factory, tasks=tasks, max_sessions=max_sessions, step_timeout=step_timeout)


def create_app(env: str | Callable[[], Env], **kwargs: Any) -> FastAPI:
    """The ASGI app serving ``env`` (arguments as :func:`build_server`), for ``uvicorn`` or any ASGI server."""
    return build_server(env, **kwargs).app()


# -- the command ----------------------------------------------------------------------------------


def cmd_env_serve(args: argparse.Namespace) -> int:
    """``agentrl env-serve`` (flags defined in :mod:`agentrl.cli`): check the env, then serve until interrupted."""
    import uvicorn

    from agentrl import sandbox
    from agentrl.flags import naming_flag

    if args.max_sessions < 1:
        raise ValueError(f"--max-sessions must be at least 1, got {args.max_sessions}")
    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port must be 0..65535, got {args.port}")
    if not args.step_timeout > 0:
        raise ValueError(f"--step-timeout must be a positive number of seconds, got {args.step_timeout}")
    sandbox.configure(sandbox.SandboxConfig(backend=args.sandbox))
    with naming_flag("--prompt-data" if args.prompt_data else "--env", args.prompt_data or args.env):
        server = build_server(
            args.env,
            prompt_data=args.prompt_data,
            input_key=args.input_key,
            label_key=args.label_key,
            max_sessions=args.max_sessions,
            step_timeout=args.step_timeout,
        )
        asyncio.run(server.describe())  # a roles env or a broken constructor: refused before the port is bound
    print(f"agentrl env-serve: {args.env} on http://{args.host}:{args.port} (OpenEnv: /ws, /schema, /health)")
    uvicorn.run(server.app(), host=args.host, port=args.port, log_level="warning")
    return 0
