"""Sandbox conformance: every backend (docker, bubblewrap, process) honours the same contract.

Real backends only: a real Docker engine, real bwrap, real processes. Each test runs once per
backend (``sandbox_backend``; docker ones carry ``pytest.mark.docker`` so ``-m "not docker"``
deselects them) and skips only when that backend cannot exist on this machine.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import time
from pathlib import Path

import pytest

from agentrl.sandbox import ExecResult, Sandbox, create_sandbox
from tests.conftest import sandbox_config

pytestmark = pytest.mark.e2e  # real sandboxes (docker, bubblewrap, process): see conftest

BACKENDS = [pytest.param("docker", marks=pytest.mark.docker), "bubblewrap", "process"]
per_backend = pytest.mark.parametrize("sandbox_backend", BACKENDS, indirect=True)


@pytest.fixture
async def sb(sandbox_backend):
    sandbox = await create_sandbox(sandbox_config(sandbox_backend, timeout=10.0, max_output_bytes=4096))
    yield sandbox
    await sandbox.close()


def _marked_pids(mark: str) -> list[int]:
    """Host pids whose command line carries ``mark`` (the host sees every backend's processes here)."""
    pids = []
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            try:
                if mark.encode() in (p / "cmdline").read_bytes():
                    pids.append(int(p.name))
            except OSError:
                pass
    return pids


async def _gone(mark: str, grace: float = 3.0) -> bool:
    deadline = time.monotonic() + grace
    while _marked_pids(mark):
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(0.05)
    return True


# -- running programs -----------------------------------------------------------------------------


@per_backend
async def test_shell_string_argv_list_and_code(sb: Sandbox):
    r = await sb.run("echo $((6 * 7)); echo oops >&2")
    assert (r.stdout, r.stderr, r.exit_code, r.ok) == ("42\n", "oops\n", 0, True)
    assert r.duration > 0
    r = await sb.run(["printf", "%s|", "a b", "$HOME", "*"])  # argv: no shell, no expansion
    assert r.stdout == "a b|$HOME|*|" and r.ok
    r = await sb.run(code="import sys\nprint(sum(range(5)))\nsys.exit(3)")
    assert (r.stdout, r.exit_code, r.ok) == ("10\n", 3, False)


@per_backend
async def test_command_and_code_are_exclusive(sb: Sandbox):
    with pytest.raises((ValueError, TypeError)):
        await sb.run("true", code="pass")
    with pytest.raises((ValueError, TypeError)):
        await sb.run()


@per_backend
async def test_stdin_text_and_bytes(sb: Sandbox):
    r = await sb.run("tr a-z A-Z", stdin="hello\nworld\n")
    assert r.stdout == "HELLO\nWORLD\n"
    r = await sb.run(code="import sys; d = sys.stdin.buffer.read(); print(len(d), d[:2].hex())", stdin=b"\xff\x00abc")
    assert r.stdout == "5 ff00\n"
    r = await sb.run("cat")  # no stdin given: EOF at once, never a hang
    assert r.stdout == "" and r.ok and not r.timed_out


@per_backend
async def test_exit_codes_and_crashes_never_raise(sb: Sandbox):
    assert (await sb.run("exit 7")).exit_code == 7
    assert (await sb.run(["false"])).exit_code == 1
    killed = await sb.run("kill -9 $$")
    assert not killed.ok and killed.exit_code in (None, 137, -9)
    missing = await sb.run(["/no/such/program"])  # the model's mistake: a result, not an exception
    assert not missing.ok and missing.exit_code not in (0, None)
    crash = await sb.run(code="raise KeyError('boom')")
    assert crash.exit_code == 1 and "KeyError: 'boom'" in crash.stderr


@per_backend
async def test_files_in_and_out(sb: Sandbox):
    blob = bytes(range(256)) * 64
    await sb.write_files({"a/b/c.txt": "nested ✓", "bin.dat": blob, "./x/../top.txt": "top"})
    r = await sb.run("cat a/b/c.txt && wc -c < bin.dat && cat top.txt")
    assert r.stdout == "nested ✓" + "16384\n" + "top"
    assert await sb.read_file("bin.dat") == blob
    assert await sb.read_file("bin.dat", max_bytes=10) == blob[:10]
    assert await sb.read_file("/scratch/a/b/c.txt") == "nested ✓".encode()
    r = await sb.run(
        code="import os; os.makedirs('out/deep'); open('out/deep/r.bin','wb').write(bytes([0, 255]) * 3)",
        files={"in/args.txt": "ignored"},
    )
    assert r.ok, r.text()
    assert await sb.read_file("out/deep/r.bin") == bytes([0, 255]) * 3
    assert await sb.read_file("in/args.txt") == b"ignored"
    with pytest.raises(FileNotFoundError):
        await sb.read_file("nope.txt")


@per_backend
@pytest.mark.parametrize("path", ["../x", "/etc/passwd", "a/../../x", "/scratch/../etc/passwd"])
async def test_path_escape_refused(sb: Sandbox, path: str):
    with pytest.raises(ValueError):
        await sb.write_files({path: "x"})
    with pytest.raises(ValueError):
        await sb.read_file(path)
    with pytest.raises(ValueError):
        await sb.run("true", files={path: "x"})


@per_backend
async def test_symlinks_planted_by_the_program_never_lead_the_host_outside(sb: Sandbox, tmp_path: Path):
    """write_files/read_file run with the host's privileges: a symlink the program made must not redirect them."""
    tmp_path.chmod(0o777)
    secret = tmp_path / "secret.txt"
    secret.write_text(token := secrets.token_hex(8))
    secret.chmod(0o644)
    r = await sb.run(
        ["sh", "-c", 'ln -s "$1" link; ln -s "$2" dirlink; ln -s "$2/target" flink', "sh", str(secret), str(tmp_path)]
    )
    assert r.ok, r.text()
    try:
        leaked = await sb.read_file("link")
    except (ValueError, FileNotFoundError):
        leaked = b""
    assert token.encode() not in leaked
    for path in ("dirlink/planted.txt", "flink"):
        try:
            await sb.write_files({path: "pwned"})
        except (ValueError, FileNotFoundError, OSError):
            pass
    assert not (tmp_path / "planted.txt").exists() and not (tmp_path / "target").exists()
    assert secret.read_text() == token


# -- environment ------------------------------------------------------------------------------------


@per_backend
async def test_env_host_absent_config_and_call_present(sandbox_backend, monkeypatch):
    monkeypatch.setenv("AGENTRL_TEST_HOST_ONLY", "host-value")
    cfg = sandbox_config(sandbox_backend, env={"FROM_CONFIG": "cfg", "BOTH": "config"})
    async with await create_sandbox(cfg) as sb:
        r = await sb.run(
            code="import json, os; print(json.dumps(dict(os.environ)))", env={"PER_CALL": "call", "BOTH": "call"}
        )
        env = json.loads(r.stdout)
        assert "AGENTRL_TEST_HOST_ONLY" not in env and "host-value" not in r.stdout
        assert env["FROM_CONFIG"] == "cfg" and env["PER_CALL"] == "call"
        assert env["BOTH"] == "call"  # the call's own env wins over the config's
        r = await sb.run("echo ${PER_CALL:-unset}")
        assert r.stdout == "unset\n"  # per-call env does not leak into the next call


# -- time limits and output limits -------------------------------------------------------------------


@per_backend
async def test_timeout_kills_the_whole_tree(sb: Sandbox):
    mark = f"tree-{secrets.token_hex(6)}"
    loop = "while :; do echo x >> {f}; sleep 0.05; done"
    script = (
        f"sh -c '{loop.format(f='bg.txt')}' {mark} & "  # backgrounded grandchild
        f"setsid sh -c '{loop.format(f='sid.txt')}' {mark} & "  # one that left the process group
        "sleep 100"
    )
    t0 = time.monotonic()
    r = await sb.run(script, timeout=1.0)
    took = time.monotonic() - t0
    assert r.timed_out and r.exit_code is None and not r.ok
    assert 0.9 <= took < 4.0, took
    assert "timed out" in r.text()
    assert await _gone(mark), "a backgrounded process survived the timeout"
    sizes = [len(await sb.read_file(f)) for f in ("bg.txt", "sid.txt")]
    await asyncio.sleep(0.5)
    assert [len(await sb.read_file(f)) for f in ("bg.txt", "sid.txt")] == sizes, "still writing after the timeout"
    assert sizes[0] > 0


@per_backend
async def test_output_truncated_with_marker(sb: Sandbox):
    r = await sb.run("head -c 100000 /dev/zero | tr '\\0' a; head -c 50000 /dev/zero | tr '\\0' b >&2")
    assert r.truncated and r.ok
    assert r.stdout.startswith("a" * 4096) and "output truncated: 100000 bytes in total" in r.stdout
    assert r.stderr.startswith("b" * 4096) and "output truncated: 50000 bytes in total" in r.stderr
    assert len(r.stdout) < 4096 + 200 and len(r.stderr) < 4096 + 200
    small = await sb.run("echo short")
    assert not small.truncated and small.stdout == "short\n"


@per_backend
async def test_result_text_as_the_model_reads_it(sb: Sandbox):
    assert (await sb.run("echo hi")).text() == "hi"
    assert (await sb.run("echo out; echo err >&2; exit 3")).text() == "out\nerr\n[exit code 3]"
    assert (await sb.run("true")).text() == "[no output]"
    timed = await sb.run("sleep 5", timeout=0.5)
    # the marker follows whatever the process wrote before it died (a shell may print "Killed")
    assert "[timed out after 0." in timed.text() and timed.text().endswith("the process was killed]")
    assert isinstance(timed, ExecResult)


# -- sessions -----------------------------------------------------------------------------------------

REPL = [
    "python3",
    "-u",
    "-c",
    "import sys\nns = {}\nfor line in sys.stdin:\n    exec(line, ns)\n    print(repr(ns.get('x')), flush=True)",
]


@per_backend
async def test_session_keeps_state_and_times_out(sb: Sandbox):
    s = await sb.session("py", REPL)
    await s.send(b"x = 41\n")
    assert await s.readline(timeout=10) == b"41\n"
    await s.send(b"x += 1\n")
    assert await s.readline(timeout=10) == b"42\n"
    assert await sb.session("py", REPL) is s  # alive: the same session
    await s.send(b"import time; time.sleep(30)\n")
    with pytest.raises(TimeoutError):
        await s.readline(timeout=0.3)
    await s.kill()
    await s.kill()  # idempotent
    assert not s.alive
    with pytest.raises(EOFError):
        await s.send(b"x = 1\n")
    s2 = await sb.session("py", REPL)  # dead: restarted by name, state lost
    assert s2 is not s and s2.alive
    await s2.send(b"pass\n")
    assert await s2.readline(timeout=10) == b"None\n"


@per_backend
async def test_session_long_line_and_exit(sb: Sandbox):
    s = await sb.session("py", REPL)
    await s.send(b"x = 'y' * 5000\n")
    with pytest.raises(ValueError):
        await s.readline(timeout=10, limit=100)
    s2 = await sb.session("exits", ["python3", "-c", "print('bye')"])
    assert await s2.readline(timeout=10) == b"bye\n"
    with pytest.raises(EOFError):
        await s2.readline(timeout=10)
    deadline = time.monotonic() + 5
    while s2.alive and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    assert not s2.alive
    assert (await sb.session("exits", ["python3", "-c", "print('again')"])) is not s2


@per_backend
async def test_reset_kills_sessions(sb: Sandbox):
    s = await sb.session("py", REPL)
    await s.send(b"x = 1\n")
    assert await s.readline(timeout=10) == b"1\n"
    await sb.reset()
    assert not s.alive
    with pytest.raises(EOFError):
        await s.readline(timeout=2)


# -- reset, close, concurrency ------------------------------------------------------------------------


@per_backend
async def test_reset_wipes_scratch_and_kills_background(sb: Sandbox):
    mark = f"bg-{secrets.token_hex(6)}"
    await sb.write_files({"a.txt": "1", ".hidden": "2", ".dir/.x": "3", "d/e/f": "4"})
    r = await sb.run(
        f"setsid sh -c 'while :; do echo x >> bg.txt; sleep 0.05; done' {mark} > /dev/null 2>&1 & "
        "chmod 000 d; sleep 0.2"
    )
    assert r.ok, r.text()
    await sb.reset()
    assert await _gone(mark), "reset left a background process running"
    await asyncio.sleep(0.3)
    r = await sb.run("ls -A")
    assert r.ok and r.stdout == "", f"scratch not empty after reset: {r.stdout!r}"
    assert (await sb.run("echo usable")).stdout == "usable\n"


@per_backend
async def test_close_is_idempotent(sandbox_backend):
    sb = await create_sandbox(sandbox_config(sandbox_backend))
    assert (await sb.run("echo up")).stdout == "up\n"
    await sb.close()
    await sb.close()
    async with await create_sandbox(sandbox_config(sandbox_backend)) as sb2:
        assert (await sb2.run("true")).ok
    await sb2.close()


@per_backend
async def test_many_sandboxes_concurrently_are_isolated(sandbox_backend):
    cfg = sandbox_config(sandbox_backend)
    boxes = await asyncio.gather(*(create_sandbox(cfg) for _ in range(6)))
    try:
        assert len({id(b) for b in boxes}) == 6
        await asyncio.gather(*(b.write_files({f"mine{i}.txt": str(i)}) for i, b in enumerate(boxes)))
        results = await asyncio.gather(*(b.run("sleep 0.3; ls") for b in boxes))
        assert [r.stdout.split() for r in results] == [[f"mine{i}.txt"] for i in range(6)]
    finally:
        await asyncio.gather(*(b.close() for b in boxes))


@per_backend
async def test_isolation_is_named(sb: Sandbox, sandbox_backend):
    expected = {"docker": "docker", "bubblewrap": "bubblewrap", "process": "process (weak: no filesystem isolation)"}
    assert sb.isolation == expected[sandbox_backend]
