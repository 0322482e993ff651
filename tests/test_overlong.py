"""Over-long samples: DAPO's reward ramp, which samples count as cut by a length limit, and the flags'
refusals (the end-to-end run is tests/test_train.py::test_over_long_samples_are_masked_and_penalized)."""

from __future__ import annotations

import pytest

from agentrl.config import RolloutConfig, RunConfig, TrainConfig
from agentrl.rollout.reward import apply_overlong_penalty, cut_by_length, overlong_penalty
from agentrl.types import Sample, Status


def test_the_ramp_is_dapos():
    # max 100, buffer 20: free up to 80 tokens, then -factor * (len - 80) / 20, capped at -factor
    assert overlong_penalty(50, 100, 20, 1.0) == 0.0
    assert overlong_penalty(80, 100, 20, 1.0) == 0.0
    assert overlong_penalty(85, 100, 20, 1.0) == pytest.approx(-0.25)
    assert overlong_penalty(90, 100, 20, 2.0) == pytest.approx(-1.0)
    assert overlong_penalty(100, 100, 20, 1.0) == pytest.approx(-1.0)
    assert overlong_penalty(130, 100, 20, 1.0) == pytest.approx(-1.0)
    with pytest.raises(ValueError, match="buffer_len < max_len"):
        overlong_penalty(10, 20, 20, 1.0)


def test_the_penalty_is_added_to_live_samples_only():
    live = Sample(status=Status.COMPLETED, reward=1.0, response_length=95)
    failed = Sample(status=Status.FAILED, reward=0.0, response_length=95)
    apply_overlong_penalty([live, failed], 100, 20, 1.0)
    assert live.reward == pytest.approx(0.25) and live.metadata["overlong_penalty"] == pytest.approx(-0.75)
    assert failed.reward == 0.0 and "overlong_penalty" not in failed.metadata


@pytest.mark.parametrize(
    ("status", "reason", "cut"),
    [
        (Status.TRUNCATED, "response_length", True),
        (Status.TRUNCATED, "response_budget", True),
        (Status.TRUNCATED, "context_length", True),
        (Status.TRUNCATED, "max_turns", False),
        (Status.TRUNCATED, "env_truncated", False),
        (Status.COMPLETED, "terminated", False),
    ],
)
def test_only_a_length_limit_counts_as_cut(status, reason, cut):
    sample = Sample(status=status)
    sample.status_reason = reason
    assert cut_by_length(sample) is cut


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"overlong_buffer_len": 4}, "--overlong-buffer-len needs --rollout-max-response-len"),
        ({"overlong_buffer_len": 16, "max_len": 16}, "must be between 1 and it"),
        ({"overlong_buffer_len": 0, "max_len": 16}, "must be between 1 and it"),
        ({"overlong_penalty_factor": 0.5}, "--overlong-penalty-factor scales the over-long penalty"),
        ({"overlong_penalty_factor": 1.0}, "--overlong-penalty-factor scales the over-long penalty"),
        ({"overlong_buffer_len": 4, "max_len": 16, "overlong_penalty_factor": "0.5"}, "finite number >= 0"),
        ({"overlong_buffer_len": 4, "max_len": 16, "overlong_penalty_factor": -1.0}, "finite number >= 0"),
        ({"overlong_buffer_len": 4, "max_len": 16, "overlong_penalty_factor": float("nan")}, "finite number >= 0"),
    ],
)
def test_bad_overlong_flags_are_refused(kw, message):
    max_len = kw.pop("max_len", None)
    cfg = RunConfig(env="agentrl.envs.digits:Digits", rollout=RolloutConfig(rollout_max_response_len=max_len), **kw)
    with pytest.raises(ValueError, match=message):
        cfg.validate()


def test_sft_refuses_the_rollout_shaping_flags():
    for kw in ({"mask_truncated_samples": True}, {"overlong_buffer_len": 4}):
        cfg = RunConfig(
            sft_data="x.jsonl",
            train=TrainConfig(loss_type="sft_loss"),
            rollout=RolloutConfig(rollout_max_response_len=16),
            **kw,
        )
        with pytest.raises(ValueError, match="shape RL rollouts"):
            cfg.validate()
