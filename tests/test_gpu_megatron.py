"""GPU path of the megatron backend (skipped without CUDA; run by bench/gpu_check.sh on a GPU machine).

On CPU the megatron backend is checked against the torch backend in fp32 (tests/test_megatron_trainer.py);
here the same comparison runs on CUDA with NCCL and bf16 autocast, and `agentrl train --train-backend
megatron` learns on the GPU, colocated with the embedded engine.
"""

from __future__ import annotations

import json

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def test_megatron_matches_torch_on_cuda(tiny_ckpt):
    pytest.importorskip("megatron.core")
    from agentrl.trainer.megatron_trainer import MegatronTrainer
    from agentrl.trainer.torch_trainer import TorchTrainer

    from .test_trainer import cfg, make_samples

    samples = make_samples(8, seed=3)
    config = cfg(dtype="bfloat16", global_batch_size=8, max_tokens_per_gpu=64)
    mega = MegatronTrainer(tiny_ckpt, config, device="cuda")
    try:
        ref = TorchTrainer(tiny_ckpt, config, device="cuda")
        a = torch.tensor([x for lp in mega.compute_log_probs(samples, ref=False).old for x in lp])
        b = torch.tensor([x for lp in ref.compute_log_probs(samples, ref=False).old for x in lp])
        assert (a - b).abs().mean() < 2e-2, (a - b).abs().mean()  # bf16 compute, different kernels
        m, t = mega.train_step(samples), ref.train_step(samples)
        assert m["grad_norm"] == pytest.approx(t["grad_norm"], rel=5e-2)
        assert m["loss"] == pytest.approx(t["loss"], rel=5e-2, abs=1e-3)
    finally:
        mega.close()


def test_megatron_colocated_gpu_run_learns(tiny_ckpt, tmp_path, ray_local):
    pytest.importorskip("megatron.core")
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
        train_backend="megatron",
        rollout=RolloutConfig(n_samples_per_prompt=8, max_turns=3, rollout_max_turn_len=16, rollout_seed=7),
        train=TrainConfig(lr=3e-3, global_batch_size=64, seed=7),
    )
    train(cfg)
    lines = [json.loads(x) for x in open(save / "metrics.jsonl")]
    first = sum(x["reward_mean"] for x in lines[:5]) / 5
    last = sum(x["reward_mean"] for x in lines[-5:]) / 5
    assert len(lines) == 24 and last > first + 0.05, (first, last)


def test_initial_megatron_checkpoint_saved_and_loaded_on_cuda(tiny_ckpt, tmp_path):
    """megatron-core's own writer, unpatched (it synchronizes CUDA), and the trainer starting from what it wrote."""
    pytest.importorskip("megatron.core")
    from megatron.core import dist_checkpointing

    from agentrl.trainer.megatron_trainer import MegatronTrainer

    from .test_trainer import cfg, make_samples

    samples = make_samples(6, seed=11)
    trained = MegatronTrainer(tiny_ckpt, cfg(lr=1e-2), device="cuda")
    try:
        trained.train_step(samples)
        (tmp_path / "ckpt").mkdir()
        dist_checkpointing.save({"model": trained.model.sharded_state_dict()}, str(tmp_path / "ckpt"))
        want = trained.compute_log_probs(samples, ref=False).old
        started = MegatronTrainer(tiny_ckpt, cfg(initial_megatron_checkpoint=str(tmp_path / "ckpt")), device="cuda")
        got = started.compute_log_probs(samples, ref=False).old
        assert max(abs(a - b) for x, y in zip(got, want) for a, b in zip(x, y)) < 1e-5
    finally:
        trained.close()
