"""Rollout workers: episodes in Ray actors across the cluster's nodes (``--rollout-num-workers N``).

With one worker (the default) every episode of a run runs in the driver process, on its event loop,
as :func:`~agentrl.rollout.generate.generate_rollout` always did. With ``N > 1`` the run starts N
:class:`RolloutWorker` actors, spread over the nodes (``--rollout-worker-cpus``, custom resources
with ``--rollout-worker-resources``). Each builds what an episode needs in its own process: the env
(loaded from ``--env`` there), the tokenizer and chat template, a router over the run's engines, a
thread pool for blocking env steps, and the sandbox config: a worker's sandboxes are created by its
own process, on its own node's Docker engine (or bubblewrap).

:class:`RolloutWorkerGroup` runs a step's groups on them: one group (all ``n_samples_per_prompt``
episodes of a task) per call, so group rewards, dynamic-sampling filters and prefix-cache reuse stay
on one worker; each call goes to the worker with the fewest groups in flight, and at most
``--rollout-concurrency`` episodes are in flight over all workers (memory stays bounded however many
workers run). Samples come back with the ``group_index``, ``index`` and seeds the in-process loop
gives them, every turn's weight version recorded by the engine as usual.

Faults: a worker that dies (killed, OOM) loses only its in-flight groups: the group is run again on
another worker, a replacement is started, and both are counted (``rollout_groups_rerun``,
``rollout_worker_restarts`` in ``metrics.jsonl``). A busy worker that leaves a health check
unanswered for ``--rollout-worker-timeout`` seconds (its event loop blocked) is killed and handled
the same way. A dead worker's Docker sandboxes are removed on its node at once (by the run id on
their labels), not left to their ttl.

Engine routing: each worker routes its own episodes (sticky per episode, least-outstanding among
the engines for its requests); with one engine per run, as on a CPU machine, there is nothing to
balance.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from agentrl.config import RunConfig
from agentrl.types import Sample

log = logging.getLogger(__name__)

MAX_GROUP_ATTEMPTS = 3
"""A group whose worker died this many times in a row fails the step (something in it kills workers)."""


def episode_context(cfg: RunConfig, checkpoint: str | Path, urls: Sequence[str], api_key: str | None) -> Any:
    """What every episode of this process shares: a router over ``urls``, the chat template, a thread pool.

    Returns ``(ctx, tokenizer, template)``. The driver builds one for in-process rollouts and evals;
    each rollout worker builds its own.
    """
    from transformers import AutoTokenizer

    from agentrl.chat import ChatTemplate
    from agentrl.engines.http import SGLangEngine
    from agentrl.engines.router import Router
    from agentrl.rollout.episode import EpisodeContext
    from agentrl.rollout.threads import SyncPool

    tokenizer = AutoTokenizer.from_pretrained(str(checkpoint))
    template = ChatTemplate(tokenizer, tool_template=cfg.rollout.tool_template)
    routed = cfg.rollout_return_routed_experts
    engine = Router([SGLangEngine(u, api_key=api_key, return_routed_experts=routed) for u in urls])
    # one pool of threads for blocking env steps for the whole run: hung ones are bounded per run, not per step
    pool = SyncPool.for_rollout(cfg.rollout.rollout_concurrency)
    ctx = EpisodeContext(
        engine=engine,
        template=template,
        config=cfg.rollout,
        executor=pool,
        role_engines={r: SGLangEngine(u) for r, u in cfg.rollout.role_engine_urls().items()},
    )
    return ctx, tokenizer, template


class RolloutWorker:
    """One rollout worker (a Ray actor, async: its groups run concurrently on its own event loop)."""

    def __init__(
        self,
        cfg: RunConfig,
        checkpoint: str,
        urls: list[str],
        api_key: str | None,
        index: int,
        driver_path: list[str] | None = None,
    ):
        from agentrl import sandbox
        from agentrl.registry import load_env, load_function
        from agentrl.rollout.generate import bind_engine_args
        from agentrl.runtime.train import argparse_namespace

        for entry in driver_path or []:  # modules the driver could import (a test's or a script's own folder)
            if entry not in sys.path:
                sys.path.append(entry)
        self.index = index
        self.cfg = cfg
        sandbox.configure(cfg.rollout.sandbox_config())  # this process's sandboxes, on this node
        self.factory = load_env(cfg.env) if cfg.env else None
        self.custom_generate = (
            load_function(cfg.custom_generate_function_path) if cfg.custom_generate_function_path else None
        )
        custom_rm = load_function(cfg.custom_rm_path) if cfg.custom_rm_path else None
        # a group reward model (--group-rm) scores whole groups on the driver, as in-process
        self.custom_reward = None if cfg.group_rm else custom_rm
        self.ctx, tokenizer, template = episode_context(cfg, checkpoint, urls, api_key)
        self.args = argparse_namespace(cfg)
        bind_engine_args(self.args, self.ctx.engine, tokenizer, template, list(urls))

    async def info(self) -> dict[str, Any]:
        """Where this worker runs: Ray node id, pid, host, and the run id on its Docker sandboxes' labels."""
        import ray

        from agentrl.sandbox import docker as docker_backend

        return {
            "index": self.index,
            "node_id": ray.get_runtime_context().get_node_id(),
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "sandbox_run_id": docker_backend.run_id(),
        }

    async def peak_rss_mb(self) -> float:
        """This worker's peak resident memory (MiB), for ``metrics.jsonl`` and the benchmark."""
        from agentrl.runtime.cluster import peak_rss_mb

        return peak_rss_mb()

    async def ping(self) -> bool:
        """Answers while the event loop runs (a blocked loop leaves it unanswered)."""
        return True

    async def run_group(self, row: dict[str, Any], group: int, seed: int) -> list[Sample]:
        """The ``n_samples_per_prompt`` episodes of ``row``, as group ``group`` of a rollout seeded ``seed``."""
        import dataclasses

        from agentrl.rollout.generate import generate_rollout

        ctx = dataclasses.replace(self.ctx, config=dataclasses.replace(self.ctx.config, rollout_seed=seed))
        samples, _ = await generate_rollout(
            ctx,
            self.factory,
            [row],
            args=self.args,
            custom_generate=self.custom_generate,
            custom_reward=self.custom_reward,
            first_group=group,
        )
        return samples

    async def shutdown(self) -> None:
        """Close this worker's sandboxes and engine sessions (its actor is killed next)."""
        from agentrl import sandbox

        try:
            await sandbox.close_default_pool()
        finally:
            for e in self.ctx.engine.engines:
                await e.close()
            if self.ctx.executor is not None:
                self.ctx.executor.shutdown(wait=False)


