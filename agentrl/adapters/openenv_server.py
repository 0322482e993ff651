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

Guards (a served env runs what its clients send):

- **API key** (``--api-key``, ``--api-key-file`` or ``$AGENTRL_ENV_SERVE_API_KEY``, :data:`API_KEY_ENV`):
  every route but ``/health`` (:data:`OPEN_PATHS`: what container providers poll) wants
  ``Authorization: Bearer KEY``, compared in constant time; ``/ws`` without it is refused before the
  handshake (HTTP 403). openenv-core's clients cannot set headers, but they send a key put in the
  address, ``http://agentrl:KEY@HOST:PORT``, as ``Authorization: Basic`` (websockets and httpx both do):
  the password of a Basic header is taken as the key (:class:`BasicKey`). agentrl's ``openenv:`` adapter
  sends ``$AGENTRL_ENV_SERVE_API_KEY`` itself.
- **Bounded requests**: a body over ``--max-body-mb`` (:data:`agentrl.http_guard.DEFAULT_MAX_BODY_MB`) is
  answered 413, a WebSocket message over it closes its session (1009: uvicorn's ``ws_max_size``, set by
  ``agentrl env-serve``); JSON of any shape is parsed safely (``/mcp``: JSON-RPC -32700, ``/ws``: INVALID_JSON).
- **Idle sessions end**: a session whose client sends nothing for ``--idle-timeout`` seconds is sent a
  ``SESSION_ERROR`` and closed, its env closed and its slot freed, so abandoned connections cannot hold
  every slot.
