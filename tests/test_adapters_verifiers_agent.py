"""The verifiers adapter's agent path, run for real: what stays on this machine, deadlines, retries,
one ``serving()`` for concurrent episodes, and no process or workdir left behind.

Each taskset is a module written the way verifiers wants one (``Taskset``, ``Task`` with ``@vf.reward``,
an exported ``Harness`` or ``Env`` subclass when it has one), put on ``sys.path`` under a name of its
own (the adapter caches a loaded taskset per process). The episodes run verifiers' own rollout on its
subprocess runtime (its chat program as a real process) against a scripted policy engine through the
recording proxy. Install: see tests/test_adapters_verifiers.py.
"""

from __future__ import annotations

import asyncio
import os
import stat
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest

try:
    import verifiers.v1  # noqa: F401
except ImportError:
    if os.environ.get("AGENTRL_REQUIRE_VERIFIERS") == "1":
        raise
    pytest.skip("verifiers 0.4 is not installed (see tests/test_adapters_verifiers.py)", allow_module_level=True)

import agentrl
from agentrl.adapters import adapter_factory
from agentrl.chat import ChatTemplate
from agentrl.config import RolloutConfig
from agentrl.engines.base import Engine, GenerateOutput
from agentrl.rollout.episode import EpisodeContext
from agentrl.rollout.generate import generate_rollout
from agentrl.types import Status

TASK = """
import verifiers.v1 as vf


class T(vf.Task[vf.TaskData, vf.State, {config}]):
    @vf.reward
    async def done(self, task, trace) -> float:
        return float(trace.last_reply == "done")

    @vf.reward(weight=0.5)
    async def short(self, task, trace) -> float:
        return float(len(trace.last_reply) < 10)


class S(vf.Taskset[T, vf.TasksetConfig]):
    def load(self):
        for i in range({tasks}):
            yield T(vf.TaskData(prompt=f"Say done ({{i}})."))
"""
OWN_HARNESS = '''
from verifiers.v1.harnesses.null import NullHarness


class OwnAgent(NullHarness):
    """The taskset's own agent: verifiers' chat program, under the taskset's harness id."""
'''


def write_taskset(root: Path, name: str, extra: str = "", *, config: str = "vf.TaskConfig", tasks: int = 1) -> str:
    """A taskset module ``name`` under ``root`` (on sys.path); ``extra`` is appended (its ``__all__`` last)."""
    (root / f"{name}.py").write_text(TASK.format(config=config, tasks=tasks) + textwrap.dedent(extra))
    return f"verifiers:{name}"


@pytest.fixture
def tasksets(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path))
    before = set(sys.modules)
    yield tmp_path
    for name in set(sys.modules) - before:
        if name.startswith("vf_"):
            sys.modules.pop(name, None)


class Say(Engine):
    """A scripted policy: every turn is ``text`` (the tiny model cannot be made to say a chosen word)."""

    def __init__(self, tokenizer, text: str = "done"):
        self.tok, self.text, self.calls = tokenizer, text, 0

    async def generate(self, input_ids, sampling_params, *, key=None):
        self.calls += 1
        ids = self.tok.encode(self.text, add_special_tokens=False) + [self.tok.eos_token_id]
        return GenerateOutput(ids, [-0.5] * len(ids), "stop", self.tok.eos_token_id)

    async def health(self):
        return True


def context(tokenizer, engine=None) -> EpisodeContext:
    return EpisodeContext(
        engine=engine or Say(tokenizer), template=ChatTemplate(tokenizer), config=RolloutConfig(max_turns=4)
    )


def workdirs() -> set[str]:
    from verifiers.v1.utils.paths import CACHE_DIR

    root = CACHE_DIR / "runtimes" / "subprocess"
    return {p.name for p in root.iterdir()} if root.is_dir() else set()


def children() -> set[int]:
    """This process's live descendants now (a session's engine server, say)."""
    return {p.pid for p in psutil.Process().children(recursive=True) if p.status() != psutil.STATUS_ZOMBIE}


