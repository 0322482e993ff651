"""The ``docker`` sandbox backend: one locked-down container per sandbox, driven through the Engine API.

Each :class:`DockerSandbox` is a container with no network (``network_mode=none``), memory =
memory+swap = ``memory_mb``, a pids limit, ``cpus``, ulimits on file size and open files, a
read-only root, ``cap_drop=ALL`` and ``no-new-privileges``, running as the numeric non-root uid
10001. ``/scratch`` is a tmpfs-backed volume capped at ``scratch_mb`` (a volume, not ``--tmpfs``, so
the engine can copy files into it on a read-only container); ``/tmp`` and ``/dev/shm`` are small
tmpfs. Files there live in memory and count toward ``memory_mb``. Nothing of the host's environment
enters: each program starts under ``env -i`` with ``PATH``, ``HOME``, ``LANG``, the image's own
``ENV``, the config's ``env`` and the call's ``env`` (later ones win). ``DOCKER_HOST`` is honoured,
so Podman's Docker-compatible socket works too.

Pid 1 is a tiny shell loop (:data:`~agentrl.sandbox.docker_exec.PID1`) that reaps orphans and
exits at the sandbox's ``ttl``, so a container outlives a SIGKILLed owner by at most ``ttl``
(``auto_remove`` then deletes it). Every container carries the labels ``agentrl.sandbox``,
``agentrl.run_id``, ``agentrl.owner_pid``, ``agentrl.owner_host`` and ``agentrl.expires_at``;
:func:`reap` removes the ones whose owner died on this host, whose ttl passed, or (``run_id``) of
one run. It runs once per process before the first container is made, and at exit for the
process's own run (``agentrl sandbox reap [--all]`` runs it by hand).

How programs run inside (supervised calls that never leave processes behind, timeouts, sessions,
the exec streams) is :mod:`agentrl.sandbox.docker_exec`. Calls on one sandbox run one at a time (a
lock), as a call's cleanup kills every other process but pid 1 and the live sessions; a cancelled
call (a tool's shorter timeout) kills its program before it lets go of the lock. Blocking engine
calls run in threads (``asyncio.to_thread``); a running program holds no thread.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import importlib.util
import logging
import os
import shlex
import socket
import threading
import time
import uuid
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

from agentrl.sandbox.base import SCRATCH, ExecResult, Sandbox, SandboxConfig, SandboxError, check_relative_path
from agentrl.sandbox.docker_exec import (
    CALL,
    KILL,
    OOM_MARK,
    PID1,
    READ,
    RESET,
    SESSION,
    Capped,
    DockerSession,
    ExecStream,
    SandboxGone,
    container_gone,
    engine_error,
    env_prefix,
    exit_code,
    open_exec,
    program_argv,
    scratch_tar,
    settle,
)
from agentrl.sandbox.image import SANDBOX_UID, docker_client, ensure_image

__all__ = ["DockerSandbox", "DockerSession", "docker_client", "reap", "run_id", "unavailable_reason"]

log = logging.getLogger(__name__)

USER = f"{SANDBOX_UID}:{SANDBOX_UID}"
LABEL = "agentrl.sandbox"
BASE_ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": SCRATCH, "LANG": "C.UTF-8"}
Ender = Callable[[ExecStream], Awaitable[object]]  # stops what a started exec runs

# -- engine connection ---------------------------------------------------------------------------


_reason: list[tuple[float, str | None]] = []


def unavailable_reason() -> str | None:
    """None when a Docker engine answers, else one line saying what to do (cached for 10 s)."""
    if _reason and time.monotonic() - _reason[0][0] < 10.0:
        return _reason[0][1]
    host = os.environ.get("DOCKER_HOST", "unix:///var/run/docker.sock")
    if importlib.util.find_spec("docker") is None:
        reason: str | None = "the `docker` Python package is missing: pip install docker, or use --sandbox local"
    else:
        try:
            docker_client().ping()
            reason = None
        except Exception as e:  # connection refused, no socket, permission denied ...
            docker_client.cache_clear()
            why = str(e).splitlines()[0][:160] if str(e) else type(e).__name__
            reason = (
                f"no Docker engine at {host} ({why}): start one with `dockerd &` (or "
                f"`systemctl start docker`; Podman: export DOCKER_HOST=unix://$XDG_RUNTIME_DIR/podman/podman.sock) "
                f"or use --sandbox local"
            )
    _reason[:] = [(time.monotonic(), reason)]
    return reason


_run_ids: dict[int, str] = {}


def run_id() -> str:
    """This process's run id (labels its containers; a forked child gets its own)."""
    pid = os.getpid()
    if pid not in _run_ids:
        _run_ids[pid] = uuid.uuid4().hex[:16]
    return _run_ids[pid]


