"""Write a Python function that passes hidden unit tests, run in a sandbox (HumanEval/MBPP style).

Each task (``envs/data/python_code.jsonl``, 48 of them) gives a signature, a description and one
example. The model may try code with the ``python`` tool (a stateful interpreter in the episode's
sandbox), then answers, without a tool call, with its solution in a ```` ```python ```` block.

Reward (once, on the final answer): the fraction of the task's hidden tests the function passes.
A test passes when the function returns, within ``test_timeout`` seconds, a JSON value equal to the
expected one (floats within 1e-6 relative). A crash, a timeout, a non-JSON result or an answer
without a code block counts as a failure. ``info`` records ``passed``, ``total`` and ``error`` (why
nothing could be tested, e.g. no code block or a ``SyntaxError``).

Why the reward cannot be gamed by the code it scores: the expected outputs never enter the
sandbox. The episode's sandbox is reset (the model's files and interpreter are gone), then a small
harness runs the submission there on the test *inputs* only and prints each result as JSON after
a fresh random marker, writing to a private copy of stdout while the submission's own fds 0-2 point
at ``/dev/null``. The host parses the marked lines and compares them with the expected values. Code
that prints fake result lines, patches the harness or exits early can only lose tests: it would
have to produce the right outputs, which is solving the task. This needs a sandbox that hides the
host's files (docker, bubblewrap): the ``process`` fallback lets code read the task file itself,
and the env warns once when it runs there.

Task rows: ``prompt``, ``entry_point`` (the function's name), ``tests`` (``[{"args": [...],
"expected": ...}]``) and ``label`` (the reference solution as a submission, which scores 1.0).
"""

from __future__ import annotations

import json
import logging
import math
import re
import secrets
from pathlib import Path
from typing import Any

import agentrl
from agentrl.data import load_tasks
from agentrl.tools.python import python

DATA = Path(__file__).resolve().parent / "data" / "python_code.jsonl"
log = logging.getLogger(__name__)
_warned_weak = False

_CODE_BLOCK = re.compile(r"```[ \t]*(?:python3?|py)?[ \t]*\n(.*?)```", re.DOTALL | re.IGNORECASE)

HARNESS = r"""
import json, os, signal, sys

class TestTimeout(BaseException):
    pass

def on_alarm(signum, frame):
    raise TestTimeout()

def describe(e):
    return (type(e).__name__ + ": " + str(e))[:300]

def main():
    request = json.loads(sys.stdin.read())
    marker, limit = request["marker"], request["timeout"]
    out = os.fdopen(os.dup(1), "w")  # results go here; the submission's fds 0-2 go to /dev/null
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(null, fd)

    def emit(obj):
        out.write(marker + json.dumps(obj) + "\n")
        out.flush()

    signal.signal(signal.SIGALRM, on_alarm)
    namespace = {"__name__": "solution"}
    try:
        signal.setitimer(signal.ITIMER_REAL, limit)
        with open("solution.py", encoding="utf-8") as f:
            exec(compile(f.read(), "solution.py", "exec"), namespace)
        signal.setitimer(signal.ITIMER_REAL, 0)
    except TestTimeout:
        return emit({"error": "loading the solution timed out"})
    except BaseException as e:
        signal.setitimer(signal.ITIMER_REAL, 0)
        return emit({"error": "loading the solution raised " + describe(e)})
    fn = namespace.get(request["entry_point"])
    if not callable(fn):
        return emit({"error": "the solution defines no function " + request["entry_point"]})
    for i, args in enumerate(request["inputs"]):
        try:
            signal.setitimer(signal.ITIMER_REAL, limit)
            value = fn(*json.loads(args))
            signal.setitimer(signal.ITIMER_REAL, 0)
            text = json.dumps(value, allow_nan=False)
            emit({"i": i, "value": text} if len(text) <= 1500 else {"i": i, "fail": "result too large"})
        except TestTimeout:
            emit({"i": i, "fail": "timeout"})
        except BaseException as e:
            signal.setitimer(signal.ITIMER_REAL, 0)
            emit({"i": i, "fail": describe(e)})

main()
"""
"""Runs in the sandbox as ``python3 -I harness.py``; reads ``{marker, entry_point, inputs, timeout}``
on stdin (each input a JSON array of arguments) and prints one marked JSON line per test."""


def extract_code(text: str, entry_point: str) -> str | None:
    """The last fenced code block that defines ``entry_point`` (else the last block; None if none)."""
    blocks = _CODE_BLOCK.findall(text)
    defining = [b for b in blocks if re.search(rf"\bdef\s+{re.escape(entry_point)}\s*\(", b)]
    return (defining or blocks or [None])[-1]


