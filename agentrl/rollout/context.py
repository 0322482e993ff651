"""The episode context a process shares, built in one place: the router over the engines, the chat template
and the rollout settings (:class:`~agentrl.rollout.episode.EpisodeContext`).

Every process that plays episodes builds its context here: the ``rollout``, ``eval`` and ``proxy``
commands (:func:`command_context`), the training driver and each rollout worker (:func:`run_context`)
and SFT's rejection sampling (:func:`episode_context`), so a setting such as ``--role-engine-url`` or
the routed-experts switch reaches every run that allows it the same way.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import sys
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import Executor
from pathlib import Path
from typing import TYPE_CHECKING, Any

from agentrl.chat import ChatTemplate
from agentrl.checkpoint import cache_dir
from agentrl.config import RolloutConfig, RunConfig
from agentrl.engines.base import Engine
from agentrl.engines.http import API_KEY_ENV, ChatCompletionsEngine, SGLangEngine, wait_healthy
from agentrl.engines.router import Router
from agentrl.rollout.episode import EpisodeContext
from agentrl.rollout.generate import bind_engine_args
from agentrl.rollout.threads import SyncPool
from agentrl.sandbox import close_default_pool
from agentrl.vlm import vision_for

if TYPE_CHECKING:
    import argparse

__all__ = [
    "chat_template",
    "close_context",
    "command_context",
    "command_engine_urls",
    "engine_urls",
    "episode_context",
    "follow_urls",
    "load_tokenizer",
    "run_context",
]


def load_tokenizer(path: str | Path, chat_template_file: str | None = None) -> tuple[Any, str | None]:
    """The checkpoint's tokenizer and the ``--chat-template`` file's text (None: the tokenizer's own)."""
    from transformers import AutoTokenizer  # heavy: only where a tokenizer is needed

    tok = AutoTokenizer.from_pretrained(path)
    template = Path(chat_template_file).read_text() if chat_template_file else None
    return tok, template


def chat_template(
    tokenizer: Any, config: RolloutConfig, template_src: str | None = None, vision_source: Any = None
) -> ChatTemplate:
    """The run's chat template: ``template_src`` (else the tokenizer's), the config's tool template, and the
    checkpoint's vision processor when ``vision_source`` (its folder) has one."""
    vision = vision_for(vision_source, strict=False)
    return ChatTemplate(tokenizer, template=template_src, tool_template=config.tool_template, vision=vision)


def episode_context(
    config: RolloutConfig,
    urls: Sequence[str],
    template: ChatTemplate,
    *,
    api_key: str | None = None,
    routed_experts: bool = False,
    chat_api: bool = False,
    model: str | None = None,
    executor: Executor | None = None,
    lora_path: str | None = None,
) -> EpisodeContext:
    """The context for episodes on the engines at ``urls``: a token-exact router of SGLang clients (each
    asking for routed experts when ``routed_experts``), or, with ``chat_api``, of OpenAI chat-completions
    clients for ``model`` (text in, text out: evaluation of API models); the roles' own engines
    (``--role-engine-url``). ``api_key`` is the engines' key (the chat API's key with ``chat_api``); ``lora_path`` the
    loaded adapter every request of the run's engines names (:attr:`~agentrl.config.RunConfig.policy_lora_path`)."""
    engines: list[Engine]
    if chat_api:
        engines = [ChatCompletionsEngine(u, template, model=model, api_key=api_key) for u in urls]
    else:
        engines = [
            SGLangEngine(u, api_key=api_key, return_routed_experts=routed_experts, lora_path=lora_path) for u in urls
        ]
    policies = sorted(set(config.role_policies().values()))
    if policies and chat_api:
        raise ValueError("--role-policy names adapters of token-exact engines (lora_path), not a chat API's model")
    policy_engines: dict[str, Engine] = {
        p: Router([SGLangEngine(u, api_key=api_key, return_routed_experts=routed_experts, lora_path=p) for u in urls])
        for p in policies
    }
    return EpisodeContext(
        engine=Router(engines),
        template=template,
        config=config,
        executor=executor,
        role_engines=role_engines(config),
        policy_engines=policy_engines,
    )


def role_engines(config: RolloutConfig) -> dict[str, Engine]:
    """The engines of the roles played by a fixed policy (``--role-engine-url role=url``): one SGLang client each,
    built here only (the episodes' context and the preflight's check use the same)."""
    return {role: SGLangEngine(url) for role, url in config.role_engine_urls().items()}


async def close_context(ctx: EpisodeContext) -> None:
    """Close the context's engine clients (the router's and the roles')."""
    await ctx.engine.close()
    for engine in [*ctx.role_engines.values(), *ctx.policy_engines.values()]:
        await engine.close()


def run_context(cfg: RunConfig, checkpoint: str | Path, urls: Sequence[str], api_key: str | None) -> tuple:
    """What every episode of a training run's process shares: a router over ``urls``, the checkpoint's chat
    template, one thread pool for blocking env calls. Returns ``(ctx, tokenizer, template)``. The driver
    builds one for in-process rollouts and evals; each rollout worker builds its own."""
    tokenizer, _ = load_tokenizer(str(checkpoint))
    template = chat_template(tokenizer, cfg.rollout, vision_source=checkpoint)
    # one pool of threads for blocking env steps for the whole run: hung ones are bounded per run, not per step
    pool = SyncPool.for_rollout(cfg.rollout.rollout_concurrency)
    ctx = episode_context(
        cfg.rollout,
        urls,
        template,
        api_key=api_key,
        routed_experts=cfg.rollout_return_routed_experts,
        executor=pool,
        lora_path=cfg.policy_lora_path,
    )
    return ctx, tokenizer, template


def follow_urls(router: Any, urls: list[str], api_key: str | None) -> None:
    """Point the router at engines that came back on another address (a lost actor rescheduled)."""
    import asyncio

    for i, url in enumerate(urls):
        old = router.engines[i] if i < len(router.engines) else None
        if old is not None and getattr(old, "url", url) != url:
            router.engines[i] = SGLangEngine(
                url, api_key=api_key, return_routed_experts=old.return_routed_experts, lora_path=old.lora_path
            )
            asyncio.get_running_loop().create_task(old.close())


def engine_urls(
    given: Sequence[str],
    checkpoint: Path,
    stack: contextlib.ExitStack,
    *,
    engine_log: str | None = None,
    max_running_requests: int | None = None,
) -> tuple[list[str], str | None]:
    """``(urls, api_key)``: the ``--engine-url`` values with ``$AGENTRL_ENGINE_API_KEY``, or the URL of an
    embedded engine started on ``stack`` for this command, with a fresh key (nothing else on the machine
    can then drive it)."""
    if given:
        return list(given), os.environ.get(API_KEY_ENV) or None
    from agentrl.engines.local.process import local_server

    api_key = secrets.token_urlsafe(24)
    log = Path(engine_log or cache_dir() / "logs" / f"engine-{os.getpid()}.log")
    log.parent.mkdir(parents=True, exist_ok=True)
    print(f"starting the embedded engine for {checkpoint} (log: {log}) ...", file=sys.stderr)
    extra = ["--max-running-requests", str(max_running_requests)] if max_running_requests is not None else []
    return [stack.enter_context(local_server(checkpoint, log_path=log, extra_args=extra, api_key=api_key))], api_key


def command_engine_urls(args: argparse.Namespace, checkpoint: Path, stack: contextlib.ExitStack) -> list[str]:
    """A command's engines (``--engine-url``, else an embedded one started on ``stack`` with ``--engine-log``
    and ``--engine-max-running-requests``); sets ``args.engine_api_key`` for :func:`command_context`."""
    urls, args.engine_api_key = engine_urls(
        args.engine_url,
        checkpoint,
        stack,
        engine_log=args.engine_log,
        max_running_requests=args.engine_max_running_requests,
    )
    return urls


async def command_context(
    args: argparse.Namespace, cfg: RolloutConfig, urls: list[str], tokenizer: Any, template_src: str | None
) -> tuple[EpisodeContext, list[Callable[[], Awaitable[None]]]]:
    """The context of a command's episodes (``rollout``, ``eval``, ``proxy``): token-exact, or chat
    completions with ``--engine-api chat``; waits for the engines, binds slime's engine attributes on
    ``args``. Returns the context and what to close when the command ends."""
    template = chat_template(tokenizer, cfg, template_src, vision_source=getattr(tokenizer, "name_or_path", None))
    if args.engine_api == "chat":
        # the engine this command started wants its own key; a given URL, the user's API key
        key = os.environ.get(args.api_key_env) if args.engine_url else getattr(args, "engine_api_key", None)
        ctx = episode_context(cfg, urls, template, api_key=key, chat_api=True, model=args.model)
    else:
        ctx = episode_context(cfg, urls, template, api_key=getattr(args, "engine_api_key", None))
        await wait_healthy(ctx.engine, timeout=60)
    bind_engine_args(args, ctx.engine, tokenizer, template, urls)
    return ctx, [lambda: close_context(ctx), close_default_pool]
