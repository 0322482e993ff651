"""What the loss math needs to know, without the rest of the run: names and a structural config type.

:mod:`agentrl.config` imports these lists (its flags' choices), never the other way round, so
``agentrl.algo`` can be lifted out with torch alone. This module imports nothing heavy.
"""

from __future__ import annotations

from typing import Protocol

LOSS_TYPES = ("policy_loss", "sft_loss", "custom_loss")
"""slime's ``--loss-type``: RL on rollouts, supervised fine-tuning on demonstrations, or the user's
function (``--custom-loss-function-path``, see :func:`agentrl.algo.loss.custom_loss`)."""

ADVANTAGE_ESTIMATORS = ("grpo", "gspo", "ppo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "rloo")
"""``--advantage-estimator`` values: :func:`agentrl.algo.advantages.compute_advantages` computes all but
``ppo``, whose advantages need a critic's values (:func:`agentrl.algo.advantages.ppo_advantages`)."""

KL_LOSS_TYPES = ("k1", "k2", "k3")
"""``--kl-loss-type``: Schulman's estimators of KL(policy || reference), see :func:`agentrl.algo.loss.kl_penalty`."""


class LossConfig(Protocol):
    """The knobs :func:`agentrl.algo.loss.policy_loss` reads, by slime's flag names.

    Any object with these attributes works (:class:`agentrl.config.TrainConfig` is one); a script
    that uses only the loss can pass a ``types.SimpleNamespace`` or its own dataclass.
    """

    loss_type: str
    advantage_estimator: str
    eps_clip: float
    use_tis: bool
    tis_threshold: float
    use_kl_loss: bool
    kl_loss_coef: float
    kl_loss_type: str
    entropy_coef: float
    calculate_per_token_loss: bool

    @property
    def clip_high(self) -> float:
        """The upper ratio clip ``eps_clip_high`` (``eps_clip`` when unset)."""
        ...
