"""An MCP server for tests/test_mcp.py, written with the official SDK (``mcp.server.mcpserver.MCPServer``,
FastMCP's name in mcp 2): ``python demo_server.py`` speaks stdio, ``python demo_server.py --http PORT``
streamable HTTP on 127.0.0.1.

``where`` and ``save`` show where it runs (tests/test_mcp.py also runs it inside a Docker sandbox).
``bump`` counts per MCP session: over stdio a session is the process; over HTTP it is the
``mcp-session-id`` the client's handshake got, so episodes that share a server can be told apart.
"""

from __future__ import annotations

import asyncio
import base64
import os
import socket
import sys
from pathlib import Path

from mcp.server.mcpserver import Context, MCPServer
from mcp.server.mcpserver.exceptions import ToolError
from mcp.server.mcpserver.utilities.types import Image
from mcp_types import CallToolResult, TextContent

server = MCPServer("demo", log_level="ERROR")
_counts: dict[str, int] = {}


@server.tool()
def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: the first number
        b: the second number
    """
    return a + b


@server.tool()
def read_note(name: str) -> str:
    """Read a note by name; there are none, so this always fails with a message for the model."""
    raise ToolError(f"no note called {name!r}; list the notes first")


@server.tool()
def crash() -> str:
    """A tool with a bug: raises an exception the server reports as an error result."""
    raise ZeroDivisionError("division by zero")


@server.tool()
async def slow(seconds: float) -> str:
    """Sleep, then answer."""
    await asyncio.sleep(seconds)
    return f"slept {seconds}"


@server.tool()
def bump(ctx: Context) -> str:
    """Add one to this session's counter and return it."""
    headers = ctx.headers or {}
    key = headers.get("mcp-session-id", "stdio")
    _counts[key] = _counts.get(key, 0) + 1
    return str(_counts[key])


@server.tool()
def pid() -> int:
    """The server's process id."""
    return os.getpid()


@server.tool()
def where() -> str:
    """The server's host name and working directory (in a sandbox: the container's and /scratch)."""
    return f"{socket.gethostname()} {os.getcwd()}"


@server.tool()
def save(name: str, text: str) -> str:
    """Write ``text`` to the file ``name`` in the working directory; returns its absolute path."""
    path = Path(name).resolve()
    path.write_text(text)
    return str(path)


@server.tool()
def die() -> str:
    """Exit the server process at once (a crash mid-episode)."""
    os._exit(3)


@server.tool()
def picture() -> list:
    """A caption and a 4-byte PNG-typed image."""
    return ["a red dot", Image(data=base64.b64decode("iVBORw=="), format="png")]


@server.tool()
def mismatch() -> CallToolResult:
    """A buggy tool: its structured content breaks the output schema it declares (set below)."""
    return CallToolResult(content=[TextContent(type="text", text="oops")], structured_content={"n": "x"})


# declared by hand, so the server publishes it without checking its own replies against it
server._tool_manager.get_tool("mismatch").fn_metadata.output_schema = {  # type: ignore[union-attr]
    "type": "object",
    "properties": {"n": {"type": "integer"}},
    "required": ["n"],
}


@server.tool()
def box(sandbox: str) -> str:
    """Echo an argument called ``sandbox`` (agentrl's name for the episode's sandbox, when sandboxed)."""
    return f"box {sandbox}"


@server.tool()
def big(n: int) -> str:
    """``n`` characters of text."""
    return "x" * n


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--http":
        server.run("streamable-http", host="127.0.0.1", port=int(sys.argv[2]))
    else:
        server.run()
