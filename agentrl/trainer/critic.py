"""What both critic backends share (``--advantage-estimator ppo``): the value head and the critic's config.

The critic is the policy's architecture with its LM head replaced by a scalar value head (a
``Linear(hidden, 1)``), as slime and OpenRLHF build it: the transformer trunk starts from
``--critic-hf-checkpoint`` (default: the policy checkpoint), the head from a small random init, so
the first values are close to 0 and the first advantages close to the Monte-Carlo returns. Each
backend keeps its own forward (packing, sharding, pipeline schedule) and reads the head's output at
the positions where the policy reads logits: the value of response token t is predicted from the
hidden state of the token before it, the state the policy acted in.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from agentrl.config import TrainConfig


def value_head(hidden_size: int, seed: int) -> nn.Linear:
    """A ``Linear(hidden_size, 1)`` with weights drawn from a normal of std 1/(hidden_size + 1) (OpenRLHF's) and a zero bias.

    Seeded by the run's seed alone (not the rank): every data-parallel or sharded rank must start
    from the same head, since its weights do not come from the checkpoint.
    """
    head = nn.Linear(hidden_size, 1, bias=True)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        head.weight.copy_(torch.randn(head.weight.shape, generator=g) / (hidden_size + 1))
        head.bias.zero_()
    return head


def critic_config(cfg: TrainConfig) -> TrainConfig:
    """The actor's config as the critic uses it: ``--critic-lr``, and none of the policy-only terms.

    The critic trains a value loss only: no reference model (KL loss or KL-shaped rewards belong to
    the actor), no entropy, no TIS, no custom loss, and its outputs are values, not logits to divide
    by the sampling temperature. Batch sizes, precision, clipping and AdamW settings are the actor's.
    """
    return dataclasses.replace(
        cfg,
        lr=cfg.critic_lr if cfg.critic_lr is not None else cfg.lr,
        loss_type="policy_loss",
        custom_loss_function_path=None,
        use_kl_loss=False,
        kl_coef=0.0,
        entropy_coef=0.0,
        use_tis=False,
        logit_temperature=1.0,
        initial_megatron_checkpoint=None,  # an LM's checkpoint: the critic's trunk starts from --critic-hf-checkpoint
    )


CRITIC_METRICS = frozenset({"loss", "value_loss", "value_clipfrac", "values_mean"})
"""The metrics every critic rank reports (see :func:`agentrl.algo.loss.value_loss`)."""


__all__ = ["CRITIC_METRICS", "critic_config", "value_head"]
