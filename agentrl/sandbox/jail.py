"""How the local sandbox's jail is built: uids, cgroups, rlimits, bubblewrap's command line, safe files.

:class:`agentrl.sandbox.local.LocalSandbox` is what callers use; this module is the host-side
machinery under it, kept apart so that the security-relevant pieces read (and get audited) on their
own. Internal to the local backend: not a stable API, except :func:`bubblewrap_unavailable_reason`
(whether a trial jail runs here), which :mod:`agentrl.sandbox.local` re-exports.

Uids: bwrap always runs as an *unprivileged* uid: started by root, bubblewrap maps the program to
host root, which contains nothing. So as root every live sandbox gets its own uid from
``UID_BASE`` (61000) up (:class:`UidLease`: a lock file per uid makes the choice safe across
processes), which also makes ``RLIMIT_NPROC`` and kill-by-uid (:func:`kill_uid`) per sandbox; as a
normal user the programs run as that user inside a user namespace.

Limits: as root with writable (v1) cgroups, a cgroup per sandbox (:class:`Cgroup`) caps memory
(+swap), pids and CPU for all its processes together (like a container), with a child cgroup per
call or session so that a timeout kills exactly that call's tree; rlimits (processes, file size,
open files, CPU seconds as a backstop, and address space when no memory cgroup exists) apply in
every mode. Scratch and ``/tmp`` share one ``scratch_mb`` tmpfs mounted per sandbox as root
(:func:`mount_tmpfs`); as a normal user they are a plain dir whose usage (:func:`usage_bytes`) the
sandbox checks after each call. All of it is applied in the child between fork and exec
(:func:`preexec`).

Files: ``write_files``/``read_file`` work on the host dir component by component with
``O_NOFOLLOW`` (:func:`open_beneath`) so a symlink the program planted never leads the host outside
scratch.

Cleanup: sandboxes whose owner process died (SIGKILL) are removed (:func:`reap_stale`: their
processes, cgroups, tmpfs and dir) by the next process that creates one on this host.

Not done: cgroup v2 (rlimits only there); as a normal user the process fallback cannot kill what
left its process group. Each call forks the parent process to set limits before exec
(``preexec_fn``): a few ms, ~8 ms more when torch is loaded.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import errno
import fcntl
import functools
import os
import pwd
import random
import resource
import shutil
import signal
import socket
import stat
import struct
import subprocess
import time
from pathlib import Path

from agentrl.sandbox.base import SandboxConfig, SandboxError

UID_BASE, UID_COUNT = 61000, 4000
MB = 1 << 20
_HOST_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
ETC_FROM_HOST = (
    "ld.so.cache",
    "ld.so.conf",
    "ld.so.conf.d",
    "alternatives",
    "localtime",
    "timezone",
    "python3",
    "python3.11",
    "python3.12",
    "python3.13",
    "ssl",
    "mime.types",
    "os-release",
)
_libc = ctypes.CDLL(None, use_errno=True)
_uid_cursor = [random.randrange(UID_COUNT)]  # processes start apart in the range


def privileged() -> bool:
    """Root can give each sandbox its own uid, cgroups and tmpfs; a normal user gets the weaker forms."""
    return os.geteuid() == 0


def runtime_dir() -> Path:
    """``$AGENTRL_SANDBOX_DIR`` or ``/tmp/agentrl-sandbox[-uid]``; refuses one another user planted."""
    default = "/tmp/agentrl-sandbox" + ("" if privileged() else f"-{os.geteuid()}")
    path = Path(os.environ.get("AGENTRL_SANDBOX_DIR", default))
    with contextlib.suppress(FileExistsError):
        path.mkdir(mode=0o711, parents=True)
    st = path.lstat()
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
        raise SandboxError(
            f"sandbox runtime dir {path} is not a directory owned by uid {os.geteuid()}; "
            "remove it or set AGENTRL_SANDBOX_DIR"
        )
    os.chmod(path, 0o711)  # sandbox uids traverse it to reach their own scratch, never list it
    return path


def start_time(pid: int) -> str | None:
    """The kernel's start time of ``pid`` (tells a live owner from a recycled pid); None if gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return text[text.rfind(")") + 2 :].split()[19]


# -- uids --------------------------------------------------------------------------------------


