"""An MCP server for tests/test_mcp.py that may never answer: ``python silent_server.py DIR``.

It records its pid as the file ``DIR/pid.<pid>``; then, while ``DIR/silent`` exists, it sleeps without
reading stdin (a server stuck before its handshake); otherwise it is the demo server.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

if __name__ == "__main__":
    where = Path(sys.argv[1])
    (where / f"pid.{os.getpid()}").touch()
    if (where / "silent").exists():
        time.sleep(3600)
    sys.path.insert(0, str(Path(__file__).parent))
    from demo_server import server

    server.run()
