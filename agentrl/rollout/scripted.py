"""Play an environment with a scripted policy (a Python function instead of a model).

Two questions every new environment must answer before a GPU hour is spent on it: *can the reward
be earned at all* (a scripted solver that knows the task should score ~1) and *is it not free* (a
random policy should score low). :func:`play` runs episodes exactly as the rollout does: the same
``reset``/``step`` verbs, the env's own tool-call parser on the policy's text, ``max_turns``, and
``close`` at the end; only the engine is replaced by ``policy(messages, task) -> str``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from agentrl.env import Env, call_env, maybe_await
from agentrl.parsing import get_parser
from agentrl.types import Action, Message

__all__ = ["PlayResult", "Policy", "play", "play_sync"]

Policy = Callable[[list[Message], dict[str, Any]], "str | Awaitable[str]"]
"""``policy(messages so far, task row) -> the assistant's text`` (tool calls in the env's wire format)."""


@dataclass
class PlayResult:
    """One scripted episode: per-step rewards, their sum, and how it ended."""

    task: dict[str, Any]
    rewards: list[float] = field(default_factory=list)
    messages: list[Message] = field(default_factory=list)
    terminated: bool = False
    truncated: bool = False
    error: str | None = None

    @property
    def reward(self) -> float:
        return float(sum(self.rewards))

    @property
    def turns(self) -> int:
        return len(self.rewards)


async def _episode(make_env: Callable[[], Env], policy: Policy, task: dict[str, Any], seed: int,
                   max_turns: int) -> PlayResult:
    env = make_env()
    result = PlayResult(task=task)
    parser = get_parser(getattr(env, "tool_parser", "hermes"))
    try:
        obs, _ = await call_env(env.reset, seed=seed, options=dict(task))
        result.messages.extend(obs)
        limit = getattr(env, "max_turns", None) or max_turns
        for _ in range(limit):
            text = await maybe_await(policy(list(result.messages), task))
            _, calls, errors = parser.parse(text)
            action = Action(text=text, tool_calls=calls, errors=errors)
            result.messages.append(action.as_message())
            obs, reward, terminated, truncated, _ = await call_env(env.step, action)
            result.rewards.append(float(reward))
            result.messages.extend(obs)
            if terminated or truncated:
                result.terminated, result.truncated = bool(terminated), bool(truncated)
                break
        else:
            result.truncated = True
    except Exception as e:  # reported per episode, like a failed sample in a rollout
        result.error = f"{type(e).__name__}: {e}"
    finally:
        await call_env(env.close)
    return result


async def play(make_env: Callable[[], Env], policy: Policy, tasks: Sequence[dict[str, Any]], *,
               seed: int = 0, max_turns: int = 10, concurrency: int = 8) -> list[PlayResult]:
    """Run one episode per task with ``policy``; results in task order. Env errors are recorded, not raised."""
    gate = asyncio.Semaphore(concurrency)

    async def one(i: int, task: dict[str, Any]) -> PlayResult:
        async with gate:
            return await _episode(make_env, policy, task, seed + i, max_turns)

    return list(await asyncio.gather(*(one(i, t) for i, t in enumerate(tasks))))


def play_sync(make_env: Callable[[], Env], policy: Policy, tasks: Sequence[dict[str, Any]], **kwargs: Any) -> list[PlayResult]:
    """:func:`play` from synchronous code (scripts, notebooks without a running loop)."""
    return asyncio.run(play(make_env, policy, tasks, **kwargs))
