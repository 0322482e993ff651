"""Arithmetic word problems that the calculator tool solves: the bundled starter environment.

:class:`Calculator` scores the final answer (a turn without a tool call) by the exact answer: 1.0
when the last number in it equals the label, else 0.

:class:`ShapedCalculator` (the README's first main job; the current one trains :class:`Calculator`
after a warm start, ``examples/calculator_agent/``) adds partial credit, so a small model that never
gets the answer right still has something to learn from: up to 0.3 for a short numeric answer (0.3
for a bare number, falling linearly to 0 at ``BREVITY_WORDS`` words) and 0.2 when the episode made
at least one successful calculator call. Partial credit never reaches the 1.0 of a correct answer,
so pass@k (reward >= 1) still counts only correct answers. Out of the box SmolLM2-135M rambles
without calling the tool and is rarely right (reward ~0.03, most groups all-zero); GRPO first
learns the short answer format.

Tasks are generated locally (``Calculator.tasks()``, each row also carries the ``expression`` that
computes the label, for scripted solvers) or read from a JSONL file with ``prompt`` and ``label``
keys (``envs/data/calculator.jsonl`` holds 64). :func:`solver_policy` (calls the tool, then
answers with its result) and :func:`random_policy` show the reward is earnable and not free.
"""

from __future__ import annotations

import json
import random
import re

import agentrl
from agentrl.tools.calculator import calculator, evaluate

_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")
BREVITY_WORDS = 60

_TEMPLATES = [  # (problem, the expression that solves it)
    (
        "A shop has {a} apples and receives {b} boxes of {c} apples each. How many apples does it have now?",
        "{a} + {b} * {c}",
    ),
    ("A train travels {b} km per hour for {c} hours, then {a} km more. How many km did it travel?", "{b} * {c} + {a}"),
    (
        "Tom had {a} coins, spent {b} of them and then found {c} times as many as he spent. How many coins does he have?",
        "{a} - {b} + {b} * {c}",
    ),
    ("A box holds {c} rows of {b} cans. {a} cans are taken out. How many cans are left?", "{b} * {c} - {a}"),
    (
        "There are {a} students in each of {b} classes, and {c} teachers. How many people are there in total?",
        "{a} * {b} + {c}",
    ),
]


class Calculator(agentrl.ToolEnv):
    """Solve an arithmetic word problem, using the ``calculator`` tool for the arithmetic."""

    tools = [calculator]
    max_turns = 4
    system_prompt = (
        "You are a careful assistant. Use the calculator tool for every computation, "
        "then give the final answer as a single number."
    )

    @staticmethod
    def tasks(n: int = 64, seed: int = 0) -> list[dict]:
        """``n`` generated problems (deterministic for a seed), as task rows with prompt and label."""
        rng = random.Random(seed)
        rows = []
        for i in range(n):
            text, expr = _TEMPLATES[i % len(_TEMPLATES)]
            a, b, c = rng.randint(10, 99), rng.randint(2, 30), rng.randint(2, 30)
            expression = expr.format(a=a, b=b, c=c)
            rows.append(
                {"prompt": text.format(a=a, b=b, c=c), "label": str(evaluate(expression)), "expression": expression}
            )
        return rows

    async def reset(self, *, seed=None, options=None):
        self.successful_calls = 0
        return await super().reset(seed=seed, options=options)

    async def call_tools(self, action: agentrl.Action) -> list[dict]:
        results = await super().call_tools(action)
        self.successful_calls += sum(1 for m in results if not str(m.get("content", "")).startswith("Error"))
        return results

    def exact(self, action: agentrl.Action) -> bool:
        """Whether the last number of the answer equals the label."""
        numbers = _NUMBER.findall(action.text.replace(",", ""))
        try:
            return bool(numbers) and float(numbers[-1]) == float(self.task["label"])
        except (TypeError, ValueError):
            return False

    async def reward(self, action: agentrl.Action) -> float:
        return 1.0 if self.exact(action) else 0.0


class ShapedCalculator(Calculator):
    """:class:`Calculator` plus partial credit for short numeric answers and tool use (see the module doc)."""

    async def reward(self, action: agentrl.Action) -> float:
        if self.exact(action):
            return 1.0
        numbers = _NUMBER.findall(action.text.replace(",", ""))
        words = len(action.text.split())
        brevity = max(0.0, 1.0 - (words - 1) / BREVITY_WORDS) if numbers else 0.0
        return 0.3 * brevity + 0.2 * (getattr(self, "successful_calls", 0) > 0)


def solver_policy(messages: list[dict], task: dict) -> str:
    """Call the calculator on the task's expression, then answer with the tool's result."""
    if messages and messages[-1].get("role") == "tool":
        return f"The answer is {messages[-1]['content']}."
    call = {"name": "calculator", "arguments": {"expression": task["expression"]}}
    return f"<tool_call>{json.dumps(call)}</tool_call>"


def random_policy(seed: int = 0):
    """A policy that answers a random number at once (what guessing earns)."""
    rng = random.Random(seed)
    return lambda messages, task: f"The answer is {rng.randint(0, 1000)}."
