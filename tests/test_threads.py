"""SyncPool: blocking env/tool calls that hang are written off and replaced; they never starve the others."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from agentrl.rollout.threads import HungThreadsError, SyncPool


async def test_hung_calls_are_replaced_and_healthy_calls_keep_running():
    pool = SyncPool(2, max_hung=3)
    release = threading.Event()
    try:
        for _ in range(3):  # more hangs than workers: with a ThreadPoolExecutor the next call would wait forever
            with pytest.raises(TimeoutError):
                async with asyncio.timeout(0.2):
                    await pool.run(release.wait)
        assert pool.hung == 3 and pool.hung_total == 3
        async with asyncio.timeout(10):
            assert await asyncio.gather(*(pool.run(lambda i=i: i * i) for i in range(8))) == [i * i for i in range(8)]
        with pytest.raises(TimeoutError):  # a 4th: past max_hung, not replaced, and the pool refuses new calls
            async with asyncio.timeout(0.2):
                await pool.run(release.wait)
        with pytest.raises(HungThreadsError, match="4 blocking env/tool calls are stuck"):
            await pool.run(lambda: 1)
        release.set()  # the hung calls return: their threads end, their replacements serve on

        def workers() -> int:
            return sum(t.name.startswith("agentrl-sync") for t in threading.enumerate())

        for _ in range(100):
            if pool.hung == 0 and workers() == 2:
                break
            await asyncio.sleep(0.05)
        # the 3 replaced threads ended; the 4th (never replaced) serves again: 2 workers, as at the start
        assert pool.hung == 0 and workers() == 2
        assert await asyncio.gather(pool.run(time.sleep, 0.2), pool.run(lambda: "ok")) == [None, "ok"]
    finally:
        release.set()
        pool.shutdown()


async def test_exceptions_and_contextvars_reach_the_caller():
    import contextvars

    var = contextvars.ContextVar("v", default="unset")
    var.set("caller's")
    pool = SyncPool(1)
    try:
        assert await pool.run(var.get) == "caller's"
        with pytest.raises(SystemExit):
            await pool.run(sys.exit, 3)
        assert await pool.run(lambda: 5) == 5  # the worker survived it
    finally:
        pool.shutdown()


def test_a_process_with_hung_calls_exits_at_once():
    """concurrent.futures joins its workers at exit (a hung step held the CLI for 48 s): daemon threads do not."""
    script = textwrap.dedent("""
        import asyncio, threading
        from agentrl.rollout.threads import SyncPool
        pool = SyncPool(2)
        async def main():
            try:
                async with asyncio.timeout(0.1):
                    await pool.run(threading.Event().wait)  # never returns
            except TimeoutError:
                print("timed out", pool.hung)
        asyncio.run(main())
        pool.shutdown()
    """)
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "timed out 1" in r.stdout, r.stderr
