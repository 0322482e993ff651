"""MetricsLogger files and console, step_metrics numbers, the reward curve, rollout dumps, trackers."""

from __future__ import annotations

import io
import json
import math
import sys

import pytest

from agentrl.metrics import MetricsLogger, dump_rollout, format_step, plot_rewards, read_metrics, step_metrics
from agentrl.types import Sample, Status


def _sample(
    status: Status,
    reward,
    n: int = 4,
    *,
    sampled: int = 3,
    turns: int = 2,
    tools: int = 1,
    exact: bool = True,
    index: int = 0,
) -> Sample:
    mask = [1] * sampled + [0] * (n - sampled)
    return Sample(
        group_index=0,
        index=index,
        prompt="p",
        tokens=[7, 8] + list(range(n)),
        response="r" * n,
        response_length=n,
        reward=reward,
        loss_mask=mask,
        rollout_log_probs=[-0.5] * n,
        status=status,
        metadata={"num_turns": turns, "tool_calls": tools},
        token_exact=exact,
    )


def _lines(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_log_writes_sorted_flushed_lines_with_nan_as_null(tmp_path):
    buf = io.StringIO()
    logger = MetricsLogger(tmp_path, total_steps=3, stream=buf, plot_every=0)
    logger.log(0, {"reward_mean": 0.5, "kl": float("nan"), "b": float("inf"), "count": 3, "name": "x"})
    # flushed before close: another reader (or a SIGKILL) sees the line already
    rows = _lines(tmp_path / "metrics.jsonl")
    assert len(rows) == 1 and rows[0]["step"] == 0 and rows[0]["kl"] is None and rows[0]["b"] is None
    assert rows[0]["count"] == 3 and rows[0]["name"] == "x" and abs(rows[0]["time"] - __import__("time").time()) < 60
    raw = (tmp_path / "metrics.jsonl").read_text().splitlines()[0]
    assert list(json.loads(raw)) == sorted(json.loads(raw)) and "NaN" not in raw and "Infinity" not in raw
    logger.log(1, {"reward_mean": 0.7})
    logger.close()
    assert [r["step"] for r in _lines(tmp_path / "metrics.jsonl")] == [0, 1]
    # no terminal: one plain line per step
    out = buf.getvalue().splitlines()
    assert out[0].startswith("step 1/3 reward 0.5") and "eta" in out[0] and len(out) == 2


def test_resume_truncates_redone_steps_and_torn_lines(tmp_path):
    with MetricsLogger(tmp_path, console=False, plot_every=0) as logger:
        for step in range(5):
            logger.log(step, {"reward_mean": step / 10})
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 5, "reward_m')  # killed mid-write
    with MetricsLogger(tmp_path, console=False, resume_step=3, plot_every=0) as logger:
        assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [0, 1, 2]
        for step in range(3, 6):
            logger.log(step, {"reward_mean": 1.0})
    steps = [r["step"] for r in _lines(tmp_path / "metrics.jsonl")]
    assert steps == [0, 1, 2, 3, 4, 5]
    assert _lines(tmp_path / "metrics.jsonl")[2]["reward_mean"] == 0.2
    # truncate_after on an open logger keeps appending to the rewritten file
    logger = MetricsLogger(tmp_path, console=False, plot_every=0)
    assert logger.truncate_after(2) == 2
    logger.log(2, {"reward_mean": 0.0})
    logger.close()
    assert [r["step"] for r in _lines(tmp_path / "metrics.jsonl")] == [0, 1, 2]


def test_step_metrics_counts_statuses_and_scores_only_trainable_samples():
    samples = [
        _sample(Status.COMPLETED, 1.0, n=4, sampled=3, turns=2, tools=1, index=0),
        _sample(Status.TRUNCATED, 0.0, n=6, sampled=5, turns=4, tools=3, index=1, exact=False),
        _sample(Status.FAILED, None, n=2, sampled=2, index=2),
        _sample(Status.ABORTED, 0.0, n=2, sampled=1, index=3),
    ]
    m = step_metrics(
        samples,
        rollout_seconds=2.0,
        train_metrics={"kl": 0.01, "train_seconds": 3.0, "loss": -0.2},
        extra={"weight_version": 4},
    )
    assert m["reward_mean"] == 0.5 and m["reward_std"] == 0.5 and m["reward_max"] == 1.0 and m["reward_min"] == 0.0
    assert m["response_length_mean"] == 5.0 and m["turns_mean"] == 3.0 and m["tool_calls_mean"] == 2.0
    assert m["sampled_tokens"] == 11 and m["rollout_tokens_per_s"] == 5.5 and m["rollout_seconds"] == 2.0
    assert (m["count_completed"], m["count_truncated"], m["count_failed"], m["count_aborted"]) == (1, 1, 1, 1)
    assert m["count_not_token_exact"] == 1 and m["samples"] == 4
    assert m["kl"] == 0.01 and m["train_seconds"] == 3.0 and m["loss"] == -0.2 and m["weight_version"] == 4
    assert format_step(2, m, 20) == "step 3/20 reward 0.5 ± 0.5 len 5 rollout 2.0s train 3.0s"
    # nothing trainable: the means are NaN (null in the file), never a silent 0
    m = step_metrics(samples[2:], rollout_seconds=0.0, train_metrics=None)
    assert math.isnan(m["reward_mean"]) and math.isnan(m["rollout_tokens_per_s"]) and m["count_failed"] == 1
    assert format_step(0, m).startswith("step 1 reward nan")


def test_plot_rewards_writes_a_png(tmp_path):
    with MetricsLogger(tmp_path, console=False) as logger:  # plot_every=1: drawn at each step
        for step in range(6):
            logger.log(step, {"reward_mean": step / 6, "reward_std": 0.1})
        png = tmp_path / "reward_curve.png"
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    out = plot_rewards(tmp_path / "metrics.jsonl", tmp_path / "sub" / "curve.png")
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 1000
    assert "matplotlib.pyplot" not in sys.modules or sys.modules["matplotlib"].get_backend().lower() == "agg"


def test_dump_rollout_lines_and_advantages(tmp_path):
    samples = [_sample(Status.COMPLETED, 1.0, index=0), _sample(Status.FAILED, None, index=1)]
    path = dump_rollout(tmp_path, 7, samples, advantages=[[0.5] * 4, [0.0] * 4])
    assert path == tmp_path / "rollouts" / "rollout_000007.jsonl"
    rows = _lines(path)
    assert [r["index"] for r in rows] == [0, 1] and all(r["step"] == 7 for r in rows)
    assert rows[0]["advantages"] == [0.5] * 4 and rows[1]["status"] == "failed"
    back = Sample.from_dict({k: v for k, v in rows[0].items() if k not in ("step", "advantages")})
    assert back.tokens == samples[0].tokens
    assert "advantages" not in _lines(dump_rollout(tmp_path, 8, samples))[0]
    with pytest.raises(ValueError, match="advantages for response_length"):
        dump_rollout(tmp_path, 9, samples, advantages=[[0.5] * 3, [0.0] * 4])


def test_tensorboard_writes_event_file(tmp_path):
    pytest.importorskip("tensorboard")
    with MetricsLogger(tmp_path, tensorboard=True, console=False, plot_every=0) as logger:
        logger.log(0, {"reward_mean": 0.25, "kl": float("nan")})
    events = list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
    assert events and events[0].stat().st_size > 0


def test_wandb_missing_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # makes `import wandb` raise ImportError
    with pytest.raises(ImportError, match="pip install wandb"):
        MetricsLogger(tmp_path, wandb=True, wandb_project="p", console=False)
    MetricsLogger(tmp_path, console=False).close()  # not asked for: never imported


def test_progress_bar_on_a_terminal(tmp_path):
    class Tty(io.StringIO):
        def isatty(self):
            return True

    buf = Tty()
    with MetricsLogger(None, total_steps=4, stream=buf, resume_step=1) as logger:
        logger.log(1, {"reward_mean": 0.5, "reward_std": 0.1, "rollout_seconds": 1.0, "train_seconds": 2.0})
        logger.log(2, {"reward_mean": 0.6})
    text = buf.getvalue()
    assert "step 3/4" in text and "reward 0.6" in text and "eta" in text
