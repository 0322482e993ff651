"""Soak: 1,000 concurrent episodes against the embedded engine, 15% of them hostile, on the tiny model.

    python bench/soak.py [--episodes 1000] [--concurrency 256] [--step-timeout 2]

Each run is a child process (so its exit can be timed) that rolls out ``--episodes`` episodes of
:class:`SoakEnv` against one ``agentrl serve`` (with an API key) on loopback. Per task, by index:
5% raise from ``step()`` (half ``RuntimeError``, half ``SystemExit``), 5% hang in a blocking
``step()`` forever (written off at ``--step-timeout``), 5% return garbage (wrong shapes, a NaN
reward, a non-dict info), the rest play 2 turns. Two runs, in the same invocation: ``baseline``
(every episode healthy) and ``soak``. Reported for each: the status counts against what the mix
implies (they must match exactly), the driver's peak RSS and the engine server's (its process
tree's summed ``VmHWM``), and the seconds from the last sample to the process's exit (hung threads
must not hold it); ``soak / baseline`` for both RSS figures and wall time.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import agentrl  # noqa: E402

KINDS = ("raise", "hang", "garbage")


def kind(i: int, hostile: bool) -> str:
    """Task ``i``'s behaviour: 5% each of raise / hang / garbage (by index, so counts are exact), else ok."""
    if not hostile:
        return "ok"
    r = i % 20
    return {0: "raise", 1: "hang", 2: "garbage"}.get(r, "ok")


class SoakEnv(agentrl.Env):
    """Two turns for healthy tasks; the task's ``kind`` decides how a hostile one misbehaves."""

    async def reset(self, *, seed=None, options=None):
        self.kind, self.i, self.n = options["kind"], options["i"], 0
        return [{"role": "user", "content": f"task {self.i}: say something"}], {}

    def step(self, action):  # sync on purpose: the hung ones hold real threads
        self.n += 1
        if self.kind == "raise":
            raise (SystemExit(3) if self.i % 40 == 0 else RuntimeError("boom"))
        if self.kind == "hang":
            import threading

            threading.Event().wait()
        if self.kind == "garbage":
            return [{"role": "user", "content": "x"}], math.nan, "yes", None, []
        done = self.n >= 2
        return ([] if done else [{"role": "user", "content": "go on"}]), 1.0, done, False, {}


def descendants_peak_rss_mb(pid: int) -> float:
    """Summed peak RSS (``VmHWM``) of ``pid``'s descendants: the engine server and whatever it started."""
    total, todo = 0.0, [pid]
    while todo:
        p = todo.pop()
        for task in Path(f"/proc/{p}/task").glob("*/children"):
            with open(task) as f:
                kids = [int(c) for c in f.read().split()]
            for kid in kids:
                todo.append(kid)
                try:
                    status = Path(f"/proc/{kid}/status").read_text()
                except OSError:
                    continue
                total += next((int(x.split()[1]) for x in status.splitlines() if x.startswith("VmHWM:")), 0) / 1024
    return total


def child(a: argparse.Namespace) -> None:
    import asyncio

    from transformers import AutoTokenizer

    from agentrl.chat import ChatTemplate
    from agentrl.config import RolloutConfig
    from agentrl.engines.http import SGLangEngine
    from agentrl.engines.local.process import local_server
    from agentrl.rollout.episode import EpisodeContext
    from agentrl.rollout.generate import generate_rollout
    from agentrl.tiny import build_model

    ckpt = build_model(Path(a.workdir) / "tiny", mean_turn_tokens=10.0)
    hostile = a.mode == "soak"
    tasks = [{"prompt": f"task {i}", "kind": kind(i, hostile), "i": i} for i in range(a.episodes)]
    with local_server(
        ckpt,
        api_key="soak-key",
        extra_args=["--max-running-requests", "64"],
        log_path=Path(a.workdir) / f"engine-{a.mode}.log",
    ) as url:
        cfg = RolloutConfig(
            max_turns=3,
            rollout_concurrency=a.concurrency,
            rollout_max_turn_len=200,
            env_step_timeout=a.step_timeout,
        )
        ctx = EpisodeContext(
            engine=SGLangEngine(url, api_key="soak-key"),
            template=ChatTemplate(AutoTokenizer.from_pretrained(ckpt)),
            config=cfg,
        )

        async def run():
            t = time.perf_counter()
            samples, summary = await generate_rollout(ctx, SoakEnv, tasks)
            await ctx.engine.close()
            return samples, summary, time.perf_counter() - t

        samples, summary, seconds = asyncio.run(run())
        engine_rss = descendants_peak_rss_mb(os.getpid())  # before local_server stops it
    reasons: dict[str, dict[str, int]] = {}
    for s, task in zip(sorted(samples, key=lambda s: s.index), tasks):
        r = reasons.setdefault(task["kind"], {})
        key = f"{s.status.value}/{s.status_reason}"
        r[key] = r.get(key, 0) + 1
    out = {
        "mode": a.mode,
        "episodes": len(samples),
        "seconds": seconds,
        "by_kind": reasons,
        "hung_threads": summary.hung_threads,
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "engine_peak_rss_mb": engine_rss,
    }
    print("RESULT " + json.dumps(out), flush=True)
    print(f"LAST_SAMPLE_AT {time.time()}", flush=True)


