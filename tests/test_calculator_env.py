"""The calculator env's reward: exact answers score 1; the shaped variant's credit stays below it."""

from __future__ import annotations

import pytest

import agentrl
from agentrl.envs.calculator import Calculator, ShapedCalculator, random_policy, solver_policy
from agentrl.rollout.scripted import play


async def _final_reward(text: str, *, call: bool = False, env_cls=ShapedCalculator) -> float:
    env = env_cls()
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
    assert await _final_reward("The answer is 42.", env_cls=Calculator) == 1.0


async def test_plain_calculator_scores_only_the_exact_answer():
    assert await _final_reward("41", env_cls=Calculator) == 0.0
    assert await _final_reward("It is 41.", call=True, env_cls=Calculator) == 0.0
    assert await _final_reward("6 * 7 = 42", call=True, env_cls=Calculator) == 1.0


async def test_scripted_solver_earns_the_reward_and_random_guessing_does_not():
    tasks = Calculator.tasks(40, seed=5)
    solved = await play(Calculator, solver_policy, tasks)
    assert all(r.error is None for r in solved)
    assert all(r.turns == 2 for r in solved)  # one calculator call, then the answer
    assert sum(r.reward for r in solved) / len(solved) >= 0.95
    guessed = await play(Calculator, random_policy(0), tasks)
    assert sum(r.reward for r in guessed) / len(guessed) <= 0.05


async def test_shaping_credit_for_concise_answers_and_tool_use():
    assert await _final_reward("41") == pytest.approx(0.3)  # a bare number: full brevity credit
    assert await _final_reward("It is 41.") == pytest.approx(0.3 * (1 - 2 / 60))
    assert await _final_reward("It is 41.", call=True) == pytest.approx(0.3 * (1 - 2 / 60) + 0.2)
    assert await _final_reward(" ".join(["word"] * 80) + " 41") == 0.0  # past BREVITY_WORDS
    assert await _final_reward("I do not know.") == 0.0  # no number, no credit
    assert await _final_reward("I do not know.", call=True) == pytest.approx(0.2)
