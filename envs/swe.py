"""Fix a reported bug in a small Python repository, scored by hidden tests (SWE-bench style).

Each task is one mini-repository bundled under ``envs/data/swe/<name>/``:

- ``issue.md``: the bug report, as a user would write it (the task's prompt);
- ``repo/``: the repository, copied into ``/scratch`` of the episode's sandbox at ``reset``, with a
  visible ``unittest`` suite that has at least one failing test (``python3 -m unittest -v``);
- ``hidden_tests.json``: the tests that decide the reward; they never enter the episode's sandbox;
- ``fix/``: the reference fix (fixed copies of the source files), for :func:`fix_policy`.

The model inspects and edits the repository with the ``bash``, ``read_file`` and ``write_file`` tools
and answers without a tool call when it is done (the :class:`agentrl.ToolEnv` convention).

Reward (once, on that answer): 1.0 when every hidden test passes, else 0.0, SWE-bench's "resolved".
Why all-or-nothing: the hidden tests check the reported behaviour *and* behaviour that already
worked (so a fix may not break the rest), and the unfixed repository passes most of the latter, so a
fraction would pay a model for doing nothing. ``info`` records ``passed``, ``total``, the names of
the ``failed`` tests, the source files that could not be carried over (``dropped``) and ``error``.

Why the reward cannot be gamed from inside the sandbox:

- Only the repository's *source files* are carried over: its ``.py`` files outside ``tests/`` that
  are not ``test_*.py`` or ``conftest.py``, read back from the sandbox. One time-limited run lists
  which of them are regular files within ``max_source_bytes``; only those are read, so a deleted
  file, a directory, a planted symlink, a FIFO (whose read would block) or a file too large is
  dropped, i.e. missing. Edited tests, a new ``conftest.py`` or ``sitecustomize.py``, other new
  files and anything outside ``/scratch`` are not used.
- The sandbox is then reset (every process the model started is killed, ``/scratch`` and ``/tmp``
  are wiped) and gets a fresh copy of the pristine repository with those source files on top, plus
  a harness. The harness runs each hidden test's code (with ``python3 -I -B``) and prints its value
  as JSON after a fresh random marker on a private copy of stdout (the repository's fds 0-2 point at
  ``/dev/null``). The *expected* values stay on the host, which compares them
  (:func:`agentrl.envs.python_code.same_value`): code that prints fake result lines, exits early or
  patches the harness can only lose tests, since it would have to produce the right values, which is
  fixing the bug. No exit code or test-runner summary is trusted.

The hidden tests and the reference fix must be out of the sandbox's reach. The ``process`` backend
lets code read the host's files, so the env refuses it. Bubblewrap binds the host's ``/usr``
read-only, so an agentrl installed under ``/usr`` (``/usr/local/lib/python3.X/site-packages``, a
system-wide pip install) ships ``envs/data/swe`` into the sandbox: at its first reset on each kind
of sandbox the env checks from inside that no ``hidden_tests.json`` of ``data_dir`` is readable,
and refuses the sample (:class:`~agentrl.sandbox.SandboxError` naming the fix: the docker backend,
or agentrl installed outside ``/usr``, e.g. in a virtual environment) when one is. Each scored test
gets ``case_timeout`` seconds, the whole run at most ``max_total_timeout``.

Task rows: ``prompt`` (the issue), ``repo`` (the folder's name, kept in each sample's metadata) and
``label`` (the repo name too). Point ``data_dir`` at your own folder of repositories in the same
layout to train on them.
"""

from __future__ import annotations

import functools
import json
import logging
import re
import secrets
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import agentrl
from agentrl.envs.python_code import parse_results, same_value
from agentrl.sandbox import Sandbox, SandboxError
from agentrl.tools.bash import BashTool
from agentrl.tools.files import read_file, write_file

