"""The local sandbox backend: bubblewrap, or (loudly weaker) a plain process, for hosts without Docker.

``bubblewrap`` (``isolation == "bubblewrap"``): each call runs in fresh namespaces (user, pid,
network with only ``lo``, ipc, uts, cgroup, mount) with ``/usr`` and the ``/lib*`` dirs read-only,
a synthetic ``/etc`` (``passwd``/``group``/``hosts`` for the sandbox user plus the loader's and
Python's files), a private ``/proc`` and ``/dev``, and two writable places: ``/scratch`` (cwd) and
``/tmp``, both kept between the calls of one sandbox. Nothing else of the host is visible: not
``/root``, ``/home``, ``/work``, the project tree or the host's ``/tmp``. Programs never run as
host root: as root every live sandbox gets its own uid from ``61000`` up; as a normal user the
programs run as that user inside a user namespace.

``process`` (``isolation == "process (weak: no filesystem isolation)"``): a plain subprocess with the
same limits, a cleared environment, a new session, and its own user namespace (no capabilities, no
nested namespaces) owning a network namespace with only ``lo``; as a distinct uid when root. It can
READ the host filesystem (whatever that uid may read) and, as a normal user, anything of that user,
including other processes' environments. ``/scratch`` does not exist as a path there: the cwd is the
sandbox's scratch dir, and ``$SCRATCH``/``$HOME`` name it (``$TMPDIR`` its private tmp).

Limits: memory, pids and CPU for the whole sandbox (a cgroup as root, else rlimits), file size and
open files per process, and ``scratch_mb`` for scratch and ``/tmp`` together (a tmpfs as root; as a
normal user checked after each call: over the cap it is wiped, and the result says so).

A call's processes never outlive it (bwrap's pid namespace; the call's cgroup or process group for
the fallback); long-lived programs are :meth:`LocalSandbox.session` s. Sandboxes whose owner
process died (SIGKILL) are reaped by the next process that creates one on this host.

This module holds what callers meet: :class:`LocalSandbox` (calls, sessions, files, reset, close)
and :func:`bubblewrap_unavailable_reason` (re-exported). How the jail is built (uids, cgroups,
rlimits, the bwrap command line and trial runs, symlink-safe file access, the reaper) is
:mod:`agentrl.sandbox.jail`, which also lists what is not done there. Not done here:
``config.ttl`` (owner death is detected instead).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import functools
import itertools
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from agentrl.sandbox.base import (
    ExecResult,
    Sandbox,
    SandboxConfig,
    SandboxError,
    Session,
    check_relative_path,
    normalize_files,
    program_argv,
    truncate_output,
)
from agentrl.sandbox.jail import (
    ETC_FROM_HOST,
    MB,
    Cgroup,
    UidLease,
    bubblewrap_unavailable_reason,
    bwrap_base,
    kill_uid,
    mount_tmpfs,
    open_beneath,
    preexec,
    privileged,
    process_unavailable_reason,
    reap_stale,
    rlimits,
    runtime_dir,
    start_time,
    umount,
    usage_bytes,
    wipe,
    write_etc,
)

__all__ = ["LocalSandbox", "bubblewrap_unavailable_reason"]

WEAK = "process (weak: no filesystem isolation)"
PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
_ids = itertools.count()
_reaped: list[bool] = []


# -- the sandbox -------------------------------------------------------------------------------


class _Capture:
    """Keeps the first ``limit`` bytes of a stream and counts the rest (100 MB is never buffered)."""

    def __init__(self, limit: int) -> None:
        self.head, self.total, self.limit = bytearray(), 0, limit

    def add(self, chunk: bytes) -> None:
        self.total += len(chunk)
        if len(self.head) < self.limit:
            self.head += chunk[: self.limit - len(self.head)]

    def text(self) -> tuple[str, bool]:
        return truncate_output(bytes(self.head), self.limit, self.total)


class _Call(asyncio.SubprocessProtocol):
    """One call's output as it arrives, and its exit: ``exited`` does not wait for the pipes (a
    background process may hold them), ``closed`` does."""

    def __init__(self, limit: int) -> None:
        loop = asyncio.get_running_loop()
        self.out, self.err = _Capture(limit), _Capture(limit)
        self.exited, self.closed = loop.create_future(), loop.create_future()

    def pipe_data_received(self, fd: int, data: bytes) -> None:
        (self.out if fd == 1 else self.err).add(data)

    def process_exited(self) -> None:
        if not self.exited.done():
            self.exited.set_result(None)

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.closed.done():
            self.closed.set_result(None)


@functools.cache
def _have_prlimit() -> bool:
    """Whether ``prlimit`` exists (looked up once, not on every call)."""
    return shutil.which("prlimit") is not None


def _claim(bubblewrap: bool) -> tuple[Path, UidLease]:
    """The blocking first half of :meth:`LocalSandbox.create`: the (cached) trial run, the runtime
    dir (made and checked once per sandbox) and a uid lease."""
    if reason := (bubblewrap_unavailable_reason() if bubblewrap else process_unavailable_reason()):
        raise SandboxError(f"{'bubblewrap' if bubblewrap else 'process'} sandbox unavailable: {reason}")
    runtime = runtime_dir()
    return runtime, UidLease(runtime)


class _LocalSession(Session):
    """A jailed long-lived process; newline-delimited stdin/stdout (see :class:`Session`)."""

    def __init__(self, proc: asyncio.subprocess.Process, killer) -> None:
        self._proc, self._killer, self._buf, self._skipping = proc, killer, bytearray(), False

    async def send(self, data: bytes) -> None:
        if not self.alive or self._proc.stdin is None:
            raise EOFError("the session's process has exited")
        try:
            self._proc.stdin.write(data)
            await self._proc.stdin.drain()
        except (BrokenPipeError, ConnectionResetError) as e:
            raise EOFError("the session's process has exited") from e

    async def readline(self, timeout: float, limit: int = 1 << 20) -> bytes:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            i = self._buf.find(b"\n")
            if self._skipping and i >= 0:  # the rest of an overlong line already reported
                del self._buf[: i + 1]
                self._skipping = False
                continue
            if 0 <= i < limit and not self._skipping:
                line = bytes(self._buf[: i + 1])
                del self._buf[: i + 1]
                return line
            if self._skipping or i >= limit or len(self._buf) > limit:
                self._buf.clear()
                if not self._skipping:
                    self._skipping = True
                    raise ValueError(f"the session wrote a line longer than {limit} bytes (dropped)")
            try:
                chunk = await asyncio.wait_for(self._proc.stdout.read(1 << 16), max(0.0, deadline - loop.time()))
            except TimeoutError:
                raise TimeoutError(f"no complete line from the session within {timeout:g}s") from None
            if not chunk:
                raise EOFError("the session's process has exited")
            self._buf += chunk

    async def kill(self) -> None:
        await self._killer()

    @property
    def alive(self) -> bool:
        return self._proc.returncode is None


class LocalSandbox(Sandbox):
    """A sandbox on this host: bubblewrap, or the weak process fallback (see the module docstring).

    Make one with ``await LocalSandbox.create(config, bubblewrap=...)``. ``scratch_dir`` is the host
    path of its scratch (for the process fallback it is also the programs' cwd and ``$SCRATCH``).
    ``config.image`` is ignored: programs use the host's own ``/usr`` (its ``python3``).
    """

    def __init__(self, config: SandboxConfig, bubblewrap: bool, root: Path, lease: UidLease) -> None:
        self.config, self.bubblewrap, self.root, self._lease = config, bubblewrap, root, lease
        self.isolation = "bubblewrap" if bubblewrap else WEAK
        self.scratch_dir = str(root / "data" / "scratch")
        self._tmp_dir = str(root / "data" / "tmp")
        self._cgroup: Cgroup | None = None
        self._sessions: dict[str, _LocalSession] = {}
        self._seq = itertools.count()
        self._closed = False
        self._bwrap: list[str] = []

    @classmethod
    async def create(cls, config: SandboxConfig, *, bubblewrap: bool) -> LocalSandbox:
        """A new sandbox (reaps dead owners' leftovers first, once per process). Close it when done."""
        config.validate()
        runtime, lease = await asyncio.to_thread(_claim, bubblewrap)
        self = cls(config, bubblewrap, runtime / f"{os.getpid()}-{next(_ids)}", lease)
        try:
            if not _reaped:  # before our dir exists: a dead owner with our (recycled) pid left one of our name
                _reaped.append(True)
                await reap_stale(runtime)
            if lease.dirty:  # before our dirs exist: whatever a dead owner of this uid left running
                await kill_uid(lease.uid)
            await asyncio.to_thread(self._build)
        except BaseException:
            await self.close()
            raise
        return self

    def _build(self) -> None:
        """The blocking second half of :meth:`create`: dirs, ``/etc``, scratch, cgroup, bwrap's argv."""
        self.root.mkdir(mode=0o711)
        (self.root / "owner").write_text(f"{os.getpid()} {start_time(os.getpid())} {self._lease.uid}")
        write_etc(self.root / "etc", self._lease.uid)
        (self.root / "data").mkdir(mode=0o711)
        self._fresh_data()
        self._cgroup = Cgroup.for_sandbox(f"agentrl-{self.root.name}", self.config)
        if self.bubblewrap:
            self._bwrap = self._bwrap_argv()

    def _bwrap_argv(self) -> list[str]:
        argv = bwrap_base() + ["--ro-bind", str(self.root / "etc"), "/etc"]
        for name in ETC_FROM_HOST:
            if os.path.exists(f"/etc/{name}") and not os.path.islink(f"/etc/{name}"):
                argv += ["--ro-bind", f"/etc/{name}", f"/etc/{name}"]
        return argv + [
            "--size",
            str(self.config.scratch_mb * MB),
            "--tmpfs",
            "/dev/shm",
            "--bind",
            self._tmp_dir,
            "/tmp",
            "--bind",
            self.scratch_dir,
            "/scratch",
            "--remount-ro",
            "/",
            "--chdir",
            "/scratch",
        ]

    def _fresh_data(self) -> None:
        """Empty scratch and tmp: a new tmpfs as root (O(1), hidden files included), else a wipe."""
        data = str(self.root / "data")
        if privileged():
            umount(data)
            mount_tmpfs(data, self.config.scratch_mb)
        for path in (self.scratch_dir, self._tmp_dir):
            if os.path.isdir(path):
                wipe(path)
            else:
                os.mkdir(path, 0o700)
            os.chown(path, self._lease.uid, self._lease.uid if privileged() else os.getgid())

    def _environment(self, extra: Mapping[str, str] | None) -> dict[str, str]:
        inside = "/scratch" if self.bubblewrap else self.scratch_dir
        env = {
            "PATH": PATH,
            "HOME": inside,
            "SCRATCH": inside,
            "LANG": "C.UTF-8",
            "USER": "sandbox",
            "TMPDIR": "/tmp" if self.bubblewrap else self._tmp_dir,
        }
        for source in (self.config.env, extra or {}):
            for key, value in source.items():
                if not isinstance(key, str) or not key or "=" in key or "\0" in key or not isinstance(value, str):
                    raise ValueError(f"env {key!r}={value!r}: names are non-empty strings without '=', values strings")
                env[key] = value
        return env

    async def _spawn(
        self,
        start,
        argv: list[str],
        env: Mapping[str, str] | None,
        *,
        stdin: bool,
        cpu_seconds: int | None,
        stderr: int = subprocess.PIPE,
    ) -> tuple[Any, Cgroup | None]:
        """``start(*argv, **popen_kwargs)`` the program jailed; returns what ``start`` gave and its cgroup."""
        group = self._cgroup.child(f"p{next(self._seq)}") if self._cgroup else None
        limits = rlimits(
            self.config,
            cpu_seconds=cpu_seconds,
            nproc=self._lease.distinct or not self.bubblewrap,
            memory=group is None or "memory" not in group.dirs,
        )
        environment = self._environment(env)
        if self.bubblewrap and not self._lease.distinct and _have_prlimit():
            argv = ["prlimit", f"--nproc={self.config.pids}", "--"] + argv  # counted in bwrap's user namespace
        if self.bubblewrap:  # pid 1 ignores SIGKILL from inside: a shell is init, the program its child
            argv = ["/bin/sh", "-c", '"$@"; exit $?', "sh"] + argv
            setenv = [x for key, value in environment.items() for x in ("--setenv", key, value)]
            full, environment, cwd = self._bwrap + setenv + ["--"] + argv, {}, "/"
        else:
            full, cwd = argv, self.scratch_dir
        setup = preexec(group.procs_files if group else [], limits, self._lease.uid, net=not self.bubblewrap)
        try:
            proc = await start(
                *full,
                stdin=subprocess.PIPE if stdin else subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=stderr,
                env=environment,
                cwd=cwd,
                start_new_session=True,
                preexec_fn=setup,
            )
        except BaseException as e:
            if group:
                group.remove()
            if isinstance(e, subprocess.SubprocessError):  # the setup between fork and exec failed
                raise SandboxError(
                    f"could not start the sandboxed process ({e}); see "
                    "bubblewrap_unavailable_reason() and the cgroup/uid setup"
                ) from e
            raise
        return proc, group

    async def _kill(self, pid: int, exited: asyncio.Future, group: Cgroup | None) -> None:
        """Kill one call's or session's whole tree (bwrap: its pid namespace dies with bwrap).

        With a cgroup, bwrap (``pid``) is spared at first: it reaps the jailed init and exits by itself,
        so nothing is orphaned to the host's init (which may reap slowly, holding the pids limit)."""
        end = time.monotonic() + 1.0
        while group is not None and self.bubblewrap and not exited.done() and time.monotonic() < end:
            await group.kill(spare=pid, deadline=0.2)  # again: bwrap may not have made its child yet
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(exited), 0.01)
        if not exited.done() or (group is None and not self.bubblewrap and not os.path.exists(f"/proc/{pid}")):
            # Unreaped, ``pid`` still names this call's group. Once reaped (only the fallback without a
            # cgroup has survivors to kill then), survivors keep it reserved as their pgid, so no process
            # has it as its pid; one that does got the number after the group emptied: not ours to kill.
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signal.SIGKILL)
        if group is not None:  # also what left the process group
            await group.kill()
            group.remove()

    def _check_open(self) -> None:
        if self._closed:
            raise SandboxError("this sandbox is closed; create a new one")

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
        self._check_open()
        argv = program_argv(command, code)
        limit = self.config.timeout if timeout is None else float(timeout)
        if limit <= 0:
            raise ValueError(f"timeout must be > 0 seconds, got {timeout}")
        if files:
            await self.write_files(files)
        if code is not None and len(code.encode()) > 65536:  # over what one argv string may hold: pass a file
            name = f".agentrl-code-{next(self._seq)}.py"
            await asyncio.to_thread(self._write_all, [(name, code.encode())], self._tmp_dir)
            argv = ["python3", f"{'/tmp' if self.bubblewrap else self._tmp_dir}/{name}"]
        data = stdin.encode() if isinstance(stdin, str) else stdin
        started, call = time.monotonic(), _Call(self.config.max_output_bytes)
        start = functools.partial(asyncio.get_running_loop().subprocess_exec, lambda: call)
        try:
            (transport, _), group = await self._spawn(
                start, argv, env, stdin=data is not None, cpu_seconds=int(limit * max(1.0, self.config.cpus)) + 2
            )
        except (FileNotFoundError, PermissionError) as e:  # the process fallback execs the program itself
            rc, why = (127, "command not found") if isinstance(e, FileNotFoundError) else (126, "permission denied")
            return ExecResult("", f"{argv[0]}: {why}\n", rc, duration=time.monotonic() - started)
        timed_out = False
        try:
            if data is not None:
                pipe = transport.get_pipe_transport(0)
                pipe.write(data)
                pipe.close()  # after the buffer drains; a program that never reads gets killed with the rest
            await asyncio.wait_for(asyncio.shield(call.exited), limit)
        except TimeoutError:
            timed_out = True
        finally:
            oom = group is not None and group.oom_kills() > 0  # the victim's own cgroup counts it
            await self._kill(transport.get_pid(), call.exited, group)
            for waiting in (call.exited, call.closed):  # output still in the pipes; bounded: an escaped
                with contextlib.suppress(TimeoutError):  # process may hold them open (no cgroup)
                    await asyncio.wait_for(asyncio.shield(waiting), 1.0)
            transport.close()
        wiped = not privileged() and await asyncio.to_thread(self._cap_scratch)
        return self._result(
            transport.get_returncode(),
            call.out,
            call.err,
            timed_out,
            oom=oom,
            wiped=wiped,
            duration=time.monotonic() - started,
        )

    def _cap_scratch(self) -> bool:
        """As a normal user (no tmpfs caps it): scratch and /tmp over ``scratch_mb`` are wiped (True)."""
        if usage_bytes(str(self.root / "data")) <= self.config.scratch_mb * MB:
            return False
        self._fresh_data()
        return True

    def _result(
        self, rc: int | None, out: _Capture, err: _Capture, timed_out: bool, *, oom: bool, wiped: bool, duration: float
    ) -> ExecResult:
        stdout, cut_out = out.text()
        stderr, cut_err = err.text()
        if rc is not None and rc < 0:
            rc = 128 - rc  # killed by a signal: the shell's (and docker's, bwrap's) 128+N
        notes = []
        if oom:
            notes.append(f"[killed: out of memory (limit {self.config.memory_mb} MB)]")
        if wiped:
            notes.append(f"[scratch exceeded {self.config.scratch_mb} MB and was wiped]")
        if notes:
            stderr += ("\n" if stderr and not stderr.endswith("\n") else "") + "\n".join(notes) + "\n"
        return ExecResult(
            stdout,
            stderr,
            None if timed_out or oom else rc,
            timed_out=timed_out,
            duration=duration,
            truncated=cut_out or cut_err,
        )

    async def write_files(self, files: Mapping[str, str | bytes]) -> None:
        self._check_open()
        await asyncio.to_thread(self._write_all, normalize_files(files))

    def _write_all(self, items: list[tuple[str, bytes]], root: str | None = None) -> None:
        owner = self._lease.uid if privileged() else None
        for rel, content in items:
            fd = open_beneath(root or self.scratch_dir, rel, create=True, owner=owner)
            try:
                view = memoryview(content)
                while view:
                    view = view[os.write(fd, view) :]
            except OSError as e:
                if e.errno in (errno.ENOSPC, errno.EFBIG):
                    full = f"writing {rel!r}: scratch is full (scratch_mb={self.config.scratch_mb})"
                    raise ValueError(full) from None
                raise
            finally:
                os.close(fd)

    async def read_file(self, path: str, *, max_bytes: int | None = None) -> bytes:
        self._check_open()
        rel = check_relative_path(path)
        return await asyncio.to_thread(self._read, rel, max_bytes)

    def _read(self, rel: str, max_bytes: int | None) -> bytes:
        fd = open_beneath(self.scratch_dir, rel, create=False, owner=None)
        try:
            chunks, left = [], max_bytes if max_bytes is not None else 1 << 62
            while left > 0 and (chunk := os.read(fd, min(left, 1 << 20))):
                chunks.append(chunk)
                left -= len(chunk)
            return b"".join(chunks)
        finally:
            os.close(fd)

    async def session(self, name: str, argv: Sequence[str], env: Mapping[str, str] | None = None) -> Session:
        self._check_open()
        current = self._sessions.get(name)
        if current is not None and current.alive:
            return current
        if current is not None:
            await current.kill()
        proc, group = await self._spawn(
            asyncio.create_subprocess_exec,
            program_argv(list(argv), None),
            env,
            stdin=True,
            cpu_seconds=None,
            stderr=subprocess.DEVNULL,
        )

        async def kill() -> None:
            await self._kill(proc.pid, waited, group)
            with contextlib.suppress(TimeoutError):  # bounded: without a cgroup an escapee may hold the pipe
                await asyncio.wait_for(asyncio.shield(waited), 2.0)

        waited = asyncio.ensure_future(proc.wait())
        session = _LocalSession(proc, kill)
        self._sessions[name] = session
        return session

    async def _kill_all(self) -> bool:
        """Kill sessions and every process of the sandbox; True when none can be left."""
        sessions, self._sessions = list(self._sessions.values()), {}
        for session in sessions:
            await session.kill()
        if self._cgroup is not None:
            return await self._cgroup.kill(reaped=True)
        if self._lease.distinct:
            await kill_uid(self._lease.uid)
            return True
        return False

    async def reset(self) -> None:
        """Kill every process (sessions too) and give it an empty scratch and /tmp (and, for the process
        backend as root, remove what its uid left in the host's ``/dev/shm``)."""
        self._check_open()
        if not await self._kill_all() and self._cgroup is not None:
            raise SandboxError("processes of this sandbox survived SIGKILL for 5 s; close it and create a new one")
        await asyncio.to_thread(self._fresh_data)
        await asyncio.to_thread(self._clean_host_shm)

    def _clean_host_shm(self) -> None:
        """The process backend writes the host's ``/dev/shm`` (it has no mount namespace): as root each
        sandbox has a uid of its own, so what that uid owns there is this sandbox's and goes. As a normal
        user the files cannot be told from the user's own and stay (the backend's warning says so)."""
        if self.bubblewrap or not self._lease.distinct:
            return
        with contextlib.suppress(OSError):
            for entry in os.scandir("/dev/shm"):
                with contextlib.suppress(OSError):
                    if entry.stat(follow_symlinks=False).st_uid == self._lease.uid:
                        if entry.is_dir(follow_symlinks=False):
                            wipe(entry.path)
                            os.rmdir(entry.path)
                        else:
                            os.unlink(entry.path)

    async def close(self) -> None:
        """Kill everything, unmount and delete its dirs, free its cgroup and uid. Idempotent."""
        if self._closed:
            return
        self._closed, clean = True, False
        try:
            clean = await self._kill_all()
        finally:  # nested: whatever fails, the cgroup and the uid (its lock fd) are still freed
            try:
                await asyncio.to_thread(self._remove_dirs)
                await asyncio.to_thread(self._clean_host_shm)
            finally:
                try:
                    if self._cgroup is not None:
                        self._cgroup.remove()
                finally:
                    self._lease.release(clean=clean)

    def _remove_dirs(self) -> None:
        umount(str(self.root / "data"))
        if self.root.exists():
            wipe(str(self.root))
            with contextlib.suppress(OSError):  # something wipe could not remove (a mount): left for good
                self.root.rmdir()
