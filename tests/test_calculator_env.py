"""The calculator env's reward: exact answers score 1, shaping credit stays below it."""

from __future__ import annotations

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
    assert await _final_reward("It is 41.") == 0.2
    assert await _final_reward("It is 41.", call=True) == 0.4
    rambling = "Let us think about this very carefully step by step because numbers like 41 are tricky to get"
    assert await _final_reward(rambling) == 0.0
    assert await _final_reward("I do not know.") == 0.0
