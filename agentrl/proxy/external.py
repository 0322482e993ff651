"""Agents started elsewhere (``agentrl proxy``): every session they open becomes an episode.

The agent is not ours to start or stop: its first request to ``/s/ID/v1`` opens session ``ID`` and
an episode for it (:class:`ExternalSession`), which ends when the agent posts ``/s/ID/end``, after
``--idle-timeout`` seconds without a request, or at shutdown. :func:`serve` runs the endpoint and
appends each ended episode's samples to the output file.
"""

from __future__ import annotations

import asyncio
import itertools
import signal
import sys
from typing import IO, Any

from agentrl.proxy.env import ProxyEnv
from agentrl.proxy.server import Call, ProxyServer, Session
from agentrl.types import Action, Message

__all__ = ["ExternalSession", "serve"]


class ExternalSession(ProxyEnv):
    """A session opened by an agent running elsewhere (``agentrl proxy``): the episode ends when the agent
    posts ``/s/ID/end`` (``{"reward": r, "output": ...}``, both optional), after ``idle_timeout`` seconds
    without a request, or when the proxy shuts down (those two: ``truncated``, reward 0)."""

    end_grace = 0.0  # the agent is not ours to wait for: it gets its reply and runs on

    def __init__(self, server: ProxyServer, session: Session, idle_timeout: float):
        self._given = (server, session)
        self.idle_timeout = idle_timeout
        self.step_timeout = idle_timeout + 60.0

    async def open_session(self) -> tuple[ProxyServer, Session]:
        return self._given

    async def run_agent(self, base_url: str, task: dict[str, Any]) -> Any:
        await asyncio.get_running_loop().create_future()  # the agent is not ours: it ends its session

    async def _next(self) -> Call | None:
        try:
            async with asyncio.timeout(self.idle_timeout):
                return await super()._next()
        except TimeoutError:
            if not self._session.ended.done():
                self._session.ended.set_result({"reason": "idle"})
            return None

    def reward(self, task: dict[str, Any], messages: list[Message], output: Any) -> float:
        return float(self._session.ended.result().get("reward") or 0.0)

    async def step(self, action: Action) -> tuple[list[Message], float, bool, bool, dict]:
        obs, reward, terminated, truncated, info = await super().step(action)
        reason = self._session.ended.result().get("reason") if self._session.ended.done() else None
        if terminated and reason:
            info["end"] = reason
            return obs, reward, False, True, info
        return obs, reward, terminated, truncated, info


def _writer(out: IO[str], episodes: set[asyncio.Task]) -> Any:
    """The done-callback of an episode task: its samples appended to ``out``, one line on stderr each."""

    def write(task: asyncio.Task) -> None:
        episodes.discard(task)
        if task.cancelled() or task.exception() is not None:
            return
        for s in task.result():
            out.write(s.to_json() + "\n")
            session = s.metadata.get("task", {}).get("session")
            print(f"session {session}: {s.status.value}, reward {s.reward}", file=sys.stderr, flush=True)
        out.flush()

    return write


async def serve(args: Any, cfg: Any, urls: list[str], tokenizer: Any, template_src: str | None) -> None:
    """Serve ``--host``/``--port`` until SIGINT/SIGTERM; then end the open sessions (``truncated``),
    wait for their episodes and append everything to ``--output``."""
    from agentrl.cli import _context
    from agentrl.rollout.episode import run_episode

    ctx, closers = await _context(args, cfg, urls, tokenizer, template_src)
    episodes: set[asyncio.Task] = set()
    counter = itertools.count()
    out = open(args.output, "a", encoding="utf-8")  # noqa: SIM115 - closed below, after the last episode
    write = _writer(out, episodes)

    def new_session(sid: str) -> Session:
        session = server.open(sid)
        env = ExternalSession(server, session, args.idle_timeout)
        k = next(counter)
        task = asyncio.create_task(
            run_episode(ctx, lambda: env, {"prompt": "", "session": sid}, group_index=k, index=k)
        )
        episodes.add(task)
        task.add_done_callback(write)
        return session

    server = ProxyServer(args.host, args.port, api_key=args.api_key, on_new_session=new_session)
    await server.start()
    print(f"agentrl proxy: OPENAI_BASE_URL={server.url}/s/<SESSION>/v1, samples to {args.output}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
        for session in list(server.sessions.values()):
            if not session.ended.done():
                session.ended.set_result({"reason": "shutdown"})
        await asyncio.gather(*list(episodes), return_exceptions=True)
    finally:
        await server.stop()
        out.close()
        for close in closers:
            await close()
