"""verifiers environments (PyPI ``verifiers`` 0.4.0, its ``verifiers.v1`` stack) through ``verifiers:<taskset id>``.

The taskset under test is a package written the way verifiers wants one (a ``Taskset`` subclass
exported through ``__all__``, tasks with ``@vf.reward`` methods), put on the path as an installed
package would be; ``verifiers:agentrl-test-reverse-words`` loads it through verifiers' own
``load_environment``, in-process and from the CLI.

Install (verifiers pins mcp==2.0.0 and openai<3, which would downgrade packages other parts of
agentrl use, so its dependencies are installed one by one, each with --no-deps)::

    pip install --no-deps verifiers==0.4.0 prime-pydantic-config==0.4.3 renderers==0.1.12 \
        anthropic==2.16.0 prime-sandboxes==0.5.1 tenacity==9.2.1 connectrpc==0.11.1 pyqwest==0.12.0 \
        protobuf-py==0.1.1 protobuf-py-ext==0.1.1 aiofiles==25.1.0 tomli-w==1.2.0 math-verify==0.9.0 \
        latex2sympy2_extended==1.11.0
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

try:
    import verifiers.v1  # noqa: F401
except ImportError:
    if os.environ.get("AGENTRL_REQUIRE_VERIFIERS") == "1":
        raise
    pytest.skip("verifiers 0.4 is not installed (see this module's docstring)", allow_module_level=True)

import agentrl
from agentrl.chat import ChatTemplate
from agentrl.check import check_env
from agentrl.config import RolloutConfig
from agentrl.engines.base import Engine, GenerateOutput
from agentrl.rollout.episode import EpisodeContext
from agentrl.rollout.generate import generate_rollout
from agentrl.types import Action, Status
from tests.test_adapters import read_samples
from tests.test_adapters_verifiers_agent import children, settled
from tests.test_cli import REPO

TASKSET = '''"""A verifiers taskset package: reverse a few words; exact answers score 1, the right words 0.5 more."""
import verifiers.v1 as vf


class ReverseData(vf.TaskData):
    answer: str


class ReverseTask(vf.Task[ReverseData, vf.State, vf.TaskConfig]):
    @vf.reward
    async def exact(self, task: ReverseData, trace: vf.Trace) -> float:
        return float(trace.last_reply == task.answer)

    @vf.reward(weight=0.5)
    async def same_words(self, task: ReverseData, trace: vf.Trace) -> float:
        return float(sorted(trace.last_reply.split()) == sorted(task.answer.split()))

    @vf.metric
    async def turns(self, task: ReverseData, trace: vf.Trace) -> float:
        return float(trace.num_turns)


class ReverseWords(vf.Taskset[ReverseTask, vf.TasksetConfig]):
    def load(self):
        for words in ["a b", "one two three", "x y z w"]:
            answer = " ".join(reversed(words.split()))
            data = ReverseData(prompt=f"Reverse the words: {words}", system_prompt="Answer with the words only.", answer=answer)
            yield ReverseTask(data)


__all__ = ["ReverseWords"]
'''
SPEC = "verifiers:agentrl-test-reverse-words"  # verifiers' loader imports it as agentrl_test_reverse_words


@pytest.fixture(scope="module")
def taskset_path(tmp_path_factory) -> Iterator[Path]:
    """The taskset package on sys.path, as ``pip install`` would put it."""
    root = tmp_path_factory.mktemp("tasksets")
    (root / "agentrl_test_reverse_words").mkdir()
    (root / "agentrl_test_reverse_words" / "__init__.py").write_text(TASKSET)
    with pytest.MonkeyPatch.context() as mp:
        mp.syspath_prepend(str(root))
        yield root


async def test_taskset_rows_prompts_and_the_tasks_own_rubric(taskset_path):
    factory = agentrl.load_env(SPEC)
    rows = factory.tasks()
    assert [r["vf_idx"] for r in rows] == [0, 1, 2]
    assert rows[1]["prompt"] == [
        {"role": "system", "content": "Answer with the words only."},
        {"role": "user", "content": "Reverse the words: one two three"},
    ]
    for reply, reward, rewards in [
        ("three two one", 1.5, {"exact": 1.0, "same_words": 1.0}),
        ("one three two", 0.5, {"exact": 0.0, "same_words": 1.0}),
        ("no idea", 0.0, {"exact": 0.0, "same_words": 0.0}),
    ]:
        env = factory()
        obs, info = await env.reset(seed=0, options=rows[1])
        assert obs == rows[1]["prompt"] and len(info["task_key"]) == 64
        msgs, got, terminated, truncated, step_info = await env.step(Action(text=reply))
        assert (msgs, got, terminated, truncated) == ([], reward, True, False)
        assert step_info == {"rewards": rewards, "metrics": {"turns": 1.0}}
        await env.close()
    # a --prompt-data row of the taskset's own shape (no vf_idx) is validated as its task data
    env = factory()
    obs, _ = await env.reset(options={"prompt": "Reverse the words: p q", "answer": "q p", "label": None})
    assert obs == [{"role": "user", "content": "Reverse the words: p q"}]
    assert (await env.step(Action(text="q p")))[1] == 1.5
    with pytest.raises(Exception, match="answer"):  # pydantic names the missing field; the sample fails
        await factory().reset(options={"prompt": "Reverse the words: p q", "label": None})


async def test_verifiers_env_passes_check_env(taskset_path):
    factory = agentrl.load_env(SPEC)
    report = await check_env(factory, factory.tasks()[:2])
    assert report.ok, report.format()
    assert len(report.results) == 2 * 5


UNSUPPORTED = {
    "vf_box_task": ("NEEDS_CONTAINER = True", "", "", "its tasks need a container runtime"),
    "vf_code_harness": (
        "pass",
        "",
        "    EXECUTES_CODE = True\n",
        r"\(it ships its own harness OwnAgent\): role 'agent': its harness 'vf_code_harness' runs model-written code",
    ),
}
AGENT_PATH = {  # what one reply cannot stand in for, and verifiers' own rollout can run here
    "vf_runtime_reward": (
        "",
        "    @vf.reward\n    async def ran(self, task, trace, runtime) -> float:\n        return 1.0\n",
        None,
    ),
    "vf_own_harness": ("pass", "", "    pass\n"),
}
HARNESS = """
from verifiers.v1.harnesses.null import NullHarness


