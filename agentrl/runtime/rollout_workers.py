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

from agentrl import sandbox
from agentrl.config import RunConfig, argparse_namespace
from agentrl.registry import load_env
from agentrl.rollout.context import close_context, follow_urls, run_context
from agentrl.rollout.generate import bind_engine_args, generate_rollout
from agentrl.runtime.cluster import peak_rss_mb
from agentrl.sandbox import docker as docker_backend
from agentrl.types import Sample
from agentrl.user_code import load_function

log = logging.getLogger(__name__)

MAX_GROUP_ATTEMPTS = 3
"""A group whose worker died this many times in a row fails the step (something in it kills workers)."""


BOUND_ARGS = (
    "engine",
    "tokenizer",
    "chat_template_obj",
    "engine_urls",
    "engine_headers",
    "sglang_router_ip",
    "sglang_router_port",
    "lora_path",
)
"""What :func:`~agentrl.rollout.generate.bind_engine_args` sets on ``args``: each worker binds its own."""


def worker_args(args: Any) -> Any:
    """The caller's ``args`` for the workers: every attribute but the ones each process binds itself."""
    import argparse

    return argparse.Namespace(**{k: v for k, v in vars(args).items() if k not in BOUND_ARGS})


def _check_reachable(urls: Sequence[str]) -> None:
    """Refuse to start a worker that can open a connection to none of the engines (a loopback URL seen
    from another node). A TCP connect, not a request: a busy or paused engine still accepts it."""
    from urllib.parse import urlsplit

    errors = []
    for url in urls:
        parts = urlsplit(url)
        port = parts.port or (443 if parts.scheme == "https" else 80)
        try:
            with socket.create_connection((parts.hostname or "127.0.0.1", port), timeout=5):
                return
        except OSError as exc:
            errors.append(f"{url}: {type(exc).__name__}")
    raise RuntimeError(
        f"a rollout worker on {socket.gethostname()} reaches none of the engines ({'; '.join(errors)}): engines a "
        "run starts listen on --engine-host (default 127.0.0.1, this node only); with workers on other nodes pass "
        "--engine-host 0.0.0.0, or --engine-url addresses every node can reach"
    )


