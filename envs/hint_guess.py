"""Hint and guess: a cooperative game of two roles, each its own sample (a hinter and a guesser).

The hinter sees a secret digit (the task row's ``label``, ``"0"`` to ``"9"``) and replies with a hint: the digit
after the secret (9 is followed by 0), as the rules say. The guesser sees only the hint and replies with the secret.
Both players get 1.0 when the hint keeps the rule and the guess is the secret, else 0.0: neither can score alone.
The reply's last digit counts. Every episode has both turns, so both seats are always played.

The rule is part of the game on purpose. With a free choice of hint (a Lewis signalling game) two policies trained
together do score more with each other, but on conventions of their own making: measured, a hinter and a guesser
co-trained from a warm start that kept "the digit after" for some secrets drifted to "4 is hinted as 1" and
"1 means 4", which a fixed partner does not share. With the rule, each role's skill is its own and can be measured
against any partner that keeps the rule: the hinter's (secret to the next digit) and the guesser's (hint back to the
secret).

Measured with :func:`agentrl.rollout.scripted.play` on ``HintGuess.tasks(1000)`` (mean reward):
``convention_policy(1.0)`` 1.00; ``convention_policy(0.5)`` (half the moves by the rule, half random) 0.31;
``convention_policy(0.0)`` (random hints and guesses) 0.01 (by the odds 1, 0.31 and 0.011).
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable
from typing import Any

import agentrl

_DIGIT = re.compile(r"[0-9]")
_SECRET = re.compile(r"[0-9]")  # ASCII only: str.isdigit() also takes "²" and "٣"

RULES = (
    "We play hint and guess with the digits 0 to 9. The hinter sees a secret digit and gives the guesser the digit "
    "after it as the hint (9 is followed by 0). The guesser sees only the hint and guesses the secret. "
    "We both score when the hint keeps this rule and the guess is right. You are the {role}. Reply with one digit."
)


def secret_of(task: dict[str, Any]) -> int:
    """The task row's secret (its ``label``: one digit as a string, ``"0"`` to ``"9"``), checked."""
    label = task.get("label")
    if not isinstance(label, str) or not _SECRET.fullmatch(label):
        raise ValueError(f"a hint-and-guess task's 'label' must be the secret, one digit '0' to '9', got {label!r}")
    return int(label)


def last_digit(text: str) -> int | None:
    """The reply's last digit, or None."""
    found = _DIGIT.findall(text)
    return int(found[-1]) if found else None


class HintGuess(agentrl.Env):
    """Roles ``hinter`` (moves first) and ``guesser``; see the module docstring."""

    roles = ("hinter", "guesser")
    max_turns = 2

    @staticmethod
    def tasks(n: int = 64, seed: int = 0) -> list[dict[str, Any]]:
        """``n`` games, each secret a digit drawn from ``seed``."""
        rng = random.Random(seed)
        return [{"prompt": "hint and guess", "label": str(rng.randrange(10))} for _ in range(n)]

    async def reset(self, *, seed: int | None = None, options: dict | None = None):
        self.secret = secret_of(options or {})
        self.hint: int | None = None
        self.turn = "hinter"
        return {
            "hinter": [
                {"role": "system", "content": RULES.format(role="hinter")},
                {"role": "user", "content": f"The secret is {self.secret}. Your hint?"},
            ],
            "guesser": [
                {"role": "system", "content": RULES.format(role="guesser")},
                {"role": "user", "content": "Wait for the hint."},
            ],
        }, {}

    def current_role(self) -> str:
        return self.turn

    async def step(self, action: agentrl.Action):
        if self.turn == "hinter":
            self.hint, self.turn = last_digit(action.text), "guesser"
            shown = "no digit" if self.hint is None else str(self.hint)
            info = {"role": "hinter", "hint": self.hint, "kept_rule": self.hint == (self.secret + 1) % 10}
            return (
                {"guesser": [{"role": "user", "content": f"The hint is {shown}. Your guess?"}]},
                {},
                False,
                False,
                info,
            )
        guess = last_digit(action.text)
        won = self.hint == (self.secret + 1) % 10 and guess == self.secret
        info = {"role": "guesser", "guess": guess, "secret": self.secret, "won": won}
        return {}, {"hinter": float(won), "guesser": float(won)}, True, False, info


def convention_policy(follow: float = 1.0, seed: int = 0) -> Callable[[list[agentrl.Message], dict[str, Any]], str]:
    """A scripted player of both seats that keeps the rule (the hint is the digit after the secret; the guess the
    digit before the hint) with probability ``follow`` on each move, and otherwise moves at random (a random hint
    other than the secret; a random guess). The moves are drawn from ``seed`` in the order they are asked for."""
    if not 0.0 <= follow <= 1.0:
        raise ValueError(f"follow must be a probability from 0 to 1, got {follow!r}")
    rng = random.Random(seed)

    def policy(messages: list[agentrl.Message], task: dict[str, Any]) -> str:
        shown = next(m["content"] for m in reversed(messages) if m["role"] == "user")
        keep = rng.random() < follow
        if "secret is" in shown:  # the hinter
            secret = secret_of(task)
            return str((secret + 1) % 10 if keep else rng.choice([d for d in range(10) if d != secret]))
        hint = last_digit(shown)
        return str((hint - 1) % 10 if keep and hint is not None else rng.randrange(10))

    return policy


demo_policy = convention_policy(1.0)
"""Every move by the rule: ``agentrl sft --demo-policy agentrl.envs.hint_guess:demo_policy`` (a demonstration per
seat). A short warm start on them learns the rule for some secrets and not yet for others (a 128-wide tiny model
after 250 steps: the hinter keeps it with probability 0.14 to 0.93 by secret, 0.32 on average; the guesser 0.39),
which the two policies then complete together. Noisy demonstrations (``convention_policy(0.5)`` or ``0.6``) taught
that model nothing in 400 steps: its replies stayed independent of the secret."""