def leftovers(before: set[int], marker: str = "") -> list[str]:
    """Descendants started since ``before`` (harness and tool server programs), and any process naming ``marker``."""
    found = [psutil.Process(pid) for pid in children() - before]
    if marker:
        found += [p for p in psutil.process_iter(["cmdline"]) if any(marker in a for a in p.info["cmdline"] or ())]
    return [" ".join(p.cmdline()) for p in found if p.pid != os.getpid() and p.is_running()]


async def settled(before: set[int], marker: str = "", seconds: float = 3.0) -> list[str]:
    """Leftover processes once a moment has passed for killed ones to be reaped."""
    deadline = time.monotonic() + seconds
    while (left := leftovers(before, marker)) and time.monotonic() < deadline:
        await asyncio.sleep(0.1)
    return left


# -- 1: verifiers' chat program never bootstraps uv or downloads, whatever the harness id --
FAKE_TOOL = '#!/bin/sh\necho "$0 $*" >> "{sentinel}"\nexit 1\n'


async def test_an_own_harness_runs_on_this_interpreter_with_no_uv_bootstrap(tasksets, tiny_tokenizer, monkeypatch):
    """A taskset's own harness subclassing NullHarness (harness id = the taskset's) runs verifiers' chat
    program. ``uv``, ``pip``, ``curl``... on PATH are sentinels: verifiers' uv bootstrap (``_ENSURE_UV``
    then ``uv sync``) would call them; it must never be reached, and the sample is verifiers' score."""
    from verifiers.v1.harnesses.utils.launch import CHAT_PROGRAM_SOURCE
    from verifiers.v1.runtimes.subprocess import SubprocessRuntime

    from agentrl.adapters.verifiers_agent import VerifiersAgentEnv

    fake, sentinel = tasksets / "bin", tasksets / "called"
    fake.mkdir()
    for tool in ("uv", "pip", "pip3", "curl", "wget", "apt-get", "apk"):
        (fake / tool).write_text(FAKE_TOOL.format(sentinel=sentinel))
        (fake / tool).chmod(stat.S_IRWXU)
    monkeypatch.setenv("PATH", f"{fake}:/usr/bin:/bin")
    monkeypatch.setenv("HOME", str(tasksets))  # verifiers' bootstrap also looks in ~/.local/bin
    script = SubprocessRuntime._interpreters
    for path in [p for p in script if p.endswith(".py")]:  # as in a fresh process: nothing prepared yet
        monkeypatch.delitem(script, path)
    spec = write_taskset(tasksets, "vf_own_agent", OWN_HARNESS + "__all__ = ['S', 'OwnAgent']\n")
    factory = agentrl.load_env(spec)
    env = factory()
    assert isinstance(env, VerifiersAgentEnv)
    assert {h.id for h in env.vf_env.config.agent_harnesses().values()} == {"vf_own_agent"}
    samples, _ = await generate_rollout(context(tiny_tokenizer), factory, factory.tasks())
    assert not sentinel.exists(), sentinel.read_text()
    (s,) = samples
    assert s.status == Status.COMPLETED, s.metadata.get("error")
    assert s.reward == 1.5  # verifiers' score: done (1.0) + 0.5 * short (1.0)
    assert "'done': 1.0" in s.metadata["env_infos"][-1]["output"]
    assert sys.executable in script.values() and len(script) == 1
    assert script.keys() == {str(Path(SubprocessRuntime.scripts_dir) / f"{_digest(CHAT_PROGRAM_SOURCE)}.py")}


def _digest(text: str) -> str:
    import hashlib

    return hashlib.sha256(text.encode()).hexdigest()


def test_the_chat_programs_packages_come_from_its_pep_723_header():
    from verifiers.v1.harnesses.utils.launch import CHAT_PROGRAM_SOURCE

    from agentrl.adapters.verifiers_harness import script_packages

    assert script_packages(CHAT_PROGRAM_SOURCE) == ["openai", "mcp", "httpx", "httpx2", "tenacity", "certifi"]
    src = '# /// script\n# dependencies = ["left-pad>=1", "requests[socks]"]\n# ///\nprint(1)\n'
    assert script_packages(src) == ["left-pad", "requests"]
    with pytest.raises(ValueError, match="0 PEP 723 script blocks"):
        script_packages("print(1)\n")