class UidLease:
    """A uid held by this process (an flock on ``uids/<uid>``; the kernel frees it if we die)."""

    def __init__(self, runtime: Path | None = None) -> None:
        """``runtime``: the :func:`runtime_dir` the caller already has (made and checked once)."""
        self.uid, self._fd, self.dirty = os.getuid(), -1, False
        if not privileged():
            return
        locks = (runtime or runtime_dir()) / "uids"
        locks.mkdir(mode=0o700, exist_ok=True)
        start = _uid_cursor[0] + 1  # round robin: a just-freed uid may still have dying processes
        for uid in (UID_BASE + (start + i) % UID_COUNT for i in range(UID_COUNT)):
            with contextlib.suppress(KeyError):
                pwd.getpwuid(uid)
                continue  # a real account: never borrow it
            fd = os.open(locks / str(uid), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                continue
            self.uid, self._fd, _uid_cursor[0] = uid, fd, uid - UID_BASE
            self.dirty = os.pread(fd, 1, 0) != b""  # its last owner died before killing everything
            os.pwrite(fd, b"1", 0)
            return
        raise SandboxError(
            f"all {UID_COUNT} sandbox uids from {UID_BASE} are in use; close sandboxes or lower max_concurrency"
        )

    @property
    def distinct(self) -> bool:
        """Whether the uid is this sandbox's alone (so killing by uid is safe)."""
        return self._fd >= 0

    def release(self, *, clean: bool = False) -> None:
        """Free the uid; ``clean``: none of its processes is left (the next owner need not kill any)."""
        if self._fd >= 0:
            fd, self._fd = self._fd, -1
            try:
                if clean:
                    os.ftruncate(fd, 0)
            finally:  # the lock must go even if marking it clean failed (the next owner then kills)
                os.close(fd)


async def kill_uid(uid: int) -> None:
    """SIGKILL every process of ``uid`` (``kill -KILL -1`` run as that uid), twice against forks."""
    if uid == os.getuid():
        raise AssertionError("refusing to kill our own uid")
    proc = await asyncio.create_subprocess_exec(
        "/bin/sh",
        "-c",
        "kill -KILL -1; kill -KILL -1; exit 0",
        env={},
        stderr=subprocess.DEVNULL,
        preexec_fn=preexec([], [], uid, net=False),
    )
    await proc.wait()


# -- limits ------------------------------------------------------------------------------------


@functools.cache
def cgroup_parents() -> dict[str, str]:
    """Our own v1 cgroup per controller (memory, pids, cpu) where we may make children; {} if none."""
    parents: dict[str, str] = {}
    if privileged() and not os.path.exists("/sys/fs/cgroup/cgroup.controllers"):  # v2 unsupported
        own = {}
        for line in Path("/proc/self/cgroup").read_text().splitlines():
            _, names, path = line.split(":", 2)
            own.update({name: path for name in names.split(",")})
        for c in ("memory", "pids", "cpu"):
            path = f"/sys/fs/cgroup/{c}{own.get(c, '/')}".rstrip("/")
            try:
                os.mkdir(probe := f"{path}/agentrl-probe-{os.getpid()}")
                os.rmdir(probe)
                parents[c] = path
            except OSError:
                continue
    return parents


class Cgroup:
    """One cgroup in each available controller; ``kill`` empties it, ``remove`` deletes it."""

    def __init__(self, dirs: dict[str, str]) -> None:
        self.dirs = dirs

    @classmethod
    def for_sandbox(cls, name: str, config: SandboxConfig) -> Cgroup | None:
        parents = cgroup_parents()
        if not parents:
            return None
        group = cls({c: f"{p}/{name}" for c, p in parents.items()})
        limits = {
            "memory": [
                ("memory.limit_in_bytes", config.memory_mb * MB),
                ("memory.memsw.limit_in_bytes", config.memory_mb * MB),
            ],
            "pids": [("pids.max", config.pids)],
            "cpu": [("cpu.cfs_period_us", 100_000), ("cpu.cfs_quota_us", max(1000, int(config.cpus * 1e5)))],
        }
        try:
            for c, path in group.dirs.items():
                os.makedirs(path, exist_ok=True)
                for file, value in limits[c]:
                    if os.path.exists(f"{path}/{file}"):
                        Path(path, file).write_text(str(value))
        except BaseException:
            group.remove()  # the caller never gets it, so nobody else would
            raise
        return group

    def child(self, name: str) -> Cgroup:
        group = Cgroup({c: f"{d}/{name}" for c, d in self.dirs.items()})
        for path in group.dirs.values():
            os.makedirs(path, exist_ok=True)
        return group

    @property
    def procs_files(self) -> list[str]:
        return [f"{d}/cgroup.procs" for d in self.dirs.values()]

    def members(self) -> set[int]:
        pids: set[int] = set()
        for root, _, _ in os.walk(next(iter(self.dirs.values()))):
            with contextlib.suppress(OSError):
                pids.update(int(p) for p in Path(root, "cgroup.procs").read_text().split())
        return pids

    def charged(self) -> int:
        """Tasks still counted against ``pids.max``: killed ones count until they are reaped."""
        try:
            return int(Path(self.dirs["pids"], "pids.current").read_text())
        except (KeyError, OSError, ValueError):
            return 0

    async def kill(self, *, spare: int = 0, reaped: bool = False, deadline: float = 5.0) -> bool:
        """SIGKILL its members but ``spare`` until none is left (True), or ``deadline`` s passed (False).

        ``reaped``: also until none is counted in ``pids.current``: killed orphans count until the
        host's init reaps them, and a reset must not leave the next episode short of processes."""
        end = time.monotonic() + deadline
        while (pids := self.members() - {spare}) or (reaped and self.charged()):
            if time.monotonic() > end:
                return False
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            await asyncio.sleep(0.002)
        return True

    def remove(self) -> None:
        for top in self.dirs.values():
            for root, _, _ in sorted(os.walk(top), key=lambda w: -len(w[0])):
                with contextlib.suppress(OSError):
                    os.rmdir(root)

    def oom_kills(self) -> int:
        try:
            text = Path(self.dirs["memory"], "memory.oom_control").read_text()
        except (KeyError, OSError):
            return 0
        return next((int(line.split()[1]) for line in text.splitlines() if line.startswith("oom_kill ")), 0)


def rlimits(config: SandboxConfig, *, cpu_seconds: int | None, nproc: bool, memory: bool) -> list[tuple[int, int]]:
    limits = [
        (resource.RLIMIT_FSIZE, config.file_size_mb * MB),
        (resource.RLIMIT_NOFILE, 1024),
        (resource.RLIMIT_CORE, 0),
    ]
    if nproc:  # counts every process of the uid: only meaningful when the uid is the sandbox's own
        limits.append((resource.RLIMIT_NPROC, config.pids))
    if memory:
        limits.append((resource.RLIMIT_AS, config.memory_mb * MB))
    if cpu_seconds:
        limits.append((resource.RLIMIT_CPU, cpu_seconds))
    return limits


def _private_net() -> None:
    """In the child: a user namespace (our uid mapped to itself, nested ones forbidden) owning a new
    network namespace with only ``lo`` (up). exec then drops every capability (the uid is not 0)."""
    uid, gid = os.getuid(), os.getgid()
    if _libc.unshare(0x10000000 | 0x40000000) != 0:  # CLONE_NEWUSER | CLONE_NEWNET
        raise OSError(ctypes.get_errno(), "unshare(CLONE_NEWUSER | CLONE_NEWNET) failed")
    for file, text in (
        ("self/setgroups", "deny"),
        ("self/uid_map", f"{uid} {uid} 1"),
        ("self/gid_map", f"{gid} {gid} 1"),
        ("sys/user/max_user_namespaces", "0"),
    ):
        fd = os.open(f"/proc/{file}", os.O_WRONLY)
        os.write(fd, text.encode())
        os.close(fd)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:  # SIOCSIFFLAGS lo UP|LOOPBACK|RUNNING
        fcntl.ioctl(s.fileno(), 0x8914, struct.pack("16sH22x", b"lo", 0x1 | 0x8 | 0x40))


def preexec(procs_files: list[str], limits: list[tuple[int, int]], uid: int | None, *, net: bool):
    """The child's setup between fork and exec: join cgroups, set rlimits, unshare net, drop to ``uid``.

    Only plain syscalls (no locks a thread of the parent could hold) run here.
    """

    def setup() -> None:
        for file in procs_files:
            fd = os.open(file, os.O_WRONLY)
            os.write(fd, str(os.getpid()).encode())
            os.close(fd)
        if uid is not None and privileged():
            os.setgroups([])
            os.setresgid(uid, uid, uid)
            os.setresuid(uid, uid, uid)
            _libc.prctl(4, 1, 0, 0, 0)  # PR_SET_DUMPABLE: the uid change made /proc/self root's
        if net:
            _private_net()
        for res, value in limits:  # after unshare: RLIMIT_NPROC then counts this user namespace only
            hard = resource.getrlimit(res)[1]
            value = value if hard == resource.RLIM_INFINITY else min(value, hard)
            resource.setrlimit(res, (value, value))

    return setup


# -- bubblewrap --------------------------------------------------------------------------------


def bwrap_base() -> list[str]:
    """Namespaces and the read-only host dirs every bwrap run gets."""
    argv = [shutil.which("bwrap") or "bwrap", "--unshare-all", "--unshare-user"]
    if "--disable-userns" in _bwrap_help():
        argv.append("--disable-userns")  # no nested user namespace to regain capabilities in
    # --as-pid-1: the init is our small shell (see LocalSandbox._spawn), reaped by bwrap itself; bwrap's own init would
    # be orphaned to the host's init when bwrap exits, and counted in the pids limit until that reaps it
    argv += [
        "--die-with-parent",
        "--as-pid-1",
        "--new-session",
        "--cap-drop",
        "ALL",
        "--hostname",
        "sandbox",
        "--clearenv",
    ]
    for d in _HOST_DIRS:
        if os.path.islink(d):
            argv += ["--symlink", os.readlink(d), d]
        elif os.path.isdir(d):
            argv += ["--ro-bind", d, d]
    return argv + ["--proc", "/proc", "--dev", "/dev"]


@functools.cache
def _bwrap_help() -> str:
    out = subprocess.run([shutil.which("bwrap") or "bwrap", "--help"], capture_output=True, text=True)
    return out.stdout + out.stderr


@functools.cache
def bubblewrap_unavailable_reason() -> str | None:
    """None when ``bwrap`` is installed and a trial jail runs here (cached), else why and what to do."""
    reason = None
    if shutil.which("bwrap") is None:
        reason = "bwrap not found: install bubblewrap (apt-get install bubblewrap)"
    else:
        lease = UidLease()
        try:
            out = subprocess.run(
                bwrap_base() + ["--", "/bin/true"],
                capture_output=True,
                text=True,
                env={},
                timeout=30,
                preexec_fn=preexec([], [], lease.uid, net=False),
            )
            if out.returncode != 0:
                detail = (out.stderr.strip().splitlines() or [f"exit {out.returncode}"])[-1]
                reason = (
                    f"bwrap cannot create its namespaces here ({detail}): enable unprivileged user "
                    "namespaces (sysctl user.max_user_namespaces=15000 kernel.unprivileged_userns_clone=1, "
                    "on Ubuntu kernel.apparmor_restrict_unprivileged_userns=0) or use a Docker engine"
                )
        except (OSError, subprocess.SubprocessError) as e:
            reason = f"bwrap trial run failed ({type(e).__name__}: {e}); use a Docker engine or the process backend"
        finally:
            lease.release(clean=True)  # /bin/true leaves nothing behind
    return reason


@functools.cache
def process_unavailable_reason() -> str | None:
    """None when the fallback's user + network namespaces can be made here (cached), else what to do."""
    lease = UidLease()
    try:
        subprocess.run(
            ["/bin/true"], env={}, cwd="/", timeout=30, check=True, preexec_fn=preexec([], [], lease.uid, net=True)
        )
    except (OSError, subprocess.SubprocessError) as e:
        return (
            f"the process sandbox cannot make its user and network namespaces here ({type(e).__name__}): "
            "enable unprivileged user namespaces (sysctl user.max_user_namespaces=15000) or use Docker"
        )
    finally:
        lease.release(clean=True)
    return None


def write_etc(etc: Path, uid: int) -> None:
    """The jail's ``/etc``: its own passwd/group/hosts, placeholders where host files get bound."""
    etc.mkdir(mode=0o755)
    gid = uid if privileged() else os.getgid()
    files = {
        "passwd": "root:x:0:0:root:/root:/usr/sbin/nologin\n"
        f"sandbox:x:{uid}:{gid}:agentrl sandbox:/scratch:/bin/sh\n"
        "nobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin\n",
        "group": f"root:x:0:\nsandbox:x:{gid}:\nnogroup:x:65534:\n",
        "hosts": "127.0.0.1\tlocalhost sandbox\n::1\tlocalhost ip6-localhost ip6-loopback\n",
        "hostname": "sandbox\n",
        "nsswitch.conf": "passwd: files\ngroup: files\nhosts: files\n",
    }
    for name, text in files.items():
        (etc / name).write_text(text)
    for name in ETC_FROM_HOST:
        host = Path("/etc", name)
        if host.is_symlink():
            (etc / name).symlink_to(os.readlink(host))
        elif host.is_dir():
            (etc / name).mkdir()
        elif host.is_file():
            (etc / name).touch()
    for p in etc.rglob("*"):
        if not p.is_symlink():
            p.chmod(0o755 if p.is_dir() else 0o644)


# -- files in scratch --------------------------------------------------------------------------


def open_beneath(root: str, rel: str, *, create: bool, owner: int | None) -> int:
    """Open ``rel`` under ``root`` one component at a time, never following a symlink (ValueError).

    A directory raises ``IsADirectoryError``, as the docker backend does, so callers tell the model
    to list it instead."""
    parts = rel.split("/")
    dfd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        for comp in parts[:-1]:
            if create:
                with contextlib.suppress(FileExistsError):
                    os.mkdir(comp, 0o755, dir_fd=dfd)
                    if owner is not None:
                        os.chown(comp, owner, owner, dir_fd=dfd, follow_symlinks=False)
            nfd = os.open(comp, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dfd)
            os.close(dfd)
            dfd = nfd
        flags = os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
        flags |= (os.O_WRONLY | os.O_CREAT | os.O_TRUNC) if create else os.O_RDONLY
        fd = os.open(parts[-1], flags, 0o644, dir_fd=dfd)
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.ENOTDIR, errno.ENXIO):
            raise ValueError(
                f"path {rel!r} goes through a symbolic link or a non-regular file; "
                "refusing to follow it outside scratch"
            ) from None
        if e.errno == errno.EISDIR:
            raise IsADirectoryError(errno.EISDIR, "is a directory, not a file", rel) from None
        raise
    finally:
        os.close(dfd)
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        if stat.S_ISDIR(mode):  # O_RDONLY opens a directory without EISDIR
            raise IsADirectoryError(errno.EISDIR, "is a directory, not a file", rel)
        raise ValueError(f"path {rel!r} is not a regular file")
    if create and owner is not None:
        os.fchown(fd, owner, owner)
    return fd


