"""Say it in numbers: a multi-turn environment with a dense per-turn reward, for learning checks.

Each episode lasts ``max_turns`` assistant turns. Every turn is scored on its own: the fraction of
its non-space characters that are digits, divided by ``max_turns`` (so an episode's reward is in
[0, 1]); the environment then asks for more numbers. A randomly initialised model writes a few
digits by chance, so every GRPO group has reward variance from the first step, and a working
policy-gradient loop raises the reward within a few dozen steps. ``tests/test_learning.py`` trains
a tiny local model on it; with the advantage sign flipped the reward falls instead.

Not a tool-use task on purpose: a random-init model never writes a well-formed tool call, so a
tool task would teach nothing without supervised warm-up. The tool path is exercised by
``agentrl.envs.calculator`` on the default model.
"""

from __future__ import annotations

import random

import agentrl

_TOPICS = ["apples", "trains", "stars", "coins", "birds", "boxes", "pages", "steps"]


class Digits(agentrl.Env):
    """Answer every turn with as many digits as possible."""

    max_turns = 3

    @staticmethod
    def tasks(n: int = 32, seed: int = 0) -> list[dict]:
        rng = random.Random(seed)
        return [
            {"prompt": f"How many {rng.choice(_TOPICS)} are there? Answer with numbers only.", "label": None}
            for _ in range(n)
        ]

    async def reset(self, *, seed=None, options=None):
        self.task = options or {}
        self.turn = 0
        return [{"role": "user", "content": self.task.get("prompt", "Answer with numbers only.")}], {}

    async def step(self, action: agentrl.Action):
        self.turn += 1
        chars = [c for c in action.text if not c.isspace()]
        score = sum(c.isdigit() for c in chars) / len(chars) if chars else 0.0
        done = self.turn >= self.max_turns
        obs = [] if done else [{"role": "user", "content": "More numbers, please."}]
        return obs, score / self.max_turns, done, False, {"digit_fraction": score}
