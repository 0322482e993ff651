"""Supervised warm starts: demonstrations in, the same trainer, checkpoints and metrics as RL out.

``agentrl sft`` (= ``agentrl train --loss-type sft_loss``, slime's name) trains on token-exact
demonstrations (:mod:`agentrl.rollout.demos`) with the trainer backends, Ray actors, ``iter_*``
checkpoints, ``metrics.jsonl`` and eval that ``agentrl train`` uses; only the data and the loss
differ. It runs in the same :class:`~agentrl.runtime.loop.TrainLoop` as RL, with the demonstrations as its rollout
side (:class:`~agentrl.runtime.collect.DemoCollector`) and :class:`~agentrl.runtime.recipes.SFT` as its recipe. One
step is one optimizer step on ``--global-batch-size`` demonstrations drawn in a seeded, epoch-shuffled order
(:class:`~agentrl.runtime.buffer.PromptSource`, whose cursor is checkpointed); ``--num-epoch`` passes over the
demonstrations (default 1), or ``--num-rollout`` steps (:func:`sft_steps`).

Demonstrations are loaded and checked before Ray starts (:func:`load_demonstrations`): a bad row
stops the run with its file and line before any model is loaded for training, and the counts are
printed. With ``--save`` they are also written to ``<save>/demos.jsonl`` (``agentrl view`` shows
what was trained on, token by token).
"""

from __future__ import annotations

import asyncio
import math
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from agentrl.config import RunConfig
from agentrl.data import read_rows
from agentrl.env import call_env, reset_once
from agentrl.rollout import demos
from agentrl.rollout.demos import rejection_samples, scripted_samples
from agentrl.sandbox import close_default_pool
from agentrl.types import Sample
from agentrl.user_code import load_function

__all__ = ["env_tool_schemas", "load_demonstrations", "sft_steps"]


def load_demonstrations(cfg: RunConfig, factory: Any, rows: list[dict[str, Any]], checkpoint: Path) -> list[Sample]:
    """The run's demonstrations as Samples, from ``--sft-data``, ``--demo-policy`` or ``--demo-engine-url``."""
    if any(r.get("generate_function_path") for r in rows):
        raise ValueError(
            "a task row has 'generate_function_path': a per-row generate function is for RL rollouts, not demonstrations"
        )
    from agentrl.rollout.context import chat_template, load_tokenizer

    # the run's own chat template, built as the episodes' is (an unsupported vision family was refused by the
    # preflight's checkpoint checks before this)
    template = chat_template(load_tokenizer(str(checkpoint))[0], cfg.rollout, vision_source=checkpoint)
    if cfg.sft_data:
        demo_rows = list(read_rows(cfg.sft_data))
        env_tools = None
        if factory is not None:
            task = rows[0] if rows else demo_task(demo_rows[0][1] if demo_rows else {})
            calls = any(
                isinstance(m, dict) and m.get("tool_calls")
                for _, row in demo_rows
                for m in (row.get("messages") if isinstance(row.get("messages"), list) else [])
            )
            env_tools = env_tool_schemas(
                factory,
                task,
                seed=cfg.rollout.rollout_seed,
                timeout=cfg.rollout.env_step_timeout,
                reset_if_none=calls,
            )
        samples, stats = demos.conversation_samples(
            demo_rows, template, env_tools=env_tools, allow_non_token_exact=cfg.allow_non_token_exact
        )
    elif cfg.demo_policy:
        policy = load_function(cfg.demo_policy)
        samples, stats = asyncio.run(_scripted(factory, policy, rows, template, cfg))
    else:
        samples, stats = asyncio.run(_rejection(cfg, factory, rows, template))
    print(f"demonstrations: {stats.summary()}", file=sys.stderr)
    for line in stats.problems[:5]:
        print(f"  {line}", file=sys.stderr)
    if not samples:
        raise ValueError(
            "no demonstrations to train on: "
            + stats.summary()
            + ("; lower --demo-min-reward" if stats.below_min_reward else "")
        )
    return samples


