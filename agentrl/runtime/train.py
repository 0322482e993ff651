"""Assemble a training run from a :class:`~agentrl.config.RunConfig` and run it.

``agentrl train`` calls :func:`train`: :func:`~agentrl.runtime.preflight.preflight` checks the run and
resolves it (every check and derived value is there), the resolved configuration is written to
``<save>/config.json``, and only then are Ray, the engines and the trainer started (:class:`_Runtime`)
and the loop built from them: :class:`~agentrl.runtime.loop.TrainLoop` over a rollout side
(:mod:`agentrl.runtime.collect`) and a recipe (:mod:`agentrl.runtime.recipes`: GRPO family, PPO or SFT).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import shutil
import sys
import time
from pathlib import Path
from typing import Any

from agentrl.config import POLICY_ADAPTER, RunConfig
from agentrl.cpu_share import usable_cores
from agentrl.metrics import MetricsLogger
from agentrl.rollout.eval import evaluate
from agentrl.rollout.generate import BatchGenerate, bind_engine_args
from agentrl.runtime.backends import adapter_server_args, sglang_launch
from agentrl.runtime.cluster import init_ray, peak_rss_mb, plan_placement
from agentrl.runtime.collect import DemoCollector, EpisodeCollector
from agentrl.runtime.preflight import ResolvedRun, preflight
from agentrl.sandbox import close_default_pool

log = logging.getLogger(__name__)


def config_dict(cfg: RunConfig) -> dict[str, Any]:
    """The configuration as plain JSON (nested rollout/train sections)."""
    return json.loads(json.dumps(dataclasses.asdict(cfg), default=str))


def train(cfg: RunConfig, args: Any = None) -> dict[str, Any]:
    """Run ``cfg`` to the end; return the last metrics line (plus the run folder).

    :func:`~agentrl.runtime.preflight.preflight` checks and resolves the run first; Ray, the engines and the
    trainer start only from what it returns, and ``cfg`` itself is left as it was given.
    """
    run = preflight(cfg, args)
    cfg = run.config
    run_dir = Path(cfg.save) if cfg.save else None
    if run_dir is not None:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.json").write_text(json.dumps(config_dict(cfg), indent=2))
        if run.demos is not None:
            with open(run_dir / "demos.jsonl", "w", encoding="utf-8") as f:
                f.writelines(s.to_json() + "\n" for s in run.demos)
    with contextlib.ExitStack() as stack:
        runtime = stack.enter_context(_Runtime(cfg, run.checkpoint))
        loop = runtime.build_loop(run)
        if run.resume_from is not None:
            loop.resume(run.resume_from)
        elif cfg.train.starts_off_checkpoint or cfg.adapters_by_name:
            # the engines loaded --hf-checkpoint's weights: replace them; or engines that serve the policy's adapter
            # (each --policy's) by name, which every request names, load it before the first
            runtime.sync_weights(0)
        t0 = time.monotonic()
        lines = asyncio.run(_run(loop, runtime.ctx))
        summary = dict(lines[-1]) if lines else {}
        summary["wall_seconds"] = round(time.monotonic() - t0, 1)
        summary["run_dir"] = str(run_dir) if run_dir else None
        summary["weight_sync"] = sorted(set(runtime.routes_taken))  # the routes the weight pushes took
        return summary


async def _run(loop: Any, ctx: Any) -> list[dict[str, Any]]:
    from agentrl.rollout.context import close_context

    try:
        return await loop.run()
    finally:
        await close_context(ctx)
        await close_default_pool()


class _Runtime:
    """Ray, engines and trainer actors for one run; torn down on exit, whatever happened."""

    def __init__(self, cfg: RunConfig, checkpoint: Path):
        self.cfg = cfg
        self.checkpoint = checkpoint
        self.engines: Any = None
        self.trainers: Any = None
        self.critic: Any = None  # ppo: the critic's trainer group
        self.metrics: Any = None
        self.placement: Any = None
        self.routes_taken: list[str] = []  # the route of every weight push, in order
        self.rollout_workers: Any = None  # --rollout-num-workers > 1: the episodes' Ray actors
        self.worker_placement: Any = None  # their bundles, reserved before any model loads
        self.ctx: Any = None  # the episodes' context, once the engines are up

    def __enter__(self) -> _Runtime:
        from agentrl.runtime.engine_group import EngineGroup
        from agentrl.runtime.trainer_group import TrainerGroup

        try:
            return self._start(init_ray, plan_placement, EngineGroup, TrainerGroup)
        except BaseException:
            self.__exit__(None, None, None)  # servers, actors and reserved devices must not outlive a failed start
            raise

    def _start(self, init_ray: Any, plan_placement: Any, EngineGroup: Any, TrainerGroup: Any) -> _Runtime:
        cfg = self.cfg
        init_ray(cfg.ray_address)
        placement = self.placement = plan_placement(cfg)
        if cfg.rollout_num_workers > 1:  # the workers' bundles: refused (naming the resource) before any model loads
            from agentrl.runtime.rollout_workers import RolloutWorkerGroup

            self.worker_placement = RolloutWorkerGroup.reserve(cfg)
        print(
            f"starting {cfg.trainer_world_size} trainer rank(s) and "
            f"{len(cfg.engine_url) or len(placement.engines)} engine(s) for {self.checkpoint} ...",
            file=sys.stderr,
        )
        t_threads, e_threads, floor = _threads(cfg, placement)
        if cfg.engine_url:
            self.engines = EngineGroup.external(cfg.engine_url)
        elif cfg.rollout_backend == "sglang":
            self.engines = _launch_sglang(cfg, self.checkpoint, placement)
        else:
            self.engines = EngineGroup.embedded(
                self.checkpoint,
                len(placement.engines),
                num_cpus=placement.engine_cpus,
                num_gpus=placement.engine_gpus,
                placement=placement.engines,
                host=cfg.engine_host,
                max_running_requests=cfg.engine_max_running_requests,
                seed=cfg.rollout.rollout_seed,
                num_threads=e_threads,
                adaptive_threads=cfg.cpu_threads == "adaptive",
                min_threads=floor,
                **adapter_server_args(cfg),
            )
        self.trainers = TrainerGroup(
            self.checkpoint,
            cfg.train,
            world_size=cfg.trainer_world_size,
            num_cpus=placement.trainer_cpus,
            num_gpus=placement.trainer_gpus,
            placement_group=placement.trainer[0][0],
            num_threads=t_threads,
            backend=cfg.train_backend,
            adaptive_threads=cfg.cpu_threads == "adaptive",
            min_threads=floor,
        )
        if placement.critic:
            self.critic = TrainerGroup(
                Path(cfg.critic_hf_checkpoint) if cfg.critic_hf_checkpoint else self.checkpoint,
                cfg.train,
                world_size=cfg.trainer_world_size,
                num_cpus=placement.trainer_cpus,
                num_gpus=placement.critic_gpus,
                placement_group=placement.critic[0][0],
                bundle_indices=[b for _, b in placement.critic],
                num_threads=t_threads,
                backend=cfg.train_backend,
                role="critic",
                adaptive_threads=cfg.cpu_threads == "adaptive",
                min_threads=floor,
            )
        if cfg.weight_sync == "adapter":
            self.weight_route()  # an adapter the engines cannot serve: refused now, not after the first step
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.metrics is not None:
            self.metrics.close()
        if self.rollout_workers is not None:
            with contextlib.suppress(Exception):
                self.rollout_workers.shutdown()
            self.rollout_workers = None
        if self.worker_placement is not None:  # the workers' bundles, whatever shutdown managed
            from ray.util.placement_group import remove_placement_group

            with contextlib.suppress(Exception):
                remove_placement_group(self.worker_placement)
        self.worker_placement = None
        if getattr(self, "env_pool", None) is not None:
            self.env_pool.shutdown()  # idle workers end; hung ones are daemon threads
        for part in (self.trainers, self.critic, self.engines):
            if part is not None:
                with contextlib.suppress(Exception):
                    part.shutdown()
        self.trainers = self.critic = self.engines = None
        if self.placement is not None:
            self.placement.release()
            self.placement = None

    def weight_route(self) -> str:
        """The route of every weight push (one of :data:`agentrl.runtime.weight_sync.TRANSPORTS`, or ``adapter``: a LoRA
        policy's adapter alone, :meth:`TrainerGroup.push_adapter`), chosen once.

        ``--weight-sync``, or for ``auto`` as slime: embedded engines take the weights through Ray,
        by shared memory when they all share the trainer's node (``shm``), else the object store;
        launched SGLang servers on GPUs take tensor handles when colocated and an NCCL broadcast
        when not; anything else loads a checkpoint folder (``disk``: any engine, any node with the
        run folder). ``--weight-sync tensor`` means by handle: Ray's routes for embedded engines.
        """
        if getattr(self, "_route", None) is None:
            cfg = self.cfg
            mode = cfg.weight_sync
            if mode == "auto":
                if self.engines.supports_tensors:
                    mode = "tensor"
                elif cfg.rollout_backend == "sglang" and self.placement.engine_gpus:
                    mode = "tensor" if cfg.colocate and cfg.rollout_num_gpus_per_engine == 1 else "nccl"
                else:
                    mode = "disk"
            if mode == "tensor" and self.engines.supports_tensors:
                mode = "shm" if self._same_node() else "object_store"
            if mode == "adapter":  # refused before the first rollout: an adapter the engines cannot serve
                from agentrl.engines.local.lora import SUPPORTED_TARGETS

                unserved = sorted(self.trainers.adapted_modules() - set(SUPPORTED_TARGETS))
                if unserved:
                    raise ValueError(
                        f"--weight-sync adapter: the policy's adapter adapts {unserved}, which the engines "
                        f"are not given adapters on ({', '.join(SUPPORTED_TARGETS)}): use --weight-sync auto (the "
                        "merged weights) or --lora-target-modules among those"
                    )
            self._route = mode
        return self._route

    def sync_weights(self, version: int) -> None:
        """Push the trainer's current weights to every engine as ``str(version)``: one call, any route."""
        route = self.weight_route()
        if route == "adapter" and self.engines.supports_tensors:  # embedded engines: the adapter through Ray
            self.trainers.push_adapter(self.engines.actors, str(version))
            self.routes_taken.append(route)
            return
        if route == "adapter":  # launched servers: a PEFT folder each loads by name (SGLang's /load_lora_adapter)
            previous = getattr(self, "_adapter_folder", None)
            # absolute: the servers are other processes, maybe with another working directory
            adapters = (Path(self._sync_dir()) / f"adapter-{version}").resolve()
            if self.cfg.train.policy:  # several policies: a folder each, loaded under the policy's name
                for policy in self.cfg.train.policy:
                    self.trainers.save_adapter_folder(adapters / policy, policy)
                    last = policy == self.cfg.train.policy[-1]
                    self.engines.load_adapter(policy, str(adapters / policy), str(version), last=last)
            else:
                self.trainers.save_adapter_folder(adapters)
                self.engines.load_adapter(POLICY_ADAPTER, str(adapters), str(version))
            self._adapter_folder = adapters  # the latest stays: a restarted server loads it
            if previous is not None and previous != adapters:
                shutil.rmtree(previous, ignore_errors=True)
            self.routes_taken.append(route)
            return
        targets = self.engines.actors if route in ("shm", "object_store") else self.engines.urls
        folder = push_folder(route, self.engines, self._sync_dir())
        taken = self.trainers.push_weights(route, targets, str(version), folder=folder, api_key=self.engines.api_key)
        if taken != route:  # shared memory fell back to the object store (said once, in the trainer's log)
            self._route = taken
        self.routes_taken.append(taken)
        if route == "disk" and hasattr(self.engines, "record_weights"):  # a restarted server loads these first
            self.engines.record_weights(str(Path(self._sync_dir()) / f"weights-{version}"), str(version))

    def _same_node(self) -> bool:
        """Every engine shares rank 0's node (so shared memory reaches them)."""
        return set(self.engines.node_ids()) == {self.trainers.node_id()}

    def _sync_dir(self) -> str:
        base = Path(self.cfg.save) if self.cfg.save else Path.cwd() / ".agentrl"
        return str(base / "weight_sync")

    def _context(self, args: Any, resume_step: int | None, curve_key: str = "reward_mean") -> Any:
        """The episodes' context (router over the run's engines, chat template) and the metrics logger."""
        cfg = self.cfg
        from agentrl.rollout.context import run_context  # the engines' HTTP clients: not on `import agentrl`

        ctx, tokenizer, template = run_context(cfg, self.checkpoint, self.engines.urls, self.engines.api_key)
        engine = ctx.engine
        if cfg.rollout_return_routed_experts:
            _check_routed_experts(engine)
        self.env_pool = ctx.executor
        self.ctx = ctx  # closed with the run (its engine clients), after the loop
        bind_engine_args(args, engine, tokenizer, template, self.engines.urls)
        self.metrics = MetricsLogger(
            cfg.save,
            tensorboard=cfg.tensorboard,
            wandb=cfg.wandb,
            wandb_project=cfg.wandb_project,
            config=config_dict(cfg),
            total_steps=cfg.num_rollout,
            resume_step=resume_step,
            curve_key=curve_key,
        )
        return ctx

    def build_loop(self, run: ResolvedRun) -> Any:
        """The run's :class:`~agentrl.runtime.loop.TrainLoop`: its rollout side, its recipe, the engines' hooks
        (weight pushes, their guard, colocated memory) and the observers (metrics, eval, peak memory)."""
        from agentrl.runtime.loop import EngineHooks, Observers, TrainLoop
        from agentrl.runtime.recipes import recipe_for

        cfg = self.cfg
        args = run.args
        sft = run.demos is not None
        ctx = self._context(args, run.resume_step, curve_key="loss" if sft else "reward_mean")
        engine = ctx.engine
        collector: Any
        if run.demos is not None:
            collector = DemoCollector(cfg, run.demos)
        else:
            if cfg.rollout_num_workers > 1:
                from agentrl.runtime.rollout_workers import RolloutWorkerGroup

                self.rollout_workers = RolloutWorkerGroup(
                    cfg,
                    self.checkpoint,
                    self.engines.urls,
                    self.engines.api_key,
                    placement_group=self.worker_placement,
                    args=args,
                )
                nodes = len(set(self.rollout_workers.node_ids()))
                print(f"{cfg.rollout_num_workers} rollout workers on {nodes} node(s)", file=sys.stderr)
            collector = EpisodeCollector(
                cfg,
                ctx=ctx,
                env_factory=run.env_factory,
                source=run.source,
                args=args,
                custom_generate=run.custom_generate,
                custom_reward=run.custom_rm,
                group_filter=run.group_filter,
                sample_filter=run.sample_filter,
                workers=self.rollout_workers,
            )
        evaluator = (
            _evaluator(
                cfg, ctx, run.env_factory, run.eval_sets, run.custom_rm, args, None if sft else run.custom_generate
            )
            if run.eval_sets
            else None
        )
        return TrainLoop(
            cfg,
            collector=collector,
            recipe=recipe_for(
                cfg, self.trainers, critic=self.critic, n_demos=len(run.demos) if run.demos is not None else None
            ),
            engines=EngineHooks(
                push=self.sync_weights,
                guard=None if sft else self._update_guard(engine),
                memory=_EngineMemory(engine, self.engines) if cfg.colocate and not sft else None,
            ),
            observers=Observers(metrics=self.metrics, evaluator=evaluator, memory_probe=self.peak_memory),
        )

    def peak_memory(self) -> dict[str, float]:
        """Peak resident memory (MiB) of every kind of actor so far, for ``metrics.jsonl``.

        ``trainer_`` (largest rank), ``critic_`` (ppo), ``engine_`` (embedded engines; launched SGLang
        servers are other processes and are not measured), ``rollout_worker_`` (largest worker, with
        ``--rollout-num-workers`` > 1) and ``driver_peak_rss_mb``.
        """
        out = {"driver_peak_rss_mb": peak_rss_mb(), "trainer_peak_rss_mb": self.trainers.peak_rss_mb()}
        if self.critic is not None:
            out["critic_peak_rss_mb"] = self.critic.peak_rss_mb()
        if self.rollout_workers is not None and (mb := self.rollout_workers.peak_rss_mb()) is not None:
            out["rollout_worker_peak_rss_mb"] = mb
        engine = getattr(self.engines, "peak_rss_mb", None)
        if engine is not None and (mb := engine()) is not None:
            out["engine_peak_rss_mb"] = mb
        return out

    def _update_guard(self, router: Any) -> Any:
        """Launched SGLang servers: pause generation (restarting dead servers first) around each push.

        Mode ``abort``, as slime: a synchronous run has nothing in flight at a push; in an ``--async``
        run the episodes caught mid-turn end ``aborted`` (counted, never trained on) rather than finish
        half on old and half on new weights under a version that hides it. The embedded engine
        (``--sglang-launcher agentrl``) in an async run needs no pause (unless ``--partial-rollout``: then
        every push aborts, and the episodes continue their turns on the new weights): it swaps weights between two
        decode steps (dead servers are still restarted first and the monitor held during the push). A
        server restarted since the last push (by the monitor or the guard itself) has left the NCCL
        group and may have a new URL: the router and the trainer's transport follow.
        """
        from agentrl.engines.sglang import paused_for_update
        from agentrl.rollout.context import follow_urls
        from agentrl.runtime.engine_group import SGLangEngineGroup

        group = self.engines
        if not isinstance(group, SGLangEngineGroup):
            return None
        # --partial-rollout: abort mode for every launched server, so a turn split by a push records both versions
        # a policy adapter served by name is unloaded and loaded again: requests between the two would be refused
        swaps_in_place = (
            group.launch.binary != "sglang" and not self.cfg.rollout.partial_rollout and not self.cfg.adapters_by_name
        )
        mode = None if self.cfg.async_mode and swaps_in_place else "abort"
        seen = {"restarts": list(group.restarts)}

        @contextlib.asynccontextmanager
        async def guard():
            async with paused_for_update(router, mode=mode, group=group):
                if group.restarts != seen["restarts"]:
                    seen["restarts"] = list(group.restarts)
                    for r in [router, *(self.ctx.policy_engines.values() if self.ctx is not None else ())]:
                        follow_urls(r, group.urls, group.api_key)  # each --policy's router too
                    if self.rollout_workers is not None:  # their routers too
                        await asyncio.to_thread(self.rollout_workers.follow_urls, group.urls)
                    await asyncio.to_thread(self.trainers.reset_weight_transport)
                yield

        return guard


def _check_routed_experts(router: Any) -> None:
    """--rollout-return-routed-experts: every server must have been started to report them (or each request fails)."""

    async def infos() -> list[dict[str, Any]]:
        try:
            return [await e.server_info() for e in router.engines]
        finally:
            for e in router.engines:
                await e.close()  # this loop ends here: the run's loop opens its own sessions

    try:
        answers = asyncio.run(infos())
    except Exception as exc:  # an engine or router without /get_server_info: say which flag needs it
        raise ValueError(
            f"--rollout-return-routed-experts: could not read the engines' /get_server_info ({type(exc).__name__}: "
            f"{exc}); the check needs SGLang servers reached directly"
        ) from exc
    for e, info in zip(router.engines, answers):
        if not info.get("enable_return_routed_experts"):
            raise ValueError(
                f"--rollout-return-routed-experts: {e.url} does not report routed experts (its /get_server_info has "
                "no enable_return_routed_experts: true); start SGLang with --enable-return-routed-experts (with "
                "--rollout-backend sglang: --sglang-enable-return-routed-experts) on an MoE model"
            )


def push_folder(route: str, engines: Any, sync_dir: str) -> str | None:
    """The folder a weight push names: the run's ``weight_sync`` folder for ``disk``; for ``tensor`` the launched
    ``agentrl serve`` engines' private folder (CPU tensors travel as files there), None for any other engines
    (SGLang takes CUDA handles and needs none; a folder it never made would be refused)."""
    if route != "tensor":
        return sync_dir
    ipc = getattr(engines, "ipc_folder", None)
    return str(ipc.path) if ipc is not None else None


def _launch_sglang(cfg: RunConfig, checkpoint: Path, placement: Any) -> Any:
    """``--rollout-backend sglang``: one server per engine bundle, as Ray actors, health-monitored."""
    from agentrl.runtime.engine_group import SGLangEngineGroup

    log_dir = str(Path(cfg.save) / "engine_logs") if cfg.save else None
    launch = sglang_launch(cfg, str(checkpoint), engine_gpus=placement.engine_gpus, log_dir=log_dir)
    if not launch.api_key:  # a fresh key per run: nothing else that reaches the ports can drive the servers
        import secrets

        launch.api_key = secrets.token_urlsafe(24)
    ipc = None
    by_handle = cfg.weight_sync == "tensor" or (  # as weight_route() decides it for launched servers
        cfg.weight_sync == "auto"
        and bool(placement.engine_gpus)
        and cfg.colocate
        and cfg.rollout_num_gpus_per_engine == 1
    )
    if launch.binary == "agentrl" and by_handle and launch.host in ("127.0.0.1", "::1", "localhost"):
        # tensor handles reach engines on this machine only (loopback engines are): the run's private folder
        from agentrl.engines.ipc_folder import IpcFolder

        ipc = IpcFolder.create()
        launch.weight_ipc_dir = str(ipc.path)
    if launch.binary == "agentrl" and cfg.sglang_launcher == "auto":
        log.warning(
            "--rollout-backend sglang: no SGLang with GPUs here (not installed, or --rollout-num-gpus 0); "
            "launching `agentrl serve` servers (same API and management) instead"
        )
    try:
        group = SGLangEngineGroup.start(
            launch,
            max(len(placement.engines), 1),
            num_cpus=placement.engine_cpus,
            num_gpus=placement.engine_gpus or None,
            placement=placement.engines,
        )
    except BaseException:
        if ipc is not None:
            ipc.remove()
        raise
    group.ipc_folder = ipc
    if cfg.engine_monitor_interval:
        group.start_monitor(cfg.engine_monitor_interval)
    return group


class _EngineMemory:
    """``--colocate``: engines give back their KV cache while the trainer uses the shared devices.

    Launched servers' health monitor is held meanwhile: SGLang's health check is a generation,
    which must not run on a released KV cache (nor get the server restarted for failing).
    """

    def __init__(self, engine: Any, group: Any = None):
        self.engine = engine
        self.group = group if hasattr(group, "monitor_suspended") else None
        self._hold: Any = None

    async def release(self) -> None:
        if self.group is not None:
            self._hold = self.group.monitor_suspended()
            await asyncio.to_thread(self._hold.__enter__)  # waits for a check in progress
        await self.engine.release_memory_occupation(["kv_cache"])

    async def resume(self) -> None:
        try:
            await self.engine.resume_memory_occupation(["kv_cache"])
        finally:
            if self._hold is not None:
                hold, self._hold = self._hold, None
                await asyncio.to_thread(hold.__exit__, None, None, None)


def _threads(cfg: RunConfig, placement: Any) -> tuple[int | None, int | None, int]:
    """torch threads for trainer ranks and engines on CPU, and the floor of adaptive threads.

    A synchronous loop runs one phase at a time, so each phase gets every core (actor and critic
    ranks, which train together, split them). In ``--async`` mode they run together:
    ``--cpu-threads fixed`` splits the cores evenly; ``adaptive`` still gives each every core and lets
    its :class:`~agentrl.cpu_share.CoreShare` shed the ones the other phase is using, down to that
    even split (the floor), so neither can starve the other."""
    if placement.trainer_gpus or placement.engine_gpus:
        return None, None, 1
    cores = usable_cores()
    # ppo: the critic's ranks train at the same time as the actor's, and share its thread budget
    world, engines = cfg.trainer_world_size * (2 if placement.critic else 1), max(len(placement.engines), 1)
    share = max(1, cores // (world + engines)) if cfg.async_mode else 1
    if cfg.async_mode and cfg.cpu_threads == "fixed":
        return share, share, share
    return max(1, cores // world), max(1, cores // engines), share


def _evaluator(
    cfg: RunConfig, ctx: Any, factory: Any, eval_sets: dict, custom_rm: Any, args: Any, custom_generate: Any = None
):
    if isinstance(custom_generate, BatchGenerate):  # slime: the rollout function evaluates too, told so
        custom_generate = dataclasses.replace(custom_generate, evaluation=True)

    rc = cfg.rollout
    if cfg.eval_temperature is not None:
        rc = dataclasses.replace(rc, rollout_temperature=cfg.eval_temperature)
    eval_ctx = dataclasses.replace(ctx, config=rc)

    async def run(step: int) -> dict[str, float]:
        results = await evaluate(
            eval_ctx,
            factory,
            eval_sets,
            n_samples=cfg.n_samples_per_eval_prompt,
            custom_reward=custom_rm,
            args=args,
            custom_generate=custom_generate,
        )
        out: dict[str, float] = {}
        for name, res in results.items():
            for k, v in res.items():
                if isinstance(v, (int, float)):
                    out[f"eval/{name}/{k}"] = v
        return out

    return run
