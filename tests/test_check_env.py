"""check_env catches contract violations and passes well-behaved envs."""

from __future__ import annotations

import time

import agentrl
from agentrl.check import check_env
from agentrl.envs.calculator import Calculator


async def test_bundled_calculator_env_passes():
    report = await check_env(Calculator, Calculator.tasks(2))
    assert report.ok, report.format()
    names = [r.scenario for r in report.results]
    assert any("wrong argument types for calculator" in n for n in names)
    assert any("broken JSON" in n for n in names) and any("huge text" in n for n in names)


class WrongShape(agentrl.Env):
    async def reset(self, *, seed=None, options=None):
        return [{"role": "user", "content": "hi"}], {}

    async def step(self, action):
        return "not a list", 1, True  # wrong arity and types


class RaisesOnGarbage(agentrl.ToolEnv):
    async def step(self, action):
        if not action.text.strip():
            raise ValueError("empty!")
        return [], 0.0, True, False, {}


class Blocking(agentrl.ToolEnv):
    async def step(self, action):
        time.sleep(0.4)  # blocks the event loop
        return [], 0.0, True, False, {}


class SyncSleeper(agentrl.ToolEnv):
    def step(self, action):  # synchronous: runs in a thread, so sleeping is fine
        time.sleep(0.3)
        return [], 0.0, True, False, {}


class IgnoresToolCalls(agentrl.ToolEnv):
    tools = Calculator.tools

    async def step(self, action):
        return [{"role": "user", "content": "whatever"}], 0.0, False, False, {}


async def test_violations_are_reported():
    r = await check_env(WrongShape, [])
    assert not r.ok and all("step() must return" in v.detail for v in r.violations)
    r = await check_env(RaisesOnGarbage, [])
    assert [v.scenario for v in r.violations] == ["task 0: empty text"]
    assert "raised ValueError: empty!" in r.violations[0].detail
    r = await check_env(Blocking, [])
    assert not r.ok and "blocked the event loop" in r.violations[0].detail
    r = await check_env(IgnoresToolCalls, [])
    assert any("answered no tool message" in v.detail for v in r.violations)


class ExitsOnReset(agentrl.ToolEnv):
    async def reset(self, *, seed=None, options=None):
        raise SystemExit(3)


class ExitsInSyncStep(agentrl.ToolEnv):
    def step(self, action):  # in a worker thread
        raise SystemExit("bye")


async def test_an_env_that_raises_system_exit_is_a_violation_not_the_end_of_check_env():
    r = await check_env(ExitsOnReset, [])
    assert not r.ok and "raised SystemExit: 3" in r.violations[0].detail
    r = await check_env(ExitsInSyncStep, [])
    assert not r.ok and all("raised SystemExit: bye" in v.detail for v in r.violations)


class StallsOnce(agentrl.ToolEnv):
    stalled = False

    async def step(self, action):
        if not StallsOnce.stalled:  # one stall in the whole check, as a busy machine causes
            StallsOnce.stalled = True
            time.sleep(0.4)
        return [], 0.0, True, False, {}


async def test_a_stall_that_does_not_recur_is_not_a_violation():
    r = await check_env(StallsOnce, [])
    assert r.ok, r.format()
    assert sum("did not recur" in x.detail for x in r.results) == 1


async def test_sync_env_that_sleeps_does_not_count_as_blocking():
    assert (await check_env(SyncSleeper, [])).ok


class Llama3Calculator(Calculator):
    tool_parser = "llama3_json"


class UnknownParser(agentrl.ToolEnv):
    tool_parser = "no_such_format"


async def test_non_hermes_envs_get_their_tools_exercised_and_bad_factories_are_reported():
    r = await check_env(Llama3Calculator, Calculator.tasks(1))
    assert r.ok, r.format()
    valid = next(x for x in r.results if x.scenario.endswith("valid call of calculator"))
    assert (
        valid.detail.startswith("2 step(s)") or "still running" in valid.detail
    )  # the call was answered, not taken as a final answer
    r = await check_env(UnknownParser, [])
    assert not r.ok and "tool_parser 'no_such_format'" in r.violations[0].detail

    calls = {"n": 0}

    def flaky_factory():
        calls["n"] += 1
        if calls["n"] > 1:
            raise RuntimeError("out of sandboxes")
        return Calculator()

    r = await check_env(flaky_factory, Calculator.tasks(1))
    assert not r.ok and all("out of sandboxes" in v.detail for v in r.violations)


class BrokenToolSchema(agentrl.ToolEnv):
    class _T(agentrl.Tool):
        name, description, parameters = "t", "a tool with a broken schema", "not a schema"

        async def __call__(self, **arguments):
            return "x"

    tools = [_T()]


async def test_broken_tool_schema_is_reported_not_raised():
    r = await check_env(BrokenToolSchema, [])
    assert not r.ok and r.violations[0].scenario == "build scenarios from the env's tools"
