"""MCP servers' tools as a toolset: :func:`mcp_tools`, :class:`MCPToolset` (an env's ``tools``, with the
sessions its tools call) and :class:`MCPTool`; the listing, fetched once per process and server."""

from __future__ import annotations

import asyncio
import contextlib
import copy
import json
import threading
import time
from collections.abc import Callable, Coroutine, Iterator, Sequence
from typing import Any, overload

from agentrl.mcp.server_spec import Listing, MCPServerError, MCPServerSpec
from agentrl.mcp.sessions import Sessions, shared_sessions
from agentrl.sandbox import create_sandbox
from agentrl.sandbox.base import Sandbox, SandboxConfig
from agentrl.tool import Tool, ToolError, ToolResult

__all__ = ["MCPTool", "MCPToolset", "mcp_tools"]


class MCPTool(Tool):
    """One tool of an MCP server; calling it sends ``tools/call`` on its episode's session.

    ``name`` is what the model calls (the server's name after ``mcp_tools``' ``prefix``),
    ``remote_name`` the server's. Made by :func:`mcp_tools`, not by hand.
    """

    def __init__(self, server: _Server, remote_name: str, description: str, parameters: dict[str, Any]) -> None:
        self.server = server
        self.remote_name = remote_name
        self.name = server.prefix + remote_name
        self.description = description
        self.parameters = parameters
        self.timeout = server.timeout
        self.sandboxed = server.sandboxed

    async def __call__(self, **arguments: Any) -> ToolResult:
        sandbox = arguments.pop("sandbox", None) if self.sandboxed else None
        try:  # what the transport could not send (a lone surrogate, NaN) would break the session
            json.dumps(arguments, ensure_ascii=False, allow_nan=False).encode("utf-8")
        except (TypeError, ValueError) as e:  # UnicodeEncodeError is a ValueError
            raise ToolError(
                f"{self.name}: the arguments cannot be sent as JSON ({type(e).__name__}: {e}); "
                "use valid UTF-8 text and finite numbers"
            ) from None
        conn = await self.server.sessions.get(sandbox)
        return await conn.call(self.remote_name, arguments)


class _Server:
    """One server as a toolset holds it: its spec, listing, options, tools and sessions."""

    def __init__(self, spec: MCPServerSpec, listing: Listing, options: dict[str, Any]) -> None:
        self.spec, self.listing, self.options = spec, listing, options
        self.sandboxed: bool = options["sandboxed"]
        self.shared: bool = options["shared"]
        self.timeout: float | None = options["timeout"]
        self.prefix: str = options["prefix"]
        self.sessions = shared_sessions(spec) if self.shared else Sessions(spec, self.sandboxed)
        # deep copies: the listing is cached for the process, and no toolset may change another's schema
        self.tools = [MCPTool(self, n, d, copy.deepcopy(schema)) for n, d, schema in listing]

    def copy(self) -> _Server:
        """The same server with sessions of its own (the shared one stays shared)."""
        return _Server(self.spec, self.listing, self.options)


