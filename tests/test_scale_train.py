"""`agentrl train` on the scale path, end to end on CPU with the tiny model.

* ``--rollout-backend sglang``: servers launched as Ray actors by the SGLang launcher (here with
  ``--sglang-launcher agentrl``: ``agentrl serve``, the same API, since SGLang needs a GPU), one of
  them SIGKILLed mid-run: its requests fail over, the monitor restarts it on its port with the
  latest weights, the run finishes every step and leaves no server process behind;
* ``--train-backend megatron``: the megatron-core trainer raises the reward on the learning env
  (``agentrl.envs.digits``), as ``tests/test_learning.py`` asks of the ``torch`` backend.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import pytest

from agentrl.config import RolloutConfig, RunConfig, TrainConfig
from tests.conftest import REPO

pytestmark = pytest.mark.e2e  # engine processes, Ray, several processes or a browser: see conftest


def _server_processes(ckpt) -> list:
    import psutil

    found = []
    for p in psutil.process_iter(["cmdline", "status"]):
        cmd = p.info["cmdline"] or []
        if "serve" in cmd and str(ckpt) in cmd and p.info["status"] != psutil.STATUS_ZOMBIE:
            found.append(p)
    return found


def _lines(save) -> list[dict]:
    path = save / "metrics.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


_LOOPBACK_PROBE = """
import json, os, psutil, ray
from agentrl.runtime.cluster import init_ray

init_ray(num_cpus=1)
left = os.environ.get("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER")  # put back once the cluster is up


@ray.remote(num_cpus=0)
def node_ip():
    import ray

    return ray.util.get_node_ip_address()


session = ray._private.worker._global_node.get_session_dir_path()
listening = []
for p in psutil.process_iter(["cmdline"]):
    if any(session in part for part in p.info["cmdline"] or []):
        try:
            listening += [c.laddr.ip for c in p.net_connections("tcp") if c.status == psutil.CONN_LISTEN]
        except psutil.Error:
            pass
