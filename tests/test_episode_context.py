"""One builder for the episode context (issue 39, item 3): every process that plays episodes (the rollout,
eval and proxy commands, the train driver, rollout workers, SFT's rejection sampling) gets its router,
chat template and role engines from :mod:`agentrl.rollout.context`, so a setting reaches every shape."""

from __future__ import annotations

import asyncio

from agentrl.config import RolloutConfig, RunConfig
from agentrl.engines.http import ChatCompletionsEngine, SGLangEngine
from agentrl.engines.router import Router
from agentrl.rollout.context import chat_template, close_context, episode_context, follow_urls, run_context


def test_one_builder_gives_router_roles_keys_and_routed_experts(tiny_tokenizer):
    cfg = RolloutConfig(role_engine_url=["o=http://127.0.0.1:9"])
    template = chat_template(tiny_tokenizer, cfg)
    urls = ["http://127.0.0.1:7", "http://127.0.0.1:8/"]
    ctx = episode_context(cfg, urls, template, api_key="k", routed_experts=True)
    assert isinstance(ctx.engine, Router) and ctx.config is cfg and ctx.template is template
    engines = ctx.engine.engines
    assert [type(e) for e in engines] == [SGLangEngine, SGLangEngine]
    assert [e.url for e in engines] == ["http://127.0.0.1:7", "http://127.0.0.1:8"]
    assert all(e.api_key == "k" and e.return_routed_experts for e in engines)
    assert list(ctx.role_engines) == ["o"] and ctx.role_engines["o"].url == "http://127.0.0.1:9"
    asyncio.run(close_context(ctx))


def test_chat_api_context_speaks_chat_completions(tiny_tokenizer):
    cfg = RolloutConfig()
    ctx = episode_context(cfg, ["http://127.0.0.1:7"], chat_template(tiny_tokenizer, cfg), api_key="k", chat_api=True)
    (engine,) = ctx.engine.engines
    assert isinstance(engine, ChatCompletionsEngine) and engine.base_url == "http://127.0.0.1:7/v1"
    assert ctx.role_engines == {}
    asyncio.run(close_context(ctx))


def test_run_context_is_the_same_builder_for_driver_and_workers(tiny_ckpt):
    cfg = RunConfig(rollout_return_routed_experts=True)
    cfg.rollout.role_engine_url = ["x=http://127.0.0.1:11"]
    ctx, tokenizer, template = run_context(cfg, tiny_ckpt, ["http://127.0.0.1:10"], "key")
    assert template.tokenizer is tokenizer and ctx.executor is not None
    (engine,) = ctx.engine.engines
    assert engine.return_routed_experts and engine.api_key == "key"
    assert list(ctx.role_engines) == ["x"]
    asyncio.run(close_context(ctx))
    ctx.executor.shutdown(wait=False)


def test_follow_urls_replaces_only_moved_engines_and_keeps_their_settings(tiny_tokenizer):
    cfg = RolloutConfig()
    ctx = episode_context(
        cfg, ["http://127.0.0.1:7", "http://127.0.0.1:8"], chat_template(tiny_tokenizer, cfg), routed_experts=True
    )
    first, second = ctx.engine.engines

    async def move() -> None:
        follow_urls(ctx.engine, ["http://127.0.0.1:7", "http://127.0.0.1:18"], "new-key")
        await asyncio.sleep(0)  # the old client's close runs on the loop

    asyncio.run(move())
    kept, moved = ctx.engine.engines
    assert kept is first and moved is not second
    assert moved.url == "http://127.0.0.1:18" and moved.api_key == "new-key" and moved.return_routed_experts
    asyncio.run(close_context(ctx))
