"""Recipes: what one update does with a step's samples, the train side of a run.

The loop (:class:`~agentrl.runtime.loop.TrainLoop`) orders the phases; a recipe fills in the train side's:

- ``select``: which samples train (RL: completed or truncated, token-exact, not stale, of a trained role, an even
  split over the ranks; SFT: every demonstration);
- ``update``: the step itself. :class:`PolicyGradient` (the GRPO family: grpo, gspo, rloo, reinforce++, ...) asks
  the trainer for old/reference log-probs when a term needs them, computes per-token advantages
  (:mod:`agentrl.algo.advantages`) and runs ``train_step``. :class:`PPO` adds the critic: its values beside the
  log-probs, GAE advantages and returns, its own ``train_step`` beside the actor's (alone for the first
  ``--num-critic-only-steps``). :class:`SFT` trains on demonstrations, no advantages;
- when the engines get the new weights (``push_due``) and what the step's metrics line says (``line``);
- what a checkpoint holds (``save`` / ``load``: the actor, and the critic for PPO).

:func:`recipe_for` picks the recipe a configuration asks for.
"""

from __future__ import annotations

import asyncio
import math
from typing import Any

import torch

from agentrl.algo.advantages import compute_advantages, masked_whiten, ppo_advantages
from agentrl.algo.loss import kl_penalty
from agentrl.config import RunConfig
from agentrl.metrics import step_metrics
from agentrl.rollout.reward import cut_by_length, train_reward
from agentrl.runtime import run_folder
from agentrl.runtime.buffer import staleness
from agentrl.runtime.collect import Batch
from agentrl.runtime.sft import sft_steps
from agentrl.trainer.base import TrainSample
from agentrl.types import Sample, Status

__all__ = ["PPO", "SFT", "PolicyGradient", "Recipe", "is_trainable", "recipe_for", "value_fit"]


def is_trainable(s: Sample, *, allow_non_token_exact: bool = False) -> bool:
    """Completed or truncated, token-exact (unless allowed), with at least one sampled token."""
    return (
        s.status in (Status.COMPLETED, Status.TRUNCATED)
        and (s.token_exact or allow_non_token_exact)
        and s.response_length > 0
        and bool(s.loss_mask)
        and sum(s.loss_mask or ()) > 0
        and s.rollout_log_probs is not None
    )


def value_fit(batch: list[TrainSample]) -> dict[str, float]:
    """How well the critic's values (before this step's update) predicted the returns, over the trained tokens.

    ``returns_mean``, ``returns_std``, and ``critic/explained_variance`` = 1 - Var(R - V) / Var(R) (1: perfect, 0: no
    better than a constant, < 0: worse), the usual PPO diagnostic; it does not grow with the reward's
    scale as the value loss does.
    """
    pairs = [(r, v) for b in batch for r, v, m in zip(b.returns or [], b.values or [], b.loss_mask) if m]
    if not pairs:
        return {}
    rets = torch.tensor([r for r, _ in pairs], dtype=torch.float64)
    vals = torch.tensor([v for _, v in pairs], dtype=torch.float64)
    var = float(rets.var(unbiased=False))
    out = {"returns_mean": float(rets.mean()), "returns_std": var**0.5}
    if var > 0:  # returns that never vary (every reward and value alike) have no variance to explain
        out["critic/explained_variance"] = 1.0 - float((rets - vals).var(unbiased=False)) / var
    return out


class Recipe:
    """What the loop asks of the train side each step (:class:`PolicyGradient`, :class:`PPO`, :class:`SFT` fill it in).

    ``trainers`` is a :class:`~agentrl.runtime.trainer_group.TrainerGroup` (or anything with its methods). A
    checkpoint holds the actor (``save`` / ``load``); a recipe with more to keep (PPO's critic) adds it.
    """

    dumps_rollouts = True  # --dump-rollouts writes each step's samples
    eval_at_end = False  # evaluated at --eval-interval steps only
    push_on_resume = True  # a resumed run's engines get the checkpoint's weights at once
    critic: Any = None

    def __init__(self, cfg: RunConfig, trainers: Any):
        self.cfg = cfg
        self.trainers = trainers

    def select(self, batch: Batch, counts: dict[str, int], version: int) -> list[Sample]:
        """The samples this step trains on; each one left out is counted in ``counts`` by reason."""
        raise NotImplementedError

    async def update(self, samples: list[Sample], step: int = 0) -> tuple[dict[str, float], list[list[float]]]:
        """One step on ``samples``: the update's metrics and each sample's per-token advantages (or none)."""
        raise NotImplementedError

    def moves_policy(self, step: int) -> bool:
        """Whether this step changed the policy's weights (and so the engines need them)."""
        return True

    def push_due(self, step: int, evaluating: bool) -> bool:
        """Whether the engines get the new weights after ``step`` (``evaluating``: an evaluation follows)."""
        raise NotImplementedError

    def line(self, step: int, batch: Batch, train_metrics: dict[str, float], extra: dict[str, Any]) -> dict[str, Any]:
        """The step's metrics line."""
        raise NotImplementedError

    # -- checkpoints

    def loop_state(self) -> dict[str, Any]:
        """What this recipe adds to a checkpoint's ``loop_state.json``."""
        return {}

    def save(self, folder: Any, state: dict[str, Any]) -> None:
        self.trainers.save(str(folder), extra_state={"loop": state})

    def load(self, folder: Any) -> None:
        self.trainers.load(str(folder))