def test_a_missing_package_or_a_changed_verifiers_is_refused_in_one_line(tasksets, monkeypatch):
    from verifiers.v1.runtimes.subprocess import SubprocessRuntime

    from agentrl.adapters import verifiers_harness

    real = verifiers_harness._version
    monkeypatch.setattr(verifiers_harness, "_version", lambda name: None if name == "httpx2" else real(name))
    spec = write_taskset(tasksets, "vf_no_httpx2", OWN_HARNESS + "__all__ = ['S', 'OwnAgent']\n")
    with pytest.raises(ValueError, match=r"^taskset 'vf_no_httpx2': .*needs the packages httpx2 .*pip install httpx2$"):
        agentrl.load_env(spec)
    monkeypatch.setattr(verifiers_harness, "_version", real)
    monkeypatch.delattr(SubprocessRuntime, "_interpreters")
    spec = write_taskset(tasksets, "vf_new_verifiers", OWN_HARNESS + "__all__ = ['S', 'OwnAgent']\n")
    with pytest.raises(ValueError, match=r"SubprocessRuntime._interpreters.*supports verifiers==0\.4\.0") as err:
        agentrl.load_env(spec)
    assert "\n" not in str(err.value)


# -- 2: tool servers and judges off loopback are refused at load, on both paths --
TOOLSET = '''
class Tools(vf.Toolset[vf.ToolsetConfig]):
    @vf.tool
    def noop(self) -> str:
        """Nothing."""
        return ""
'''
OFF_LOOPBACK = {
    "vf_url_toolset": (  # a taskset-level (shared) tool server somewhere else
        TOOLSET + "\n\nclass S2(S):\n    @classmethod\n    def toolsets(cls, config):\n"
        "        return [Tools(vf.ToolsetConfig(url='http://10.9.8.7:8000/mcp'))]\n\n\n__all__ = ['S2']\n",
        "vf.TaskConfig",
        r"toolset '.*' is served at http://10\.9\.8\.7:8000/mcp, off this machine.*leave its url unset",
    ),
    "vf_docker_toolset": (  # a task-level tool server in a container runtime
        TOOLSET + "\n\nclass T2(T):\n    @classmethod\n    def toolsets(cls, config):\n"
        "        return [Tools(vf.ToolsetConfig(runtime={'type': 'docker', 'image': 'python:3.11'}))]\n\n\n"
        "class S2(vf.Taskset[T2, vf.TasksetConfig]):\n    def load(self):\n        yield T2(vf.TaskData(prompt='x'))\n"
        "\n\n__all__ = ['S2']\n",
        "vf.TaskConfig",
        r"toolset '.*' runs in the 'docker' runtime.*set its runtime to subprocess",
    ),
    "vf_plugged_judge": (  # single-reply path: a plugged judge on verifiers' default (Prime's) endpoint
        "\n__all__ = ['S']\n",
        "JudgedConfig",
        r"judge 'reference' at task 0 config\.judges\[0\] calls https://api\.pinference\.ai/api/v1, off this machine",
    ),
    "vf_code_judge": (  # agent path: a judge config that reward code would call
        OWN_HARNESS + "\n__all__ = ['S', 'OwnAgent']\n",
        "CodeJudgeConfig",
        r"model client at task 0 config\.judge calls https://judge\.example\.com/v1, off this machine",
    ),
}
JUDGE_CONFIGS = """
import verifiers.v1 as vf


class JudgedConfig(vf.TaskConfig):
    judges: vf.Judges = [vf.ReferenceJudgeConfig(id="reference")]


class CodeJudgeConfig(vf.TaskConfig):
    judge: vf.JudgeConfig = vf.JudgeConfig(base_url="{url}")
"""


