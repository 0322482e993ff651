"""MCP servers' tools as agentrl tools: ``tools = mcp_tools(["python", "server.py"])``.

The Model Context Protocol is how tools are published today: a server lists its tools (name,
description, JSON schema) and runs calls. :func:`mcp_tools` turns every tool of one server into a
:class:`~agentrl.tool.Tool`, so an env offers them to the model, and dispatches and time-limits the
model's calls, exactly as it does its own tools. It speaks MCP through the official ``mcp`` SDK
(``pip install mcp``; imported only when used).

Where the server runs:

- a command (an argv list): started as a child process speaking stdio; with ``sandboxed=True`` it is
  started inside the episode's sandbox instead (a :meth:`~agentrl.sandbox.Sandbox.session`), so a
  server that touches files sees the episode's ``/scratch`` and nothing of the host;
- a URL (``http://127.0.0.1:8000/mcp``): a running server, reached over streamable HTTP.

Sessions: an episode is one MCP session by default, because tools with state (a shell, a browser,
a counter) must not leak it between episodes, which run concurrently. It opens when the env
resets (:class:`MCPToolEnv`) or on the first call, and closes with the env (the rollout and
:func:`~agentrl.play` close the sessions of any env's ``tools`` after its ``close``). ``shared=True`` keeps one
session for every episode of the process instead (stateless servers; cheaper). The handshake is
MCP's ``initialize`` (``protocol="legacy"`` in the SDK's terms): the 2026 protocol is stateless,
so a server keeps session state only over the handshake era (pass ``protocol="auto"`` to negotiate).

Errors: the model reads ``Error: ...`` for what it can act on: bad arguments (checked against the
schema first), a result the server marks ``isError``, a JSON-RPC error, a timeout. A server that
cannot start, exits or becomes unreachable is not the model's doing; the call raises
:class:`MCPServerError` (a :class:`~agentrl.sandbox.SandboxError`), which fails the sample, as a
broken sandbox does, instead of teaching the model that its call was wrong. The next episode (or,
when shared, the next call) starts a fresh session.

Listing: ``mcp_tools`` asks the server for ``tools/list`` once per process and server (cached), in
a thread of its own, so it works at class level, in ``__init__`` and inside a running event loop.
The package: :mod:`~agentrl.mcp.server_spec` (the server spec), :mod:`~agentrl.mcp.toolset` (``mcp_tools``,
the toolset, the listing), :mod:`~agentrl.mcp.sessions` (per-episode and shared sessions),
:mod:`~agentrl.mcp.connection` (one session: the SDK client, transports, results) and
:mod:`~agentrl.mcp.tool_env` (:class:`MCPToolEnv`).
"""

from agentrl.mcp.server_spec import MCPServerError, MCPServerSpec
from agentrl.mcp.sessions import close_shared_sessions
from agentrl.mcp.tool_env import MCPToolEnv, close_mcp_sessions
from agentrl.mcp.toolset import MCPTool, MCPToolset, mcp_tools

__all__ = [
    "MCPServerError",
    "MCPServerSpec",
    "MCPTool",
    "MCPToolEnv",
    "MCPToolset",
    "close_mcp_sessions",
    "close_shared_sessions",
    "mcp_tools",
]