class PolicyGradient(Recipe):
    """The GRPO family: group-relative (or batch) advantages from sequence or per-turn rewards; no critic."""

    def __init__(self, cfg: RunConfig, trainers: Any):
        if cfg.is_sft or (cfg.train.advantage_estimator == "ppo") != isinstance(self, PPO):
            raise ValueError(
                f"--loss-type {cfg.train.loss_type} --advantage-estimator {cfg.train.advantage_estimator} is not "
                f"{type(self).__name__}'s: build the recipe with recipe_for(cfg, ...)"
            )
        if cfg.train.num_steps_per_rollout is None and cfg.steps_per_rollout != 1:  # the trainers would make one
            raise ValueError(
                f"num_steps_per_rollout is unset and this run makes {cfg.steps_per_rollout} optimizer steps per "
                "rollout: pass the configuration preflight() resolved (or set it)"
            )
        super().__init__(cfg, trainers)

    # -- select

    def select(self, batch: Batch, counts: dict[str, int], version: int) -> list[Sample]:
        """The samples this step trains on; each one left out is counted in ``counts`` by reason."""
        keep = []
        counts.setdefault("dropped_stale", 0)
        counts.setdefault("dropped_untrainable", 0)
        counts.setdefault("dropped_fixed_role", 0)
        for s in batch.samples:
            if not s.trained:  # a role played by a fixed policy (--role-engine-url)
                counts["dropped_fixed_role"] += 1
            elif not is_trainable(s, allow_non_token_exact=self.cfg.allow_non_token_exact):
                counts["dropped_untrainable"] += 1
            elif staleness([s], version) > self.cfg.staleness_limit:
                counts["dropped_stale"] += 1
            else:
                keep.append(s)
        # every optimizer step's global batch must split evenly over the trainer ranks
        unit = self.cfg.trainer_world_size * self.cfg.steps_per_rollout
        counts["dropped_uneven"] = len(keep) % unit
        if counts["dropped_uneven"]:
            keep = keep[: len(keep) - counts["dropped_uneven"]]
        if self.cfg.mask_truncated_samples:
            counts["masked_truncated"] = sum(cut_by_length(s) for s in keep)
        return keep

    def masked(self, s: Sample) -> bool:
        """Whether ``s`` keeps its place in its group (its reward is in the baseline) but trains no token:
        removed by a filter, or cut by a length limit under ``--mask-truncated-samples``."""
        return s.remove_sample or (self.cfg.mask_truncated_samples and cut_by_length(s))

    # -- update

    def needs_log_probs(self) -> tuple[bool, bool]:
        """(old, ref): whether this configuration needs them before the update."""
        t = self.cfg.train
        ref = t.needs_ref_model
        old = ref or t.use_tis or self.cfg.steps_per_rollout > 1 or t.loss_type == "custom_loss"
        old = old or self.cfg.true_on_policy_mode
        return old, ref

    def _kl(self, batch: list[TrainSample]) -> list[torch.Tensor] | None:
        """The reward's KL per sample (--kl-loss-type's estimator, as slime's compute_approx_kl), when both
        log-probs are there."""
        if batch and batch[0].ref_log_probs is not None and batch[0].old_log_probs is not None:
            t = self.cfg.train
            return [
                kl_penalty(torch.tensor(b.old_log_probs), torch.tensor(b.ref_log_probs), t.kl_loss_type) for b in batch
            ]
        return None

    def advantages(self, samples: list[Sample], batch: list[TrainSample]) -> None:
        """Fill ``advantages`` on ``batch`` (aligned with ``samples``); each ``--policy``'s samples apart
        (REINFORCE++ whitens over its whole batch: one policy's rewards must not shift another's)."""
        advs: list[torch.Tensor] = [torch.zeros(0)] * len(samples)
        for idx in _by_policy([s.policy for s in samples]):
            for i, a in zip(
                idx, self._whiten(batch, idx, self._advantages([samples[i] for i in idx], [batch[i] for i in idx]))
            ):
                advs[i] = a
        _write_advantages(batch, advs)

    def _advantages(self, samples: list[Sample], batch: list[TrainSample]) -> list[torch.Tensor]:
        """One policy's advantages. Segments of one episode (a history rewrite) share its id; a sample without one
        is its own episode; the roles of a multi-role episode are separate sequences, grouped and normalised per
        (task group, policy, role)."""
        t = self.cfg.train
        per_turn = t.per_turn_credit
        group_keys = [(int(s.group_index or 0), s.policy or "", s.role or "") for s in samples]
        numbered = {key: i for i, key in enumerate(dict.fromkeys(group_keys))}
        return compute_advantages(
            t.advantage_estimator,
            rewards=torch.tensor([train_reward(s) for s in samples]),
            group_ids=[numbered[key] for key in group_keys],
            # the masks the trainer uses: a removed sample's tokens stay out of batch-wide whitening too (as slime)
            loss_masks=[torch.tensor(b.loss_mask, dtype=torch.float32) for b in batch],
            turn_rewards=[list(s.turn_rewards) for s in samples] if per_turn else None,
            turn_spans=[list(s.turn_spans) for s in samples] if per_turn else None,
            kl=self._kl(batch),
            gamma=t.gamma,
            kl_coef=t.kl_coef,
            std_normalize=not t.disable_grpo_std_normalization,
            per_turn=per_turn,
            episode_ids=[s.episode_key for s in samples],
        )

    def _whiten(self, batch: list[TrainSample], idx: list[int], advs: list[torch.Tensor]) -> list[torch.Tensor]:
        """slime's ``--normalize-advantages``: whiten one policy's advantages (``advs``, for ``batch[i]`` of ``idx``)
        over its trained tokens (one policy's scale is not another's); unchanged without the flag."""
        if not self.cfg.train.normalize_advantages:
            return advs
        return masked_whiten(advs, [torch.tensor(batch[i].loss_mask, dtype=torch.float32) for i in idx])

    def records(self, samples: list[Sample]) -> list[TrainSample]:
        """The trainer's records of ``samples`` (a masked sample keeps its tokens and trains none)."""
        return [
            TrainSample(
                tokens=list(s.tokens),
                response_length=s.response_length,
                loss_mask=[0] * s.response_length if self.masked(s) else list(s.loss_mask or []),
                rollout_log_probs=list(s.rollout_log_probs or []),
                train_metadata=s.train_metadata,
                multimodal_inputs=s.multimodal_inputs,
                multimodal_train_inputs=s.multimodal_train_inputs,
                policy=s.policy if self.cfg.train.policy else None,
            )
            for s in samples
        ]

    async def update(self, samples: list[Sample], step: int = 0) -> tuple[dict[str, float], list[list[float]]]:
        """One update on ``samples``: its metrics and each sample's advantages (for the rollout dump)."""
        batch = self.records(samples)
        if not batch:
            return {}, []
        need_old, need_ref = self.needs_log_probs()
        # the critic (its own actors) scores the batch while the actor computes its log-probs
        values = asyncio.create_task(asyncio.to_thread(self.critic.compute_values, batch)) if self.critic else None
        try:
            if need_old:
                lp = await asyncio.to_thread(self.trainers.compute_log_probs, batch, ref=need_ref)
                for b, old in zip(batch, lp.old):
                    b.old_log_probs = old
                if lp.ref is not None:
                    for b, ref in zip(batch, lp.ref):
                        b.ref_log_probs = ref
        finally:
            if values is not None:
                await asyncio.wait({values})  # never leave the critic's call behind a failed actor call
                critic_error = values.exception()  # (retrieved here, so a double failure logs no stray warning)
        if values is not None:
            if critic_error is not None:
                raise RuntimeError(
                    f"ppo step {step}: the critic's values failed: {type(critic_error).__name__}: {critic_error}"
                ) from critic_error
            for b, v in zip(batch, values.result()):
                b.values = v
        checked = self.check_on_policy(batch) if self.cfg.true_on_policy_mode else {}
        self.advantages(samples, batch)
        metrics = await self._train_step(batch, step)
        return {**metrics, **checked}, [b.advantages for b in batch]

    async def _train_step(self, batch: list[TrainSample], step: int) -> dict[str, float]:
        return await asyncio.to_thread(self.trainers.train_step, batch)

    def check_on_policy(self, batch: list[TrainSample]) -> dict[str, float]:
        """``--true-on-policy-mode``: the trainer's log-probs of the sampled tokens against the engine's.

        Fails the step (before any update) when the largest gap exceeds ``--true-on-policy-tolerance``:
        the run asked for exact on-policy training, and training anyway would silently not be it.
        """
        gaps = [
            abs(o - r)
            for b in batch
            for o, r, m in zip(b.old_log_probs or [], b.rollout_log_probs or [], b.loss_mask)
            if m
        ]
        if not gaps:
            return {}
        worst, mean = max(gaps), sum(gaps) / len(gaps)
        tol = self.cfg.true_on_policy_tolerance
        if worst > tol:
            raise RuntimeError(
                f"--true-on-policy-mode: the trainer's log-probs differ from the engine's by up to {worst:.3g} "
                f"(mean {mean:.3g}) over {len(gaps)} sampled tokens, above --true-on-policy-tolerance {tol:g}: "
                "the engine and trainer do not compute the same policy (precision, kernels, or a stale engine); "
                "match their dtypes, or raise the tolerance"
            )
        return {"true_on_policy_logprob_diff_max": worst, "true_on_policy_logprob_diff_mean": mean}

    # -- after the update

    def push_due(self, step: int, evaluating: bool) -> bool:
        """Push after every ``--update-weights-interval`` steps and after the last."""
        return (step + 1) % self.cfg.update_weights_interval == 0 or step + 1 == self.cfg.num_rollout

    def line(self, step: int, batch: Batch, train_metrics: dict[str, float], extra: dict[str, Any]) -> dict[str, Any]:
        """The step's metrics line: the episodes' rewards and lengths, the update's metrics, ``extra``."""
        return step_metrics(batch.samples, rollout_seconds=batch.seconds, train_metrics=train_metrics, extra=extra)


