"""verifiers' own ``openenv`` taskset (shipped in the verifiers PyPI package) against agentrl's env server.

``verifiers:openenv?base_url=...`` gives the taskset its settings (its ``OpenEnvConfig``, as
``vf eval --taskset.base-url`` would); the server is agentrl's :class:`EnvServer` serving the
bundled GuessNumber game on 127.0.0.1, spoken to by verifiers' ``OpenEnvEnv`` through openenv-core's
``GenericEnvClient``. The episode is verifiers' own rollout (its chat program as the player, the
server's observations as the user turns) recorded through agentrl's proxy; the reward is verifiers'
score (``openenv_reward``: the sum of the server's step rewards). Settings that would leave this
machine (a remote server, OpenEnv's uv or Docker provider) are refused in one line.

Install: verifiers as in ``tests/test_adapters_verifiers.py`` and ``pip install openenv-core==0.3.0``.
"""

from __future__ import annotations

import json
import os
import pickle
import re
import sys

import pytest

try:
    import openenv.core  # noqa: F401
    import verifiers.v1  # noqa: F401
except ImportError:
    if os.environ.get("AGENTRL_REQUIRE_VERIFIERS") == "1":
        raise
    pytest.skip(
        "verifiers 0.4 and openenv-core are not installed (see this module's docstring)", allow_module_level=True
    )

import agentrl
from agentrl.adapters import adapter_factory
from agentrl.adapters.openenv_server import build_server
from agentrl.adapters.verifiers_agent import VerifiersAgentEnv
from agentrl.adapters.verifiers_taskset import _openenv_client_missing, load_taskset, settings_key
from agentrl.chat import ChatTemplate
from agentrl.check import check_env
from agentrl.config import RolloutConfig
from agentrl.engines.base import Engine, GenerateOutput
from agentrl.envs import guess_number
from agentrl.rollout.episode import EpisodeContext
from agentrl.rollout.generate import generate_rollout
from agentrl.types import Action, Status
from tests.serving import serve_app
from tests.test_adapters_verifiers_agent import children, settled

MISSING = _openenv_client_missing()
needs_openenv = pytest.mark.skipif(
    MISSING is not None and os.environ.get("AGENTRL_REQUIRE_VERIFIERS_OPENENV") != "1", reason=str(MISSING)
)


@pytest.fixture(scope="module")
def guess_url():
    with serve_app(build_server("agentrl/GuessNumber-v0", max_sessions=8).app()) as url:
        yield url


class Guesser(Engine):
    """A scripted player: reads the server's observation from the JSON user turn verifiers writes
    (``{"observation": ..., "action_schema": ...}``), guesses one too low, then the secret."""

    def __init__(self, tokenizer, secret: int):
        self.tok, self.secret, self.payloads, self.outputs = tokenizer, secret, [], []

    async def generate(self, input_ids, sampling_params, *, key=None):
        prompt = self.tok.decode(input_ids)
        payload = json.loads(re.findall(r"<\|im_start\|>user\n(.*?)<\|im_end\|>", prompt, re.S)[-1])
        self.payloads.append(payload)
        guess = self.secret - 1 if len(self.payloads) == 1 else self.secret
        ids = self.tok.encode(f"<guess>{guess}</guess>", add_special_tokens=False) + [self.tok.eos_token_id]
        self.outputs.append(ids)
        return GenerateOutput(ids, [-0.5] * len(ids), "stop", self.tok.eos_token_id)

    async def health(self):
        return True


@needs_openenv
async def test_verifiers_openenv_taskset_plays_an_agentrl_server(guess_url, tiny_tokenizer):
    spec = f'verifiers:openenv?base_url={guess_url}&resets=[{{"seed": 1}}]'  # JSON where the field takes it
    factory = agentrl.load_env(spec)
    assert (factory.target, factory.kwargs) == (
        "openenv",
        {"taskset": {"base_url": guess_url, "resets": [{"seed": 1}]}},
    )
    assert pickle.loads(pickle.dumps(factory)) == factory  # the settings travel to Ray workers
    assert isinstance(factory(), VerifiersAgentEnv)
    rows = factory.tasks()
    assert [r["vf_idx"] for r in rows] == [0]
    secret = int(guess_number.GuessNumber.tasks()[1]["label"])
    engine, before = Guesser(tiny_tokenizer, secret), children()
    ctx = EpisodeContext(engine=engine, template=ChatTemplate(tiny_tokenizer), config=RolloutConfig(max_turns=6))
    samples, _ = await generate_rollout(ctx, factory, rows)
    assert await settled(before) == []
    [s] = samples
    assert s.status == Status.COMPLETED, s.metadata.get("error")
    s.validate()
    first = engine.payloads[0]
    assert first["action_schema"]["required"] == ["text"]  # agentrl's served action: the turn's text
    assert first["observation"]["messages"][0]["content"] == guess_number.GuessNumber.tasks()[1]["prompt"]
    assert "is too low" in engine.payloads[1]["observation"]["messages"][0]["content"]
    turns = [s.tokens[s.prompt_length + a : s.prompt_length + b] for a, b in s.turn_spans]
    assert turns == engine.outputs and s.metadata["num_turns"] == 2
    assert s.reward == pytest.approx(0.95)  # verifiers' score: the server's step rewards summed
    assert "'openenv_reward': 0.95" in s.metadata["env_infos"][-1]["output"]


