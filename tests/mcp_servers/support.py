"""What the MCP test files (tests/test_mcp*.py) share: the servers' paths and small helpers."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

from agentrl.tool import ToolResult, call_tool, find_tool

HERE = Path(__file__).parent
SERVER = str(HERE / "demo_server.py")
"""The demo server (the official SDK's MCPServer): stdio, or ``--http PORT``."""
SILENT = str(HERE / "silent_server.py")
"""A server that never answers or answers late (see its docstring)."""
STDIO = [sys.executable, SERVER]


def alive(pid: int) -> bool:
    """Whether process ``pid`` runs (a zombie is gone for our purposes)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split(") ", 1)[1][0] != "Z"


async def call(
    tools: Any, name: str, arguments: dict | None = None, timeout: float = 20.0, sandbox: Any = None
) -> ToolResult:
    """Call tool ``name`` of ``tools`` as the rollout does (validated, time-limited, errors as results)."""
    return await call_tool(find_tool(tools, name), arguments or {}, timeout=timeout, sandbox=sandbox)


def scripted(calls: list[tuple[str | None, Any]]) -> Any:
    """A policy for ``play``: turn i is ``calls[i]``, a Hermes tool call ``(name, arguments)`` or ``(None, text)``."""

    def policy(messages: list[dict], task: dict) -> str:
        turn = sum(m["role"] == "assistant" for m in messages)
        name, args = calls[turn]
        if name is None:
            return str(args)
        return f"<tool_call>{json.dumps({'name': name, 'arguments': args})}</tool_call>"

    return policy
