"""Sandboxed execution of model-written code: the contract, the backends and the pool.

``await create_sandbox(SandboxConfig(...))`` makes one sandbox on the chosen backend;
:func:`default_pool` is the pool :class:`agentrl.ToolEnv` takes an episode's sandbox from
(configured once per process by :func:`configure`, which ``agentrl rollout|train`` call from their
``--sandbox*`` flags). Backends: ``docker`` (a container per sandbox) and ``local`` (bubblewrap, or
a plain process with rlimits, which isolates the network but not the filesystem and says so).
"""

from __future__ import annotations

import asyncio
import logging
import shutil
import weakref

from agentrl.sandbox import docker as docker_backend
from agentrl.sandbox import local as local_backend
from agentrl.sandbox.base import (
    DEFAULT_IMAGE,
    ExecResult,
    Sandbox,
    SandboxConfig,
    SandboxError,
    Session,
    check_relative_path,
    truncate_output,
)
from agentrl.sandbox.docker import DockerSandbox
from agentrl.sandbox.local import LocalSandbox
from agentrl.sandbox.pool import SandboxPool

__all__ = [
    "DEFAULT_IMAGE",
    "ExecResult",
    "Sandbox",
    "SandboxConfig",
    "SandboxError",
    "SandboxPool",
    "Session",
    "check_relative_path",
    "configure",
    "create_sandbox",
    "close_default_pool",
    "default_pool",
    "resolve_backend",
    "truncate_output",
]

log = logging.getLogger(__name__)

_config = SandboxConfig()
_pools: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, SandboxPool] = weakref.WeakKeyDictionary()
_resolved: dict[str, str] = {}


def resolve_backend(backend: str = "auto") -> str:
    """``docker``, ``bubblewrap`` or ``process``: what ``backend`` means on this machine.

    ``auto`` picks docker when an engine answers, else bubblewrap when it works here, else the
    process fallback (with a warning: it does not isolate the filesystem). An explicit ``docker``
    that cannot be reached raises :class:`SandboxError` saying how to start an engine.
    """
    if backend in _resolved:
        return _resolved[backend]
    if backend == "docker":
        reason = docker_backend.unavailable_reason()
        if reason:
            raise SandboxError(f"docker sandbox unavailable: {reason}")
        chosen = "docker"
    elif backend == "process":
        chosen = "process"
    elif backend in ("local", "auto"):
        if backend == "auto" and docker_backend.unavailable_reason() is None:
            chosen = "docker"
        elif local_backend.bubblewrap_unavailable_reason() is None:
            chosen = "bubblewrap"
        else:
            chosen = "process"
    else:
        raise ValueError(f"sandbox backend {backend!r}: choose auto, docker, local or process")
    if chosen == "process":
        log.warning(
            "sandbox backend 'process': model-written code runs as a plain process with rlimits and no "
            "network, but what stays open is: it can READ the host filesystem, see every host process and its "
            "command line (tokens passed as arguments included), connect to the host's unix sockets at "
            "filesystem paths, and write the host's /dev/shm up to its memory limit (as root, a sandbox's files "
            "there are removed on reset and close; as a normal user they stay). Install bubblewrap "
            "(apt-get install bubblewrap) or start a Docker engine for real isolation.%s",
            "" if shutil.which("bwrap") else " (bwrap not found)",
        )
    _resolved[backend] = chosen
    return chosen


async def create_sandbox(config: SandboxConfig | None = None) -> Sandbox:
    """A new sandbox on ``config.backend`` (see :func:`resolve_backend`). Close it when done."""
    config = config or _config
    config.validate()
    chosen = resolve_backend(config.backend)
    if chosen == "docker":
        return await DockerSandbox.create(config)
    return await LocalSandbox.create(config, bubblewrap=chosen == "bubblewrap")


def configure(config: SandboxConfig) -> None:
    """Set the process-wide sandbox config used by :func:`default_pool` (validated now).

    Call it before a command's event loop starts; pools already made keep their config until
    :func:`close_default_pool`.
    """
    global _config
    config.validate()
    _config = config


def default_pool() -> SandboxPool:
    """The process's pool for the running event loop, created on first use from :func:`configure`'s config."""
    loop = asyncio.get_running_loop()
    pool = _pools.get(loop)
    if pool is None:
        config = _config
        pool = SandboxPool(lambda: create_sandbox(config), config)
        _pools[loop] = pool
    return pool


async def close_default_pool() -> None:
    """Destroy the running loop's default pool (its idle sandboxes); commands call it when done.

    Without it idle sandboxes would live until the process exits (containers are then removed by
    the exit reaper, local sandboxes by the next process's reaper).
    """
    pool = _pools.pop(asyncio.get_running_loop(), None)
    if pool is not None:
        await pool.close()
