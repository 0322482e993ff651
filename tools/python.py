"""The ``python`` tool: a stateful Python session in the episode's sandbox, like a notebook kernel.

Agents solve tasks in many small steps: load data, look at it, fix a function, try again. Starting a
fresh interpreter per call would force the model to re-run everything each time, so the tool keeps
one interpreter per episode (a :class:`agentrl.sandbox.Session` called ``"python"``): variables,
imports and functions persist between calls until the episode ends, a call times out, or the
process dies (each of those is told to the model, who then knows its state is gone).

The session runs :data:`REPL_SOURCE`, a supervisor speaking one JSON line per request and per reply,
which runs the model's code in a child interpreter (:data:`WORKER_SOURCE`). The split is what keeps
the reply channel out of the code's reach: the supervisor alone holds the session's protocol pipes,
makes itself non-dumpable and runs with ``python3 -I`` (so no file the model writes in the cwd or
the user site is ever imported into it), and nothing the model's code does (walking frames,
``gc``, ``/proc/<pid>/fd``) can write or queue a reply; every reply is framed by the supervisor from the child's fds 1 and
2 (a capture pipe: ``print``, ``os.write(1, ...)`` and subprocess output all land there, in the
order they were written) and a one-line result that must carry that request's fresh random token.
Code that writes to the child's own pipes gets what a crash gets: the session is restarted and the
model reads why; it is never a sandbox failure (which would fail, and so hide, the sample). The
capture keeps only the first ``max_output_bytes`` (the sandbox config's cap) and counts the rest,
so printing 10 MB costs the model one truncation marker, not its context window.

What the split does not (and cannot) do is protect the session from itself: variables, threads
and patched modules persist by design, and code from an earlier call can patch the child's own
loop (its frames are the model's), so it controls everything in a later reply but the request id,
``duration`` and whether the child died (``lost``, ``exit_code``). An env that grades the model's
work must do it outside the session, in a fresh process (``sandbox.run``, as
:class:`agentrl.envs.python_code.PythonCode` does), never by running checks in it.

As in Jupyter, when the last statement is an expression its ``repr`` is shown (unless it is
``None``); top-level ``await`` works. An exception is shown as a short traceback of the model's
own frames (the REPL's frames are cut) and the result is marked ``is_error``.
"""

from __future__ import annotations

import itertools
import json
import logging
import math
import time
import weakref
from base64 import b64decode
from typing import Any

from agentrl.sandbox import Sandbox, SandboxError, Session, truncate_output
from agentrl.tool import Tool, ToolError, ToolResult

logger = logging.getLogger(__name__)

__all__ = ["REPL_SOURCE", "WORKER_SOURCE", "PythonTool", "python"]

START_TIMEOUT = 30.0
"""Seconds a new interpreter may take to say it is ready (a cold container can be slow)."""

