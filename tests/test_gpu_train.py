"""GPU path of `agentrl train` (skipped without CUDA): trainer and embedded engine on one GPU,
colocated, bf16 autocast, and the learning check of tests/test_learning.py on that path."""

from __future__ import annotations

import json

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def test_colocated_gpu_run_learns(tiny_ckpt, tmp_path, ray_local):
    from agentrl.config import RolloutConfig, RunConfig, TrainConfig
    from agentrl.runtime.train import train

    save = tmp_path / "run"
    cfg = RunConfig(
        env="agentrl.envs.digits:Digits",
        hf_checkpoint=str(tiny_ckpt),
        num_rollout=24,
        rollout_batch_size=8,
        save=str(save),
        actor_num_gpus_per_node=1,
        rollout_num_gpus=1,
        colocate=True,
        rollout=RolloutConfig(n_samples_per_prompt=8, max_turns=3, rollout_max_turn_len=16, rollout_seed=7),
        train=TrainConfig(lr=3e-3, global_batch_size=64, seed=7),
    )
    train(cfg)
    lines = [json.loads(x) for x in open(save / "metrics.jsonl")]
    assert len(lines) == 24 and all(x["count_failed"] == 0 for x in lines)
    first = sum(x["reward_mean"] for x in lines[:5]) / 5
    last = sum(x["reward_mean"] for x in lines[-5:]) / 5
    assert last > first + 0.05, (first, last)
