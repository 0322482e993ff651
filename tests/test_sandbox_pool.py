"""SandboxPool and ToolEnv's episode sandbox, on real backends (docker via the fixture, bwrap, process).

The pool's promises: never more than ``max_concurrency`` sandboxes alive, waiters served in
arrival order, warm sandboxes reused (reset in between), creations spaced by ``1/create_rate``,
a sandbox whose reset fails destroyed rather than handed out, idle ones destroyed on close.
ToolEnv's: one sandbox per episode for all its sandboxed tool calls, those calls serialized,
the sandbox returned to the pool (reset) by ``close``.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping, Sequence

import pytest

from agentrl.env import ToolEnv
from agentrl.sandbox import ExecResult, Sandbox, SandboxConfig, SandboxPool, Session, create_sandbox
from agentrl.tool import Tool
from agentrl.types import Action, ToolCall
from tests.conftest import sandbox_config

pytestmark = pytest.mark.e2e  # real sandboxes (docker, bubblewrap, process): see conftest

BACKENDS = [pytest.param("docker", marks=pytest.mark.docker), "bubblewrap", "process"]
per_backend = pytest.mark.parametrize("sandbox_backend", BACKENDS, indirect=True)


class Watched(Sandbox):
    """A real sandbox that counts its resets and closes; ``fail_reset`` makes its reset raise (a named
    fake of one failure: the engine lost the container). Everything else is the real backend's."""

    def __init__(self, inner: Sandbox, fail_reset: bool = False) -> None:
        self.inner, self.fail_reset = inner, fail_reset
        self.config, self.isolation = inner.config, inner.isolation
        self.resets = self.closes = 0

    async def run(self, command: str | Sequence[str] | None = None, **kw) -> ExecResult:
        return await self.inner.run(command, **kw)

    async def write_files(self, files: Mapping[str, str | bytes]) -> None:
        await self.inner.write_files(files)

    async def read_file(self, path: str, *, max_bytes: int | None = None) -> bytes:
        return await self.inner.read_file(path, max_bytes=max_bytes)

    async def session(self, name: str, argv: Sequence[str], env: Mapping[str, str] | None = None) -> Session:
        return await self.inner.session(name, argv, env)

    async def reset(self) -> None:
        self.resets += 1
        await self.inner.reset()
        if self.fail_reset:
            raise RuntimeError("container vanished during reset")

    async def close(self) -> None:
        self.closes += 1
        await self.inner.close()


def _pool(cfg: SandboxConfig, made: list[Watched], fail_reset: bool = False) -> SandboxPool:
    async def factory() -> Sandbox:
        sb = Watched(await create_sandbox(cfg), fail_reset)
        made.append(sb)
        return sb

    return SandboxPool(factory, cfg)


@per_backend
async def test_concurrency_cap_fifo_and_reuse(sandbox_backend):
    cfg = sandbox_config(sandbox_backend, max_concurrency=2, create_rate=100.0)
    made: list[Watched] = []
    pool = _pool(cfg, made)
    in_use, peak, order = [0], [0], []

    async def episode(i: int) -> None:
        async with pool.sandbox() as sb:
            order.append(i)
            in_use[0] += 1
            peak[0] = max(peak[0], in_use[0])
            assert pool.live <= 2
            r = await sb.run(["sh", "-c", f"ls; echo {i} > owner.txt; sleep 0.1"])
            assert r.stdout == "", f"episode {i} saw a dirty scratch: {r.stdout!r}"
            in_use[0] -= 1

    tasks = []
    for i in range(6):  # start in a known order; each waits on the pool before the next starts
        tasks.append(asyncio.create_task(episode(i)))
        await asyncio.sleep(0)
    await asyncio.gather(*tasks)
    try:
        assert peak[0] == 2 and pool.live == 2 and len(made) == 2
        # the first two create concurrently (either may finish first); the four waiters are served FIFO
        assert sorted(order[:2]) == [0, 1] and order[2:] == [2, 3, 4, 5], f"waiters out of arrival order: {order}"
        assert pool.stats["created"] == 2 and pool.stats["reused"] == 4
        assert sum(sb.resets for sb in made) == 6  # every release reset its sandbox
    finally:
        await pool.close()


@per_backend
async def test_reuse_hands_back_a_reset_sandbox(sandbox_backend):
    made: list[Watched] = []
    pool = _pool(sandbox_config(sandbox_backend), made)
    first = await pool.acquire()
    await first.write_files({"leftover.txt": "x"})
    await pool.release(first)
    second = await pool.acquire()
    try:
        assert second is first and pool.stats["reused"] == 1
        assert (await second.run("ls -A")).stdout == ""
    finally:
        await pool.release(second)
        await pool.close()


@pytest.mark.parametrize("sandbox_backend", ["bubblewrap", "process"], indirect=True)
async def test_creation_rate_limit_spaces_creations(sandbox_backend):
    cfg = sandbox_config(sandbox_backend, max_concurrency=4, create_rate=5.0)
    starts: list[float] = []

    async def factory() -> Sandbox:
        starts.append(time.monotonic())
        return await create_sandbox(cfg)

    pool = SandboxPool(factory, cfg)
    boxes = await asyncio.gather(*(pool.acquire() for _ in range(4)))
    try:
        gaps = [b - a for a, b in zip(starts, starts[1:])]
        assert len(starts) == 4 and min(gaps) >= 0.19, gaps
    finally:
        for sb in boxes:
            await pool.release(sb)
        await pool.close()


