"""The local backend's own guarantees: uids, cgroups/rlimits, symlink escapes, the reaper, the fallback.

Everything runs the real ``bwrap`` and real subprocesses on this host; the cross-backend contract and
the hostile programs live in tests/test_sandbox.py and tests/test_sandbox_security.py.
"""

from __future__ import annotations

import asyncio
import fcntl
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from agentrl.sandbox import SandboxError, jail, local
from agentrl.sandbox.local import LocalSandbox, bubblewrap_unavailable_reason
from tests.conftest import sandbox_config

pytestmark = pytest.mark.e2e  # real sandboxes (docker, bubblewrap, process): see conftest

BACKENDS = ["bubblewrap", "process"]
ROOT = os.geteuid() == 0
needs_root = pytest.mark.skipif(not ROOT, reason="distinct uids, cgroups and the tmpfs need root")


async def make(backend: str, **overrides) -> LocalSandbox:
    return await LocalSandbox.create(sandbox_config(backend, **overrides), bubblewrap=backend == "bubblewrap")


@pytest.fixture(params=BACKENDS)
async def sb(request):
    sandbox = await make(request.param)
    yield sandbox
    await sandbox.close()


def host_pids_with(marker: str) -> list[int]:
    """Host pids whose command line contains ``marker`` (processes a sandbox should have lost)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if marker in Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode():
                found.append(int(pid))
        except OSError:
            continue
    return found


def test_bubblewrap_reason_names_the_fix(monkeypatch):
    bubblewrap_unavailable_reason.cache_clear()
    monkeypatch.setenv("PATH", "/nonexistent")  # bwrap really absent from PATH
    try:
        reason = bubblewrap_unavailable_reason()
        assert reason is not None and "apt-get install bubblewrap" in reason
    finally:
        bubblewrap_unavailable_reason.cache_clear()


async def test_isolation_names_and_what_each_can_see(sb):
    result = await sb.run("test -e /work && echo host-visible; pwd; echo $SCRATCH")
    assert result.ok, result
    if sb.bubblewrap:
        assert sb.isolation == "bubblewrap"
        assert result.stdout.split() == ["/scratch", "/scratch"]
    else:  # the weak fallback says it reads the host, and it does
        assert sb.isolation == "process (weak: no filesystem isolation)"
        assert result.stdout.split() == ["host-visible", sb.scratch_dir, sb.scratch_dir]


async def test_bwrap_hides_host_paths():
    sandbox = await make("bubblewrap")
    try:
        hidden = "/root /home /work /tmp/agentrl-sandbox /etc/shadow /etc/pip.conf"
        probe = f"for p in {hidden}; do test -e $p && echo $p; done; ls /tmp"
        result = await sandbox.run(probe)
        assert result.ok and result.stdout == "", result
        assert (await sandbox.run("touch /usr/x || touch /newdir || echo read-only")).stdout.strip() == "read-only"
        assert (await sandbox.run("whoami")).stdout.strip() == "sandbox"
    finally:
        await sandbox.close()


@needs_root
async def test_uids_are_distinct_per_live_sandbox_and_freed_on_close():
    a, b = await make("bubblewrap"), await make("process")
    try:
        ids = [int((await s.run("id -u")).stdout) for s in (a, b)]
        assert ids == [a._lease.uid, b._lease.uid] and ids[0] != ids[1]
        assert all(jail.UID_BASE <= uid < jail.UID_BASE + jail.UID_COUNT for uid in ids)
        lock = os.open(jail.runtime_dir() / "uids" / str(a._lease.uid), os.O_RDWR)
        try:
            with pytest.raises(BlockingIOError):  # held while the sandbox lives (other processes skip it)
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            await a.close()
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)  # free again once closed,
            assert os.pread(lock, 1, 0) == b""  # and marked clean: nothing of it left to kill
        finally:
            os.close(lock)
    finally:
        await a.close()
        await b.close()


@pytest.mark.parametrize("backend", BACKENDS)
async def test_rlimits_are_applied_inside(backend):
    sandbox = await make(backend, pids=77, file_size_mb=3, timeout=5.0)
    try:
        limits = (await sandbox.run("cat /proc/self/limits")).stdout
        row = {line[:26].strip(): line[26:].split()[0] for line in limits.splitlines()[1:]}
        assert row["Max file size"] == str(3 << 20)
        assert row["Max open files"] == "1024"
        assert row["Max cpu time"] == str(5 + 2)
        if ROOT:  # per-uid process count is only the sandbox's own when its uid is
            assert row["Max processes"] == "77"
        big = await sandbox.run(code="open('big', 'wb').write(b'x' * (4 << 20))")
        assert big.exit_code != 0 and "File too large" in big.stderr
    finally:
        await sandbox.close()


@needs_root
@pytest.mark.parametrize("backend", BACKENDS)
async def test_cgroup_limits_hold_the_sandbox_processes(backend):
    if not jail.cgroup_parents():
        pytest.skip("cgroups (v1) are not writable here")
    sandbox = await make(backend, memory_mb=96, pids=40, cpus=0.5)
    try:
        session = await sandbox.session("s", ["sleep", "31.25"])
        assert session.alive
        group = sandbox._cgroup
        mem = Path(group.dirs["memory"])
        assert int((mem / "memory.limit_in_bytes").read_text()) == 96 << 20
        assert (Path(group.dirs["pids"]) / "pids.max").read_text().strip() == "40"
        assert (Path(group.dirs["cpu"]) / "cpu.cfs_quota_us").read_text().strip() == "50000"
        assert set(host_pids_with("sleep 31.25")) <= group.members() != set()
        hog = await sandbox.run(code="x = bytearray(400 << 20)")
        assert hog.exit_code is None and "out of memory" in hog.stderr
        assert (await sandbox.run("echo alive")).stdout == "alive\n"  # the sandbox survives its OOM
    finally:
        await sandbox.close()
    assert not os.path.exists(group.dirs["memory"])


async def test_symlinks_planted_by_the_program_are_never_followed(sb, tmp_path):
    secret = tmp_path / "secret"
    secret.write_text("host secret")
    os.chmod(tmp_path, 0o755)
    planted = await sb.run(f"ln -s {secret} link; ln -s {tmp_path} dir; mkfifo fifo; echo ok")
    assert planted.stdout == "ok\n", planted
    for path in ("link", "dir/secret", "fifo"):
        with pytest.raises(ValueError, match="symbolic link|regular file"):
            await asyncio.wait_for(sb.read_file(path), 5)
    for path in ("link", "dir/new"):
        with pytest.raises(ValueError, match="symbolic link"):
            await sb.write_files({path: "pwned"})
    assert secret.read_text() == "host secret" and not (tmp_path / "new").exists()
    with pytest.raises(ValueError, match="leaves the scratch"):
        await sb.write_files({"../x": "no"})
    with pytest.raises(FileNotFoundError):
        await sb.read_file("missing.txt")


async def test_files_round_trip_and_belong_to_the_sandbox_user(sb):
    await sb.write_files({"sub/dir/a.txt": "alpha", "b.bin": b"\x00\x01"})
    result = await sb.run("cat sub/dir/a.txt && echo more >> sub/dir/a.txt && touch sub/dir/c")
    assert result.ok and result.stdout == "alpha", result
    assert await sb.read_file("sub/dir/a.txt") == b"alphamore\n"
    assert await sb.read_file("/scratch/b.bin", max_bytes=1) == b"\x00"


async def test_a_timeout_or_the_end_of_a_call_kills_its_whole_tree(sb):
    started = time.monotonic()
    slow = await sb.run("sleep 97.25 & sleep 97.5 & wait", timeout=0.5)
    assert slow.timed_out and slow.exit_code is None and time.monotonic() - started < 5
    quick = await sb.run("sleep 97.75 > /dev/null 2>&1 & echo started")
    assert quick.ok and quick.stdout == "started\n"
    await asyncio.sleep(0.2)
    assert host_pids_with("sleep 97.") == []


async def test_output_is_capped_while_streaming(sb):
    result = await sb.run("head -c 5000000 /dev/zero | tr '\\0' a; echo err >&2", timeout=30)
    assert result.ok and result.truncated and result.stderr == "err\n"
    assert result.stdout.startswith("a" * sb.config.max_output_bytes)
    assert "5000000 bytes in total" in result.stdout


async def test_environment_is_cleared_and_set_explicitly(monkeypatch):
    monkeypatch.setenv("AGENTRL_HOST_SECRET", "s3cr3t")
    for backend in BACKENDS:
        sandbox = await make(backend, env={"FROM_CONFIG": "1"})
        try:
            env = (await sandbox.run("env", env={"PER_CALL": "2"})).stdout
            assert "s3cr3t" not in env and "FROM_CONFIG=1" in env and "PER_CALL=2" in env
            assert "PATH=/usr/local/sbin" in env
            with pytest.raises(ValueError, match="names are non-empty"):
                await sandbox.run("true", env={"A=B": "x"})
        finally:
            await sandbox.close()


async def test_process_fallback_has_only_loopback_and_no_host_network():
    server = await asyncio.start_server(lambda r, w: w.close(), "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    sandbox = await make("process")
    try:
        links = (await sandbox.run("tail -n +3 /proc/net/dev")).stdout.split()
        assert [w for w in links if w.endswith(":")] == ["lo:"]
        probe = f"import socket; socket.create_connection(('127.0.0.1', {port}), timeout=3); print('connected')"
        result = await sandbox.run(code=probe)
        assert result.exit_code != 0 and "connected" not in result.stdout
        inner = "import socket; s=socket.socket(); s.bind(('127.0.0.1',0)); s.listen(); print('lo up')"
        assert (await sandbox.run(code=inner)).stdout == "lo up\n"  # lo is up inside, as in docker
    finally:
        await sandbox.close()
        server.close()


async def test_reset_kills_sessions_and_wipes_scratch_and_tmp(sb):
    session = await sb.session("py", ["python3", "-u", "-c", "import sys\nfor l in sys.stdin: print(l.strip()[::-1])"])
    await session.send(b"abc\n")
    assert await session.readline(5) == b"cba\n"
    assert (await sb.run('touch .hidden visible "$TMPDIR/t" && mkdir -p d && chmod 000 d')).ok
    await sb.reset()
    assert not session.alive
    listing = await sb.run('ls -A; ls -A "$TMPDIR"')
    assert listing.ok and listing.stdout == "", listing
    again = await sb.session("py", ["cat"])
    assert again is not session and again.alive


async def test_session_errors_are_typed(sb):
    session = await sb.session("s", ["sh", "-c", "read x; head -c 3000 /dev/zero | tr '\\0' y; echo; exit 0"])
    with pytest.raises(TimeoutError):
        await session.readline(0.2)
    await session.send(b"go\n")
    with pytest.raises(ValueError, match="longer than 1000"):
        await session.readline(5, limit=1000)
    with pytest.raises(EOFError):
        await session.readline(5)
    await session.kill()
    await session.kill()  # idempotent
    with pytest.raises(EOFError):
        await session.send(b"x\n")


async def test_bad_calls_get_clear_errors(sb):
    with pytest.raises(ValueError, match="exactly one"):
        await sb.run("true", code="pass")
    with pytest.raises(ValueError, match="timeout"):
        await sb.run("true", timeout=0)
    missing = await sb.run(["no-such-program-xyz"])
    assert missing.exit_code not in (0, None)
    big = await sb.run(code="x = 1\n" * 20000 + "print('big ok')")  # 120 kB: more than one argv string holds
    assert big.stdout == "big ok\n", big
    assert (await sb.run("cat", stdin="piped")).stdout == "piped"
    with pytest.raises(TypeError, match="list of str"):  # as on docker
        await sb.run(["echo", 1])
    with pytest.raises(TypeError, match="list of str"):
        await sb.session("s", [])
    assert (await sb.run("mkdir -p adir")).ok
    with pytest.raises(IsADirectoryError):  # as on docker: the tools then suggest listing it
        await sb.read_file("adir")
    with pytest.raises(IsADirectoryError):
        await sb.write_files({"adir": "x"})


@needs_root
async def test_scratch_is_capped_and_the_sandbox_recovers(sb):
    small = await make("bubblewrap" if sb.bubblewrap else "process", scratch_mb=8, file_size_mb=64)
    try:
        fill = await small.run("dd if=/dev/zero of=fill bs=1M count=20 2>&1; echo rc=$?")
        assert "No space left" in fill.stdout and "rc=1" in fill.stdout
        with pytest.raises(ValueError, match="scratch is full"):
            await small.write_files({"more": b"x" * (9 << 20)})
        await small.reset()
        assert (await small.run("df -k . | tail -1")).ok
        assert (await small.run("ls -A")).stdout == ""
    finally:
        await small.close()


async def test_close_removes_everything_and_is_idempotent(sb):
    root, session = sb.root, await sb.session("s", ["sleep", "93.5"])
    await sb.close()
    await sb.close()
    assert not root.exists() and not session.alive and host_pids_with("sleep 93.5") == []
    with pytest.raises(SandboxError, match="closed"):
        await sb.run("true")


@needs_root
async def test_close_frees_the_cgroup_and_uid_even_when_its_dir_cannot_be_removed():
    sandbox = await make("process")
    blocker = sandbox.root / "blocker"
    blocker.mkdir()
    jail.mount_tmpfs(str(blocker), 1)  # a mount point: the wipe cannot delete it, so the root dir stays
    lock = os.open(jail.runtime_dir() / "uids" / str(sandbox._lease.uid), os.O_RDWR)
    try:
        await sandbox.close()
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)  # the uid's lock was released
        assert os.pread(lock, 1, 0) == b"" and sandbox.root.exists()
        if sandbox._cgroup is not None:
            assert not any(os.path.exists(d) for d in sandbox._cgroup.dirs.values())
    finally:
        os.close(lock)
        jail.umount(str(blocker))
        shutil.rmtree(sandbox.root, ignore_errors=True)


async def test_a_reaped_leaders_pid_taken_by_another_group_is_not_killed():
    """Without a cgroup the fallback kills a call's process group after its leader was reaped; if that
    pid now belongs to a live process (another call's new group), that group must be spared."""
    sandbox = await make("process")
    other = subprocess.Popen(["sleep", "89.25"], start_new_session=True)  # its own group, pgid == pid
    try:
        reaped = asyncio.get_running_loop().create_future()
        reaped.set_result(None)
        await sandbox._kill(other.pid, reaped, None)  # as if ``other.pid`` were a reaped leader's
        await asyncio.sleep(0.1)
        assert other.poll() is None
    finally:
        other.kill()
        other.wait()
        await sandbox.close()


CHILD = """
import asyncio, sys
from agentrl.sandbox import SandboxConfig
from agentrl.sandbox.local import LocalSandbox
async def main():
    sb = await LocalSandbox.create(SandboxConfig(backend="process"), bubblewrap=False)
    await sb.session("s", ["sleep", "91.75"])
    print(sb.root, flush=True)
    await asyncio.sleep(600)
asyncio.run(main())
"""


async def test_stale_sandboxes_of_a_killed_owner_are_reaped():
    sandbox_config("process")
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    child = subprocess.Popen([sys.executable, "-c", CHILD], stdout=subprocess.PIPE, text=True, env=env)
    try:
        line = await asyncio.wait_for(asyncio.to_thread(child.stdout.readline), 60)
        root = Path(line.strip())
        assert root.is_dir() and host_pids_with("sleep 91.75")
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
    assert root.is_dir()  # the owner died without cleaning up
    local._reaped.clear()  # as if this were the next process to create a sandbox here
    sandbox = await make("process")
    await sandbox.close()
    assert not root.exists()
    if ROOT:  # its uid could be killed; as a normal user the orphan stays until it ends
        assert host_pids_with("sleep 91.75") == []


UNPRIVILEGED = """
import asyncio, json, os, sys
from agentrl.sandbox.base import SandboxConfig
MARK = 95 + 0.5  # not spelled out: this script is in our own command line
def cmdline(pid):
    try:
        return open(f"/proc/{pid}/cmdline", "rb").read()
    except OSError:
        return b""
from agentrl.sandbox.local import LocalSandbox
async def main():
    out = {}
    for backend in ("bubblewrap", "process"):
        config = SandboxConfig(scratch_mb=8, pids=50, memory_mb=256)
        sb = await LocalSandbox.create(config, bubblewrap=backend == "bubblewrap")
        r = {"id": (await sb.run("id -u")).stdout.strip(),
             "limits": (await sb.run("grep -E 'processes|address space' /proc/self/limits")).stdout,
             "net": (await sb.run("tail -n +3 /proc/net/dev | cut -d: -f1")).stdout.split(),
             "fill": (await sb.run("dd if=/dev/zero of=big bs=1M count=12 2>/dev/null; echo done")).stderr,
             "after_fill": (await sb.run("ls -A")).stdout}
        r["bg"] = (await sb.run(f"sleep {MARK} > /dev/null 2>&1 & echo started")).stdout
        await sb.run("mkdir -p d/e && touch d/e/f .h && chmod 000 d")
        await sb.reset()
        r["after_reset"] = (await sb.run("ls -A")).stdout
        await sb.close()
        r["closed"] = not sb.root.exists()
        r["leftover"] = [p for p in os.listdir("/proc") if p.isdigit() and cmdline(p) == f"sleep\\0{MARK}\\0".encode()]
        out[backend] = r
    print(json.dumps(out))
asyncio.run(main())
"""


@needs_root
def test_the_unprivileged_path_as_a_normal_user():
    """As a normal user (nobody, the host's own /usr/bin/python3): no uid switch, no cgroups, no tmpfs,
    so rlimits carry the limits, the scratch cap is checked after each call, and a call's background
    processes die with its process group."""
    import json
    import shutil
    import tempfile

    if not (shutil.which("setpriv") and os.path.exists("/usr/bin/python3")):
        pytest.skip("needs setpriv and /usr/bin/python3")
    sandbox_config("bubblewrap")
    tree = Path(tempfile.mkdtemp(prefix="agentrl-nobody-"))
    try:
        pkg = tree / "agentrl" / "sandbox"
        pkg.mkdir(parents=True)
        for name in ("base.py", "jail.py", "local.py"):
            shutil.copy(Path(local.__file__).with_name(name), pkg / name)
        for init in (tree / "agentrl" / "__init__.py", pkg / "__init__.py"):
            init.touch()
        for p in [tree, *tree.rglob("*")]:
            p.chmod(0o755)
        cmd = [
            "setpriv",
            "--reuid",
            "65534",
            "--regid",
            "65534",
            "--clear-groups",
            "/usr/bin/python3",
            "-c",
            UNPRIVILEGED,
        ]
        done = subprocess.run(
            cmd,
            cwd=tree,
            capture_output=True,
            text=True,
            timeout=120,
            env={"PATH": "/usr/bin:/bin", "HOME": str(tree), "PYTHONPATH": str(tree)},
        )
        assert done.returncode == 0, done.stderr
        report = json.loads(done.stdout)
    finally:
        shutil.rmtree(tree, ignore_errors=True)
    for backend, r in report.items():
        assert r["id"] == "65534" and r["net"] == ["lo"], (backend, r)
        assert "Max processes             50" in r["limits"] and str(256 << 20) in r["limits"], (backend, r)
        assert "scratch exceeded 8 MB and was wiped" in r["fill"] and r["after_fill"] == "", (backend, r)
        assert r["after_reset"] == "" and r["closed"], (backend, r)
        assert r["bg"] == "started\n" and r["leftover"] == [], (backend, r)  # no cgroup: its group was killed
