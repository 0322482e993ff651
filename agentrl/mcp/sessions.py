"""A toolset's MCP sessions (:class:`Sessions`): one per episode (keyed by its sandbox when the server
runs there), or one for every episode of the process (``shared=True``)."""

from __future__ import annotations

import asyncio
import hashlib
import weakref
from typing import Any

from agentrl.mcp.connection import Connection
from agentrl.mcp.server_spec import MCPServerError, MCPServerSpec
from agentrl.sandbox.base import Sandbox, SandboxError, Session

__all__ = ["Sessions", "close_shared_sessions", "shared_sessions"]


class Sessions:
    """A server's open connections for one toolset: one per event loop (and per episode sandbox).

    Keyed by (sandbox, running loop): an SDK client belongs to the loop that opened it, so episodes
    run on several loops (threads) each get their own connection instead of replacing each other's.
    A lock per key makes concurrent first calls share one handshake instead of racing two servers.
    """

    def __init__(self, spec: MCPServerSpec, sandboxed: bool) -> None:
        self.spec, self.sandboxed = spec, sandboxed
        # (None or id(sandbox), loop) -> its connection; None: the host's
        self._conns: dict[tuple[int | None, asyncio.AbstractEventLoop], Connection] = {}
        self._locks: dict[tuple[int | None, asyncio.AbstractEventLoop], asyncio.Lock] = {}
        weakref.finalize(self, _stop_all, self._conns)  # nobody closed it: end its servers anyway

    async def get(self, sandbox: Sandbox | None) -> Connection:
        """The live connection (opened now if missing, dead, or of another sandbox session).

        A server that does not start raises :class:`MCPServerError` after its connection is closed
        (its process is gone); the next call tries a fresh one.
        """
        loop = asyncio.get_running_loop()
        stream: Session | None = None
        if self.sandboxed:
            if sandbox is None:
                raise SandboxError(f"MCP server {self.spec.describe()!r} is sandboxed and no sandbox was given")
            name = "mcp-" + hashlib.sha1("\0".join(self.spec.command).encode()).hexdigest()[:12]
            stream = await sandbox.session(name, self.spec.command, env=dict(self.spec.env))
        key = (id(sandbox) if self.sandboxed else None, loop)
        self._forget_closed_loops()
        lock = self._locks.setdefault(key, asyncio.Lock())
        async with lock:
            conn = self._conns.get(key)
            if conn is None or conn.stream is not stream or not conn.usable(loop):
                if conn is not None:
                    await conn.close()
                conn = self._conns[key] = Connection(self.spec, stream)
            try:
                await conn.ready()
            except MCPServerError:
                if self._conns.get(key) is conn:
                    del self._conns[key]
                await conn.close()
                raise
        return conn

    def _forget_closed_loops(self) -> None:
        """Drop the connections of loops that have closed (their tasks ended with them)."""
        for key in [k for k in list(self._conns) if k[1].is_closed()]:
            self._conns.pop(key, None)
            self._locks.pop(key, None)

    async def aclose(self) -> None:
        """Close this loop's connections (awaited). Other loops' stay: they may be mid-call there, and
        each ends with its own loop (``asyncio.run`` cancels its tasks) or that loop's ``aclose``."""
        loop = asyncio.get_running_loop()
        self._forget_closed_loops()
        mine = [(key, conn) for key, conn in list(self._conns.items()) if key[1] is loop]
        for key, _ in mine:
            self._conns.pop(key, None)
            self._locks.pop(key, None)
        for _, conn in mine:
            await conn.close()


def _stop_all(conns: dict[Any, Connection]) -> None:
    for conn in list(conns.values()):
        conn.stop()


_SHARED: dict[MCPServerSpec, Sessions] = {}


def shared_sessions(spec: MCPServerSpec) -> Sessions:
    return _SHARED.setdefault(spec, Sessions(spec, False))


async def close_shared_sessions() -> None:
    """End the shared sessions (``mcp_tools(..., shared=True)``) of the running event loop; a later call
    opens a new one. Other loops' end with their loop, or with this call made on it."""
    for sessions in list(_SHARED.values()):
        await sessions.aclose()
