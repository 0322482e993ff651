"""Adapters: run environments written for other frameworks as agentrl envs, unchanged.

Four kinds are supported, each reachable from the command line through :func:`agentrl.load_env`:

- ``gym:<gymnasium id>`` (:class:`GymnasiumEnv`): a synchronous Gymnasium env whose observations
  become user messages and whose action is parsed from the assistant's text. The id may name the
  module that registers it, Gymnasium style: ``gym:my_pkg.envs:Guess-v0``.
- ``openenv:<http://host:port>`` (:class:`OpenEnvEnv`): an OpenEnv server (openenv-core's
  ``create_app``), spoken to over its per-session WebSocket protocol so each episode has its own
  environment instance on the server; MCP-style servers are played with tool calls.
- ``gem:<id>`` (:class:`~agentrl.adapters.gem.GemEnv`): a GEM env (``gem.make(id)``, package
  ``gem-llm``), text in and text out.
- ``verifiers:<env id>`` (:class:`~agentrl.adapters.verifiers.VerifiersEnv`): a verifiers
  environment (package ``verifiers``) loaded through its ``load_environment`` entry point; the
  taskset's settings follow as a query, ``verifiers:openenv?base_url=http://127.0.0.1:8000``, or
  as ``adapter_factory("verifiers:openenv", taskset={...})``.

The factories list seed tasks (``tasks()``): row ``i`` is ``{"prompt": ..., "seed": i}``, and a
task row's ``seed`` overrides the episode seed, so the ``n`` samples of a GRPO group play the same
game. Rows from ``--prompt-data`` may carry ``seed`` and ``options`` (passed to the env's reset).
A spec that cannot work (unknown id, missing module, server down) is refused when it is loaded,
with one line that says what to fix.

A reply that cannot be turned into an action is the model's mistake, not a crash: parsers raise
:class:`InvalidAction` and the model reads its message. A server or environment that fails is an
infrastructure fault: it raises, and the sample fails without the model seeing it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from agentrl.adapters.base import ADAPTER_PREFIXES, InvalidAction, seed_prompt
from agentrl.adapters.gem import GemEnv, resolve_gem_id
from agentrl.adapters.gymnasium import GymnasiumEnv, format_observation, json_safe, resolve_gym_id
from agentrl.adapters.openenv import OpenEnvEnv, OpenEnvError
from agentrl.adapters.openenv_probe import SERVER_INFO, probe_server, session_urls
from agentrl.env import Env

PREFIXES = ADAPTER_PREFIXES
"""The ``load_env`` spec prefixes handled here."""


def _adapter_class(kind: str) -> Any:
    if kind == "gym":
        return GymnasiumEnv
    if kind == "openenv":
        return OpenEnvEnv
    if kind == "gem":
        return GemEnv
    from agentrl.adapters.verifiers import VerifiersEnv

    return VerifiersEnv


@dataclass(frozen=True)
class AdapterFactory:
    """The env factory behind ``load_env("gym:...")``, ``"openenv:..."``, ``"gem:..."`` and ``"verifiers:..."``.

    Calling it builds a fresh adapter env (one per episode, so episodes never share state); keyword
    arguments go to the adapter's constructor. A frozen dataclass of plain values (an OpenEnv server's schema and metadata included), so it pickles to Ray
    workers. ``tasks()`` gives ``num_tasks`` seed tasks for runs without ``--prompt-data``
    (``--num-tasks`` takes the first N); a verifiers env gives its own dataset's rows instead.
    """

    kind: str
    target: str
    num_tasks: int = 100
    kwargs: dict[str, Any] = field(default_factory=dict)

    def __call__(self, **kwargs: Any) -> Env:
        return _adapter_class(self.kind)(self.target, **{**self.kwargs, **kwargs})  # type: ignore[no-any-return]

    def tasks(self) -> list[dict[str, Any]]:
        """Seed tasks ``{"prompt", "label", "seed"}``; the prompt only names the game (reset writes the real one)."""
        if self.kind == "verifiers":
            from agentrl.adapters.verifiers_taskset import verifiers_tasks

            return verifiers_tasks(self.target, **self.kwargs)
        return [
            {"prompt": seed_prompt(self.kind, self.target, i), "label": None, "seed": i} for i in range(self.num_tasks)
        ]


def adapter_factory(spec: str, **kwargs: Any) -> AdapterFactory:
    """The factory for a ``gym:ID``, ``openenv:URL``, ``gem:ID`` or ``verifiers:ID`` spec, checked now.

    An unknown id, a module that does not import, a malformed address or an OpenEnv server that
    does not answer raise ValueError (or ImportError for a missing package) with one line naming
    the fix, so a bad ``--env`` is refused before any engine or episode starts.
    """
    kind, sep, target = spec.partition(":")
    if not sep or f"{kind}:" not in PREFIXES:
        raise ValueError(f"{spec!r}: expected one of {', '.join(p + '...' for p in PREFIXES)}")
    if not target:
        raise ValueError(f"{spec!r}: nothing after {kind + ':'!r}")
    if kind == "gym":
        resolve_gym_id(target)
    elif kind == "openenv":
        # its answers travel with the factory: envs built in Ray workers know them too
        probe_server(target, api_key=kwargs.get("api_key"))
        kwargs = {"server_info": SERVER_INFO[session_urls(target)[0]], **kwargs}
    elif kind == "gem":
        resolve_gem_id(target)
    else:
        from agentrl.adapters.verifiers_taskset import resolve_verifiers_env, taskset_settings

        target, _, query = target.partition("?")  # verifiers:ID?FIELD=VALUE&...: the taskset's settings
        settings = taskset_settings(target, query, kwargs.pop("taskset", None))
        kwargs = {**kwargs, "taskset": settings} if settings else kwargs
        resolve_verifiers_env(target, settings)
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
    "seed_prompt",
]
