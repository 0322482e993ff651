"""The sandboxed tools (python, bash, read_file, write_file) on every real sandbox backend.

The REPL program behind the python tool is first tested as a plain subprocess speaking its JSON
protocol (fast, no sandbox). Then every tool is driven the way an episode drives it, through
:func:`agentrl.tool.call_tool` with a real sandbox (docker, bubblewrap, process), and through a
:class:`agentrl.ToolEnv` whose ``step`` receives the model's tool calls.
"""

from __future__ import annotations

import asyncio
import base64
import json
import subprocess
import sys
import time

import pytest

from agentrl.env import ToolEnv
from agentrl.sandbox import SandboxPool, create_sandbox
from agentrl.tool import call_tool
from agentrl.tools import BashTool, PythonTool, ReadFileTool, WriteFileTool, bash, python, read_file, write_file
from agentrl.tools.python import REPL_SOURCE
from agentrl.types import Action, ToolCall
from tests.conftest import sandbox_config

# -- the REPL program, as a plain subprocess --------------------------------------------------------


class Repl:
    """``python3 -u -c REPL_SOURCE`` with pipes: ``ask(code)`` -> the decoded reply."""

    def __init__(self, cwd=None) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-I", "-u", "-c", REPL_SOURCE], stdin=subprocess.PIPE, stdout=subprocess.PIPE, cwd=cwd
        )
        self.ready = json.loads(self.proc.stdout.readline())
        self.n = 0

    def ask(self, code: str, cap: int = 1000) -> dict:
        self.n += 1
        try:
            self.proc.stdin.write(json.dumps({"id": self.n, "code": code, "max_output_bytes": cap}).encode() + b"\n")
            self.proc.stdin.flush()
        except BrokenPipeError:
            raise EOFError("the REPL exited") from None
        line = self.proc.stdout.readline()
        if not line:
            raise EOFError("the REPL exited")
        reply = json.loads(line)
        assert reply["id"] == self.n
        reply["text"] = base64.b64decode(reply["output"]).decode()
        return reply


@pytest.fixture
def repl():
    r = Repl()
    yield r
    r.proc.kill()
    r.proc.wait()


def test_repl_says_ready_and_keeps_state(repl):
    assert repl.ready["ready"] is True and repl.ready["python"].startswith("3.")
    assert repl.ask("x = 40\ndef f(y):\n    return x + y")["text"] == ""
    r = repl.ask("f(2)")
    assert r["text"] == "42\n" and r["error"] is None and not r["is_error"]
    assert repl.ask("import math")["text"] == ""
    assert repl.ask("math.floor(2.5)")["text"] == "2\n"
    assert repl.ask("_ * 10")["text"] == "20\n"  # `_` is the last shown value, as in a notebook


@pytest.mark.parametrize(
    ("code", "shown"),
    [
        ("1 + 1", "2\n"),
        ("'a' * 3", "'aaa'\n"),  # repr, not str
        ("None", ""),
        ("print('p')", "p\n"),  # print returns None: shown once
        ("x = 5", ""),
        ("for i in range(2):\n    i", ""),  # only a last top-level expression is shown
        ("import asyncio\nawait asyncio.sleep(0)\n7", "7\n"),  # top-level await
    ],
)
def test_repl_shows_the_last_expression(repl, code, shown):
    assert repl.ask(code)["text"] == shown


def test_repl_tracebacks_show_only_the_models_frames(repl):
    repl.ask("def inner():\n    return {}['missing']")
    r = repl.ask("inner()")
    assert r["is_error"] and r["text"] == ""
    tb = r["error"]
    assert tb.startswith("Traceback (most recent call last):") and tb.rstrip().endswith("KeyError: 'missing'")
    assert '<cell 2>", line 1' in tb and '<cell 1>", line 2, in inner' in tb and "return {}['missing']" in tb
    assert "<string>" not in tb and "run_code" not in tb  # the REPL's own frames are cut
    r = repl.ask("x = (")
    assert r["is_error"] and "SyntaxError" in r["error"] and "Traceback" not in r["error"]
    r = repl.ask("input('name? ')")
    assert r["is_error"] and "input() is not available" in r["error"] and "no_input" not in r["error"]
    assert repl.ask("1")["text"] == "1\n"  # still alive after all of that


