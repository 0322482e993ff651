"""A toolset's MCP sessions (:class:`Sessions`): one per episode (keyed by its sandbox when the server
runs there), or one for every episode of the process (``shared=True``)."""

from __future__ import annotations

import asyncio
import hashlib
import weakref
from typing import Any

from agentrl.mcp.connection import Connection
from agentrl.mcp.spec import MCPServerSpec
from agentrl.sandbox.base import Sandbox, SandboxError, Session

__all__ = ["Sessions", "close_shared_sessions", "shared_sessions"]


class Sessions:
    """A server's open connections for one toolset: one, or one per episode sandbox; on one event loop."""

    def __init__(self, spec: MCPServerSpec, sandboxed: bool) -> None:
        self.spec, self.sandboxed = spec, sandboxed
        self._conns: dict[int | None, Connection] = {}  # None: the host's; id(sandbox): that sandbox's
        weakref.finalize(self, _stop_all, self._conns)  # nobody closed it: end its servers anyway

    async def get(self, sandbox: Sandbox | None) -> Connection:
        """The live connection (opened now if missing, dead, or of another event loop or sandbox session)."""
        loop = asyncio.get_running_loop()
        stream: Session | None = None
        key: int | None = None
        if self.sandboxed:
            if sandbox is None:
                raise SandboxError(f"MCP server {self.spec.describe()!r} is sandboxed and no sandbox was given")
            name = "mcp-" + hashlib.sha1("\0".join(self.spec.command).encode()).hexdigest()[:12]
            stream = await sandbox.session(name, self.spec.command, env=dict(self.spec.env))
            key = id(sandbox)
        conn = self._conns.get(key)
        if conn is None or conn.stream is not stream or not conn.usable(loop):
            if conn is not None:
                conn.stop()
            conn = self._conns[key] = Connection(self.spec, stream)
        await conn.ready()
        return conn

    async def aclose(self) -> None:
        conns = list(self._conns.values())
        self._conns.clear()
        for conn in conns:
            await conn.close()


def _stop_all(conns: dict[Any, Connection]) -> None:
    for conn in list(conns.values()):
        conn.stop()


_SHARED: dict[MCPServerSpec, Sessions] = {}


def shared_sessions(spec: MCPServerSpec) -> Sessions:
    return _SHARED.setdefault(spec, Sessions(spec, False))


async def close_shared_sessions() -> None:
    """End the shared sessions (``mcp_tools(..., shared=True)``); a later call opens a new one."""
    for sessions in list(_SHARED.values()):
        await sessions.aclose()
