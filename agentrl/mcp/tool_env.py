"""An env whose tools are MCP tools (:class:`MCPToolEnv`), and closing an env's MCP sessions."""

from __future__ import annotations

from typing import Any

from agentrl.env import ToolEnv
from agentrl.mcp.toolset import MCPToolset

__all__ = ["MCPToolEnv", "close_mcp_sessions"]


async def close_mcp_sessions(env: object) -> None:
    """End an env's MCP sessions (its servers). The rollout and :func:`~agentrl.play` do it after every
    episode's ``close`` for any env; call it when driving an env that is not an :class:`MCPToolEnv` by hand."""
    tools = getattr(env, "tools", None)
    if isinstance(tools, MCPToolset):
        await tools.aclose()


class MCPToolEnv(ToolEnv):
    """A :class:`~agentrl.env.ToolEnv` whose ``tools`` are (or include) MCP tools: ``tools = mcp_tools(...)``.

    ``reset`` opens the episode's sessions before the first turn, so starting a server never eats a
    tool call's time limit (a server that does not start fails the sample there), and ``close`` ends
    them. The rest is ToolEnv's: write ``reward``.
    """

    async def reset(self, *, seed: int | None = None, options: dict | None = None) -> tuple[list[Any], dict]:
        tools = self.tools
        if isinstance(tools, MCPToolset):
            await tools.open(await self.sandbox() if tools.sandboxed else None)
        return await super().reset(seed=seed, options=options)

    async def close(self) -> None:
        try:
            await close_mcp_sessions(self)
        finally:
            await super().close()