# -- the reaper ------------------------------------------------------------------------------------


def _stale(labels: Mapping[str, str], host: str, now: float) -> bool:
    try:
        if float(labels.get("agentrl.expires_at", "inf")) < now:
            return True
        pid = int(labels.get("agentrl.owner_pid", "0"))
    except ValueError:
        return False
    if labels.get("agentrl.owner_host") != host or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True  # the owner died without closing it (SIGKILL, OOM killer)
    except PermissionError:
        pass  # alive, another user's
    return False


def reap(*, run_id: str | None = None, everything: bool = False) -> int:
    """Remove agentrl sandbox containers that nobody will close; returns how many were removed.

    Removed: ``everything`` labelled ``agentrl.sandbox``; else those whose ``expires_at`` passed,
    whose owner process is dead on this host, or (given) of ``run_id``. Dangling scratch volumes
    left by removed containers go too.
    """
    import docker

    client = docker_client()
    host, now = socket.gethostname(), time.time()
    # ignore_removed: one that goes (its ttl, auto-remove, another reap) between docker's list and its inspect is gone
    doomed = [
        c
        for c in client.containers.list(all=True, filters={"label": f"{LABEL}=1"}, ignore_removed=True)
        if everything
        or (run_id is not None and c.labels.get("agentrl.run_id") == run_id)
        or _stale(c.labels, host, now)
    ]

    def remove(c: Any) -> int:
        try:
            c.remove(force=True, v=True)
            return 1
        except docker.errors.NotFound:
            return 0
        except docker.errors.APIError as e:
            if e.status_code != 409:
                return _warn(f"could not remove sandbox container {c.short_id}: {e}")
            # 409: another remover (auto-remove, a concurrent reap) is at it: gone when this returns, as if removed here
            return _wait_gone(c, docker.errors.NotFound)

    # plain threads: an executor refuses work during interpreter shutdown, when the atexit hook runs
    counts = [0] * len(doomed)
    workers = [
        threading.Thread(target=lambda i=i: counts.__setitem__(i, remove(doomed[i]))) for i in range(len(doomed))
    ]
    for i in range(0, len(workers), 8):
        for w in workers[i : i + 8]:
            w.start()
        for w in workers[i : i + 8]:
            w.join()
    removed = sum(counts)
    for vol in client.volumes.list(filters={"label": f"{LABEL}=1", "dangling": True}):
        try:
            vol.remove(force=True)
        except docker.errors.APIError:
            pass  # taken by a container created meanwhile
    if removed:
        log.info("reaped %d agentrl sandbox container(s)", removed)
    return removed


def _warn(msg: str) -> int:
    log.warning(msg)
    return 0


REMOVAL_WAIT_S = 30.0
"""Seconds :func:`reap` waits for a container another remover is removing (Docker answers 409) to be gone."""