@pytest.mark.parametrize("name", sorted(OFF_LOOPBACK))
def test_tools_and_judges_off_loopback_are_refused_in_one_line(name, tasksets):
    extra, config, why = OFF_LOOPBACK[name]
    (tasksets / f"{name}_cfg.py").write_text(JUDGE_CONFIGS.format(url="https://judge.example.com/v1"))
    (tasksets / f"{name}.py").write_text(
        f"from {name}_cfg import JudgedConfig, CodeJudgeConfig\n"
        + TASK.format(config=config, tasks=1)
        + textwrap.dedent(extra)
    )
    with pytest.raises(ValueError, match=f"^taskset '{name}': {why}") as err:
        agentrl.load_env(f"verifiers:{name}")
    assert "\n" not in str(err.value)


def test_a_judge_on_loopback_loads(tasksets):
    (tasksets / "vf_local_judge_cfg.py").write_text(JUDGE_CONFIGS.format(url="http://127.0.0.1:8000/v1"))
    (tasksets / "vf_local_judge.py").write_text(
        "from vf_local_judge_cfg import CodeJudgeConfig\n"
        + TASK.format(config="CodeJudgeConfig", tasks=1)
        + "__all__ = ['S']\n"
    )
    assert agentrl.load_env("verifiers:vf_local_judge").tasks()


# -- 3 and 6: a hanging harness fails its sample within agent_timeout; nothing is left behind --
HANGING = '''
import sys

from verifiers.v1.harnesses.null import NullHarness


class Hang(NullHarness):
    """Never calls the model: its program sleeps (marked, so a leftover is found by name)."""

    async def launch(self, ctx, trace, runtime, endpoint, secret, mcp_urls, data, tool_interception_url=None):
        program = "import time; time.sleep(300)  # {marker}"
        return await runtime.run_program([sys.executable, "-c", program], {{}})


__all__ = ["S", "Hang"]
'''


async def test_a_hanging_harness_fails_its_sample_within_agent_timeout(tasksets, tiny_tokenizer):
    marker = f"agentrl-hang-{os.getpid()}"
    spec = write_taskset(tasksets, "vf_hang", HANGING.format(marker=marker))
    factory = adapter_factory(spec, agent_timeout=2)  # what load_env(spec) builds, with the env's argument
    env = factory()
    assert env.agent_timeout == 2.0 and env.vf_env.config.agent.timeout.rollout == 2.0
    assert env.vf_env.config.agent.timeout.scoring == 2.0
    assert type(env).agent_timeout == 600.0  # the default, finite (ProxyEnv's)
    dirs, before = workdirs(), children()
    start = time.monotonic()
    samples, _ = await generate_rollout(context(tiny_tokenizer), factory, factory.tasks())
    assert time.monotonic() - start < 10
    (s,) = samples
    assert s.status == Status.FAILED and "agent_timeout=2s" in s.metadata["error"], s.metadata.get("error")
    assert await settled(before, marker) == []
    assert workdirs() <= dirs
    with pytest.raises(ValueError, match=r"agent_timeout: expected seconds > 0"):
        factory(agent_timeout=0)


async def test_a_cancelled_episode_leaves_no_process_or_workdir(tasksets, tiny_tokenizer):
    """The harness is waiting for its first reply when the episode is closed (its agent task cancelled):
    verifiers kills its process group and removes its workdir, and the last episode leaves serving()."""
    from agentrl.adapters.verifiers_agent import _SERVING

    spec = write_taskset(tasksets, "vf_cancelled", OWN_HARNESS + "__all__ = ['S', 'OwnAgent']\n")
    dirs, before = workdirs(), children()
    env = agentrl.load_env(spec)()
    obs, _ = await env.reset(options={"vf_idx": 0})
    assert obs[-1]["content"] == "Say done (0)."
    assert leftovers(before)  # the chat program waits on its request
    await env.close()
    assert await settled(before) == [] and workdirs() <= dirs and not _SERVING


