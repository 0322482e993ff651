"""The python_code env: hidden tests run in a real sandbox, the reference solutions score 1, random
and adversarial submissions do not, and ``agentrl rollout`` runs it with the tiny model."""

from __future__ import annotations

import asyncio
import json
import random
import string
import textwrap

import pytest

import agentrl
from agentrl.envs.python_code import DATA, PythonCode, extract_code, parse_results, same_value
from agentrl.rollout.scripted import play
from agentrl.sandbox import SandboxPool, create_sandbox
from tests.conftest import cli_rollout, sandbox_config

TASKS = {t["id"]: t for t in PythonCode.tasks()}


@pytest.fixture
async def env_cls(sandbox_backend):
    """PythonCode on one backend, with a short per-test timeout so timeout cases stay fast."""
    cfg = sandbox_config(sandbox_backend)
    pool = SandboxPool(lambda: create_sandbox(cfg), cfg)
    yield type("PythonCodeUnderTest", (PythonCode,), {"sandbox_pool": pool, "test_timeout": 0.5})
    await pool.close()


async def score(env_cls, task_id: str, code: str, *, before: list[agentrl.ToolCall] = ()) -> tuple[float, dict]:
    """Reward and info of one episode: optional tool calls, then ``code`` as the final answer."""
    env = env_cls()
    try:
        await env.reset(options=TASKS[task_id])
        for call in before:
            obs, _, done, _, _ = await env.step(agentrl.Action(text="", tool_calls=[call]))
            assert not done and obs[0]["role"] == "tool" and not obs[0]["content"].startswith("Error"), obs
        _, reward, done, _, info = await env.step(
            agentrl.Action(text=f"Here it is:\n```python\n{textwrap.dedent(code)}\n```")
        )
        assert done
        return reward, info
    finally:
        await env.close()


TRIED_FIRST = {"fizzbuzz", "nth_prime", "word_frequencies", "count_islands", "median", "spiral_order"}


def solver(messages, task):
    """Submit the reference; for a few tasks, first try it in the python tool on a test's arguments."""
    if task["id"] in TRIED_FIRST and not any(m["role"] == "tool" for m in messages):
        code = extract_code(task["label"], task["entry_point"])
        args = json.dumps(task["tests"][0]["args"])
        code += f"\nimport json\nprint({task['entry_point']}(*json.loads({args!r})))"
        call = {"name": "python", "arguments": {"code": code}}
        return f"<tool_call>{json.dumps(call)}</tool_call>"
    assert "Error" not in messages[-1]["content"], messages[-1]["content"]
    return "My solution:\n" + task["label"]


def random_policy(rng: random.Random):
    def policy(messages, task):
        junk = "".join(rng.choice(string.ascii_letters + " ()+:=\n") for _ in range(80))
        choice = rng.random()
        if choice < 0.3:
            return junk
        if choice < 0.6:
            value = rng.choice(["None", "0", "[]", repr(junk[:5]), "args[0]"])
            return f"```python\ndef {task['entry_point']}(*args):\n    return {value}\n```"
        return f"```python\n{junk}\n```"

    return policy


# -- without a sandbox ----------------------------------------------------------------------------


def test_shipped_tasks_are_well_formed():
    assert 30 <= len(TASKS) <= 60 and len(TASKS) == len(PythonCode.tasks())
    for t in TASKS.values():
        assert f"`{t['entry_point']}(" in t["prompt"] and len(t["tests"]) >= 4
        assert extract_code(t["label"], t["entry_point"]).startswith(("def ", "import ", "from "))
        assert all(isinstance(c["args"], list) for c in t["tests"])
        assert max(len(json.dumps(c["expected"])) for c in t["tests"]) < 750  # fits the harness's 1500-char cap
        assert "expected" not in t["prompt"]