def _wait_gone(c: Any, not_found: type[Exception]) -> int:
    """Wait until ``c`` no longer exists (another process's removal finishes); 0 either way, warned on timeout.

    Whoever reaps a dead worker's sandboxes relies on them being gone when :func:`reap` returns (its replacement
    starts next, the run may end); returning at Docker's 409 would leave them for a moment, or for good if that
    other remover dies mid-way."""
    deadline = time.monotonic() + REMOVAL_WAIT_S
    while time.monotonic() < deadline:
        try:
            c.reload()
        except not_found:
            return 0
        time.sleep(0.05)
    return _warn(f"sandbox container {c.short_id} was still being removed after {REMOVAL_WAIT_S:g} s")


_reaper_lock = threading.Lock()
_reaped_for: set[int] = set()


def _first_use() -> None:
    """Once per process: reap what dead runs left, and remove this run's containers at exit."""
    with _reaper_lock:
        pid = os.getpid()
        if pid in _reaped_for:
            return
        _reaped_for.add(pid)
        try:
            reap()
        except Exception as e:  # never block sandbox creation on cleanup of others
            log.warning("sandbox reaper failed: %s", e)
        atexit.register(_reap_own, run_id(), pid)


def _reap_own(rid: str, pid: int) -> None:
    if os.getpid() == pid:  # not in a forked child that inherited the hook
        try:
            reap(run_id=rid)
        except Exception:
            pass


# -- the sandbox ------------------------------------------------------------------------------------

_image_env: dict[str, dict[str, str]] = {}


def _image_environment(image: str) -> dict[str, str]:
    """``BASE_ENV`` overlaid with the image's own ``ENV`` (a user image's ``PATH``, ``PYTHONPATH`` ...)."""
    if image not in _image_env:
        ensure_image(image)
        pairs = docker_client().images.get(image).attrs["Config"].get("Env") or []
        _image_env[image] = {**BASE_ENV, **dict(p.split("=", 1) for p in pairs if "=" in p)}
    return _image_env[image]


def _labels(config: SandboxConfig) -> dict[str, str]:
    return {
        LABEL: "1",
        "agentrl.run_id": run_id(),
        "agentrl.owner_pid": str(os.getpid()),
        "agentrl.owner_host": socket.gethostname(),
        "agentrl.expires_at": str(int(time.time() + config.ttl)),
    }


def _create_container(config: SandboxConfig) -> tuple[Any, dict[str, str]]:
    """Blocking: ensure the image, reap once, create and start the container; returns it and its base env."""
    import docker
    from docker.types import DriverConfig, Mount, Ulimit

    env = _image_environment(config.image)
    _first_use()
    labels = _labels(config)
    small = min(config.scratch_mb, 64)
    scratch = Mount(
        SCRATCH,
        None,
        type="volume",
        labels=labels,
        driver_config=DriverConfig(
            "local",
            {
                "type": "tmpfs",
                "device": "tmpfs",
                "o": f"size={config.scratch_mb}m,uid={SANDBOX_UID},gid={SANDBOX_UID},mode=0755",
            },
        ),
    )
    fsize = config.file_size_mb << 20
    try:
        container = docker_client().containers.run(
            config.image,
            entrypoint=["/bin/sh", "-c", PID1, "agentrl-init", str(int(config.ttl))],
            user=USER,
            working_dir=SCRATCH,
            environment=dict(BASE_ENV),
            labels=labels,
            detach=True,
            auto_remove=True,
            network_mode="none",
            read_only=True,
            mem_limit=f"{config.memory_mb}m",
            memswap_limit=f"{config.memory_mb}m",
            pids_limit=config.pids,
            nano_cpus=int(config.cpus * 1e9),
            cap_drop=["ALL"],
            security_opt=["no-new-privileges"],
            ulimits=[Ulimit(name="fsize", soft=fsize, hard=fsize), Ulimit(name="nofile", soft=1024, hard=1024)],
            mounts=[scratch],
            tmpfs={"/tmp": f"size={small}m,mode=1777"},
            shm_size=f"{small}m",
            hostname="sandbox",
        )
        return container, env
    except docker.errors.ImageNotFound as e:
        raise SandboxError(f"sandbox image {config.image!r} is missing: {e}; run `agentrl sandbox build`") from None
    except docker.errors.APIError as e:
        raise engine_error(e, "creating a sandbox container") from None


