"""P2 loop capacity: SDK episodes/s at 256 concurrent episodes against a no-op engine on loopback,
divided by the loopback HTTP request floor (the same requests replayed directly), measured in the
same run. Goal >= 0.5.

    python bench/p2_loop_capacity.py [--episodes 512] [--concurrency 256] [--turns 3] [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


import agentrl  # noqa: E402
from agentrl.chat import ChatTemplate  # noqa: E402
from agentrl.config import RolloutConfig  # noqa: E402
from agentrl.engines.http import SGLangEngine  # noqa: E402
from agentrl.ports import free_port  # noqa: E402
from agentrl.rollout.episode import EpisodeContext  # noqa: E402
from agentrl.rollout.generate import generate_rollout  # noqa: E402
from agentrl.tiny import build_tokenizer  # noqa: E402
from bench.noop_engine import wait_healthy  # noqa: E402
from bench.replay import RecordingEngine, replay  # noqa: E402


class TalkEnv(agentrl.Env):
    """Answers every turn with a short user message; terminates after ``turns`` steps."""

    turns = 3

    async def reset(self, *, seed=None, options=None):
        self.n = 0
        return [{"role": "user", "content": str((options or {}).get("prompt", ""))}], {}

    async def step(self, action):
        self.n += 1
        done = self.n >= self.turns
        return ([] if done else [{"role": "user", "content": f"go on ({self.n})"}]), float(done), done, False, {}


async def sdk_run(url: str, template: ChatTemplate, episodes: int, concurrency: int, turns: int):
    TalkEnv.turns = turns
    engine = RecordingEngine(SGLangEngine(url))
    cfg = RolloutConfig(max_turns=turns + 1, rollout_concurrency=concurrency, rollout_max_turn_len=16)
    ctx = EpisodeContext(engine=engine, template=template, config=cfg)
    tasks = [{"prompt": f"task {i}", "label": None} for i in range(episodes)]
    t = time.perf_counter()
    samples, summary = await generate_rollout(ctx, TalkEnv, tasks)
    dt = time.perf_counter() - t
    assert summary.status.get("completed") == episodes, summary.to_dict()
    await engine.inner.close()
    return dt, engine.calls


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--episodes", type=int, default=2048)
    p.add_argument("--concurrency", type=int, default=256)
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--rounds", type=int, default=5)
    a = p.parse_args()
    tmp = Path(tempfile.mkdtemp())
    tok = build_tokenizer(tmp / "tok")
    template = ChatTemplate(tok)
    turn_ids = template.encode("ok") + [tok.eos_token_id]
    port = free_port()
    server = subprocess.Popen(
        [
            sys.executable,
            str(Path(__file__).parent / "noop_engine.py"),
            "--port",
            str(port),
            "--turn-ids",
            ",".join(map(str, turn_ids)),
        ]
    )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url)
        ratios = []
        for r in range(a.rounds):
            t_sdk, calls = asyncio.run(sdk_run(url, template, a.episodes, a.concurrency, a.turns))
            t_floor, _, _ = asyncio.run(replay(url, calls, a.concurrency))
            ratios.append(t_floor / t_sdk)
            n_req = sum(len(c) for c in calls.values())
            print(
                f"round {r}: SDK {a.episodes / t_sdk:.1f} episodes/s ({n_req} requests in {t_sdk:.2f}s); "
                f"floor {a.episodes / t_floor:.1f} episodes/s ({t_floor:.2f}s); ratio {t_floor / t_sdk:.3f}"
            )
        print(
            f"P2 loop capacity ratio (SDK episodes/s / HTTP floor), median of {a.rounds}: "
            f"{statistics.median(ratios):.3f}  (goal >= 0.5)"
        )
    finally:
        server.terminate()
        server.wait()


if __name__ == "__main__":
    main()
