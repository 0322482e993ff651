"""The trainer contract: what the train loop sends to a backend and what it gets back.

A backend (``torch`` here, ``megatron`` at scale) receives plain per-sample records, never the
rollout's ``Sample`` objects: the loop has already dropped what must not be trained on (failed,
aborted, not token-exact) and attached per-token advantages. Everything is per *response* token
(``len == response_length``), the same indexing as ``Sample.loss_mask``.

The loop drives a step in two calls so the algorithm lives in one place (``agentrl.algo``) with
all the information it needs: ``compute_log_probs`` (old policy and reference log-probs, which
some estimators and the KL/TIS terms need), then ``train_step`` with advantages attached.
"""

from __future__ import annotations

import abc
import time
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from agentrl.user_code import load_function


@dataclass
class TrainSample:
    """One trainable episode: ``tokens`` = prompt ids + response ids.

    ``loss_mask`` (1 = sampled by the policy) and ``advantages`` cover the response only.
    ``rollout_log_probs`` are the engine's (for TIS); ``old_log_probs``/``ref_log_probs`` are
    filled by :meth:`Trainer.compute_log_probs` when needed; ``values``/``returns`` by the loop for a
    critic (:class:`Critic`).
    """

    tokens: list[int]
    response_length: int
    loss_mask: list[int]
    advantages: list[float] = field(default_factory=list)
    rollout_log_probs: list[float] | None = None
    old_log_probs: list[float] | None = None
    ref_log_probs: list[float] | None = None
    train_metadata: dict | None = None
    """The sample's ``Sample.train_metadata``, handed to a custom loss (``batch["metadata"]``)."""
    values: list[float] | None = None
    """ppo: the critic's values when the advantages were computed (the value clip's anchor)."""
    returns: list[float] | None = None
    """ppo: the critic's regression targets (GAE returns)."""
    multimodal_inputs: dict | None = None
    """The sample's images (``Sample.multimodal_inputs``: ``{"images": [data URLs]}``, placeholder order)."""
    multimodal_train_inputs: dict | None = None
    """Their processed arrays (``Sample.multimodal_train_inputs``); None = the trainer processes the images."""
    policy: str | None = None
    """The ``--policy`` whose adapter trains on this sample (several policies); None: the run's one policy."""

    @property
    def prompt_length(self) -> int:
        return len(self.tokens) - self.response_length


@dataclass
class LogProbs:
    """Per-sample, per-response-token log-probs under the current (``old``) and reference policy."""

    old: list[list[float]]
    ref: list[list[float]] | None = None


class Trainer(abc.ABC):
    """A policy-training backend. One instance per rank; the runtime wraps it in a Ray actor."""

    weights_finite: bool = False
    """True while every weight :meth:`named_weights` yields is known finite on every rank (the torch
    trainer checks after it loads weights and after each optimizer step, while it owns them). A weight
    transport may then skip its own pass over the bytes (the shared-memory push does, bench P5); False
    (the default, and a backend that does not check) leaves the check to the transport."""

    @abc.abstractmethod
    def compute_log_probs(self, samples: list[TrainSample], *, ref: bool) -> LogProbs:
        """Log-probs of every response token under the current weights (and the reference model)."""

    @abc.abstractmethod
    def train_step(self, samples: list[TrainSample]) -> dict[str, float]:
        """Run ``num_steps_per_rollout`` optimizer steps over ``samples``; return metrics."""

    @abc.abstractmethod
    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Full (unsharded) weights in Hugging Face names, for weight sync and checkpoints."""

    @abc.abstractmethod
    def save(self, path: str | Path, extra_state: dict[str, Any] | None = None) -> None:
        """Write a HF checkpoint (config, tokenizer, safetensors) plus optimizer/RNG state."""

    @abc.abstractmethod
    def load(self, path: str | Path) -> dict[str, Any]:
        """Restore weights, optimizer and RNG state from :meth:`save`; return its ``extra_state``."""

    def adapted_modules(self) -> set[str]:
        """The modules a LoRA adapter adapts, by last name (``q_proj``): what the engines must serve it on.

        Empty for full fine-tuning (the default); the LoRA backends say which, so ``--weight-sync adapter`` is
        refused at start when an engine cannot serve one of them."""
        return set()


class Critic(abc.ABC):
    """A value model (``--advantage-estimator ppo``): the policy's architecture with a scalar head.

    Same sample records and sharding as a :class:`Trainer`, with values in place of log-probs: the
    value at response token t is the critic's estimate of the return from the state BEFORE token t
    (read from the position that predicts token t, as a log-prob is). ``train_step`` regresses the
    values on ``TrainSample.returns`` with :func:`agentrl.algo.loss.value_loss`.
    """

    @abc.abstractmethod
    def compute_values(self, samples: list[TrainSample]) -> list[list[float]]:
        """The value of every response token's state under the current critic weights."""

    @abc.abstractmethod
    def train_step(self, samples: list[TrainSample]) -> dict[str, float]:
        """``num_steps_per_rollout`` optimizer steps of the value loss; return metrics."""

    @abc.abstractmethod
    def save(self, path: str | Path, extra_state: dict[str, Any] | None = None) -> None:
        """Write the critic's weights, optimizer and RNG state under ``path``."""

    @abc.abstractmethod
    def load(self, path: str | Path) -> dict[str, Any]:
        """Restore what :meth:`save` wrote; return its ``extra_state``."""