def same_value(got: Any, expected: Any) -> bool:
    """JSON equality where booleans are not numbers and floats compare within 1e-6 relative."""
    if isinstance(expected, bool) or isinstance(got, bool):
        return type(got) is type(expected) and got == expected
    if isinstance(expected, (int, float)) and isinstance(got, (int, float)):
        if isinstance(expected, int) and isinstance(got, int):
            return got == expected
        return math.isclose(got, expected, rel_tol=1e-6, abs_tol=1e-9)
    if isinstance(expected, list) and isinstance(got, list):
        return len(got) == len(expected) and all(same_value(g, e) for g, e in zip(got, expected))
    if isinstance(expected, dict) and isinstance(got, dict):
        return got.keys() == expected.keys() and all(same_value(got[k], expected[k]) for k in expected)
    return type(got) is type(expected) and got == expected


def parse_results(stdout: str, marker: str, n: int) -> tuple[list[Any], str | None]:
    """Per test, the first marked result (``("ok", value)`` or ``("fail", why)``; None if missing),
    and the harness's load error if it reported one. Unmarked lines are ignored."""
    results: list[Any] = [None] * n
    error = None
    for line in stdout.splitlines():
        if not line.startswith(marker):
            continue
        try:
            msg = json.loads(line[len(marker) :])
            if not isinstance(msg, dict):
                continue
            if "error" in msg:
                error = error or str(msg["error"])
                continue
            i = msg["i"]
            if isinstance(i, int) and 0 <= i < n and results[i] is None:
                results[i] = ("ok", json.loads(msg["value"])) if "value" in msg else ("fail", str(msg.get("fail")))
        except (ValueError, KeyError, TypeError):
            continue
    return results, error


def _warn_if_weak(isolation: str) -> None:
    global _warned_weak
    if isolation.startswith("process") and not _warned_weak:
        _warned_weak = True
        log.warning(
            "python_code: the %r sandbox lets a submission read the host's files, including the hidden "
            "tests in the task file; train with --sandbox docker or local (bubblewrap)",
            isolation,
        )


class PythonCode(agentrl.ToolEnv):
    """Write the function a task describes; scored by hidden tests in a sandbox (see the module docstring)."""

    tools = [python]
    max_turns = 6
    test_timeout = 3.0
    """Seconds one hidden test (and loading the submission) may take."""
    max_total_timeout = 30.0
    """Wall limit of the whole test run (the sandbox kills it after that; unfinished tests fail)."""
    system_prompt = (
        "You write Python functions. You may run code with the python tool to try your ideas. When you are "
        "done, reply without a tool call, with the complete function (and any imports it needs) in one "
        "```python code block. It is then checked by hidden unit tests; the score is the fraction it passes."
    )

    @staticmethod
    def tasks(n: int | None = None) -> list[dict]:
        """The shipped tasks (``envs/data/python_code.jsonl``)."""
        rows = load_tasks(DATA)
        return rows[:n] if n is not None else rows

    async def step(self, action: agentrl.Action):
        if action.tool_calls or action.errors:
            return await super().step(action)
        passed, total, error = await self.run_tests(action.text)
        reward = passed / total if total else 0.0
        return [], reward, True, False, {"passed": passed, "total": total, "error": error}

    async def run_tests(self, text: str) -> tuple[int, int, str | None]:
        """``(passed, total, error)`` for the submission in ``text`` against the task's hidden tests."""
        tests = self.task.get("tests") or []
        entry_point = str(self.task.get("entry_point") or "")
        if not tests or not entry_point:
            raise ValueError("python_code task rows need 'entry_point' and a non-empty 'tests' list")
        code = extract_code(text, entry_point)
        if code is None:
            return 0, len(tests), "no ```python code block in the answer"
        sandbox = await self.sandbox()
        _warn_if_weak(sandbox.isolation)
        await sandbox.reset()  # nothing the model left in the sandbox (files, interpreters) survives
        marker = f"@@result-{secrets.token_hex(16)}@@"
        request = {
            "marker": marker,
            "entry_point": entry_point,
            "timeout": self.test_timeout,
            "inputs": [json.dumps(t["args"]) for t in tests],
        }
        limit = min(self.max_total_timeout, self.test_timeout * (len(tests) + 1) + 5.0)
        result = await sandbox.run(
            ["python3", "-I", "harness.py"],
            stdin=json.dumps(request),
            timeout=limit,
            files={"harness.py": HARNESS, "solution.py": code},
        )
        results, error = parse_results(result.stdout, marker, len(tests))
        passed = sum(
            1 for r, t in zip(results, tests) if r is not None and r[0] == "ok" and same_value(r[1], t["expected"])
        )
        if error is None and result.timed_out and passed < len(tests):
            error = "the test run timed out"
        return passed, len(tests), error
