"""An agent given as a command: started in its own process group, its output read, all of it stopped after.

The agent's stdout and stderr go to files, not pipes. A pipe stays open as long as any process holds
its write end, so an agent that exits while a child it started (a language server, a shell left in
the background) still holds stdout would keep a pipe reader waiting for that child; its episode
would fail although the agent had finished. With files, the agent's exit is the end: the output is
what the files hold then (at most :data:`OUTPUT_LIMIT` bytes each), and the whole process group is
killed, whatever the agent left running.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import tempfile
from pathlib import Path
from typing import Any

__all__ = ["OUTPUT_LIMIT", "AgentError", "run_command"]

OUTPUT_LIMIT = 16 * 2**20
"""Bytes of an agent command's stdout (its output) and stderr (quoted when it fails) that are read."""


class AgentError(RuntimeError):
    """The agent program crashed, exited non-zero, timed out or broke the protocol: its sample fails."""


async def run_command(argv: list[str], base_url: str, task: dict[str, Any], *, cwd: str | None = None) -> str:
    """Run an agent program against ``base_url``; return its stdout (stripped) once it exits.

    The program gets ``OPENAI_BASE_URL``/``OPENAI_API_KEY`` for its session, the task row as JSON in
    ``AGENTRL_TASK`` and on stdin. It runs in a process group of its own, which is killed when it
    exits, fails or is cancelled (the caller bounds the time: :attr:`ProxyEnv.agent_timeout`), so
    nothing it started outlives its episode; only a process that left the group (``setsid``) escapes.
    A non-zero exit is an :class:`AgentError` quoting the end of its stderr.
    """
    env = dict(os.environ)
    task_json = json.dumps(task, ensure_ascii=False, default=str)
    no_proxy = ",".join(x for x in (env.get("NO_PROXY"), "127.0.0.1", "localhost", "::1") if x)
    env.update(OPENAI_BASE_URL=base_url, OPENAI_API_KEY="agentrl-proxy", AGENTRL_TASK=task_json, NO_PROXY=no_proxy)
    with tempfile.TemporaryDirectory(prefix="agentrl-agent-") as tmp:
        paths = {name: Path(tmp, name) for name in ("stdin", "stdout", "stderr")}
        paths["stdin"].write_text(task_json, encoding="utf-8")
        with contextlib.ExitStack() as files:
            stdin, stdout, stderr = (files.enter_context(open(paths[n], "rb" if n == "stdin" else "wb")) for n in paths)
            proc = await asyncio.create_subprocess_exec(
                *argv, stdin=stdin, stdout=stdout, stderr=stderr, env=env, cwd=cwd, start_new_session=True
            )
        try:
            returncode = await proc.wait()  # no pipes: this returns when the agent exits, whatever its children do
        finally:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)  # the group outlives its leader while a member lives
            if proc.returncode is None:
                await proc.wait()
        out, err = _read(paths["stdout"]), _read(paths["stderr"], tail=True)
    if returncode != 0:
        raise AgentError(f"the agent command exited with status {returncode}: {err.strip()[-1500:]}")
    return out.strip()


def _read(path: Path, *, tail: bool = False) -> str:
    """The file's first (``tail``: last) :data:`OUTPUT_LIMIT` bytes, as text."""
    with open(path, "rb") as f:
        if tail:
            f.seek(max(0, path.stat().st_size - OUTPUT_LIMIT))
        return f.read(OUTPUT_LIMIT).decode(errors="replace")
