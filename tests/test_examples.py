"""The bundled example runs as its docstring says (tiny model instead of the default one)."""

from __future__ import annotations

import json

import pytest

from tests.conftest import REPO, cli_rollout, run_cli

pytestmark = pytest.mark.e2e  # engine processes, Ray, several processes or a browser: see conftest


def test_arithmetic_example_checks_and_rolls_out(tiny_server, tiny_ckpt, tmp_path):
    env, data = "examples/arithmetic/env.py:Arithmetic", "examples/arithmetic/tasks.jsonl"
    r = run_cli("check-env", "--env", env, "--prompt-data", data)
    assert r.returncode == 0, r.stdout + r.stderr
    r, samples = cli_rollout(env, tiny_ckpt, tmp_path, "--prompt-data", data, max_turns=4, engine_url=tiny_server)
    assert len(samples) == 8 and json.loads(r.stdout)["samples"] == 8
    assert all(s["label"] in {"42", "127", "7.75", "1000"} for s in samples)
    assert (REPO / data).is_file()


def test_main_job_configs_are_valid_and_the_held_out_set_is_unseen():
    from agentrl.envs.calculator import Calculator
    from agentrl.flags import load_config_file, run_config_from_values

    warm = run_config_from_values(load_config_file(REPO / "examples/calculator_agent/sft.yaml"))
    rl = run_config_from_values(load_config_file(REPO / "examples/calculator_agent/grpo.yaml"))
    warm.validate(), rl.validate()
    assert warm.is_sft and warm.demo_policy and not rl.is_sft and rl.hf_checkpoint == warm.save
    held_out = [json.loads(x) for x in open(REPO / "envs/data/calculator_test.jsonl")]
    train = {t["prompt"] for t in Calculator.tasks()}  # what the warm start and GRPO see (the env's own tasks)
    assert len(held_out) == 200 and not train & {t["prompt"] for t in held_out}


def test_main_job_rl_batches_see_every_template_once():
    # the reason grpo.yaml does not shuffle: a step that sees only some templates rewrites the others
    import re

    from agentrl.data import task_rows
    from agentrl.flags import load_config_file, run_config_from_values
    from agentrl.registry import load_env
    from agentrl.runtime.preflight import _data_source

    rl = run_config_from_values(load_config_file(REPO / "examples/calculator_agent/grpo.yaml"))
    src = _data_source(rl, task_rows(load_env(rl.env), rl.prompt_data), None)  # what `agentrl train` samples from
    for _ in range(rl.num_rollout):
        batch = src.get_samples(rl.rollout_batch_size)
        shapes = {re.sub(r"\d+", "N", t["prompt"]) for t in batch}  # the problem text without its numbers
        assert len(shapes) == len(batch) == 5, shapes


def test_gsm8k_report_configs_are_valid_and_train_on_the_train_split():
    from agentrl.envs.gsm8k import GSM8K
    from agentrl.flags import load_config_file, run_config_from_values

    sft = run_config_from_values(load_config_file(REPO / "examples/gsm8k/sft.yaml"))
    rl = run_config_from_values(load_config_file(REPO / "examples/gsm8k/grpo.yaml"))
    sft.validate(), rl.validate()
    assert sft.is_sft and sft.sft_data == "runs/gsm8k/sft.jsonl" and rl.hf_checkpoint == sft.save
    assert rl.prompt_data is None  # GRPO samples the env's own tasks(): the train split
    train = {t["prompt"] for t in GSM8K.tasks()}
    test = {t["prompt"] for t in GSM8K.tasks(split="test")}
    assert len(train) > 7000 and len(test) > 1300 and not train & test
