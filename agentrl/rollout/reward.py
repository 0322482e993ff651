"""Rewards on top of the environment's: slime's ``--custom-rm-path`` reward function (per sample,
or per group with ``--group-rm``).

``async def reward_func(args, sample) -> float`` (sync functions work too) is called once per
finished sample; its score is *added* to the sum of the env's per-turn rewards and recorded in
``metadata["rm_reward"]``. A reward function that raises fails that sample (``status=failed``,
reason ``reward_error``), like an env that raises.
"""

from __future__ import annotations

import asyncio
import math
import traceback
from collections.abc import Callable
from typing import Any

from agentrl.env import maybe_await
from agentrl.types import Sample, Status

RewardFn = Callable[[Any, Sample], Any]


async def apply_custom_reward(fn: RewardFn, args: Any, sample: Sample) -> Sample:
    """Add ``fn(args, sample)`` to ``sample.reward`` (only for completed or truncated samples)."""
    if sample.status not in (Status.COMPLETED, Status.TRUNCATED):
        return sample
    try:
        score = await maybe_await(fn(args, sample))
        if isinstance(score, bool) or not isinstance(score, (int, float)) or not math.isfinite(score):
            raise TypeError(f"the reward function returned {score!r}; expected a finite number")
        sample.validate()  # what it may have set on the sample (remove_sample, ...) holds
    except asyncio.CancelledError:
        raise
    except BaseException as exc:  # SystemExit included: the reward function fails its sample only
        sample.status = Status.FAILED
        sample.status_reason = "reward_error"
        sample.metadata["error"] = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__, limit=-3))
        return sample
    sample.metadata["rm_reward"] = float(score)
    sample.reward = float(sample.reward or 0.0) + float(score)
    return sample


async def apply_group_reward(fn: Callable[[Any, list[Sample]], Any], args: Any, samples: list[Sample]) -> list[Sample]:
    """slime's ``--group-rm``: ``fn(args, samples) -> list[float]`` scores a whole group in one call.

    Each score is added to its sample's reward (completed/truncated samples only, as with
    :func:`apply_custom_reward`). A function that raises or returns the wrong number of finite
    scores fails every sample of the group (``reward_error``).
    """
    live = [s for s in samples if s.status in (Status.COMPLETED, Status.TRUNCATED)]
    if not live:
        return samples
    try:
        scores = list(await maybe_await(fn(args, live)))
        if len(scores) != len(live) or not all(
            isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) for x in scores
        ):
            raise TypeError(f"the group reward function returned {scores!r}; expected {len(live)} finite numbers")
        for s in live:
            s.validate()
    except asyncio.CancelledError:
        raise
    except BaseException as exc:  # SystemExit included: fails the group's samples only
        error = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__, limit=-3))
        for s in live:
            s.status = Status.FAILED
            s.status_reason = "reward_error"
            s.metadata["error"] = error
        return samples
    for s, score in zip(live, scores):
        s.metadata["rm_reward"] = float(score)
        s.reward = float(s.reward or 0.0) + float(score)
    return samples


LENGTH_LIMITS = ("response_length", "response_budget", "context_length")
"""``status_reason`` values of an episode a length limit cut off (a turn at ``--rollout-max-turn-len``,
the response at ``--rollout-max-response-len``, the context full): ``--mask-truncated-samples`` masks
those. ``max_turns`` and ``env_truncated`` are not among them: every turn of those ended normally."""


def cut_by_length(sample: Sample) -> bool:
    """Whether a length limit ended ``sample`` (see :data:`LENGTH_LIMITS`)."""
    return sample.status == Status.TRUNCATED and sample.status_reason in LENGTH_LIMITS


def overlong_penalty(length: int, max_len: int, buffer_len: int, factor: float) -> float:
    """DAPO's soft over-long punishment: 0 up to ``max_len - buffer_len`` tokens, then falling
    linearly to ``-factor`` at ``max_len`` (and ``-factor`` beyond it).

    Why: a hard cut gives a truncated answer the same reward as a wrong one, a noisy signal; the
    ramp tells the policy that length itself costs, before the cut. ``length`` is the response's
    tokens (the policy's and, in multi-turn episodes, the env's), the same count
    ``--rollout-max-response-len`` limits.
    """
    if buffer_len < 1 or max_len <= buffer_len:
        raise ValueError(
            f"overlong_penalty: need 1 <= buffer_len < max_len, got buffer_len={buffer_len}, max_len={max_len}"
        )
    exceed = length - (max_len - buffer_len)
    return -min(max(exceed, 0) / buffer_len, 1.0) * factor


def apply_overlong_penalty(samples: list[Sample], max_len: int, buffer_len: int, factor: float) -> None:
    """Add :func:`overlong_penalty` to each completed or truncated sample's reward, in place; the
    penalty is kept in ``metadata["overlong_penalty"]`` (0.0 for samples under the ramp)."""
    for s in samples:
        if s.status in (Status.COMPLETED, Status.TRUNCATED):
            p = overlong_penalty(s.response_length, max_len, buffer_len, factor)
            s.metadata["overlong_penalty"] = p
            s.reward = float(s.reward or 0.0) + p


def share_outcome(segments: list[Sample]) -> None:
    """Give every segment of an episode the outcome of its last one, which the reward function scored:
    ``reward``, ``status``, ``status_reason`` and the ``rm_reward`` / ``error`` it recorded."""
    last = segments[-1]
    for s in segments[:-1]:
        s.reward, s.status, s.status_reason = last.reward, last.status, last.status_reason
        for k in ("rm_reward", "error"):
            if k in last.metadata:
                s.metadata[k] = last.metadata[k]


def train_reward(s: Sample) -> float:
    """The reward an update trains on: a number (None, or an empty dict, counts as 0.0). A dict reward (slime allows
    them from custom reward models) has no single value to train on and is refused, naming the sample."""
    if isinstance(s.reward, dict) and s.reward:
        raise TypeError(
            f"sample {s.index}: its reward is a dict ({sorted(s.reward)[:5]}); a reward function must return a "
            "number for the update to train on"
        )
    return float(s.reward or 0.0)
