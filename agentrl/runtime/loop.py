"""The train loop: rollout -> advantages -> train step -> weight sync, synchronous or overlapped.

One step (``rollout_id``) of the synchronous loop:

1. draw ``rollout_batch_size`` groups: buffered groups first (if a buffer is configured), then new
   task rows from the data source, generated with the current weights (``n_samples_per_prompt``
   episodes each); with dynamic sampling, rejected groups are dropped and more prompts generated;
2. keep what may be trained on: completed or truncated, token-exact, at least one sampled token,
   not older than ``--max-staleness`` weight versions; everything else is counted in the metrics;
3. old/reference log-probs from the trainer when an algorithm term needs them (and, with
   ``--advantage-estimator ppo``, the critic's values, computed beside them), then per-token
   advantages (``agentrl.algo.advantages``);
4. ``train_step`` on the trainer actors (with ppo the critic's ``train_step`` on its own actors at
   the same time; the first ``--num-critic-only-steps`` train the critic alone); weights go to the
   engines (version += 1);
5. metrics line, rollout dump, checkpoint and eval at their intervals.

``--async`` overlaps step 1 of rollout k+1 with steps 3-4 of rollout k (slime's ``train_async.py``):
the engines keep generating while the trainer works, and take new weights between batches. Each
sample's oldest ``weight_versions`` entry says how stale it is; stale samples are dropped.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import logging
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from agentrl.algo.advantages import compute_advantages, masked_whiten, ppo_advantages
from agentrl.algo.loss import kl_penalty
from agentrl.config import RunConfig
from agentrl.rollout.episode import EpisodeContext
from agentrl.rollout.generate import generate_rollout
from agentrl.rollout.reward import apply_group_reward, apply_overlong_penalty, cut_by_length, share_outcome
from agentrl.runtime import run_folder
from agentrl.runtime.buffer import BufferedSource, Group, staleness
from agentrl.trainer.base import TrainSample
from agentrl.types import Sample, Status, episode_units

log = logging.getLogger(__name__)


@dataclass
class Batch:
    """One rollout's groups plus what happened while collecting them."""

    groups: list[Group]
    seconds: float
    counts: dict[str, int] = field(default_factory=dict)

    @property
    def samples(self) -> list[Sample]:
        return [s for g in self.groups for s in g]


def by_role(group: list[Sample]) -> list[list[Sample]]:
    """A group's trained samples split by role (one list for a single-agent env): what its advantages see."""
    roles: dict[Any, list[Sample]] = {}
    for s in group:
        if s.trained:
            roles.setdefault(s.role, []).append(s)
    return list(roles.values())


