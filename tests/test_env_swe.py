"""The swe env against a real Docker engine: the reference fixes resolve every task, doing nothing or
random edits resolve none, edited tests, conftest.py, forged output and ``rm -rf`` earn nothing and
break nothing, tool errors are messages, and check-env passes."""

from __future__ import annotations

import asyncio
import json
import random

import pytest

import agentrl
from agentrl.envs.swe import DATA, HARNESS_NAME, SWE, case_passed, fix_policy, is_source, load_repo, solver
from agentrl.parsing import get_parser
from agentrl.rollout.scripted import play
from agentrl.sandbox import SandboxPool, create_sandbox
from tests.conftest import sandbox_config

TASKS = {t["repo"]: t for t in SWE.tasks()}


def call(name: str, **arguments) -> str:
    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"


def script(*turns: str):
    """A policy playing ``turns`` in order, then answering without a tool call."""

    def policy(messages, task):
        n = sum(1 for m in messages if m["role"] == "assistant")
        return turns[n] if n < len(turns) else "Done."

    return policy


def tool_outputs(result) -> list[str]:
    return [m["content"] for m in result.messages if m["role"] == "tool"]


async def make_env_cls(backend: str):
    cfg = sandbox_config(backend)
    pool = SandboxPool(lambda: create_sandbox(cfg), cfg)
    return type("SWEUnderTest", (SWE,), {"sandbox_pool": pool}), pool


@pytest.fixture
async def env_cls(docker_image):
    cls, pool = await make_env_cls("docker")
    yield cls
    await pool.close()


# -- without a sandbox ----------------------------------------------------------------------------


def test_bundled_repos_are_well_formed():
    assert sorted(TASKS) == ["csvlite", "datekit", "numerals", "ringq", "slugger", "spans"]
    assert agentrl.load_env("agentrl/SWE-v0") is SWE
    for name, task in TASKS.items():
        repo = load_repo(task)
        assert task["label"] == name and task["prompt"] == repo.issue and len(repo.issue) > 200
        assert any(p.startswith("tests/test_") for p in repo.files), "a visible test suite"
        assert repo.fixed and set(repo.fixed) <= set(repo.sources)
        assert all(repo.fixed[p].encode() != repo.files[p] for p in repo.fixed)
        assert len(repo.cases) >= 10 and len({c["name"] for c in repo.cases}) == len(repo.cases)
        text = b"".join(repo.files.values()).decode()
        assert not any("hidden" in p for p in repo.files)  # the visible tests reproduce the issue; the rest stays out
        assert not any(c["code"] in text for c in repo.cases if "\n" in c["code"])


def test_only_source_files_are_carried_over():
    assert is_source("pkg/mod.py") and is_source("setup.py") and is_source("pkg/sub/x.py")
    for path in ("tests/test_x.py", "pkg/tests/helpers.py", "test_mod.py", "conftest.py", "pkg/conftest.py"):
        assert not is_source(path), path
    assert not is_source("sitecustomize.py") and not is_source("README.md")


def test_bad_repo_names_are_refused_naming_the_field():
    for bad in (None, 3, "", "../csvlite", "csvlite/repo", "nope"):
        with pytest.raises(ValueError, match="'repo'"):
            load_repo({"prompt": "x", "repo": bad})


def test_your_own_repositories_in_the_same_layout(tmp_path):
    root = tmp_path / "adder"
    for path, text in {
        "issue.md": "add(2, 2) returns 5",
        "repo/calc.py": "def add(a, b):\n    return a + b + 1\n",
        "repo/tests/test_calc.py": "",
        "fix/calc.py": "def add(a, b):\n    return a + b\n",
        "hidden_tests.json": json.dumps(
            {"setup": "from calc import add", "cases": [{"name": "2+2", "code": "add(2, 2)"}]}
        ),
    }.items():
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        (root / path).write_text(text)
    mine = type("MySWE", (SWE,), {"data_dir": tmp_path})
    with pytest.raises(ValueError, match=r"hidden_tests.json: cases\[0\] needs 'name', 'code' and exactly one"):
        mine.tasks()
    (root / "hidden_tests.json").write_text(
        json.dumps({"setup": "", "cases": [{"name": "a", "code": "1", "raises": "E"}]})
    )
    assert mine.tasks() == [{"prompt": "add(2, 2) returns 5", "repo": "adder", "label": "adder"}]
    assert load_repo(mine.tasks()[0], tmp_path).sources == ("calc.py",)
    with pytest.raises(ValueError, match="'repo', one of the folders"):
        load_repo(TASKS["spans"], tmp_path)


