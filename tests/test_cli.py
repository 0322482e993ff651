"""The ``agentrl`` command end to end: real processes, real engine on loopback, tiny model."""

from __future__ import annotations

import json
import textwrap

import pytest

from tests.conftest import REPO, read_samples, run_cli  # noqa: F401 (REPO: imported from here by older modules)

pytestmark = pytest.mark.e2e  # runs the agentrl command (engine, Ray) as a user would: see conftest

run = run_cli  # this module's name for it, imported by other test modules


def test_rollout_starts_the_embedded_engine_itself(tiny_ckpt, tmp_path):
    out = tmp_path / "samples.jsonl"
    r = run(
        "rollout",
        "--env",
        "agentrl.envs.calculator:Calculator",
        "--prompt-data",
        "envs/data/calculator.jsonl",
        "--num-tasks",
        "3",
        "--n-samples-per-prompt",
        "2",
        "--max-turns",
        "3",
        "--rollout-max-turn-len",
        "32",
        "--hf-checkpoint",
        str(tiny_ckpt),
        "--output",
        str(out),
    )
    assert r.returncode == 0, r.stderr
    summary = json.loads(r.stdout)
    samples = read_samples(out)
    assert summary["samples"] == len(samples) == 6
    assert sorted(s["index"] for s in samples) == list(range(6))
    assert sorted({s["group_index"] for s in samples}) == [0, 1, 2]
    for s in samples:
        assert s["status"] in ("completed", "truncated")
        assert len(s["loss_mask"]) == len(s["rollout_log_probs"]) == s["response_length"] > 0
        assert s["label"] and s["prompt"][0]["role"] == "system"
        assert s["reward"] == sum(s["metadata"]["turn_rewards"])


def test_rollout_against_running_engines_with_registered_id(tiny_server, tiny_ckpt, tmp_path):
    out = tmp_path / "s.jsonl"
    r = run(
        "rollout",
        "--env",
        "agentrl/Calculator-v0",
        "--num-tasks",
        "2",
        "--engine-url",
        tiny_server,
        "--engine-url",
        tiny_server,
        "--hf-checkpoint",
        str(tiny_ckpt),
        "--rollout-max-turn-len",
        "16",
        "--output",
        str(out),
    )
    assert r.returncode == 0, r.stderr
    assert len(read_samples(out)) == 2


def test_custom_generate_and_reward_functions(tiny_server, tiny_ckpt, tmp_path):
    (tmp_path / "custom.py").write_text(
        textwrap.dedent("""
        from agentrl.engines.base import SamplingParams

        async def generate(args, sample, sampling_params):
            ids = args.tokenizer.encode("<|im_start|>user\\n" + sample.prompt + "<|im_end|>\\n<|im_start|>assistant\\n")
            out = await args.engine.generate(ids, SamplingParams(**sampling_params))
            sample.tokens = ids + out.output_ids
            sample.response_length = len(out.output_ids)
            sample.loss_mask = [1] * len(out.output_ids)
            sample.rollout_log_probs = out.output_logprobs
            sample.response = args.tokenizer.decode(out.output_ids)
            sample.reward = 0.25
            return sample

        def reward_func(args, sample):
            return 1.0 if sample.label == "yes" else 0.5
    """)
    )
    data = tmp_path / "tasks.jsonl"
    data.write_text('{"question": "a?", "answer": "yes"}\n{"question": "b?", "answer": "no"}\n')
    out = tmp_path / "s.jsonl"
    r = run(
        "rollout",
        "--custom-generate-function-path",
        f"{tmp_path}/custom.py:generate",
        "--custom-rm-path",
        f"{tmp_path}/custom.py:reward_func",
        "--prompt-data",
        str(data),
        "--input-key",
        "question",
        "--label-key",
        "answer",
        "--engine-url",
        tiny_server,
        "--hf-checkpoint",
        str(tiny_ckpt),
        "--rollout-max-turn-len",
        "8",
        "--output",
        str(out),
    )
    assert r.returncode == 0, r.stderr
    samples = sorted(read_samples(out), key=lambda s: s["index"])
    assert [s["reward"] for s in samples] == [1.25, 0.75]
    assert [s["metadata"]["rm_reward"] for s in samples] == [1.0, 0.5]
    assert [s["prompt"] for s in samples] == ["a?", "b?"] and samples[0]["status"] == "completed"