DATA = Path(__file__).resolve().parent / "data" / "swe"
HARNESS_NAME = "_hidden_tests_harness.py"
log = logging.getLogger(__name__)
_HIDDEN_CHECKED: set[tuple[str, str]] = set()  # (sandbox isolation, data_dir) found not to see the hidden tests
_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*")

HARNESS = r"""
import ast, json, os, signal, sys

class CaseTimeout(BaseException):
    pass

def on_alarm(signum, frame):
    raise CaseTimeout()

def describe(e):
    return (type(e).__name__ + ": " + str(e))[:300]

def run_case(setup, code):
    namespace = {"__name__": "hidden_test"}
    exec(compile(setup, "setup", "exec"), namespace)
    tree = ast.parse(code, "hidden_test", "exec")
    last = tree.body.pop() if tree.body and isinstance(tree.body[-1], ast.Expr) else None
    exec(compile(tree, "hidden_test", "exec"), namespace)
    return None if last is None else eval(compile(ast.Expression(last.value), "hidden_test", "eval"), namespace)

def main():
    request = json.loads(sys.stdin.read())
    marker, limit, dumps = request["marker"], request["timeout"], json.dumps
    sys.path.append(os.getcwd())  # after the standard library: the repository cannot shadow it
    out = os.fdopen(os.dup(1), "w")  # results go here; the repository's fds 0-2 go to /dev/null
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(null, fd)

    def emit(obj):
        out.write(marker + dumps(obj) + "\n")
        out.flush()

    signal.signal(signal.SIGALRM, on_alarm)
    for i, code in enumerate(request["cases"]):
        try:
            signal.setitimer(signal.ITIMER_REAL, limit)
            value = run_case(request["setup"], code)
            signal.setitimer(signal.ITIMER_REAL, 0)
            text = dumps(value, allow_nan=False)
            emit({"i": i, "value": text} if len(text) <= 4000 else {"i": i, "fail": "result too large"})
        except CaseTimeout:
            emit({"i": i, "fail": "timeout"})
        except BaseException as e:
            signal.setitimer(signal.ITIMER_REAL, 0)
            emit({"i": i, "fail": describe(e)})

main()
"""
"""Runs in the sandbox as ``python3 -I -B _hidden_tests_harness.py``; reads ``{marker, setup, cases,
timeout}`` on stdin and prints one marked JSON line per case: its last expression's value, or why
it failed (``"ValueError: ..."`` for an exception)."""


@dataclass(frozen=True)
class Repo:
    """One bundled task, as read from its folder (treat the dicts as read-only: they are cached)."""

    name: str
    issue: str
    files: dict[str, bytes]
    """The pristine repository: path relative to its root -> content."""
    sources: tuple[str, ...]
    """The files carried over from the model's copy when scoring."""
    setup: str
    """Python run before every hidden test (imports)."""
    cases: tuple[dict[str, Any], ...]
    """Hidden tests: ``name``, ``code`` (its last expression is the result) and ``expected`` (a JSON
    value) or ``raises`` (an exception's class name)."""
    fixed: dict[str, str]
    """The reference fix: source path -> fixed content."""


def is_source(path: str) -> bool:
    """Whether ``path`` (relative, POSIX) is a source file: ``.py`` outside ``tests/``, not a test or conftest."""
    parts = path.split("/")
    name = parts[-1]
    return (
        name.endswith(".py")
        and "tests" not in parts[:-1]
        and not name.startswith("test_")
        and name not in ("conftest.py", "sitecustomize.py", "usercustomize.py")
    )


def repo_names(data_dir: Path = DATA) -> list[str]:
    """The task folders of ``data_dir`` (those with an ``issue.md``), sorted."""
    return sorted(p.parent.name for p in Path(data_dir).glob("*/issue.md"))


def _tree(root: Path) -> dict[str, bytes]:
    return {
        p.relative_to(root).as_posix(): p.read_bytes()
        for p in sorted(root.rglob("*"))
        if p.is_file() and "__pycache__" not in p.parts and p.suffix != ".pyc"
    }