def test_repl_captures_raw_fds_and_subprocesses_in_order(repl):
    code = (
        "import os, subprocess, sys\n"
        "print('one'); os.write(1, b'two\\n'); sys.stderr.write('three\\n'); os.write(2, b'four\\n')\n"
        "subprocess.run('echo five; echo six >&2', shell=True)\n"
        "'seven'"
    )
    assert repl.ask(code)["text"] == "one\ntwo\nthree\nfour\nfive\nsix\n'seven'\n"
    assert repl.ask("import sys; sys.stdin.read()")["text"] == "''\n"  # stdin is /dev/null, not the protocol
    r = repl.ask("import os; os.close(0); os.close(1); os.close(2); print('lost')")
    assert r["is_error"] and "Bad file descriptor" in r["error"]
    assert repl.ask("print('back')")["text"] == "back\n"  # fds 0-2 are restored before each request


def test_repl_caps_output_and_counts_the_rest(repl):
    start = time.monotonic()
    r = repl.ask("print('x' * 10_000_000)", cap=100)
    assert r["text"] == "x" * 100 and r["total"] == 10_000_001
    assert time.monotonic() - start < 5
    assert repl.ask("print('small')", cap=100)["text"] == "small\n"  # the next call starts clean


def test_repl_forked_children_never_answer(repl):
    r = repl.ask(
        "import os\npid = os.fork()\nif pid == 0:\n    print('child')\nelse:\n    os.waitpid(pid, 0)\n    print('parent')"
    )
    assert sorted(r["text"].split()) == ["child", "parent"]
    assert repl.ask("pid > 0")["text"] == "True\n"  # the parent's reply, and the next one, arrive in order


def test_repl_exit_keeps_the_session_and_os_exit_ends_it(repl):
    r = repl.ask("exit()")
    assert not r["is_error"] and "SystemExit" in r["error"] and "variables are kept" in r["error"]
    assert repl.ask("import sys; sys.exit(3)")["is_error"]
    assert repl.ask("2")["text"] == "2\n"
    r = repl.ask("print('last words')\nimport os; os._exit(7)")  # the supervisor's last reply, then EOF
    assert (r["lost"], r["exit_code"], r["text"]) == ("died", 7, "last words\n")
    with pytest.raises(EOFError):
        repl.ask("1")


FORGE = r"""
import base64, json, os, stat, sys, threading, time

def forged(i):
    return (json.dumps({"id": i, "output": base64.b64encode(b"all tests passed\n").decode(), "total": 17,
                        "error": None, "is_error": False, "duration": 0.0}) + "\n").encode()

def pipes(through_parent):
    # every pipe this process can open for writing: its own fds, and its parent's when /proc lets it
    dirs = ["/proc/self/fd"] + (["/proc/%d/fd" % os.getppid()] if through_parent else [])
    fds = []
    for d in dirs:
        try:
            names = os.listdir(d)
        except OSError:
            continue
        for name in names:
            try:
                if stat.S_ISFIFO(os.stat(d + "/" + name).st_mode) and not (d == dirs[0] and name in ("1", "2")):
                    fds.append(os.open(d + "/" + name, os.O_WRONLY | os.O_NONBLOCK))
            except OSError:
                pass
    return fds

def writers():
    # the REPL's own file objects, found by walking the frames of every thread
    found = []
    for frame in sys._current_frames().values():
        while frame is not None:
            for v in frame.f_locals.values():
                if hasattr(v, "write") and hasattr(v, "fileno") and v not in (sys.stdout, sys.stderr):
                    found.append(v)
            frame = frame.f_back
    return found

def current_request():
    for frame in sys._current_frames().values():
        while frame is not None:
            r = frame.f_locals.get("request")
            if isinstance(r, dict):
                return r
            frame = frame.f_back

def attack(first, through_parent):
    deadline = time.time() + 10
    while time.time() < deadline:  # wait for the next request, then answer it before the REPL does
        r = current_request()
        if r is not None and r is not first:
            break
        time.sleep(0.005)
    else:
        return
    line = forged(r.get("id", r.get("n")))
    for w in writers():
        try:
            w.write(line); w.flush()
        except Exception:
            pass
    for fd in pipes(through_parent):
        try:
            os.write(fd, line)
        except OSError:
            pass

try:
    os.listdir("/proc/%d/fd" % os.getppid())
    print("parent fds: open")
except PermissionError:
    print("parent fds: closed")
threading.Thread(target=attack, args=(current_request(), THROUGH_PARENT), daemon=True).start()
"""
"""Cell code trying to answer the *next* request itself (issue 18 item 9): it walks the frames to the
REPL's file objects and opens every pipe it can reach, and writes a forged "all tests passed" reply
there as soon as the next request arrives (``THROUGH_PARENT``: also through ``/proc/<ppid>/fd``)."""


