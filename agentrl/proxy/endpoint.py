"""The endpoint agents call: an OpenAI-compatible FastAPI server whose requests queue on sessions.

One agent's conversation is one :class:`Session`. A session has two names: its ``id``, which its samples
and log lines carry and which is no secret, and its ``token``, an unguessable capability (256 random
bits) that is the only way to reach it. The token is in the base URL the session's agent is given
(``/s/{token}/v1/chat/completions``; :meth:`ProxyServer.base_url`) or, for clients that cannot change
the path, in the ``X-Agentrl-Session`` header of ``/v1/chat/completions``; ``/s/{token}/end`` ends it.
An unmodified OpenAI client needs nothing but that base URL. A request with a wrong or missing token is
refused (404) before its body is read, so no client can write a turn into, or end, or score, a session
it was not given; tokens are looked up by their SHA-256 digest, so the lookup's timing says nothing
about any token.

A request is validated (:func:`~agentrl.proxy.requests.parse_request`: a large body in a worker thread,
off the event loop), queued on its session as a :class:`Call`, and held open until the episode
(:class:`~agentrl.proxy.proxy_env.ProxyEnv`) answers it with the turn it generated. Sessions take one request
at a time, and an ended session refuses every later one (409), so an agent can never talk past the end
of its episode or into another agent's.

Every request passes :mod:`agentrl.http_guard` first: bodies over ``max_body_bytes`` are a 413
(``--max-body-mb``), and with ``api_key`` every route but ``GET /health`` wants ``Authorization: Bearer
KEY`` (compared in constant time).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import secrets
import socket
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from agentrl.http_guard import DEFAULT_MAX_BODY_MB, INLINE_PARSE_BYTES, ApiKeyGuard, BodyLimit, json_bytes
from agentrl.proxy.replies import Streamed
from agentrl.proxy.requests import ChatRequest, EndRequest, Refusal, parse_end, parse_open, parse_request
from agentrl.types import Message

__all__ = ["OPEN_PATHS", "SESSION_HEADER", "Call", "ProxyServer", "Session", "SessionsFull", "answer"]

SESSION_HEADER = "X-Agentrl-Session"
"""The header carrying the session's token when the base URL does not (``/v1/chat/completions``)."""

OPEN_PATHS = ("/health",)
"""The routes answered without the API key: liveness only (as SGLang's ``/health``); it says nothing
about sessions."""

_ENDED_KEPT = 10_000
"""Ended sessions a server remembers (to refuse their late requests as ended, not unknown)."""


class SessionsFull(RuntimeError):
    """:meth:`ProxyServer.open` at ``max_sessions`` open sessions."""


def _digest(token: str) -> bytes:
    return hashlib.sha256(token.encode("utf-8", "surrogatepass")).digest()


@dataclass
class Call:
    """One validated request, waiting for the episode to answer it."""

    request: ChatRequest
    messages: list[Message]
    tools: list[dict[str, Any]]
    reply: asyncio.Future = field(default_factory=lambda: asyncio.get_running_loop().create_future())


def answer(call: Call, result: dict[str, Any] | Refusal) -> None:
    """Answer a waiting request (once: a second answer is ignored)."""
    if not call.reply.done():
        call.reply.set_result(result)


@dataclass
class Session:
    """One agent's conversation: its requests queue here until the episode takes them.

    ``ended`` resolves when the agent says it is done (``POST /s/{token}/end``), with what it posted.
    ``external``: the session of an agent started elsewhere (``agentrl proxy``), whose ``/end`` carries
    the episode's reward; an env's own session scores the episode with the env's ``reward()``, so a
    reward posted to it is refused.
    """

    id: str
    token: str = field(default="", repr=False)
    """The capability that reaches the session (in its base URL); never logged, never in a sample."""
    external: bool = False
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    busy: bool = False
    closed: bool = False
    ended: asyncio.Future[EndRequest] = field(default_factory=lambda: asyncio.get_running_loop().create_future())
    end_reason: str | None = None
    """Why it ended without its agent's ``/end`` (``"idle"``, ``"shutdown"``); None otherwise."""
    requests: int = 0
    """Requests queued on it so far (an ``agentrl proxy`` session ended before its first writes no sample)."""

    def end(self, body: EndRequest | None = None, *, reason: str | None = None) -> None:
        """Resolve :attr:`ended` (the first end counts): with the agent's ``/end`` body, or for ``reason``."""
        if not self.ended.done():
            self.end_reason = reason
            self.ended.set_result(body if body is not None else EndRequest())

    def close(self, why: str) -> None:
        """Refuse whatever is queued or waiting, and every later request."""
        self.closed = True
        while not self.queue.empty():
            answer(self.queue.get_nowait(), Refusal(409, why))