@needs_openenv
async def test_verifiers_openenv_passes_check_env(guess_url):
    factory = adapter_factory("verifiers:openenv", taskset={"base_url": guess_url})
    report = await check_env(factory, factory.tasks())
    assert report.ok, report.format()


SETTINGS_TASKSET = """
import verifiers.v1 as vf


class CountConfig(vf.TasksetConfig):
    count: int = 1
    word: str = "hi"


class Say(vf.Task[vf.TaskData, vf.State, vf.TaskConfig]):
    @vf.reward
    async def said(self, task, trace) -> float:
        return float(trace.last_reply == task.prompt)


class Count(vf.Taskset[Say, CountConfig]):
    def load(self):
        for i in range(self.config.count):
            yield Say(vf.TaskData(prompt=f"{self.config.word} {i}"), self.config.task)


__all__ = ["Count"]
"""


@pytest.fixture
def count_taskset(tmp_path, monkeypatch):
    (tmp_path / "vf_settings_count.py").write_text(SETTINGS_TASKSET)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "verifiers:vf-settings-count"
    sys.modules.pop("vf_settings_count", None)


async def test_taskset_settings_reach_the_taskset_and_key_its_load(count_taskset):
    factory = adapter_factory(f"{count_taskset}?count=3&word=2048")  # 3: JSON for an int; 2048: text for a str
    assert factory.kwargs == {"taskset": {"count": 3, "word": "2048"}}
    assert [r["prompt"][-1]["content"] for r in factory.tasks()] == ["2048 0", "2048 1", "2048 2"]
    assert pickle.loads(pickle.dumps(factory)) == factory  # the settings travel to Ray workers
    env = pickle.loads(pickle.dumps(factory))()
    obs, _ = await env.reset(options=factory.tasks()[2])
    assert obs[-1]["content"] == "2048 2" and (await env.step(Action(text="2048 2")))[1] == 1.0
    # one load per distinct settings, however they are spelled; other settings, another load
    same = adapter_factory(count_taskset, taskset={"word": "2048", "count": 3})
    assert same == factory and load_taskset(*_key(same)) is load_taskset(*_key(factory))
    assert load_taskset(*_key(adapter_factory(count_taskset))) is not load_taskset(*_key(factory))
    assert len(adapter_factory(count_taskset).tasks()) == 1


@pytest.mark.parametrize(
    "query, given, why",
    [
        ("?count=x", None, r"setting 'count': Input should be a valid integer.*got 'x'; its settings \(CountConfig\)"),
        ("?max_turns=4", None, r"setting 'max_turns': Extra inputs are not permitted"),
        ("?count", None, r"settings 'count': expected FIELD=VALUE"),
        ("?count=1&count=2", None, r"setting 'count' is given twice"),
        ("?count=2", {"count": 2}, r"setting 'count' is given both in the spec and as taskset="),
        ("", ["count"], r"taskset= must be a dict"),
        ("", {"word": float("nan")}, r"settings must be JSON values"),
        ("?id=other", None, r"'id' is not a setting"),
    ],
)
def test_bad_taskset_settings_are_refused_in_one_line_naming_the_field(count_taskset, query, given, why):
    kwargs = {} if given is None else {"taskset": given}
    with pytest.raises(ValueError, match=f"^taskset 'vf-settings-count': {why}") as err:
        adapter_factory(count_taskset + query, **kwargs)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize(
    "spec, given, why",
    [
        ("verifiers:openenv", None, r"pass `env` or `base_url` \(its settings \(OpenEnvConfig\): .*base_url"),
        (
            "verifiers:openenv",
            {"base_url": "http://example.com:8000"},
            r"base_url http://example.com:8000 is off this machine.*openenv:http://example",
        ),
        ("verifiers:openenv?env=echo_env", None, r"without base_url .* after downloading it with uv"),
        ("verifiers:openenv?env=echo_env&use_docker=true", None, r"without base_url .* in Docker \(use_docker\)"),
    ],
)
def test_openenv_settings_that_leave_this_machine_are_refused(spec, given, why):
    if MISSING is not None:
        why = "verifiers' openenv env needs openenv>=" if "pass" not in why else why
    with pytest.raises(ValueError, match=f"^taskset 'openenv': {why}") as err:
        adapter_factory(spec, **({} if given is None else {"taskset": given}))
    assert "\n" not in str(err.value)


@pytest.mark.skipif(MISSING is None, reason="openenv >= 0.4.1 is installed: the taskset plays (tests above)")
def test_without_the_openenv_package_verifiers_openenv_is_refused_in_one_line(guess_url):
    """openenv-core 0.3.0 (the same ``openenv`` module) lacks the client attribute verifiers' env reads
    (``GenericEnvClient._base_url``): every episode would fail, so the spec is refused when it loads."""
    with pytest.raises(ValueError, match=r"^taskset 'openenv': verifiers' openenv env needs openenv>=0\.4\.1") as err:
        adapter_factory(f"verifiers:openenv?base_url={guess_url}")
    assert "pip install 'openenv>=0.4.1'" in str(err.value) and "\n" not in str(err.value)


def _key(factory) -> tuple:
    return factory.target, None, settings_key(factory.kwargs.get("taskset"))