class DockerSandbox(Sandbox):
    """A sandbox backed by one container; see the module docstring for what is locked down and how."""

    isolation = "docker"

    def __init__(self, container: Any, config: SandboxConfig, env: Mapping[str, str] | None = None) -> None:
        self.container, self.config = container, config
        self._env = dict(BASE_ENV if env is None else env)
        self._sessions: dict[str, DockerSession] = {}
        self._closed = False
        self._lock = asyncio.Lock()  # one program at a time: a call's cleanup kills whatever else runs

    @classmethod
    async def create(cls, config: SandboxConfig) -> DockerSandbox:
        """A new running container for ``config`` (builds the default image on first use)."""
        config.validate()
        reason = await asyncio.to_thread(unavailable_reason)
        if reason:
            raise SandboxError(f"docker sandbox unavailable: {reason}")
        container, env = await asyncio.to_thread(_create_container, config)
        return cls(container, config, env)

    def __repr__(self) -> str:
        return f"DockerSandbox({self.container.short_id}, image={self.config.image!r})"

    # -- execs --

    async def _start(self, argv: list[str], *, stdin: bool, end: Ender | None = None) -> ExecStream:
        """Start an exec. Cancelled meanwhile, it starts anyway (a thread cannot be stopped): ``end``
        then stops what it runs (helpers that end by themselves need none) before the cancel goes on."""
        if self._closed:
            raise SandboxError("the sandbox is closed")
        opening = asyncio.ensure_future(
            asyncio.to_thread(
                open_exec, docker_client().api, self.container.id, argv, stdin=stdin, user=USER, workdir=SCRATCH
            )
        )
        try:
            return await asyncio.shield(opening)
        except asyncio.CancelledError:
            await settle(self._abandon(opening, end))
            raise
        except SandboxError:
            raise
        except Exception as e:
            raise engine_error(e, f"starting {argv[-1][:40]!r}") from None

    @staticmethod
    async def _abandon(opening: asyncio.Future[ExecStream], end: Ender | None) -> None:
        with contextlib.suppress(Exception):  # it never started, or the container is gone (its processes with it)
            ex = await opening
            try:
                if end is not None:
                    await end(ex)
            finally:
                ex.close()

    async def _exec_quiet(self, argv: list[str], timeout: float = 30.0) -> tuple[int | None, bytes, bytes]:
        """Run a helper (as the sandbox user) to the end: exit code, stdout, stderr (4 KiB each)."""
        ex = await self._start(argv, stdin=False)
        out, err = Capped(4096), Capped(4096)
        try:
            await asyncio.wait_for(ex.pump(out, err), timeout)
        finally:
            ex.close()
        return await exit_code(docker_client().api, ex.id), bytes(out.head), bytes(err.head)

    async def _kill_sid(self, sid: int) -> None:
        await self._exec_quiet(["/bin/sh", "-c", KILL, "agentrl-kill", "only", str(sid)])

    async def _stop(self, ex: ExecStream, out: Capped, err: Capped) -> None:
        """End a call early: kill its whole tree (all but pid 1 and the live sessions), read its stream to
        the end. When no exec can (a fork bomb holds every pid, or keeps forking), pid 1 kills everything
        on SIGUSR1, and the sessions are lost too."""
        try:
            rc, _, _ = await self._exec_quiet(["/bin/sh", "-c", KILL, "agentrl-kill", "except", f"1 {self._keep()}"])
        except SandboxGone:
            raise
        except (SandboxError, TimeoutError):
            rc = None
        # 137: the call's own supervisor, woken by its program's death, killed this helper while reaping the rest
        if rc in (0, 137) and (await self._drain(ex, out, err) or rc == 0):
            return
        for s in self._sessions.values():
            s.mark_killed()
        self._sessions.clear()
        try:
            await asyncio.to_thread(self.container.kill, "SIGUSR1")
        except Exception as e:
            raise engine_error(e, "killing a timed-out program") from None
        await self._drain(ex, out, err)

    @staticmethod
    async def _drain(ex: ExecStream, out: Capped, err: Capped) -> bool:
        """Read a killed call's stream to its end (2 s at most); whether it ended."""
        try:
            await asyncio.wait_for(ex.pump(out, err), 2.0)
            return True
        except TimeoutError:
            return False

    def _keep(self) -> str:
        return " ".join(str(s.sid) for s in self._sessions.values() if s.alive and s.sid > 1)

    # -- the Sandbox API --

    async def run(
        self,
        command: str | Sequence[str] | None = None,
        *,
        code: str | None = None,
        stdin: str | bytes | None = None,
        timeout: float | None = None,
        files: Mapping[str, str | bytes] | None = None,
        env: Mapping[str, str] | None = None,
    ) -> ExecResult:
        argv = program_argv(command, code)
        prefix = env_prefix(self._env, self.config.env, env)
        limit = self.config.timeout if timeout is None else float(timeout)
        if limit <= 0:
            raise ValueError(f"timeout must be > 0 seconds, got {timeout}")
        data = stdin.encode() if isinstance(stdin, str) else (bytes(stdin) if stdin is not None else None)
        if files:
            await self.write_files(files)
        async with self._lock:
            return await self._call(argv, prefix, data, limit)

    async def _call(self, argv: list[str], prefix: list[str], data: bytes | None, limit: float) -> ExecResult:
        started = time.monotonic()
        out, err = Capped(self.config.max_output_bytes), Capped(self.config.max_output_bytes)
        ex = await self._start(
            [*prefix, "/bin/sh", "-c", CALL, "sh", self._keep(), *argv],
            stdin=data is not None,
            end=lambda ex: self._stop(ex, out, err),
        )
        timed_out = False
        try:
            try:
                await asyncio.wait_for(ex.pump(out, err, data), limit)
            except TimeoutError:
                timed_out = True
            except BaseException:  # cancelled: the program must not outlive the call (nor overlap the next)
                with contextlib.suppress(Exception):
                    await settle(self._stop(ex, out, err))
                raise
            duration = time.monotonic() - started
            if timed_out:
                await settle(self._stop(ex, out, err))
        finally:
            ex.close()
        rc = None if timed_out else await exit_code(docker_client().api, ex.id)
        if rc == 126 and out.head.startswith(b"OCI runtime exec failed"):  # the engine could not start it
            raise SandboxError(
                f"the sandbox cannot start programs (memory or pids used up?): {out.head.decode()[:300]}"
            )
        return self._result(rc, out, err, timed_out, duration)

    def _result(self, rc: int | None, out: Capped, err: Capped, timed_out: bool, duration: float) -> ExecResult:
        oom = err.tail.endswith(OOM_MARK)
        if oom:  # the supervisor saw the memory cgroup's OOM killer fire during the call
            err.total -= len(OOM_MARK)
            del err.head[err.total :]
        stdout, cut_out = out.text()
        stderr, cut_err = err.text()
        if oom:
            stderr += (
                "\n" if stderr and not stderr.endswith("\n") else ""
            ) + f"[killed: out of memory (limit {self.config.memory_mb} MB)]"
        return ExecResult(
            stdout,
            stderr,
            None if timed_out or oom else rc,
            timed_out=timed_out,
            duration=duration,
            truncated=cut_out or cut_err,
        )

    async def write_files(self, files: Mapping[str, str | bytes]) -> None:
        data = scratch_tar(files)
        if self._closed:
            raise SandboxError("the sandbox is closed")
        api = docker_client().api

        def put() -> None:  # put_archive, refusing to replace a dir (or a planted symlink) by a non-dir
            res = api._put(
                api._url("/containers/{0}/archive", self.container.id),
                data=data,
                params={"path": SCRATCH, "noOverwriteDirNonDir": "true"},
            )
            api._raise_for_status(res)

        try:
            await asyncio.to_thread(put)
        except Exception as e:
            import docker

            if isinstance(e, docker.errors.APIError) and not container_gone(e):
                raise OSError(f"could not write {sorted(files)} into {SCRATCH}: {e.explanation or e}") from None
            raise engine_error(e, "writing files") from None

    async def read_file(self, path: str, *, max_bytes: int | None = None) -> bytes:
        rel = check_relative_path(path)
        if max_bytes is not None and int(max_bytes) < 0:
            raise ValueError(f"max_bytes must be >= 0, got {max_bytes}")
        out, err = Capped(1 << 62 if max_bytes is None else int(max_bytes)), Capped(4096)
        async with self._lock:
            ex = await self._start(
                ["/bin/sh", "-c", READ, "agentrl-read", rel, "all" if max_bytes is None else str(int(max_bytes))],
                stdin=False,
            )
            try:
                await asyncio.wait_for(ex.pump(out, err), max(60.0, self.config.timeout))
            except TimeoutError:
                raise OSError(f"{path}: reading it timed out (a fifo?)") from None
            finally:
                ex.close()
            rc = await exit_code(docker_client().api, ex.id)
        if rc == 0:
            return bytes(out.head)
        errors = {3: FileNotFoundError, 4: IsADirectoryError, 5: PermissionError}
        raise errors.get(rc, OSError)(
            f"{path}: cannot read it in {SCRATCH} ({err.head.decode(errors='replace').strip() or f'exit {rc}'})"
        )

    async def session(self, name: str, argv: Sequence[str], env: Mapping[str, str] | None = None) -> DockerSession:
        s = self._sessions.get(name)
        if s is not None and s.alive:
            return s
        if s is not None:
            await s.kill()
        argv = program_argv(list(argv), None)
        ex = await self._start(
            [*env_prefix(self._env, self.config.env, env), "/bin/sh", "-c", SESSION, "sh", *argv],
            stdin=True,
            end=lambda ex: DockerSession(ex, self._kill_sid).discard(),
        )
        s = DockerSession(ex, self._kill_sid)
        try:
            await s._start(timeout=30.0)
        except (TimeoutError, EOFError, ValueError) as e:
            await s.kill()
            raise SandboxError(
                f"session {name!r} ({shlex.join(argv)[:80]}) did not start: {type(e).__name__} {e}"
            ) from None
        except BaseException:  # cancelled: a session nobody holds would run until the reset
            await settle(s.discard())
            raise
        self._sessions[name] = s
        return s

    async def reset(self) -> None:
        for s in self._sessions.values():
            s.mark_killed()
        self._sessions.clear()
        why = ""
        for attempt in range(4):
            try:
                rc, _, err = await self._exec_quiet(["/bin/sh", "-c", RESET, "agentrl-reset"])
                if rc == 0:
                    return
                why = err.decode(errors="replace").strip() or f"exit {rc}"
            except SandboxGone:
                raise
            except (SandboxError, TimeoutError) as e:
                why = str(e) or type(e).__name__
            # no exec could start (a fork bomb holds every pid?): pid 1 kills everything on SIGUSR1
            try:
                await asyncio.to_thread(self.container.kill, "SIGUSR1")
            except Exception as e:
                raise engine_error(e, "resetting the sandbox") from None
            await asyncio.sleep(0.1 * (attempt + 1))
        raise SandboxError(f"could not reset the sandbox container {self.container.short_id}: {why}")

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for s in self._sessions.values():
            s.mark_killed()
        self._sessions.clear()
        import docker

        try:
            await asyncio.to_thread(self.container.remove, force=True, v=True)
        except docker.errors.NotFound:
            pass
        except docker.errors.APIError as e:
            if e.status_code != 409:  # 409: the engine's auto-remove got there first
                raise engine_error(e, "removing the sandbox container") from None
