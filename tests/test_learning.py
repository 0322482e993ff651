"""Learning proof: the whole train loop (embedded engine actor, Ray trainer actor, weight sync)
raises the reward of a tiny local model on a multi-turn env, and lowers it when the advantage
sign is flipped, so the test can fail for the reason it exists. PPO (a critic on its own Ray actor,
GAE over the policy tokens of the 3 turns) raises it too, and its value loss falls while the
critic warms up on a fixed policy.

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
        rollout=RolloutConfig(n_samples_per_prompt=8, max_turns=3, rollout_max_turn_len=16, rollout_seed=7),
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
    import agentrl.runtime.recipes as recipes
    from agentrl.runtime.train import train

    real = recipes.compute_advantages
    monkeypatch.setattr(recipes, "compute_advantages", lambda *a, **kw: [-x for x in real(*a, **kw)])
    train(_config(tiny_ckpt, tmp_path / "flipped"))
    first, last = _first_last(_rewards(tmp_path / "flipped"))
    print(f"flipped: reward first {first:.3f} last {last:.3f}")
    assert last < first + 0.01, (first, last)


def test_ppo_raises_reward_and_the_critic_fits(tiny_ckpt, tmp_path, ray_local):
    from agentrl.runtime.train import train

    cfg = _config(tiny_ckpt, tmp_path / "ppo")
    cfg.num_rollout = 20
    cfg.train = TrainConfig(
        lr=3e-3,
        global_batch_size=64,
        seed=7,
        advantage_estimator="ppo",
        critic_lr=1e-3,
        normalize_advantages=True,
        num_critic_only_steps=4,
    )
    summary = train(cfg)
    lines = [json.loads(line) for line in open(tmp_path / "ppo" / "metrics.jsonl")]
    warmup = [line["critic/value_loss"] for line in lines[:4]]  # the policy is fixed: a stationary target
    first, last = _first_last([line["reward_mean"] for line in lines])
    print(f"ppo: warm-up value loss {warmup}; reward first {first:.3f} last {last:.3f} in {summary['wall_seconds']}s")
    assert warmup[-1] < 0.6 * warmup[0], warmup
    assert [line["weight_version"] for line in lines[:5]] == [0, 0, 0, 0, 1]
    assert last > first + 0.05 and last > 2 * first, (first, last)