class MCPToolset(Sequence[Tool]):
    """The tools of MCP servers (and any others joined with ``+``), plus the sessions they call.

    Use it as an env's ``tools`` (``tools = mcp_tools(...)``, at class level or in ``__init__``).
    At class level it binds a copy to each env instance on first access, so every episode gets
    sessions of its own. ``mcp_tools(a) + mcp_tools(b) + [calculator]`` is again a toolset and keeps
    that; a plain list built from it does not (its episodes would share one session).
    :meth:`aclose` (called by :class:`MCPToolEnv` and :func:`close_mcp_sessions`) ends the sessions.
    """

    def __init__(self, members: Sequence[_Server | Tool]) -> None:
        self._members = list(members)
        self._tools: list[Tool] = []
        for m in self._members:
            self._tools.extend(m.tools if isinstance(m, _Server) else [m])
        seen: set[str] = set()
        for t in self._tools:
            if t.name in seen:
                raise ValueError(
                    f"two tools are called {t.name!r}; give a server a prefix: mcp_tools(..., prefix='x_')"
                )
            seen.add(t.name)
        self._attr: str | None = None

    @overload
    def __getitem__(self, index: int) -> Tool: ...
    @overload
    def __getitem__(self, index: slice) -> Sequence[Tool]: ...
    def __getitem__(self, index: int | slice) -> Tool | Sequence[Tool]:
        return self._tools[index]

    def __len__(self) -> int:
        return len(self._tools)

    def __iter__(self) -> Iterator[Tool]:
        return iter(self._tools)

    def __add__(self, other: Sequence[Tool]) -> MCPToolset:
        return MCPToolset([*self._members, *_members(other)])

    def __radd__(self, other: Sequence[Tool]) -> MCPToolset:
        return MCPToolset([*_members(other), *self._members])

    def __repr__(self) -> str:
        return f"<MCPToolset: {', '.join(t.name for t in self._tools)}>"

    def __set_name__(self, owner: type, name: str) -> None:
        self._attr = name

    def __get__(self, instance: object, owner: type | None = None) -> MCPToolset:
        """Class attribute read on an instance: that instance's own copy (its own sessions)."""
        if instance is None or self._attr is None:
            return self
        bound = self.bind()
        with contextlib.suppress(AttributeError, TypeError):  # no __dict__: a fresh copy per access
            instance.__dict__[self._attr] = bound
        return bound

    def bind(self) -> MCPToolset:
        """A copy with sessions of its own (shared servers stay shared)."""
        return MCPToolset([m.copy() if isinstance(m, _Server) else m for m in self._members])

    @property
    def sandboxed(self) -> bool:
        """Whether some server runs in the episode's sandbox."""
        return any(isinstance(m, _Server) and m.sandboxed for m in self._members)

    async def open(self, sandbox: Sandbox | None = None) -> None:
        """Open the sessions now (an env's ``reset``) instead of in the first call, whose time limit it would eat."""
        await asyncio.gather(*(m.sessions.get(sandbox) for m in self._members if isinstance(m, _Server)))

    async def aclose(self) -> None:
        """End this toolset's sessions; shared ones stay open (see :func:`close_shared_sessions`)."""
        for m in self._members:
            if isinstance(m, _Server) and not m.shared:
                await m.sessions.aclose()


def _members(tools: Sequence[Tool]) -> list[_Server | Tool]:
    if isinstance(tools, MCPToolset):
        return list(tools._members)
    if isinstance(tools, (str, bytes)) or not isinstance(tools, Sequence):
        raise TypeError(f"an MCPToolset joins a sequence of tools, got {type(tools).__name__}")
    return list(tools)


# ---------------------------------------------------------------------------------------------
# mcp_tools and the listing: once per process and server, in a thread with its own event loop


_LISTINGS: dict[tuple[Any, ...], Listing] = {}
_FAILED: dict[tuple[Any, ...], tuple[float, str]] = {}  # key -> (when, why): not retried for a while
_LISTING_LOCK = threading.Lock()
RETRY_FAILED_LISTING = 30.0
"""Seconds a server whose listing failed is not asked again (each env built meanwhile fails at once)."""