WORKER_SOURCE = r'''
import sys
_cwd = sys.path.pop(0) if sys.path and sys.path[0] == "" else None  # our imports: the stdlib, not /scratch
import ast, builtins, json, linecache, os, traceback, types
try:
    import ctypes
except Exception:
    ctypes = None
if _cwd is not None:
    sys.path.insert(0, _cwd)  # the model's own imports see its files, as `python -c` would
MAX_ERROR = 6000


def cap(text):
    if len(text) > MAX_ERROR:
        text = text[:1000] + "\n[... %d characters cut ...]\n" % (len(text) - 5000) + text[-4000:]
    return text


def no_input(prompt=""):
    raise EOFError("input() is not available: the python tool has no stdin; put the values in the code")


def format_exception(e):
    tb = e.__traceback__
    skip = tb
    while skip is not None and not skip.tb_frame.f_code.co_filename.startswith("<cell "):
        skip = skip.tb_next
    te = traceback.TracebackException(type(e), e, skip if skip is not None else tb)
    te.stack = traceback.StackSummary.from_list(  # the worker's own helpers are noise to the model
        [f for f in te.stack if not (f.filename == "<string>" and f.name == "no_input")])
    return cap("".join(te.format()))


def run_code(code, ns, filename):
    """Exec `code` in `ns`; print the last expression's repr. Returns (error text or None, is_error)."""
    linecache.cache[filename] = (len(code), None, code.splitlines(True), filename)
    flags = ast.PyCF_ALLOW_TOP_LEVEL_AWAIT
    try:
        tree = compile(code, filename, "exec", ast.PyCF_ONLY_AST | flags)
        last = None
        if tree.body and isinstance(tree.body[-1], ast.Expr):
            last = ast.Expression(tree.body.pop().value)
        body = compile(tree, filename, "exec", flags)
        tail = compile(last, filename, "eval", flags) if last is not None else None
    except (SyntaxError, ValueError, OverflowError, MemoryError, RecursionError) as e:
        return cap("".join(traceback.format_exception_only(type(e), e))), True
    try:
        evaluate(body, ns)
        if tail is not None:
            value = evaluate(tail, ns)
            if value is not None:
                ns["_"] = value
                print(repr(value))
    except SystemExit as e:
        failed = e.code not in (None, 0)
        return cap("SystemExit: %r (exit() does not end the session; variables are kept)\n" % (e.code,)), failed
    except BaseException as e:
        return format_exception(e), True
    return None, False


def evaluate(code, ns):
    if code.co_flags & 0x80:  # CO_COROUTINE: top-level await
        import asyncio
        return asyncio.run(eval(code, ns))
    return eval(code, ns)


def main():
    try:  # die with the supervisor (prctl(PR_SET_PDEATHSIG, SIGKILL)); the session's kill gets us anyway
        ctypes.CDLL(None).prctl(1, 9, 0, 0, 0)
    except Exception:
        pass
    requests, results = int(sys.argv[1]), int(sys.argv[2])
    for fd in (requests, results):
        os.set_inheritable(fd, False)  # os.system and exec'd children must not get them
    requests, results = os.fdopen(requests, "rb"), os.fdopen(results, "wb")
    sys.argv = ["-c"]
    null, out = os.open(os.devnull, os.O_RDWR), os.dup(1)  # fd 1 is the supervisor's capture pipe
    main_pid = os.getpid()
    module = types.ModuleType("__main__")  # the user's namespace is a real __main__ (pickle works)
    module.__dict__["__builtins__"] = builtins
    sys.modules["__main__"] = module
    builtins.input = no_input
    results.write(b'{"hello": true}\n')
    results.flush()
    for line in requests:
        request = json.loads(line)
        os.dup2(null, 0)  # the code may have closed or moved fds 0-2 last time
        os.dup2(out, 1)
        os.dup2(out, 2)
        error, failed = run_code(request["code"], module.__dict__, "<cell %d>" % request["n"])
        if os.getpid() != main_pid:  # a fork of the user's code must not answer requests
            os._exit(0)
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except BaseException:
                pass
        results.write(json.dumps({"token": request["token"], "error": error, "is_error": failed}).encode() + b"\n")
        results.flush()


main()
'''
"""The program that runs the model's code (``python3 -u -c WORKER_SOURCE <request fd> <result fd>``).

Started by the supervisor (:data:`REPL_SOURCE`), it holds only its own pipes to it: one JSON line
per request ``{"n": cell, "code": "...", "token": t}`` in, ``{"token": t, "error": traceback text or
null, "is_error": bool}`` out; fds 1 and 2 are the supervisor's capture pipe, fd 0 is ``/dev/null``.
"""