async def test_reset_with_a_bad_row_fails_before_taking_a_sandbox():
    env = SWE()
    with pytest.raises(ValueError, match="'repo'"):
        await env.reset(options={"prompt": "fix it", "repo": "../../etc"})
    assert env._sandbox is None


def test_case_passed_compares_values_and_exception_names():
    assert case_passed(("ok", [1, 2]), {"expected": [1, 2]}) and not case_passed(("ok", [1]), {"expected": [1, 2]})
    assert case_passed(("fail", "IndexError: empty"), {"raises": "IndexError"})
    assert not case_passed(("fail", "ValueError: x"), {"raises": "IndexError"})
    assert not case_passed(("ok", None), {"raises": "IndexError"}) and not case_passed(None, {"expected": None})
    assert not case_passed(("fail", "timeout"), {"expected": 1}) and not case_passed(("ok", True), {"expected": 1})


# -- against the Docker engine --------------------------------------------------------------------


@pytest.mark.docker
async def test_scripted_solver_resolves_every_task(env_cls):
    results = await play(env_cls, solver, list(TASKS.values()))
    assert [r.error for r in results if r.error] == []
    for r in results:
        before, _, after = tool_outputs(r)
        assert "FAILED" in before and after.endswith("OK"), (r.task["repo"], before, after)
        assert r.reward == 1.0 and r.turns == 4 and r.terminated


@pytest.mark.docker
async def test_doing_nothing_or_random_edits_resolve_nothing(env_cls):
    rng = random.Random(0)

    def random_policy(messages, task):
        repo = load_repo(task)
        path = rng.choice(repo.sources)
        moves = [
            call("bash", command=rng.choice(["ls -R", "python3 -m unittest", f"cat {path}", "rm -rf tests"])),
            call("read_file", path=rng.choice(list(repo.files))),
            call("write_file", path=path, content=repo.files[path].decode().replace("1", str(rng.randint(2, 9)))),
            call("bash", command=f"sed -i 's/return/return None or/' {path}"),
            "I think it is fixed now.",
        ]
        return rng.choice(moves)

    tasks = list(TASKS.values())
    noop, rand = await asyncio.gather(
        play(env_cls, lambda m, t: "I could not find the bug.", tasks),
        play(env_cls, random_policy, tasks, max_turns=4),
    )
    assert [r.error for r in noop + rand if r.error] == []
    assert [r.reward for r in noop] == [0.0] * len(tasks) and [r.reward for r in rand] == [0.0] * len(tasks)


async def final_info(env_cls, repo: str, *turns: str) -> tuple[float, dict, list[str]]:
    """Play ``turns`` (tool calls, each turn's results checked), then answer; reward, info, tool outputs."""
    env = env_cls()
    outputs: list[str] = []
    try:
        await env.reset(options=TASKS[repo])
        parser = get_parser("hermes")
        for text in turns:
            _, calls, errors = parser.parse(text)
            obs, _, done, _, _ = await env.step(agentrl.Action(text=text, tool_calls=calls, errors=errors))
            assert not done and not errors
            outputs += [m["content"] for m in obs]
        _, reward, done, _, info = await env.step(agentrl.Action(text="All tests pass now."))
        assert done
        return reward, info, outputs
    finally:
        await env.close()


FORGED_SOURCE = """
import json, os, sys
frame = sys._getframe()
while frame is not None and "emit" not in frame.f_locals:
    frame = frame.f_back
for i in range(100):  # the harness's own writer, marker and all: claims a result for every hidden test
    frame.f_locals["emit"]({"i": i, "value": json.dumps([[1, 10]])})
    print("@@result-0@@" + json.dumps({"i": i, "value": "true"}))
os._exit(0)
"""