def load_custom_loss(cfg: Any) -> Callable[..., Any] | None:
    """The ``--custom-loss-function-path`` function when ``--loss-type custom_loss`` (each trainer rank
    loads it itself: functions do not travel to Ray actors by value); else None."""
    if getattr(cfg, "loss_type", None) != "custom_loss":
        return None
    return load_function(cfg.custom_loss_function_path)


def with_gradient(samples: Sequence[TrainSample], cfg: Any) -> list[TrainSample]:
    """The samples that can move the weights in a policy-loss step; the rest need no forward or backward.

    With no KL loss and no entropy bonus, a token's loss is its advantage times a ratio (PPO clip,
    GSPO, TIS alike), so a sample whose advantages are 0 on every trained token (a GRPO group whose
    episodes all tie) contributes exactly 0 to the gradient. Dropping it saves its whole pass; the
    loss keeps the batch's normalizers (``num_tokens``/``num_seqs`` of all samples), so the
    gradient and the optimizer step are those of the full batch. SFT, KL and entropy terms (and a
    custom loss) depend on every sample: then all are kept.
    """
    if cfg.loss_type != "policy_loss" or cfg.use_kl_loss or cfg.entropy_coef != 0:
        return list(samples)  # SFT and KL terms need every sample; a custom loss may too
    return [s for s in samples if any(a != 0 and m for a, m in zip(s.advantages, s.loss_mask))]


def mean_over_trained(
    metrics: dict[str, float], cfg: Any, all_counts: Sequence[float], trained_counts: Sequence[float]
) -> dict[str, float]:
    """``entropy``/``clipfrac``/``ratio_mean`` as means over the samples trained on (see :func:`with_gradient`).

    The loss normalizes every term by the whole batch's tokens (or sequences); for these per-token
    statistics that would count the dropped samples as zeros. ``*_counts`` are (tokens, sequences).
    """
    i = 0 if cfg.calculate_per_token_loss else 1
    if trained_counts[i] <= 0:
        return metrics
    scale = all_counts[i] / trained_counts[i]
    return {k: v * scale if k in ("entropy", "clipfrac", "ratio_mean") else v for k, v in metrics.items()}


def restore_learning_rates(optimizer: torch.optim.Optimizer, cfg: Any) -> None:
    """After an optimizer's state is loaded: each parameter group's learning rate as this run's flags give it
    (``--lr``, or a ``--policy``'s ``--policy-lr``), not the saving run's, so a resumed run trains (and reports
    ``lr``) at the rate it was given. (There is no learning-rate schedule whose position a checkpoint would hold.)"""
    lrs = cfg.policy_lrs()
    for group in optimizer.param_groups:
        group["lr"] = lrs.get(group.get("policy", ""), cfg.lr)


def run_optimizer_steps(
    samples: Sequence[TrainSample],
    n_steps: int | None,
    optimizer_step: Callable[[Sequence[TrainSample]], dict[str, float] | None],
    sum_over_ranks: Callable[[list[float]], list[float]],
    lr: float,
) -> dict[str, float]:
    """``train_step``'s outer loop, shared by the backends: ``n_steps`` equal consecutive chunks of
    ``samples``, one ``optimizer_step`` each (None = no rank had samples), then step-mean metrics plus
    ``lr``, ``train_tokens`` (masked response tokens, summed over ranks by ``sum_over_ranks``),
    ``train_seconds``, ``tokens_per_s`` (every token through the model) and ``steps``. ``n_steps`` None: a
    trainer used on its own, outside a run whose preflight derived ``num_steps_per_rollout``, makes one step.
    """
    t0 = time.perf_counter()
    n_steps = 1 if n_steps is None else n_steps
    bounds = np.linspace(0, len(samples), n_steps + 1).round().astype(int)
    sums: dict[str, float] = defaultdict(float)
    done = 0
    for lo, hi in zip(bounds[:-1], bounds[1:]):
        m = optimizer_step(samples[lo:hi])
        if m is not None:
            done += 1
            for k, v in m.items():
                sums[k] += v
    seconds = time.perf_counter() - t0
    tokens = sum_over_ranks([sum(len(s.tokens) for s in samples), sum(sum(s.loss_mask) for s in samples)])
    metrics = {k: v / max(done, 1) for k, v in sums.items()}
    metrics.update(
        lr=lr,
        train_tokens=tokens[1],
        train_seconds=seconds,
        tokens_per_s=tokens[0] / max(seconds, 1e-9),
        steps=float(done),
    )
    return metrics
