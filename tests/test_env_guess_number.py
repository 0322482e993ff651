"""GuessNumber: a plain Env with tools (the SDK's dispatch on tool turns, the env's own rules on moves),
and tool dispatch in any Env: errors the model reads, the episode going on, a sandbox kept and released."""

from __future__ import annotations

import json
import statistics

import pytest

import agentrl
from agentrl.envs.guess_number import MAX_GUESSES, GuessNumber, random_policy, solver_policy
from agentrl.rollout.scripted import play
from agentrl.sandbox import SandboxPool, create_sandbox
from agentrl.tools import python
from agentrl.types import Action, ToolCall
from tests.conftest import cli_rollout, sandbox_config


def _call(name: str, **arguments) -> Action:
    return Action(text="", tool_calls=[ToolCall(name, arguments, id="c0")])


async def _game(secret: int = 700, high: int = 1000) -> GuessNumber:
    env = GuessNumber()
    await env.reset(options={"prompt": "go", "label": str(secret), "high": high})
    return env


async def test_tool_turns_are_dispatched_and_the_game_goes_on():
    env = await _game()
    obs, reward, terminated, truncated, info = await env.step(_call("calculator", expression="(1 + 1000) // 2"))
    assert obs == [{"role": "tool", "name": "calculator", "tool_call_id": "c0", "content": "500"}]
    assert (reward, terminated, truncated, env.guesses) == (0.0, False, False, 0)  # a tool turn costs no guess
    for action, text in (
        (_call("calculator", expression="import os"), "Error: invalid expression"),
        (_call("no_such_tool", a=1), "Error: unknown tool 'no_such_tool'"),
        (_call("calculator"), "Error: calculator"),  # a missing argument
    ):
        obs, reward, terminated, _, _ = await env.step(action)
        assert obs[0]["content"].startswith(text) and not terminated, obs  # an error the model reads; no end
    _, calls, errors = agentrl.parsing.get_parser("hermes").parse("<tool_call>{broken</tool_call>")
    obs, _, terminated, _, info = await env.step(Action(text="", tool_calls=calls, errors=errors))
    assert obs[0]["role"] == "tool" and obs[0]["content"].startswith("Error") and not terminated
    assert info == {"tool_calls": 0, "tool_errors": 1}


async def test_moves_get_feedback_and_the_solve_is_scored_by_guesses():
    env = await _game(secret=700)
    obs, reward, terminated, _, info = await env.step(Action(text="<guess>500</guess>"))
    assert obs[0]["content"] == f"Guess 1 of {MAX_GUESSES}: 500 is too low. 9 left." and not terminated
    obs, *_ = await env.step(Action(text="I think <guess>800</guess>"))
    assert "800 is too high" in obs[0]["content"]
    obs, reward, terminated, _, info = await env.step(Action(text="no idea"))  # no guess read: still costs one
    assert "no guess read" in obs[0]["content"] and info == {"guess": None, "valid": False, "guesses_used": 3}
    obs, reward, terminated, _, info = await env.step(Action(text="<guess>700</guess>"))
    assert terminated and obs == [] and reward == pytest.approx(1.0 - 0.05 * 3) and info["secret"] == 700


async def test_running_out_of_guesses_ends_the_game_with_nothing():
    env = await _game(secret=3, high=10)
    for k in range(MAX_GUESSES):
        obs, reward, terminated, truncated, info = await env.step(Action(text="<guess>9</guess>"))
        assert reward == 0.0 and terminated == (k == MAX_GUESSES - 1) and not truncated
    assert info["secret"] == 3


@pytest.mark.parametrize(
    ("row", "message"),
    [
        ({"label": "0"}, "'label' must be the secret"),
        ({"label": "abc"}, "'label' must be the secret"),
        ({"label": "5", "high": 4}, "'label' must be the secret"),
        ({"label": "5", "high": "10"}, "'high' must be a whole number"),
        ({"label": "5", "high": True}, "'high' must be a whole number"),
    ],
)
async def test_bad_task_rows_get_a_clear_error(row, message):
    with pytest.raises(ValueError, match=message):
        await GuessNumber().reset(options={"prompt": "x", **row})


async def test_check_env_finds_no_violations():
    report = await agentrl.check_env(GuessNumber, GuessNumber.tasks(3))
    assert report.ok, report.format()


async def test_the_bisecting_solver_needs_the_tool_and_wins_and_random_guessing_does_not():
    tasks = GuessNumber.tasks(32)
    solved = await play(GuessNumber, solver_policy, tasks, max_turns=GuessNumber.max_turns)
    assert not [r.error for r in solved if r.error]
    assert all(r.reward >= 0.55 for r in solved)  # found within 10 guesses, every one
    assert all(any(m["role"] == "tool" for m in r.messages) for r in solved)  # through the SDK's dispatch
    rand = await play(GuessNumber, random_policy(), tasks, max_turns=GuessNumber.max_turns)
    assert statistics.mean(r.reward for r in rand) < 0.1 < statistics.mean(r.reward for r in solved)


class Notebook(agentrl.Env):
    """A plain Env (no __init__, a close that forgets super()) whose python tool keeps state across turns."""

    tools = [python]

    async def reset(self, *, seed=None, options=None):
        return [{"role": "user", "content": "compute"}], {}

    async def step(self, action):
        if action.tool_calls or action.errors:
            return await self.call_tools(action), 0.0, False, False, {}
        return [], float(action.text.strip() == "42"), True, False, {}

    async def close(self):
        pass


async def test_a_plain_env_runs_sandboxed_tools_and_the_episode_returns_the_sandbox():
    config = sandbox_config("process", timeout=5.0, max_output_bytes=4096)
    pool = SandboxPool(lambda: create_sandbox(config), config)
    Notebook.sandbox_pool = pool
    turns = iter(
        [
            '<tool_call>{"name": "python", "arguments": {"code": "n = 21"}}</tool_call>',
            '<tool_call>{"name": "python", "arguments": {"code": "n * 2"}}</tool_call>',
            "42",
        ]
    )
    try:
        (result,) = await play(Notebook, lambda messages, task: next(turns), [{"prompt": "x"}])
        assert result.error is None and result.reward == 1.0
        assert [m["content"] for m in result.messages if m["role"] == "tool"] == ["[no output]", "42"]
        assert pool.stats["created"] == 1 and len(pool._idle) == 1  # released though close() skipped super()
    finally:
        Notebook.sandbox_pool = None
        await pool.close()


@pytest.mark.e2e
def test_rollout_end_to_end_with_the_tiny_model(tiny_ckpt, tmp_path):
    r, samples = cli_rollout("agentrl/GuessNumber-v0", tiny_ckpt, tmp_path, num_tasks=2, max_turns=4, turn_len=24)
    assert json.loads(r.stdout)["samples"] == len(samples) == 4
    for row in samples:
        s = agentrl.Sample.from_dict(row)
        s.validate()
        assert s.status in (agentrl.Status.COMPLETED, agentrl.Status.TRUNCATED), s.metadata