@pytest.mark.docker
async def test_cheats_earn_nothing(env_cls):
    passing_test = "import unittest\n\n\nclass T(unittest.TestCase):\n    def test_ok(self):\n        pass\n"
    conftest = "import os\nos._exit(0)\n"
    cheats = {
        "edits the visible tests": [
            call("write_file", path="tests/test_intervals.py", content=passing_test)
            + call("write_file", path="conftest.py", content=conftest)
            + call("write_file", path="sitecustomize.py", content=conftest)
            + call("write_file", path="spans/conftest.py", content=conftest),
            call("bash", command="python3 -m unittest 2>&1 | tail -n 1"),
        ],
        "forges result lines": [call("write_file", path="spans/__init__.py", content=FORGED_SOURCE)],
        "plants a symlink and a directory": [
            call(
                "bash",
                command="cd spans && rm intervals.py __init__.py && ln -s /etc/passwd intervals.py && mkdir __init__.py",
            )
        ],
    }
    outcomes = await asyncio.gather(*(final_info(env_cls, "spans", *turns) for turns in cheats.values()))
    got = {name: (reward, info["passed"] < info["total"]) for name, (reward, info, _) in zip(cheats, outcomes)}
    assert got == dict.fromkeys(cheats, (0.0, True))
    edited, forged, symlink = outcomes
    assert edited[2][-1] == "OK"  # the visible suite was made to pass, for nothing
    # a symlink is read in the sandbox (docker: its own /etc/passwd) or refused (bubblewrap): it cannot reach the host
    assert "spans/__init__.py" in symlink[1]["dropped"] and forged[1]["dropped"] == []
    # the forged claims count only where the guessed value is right: the two cases expecting [(1, 10)]
    assert forged[1]["passed"] == 2 and forged[1]["error"] is None


@pytest.mark.docker
async def test_rm_rf_does_not_break_scoring(env_cls):
    repo = load_repo(TASKS["ringq"])
    wipe = call("bash", command="rm -rf /scratch/* /scratch/.[!.]* 2>/dev/null; ls -A /scratch | wc -l")
    sources = {p: repo.fixed.get(p, repo.files[p].decode()) for p in repo.sources}
    rewrite = "".join(call("write_file", path=p, content=c) for p, c in sources.items())
    # a writer running in the background would break the harness, if anything outlived its call
    sabotage = call("bash", command=f"(while true; do echo 'x = (' > {HARNESS_NAME}; done) & sleep 0.2; echo ok")
    (r0, info0, out0), (r1, info1, _), (r2, _, _) = await asyncio.gather(
        final_info(env_cls, "ringq", wipe),
        final_info(env_cls, "ringq", wipe, rewrite),
        final_info(env_cls, "ringq", rewrite, sabotage),
    )
    assert out0 == ["0"] and r0 == 0.0 and info0["passed"] == 0 and info0["error"] is None
    assert info0["dropped"] == list(repo.sources)
    assert (r1, info1["dropped"], r2) == (1.0, [], 1.0)  # only the source files matter


@pytest.mark.docker
async def test_tool_errors_are_messages_the_model_reads(env_cls):
    turns = [
        call("read_file", path="nope.py") + call("write_file", path="../outside.py", content="x"),
        call("bash", command="python3 -c 'import datekit; datekit.validate((2000, 2, 29))'"),
        call("read_file", path="datekit/dates.py") + call("bash", command="pwd && ls"),
        call("bash", command=f"cat {DATA / 'datekit' / 'hidden_tests.json'}"),
    ]
    reward, info, outputs = await final_info(env_cls, "datekit", *turns)
    missing, outside, traceback, source, listing, hidden = outputs
    assert missing.startswith("Error: read_file: no file 'nope.py'") and outside.startswith("Error: write_file:")
    assert "ValueError: day out of range" in traceback and "[exit code 1]" in traceback
    assert "def is_leap_year" in source and listing.split() == ["/scratch", "README.md", "datekit", "tests"]
    assert "No such file or directory" in hidden and hidden.endswith("[exit code 1]")  # the host's files stay out
    assert reward == 0.0 and info["passed"] < info["total"]


@pytest.mark.docker
async def test_a_second_reset_starts_from_a_fresh_copy(env_cls):
    env = env_cls()
    try:
        await env.reset(options=TASKS["slugger"])
        await env.step(agentrl.Action(text="", tool_calls=[agentrl.ToolCall("bash", {"command": "touch junk"})]))
        _, info = await env.reset(options=TASKS["numerals"])
        obs, *_ = await env.step(agentrl.Action(text="", tool_calls=[agentrl.ToolCall("bash", {"command": "ls"})]))
        assert info == {"repo": "numerals"} and obs[0]["content"].split() == ["README.md", "numerals", "tests"]
    finally:
        await env.close()