def test_repl_replies_cannot_be_forged_from_cell_code(repl):
    """Only the supervisor can reply: the worker's pipes lead to it, and what it finds there that is not
    the cell's own result ends the session (never a forged reply)."""
    repl.ask(FORGE.replace("THROUGH_PARENT", "False"))  # not through /proc: as root, that is open here
    r = repl.ask("import time; time.sleep(0.5); print(6 * 7)")
    # the forged line reached only the supervisor (and the capture, as the code's own output), which
    # ended the session; on the old one-process REPL this reply was the forged "all tests passed"
    assert r["lost"] == "protocol" and "error" not in r and "all tests passed" not in r["text"], r
    with pytest.raises(EOFError):
        repl.ask("1")


SHADOWS = (
    "secrets",
    "select",
    "subprocess",
    "json",
    "ctypes",
    "threading",
    "base64",
    "ast",
    "types",
    "traceback",
    "linecache",
)


def plant_shadows(folder) -> None:
    """Modules named like the REPL's imports, each leaving a mark when imported (a model can write these)."""
    for name in SHADOWS:
        (folder / f"{name}.py").write_text(f"open({str(folder / ('imported-' + name))!r}, 'w').close()\n")
    (folder / "helper.py").write_text("def answer():\n    return 42\n")


def test_repl_never_imports_the_models_files_into_itself(tmp_path):
    """Files in the cwd named like stdlib modules: neither process imports them for itself (the supervisor
    runs with -I, the worker drops the cwd while importing), yet the model's own imports see its files."""
    plant_shadows(tmp_path)
    r = Repl(cwd=tmp_path)
    try:
        assert r.ready["ready"] is True and r.ready["isolated"] is True
        assert r.ask("print(6 * 7)")["text"] == "42\n"
        assert r.ask("import helper; helper.answer()")["text"] == "42\n"
        assert sorted(p.name for p in tmp_path.glob("imported-*")) == []
    finally:
        r.proc.kill()
        r.proc.wait()


def test_repl_huge_errors_are_capped_not_a_protocol_fault(repl):
    """A 100k-character syntax error or exit message is the model's error, cut to a few KB."""
    r = repl.ask("x = (" + "1 + " * 25_000)
    assert r["is_error"] and "lost" not in r and "SyntaxError" in r["error"] and len(r["error"]) < 7000
    r = repl.ask("import sys; sys.exit('e' * 300_000)")
    assert r["is_error"] and "lost" not in r and "characters cut" in r["error"] and len(r["error"]) < 7000
    assert repl.ask("1 + 1")["text"] == "2\n"


def test_repl_worker_holds_none_of_the_protocol_pipes(repl):
    """The model's code runs in a child that has no fd on the session's stdin/stdout pipes."""
    import os

    pid = int(repl.ask("import os; os.getpid()")["text"])
    assert pid != repl.proc.pid and repl.ready["isolated"] is True
    ours = {os.fstat(f.fileno()).st_ino for f in (repl.proc.stdin, repl.proc.stdout)}
    theirs = {
        os.stat(f"/proc/{pid}/fd/{fd}").st_ino
        for fd in os.listdir(f"/proc/{pid}/fd")
        if os.path.exists(f"/proc/{pid}/fd/{fd}")
    }
    assert ours and not ours & theirs
    supervisor = {os.stat(f"/proc/{repl.proc.pid}/fd/{fd}").st_ino for fd in os.listdir(f"/proc/{repl.proc.pid}/fd")}
    assert ours <= supervisor  # the check can see the pipes where they are


# -- the tools on real sandboxes ---------------------------------------------------------------------


@pytest.fixture
async def sb(sandbox_backend):
    sandbox = await create_sandbox(sandbox_config(sandbox_backend, timeout=5.0, max_output_bytes=4096))
    yield sandbox
    await sandbox.close()


async def call(tool, sandbox, **arguments):
    return await call_tool(tool, arguments, timeout=60, sandbox=sandbox)


