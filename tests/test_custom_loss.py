"""``--loss-type custom_loss``: the user's loss function runs inside the trainer on every micro-batch,
with slime's signature, the step's normalization and each sample's ``train_metadata``."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from agentrl.config import TrainConfig
from agentrl.trainer.torch_trainer import TorchTrainer

from .test_trainer import cfg, make_samples

LOSSES = '''
import torch

def nll(args, batch, log_probs, sum_of_sample_mean):
    """sft_loss written as a custom loss: must give the built-in's numbers."""
    loss = sum_of_sample_mean(-log_probs)
    return loss, {"nll": float(loss.detach())}

def weighted(args, batch, log_probs, sum_of_sample_mean):
    """Per-sample weights from train_metadata; reports the weights it saw."""
    w = torch.tensor([m["w"] for m in batch["metadata"]], dtype=log_probs.dtype)[batch["seq_ids"]]
    loss = sum_of_sample_mean(-log_probs * w)
    seen = sum(m["w"] for m in batch["metadata"])
    assert batch["log_probs"].shape == log_probs.shape and batch["loss_masks"].shape == log_probs.shape
    assert len(batch["response_lengths"]) == len(batch["metadata"]) and batch["tokens"].dim() == 1
    return loss, {"w_seen": seen, "weighted_nll": float(loss.detach())}

def not_a_tensor(args, batch, log_probs, sum_of_sample_mean):
    return 1.0, {}

def nan(args, batch, log_probs, sum_of_sample_mean):
    return log_probs.sum() * float("nan"), {}

def bad_metrics(args, batch, log_probs, sum_of_sample_mean):
    return log_probs.sum() * 0, {"x": "high"}

def says_loss(args, batch, log_probs, sum_of_sample_mean):
    loss = sum_of_sample_mean(-log_probs)
    return loss, {"loss": float(loss)}
'''


@pytest.fixture
def losses(tmp_path):
    path = tmp_path / "my_losses.py"
    path.write_text(LOSSES)
    return lambda name: f"{path}:{name}"


@pytest.mark.parametrize("per_token", [False, True])
def test_a_custom_loss_equal_to_sft_trains_exactly_like_sft(tiny_ckpt, losses, per_token):
    samples = make_samples(8, seed=3)
    common = {"lr": 1e-3, "max_tokens_per_gpu": 48, "calculate_per_token_loss": per_token}  # several micro-batches
    builtin = TorchTrainer(tiny_ckpt, cfg(loss_type="sft_loss", **common))
    custom = TorchTrainer(tiny_ckpt, cfg(loss_type="custom_loss", custom_loss_function_path=losses("nll"), **common))
    want, got = builtin.train_step(samples), custom.train_step(samples)
    assert "pg_loss" not in got and got["loss"] == pytest.approx(want["loss"], rel=1e-5)  # no zeros for unrun terms
    assert got["nll"] == pytest.approx(want["sft_loss"], rel=1e-5) and got["grad_norm"] == pytest.approx(
        want["grad_norm"], rel=1e-4
    )
    for (name, a), (_, b) in zip(builtin.named_weights(), custom.named_weights()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7, msg=name)


def test_train_metadata_reaches_the_loss(tiny_ckpt, losses):
    samples = make_samples(8, seed=5)
    samples = [dataclasses.replace(s, train_metadata={"w": float(i % 3)}) for i, s in enumerate(samples)]
    trainer = TorchTrainer(
        tiny_ckpt, cfg(loss_type="custom_loss", custom_loss_function_path=losses("weighted"), max_tokens_per_gpu=48)
    )
    before = trainer.compute_log_probs(samples, ref=False).old
    metrics = trainer.train_step(samples)
    assert metrics["w_seen"] == sum(i % 3 for i in range(8))  # summed over the micro-batches: every sample once
    after = trainer.compute_log_probs(samples, ref=False).old
    # the loss raises the likelihood of trained tokens; most on the heavily weighted samples
    gain = [sum(a) - sum(b) for a, b in zip(after, before)]
    assert sum(gain[i] for i in range(8) if i % 3 == 2) > 0


@pytest.mark.parametrize(
    "name, error, message",
    [
        ("not_a_tensor", TypeError, "scalar tensor"),
        ("nan", ValueError, "not finite"),
        ("bad_metrics", TypeError, "metrics must be numbers"),
        ("says_loss", ValueError, "'loss' is the trainer's own"),
    ],
)
def test_a_bad_custom_loss_fails_the_step_naming_the_flag(tiny_ckpt, losses, name, error, message):
    trainer = TorchTrainer(tiny_ckpt, cfg(loss_type="custom_loss", custom_loss_function_path=losses(name)))
    with pytest.raises(error, match=f"--custom-loss-function-path .*{message}"):
        trainer.train_step(make_samples(4))


def test_custom_loss_flags_go_together(losses):
    with pytest.raises(ValueError, match="--loss-type custom_loss and --custom-loss-function-path go together"):
        TrainConfig(loss_type="custom_loss").validate()
    with pytest.raises(ValueError, match="go together"):
        TrainConfig(custom_loss_function_path=losses("nll")).validate()
    TrainConfig(loss_type="custom_loss", custom_loss_function_path=losses("nll")).validate()


def test_a_missing_custom_loss_is_refused_before_ray_starts(tiny_ckpt, tmp_path):
    import subprocess
    import sys

    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "agentrl",
            "train",
            "--env",
            "agentrl.envs.digits:Digits",
            "--hf-checkpoint",
            str(tiny_ckpt),
            "--loss-type",
            "custom_loss",
            "--custom-loss-function-path",
            str(tmp_path / "nope.py:f"),
            "--num-rollout",
            "1",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 2 and "--custom-loss-function-path" in r.stderr and "Ray" not in r.stderr, r.stderr
