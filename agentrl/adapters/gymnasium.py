"""A synchronous Gymnasium text environment as an agentrl :class:`~agentrl.Env`, unchanged.

Gymnasium envs are synchronous and single-agent: ``reset(seed, options) -> (obs, info)`` and
``step(action) -> (obs, reward, terminated, truncated, info)``. :class:`GymnasiumEnv` keeps those
verbs and the 5-tuple and changes only the types at the edges:

- observation -> one user message: a ``str`` as is, anything else through ``render_observation``
  (default :func:`format_observation`: numbers and containers as compact JSON);
- the assistant's text -> action through ``parse_action`` (default: from the action space, see
  :func:`default_action_parser`);
- ``reward``/``terminated``/``truncated`` pass through as ``float``/``bool``; ``info`` is made
  JSON-safe (:func:`json_safe`) because samples are written as JSON lines.

Its ``reset``/``step``/``close`` are *synchronous* methods on purpose: the SDK runs synchronous env
methods in its worker threads (a pool as large as the rollout's concurrency), so a Gymnasium env
never blocks the event loop the other episodes share. From async code of your own, call them
through :func:`agentrl.env.call_env`.

**Invalid replies.** A reply the parser rejects (:class:`~agentrl.adapters.InvalidAction`) does
*not* step the Gymnasium env: its state and its ``TimeLimit`` counter are untouched, since the game
never saw an action. The model reads ``"Invalid action: <why>"`` as a user message, the turn's
reward is ``invalid_action_reward`` (default 0.0), and the turn counts against the episode's
``max_turns``, so a model that never answers validly is truncated by the turn limit.
"""

from __future__ import annotations

import functools
import json
import math
import re
from collections.abc import Callable
from typing import Any

import numpy as np

from agentrl.adapters.base import InvalidAction
from agentrl.env import Env, StepResult
from agentrl.types import Action, Message
from agentrl.user_code import import_user_module

_INTEGER = re.compile(r"-?\d+")
_SHOWN = 80  # characters of a bad reply quoted back to the model


def _gymnasium() -> Any:
    try:
        import gymnasium
    except ImportError as exc:  # an optional dependency (agentrl[gym])
        raise ImportError("the gym: adapter needs gymnasium: pip install gymnasium (or agentrl[gym])") from exc
    return gymnasium


def resolve_gym_id(env_id: str) -> Any:
    """The Gymnasium ``EnvSpec`` of ``env_id`` (``ID`` or ``module:ID``).

    ``module:ID`` imports the module first (it registers the id), as ``gymnasium.make`` does, with
    the working directory importable like agentrl's own ``module:Class`` specs. An unknown id or a
    module that is not there raises ValueError / ImportError with one line saying what to fix.
    """
    gym = _gymnasium()
    module, sep, name = env_id.rpartition(":")
    if sep:
        import_user_module(module, hint=f"it should register {name!r} with gymnasium.register")
    try:
        return gym.spec(name)
    except gym.error.Error as exc:
        why = " ".join(str(exc).split())  # gymnasium's message, suggestions included, on one line
        where = (
            f"does {module!r} call gymnasium.register({name!r}, ...)?"
            if sep
            else ("pass gym:MODULE:ID to import the module that registers it")
        )
        raise ValueError(f"{why.rstrip('.')}; {where} (gymnasium.pprint_registry() lists the known ids)") from None