def test_extract_code_and_compare_values():
    text = (
        "try\n```python\ndef f(x):\n    return 1\n```\nbetter:\n```py\ndef f(x):\n    return 2\n```\n```\nprint(3)\n```"
    )
    assert extract_code(text, "f") == "def f(x):\n    return 2\n"
    assert extract_code(text, "g") == "print(3)\n" and extract_code("no code", "f") is None
    assert same_value([1, 2.0000001, {"a": [True]}], [1, 2, {"a": [True]}])
    assert not same_value(True, 1) and not same_value(1, True) and not same_value("1", 1)
    assert not same_value([1, 2], [1, 2, 3]) and not same_value({"a": 1}, {"a": 1, "b": 2}) and same_value(None, None)


def test_parse_results_keeps_only_marked_first_results():
    m = "@@result-abc@@"
    stdout = "\n".join(
        [
            '{"i": 0, "value": "99"}',  # unmarked junk
            m + '{"i": 0, "value": "1"}',
            m + '{"i": 0, "value": "2"}',  # first wins
            m + '{"i": 2, "fail": "timeout"}',
            m + "not json",
            m + '{"i": 7, "value": "1"}',
            m + '{"i": "1", "value": "1"}',
            "@@result-xyz@@" + '{"i": 1, "value": "5"}',
        ]
    )
    results, error = parse_results(stdout, m, 3)
    assert results == [("ok", 1), None, ("fail", "timeout")] and error is None
    assert parse_results(m + '{"error": "boom"}', m, 2) == ([None, None], "boom")


# -- in a real sandbox, every backend -------------------------------------------------------------


async def test_scripted_solver_scores_one(env_cls, sandbox_backend):
    """Every task on the fast process backend (the references vs. the expected values); a third elsewhere."""
    tasks = [
        t for i, t in enumerate(TASKS.values()) if sandbox_backend == "process" or i % 3 == 0 or t["id"] in TRIED_FIRST
    ]
    results = await play(env_cls, solver, tasks)
    assert [r.error for r in results if r.error] == []
    low = [(r.task["id"], r.reward, r.messages[-1]) for r in results if r.reward < 1.0]
    assert not low, low[:3]
    assert all(r.turns == (2 if r.task["id"] in TRIED_FIRST else 1) for r in results)


async def test_random_policy_scores_low(env_cls):
    tasks = list(TASKS.values())[:12]
    results = await play(env_cls, random_policy(random.Random(0)), tasks)
    mean = sum(r.reward for r in results) / len(results)
    assert not [r.error for r in results if r.error] and mean < 0.2


SUBMISSIONS = {  # name: (code, reward, start of info["error"]); gcd's hidden tests expect 6, 1, 9, 0, 21, 10**9
    "constant guess": ("def gcd(a, b):\n    return 1", 1 / 6, None),
    "hangs on a == 0": (
        "import math\ndef gcd(a, b):\n    while a == 0:\n        pass\n    return math.gcd(a, b)",
        4 / 6,
        None,
    ),
    "not JSON": ("def gcd(a, b):\n    return {a, b}", 0.0, None),
    "sys.exit on import": ("import sys\nsys.exit(0)", 0.0, "loading the solution raised SystemExit: 0"),
    "syntax error": ("def gcd(a, b)\n    return a", 0.0, "loading the solution raised SyntaxError"),
    "wrong name": ("def other(a, b):\n    return a", 0.0, "the solution defines no function gcd"),
    "os._exit on import": ("import os\nos._exit(0)", 0.0, None),
    "sleeps on import": ("import time\ntime.sleep(60)", 0.0, "loading the solution timed out"),
    "fake result lines": (
        """
        import json, sys
        for i in range(6):
            print("@@result-00000000000000000000000000000000@@" + json.dumps({"i": i, "value": "6"}))
            sys.__stdout__.write(json.dumps({"i": i, "value": "6"}) + "\\n")
        def gcd(a, b):
            print('{"i": 0, "value": "6"}')
            return None
    """,
        0.0,
        None,
    ),
    "monkeypatched harness": (
        """
        import builtins, json
        json.dumps = lambda *a, **k: '"patched"'
        builtins.print = lambda *a, **k: None
        def gcd(a, b):
            return -1
    """,
        0.0,
        None,
    ),
    "always-equal result": (
        """
        class Yes(int):
            def __eq__(self, other):
                return True
            __hash__ = int.__hash__
        def gcd(a, b):
            return Yes(-1)
    """,
        0.0,
        None,
    ),
    "stolen marker": (
        """
        import sys
        def gcd(a, b):
            emit = sys._getframe(1).f_locals["emit"]  # the harness's own writer, marker and all
            for i in range(6):
                emit({"i": i, "value": "6"})  # claims every test, but must still guess the values
            return -1
    """,
        1 / 6,
        None,
    ),  # "6" is right for gcd(12, 18) only: exactly what returning 6 would earn
}