def _check_cases(where: Path, spec: Any) -> tuple[str, tuple[dict[str, Any], ...]]:
    if not isinstance(spec, dict) or not isinstance(spec.get("setup"), str):
        raise ValueError(f"{where}: expected an object with a 'setup' string and a 'cases' list")
    cases = spec.get("cases")
    if not isinstance(cases, list) or not cases:
        raise ValueError(f"{where}: 'cases' must be a non-empty list")
    for i, c in enumerate(cases):
        ok = isinstance(c, dict) and isinstance(c.get("name"), str) and isinstance(c.get("code"), str)
        if not ok or ("expected" in c) == ("raises" in c):
            raise ValueError(f"{where}: cases[{i}] needs 'name', 'code' and exactly one of 'expected' or 'raises'")
    return spec["setup"], tuple(cases)


@functools.lru_cache(maxsize=64)
def _load(data_dir: str, name: str) -> Repo:
    root = Path(data_dir) / name
    files = _tree(root / "repo")
    fixed = {path: data.decode() for path, data in _tree(root / "fix").items()}
    sources = tuple(p for p in files if is_source(p))
    strays = sorted(set(fixed) - set(sources))
    if not files or not sources or strays:
        raise ValueError(f"{root}: repo/ must hold source files and fix/ only fixed copies of them (not {strays})")
    where = root / "hidden_tests.json"
    setup, cases = _check_cases(where, json.loads(where.read_text(encoding="utf-8")))
    issue = (root / "issue.md").read_text(encoding="utf-8").strip()
    return Repo(name, issue, files, sources, setup, cases, fixed)


def load_repo(task: dict[str, Any], data_dir: Path = DATA) -> Repo:
    """The repository a task row names in ``repo`` (``ValueError`` naming the field when it is bad)."""
    name = task.get("repo")
    known = repo_names(data_dir)
    if not isinstance(name, str) or not _NAME.fullmatch(name) or name not in known:
        raise ValueError(f"swe task rows need 'repo', one of the folders of {data_dir}: {known}; got {name!r}")
    return _load(str(data_dir), name)


def case_passed(result: tuple[str, Any] | None, case: dict[str, Any]) -> bool:
    """Whether one hidden test passed: the right JSON value, or the named exception."""
    if result is None:
        return False
    kind, value = result
    if "raises" in case:
        return kind == "fail" and str(value).split(":", 1)[0] == case["raises"]
    return kind == "ok" and same_value(value, case["expected"])


LIST_REGULAR = r"""
import json, os, stat, sys
request = json.loads(sys.stdin.read())
regular = []
for path in request["paths"]:
    try:
        st = os.lstat(path)
    except OSError:
        continue
    if stat.S_ISREG(st.st_mode) and st.st_size <= request["max_bytes"]:
        regular.append(path)
print(json.dumps(regular))
"""
"""Run as ``python3 -I -S -c``: of ``{paths, max_bytes}`` on stdin, prints the regular files (no
symlink, FIFO, device or directory) within the size limit, as a JSON list."""


async def read_sources(
    sandbox: Sandbox, paths: tuple[str, ...], max_bytes: int, timeout: float = 30.0
) -> tuple[dict[str, bytes], list[str]]:
    """The model's version of each source file, and the paths that could not be carried over.

    One time-limited run lists the regular files first: reading a FIFO the model left in a source's
    place would block past the step's time limit and drop the sample instead of scoring it. No
    process of the model's survives its own run, so nothing swaps a file between listing and reading.
    A listing that fails (a timeout on a loaded machine) raises :class:`SandboxError`: the sample fails
    rather than being scored 0 with every source missing.
    """
    request = json.dumps({"paths": list(paths), "max_bytes": max_bytes})
    listed = await sandbox.run(["python3", "-I", "-S", "-c", LIST_REGULAR], stdin=request, timeout=timeout)
    try:  # the model cannot make this run fail (it lstat's given paths); a failure is the machine's
        if not listed.ok:
            raise ValueError(f"exit code {listed.exit_code}, timed out: {listed.timed_out}")
        regular = set(json.loads(listed.stdout.strip().splitlines()[-1]))
    except (ValueError, IndexError) as exc:  # scoring every source as missing would record a false 0
        raise SandboxError(f"swe: listing the model's source files failed ({exc}); the sample is not scored") from None
    edited: dict[str, bytes] = {}
    dropped: list[str] = []
    for path in paths:
        try:
            if path not in regular:
                raise FileNotFoundError(path)
            data = await sandbox.read_file(path, max_bytes=max_bytes + 1)
        except (OSError, ValueError):  # deleted, a directory, a planted symlink, a fifo
            dropped.append(path)
            continue
        if len(data) > max_bytes:
            dropped.append(path)
        else:
            edited[path] = data
    return edited, dropped


