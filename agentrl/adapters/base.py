"""What every adapter shares: the error a parser raises for a reply that is no action, the seed tasks'
placeholder prompt, and the spec prefixes :func:`agentrl.load_env` hands to :mod:`agentrl.adapters`."""

from __future__ import annotations

ADAPTER_PREFIXES = ("gym:", "openenv:", "gem:", "verifiers:")
"""Specs that name another framework's env (:mod:`agentrl.adapters`), never a module of that name."""


class InvalidAction(ValueError):
    """The model's reply is not a valid action. The message is shown to the model, which may retry.

    Raise it from a ``parse_action`` / ``action_from_text`` function; any other exception from
    those functions is a bug in them and fails the sample.
    """


def seed_prompt(kind: str, target: str, seed: int | None) -> str:
    """The placeholder prompt of seed task ``seed`` (the env's reset writes the real first message)."""
    return f"{kind}:{target} seed {seed}"