class PPO(PolicyGradient):
    """PPO: a critic (its own trainer group, ``role="critic"``) beside the actor; GAE advantages and returns."""

    def __init__(self, cfg: RunConfig, trainers: Any, critic: Any):
        super().__init__(cfg, trainers)
        self.critic = critic

    def advantages(self, samples: list[Sample], batch: list[TrainSample]) -> None:
        t = self.cfg.train
        episode_ids = [s.episode_key for s in samples]
        if len(set(episode_ids)) < len(episode_ids):
            raise ValueError(
                "--advantage-estimator ppo bootstraps values along one token sequence: episodes split into "
                "segments (a history rewrite, --history-mode template) need a sequence-level estimator (grpo, rloo, "
                "reinforce_plus_plus_baseline)"
            )
        advs, returns = ppo_advantages(
            torch.tensor([train_reward(s) for s in samples]),
            [torch.tensor(b.loss_mask, dtype=torch.float32) for b in batch],
            [torch.tensor(b.values) for b in batch],
            turn_rewards=[list(s.turn_rewards) for s in samples],
            turn_spans=[list(s.turn_spans) for s in samples],
            kl=self._kl(batch),
            kl_coef=t.kl_coef,
            gamma=t.gamma,
            lambd=t.lambd,
        )
        for b, r in zip(batch, returns):
            b.returns = [float(x) for x in r]
        advs = list(advs)
        for idx in _by_policy([b.policy for b in batch]):
            for i, a in zip(idx, self._whiten(batch, idx, [advs[i] for i in idx])):
                advs[i] = a
        _write_advantages(batch, advs)

    async def _train_step(self, batch: list[TrainSample], step: int) -> dict[str, float]:
        # actor and critic step together on their own actors; a failure of either fails the step
        critic_only = not self.moves_policy(step)
        jobs = [asyncio.to_thread(self.critic.train_step, batch)]
        if not critic_only:
            jobs.append(asyncio.to_thread(self.trainers.train_step, batch))
        results = await asyncio.gather(*jobs, return_exceptions=True)
        for who, r in zip(("critic", "actor"), results):
            if isinstance(r, BaseException):
                raise RuntimeError(f"ppo step {step}: the {who}'s train step failed: {type(r).__name__}: {r}") from r
        critic_metrics = {f"critic/{k}": v for k, v in dict(results[0]).items()}  # type: ignore[arg-type]
        metrics = dict(results[1]) if not critic_only else {}  # type: ignore[arg-type]
        return {**metrics, **critic_metrics, "critic_only_step": float(critic_only), **value_fit(batch)}

    def moves_policy(self, step: int) -> bool:
        """The first ``--num-critic-only-steps`` train the critic alone: the policy (and the engines) stay."""
        return step >= self.cfg.train.num_critic_only_steps

    def save(self, folder: Any, state: dict[str, Any]) -> None:
        super().save(folder, state)
        self.critic.save(str(folder / run_folder.CRITIC_DIR), extra_state={"loop": state})

    def load(self, folder: Any) -> None:
        super().load(folder)
        self.critic.load(str(folder / run_folder.CRITIC_DIR))


