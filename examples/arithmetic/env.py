"""The smallest useful agentrl environment: arithmetic with one tool.

Run it (from the repository root) on the embedded engine and default model:

    agentrl check-env --env examples/arithmetic/env.py:Arithmetic --prompt-data examples/arithmetic/tasks.jsonl
    agentrl rollout --env examples/arithmetic/env.py:Arithmetic --prompt-data examples/arithmetic/tasks.jsonl \
        --n-samples-per-prompt 4 --max-turns 4 --rollout-max-turn-len 256 --output samples.jsonl
"""

import agentrl


@agentrl.tool
async def add(a: float, b: float) -> str:
    """Add two numbers.

    Args:
        a: first addend
        b: second addend
    """
    return str(a + b)


class Arithmetic(agentrl.ToolEnv):
    tools = [add]
    max_turns = 4

    async def reward(self, action: agentrl.Action) -> float:  # called on the final answer (a turn with no tool call)
        return float(self.task["label"] in action.text)