def _reap_sandboxes(run_id: str) -> int:
    """Remove the Docker sandboxes labelled with ``run_id`` (a dead worker's), on the node this runs on."""
    try:
        from agentrl.sandbox import docker as docker_backend

        return docker_backend.reap(run_id=run_id)
    except Exception as exc:  # noqa: BLE001 - no Docker on that node, or the engine is gone: nothing to remove
        log.debug("reaping sandboxes of run %s: %s", run_id, exc)
        return 0


class RolloutWorkerGroup:
    """``cfg.rollout_num_workers`` :class:`RolloutWorker` actors and the dispatch of groups onto them."""

    def __init__(self, cfg: RunConfig, checkpoint: str | Path, urls: Sequence[str], api_key: str | None):
        import ray

        self.cfg = cfg
        self.checkpoint = str(checkpoint)
        self.urls = list(urls)
        self.api_key = api_key
        self.remote = ray.remote(RolloutWorker)
        self.workers: list[Any] = []
        self.infos: list[dict[str, Any]] = []
        self.in_flight: list[int] = []
        self.restarts = 0  # workers replaced over the run
        self.groups_rerun = 0  # groups run again after their worker died or hung
        self.reaped = 0  # sandboxes of dead workers removed on their nodes
        self._reported = (0, 0, 0)
        self._spawned = 0
        self.check_placement(cfg)
        starting = [self._spawn(i) for i in range(cfg.rollout_num_workers)]
        self.workers = [w for w, _ in starting]
        try:
            self.infos = ray.get([ref for _, ref in starting], timeout=max(120.0, cfg.rollout_worker_timeout))
        except Exception as exc:
            self.shutdown()
            raise RuntimeError(
                f"the {cfg.rollout_num_workers} rollout workers did not start: {type(exc).__name__}: {exc}"
            ) from exc
        self.in_flight = [0] * len(self.workers)
        self.generation = [0] * len(self.workers)  # bumped when a slot's worker is replaced

    @staticmethod
    def check_placement(cfg: RunConfig) -> None:
        """Refuse a worker count the cluster cannot place, naming the resource (before any worker starts)."""
        import ray

        n, cpus, custom = cfg.rollout_num_workers, cfg.rollout_worker_cpus, cfg.worker_resources
        need = {"CPU": cpus, **custom} if cpus else dict(custom)
        nodes = [node.get("Resources", {}) for node in ray.nodes() if node.get("Alive")]
        available = ray.available_resources()
        for name, amount in need.items():
            biggest = max((float(r.get(name, 0.0)) for r in nodes), default=0.0)
            if biggest < amount:
                raise ValueError(
                    f"--rollout-num-workers {n}: no node of the cluster has {amount:g} {name} for one rollout worker "
                    f"(the most any node has is {biggest:g}); lower --rollout-worker-cpus / --rollout-worker-resources "
                    "or start nodes with that resource"
                )
            # whole workers per node: a worker cannot span nodes
            fits = sum(int(float(r.get(name, 0.0)) // amount) for r in nodes)
            free = float(available.get(name, 0.0))
            if fits < n or free < n * amount - 1e-9:
                raise ValueError(
                    f"--rollout-num-workers {n} needs {n} x {amount:g} {name}, but the cluster has {free:g} {name} "
                    f"free after the engines and trainers ({fits} worker(s) fit on its nodes); lower "
                    "--rollout-num-workers or --rollout-worker-cpus (0 places workers by custom resources alone), "
                    "or add nodes"
                )

    def _spawn(self, index: int) -> tuple[Any, Any]:
        options: dict[str, Any] = {
            "num_cpus": self.cfg.rollout_worker_cpus,
            "scheduling_strategy": "SPREAD",
            "max_concurrency": 1_000_000,  # async actor: every group a call, bounded by the dispatcher
            "max_restarts": 0,
        }
        if self.cfg.worker_resources:
            options["resources"] = self.cfg.worker_resources
        self._spawned += 1
        worker = self.remote.options(**options).remote(
            self.cfg, self.checkpoint, self.urls, self.api_key, index, list(sys.path)
        )
        return worker, worker.info.remote()

    def counts(self) -> dict[str, int]:
        """Workers replaced, groups re-run and dead workers' sandboxes removed since the last call (metrics)."""
        now = (self.restarts, self.groups_rerun, self.reaped)
        restarts, rerun, reaped = (a - b for a, b in zip(now, self._reported))
        self._reported = now
        return {
            "rollout_worker_restarts": restarts,
            "rollout_groups_rerun": rerun,
            "rollout_sandboxes_reaped": reaped,
        }

    async def run_groups(self, rows: Sequence[dict[str, Any]], seed: int) -> list[list[Sample]]:
        """Every row as one group (index = its position), spread over the workers; returns them in order."""
        per_group = max(1, self.cfg.rollout.n_samples_per_prompt)
        slots = asyncio.Semaphore(max(1, self.cfg.rollout.rollout_concurrency // per_group))
        monitor = asyncio.create_task(self._monitor())
        try:
            return list(await asyncio.gather(*(self._one(slots, row, g, seed) for g, row in enumerate(rows))))
        finally:
            monitor.cancel()
            await asyncio.gather(monitor, return_exceptions=True)

    async def _one(self, slots: asyncio.Semaphore, row: dict[str, Any], group: int, seed: int) -> list[Sample]:
        from ray.exceptions import RayActorError

        async with slots:
            for attempt in range(MAX_GROUP_ATTEMPTS):
                w = min(range(len(self.workers)), key=lambda i: self.in_flight[i])
                worker, generation = self.workers[w], self.generation[w]
                self.in_flight[w] += 1
                try:
                    return await worker.run_group.remote(row, group, seed)
                except RayActorError as exc:
                    log.warning(
                        "rollout worker %d died with group %d in flight (%s); re-running the group",
                        w,
                        group,
                        type(exc).__name__,
                    )
                    self.groups_rerun += 1
                    self._replace(w, generation)
                    if attempt + 1 == MAX_GROUP_ATTEMPTS:
                        raise RuntimeError(
                            f"group {group}: its rollout worker died {MAX_GROUP_ATTEMPTS} times in a row; "
                            f"something in this task kills workers: {row!r:.200}"
                        ) from exc
                finally:
                    if self.generation[w] == generation:
                        self.in_flight[w] -= 1
        raise AssertionError("unreachable")

    def _replace(self, w: int, generation: int) -> None:
        """Start a new worker in slot ``w`` (once per dead worker) and remove the dead one's sandboxes."""
        import ray

        if self.generation[w] != generation:  # another of its groups already replaced it
            return
        dead, info = self.workers[w], self.infos[w]
        self.generation[w] += 1
        self.in_flight[w] = 0
        self.restarts += 1
        ray.kill(dead, no_restart=True)
        self._reap_on(info)
        worker, ready = self._spawn(w)
        self.workers[w] = worker
        self.infos[w] = {**info, "starting": True}

        async def record() -> None:
            try:
                self.infos[w] = await ready
            except Exception as exc:  # noqa: BLE001 - its first group fails, is re-run, and it is replaced again
                log.warning("replacement rollout worker %d did not start: %s", w, exc)

        asyncio.get_running_loop().create_task(record())

    def _reap_on(self, info: dict[str, Any]) -> None:
        """Remove the dead worker's Docker sandboxes on its node (a task pinned there; best effort)."""
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        run_id = info.get("sandbox_run_id")
        if not run_id or info.get("starting"):
            return
        strategy = NodeAffinitySchedulingStrategy(node_id=info["node_id"], soft=True)
        ref = ray.remote(_reap_sandboxes).options(num_cpus=0, scheduling_strategy=strategy).remote(run_id)

        async def count() -> None:
            try:
                self.reaped += int(await ref)
            except Exception as exc:  # noqa: BLE001 - the node itself may be gone
                log.warning("could not remove the sandboxes of a dead rollout worker: %s", exc)

        asyncio.get_running_loop().create_task(count())

    async def _monitor(self) -> None:
        """Every few seconds, ask each busy worker to answer; one that stays silent past the timeout is replaced."""
        timeout = self.cfg.rollout_worker_timeout
        period = min(5.0, timeout / 4)
        while True:
            await asyncio.sleep(period)
            busy = [w for w in range(len(self.workers)) if self.in_flight[w] and not self.infos[w].get("starting")]
            answers = await asyncio.gather(
                *(asyncio.wait_for(self._ping(w), timeout) for w in busy), return_exceptions=True
            )
            for w, answer in zip(busy, answers):
                if isinstance(answer, TimeoutError):
                    log.warning(
                        "rollout worker %d left a health check unanswered for %.0f s (--rollout-worker-timeout): "
                        "replacing it; its groups run again",
                        w,
                        timeout,
                    )
                    import ray

                    ray.kill(self.workers[w], no_restart=True)  # its in-flight calls fail: _one re-runs them

    async def _ping(self, w: int) -> bool:
        return await self.workers[w].ping.remote()

    def peak_rss_mb(self) -> float | None:
        """The largest peak resident memory (MiB) among the live workers (None when none answers)."""
        import ray

        found = []
        for w in self.workers:
            try:
                found.append(ray.get(w.peak_rss_mb.remote(), timeout=30))
            except Exception:  # noqa: BLE001 - a worker being replaced reports next step
                continue
        return max(found, default=None)

    def node_ids(self) -> list[str]:
        """The Ray node of each worker (as started)."""
        return [i["node_id"] for i in self.infos]

    def shutdown(self) -> None:
        """Close every worker's sandboxes and sessions, then kill the actors."""
        import ray

        deadline = time.monotonic() + 30
        for w in self.workers:
            try:
                ray.get(w.shutdown.remote(), timeout=max(1.0, deadline - time.monotonic()))
            except Exception:  # noqa: BLE001 - best effort; the actor is killed next
                pass
            ray.kill(w, no_restart=True)
        self.workers = []