async def test_python_state_display_and_errors(sb):
    r = await call(python, sb, code="import math\nx = 20\ndef double(v):\n    return 2 * v")
    assert (r.content, r.is_error) == ("[no output]", False)
    assert r.metadata["duration"] > 0
    r = await call(python, sb, code="print('hi ✓')\ndouble(x) + math.floor(2.5)")
    assert (r.content, r.is_error) == ("hi ✓\n42", False)
    r = await call(python, sb, code="double(None)")
    assert r.is_error and r.content.startswith("Traceback") and "TypeError" in r.content
    assert "in double" in r.content and "<string>" not in r.content
    r = await call(python, sb, code="x")  # an exception does not lose the session
    assert (r.content, r.is_error) == ("20", False)


async def test_python_survives_raw_fd_writes_and_subprocesses(sb):
    code = "import os, subprocess\nos.write(1, b'raw out\\n')\nos.write(2, b'raw err\\n')\nsubprocess.run(['echo', 'child'])\n3"
    r = await call(python, sb, code=code)
    assert (r.content, r.is_error) == ("raw out\nraw err\nchild\n3", False)
    r = await call(python, sb, code="import sys\nsys.stdin.read() == ''")
    assert r.content == "True"


async def test_python_truncates_10mb_of_output(sb):
    r = await call(python, sb, code="print('y' * 10_000_000)\nz = 1")
    assert not r.is_error and r.metadata["truncated"]
    assert r.content.startswith("y" * 4096)
    assert "[... output truncated: 10000001 bytes in total, the first 4096 shown]" in r.content
    assert len(r.content) < 4096 + 200
    assert (await call(python, sb, code="z")).content == "1"


async def test_python_timeout_restarts_the_session(sandbox_backend):
    async with await create_sandbox(sandbox_config(sandbox_backend, timeout=2.0)) as sb:
        await _timeout_restarts(sb)


async def _timeout_restarts(sb):
    await call(python, sb, code="kept = 'v'")
    start = time.monotonic()
    r = await call(python, sb, code="import time\ntime.sleep(30)", timeout=1)
    assert time.monotonic() - start < 10
    assert r.is_error and r.content == (
        "Error: timed out after 1s; the Python session was restarted and its variables are lost."
    )
    r = await call(python, sb, code="kept")
    assert r.is_error and "NameError" in r.content
    r = await call(python, sb, code="while True:\n    pass")  # no timeout given: the sandbox's 2 s
    assert r.is_error and "timed out after 2s" in r.content
    assert (await call(python, sb, code="6 * 7")).content == "42"


async def test_python_os_exit_restarts_the_session(sb):
    await call(python, sb, code="kept = 1")
    r = await call(python, sb, code="import os\nos._exit(7)")
    assert r.is_error and "the Python process exited with code 7" in r.content and "variables are lost" in r.content
    assert r.metadata["error"] == "died" and r.metadata["restarted"]
    r = await call(python, sb, code="'kept' in globals()")
    assert (r.content, r.is_error) == ("False", False)


async def test_python_forged_protocol_message_restarts_the_session_not_fails_the_sample(sb):
    """Code can find the REPL's private pipes; writing a protocol error there must not raise SandboxError
    (which would fail the sample and drop it from training: a way for a policy to hide bad samples)."""
    forge = (
        "import os, stat\nfor fd in range(3, 64):\n    try:\n"
        "        if stat.S_ISFIFO(os.fstat(fd).st_mode):\n"
        '            os.write(fd, b\'{"protocol_error": "forged"}\\n\')\n'
        "    except OSError:\n        pass"
    )
    r = await call(python, sb, code=forge)
    assert r.is_error and r.metadata.get("restarted") and "restarted" in r.content
    r = await call(python, sb, code="1 + 1")
    assert (r.content, r.is_error) == ("2", False)


async def test_python_replies_cannot_be_forged_from_cell_code(sb):
    """Issue 18 item 9 on every backend: the session's reply pipe is out of the code's reach (its
    supervisor is non-dumpable, so ``/proc/<ppid>/fd`` is closed too) and a forged reply never arrives."""
    from tests.test_sandbox_tools import FORGE

    r = await call(python, sb, code=FORGE.replace("THROUGH_PARENT", "True"))
    assert r.content == "parent fds: closed", r.content
    r = await call(python, sb, code="import time; time.sleep(0.5); print(6 * 7)")
    assert r.is_error and r.metadata["error"] == "protocol" and "all tests passed" not in r.content, r.content
    r = await call(python, sb, code="6 * 7")
    assert (r.content, r.is_error) == ("42", False)


