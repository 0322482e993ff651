"""The hostile programs of the sandbox audit, each with its verdict taken on the host.

Each check runs one small program a misbehaving model could write (Python, passed as
``python3 -c``) in a sandbox that was just reset, then decides **from the host** whether it was
contained: a listener counts connections, canary files are compared, a victim process is polled,
``/proc`` is scanned for leftovers, this process's RSS is watched. The program's own output only
fills the detail text. Every program is bounded (at most 4x a limit, 1024 forks, 100 MB of
output), so even a backend that contains nothing cannot take the host down; all traffic goes to
127.0.0.1; every canary is removed afterwards. :mod:`agentrl.sandbox.audit` runs them.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

from agentrl.sandbox.base import ExecResult, Sandbox, SandboxConfig, SandboxError

__all__ = ["CHECKS", "MARK_PREFIX", "SECRET_ENV", "WEAK_ON_PROCESS", "Hostile", "leftovers"]

MARK_PREFIX = "agentrl-audit-"
"""Every hostile program carries ``agentrl-audit-<token>`` in its argv, so the host can find leftovers."""
SECRET_ENV = "AGENTRL_AUDIT_SECRET"
"""The canary variable the audit sets in its own environment (standing in for HF_TOKEN & co.)."""
WEAK_ON_PROCESS = frozenset(
    {"read_outside_scratch", "write_outside_scratch", "unix_socket", "host_proc_argv", "shm_quota"}
)
"""Checks the ``process`` backend is documented to fail: no filesystem, mount or pid isolation."""


@dataclass
class Hostile:
    """What a check works with: the (reset) sandbox, its config, the host-side canary dir, the audit's token."""

    sandbox: Sandbox
    config: SandboxConfig
    tmp: Path
    token: str

    @property
    def mark(self) -> str:
        return MARK_PREFIX + self.token

    async def py(self, src: str, *args: object, timeout: float) -> ExecResult:
        """Run Python ``src`` in the sandbox; ``sys.argv[2:]`` are ``args`` (argv[1] is the marker)."""
        return await self.sandbox.run(["python3", "-c", src, self.mark, *map(str, args)], timeout=timeout)


def _out(r: ExecResult, limit: int = 160) -> str:
    text = " | ".join(line for line in (r.stdout + r.stderr).splitlines() if line.strip())
    ending = "timed out" if r.timed_out else f"exit {r.exit_code}"
    return f"{text[:limit]}{'...' if len(text) > limit else ''} ({ending})"


def _marked_pids(mark: str) -> list[int]:
    """Host pids whose argv carries ``mark`` (the sandbox's processes, seen from the host's /proc)."""
    pids = []
    for p in Path("/proc").iterdir():
        if p.name.isdigit() and int(p.name) != os.getpid():
            with contextlib.suppress(OSError):
                if mark.encode() in (p / "cmdline").read_bytes():
                    pids.append(int(p.name))
    return pids


async def leftovers(mark: str, grace: float = 3.0) -> list[int]:
    """Marked processes still alive after ``grace`` seconds; they are then SIGKILLed (audit cleanup)."""
    deadline = time.monotonic() + grace
    while (pids := _marked_pids(mark)) and time.monotonic() < deadline:
        await asyncio.sleep(0.1)
    for pid in pids:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
    return pids


# -- the hostile programs and their host-side verdicts ----------------------------------------------

_CONNECT = """import socket, sys
try:
    s = socket.create_connection(("127.0.0.1", int(sys.argv[2])), timeout=3); s.sendall(b"hello"); print("connected")
except OSError as e:
    print("connect failed:", e)"""


