"""A verifiers 0.4 taskset package with a tool server, laid out as ``vf init --add-tool`` scaffolds one.

Multiply two numbers with the ``multiply`` tool (an MCP ``vf.Toolset`` served per rollout), then
answer. ``exact`` scores the final reply; ``used_tool`` scores that the tool ran (read off the trace).
"""

from agentrl_test_calc_tools.taskset import CalcTask, CalcTaskset

__all__ = ["CalcTask", "CalcTaskset"]