def check_worker_args(args: Any) -> None:
    """Refuse (before Ray starts) an ``args`` the workers cannot receive: each gets a pickled copy."""
    import ray.cloudpickle as cloudpickle

    if not hasattr(args, "__dict__"):
        raise ValueError(
            f"--rollout-num-workers sends `args` to every worker as attributes: a {type(args).__name__} has none"
        )
    bad = []
    for name, value in vars(worker_args(args)).items():
        try:
            cloudpickle.dumps(value)
        except Exception as exc:  # noqa: BLE001 - any reason it cannot travel
            bad.append(f"{name} ({type(value).__name__}: {type(exc).__name__})")
    if bad:
        raise ValueError(
            "--rollout-num-workers: each rollout worker gets a copy of `args`, and these attributes cannot be "
            f"pickled: {', '.join(bad)}; drop them from args or create them in your functions"
        )


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
        args: Any = None,
    ):
        for entry in driver_path or []:  # modules the driver could import (a test's or a script's own folder)
            if entry not in sys.path:
                sys.path.append(entry)
        _check_reachable(urls)
        self.index = index
        self.cfg = cfg
        self.api_key = api_key
        sandbox.configure(cfg.rollout.sandbox_config())  # this process's sandboxes, on this node
        self.factory = load_env(cfg.env) if cfg.env else None
        self.custom_generate = (
            load_function(cfg.custom_generate_function_path) if cfg.custom_generate_function_path else None
        )
        custom_rm = load_function(cfg.custom_rm_path) if cfg.custom_rm_path else None
        # a group reward model (--group-rm) scores whole groups on the driver, as in-process
        self.custom_reward = None if cfg.group_rm else custom_rm
        self.ctx, tokenizer, template = run_context(cfg, checkpoint, urls, api_key)
        self.args = args if args is not None else argparse_namespace(cfg)  # the driver's, as in-process
        bind_engine_args(self.args, self.ctx.engine, tokenizer, template, list(urls))

    async def info(self) -> dict[str, Any]:
        """Where this worker runs: Ray node id, pid, host, and the run id on its Docker sandboxes' labels."""
        import ray

        return {
            "index": self.index,
            "node_id": ray.get_runtime_context().get_node_id(),
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "sandbox_run_id": docker_backend.run_id(),
        }

    async def peak_rss_mb(self) -> float:
        """This worker's peak resident memory (MiB), for ``metrics.jsonl`` and the benchmark."""
        return peak_rss_mb()

    async def hung_threads(self) -> int:
        """Blocking env calls this worker wrote off (timed out, still running in their threads)."""
        return int(getattr(self.ctx.executor, "hung", 0))

    async def ping(self) -> bool:
        """Answers while the event loop runs (a blocked loop leaves it unanswered)."""
        return True

    async def follow_urls(self, urls: list[str]) -> None:
        """Point this worker's router at engines that came back on other addresses (as the driver's)."""
        for router in [self.ctx.engine, *self.ctx.policy_engines.values()]:  # each --policy's router too
            follow_urls(router, urls, self.api_key)

    async def run_group(self, row: dict[str, Any], group: int, seed: int, group_base: int = 0) -> list[Sample]:
        """The ``n_samples_per_prompt`` episodes of ``row``, as group ``group`` of a rollout seeded ``seed``
        (its ``group_index`` is ``group_base + group``, as in :func:`~agentrl.rollout.generate.generate_rollout`)."""
        import dataclasses

        ctx = dataclasses.replace(self.ctx, config=dataclasses.replace(self.ctx.config, rollout_seed=seed))
        samples, _ = await generate_rollout(
            ctx,
            self.factory,
            [row],
            args=self.args,
            custom_generate=self.custom_generate,
            custom_reward=self.custom_reward,
            first_group=group,
            group_base=group_base,
        )
        return samples

    async def shutdown(self) -> None:
        """Close this worker's sandboxes and engine sessions (its actor is killed next)."""
        try:
            await sandbox.close_default_pool()
        finally:
            await close_context(self.ctx)
            if self.ctx.executor is not None:
                self.ctx.executor.shutdown(wait=False)


def _reap_sandboxes(run_id: str) -> int:
    """Remove the Docker sandboxes labelled with ``run_id`` (a dead worker's), on the node this runs on."""
    try:
        return docker_backend.reap(run_id=run_id)
    except Exception as exc:  # noqa: BLE001 - no Docker on that node, or the engine is gone: nothing to remove
        log.debug("reaping sandboxes of run %s: %s", run_id, exc)
        return 0


class _WorkerUnavailable(RuntimeError):
    """A slot's replacement worker could not be started."""


class _Starting:
    """Holds a worker slot while its replacement is started; ``event`` is set once that attempt is over
    (``error`` then says why none could be created)."""

    def __init__(self) -> None:
        self.event = asyncio.Event()
        self.error = ""


def worker_bundle(cfg: RunConfig) -> dict[str, float]:
    """What Ray reserves for one worker: ``--rollout-worker-cpus`` CPUs and ``--rollout-worker-resources``."""
    return {**({"CPU": float(cfg.rollout_worker_cpus)} if cfg.rollout_worker_cpus else {}), **cfg.worker_resources}


