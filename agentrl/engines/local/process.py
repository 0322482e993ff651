"""Run the embedded engine as a child process on a loopback port (what ``agentrl rollout`` does
when no ``--engine-url`` is given).

A separate process keeps the model's Python work off the rollout loop's interpreter (one GIL each),
and puts the embedded engine behind the same HTTP client code path as a real SGLang server. The
child is started with ``--parent-pid`` semantics emulated by a pipe: it exits when we do, so an
interrupted rollout leaves no orphan server.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

from agentrl.engines.http import API_KEY_ENV
from agentrl.ports import free_port


@contextlib.contextmanager
def local_server(
    checkpoint: str | Path,
    *,
    host: str = "127.0.0.1",
    port: int | None = None,
    extra_args: list[str] | None = None,
    startup_timeout: float = 600.0,
    log_path: str | Path | None = None,
    api_key: str | None = None,
) -> Iterator[str]:
    """Start ``agentrl serve`` for ``checkpoint`` and yield its URL; stop it on exit.

    ``api_key`` (handed over in the environment, not on argv) is then required by every endpoint
    but ``/health``: send it with :func:`~agentrl.engines.http.auth_headers`.
    """
    port = port or free_port(host)
    cmd = [
        sys.executable,
        "-m",
        "agentrl",
        "serve",
        "--hf-checkpoint",
        str(checkpoint),
        "--host",
        host,
        "--port",
        str(port),
        "--exit-with-stdin",
        *(extra_args or []),
    ]
    log = open(log_path, "ab") if log_path else subprocess.DEVNULL
    env = {k: v for k, v in os.environ.items() if k != API_KEY_ENV}
    env.update({"PYTHONUNBUFFERED": "1", **({API_KEY_ENV: api_key} if api_key else {})})
    proc = subprocess.Popen(
        cmd,
        stdin=subprocess.PIPE,
        stdout=log,
        stderr=subprocess.STDOUT if log_path else None,
        start_new_session=True,
        env=env,
    )
    url = f"http://{host}:{port}"
    try:
        deadline = time.monotonic() + startup_timeout
        while True:
            if proc.poll() is not None:
                raise RuntimeError(
                    f"the embedded engine exited with code {proc.returncode} during startup"
                    + (f"; see {log_path}" if log_path else "")
                )
            try:
                if httpx.get(url + "/health", timeout=2.0).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"the embedded engine did not answer on {url} within {startup_timeout:.0f}s")
            time.sleep(0.3)
        yield url
    finally:
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        if proc.stdin:
            proc.stdin.close()
        if log_path and log is not subprocess.DEVNULL:
            log.close()  # type: ignore[union-attr]