# -- 4: success is verifiers' ok stamp; retries are off whatever the taskset sets --
RETRYING = """
from verifiers.v1.configs.retries import RetryConfig
from verifiers.v1.env import Env
from verifiers.v1.envs.single_agent import SingleAgentEnv, SingleAgentEnvConfig


class Cfg(SingleAgentEnvConfig):
    agent: vf.AgentConfig = vf.AgentConfig(retries=RetryConfig(max_retries=2), timeout={"rollout": 30})
    retries: RetryConfig = RetryConfig(max_retries=1)


class E(SingleAgentEnv, Env[Cfg]):
    pass


__all__ = ["S", "E"]
"""


def test_retries_are_forced_off_and_a_roles_shorter_deadline_stands(tasksets):
    """A retried run restarts the harness: the proxy would record its new conversation as a rewrite (a
    new segment) trained with the retry's reward. The taskset's own retries are overridden to none."""
    env = agentrl.load_env(write_taskset(tasksets, "vf_retrying", RETRYING))()
    config = env.vf_env.config
    assert (config.agent.retries.max_retries, config.agent.retries.rules) == (0, [])
    assert (config.retries.max_retries, config.retries.rules) == (0, [])
    assert (config.agent.timeout.rollout, config.agent.timeout.scoring) == (30.0, 60.0)


def test_success_is_verifiers_ok_stamp():
    """A trace that recovered from an error (its history kept in ``errors``) but is stamped ok is scored;
    a failed one or one a deadline stopped fails the sample."""
    import verifiers.v1 as vf
    from verifiers.v1.episode import EnvInfo, Episode
    from verifiers.v1.trace import Error, TraceTask

    from agentrl.adapters.verifiers_agent import outcome

    data = vf.TaskData(prompt="p")
    task = TraceTask(type="T", data=data, key="k", hash="h")

    def episode(ok: bool, timeout: bool = False) -> Episode:
        trace = vf.Trace(task=task, agent=vf.AgentInfo(config=vf.AgentConfig()), is_completed=True, ok=ok)
        trace.errors.append(Error(type="ProviderError", message="502 from upstream"))
        trace.is_timeout = timeout
        trace.stop_condition = "agent_timeout" if timeout else "agent_completed"
        return Episode(env=EnvInfo(id="x"), task=task, traces=[trace], ok=ok)

    assert outcome(episode(ok=True)).reward == 0.0
    with pytest.raises(RuntimeError, match="ProviderError: 502 from upstream"):
        outcome(episode(ok=False))
    with pytest.raises(RuntimeError, match=r"deadline expired \(agent_timeout\)"):
        outcome(episode(ok=True, timeout=True))


# -- 5: one serving() per event loop for concurrent episodes --
COUNTING = '''
from verifiers.v1.envs.single_agent import SingleAgentEnv

CALLS = {"start": 0, "stop": 0, "live": 0, "most": 0}


class Counting(SingleAgentEnv):
    """Counts start()/stop(); a second start() while one is live would be a second serving()."""

    async def start(self):
        CALLS["start"] += 1
        CALLS["live"] += 1
        CALLS["most"] = max(CALLS["most"], CALLS["live"])

    async def stop(self):
        CALLS["stop"] += 1
        CALLS["live"] -= 1


__all__ = ["S", "Counting"]
'''


async def test_concurrent_episodes_share_one_serving(tasksets, tiny_tokenizer):
    from agentrl.adapters.verifiers_agent import _SERVING

    spec = write_taskset(tasksets, "vf_counting", COUNTING, tasks=4)
    factory = agentrl.load_env(spec)
    calls = sys.modules["vf_counting"].CALLS
    engine, dirs, before = Say(tiny_tokenizer), workdirs(), children()
    samples, _ = await generate_rollout(context(tiny_tokenizer, engine), factory, factory.tasks())
    assert [s.status for s in samples] == [Status.COMPLETED] * 4, [s.metadata.get("error") for s in samples]
    assert [s.reward for s in samples] == [1.5] * 4 and engine.calls == 4
    assert calls == {"start": 1, "stop": 1, "live": 0, "most": 1}
    assert not _SERVING and await settled(before) == [] and workdirs() <= dirs  # a normal exit leaves nothing