_SUPERVISOR = r'''
import base64, json, os, secrets, select, subprocess, sys, threading, time

WORKER = None  # WORKER_SOURCE, filled in below
RESULT_LIMIT = 1 << 20  # a worker result line (its texts are capped at 6000 characters, JSON-escaped)


class Capture:
    """The worker's fds 1 and 2 point at a pipe; a thread drains it, keeping the first `limit` bytes."""

    def __init__(self):
        self.r, self.w = os.pipe()
        self.lock = threading.Lock()
        self.done = threading.Event()
        self.pending, self.head, self.total = bytearray(), bytearray(), 0
        self.limit, self.marker, self.result = 16384, None, (b"", 0)
        threading.Thread(target=self.pump, daemon=True).start()

    def pump(self):
        while True:
            data = os.read(self.r, 65536)
            if not data:
                return
            with self.lock:
                self.feed(data)

    def feed(self, data):
        self.pending += data
        m = self.marker
        if m is not None:
            i = self.pending.find(m)
            if i >= 0:  # the end of this request's output; what follows belongs to the next one
                self.keep(self.pending[:i])
                self.result = (bytes(self.head), self.total)
                self.head, self.total, self.marker = bytearray(), 0, None
                rest = bytes(self.pending[i + len(m):])
                self.pending.clear()
                self.keep(rest)
                self.done.set()
                return
            cut = max(0, len(self.pending) - len(m) + 1)  # hold back a possible marker prefix
        else:
            cut = len(self.pending)
        self.keep(self.pending[:cut])
        del self.pending[:cut]

    def keep(self, data):
        room = self.limit - len(self.head)
        if room > 0:
            self.head += data[:room]
        self.total += len(data)

    def finish(self):
        """Everything written so far (head, total bytes): a random marker through the pipe ends it."""
        marker = b"\0<end-" + secrets.token_hex(8).encode() + b">\0"
        with self.lock:
            self.marker = marker
            self.done.clear()
        os.write(self.w, marker)
        if not self.done.wait(10.0):
            with self.lock:
                self.marker = None
                self.result = (bytes(self.head), self.total)
                self.head, self.total = bytearray(), 0
        return self.result


def private():
    """Make this process non-dumpable (prctl PR_SET_DUMPABLE 0): its /proc/<pid>/fd, mem and ptrace are
    then closed to processes of the same uid without CAP_SYS_PTRACE, i.e. to the worker."""
    try:
        import ctypes
        return ctypes.CDLL(None, use_errno=True).prctl(4, 0, 0, 0, 0) == 0
    except Exception:
        return False


class Worker:
    """The child interpreter running the model's code, and the supervisor's two pipes to it."""

    def __init__(self, capture):
        req_r, self.requests = os.pipe()
        self.results, res_w = os.pipe()
        self.proc = subprocess.Popen([sys.executable, "-u", "-c", WORKER, str(req_r), str(res_w)],
                                     stdin=subprocess.DEVNULL, stdout=capture.w, stderr=capture.w,
                                     pass_fds=(req_r, res_w), close_fds=True)
        os.close(req_r)
        os.close(res_w)
        self.buffer = b""

    def drain(self):
        """Drop whatever the worker wrote while idle (code from an earlier cell may still be running)."""
        while select.select([self.results], [], [], 0)[0]:
            if not os.read(self.results, 65536):
                break
        self.buffer = b""

    def send(self, obj):
        data = json.dumps(obj).encode() + b"\n"
        try:
            while data:
                data = data[os.write(self.requests, data):]
        except OSError:  # the worker is gone: the wait below says so
            pass

    def message(self):
        """The worker's next line as an object, or ("died", exit code) / ("protocol", None)."""
        while b"\n" not in self.buffer:
            if len(self.buffer) > RESULT_LIMIT:
                return "protocol", None
            if select.select([self.results], [], [], 0.2)[0]:
                data = os.read(self.results, 65536)
                if data:
                    self.buffer += data
                    continue
            code = self.proc.poll()  # polled, not EOF: a forked child may hold the pipe open
            if code is not None:
                return "died", code
        line, _, self.buffer = self.buffer.partition(b"\n")
        if len(line) > RESULT_LIMIT:  # however the reads were split
            return "protocol", None
        try:
            msg = json.loads(line)
        except ValueError:
            return "protocol", None
        return ("ok", msg) if isinstance(msg, dict) else ("protocol", None)

    def result(self, token):
        """("ok", result) for the request holding `token`, or ("died", exit code) / ("protocol", None)."""
        status, msg = self.message()
        if status == "ok" and not (msg.get("token") == token and isinstance(msg.get("is_error"), bool)
                                   and (msg.get("error") is None or isinstance(msg.get("error"), str))):
            return "protocol", None
        return status, msg

    def stop(self):
        try:
            self.proc.kill()
            self.proc.wait(5)
        except Exception:
            pass


def main():
    isolated = private()
    proto_in = os.fdopen(os.dup(0), "rb")  # private copies; os.dup makes them non-inheritable
    proto_out = os.fdopen(os.dup(1), "wb")
    null = os.open(os.devnull, os.O_RDWR)
    os.dup2(null, 0)
    os.dup2(null, 1)
    capture = Capture()

    def reply(obj):
        proto_out.write(json.dumps(obj).encode() + b"\n")
        proto_out.flush()

    try:
        worker = Worker(capture)
    except OSError as e:  # e.g. EAGAIN: the sandbox is out of processes
        reply({"ready": False, "error": "could not start the interpreter: %r" % (e,)})
        return
    status, hello = worker.message()
    if status != "ok" or hello.get("hello") is not True:
        worker.stop()
        head, total = capture.finish()
        why = "it exited with code %s" % hello if status == "died" else "it wrote %r" % (hello,)
        tail = head[-2000:].decode("utf-8", "replace").strip()
        reply({"ready": False, "error": "the interpreter did not start (%s)%s" % (why, ": " + tail if tail else "")})
        return
    reply({"ready": True, "python": sys.version.split()[0], "isolated": isolated})
    for n, line in enumerate(proto_in, 1):
        try:
            request = json.loads(line)
            code, limit = str(request["code"]), int(request.get("max_output_bytes", 16384))
        except (ValueError, KeyError, TypeError) as e:
            reply({"id": None, "protocol_error": repr(e)[:200]})
            continue
        capture.limit = max(limit, 1)
        worker.drain()
        token = secrets.token_hex(16)
        start = time.monotonic()
        worker.send({"n": n, "code": code, "token": token})
        status, value = worker.result(token)
        head, total = capture.finish()
        answer = {"id": request.get("id"), "output": base64.b64encode(head[:limit]).decode(), "total": total,
                  "duration": time.monotonic() - start}
        if status == "ok":
            reply(dict(answer, error=value["error"], is_error=value["is_error"]))
            continue
        reply(dict(answer, lost=status, exit_code=value))  # the session ends: the host restarts it
        worker.stop()
        return
    worker.stop()


main()
'''
REPL_SOURCE = _SUPERVISOR.replace("WORKER = None", f"WORKER = {WORKER_SOURCE!r}", 1)
"""The python tool's session program, a supervisor (run as ``python3 -I -u -c REPL_SOURCE``).

It owns the protocol pipes (fds 0 and 1 of the session), makes itself non-dumpable, and runs the
model's code in a child interpreter (:data:`WORKER_SOURCE`) that has none of them, so nothing the
code does can write a reply: the supervisor frames every reply itself from the child's captured
fds 1 and 2 and its one-line result, which must carry the request's fresh random token.

Protocol: after startup it writes ``{"ready": true, "python": "3.x.y", "isolated": bool}``
(``isolated`` false: ``prctl`` was unavailable, so same-uid code could still reach the pipes
through ``/proc``) or ``{"ready": false, "error": why}`` (the child could not start); then for each request line ``{"id": n, "code": "...", "max_output_bytes": N}``
it answers one line ``{"id": n, "output": base64 of the first N bytes, "total": bytes written,
"error": traceback text or null, "is_error": bool, "duration": s}``; a reply with ``"lost":
"died"`` (and ``"exit_code"``) or ``"lost": "protocol"`` (the child wrote a result that was not its
own) is the session's last. Only the standard library is used (the sandbox image has nothing else).
"""

