"""P11 (issue 15's "P9"): rollout episodes/s with rollout workers vs the in-process loop, same run.

    python bench/p11_rollout_workers.py [--reps 3] [--episodes 256] [--turns 3] [--work-ms 20]

A no-op engine (``bench/noop_engine.py``: answers every ``/generate`` at once, in its own process)
serves every turn, so what is measured is the episodes' own side: the env's step, the ledger's
tokenizer and template work, HTTP. Three ways to run the same episodes, interleaved per rep:

* ``in-process``: :func:`~agentrl.rollout.generate.generate_rollout` on this process's event loop
  (``--rollout-num-workers 1``, the default);
* ``1 worker`` and ``2 workers``: :class:`~agentrl.runtime.rollout_workers.RolloutWorkerGroup` on a
  local Ray cluster (one group of ``--n-samples-per-prompt`` episodes per call).

Two envs: ``cpu`` does ``--work-ms`` of pure-Python work in every step (a tool that parses, scores
or simulates: it holds the GIL, so one process runs one at a time); ``trivial`` does nothing (the
cost of the Ray hop itself). Goals (issue 15): with ``cpu`` 2 workers >= 1.6x in-process on this
2-core machine; with ``trivial`` 2 workers not slower than in-process.

``--memory``: instead, peak RSS of the driver and of each worker with 100 and with 1,000 episodes
in flight at once (every step waits 2 s), to show what the dispatcher keeps bounded.

``--balance``: instead, two no-op engines, and how the ``/generate`` requests split between them
when 2 workers (each its own router) run the episodes, beside the in-process loop (one router).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
# Ray would put its services on the host's interface address; this benchmark's cluster stays on loopback
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")

import httpx  # noqa: E402

import agentrl  # noqa: E402
from bench.noop_engine import wait_healthy  # noqa: E402

WORK_S = 0.02


class CPUEnv(agentrl.Env):
    """Every step burns ``options["work_ms"]`` of pure-Python CPU, then asks again; ``turns`` steps."""

    async def reset(self, *, seed=None, options=None):
        self.opts = options or {}
        self.n = 0
        return [{"role": "user", "content": str(self.opts.get("prompt", ""))}], {}

    async def step(self, action):
        self.n += 1
        end = time.perf_counter() + float(self.opts.get("work_ms", 0)) / 1000
        x = 0
        while time.perf_counter() < end:  # a tool's own computation: holds the GIL
            x += sum(range(200))
        if self.opts.get("sleep_s"):
            await asyncio.sleep(float(self.opts["sleep_s"]))
        done = self.n >= int(self.opts.get("turns", 3))
        return ([] if done else [{"role": "user", "content": f"go on ({self.n})"}]), float(done), done, False, {}


def _cfg(a: argparse.Namespace, tok_dir: Path, workers: int, concurrency: int):
    from agentrl.config import RolloutConfig, RunConfig

    return RunConfig(
        env=f"{Path(__file__).resolve()}:CPUEnv",
        hf_checkpoint=str(tok_dir),
        rollout_batch_size=1,
        rollout_num_workers=workers,
        rollout_worker_cpus=0.0 if workers > 1 else 1.0,
        rollout=RolloutConfig(
            n_samples_per_prompt=a.n_samples_per_prompt,
            max_turns=a.turns + 1,
            rollout_max_turn_len=16,
            rollout_concurrency=concurrency,
        ),
    )


def _rows(n_groups: int, turns: int, work_ms: float, sleep_s: float = 0.0) -> list[dict]:
    return [
        {"prompt": f"task {i}", "label": None, "turns": turns, "work_ms": work_ms, "sleep_s": sleep_s}
        for i in range(n_groups)
    ]


async def _in_process(cfg, tok_dir: Path, urls: list[str], rows: list[dict]) -> float:
    from agentrl.registry import load_env
    from agentrl.rollout.context import run_context
    from agentrl.rollout.generate import generate_rollout

    ctx, _, _ = run_context(cfg, tok_dir, urls, None)
    t = time.perf_counter()
    samples, summary = await generate_rollout(ctx, load_env(cfg.env), rows)
    dt = time.perf_counter() - t
    assert summary.status.get("completed") == len(samples), summary.to_dict()
    for e in ctx.engine.engines:
        await e.close()
    ctx.executor.shutdown(wait=False)
    return dt


def _workers_run(group, rows: list[dict]) -> float:
    async def go() -> float:
        t = time.perf_counter()
        groups = await group.run_groups(rows, seed=1)
        dt = time.perf_counter() - t
        done = sum(s.status.value == "completed" for g in groups for s in g)
        assert done == sum(len(g) for g in groups), "every episode completes"
        return dt

    return asyncio.run(go())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--episodes", type=int, default=256)
    p.add_argument("--n-samples-per-prompt", type=int, default=8)
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--work-ms", type=float, default=20.0)
    p.add_argument("--trivial-episodes", type=int, default=2048, help="episodes of the trivial env (it runs fast)")
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--memory", action="store_true", help="instead: peak RSS with 100 and 1,000 episodes in flight")
    p.add_argument("--balance", action="store_true", help="instead: requests per engine over two no-op engines")
    a = p.parse_args()

    import ray

    from agentrl.chat import ChatTemplate
    from agentrl.ports import free_port
    from agentrl.runtime.cluster import init_ray, peak_rss_mb
    from agentrl.runtime.rollout_workers import RolloutWorkerGroup
    from agentrl.tiny import build_tokenizer

    tmp = Path(tempfile.mkdtemp(prefix="p11_"))
    tok = build_tokenizer(tmp / "tok")
    turn_ids = ChatTemplate(tok).encode("ok") + [tok.eos_token_id]
    port = free_port()
    engine = [sys.executable, str(Path(__file__).parent / "noop_engine.py"), "--port", str(port)]
    server = subprocess.Popen([*engine, "--turn-ids", ",".join(map(str, turn_ids))])
    url = f"http://127.0.0.1:{port}"
    init_ray(num_cpus=2)
    try:
        wait_healthy(url)
        if a.memory:
            memory_report(a, tmp / "tok", url, RolloutWorkerGroup, peak_rss_mb)
            return
        if a.balance:
            port2 = free_port()
            second = subprocess.Popen([*engine[:-1], str(port2), "--turn-ids", ",".join(map(str, turn_ids))])
            try:
                balance_report(a, tmp / "tok", [url, f"http://127.0.0.1:{port2}"], RolloutWorkerGroup)
            finally:
                second.terminate()
                second.wait()
            return
        groups = {
            n: RolloutWorkerGroup(_cfg(a, tmp / "tok", n, a.concurrency), tmp / "tok", [url], None) for n in (1, 2)
        }
        for env, work, episodes in (("cpu", a.work_ms, a.episodes), ("trivial", 0.0, a.trivial_episodes)):
            rows = _rows(episodes // a.n_samples_per_prompt, a.turns, work)
            times: dict[str, list[float]] = {"in-process": [], "1 worker": [], "2 workers": []}
            _workers_run(groups[2], rows[:2])  # warm: each worker loads the env and opens its sessions
            _workers_run(groups[1], rows[:2])
            for r in range(a.reps):
                order = ["in-process", "1 worker", "2 workers"]
                for name in order if r % 2 == 0 else order[::-1]:
                    if name == "in-process":
                        dt = asyncio.run(_in_process(_cfg(a, tmp / "tok", 1, a.concurrency), tmp / "tok", [url], rows))
                    else:
                        dt = _workers_run(groups[1 if name == "1 worker" else 2], rows)
                    times[name].append(dt)
                    print(f"{env} rep {r} {name}: {episodes / dt:.1f} episodes/s ({dt:.2f}s)", flush=True)
            base = statistics.median(times["in-process"])
            for name in ("1 worker", "2 workers"):
                ratios = [b / w for b, w in zip(times["in-process"], times[name])]
                print(
                    f"P11 {env} env ({work:g} ms a step): {name} / in-process episodes/s, median of {a.reps}: "
                    f"{statistics.median(ratios):.2f} ({', '.join(f'{x:.2f}' for x in ratios)}); "
                    f"in-process {episodes / base:.1f} episodes/s",
                    flush=True,
                )
        for g in groups.values():
            g.shutdown()
    finally:
        server.terminate()
        server.wait()
        ray.shutdown()


def _served(urls: list[str]) -> list[int]:
    for u in urls:
        wait_healthy(u)
    return [int(httpx.get(u + "/count").json()["generate"]) for u in urls]


def balance_report(a, tok_dir: Path, urls: list[str], Group) -> None:
    """Requests per engine: 2 workers (a router each) vs the in-process loop (one router), same episodes.
    Each step waits 50 ms, so requests of many episodes overlap and least-outstanding has a choice."""
    rows = _rows(a.trivial_episodes // a.n_samples_per_prompt, a.turns, 0.0, sleep_s=0.05)
    before = _served(urls)
    asyncio.run(_in_process(_cfg(a, tok_dir, 1, a.concurrency), tok_dir, urls, rows))
    mid = _served(urls)
    group = Group(_cfg(a, tok_dir, 2, a.concurrency), tok_dir, urls, None)
    _workers_run(group, rows)
    group.shutdown()
    after = _served(urls)
    for name, x, y in (("in-process (one router)", before, mid), ("2 workers (a router each)", mid, after)):
        got = [b - a_ for a_, b in zip(x, y)]
        print(f"{name}: requests per engine {got}, larger share {max(got) / max(sum(got), 1):.3f}", flush=True)


def memory_report(a, tok_dir: Path, url: str, Group, peak_rss_mb) -> None:
    """Peak RSS (MiB) of the driver and of each worker with ``n`` episodes in flight at once (n = 100, 1,000):
    every episode's step waits 2 s, so all of them are in flight together. A fresh cluster of workers each."""
    for n in (100, 1000):
        group = Group(_cfg(a, tok_dir, 2, n), tok_dir, [url], None)
        rows = _rows(n // a.n_samples_per_prompt, 2, 0.0, sleep_s=2.0)
        dt = _workers_run(group, rows)
        n = len(rows) * a.n_samples_per_prompt
        import ray

        workers = ray.get([w.peak_rss_mb.remote() for w in group.workers])
        print(
            f"{n} episodes in flight over 2 workers: {n / dt:.0f} episodes/s ({dt:.1f}s, 2 steps of 2 s each); "
            f"peak RSS driver {peak_rss_mb():.0f} MiB, workers {', '.join(f'{w:.0f}' for w in workers)} MiB",
            flush=True,
        )
        group.shutdown()


if __name__ == "__main__":
    main()
