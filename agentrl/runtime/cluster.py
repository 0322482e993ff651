"""Ray: start or join a cluster, and reserve devices for trainer and engine actors.

Locally, ``ray.init()`` starts a private cluster quietly (dashboard off, logs not echoed); with
``--ray-address`` or ``RAY_ADDRESS`` it joins an existing one. Ray 2.60 enables token
authentication for new local clusters (the token lands in ``~/.ray/auth_token``); it stays on,
``RAY_AUTH_MODE=disabled`` turns it off. A private cluster lives on loopback: Ray otherwise binds its
GCS, raylet and object store to the machine's network address and talks to itself through it, which a
one-machine run has no reason to do (see :func:`init_ray`).

Placement: one placement group holds a bundle per trainer rank and per engine. ``--colocate``
puts each engine in the bundle of a trainer rank (they share the device; the engine releases its
memory while the trainer works); otherwise engines get bundles of their own
(``--rollout-num-gpus``, ``--rollout-num-gpus-per-engine``). With ``--advantage-estimator ppo`` the
critic has as many ranks as the actor, each in a bundle of its own (a device of its own on GPU), or
in its trainer rank's bundle with ``--colocate`` (actor, critic and engine then split the device
0.34 / 0.33 / 0.33 and the critic keeps its memory). On a CPU machine a bundle is CPUs.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from agentrl.config import RunConfig

log = logging.getLogger(__name__)


def peak_rss_mb() -> float:
    """This process's peak resident memory so far, in MiB (``VmHWM``: the high-water mark the OS kept).

    Every actor reports its own (trainer ranks, engines), so ``metrics.jsonl`` shows which one a
    memory limit must cover; a high-water mark, not a sample, so no spike between two reads hides.
    """
    import resource
    import sys

    try:  # Linux: this process image's own high-water mark (ru_maxrss survives exec: a child started by
        # a big parent would report the parent's peak)
        for line in open("/proc/self/status"):
            if line.startswith("VmHWM:"):
                return round(int(line.split()[1]) / 1024, 1)
    except (OSError, ValueError, IndexError):
        pass
    kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return round(kib / (1024 * 1024 if sys.platform == "darwin" else 1024), 1)  # bytes on macOS, KiB on Linux


def init_ray(address: str | None = None, *, num_cpus: int | None = None) -> None:
    """Start (or join) Ray once per process; quiet by default."""
    import ray

    if ray.is_initialized():
        return
    address = address or os.environ.get("RAY_ADDRESS")
    kwargs: dict[str, Any] = {
        "include_dashboard": False,
        "log_to_driver": False,
        "configure_logging": True,
        "logging_level": logging.WARNING,
    }
    if address:
        ray.init(address=address, **kwargs)
    else:
        with _loopback_only():
            ray.init(num_cpus=num_cpus or os.cpu_count() or 1, **kwargs)


@contextlib.contextmanager
def _loopback_only() -> Iterator[None]:
    """While a private local cluster starts, make it bind and dial 127.0.0.1 only, as Ray does on macOS.

    ``ray.init(_node_ip_address="127.0.0.1")`` is not enough: Ray rewrites a loopback address to the
    node's network address. Its own switch for single-machine clusters is read from the environment by
    the processes it starts (GCS and raylet inherit it, and the workers the raylet's) and from a module
    constant in this one; both are put back once the cluster is up (the driver then reads its node's
    address, 127.0.0.1, from the running node), so a later cluster this process joins and the processes
    it starts are untouched. A value the user set is left alone.
    """
    try:
        from ray._private import ray_constants
    except ImportError:  # a Ray without that module: start as it would
        yield
        return
    name = getattr(ray_constants, "ENABLE_RAY_CLUSTERS_ENV_VAR", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER")
    if name in os.environ:
        yield
        return
    before = getattr(ray_constants, "ENABLE_RAY_CLUSTER", True)
    os.environ[name] = "0"
    ray_constants.ENABLE_RAY_CLUSTER = False
    try:
        yield
    finally:
        os.environ.pop(name, None)
        ray_constants.ENABLE_RAY_CLUSTER = before


@dataclass
class Placement:
    """Where each actor goes: ``(placement_group, bundle_index)`` per trainer rank and per engine."""

    trainer: list[tuple[Any, int]]
    engines: list[tuple[Any, int]]
    trainer_gpus: float
    engine_gpus: float
    trainer_cpus: float
    engine_cpus: float
    group: Any = None
    critic: list[tuple[Any, int]] = field(default_factory=list)
    """ppo: one bundle per critic rank (the trainer's own bundles with ``--colocate``)."""
    critic_gpus: float = 0.0

    def release(self) -> None:
        """Give the reserved bundles back to Ray (the actors in them must be gone)."""
        if self.group is not None:
            from ray.util.placement_group import remove_placement_group

            remove_placement_group(self.group)
            self.group = None


def actor_options(num_cpus: float, num_gpus: float, bundle: tuple[Any, int] | None = None) -> dict[str, Any]:
    """Ray actor options: resources, pinned to ``bundle`` = ``(placement_group, bundle_index)`` when given."""
    opts: dict[str, Any] = {"num_cpus": num_cpus, "num_gpus": num_gpus}
    if bundle is not None:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        opts["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
            placement_group=bundle[0], placement_group_bundle_index=bundle[1]
        )
    return opts


def plan_placement(cfg: RunConfig) -> Placement:
    """Reserve bundles for the run and wait until Ray grants them (fails fast with what is missing)."""
    import ray
    from ray.util.placement_group import placement_group

    world = cfg.trainer_world_size
    critics = world if cfg.train.advantage_estimator == "ppo" else 0
    gpus_per_trainer = 1.0 if cfg.actor_num_gpus_per_node else 0.0
    if cfg.engine_url:
        n_engines = 0  # engines someone else runs need no bundles
    elif cfg.rollout_num_gpus:
        n_engines = cfg.rollout_num_gpus // cfg.rollout_num_gpus_per_engine
    else:
        n_engines = cfg.num_engines
    total_cpus = float(ray.cluster_resources().get("CPU", 1.0))
    if gpus_per_trainer:
        bundles = [{"GPU": 1.0, "CPU": 1.0} for _ in range(world)]
        engine_gpus = float(cfg.rollout_num_gpus_per_engine)
        if not cfg.colocate:
            bundles += [{"GPU": engine_gpus, "CPU": 1.0} for _ in range(n_engines)]
            bundles += [{"GPU": 1.0, "CPU": 1.0} for _ in range(critics)]
        if cfg.colocate:
            t_gpu, e_gpu, c_gpu = (0.34, 0.33, 0.33) if critics else (0.5, 0.5, 0.0)
        else:
            t_gpu, e_gpu, c_gpu = 1.0, engine_gpus, 1.0
    else:
        # CPU: trainer ranks, critic ranks and engines share the node's cores; bundles only order the actors.
        own = world + (0 if cfg.colocate else n_engines + critics)
        cpus = min(1.0, total_cpus / max(own, 1))
        bundles = [{"CPU": cpus} for _ in range(own)]
        t_gpu = e_gpu = c_gpu = 0.0
    pg = placement_group(bundles, strategy="PACK")
    try:
        ray.get(pg.ready(), timeout=120)
    except Exception as exc:
        raise RuntimeError(
            f"Ray could not reserve {bundles} (available: {ray.available_resources()}); "
            "lower --actor-num-gpus-per-node / --rollout-num-gpus or add nodes"
        ) from exc
    trainer = [(pg, i) for i in range(world)]
    if cfg.colocate:
        engines = [(pg, i % world) for i in range(n_engines)]
        critic = [(pg, i) for i in range(critics)]
    else:
        engines = [(pg, world + i) for i in range(n_engines)]
        critic = [(pg, world + n_engines + i) for i in range(critics)]
    share = bundles[0].get("CPU", 1.0)
    t_cpu = share / (3 if critics else 2) if cfg.colocate else share
    return Placement(trainer, engines, t_gpu, e_gpu, t_cpu, t_cpu, pg, critic=critic, critic_gpus=c_gpu)
