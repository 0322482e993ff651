"""Serving an ASGI app on loopback for a test: the one helper the OpenEnv and ``env-serve`` tests share.

uvicorn runs in a daemon thread on a socket bound before it starts, so the port is known (and
taken) before any client connects and two tests never race for one; the server is stopped and
its thread joined when the ``with`` block ends.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any


@contextlib.contextmanager
def serve_app(app: Any) -> Iterator[str]:
    """``app`` (any ASGI app) under uvicorn in a thread on 127.0.0.1; yields its ``http://127.0.0.1:PORT``."""
    import uvicorn

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(15)
        sock.close()


def wait_for_health(proc: Any, url: str, timeout: float = 120.0) -> None:
    """Wait until the server process ``proc`` answers ``GET url/health`` with 200; fail with its stderr if it exits."""
    import httpx

    deadline = time.monotonic() + timeout
    while proc.poll() is None and time.monotonic() < deadline:
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return
        time.sleep(0.2)
    assert proc.poll() is None, f"the server exited {proc.returncode}: {proc.communicate()[1][-2000:]}"
    raise AssertionError(f"{url}/health did not answer within {timeout:g} s")
