"""The ``python`` tool: a stateful Python session in the episode's sandbox, like a notebook kernel.

Agents solve tasks in many small steps: load data, look at it, fix a function, try again. Starting a
fresh interpreter per call would force the model to re-run everything each time, so the tool keeps
one interpreter per episode (a :class:`agentrl.sandbox.Session` called ``"python"``): variables,
imports and functions persist between calls until the episode ends, a call times out, or the
process dies (each of those is told to the model, who then knows its state is gone).

The interpreter runs :data:`REPL_SOURCE`, a small read-eval-print loop speaking one JSON line per
request and per reply. It must survive whatever the model's code does, so at startup it moves its
protocol pipes to private descriptors and points fd 0 at ``/dev/null`` and fds 1 and 2 at a
capture pipe: ``print``, ``os.write(1, ...)`` and subprocess output all land in the captured text,
in the order they were written. Code that deliberately finds the private descriptors (``/proc/self/fd``)
and writes to them gets what a crash gets: the session is restarted and the model reads why; it is
never a sandbox failure (which would fail, and so hide, the sample). The capture keeps only the first ``max_output_bytes`` (the sandbox config's cap) and counts the rest,
so printing 10 MB costs the model one truncation marker, not its context window.

As in Jupyter, when the last statement is an expression its ``repr`` is shown (unless it is
``None``); top-level ``await`` works. An exception is shown as a short traceback of the model's
own frames (the REPL's frames are cut) and the result is marked ``is_error``.
"""

from __future__ import annotations

import itertools
import json
import math
import time
import weakref
from base64 import b64decode
from typing import Any

from agentrl.sandbox import Sandbox, SandboxError, Session, truncate_output
from agentrl.tool import Tool, ToolError, ToolResult

__all__ = ["REPL_SOURCE", "PythonTool", "python"]

START_TIMEOUT = 30.0
"""Seconds a new interpreter may take to say it is ready (a cold container can be slow)."""