nodes = [n["NodeManagerAddress"] for n in ray.nodes()]
print(json.dumps({"nodes": nodes, "actor": ray.get(node_ip.remote()), "listening": listening, "left": left}))
"""


def test_a_local_cluster_binds_and_dials_loopback_only():
    """The private cluster ``init_ray`` starts lives on 127.0.0.1: its node address, an actor's view of it,
    and every TCP socket its GCS and raylet listen on. Ray on Linux would use the machine's network address;
    the child process starts without the switch the test suite's conftest sets, as a user's run does."""
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "RAY_ADDRESS")}
    out = subprocess.run(
        [sys.executable, "-c", _LOOPBACK_PROBE], env=env, cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr[-2000:]
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    assert seen["nodes"] == ["127.0.0.1"] and seen["actor"] == "127.0.0.1", seen
    assert seen["left"] is None, "the switch leaked into the driver's environment (its children would inherit it)"
    listening = {ip.removeprefix("::ffff:") for ip in seen["listening"]}
    assert listening, "found no listening socket of the cluster's own processes"
    assert listening <= {"127.0.0.1", "::1"}, seen


@pytest.mark.parametrize("weight_sync, async_mode", [("disk", False), ("nccl", False), ("nccl", True)])
def test_sglang_backend_trains_through_an_engine_kill(tiny_ckpt, tmp_path, ray_local, weight_sync, async_mode):
    """With ``nccl`` (gloo here) the restarted server has left the broadcast group: the next push builds a new one
    (also in ``--async``, where the embedded engine takes weights without a pause)."""
    from agentrl.runtime.train import train

    save = tmp_path / f"{weight_sync}-{async_mode}"
    cfg = RunConfig(
        env="agentrl.envs.digits:Digits",
        hf_checkpoint=str(tiny_ckpt),
        num_rollout=5,
        rollout_batch_size=4,
        save=str(save),
        num_engines=2,
        rollout_backend="sglang",
        sglang_launcher="agentrl",
        engine_monitor_interval=1.0,
        weight_sync=weight_sync,
        async_mode=async_mode,
        rollout=RolloutConfig(n_samples_per_prompt=4, max_turns=3, rollout_max_turn_len=16, rollout_seed=7),
        train=TrainConfig(lr=3e-3, global_batch_size=16, seed=7),
    )
    killed: list[int] = []
    others = {p.pid for p in _server_processes(tiny_ckpt)}  # e.g. the session's tiny_server fixture

    def launched() -> list:
        return [p for p in _server_processes(tiny_ckpt) if p.pid not in others]

    def kill_one_engine_after_the_first_step() -> None:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and not _lines(save):
            time.sleep(0.05)
        servers = launched()
        if servers:
            os.killpg(servers[0].pid, signal.SIGKILL)  # the server and everything it started, mid-rollout
            killed.append(servers[0].pid)

    killer = threading.Thread(target=kill_one_engine_after_the_first_step, daemon=True)
    killer.start()
    summary = train(cfg)
    killer.join(timeout=5)
    lines = _lines(save)
    assert killed, "no engine server process was found to kill"
    assert [x["weight_version"] for x in lines] == [1, 2, 3, 4, 5]
    assert summary["weight_version"] == 5
    # a step may lose the episodes that were on the killed engine mid-turn, never the run
    assert sum(x["train_samples"] for x in lines) >= 16 * 4
    logs = "".join(p.read_text(errors="replace") for p in (save / "engine_logs").iterdir())
    assert "start 2 of engine" in logs, "the killed engine was not restarted"
    deadline = time.monotonic() + 10
    while launched() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not launched(), "server processes outlived the run"


def _learning_config(ckpt, save, **train_kw) -> RunConfig:
    return RunConfig(
        env="agentrl.envs.digits:Digits",
        hf_checkpoint=str(ckpt),
        num_rollout=24,
        rollout_batch_size=8,
        save=str(save),
        train_backend="megatron",
        rollout=RolloutConfig(n_samples_per_prompt=8, max_turns=3, rollout_max_turn_len=16, rollout_seed=7),
        train=TrainConfig(lr=3e-3, global_batch_size=64, seed=7, **train_kw),
    )


def test_megatron_backend_raises_reward(tiny_ckpt, tmp_path, ray_local):
    pytest.importorskip("megatron.core")
    from agentrl.runtime.train import train

    save = tmp_path / "megatron"
    summary = train(_learning_config(tiny_ckpt, save))
    rewards = [x["reward_mean"] for x in _lines(save)]
    first, last = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    print(f"megatron: reward first {first:.3f} last {last:.3f} in {summary['wall_seconds']}s")
    assert len(rewards) == 24
    assert last > first + 0.05 and last > 2 * first, (first, last)
    ckpt = save / "iter_0000024"
    if ckpt.exists():  # the saved folder is a Hugging Face checkpoint
        from transformers import AutoModelForCausalLM

        AutoModelForCausalLM.from_pretrained(str(ckpt))


def test_sglang_backend_colocated_with_tensor_handles(tiny_ckpt, tmp_path, ray_local):
    """--colocate --weight-sync tensor: memory released/resumed around training, weights by handle, paused."""
    from agentrl.runtime.train import train

    save = tmp_path / "colocated"
    cfg = RunConfig(
        env="agentrl.envs.digits:Digits",
        hf_checkpoint=str(tiny_ckpt),
        num_rollout=3,
        rollout_batch_size=4,
        save=str(save),
        rollout_backend="sglang",
        sglang_launcher="agentrl",
        colocate=True,
        weight_sync="tensor",
        rollout=RolloutConfig(n_samples_per_prompt=4, max_turns=2, rollout_max_turn_len=16, rollout_seed=7),
        train=TrainConfig(lr=3e-3, global_batch_size=16, seed=7),
    )
    train(cfg)
    lines = _lines(save)
    assert [x["weight_version"] for x in lines] == [1, 2, 3]
    assert all(x["count_failed"] == 0 for x in lines)
    # every sample of step k was generated by weights k - 1: the engine reported each pushed version
    rollout = [json.loads(x) for x in (save / "rollouts" / "rollout_000002.jsonl").read_text().splitlines()]
    assert {v for s in rollout for v in s["weight_versions"]} == {"2"}
    assert not (save / "weight_sync").exists(), "tensor handles must not go through the disk"


@pytest.mark.parametrize("weight_sync", ["nccl", "tensor"])
def test_megatron_tp2_with_launched_engines(tiny_ckpt, tmp_path, ray_local, weight_sync):
    """Two trainer ranks holding one model copy (TP=2) push to launched servers by broadcast (gloo on CPU,
    the same code path as NCCL) or by tensor handles from each rank; the run's samples carry every version."""
    pytest.importorskip("megatron.core")
    from agentrl.runtime.train import train

    save = tmp_path / weight_sync
    cfg = RunConfig(
        env="agentrl.envs.digits:Digits",
        hf_checkpoint=str(tiny_ckpt),
        num_rollout=2,
        rollout_batch_size=4,
        save=str(save),
        train_backend="megatron",
        trainer_num_procs=2,
        rollout_backend="sglang",
        sglang_launcher="agentrl",
        weight_sync=weight_sync,
        num_engines=2 if weight_sync == "tensor" else 1,
        rollout=RolloutConfig(n_samples_per_prompt=4, max_turns=2, rollout_max_turn_len=16, rollout_seed=7),
        train=TrainConfig(lr=3e-3, global_batch_size=16, seed=7, tensor_model_parallel_size=2),
    )
    train(cfg)
    lines = _lines(save)
    assert [x["weight_version"] for x in lines] == [1, 2]
    assert all(x["count_failed"] == 0 and x["train_samples"] == 16 for x in lines)
    assert any(x["grad_norm"] > 0 for x in lines)  # a step whose groups all tie has nothing to learn
    rollout = [json.loads(x) for x in (save / "rollouts" / "rollout_000001.jsonl").read_text().splitlines()]
    assert {v for s in rollout for v in s["weight_versions"]} == {"1"}
