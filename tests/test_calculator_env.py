"""The calculator env's reward: exact answers score 1, shaping credit stays below it."""

from __future__ import annotations

import pytest

import agentrl
from envs.calculator import Calculator


async def _final_reward(text: str, *, call: bool = False) -> float:
    env = Calculator()
    await env.reset(seed=0, options={"prompt": "What is 6 times 7?", "label": "42"})
    if call:
        action = agentrl.Action(text="", tool_calls=[agentrl.ToolCall("calculator", {"expression": "6*7"}, "call_0")])
        obs, reward, done, _, _ = await env.step(action)
        assert obs[0]["content"] == "42" and reward == 0.0 and not done
    _, reward, done, _, _ = await env.step(agentrl.Action(text=text))
    assert done
    return reward


async def test_exact_answer_scores_one():
    assert await _final_reward("The answer is 42.") == 1.0


async def test_shaping_credit_for_concise_answers_and_tool_use():
    assert await _final_reward("41") == pytest.approx(0.3)  # a bare number: full brevity credit
    assert await _final_reward("It is 41.") == pytest.approx(0.3 * (1 - 2 / 60))
    assert await _final_reward("It is 41.", call=True) == pytest.approx(0.3 * (1 - 2 / 60) + 0.2)
    assert await _final_reward(" ".join(["word"] * 80) + " 41") == 0.0  # past BREVITY_WORDS
    assert await _final_reward("I do not know.") == 0.0  # no number, no credit
    assert await _final_reward("I do not know.", call=True) == pytest.approx(0.2)
