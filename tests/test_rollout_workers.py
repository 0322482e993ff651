"""Rollout workers (``--rollout-num-workers``): episodes in Ray actors across nodes.

The end-to-end test runs a real three-node Ray cluster on this machine (``ray.cluster_utils.Cluster``,
every node on loopback) in a child process: the head node holds engine and trainer, two nodes with a
``rollout_host`` resource hold one worker each. One worker is SIGKILLed mid-group with a sandbox open,
another hangs with its event loop blocked; the run must finish with every group complete.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from agentrl.config import RolloutConfig, RunConfig, TrainConfig

REPO = Path(__file__).resolve().parents[1]


def _cfg(**kw) -> RunConfig:
    base = {"env": "agentrl.envs.digits:Digits", "rollout_batch_size": 2}
    return RunConfig(
        **{**base, **kw},
        rollout=RolloutConfig(n_samples_per_prompt=4),
        train=TrainConfig(global_batch_size=8),
    )


@pytest.mark.parametrize(
    "kw,message",
    [
        ({"rollout_num_workers": 0}, "--rollout-num-workers must be an integer in"),
        ({"rollout_num_workers": 2000}, "--rollout-num-workers must be an integer in"),
        ({"rollout_num_workers": 2, "rollout_worker_cpus": -1.0}, "--rollout-worker-cpus must be"),
        ({"rollout_num_workers": 2, "rollout_worker_cpus": float("nan")}, "--rollout-worker-cpus must be"),
        ({"rollout_num_workers": 2, "rollout_worker_resources": ["sandbox_host"]}, "NAME=AMOUNT"),
        ({"rollout_num_workers": 2, "rollout_worker_resources": ["sandbox_host=0"]}, "NAME=AMOUNT"),
        ({"rollout_num_workers": 2, "rollout_worker_resources": ["=1"]}, "NAME=AMOUNT"),
        ({"rollout_num_workers": 2, "rollout_worker_resources": ["a=0.00001"]}, "NAME=AMOUNT"),
        ({"rollout_num_workers": 2, "rollout_worker_resources": ["CPU=2"]}, "CPUs are --rollout-worker-cpus"),
        ({"rollout_num_workers": 2, "rollout_worker_resources": ["GPU=1"]}, "not custom resources"),
        ({"rollout_num_workers": 2, "rollout_worker_resources": ["a=1", "a=2"]}, "names a resource twice"),
        ({"rollout_num_workers": 2, "rollout_worker_timeout": 0.0}, "--rollout-worker-timeout must be"),
        ({"rollout_num_workers": 2, "rollout_worker_timeout": float("inf")}, "--rollout-worker-timeout must be"),
        ({"rollout_worker_cpus": 2.0}, "need --rollout-num-workers > 1"),
        ({"rollout_worker_resources": ["sandbox_host=1"]}, "need --rollout-num-workers > 1"),
        ({"rollout_num_workers": 2, "rollout_function_path": "m:f"}, "cannot be split across"),
    ],
)
def test_bad_worker_flags_are_refused_naming_the_flag(kw, message):
    problems = _cfg(**kw).problems()
    assert any(message in p for p in problems), problems


@pytest.mark.parametrize(
    "values,message",
    [
        ({"rollout_num_workers": "two"}, "--rollout-num-workers must be an integer"),
        ({"rollout_num_workers": 2.5}, "--rollout-num-workers must be an integer"),
        ({"rollout_num_workers": 2, "rollout_worker_cpus": True}, "--rollout-worker-cpus must be a finite number"),
        ({"rollout_num_workers": 2, "rollout_worker_resources": "a=1"}, "NAME=AMOUNT entries"),
        ({"rollout_num_workers": 2, "rollout_worker_timeout": "5"}, "--rollout-worker-timeout must be"),
    ],
)
def test_config_file_values_of_the_wrong_type_are_refused(values, message):
    from agentrl.flags import run_config_from_values

    with pytest.raises(ValueError, match=message):
        run_config_from_values({"env": "agentrl.envs.digits:Digits", **values}).validate()


def test_the_cli_builds_the_worker_flags(monkeypatch):
    from agentrl import cli

    seen = {}
    monkeypatch.setattr("agentrl.cli.train", lambda cfg: seen.setdefault("cfg", cfg) and {})
    argv = ["train", "--env", "agentrl.envs.digits:Digits", "--rollout-num-workers", "4", "--rollout-worker-cpus"]
    argv += ["0.5", "--rollout-worker-resources", "sandbox_host=1", "--rollout-worker-resources", "big_disk=2"]
    assert cli.main([*argv, "--rollout-worker-timeout", "30"]) == 0
    cfg = seen["cfg"]
    assert (cfg.rollout_num_workers, cfg.rollout_worker_cpus, cfg.rollout_worker_timeout) == (4, 0.5, 30.0)
    assert cfg.worker_resources == {"sandbox_host": 1.0, "big_disk": 2.0}


def test_an_engine_on_every_interface_is_reached_at_its_node_address(ray_local):
    from agentrl.runtime.engine_group import _reachable_host

    assert _reachable_host("127.0.0.1") == "127.0.0.1"
    assert _reachable_host("0.0.0.0") == ray_local.util.get_node_ip_address() != "0.0.0.0"


def test_worker_resources_parse_to_a_dict():
    cfg = _cfg(rollout_num_workers=2, rollout_worker_resources=["sandbox_host=1", "gpu_free=0.5"])
    assert cfg.problems() == []
    assert cfg.worker_resources == {"sandbox_host": 1.0, "gpu_free": 0.5}


@pytest.mark.e2e
@pytest.mark.parametrize(
    "kw,named",
    [
        ({"rollout_num_workers": 3, "rollout_worker_cpus": 1.0}, "CPU"),  # the local cluster has 2, all reserved
        (
            {"rollout_num_workers": 2, "rollout_worker_cpus": 0.0, "rollout_worker_resources": ["rollout_host=1"]},
            "rollout_host",
        ),
    ],
)
def test_a_worker_count_the_cluster_cannot_place_is_refused_before_any_model_loads(
    tiny_ckpt, tmp_path, ray_local, kw, named
):
    from agentrl.runtime.train import train

    cfg = _cfg(hf_checkpoint=str(tiny_ckpt), num_rollout=1, **kw)
    with pytest.raises(ValueError, match=f"--rollout-num-workers .*{named}"):
        train(cfg)
    # nothing was left behind: the reserved bundles go back (Ray frees them asynchronously)
    deadline = time.monotonic() + 30
    while ray_local.available_resources().get("CPU") != ray_local.cluster_resources().get("CPU"):
        assert time.monotonic() < deadline, ray_local.available_resources()
        time.sleep(0.2)


def _rescore(model, tokens: list[int], temperature: float) -> torch.Tensor:
    with torch.no_grad():
        logits = model(torch.tensor([tokens])).logits[0].float()
    lp = torch.log_softmax(logits / temperature, dim=-1)
    return lp[:-1].gather(1, torch.tensor(tokens[1:]).unsqueeze(1)).squeeze(1)


def _docker_up() -> bool:
    if shutil.which("docker") is None:
        return False
    return subprocess.run(["docker", "info"], capture_output=True, timeout=30).returncode == 0


@pytest.mark.e2e
def test_two_workers_on_two_nodes_survive_a_killed_and_a_hung_worker(tiny_ckpt, tmp_path):
    """A real multi-node cluster: episodes run on the worker nodes (never the head), their samples are
    token-exact (re-scored by the model they were sampled from), each sandbox was created by the worker
    process that ran the episode, on its node; a SIGKILLed and a hung worker are replaced, their groups
    re-run (every group complete), counted in metrics.jsonl, and the dead workers' containers removed."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from agentrl.chat import ChatTemplate

    backend = "docker" if _docker_up() else "process"
    out = tmp_path / "out"
    proc = subprocess.run(
        [
            sys.executable,
            str(REPO / "tests" / "_rollout_workers_run.py"),
            str(tiny_ckpt),
            str(out),
            "--sandbox",
            backend,
        ],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=REPO,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    nodes = result["nodes"]
    worker_nodes = {n for n, res in nodes.items() if res.get("rollout_host")}
    assert len(nodes) == 3 and len(worker_nodes) == 2

    steps = [json.loads(line) for line in open(out / "steps.jsonl")]
    killed = json.loads((out / "killed.json").read_text())
    hung = json.loads((out / "hung.json").read_text())
    assert killed["pid"] != hung["pid"]
    # both worker nodes ran episodes, the head none (after the faults the survivors may be on one node)
    assert {s["node"] for s in [*steps, killed, hung]} == worker_nodes
    assert all(s["stdout"] == "hi" for s in steps)
    assert {s["pid"] for s in steps}.isdisjoint({killed["pid"], hung["pid"]})  # nothing after the faults there
    if backend == "docker":
        for s in [*steps, killed, hung]:  # created by the process that ran the episode, on that process's node
            assert s["labels"]["agentrl.owner_pid"] == str(s["pid"])
        for dead in (killed, hung):  # removed on their node at once (their ttl is an hour away)
            gone = subprocess.run(["docker", "inspect", dead["container"]], capture_output=True, timeout=30)
            assert gone.returncode != 0, f"the dead worker's sandbox {dead['container'][:12]} is still there"

    lines = [json.loads(line) for line in open(out / "run" / "metrics.jsonl")]
    assert len(lines) == 2
    assert sum(x["rollout_worker_restarts"] for x in lines) == 2
    assert sum(x["rollout_groups_rerun"] for x in lines) >= 2
    if backend == "docker":  # removed by the task pinned to their node (the env turns off each worker's own
        # first-use reaper, which would otherwise race it for containers whose owner is dead)
        # (at least the two containers the dying steps held open; their workers' other episodes may hold more)
        assert sum(x["rollout_sandboxes_reaped"] for x in lines) >= 2

    tok = AutoTokenizer.from_pretrained(tiny_ckpt)
    template = ChatTemplate(tok)
    model = AutoModelForCausalLM.from_pretrained(tiny_ckpt, dtype=torch.float32).eval()
    for step in range(2):
        samples = [json.loads(line) for line in open(out / "run" / "rollouts" / f"rollout_{step:06d}.jsonl")]
        # every group complete, each sample once: 4 groups x 2 samples with the in-process loop's indices
        assert sorted(s["index"] for s in samples) == list(range(8))
        assert sorted(s["group_index"] % 10_000 for s in samples) == [0, 0, 1, 1, 2, 2, 3, 3]
        assert all(s["status"] in ("completed", "truncated") and s["token_exact"] for s in samples)
        if step:
            continue  # step 1 sampled from trained weights; step 0 from the checkpoint on disk
        for s in samples:
            prompt_length = len(s["tokens"]) - s["response_length"]
            assert s["tokens"][:prompt_length] == template.prompt(s["prompt"], [])[1]
            lp = _rescore(model, s["tokens"], 1.0)[prompt_length - 1 :]
            mask = torch.tensor(s["loss_mask"], dtype=torch.bool)
            assert mask.sum() > 0 and len(s["weight_versions"]) >= 1
            diff = (lp[mask] - torch.tensor(s["rollout_log_probs"])[mask]).abs().max().item()
            assert diff < 1e-4, f"sample {s['index']}: max |rescored - rollout| = {diff}"
    if backend != "docker":
        pytest.skip("no Docker engine: the run used the process sandbox; the container checks did not run")


@pytest.mark.e2e
def test_async_dynamic_sampling_eval_and_a_reward_function_work_unchanged_with_workers(
    tiny_ckpt, tmp_path, ray_local, monkeypatch
):
    """Two workers on the one-node test cluster (0 CPUs reserved each): --async (bounded staleness, every
    turn's weight version recorded), dynamic sampling with over-sampling, a custom reward function loaded
    in the workers, eval on the driver, and the workers' peak memory in metrics.jsonl."""
    from agentrl.runtime.train import train

    (tmp_path / "worker_fns.py").write_text(
        "import os\n"
        "def keep_some(args, samples):\n"
        "    return samples[0].group_index % 3 != 0\n"
        "async def reward(args, sample):\n"
        "    sample.metadata['scored_by'] = os.getpid()\n"
        "    return 0.25\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))  # the workers get the driver's sys.path
    evalset = tmp_path / "eval.jsonl"
    evalset.write_text("".join(json.dumps({"prompt": f"eval {i}"}) + "\n" for i in range(2)))
    save = tmp_path / "run"
    cfg = _cfg(
        hf_checkpoint=str(tiny_ckpt),
        num_rollout=3,
        save=str(save),
        rollout_num_workers=2,
        rollout_worker_cpus=0.0,
        async_mode=True,
        over_sampling_batch_size=4,
        dynamic_sampling_filter_path="worker_fns:keep_some",
        custom_rm_path="worker_fns:reward",
        eval_prompt_data=[("held", str(evalset))],
        eval_interval=1,
    )
    cfg.rollout.max_turns, cfg.rollout.rollout_max_turn_len = 2, 8
    train(cfg)
    lines = [json.loads(line) for line in open(save / "metrics.jsonl")]
    assert len(lines) == 3 and lines[-1]["weight_version"] == 3
    assert sum(x["dropped_filter"] for x in lines) > 0
    assert all(x["rollout_worker_restarts"] == 0 for x in lines)  # (surplus groups from the buffer may be stale)
    assert all(x["rollout_worker_peak_rss_mb"] > 0 and "eval/held/num_prompts" in x for x in lines)
    scorers = set()
    for step in range(3):
        samples = [json.loads(line) for line in open(save / "rollouts" / f"rollout_{step:06d}.jsonl")]
        assert len(samples) == 8 and all(s["group_index"] % 3 != 0 for s in samples)
        fresh = [s for s in samples if s["metadata"]["rollout_id"] == step]  # not surplus from the buffer
        versions = {int(v) if v.isdigit() else 0 for s in fresh for v in s["weight_versions"]}
        assert versions and min(versions) >= step - 1 and max(versions) <= step, (step, versions)
        scorers |= {s["metadata"]["scored_by"] for s in samples}
    assert os.getpid() not in scorers and len(scorers) == 2  # scored in the two worker processes


def test_a_worker_that_reaches_no_engine_refuses_to_start_naming_the_flag():
    from agentrl.runtime.rollout_workers import _check_reachable

    with pytest.raises(RuntimeError, match="--engine-host 0.0.0.0"):
        _check_reachable(["http://127.0.0.1:9"])  # nothing listens on the discard port


@pytest.mark.e2e
def test_a_replacement_that_cannot_start_fails_its_group_instead_of_hanging(tiny_ckpt, tiny_server, ray_local):
    """A dead worker whose replacements cannot start (here: they reach no engine) fails the group after
    MAX_GROUP_ATTEMPTS replacements, with the reason; nothing waits forever."""
    import asyncio

    from agentrl.runtime.rollout_workers import MAX_GROUP_ATTEMPTS, RolloutWorkerGroup

    cfg = _cfg(hf_checkpoint=str(tiny_ckpt), rollout_num_workers=1, rollout_worker_cpus=0.0)
    cfg.rollout.max_turns, cfg.rollout.rollout_max_turn_len = 1, 4
    group = RolloutWorkerGroup(cfg, tiny_ckpt, [tiny_server], None)
    try:
        rows = [{"prompt": "Count to 3."}]
        (samples,) = asyncio.run(group.run_groups(rows, seed=1))
        assert [s.index for s in samples] == [0, 1, 2, 3] and group.restarts == 0
        group.urls = ["http://127.0.0.1:9"]  # what replacements get: an address with no engine
        ray_local.kill(group.workers[0], no_restart=True)
        with pytest.raises(RuntimeError, match=f"died {MAX_GROUP_ATTEMPTS} times in a row"):
            asyncio.run(group.run_groups(rows, seed=2))
        assert group.restarts == MAX_GROUP_ATTEMPTS and group.groups_rerun == MAX_GROUP_ATTEMPTS - 1
    finally:
        group.shutdown()


def test_args_the_workers_cannot_receive_are_refused_naming_the_attribute():
    import argparse
    import threading

    from agentrl.runtime.rollout_workers import check_worker_args

    ok = argparse.Namespace(lr=1e-6, tags=["a"], engine=threading.Lock())  # engine: bound in each worker itself
    check_worker_args(ok)
    with pytest.raises(ValueError, match=r"cannot be pickled: lock \(lock"):
        check_worker_args(argparse.Namespace(lr=1e-6, lock=threading.Lock()))
    with pytest.raises(ValueError, match="a tuple has none"):
        check_worker_args((1, 2))


@pytest.mark.e2e
def test_placement_counts_in_rays_units(ray_local):
    """2 free CPUs hold ten workers of 0.2 (2.0 // 0.2 is 9.0 in floats), not eleven."""
    from agentrl.runtime.rollout_workers import RolloutWorkerGroup

    free = ray_local.available_resources().get("CPU", 0.0)
    n = round(free / 0.2)
    assert n >= 5 and abs(n * 0.2 - free) < 1e-9, free  # whole multiples of 0.2 free (the test cluster has 2)
    RolloutWorkerGroup.check_placement(_cfg(rollout_num_workers=n, rollout_worker_cpus=0.2))
    with pytest.raises(ValueError, match=f"--rollout-num-workers {n + 1} needs {n + 1} x 0.2 CPU"):
        RolloutWorkerGroup.check_placement(_cfg(rollout_num_workers=n + 1, rollout_worker_cpus=0.2))
