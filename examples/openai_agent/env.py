"""The agent program in agent.py as an agentrl env: `--env examples/openai_agent/env.py:CalculatorAgent`.

The episode is whatever agent.py does: the proxy answers its OpenAI requests from the policy being
trained, records every token, and scores the printed answer when the program exits.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

from agentrl.proxy import ProxyEnv

_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


class CalculatorAgent(ProxyEnv):
    """agent.py, run once per episode with the task row on stdin."""

    command = (sys.executable, str(Path(__file__).with_name("agent.py")))
    max_turns = 4
    agent_timeout = 120.0

    def reward(self, task, messages, output) -> float:
        """1.0 when the last number the agent printed is the label, else 0.0."""
        numbers = _NUMBER.findall(str(output))
        return 1.0 if numbers and float(numbers[-1]) == float(task["label"]) else 0.0
