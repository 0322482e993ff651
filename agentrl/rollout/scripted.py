"""Play an environment with a scripted policy (a Python function instead of a model).

Two questions every new environment must answer before a GPU hour is spent on it: *can the reward
be earned at all* (a scripted solver that knows the task should score ~1) and *is it not free* (a
random policy should score low). :func:`play` runs episodes exactly as the rollout does: the same
``reset``/``step`` verbs, the env's own tool-call parser on the policy's text, ``max_turns``, and
``close`` at the end; only the engine is replaced by ``policy(messages, task) -> str``.
"""

from __future__ import annotations

import asyncio
import copy
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from agentrl.env import (
    Env,
    call_env,
    check_messages,
    check_reset,
    check_roles_reset,
    check_roles_step,
    check_step,
    maybe_await,
)
from agentrl.parsing import get_parser
from agentrl.rollout.episode import release_episode
from agentrl.sandbox import close_default_pool
from agentrl.types import Action, Message

__all__ = ["PlayResult", "Policy", "RolePlay", "play", "play_sync"]

Policy = Callable[[list[Message], dict[str, Any]], "str | Awaitable[str]"]
"""``policy(messages so far, task row) -> the assistant's text`` (tool calls in the env's wire format)."""


@dataclass
class RolePlay:
    """One role's part of a scripted episode with roles: what a demonstration of that seat is made of."""

    messages: list[Message] = field(default_factory=list)
    """The seat's conversation as played (its own turns and what the env showed it)."""
    texts: list[str] = field(default_factory=list)
    """The seat's own texts, turn by turn (another role's turns are not in them)."""
    turn_rewards: list[float] = field(default_factory=list)
    """The seat's reward per own turn, credited as the rollout credits it: a reward given at another role's step
    goes to the seat's last turn before it (or its first turn, when it has not acted yet)."""

    @property
    def reward(self) -> float:
        return float(sum(self.turn_rewards))


@dataclass
class PlayResult:
    """One scripted episode: per-step rewards, their sum, and how it ended."""

    task: dict[str, Any]
    rewards: list[float] = field(default_factory=list)
    messages: list[Message] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)
    """The policy's text of each turn, verbatim (what a model would have sampled, tool-call markup included)."""
    tools: list[dict] = field(default_factory=list)
    """The env's tool schemas (what the chat template renders), for turning the episode into a demonstration."""
    role_rewards: dict[str, float] = field(default_factory=dict)
    """An env with roles (the policy plays them all): each role's total reward."""
    role_plays: dict[str, RolePlay] = field(default_factory=dict)
    """An env with roles: each role's own conversation, texts and per-turn rewards (a demonstration per seat)."""
    rewrites: int = 0
    """How often the env changed the history (:meth:`agentrl.Env.rewrite_history`), counted as a rollout's
    ``history_rewrites``: a rewrite that returns the same messages is none; ``messages`` keeps
    the whole episode as played, the policy saw the rewritten history."""
    terminated: bool = False
    truncated: bool = False
    error: str | None = None

    @property
    def reward(self) -> float:
        return float(sum(self.rewards))

    @property
    def turns(self) -> int:
        return len(self.rewards)


@dataclass
class _Seat:
    """Who the policy plays: the single agent, or one role of an env with roles (self-play)."""

    view: list[Message]
    """What the policy sees: the seat's conversation as the env's rewrites left it."""
    played: list[Message]
    """The seat's whole episode, as played."""
    acted: bool = False
    owed: bool = False
    """Shown something since its last turn (the single agent: after every step), so the env may rewrite
    its history before its next turn, as in a rollout."""
    texts: list[str] = field(default_factory=list)
    turn_rewards: list[float] = field(default_factory=list)
    early_reward: float = 0.0
    """Rewards given to the seat before its first turn: they go to that turn, as in a rollout."""

    def credit(self, value: float) -> None:
        if self.turn_rewards:
            self.turn_rewards[-1] += value
        else:
            self.early_reward += value