class RolloutWorkerGroup:
    """``cfg.rollout_num_workers`` :class:`RolloutWorker` actors and the dispatch of groups onto them.

    :meth:`reserve` (before any model loads) refuses a count the cluster cannot place and reserves a
    placement group of one bundle per worker (strategy ``SPREAD``); worker ``i`` and every
    replacement of it run in bundle ``i``, so a replacement always has room.
    """

    def __init__(
        self,
        cfg: RunConfig,
        checkpoint: str | Path,
        urls: Sequence[str],
        api_key: str | None,
        *,
        placement_group: Any = None,
        args: Any = None,
    ):
        import ray

        self.cfg = cfg
        self.checkpoint = str(checkpoint)
        self.urls = list(urls)
        self.api_key = api_key
        self.placement_group = placement_group
        self.args = worker_args(args) if args is not None else None
        self.start_timeout = max(120.0, cfg.rollout_worker_timeout)
        self.remote = ray.remote(RolloutWorker)
        self.workers: list[Any] = []
        self.infos: list[dict[str, Any]] = []
        self.in_flight: list[int] = []
        self.generation: list[int] = []  # bumped when a slot's worker is replaced
        self.restarts = 0  # workers replaced over the run
        self.groups_rerun = 0  # groups run again after their worker died or hung
        self.reaped = 0  # sandboxes of dead workers removed on their nodes
        self._reported = (0, 0, 0)
        self._tasks: set[asyncio.Task] = set()  # background work (replacements starting, reaps): kept alive
        try:
            ready = []
            for i in range(cfg.rollout_num_workers):
                worker, info = self._spawn(i)
                self.workers.append(worker)  # (each one made is shut down if a later one fails)
                ready.append(info)
            self.infos = ray.get(ready, timeout=self.start_timeout)
        except Exception as exc:
            available = ray.available_resources()
            self.shutdown()
            raise RuntimeError(
                f"the {cfg.rollout_num_workers} rollout workers did not start: {type(exc).__name__}: {exc}. Each "
                f"needs {worker_bundle(cfg) or 'no reserved resources'} on one node (the cluster has {available} "
                "free); check that the env, the functions and --hf-checkpoint load on every node"
            ) from exc
        self.in_flight = [0] * len(self.workers)
        self.generation = [0] * len(self.workers)

    @staticmethod
    def reserve(cfg: RunConfig) -> Any:
        """Refuse a worker count the cluster cannot place, naming the resource, then reserve the workers'
        bundles (None when a worker reserves nothing: ``--rollout-worker-cpus 0`` and no custom resources)."""
        import ray
        from ray.util.placement_group import placement_group, remove_placement_group

        RolloutWorkerGroup.check_placement(cfg)
        bundle = worker_bundle(cfg)
        if not bundle:
            return None
        pg = placement_group([dict(bundle) for _ in range(cfg.rollout_num_workers)], strategy="SPREAD")
        try:
            ray.get(pg.ready(), timeout=60)
        except Exception as exc:
            available = ray.available_resources()
            remove_placement_group(pg)
            raise ValueError(
                f"--rollout-num-workers {cfg.rollout_num_workers}: Ray could not place {cfg.rollout_num_workers} "
                f"workers of {bundle}, each on one node (free: {available}); lower --rollout-num-workers, "
                "--rollout-worker-cpus or --rollout-worker-resources, or add nodes"
            ) from exc
        return pg

    @staticmethod
    def check_placement(cfg: RunConfig) -> None:
        """Refuse at once a count no arrangement of the cluster's nodes could hold, naming the resource."""
        import ray

        n = cfg.rollout_num_workers
        nodes = [node.get("Resources", {}) for node in ray.nodes() if node.get("Alive")]
        available = ray.available_resources()
        for name, amount in worker_bundle(cfg).items():
            biggest = max((float(r.get(name, 0.0)) for r in nodes), default=0.0)
            if biggest < amount:
                raise ValueError(
                    f"--rollout-num-workers {n}: no node of the cluster has {amount:g} {name} for one rollout worker "
                    f"(the most any node has is {biggest:g}); lower --rollout-worker-cpus / --rollout-worker-resources "
                    "or start nodes with that resource"
                )
            # a worker cannot span nodes; Ray counts in units of 1e-4 (2.0 // 0.2 is 9.0 in floats)
            fits = sum(round(float(r.get(name, 0.0)) * 1e4) // max(1, round(amount * 1e4)) for r in nodes)
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
            "max_concurrency": 1_000_000,  # async actor: every group a call, bounded by the dispatcher
            "max_restarts": 0,
        }
        if self.cfg.worker_resources:
            options["resources"] = self.cfg.worker_resources
        if self.placement_group is not None:
            from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

            options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
                placement_group=self.placement_group, placement_group_bundle_index=index
            )
        else:
            options["scheduling_strategy"] = "SPREAD"
        worker = self.remote.options(**options).remote(
            self.cfg, self.checkpoint, self.urls, self.api_key, index, list(sys.path), self.args
        )
        return worker, worker.info.remote()

    def _background(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

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

    def _live(self) -> list[Any]:
        """Handles of the workers that have started (not a slot whose replacement is still loading)."""
        return [
            w for w, info in zip(self.workers, self.infos) if not isinstance(w, _Starting) and not info.get("starting")
        ]

    def _ask_all(self, method: str, *args: Any, timeout: float = 10.0) -> list[Any]:
        """``method`` on every live worker; the answers of those that answered in ``timeout`` seconds."""
        import ray

        refs = [getattr(w, method).remote(*args) for w in self._live()]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout)
        found = []
        for ref in ready:
            try:
                found.append(ray.get(ref))
            except Exception:  # noqa: BLE001 - a worker that just died answers nothing; it is replaced
                continue
        return found

    def hung_threads(self) -> int:
        """Blocking env calls the live workers wrote off (their threads still running)."""
        return int(sum(self._ask_all("hung_threads")))

    def follow_urls(self, urls: Sequence[str]) -> None:
        """Engines came back on other addresses: every worker's router (and replacements) follow."""
        self.urls = list(urls)  # what replacements start with
        self._ask_all("follow_urls", self.urls, timeout=5.0)

    async def run_groups(self, rows: Sequence[dict[str, Any]], seed: int, group_base: int = 0) -> list[list[Sample]]:
        """Every row as one group (index = ``group_base`` + its position), spread over the workers; returns them
        in order.

        At most ``--rollout-concurrency`` episodes (whole groups; at least one group) are in flight."""
        per_group = max(1, self.cfg.rollout.n_samples_per_prompt)
        slots = asyncio.Semaphore(max(1, self.cfg.rollout.rollout_concurrency // per_group))
        monitor = asyncio.create_task(self._monitor())
        try:
            return list(
                await asyncio.gather(*(self._one(slots, row, g, seed, group_base) for g, row in enumerate(rows)))
            )
        finally:
            monitor.cancel()
            await asyncio.gather(monitor, return_exceptions=True)

    def _pick(self) -> int:
        """The least busy worker, preferring ones that have started (a replacement may still be loading)."""
        return min(range(len(self.workers)), key=lambda i: (bool(self.infos[i].get("starting")), self.in_flight[i]))

    async def _one(
        self, slots: asyncio.Semaphore, row: dict[str, Any], group: int, seed: int, group_base: int
    ) -> list[Sample]:
        from ray.exceptions import RayActorError

        async with slots:
            for attempt in range(MAX_GROUP_ATTEMPTS):
                w = self._pick()
                generation = self.generation[w]
                self.in_flight[w] += 1
                try:
                    worker = await self._handle(w)
                    return await worker.run_group.remote(row, group, seed, group_base)
                except (RayActorError, _WorkerUnavailable) as exc:
                    self._replace(w, generation)
                    if attempt + 1 == MAX_GROUP_ATTEMPTS:
                        raise RuntimeError(
                            f"group {group}: the rollout worker running it died {MAX_GROUP_ATTEMPTS} times in a row "
                            f"(last: {type(exc).__name__}: {exc}); a task that kills workers, or workers that cannot "
                            f"start: {row!r:.200}"
                        ) from exc
                    self.groups_rerun += 1
                    log.warning(
                        "rollout worker %d died with group %d in flight (%s); re-running the group",
                        w,
                        group,
                        type(exc).__name__,
                    )
                finally:
                    if self.generation[w] == generation:
                        self.in_flight[w] -= 1
        raise AssertionError("unreachable")

    async def _handle(self, w: int) -> Any:
        """Slot ``w``'s worker, once its replacement (if one is starting) exists."""
        slot = self.workers[w]
        if isinstance(slot, _Starting):
            await slot.event.wait()
            if isinstance(self.workers[w], _Starting):
                raise _WorkerUnavailable(f"the replacement for rollout worker {w} could not be created: {slot.error}")
        return self.workers[w]

    def _replace(self, w: int, generation: int) -> None:
        """Start a new worker in slot ``w`` (once per dead worker) and remove the dead one's sandboxes first."""
        import ray

        if self.generation[w] != generation:  # another of its groups already replaced it
            return
        dead, info = self.workers[w], self.infos[w]
        self.generation[w] += 1
        self.in_flight[w] = 0
        self.restarts += 1
        if not isinstance(dead, _Starting):
            ray.kill(dead, no_restart=True)
        self.infos[w] = {**info, "starting": True}
        stand_in = self.workers[w] = _Starting()  # groups sent to slot w wait until the new worker exists
        self._background(self._reap_then_start(w, info, stand_in))

    async def _reap_then_start(self, w: int, info: dict[str, Any], stand_in: _Starting) -> None:
        """Remove the dead worker's Docker sandboxes on its node, then start its replacement (bounded)."""
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        worker = ready = None
        try:
            run_id = info.get("sandbox_run_id")
            if run_id and not info.get("starting"):
                strategy = NodeAffinitySchedulingStrategy(node_id=info["node_id"], soft=True)
                try:
                    reap = ray.remote(_reap_sandboxes).options(num_cpus=0, scheduling_strategy=strategy)
                    self.reaped += int(await asyncio.wait_for(asyncio.wrap_future(reap.remote(run_id).future()), 60))
                except Exception as exc:  # noqa: BLE001 - the node itself may be gone
                    log.warning("could not remove the sandboxes of dead rollout worker %d: %s", w, exc)
            worker, ready = self._spawn(w)
            self.workers[w] = worker
        except Exception as exc:  # noqa: BLE001 - its waiting groups fail with this reason and replace it again
            stand_in.error = f"{type(exc).__name__}: {exc}"
            log.warning("could not create a replacement for rollout worker %d: %s", w, stand_in.error)
        finally:
            stand_in.event.set()  # whatever happened: waiting groups go on (or fail and replace it again)
        if worker is None or ready is None:
            self.infos[w] = {**info, "starting": False}  # the next group there fails and replaces it again
            return
        try:
            self.infos[w] = await asyncio.wait_for(asyncio.wrap_future(ready.future()), self.start_timeout)
        except Exception as exc:  # noqa: BLE001 - its groups fail, and it is replaced again (bounded per group)
            log.warning("replacement rollout worker %d did not start in %.0f s: %s", w, self.start_timeout, exc)
            ray.kill(worker, no_restart=True)
            self.infos[w] = {**info, "starting": False}  # not left aside: the next group there replaces it

    async def _monitor(self) -> None:
        """Every few seconds, ask each busy worker to answer; one that stays silent past the timeout is replaced."""
        import ray

        timeout = self.cfg.rollout_worker_timeout
        period = min(5.0, timeout / 4)
        while True:
            await asyncio.sleep(period)
            busy = [
                (w, self.workers[w], self.generation[w])
                for w in range(len(self.workers))
                if self.in_flight[w] and not self.infos[w].get("starting")
            ]
            answers = await asyncio.gather(
                *(asyncio.wait_for(self._ping(handle), timeout) for _, handle, _ in busy), return_exceptions=True
            )
            for (w, handle, generation), answer in zip(busy, answers):
                if isinstance(answer, TimeoutError) and self.generation[w] == generation:
                    log.warning(
                        "rollout worker %d left a health check unanswered for %.0f s (--rollout-worker-timeout): "
                        "replacing it; its groups run again",
                        w,
                        timeout,
                    )
                    ray.kill(handle, no_restart=True)  # its in-flight calls fail: _one re-runs them

    @staticmethod
    async def _ping(handle: Any) -> bool:
        return await handle.ping.remote()

    def peak_rss_mb(self) -> float | None:
        """The largest peak resident memory (MiB) among the live workers (None when none answers in 10 s)."""
        return max(self._ask_all("peak_rss_mb"), default=None)

    def node_ids(self) -> list[str]:
        """The Ray node of each worker (as started)."""
        return [i["node_id"] for i in self.infos]

    def shutdown(self) -> None:
        """Close every worker's sandboxes and sessions, kill the actors, give their bundles back."""
        import ray

        deadline = time.monotonic() + 30
        live = [w for w in self.workers if not isinstance(w, _Starting)]
        for w in live:
            try:
                ray.get(w.shutdown.remote(), timeout=max(1.0, deadline - time.monotonic()))
            except Exception:  # noqa: BLE001 - best effort; the actor is killed next
                pass
            ray.kill(w, no_restart=True)
        self.workers = []
        if self.placement_group is not None:
            from ray.util.placement_group import remove_placement_group

            remove_placement_group(self.placement_group)
            self.placement_group = None
