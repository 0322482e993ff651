"""The rollout side of a run: each step's finished, shaped groups, ready for a recipe to train on.

A collector's ``collect(step, version)`` returns a :class:`Batch`. :class:`EpisodeCollector` (RL) draws task rows,
runs ``n_samples_per_prompt`` episodes each (in this process or on rollout workers), shapes their rewards (a group
reward function, the overlong penalty, one outcome shared by an episode's segments) and keeps the groups the dynamic
sampling filter passes; at the step that trains them, its ``filter_samples`` lets ``--rollout-sample-filter-path``
mark samples to leave out of the loss.
:class:`DemoCollector` (SFT) hands out the next ``--global-batch-size`` demonstrations. Both keep the data cursor a
checkpoint saves (``state_dict`` / ``load_state_dict``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from agentrl.config import RunConfig
from agentrl.rollout.episode import EpisodeContext
from agentrl.rollout.generate import generate_rollout
from agentrl.rollout.reward import apply_group_reward, apply_overlong_penalty, share_outcome, train_reward
from agentrl.runtime.buffer import BufferedSource, Group, PromptSource
from agentrl.types import Sample, Status, episode_units

log = logging.getLogger(__name__)

__all__ = ["Batch", "DemoCollector", "EpisodeCollector", "by_role"]


@dataclass
class Batch:
    """One step's groups plus what happened while collecting them."""

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


class EpisodeCollector:
    """An RL run's rollout side: generated, shaped and filtered groups for each step (see the module).

    ``source`` is a data source (optionally a :class:`~agentrl.runtime.buffer.BufferedSource`); ``workers`` a
    :class:`~agentrl.runtime.rollout_workers.RolloutWorkerGroup` that runs the episodes in Ray actors (None: here).
    ``custom_reward`` scores each sample (or, with ``--group-rm``, each group once its episodes are done).
    """

    def __init__(
        self,
        cfg: RunConfig,
        *,
        ctx: EpisodeContext,
        env_factory: Any,
        source: Any,
        args: Any = None,
        custom_generate: Any = None,
        custom_reward: Any = None,
        group_filter: Any = None,
        sample_filter: Any = None,
        workers: Any = None,
    ):
        self.cfg = cfg
        self.ctx = ctx
        self.env_factory = env_factory
        self.source = source
        self.args = args
        self.custom_generate = custom_generate
        self.custom_reward = custom_reward
        self.group_filter = group_filter
        self.sample_filter = sample_filter  # slime's --rollout-sample-filter-path: sets Sample.remove_sample
        self.workers = workers

    async def collect(self, step: int, version: Callable[[], int]) -> Batch:
        """``rollout_batch_size`` groups for ``step``: buffered groups first (if a buffer is configured), then new
        task rows generated with the current weights; with dynamic sampling, rejected groups are dropped and more
        prompts generated. ``version`` is called for the engines' weight version when the buffer is read (an
        ``--async`` collection runs while the step before trains)."""
        cfg, need = self.cfg, self.cfg.rollout_batch_size
        t0 = time.monotonic()
        counts = {"dropped_filter": 0, "buffer_reused": 0, "dynamic_rounds": 0}
        groups: list[Group] = []
        if isinstance(self.source, BufferedSource):
            groups = self.source.take_buffered(need, version())
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
        """The rows' groups, generated and shaped (group reward, overlong penalty, one outcome per episode)."""
        rc = self.ctx.config
        seed = rc.rollout_seed + 1_000_003 * step + 7_919 * round_
        ctx = dataclasses.replace(self.ctx, config=dataclasses.replace(rc, rollout_seed=seed))
        group_rm = self.cfg.group_rm and self.custom_reward is not None
        base = step * 1_000_000 + round_ * 10_000  # group indices unique across rounds and steps
        if self.workers is not None:  # one group per call, on the workers' own event loops and nodes
            samples = [s for group in await self.workers.run_groups(rows, seed, base) for s in group]
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
                            s.reward = train_reward(s) + s.metadata["overlong_penalty"]
            if group_rm:
                for unit in units:
                    share_outcome(unit)
            groups.append(members)
        return groups

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

    async def health(self) -> dict[str, int]:
        """What the metrics line reports about the episodes' machinery: hung env threads, worker counts."""
        hung = getattr(self.ctx.executor, "hung", 0)
        if self.workers is None:
            return {"hung_threads": hung}
        return {"hung_threads": hung + await asyncio.to_thread(self.workers.hung_threads), **self.workers.counts()}

    def state_dict(self) -> Any:
        return self.source.state_dict() if hasattr(self.source, "state_dict") else None

    def load_state_dict(self, state: Any) -> None:
        if state is not None and hasattr(self.source, "load_state_dict"):
            self.source.load_state_dict(state)


class DemoCollector:
    """A warm start's rollout side: the next ``--global-batch-size`` demonstrations, one group each."""

    def __init__(self, cfg: RunConfig, demos: list[Sample]):
        self.demos = demos
        self.batch_size = cfg.train.global_batch_size
        self.source = PromptSource(
            [{"demo": i} for i in range(len(demos))], shuffle=cfg.shuffle_prompts, seed=cfg.train.seed
        )

    async def collect(self, step: int, version: Callable[[], int]) -> Batch:
        """The next demonstrations, in the seeded epoch order."""
        picked = [self.demos[r["demo"]] for r in self.source.get_samples(self.batch_size)]
        return Batch([[s] for s in picked], 0.0)

    def filter_samples(self, groups: list[Group]) -> None:
        """Demonstrations train as given."""

    async def health(self) -> dict[str, int]:
        return {}

    def state_dict(self) -> Any:
        return self.source.state_dict()

    def load_state_dict(self, state: Any) -> None:
        if state is not None:
            self.source.load_state_dict(state)