async def check_network_loopback(c: Hostile) -> tuple[bool, str]:
    """Connect to a TCP listener the audit runs on the host's 127.0.0.1: no connection may arrive."""
    arrived: list[int] = []

    def on_connect(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        arrived.append(1)
        writer.close()

    server = await asyncio.start_server(on_connect, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        r = await c.py(_CONNECT, port, timeout=15)
        await asyncio.sleep(0.2)
    finally:
        server.close()
        await server.wait_closed()
    if arrived:
        return False, f"{len(arrived)} connection(s) reached the host's 127.0.0.1:{port}: {_out(r)}"
    return True, f"no connection arrived at 127.0.0.1:{port}; inside: {_out(r)}"


_INTERFACES = """import socket
try: print("if_nameindex", *sorted(n for _, n in socket.if_nameindex()))
except OSError as e: print("if_nameindex error", e)
try: print("proc_net_dev", *sorted(l.split(":")[0].strip() for l in open("/proc/net/dev").read().splitlines()[2:]))
except OSError as e: print("proc_net_dev error", e)"""


async def check_network_interfaces(c: Hostile) -> tuple[bool, str]:
    """List network interfaces from inside: only ``lo`` may exist."""
    r = await c.py(_INTERFACES, timeout=15)
    seen = [line.split()[1:] for line in r.stdout.splitlines() if line.split()[1:2] != ["error"]]
    if not seen:
        return False, f"could not list interfaces, so cannot vouch for isolation: {_out(r)}"
    extra = sorted({name for names in seen for name in names} - {"lo"})
    return (not extra), (f"interfaces besides lo: {extra}" if extra else f"only lo: {_out(r)}")


_FORK_BOMB = """import os, sys, time
n, why = 0, "no limit hit"
for _ in range(int(sys.argv[2])):
    try:
        pid = os.fork()
    except OSError as e:
        why = e.strerror; break
    if pid == 0:
        os.close(1); os.close(2); time.sleep(120); os._exit(0)
    n += 1
print(n, why, flush=True)"""


async def check_fork_bomb(c: Hostile) -> tuple[bool, str]:
    """Fork up to 4x the pids limit (bounded, so an escape cannot take the host down); the limit must stop it
    and ``reset`` must kill every child left behind."""
    tries = min(4 * c.config.pids, 1024)
    r = await c.py(_FORK_BOMB, tries, timeout=30)
    await c.sandbox.reset()
    left = await leftovers(c.mark)
    words = r.stdout.split()
    forked = int(words[0]) if words and words[0].isdigit() else None
    if left:
        return False, f"{len(left)} forked processes survived reset (killed by the audit); {_out(r)}"
    if not forked:  # no fork at all proves nothing about the limit (the program may not even have started)
        return False, f"could not fork at all, so the limit was not exercised: {_out(r)}"
    ok = forked <= c.config.pids
    return ok, f"{forked} of {tries} forks succeeded (pids limit {c.config.pids}): {_out(r)}"


_MEMORY_HOG = """import sys
blocks = []
try:
    while len(blocks) * 16 < int(sys.argv[2]):
        blocks.append(b"\\x01" * (16 << 20)); print(len(blocks) * 16, flush=True)
    print("ALL", flush=True)
except MemoryError:
    print("MemoryError", flush=True)"""


async def check_memory_hog(c: Hostile) -> tuple[bool, str]:
    """Touch 4x ``memory_mb`` of memory: a MemoryError or a kill must stop it near the limit."""
    target = 4 * c.config.memory_mb
    r = await c.py(_MEMORY_HOG, target, timeout=60)
    sizes = [int(w) for w in r.stdout.split() if w.isdigit()]
    reached = max(sizes, default=0)
    how = "MemoryError" if "MemoryError" in r.stdout else ("killed" if r.exit_code != 0 else "not stopped")
    ok = "ALL" not in r.stdout and reached <= c.config.memory_mb + 16
    return ok, f"reached {reached} of {target} MB tried (limit {c.config.memory_mb} MB), {how}; exit {r.exit_code}"


_SPIN = """import os
os.fork()
while True: pass"""


async def check_infinite_loop(c: Hostile) -> tuple[bool, str]:
    """Two spinning processes (a parent and its child): killed at the timeout, none left running."""
    limit = min(c.config.timeout, 2.0)
    t0 = time.monotonic()
    r = await c.py(_SPIN, timeout=limit)
    took = time.monotonic() - t0
    left = await leftovers(c.mark)
    ok = r.timed_out and limit - 0.05 <= took <= limit + 5.0 and not left
    detail = f"timeout {limit:.1f}s: returned after {took:.2f}s, timed_out={r.timed_out}, exit {r.exit_code}"
    detail += "" if r.timed_out else f" ({_out(r, 120)})"
    return ok, detail + (f"; {len(left)} spinning processes survived (killed by the audit)" if left else "")


def _project_root() -> Path:
    return Path(__file__).resolve().parents[2]


def _plant(path: Path, content: str, mode: int) -> bool:
    """Create a canary file on the host (False when this user may not write there)."""
    try:
        path.write_text(content)
        path.chmod(mode)
        return True
    except OSError:
        return False


_WRITE = """import sys
for p in sys.argv[2:]:
    try:
        with open(p, "w") as f: f.write("escaped")
        print("wrote", p)
    except OSError as e:
        print("refused", p, e.strerror)"""


async def check_write_outside_scratch(c: Hostile) -> tuple[bool, str]:
    """Overwrite a world-writable host canary and create files in /etc, ~, the project tree and /tmp:
    every host path must be unchanged (judged on the host; writes into a container's own /etc are fine)."""
    canary = c.tmp / "canary.txt"
    original = f"canary {c.token}\n"
    _plant(canary, original, 0o666)  # permissions allow it: only isolation can stop the write
    new = [c.tmp / f"{c.mark}-new", Path("/etc") / c.mark, Path.home() / c.mark, _project_root() / c.mark]
    try:
        r = await c.py(_WRITE, canary, *new, timeout=15)
        changed = [str(canary)] if canary.read_text() != original else []
        changed += [str(p) for p in new if p.exists()]
    finally:
        for p in new:
            with contextlib.suppress(OSError):
                p.unlink()
    if changed:
        return False, f"host files written: {', '.join(changed)}"
    return True, f"{1 + len(new)} host paths unchanged; inside: {_out(r, 120)}"


_READ = """import sys
for p in sys.argv[2:]:
    try: print(p, "=>", open(p).read().strip())
    except OSError as e: print(p, "=>", e.strerror)"""


async def check_read_outside_scratch(c: Hostile) -> tuple[bool, str]:
    """Read world-readable secret canaries the audit plants in ~, the project tree and the host's /tmp:
    the secret must not appear in the output."""
    secret = f"file-secret-{secrets.token_hex(8)}"
    spots = [c.tmp / "secret.txt", Path.home() / f".{c.mark}-secret", _project_root() / f".{c.mark}-secret"]
    planted = [p for p in spots if _plant(p, secret, 0o644)]
    try:
        r = await c.py(_READ, *planted, timeout=15)
    finally:
        for p in planted:
            with contextlib.suppress(OSError):
                p.unlink()
    leaked = [line.split(" =>")[0] for line in (r.stdout + r.stderr).splitlines() if secret in line]
    if leaked or secret in r.stdout + r.stderr:
        return False, f"host secrets read: {', '.join(leaked) or 'yes'}"
    return True, f"{len(planted)} planted secrets not readable: {_out(r, 120)}"


_ENV = f"""import glob, os
name = "{SECRET_ENV}"
print("own env:", {{k: v for k, v in os.environ.items() if k == name}})
paths = ["/proc/self/environ", "/proc/1/environ", f"/proc/{{os.getppid()}}/environ"]
for p in paths + glob.glob("/proc/[0-9]*/environ"):
    try:
        hits = [v for v in open(p, "rb").read().split(b"\\0") if v.startswith(name.encode())]
        if hits: print(p, hits)
    except OSError: pass
print("done")"""


async def check_env_secrets(c: Hostile) -> tuple[bool, str]:
    """The audit's own environment holds a canary secret: it must not be in the sandbox's environment, nor
    readable through any /proc/*/environ the sandbox can see."""
    r = await c.py(_ENV, timeout=15)
    value = os.environ.get(SECRET_ENV, "")
    if value and value in r.stdout + r.stderr:
        return False, f"the host's {SECRET_ENV} was read: {_out(r)}"
    return "done" in r.stdout, f"{SECRET_ENV} not visible: {_out(r, 120)}"


_SIGNALS = """import ctypes, os, sys
audit, victim, ppid = int(sys.argv[2]), int(sys.argv[3]), os.getppid()
def send(label, pid, sig):
    try: os.kill(pid, sig); print(label, pid, "SENT")
    except OSError as e: print(label, pid, e.strerror)
send("probe-audit", audit, 0)
send("kill-victim", victim, 9)
send("kill-ppid", ppid, 9) if ppid not in (0, audit) else send("probe-ppid", ppid, 0)
send("kill-init", 1, 9)
libc = ctypes.CDLL(None, use_errno=True)
if libc.ptrace(16, victim, 0, 0) == 0:
    print("ptrace-victim ATTACHED"); libc.ptrace(17, victim, 0, 0)
else:
    print("ptrace-victim", os.strerror(ctypes.get_errno()))"""


async def check_signal_parent(c: Hostile) -> tuple[bool, str]:
    """SIGKILL a host process (a victim the audit starts), the parent and pid 1; probe the audit's pid; ptrace
    the victim. The victim and the audit must survive, ptrace must fail, and the sandbox must still answer.
    (The audit's own pid is only probed with signal 0: proving an escape must not kill the audit.)"""
    victim = subprocess.Popen(["sleep", "300"], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
    try:
        r = await c.py(_SIGNALS, os.getpid(), victim.pid, timeout=15)
        await asyncio.sleep(0.2)
        victim_alive = victim.poll() is None
    finally:
        victim.kill()
        victim.wait()
    try:
        alive = await c.sandbox.run(["echo", "alive"], timeout=15)
        sandbox_ok = alive.stdout.strip() == "alive"
    except SandboxError as e:
        sandbox_ok = False
        r.stderr += f" sandbox unusable afterwards: {e}"
    lines = r.stdout.splitlines()
    escaped = [ln for ln in lines if ln.startswith("probe-audit") and ln.endswith("SENT")]
    escaped += [ln for ln in lines if "ATTACHED" in ln]
    escaped += [] if victim_alive else ["host victim process killed"]
    escaped += [] if sandbox_ok else ["sandbox did not survive"]
    return (not escaped and bool(lines)), ("; ".join(escaped) if escaped else f"host unharmed: {_out(r, 200)}")


_PRIVILEGED = """import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
os.makedirs("mnt", exist_ok=True)
tries = {"mount": lambda: libc.mount(b"none", b"mnt", b"tmpfs", 0, None), "chroot": lambda: libc.chroot(b"."),
         "unshare(mnt)": lambda: libc.unshare(0x20000), "unshare(user)": lambda: libc.unshare(0x10000000),
         "unshare(net)": lambda: libc.unshare(0x40000000), "unshare(pid)": lambda: libc.unshare(0x20000000)}
for name, fn in tries.items():  # each in its own child, so one success cannot enable the next
    r, w = os.pipe()
    if os.fork() == 0:
        os.write(w, b"SUCCEEDED" if fn() == 0 else os.strerror(ctypes.get_errno()).encode()); os._exit(0)
    os.close(w); os.wait(); print(name + ":", os.read(r, 100).decode() or "?"); os.close(r)"""


async def check_mount_chroot_unshare(c: Hostile) -> tuple[bool, str]:
    """mount, chroot and unshare (mount, user, net, pid namespaces) must all fail inside."""
    r = await c.py(_PRIVILEGED, timeout=15)
    lines = [ln for ln in r.stdout.splitlines() if ":" in ln]
    won = [ln.split(":")[0] for ln in lines if "SUCCEEDED" in ln]
    if won:
        return False, f"succeeded: {', '.join(won)}"
    if len(lines) < 6:
        return False, f"the attempts did not all run, so nothing is proven: {_out(r, 200)}"
    return True, f"all refused: {_out(r, 200)}"


_FILL = """import os, sys
limit, per_file = int(sys.argv[2]) << 20, int(sys.argv[3]) << 20
chunk, written, i, why = b"\\x01" * (1 << 20), 0, 0, "not stopped"
try:
    while written < limit:
        fd = os.open(f"fill{i}.bin", os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        try:
            n = 0
            while n < per_file and written < limit:
                k = os.write(fd, chunk); n += k; written += k
        finally: os.close(fd)
        i += 1
except OSError as e: why = e.strerror
print(written >> 20, why, flush=True)"""


async def check_fill_disk(c: Hostile) -> tuple[bool, str]:
    """Write 2x ``scratch_mb`` into scratch, file by file under the single-file limit: writing must stop near
    ``scratch_mb`` and the host's temp filesystem must keep its free space."""
    tries = 2 * c.config.scratch_mb + 16
    per_file = max(1, min(16, c.config.file_size_mb // 2))
    host = tempfile.gettempdir()
    free_before = shutil.disk_usage(host).free
    r = await c.py(_FILL, tries, per_file, timeout=120)
    free_after = shutil.disk_usage(host).free
    words = r.stdout.split()
    written = int(words[0]) if words and words[0].isdigit() else None
    drop = (free_before - free_after) / 2**20
    detail = (
        f"wrote {written} of {tries} MB tried (scratch {c.config.scratch_mb} MB), {_out(r, 80)}; "
        f"host free space {-drop:+.0f} MB"
    )
    if written is None:
        return r.exit_code != 0, detail
    return written <= c.config.scratch_mb + 1 and free_after > 64 * 2**20, detail


_FLOOD = """import sys
b = b"x" * (1 << 20)
for _ in range(100): sys.stdout.buffer.write(b)
sys.stdout.flush()"""


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _peak_rss(reset: bool = False) -> int:
    """This process's peak RSS (VmHWM), reset to the current RSS first when asked; 0 where unsupported."""
    try:
        if reset:
            Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return 0
    with contextlib.suppress(OSError):
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


async def check_stdout_flood(c: Hostile) -> tuple[bool, str]:
    """100 MB on stdout: the result is cut at ``max_output_bytes`` with the marker, and the host's memory
    (this process's peak RSS during the call, plus samples where the kernel cannot reset the peak) does
    not grow by anything near 100 MB."""
    base, peak = _rss(), [0]
    use_hwm = _peak_rss(reset=True) > 0

    async def sample() -> None:
        while True:
            peak[0] = max(peak[0], _rss())
            await asyncio.sleep(0.01)

    sampler = asyncio.create_task(sample())
    try:
        r = await c.py(_FLOOD, timeout=60)
    finally:
        sampler.cancel()
    grew = max(0, peak[0] - base, (_peak_rss() - base) if use_hwm else 0) / 2**20
    size = len(r.stdout.encode())
    ok = r.truncated and "output truncated" in r.stdout and size <= c.config.max_output_bytes + 200 and grew < 50
    return ok, f"{size} bytes returned, truncated={r.truncated}, host RSS +{grew:.0f} MB, exit {r.exit_code}"


_UNIX = """import socket, sys
for label, addr in (("path", sys.argv[2]), ("abstract", "\\0" + sys.argv[3])):
    try:
        s = socket.socket(socket.AF_UNIX); s.settimeout(3); s.connect(addr); s.sendall(b"hello"); print(label, "connected")
    except OSError as e:
        print(label, "connect failed:", e)"""


async def check_unix_socket(c: Hostile) -> tuple[bool, str]:
    """Connect to unix-socket listeners the audit runs on the host: one at a filesystem path (world-writable,
    in the host's temp dir) and one in the abstract namespace. No connection may arrive."""
    arrived: list[str] = []
    servers = []
    path = os.path.join(tempfile.gettempdir(), f"{c.mark}.sock")
    try:
        for label, where in (("path", path), ("abstract", "\0" + c.mark)):

            def on_connect(reader, writer, label=label):
                arrived.append(label)
                writer.close()

            servers.append(await asyncio.start_unix_server(on_connect, where))
        with contextlib.suppress(OSError):
            os.chmod(path, 0o777)
        r = await c.py(_UNIX, path, c.mark, timeout=15)
        await asyncio.sleep(0.2)
    finally:
        for server in servers:
            server.close()
            await server.wait_closed()
        with contextlib.suppress(OSError):
            os.unlink(path)
    if arrived:
        return False, f"{len(arrived)} connection(s) reached host unix sockets ({', '.join(arrived)}): {_out(r)}"
    return True, f"no connection reached the host's unix sockets; inside: {_out(r)}"


_ARGV = """import os
seen, found = 0, []
for p in os.listdir("/proc"):
    if p.isdigit():
        seen += 1
        try:
            argv = open(f"/proc/{p}/cmdline", "rb").read()
        except OSError:
            continue
        if b"argv-" + b"secret-" in argv:  # spelled in two parts, so this program's own argv does not match
            found.append(argv.replace(b"\\0", b" ").decode(errors="replace"))
print("pids", seen, "found", found)"""


async def check_host_proc_argv(c: Hostile) -> tuple[bool, str]:
    """A host process carries a secret on its command line (as ``--api-key``s and tokens often do): it must
    not be readable from inside, and the sandbox should see no more than its own processes."""
    secret = f"argv-secret-{secrets.token_hex(8)}"
    victim = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(60)", secret],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    await asyncio.sleep(0.1)  # exec'd: its argv is in /proc
    try:
        r = await c.py(_ARGV, timeout=15)
    finally:
        victim.kill()
        victim.wait()
    words = r.stdout.split()
    pids = words[1] if len(words) > 1 else "?"
    if secret in r.stdout + r.stderr:
        return False, f"a host process's argv was read ({pids} pids visible): {_out(r, 120)}"
    return True, f"host argv not visible ({pids} pids visible): {_out(r, 120)}"


_SHM = """import os, sys
prefix, tries, per_file = sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
written, why, n = 0, "done", 0
try:
    while written < tries << 20:
        with open(f"{prefix}-{n}", "wb") as f:  # file by file, each under the single-file limit
            for _ in range(per_file):
                f.write(b"x" * (1 << 20)); f.flush(); written += 1 << 20
        n += 1
except OSError as e:
    why = e.strerror or str(e)
print(written >> 20, why, flush=True)"""


async def check_shm_quota(c: Hostile) -> tuple[bool, str]:
    """Write 2x ``scratch_mb`` into ``/dev/shm`` (file by file), then reset the sandbox: the host's
    ``/dev/shm`` must not get more than ``scratch_mb`` (a private one is fine), and nothing may be left of it
    after ``reset()``."""
    shm = Path("/dev/shm")
    if not shm.is_dir():
        return True, "no /dev/shm on this host"
    name = f"{c.mark}-shm"
    tries = 2 * c.config.scratch_mb + 16
    per_file = max(1, min(16, c.config.file_size_mb // 2))

    def on_host() -> int:
        return sum(p.stat().st_size for p in shm.glob(name + "-*")) >> 20

    try:
        r = await c.py(_SHM, f"/dev/shm/{name}", tries, per_file, timeout=120)
        got = on_host()
        await c.sandbox.reset()
        left = on_host()
    finally:
        for p in shm.glob(name + "-*"):
            with contextlib.suppress(OSError):
                p.unlink()
    detail = f"inside wrote {_out(r, 60)}; host /dev/shm got {got} MB, {left} MB left after reset"
    return got <= c.config.scratch_mb + 1 and left == 0, detail


CHECKS: dict[str, Callable[[Hostile], Awaitable[tuple[bool, str]]]] = {
    "network_loopback": check_network_loopback,
    "network_interfaces": check_network_interfaces,
    "fork_bomb": check_fork_bomb,
    "memory_hog": check_memory_hog,
    "infinite_loop": check_infinite_loop,
    "write_outside_scratch": check_write_outside_scratch,
    "read_outside_scratch": check_read_outside_scratch,
    "env_secrets": check_env_secrets,
    "signal_parent": check_signal_parent,
    "mount_chroot_unshare": check_mount_chroot_unshare,
    "fill_disk": check_fill_disk,
    "stdout_flood": check_stdout_flood,
    "unix_socket": check_unix_socket,
    "host_proc_argv": check_host_proc_argv,
    "shm_quota": check_shm_quota,
}
"""Every check, in the order the report lists them."""
