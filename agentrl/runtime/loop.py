"""The train loop: the phases of a step in order, the same for every recipe, synchronous or overlapped.

One step (``rollout_id``):

1. **collect** (the rollout side, :mod:`agentrl.runtime.collect`): finished, shaped groups: generated episodes with
   their rewards shaped and filtered (RL), or the next demonstrations (SFT);
2. **select** and **update** (the recipe, :mod:`agentrl.runtime.recipes`): keep what may be trained on (everything
   else is counted in the metrics), then the update: log-probs, advantages and the train step for the GRPO family;
   the critic beside the actor for PPO; the demonstrations' likelihood for SFT. Colocated engines free their memory
   around it;
3. **push weights** to the engines when the recipe says they are due (version += 1 for each update that moved the
   policy);
4. dump the step's rollouts, **evaluate** at ``--eval-interval`` (its metrics join the line), **log** the metrics
   line, **checkpoint** at ``--save-interval`` (``--save`` always keeps the final model).

``--async`` overlaps step 1 of rollout k+1 with steps 2-3 of rollout k (slime's ``train_async.py``):
the engines keep generating while the trainer works, and take new weights between batches. Each
sample's oldest ``weight_versions`` entry says how stale it is; stale samples are dropped.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agentrl.config import RunConfig
from agentrl.metrics import dump_rollout
from agentrl.runtime import run_folder
from agentrl.runtime.collect import Batch
from agentrl.runtime.recipes import Recipe

log = logging.getLogger(__name__)

__all__ = ["EngineHooks", "Observers", "TrainLoop"]


@dataclass
class EngineHooks:
    """What the loop does to the engines: push the trainer's weights, guard a push, free memory around an update.

    ``push(version)`` sends the current weights as ``str(version)``; ``guard()`` is an async context manager
    factory wrapped around every push (launched SGLang servers: pause generation, flush the cache, continue
    afterwards; None = push directly); ``memory`` (colocated engines) has async ``release()`` / ``resume()``.
    """

    push: Callable[[int], Any]
    guard: Callable[[], Any] | None = None
    memory: Any = None


@dataclass
class Observers:
    """Where a step's results go: ``metrics`` (a :class:`~agentrl.metrics.MetricsLogger`), ``evaluator(step)``
    (eval-set metrics, at ``--eval-interval``), ``memory_probe()`` (``{"<actor>_peak_rss_mb": MiB}``)."""

    metrics: Any
    evaluator: Callable[[int], Awaitable[dict[str, float]]] | None = None
    memory_probe: Callable[[], dict[str, float]] | None = None


class TrainLoop:
    """Drives a run: a collector (the rollout side), a recipe (the train side), the engines' hooks, the observers.

    Every part is passed in, so tests assemble a loop from real parts; ``train()`` builds them from a resolved run.
    """

    def __init__(self, cfg: RunConfig, *, collector: Any, recipe: Recipe, engines: EngineHooks, observers: Observers):
        if cfg.num_rollout is None:
            raise ValueError(
                "the run's length (num_rollout) is not derived yet: pass the configuration preflight() resolved"
            )
        self.cfg = cfg
        self.steps = cfg.num_rollout
        self.collector = collector
        self.recipe = recipe
        self.engines = engines
        self.observers = observers
        self.version = 0  # number of weight updates the engines have received
        self.start_step = 0
        self.run_dir = Path(cfg.save) if cfg.save else None

    async def _collect_after(self, previous: asyncio.Task | None, step: int) -> Batch:
        """The collector's batch for ``step`` once ``previous`` (the step before's) has finished, however it ended."""
        if previous is not None:
            await asyncio.wait({previous})
        return await self.collect(step)

    async def collect(self, step: int) -> Batch:
        return await self.collector.collect(step, lambda: self.version)

    # ------------------------------------------------------------------ the run

    async def run(self) -> list[dict[str, Any]]:
        """Run steps ``start_step .. num_rollout-1``; return the metric lines written."""
        cfg = self.cfg
        lines: list[dict[str, Any]] = []
        pending: collections.deque[asyncio.Task] = collections.deque()  # rollouts of the next steps, in order
        try:
            for step in range(self.start_step, self.steps):
                batch = await pending.popleft() if pending else await self.collect(step)
                if cfg.async_mode:  # keep --async-buffer-size rollouts queued while this step trains
                    nxt = step + 1 + len(pending)
                    while len(pending) < cfg.async_buffer_size and nxt < self.steps:
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
        """Select, update, push, log, checkpoint: one step over a collected batch."""
        cfg, recipe, engines, observers = self.cfg, self.recipe, self.engines, self.observers
        counts = dict(batch.counts)
        self.collector.filter_samples(batch.groups)  # --rollout-sample-filter-path, when the step trains them
        keep = recipe.select(batch, counts, self.version)
        t0 = time.monotonic()
        if engines.memory is not None:
            await engines.memory.release()
        train_metrics, advs = await recipe.update(keep, step)
        train_seconds = time.monotonic() - t0
        if engines.memory is not None:
            await engines.memory.resume()
        moved = recipe.moves_policy(step)
        self.version += int(moved)  # a critic-only step leaves the policy (and the engines) as they were
        last = step + 1 == self.steps
        evaluating = observers.evaluator is not None and (
            bool(cfg.eval_interval and (step + 1) % cfg.eval_interval == 0) or (last and recipe.eval_at_end)
        )
        t1 = time.monotonic()
        if moved and recipe.push_due(step, evaluating):
            async with (engines.guard or contextlib.nullcontext)():
                await asyncio.to_thread(engines.push, self.version)
        sync_seconds = time.monotonic() - t1
        extra = {
            **counts,
            "weight_version": self.version,
            "train_samples": len(keep),
            **(await self.collector.health()),
            "weight_sync_seconds": sync_seconds,
            "step_train_seconds": train_seconds,
            **(await asyncio.to_thread(observers.memory_probe) if observers.memory_probe is not None else {}),
        }
        line = recipe.line(step, batch, train_metrics, extra)
        if self.run_dir is not None and cfg.dump_rollouts and recipe.dumps_rollouts:
            samples = batch.samples
            adv_by_id = {id(s): a for s, a in zip(keep, advs)}
            dump_rollout(self.run_dir, step, samples, [adv_by_id.get(id(s)) for s in samples])
        if evaluating:
            assert observers.evaluator is not None
            line.update(await observers.evaluator(step))
        observers.metrics.log(step, line)
        # with --save the final model is always kept, --save-interval or not
        if self.run_dir is not None and ((cfg.save_interval and (step + 1) % cfg.save_interval == 0) or last):
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
            **self.recipe.loop_state(),
            "data": self.collector.state_dict(),
            "python_random": repr(random.getstate()),
        }
        self.recipe.save(tmp, state)
        return run_folder.commit(self.run_dir, steps_done, tmp, state)

    def resume(self, load: str | Path) -> bool:
        """Restore from the newest checkpoint under ``load`` (a run folder, or an ``iter_*`` checkpoint :meth:`save`
        wrote); False if there is none yet."""
        path = run_folder.latest_checkpoint(load)
        if path is None:
            return False
        state = run_folder.read_loop_state(path)
        run_folder.check_critic(path, self.recipe.critic is not None)  # train() checked it; a hand-built loop too
        critic_dir = path / run_folder.CRITIC_DIR
        if self.recipe.critic is None and critic_dir.is_dir():
            log.warning("resuming %s without ppo: its critic (%s) is not used", path, critic_dir)
        self.recipe.load(path)
        self.collector.load_state_dict(state.get("data"))
        self.start_step = int(state["step"])
        self.version = int(state.get("weight_version", self.start_step))
        if self.recipe.push_on_resume:
            self.engines.push(self.version)
        if hasattr(self.observers.metrics, "truncate_after"):
            self.observers.metrics.truncate_after(self.start_step)
        log.warning("resumed from %s at step %d", path, self.start_step)
        return True