class OwnAgent(NullHarness):
    # verifiers runs an exported harness as the taskset's agent (a multi-turn program, say)
"""


def _write_taskset(path: Path, name: str, attr: str, method: str, harness: str | None) -> None:
    (path / f"{name}.py").write_text(
        textwrap.dedent(f"""
        import verifiers.v1 as vf

        class T(vf.Task[vf.TaskData, vf.State, vf.TaskConfig]):
            {attr}
        """)
        + method
        + textwrap.dedent("""
        class S(vf.Taskset[T, vf.TasksetConfig]):
            def load(self):
                yield T(vf.TaskData(prompt="hi"))
        """)
        + (HARNESS + harness if harness else "")
        + f"__all__ = {['S', 'OwnAgent'] if harness else ['S']}\n"
    )


@pytest.mark.parametrize("name", sorted(UNSUPPORTED))
def test_tasksets_that_cannot_run_here_are_refused_in_one_line(name, tmp_path, monkeypatch):
    attr, method, harness, why = UNSUPPORTED[name]
    _write_taskset(tmp_path, name, attr, method, harness)
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ValueError, match=f"^taskset '{name}'.*{why}") as err:
        agentrl.load_env(f"verifiers:{name}")
    assert "\n" not in str(err.value)
    sys.modules.pop(name, None)


def test_an_env_of_several_agents_is_refused_in_one_line(tmp_path, monkeypatch):
    """A user simulator's turns would be recorded (and trained) as the policy's: refused at load."""
    _write_taskset(tmp_path, "vf_user_sim", "pass", "", None)
    with open(tmp_path / "vf_user_sim.py", "a") as f:
        f.write("from verifiers.v1.envs.user_sim import UserSimEnv\n\n\nclass Chat(UserSimEnv):\n    pass\n\n\n")
        f.write("__all__ = ['S', 'Chat']\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(
        ValueError, match=r"^taskset 'vf_user_sim': its env class Chat is not a single-agent env"
    ) as err:
        agentrl.load_env("verifiers:vf_user_sim")
    assert "\n" not in str(err.value)
    sys.modules.pop("vf_user_sim", None)


@pytest.mark.parametrize("name", sorted(AGENT_PATH))
def test_tasksets_one_reply_cannot_stand_in_for_take_the_agent_path(name, tmp_path, monkeypatch):
    from agentrl.adapters.verifiers_agent import VerifiersAgentEnv

    _write_taskset(tmp_path, name, *AGENT_PATH[name])
    monkeypatch.syspath_prepend(str(tmp_path))
    env = agentrl.load_env(f"verifiers:{name}")()
    assert isinstance(env, VerifiersAgentEnv)
    assert {h.id for h in env.vf_env.config.agent_harnesses().values()} == {name if AGENT_PATH[name][2] else "null"}
    assert env.vf_env.config.agent.runtime.type == "subprocess"  # never Prime's remote sandboxes
    sys.modules.pop(name, None)


def test_verifiers_rollout_end_to_end(taskset_path, tiny_server, tiny_ckpt, tmp_path):
    out = tmp_path / "samples.jsonl"
    flags = ["--num-tasks", "2", "--n-samples-per-prompt", "2", "--rollout-max-turn-len", "16"]
    command = [sys.executable, "-m", "agentrl", "rollout", "--env", SPEC, *flags, "--engine-url", tiny_server]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(taskset_path), os.environ.get("PYTHONPATH", "")])}
    r = subprocess.run(
        [*command, "--hf-checkpoint", str(tiny_ckpt), "--output", str(out)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr
    samples = read_samples(out)
    assert sorted(s["group_index"] for s in samples) == [0, 0, 1, 1]
    for s in samples:
        assert s["status"] in ("completed", "truncated"), s["metadata"].get("error")
        words = ["a b", "one two three"][s["group_index"]]
        assert s["prompt"][-1] == {"role": "user", "content": f"Reverse the words: {words}"}
        assert s["reward"] in (0.0, 0.5, 1.5) and s["reward"] == sum(s["metadata"]["turn_rewards"])


# -- the agent path: verifiers' own rollout (its harness, tool server, rubric), recorded through the proxy --
TASKSETS = Path(__file__).resolve().parent / "verifiers_tasksets"
TOOLS_SPEC = "verifiers:agentrl-test-calc-tools"  # tests/verifiers_tasksets/agentrl_test_calc_tools


@pytest.fixture
def tool_taskset(monkeypatch) -> None:
    """The tool-using taskset importable here and in the processes verifiers starts (its tool server)."""
    monkeypatch.syspath_prepend(str(TASKSETS))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(TASKSETS), os.environ.get("PYTHONPATH", "")]))


class ToolPolicy(Engine):
    """A scripted policy (the tiny model cannot be made to write chosen tool calls): a ``multiply`` call
    with the prompt's numbers, then an answer quoting the tool's result as the prompt shows it."""

    def __init__(self, tokenizer):
        self.tok, self.requests, self.outputs = tokenizer, [], []

    async def generate(self, input_ids, sampling_params, *, key=None):
        prompt = self.tok.decode(input_ids)
        results = re.findall(r"<tool_response>\n(.*?)\n</tool_response>", prompt, re.S)
        a, b = re.findall(r"What is (\d+) \* (\d+)\?", prompt)[-1]
        tool = re.findall(r'"name": "([\w.-]*multiply)"', prompt)[0]  # as verifiers names the server's tool
        call = json.dumps({"name": tool, "arguments": {"a": int(a), "b": int(b)}})
        text = f"The answer is {results[-1]}." if results else f"Let me multiply.\n<tool_call>\n{call}\n</tool_call>"
        ids = self.tok.encode(text, add_special_tokens=False) + [self.tok.eos_token_id]
        self.requests.append(list(input_ids))
        self.outputs.append(ids)
        return GenerateOutput(ids, [-0.5] * len(ids), "stop", self.tok.eos_token_id)

    async def health(self):
        return True


async def test_a_tool_using_taskset_runs_verifiers_own_rollout_recorded_token_exact(tool_taskset, tiny_tokenizer):
    """verifiers' null harness (its chat program) calls the taskset's MCP tool server; each model call reaches
    the episode loop through the proxy: one sample whose turns are the policy's ids verbatim (mask 1) and
    whose tool results are mask-0 deltas, rewarded with verifiers' own score of that rollout."""
    from agentrl.adapters.verifiers_agent import VerifiersAgentEnv

    factory = agentrl.load_env(TOOLS_SPEC)
    rows = factory.tasks()
    assert isinstance(factory(), VerifiersAgentEnv) and [r["vf_idx"] for r in rows] == [0, 1, 2]
    engine, before = ToolPolicy(tiny_tokenizer), children()
    ctx = EpisodeContext(engine=engine, template=ChatTemplate(tiny_tokenizer), config=RolloutConfig(max_turns=6))
    samples, _ = await generate_rollout(ctx, factory, rows[1:2])
    assert await settled(before) == []  # the chat program and the taskset's tool server ended with the episode
    assert len(samples) == 1
    for s, answer in zip(samples, ["15"]):
        assert s.status == Status.COMPLETED, s.metadata.get("error")
        s.validate()
        assert s.metadata["num_turns"] == 2 and "segment" not in s.metadata
        turns = [s.tokens[s.prompt_length + a : s.prompt_length + b] for a, b in s.turn_spans]
        assert turns == engine.outputs  # the policy's ids verbatim, every request a prefix of the sample
        assert all(s.tokens[: len(req)] == req for req in engine.requests)
        mask = s.loss_mask
        assert [sum(mask[a:b]) for a, b in s.turn_spans] == [b - a for a, b in s.turn_spans]
        gap = s.turn_spans[1][0] - s.turn_spans[0][1]  # the tool's result, between the two turns
        assert gap > 0 and not any(mask[s.turn_spans[0][1] : s.turn_spans[1][0]])
        text = ctx.template.decode(s.tokens)
        assert f"<tool_response>\n{answer}\n</tool_response>" in text and "The answer is 15." in text
        # verifiers' own score: exact (1.0) + 0.5 * used_tool (1.0)
        assert s.reward == 1.5
        outcome = s.metadata["env_infos"][-1]["output"]
        assert "'exact': 1.0" in outcome and "'used_tool': 1.0" in outcome and "turns=[2]" in outcome
