"""Arithmetic word problems that the calculator tool solves: the bundled starter environment.

Reward: 1.0 when the last number in the model's final answer (a turn without a tool call) equals
the label exactly, else 0.0. Tasks are generated locally (``Calculator.tasks()``) or read from a
JSONL file with ``prompt`` and ``label`` keys (``envs/data/calculator.jsonl`` holds 64 of them).
"""

from __future__ import annotations

import random
import re

import agentrl
from tools.calculator import calculator

_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")

_TEMPLATES = [
    ("A shop has {a} apples and receives {b} boxes of {c} apples each. How many apples does it have now?",
     lambda a, b, c: a + b * c),
    ("A train travels {b} km per hour for {c} hours, then {a} km more. How many km did it travel?",
     lambda a, b, c: b * c + a),
    ("Tom had {a} coins, spent {b} of them and then found {c} times as many as he spent. How many coins does he have?",
     lambda a, b, c: a - b + b * c),
    ("A box holds {c} rows of {b} cans. {a} cans are taken out. How many cans are left?",
     lambda a, b, c: b * c - a),
    ("There are {a} students in each of {b} classes, and {c} teachers. How many people are there in total?",
     lambda a, b, c: a * b + c),
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
            text, fn = _TEMPLATES[i % len(_TEMPLATES)]
            a, b, c = rng.randint(10, 99), rng.randint(2, 30), rng.randint(2, 30)
            rows.append({"prompt": text.format(a=a, b=b, c=c), "label": str(fn(a, b, c))})
        return rows

    async def reward(self, action: agentrl.Action) -> float:
        numbers = _NUMBER.findall(action.text.replace(",", ""))
        if not numbers:
            return 0.0
        try:
            return float(float(numbers[-1]) == float(self.task["label"]))
        except (TypeError, ValueError):
            return 0.0