def mcp_tools(
    server: MCPServerSpec | str | Sequence[str],
    *,
    sandboxed: bool = False,
    shared: bool = False,
    timeout: float | None = None,
    prefix: str = "",
    include: Sequence[str] | None = None,
    sandbox_config: SandboxConfig | None = None,
) -> MCPToolset:
    """Every tool of an MCP server as an agentrl :class:`~agentrl.tool.Tool`: ``tools = mcp_tools(...)``.

    Args:
        server: a stdio server's argv (``["python", "server.py"]``), a streamable-HTTP URL, or an
            :class:`MCPServerSpec` (environment, cwd, headers, protocol, timeouts).
        sandboxed: start the stdio server inside the episode's sandbox, whose image must hold the
            server and its packages; the env hands the sandbox to the tools as to any sandboxed tool.
        shared: one session for every episode of the process instead of one per episode.
        timeout: seconds per call (None: the env's ``tool_timeout``); a call past it is an error the
            model reads.
        prefix: put before every tool name (two servers with the same tool names).
        include: offer only these tools (the server's names; one str is one name); an unknown name is refused.
        sandbox_config: with ``sandboxed``, the sandbox the listing runs in (None: the process's,
            :func:`agentrl.sandbox.configure`); episodes use their env's sandbox pool.

    The listing (``tools/list``, every page) is fetched once per process and server and cached, so
    building envs stays cheap; a server that cannot be listed raises :class:`MCPServerError` here,
    before any episode starts (and again, without asking it, for :data:`RETRY_FAILED_LISTING` seconds).
    A sandboxed server's tool may not take an argument called ``sandbox`` (agentrl passes the sandbox
    under that name), and a sandboxed server's stderr stays in the sandbox (``spec.stderr`` is refused).
    """
    spec = MCPServerSpec.of(server)
    if sandboxed and (not spec.command or spec.cwd is not None):
        raise ValueError(
            "mcp_tools(sandboxed=True) needs a stdio command without cwd (it runs in the sandbox's /scratch)"
        )
    if sandboxed and spec.stderr is not None:
        raise ValueError(
            "mcp_tools(sandboxed=True): MCPServerSpec.stderr names a host file; a sandboxed server's "
            "stderr stays in its sandbox, so leave stderr unset"
        )
    if sandboxed and shared:
        raise ValueError("mcp_tools: a sandboxed server runs in each episode's sandbox, so it cannot be shared")
    if timeout is not None and (isinstance(timeout, bool) or not timeout > 0):
        raise ValueError(f"mcp_tools timeout must be > 0 seconds or None, got {timeout!r}")
    if not isinstance(prefix, str):
        raise TypeError(f"mcp_tools prefix must be a str, got {type(prefix).__name__}")
    listing = _listing(spec, sandboxed, sandbox_config)
    if isinstance(include, str):
        include = [include]
    if include is not None:
        known = [name for name, _, _ in listing]
        unknown = [n for n in include if n not in known]
        if unknown:
            raise ValueError(f"mcp_tools include: {unknown} are not tools of {spec.describe()!r} (it has {known})")
        listing = tuple(t for t in listing if t[0] in include)
    taken = [name for name, _, schema in listing if "sandbox" in schema.get("properties", {})]
    if sandboxed and taken:
        raise ValueError(
            f"mcp_tools(sandboxed=True): {taken} of {spec.describe()!r} take an argument called 'sandbox', the "
            "name agentrl passes the episode's sandbox under; leave them out with include=, or run the server unsandboxed"
        )
    options = {"sandboxed": sandboxed, "shared": shared, "timeout": timeout, "prefix": prefix}
    return MCPToolset([_Server(spec, listing, options)])


def _listing(spec: MCPServerSpec, sandboxed: bool, config: SandboxConfig | None) -> Listing:
    """The server's tools, cached per process; a failure is remembered for :data:`RETRY_FAILED_LISTING` s."""
    key = (spec, sandboxed, repr(config) if sandboxed else None)
    with _LISTING_LOCK:
        if key in _LISTINGS:
            return _LISTINGS[key]
        failed = _FAILED.get(key)
        if failed is not None and time.monotonic() - failed[0] < RETRY_FAILED_LISTING:
            ago = time.monotonic() - failed[0]
            raise MCPServerError(f"{failed[1]} ({ago:.0f}s ago; not retried for {RETRY_FAILED_LISTING:g}s)")
        try:
            listing: Listing = _in_thread(lambda: _list_tools(spec, sandboxed, config))
        except MCPServerError as e:
            _FAILED[key] = (time.monotonic(), str(e))
            raise
        _FAILED.pop(key, None)
        _LISTINGS[key] = listing
        return listing


def _in_thread(make: Callable[[], Coroutine[Any, Any, Any]]) -> Any:
    """Run the coroutine ``make()`` returns in a new event loop on a new thread (fine inside a running loop)."""
    out: dict[str, Any] = {}

    def target() -> None:
        try:
            out["value"] = asyncio.run(make())
        except BaseException as e:  # re-raised in the caller's thread
            out["error"] = e

    thread = threading.Thread(target=target, name="agentrl-mcp-list", daemon=True)
    thread.start()
    thread.join()
    if "error" in out:
        raise out["error"]
    return out["value"]


async def _list_tools(spec: MCPServerSpec, sandboxed: bool, config: SandboxConfig | None) -> Listing:
    sessions = Sessions(spec, sandboxed)
    try:
        if not sandboxed:
            return await (await sessions.get(None)).list_tools()
        async with await create_sandbox(config) as sandbox:
            return await (await sessions.get(sandbox)).list_tools()
    finally:
        await sessions.aclose()
