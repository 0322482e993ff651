"""Agents started elsewhere (``agentrl proxy``): every session they open becomes an episode.

The agent is not ours to start or stop. A client opens a session with ``POST /sessions`` (``{"name":
ID}``, optional) and gets its ``base_url`` (``/s/TOKEN/v1``, what the agent takes as ``OPENAI_BASE_URL``)
and ``end_url``; the session's episode (:class:`ExternalSession`) takes the agent's requests and ends when
the agent posts ``/s/TOKEN/end``, after ``--idle-timeout`` seconds without a request (the first one
included), or at shutdown. The token (256 random bits) is what reaches the session; whoever knows only its
id (``ID``, in the samples) can do nothing to it. At most ``--max-sessions`` are open at once.
:class:`Recorder` opens those episodes and appends each ended one's samples to the output file (none for
a session that ended before its first request); :func:`serve` runs it all.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import math
import signal
import sys
from collections.abc import Callable
from typing import IO, Any

from agentrl.parsing import get_parser
from agentrl.proxy.endpoint import Call, ProxyServer, Session
from agentrl.proxy.proxy_env import REWARD_SECONDS, ProxyEnv
from agentrl.rollout.episode import run_episode
from agentrl.rollout.generate import check_rollout_features
from agentrl.types import Action, Message

__all__ = ["ExternalSession", "Recorder", "check_config", "serve"]


class ExternalSession(ProxyEnv):
    """A session opened by an agent running elsewhere (``agentrl proxy``): the episode ends when the agent
    posts ``/s/TOKEN/end`` (``{"reward": r, "output": ...}``, both optional), after ``idle_timeout`` seconds
    without a request, or when the proxy shuts down (those two: ``truncated``, reward 0). The run's
    ``--max-turns`` alone caps its turns; nothing caps the session's whole length but the idle timeout."""

    end_grace = 0.0  # the agent is not ours to wait for: it gets its reply and runs on
    max_turns = None  # --max-turns decides
    agent_timeout = math.inf  # an agent that keeps talking keeps its session: idle_timeout ends a silent one

    def __init__(
        self,
        server: ProxyServer,
        session: Session,
        idle_timeout: float,
        *,
        tool_parser: str | None = None,
    ):
        self._given = (server, session)
        self.idle_timeout = idle_timeout
        self.step_timeout = idle_timeout + REWARD_SECONDS
        if tool_parser is not None:
            self.tool_parser = tool_parser  # the run's --tool-parser: what the loop parses with

    async def open_session(self) -> tuple[ProxyServer, Session]:
        return self._given

    async def run_agent(self, base_url: str, task: dict[str, Any]) -> Any:
        await asyncio.get_running_loop().create_future()  # the agent is not ours: it ends its session

    async def _next(self) -> Call | None:
        try:
            async with asyncio.timeout(self.idle_timeout):
                return await super()._next()
        except TimeoutError:
            self._session.end(reason="idle")
            return None

    def reward(self, task: dict[str, Any], messages: list[Message], output: Any) -> float:
        return float(self._session.ended.result().reward or 0.0)

    async def step(self, action: Action) -> tuple[list[Message], float, bool, bool, dict]:
        obs, reward, terminated, truncated, info = await super().step(action)
        reason = self._session.end_reason
        if terminated and reason:
            info["end"] = reason
            return obs, reward, False, True, info
        return obs, reward, terminated, truncated, info


def check_config(cfg: Any) -> Callable[..., Any] | None:
    """Refuse, before anything is served, a config every session's episode would fail on (an unknown
    ``--tool-parser``, a ``--history-rewrite-path`` that does not load); return the loaded hook."""
    get_parser(cfg.tool_parser or ExternalSession.tool_parser)
    return check_rollout_features(cfg)


class Recorder:
    """The server of ``agentrl proxy`` and its episodes: a session opened by a client (``POST /sessions``)
    runs an :class:`ExternalSession` episode on ``ctx``; when the episode ends, in any way, the session is
    dropped (its waiting request answered 409, saying why) and its samples are appended to ``out`` (one
    line on stderr each). ``server``: :class:`ProxyServer`'s arguments (``max_sessions``, ``api_key``, ...)."""

    def __init__(self, ctx: Any, out: IO[str], idle_timeout: float, **server: Any):
        self.ctx, self.out, self.idle_timeout = ctx, out, idle_timeout
        self.server = ProxyServer(**server, on_open=self.new_session)
        self.episodes: set[asyncio.Task] = set()
        self._count = itertools.count()

    def new_session(self, session: Session) -> None:
        """Start the episode of a session just opened."""
        cfg = self.ctx.config
        env = ExternalSession(self.server, session, self.idle_timeout, tool_parser=cfg.tool_parser)
        k = next(self._count)
        row = {"prompt": "", "session": session.id}  # the id, never the token
        task = asyncio.create_task(run_episode(self.ctx, lambda: env, row, group_index=k, index=k))
        self.episodes.add(task)
        task.add_done_callback(functools.partial(self._done, session))

    def _done(self, session: Session, task: asyncio.Task) -> None:
        self.episodes.discard(task)
        if not session.requests and session.ended.done():  # ended (its /end, idle, shutdown) before any request
            self.server.drop(session, "it ended before its first request")
            print(f"session {session.id}: ended before its first request; nothing recorded", file=sys.stderr)
            return
        samples = [] if task.cancelled() or task.exception() is not None else task.result()
        why = "its episode was cancelled" if not samples else f"its episode ended {samples[-1].status.value}"
        error = next((s.metadata["error"] for s in samples if s.metadata.get("error")), None)
        if error:
            why += f" ({str(error).strip().splitlines()[-1][:300]})"
        self.server.drop(session, why)  # a no-op when the episode dropped it itself
        for s in samples:
            self.out.write(s.to_json() + "\n")
            line = f"session {session.id}: {s.status.value} ({s.status_reason}), reward {s.reward}"
            print(line + (f": {error.strip()[:300]}" if error else ""), file=sys.stderr, flush=True)
        self.out.flush()


async def serve(
    args: Any, cfg: Any, urls: list[str], tokenizer: Any, template_src: str | None, hook: Any = None
) -> None:
    """Serve ``--host``/``--port`` until SIGINT/SIGTERM; then end the open sessions (``truncated``),
    wait for their episodes and append everything to ``--output``. ``hook``: the loaded
    ``--history-rewrite-path`` (:func:`check_config`)."""
    from agentrl.rollout.context import command_context

    ctx, closers = await command_context(args, cfg, urls, tokenizer, template_src)
    ctx.history_rewrite = hook
    out = open(args.output, "a", encoding="utf-8")  # noqa: SIM115 - closed below, after the last episode
    recorder = Recorder(
        ctx,
        out,
        args.idle_timeout,
        host=args.host,
        port=args.port,
        api_key=args.api_key,
        max_sessions=args.max_sessions,
        max_body_bytes=args.max_body_bytes,
    )
    server = recorder.server
    await server.start()
    print(
        f"agentrl proxy on {server.url}: POST {server.url}/sessions opens a session (its base_url is the agent's "
        f"OPENAI_BASE_URL); samples to {args.output}",
        flush=True,
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
        for session in list(server.sessions.values()):
            session.end(reason="shutdown")
        await asyncio.gather(*list(recorder.episodes), return_exceptions=True)
    finally:
        await server.stop()
        out.close()
        for close in closers:
            await close()