class SFT(Recipe):
    """A warm start: the masked negative log-likelihood of demonstrations (``--loss-type sft_loss``).

    The engines serve the starting checkpoint until an evaluation needs the new weights: a push happens only
    before one (``--eval-interval`` steps, and after the last step when eval sets are given).
    """

    dumps_rollouts = False
    eval_at_end = True
    push_on_resume = False

    def __init__(self, cfg: RunConfig, trainers: Any, n_demos: int):
        if not cfg.is_sft:
            raise ValueError(f"SFT trains with --loss-type sft_loss, not {cfg.train.loss_type}")
        if cfg.num_rollout is None:
            raise ValueError(
                "the run's length (num_rollout) is not derived yet: pass the configuration preflight() resolved"
            )
        if cfg.num_rollout != sft_steps(cfg, n_demos):  # the preflight derives it; a hand-built loop must agree
            raise ValueError(
                f"--num-rollout {cfg.num_rollout} is not this warm start's length ({sft_steps(cfg, n_demos)} steps "
                f"for {n_demos} demonstrations): pass the configuration preflight() resolved"
            )
        super().__init__(cfg, trainers)
        self.per_epoch = math.ceil(n_demos / cfg.train.global_batch_size)

    def select(self, batch: Batch, counts: dict[str, int], version: int) -> list[Sample]:
        return batch.samples

    async def update(self, samples: list[Sample], step: int = 0) -> tuple[dict[str, float], list[list[float]]]:
        batch = [
            TrainSample(
                tokens=list(s.tokens),
                response_length=s.response_length,
                loss_mask=list(s.loss_mask or []),
                advantages=[0.0] * s.response_length,  # unused by the SFT loss
                multimodal_inputs=s.multimodal_inputs,
                multimodal_train_inputs=s.multimodal_train_inputs,
            )
            for s in samples
        ]
        return await asyncio.to_thread(self.trainers.train_step, batch), []

    def push_due(self, step: int, evaluating: bool) -> bool:
        return evaluating

    def line(self, step: int, batch: Batch, train_metrics: dict[str, float], extra: dict[str, Any]) -> dict[str, Any]:
        """The step's metrics line: the update's metrics, the epoch it reached (fractional), ``extra`` (less the
        weight push's keys: the engines serve the starting checkpoint until an evaluation)."""
        kept = {k: v for k, v in extra.items() if k not in ("weight_version", "weight_sync_seconds")}
        return {**train_metrics, "epoch": (step + 1) / self.per_epoch, **kept}

    def loop_state(self) -> dict[str, Any]:
        return {"loss_type": "sft_loss"}


