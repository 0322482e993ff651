"""Learning proof: the whole train loop (embedded engine actor, Ray trainer actor, weight sync)
raises the reward of a tiny local model on a multi-turn env, and lowers it when the advantage
sign is flipped, so the test can fail for the reason it exists.

``agentrl.envs.digits`` scores each of 3 turns by the fraction of digits in the reply; a random-init
model scores ~0.03. About a minute per run on 2 CPU cores.
"""

from __future__ import annotations

import json

import pytest

from agentrl.config import RolloutConfig, RunConfig, TrainConfig

pytestmark = pytest.mark.e2e  # engine processes, Ray, several processes or a browser: see conftest

STEPS = 24


def _config(ckpt, save) -> RunConfig:
    return RunConfig(
        env="agentrl.envs.digits:Digits",
        hf_checkpoint=str(ckpt),
        num_rollout=STEPS,
        rollout_batch_size=8,
        save=str(save),
        rollout=RolloutConfig(n_samples_per_prompt=8, max_turns=3, rollout_max_response_len=16, rollout_seed=7),
        train=TrainConfig(lr=3e-3, global_batch_size=64, seed=7),
    )


def _rewards(save) -> list[float]:
    return [json.loads(line)["reward_mean"] for line in open(save / "metrics.jsonl")]


def _first_last(rewards: list[float], k: int = 5) -> tuple[float, float]:
    return sum(rewards[:k]) / k, sum(rewards[-k:]) / k


def test_grpo_raises_reward(tiny_ckpt, tmp_path, ray_local):
    from agentrl.runtime.train import train

    summary = train(_config(tiny_ckpt, tmp_path / "run"))
    first, last = _first_last(_rewards(tmp_path / "run"))
    print(f"reward first {first:.3f} last {last:.3f} in {summary['wall_seconds']}s")
    assert last > first + 0.05 and last > 2 * first, (first, last)
    assert (tmp_path / "run" / "reward_curve.png").read_bytes()[:4] == b"\x89PNG"


def test_flipped_advantage_sign_does_not_learn(tiny_ckpt, tmp_path, ray_local, monkeypatch):
    import agentrl.runtime.loop as loop
    from agentrl.runtime.train import train

    real = loop.compute_advantages
    monkeypatch.setattr(loop, "compute_advantages", lambda *a, **kw: [-x for x in real(*a, **kw)])
    train(_config(tiny_ckpt, tmp_path / "flipped"))
    first, last = _first_last(_rewards(tmp_path / "flipped"))
    print(f"flipped: reward first {first:.3f} last {last:.3f}")
    assert last < first + 0.01, (first, last)