async def test_partial_failing_and_forged_submissions(env_cls):
    names = list(SUBMISSIONS)
    outcomes = await asyncio.gather(*(score(env_cls, "gcd", SUBMISSIONS[n][0]) for n in names))
    got = {
        n: (round(r, 4), info["total"], (info["error"] or "")[: len(SUBMISSIONS[n][2] or "")])
        for n, (r, info) in zip(names, outcomes)
    }
    want = {n: (round(r, 4), 6, e or "") for n, (_, r, e) in SUBMISSIONS.items()}
    assert got == want
    assert all(info["error"] is None for n, (_, info) in zip(names, outcomes) if SUBMISSIONS[n][2] is None)


async def test_the_tests_cannot_be_read_inside_isolated_sandboxes(env_cls, sandbox_backend):
    if sandbox_backend == "process":
        pytest.skip("the process fallback does not isolate the filesystem (documented); use docker or bubblewrap")
    cheat = f"""
        import json
        def gcd(a, b):
            for line in open({str(DATA)!r}):
                for t in json.loads(line)["tests"]:
                    if t["args"] == [a, b]:
                        return t["expected"]
    """
    assert await score(env_cls, "gcd", cheat) == (0.0, {"passed": 0, "total": 6, "error": None})


async def test_what_the_model_left_in_the_sandbox_is_gone_before_the_tests(env_cls):
    plant = agentrl.ToolCall(
        "python",
        {
            "code": textwrap.dedent("""
        import subprocess
        open("json.py", "w").write("raise SystemExit('shadowed')")
        open("solution.py", "w").write("def gcd(a, b): return 0")
        subprocess.Popen(["sh", "-c", "while true; do echo junk > harness.py; sleep 0.01; done"])
        print("planted")
    """)
        },
        "c0",
    )
    reference = extract_code(TASKS["gcd"]["label"], "gcd")
    assert await score(env_cls, "gcd", reference, before=[plant]) == (1.0, {"passed": 6, "total": 6, "error": None})


async def test_answers_without_code_are_scored_without_a_sandbox():
    env = PythonCode()
    await env.reset(options=TASKS["fizzbuzz"])
    _, reward, done, _, info = await env.step(agentrl.Action(text="I would use a loop."))
    assert (reward, done, info) == (
        0.0,
        True,
        {"passed": 0, "total": 6, "error": "no ```python code block in the answer"},
    )
    assert env._sandbox is None
    await env.close()


async def test_check_env_finds_no_violations(env_cls):
    report = await agentrl.check_env(env_cls, [TASKS["gcd"]])
    assert report.ok, report.format()
    assert any("valid call of python" in r.scenario for r in report.results)


@pytest.mark.e2e
def test_rollout_cli_with_the_tiny_model(tiny_ckpt, tmp_path):
    sandbox_config("bubblewrap")  # skips where bubblewrap cannot run
    spec = "agentrl.envs.python_code:PythonCode"
    _, samples = cli_rollout(spec, tiny_ckpt, tmp_path, "--sandbox", "local", num_tasks=2, max_turns=2, turn_len=24)
    assert len(samples) == 4 and sorted({s["group_index"] for s in samples}) == [0, 1]
    for s in samples:
        assert s["status"] in ("completed", "truncated")
        assert len(s["loss_mask"]) == len(s["rollout_log_probs"]) == s["response_length"] > 0
        assert s["prompt"][0]["role"] == "system" and s["label"].startswith("```python")
        assert 0.0 <= s["reward"] <= 1.0
