"""Rewards on top of the environment's: slime's ``--custom-rm-path`` reward function.

``async def reward_func(args, sample) -> float`` (sync functions work too) is called once per
finished sample; its score is *added* to the sum of the env's per-turn rewards and recorded in
``metadata["rm_reward"]``. A reward function that raises fails that sample (``status=failed``,
reason ``reward_error``), like an env that raises.
"""

from __future__ import annotations

import math
import traceback
from typing import Any, Callable

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
    except Exception as exc:
        sample.status = Status.FAILED
        sample.metadata["status_reason"] = "reward_error"
        sample.metadata["error"] = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__, limit=-3))
        return sample
    sample.metadata["rm_reward"] = float(score)
    sample.reward = float(sample.reward or 0.0) + float(score)
    return sample