- **No host sandbox unasked**: an env whose tools run model code (``sandboxed`` tools) is refused when its
  sandboxes would be the ``process`` backend, which lets that code read the host's files, unless the
  operator passes ``--allow-host-sandbox``; envs that take a sandbox without such a tool get an
  EXECUTION_ERROR at that point instead (their sandboxes come from the server's own pool).
- **No host files**: a ``file://`` picture in an observation is shown only when the server's own task rows
  name it (:mod:`agentrl.adapters.openenv_session`).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import binascii
import contextlib
import json
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import FastAPI, Request, WebSocket

from agentrl import __version__, sandbox
from agentrl.adapters.openenv_actions import AGENTRL_PROTOCOL
from agentrl.adapters.openenv_probe import API_KEY_ENV
from agentrl.adapters.openenv_session import (
    DEFAULT_STEP_TIMEOUT,
    Episode,
    Failed,
    ServedObservation,
    Session,
    SessionState,
    TurnAction,
    named_files,
    openenv_tool,
)
from agentrl.data import task_rows
from agentrl.env import Env, call_env
from agentrl.flags import naming_flag
from agentrl.http_guard import (
    DEFAULT_MAX_BODY_MB,
    ApiKeyGuard,
    BadRequest,
    BodyLimit,
    max_body_bytes,
    read_json,
    resolve_api_key,
    warn_if_open,
)
from agentrl.registry import load_env
from agentrl.sandbox import (
    Sandbox,
    SandboxConfig,
    SandboxError,
    SandboxPool,
    close_default_pool,
    create_sandbox,
    resolve_backend,
)

log = logging.getLogger(__name__)

SERVER_KEYS = frozenset({"label"})
"""Fields reset options may never change on a server's task row, even one without them (the task's answer)."""

OPEN_PATHS = ("/health",)
"""Routes answered without the key: liveness only (what OpenEnv's container providers poll). ``/metadata``
and ``/schema`` describe the env's tools and are keyed; openenv-core 0.3.0's clients never read them
(they open ``/ws``, and ``MCPToolClient`` in production mode posts ``/mcp``)."""

DEFAULT_IDLE_TIMEOUT = 300.0
"""Seconds a session may wait for its client's next message. A client's model writes its turn between two
messages, so this bounds the slowest turn a client may take; an abandoned connection holds its slot this long."""


# -- the server -----------------------------------------------------------------------------------


class EnvServer:
    """Serves episodes of one env factory; :meth:`app` is the ASGI app (FastAPI).

    Args:
        factory: builds one env per episode (what :func:`agentrl.load_env` returns).
        tasks: rows a reset without its own row plays (``--prompt-data`` or the env's ``tasks()``).
        max_sessions: WebSocket sessions at once; one more is answered CAPACITY_REACHED and closed.
        step_timeout: seconds a reset/step may take when the env sets no ``step_timeout``.
        name: shown in ``/metadata`` (default: the env class's name).
        idle_timeout: seconds a session waits for its client's next message before it is closed (None: forever).
        api_key: the key every route but :data:`OPEN_PATHS` wants (None: no key).
        max_body_bytes: the largest request body (and WebSocket message, where the ASGI server is told).
        sandbox: the sandboxes of the envs' sandboxed tools (None: ``SandboxConfig()``, backend ``auto``).
        allow_host_sandbox: serve envs with sandboxed tools even when the sandboxes are the ``process``
            backend, which lets model code read the host's files (the operator trusts every client).
    """

    def __init__(
        self,
        factory: Callable[[], Env],
        *,
        tasks: list[dict[str, Any]] | None = None,
        max_sessions: int = 8,
        step_timeout: float = DEFAULT_STEP_TIMEOUT,
        name: str | None = None,
        idle_timeout: float | None = DEFAULT_IDLE_TIMEOUT,
        api_key: str | None = None,
        max_body_bytes: int = DEFAULT_MAX_BODY_MB << 20,
        sandbox: SandboxConfig | None = None,
        allow_host_sandbox: bool = False,
    ) -> None:
        if max_sessions < 1:
            raise ValueError(f"max_sessions must be at least 1, got {max_sessions}")
        if idle_timeout is not None and not idle_timeout > 0:
            raise ValueError(f"idle_timeout must be a positive number of seconds (or None), got {idle_timeout}")
        self.factory, self.tasks, self.max_sessions = factory, tasks, max_sessions
        self.step_timeout, self.name, self.idle_timeout = step_timeout, name, idle_timeout
        self.api_key, self.max_body_bytes = api_key, max_body_bytes
        self.sandbox_config, self.allow_host_sandbox = sandbox or SandboxConfig(), allow_host_sandbox
        self.sandbox_config.validate()
        self.sandbox_pool: SandboxPool | None = None  # the envs' sandboxes while the app runs (made by its lifespan)
        self.image_files = named_files(tasks or ())
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
            self._check_sandbox([t.name for t in env.tools if getattr(t, "sandboxed", False)], type(env).__name__)
            doc = (type(env).__doc__ or "").strip().split("\n\n")[0]
            self.info = {
                "name": self.name or type(env).__name__,
                "description": " ".join(doc.split()) or f"agentrl env {type(env).__name__}",
                "max_turns": getattr(env, "max_turns", None),
                "tool_parser": getattr(env, "tool_parser", "hermes"),
            }
        finally:
            await call_env(env.close)

    def host_sandbox_refusal(self, what: str) -> str | None:
        """Why ``what`` (model code) may not run here, or None: the sandboxes are the ``process`` backend
        (model code reads the host's files) and the operator did not allow it. Resolving the backend may
        raise :class:`~agentrl.sandbox.SandboxError` (an explicit ``docker`` without an engine)."""
        if self.allow_host_sandbox or resolve_backend(self.sandbox_config.backend) != "process":
            return None
        return (
            f"{what} model-written code, and the sandbox backend {self.sandbox_config.backend!r} is the 'process' "
            "one here, which lets that code read this machine's files: a served env runs the code its clients "
            "choose, so env-serve refuses it. Start a Docker engine (--sandbox docker) or install bubblewrap "
            "(--sandbox local); or pass --allow-host-sandbox if every client is trusted"
        )

    def _check_sandbox(self, sandboxed: list[str], env_name: str) -> None:
        if not sandboxed:
            return
        try:
            why = self.host_sandbox_refusal(f"{env_name}'s tools {', '.join(sandboxed)} run")
        except SandboxError as exc:  # an explicit backend this machine lacks: refused before serving, too
            raise ValueError(str(exc)) from None
        if why:
            raise ValueError(why)

    async def _new_sandbox(self) -> Sandbox:
        """A sandbox for an episode (the server pool's factory): refused on the unallowed ``process`` backend."""
        why = self.host_sandbox_refusal("this env runs")
        if why:
            raise SandboxError(why)
        return await create_sandbox(self.sandbox_config)

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
                try:
                    msg = await asyncio.wait_for(ws.receive(), self.idle_timeout)
                except TimeoutError:
                    await ws.send_text(json.dumps({"type": "error", "data": self._idle_error()}))
                    break
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

    def _idle_error(self) -> dict[str, Any]:
        return {
            "message": f"session closed: no message for {self.idle_timeout:g}s (the server's --idle-timeout); "
            "its episode is over: open a new session and reset",
            "code": "SESSION_ERROR",
        }

    def app(self) -> FastAPI:
        """The ASGI app: ``/health``, ``/metadata``, ``/schema``, ``/mcp`` and the ``/ws`` sessions, behind
        the body cap and (with ``api_key``) the key check. Serve it with uvicorn's ``ws_max_size`` set to
        ``max_body_bytes`` (``agentrl env-serve`` does) so WebSocket messages are capped alike."""

        @contextlib.asynccontextmanager
        async def lifespan(_: FastAPI) -> AsyncIterator[None]:
            await self.describe()
            self.sandbox_pool = SandboxPool(self._new_sandbox, self.sandbox_config)
            try:
                yield
            finally:
                pool, self.sandbox_pool = self.sandbox_pool, None
                await pool.close()
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
                body = await read_json(request, what="JSON-RPC request")
            except BadRequest as exc:
                return {
                    "jsonrpc": "2.0",
                    "id": None,
                    "error": {"code": -32700, "message": "Parse error", "data": str(exc)},
                }
            return self.json_rpc(body)

        app.websocket("/ws")(self.session)
        app.add_middleware(BodyLimit, max_bytes=self.max_body_bytes)
        if self.api_key:  # added last, so run first: the key is checked before anything reads the body
            app.add_middleware(ApiKeyGuard, api_key=self.api_key, open_paths=OPEN_PATHS)
            app.add_middleware(BasicKey)
        return app


class BasicKey:
    """ASGI middleware: ``Authorization: Basic base64(USER:KEY)`` is read as ``Bearer KEY`` (any user name).

    openenv-core's clients take no headers, but a key in their base URL (``http://agentrl:KEY@HOST:PORT``)
    is sent as Basic credentials by both of their transports (websockets for ``/ws``, httpx for ``/mcp``).
    This only rewrites the header; :class:`~agentrl.http_guard.ApiKeyGuard` after it compares the key."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] in ("http", "websocket"):
            headers = list(scope.get("headers") or ())
            for i, (name, value) in enumerate(headers):
                if name.lower() != b"authorization" or value[:6].lower() != b"basic ":
                    continue
                with contextlib.suppress(binascii.Error, ValueError):
                    _user, sep, key = base64.b64decode(value[6:].strip(), validate=True).partition(b":")
                    if sep:
                        headers[i] = (name, b"Bearer " + key)
                        scope = {**scope, "headers": headers}
                break
        await self.app(scope, receive, send)


def _version() -> str:
    return __version__


def build_server(
    env: str | Callable[[], Env],
    *,
    prompt_data: str | None = None,
    input_key: str = "prompt",
    label_key: str = "label",
    max_sessions: int = 8,
    step_timeout: float = DEFAULT_STEP_TIMEOUT,
    trust_row_code: bool = False,
    **guards: Any,
) -> EnvServer:
    """An :class:`EnvServer` for an env spec (anything :func:`agentrl.load_env` takes) or factory.

    Task rows come from ``prompt_data`` when given, else the env's own ``tasks()``, else none (then
    every reset must carry its row). A bad spec or file raises here, before any port is bound; so does a
    row naming code (``generate_function_path``) unless ``trust_row_code`` (:func:`agentrl.data.task_from_row`).
    ``guards`` go to :class:`EnvServer` (``idle_timeout``, ``api_key``, ``max_body_bytes``, ``sandbox``,
    ``allow_host_sandbox``).
    """
    factory = load_env(env) if isinstance(env, str) else env
    tasks = None
    if prompt_data or getattr(factory, "tasks", None) is not None:
        tasks = task_rows(
            factory,
            prompt_data,
            input_key=input_key,
            label_key=label_key,
            env_name=str(env),
            trust_row_code=trust_row_code,
        )
    return EnvServer(factory, tasks=tasks, max_sessions=max_sessions, step_timeout=step_timeout, **guards)


def create_app(env: str | Callable[[], Env], **kwargs: Any) -> FastAPI:
    """The ASGI app serving ``env`` (arguments as :func:`build_server`), for ``uvicorn`` or any ASGI server."""
    return build_server(env, **kwargs).app()


# -- the command ----------------------------------------------------------------------------------


def cmd_env_serve(args: argparse.Namespace) -> int:
    """``agentrl env-serve`` (flags defined in :mod:`agentrl.cli`): check the env, then serve until interrupted."""
    import math

    import uvicorn

    if args.max_sessions < 1:
        raise ValueError(f"--max-sessions must be at least 1, got {args.max_sessions}")
    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port must be 0..65535, got {args.port}")
    if not args.step_timeout > 0:
        raise ValueError(f"--step-timeout must be a positive number of seconds, got {args.step_timeout}")
    if not (math.isfinite(args.idle_timeout) and args.idle_timeout > 0):
        raise ValueError(f"--idle-timeout must be a positive number of seconds, got {args.idle_timeout}")
    body_cap = max_body_bytes(args.max_body_mb)
    api_key = resolve_api_key(args.api_key, file=args.api_key_file, env=API_KEY_ENV)
    warn_if_open(args.host, api_key, exposes="plays the env and runs its tools", env=API_KEY_ENV)
    config = sandbox.SandboxConfig(backend=args.sandbox)
    sandbox.configure(config)
    with naming_flag("--prompt-data" if args.prompt_data else "--env", args.prompt_data or args.env):
        server = build_server(
            args.env,
            prompt_data=args.prompt_data,
            input_key=args.input_key,
            label_key=args.label_key,
            max_sessions=args.max_sessions,
            step_timeout=args.step_timeout,
            trust_row_code=args.trust_row_code,
            idle_timeout=args.idle_timeout,
            api_key=api_key,
            max_body_bytes=body_cap,
            sandbox=config,
            allow_host_sandbox=args.allow_host_sandbox,
        )
        # a roles env, a broken constructor or sandboxed tools on the host: refused before the port is bound
        asyncio.run(server.describe())
    print(f"agentrl env-serve: {args.env} on http://{args.host}:{args.port} (OpenEnv: /ws, /schema, /health)")
    uvicorn.run(server.app(), host=args.host, port=args.port, log_level="warning", ws_max_size=server.max_body_bytes)
    return 0