async def _episode(
    make_env: Callable[[], Env], policy: Policy, task: dict[str, Any], seed: int, max_turns: int | None
) -> PlayResult:
    """One episode over seats, as the rollout's episode loop plays it (one seat, or one per role).

    ``result.rewards`` holds the acting seat's reward of each step; with roles ``result.role_rewards``
    holds each role's total, ``result.role_plays`` each role's own part and ``result.messages`` is the
    first role's conversation."""
    result = PlayResult(task=task)
    env: Env | None = None
    try:
        env = make_env()
        parser = get_parser(getattr(env, "tool_parser", "hermes"))
        roles = tuple(env.roles)
        raw = await call_env(env.reset, seed=seed, options=dict(task))
        views = check_roles_reset(raw, roles)[0] if roles else {None: check_reset(raw)[0]}
        seats = {role: _Seat(list(obs), list(obs)) for role, obs in views.items()}
        result.messages = seats[roles[0] if roles else None].played  # grows as the episode is played
        result.role_rewards = dict.fromkeys(roles, 0.0)
        result.tools = env.tool_schemas()
        rewrites = type(env).rewrite_history is not Env.rewrite_history
        for _ in range(_turn_limit(max_turns, env)):
            role = _current_role(env, roles) if roles else None
            seat = seats[role]
            if rewrites and seat.owed:  # before the seat's next turn; a rewrite that changes nothing is none
                # a deep copy, as the rollout gives it: one that edits messages in place returns a new history
                rewritten = await call_env(env.rewrite_history, copy.deepcopy(seat.view))
                if rewritten is not None:
                    rewritten = check_messages(rewritten, "rewrite_history()")
                    if rewritten != seat.view:
                        seat.view = rewritten
                        result.rewrites += 1
            seat.acted, seat.owed = True, False
            text = await maybe_await(policy(list(seat.view), task))
            if not isinstance(text, str):
                raise TypeError(f"the policy returned {type(text).__name__}, not the assistant's text (str)")
            _, calls, errors = parser.parse(text)
            action = Action(text=text, tool_calls=calls, errors=errors)
            result.texts.append(text)
            seat.texts.append(text)
            seat.turn_rewards.append(seat.early_reward)
            seat.early_reward = 0.0
            seat.view.append(action.as_message())
            seat.played.append(action.as_message())
            raw = await call_env(env.step, action)
            shown: dict[str | None, list[Message]]
            rewards: dict[str | None, float]
            if roles:
                by_role, role_reward, terminated, truncated, _ = check_roles_step(raw, roles, role or "")
                shown = {r: msgs for r, msgs in by_role.items()}
                rewards = {r: value for r, value in role_reward.items()}
            else:
                obs, reward, terminated, truncated, _ = check_step(raw)
                shown, rewards = {None: obs}, {None: float(reward)}
            result.rewards.append(float(rewards.get(role, 0.0)))
            for r, value in rewards.items():
                if r is not None:
                    result.role_rewards[r] += value
                    seats[r].credit(value)
            for r, msgs in shown.items():
                seats[r].view.extend(msgs)
                seats[r].played.extend(msgs)
                # owed until the seat's next turn (a later step that shows it nothing keeps the debt)
                seats[r].owed = seats[r].owed or (seats[r].acted and (not roles or bool(msgs)))
            if terminated or truncated:
                result.terminated, result.truncated = bool(terminated), bool(truncated)
                break
        else:
            result.truncated = True
        for r in roles:
            result.role_plays[r] = RolePlay(seats[r].played, seats[r].texts, seats[r].turn_rewards)
    except asyncio.CancelledError:
        raise
    except BaseException as e:  # reported per episode (SystemExit included), like a failed sample in a rollout
        result.error = f"{type(e).__name__}: {e}"
    finally:
        if env is not None:
            meta: dict[str, Any] = {}
            try:
                await call_env(env.close)
            except asyncio.CancelledError:
                raise
            except BaseException as e:
                meta["close_error"] = f"{type(e).__name__}: {e}"
            await release_episode(env, meta)
            result.error = result.error or meta.get("close_error")
    return result


def _current_role(env: Env, roles: tuple[str, ...]) -> str:
    role = env.current_role()
    if role not in roles:
        raise ValueError(f"current_role() returned {role!r}; the env's roles are {list(roles)}")
    return role


def _turn_limit(max_turns: int | None, env: Env) -> int:
    """The smaller of ``max_turns`` and the env's own ``max_turns``; 10 when neither is set."""
    limits = [n for n in (max_turns, getattr(env, "max_turns", None)) if n]
    return min(limits) if limits else 10


async def play(
    make_env: Callable[[], Env],
    policy: Policy,
    tasks: Sequence[dict[str, Any]],
    *,
    seed: int = 0,
    max_turns: int | None = None,
    concurrency: int = 8,
) -> list[PlayResult]:
    """Run one episode per task with ``policy``; results in task order. Env errors are recorded, not raised.

    ``max_turns`` caps every episode; an env's own ``max_turns`` lowers it (as in a rollout); with
    neither, 10 turns.
    """
    gate = asyncio.Semaphore(concurrency)

    async def one(i: int, task: dict[str, Any]) -> PlayResult:
        async with gate:
            return await _episode(make_env, policy, task, seed + i, max_turns)

    return list(await asyncio.gather(*(one(i, t) for i, t in enumerate(tasks))))


def play_sync(
    make_env: Callable[[], Env], policy: Policy, tasks: Sequence[dict[str, Any]], **kwargs: Any
) -> list[PlayResult]:
    """:func:`play` from synchronous code (scripts, notebooks without a running loop)."""

    async def run() -> list[PlayResult]:
        try:
            return await play(make_env, policy, tasks, **kwargs)
        finally:
            await close_default_pool()

    return asyncio.run(run())
