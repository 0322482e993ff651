"""Guess the number, with a calculator: a multi-turn game whose env also runs tools.

The pattern every game with tools follows (a plain :class:`agentrl.Env`, not a
:class:`~agentrl.ToolEnv`): a turn with tool calls is answered by the SDK's dispatch,
``await self.call_tools(action)`` (bad calls, unknown tools, timeouts and the turn budget become
error messages the model reads), and the game goes on; a turn without one is a *move*, which the env
judges and answers itself, ending the episode only when the game is over.

The secret is a whole number from 1 to ``high`` (the task row's ``high``, default 1000; the
``label`` is the secret). A move is ``<guess>N</guess>`` (the last such tag counts); the env answers
``Guess 3 of 10: 500 is too high.``. A move without a readable whole number costs a guess too, so
an episode always ends. Tool turns cost no guess but count against ``max_turns`` (20 = a tool turn
and a guess for each of the 10 guesses): bisecting 1..1000 takes at most 10 guesses, and the
calculator gives the midpoints.

Reward (once, when the game ends): ``1.0 - 0.05 * (guesses - 1)`` for finding the secret at guess
``guesses`` (1.0 .. 0.55), 0.0 for running out of guesses. ``info`` records each move's ``guess``,
``valid`` and ``guesses_used``, and ``secret`` at the end.

Measured with :func:`agentrl.rollout.scripted.play` on ``tasks(64)``: :func:`solver_policy` (asks the
calculator for the midpoint of what is left, then guesses it) finds every secret, mean reward ~0.6;
:func:`random_policy` (a random number in range each turn) ~0.03.
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Callable
from typing import Any

import agentrl
from agentrl.parsing import last_tag
from agentrl.tools.calculator import calculator

MAX_GUESSES = 10
DEFAULT_HIGH = 1000
SOLVE_REWARD = 1.0
SOLVE_DECAY = 0.05
MAX_HIGH = 10**9

PROMPT = (
    "I am thinking of a whole number from 1 to {high}. Find it in at most {guesses} guesses. Each turn either "
    "use the calculator tool or make one guess written as <guess>N</guess>; after each guess I say whether the "
    "number is too low or too high."
)

_FEEDBACK = re.compile(r"Guess \d+ of \d+: (-?\d+) is too (low|high)\.")


def parse_guess(text: str) -> int | None:
    """The whole number in the text's last ``<guess>`` tag, or None."""
    found = last_tag(text, "guess")
    if found is None:
        return None
    try:
        return int(found.strip().replace(",", ""))
    except ValueError:
        return None


class GuessNumber(agentrl.Env):
    """Find the secret number (the task's ``label``) by bisection; see the module docstring."""

    tools = [calculator]
    max_turns = 2 * MAX_GUESSES

    @staticmethod
    def tasks(n: int = 64, seed: int = 0, high: int = DEFAULT_HIGH) -> list[dict[str, Any]]:
        """``n`` games (deterministic for a seed): the rules as prompt, the secret as label."""
        rng = random.Random(seed)
        prompt = PROMPT.format(high=high, guesses=MAX_GUESSES)
        return [{"prompt": prompt, "label": str(rng.randint(1, high)), "high": high} for _ in range(n)]

    async def reset(self, *, seed: int | None = None, options: dict | None = None):
        task = dict(options or {})
        high = task.get("high", DEFAULT_HIGH)
        if isinstance(high, bool) or not isinstance(high, int) or not 1 <= high <= MAX_HIGH:
            raise ValueError(f"a GuessNumber task's 'high' must be a whole number from 1 to {MAX_HIGH}, got {high!r}")
        try:
            secret = int(str(task.get("label")).strip())
        except ValueError:
            secret = 0
        if not 1 <= secret <= high:
            raise ValueError(
                f"a GuessNumber task's 'label' must be the secret, a whole number from 1 to {high}, "
                f"got {task.get('label')!r}"
            )
        self.secret, self.high, self.guesses = secret, high, 0
        prompt = str(task.get("prompt") or PROMPT.format(high=high, guesses=MAX_GUESSES))
        return [{"role": "user", "content": prompt}], {}

    async def step(self, action: agentrl.Action):
        if action.tool_calls or action.errors:  # a tool turn: the SDK's dispatch answers it, the game goes on
            info = {"tool_calls": len(action.tool_calls), "tool_errors": len(action.errors)}
            return await self.call_tools(action), 0.0, False, False, info
        self.guesses += 1
        guess = parse_guess(action.text)
        info: dict[str, Any] = {"guess": guess, "valid": guess is not None, "guesses_used": self.guesses}
        if guess == self.secret:
            info["secret"] = self.secret
            return [], SOLVE_REWARD - SOLVE_DECAY * (self.guesses - 1), True, False, info
        left = MAX_GUESSES - self.guesses
        if left == 0:  # losing is the game's end, not a limit: terminated
            info["secret"] = self.secret
            return [], 0.0, True, False, info
        head = f"Guess {self.guesses} of {MAX_GUESSES}: "
        if guess is None:
            line = head + "no guess read. Write one whole number as <guess>N</guess>."
        else:
            line = head + f"{guess} is too {'low' if guess < self.secret else 'high'}."
        return [{"role": "user", "content": f"{line} {left} left."}], 0.0, False, False, info


def _bounds(messages: list[agentrl.Message], high: int) -> tuple[int, int]:
    lo, hi = 1, high
    for m in messages:
        if m["role"] == "user":
            for n, way in _FEEDBACK.findall(m["content"]):
                if way == "low":
                    lo = max(lo, int(n) + 1)
                else:
                    hi = min(hi, int(n) - 1)
    return lo, hi


def solver_policy(messages: list[agentrl.Message], task: dict[str, Any]) -> str:
    """Scripted bisection for :func:`agentrl.rollout.scripted.play`: reads only the feedback, never the label.

    It asks the calculator for the midpoint, then guesses what the tool answered, so every guess goes
    through the SDK's tool dispatch first.
    """
    last = messages[-1]
    if last["role"] == "tool":
        return f"<guess>{last['content'].strip()}</guess>"
    lo, hi = _bounds(messages, int(task.get("high", DEFAULT_HIGH)))
    call = {"name": "calculator", "arguments": {"expression": f"({lo} + {hi}) // 2"}}
    return f"<tool_call>\n{json.dumps(call)}\n</tool_call>"


def random_policy(seed: int = 0) -> Callable[[list[agentrl.Message], dict[str, Any]], str]:
    """Baseline: a random number in range each turn, never a tool call."""

    def policy(messages: list[agentrl.Message], task: dict[str, Any]) -> str:
        rng = random.Random(f"{seed}:{task.get('label')}:{len(messages)}")
        return f"<guess>{rng.randint(1, int(task.get('high', DEFAULT_HIGH)))}</guess>"

    return policy
