"""`agentrl train` end to end on a tiny local model: config handling, checkpoints and resume after
SIGKILL, async mode staleness, dynamic sampling and the buffer, user data sources, eval, env faults.

Every run is real: a local Ray cluster, the embedded engine as a Ray actor behind HTTP, the torch
trainer as a Ray actor, weights synced through the object store (or disk/NCCL-over-gloo).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from agentrl.cli import main
from agentrl.config import RolloutConfig, RunConfig, TrainConfig

pytestmark = pytest.mark.e2e  # engine processes, Ray, several processes or a browser: see conftest

REPO = Path(__file__).resolve().parents[1]


def _cfg(ckpt, save, **kw) -> RunConfig:
    rollout = kw.pop("rollout", {})
    train_kw = kw.pop("train", {})
    base = dict(
        env="agentrl.envs.digits:Digits", hf_checkpoint=str(ckpt), num_rollout=2, rollout_batch_size=2, save=str(save)
    )
    base.update(kw)
    return RunConfig(
        rollout=RolloutConfig(**{"n_samples_per_prompt": 4, "max_turns": 2, "rollout_max_turn_len": 8, **rollout}),
        train=TrainConfig(**{"lr": 1e-3, "global_batch_size": 8, **train_kw}),
        **base,
    )


def _lines(save) -> list[dict]:
    return [json.loads(line) for line in open(Path(save) / "metrics.jsonl")]


def _dump(save, step) -> list[dict]:
    return [json.loads(line) for line in open(Path(save) / "rollouts" / f"rollout_{step:06d}.jsonl")]


def _step_prompts(save, steps) -> list[list[str]]:
    return [sorted({s["metadata"]["task"]["prompt"] for s in _dump(save, k)}) for k in range(steps)]


def test_bad_config_is_refused_before_any_work(tmp_path, capsys):
    save = tmp_path / "run"
    rc = main(
        [
            "train",
            "--env",
            "agentrl.envs.digits:Digits",
            "--rollout-batch-size",
            "3",
            "--n-samples-per-prompt",
            "2",
            "--global-batch-size",
            "4",
            "--save",
            str(save),
        ]
    )
    assert rc == 2
    err = capsys.readouterr().err
    assert "--global-batch-size (4) must divide" in err
    assert not save.exists()
    cfg_file = tmp_path / "c.yaml"
    cfg_file.write_text("rollout_batch_size: 2\nnot_a_flag: 1\n")
    assert main(["train", "--config", str(cfg_file), "--env", "agentrl.envs.digits:Digits"]) == 2
    assert "unknown keys ['not_a_flag']" in capsys.readouterr().err
    assert main(["train", "--env", "envs.nope:Missing"]) == 2


def test_config_file_flags_override_and_resolved_config_is_saved(tiny_ckpt, tmp_path, ray_local, capsys):
    cfg_file = tmp_path / "exp.toml"
    cfg_file.write_text(
        'env = "agentrl.envs.digits:Digits"\nnum_rollout = 5\nrollout_batch_size = 2\nlr = 0.002\n'
        "n_samples_per_prompt = 2\nglobal_batch_size = 4\nrollout_max_turn_len = 8\nmax_turns = 1\n"
    )
    save = tmp_path / "run"
    rc = main(
        [
            "train",
            "--config",
            str(cfg_file),
            "--num-rollout",
            "1",
            "--hf-checkpoint",
            str(tiny_ckpt),
            "--save",
            str(save),
        ]
    )
    assert rc == 0, capsys.readouterr().err
    saved = json.loads((save / "config.json").read_text())
    assert saved["num_rollout"] == 1  # the flag won
    assert saved["train"]["lr"] == 0.002 and saved["rollout"]["n_samples_per_prompt"] == 2  # from the file
    assert len(_lines(save)) == 1
    assert (save / "iter_0000001" / "model.safetensors").is_file()  # --save keeps the final model, no interval needed
    # every actor's peak memory is in the step's line (a torch process with a model holds > 100 MiB)
    line = _lines(save)[0]
    for actor in ("trainer", "engine", "driver"):
        assert 100 < line[f"{actor}_peak_rss_mb"] < 24 * 1024, (actor, line)


def test_sigkill_then_resume_keeps_data_order(tiny_ckpt, tmp_path, ray_local):
    from transformers import AutoModelForCausalLM

    from agentrl.runtime.train import train

    steps = 4
    ref = tmp_path / "ref"
    train(_cfg(tiny_ckpt, ref, num_rollout=steps, save_interval=1))
    run = tmp_path / "run"
    cmd = [
        sys.executable,
        "-m",
        "agentrl",
        "train",
        "--env",
        "agentrl.envs.digits:Digits",
        "--hf-checkpoint",
        str(tiny_ckpt),
        "--num-rollout",
        str(steps),
        "--rollout-batch-size",
        "2",
        "--n-samples-per-prompt",
        "4",
        "--max-turns",
        "2",
        "--rollout-max-turn-len",
        "8",
        "--global-batch-size",
        "8",
        "--lr",
        "1e-3",
        "--save",
        str(run),
        "--save-interval",
        "1",
    ]
    proc = subprocess.Popen(
        cmd,
        cwd=REPO,
        start_new_session=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env={**os.environ, "RAY_ADDRESS": ""},
    )
    try:
        deadline = time.monotonic() + 240
        while not (run / "iter_0000002" / "loop_state.json").exists():
            assert proc.poll() is None and time.monotonic() < deadline, "the run never reached its 2nd checkpoint"
            time.sleep(0.05)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    summary = train(_cfg(tiny_ckpt, run, num_rollout=steps, save_interval=1, load=str(run)))
    assert summary["weight_version"] == steps
    assert [line["step"] for line in _lines(run)] == list(range(steps))  # no duplicates, nothing missing
    assert _step_prompts(run, steps) == _step_prompts(ref, steps)  # same data order as the uninterrupted run
    model = AutoModelForCausalLM.from_pretrained(run / f"iter_{steps:07d}")
    assert model.config.vocab_size > 0
    assert (run / "latest_checkpointed_iteration.txt").read_text() == str(steps)


def test_async_mode_bounds_staleness(tiny_ckpt, tmp_path, ray_local):
    from agentrl.runtime.train import train

    save = tmp_path / "run"
    train(_cfg(tiny_ckpt, save, num_rollout=4, async_mode=True, max_staleness=1))
    for step in range(4):
        versions = {int(v) if v.isdigit() else 0 for s in _dump(save, step) for v in s["weight_versions"]}
        # rollout k+1 starts while step k trains: it is sampled with version k (or k+1 after the push lands)
        assert versions and min(versions) >= step - 1 and max(versions) <= step, (step, versions)
    lines = _lines(save)
    assert all(line["dropped_stale"] == 0 for line in lines)
    assert lines[-1]["weight_version"] == 4


def test_async_buffer_size_collects_rollouts_further_ahead(tiny_ckpt, tmp_path, ray_local):
    """slime's --async-buffer-size 2: rollouts k+1 and k+2 run while step k trains, so a step can train on
    samples two versions old (never more); --max-staleness must allow it."""
    from agentrl.runtime.train import train

    with pytest.raises(ValueError, match="--max-staleness must be >= 2 .* --async-buffer-size 2"):
        _cfg(tiny_ckpt, tmp_path, async_mode=True, async_buffer_size=2, max_staleness=1).validate()
    with pytest.raises(ValueError, match="--async-buffer-size buffers rollouts ahead of training: it needs --async"):
        _cfg(tiny_ckpt, tmp_path, async_buffer_size=2).validate()
    save = tmp_path / "run"
    train(_cfg(tiny_ckpt, save, num_rollout=5, async_mode=True, async_buffer_size=2, max_staleness=2))
    oldest = []
    for step in range(5):
        versions = {int(v) if v.isdigit() else 0 for s in _dump(save, step) for v in s["weight_versions"]}
        assert versions and min(versions) >= step - 2 and max(versions) <= step, (step, versions)
        oldest.append(min(versions))
    # with one rollout ahead no step could see a sample two versions old; two ahead, some step does
    assert any(oldest[step] == step - 2 for step in range(2, 5)), oldest
    assert all(line["dropped_stale"] == 0 for line in _lines(save)) and len(_lines(save)) == 5


def test_dynamic_sampling_and_buffer_filter(tiny_ckpt, tmp_path, ray_local, monkeypatch):
    from agentrl.runtime.train import train

    (tmp_path / "user_fns.py").write_text(
        "calls = []\n"
        "def keep_some(args, samples):\n"
        "    return samples[0].group_index % 3 != 0\n"
        "def newest_first(args, buffer, num_samples):\n"
        "    calls.append(len(buffer))\n"
        "    return list(reversed(buffer))[:num_samples]\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    save = tmp_path / "run"
    train(
        _cfg(
            tiny_ckpt,
            save,
            num_rollout=3,
            over_sampling_batch_size=4,
            dynamic_sampling_filter_path="user_fns:keep_some",
            buffer_filter_path="user_fns:newest_first",
        )
    )
    lines = _lines(save)
    assert sum(line["dropped_filter"] for line in lines) > 0
    assert sum(line["buffer_reused"] for line in lines) > 0  # surplus groups came back on a later step
    import user_fns

    assert user_fns.calls, "the buffer filter was never consulted"
    for step in range(3):
        assert all(s["group_index"] % 3 != 0 for s in _dump(save, step) if s["metadata"]["rollout_id"] == step)


def test_rollout_sample_filter_keeps_removed_samples_out_of_the_loss(tiny_ckpt, tmp_path, ray_local, monkeypatch):
    """slime's --rollout-sample-filter-path: removed samples are dumped and counted, their advantages
    computed with their group, and the trainer trains none of their tokens."""
    from agentrl.runtime.train import train

    (tmp_path / "odd_filter.py").write_text(
        "def drop_odd(args, groups):\n"
        "    for g in groups:\n"
        "        for s in g:\n"
        "            s.remove_sample = s.index % 2 == 1\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    save = tmp_path / "run"
    train(_cfg(tiny_ckpt, save, num_rollout=1, rollout_sample_filter_path="odd_filter:drop_odd"))
    (line,) = _lines(save)
    dump = _dump(save, 0)
    removed = [s for s in dump if s["remove_sample"]]
    assert removed and all(s["index"] % 2 == 1 for s in removed) and line["count_remove_sample"] == len(removed)
    trained = [s for s in dump if "advantages" in s]
    assert any(s["remove_sample"] for s in trained)
    # the trainer trained exactly the tokens of the samples that were not removed
    assert line["train_tokens"] == sum(sum(s["loss_mask"]) for s in trained if not s["remove_sample"])
    assert all(s["non_generation_time"] > 0 for s in dump)  # Digits' reset and steps were timed


def test_over_long_samples_are_masked_and_penalized(tiny_ckpt, tmp_path, ray_local):
    """--mask-truncated-samples keeps length-cut samples out of the loss (in their group's baseline) and
    counts them; --overlong-buffer-len shapes every reward with DAPO's ramp before the advantages."""
    from agentrl.rollout.reward import LENGTH_LIMITS, overlong_penalty
    from agentrl.runtime.train import train

    save = tmp_path / "run"
    cfg = _cfg(
        tiny_ckpt,
        save,
        num_rollout=1,
        mask_truncated_samples=True,
        overlong_buffer_len=6,
        overlong_penalty_factor=0.5,
        rollout={"rollout_max_response_len": 10},
    )
    train(cfg)
    (line,) = _lines(save)
    dump = _dump(save, 0)
    for s in dump:
        assert s["metadata"]["overlong_penalty"] == overlong_penalty(s["response_length"], 10, 6, 0.5)
        assert s["reward"] == pytest.approx(sum(s["metadata"]["turn_rewards"]) + s["metadata"]["overlong_penalty"])
    assert any(s["metadata"]["overlong_penalty"] < 0 for s in dump)
    trained = [s for s in dump if "advantages" in s]
    cut = [s for s in trained if s["status"] == "truncated" and s["metadata"]["status_reason"] in LENGTH_LIMITS]
    assert cut and line["masked_truncated"] == len(cut)
    # the trainer trained exactly the tokens of the samples no length limit cut
    assert line["train_tokens"] == sum(sum(s["loss_mask"]) for s in trained if s not in cut)


def test_custom_loss_trains_with_train_metadata_set_by_a_filter(tiny_ckpt, tmp_path, ray_local, monkeypatch):
    """slime's custom loss path end to end: a sample filter sets train_metadata, the trainer actor loads
    --custom-loss-function-path and hands it every sample's metadata; its metrics reach metrics.jsonl."""
    from agentrl.runtime.train import train

    from .test_custom_loss import LOSSES

    (tmp_path / "my_losses.py").write_text(LOSSES)
    (tmp_path / "weights_filter.py").write_text(
        "def weigh(args, groups):\n"
        "    for g in groups:\n"
        "        for s in g:\n"
        "            s.train_metadata = {'w': float(s.index % 2)}\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    save = tmp_path / "run"
    cfg = _cfg(tiny_ckpt, save, num_rollout=1, rollout_sample_filter_path="weights_filter:weigh")
    cfg.train.loss_type, cfg.train.custom_loss_function_path = "custom_loss", f"{tmp_path}/my_losses.py:weighted"
    train(cfg)
    (line,) = _lines(save)
    dump = _dump(save, 0)
    assert all(s["train_metadata"] == {"w": float(s["index"] % 2)} for s in dump)
    trained = [s for s in dump if "advantages" in s]
    assert line["w_seen"] == sum(s["train_metadata"]["w"] for s in trained) > 0
    assert "weighted_nll" in line


def test_true_on_policy_mode_checks_trainer_against_engine_log_probs(tiny_ckpt, tmp_path, ray_local):
    """slime's --true-on-policy-mode: every step compares the trainer's log-probs of the sampled tokens with
    the engine's; within tolerance the gap is reported, beyond it the step fails before any update."""
    from agentrl.runtime.train import train

    save = tmp_path / "run"
    train(_cfg(tiny_ckpt, save, num_rollout=1, true_on_policy_mode=True))
    (line,) = _lines(save)
    assert 0 < line["true_on_policy_logprob_diff_max"] < 1e-3  # fp32 engine and trainer: rounding apart
    assert line["true_on_policy_logprob_diff_mean"] <= line["true_on_policy_logprob_diff_max"]
    with pytest.raises(RuntimeError, match="--true-on-policy-mode: the trainer's log-probs differ"):
        train(
            _cfg(
                tiny_ckpt, tmp_path / "strict", num_rollout=1, true_on_policy_mode=True, true_on_policy_tolerance=1e-12
            )
        )


@pytest.mark.parametrize(
    "kw, message",
    [
        ({"async_mode": True}, "drop --async"),
        ({"update_weights_interval": 2, "max_staleness": 1}, "drop --async and --update-weights-interval"),
        ({"train": {"global_batch_size": 4, "num_steps_per_rollout": 2}}, "--num-steps-per-rollout 1"),
        ({"true_on_policy_tolerance": 0.0}, "--true-on-policy-tolerance must be"),
        ({"allow_non_token_exact": True}, "not with --allow-non-token-exact"),
    ],
)
def test_true_on_policy_mode_refuses_what_would_make_it_off_policy(tiny_ckpt, tmp_path, kw, message):
    cfg = _cfg(tiny_ckpt, tmp_path, true_on_policy_mode=True, **kw)
    with pytest.raises(ValueError, match=message):
        cfg.validate()
    with pytest.raises(ValueError, match="--true-on-policy-tolerance is the check of --true-on-policy-mode"):
        _cfg(tiny_ckpt, tmp_path, true_on_policy_tolerance=1e-2).validate()


def test_a_batch_rollout_function_drives_training(tiny_ckpt, tmp_path, ray_local):
    """--rollout-function-path with the reference's batch signature replaces the env for a whole run."""
    from agentrl.runtime.train import train

    (tmp_path / "batch_fn.py").write_text(
        "calls = []\n"
        "async def rollout(args, samples, evaluation=False):\n"
        "    calls.append(len(samples))\n"
        "    for s in samples:\n"
        "        s.tokens = [5, 6, 7, 8 + s.index % 3]\n"
        "        s.response_length, s.loss_mask, s.rollout_log_probs = 1, [1], [-1.0]\n"
        "        s.reward = float(s.index % 2)\n"
        "    return samples\n"
    )
    save = tmp_path / "run"
    cfg = _cfg(tiny_ckpt, save, num_rollout=2, env=None, rollout_function_path=f"{tmp_path}/batch_fn.py:rollout")
    cfg.prompt_data = str(tmp_path / "rows.jsonl")
    cfg.eval_prompt_data, cfg.eval_interval = [("held", str(tmp_path / "rows.jsonl"))], 1  # evals use it too
    (tmp_path / "rows.jsonl").write_text("\n".join(json.dumps({"prompt": f"p{i}"}) for i in range(4)))
    train(cfg)
    lines = _lines(save)
    assert len(lines) == 2 and all(line["train_tokens"] == 8 for line in lines)  # 2 prompts x 4 samples x 1 token
    assert all(line["eval/held/reward_mean"] == 0.5 for line in lines)  # the function scored the eval: index % 2
    assert {s["metadata"]["status_reason"] for s in _dump(save, 1)} == {"rollout_function"}
    with pytest.raises(ValueError, match="pass one of them"):
        _cfg(tiny_ckpt, save, rollout_function_path="a:b", custom_generate_function_path="c:d").validate()


def test_user_data_source_and_eval_during_training(tiny_ckpt, tmp_path, ray_local, monkeypatch):
    from agentrl.runtime.train import train

    (tmp_path / "my_source.py").write_text(
        "from agentrl.envs.digits import Digits\n"
        "class NoTaskDigits(Digits):\n"
        "    tasks = None  # prompts come only from the data source\n"
        "class Source:\n"
        "    def __init__(self, args):\n"
        "        self.n = 0\n"
        "        self.added = 0\n"
        "    def get_samples(self, num_samples):\n"
        "        self.n += num_samples\n"
        "        return [{'prompt': f'custom prompt {self.n}-{i}', 'label': None} for i in range(num_samples)]\n"
        "    def add_samples(self, samples):\n"
        "        self.added += len(samples)\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    evalset = tmp_path / "eval.jsonl"
    evalset.write_text("".join(json.dumps({"prompt": f"eval {i}"}) + "\n" for i in range(2)))
    save = tmp_path / "run"
    train(
        _cfg(
            tiny_ckpt,
            save,
            env="my_source:NoTaskDigits",
            data_source_path="my_source:Source",
            eval_prompt_data=[("held", str(evalset))],
            eval_interval=1,
            n_samples_per_eval_prompt=2,
        )
    )
    assert all(s["metadata"]["task"]["prompt"].startswith("custom prompt") for s in _dump(save, 0))
    line = _lines(save)[0]
    assert line["eval/held/num_prompts"] == 2 and "eval/held/pass@2" in line


def test_failing_env_fails_samples_not_the_run(tiny_ckpt, tmp_path, ray_local, monkeypatch):
    from agentrl.runtime.train import train

    (tmp_path / "flaky_env.py").write_text(
        "from agentrl.envs.digits import Digits\n"
        "class Flaky(Digits):\n"
        "    async def step(self, action):\n"
        "        if 'custom' not in self.task.get('prompt', '') and hash(action.text) % 2:\n"
        "            raise RuntimeError('env bug')\n"
        "        return await super().step(action)\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    save = tmp_path / "run"
    summary = train(
        _cfg(
            tiny_ckpt, save, env="flaky_env:Flaky", rollout_batch_size=4, num_rollout=2, train={"global_batch_size": 16}
        )
    )
    lines = _lines(save)
    failed = sum(line["count_failed"] for line in lines)
    assert failed > 0 and sum(line["dropped_untrainable"] for line in lines) >= failed
    assert summary["weight_version"] == 2


@pytest.mark.parametrize("sync", ["shm", "object_store", "disk", "nccl"])
def test_weight_sync_modes_reach_the_engine(tiny_ckpt, tmp_path, ray_local, sync, monkeypatch):
    from agentrl.runtime import train as train_mod

    if sync == "object_store":  # what engines on another node get
        monkeypatch.setattr(train_mod._Runtime, "_same_node", lambda self: False)
    save = tmp_path / "run"
    summary = train_mod.train(
        _cfg(tiny_ckpt, save, num_rollout=2, weight_sync=sync if sync in ("disk", "nccl") else "tensor")
    )
    assert summary["weight_sync"] == [sync]  # every push took this route, through the one push call
    versions = {v for s in _dump(save, 1) for v in s["weight_versions"]}
    assert versions == {"1"}, versions  # step 1 was sampled with the weights trained at step 0


def test_group_rm_and_colocate(tiny_ckpt, tmp_path, ray_local, monkeypatch):
    from agentrl.engines.router import Router
    from agentrl.runtime.train import train

    (tmp_path / "group_rm.py").write_text(
        "def rank_bonus(args, samples):\n"
        "    assert len(samples) == args.n_samples_per_prompt\n"
        "    return [0.01 * i for i in range(len(samples))]\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    memory_calls = []
    real_release, real_resume = Router.release_memory_occupation, Router.resume_memory_occupation

    async def release(self, tags=None):
        memory_calls.append(("release", tags))
        await real_release(self, tags)

    async def resume(self, tags=None):
        memory_calls.append(("resume", tags))
        await real_resume(self, tags)

    monkeypatch.setattr(Router, "release_memory_occupation", release)
    monkeypatch.setattr(Router, "resume_memory_occupation", resume)
    save = tmp_path / "run"
    train(_cfg(tiny_ckpt, save, custom_rm_path="group_rm:rank_bonus", group_rm=True, colocate=True))
    samples = [s for s in _dump(save, 0) if s["status"] in ("completed", "truncated")]
    assert samples and all("rm_reward" in s["metadata"] for s in samples)
    assert {round(s["metadata"]["rm_reward"], 2) for s in samples} <= {0.0, 0.01, 0.02, 0.03}
    for s in samples:
        assert s["reward"] == pytest.approx(sum(s["metadata"]["turn_rewards"]) + s["metadata"]["rm_reward"])
    # colocated: engines release their KV cache around every train step and get it back
    assert memory_calls == [("release", ["kv_cache"]), ("resume", ["kv_cache"])] * 2


def test_eval_command_reports_pass_at_k(tiny_ckpt, tiny_server, tmp_path, capsys):
    evalset = tmp_path / "eval.jsonl"
    evalset.write_text("".join(json.dumps({"prompt": f"How many apples? {i}"}) + "\n" for i in range(3)))
    out = tmp_path / "eval.json"
    rc = main(
        [
            "eval",
            "--env",
            "agentrl.envs.digits:Digits",
            "--hf-checkpoint",
            str(tiny_ckpt),
            "--engine-url",
            tiny_server,
            "--eval-prompt-data",
            "digits",
            str(evalset),
            "--n-samples-per-eval-prompt",
            "4",
            "--success-threshold",
            "0.01",
            "--rollout-max-turn-len",
            "8",
            "--output",
            str(out),
        ]
    )
    assert rc == 0
    table = capsys.readouterr().out
    assert "pass@4" in table and "digits" in table
    res = json.loads(out.read_text())["digits"]
    assert res["num_prompts"] == 3 and res["num_samples"] == 12
    assert 0.0 <= res["pass@1"] <= res["pass@2"] <= res["pass@4"] <= 1.0


def test_placement_reserves_bundles_only_for_actors_it_starts(ray_local):
    from agentrl.runtime.cluster import plan_placement

    for kw, engines in (({}, 2), ({"engine_url": ["http://127.0.0.1:9"]}, 0)):
        placement = plan_placement(RunConfig(env="agentrl.envs.digits:Digits", num_engines=2, **kw))
        try:
            assert len(placement.trainer) == 1 and len(placement.engines) == engines
            assert len(placement.group.bundle_specs) == 1 + engines
        finally:
            placement.release()


def test_initial_megatron_checkpoint_reaches_the_engines_before_the_first_rollout(tiny_ckpt, tmp_path, ray_local):
    """--initial-megatron-checkpoint: the trainer starts from the megatron checkpoint and the engines get those
    weights (version 0) before step 0 samples anything; refused before Ray starts without the megatron backend."""
    from agentrl.runtime.train import train
    from agentrl.trainer.megatron_compat import megatron_available

    if megatron_available():
        pytest.skip(megatron_available())
    from agentrl.trainer.megatron_trainer import MegatronTrainer

    from .test_megatron_trainer import _save_dist_checkpoint
    from .test_trainer import cfg, make_samples

    trained = MegatronTrainer(tiny_ckpt, cfg(lr=1e-2))
    trained.train_step(make_samples(6, seed=11))
    _save_dist_checkpoint(trained.model, tmp_path / "mlm")
    trained.close()
    run = tmp_path / "run"
    train(
        _cfg(
            tiny_ckpt,
            run,
            num_rollout=1,
            train_backend="megatron",
            train={"initial_megatron_checkpoint": str(tmp_path / "mlm")},
        )
    )
    versions = {v for s in _dump(run, 0) for v in s["weight_versions"]}
    assert versions == {"0"}, versions  # pushed before the first rollout (an unsynced engine says "default")
    with pytest.raises(ValueError, match="needs --train-backend megatron"):
        train(_cfg(tiny_ckpt, tmp_path / "x", train={"initial_megatron_checkpoint": str(tmp_path / "mlm")}))


def test_eval_command_runs_the_custom_generate_functions(tiny_ckpt, tiny_server, tmp_path, capsys, monkeypatch):
    """agentrl eval runs --custom-generate-function-path / --rollout-function-path (the batch one told
    evaluation=True), as train's evaluator does; they were accepted and ignored. No env needed then."""
    (tmp_path / "eval_gen.py").write_text(
        "SEEN = []\n"
        "def _fill(sample, reward):\n"
        "    sample.tokens, sample.response_length, sample.loss_mask, sample.rollout_log_probs = [1, 2], 1, [1], [-1.0]\n"
        "    sample.reward = reward\n"
        "    return sample\n"
        "async def one(args, sample, sampling_params):\n"
        "    return _fill(sample, 1.0 if 'yes' in sample.prompt else 0.0)\n"
        "async def batch(args, samples, evaluation=False):\n"
        "    SEEN.append(evaluation)\n"
        "    return [_fill(s, 1.0 if 'yes' in s.prompt else 0.0) for s in samples]\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    evalset = tmp_path / "eval.jsonl"
    evalset.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in ("yes", "no", "yes please", "nope")))
    base = ["eval", "--hf-checkpoint", str(tiny_ckpt), "--engine-url", tiny_server, "--eval-prompt-data", "d"]
    base += [str(evalset), "--n-samples-per-eval-prompt", "2"]
    for flag in ("--custom-generate-function-path", "--rollout-function-path"):
        out = tmp_path / f"{flag}.json"
        fn = "eval_gen:one" if flag.startswith("--custom") else "eval_gen:batch"
        assert main([*base, flag, fn, "--output", str(out)]) == 0, capsys.readouterr().err
        res = json.loads(out.read_text())["d"]
        assert res["num_samples"] == 8 and res["pass@1"] == pytest.approx(0.5)
    import eval_gen

    assert eval_gen.SEEN == [True]