def demo_task(row: dict[str, Any]) -> dict[str, Any]:
    """A task row for ``reset`` made from a demonstration row: its first user message as ``prompt``,
    its ``label``, and its other keys (not ``messages``/``tools``), as ``--prompt-data`` would give them."""
    msgs = row.get("messages")
    user = (
        next((m for m in msgs if isinstance(m, dict) and m.get("role") == "user"), None)
        if isinstance(msgs, list)
        else None
    )
    prompt = user.get("content") if user is not None else None
    extra = {k: v for k, v in row.items() if k not in ("messages", "tools")}
    return {**extra, "prompt": prompt if isinstance(prompt, str) else "", "label": row.get("label")}


def env_tool_schemas(
    factory: Callable[[], Any], task: dict[str, Any], *, seed: int, timeout: float, reset_if_none: bool = True
) -> list[dict]:
    """The OpenAI specs of the tools the env offers, which demonstrations render with, as its rollouts do.

    Most envs declare ``tools`` up front. Some learn them at ``reset`` (an MCP server behind the
    ``openenv:`` adapter lists its tools once connected): when a fresh env offers none, one is reset
    with ``task`` and ``seed``, read and closed, as ``agentrl check`` first looks at an env. Without
    this every tool-call demonstration would be refused as calling a tool that is not offered. A
    reset that fails or outlasts ``timeout`` (``--env-step-timeout``) stops the load, naming the cause.
    ``reset_if_none=False`` (no demonstration calls a tool) skips that reset: a chat env without tools
    is never started just to learn it has none.
    """
    env = factory()
    tools = list(env.tool_schemas())
    if tools or not reset_if_none:
        return tools
    return asyncio.run(_tools_after_reset(env, task, seed=seed, timeout=timeout))


async def _tools_after_reset(env: Any, task: dict[str, Any], *, seed: int, timeout: float) -> list[dict]:
    async def call(what: str, method: Callable[..., Any], **kwargs: Any) -> Any:
        async with asyncio.timeout(timeout):  # in this task: a SystemExit in a task of its own would stop the loop
            return await call_env(method, **kwargs)  # a sync reset or close runs in a worker thread

    def close_failed(exc: BaseException) -> None:  # it must not hide the tools read or the reset's own error
        print(f"reading the env's tools: close() after the reset failed: {type(exc).__name__}: {exc}", file=sys.stderr)

    try:
        async with reset_once(env, task, seed=seed, call=call, on_close_error=close_failed):
            return list(env.tool_schemas())
    except (Exception, SystemExit) as exc:  # SystemExit from a user's env included: a message, not a silent exit
        kind = "timed out" if isinstance(exc, TimeoutError) else f"raised {type(exc).__name__}: {exc}"
        raise ValueError(
            f"reading the env's tools: it offers none before reset, and reset() with the first task {kind}"
        ) from None
    finally:
        await close_default_pool()


async def _scripted(factory: Any, policy: Any, rows: list[dict[str, Any]], template: Any, cfg: RunConfig) -> Any:
    try:
        return await scripted_samples(
            factory,
            policy,
            rows,
            template,
            min_reward=cfg.demo_min_reward,
            max_turns=cfg.rollout.turn_limit(getattr(factory, "max_turns", None)),
            seed=cfg.rollout.rollout_seed,
            concurrency=min(cfg.rollout.rollout_concurrency, 32),
        )
    finally:
        await close_default_pool()


async def _rejection(cfg: RunConfig, factory: Any, rows: list[dict[str, Any]], template: Any) -> Any:
    from agentrl.engines.http import API_KEY_ENV
    from agentrl.rollout.context import close_context, episode_context

    api_key = os.environ.get(API_KEY_ENV) or None
    ctx = episode_context(cfg.rollout, cfg.demo_engine_url, template, api_key=api_key)
    try:
        assert cfg.demo_min_reward is not None  # validated
        return await rejection_samples(ctx, factory, rows, min_reward=cfg.demo_min_reward, best_of_n=cfg.demo_best_of_n)
    finally:
        await close_context(ctx)
        await close_default_pool()


def sft_steps(cfg: RunConfig, n_demos: int) -> int:
    """Optimizer steps of the run: ``--num-epoch`` passes of ``--global-batch-size`` demonstrations, or
    ``--num-rollout``; one epoch when neither is given."""
    if cfg.num_epoch is None and cfg.num_rollout is not None:
        return cfg.num_rollout
    return (cfg.num_epoch or 1) * math.ceil(n_demos / cfg.train.global_batch_size)
