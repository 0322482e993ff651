"""Adapters: run environments written for other frameworks as agentrl envs, unchanged.

Two kinds are supported, each reachable from the command line through :func:`agentrl.load_env`:

- ``gym:<gymnasium id>`` (:class:`GymnasiumEnv`): a synchronous Gymnasium env whose observations
  become user messages and whose action is parsed from the assistant's text. The id may name the
  module that registers it, Gymnasium style: ``gym:my_pkg.envs:Guess-v0``.
- ``openenv:<http://host:port>`` (:class:`OpenEnvEnv`): an OpenEnv server (openenv-core's
  ``create_app``), spoken to over its per-session WebSocket protocol so each episode has its own
  environment instance on the server.

Both factories list seed tasks (``tasks()``): row ``i`` is ``{"prompt": ..., "seed": i}``, and a
task row's ``seed`` overrides the episode seed, so the ``n`` samples of a GRPO group play the same
game. Rows from ``--prompt-data`` may carry ``seed`` and ``options`` (passed to the env's reset).

A reply that cannot be turned into an action is the model's mistake, not a crash: parsers raise
:class:`InvalidAction` and the model reads its message. A server or environment that fails is an
infrastructure fault: it raises, and the sample fails without the model seeing it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


class InvalidAction(ValueError):
    """The model's reply is not a valid action. The message is shown to the model, which may retry.

    Raise it from a ``parse_action`` / ``action_from_text`` function; any other exception from
    those functions is a bug in them and fails the sample.
    """


# Imported after InvalidAction, which both modules use.
from agentrl.adapters.gymnasium import GymnasiumEnv, format_observation, json_safe  # noqa: E402
from agentrl.adapters.openenv import OpenEnvEnv, OpenEnvError  # noqa: E402

PREFIXES = ("gym:", "openenv:")
"""The ``load_env`` spec prefixes handled here."""


@dataclass(frozen=True)
class AdapterFactory:
    """The env factory behind ``load_env("gym:...")`` and ``load_env("openenv:...")``.

    Calling it builds a fresh adapter env (one per episode, so episodes never share state); keyword
    arguments go to the adapter's constructor. A frozen dataclass of strings, so it pickles to Ray
    workers. ``tasks()`` gives ``num_tasks`` seed tasks for runs without ``--prompt-data``
    (``--num-tasks`` takes the first N).
    """

    kind: str
    target: str
    num_tasks: int = 100
    kwargs: dict[str, Any] = field(default_factory=dict)

    def __call__(self, **kwargs: Any) -> GymnasiumEnv | OpenEnvEnv:
        cls = GymnasiumEnv if self.kind == "gym" else OpenEnvEnv
        return cls(self.target, **{**self.kwargs, **kwargs})

    def tasks(self) -> list[dict[str, Any]]:
        """Seed tasks ``{"prompt", "label", "seed"}``; the prompt only names the game (reset writes the real one)."""
        return [
            {"prompt": f"{self.kind}:{self.target} seed {i}", "label": None, "seed": i} for i in range(self.num_tasks)
        ]


def adapter_factory(spec: str, **kwargs: Any) -> AdapterFactory:
    """The factory for a ``gym:ID`` or ``openenv:URL`` spec, checked now (unknown id, malformed URL).

    Nothing is contacted: an OpenEnv server that is down fails each episode's reset with an
    :class:`OpenEnvError` saying so.
    """
    kind, sep, target = spec.partition(":")
    if not sep or f"{kind}:" not in PREFIXES:
        raise ValueError(f"{spec!r}: expected gym:<gymnasium id> or openenv:<http://host:port>")
    if not target:
        raise ValueError(f"{spec!r}: nothing after {kind + ':'!r}")
    if kind == "gym":
        from agentrl.adapters.gymnasium import resolve_gym_id

        resolve_gym_id(target)
    else:
        from agentrl.adapters.openenv import session_urls

        session_urls(target)
    return AdapterFactory(kind, target, kwargs=kwargs)


__all__ = [
    "AdapterFactory",
    "GymnasiumEnv",
    "InvalidAction",
    "OpenEnvEnv",
    "OpenEnvError",
    "PREFIXES",
    "adapter_factory",
    "format_observation",
    "json_safe",
]