def expected(episodes: int, hostile: bool) -> dict[str, int]:
    n = {k: 0 for k in ("ok",) + KINDS}
    for i in range(episodes):
        n[kind(i, hostile)] += 1
    return n


def check(res: dict, episodes: int, hostile: bool) -> list[str]:
    """What went wrong: every kind's episodes must end exactly as that kind should."""
    want = {
        "ok": "completed/terminated",
        "raise": "failed/env_error",
        "hang": "failed/env_timeout",
        "garbage": "failed/env_contract",
    }
    problems = []
    for k, n in expected(episodes, hostile).items():
        got = res["by_kind"].get(k, {})
        if n and got != {want[k]: n}:
            problems.append(f"{k}: expected {n} x {want[k]}, got {got}")
    return problems


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--episodes", type=int, default=1000)
    p.add_argument("--concurrency", type=int, default=256)
    p.add_argument("--step-timeout", type=float, default=2.0)
    p.add_argument("--mode", choices=["baseline", "soak"], help=argparse.SUPPRESS)
    p.add_argument("--workdir", default=None, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.mode:
        child(a)
        return
    import tempfile

    results = {}
    with tempfile.TemporaryDirectory() as work:
        for mode in ("baseline", "soak"):
            t0 = time.time()
            proc = subprocess.run(
                [
                    sys.executable,
                    __file__,
                    "--mode",
                    mode,
                    "--workdir",
                    work,
                    "--episodes",
                    str(a.episodes),
                    "--concurrency",
                    str(a.concurrency),
                    "--step-timeout",
                    str(a.step_timeout),
                ],
                capture_output=True,
                text=True,
                timeout=1800,
                env={**os.environ, "PYTHONUNBUFFERED": "1"},
            )
            exited = time.time()
            lines = proc.stdout.splitlines()
            res = next((json.loads(x[7:]) for x in lines if x.startswith("RESULT ")), None)
            last = next((float(x.split()[1]) for x in lines if x.startswith("LAST_SAMPLE_AT ")), None)
            if proc.returncode != 0 or res is None:
                sys.exit(f"{mode} run failed (rc {proc.returncode}):\n{proc.stderr[-3000:]}")
            res["exit_after_last_sample_s"] = round(exited - last, 2) if last else None
            res["wall_s"] = round(exited - t0, 1)
            res["problems"] = check(res, a.episodes, mode == "soak")
            results[mode] = res
    b, s = results["baseline"], results["soak"]
    summary = {
        "results": results,
        "soak_over_baseline": {
            "peak_rss": round(s["peak_rss_mb"] / b["peak_rss_mb"], 3),
            "engine_peak_rss": round(s["engine_peak_rss_mb"] / b["engine_peak_rss_mb"], 3),
            "rollout_seconds": round(s["seconds"] / b["seconds"], 3),
        },
    }
    print(json.dumps(summary, indent=2))
    bad = b["problems"] + s["problems"]
    if bad:
        sys.exit("counts do not match the mix: " + "; ".join(bad))


if __name__ == "__main__":
    main()
