"""CoreShare: torch threads sized to the cores a process may use and the ones other processes leave free.

Real processes on this machine: a busy-looping child stands in for "another job on the machine" (what
made train steps 3.5-7x slower instead of ~2x), and the embedded engine's worker thread must shed a
core while it runs. The cgroup reader is checked on quota files laid out as cgroup v1 and v2 write them.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
import torch

from agentrl.cpu_share import CoreShare, cgroup_cpu_quota, usable_cores

BUSY = [sys.executable, "-c", "while True: pass"]


def test_cgroup_quotas_v1_and_v2_are_read_as_cores(tmp_path):
    (tmp_path / "job").mkdir()
    (tmp_path / "job" / "cpu.max").write_text("150000 100000\n")
    assert cgroup_cpu_quota(tmp_path, ["/job"]) == 1.5
    (tmp_path / "job" / "cpu.max").write_text("max 100000\n")
    assert cgroup_cpu_quota(tmp_path, ["/job"]) is None
    v1 = tmp_path / "cpu" / "docker" / "abc"
    v1.mkdir(parents=True)
    (v1 / "cpu.cfs_quota_us").write_text("50000\n")
    (v1 / "cpu.cfs_period_us").write_text("100000\n")
    assert cgroup_cpu_quota(tmp_path, ["/docker/abc"]) == 0.5
    (v1 / "cpu.cfs_quota_us").write_text("-1\n")
    assert cgroup_cpu_quota(tmp_path, ["/docker/abc"]) is None
    assert cgroup_cpu_quota(tmp_path, ["/nowhere"]) is None


def test_usable_cores_follow_the_affinity_mask():
    code = "import os; os.sched_setaffinity(0, {min(os.sched_getaffinity(0))}); "
    code += "from agentrl.cpu_share import usable_cores; print(usable_cores())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "1"
    assert 1 <= usable_cores() <= len(os.sched_getaffinity(0))


def test_the_v1_quota_of_a_container_is_its_cpu_mount(tmp_path):
    # inside a container /proc/self/cgroup names the host's path, but /sys/fs/cgroup/cpu is the container's
    (tmp_path / "cpu").mkdir()
    (tmp_path / "cpu" / "cpu.cfs_quota_us").write_text("200000\n")
    (tmp_path / "cpu" / "cpu.cfs_period_us").write_text("100000\n")
    assert cgroup_cpu_quota(tmp_path, ["/docker/0123abcd"]) == 2.0


def test_a_v2_parent_quota_binds_its_children(tmp_path):
    (tmp_path / "jobs" / "one").mkdir(parents=True)
    (tmp_path / "jobs" / "cpu.max").write_text("100000 100000\n")
    (tmp_path / "jobs" / "one" / "cpu.max").write_text("max 100000\n")
    assert cgroup_cpu_quota(tmp_path, ["/jobs/one"]) == 1.0


def test_the_floor_and_ceiling_hold():
    share = CoreShare(1, min_threads=5)
    assert share.max_threads == 1 and share.min_threads == 1  # the floor never exceeds the ceiling
    share = CoreShare(min_threads=usable_cores())
    assert share.settle(0.05) == usable_cores()  # at the floor whatever others do


def test_apply_sets_this_threads_torch_threads():
    before = torch.get_num_threads()
    share = CoreShare(1)
    try:
        assert share.max_threads == 1
        assert share.apply() == 1 and torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


@pytest.mark.skipif(usable_cores() < 2, reason="needs 2 usable cores to share")
def test_a_busy_process_takes_a_core_and_gives_it_back():
    cores = usable_cores()
    share = CoreShare(cores)
    quiet = share.settle(0.5)
    quiet_others = share.others
    if quiet_others > cores - 1.5:
        pytest.skip(f"the machine is already busy ({quiet_others:.1f} of {cores} cores): no core to take")
    busy = subprocess.Popen(BUSY)
    try:
        time.sleep(0.2)
        loaded = share.settle(0.5)
        assert share.others > quiet_others + 0.5, (share.others, quiet_others)
        assert loaded == max(1, cores - round(share.others)) < cores
    finally:
        busy.kill()
        busy.wait()
    assert quiet >= loaded


@pytest.mark.skipif(usable_cores() < 2, reason="needs 2 usable cores to share")
def test_the_engine_worker_sheds_a_core_to_a_busy_process(tiny_ckpt):
    import asyncio

    from agentrl.engines.local.engine import LocalEngine

    before = torch.get_num_threads()
    torch.set_num_threads(usable_cores())
    engine = LocalEngine(tiny_ckpt, max_running_requests=4, adaptive_threads=True, seed=0)
    busy = subprocess.Popen(BUSY)
    try:
        assert engine._cores is not None and engine._cores.current == usable_cores()
        engine._cores.min_window = 0.1

        async def run():
            params = {"max_new_tokens": 400, "temperature": 1.0, "ignore_eos": True}
            for _ in range(3):
                outs = await asyncio.gather(*(engine.generate([1, 2, 3], params) for _ in range(4)))
                assert all(o["meta_info"]["completion_tokens"] == 400 for o in outs)

        asyncio.run(run())
        assert engine._cores.others > 0.5 and engine._cores.current == usable_cores() - 1
    finally:
        busy.kill()
        busy.wait()
        asyncio.run(engine.close())
        torch.set_num_threads(before)


def test_threads_per_actor_sync_async_and_the_fixed_split():
    from types import SimpleNamespace

    from agentrl.config import RunConfig
    from agentrl.runtime.train import _threads

    cores = usable_cores()
    placement = SimpleNamespace(trainer_gpus=0, engine_gpus=0, critic=None, engines=[0])
    assert _threads(RunConfig(), placement) == (cores, cores, 1)  # one phase at a time: every core each
    half = max(1, cores // 2)
    assert _threads(RunConfig(async_mode=True), placement) == (cores, cores, half)  # adaptive, floored at half
    assert _threads(RunConfig(async_mode=True, cpu_threads="fixed"), placement) == (half, half, half)
    gpu = SimpleNamespace(trainer_gpus=1, engine_gpus=1, critic=None, engines=[0])
    assert _threads(RunConfig(), gpu) == (None, None, 1)


def test_the_token_budget_defaults_by_device_and_a_flag_wins():
    from agentrl.config import TrainConfig

    assert TrainConfig().token_budget("cpu") == 512 and TrainConfig().token_budget("cuda") == 4096
    assert TrainConfig(max_tokens_per_gpu=300).token_budget("cpu") == 300
    with pytest.raises(ValueError, match="--max-tokens-per-gpu must be >= 16"):
        TrainConfig(max_tokens_per_gpu=8).validate()
