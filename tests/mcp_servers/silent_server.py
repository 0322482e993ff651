"""An MCP server for the MCP tests that may never answer, or answer late: ``python silent_server.py DIR``.

It records its pid as the file ``DIR/pid.<pid>``, then follows the files present in ``DIR``:

- ``silent``: sleeps without reading stdin (a server stuck before its handshake);
- ``slow_start`` (holding a number of seconds): sleeps that long, then is the demo server (a server
  that loads slowly, e.g. a big import, and then answers);
- ``slow_list``: the demo server, whose ``tools/list`` never answers (a server that completed the
  handshake and then hangs);
- none of them: the demo server.

``python silent_server.py DIR --http PORT`` accepts TCP connections on 127.0.0.1:PORT and reads them
without ever answering (an HTTP endpoint that takes the ``initialize`` request and never replies).
"""

from __future__ import annotations

import asyncio
import os
import socket
import sys
import time
from pathlib import Path


def _never_answer(port: int) -> None:
    with socket.create_server(("127.0.0.1", port)) as listener:
        held = []
        while True:
            conn, _ = listener.accept()
            held.append(conn)  # kept open, never written to


if __name__ == "__main__":
    where = Path(sys.argv[1])
    (where / f"pid.{os.getpid()}").touch()
    if sys.argv[2:3] == ["--http"]:
        _never_answer(int(sys.argv[3]))
    if (where / "silent").exists():
        time.sleep(3600)
    if (where / "slow_start").exists():
        time.sleep(float((where / "slow_start").read_text()))
    sys.path.insert(0, str(Path(__file__).parent))
    from demo_server import server

    if (where / "slow_list").exists():

        async def never(*args: object, **kwargs: object) -> list:
            await asyncio.sleep(3600)
            return []

        server.list_tools = never  # type: ignore[method-assign]  # the handler calls self.list_tools()
    server.run()
