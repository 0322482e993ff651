"""Where an MCP server is and how to talk to it (:class:`MCPServerSpec`), and the error a broken server raises."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from agentrl.sandbox.base import SandboxError

__all__ = ["PROTOCOLS", "Listing", "MCPServerError", "MCPServerSpec"]

PROTOCOLS = ("legacy", "auto")


class MCPServerError(SandboxError):
    """The MCP server itself failed: it did not start or answer its handshake, exited, or cannot be reached. Fails the sample."""


@dataclass(frozen=True)
class MCPServerSpec:
    """Where an MCP server is and how to talk to it: exactly one of ``command`` and ``url``.

    ``command`` is the argv of a stdio server (``("python", "server.py")``), run in ``cwd`` with the
    SDK's safe default environment (``PATH``, ``HOME``, ...) plus ``env``. ``url`` is a streamable-HTTP
    endpoint, sent ``headers`` (e.g. an ``Authorization``). ``protocol``: ``"legacy"`` (the
    ``initialize`` handshake: sessions keep state), ``"auto"`` (probe for the newest protocol), or a
    protocol version. ``connect_timeout`` bounds starting the server and the handshake, and (separately)
    the tool listing :func:`~agentrl.mcp.mcp_tools` reads; the error names what it was waiting for (the
    transport to open, the answer to ``initialize``, or to ``tools/list``). ``stderr``:
    a file the server's stderr is appended to (default: discarded, since every episode may start one;
    refused with ``mcp_tools(sandboxed=True)``, whose server's stderr stays in its sandbox).
    Frozen and hashable: the tool listing is cached per spec.
    """

    command: tuple[str, ...] = ()
    url: str | None = None
    env: Mapping[str, str] = field(default_factory=dict)
    cwd: str | None = None
    headers: Mapping[str, str] = field(default_factory=dict)
    protocol: str = "legacy"
    connect_timeout: float = 60.0
    stderr: str | None = None

    def __post_init__(self) -> None:
        command = (self.command,) if isinstance(self.command, str) else tuple(self.command or ())
        if not all(isinstance(a, str) and a for a in command):
            raise TypeError(f"MCPServerSpec.command must be a list of non-empty str (an argv), got {self.command!r}")
        object.__setattr__(self, "command", command)
        if bool(command) == (self.url is not None):
            raise ValueError("MCPServerSpec: give exactly one of command (a stdio server's argv) or url")
        if self.url is not None and not (isinstance(self.url, str) and self.url.startswith(("http://", "https://"))):
            raise ValueError(f"MCPServerSpec.url must be an http:// or https:// URL, got {self.url!r}")
        for name in ("env", "headers"):
            value = getattr(self, name)
            if not isinstance(value, Mapping) or not all(
                isinstance(k, str) and isinstance(v, str) for k, v in value.items()
            ):
                raise TypeError(f"MCPServerSpec.{name} must be a mapping of str to str, got {value!r}")
            object.__setattr__(self, name, _FrozenDict(value))
        if self.protocol not in PROTOCOLS and not (isinstance(self.protocol, str) and self.protocol[:2] == "20"):
            raise ValueError(
                f"MCPServerSpec.protocol must be 'legacy', 'auto' or a protocol version, got {self.protocol!r}"
            )
        if isinstance(self.connect_timeout, bool) or not self.connect_timeout > 0:
            raise ValueError(f"MCPServerSpec.connect_timeout must be > 0 seconds, got {self.connect_timeout!r}")

    @classmethod
    def of(cls, server: MCPServerSpec | str | Sequence[str]) -> MCPServerSpec:
        """A spec from what :func:`mcp_tools` accepts: a spec, a URL, or a stdio command's argv."""
        if isinstance(server, MCPServerSpec):
            return server
        if isinstance(server, str):
            if server.startswith(("http://", "https://")):
                return cls(url=server)
            raise ValueError(f"MCP server {server!r}: give a URL (http://...) or a command as a list of arguments")
        if isinstance(server, Sequence):
            return cls(command=tuple(server))
        raise TypeError(f"MCP server must be an MCPServerSpec, a URL or an argv list, got {type(server).__name__}")

    def describe(self) -> str:
        """A short name for messages: the URL or the command line."""
        return self.url or " ".join(self.command)


class _FrozenDict(dict):  # type: ignore[type-arg]
    """A hashable mapping, so that specs can key the listing cache."""

    def __hash__(self) -> int:  # type: ignore[override]
        return hash(tuple(sorted(self.items())))


Listing = tuple[tuple[str, str, dict[str, Any]], ...]
"""A server's tools as (name, description, input schema), in the server's order."""
