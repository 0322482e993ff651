"""A GEM environment (package ``gem-llm``, ``gem.make(id)``) as an agentrl :class:`~agentrl.Env`.

GEM envs are synchronous and text in, text out: ``reset(seed) -> (observation, info)`` and
``step(action: str) -> (observation, reward, terminated, truncated, info)``, with the whole reply
as the action (each env parses it itself, e.g. ``\\boxed{42}`` in its guess-the-number game, and
scores a reply it cannot parse). :class:`GemEnv` keeps that contract and changes only the edges,
following GEM's own chat wrapper (``ObservationWrapper`` in its ``concat_chat`` mode): each
observation is one message (``tool`` when ``info["use_tool"]`` says a tool answered, else
``user``), with ``info["prefix"]`` / ``info["suffix"]`` around it ("Enter your next guess.");
the assistant's replies are already in the conversation. ``info`` is made JSON-safe.

**Seeds.** GEM seeds Python's and NumPy's *global* random generators in ``reset(seed)`` and its
games draw from them, in ``reset`` (the game) and in a few games' ``step`` too (GEM 0.1.0's 2048
places a tile, Minesweeper lays its mines at the first click). Episodes of a rollout run
concurrently in worker threads, so each :class:`GemEnv` keeps its own generator states and swaps
them in, under one process-wide lock, around the calls that draw: ``gem.make``, ``reset``, and
``step`` only for games whose step draws (``step_draws``; by default the two above). Other steps
run without the lock, so a long step (running code, a container) never holds up other episodes;
a game whose step draws but is not marked would take those draws from the process's generators
(random, but not its seed's, and shuffling a concurrent reset's). A reset without a seed draws a
fresh one (GEM would otherwise replay the same generator state every time): an episode's game
depends on its seed only, whatever runs beside it.

Its methods are synchronous on purpose (the SDK runs them in its worker threads, as for
:class:`~agentrl.adapters.GymnasiumEnv`).
"""

from __future__ import annotations

import difflib
import functools
import random
import secrets
import threading
from collections.abc import Callable
from typing import Any

import numpy as np

from agentrl.adapters.gymnasium import format_observation, json_safe
from agentrl.env import Env, StepResult
from agentrl.types import Action, Message

_GLOBAL_RNG = threading.Lock()  # GEM's generators are process-wide: one drawing call at a time

STEP_DRAWS = frozenset({"Game2048Env", "MinesweeperEnv"})
"""GEM 0.1.0 env classes whose ``step`` draws from the global generators (measured: each game's
random moves, the generators compared before and after); their steps run under the lock."""


def _gem() -> Any:
    try:
        import gem
    except ImportError as exc:
        raise ImportError(f"the gem: adapter needs GEM: pip install gem-llm ({exc})") from None
    return gem


def resolve_gem_id(env_id: str) -> None:
    """Check that ``env_id`` is registered with GEM; ValueError (one line, with close ids) if not."""
    _gem()
    from gem.envs.registration import ENV_REGISTRY

    if env_id not in ENV_REGISTRY:
        close = difflib.get_close_matches(env_id, list(ENV_REGISTRY), n=3, cutoff=0.5)
        hint = f"did you mean {', '.join(close)}? " if close else ""
        raise ValueError(
            f"GEM has no env {env_id!r}; {hint}(python -c 'import gem; gem.print_envs()' lists them; "
            "register your own with gem.register(ID, 'module:Class'))"
        )


class GemEnv(Env):
    """A GEM env (an id for ``gem.make``, or an instance) as an agentrl env.

    ``render_observation(obs) -> str`` writes non-string observations (default
    :func:`~agentrl.adapters.format_observation`); ``system_prompt`` starts the conversation;
    ``make_kwargs`` go to ``gem.make``. The env is made on the first ``reset`` and closed (when it
    has a ``close``) by :meth:`close`. ``reset`` seeds it with the task row's ``seed`` when present,
    else the episode seed (GEM wants a non-negative int; None draws a fresh one). ``step_draws``
    says whether the game's ``step`` draws random numbers (its steps then hold the lock, see the
    module docstring); None: the games in :data:`STEP_DRAWS`.
    """

    def __init__(
        self,
        env_id_or_env: Any,
        *,
        render_observation: Callable[[Any], str] | None = None,
        system_prompt: str | None = None,
        step_draws: bool | None = None,
        **make_kwargs: Any,
    ) -> None:
        if isinstance(env_id_or_env, str):
            resolve_gem_id(env_id_or_env)
            self.env_id: str | None = env_id_or_env
            self.gem_env: Any = None
        else:
            if make_kwargs:
                raise TypeError(f"gem.make kwargs {sorted(make_kwargs)} given with an env instance")
            self.env_id, self.gem_env = None, env_id_or_env
        self.render_observation = render_observation or format_observation
        self.system_prompt = system_prompt
        self.make_kwargs = make_kwargs
        self.step_draws = step_draws
        self._rng: tuple[Any, Any] | None = None  # this episode's (random, numpy) generator states

    def _in_own_rng(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Call into GEM with this episode's generator states swapped in, under the lock (module docstring)."""
        with _GLOBAL_RNG:
            saved = random.getstate(), np.random.get_state()
            if self._rng is not None:
                random.setstate(self._rng[0])
                np.random.set_state(self._rng[1])
            try:
                return fn(*args, **kwargs)
            finally:
                self._rng = random.getstate(), np.random.get_state()
                random.setstate(saved[0])
                np.random.set_state(saved[1])

    def _message(self, obs: Any, info: dict[str, Any]) -> Message:
        text = self.render_observation(obs)
        if not isinstance(text, str):
            raise TypeError(f"render_observation returned {type(text).__name__}, expected str")
        suffix = info.get("suffix")
        if isinstance(suffix, str) and suffix:
            text = (text if not text or text.endswith("\n") else text + "\n") + suffix
        prefix = info.get("prefix")
        if isinstance(prefix, str):
            text = prefix + text
        return {"role": "tool" if info.get("use_tool") else "user", "content": text}

    def reset(self, *, seed: int | None = None, options: dict | None = None) -> tuple[list[Message], dict]:  # type: ignore[override]
        task = options or {}
        if task.get("seed") is not None:
            seed = int(task["seed"])
        if seed is not None and seed < 0:
            raise ValueError(f"GEM wants a seed >= 0, got {seed}")
        if seed is None:  # a fresh game: the swapped-in state alone would replay the same one
            seed = secrets.randbelow(2**31)
        if self.gem_env is None:
            self.gem_env = self._in_own_rng(_gem().make, self.env_id, **self.make_kwargs)
        obs, info = self._in_own_rng(self.gem_env.reset, seed=seed)
        info = dict(info or {})
        messages: list[Message] = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        messages.append(self._message(obs, info))
        return messages, json_safe(info)

    def step(self, action: Action) -> StepResult:  # type: ignore[override]
        if self.gem_env is None:
            raise RuntimeError("GemEnv.step() before reset()")
        draws = self.step_draws
        if draws is None:
            draws = type(getattr(self.gem_env, "unwrapped", self.gem_env)).__name__ in STEP_DRAWS
        step = functools.partial(self._in_own_rng, self.gem_env.step) if draws else self.gem_env.step
        obs, reward, terminated, truncated, info = step(action.text)
        info = dict(info or {})
        return [self._message(obs, info)], float(reward), bool(terminated), bool(truncated), json_safe(info)

    def close(self) -> None:  # type: ignore[override]
        env, self.gem_env = self.gem_env, None
        close = getattr(env, "close", None)
        if callable(close):
            close()
