"""The endpoint agents call: an OpenAI-compatible FastAPI server whose requests queue on sessions.

One agent's conversation is one :class:`Session`; its id is in the base URL
(``/s/{session}/v1/chat/completions``) or, for clients that cannot change the path, in the
``X-Agentrl-Session`` header of ``/v1/chat/completions``. A request is validated
(:func:`~agentrl.proxy.requests.parse_request`), queued on its session as a :class:`Call`, and held
open until the episode (:class:`~agentrl.proxy.env.ProxyEnv`) answers it with the turn it generated.
Sessions take one request at a time, and an ended session refuses every later one (409), so an agent
can never talk past the end of its episode or into another agent's.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import socket
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from agentrl.proxy.replies import Streamed
from agentrl.proxy.requests import ChatRequest, EndRequest, Refusal, parse_end, parse_request
from agentrl.types import Message

__all__ = ["SESSION_HEADER", "Call", "ProxyServer", "Session", "answer"]

SESSION_HEADER = "X-Agentrl-Session"
"""The header naming the session when the base URL does not (``/v1/chat/completions``)."""

_ENDED_KEPT = 10_000
"""Ended session ids a server remembers (to refuse their late requests as ended, not unknown)."""


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

    ``ended`` resolves when the agent says it is done (``POST /s/{id}/end``), with what it posted.
    ``external``: the session of an agent started elsewhere (``agentrl proxy``), whose ``/end`` carries
    the episode's reward; an env's own session scores the episode with the env's ``reward()``, so a
    reward posted to it is refused.
    """

    id: str
    external: bool = False
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    busy: bool = False
    closed: bool = False
    ended: asyncio.Future[EndRequest] = field(default_factory=lambda: asyncio.get_running_loop().create_future())
    end_reason: str | None = None
    """Why it ended without its agent's ``/end`` (``"idle"``, ``"shutdown"``); None otherwise."""

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

    ``on_new_session(id)``: what to do with a valid request for a session id not opened here (``agentrl
    proxy`` starts an episode for it); without it such a request is a 404. ``api_key``: every request,
    on every route, must carry ``Authorization: Bearer KEY`` (set it when ``host`` is not loopback).
    """

    _shared: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        api_key: str | None = None,
        on_new_session: Callable[[str], Session] | None = None,
    ):
        self.host, self.port, self.api_key = host, port, api_key
        self.on_new_session = on_new_session
        self.sessions: dict[str, Session] = {}
        self.ended: OrderedDict[str, str] = OrderedDict()
        """Recently ended session ids and why they ended."""
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

    def base_url(self, session_id: str) -> str:
        """What an OpenAI client takes as ``base_url`` for the session."""
        return f"{self.url}/s/{session_id}/v1"

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
        """A new session (a random, unguessable id unless given); see :class:`Session` for ``external``."""
        sid = session_id or secrets.token_urlsafe(16)
        if sid in self.sessions or sid in self.ended:
            raise ValueError(f"session {sid!r} is already open or has ended")
        self.sessions[sid] = session = Session(sid, external=external)
        return session

    def drop(self, session: Session, why: str = "the episode ended") -> None:
        """Close the session: what waits and every later request of it is refused (409, saying ``why``).
        A session already dropped keeps its first reason."""
        if self.sessions.get(session.id) is not session:
            return
        session.close(f"session {session.id!r} has ended: {why}; it takes no more requests")
        self.sessions.pop(session.id, None)
        self.ended[session.id] = why
        while len(self.ended) > _ENDED_KEPT:
            self.ended.popitem(last=False)

    def app(self) -> Any:
        """The FastAPI app (plain Starlette routes: each handler reads the request itself)."""
        from fastapi import FastAPI
        from fastapi.responses import JSONResponse, StreamingResponse

        app = FastAPI(title="agentrl recording proxy", docs_url=None, redoc_url=None, openapi_url=None)

        def reply(result: dict[str, Any] | Refusal | Streamed) -> JSONResponse | StreamingResponse:
            if isinstance(result, Refusal):
                return JSONResponse(result.body(), status_code=result.status)
            if isinstance(result, Streamed):
                return StreamingResponse(result.events(), media_type="text/event-stream")
            return JSONResponse(result)

        def denied(request: Any) -> JSONResponse | None:
            if self.api_key and request.headers.get("authorization") != f"Bearer {self.api_key}":
                return reply(Refusal(401, "missing or wrong API key (Authorization: Bearer KEY)"))
            return None

        async def chat(request: Any) -> JSONResponse | StreamingResponse:
            if (refused := denied(request)) is not None:
                return refused
            sid = request.path_params.get("session_id") or request.headers.get(SESSION_HEADER)
            if not sid:
                return reply(Refusal(400, f"name the session in the URL (/s/ID/v1) or the {SESSION_HEADER} header"))
            return reply(await self.handle(sid, await request.body()))

        async def end(request: Any) -> JSONResponse:
            if (refused := denied(request)) is not None:
                return refused
            return reply(self.end(request.path_params["session_id"], await request.body()))

        async def models(request: Any) -> JSONResponse:
            if (refused := denied(request)) is not None:
                return refused
            return reply(
                {"object": "list", "data": [{"id": "agentrl-policy", "object": "model", "owned_by": "agentrl"}]}
            )

        app.router.add_route("/s/{session_id}/v1/chat/completions", chat, methods=["POST"])
        app.router.add_route("/v1/chat/completions", chat, methods=["POST"])
        app.router.add_route("/s/{session_id}/end", end, methods=["POST"])
        app.router.add_route("/s/{session_id}/v1/models", models, methods=["GET"])
        return app

    def end(self, session_id: str, raw: bytes) -> dict[str, Any] | Refusal:
        """``POST /s/ID/end`` with ``{"reward": R, "output": ...}`` (both optional; :class:`EndRequest`):
        the agent is done. ``reward`` only for an external session (:class:`Session`)."""
        session = self.sessions.get(session_id)
        if session is None:
            return self._unknown(session_id)
        body = parse_end(raw)
        if isinstance(body, Refusal):
            return body
        if body.reward is not None and not session.external:
            why = "this session's episode is scored by its env's reward(); post a reward only to `agentrl proxy`"
            return Refusal(422, f"reward: {why}", "reward")
        session.end(body)
        return {"ended": session_id}

    async def handle(self, session_id: str, raw: bytes) -> dict[str, Any] | Refusal | Streamed:
        """One request (its API key already checked): validated, queued on its session, answered when the
        episode has generated the turn (:class:`Streamed` when it asked for ``stream``; a refusal is
        always a plain JSON error, as OpenAI's are). An invalid body is refused before anything else
        happens: it leaves its session as it was, and opens none (``on_new_session``)."""
        parsed = parse_request(raw)
        if isinstance(parsed, Refusal):
            return parsed
        session = self.sessions.get(session_id)
        if session is None and self.on_new_session is not None and session_id not in self.ended:
            session = self.on_new_session(session_id)
        if session is None:
            return self._unknown(session_id)
        if session.closed:
            return Refusal(409, f"session {session_id!r} has ended; it takes no more requests")
        if session.busy:
            return Refusal(409, f"session {session_id!r} already has a request waiting (one at a time)")
        call = Call(*parsed)
        session.busy = True
        session.queue.put_nowait(call)
        try:
            result = await call.reply
        finally:
            session.busy = False
        if call.request.stream and not isinstance(result, Refusal):
            options = call.request.stream_options
            return Streamed(result, include_usage=bool(options and options.include_usage))
        return result

    def _unknown(self, session_id: str) -> Refusal:
        why = self.ended.get(session_id)
        if why is not None:
            return Refusal(409, f"session {session_id!r} has ended: {why}; it takes no more requests")
        return Refusal(404, f"no open session {session_id!r} (sessions are opened by their episode)")