def usage_bytes(path: str) -> int:
    total = 0
    for root, dirs, files in os.walk(path):
        for name in dirs + files:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(root, name)).st_blocks * 512
    return total


def wipe(path: str) -> None:
    """Delete everything in ``path`` (hidden files and chmod-000 dirs too), keep ``path``."""
    for root, dirs, _ in os.walk(path):  # open up unreadable dirs before descending into them
        for d in dirs:
            if not os.path.islink(sub := os.path.join(root, d)):
                with contextlib.suppress(OSError):
                    os.chmod(sub, 0o700)
    for entry in os.scandir(path):
        if entry.is_dir(follow_symlinks=False):
            shutil.rmtree(entry.path, ignore_errors=True)
        else:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(entry.path)


def mount_tmpfs(path: str, size_mb: int) -> None:
    opts = f"size={size_mb}m,mode=0711".encode()
    if _libc.mount(b"tmpfs", path.encode(), b"tmpfs", 0x2 | 0x4, opts) != 0:  # MS_NOSUID|MS_NODEV
        raise SandboxError(f"mounting the scratch tmpfs on {path} failed: {os.strerror(ctypes.get_errno())}")


def umount(path: str) -> None:
    if os.path.ismount(path):
        _libc.umount2(path.encode(), 2)  # MNT_DETACH


async def reap_stale(runtime: Path) -> None:
    """Remove sandboxes whose owner process died: their processes, cgroups, tmpfs and dir."""
    for entry in runtime.iterdir():
        try:
            pid, start, uid = (entry / "owner").read_text().split()
        except (OSError, ValueError):
            continue  # not a sandbox dir, or one being created right now
        if start_time(int(pid)) == start:
            continue
        if privileged() and int(uid) >= UID_BASE:
            fd = os.open(runtime / "uids" / uid, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
            try:  # holding the uid's lock: nobody can have handed it to a new sandbox meanwhile
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                await kill_uid(int(uid))
                os.ftruncate(fd, 0)  # clean: its next owner need not kill again
            except BlockingIOError:
                pass  # reallocated already; the new owner killed the leftovers when it took it
            finally:
                os.close(fd)
        group = Cgroup({c: f"{p}/agentrl-{entry.name}" for c, p in cgroup_parents().items()})
        await group.kill()
        group.remove()
        umount(str(entry / "data"))
        await asyncio.to_thread(shutil.rmtree, entry, True)