def json_safe(value: Any, _depth: int = 0) -> Any:
    """``value`` as plain JSON data: numpy scalars/arrays become numbers/lists, tuples and sets lists,
    dict keys strings, non-finite floats the strings ``"nan"``/``"inf"``/``"-inf"``, anything else its ``str()``.

    Samples (with every step's ``info``) are written as JSON lines and shipped between processes;
    Gymnasium infos routinely hold numpy values that ``json`` cannot write.
    """
    if value is None or isinstance(value, (str, bool, int)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else str(value)
    if isinstance(value, np.generic):
        return json_safe(value.item(), _depth)
    if _depth > 32:  # a self-referencing structure
        return str(value)
    if isinstance(value, np.ndarray):
        return json_safe(value.tolist(), _depth + 1)
    if isinstance(value, dict):
        return {str(k): json_safe(v, _depth + 1) for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        return [json_safe(v, _depth + 1) for v in value]
    return str(value)


def format_observation(obs: Any) -> str:
    """The default observation text: a ``str`` as is; anything else as compact JSON of :func:`json_safe` (``3``, ``[1, 0]``, ``{"hp": 7}``)."""
    if isinstance(obs, str):
        return obs
    safe = json_safe(obs)
    return safe if isinstance(safe, str) else json.dumps(safe, ensure_ascii=False)


def _quote(text: str) -> str:
    return repr(text if len(text) <= _SHOWN else text[:_SHOWN] + "...")


def _parse_text(space: Any, text: str) -> str:
    reply = text.strip()
    if not space.min_length <= len(reply) <= space.max_length:
        raise InvalidAction(f"reply with {space.min_length} to {space.max_length} characters; yours had {len(reply)}")
    bad = sorted({c for c in reply if c not in space.character_set})
    if bad:
        allowed = "".join(sorted(space.character_set))
        allowed = allowed if len(allowed) <= 100 else allowed[:100] + "..."
        raise InvalidAction(f"reply only with these characters: {allowed!r}; yours contained {''.join(bad[:20])!r}")
    return reply


def _parse_discrete(space: Any, text: str) -> int:
    lo, hi = int(space.start), int(space.start) + int(space.n) - 1
    match = _INTEGER.search(text)
    if match is None:
        raise InvalidAction(f"reply with one whole number from {lo} to {hi}; {_quote(text)} contains none")
    value = int(match.group())
    if not lo <= value <= hi:
        raise InvalidAction(f"{value} is not an action here: reply with one whole number from {lo} to {hi}")
    return value


def default_action_parser(space: Any) -> Callable[[str], Any]:
    """The text -> action function for a Gymnasium action space, when the user gives none.

    ``Text``: the reply stripped of surrounding whitespace, which must fit the space's length limits
    and character set. ``Discrete(n, start)``: the *first* integer in the reply, which must lie in
    ``start .. start + n - 1``. Anything else raises :class:`InvalidAction` with what to fix. Other
    spaces have no natural text form: pass ``parse_action``.
    """
    spaces = _gymnasium().spaces
    if isinstance(space, spaces.Text):
        return functools.partial(_parse_text, space)
    if isinstance(space, spaces.Discrete):
        return functools.partial(_parse_discrete, space)
    raise TypeError(
        f"no default parser for the action space {space}: pass GymnasiumEnv(..., parse_action=fn) "
        "where fn(text) returns an action (and raises agentrl.adapters.InvalidAction for a reply to redo)"
    )


class GymnasiumEnv(Env):
    """A Gymnasium env (an id for ``gymnasium.make``, or an instance) as an agentrl env.

    ``render_observation(obs) -> str`` writes observations (default :func:`format_observation`);
    ``parse_action(text) -> action`` reads the assistant's reply (default
    :func:`default_action_parser` of the action space; raise :class:`InvalidAction` to make the
    model redo the turn); ``system_prompt`` starts the conversation; ``invalid_action_reward`` is
    the reward of a rejected reply (see the module docstring: it costs a turn, not an env step).
    ``make_kwargs`` go to ``gymnasium.make`` (e.g. ``max_episode_steps``).

    The env is made on the first ``reset`` (in a worker thread, like every call into it) and closed
    by ``close`` (an instance passed in too: give each episode its own, as the ``gym:`` factory does).
    ``reset`` seeds it with the task row's ``seed`` when present, else the episode seed, and passes
    the row's ``options`` to Gymnasium's ``reset(options=)``.
    """

    def __init__(
        self,
        env_id_or_env: Any,
        *,
        render_observation: Callable[[Any], str] | None = None,
        parse_action: Callable[[str], Any] | None = None,
        system_prompt: str | None = None,
        invalid_action_reward: float = 0.0,
        **make_kwargs: Any,
    ) -> None:
        if isinstance(env_id_or_env, str):
            resolve_gym_id(env_id_or_env)  # an unknown id fails here, with Gymnasium's suggestions
            self.env_id: str | None = env_id_or_env
            self.gym_env: Any = None
        else:
            if make_kwargs:
                raise TypeError(f"gymnasium.make kwargs {sorted(make_kwargs)} given with an env instance")
            self.env_id, self.gym_env = None, env_id_or_env
        self.render_observation = render_observation or format_observation
        self.parse_action = parse_action
        self.system_prompt = system_prompt
        self.invalid_action_reward = float(invalid_action_reward)
        self.make_kwargs = make_kwargs

    def _message(self, obs: Any) -> Message:
        text = self.render_observation(obs)
        if not isinstance(text, str):
            raise TypeError(f"render_observation returned {type(text).__name__}, expected str")
        return {"role": "user", "content": text}

    def reset(self, *, seed: int | None = None, options: dict | None = None) -> tuple[list[Message], dict]:  # type: ignore[override]
        task = options or {}
        if self.gym_env is None:
            self.gym_env = _gymnasium().make(self.env_id, **self.make_kwargs)
        if self.parse_action is None:
            self.parse_action = default_action_parser(self.gym_env.action_space)
        if task.get("seed") is not None:
            seed = int(task["seed"])
        obs, info = self.gym_env.reset(seed=seed, options=task.get("options"))
        messages: list[Message] = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        messages.append(self._message(obs))
        return messages, json_safe(dict(info))

    def step(self, action: Action) -> StepResult:  # type: ignore[override]
        if self.gym_env is None or self.parse_action is None:
            raise RuntimeError("GymnasiumEnv.step() before reset()")
        try:
            gym_action = self.parse_action(action.text)
        except InvalidAction as exc:
            message: Message = {"role": "user", "content": f"Invalid action: {exc}"}
            return [message], self.invalid_action_reward, False, False, {"invalid_action": str(exc)}
        obs, reward, terminated, truncated, info = self.gym_env.step(gym_action)
        return [self._message(obs)], float(reward), bool(terminated), bool(truncated), json_safe(dict(info))

    def close(self) -> None:  # type: ignore[override]
        env, self.gym_env = self.gym_env, None
        if env is not None:
            env.close()