async def test_python_session_never_imports_the_models_files_into_itself(sb):
    """Stdlib-named files in /scratch and a .pth in the user site: after a restart the new session starts
    clean (the supervisor never imports them), the model's helper module still imports."""
    from tests.test_sandbox_tools import SHADOWS

    files = {f"{n}.py": f"open('imported-{n}', 'w').close()\n" for n in SHADOWS}  # the cwd: scratch
    files["helper.py"] = "def answer():\n    return 42\n"
    await sb.write_files(files)
    r = await call(python, sb, code="import os\nos._exit(0)")
    assert r.metadata["error"] == "died"
    r = await call(
        python,
        sb,
        code="import helper\nprint(helper.answer())\nimport os\nsorted(f for f in os.listdir('.') if f.startswith('imported-'))",
    )
    assert (r.content, r.is_error) == ("42\n[]", False)


async def test_python_session_that_cannot_start_is_a_tool_error_not_a_sandbox_failure(sb):
    """The model can break its own interpreter's start (a .pth in its user site that exits): the next call
    is an error the model reads, never a SandboxError that would fail (and so hide) the sample."""
    r = await call(
        python,
        sb,
        code=(
            "import os, site, sys\nd = site.getusersitepackages()\nos.makedirs(d, exist_ok=True)\n"
            "open(os.path.join(d, 'stop.pth'), 'w').write('import sys; sys.stderr.write(\"no python here\\\\n\"); import os; os._exit(3)\\n')\n"
            "os._exit(0)"
        ),
    )
    assert r.metadata["error"] == "died"
    r = await call(python, sb, code="1 + 1")
    assert r.is_error and "could not start" in r.content and "code 3" in r.content and "no python here" in r.content, (
        r.content
    )
    await sb.run('rm -rf "$HOME/.local"')
    assert (await call(python, sb, code="1 + 1")).content == "2"


async def test_python_memory_hog_is_reported_and_recovered(sandbox_backend):
    config = sandbox_config(sandbox_backend, timeout=20.0, memory_mb=256)
    async with await create_sandbox(config) as sandbox:
        r = await call(python, sandbox, code="hog = [b'x' * (1 << 20) for _ in range(1024)]\nlen(hog)")
        # docker/bubblewrap: the memory cgroup kills the interpreter; process: RLIMIT_AS raises MemoryError
        assert r.is_error and ("MemoryError" in r.content or "the Python process exited" in r.content), r.content
        assert (await call(python, sandbox, code="'alive'")).content == "'alive'"


async def test_a_cancelled_call_leaves_no_stale_reply(sb):
    await call(python, sb, code="kept = 1")
    with pytest.raises(TimeoutError):  # e.g. the whole episode was cancelled mid-call
        await asyncio.wait_for(python(sandbox=sb, code="import time\ntime.sleep(30)\n'stale'"), 1.0)
    r = await call(python, sb, code="'fresh'")  # a new interpreter: the killed one can never answer this
    assert (r.content, r.is_error) == ("'fresh'", False)
    assert (await call(python, sb, code="'kept' in globals()")).content == "False"


async def test_bash_exit_codes_timeouts_and_no_shell_state(sb):
    r = await call(bash, sb, command="echo out; echo err >&2; exit 3")
    assert r.content == "out\nerr\n[exit code 3]" and r.is_error and r.metadata["exit_code"] == 3
    r = await call(bash, sb, command="[[ 2 -gt 1 ]] && echo {1..3}")  # bash, not sh
    assert (r.content, r.is_error) == ("1 2 3", False)
    start = time.monotonic()
    r = await call(bash, sb, command="echo started; sleep 30", timeout=1)
    assert time.monotonic() - start < 10
    assert r.is_error and r.metadata["timed_out"] and "[timed out after" in r.content
    await call(bash, sb, command="export V=1; cd /tmp")
    r = await call(bash, sb, command='echo "[$V]"; pwd')
    assert r.content.splitlines()[0] == "[]" and r.content.splitlines()[1] != "/tmp"