@pytest.mark.docker
async def test_check_env_finds_no_violations(env_cls):
    report = await agentrl.check_env(env_cls, [TASKS["numerals"]])
    assert report.ok, report.format()
    assert any("valid call of write_file" in r.scenario for r in report.results)


@pytest.mark.e2e
async def test_bubblewrap_fallback_scores_the_same():
    cls, pool = await make_env_cls("bubblewrap")  # skips where bubblewrap cannot run
    try:
        tasks = [TASKS["csvlite"], TASKS["ringq"]]
        fixed, idle = await asyncio.gather(play(cls, fix_policy(), tasks), play(cls, script(), tasks))
        assert [r.reward for r in fixed] == [1.0, 1.0] and [r.reward for r in idle] == [0.0, 0.0]
    finally:
        await pool.close()


async def test_a_fifo_in_a_sources_place_is_dropped_not_waited_on(env_cls):
    """Reading a FIFO blocks; listed first, it is dropped and the final step scores at once (reward 0)."""
    env = env_cls()
    try:
        await env.reset(options=TASKS["spans"])
        text = call("bash", command="cd spans && rm intervals.py && mkfifo intervals.py && ls -l intervals.py")
        _, calls, errors = get_parser("hermes").parse(text)
        obs, *_ = await env.step(agentrl.Action(text=text, tool_calls=calls, errors=errors))
        assert obs[0]["content"].startswith("p")  # a named pipe
        t0 = asyncio.get_running_loop().time()
        _, reward, done, _, info = await env.step(agentrl.Action(text="Fixed."))
        assert asyncio.get_running_loop().time() - t0 < 20  # not the read's ~60 s
        assert reward == 0.0 and done and info["dropped"] == ["spans/intervals.py"]
    finally:
        await env.close()


async def test_a_listing_that_fails_fails_the_sample_instead_of_scoring_zero(env_cls):
    """A listing run past its time limit (a loaded machine) must not read as 'every source deleted'."""
    from agentrl.envs.swe import read_sources
    from agentrl.sandbox import SandboxError

    env = env_cls()
    try:
        await env.reset(options=TASKS["spans"])
        sandbox = await env.sandbox()
        paths = ("spans/intervals.py",)
        edited, dropped = await read_sources(sandbox, paths, 1 << 20)
        assert list(edited) == ["spans/intervals.py"] and dropped == []
        with pytest.raises(SandboxError, match="listing the model's source files failed .*not scored"):
            await read_sources(sandbox, paths, 1 << 20, timeout=0.001)
    finally:
        await env.close()


@pytest.fixture
def data_dir_under_usr(tmp_path):
    """A copy of one task under /usr/local/share, which bubblewrap binds into its sandboxes."""
    import shutil
    import tempfile
    from pathlib import Path

    try:
        root = Path(tempfile.mkdtemp(prefix="agentrl-swe-test-", dir="/usr/local/share"))
    except OSError:
        pytest.skip("/usr/local/share is not writable here")
    root.chmod(0o755)  # as an installed package's folders are (mkdtemp's are private)
    try:
        shutil.copytree(DATA / "numerals", root / "numerals", ignore=shutil.ignore_patterns("__pycache__"))
        yield root
    finally:
        shutil.rmtree(root, ignore_errors=True)


async def test_a_sandbox_that_can_read_the_hidden_tests_is_refused(data_dir_under_usr, docker_image):
    from agentrl.sandbox import SandboxError

    task = {"prompt": "x", "repo": "numerals", "label": "numerals"}
    for backend, readable in (("bubblewrap", True), ("docker", False), ("process", True)):
        cls, pool = await make_env_cls(backend)
        cls.data_dir = data_dir_under_usr
        env = cls()
        try:
            if readable:
                with pytest.raises(SandboxError, match="use --sandbox docker"):
                    await env.reset(options=task)
            else:
                messages, info = await env.reset(options=task)
                assert info == {"repo": "numerals"}
        finally:
            await env.close()
            await pool.close()
