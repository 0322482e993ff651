"""The ``bash`` tool: one shell command per call in the episode's sandbox.

Each call is a fresh ``bash -c`` in ``/scratch``: the working directory, shell variables and
background jobs do not carry over (the description says so, so the model chains steps with ``&&``
instead of expecting a terminal), while files under ``/scratch`` do, and are shared with the
``python``, ``read_file`` and ``write_file`` tools. What the model reads is
:meth:`agentrl.sandbox.ExecResult.text`: stdout, then stderr (each capped at the sandbox config's
``max_output_bytes``), then the exit code when it is not 0, or how the command was killed.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from agentrl.sandbox import Sandbox
from agentrl.tool import Tool, ToolError, ToolResult

__all__ = ["BashTool", "bash"]

MAX_COMMAND_BYTES = 100_000
"""Linux refuses a single argv string over 128 KiB; refuse earlier with a message instead."""


class BashTool(Tool):
    """Runs a shell command in ``/scratch`` (``shell`` + the command as argv, default ``bash -c``).

    ``max_timeout`` caps the ``timeout`` the model may ask for (its default is the sandbox config's
    ``timeout``). The tool's own :attr:`timeout` sits above it so that the sandbox's kill, and its
    explanation, always come before :func:`agentrl.tool.call_tool` gives up on the call.
    """

    name = "bash"
    sandboxed = True

    def __init__(self, *, max_timeout: float = 120.0, shell: Sequence[str] = ("bash", "-c")) -> None:
        if max_timeout <= 0:
            raise ValueError("BashTool: max_timeout must be > 0")
        self.max_timeout = float(max_timeout)
        self.shell = list(shell)
        self.timeout = self.max_timeout + 30.0
        self.description = (
            "Run one bash command in /scratch and return its output (stdout, then stderr, each cut after a "
            "size limit) and its exit code when it is not 0. Each call starts a new shell: cd, variables and "
            "background processes do NOT carry over to the next call (chain steps with && in one command); "
            "files written under /scratch do, and are shared with the other tools. There is no network and "
            f"no stdin. Each call may run for `timeout` seconds (default about 10, at most {self.max_timeout:g}); "
            "then the command is killed."
        )
        self.parameters = {
            "type": "object",
            "properties": {
                "command": {"type": "string", "description": 'the command line, e.g. "ls -la && wc -l data.csv"'},
                "timeout": {
                    "type": "number",
                    "description": f"seconds the command may run (at most {self.max_timeout:g})",
                },
            },
            "required": ["command"],
        }

    async def __call__(self, *, sandbox: Sandbox, command: str, timeout: float | None = None) -> ToolResult:  # type: ignore[override]
        limit = self._check(command, timeout, sandbox)
        command = command.encode("utf-8", errors="replace").decode("utf-8")  # lone surrogates from JSON -> '?'
        result = await sandbox.run([*self.shell, command], timeout=limit)
        metadata = {
            "exit_code": result.exit_code,
            "timed_out": result.timed_out,
            "duration": result.duration,
            "truncated": result.truncated,
        }
        return ToolResult(result.text(), is_error=not result.ok, metadata=metadata)

    def _check(self, command: Any, timeout: Any, sandbox: Sandbox) -> float:
        """Refuse empty, huge or unrunnable commands and odd timeouts; the call's time limit."""
        if not isinstance(command, str) or not command.strip():
            raise ToolError("bash: 'command' is empty; pass the shell command to run")
        if "\x00" in command:
            raise ToolError("bash: the command contains a NUL character")
        size = len(command.encode("utf-8", errors="replace"))
        if size > MAX_COMMAND_BYTES:
            raise ToolError(
                f"bash: the command is too long ({size} bytes, at most {MAX_COMMAND_BYTES}); "
                "write a script with write_file and run it"
            )
        if timeout is None:
            return min(float(sandbox.config.timeout), self.max_timeout)
        if (
            isinstance(timeout, bool)
            or not isinstance(timeout, (int, float))
            or not math.isfinite(timeout)
            or timeout <= 0
        ):
            raise ToolError(f"bash: 'timeout' must be a positive number of seconds, got {timeout!r}")
        return min(float(timeout), self.max_timeout)


bash = BashTool()
"""The ready-made instance: ``tools = [bash]``."""
