"""The ``openenv:`` adapter's first look at a server (``/schema``, ``/metadata``) inside a running loop.

An env built by the rollout loop in a process that has not probed the server yet must not read it
synchronously: that would stall every other episode on the loop. The server here is real (agentrl's
``env-serve`` app under uvicorn on loopback, ``tests/serving.py``) with its ``/metadata`` answer
delayed by an ASGI wrapper, as a busy or distant server's would be; a server that never answers is
a loopback socket that listens and never reads. The probe is a task of the loop that built the env, so
it ends with that loop, and an env reset on another loop asks the server anew.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest

from agentrl.adapters import OpenEnvEnv, OpenEnvError
from agentrl.adapters.openenv_probe import SERVER_INFO
from agentrl.adapters.openenv_server import EnvServer
from agentrl.envs.calculator import Calculator
from tests.serving import serve_app


def slow_metadata(app: Any, delay: dict[str, float], hits: list[float]) -> Callable[..., Any]:
    """``app`` with every ``GET /metadata`` answered ``delay["s"]`` seconds late (its start times in ``hits``)."""

    async def wrapped(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["path"] == "/metadata":
            hits.append(time.monotonic())
            await asyncio.sleep(delay["s"])
        await app(scope, receive, send)

    return wrapped


def _served_calculator() -> Any:
    return EnvServer(Calculator, tasks=[{"prompt": "What is 2 + 3?", "label": "5"}], max_sessions=8).app()


async def _ticking(ticks: list[float]) -> None:
    while True:
        ticks.append(time.monotonic())
        await asyncio.sleep(0.01)


async def test_probing_a_slow_server_leaves_the_loop_running():
    """Three envs built inside the loop with nothing cached: construction returns at once, a coroutine
    on the loop keeps ticking while the one shared probe waits for ``/metadata``, and after reset every
    episode plays the served env natively (its tools, its turn limit), the server asked once."""
    delay, hits, ticks = {"s": 1.5}, [], []
    with serve_app(slow_metadata(_served_calculator(), delay, hits)) as url:
        ticker = asyncio.create_task(_ticking(ticks))
        try:
            await asyncio.sleep(0.05)
            t0 = time.monotonic()
            envs = [OpenEnvEnv(url) for _ in range(3)]
            assert time.monotonic() - t0 < 0.5, "building the envs waited for the server"
            firsts = await asyncio.gather(*(env.reset(seed=i) for i, env in enumerate(envs)))
            assert time.monotonic() - t0 >= delay["s"] - 0.1  # the delay was real: reset waited for it
            during = [t for t in ticks if t0 <= t <= t0 + delay["s"]]
            gaps = [b - a for a, b in zip(during, during[1:])]
            assert len(during) > 20 and max(gaps) < 0.5, f"the loop stalled for {max(gaps, default=0):.2f}s"
            assert len(hits) == 1  # one probe for the three envs
            for env, (messages, _) in zip(envs, firsts):
                assert env.served is not None and [t.name for t in env.tools] == ["calculator"]
                assert env.max_turns == 4 and messages[-1]["content"] == "What is 2 + 3?"
                await env.close()
            later = OpenEnvEnv(url)  # cached now: known before reset, no probe
            assert later.served is not None and later.max_turns == 4 and len(hits) == 1
        finally:
            ticker.cancel()
            SERVER_INFO.pop(url, None)


async def test_a_probe_that_times_out_fails_the_sample_and_caches_nothing():
    """``/metadata`` slower than the env's ``timeout``: reset fails naming it and the server is not
    remembered as one without metadata (a served env would lose its tools); the next env asks again."""
    delay, hits = {"s": 2.0}, []
    with serve_app(slow_metadata(_served_calculator(), delay, hits)) as url:
        try:
            env = OpenEnvEnv(url, timeout=0.5)
            with pytest.raises(OpenEnvError, match=r"/metadata did not answer \(timed out\)"):
                await env.reset(seed=0)
            await env.close()
            assert url not in SERVER_INFO and len(hits) == 1
            delay["s"] = 0.0
            again = OpenEnvEnv(url, timeout=5.0)
            await again.reset(seed=0)
            assert again.served is not None and [t.name for t in again.tools] == ["calculator"]
            assert len(hits) == 2 and SERVER_INFO[url][1]["agentrl"]["max_turns"] == 4
            await again.close()
        finally:
            SERVER_INFO.pop(url, None)


async def test_the_factory_carries_what_load_env_read_to_envs_built_elsewhere():
    """``load_env`` probes in the driver; the pickled factory (as Ray sends it to a rollout worker, a
    process whose cache is empty) builds envs inside the loop that know the served env's tools and
    turn limit before their first reset, without asking the server again."""
    import pickle

    import agentrl

    delay, hits = {"s": 0.0}, []
    with serve_app(slow_metadata(_served_calculator(), delay, hits)) as url:
        try:
            factory = await asyncio.to_thread(agentrl.load_env, f"openenv:{url}")
            assert len(hits) == 1
            SERVER_INFO.pop(url)  # the worker process has read nothing
            env = pickle.loads(pickle.dumps(factory))()
            assert env.served is not None and env.max_turns == 4 and [t.name for t in env.tools] == ["calculator"]
            messages, _ = await env.reset(seed=0)
            assert messages[-1]["content"] == "What is 2 + 3?" and len(hits) == 1
            await env.close()
        finally:
            SERVER_INFO.pop(url, None)


def test_a_probe_in_flight_ends_with_its_loop(caplog):
    """An env built inside a loop against a server that accepts and never answers, never reset: the
    probe waiting for ``/schema`` (``timeout`` 5 s) does not hold ``asyncio.run`` up after main() is
    done, leaves no thread behind, caches nothing and logs no error (no unclosed session)."""
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)  # the kernel completes connections; nobody reads the request
    url = f"http://127.0.0.1:{silent.getsockname()[1]}"
    threads = set(threading.enumerate())

    async def main() -> float:
        env = OpenEnvEnv(url, timeout=5.0)
        await asyncio.sleep(0.3)  # the probe's request is sent and waits for its answer
        assert env.served is None and url not in SERVER_INFO
        return time.monotonic()

    try:
        with caplog.at_level(logging.ERROR, logger="asyncio"):
            main_done = asyncio.run(main())
            ended = time.monotonic()
    finally:
        silent.close()
    assert ended - main_done < 1.0, f"asyncio.run waited {ended - main_done:.1f}s for the probe"
    assert set(threading.enumerate()) <= threads and url not in SERVER_INFO
    assert not caplog.records, [r.getMessage() for r in caplog.records]


def test_an_env_built_on_one_loop_resets_on_another():
    """Built on loop A (a thread's loop) while its probe is in flight, reset under ``asyncio.run`` on
    loop B: B cannot await A's probe, so reset starts its own there and plays the served env."""
    delay, hits = {"s": 1.0}, []
    ready, box = threading.Event(), {}

    async def loop_a() -> None:
        box["loop"], box["stop"] = asyncio.get_running_loop(), asyncio.Event()
        ready.set()
        await box["stop"].wait()

    async def build(url: str) -> OpenEnvEnv:
        return OpenEnvEnv(url)

    async def play(env: OpenEnvEnv) -> Any:
        try:
            return await env.reset(seed=0)
        finally:
            await env.close()

    thread = threading.Thread(target=asyncio.run, args=(loop_a(),), daemon=True)
    thread.start()
    assert ready.wait(10)
    with serve_app(slow_metadata(_served_calculator(), delay, hits)) as url:
        try:
            env = asyncio.run_coroutine_threadsafe(build(url), box["loop"]).result(5)
            assert env.served is None  # loop A's probe is still waiting for /metadata
            messages, _ = asyncio.run(play(env))
            assert messages[-1]["content"] == "What is 2 + 3?"
            assert env.served is not None and [t.name for t in env.tools] == ["calculator"]
        finally:
            box["loop"].call_soon_threadsafe(box["stop"].set)
            thread.join(10)
            SERVER_INFO.pop(url, None)
    assert not thread.is_alive()