async def test_files_round_trip_between_the_tools(sb):
    text = "héllo ✓\nline 2\n"
    r = await call(write_file, sb, path="data/in.txt", content=text)
    assert not r.is_error and r.content == f"Wrote {len(text.encode())} bytes, 2 lines to /scratch/data/in.txt."
    r = await call(
        python,
        sb,
        code="s = open('data/in.txt', encoding='utf-8').read()\n"
        "open('data/out.txt', 'w', encoding='utf-8').write(s.upper())\ns.count('✓')",
    )
    assert r.content == "1"
    r = await call(bash, sb, command="cat data/out.txt && echo tail >> data/out.txt && wc -l < data/out.txt")
    assert r.content == "HÉLLO ✓\nLINE 2\n3"
    r = await call(read_file, sb, path="data/out.txt")
    assert (r.content, r.is_error) == ("HÉLLO ✓\nLINE 2\ntail\n", False)
    r = await call(read_file, sb, path="/scratch/data/in.txt")  # the absolute scratch path is accepted
    assert r.content == text
    r = await call(write_file, sb, path="data/in.txt", content="")  # replaced, not appended
    assert (await call(read_file, sb, path="data/in.txt")).content == "['data/in.txt' is empty]"


async def test_read_file_caps_and_binary_files(sb):
    await call(python, sb, code="open('big.txt', 'w').write('ab' * 5000)\nopen('b.bin', 'wb').write(bytes(range(256)))")
    r = await call(read_file, sb, path="big.txt")  # default: the sandbox's 4096 bytes
    assert r.content.startswith("ab" * 2048) and "[... file cut: only the first 4096 bytes are shown" in r.content
    assert r.metadata["truncated"]
    r = await call(read_file, sb, path="big.txt", max_bytes=10)
    assert r.content.startswith("ababababab\n[... file cut") and "tail -c +11 big.txt" in r.content
    assert len((await call(read_file, sb, path="big.txt", max_bytes=100_000)).content) == 10_000
    r = await call(read_file, sb, path="b.bin")
    assert not r.is_error and r.metadata["binary"]
    assert r.content.startswith("['b.bin' is not UTF-8 text") and "\\x00\\x01" in r.content and "\x00" not in r.content


@pytest.mark.parametrize(
    ("tool", "arguments", "message"),
    [
        (read_file, {"path": "/etc/passwd"}, "outside the scratch directory"),
        (read_file, {"path": "../../etc/passwd"}, "leaves the scratch directory"),
        (read_file, {"path": "a/../../x"}, "leaves the scratch directory"),
        (read_file, {"path": "missing.txt"}, "no file 'missing.txt' in /scratch"),
        (read_file, {"path": "."}, "scratch directory itself"),
        (read_file, {"path": ""}, "non-empty"),
        (write_file, {"path": "/tmp/x", "content": "x"}, "outside the scratch directory"),
        (write_file, {"path": "../x", "content": "x"}, "leaves the scratch directory"),
    ],
)
async def test_path_escapes_and_missing_files_are_refused(sb, tool, arguments, message):
    r = await call(tool, sb, **arguments)
    assert r.is_error and r.content.startswith(f"Error: {tool.name}: ") and message in r.content


async def test_directories_and_planted_symlinks_are_refused(sb, tmp_path):
    secret = tmp_path / "host-secret.txt"
    secret.write_text("HOST SECRET")
    r = await call(bash, sb, command=f"mkdir -p d && ln -s {secret} link.txt && ln -s {tmp_path} d/host")
    assert not r.is_error, r.content
    r = await call(read_file, sb, path="d")
    assert r.is_error and "ls -la d" in r.content
    for path in ("link.txt", "d/host/host-secret.txt"):  # the host must never follow a planted link
        r = await call(read_file, sb, path=path)
        assert r.is_error and "HOST SECRET" not in r.content, (path, r.content)
    for path in ("link.txt", "d/host/host-secret.txt"):  # refused, or written inside the sandbox only
        await call(write_file, sb, path=path, content="overwritten")
        assert secret.read_text() == "HOST SECRET"


