"""Env/ToolEnv behaviour and how environments are found (module, file path, registered id)."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import agentrl
from agentrl.parsing import get_parser
from agentrl.user_code import load_function

REPO = Path(__file__).resolve().parent.parent

# The example's tool, used as a user would write it.
add = load_function(str(Path(__file__).resolve().parent.parent / "examples/arithmetic/env.py") + ":add")


@agentrl.tool(timeout=0.05)
async def slow(x: int) -> str:
    """Sleep too long.

    Args:
        x: ignored
    """
    await asyncio.sleep(2)
    return "late"


class Arithmetic(agentrl.ToolEnv):
    tools = [add, slow]
    max_turns = 4

    async def reward(self, action: agentrl.Action) -> float:
        return float(self.task["label"] in action.text)


def _action(text: str) -> agentrl.Action:
    content, calls, errors = get_parser("hermes").parse(text)
    return agentrl.Action(text=text, tool_calls=calls, errors=errors)


def _call(name: str, args) -> str:
    import json

    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': args})}\n</tool_call>"


async def test_tool_env_runs_calls_and_scores_the_final_answer():
    env = Arithmetic()
    obs, info = await env.reset(seed=1, options={"prompt": "1+2?", "label": "3", "extra": 7})
    assert obs == [{"role": "user", "content": "1+2?"}] and env.task["extra"] == 7
    obs, r, term, trunc, info = await env.step(_action(_call("add", {"a": 1, "b": 2})))
    assert [m["content"] for m in obs] == ["3.0"] and obs[0]["role"] == "tool" and obs[0]["tool_call_id"] == "call_0"
    assert (r, term, trunc) == (0.0, False, False)
    obs, r, term, trunc, _ = await env.step(_action("The answer is 3"))
    assert (obs, r, term) == ([], 1.0, True)


@pytest.mark.parametrize(
    "text,expected",
    [
        ('<tool_call>\n{"name": "add", "arguments": {"a": 1,</tool_call>', "Error: could not parse tool call"),
        (_call("nope", {}), "Error: unknown tool 'nope'. Available tools: add, slow."),
        (_call("add", {"a": "one", "b": 2}), "Error: add: argument 'a' must be a number"),
        (_call("add", {"a": 1}), "Error: add: missing required argument 'b'"),
        (_call("slow", {"x": 1}), "Error: tool 'slow' timed out after 0.05s"),
    ],
)
async def test_bad_tool_calls_become_error_messages_the_model_sees(text, expected):
    env = Arithmetic()
    await env.reset(options={"prompt": "q", "label": "3"})
    obs, r, term, trunc, _ = await env.step(_action(text))
    assert not term and len(obs) == 1 and obs[0]["role"] == "tool"
    assert obs[0]["content"].startswith(expected), obs[0]["content"]
    assert obs[0]["tool_call_id"]


async def test_several_calls_run_concurrently_and_answer_in_order():
    env = Arithmetic()
    await env.reset(options={"prompt": "q", "label": "x"})
    text = _call("add", {"a": 1, "b": 1}) + _call("slow", {"x": 0}) + _call("add", {"a": 2, "b": 2})
    obs, *_ = await env.step(_action(text))
    assert [m["content"][:5] for m in obs] == ["2.0", "Error", "4.0"]
    assert [m["tool_call_id"] for m in obs] == ["call_0", "call_1", "call_2"]


def test_load_env_by_module_file_and_registered_id(tmp_path, monkeypatch):
    from agentrl.envs.calculator import Calculator

    assert agentrl.load_env("agentrl.envs.calculator:Calculator") is Calculator
    assert agentrl.load_env("agentrl/Calculator-v0") is Calculator
    f = tmp_path / "my_env.py"
    f.write_text(
        textwrap.dedent("""
        import agentrl
        class Mine(agentrl.Env):
            async def reset(self, *, seed=None, options=None):
                return [{"role": "user", "content": "hi"}], {}
        agentrl.register("test/Mine-v0", Mine)
    """)
    )
    cls = agentrl.load_env(f"{f}:Mine")
    assert cls.__name__ == "Mine"
    monkeypatch.chdir(tmp_path)
    assert agentrl.load_env("my_env:Mine").__name__ == "Mine"
    assert agentrl.load_env("my_env:test/Mine-v0").__name__ == "Mine"
    assert isinstance(agentrl.make("test/Mine-v0"), agentrl.Env)
    with pytest.raises(ValueError, match="registered env id"):
        agentrl.load_env("no/Such-v0")
    with pytest.raises(AttributeError, match="no attribute 'Nope'"):
        agentrl.load_env("agentrl.envs.calculator:Nope")
    with pytest.raises(FileNotFoundError):
        agentrl.load_env(f"{tmp_path}/missing.py:X")


def _printed(code: str, cwd: Path) -> list[str]:
    """What ``python -c code`` prints in ``cwd`` (a folder outside the repository), word by word."""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=cwd, timeout=120)
    assert r.returncode == 0, r.stderr
    return r.stdout.split()


def test_bundled_envs_live_in_the_agentrl_namespace_and_the_old_spec_is_an_alias(tmp_path):
    """``envs.NAME:Class`` resolves to the same class as ``agentrl.envs.NAME:Class`` (run from a
    folder that is not the repository: no top-level ``envs`` package exists there), while a user's
    own package named ``envs`` wins over the alias."""
    code = (
        "import importlib.util, agentrl\n"
        "from agentrl.envs.calculator import Calculator\n"
        "from agentrl.tools import calculator\n"
        "print(importlib.util.find_spec('envs') is None, importlib.util.find_spec('tools') is None)\n"
        "print(agentrl.load_env('envs.calculator:Calculator') is Calculator)\n"
        "print(agentrl.load_env('envs.calculator:agentrl/Calculator-v0') is Calculator)\n"
        "print(agentrl.load_env('agentrl/Calculator-v0') is Calculator, Calculator.tools[0].name)\n"
    )
    assert _printed(code, tmp_path) == ["True", "True", "True", "True", "True", "calculator"]
    own = tmp_path / "envs"
    own.mkdir()
    (own / "__init__.py").write_text("")
    (own / "calculator.py").write_text(
        "import agentrl\nclass Calculator(agentrl.Env):\n    async def reset(self, *, seed=None, options=None):\n"
        "        return [{'role': 'user', 'content': 'mine'}], {}\n"
    )
    code = (
        "import agentrl\n"
        "print(agentrl.load_env('envs.calculator:Calculator').__module__)\n"
        "print(agentrl.load_env('envs.gsm8k:GSM8K').__module__)\n"  # not in the user's package: the bundled one
    )
    assert _printed(code, tmp_path) == ["envs.calculator", "agentrl.envs.gsm8k"]
    # a plain folder named envs (a namespace package, no __init__.py, e.g. a data folder) hides nothing
    (own / "__init__.py").unlink()
    (own / "calculator.py").rename(own / "mine.py")
    code = (
        "import agentrl\n"
        "print(agentrl.load_env('envs.calculator:Calculator').__module__)\n"
        "print(agentrl.load_env('envs:agentrl/Calculator-v0').__module__)\n"
        "print(agentrl.load_env('envs.mine:Calculator').__module__)\n"
    )
    assert _printed(code, tmp_path) == ["agentrl.envs.calculator"] * 2 + ["envs.mine"]


def test_installed_packages_register_ids_through_the_agentrl_envs_entry_points(tmp_path):
    """A package's ids resolve without importing it first: an ``agentrl.envs`` entry point in its
    installed metadata (a real ``.dist-info`` on the path, read by importlib.metadata) names the module
    that registers them; a broken entry point is logged and skipped, never hiding the others."""
    (tmp_path / "fakeenvs.py").write_text(
        textwrap.dedent("""
        import time
        import agentrl
        class Echo(agentrl.Env):
            async def reset(self, *, seed=None, options=None):
                return [{"role": "user", "content": "hi"}], {}
        time.sleep(0.3)  # a slow import: lookups from other threads must wait for it, not miss the id
        agentrl.register("fake/Echo-v0", "fakeenvs:Echo")
        agentrl.register("agentrl/Countdown-v0", "fakeenvs:Echo")  # replaces a bundled id on purpose
    """)
    )
    (tmp_path / "brokenenvs.py").write_text("raise RuntimeError('this package is broken')\n")
    for name, value in (("fakepkg", "fakeenvs"), ("brokenpkg", "brokenenvs")):
        info = tmp_path / f"{name}-0.1.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.1\n")
        (info / "entry_points.txt").write_text(f"[agentrl.envs]\n{name} = {value}\n")
    code = (
        "import logging, threading, agentrl; logging.basicConfig(level=logging.WARNING)\n"
        "found, barrier = [], threading.Barrier(4)\n"
        "def look():\n"
        "    barrier.wait()\n"
        "    found.append(agentrl.load_env('fake/Echo-v0').__name__)\n"
        "threads = [threading.Thread(target=look) for _ in range(4)]\n"
        "[t.start() for t in threads]; [t.join() for t in threads]\n"
        "print(*found)\n"
        "print(agentrl.load_env('agentrl/Calculator-v0').__name__)\n"
        "print(agentrl.load_env('agentrl/Countdown-v0').__name__)\n"
    )
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{REPO}"}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120)
    assert r.returncode == 0, r.stderr
    # four concurrent first lookups all find the id; the bundled ids load first, so the package's
    # deliberate replacement of one of them wins (and is announced)
    assert r.stdout.split() == ["Echo"] * 4 + ["Calculator", "Echo"]
    assert "brokenpkg" in r.stderr and "this package is broken" in r.stderr
    assert "'agentrl/Countdown-v0' re-registered" in r.stderr


async def test_turn_budget_cuts_slow_tool_calls_to_an_error_the_model_reads():
    import asyncio as aio

    @agentrl.tool
    async def slow(seconds: float) -> str:
        """Sleep.

        Args:
            seconds: how long
        """
        await aio.sleep(seconds)
        return "woke up"

    class Budgeted(agentrl.ToolEnv):
        tools = [slow]
        turn_budget = 0.3

    env = Budgeted()
    await env.reset(options={"prompt": "go"})
    calls = [agentrl.ToolCall("slow", {"seconds": 5}, "a"), agentrl.ToolCall("slow", {"seconds": 0.01}, "b")]
    obs, _, done, _, _ = await aio.wait_for(env.step(agentrl.Action(text="", tool_calls=calls)), 3)
    assert not done
    assert "timed out after 0.3s" in obs[0]["content"] and obs[1]["content"] == "woke up"
    from agentrl.tool import call_tool

    spent = await call_tool(slow, {"seconds": 0.01}, timeout=30, max_time=0)
    assert spent.is_error and "time for tool calls is used up" in spent.content
