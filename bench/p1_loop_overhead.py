"""P1 loop overhead: 64 concurrent multi-turn episodes through the SDK against the embedded engine,
divided by the same engine calls made directly (recorded, then replayed with the same per-episode
order and concurrency), measured in the same run. Goal <= 1.02.

    python bench/p1_loop_overhead.py [--hf-checkpoint PATH] [--episodes 64] [--turns 3] [--rounds 3]

Default model: the default SmolLM2-135M-Instruct (what `agentrl rollout` runs); ``--tiny`` uses a
tiny locally built model instead, where the engine is so fast that the loop's own CPU work (which
shares the 2 cores with the engine) is most visible.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import httpx  # noqa: E402
from transformers import AutoTokenizer  # noqa: E402

from agentrl.chat import ChatTemplate  # noqa: E402
from agentrl.checkpoint import resolve_hf_checkpoint  # noqa: E402
from agentrl.config import RolloutConfig  # noqa: E402
from agentrl.engines.http import SGLangEngine  # noqa: E402
from agentrl.engines.local.process import local_server  # noqa: E402
from agentrl.rollout.episode import EpisodeContext  # noqa: E402
from agentrl.rollout.generate import generate_rollout  # noqa: E402
from agentrl.tiny import build_model  # noqa: E402
from bench.p2_loop_capacity import TalkEnv  # noqa: E402
from bench.replay import RecordingEngine, replay  # noqa: E402


async def sdk_run(url: str, template: ChatTemplate, episodes: int, turns: int, max_new: int):
    TalkEnv.turns = turns
    engine = RecordingEngine(SGLangEngine(url))
    # Turns end at the first sentence ("." stop string), so episodes stay multi-turn on any model.
    cfg = RolloutConfig(
        max_turns=turns + 1, rollout_concurrency=episodes, rollout_max_turn_len=max_new, rollout_stop=["."]
    )
    ctx = EpisodeContext(engine=engine, template=template, config=cfg)
    tasks = [{"prompt": f"Tell me about the number {i}.", "label": None} for i in range(episodes)]
    t = time.perf_counter()
    _, summary = await generate_rollout(ctx, TalkEnv, tasks)
    dt = time.perf_counter() - t
    await engine.inner.close()
    return dt, engine.calls, summary


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--hf-checkpoint", default=None)
    p.add_argument("--tiny", action="store_true", help="a tiny local model instead of the default one")
    p.add_argument("--episodes", type=int, default=64)
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--rounds", type=int, default=7)
    a = p.parse_args()
    if a.tiny:
        ckpt = build_model(Path(tempfile.mkdtemp()) / "tiny", hidden_size=256, num_layers=4)
    else:
        ckpt = resolve_hf_checkpoint(a.hf_checkpoint)
    template = ChatTemplate(AutoTokenizer.from_pretrained(ckpt))
    with local_server(ckpt, extra_args=["--max-running-requests", str(a.episodes), "--seed", "0"]) as url:
        ratios, per_token = [], []
        for r in range(a.rounds):
            httpx.post(url + "/flush_cache")
            t_sdk, calls, summary = asyncio.run(sdk_run(url, template, a.episodes, a.turns, a.max_new_tokens))
            httpx.post(url + "/flush_cache")
            t_direct, differing, direct_tokens = asyncio.run(replay(url, calls, a.episodes))
            sdk_tokens = sum(len(c.output_ids) for seq in calls.values() for c in seq)
            ratios.append(t_sdk / t_direct)
            # a few replayed outputs diverge (batch composition changes float rounding), changing the work done:
            per_token.append((t_sdk / sdk_tokens) / (t_direct / direct_tokens))
            n_req = sum(len(c) for c in calls.values())
            turns = summary.turns_sum / max(summary.samples, 1)
            print(
                f"round {r}: {turns:.2f} turns/episode; SDK {t_sdk:.2f}s, direct {t_direct:.2f}s for {n_req} engine calls "
                f"({sdk_tokens} vs {direct_tokens} generated tokens, {differing} replayed outputs differed); "
                f"ratio {t_sdk / t_direct:.3f}, per generated token {per_token[-1]:.3f}"
            )
        print(
            f"P1 loop overhead (SDK time / direct engine calls), median of {a.rounds}: "
            f"{statistics.median(ratios):.3f}  (goal <= 1.02); per generated token: {statistics.median(per_token):.3f}"
        )


if __name__ == "__main__":
    main()