async def check_hidden_tests_hidden(sandbox: Sandbox, data_dir: Path) -> None:
    """Refuse (:class:`SandboxError`) a sandbox that can read ``data_dir``'s hidden tests (once per kind)."""
    if sandbox.isolation.startswith("process"):
        raise SandboxError(
            f"swe: the {sandbox.isolation!r} sandbox lets the repository's code read the host's files, "
            "including the hidden tests; use --sandbox docker or local (bubblewrap)"
        )
    key = (sandbox.isolation, str(Path(data_dir).resolve()))
    if key in _HIDDEN_CHECKED:
        return
    hidden = [str(p) for p in sorted(Path(key[1]).glob("*/hidden_tests.json"))]
    probe = 'for f in "$@"; do if test -r "$f"; then echo "$f"; fi; done'
    result = await sandbox.run(["sh", "-c", probe, "sh", *hidden], timeout=30.0)
    if not result.ok:
        raise SandboxError(
            f"swe: could not check that the hidden tests are out of the sandbox's reach: {result.text()}"
        )
    if result.stdout.strip():
        raise SandboxError(
            f"swe: the {sandbox.isolation!r} sandbox can read the hidden tests ({result.stdout.split()[0]}): "
            f"data_dir {key[1]} is under a host path it binds (bubblewrap binds /usr, e.g. a system-wide "
            "install in /usr/local/lib/python3.X/site-packages); use --sandbox docker, or install agentrl "
            "outside /usr (a virtual environment), or put data_dir elsewhere"
        )
    _HIDDEN_CHECKED.add(key)


bash = BashTool(shell=("env", "PYTHONDONTWRITEBYTECODE=1", "bash", "-c"))
"""The bash tool, without ``.pyc`` files: a same-size edit in the same second as the last test run
would otherwise run the stale bytecode, and the model would see its fix "not work"."""