REPL_SOURCE = r'''
import ast, base64, builtins, json, linecache, os, secrets, sys, threading, time, traceback, types


class Capture:
    """fds 1 and 2 point at a pipe; a thread drains it, keeping the first `limit` bytes."""

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


def no_input(prompt=""):
    raise EOFError("input() is not available: the python tool has no stdin; put the values in the code")


def format_exception(e):
    tb = e.__traceback__
    skip = tb
    while skip is not None and not skip.tb_frame.f_code.co_filename.startswith("<cell "):
        skip = skip.tb_next
    te = traceback.TracebackException(type(e), e, skip if skip is not None else tb)
    te.stack = traceback.StackSummary.from_list(  # the REPL's own helpers are noise to the model
        [f for f in te.stack if not (f.filename == "<string>" and f.name == "no_input")])
    text = "".join(te.format())
    if len(text) > 6000:
        text = text[:1000] + "\n[... %d characters of traceback cut ...]\n" % (len(text) - 5000) + text[-4000:]
    return text


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
        return "".join(traceback.format_exception_only(type(e), e)), True
    try:
        evaluate(body, ns)
        if tail is not None:
            value = evaluate(tail, ns)
            if value is not None:
                ns["_"] = value
                print(repr(value))
    except SystemExit as e:
        failed = e.code not in (None, 0)
        return "SystemExit: %r (exit() does not end the session; variables are kept)\n" % (e.code,), failed
    except BaseException as e:
        return format_exception(e), True
    return None, False


def evaluate(code, ns):
    if code.co_flags & 0x80:  # CO_COROUTINE: top-level await
        import asyncio
        return asyncio.run(eval(code, ns))
    return eval(code, ns)


def main():
    proto_in = os.fdopen(os.dup(0), "rb")  # private copies; os.dup makes them non-inheritable
    proto_out = os.fdopen(os.dup(1), "wb")
    null = os.open(os.devnull, os.O_RDWR)
    capture = Capture()
    main_pid = os.getpid()
    module = types.ModuleType("__main__")  # the user's namespace is a real __main__ (pickle works)
    module.__dict__["__builtins__"] = builtins
    sys.modules["__main__"] = module
    builtins.input = no_input

    def reply(obj):
        proto_out.write(json.dumps(obj).encode() + b"\n")
        proto_out.flush()

    def redirect():
        os.dup2(null, 0)
        os.dup2(capture.w, 1)
        os.dup2(capture.w, 2)

    redirect()
    reply({"ready": True, "python": sys.version.split()[0]})
    for n, line in enumerate(proto_in, 1):
        try:
            request = json.loads(line)
            code, limit = str(request["code"]), int(request.get("max_output_bytes", 16384))
        except (ValueError, KeyError, TypeError) as e:
            reply({"id": None, "protocol_error": repr(e)[:200]})
            continue
        redirect()  # the code may have closed or moved fds 0-2 last time
        capture.limit = max(limit, 1)
        start = time.monotonic()
        error, failed = run_code(code, module.__dict__, "<cell %d>" % n)
        if os.getpid() != main_pid:  # a fork of the user's code must not answer requests
            os._exit(0)
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except BaseException:
                pass
        head, total = capture.finish()
        reply({"id": request.get("id"), "output": base64.b64encode(head[:limit]).decode(), "total": total,
               "error": error, "is_error": failed, "duration": time.monotonic() - start})


main()
'''
"""The interpreter's program (run as ``python3 -u -c REPL_SOURCE``); see the module docstring.

Protocol: after startup it writes ``{"ready": true, "python": "3.x.y"}``; then for each request line
``{"id": n, "code": "...", "max_output_bytes": N}`` it answers one line ``{"id": n, "output":
base64 of the first N bytes, "total": bytes written, "error": traceback text or null, "is_error":
bool, "duration": s}``. Only the standard library is used (the sandbox image has nothing else).
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

    def __init__(self, *, max_timeout: float = 120.0, max_code_chars: int = 100_000,
                 session_name: str = "python") -> None:
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
                "code": {"type": "string", "description": "Python source to run, e.g. \"import math\\nmath.pi * 2\""},
                "timeout": {"type": "number", "description": f"seconds this call may run (at most {self.max_timeout:g})"},
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
            if "protocol_error" in reply:  # the model's code can reach the protocol fd: its doing, not ours
                raise ValueError(f"python: the session refused a request: {reply['protocol_error']}")
        except (TimeoutError, EOFError, ValueError) as e:
            await session.kill()
            return self._lost(e, limit, time.monotonic() - started)
        except BaseException:  # cancelled mid-call: the interpreter is busy with stale work
            await session.kill()
            raise
        return self._result(reply, cap, time.monotonic() - started)

    def _check(self, code: Any, timeout: Any, sandbox: Any) -> float:
        """Refuse what the schema cannot (empty or huge code, odd timeouts); the call's time limit."""
        if not isinstance(code, str) or not code.strip():
            raise ToolError("python: 'code' is empty; pass the Python source to run")
        if len(code) > self.max_code_chars:
            raise ToolError(f"python: code is too long ({len(code)} characters, at most {self.max_code_chars}); "
                            "write large data to a file with write_file and read it from the code")
        if "\x00" in code:
            raise ToolError("python: code contains a NUL character")
        if timeout is None:
            return min(float(sandbox.config.timeout), self.max_timeout)
        if not isinstance(timeout, (int, float)) or isinstance(timeout, bool) or not math.isfinite(timeout) or timeout <= 0:
            raise ToolError(f"python: 'timeout' must be a positive number of seconds, got {timeout!r}")
        return min(float(timeout), self.max_timeout)

    async def _session(self, sandbox: Sandbox) -> Session:
        """The episode's interpreter; a new one must say it is ready first (or the image is broken)."""
        session = await sandbox.session(self.session_name, ["python3", "-u", "-c", REPL_SOURCE], env=_SESSION_ENV)
        if session in _READY:
            return session
        try:
            line = await session.readline(START_TIMEOUT)
            ready = json.loads(line).get("ready") is True
        except TimeoutError:
            await session.kill()
            raise ToolError(f"python: the Python session did not start within {START_TIMEOUT:g}s "
                            "(the sandbox may be out of memory or processes); try again") from None
        except (EOFError, ValueError, AttributeError):
            ready = False
        if not ready:
            await session.kill()
            raise SandboxError("the sandbox's python3 could not start the python tool's session: check that the "
                               f"sandbox image ({sandbox.config.image}) has a working python3 >= 3.8")
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
            text, kind = (f"Error: timed out after {limit:g}s; the Python session was restarted and its variables "
                          "are lost."), "timeout"
        elif isinstance(error, EOFError):
            text, kind = ("Error: the Python process exited (os._exit, a crash or the memory limit); the session "
                          "will be restarted on the next call and its variables are lost."), "died"
        else:
            text, kind = ("Error: the Python session sent an unreadable reply and was restarted; its variables "
                          "are lost."), "protocol"
        return ToolResult(text, is_error=True, metadata={"error": kind, "duration": duration, "restarted": True})

    def _result(self, reply: dict[str, Any], cap: int, duration: float) -> ToolResult:
        raw = b64decode(reply.get("output") or "")
        output, truncated = truncate_output(raw, cap, int(reply.get("total") or 0))
        parts = [output.rstrip("\n")] if output.strip() else []
        if reply.get("error"):
            parts.append(str(reply["error"]).rstrip("\n"))
        text = "\n".join(parts) if parts else "[no output]"
        metadata = {"duration": duration, "exec_duration": reply.get("duration"), "truncated": truncated,
                    "output_bytes": reply.get("total")}
        return ToolResult(text, is_error=bool(reply.get("is_error")), metadata=metadata)


_READY: "weakref.WeakSet[Session]" = weakref.WeakSet()
"""Sessions whose ready line was read (shared by all PythonTool instances using one sandbox)."""

python = PythonTool()
"""The ready-made instance: ``tools = [python]``."""