@per_backend
async def test_sandbox_whose_reset_fails_is_destroyed(sandbox_backend):
    made: list[Watched] = []
    pool = _pool(sandbox_config(sandbox_backend, max_concurrency=1), made, fail_reset=True)
    broken = await pool.acquire()
    await pool.release(broken)
    assert broken.closes == 1 and pool.live == 0 and pool.stats["reset_failed"] == 1
    fresh = await pool.acquire()  # the slot was freed: no deadlock with max_concurrency=1
    try:
        assert fresh is not broken and pool.stats["created"] == 2
        assert (await fresh.run("echo ok")).stdout == "ok\n"
    finally:
        fresh.fail_reset = False
        await pool.release(fresh)
        await pool.close()


@per_backend
async def test_close_destroys_idle_and_later_releases(sandbox_backend):
    made: list[Watched] = []
    pool = _pool(sandbox_config(sandbox_backend, max_concurrency=3), made)
    a, b, c = [await pool.acquire() for _ in range(3)]
    await pool.release(a)
    await pool.release(b)
    await pool.close()
    assert (a.closes, b.closes, c.closes) == (1, 1, 0) and pool.live == 1
    await pool.release(c)  # in use at close: destroyed when it comes back
    assert c.closes == 1 and pool.live == 0 and pool.stats["closed"] == 3
    with pytest.raises(RuntimeError, match="closed"):
        await pool.acquire()


# -- ToolEnv: one sandbox per episode ------------------------------------------------------------------


class Shell(Tool):
    """A sandboxed tool that records which sandbox it got and when it ran."""

    name = "sh"
    description = "Run a shell command in the episode's sandbox."
    parameters = {"type": "object", "properties": {"cmd": {"type": "string"}}, "required": ["cmd"]}
    sandboxed = True

    def __init__(self) -> None:
        self.seen: list[Sandbox] = []
        self.spans: list[tuple[float, float]] = []

    async def __call__(self, cmd: str, sandbox: Sandbox) -> str:
        t0 = time.monotonic()
        self.seen.append(sandbox)
        result = await sandbox.run(cmd)
        self.spans.append((t0, time.monotonic()))
        return result.text()


class ShellEnv(ToolEnv):
    def __init__(self, pool: SandboxPool) -> None:
        super().__init__()
        self.tools = [Shell()]
        self.sandbox_pool = pool


def _calls(*cmds: str) -> Action:
    return Action(text="", tool_calls=[ToolCall("sh", {"cmd": c}, id=f"c{i}") for i, c in enumerate(cmds)])


@per_backend
async def test_toolenv_episode_shares_one_sandbox_serially(sandbox_backend):
    made: list[Watched] = []
    pool = _pool(sandbox_config(sandbox_backend, max_concurrency=2), made)
    env = ShellEnv(pool)
    await env.reset(options={"prompt": "go"})
    obs, *_ = await env.step(_calls("echo 1 >> log; sleep 0.2", "echo 2 >> log; sleep 0.2", "echo 3 >> log; sleep 0.2"))
    assert [m["tool_call_id"] for m in obs] == ["c0", "c1", "c2"]
    obs, *_ = await env.step(_calls("sort log | tr '\\n' ,"))
    assert obs[0]["content"] == "1,2,3,"  # the files of the first turn are still there
    tool = env.tools[0]
    assert len(tool.seen) == 4 and all(sb is tool.seen[0] for sb in tool.seen)
    assert await env.sandbox() is tool.seen[0]
    spans = sorted(tool.spans[:3])
    assert all(a_end <= b_start for (_, a_end), (b_start, _) in zip(spans, spans[1:])), "calls overlapped"
    assert pool.live == 1
    await env.close()
    await env.close()  # a second close returns nothing twice
    try:
        assert made[0].resets == 1 and pool.live == 1
        again = await pool.acquire()
        assert again is made[0] and (await again.run("ls -A")).stdout == ""  # handed back reset
        await pool.release(again)
    finally:
        await pool.close()


class ForgetfulEnv(ShellEnv):
    """Overrides close() without calling super().close(): a common user slip."""

    async def close(self) -> None:
        self.closed_by_user = True


@per_backend
async def test_episode_loop_returns_the_sandbox_even_if_close_skips_super(sandbox_backend):
    from agentrl.rollout.scripted import play

    made: list[Watched] = []
    pool = _pool(sandbox_config(sandbox_backend, max_concurrency=1), made)
    script = iter(['<tool_call>{"name": "sh", "arguments": {"cmd": "echo hi > f"}}</tool_call>', "done"] * 2)
    try:
        # with max_concurrency=1 a leaked sandbox would make the second episode wait forever
        results = await asyncio.wait_for(
            play(
                lambda: ForgetfulEnv(pool), lambda m, t: next(script), [{"prompt": "a"}, {"prompt": "b"}], concurrency=1
            ),
            60,
        )
        assert [r.error for r in results] == [None, None]
        assert pool.stats["created"] == 1 and pool.stats["reused"] == 1 and made[0].resets == 2
    finally:
        await pool.close()


@per_backend
async def test_cancel_during_release_destroys_the_half_reset_sandbox(sandbox_backend):
    made: list[Watched] = []
    pool = _pool(sandbox_config(sandbox_backend, max_concurrency=1), made)
    sb = await pool.acquire()
    real_reset = sb.reset

    async def slow_reset() -> None:
        await asyncio.sleep(5)
        await real_reset()

    sb.reset = slow_reset  # type: ignore[method-assign]
    with pytest.raises(asyncio.TimeoutError):
        await asyncio.wait_for(pool.release(sb), 0.2)  # e.g. the env's close timed out
    try:
        assert sb.closes == 1 and pool.live == 0
        fresh = await asyncio.wait_for(pool.acquire(), 30)  # the slot was given back
        assert fresh is not sb
        await pool.release(fresh)
    finally:
        await pool.close()