@pytest.mark.e2e
@pytest.mark.parametrize(
    ("tool", "arguments", "message"),
    [
        (python, {}, "python: missing required argument 'code'"),
        (python, {"code": 1}, "python: argument 'code' must be a string, got integer 1"),
        (python, {"code": "1", "cwd": "/"}, "python: unknown argument 'cwd'"),
        (python, {"code": "  \n"}, "python: 'code' is empty"),
        (python, {"code": "x = 1\n" * 20_000}, "python: code is too long (120000 characters, at most 100000)"),
        (python, {"code": "1", "timeout": "5"}, "python: argument 'timeout' must be a number"),
        (python, {"code": "1", "timeout": 0}, "python: 'timeout' must be a positive number"),
        (bash, {"command": ""}, "bash: 'command' is empty"),
        (bash, {"command": ["ls"]}, "bash: argument 'command' must be a string, got array"),
        (bash, {"command": "echo " + "a" * 100_000}, "bash: the command is too long"),
        (bash, {"command": "ls", "timeout": -1}, "bash: 'timeout' must be a positive number"),
        (read_file, {"path": "x", "max_bytes": 0}, "read_file: 'max_bytes' must be a positive integer"),
        (read_file, {"path": "x", "max_bytes": 1.5}, "read_file: argument 'max_bytes' must be an integer"),
        (write_file, {"path": "x"}, "write_file: missing required argument 'content'"),
        (write_file, {"path": "x", "content": None}, "write_file: argument 'content' must be a string, got null"),
        (write_file, {"path": "x", "content": "a" * (5 << 20)}, "write_file: content is too large"),
    ],
)
async def test_bad_arguments_become_error_text(tool, arguments, message):
    async with await create_sandbox(sandbox_config("process")) as sandbox:  # refused before any backend work
        r = await call(tool, sandbox, **arguments)
    assert r.is_error and r.content.startswith("Error: ") and message in r.content, r.content


def test_tools_are_sandboxed_with_schemas():
    for tool, cls in ((python, PythonTool), (bash, BashTool), (read_file, ReadFileTool), (write_file, WriteFileTool)):
        assert isinstance(tool, cls) and tool.sandboxed
        spec = tool.schema()["function"]
        assert spec["name"] == tool.name and len(spec["description"]) > 80
        assert spec["parameters"]["type"] == "object" and spec["parameters"]["required"]
        assert "sandbox" not in spec["parameters"]["properties"]
    for tool in (python, bash):  # call_tool's limit sits above the limits these tools enforce themselves
        assert tool.timeout is not None and tool.timeout > tool.max_timeout


# -- through a ToolEnv episode -------------------------------------------------------------------


class SandboxEnv(ToolEnv):
    tools = [python, bash, read_file, write_file]


def _turn(*calls: tuple[str, dict]) -> Action:
    return Action(text="", tool_calls=[ToolCall(name, args, id=f"c{i}") for i, (name, args) in enumerate(calls)])


async def test_tool_env_episode_keeps_state_and_the_pool_resets_it(sandbox_backend):
    config = sandbox_config(sandbox_backend, timeout=5.0, max_output_bytes=4096)
    pool = SandboxPool(lambda: create_sandbox(config), config)
    env = SandboxEnv()
    env.sandbox_pool = pool
    try:
        await env.reset(options={"prompt": "compute"})
        obs, reward, terminated, truncated, _ = await env.step(
            _turn(
                ("write_file", {"path": "n.txt", "content": "21"}),
                ("python", {"code": "n = int(open('n.txt').read())\nn * 2"}),
            )
        )
        assert [m["content"] for m in obs] == ["Wrote 2 bytes, 1 line to /scratch/n.txt.", "42"]
        assert [m["tool_call_id"] for m in obs] == ["c0", "c1"] and not terminated and not truncated
        obs, *_ = await env.step(
            _turn(
                ("python", {"code": "open('m.txt', 'w').write(str(n + 1))\nn"}),
                ("bash", {"command": "cat m.txt"}),
                ("python", {"code": "1/0"}),
                ("python", {"code": 5}),
            )
        )
        assert [m["content"] for m in obs][:2] == ["21", "22"]
        assert "ZeroDivisionError" in obs[2]["content"]
        assert obs[3]["content"] == "Error: python: argument 'code' must be a string, got integer 5"
        obs, reward, terminated, *_ = await env.step(Action(text="the answer is 42"))
        assert terminated and obs == []
        await env.close()  # the sandbox goes back to the pool, reset: processes killed, scratch wiped

        env = SandboxEnv()
        env.sandbox_pool = pool
        await env.reset(options={"prompt": "again"})
        obs, *_ = await env.step(_turn(("python", {"code": "'n' in globals()"}), ("bash", {"command": "ls"})))
        assert [m["content"] for m in obs] == ["False", "[no output]"]
        assert pool.stats["reused"] == 1 and pool.stats["created"] == 1
        await env.close()
    finally:
        await pool.close()