class _EmbeddedServer:
    """uvicorn without its signal handlers (the run that embeds the proxy owns Ctrl-C)."""

    def __new__(cls, config: Any) -> Any:
        import uvicorn

        class Server(uvicorn.Server):
            @contextlib.contextmanager
            def capture_signals(self) -> Iterator[None]:
                yield

        return Server(config)


class ProxyServer:
    """The OpenAI-compatible endpoint, on ``host`` (loopback by default) and a free port.

    ``on_open(session)``: clients may open sessions themselves (``POST /sessions``, ``agentrl proxy``, which
    starts an episode for each); without it that route is a 404 and only :meth:`open` (an episode) opens
    sessions. ``max_sessions``: open sessions at once (None: no cap); one more is refused (429 naming
    ``--max-sessions``). ``api_key``: every request on every route but :data:`OPEN_PATHS` must carry
    ``Authorization: Bearer KEY`` (set it when ``host`` is not loopback). ``max_body_bytes``: larger
    request bodies are a 413 (``--max-body-mb``).
    """

    _shared: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        api_key: str | None = None,
        on_open: Callable[[Session], Any] | None = None,
        max_sessions: int | None = None,
        max_body_bytes: int = DEFAULT_MAX_BODY_MB << 20,
    ):
        if max_sessions is not None and (isinstance(max_sessions, bool) or max_sessions < 1):
            raise ValueError(f"--max-sessions must be a positive number of sessions, got {max_sessions!r}")
        self.host, self.port, self.api_key = host, port, api_key
        self.on_open, self.max_sessions, self.max_body_bytes = on_open, max_sessions, max_body_bytes
        self.sessions: dict[str, Session] = {}
        """The open sessions by id."""
        self.ended: OrderedDict[str, str] = OrderedDict()
        """Recently ended session ids and why they ended."""
        self._by_token: dict[bytes, Session] = {}
        self._retired: OrderedDict[bytes, str] = OrderedDict()
        """Recently ended sessions' token digests, and their ids."""
        self._server: Any = None
        self._task: asyncio.Task | None = None

    @classmethod
    async def shared(cls) -> ProxyServer:
        """The event loop's own server (started on first use, stopped with the loop)."""
        loop = asyncio.get_running_loop()
        server = cls._shared.get(loop)
        if server is None:
            server = cls._shared[loop] = cls()
            await server.start()
        return server

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def base_url(self, session: Session, url: str | None = None) -> str:
        """What an OpenAI client takes as ``base_url`` for the session (it holds the session's token);
        ``url``: the server's address as the client reaches it (default :attr:`url`)."""
        return f"{url or self.url}/s/{session.token}/v1"

    async def start(self) -> None:
        """Bind (``port`` 0: a free one, then ``self.port``) and serve in a task of the running loop."""
        import uvicorn

        sock = socket.socket(socket.AF_INET6 if ":" in self.host else socket.AF_INET)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self.host, self.port))
        self.port = sock.getsockname()[1]
        config = uvicorn.Config(self.app(), log_level="warning", lifespan="off", access_log=False)
        self._server = _EmbeddedServer(config)
        self._task = asyncio.create_task(self._server.serve(sockets=[sock]))
        while not self._server.started:
            if self._task.done():
                self._task.result()  # raises what stopped it
            await asyncio.sleep(0.01)

    async def stop(self) -> None:
        for s in self.sessions.values():
            s.close("the proxy is shutting down")
        if self._server is not None and self._task is not None:
            self._server.should_exit = True
            await self._task

    def open(self, session_id: str | None = None, *, external: bool = False) -> Session:
        """A new session with a fresh token (:class:`Session`); its id is ``session_id`` (a label, unique
        among the open and recently ended sessions) or a random one. :class:`SessionsFull` at
        ``max_sessions``; see :class:`Session` for ``external``."""
        sid = session_id or secrets.token_hex(8)
        if sid in self.sessions or sid in self.ended:
            raise ValueError(f"session {sid!r} is already open or has ended")
        if self.max_sessions is not None and len(self.sessions) >= self.max_sessions:
            raise SessionsFull(
                f"{len(self.sessions)} sessions are open, this server's limit (--max-sessions {self.max_sessions}): "
                "end one (POST /s/TOKEN/end) or wait for an idle one to time out, or raise --max-sessions"
            )
        token = secrets.token_urlsafe(32)
        self.sessions[sid] = self._by_token[_digest(token)] = session = Session(sid, token, external=external)
        return session

    def drop(self, session: Session, why: str = "the episode ended") -> None:
        """Close the session: what waits and every later request of it is refused (409, saying ``why``).
        A session already dropped keeps its first reason."""
        if self.sessions.get(session.id) is not session:
            return
        session.close(f"session {session.id!r} has ended: {why}; it takes no more requests")
        self.sessions.pop(session.id, None)
        digest = _digest(session.token)
        self._by_token.pop(digest, None)
        self.ended[session.id] = why
        self._retired[digest] = session.id
        for kept in (self.ended, self._retired):
            while len(kept) > _ENDED_KEPT:
                kept.popitem(last=False)

    def find(self, token: str | None) -> Session | Refusal:
        """The open session ``token`` reaches, or the refusal: 409 for a session that has ended, 404 for
        a token that reaches none (the token is not echoed)."""
        digest = _digest(token or "")
        session = self._by_token.get(digest)
        if session is not None:
            return session
        sid = self._retired.get(digest)
        if sid is not None:
            return Refusal(
                409, f"session {sid!r} has ended: {self.ended.get(sid, 'it ended')}; it takes no more requests"
            )
        how = "POST /sessions opens one" if self.on_open is not None else "sessions are opened by their episode"
        return Refusal(404, f"no open session has this token: use the base URL your session was given ({how})")

    def app(self) -> Any:
        """The FastAPI app (plain Starlette routes: each handler reads the request itself), behind the body
        cap and, with ``api_key``, the key check (:mod:`agentrl.http_guard`)."""
        from fastapi import FastAPI
        from fastapi.responses import JSONResponse, Response, StreamingResponse

        app = FastAPI(title="agentrl recording proxy", docs_url=None, redoc_url=None, openapi_url=None)

        def reply(result: dict[str, Any] | Refusal | Streamed) -> Response:
            if isinstance(result, Refusal):
                return JSONResponse(result.body(), status_code=result.status)
            if isinstance(result, Streamed):
                return StreamingResponse(result.events(), media_type="text/event-stream")
            return Response(json_bytes(result), media_type="application/json")  # model text may hold a surrogate

        async def chat(request: Any) -> Response:
            token = request.path_params.get("token") or request.headers.get(SESSION_HEADER)
            if not token:
                why = f"name the session: its base URL (/s/TOKEN/v1) or the {SESSION_HEADER} header holds its token"
                return reply(Refusal(400, why))
            return reply(await self.handle(token, request))

        async def end(request: Any) -> Response:
            return reply(await self.end(request.path_params["token"], request))

        async def models(request: Any) -> Response:
            found = self.find(request.path_params["token"])
            if isinstance(found, Refusal):
                return reply(found)
            return reply(
                {"object": "list", "data": [{"id": "agentrl-policy", "object": "model", "owned_by": "agentrl"}]}
            )

        async def sessions(request: Any) -> Response:
            return reply(await self.open_from(request))

        async def health(request: Any) -> Response:
            return JSONResponse({"status": "ok"})

        app.router.add_route("/s/{token}/v1/chat/completions", chat, methods=["POST"])
        app.router.add_route("/v1/chat/completions", chat, methods=["POST"])
        app.router.add_route("/s/{token}/end", end, methods=["POST"])
        app.router.add_route("/s/{token}/v1/models", models, methods=["GET"])
        app.router.add_route("/health", health, methods=["GET"])
        if self.on_open is not None:
            app.router.add_route("/sessions", sessions, methods=["POST"])
        app.add_middleware(BodyLimit, max_bytes=self.max_body_bytes)
        if self.api_key:
            refusal = Refusal(401, "missing or wrong API key: send 'Authorization: Bearer KEY'").body()
            app.add_middleware(ApiKeyGuard, api_key=self.api_key, open_paths=OPEN_PATHS, refusal=refusal)
        return app

    async def open_from(self, request: Any) -> dict[str, Any] | Refusal:
        """``POST /sessions`` with ``{"name": ...}`` (optional; :class:`~agentrl.proxy.requests.OpenRequest`):
        a new external session, its episode started by ``on_open``. The answer holds the session's id, its
        token and the URLs that carry it: ``base_url`` (the agent's ``OPENAI_BASE_URL``) and ``end_url``."""
        body = await _off_loop(parse_open, await request.body())
        if isinstance(body, Refusal):
            return body
        try:
            session = self.open(body.name, external=True)
        except SessionsFull as exc:
            return Refusal(429, str(exc))
        except ValueError:
            return Refusal(409, f"name: session {body.name!r} is open or has ended; pick another name", "name")
        assert self.on_open is not None
        self.on_open(session)
        base = self.base_url(session, str(request.base_url).rstrip("/"))
        return {
            "session": session.id,
            "token": session.token,
            "base_url": base,
            "end_url": base[: -len("/v1")] + "/end",
        }

    async def end(self, token: str, request: Any) -> dict[str, Any] | Refusal:
        """``POST /s/TOKEN/end`` with ``{"reward": R, "output": ...}`` (both optional; :class:`EndRequest`):
        the agent is done. ``reward`` only for an external session (:class:`Session`)."""
        session = self.find(token)
        if isinstance(session, Refusal):
            return session
        body = await _off_loop(parse_end, await request.body())
        if isinstance(body, Refusal):
            return body
        if body.reward is not None and not session.external:
            why = "this session's episode is scored by its env's reward(); post a reward only to `agentrl proxy`"
            return Refusal(422, f"reward: {why}", "reward")
        session.end(body)
        return {"ended": session.id}

    async def handle(self, token: str, request: Any) -> dict[str, Any] | Refusal | Streamed:
        """One request (its API key already checked): its session found by ``token``, its body validated
        (off the event loop when large), queued on the session, answered when the episode has generated
        the turn (:class:`Streamed` when it asked for ``stream``; a refusal is always a plain JSON error,
        as OpenAI's are). A refused request leaves every session as it was."""
        session = self.find(token)
        if isinstance(session, Refusal):
            return session
        parsed = await _off_loop(parse_request, await request.body())
        if isinstance(parsed, Refusal):
            return parsed
        if session.closed:
            return Refusal(409, f"session {session.id!r} has ended; it takes no more requests")
        if session.busy:
            return Refusal(409, f"session {session.id!r} already has a request waiting (one at a time)")
        call = Call(*parsed)
        session.busy = True
        session.requests += 1
        session.queue.put_nowait(call)
        try:
            result = await call.reply
        finally:
            session.busy = False
        if call.request.stream and not isinstance(result, Refusal):
            options = call.request.stream_options
            return Streamed(result, include_usage=bool(options and options.include_usage))
        return result


async def _off_loop(parse: Callable[[bytes], Any], raw: bytes) -> Any:
    """``parse(raw)``, in a worker thread when the body is large: a many-MiB chat body takes a second or
    more to decode and validate, during which the event loop would answer no other agent."""
    if len(raw) <= INLINE_PARSE_BYTES:
        return parse(raw)
    return await asyncio.to_thread(parse, raw)