def recipe_for(cfg: RunConfig, trainers: Any, *, critic: Any = None, n_demos: int | None = None) -> Recipe:
    """The recipe ``cfg`` asks for: SFT for ``--loss-type sft_loss``, PPO for ``--advantage-estimator ppo``, else
    the GRPO family."""
    if cfg.is_sft:
        if n_demos is None:
            raise ValueError("a warm start (--loss-type sft_loss) trains on demonstrations: pass n_demos")
        return SFT(cfg, trainers, n_demos)
    if (cfg.train.advantage_estimator == "ppo") != (critic is not None):
        raise ValueError("--advantage-estimator ppo trains a critic beside the actor: pass critic= (and only then)")
    if critic is not None:
        return PPO(cfg, trainers, critic)
    return PolicyGradient(cfg, trainers)


def _by_policy(policies: list[str | None]) -> list[list[int]]:
    """The positions of each policy's items (in first-seen order): what is computed per ``--policy`` apart."""
    groups: dict[str | None, list[int]] = {}
    for i, p in enumerate(policies):
        groups.setdefault(p, []).append(i)
    return list(groups.values())


def _write_advantages(batch: list[TrainSample], advs: list[torch.Tensor]) -> None:
    for b, a in zip(batch, advs):
        b.advantages = [float(x) for x in a]
