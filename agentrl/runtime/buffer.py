"""The data buffer: where each rollout's prompts come from, and where unused samples wait.

slime's Data Buffer, with the same two user hooks:

- a **data source** hands out task rows (``get_samples(num_samples)``) and is told what was
  generated (``add_samples(groups)``). :class:`PromptSource` reads a task list in a seeded,
  epoch-shuffled order whose cursor is checkpointed, so a resumed run sees the same prompts.
  ``--data-source-path module:Class`` replaces it (constructed as ``Class(args)``; optional
  ``state_dict``/``load_state_dict`` make it resumable).
- a **buffered source** (:class:`BufferedSource`) keeps generated groups that a step did not use
  (over-sampling surplus, groups generated ahead in async mode) for off-policy reuse; the next step
  takes from the buffer first, in the order ``--buffer-filter-path`` (slime's
  ``buffer_filter(args, buffer, num_samples)``) chooses. Groups whose episodes were aborted mid-way
  come back as their task rows and are generated again from the start (an env's state lives in the
  episode's coroutine, which has ended). With ``--partial-rollout`` a turn aborted by a weight push
  does not end its episode: the episode keeps its tokens and continues the turn on the new weights
  (:func:`agentrl.rollout.episode.run_episode`), so only engine failures send tasks back here.
- **dynamic sampling** (``--dynamic-sampling-filter-path``, slime's filter signature
  ``fn(args, samples) -> bool``): a group the filter rejects is dropped and more prompts are
  generated to refill the batch. :func:`check_reward_nonzero_std` is DAPO's filter: a group whose
  rewards are all equal has zero GRPO advantage and teaches nothing.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from typing import Any, Protocol, runtime_checkable

from agentrl.types import Sample, Status

Group = list[Sample]
BufferFilter = Callable[[Any, list[Group], int], list[Group]]
GroupFilter = Callable[[Any, list[Sample]], Any]


@runtime_checkable
class DataSource(Protocol):
    """What the train loop needs from a prompt source (slime's ``RolloutDataSource``)."""

    def get_samples(self, num_samples: int) -> list[dict[str, Any]]:
        """The next ``num_samples`` task rows (each becomes ``n_samples_per_prompt`` episodes)."""

    def add_samples(self, samples: list[Group]) -> None:
        """Called with the groups a rollout generated but the step did not train on."""


def check_reward_nonzero_std(args: Any, samples: list[Sample], **kwargs: Any) -> bool:
    """Keep a group only if its rewards differ (DAPO's dynamic-sampling filter)."""
    rewards = [float(s.reward or 0.0) for s in samples if not isinstance(s.reward, dict)]
    return len(rewards) > 1 and max(rewards) - min(rewards) > 1e-8


class PromptSource:
    """Task rows in a seeded order: each epoch is a fresh shuffle; the cursor is checkpointed."""

    def __init__(self, rows: Sequence[dict[str, Any]], *, shuffle: bool = True, seed: int = 0):
        if not rows:
            raise ValueError("the prompt data is empty: pass --prompt-data with at least one row")
        self.rows = list(rows)
        self.shuffle = shuffle
        self.seed = seed
        self.epoch = 0
        self.offset = 0
        self._order = self._epoch_order(0)

    def _epoch_order(self, epoch: int) -> list[int]:
        order = list(range(len(self.rows)))
        if self.shuffle:
            random.Random(self.seed * 1_000_003 + epoch).shuffle(order)
        return order

    def get_samples(self, num_samples: int) -> list[dict[str, Any]]:
        out = []
        while len(out) < num_samples:
            if self.offset >= len(self._order):
                self.epoch += 1
                self.offset = 0
                self._order = self._epoch_order(self.epoch)
            out.append(dict(self.rows[self._order[self.offset]]))
            self.offset += 1
        return out

    def add_samples(self, samples: list[Group]) -> None:
        """A plain prompt source keeps nothing."""

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "offset": self.offset, "seed": self.seed, "num_rows": len(self.rows)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("num_rows") not in (None, len(self.rows)):
            raise ValueError(
                f"the checkpoint's prompt data had {state['num_rows']} rows, this run's has "
                f"{len(self.rows)}: resume with the same --prompt-data"
            )
        self.seed = int(state.get("seed", self.seed))
        self.epoch = int(state["epoch"])
        self.offset = int(state["offset"])
        self._order = self._epoch_order(self.epoch)


def fifo_buffer_filter(args: Any, buffer: list[Group], num_samples: int) -> list[Group]:
    """The default: the oldest groups first."""
    return buffer[:num_samples]


class BufferedSource:
    """A data source plus a buffer of generated groups reused before new prompts are drawn.

    ``max_staleness`` bounds off-policy reuse: a buffered group whose oldest weight version is more
    than that many updates behind the current policy is dropped when taken (and counted).
    """

    def __init__(
        self,
        source: Any,
        *,
        buffer_filter: BufferFilter | None = None,
        args: Any = None,
        max_staleness: int | None = None,
    ):
        self.source = source
        self.buffer: list[Group] = []
        self.retry: list[dict[str, Any]] = []
        self.buffer_filter = buffer_filter or fifo_buffer_filter
        self.args = args
        self.max_staleness = max_staleness
        self.dropped_stale = 0

    def get_samples(self, num_samples: int) -> list[dict[str, Any]]:
        """Task rows: first those whose episodes were cut short (partial rollouts), then new ones."""
        rows, self.retry = self.retry[:num_samples], self.retry[num_samples:]
        if len(rows) < num_samples:
            rows += self.source.get_samples(num_samples - len(rows))
        return rows

    def add_samples(self, samples: list[Group]) -> None:
        """Keep finished groups for reuse; send aborted ones back as tasks to run again."""
        for group in samples:
            if any(s.status == Status.ABORTED for s in group):
                task = group[0].metadata.get("task")
                if task is not None:
                    self.retry.append(dict(task))
            else:
                self.buffer.append(group)
        if hasattr(self.source, "add_samples"):
            self.source.add_samples(samples)

    def take_buffered(self, num_groups: int, current_version: int) -> list[Group]:
        """Up to ``num_groups`` groups chosen by the buffer filter, fresh enough to train on."""
        if not self.buffer or num_groups <= 0:
            return []
        chosen = self.buffer_filter(self.args, list(self.buffer), num_groups)[:num_groups]
        ids = {id(g) for g in chosen}
        self.buffer = [g for g in self.buffer if id(g) not in ids]
        fresh = []
        for g in chosen:
            if self.max_staleness is not None and staleness(g, current_version) > self.max_staleness:
                self.dropped_stale += 1
            else:
                fresh.append(g)
        return fresh

    def state_dict(self) -> dict[str, Any]:
        inner = self.source.state_dict() if hasattr(self.source, "state_dict") else None
        return {
            "source": inner,
            "retry": self.retry,
            "buffer": [[s.to_dict() for s in g] for g in self.buffer],
            "dropped_stale": self.dropped_stale,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("source") is not None and hasattr(self.source, "load_state_dict"):
            self.source.load_state_dict(state["source"])
        self.retry = list(state.get("retry", []))
        self.buffer = [[Sample.from_dict(d) for d in g] for g in state.get("buffer", [])]
        self.dropped_stale = int(state.get("dropped_stale", 0))


def staleness(group: Group, current_version: int) -> int:
    """How many policy updates behind ``current_version`` the group's oldest turn was sampled."""
    # an engine still on the checkpoint it started with reports a name ("default"): version 0
    versions = [int(v) if str(v).isdigit() else 0 for s in group for v in s.weight_versions]
    return current_version - min(versions) if versions else 0