def is_trainable(s: Sample, *, allow_non_token_exact: bool = False) -> bool:
    """Completed or truncated, token-exact (unless allowed), with at least one sampled token."""
    return (
        s.status in (Status.COMPLETED, Status.TRUNCATED)
        and (s.token_exact or allow_non_token_exact)
        and s.response_length > 0
        and bool(s.loss_mask)
        and sum(s.loss_mask) > 0
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


class TrainLoop:
    """Drives a run; every collaborator is passed in so tests can assemble a loop from real parts.

    ``trainers`` is a :class:`~agentrl.runtime.trainer_group.TrainerGroup` (or anything with its
    methods), ``critic`` (ppo only) a second one with ``role="critic"``, ``sync_weights(version)`` pushes the trainer's weights to the engines, ``metrics`` a
    :class:`~agentrl.metrics.MetricsLogger`, ``source`` a data source (optionally a
    :class:`~agentrl.runtime.buffer.BufferedSource`).
    """

    def __init__(
        self,
        cfg: RunConfig,
        *,
        ctx: EpisodeContext,
        env_factory: Any,
        source: Any,
        trainers: Any,
        sync_weights: Callable[[int], Any],
        metrics: Any,
        args: Any = None,
        custom_generate: Any = None,
        custom_reward: Any = None,
        group_filter: Any = None,
        sample_filter: Any = None,
        evaluator: Callable[[int], Any] | None = None,
        engine_memory: Any = None,
        update_guard: Callable[[], Any] | None = None,
        critic: Any = None,
        memory_probe: Callable[[], dict[str, float]] | None = None,
        rollout_workers: Any = None,
    ):
        if (cfg.train.advantage_estimator == "ppo") != (critic is not None):
            raise ValueError("--advantage-estimator ppo trains a critic beside the actor: pass critic= (and only then)")
        self.cfg = cfg
        self.critic = critic
        self.ctx = ctx
        self.env_factory = env_factory
        self.source = source
        self.trainers = trainers
        self.sync_weights = sync_weights
        self.metrics = metrics
        self.args = args
        self.custom_generate = custom_generate
        self.custom_reward = custom_reward
        self.group_filter = group_filter
        self.sample_filter = sample_filter  # slime's --rollout-sample-filter-path: sets Sample.remove_sample
        self.evaluator = evaluator
        self.engine_memory = engine_memory
        # an async context manager factory wrapped around every weight push (launched SGLang servers:
        # pause generation, flush the cache, continue afterwards); None = push directly
        self.update_guard = update_guard
        self.memory_probe = memory_probe  # each step: {"<actor>_peak_rss_mb": MiB} into metrics.jsonl
        # --rollout-num-workers > 1: a RolloutWorkerGroup runs the episodes in Ray actors (None: in this process)
        self.rollout_workers = rollout_workers
        self.version = 0  # number of weight updates the engines have received
        self.start_step = 0
        self.run_dir = Path(cfg.save) if cfg.save else None

    # ------------------------------------------------------------------ rollout

    async def _collect_after(self, previous: asyncio.Task | None, step: int) -> Batch:
        """:meth:`collect` once ``previous`` (the rollout of the step before) has finished, however it ended."""
        if previous is not None:
            await asyncio.wait({previous})
        return await self.collect(step)

    async def collect(self, step: int) -> Batch:
        """``rollout_batch_size`` groups for ``step`` (see the module docstring)."""
        cfg, need = self.cfg, self.cfg.rollout_batch_size
        t0 = time.monotonic()
        counts = {"dropped_filter": 0, "buffer_reused": 0, "dynamic_rounds": 0}
        groups: list[Group] = []
        if isinstance(self.source, BufferedSource):
            groups = self.source.take_buffered(need, self.version)
            counts["buffer_reused"] = len(groups)
        rounds = 0
        while len(groups) < need:
            if rounds >= cfg.max_dynamic_sampling_rounds:
                log.warning(
                    "step %d: only %d/%d groups passed the dynamic sampling filter after %d rounds; training on those",
                    step,
                    len(groups),
                    need,
                    rounds,
                )
                break
            # over-sampling only pays when a filter may reject groups
            per_round = (cfg.over_sampling_batch_size if self.group_filter is not None else None) or need - len(groups)
            rows = self.source.get_samples(per_round)
            new = await self._generate(rows, step, rounds)
            for g in new:
                # a multi-role group is kept when one of its trained roles passes (advantages are per role)
                if self.group_filter is None or any(self.group_filter(self.args, part) for part in by_role(g)):
                    groups.append(g)
                else:
                    counts["dropped_filter"] += 1
            rounds += 1
        counts["dynamic_rounds"] = rounds
        surplus, groups = groups[need:], groups[:need]
        if surplus and hasattr(self.source, "add_samples"):
            self.source.add_samples(surplus)
        return Batch(groups, time.monotonic() - t0, counts)

    async def _generate(self, rows: list[dict[str, Any]], step: int, round_: int) -> list[Group]:
        rc = self.ctx.config
        seed = rc.rollout_seed + 1_000_003 * step + 7_919 * round_
        ctx = dataclasses.replace(self.ctx, config=dataclasses.replace(rc, rollout_seed=seed))
        group_rm = self.cfg.group_rm and self.custom_reward is not None
        base = step * 1_000_000 + round_ * 10_000  # group indices unique across rounds and steps
        if self.rollout_workers is not None:  # one group per call, on the workers' own event loops and nodes
            samples = [s for group in await self.rollout_workers.run_groups(rows, seed, base) for s in group]
        else:
            samples, _ = await generate_rollout(
                ctx,
                self.env_factory,
                rows,
                args=self.args,
                custom_generate=self.custom_generate,
                custom_reward=None if group_rm else self.custom_reward,
                group_base=base,
            )
        by_group: dict[int, Group] = {}
        for s in samples:
            by_group.setdefault(int(s.group_index or 0), []).append(s)
        groups = []
        for _, members in sorted(by_group.items()):
            for s in members:
                s.metadata["rollout_id"] = step
            # an episode in several segments is scored once (its last segment) and every segment gets the result
            units = episode_units(members)
            if group_rm:
                await apply_group_reward(self.custom_reward, self.args, [u[-1] for u in units])
            if self.cfg.overlong_buffer_len is not None:  # before any group filter, which sees the shaped reward
                max_len = rc.rollout_max_response_len
                if max_len is None:  # RunConfig.problems refuses this before the run
                    raise ValueError("--overlong-buffer-len needs --rollout-max-response-len")
                for unit in units:  # the penalty of an episode's longest segment, on each
                    longest = max(unit, key=lambda s: s.response_length)
                    apply_overlong_penalty([longest], max_len, self.cfg.overlong_buffer_len, self.cfg.penalty_factor)
                    for s in unit:
                        if s is not longest and s.status in (Status.COMPLETED, Status.TRUNCATED):
                            s.metadata["overlong_penalty"] = longest.metadata.get("overlong_penalty", 0.0)
                            s.reward = float(s.reward or 0.0) + s.metadata["overlong_penalty"]
            if group_rm:
                for unit in units:
                    share_outcome(unit)
            groups.append(members)
        return groups

    # ------------------------------------------------------------------ train

    def filter_samples(self, groups: list[Group]) -> None:
        """Call ``--rollout-sample-filter-path`` on the step's groups (slime's signature ``fn(args, groups)``).

        The function sets ``remove_sample`` on samples to keep out of the loss and returns None; a
        removed sample still counts in its group's advantage normalization, as in slime.
        """
        if self.sample_filter is not None:
            members = [id(s) for g in groups for s in g]
            try:
                out = self.sample_filter(self.args, groups)
            except Exception as exc:
                raise RuntimeError(f"--rollout-sample-filter-path raised {type(exc).__name__}: {exc}") from exc
            if out is not None:
                raise TypeError(
                    "--rollout-sample-filter-path must set Sample.remove_sample in place and return None, "
                    f"not {type(out).__name__}"
                )
            if [id(s) for g in groups for s in g] != members:
                raise TypeError(
                    "--rollout-sample-filter-path added or dropped samples: set remove_sample instead (groups "
                    "keep every member for the advantages)"
                )
        for g in groups:  # whoever set it (a filter, a custom generate or reward function), it must be a bool
            for s in g:
                if not isinstance(s.remove_sample, bool):
                    raise TypeError(f"sample {s.index}: remove_sample={s.remove_sample!r} is not True or False")

    def trainable(self, samples: list[Sample], counts: dict[str, int]) -> list[Sample]:
        keep = []
        counts.setdefault("dropped_stale", 0)
        counts.setdefault("dropped_untrainable", 0)
        counts.setdefault("dropped_fixed_role", 0)
        for s in samples:
            if not s.trained:  # a role played by a fixed policy (--role-engine-url)
                counts["dropped_fixed_role"] += 1
            elif not is_trainable(s, allow_non_token_exact=self.cfg.allow_non_token_exact):
                counts["dropped_untrainable"] += 1
            elif staleness([s], self.version) > (0 if self.cfg.true_on_policy_mode else self.cfg.max_staleness):
                counts["dropped_stale"] += 1
            else:
                keep.append(s)
        # every optimizer step's global batch must split evenly over the trainer ranks
        unit = self.cfg.trainer_world_size * self.cfg.train.num_steps_per_rollout
        counts["dropped_uneven"] = len(keep) % unit
        if counts["dropped_uneven"]:
            keep = keep[: len(keep) - counts["dropped_uneven"]]
        return keep

    def needs_log_probs(self) -> tuple[bool, bool]:
        """(old, ref): whether this configuration needs them before the update."""
        t = self.cfg.train
        ref = t.needs_ref_model
        old = ref or t.use_tis or t.num_steps_per_rollout > 1 or t.loss_type == "custom_loss"
        old = old or self.cfg.true_on_policy_mode
        return old, ref

    def advantages(self, samples: list[Sample], batch: list[TrainSample]) -> None:
        """Fill ``advantages`` on ``batch`` (aligned with ``samples``)."""
        t = self.cfg.train
        kl = None
        if batch and batch[0].ref_log_probs is not None and batch[0].old_log_probs is not None:
            # the reward's KL uses --kl-loss-type's estimator, as slime's compute_approx_kl does
            kl = [
                kl_penalty(torch.tensor(b.old_log_probs), torch.tensor(b.ref_log_probs), t.kl_loss_type) for b in batch
            ]
        per_turn = t.per_turn_credit
        masks = [torch.tensor(b.loss_mask, dtype=torch.float32) for b in batch]
        # segments of one episode (a history rewrite) share its id; a sample without one is its own episode;
        # the roles of a multi-role episode are separate sequences, grouped and normalised per role
        episode_ids = [s.episode_key for s in samples]
        group_keys = [(int(s.group_index or 0), s.role or "") for s in samples]
        numbered = {key: i for i, key in enumerate(dict.fromkeys(group_keys))}
        group_ids = [numbered[key] for key in group_keys]
        if t.advantage_estimator == "ppo":
            if len(set(episode_ids)) < len(episode_ids):
                raise ValueError(
                    "--advantage-estimator ppo bootstraps values along one token sequence: episodes split into "
                    "segments (a history rewrite, --history-mode template) need a sequence-level estimator (grpo, rloo, "
                    "reinforce_plus_plus_baseline)"
                )
            advs, returns = ppo_advantages(
                torch.tensor([float(s.reward or 0.0) for s in samples]),
                masks,
                [torch.tensor(b.values) for b in batch],
                turn_rewards=[list(s.turn_rewards) for s in samples],
                turn_spans=[list(s.turn_spans) for s in samples],
                kl=kl,
                kl_coef=t.kl_coef,
                gamma=t.gamma,
                lambd=t.lambd,
            )
            for b, r in zip(batch, returns):
                b.returns = [float(x) for x in r]
            self._set_advantages(batch, advs, masks)
            return
        advs = compute_advantages(
            t.advantage_estimator,
            rewards=torch.tensor([float(s.reward or 0.0) for s in samples]),
            group_ids=group_ids,
            # the masks the trainer uses: a removed sample's tokens stay out of batch-wide whitening too (as slime)
            loss_masks=[torch.tensor(b.loss_mask, dtype=torch.float32) for b in batch],
            turn_rewards=[list(s.turn_rewards) for s in samples] if per_turn else None,
            turn_spans=[list(s.turn_spans) for s in samples] if per_turn else None,
            kl=kl,
            gamma=t.gamma,
            kl_coef=t.kl_coef,
            std_normalize=not t.disable_grpo_std_normalization,
            per_turn=per_turn,
            episode_ids=episode_ids,
        )
        self._set_advantages(batch, advs, masks)

    def _set_advantages(self, batch: list[TrainSample], advs: list[torch.Tensor], masks: list[torch.Tensor]) -> None:
        if self.cfg.train.normalize_advantages:  # slime's --normalize-advantages: whiten over the trained tokens
            advs = masked_whiten(advs, masks)
        for b, a in zip(batch, advs):
            b.advantages = [float(x) for x in a]

    def masked(self, s: Sample) -> bool:
        """Whether ``s`` keeps its place in its group (its reward is in the baseline) but trains no token:
        removed by a filter, or cut by a length limit under ``--mask-truncated-samples``."""
        return s.remove_sample or (self.cfg.mask_truncated_samples and cut_by_length(s))

    async def train(self, samples: list[Sample], step: int = 0) -> tuple[dict[str, float], list[list[float]]]:
        batch = [
            TrainSample(
                tokens=list(s.tokens),
                response_length=s.response_length,
                loss_mask=[0] * s.response_length if self.masked(s) else list(s.loss_mask),
                rollout_log_probs=list(s.rollout_log_probs),
                train_metadata=s.train_metadata,
                multimodal_inputs=s.multimodal_inputs,
                multimodal_train_inputs=s.multimodal_train_inputs,
            )
            for s in samples
        ]
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
            exc = critic_error
            if exc is not None:
                raise RuntimeError(f"ppo step {step}: the critic's values failed: {type(exc).__name__}: {exc}") from exc
            for b, v in zip(batch, values.result()):
                b.values = v
        checked = self.check_on_policy(batch) if self.cfg.true_on_policy_mode else {}
        self.advantages(samples, batch)
        if self.critic is None:
            metrics = await asyncio.to_thread(self.trainers.train_step, batch)
            return {**metrics, **checked}, [b.advantages for b in batch]
        # ppo: actor and critic step together on their own actors; a failure of either fails the step
        critic_only = step < self.cfg.train.num_critic_only_steps
        jobs = [asyncio.to_thread(self.critic.train_step, batch)]
        if not critic_only:
            jobs.append(asyncio.to_thread(self.trainers.train_step, batch))
        results = await asyncio.gather(*jobs, return_exceptions=True)
        for who, r in zip(("critic", "actor"), results):
            if isinstance(r, BaseException):
                raise RuntimeError(f"ppo step {step}: the {who}'s train step failed: {type(r).__name__}: {r}") from r
        critic_metrics = {f"critic/{k}": v for k, v in results[0].items()}
        metrics = dict(results[1]) if not critic_only else {}
        extra = {"critic_only_step": float(critic_only), **value_fit(batch)}
        return {**metrics, **critic_metrics, **checked, **extra}, [b.advantages for b in batch]

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

    # ------------------------------------------------------------------ the run

    async def run(self) -> list[dict[str, Any]]:
        """Run steps ``start_step .. num_rollout-1``; return the metric lines written."""
        cfg = self.cfg
        lines: list[dict[str, Any]] = []
        pending: collections.deque[asyncio.Task] = collections.deque()  # rollouts of the next steps, in order
        try:
            for step in range(self.start_step, cfg.num_rollout):
                batch = await pending.popleft() if pending else await self.collect(step)
                if cfg.async_mode:  # keep --async-buffer-size rollouts queued while this step trains
                    nxt = step + 1 + len(pending)
                    while len(pending) < cfg.async_buffer_size and nxt < cfg.num_rollout:
                        # one rollout generates at a time (as slime's rollout manager): --rollout-concurrency
                        # bounds the episodes in flight and prompts are drawn in step order
                        pending.append(asyncio.create_task(self._collect_after(pending[-1] if pending else None, nxt)))
                        nxt += 1
                lines.append(await self.step(step, batch))
        finally:
            for task in pending:  # a failed step must not leave rollouts running against the engines
                if not task.done():
                    task.cancel()
        return lines

    async def step(self, step: int, batch: Batch) -> dict[str, Any]:
        from agentrl.metrics import dump_rollout, step_metrics

        cfg = self.cfg
        counts = dict(batch.counts)
        samples = batch.samples
        self.filter_samples(batch.groups)
        keep = self.trainable(samples, counts)
        if cfg.mask_truncated_samples:
            counts["masked_truncated"] = sum(cut_by_length(s) for s in keep)
        t0 = time.monotonic()
        if self.engine_memory is not None:
            await self.engine_memory.release()
        train_metrics, advs = await self.train(keep, step)
        train_seconds = time.monotonic() - t0
        if self.engine_memory is not None:
            await self.engine_memory.resume()
        actor_trained = self.critic is None or step >= cfg.train.num_critic_only_steps
        self.version += int(actor_trained)  # a critic-only step leaves the policy (and the engines) as they were
        t1 = time.monotonic()
        if actor_trained and ((step + 1) % cfg.update_weights_interval == 0 or step + 1 == cfg.num_rollout):
            async with (self.update_guard or contextlib.nullcontext)():
                await asyncio.to_thread(self.sync_weights, self.version)
        sync_seconds = time.monotonic() - t1
        extra = {
            **counts,
            "weight_version": self.version,
            "train_samples": len(keep),
            "hung_threads": getattr(self.ctx.executor, "hung", 0)
            + (await asyncio.to_thread(self.rollout_workers.hung_threads) if self.rollout_workers is not None else 0),
            **(self.rollout_workers.counts() if self.rollout_workers is not None else {}),
            "weight_sync_seconds": sync_seconds,
            "step_train_seconds": train_seconds,
            **(await asyncio.to_thread(self.memory_probe) if self.memory_probe is not None else {}),
        }
        line = step_metrics(samples, rollout_seconds=batch.seconds, train_metrics=train_metrics, extra=extra)
        if self.run_dir is not None and cfg.dump_rollouts:
            adv_by_id = {id(s): a for s, a in zip(keep, advs)}
            dump_rollout(self.run_dir, step, samples, [adv_by_id.get(id(s)) for s in samples])
        if self.evaluator is not None and cfg.eval_interval and (step + 1) % cfg.eval_interval == 0:
            line.update(await self.evaluator(step))
        self.metrics.log(step, line)
        # with --save the final model is always kept, --save-interval or not
        if self.run_dir is not None and (
            (cfg.save_interval and (step + 1) % cfg.save_interval == 0) or step + 1 == cfg.num_rollout
        ):
            await asyncio.to_thread(self.save, step + 1)
        return line

    # ------------------------------------------------------------------ checkpoints

    def save(self, steps_done: int) -> Path:
        """Write ``iter_<steps_done>`` (model, optimizer, RNG, data cursor) atomically."""
        assert self.run_dir is not None
        tmp = run_folder.begin(self.run_dir, steps_done)
        state = {
            "step": steps_done,
            "weight_version": self.version,
            "data": self.source.state_dict() if hasattr(self.source, "state_dict") else None,
            "python_random": repr(random.getstate()),
        }
        self.trainers.save(str(tmp), extra_state={"loop": state})
        if self.critic is not None:
            self.critic.save(str(tmp / run_folder.CRITIC_DIR), extra_state={"loop": state})
        return run_folder.commit(self.run_dir, steps_done, tmp, state)

    def resume(self, load: str | Path) -> bool:
        """Restore from the newest checkpoint under ``load``; False if there is none yet."""
        path = run_folder.latest_checkpoint(load)
        if path is None:
            return False
        state = run_folder.read_loop_state(path)
        run_folder.check_critic(path, self.critic is not None)
        critic_dir = path / run_folder.CRITIC_DIR
        if self.critic is None and critic_dir.is_dir():
            log.warning("resuming %s without ppo: its critic (%s) is not used", path, critic_dir)
        self.trainers.load(str(path))
        if self.critic is not None:
            self.critic.load(str(critic_dir))
        if state.get("data") is not None and hasattr(self.source, "load_state_dict"):
            self.source.load_state_dict(state["data"])
        self.start_step = int(state["step"])
        self.version = int(state.get("weight_version", self.start_step))
        self.sync_weights(self.version)
        if hasattr(self.metrics, "truncate_after"):
            self.metrics.truncate_after(self.start_step)
        log.warning("resumed from %s at step %d", path, self.start_step)
        return True