@pytest.mark.parametrize(
    "flags,message",
    [
        (["--n-samples-per-prompt", "0"], "--n-samples-per-prompt must be >= 1"),
        (["--rollout-top-p", "0"], "--rollout-top-p must be in (0, 1]"),
        (["--env", "agentrl.envs.calculator:Nope"], "has no attribute 'Nope'"),
        (["--prompt-data", "/nonexistent.jsonl"], "No such file"),
        (["--input-key", "question"], "no 'question' key"),
        (["--hf-checkpoint", "/nonexistent"], "not a local Hugging Face checkpoint"),
    ],
)
def test_bad_configuration_is_refused_before_work_starts(flags, message):
    base = {"--env": "agentrl.envs.calculator:Calculator", "--prompt-data": "envs/data/calculator.jsonl"}
    args = ["rollout"]
    for k, v in base.items():
        if k not in flags:
            args += [k, v]
    r = run(*args, *flags, timeout=60)
    assert r.returncode == 2 and message in r.stderr, r.stderr


@pytest.mark.parametrize(
    "flags,message",
    [
        (["--global-batch-size", "0"], "--global-batch-size must be >= 1"),  # was a ZeroDivisionError traceback
        (["--rollout-temperature", "1e400"], "--rollout-temperature must be a finite number"),  # was accepted
        (["--rollout-stop-token-ids", "-5"], "--rollout-stop-token-ids must be token ids"),  # was accepted
        (["--rollout-top-k", str(2**63)], "--rollout-top-k must be -1 (off) or in [1,"),  # killed the engine
        (["--env", "nomod:Cls"], "--env nomod:Cls: 'nomod:Cls': no module named 'nomod'"),
        (["--prompt-data", "/nonexistent.jsonl"], "--prompt-data /nonexistent.jsonl: "),
        (["--eval-prompt-data", "x", "/nonexistent.jsonl"], "--eval-prompt-data x /nonexistent.jsonl: "),
        (["--load", "FILE"], "is a file; pass the run folder"),  # started a fresh run
        (["--load", "CORRUPT"], "should hold the newest step number"),  # was a bare int() ValueError
    ],
)
def test_bad_train_flags_are_refused_naming_the_flag(flags, message, tmp_path, capsys):
    from agentrl.cli import main

    if "FILE" in flags:
        (tmp_path / "f").write_text("not a run")
        flags = [f if f != "FILE" else str(tmp_path / "f") for f in flags]
    if "CORRUPT" in flags:
        (tmp_path / "run").mkdir()
        (tmp_path / "run" / "latest_checkpointed_iteration.txt").write_text("three\n")
        flags = [f if f != "CORRUPT" else str(tmp_path / "run") for f in flags]
    assert main(["train", "--env", "agentrl.envs.calculator:Calculator", "--num-rollout", "1", *flags]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err, err


def test_chat_api_against_the_engine_the_command_started(tiny_ckpt, tmp_path):
    """``--engine-api chat`` without ``--engine-url``: the chat client must send the started engine's own key."""
    out = tmp_path / "samples.jsonl"
    r = run(
        "rollout",
        "--env",
        "agentrl.envs.calculator:Calculator",
        "--prompt-data",
        "envs/data/calculator.jsonl",
        "--num-tasks",
        "2",
        "--max-turns",
        "2",
        "--rollout-max-turn-len",
        "16",
        "--engine-api",
        "chat",
        "--hf-checkpoint",
        str(tiny_ckpt),
        "--output",
        str(out),
    )
    assert r.returncode == 0, r.stderr[-2000:]
    samples = read_samples(out)
    assert len(samples) == 2 and all(s["status"] in ("completed", "truncated") for s in samples), samples
    assert all(s["token_exact"] is False for s in samples)


def test_check_env_reports_a_broken_tasks(tmp_path):
    (tmp_path / "broken.py").write_text(
        textwrap.dedent("""
        import agentrl
        class Broken(agentrl.Env):
            @staticmethod
            def tasks():
                return [{"question": "no prompt key"}]
            async def reset(self, *, seed=None, options=None):
                return [{"role": "user", "content": "hi"}], {}
            async def step(self, action):
                return [], 0.0, True, False, {}
    """)
    )
    r = run("check-env", "--env", f"{tmp_path}/broken.py:Broken")
    assert r.returncode == 2 and "--env" in r.stderr and "prompt" in r.stderr, r.stdout + r.stderr


def test_check_env_exit_codes(tmp_path):
    r = run("check-env", "--env", "agentrl.envs.calculator:Calculator")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "0 contract violation(s)" in r.stdout
    (tmp_path / "bad.py").write_text(
        textwrap.dedent("""
        import agentrl
        class Bad(agentrl.Env):
            async def reset(self, *, seed=None, options=None):
                return "hello", {}
    """)
    )
    r = run("check-env", "--env", f"{tmp_path}/bad.py:Bad", "--json")
    assert r.returncode == 1
    report = json.loads(r.stdout)
    assert report["violations"] > 0 and "reset() must return a list of messages" in report["results"][0]["detail"]
