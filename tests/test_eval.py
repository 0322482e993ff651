"""pass@k and evaluate() against the real embedded engine."""

from __future__ import annotations

import math

import pytest

import agentrl
from agentrl.chat import ChatTemplate
from agentrl.config import RolloutConfig
from agentrl.engines.http import SGLangEngine
from agentrl.rollout.episode import EpisodeContext
from agentrl.rollout.eval import evaluate, format_eval, ks_for, pass_at_k
from agentrl.types import Status


def test_pass_at_k_hand_computed():
    assert pass_at_k(4, 1, 1) == pytest.approx(0.25)
    assert pass_at_k(4, 1, 4) == 1.0
    assert pass_at_k(4, 0, 1) == 0.0 and pass_at_k(4, 0, 4) == 0.0
    assert pass_at_k(5, 2, 2) == pytest.approx(1 - 3 / 10)  # 1 - C(3,2)/C(5,2)
    assert pass_at_k(10, 10, 3) == 1.0
    assert pass_at_k(200, 13, 100) == pytest.approx(1 - math.comb(187, 100) / math.comb(200, 100))
    with pytest.raises(ValueError):
        pass_at_k(4, 5, 1)
    assert ks_for(1) == [1] and ks_for(4) == [1, 2, 4] and ks_for(6) == [1, 2, 4, 6]


class ParityEnv(agentrl.Env):
    """One turn; reward 1 when the reply has an even number of characters (a coin the model flips)."""

    async def reset(self, *, seed=None, options=None):
        return [{"role": "user", "content": str(options["prompt"])}], {}

    async def step(self, action):
        return [], float(len(action.text) % 2 == 0), True, False, {}


async def test_evaluate_end_to_end(tiny_server, tiny_tokenizer):
    config = RolloutConfig(rollout_max_turn_len=200, max_turns=2, rollout_temperature=1.0)
    ctx = EpisodeContext(engine=SGLangEngine(tiny_server), template=ChatTemplate(tiny_tokenizer), config=config)
    datasets = {"even": [{"prompt": f"Question {i}"} for i in range(3)], "odd": [{"prompt": "Hi"}]}
    seen: dict[str, list] = {"even": [], "odd": []}
    try:
        results = await evaluate(ctx, ParityEnv, datasets, n_samples=4, on_sample=lambda name, s: seen[name].append(s))
    finally:
        await ctx.engine.close()
    assert ctx.config.n_samples_per_prompt == 1  # the caller's config is not changed
    r = results["even"]
    assert r["num_prompts"] == 3 and r["num_samples"] == 12 and len(seen["even"]) == 12
    assert r["count_completed"] == 12 and r["count_failed"] == r["count_aborted"] == r["count_not_token_exact"] == 0
    assert all(s.status == Status.COMPLETED for s in seen["even"])
    wins = sum(s.reward == 1.0 for s in seen["even"])
    assert r["pass@1"] == pytest.approx(wins / 12) and r["reward_mean"] == pytest.approx(wins / 12)
    assert r["pass@4"] >= r["pass@2"] >= r["pass@1"] and set(r) >= {"pass@1", "pass@2", "pass@4", "seconds"}
    assert results["odd"]["num_samples"] == 4 and results["odd"]["num_prompts"] == 1
    table = format_eval(results)
    assert table.splitlines()[0].split()[:5] == ["dataset", "prompts", "samples", "reward", "pass@1"]
    assert len(table.splitlines()) == 3
    # a threshold above every reward: nothing passes
    high = await evaluate(
        EpisodeContext(engine=SGLangEngine(tiny_server), template=ctx.template, config=config),
        ParityEnv,
        {"odd": datasets["odd"]},
        n_samples=2,
        success_threshold=2.0,
    )
    assert high["odd"]["pass@1"] == high["odd"]["pass@2"] == 0.0


async def test_evaluate_through_chat_completions(tiny_server, tiny_tokenizer):
    from agentrl.engines.http import ChatCompletionsEngine

    config = RolloutConfig(rollout_max_turn_len=200, max_turns=2)
    template = ChatTemplate(tiny_tokenizer)
    ctx = EpisodeContext(engine=ChatCompletionsEngine(tiny_server, template), template=template, config=config)
    try:
        results = await evaluate(ctx, ParityEnv, {"d": [{"prompt": "Hi"}, {"prompt": "Yo"}]}, n_samples=2)
    finally:
        await ctx.engine.close()
    r = results["d"]
    assert r["num_samples"] == 4 and r["count_not_token_exact"] == 4 and r["count_completed"] == 4
    assert 0.0 <= r["pass@1"] <= r["pass@2"] <= 1.0