class SWE(agentrl.ToolEnv):
    """Fix the bug an issue reports in a bundled repository (see the module docstring)."""

    tools = [bash, read_file, write_file]
    max_turns = 20
    case_timeout = 3.0
    """Seconds one hidden test may take."""
    max_total_timeout = 40.0
    """Wall limit of the whole hidden test run (unfinished tests fail)."""
    max_source_bytes = 1 << 20
    """A source file larger than this is not carried over (it counts as deleted)."""
    data_dir: Path = DATA
    system_prompt = (
        "You are a software engineer fixing the bug an issue reports. The repository is in /scratch, your "
        "working directory. Use the bash, read_file and write_file tools to read the code, reproduce the bug, "
        "edit the source files and run the tests (`python3 -m unittest -v`). When the bug is fixed, reply "
        "without a tool call with a short summary of your fix. Hidden tests then check the repository's "
        "source files; changes to the tests and new files are not used."
    )

    def __init__(self) -> None:
        super().__init__()
        self.repo: Repo | None = None

    @classmethod
    def tasks(cls, n: int | None = None) -> list[dict[str, Any]]:
        """One row per repository of ``data_dir``: ``prompt`` (the issue), ``repo`` and ``label``."""
        rows = []
        for name in repo_names(cls.data_dir):
            repo = _load(str(cls.data_dir), name)
            rows.append({"prompt": repo.issue, "repo": name, "label": name})
        return rows[:n] if n is not None else rows

    async def reset(self, *, seed: int | None = None, options: dict | None = None):
        messages, _ = await super().reset(seed=seed, options=options)
        self.repo = load_repo(self.task, self.data_dir)
        async with self._sandbox_lock:
            held = getattr(self, "_sandbox", None)
            sandbox = await self.sandbox()
            if held is not None:  # reset again on the same env: the last episode's files go
                await sandbox.reset()
            await check_hidden_tests_hidden(sandbox, self.data_dir)
            await sandbox.write_files(self.repo.files)
        return messages, {"repo": self.repo.name}

    async def step(self, action: agentrl.Action):
        if action.tool_calls or action.errors:
            return await super().step(action)
        info = await self.score()
        return [], 1.0 if info["resolved"] else 0.0, True, False, info

    async def score(self) -> dict[str, Any]:
        """Run the hidden tests on the model's source files (see the module docstring); the info dict."""
        repo = self.repo
        if repo is None:
            raise RuntimeError("SWE.score() before reset()")
        marker = f"@@result-{secrets.token_hex(16)}@@"
        cases = [c["code"] for c in repo.cases]
        request = {"marker": marker, "setup": repo.setup, "cases": cases, "timeout": self.case_timeout}
        limit = min(self.max_total_timeout, self.case_timeout * (len(repo.cases) + 1) + 5.0)
        async with self._sandbox_lock:
            sandbox = await self.sandbox()
            edited, dropped = await read_sources(sandbox, repo.sources, self.max_source_bytes)
            await sandbox.reset()  # nothing the model left (processes, files, /tmp) survives
            files: dict[str, str | bytes] = {p: d for p, d in repo.files.items() if p not in dropped}
            files.update(edited)
            files[HARNESS_NAME] = HARNESS
            result = await sandbox.run(
                ["python3", "-I", "-B", HARNESS_NAME], stdin=json.dumps(request), timeout=limit, files=files
            )
        results, error = parse_results(result.stdout, marker, len(repo.cases))
        failed = [c["name"] for r, c in zip(results, repo.cases) if not case_passed(r, c)]
        passed = len(repo.cases) - len(failed)
        if error is None and result.timed_out and failed:
            error = "the hidden tests timed out"
        return {
            "resolved": not failed,
            "passed": passed,
            "total": len(repo.cases),
            "failed": failed,
            "dropped": dropped,
            "error": error,
        }


def _call(name: str, arguments: dict[str, Any]) -> str:
    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"


def fix_policy(data_dir: Path = DATA) -> Callable[[list[agentrl.Message], dict[str, Any]], str]:
    """A scripted solver for :func:`agentrl.rollout.scripted.play` that applies each task's reference fix.

    It plays the way an agent would: runs the tests, writes the fixed source files (``write_file``),
    runs the tests again, then answers. It earns 1.0 on every bundled task; use it to check a new
    repository's fix and hidden tests, or to make SFT demonstrations.
    """

    def policy(messages: list[agentrl.Message], task: dict[str, Any]) -> str:
        repo = load_repo(task, data_dir)
        turn = sum(1 for m in messages if m["role"] == "assistant")
        if turn == 0:
            return "Let me run the tests first.\n" + _call("bash", {"command": "python3 -m unittest 2>&1 | tail -n 20"})
        if turn == 1:
            writes = [_call("write_file", {"path": p, "content": c}) for p, c in repo.fixed.items()]
            return "I found the bug; here is the fix.\n" + "\n".join(writes)
        if turn == 2:
            return _call("bash", {"command": "python3 -m unittest 2>&1 | tail -n 3"})
        return f"Fixed the bug reported in the issue ({', '.join(repo.fixed)}); the tests pass."

    return policy


solver = fix_policy()
"""The scripted solver for the bundled tasks."""