_SESSION_ENV = {"PYTHONIOENCODING": "utf-8", "PYTHONDONTWRITEBYTECODE": "1", "MPLBACKEND": "Agg"}


class PythonTool(Tool):
    """Runs Python code in a per-episode interpreter whose variables persist between calls.

    ``max_timeout`` caps the ``timeout`` the model may ask for (its default is the sandbox config's
    ``timeout``); ``max_code_chars`` caps the source. The tool's own :attr:`timeout` (the limit
    :func:`agentrl.tool.call_tool` enforces) is set above ``max_timeout`` so that the tool's more
    precise handling (kill the interpreter, tell the model its variables are gone) always wins.
    """

    name = "python"
    sandboxed = True

    def __init__(
        self, *, max_timeout: float = 120.0, max_code_chars: int = 100_000, session_name: str = "python"
    ) -> None:
        if max_timeout <= 0 or max_code_chars <= 0:
            raise ValueError("PythonTool: max_timeout and max_code_chars must be > 0")
        self.max_timeout = float(max_timeout)
        self.max_code_chars = int(max_code_chars)
        self.session_name = session_name
        self.timeout = self.max_timeout + START_TIMEOUT + 10.0
        self._ids = itertools.count(1)
        self.description = (
            "Run Python 3 code in a persistent session, like a Jupyter notebook: variables, imports and "
            "functions defined in one call are still there in the next calls. Shows everything printed "
            "(stdout and stderr, cut after a size limit) and, when the last line is an expression, its "
            "value. The working directory is /scratch; files there are shared with the other tools. "
            "Only the standard library is guaranteed; there is no network and no stdin (input() fails). "
            f"Each call may run for `timeout` seconds (default about 10, at most {self.max_timeout:g}); "
            "on timeout or a crash the session restarts and all variables are lost."
        )
        self.parameters = {
            "type": "object",
            "properties": {
                "code": {"type": "string", "description": 'Python source to run, e.g. "import math\\nmath.pi * 2"'},
                "timeout": {
                    "type": "number",
                    "description": f"seconds this call may run (at most {self.max_timeout:g})",
                },
            },
            "required": ["code"],
        }

    async def __call__(self, *, sandbox: Sandbox, code: str, timeout: float | None = None) -> ToolResult:  # type: ignore[override]
        limit = self._check(code, timeout, sandbox)
        cap = int(sandbox.config.max_output_bytes)
        started = time.monotonic()
        session = await self._session(sandbox)
        request_id = next(self._ids)
        request = {"id": request_id, "code": code, "max_output_bytes": cap}
        try:
            await session.send(json.dumps(request).encode() + b"\n")
            reply = await self._reply(session, request_id, limit, cap)
            if "protocol_error" in reply:  # our request was malformed: a bug here, not the model's doing
                raise ValueError(f"python: the session refused a request: {reply['protocol_error']}")
        except (TimeoutError, EOFError, ValueError) as e:
            await session.kill()
            return self._lost(e, limit, time.monotonic() - started)
        except BaseException:  # cancelled mid-call: the interpreter is busy with stale work
            await session.kill()
            raise
        if "lost" in reply:  # the worker died, or wrote a result that was not its own: the session ended
            await session.kill()
            error = EOFError(reply.get("exit_code")) if reply["lost"] == "died" else ValueError(reply["lost"])
            lost = self._lost(error, limit, time.monotonic() - started)
            return self._result(reply, cap, lost.metadata["duration"], lost)
        return self._result(reply, cap, time.monotonic() - started)

    def _check(self, code: Any, timeout: Any, sandbox: Any) -> float:
        """Refuse what the schema cannot (empty or huge code, odd timeouts); the call's time limit."""
        if not isinstance(code, str) or not code.strip():
            raise ToolError("python: 'code' is empty; pass the Python source to run")
        if len(code) > self.max_code_chars:
            raise ToolError(
                f"python: code is too long ({len(code)} characters, at most {self.max_code_chars}); "
                "write large data to a file with write_file and read it from the code"
            )
        if "\x00" in code:
            raise ToolError("python: code contains a NUL character")
        if timeout is None:
            return min(float(sandbox.config.timeout), self.max_timeout)
        if (
            not isinstance(timeout, (int, float))
            or isinstance(timeout, bool)
            or not math.isfinite(timeout)
            or timeout <= 0
        ):
            raise ToolError(f"python: 'timeout' must be a positive number of seconds, got {timeout!r}")
        return min(float(timeout), self.max_timeout)

    async def _session(self, sandbox: Sandbox) -> Session:
        """The episode's interpreter; a new one must say it is ready first (or the image is broken)."""
        # -I: the supervisor's own imports never come from the cwd (/scratch), the user site or $PYTHON*
        session = await sandbox.session(self.session_name, ["python3", "-I", "-u", "-c", REPL_SOURCE], env=_SESSION_ENV)
        if session in _READY:
            return session
        hello: Any = None
        try:
            hello = json.loads(await session.readline(START_TIMEOUT))
        except TimeoutError:
            await session.kill()
            raise ToolError(
                f"python: the Python session did not start within {START_TIMEOUT:g}s "
                "(the sandbox may be out of memory or processes); try again"
            ) from None
        except (EOFError, ValueError):
            pass
        if not isinstance(hello, dict) or hello.get("ready") is not True:
            await session.kill()
            if isinstance(hello, dict) and isinstance(hello.get("error"), str):
                # the supervisor runs, the model's interpreter did not: something in the sandbox (files
                # the model wrote, no processes left) broke it; the model reads why, the sample lives on
                raise ToolError(f"python: the Python session could not start: {hello['error'][-2500:]}")
            raise SandboxError(
                "the sandbox's python3 could not start the python tool's session: check that the "
                f"sandbox image ({sandbox.config.image}) has a working python3 >= 3.8"
            )
        if not hello.get("isolated"):
            _warn_not_isolated(sandbox.config.image)
        _READY.add(session)
        return session

    async def _reply(self, session: Session, request_id: int, limit: float, cap: int) -> dict[str, Any]:
        """The reply to ``request_id`` within ``limit`` s (older replies are skipped)."""
        deadline = time.monotonic() + limit
        while True:
            line = await session.readline(max(deadline - time.monotonic(), 0.001), limit=8 * cap + (1 << 18))
            reply = json.loads(line)
            if not isinstance(reply, dict):
                raise ValueError("python: the session sent a reply that is not an object")
            if reply.get("id") == request_id or "protocol_error" in reply:
                return reply

    def _lost(self, error: BaseException, limit: float, duration: float) -> ToolResult:
        """The message for a call that lost the interpreter (timeout, death, garbled reply)."""
        if isinstance(error, TimeoutError):
            text, kind = (
                (f"Error: timed out after {limit:g}s; the Python session was restarted and its variables are lost."),
                "timeout",
            )
        elif isinstance(error, EOFError):
            code = error.args[0] if error.args and isinstance(error.args[0], int) else None
            how = "" if code is None else f" (killed by signal {-code})" if code < 0 else f" with code {code}"
            text, kind = (
                (
                    f"Error: the Python process exited{how} (os._exit, a crash or the memory limit); the "
                    "session will be restarted on the next call and its variables are lost."
                ),
                "died",
            )
        else:
            text, kind = (
                (
                    "Error: the Python session's control pipe was written to by the code (or sent an "
                    "unreadable reply), so it was restarted; its variables are lost."
                ),
                "protocol",
            )
        return ToolResult(text, is_error=True, metadata={"error": kind, "duration": duration, "restarted": True})

    def _result(self, reply: dict[str, Any], cap: int, duration: float, lost: ToolResult | None = None) -> ToolResult:
        """The model's view of a reply: its output, then the traceback (or, for ``lost``, why the session ended)."""
        raw = b64decode(reply.get("output") or "")
        output, truncated = truncate_output(raw, cap, int(reply.get("total") or 0))
        parts = [output.rstrip("\n")] if output.strip() else []
        if lost is not None:
            parts.append(lost.content)
        elif reply.get("error"):
            parts.append(str(reply["error"]).rstrip("\n"))
        text = "\n".join(parts) if parts else "[no output]"
        metadata = {
            "duration": duration,
            "exec_duration": reply.get("duration"),
            "truncated": truncated,
            "output_bytes": reply.get("total"),
        } | (lost.metadata if lost is not None else {})
        return ToolResult(text, is_error=lost is not None or bool(reply.get("is_error")), metadata=metadata)


_WARNED: set[str] = set()


def _warn_not_isolated(image: str) -> None:
    """Once per image: its python3 could not make the session's supervisor non-dumpable (no ctypes)."""
    if image not in _WARNED:
        _WARNED.add(image)
        logger.warning(
            "python tool: the sandbox's python3 (image %s) has no working ctypes/prctl, so the "
            "session's reply pipe is reachable through /proc from the model's code; install a "
            "python3 with ctypes in the image to close it",
            image,
        )


_READY: weakref.WeakSet[Session] = weakref.WeakSet()
"""Sessions whose ready line was read (shared by all PythonTool instances using one sandbox)."""

python = PythonTool()
"""The ready-made instance: ``tools = [python]``."""
