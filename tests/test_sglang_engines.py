"""SGLang servers as Ray actors: launch commands, routing, restarts, pause/continue, no orphans.

SGLang itself needs a GPU, so the servers here are ``agentrl serve`` processes started by the same
launcher (``binary="agentrl"``), speaking SGLang's HTTP API. Everything runs for real: Ray actors,
server processes on loopback ports, SIGKILLed processes, weights loaded from disk.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from agentrl.engines.base import SamplingParams
from agentrl.engines.http import SGLangEngine
from agentrl.engines.router import Router
from agentrl.engines.sglang import (
    SGLangLaunch,
    SGLangServer,
    build_launch_command,
    paused_for_update,
    server_args_from_flags,
)
from agentrl.runtime.engine_group import SGLangEngineGroup

pytestmark = pytest.mark.e2e  # engine processes, Ray, several processes or a browser: see conftest

PROMPT = [5, 17, 42, 99, 7]


@dataclass
class LongSampling(SamplingParams):
    """Runs to ``max_new_tokens`` (the tiny model would otherwise stop after ~10 tokens)."""

    def to_json(self) -> dict:
        return {**super().to_json(), "ignore_eos": True}


def gone(pid: int) -> bool:
    """No such process, or only its zombie (reparented processes are not always reaped in containers)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def wait_until(check, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(0.1)


# -- launch commands (no processes) ---------------------------------------------------------------

SLIME_FLAGS = {
    "sglang_mem_fraction_static": 0.8,
    "sglang_context_length": 8192,
    "sglang_tp_size": 2,
    "sglang_disable_radix_cache": True,
    "sglang_enable_torch_compile": False,
    "sglang_cuda_graph_bs": [1, 2, 4, 8],
    "sglang_log_level": None,
}


def test_server_args_from_flags_normalizes_names_and_drops_unset():
    assert server_args_from_flags(SLIME_FLAGS) == {
        "mem_fraction_static": 0.8,
        "context_length": 8192,
        "tp_size": 2,
        "disable_radix_cache": True,
        "enable_torch_compile": False,
        "cuda_graph_bs": [1, 2, 4, 8],
    }
    assert server_args_from_flags({"--sglang-max-running-requests": 64, "chunked-prefill-size": 512}) == {
        "max_running_requests": 64,
        "chunked_prefill_size": 512,
    }
    with pytest.raises(ValueError, match="twice"):
        server_args_from_flags({"context_length": 1, "sglang-context-length": 2})


def test_sglang_command_for_a_slime_like_flag_set():
    launch = SGLangLaunch("/ckpt/qwen", server_args=server_args_from_flags(SLIME_FLAGS), seed=1234, colocate=True)
    assert launch.tp_size == 2
    assert build_launch_command(launch, port=30001, seed=1235) == [
        sys.executable,
        "-m",
        "sglang.launch_server",
        "--model-path",
        "/ckpt/qwen",
        "--host",
        "127.0.0.1",
        "--port",
        "30001",
        "--tp-size",
        "2",
        "--skip-server-warmup",
        "--enable-memory-saver",
        "--random-seed",
        "1235",
        "--mem-fraction-static",
        "0.8",
        "--context-length",
        "8192",
        "--disable-radix-cache",
        "--cuda-graph-bs",
        "1",
        "2",
        "4",
        "8",
    ]
    env = launch.process_env()
    assert env["SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION"] == "false" and "PYTORCH_CUDA_ALLOC_CONF" not in env


def test_sglang_command_host_port_and_owned_args():
    launch = SGLangLaunch(
        "/m", host="0.0.0.0", port=31000, tp_size=4, server_args={"json_model_override_args": {"a": 1}}
    )
    argv = build_launch_command(launch)
    assert argv[3:11] == ["--model-path", "/m", "--host", "0.0.0.0", "--port", "31000", "--tp-size", "4"]
    assert "--enable-memory-saver" not in argv and "--random-seed" not in argv
    assert argv[-2:] == ["--json-model-override-args", '{"a": 1}']
    with pytest.raises(ValueError, match="--sglang-port is set by the launcher"):
        SGLangLaunch("/m", server_args={"port": 1})
    with pytest.raises(ValueError, match="disagrees"):
        SGLangLaunch("/m", tp_size=2, server_args={"tp_size": 4})
    with pytest.raises(ValueError, match="needs a port"):
        build_launch_command(SGLangLaunch("/m"))


def test_agentrl_command_maps_ignores_and_refuses(caplog):
    launch = SGLangLaunch(
        "/m",
        binary="agentrl",
        seed=7,
        server_args={
            "context_length": 2048,
            "max_running_requests": 8,
            "mem_fraction_static": 0.7,
            "disable_cuda_graph": True,
        },
    )
    with caplog.at_level(logging.WARNING, logger="agentrl.engines.sglang"):
        argv = build_launch_command(launch, port=30500)
    assert argv == [
        sys.executable,
        "-m",
        "agentrl",
        "serve",
        "--hf-checkpoint",
        "/m",
        "--host",
        "127.0.0.1",
        "--port",
        "30500",
        "--exit-with-stdin",
        "--context-length",
        "2048",
        "--max-running-requests",
        "8",
        "--seed",
        "7",
    ]
    assert "--sglang-mem-fraction-static, --sglang-disable-cuda-graph" in caplog.text
    with pytest.raises(ValueError, match="does not support --sglang-speculative-algorithm"):
        build_launch_command(
            SGLangLaunch("/m", binary="agentrl", server_args={"speculative_algorithm": "EAGLE"}), port=1
        )
    with pytest.raises(ValueError, match="no model parallelism"):
        build_launch_command(SGLangLaunch("/m", binary="agentrl", tp_size=2), port=1)
    # SGLang's torch.compile switches are honoured by agentrl serve (a bare switch when true, nothing when false)
    compiled = {"enable_torch_compile": True, "torch_compile_max_bs": 16}
    argv_c = build_launch_command(SGLangLaunch("/m", binary="agentrl", server_args=compiled), port=1)
    assert argv_c[-3:] == ["--enable-torch-compile", "--torch-compile-max-bs", "16"]
    off = build_launch_command(
        SGLangLaunch("/m", binary="agentrl", server_args={"enable_torch_compile": False}), port=1
    )
    assert "--enable-torch-compile" not in off
    with pytest.raises(ValueError, match="--sglang-torch-compile-max-bs must be an integer"):
        build_launch_command(SGLangLaunch("/m", binary="agentrl", server_args={"torch_compile_max_bs": 16.5}), port=1)
    with pytest.raises(ValueError, match="--sglang-enable-torch-compile is a switch"):
        build_launch_command(SGLangLaunch("/m", binary="agentrl", server_args={"enable_torch_compile": "yes"}), port=1)
    # SGLang's LoRA server args reach agentrl serve with SGLang's spellings (lists as nargs="+")
    lora = {
        "enable_lora": True,
        "lora_paths": ["a=/x", "/y"],
        "max_loras_per_batch": 2,
        "lora_target_modules": ["q_proj"],
    }
    argv_l = build_launch_command(SGLangLaunch("/m", binary="agentrl", server_args=lora), port=1)
    assert argv_l[-8:] == [
        "--enable-lora",
        "--lora-paths",
        "a=/x",
        "/y",
        "--max-loras-per-batch",
        "2",
        "--lora-target-modules",
        "q_proj",
    ]
    # SGLang's memory saver is a real switch of agentrl serve: colocated launches (and users) turn it on
    assert "--enable-memory-saver" not in argv
    assert (
        build_launch_command(SGLangLaunch("/m", binary="agentrl", colocate=True), port=1)[-1] == "--enable-memory-saver"
    )
    on = SGLangLaunch("/m", binary="agentrl", server_args={"enable_memory_saver": True})
    assert build_launch_command(on, port=1)[-1] == "--enable-memory-saver"
    with pytest.raises(ValueError, match="binary"):
        SGLangLaunch("/m", binary="vllm")


def test_api_key_reaches_sglang_by_argv_and_agentrl_serve_by_environment(monkeypatch):
    argv = build_launch_command(SGLangLaunch("/m", server_args={"api_key": "k1"}), port=30500)
    assert argv[argv.index("--api-key") + 1] == "k1"  # SGLang reads it from argv only
    launch = SGLangLaunch("/m", binary="agentrl", api_key="k2")
    argv = build_launch_command(launch, port=30500)
    assert "k2" not in " ".join(argv) and launch.process_env()["AGENTRL_ENGINE_API_KEY"] == "k2"
    assert launch.headers == {"Authorization": "Bearer k2"}
    monkeypatch.setenv("AGENTRL_ENGINE_API_KEY", "the user's key for --engine-url servers")
    assert "AGENTRL_ENGINE_API_KEY" not in SGLangLaunch("/m", binary="agentrl").process_env()  # not a launched one's


async def test_a_launched_server_with_a_key_refuses_requests_without_it(tiny_ckpt, tmp_path):
    import httpx

    from agentrl.engines.base import EngineError

    server = SGLangServer(
        SGLangLaunch(str(tiny_ckpt), binary="agentrl", log_dir=str(tmp_path), api_key="k3", startup_timeout=120)
    )
    try:
        url = server.start()  # its own readiness check and health checks carry the key
        assert server.alive()
        body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 2}}
        assert httpx.post(url + "/generate", json=body).status_code == 401
        assert httpx.post(url + "/update_weights_from_disk", json={"model_path": str(tiny_ckpt)}).status_code == 401
        ok = SGLangEngine(url, api_key="k3")
        assert (await ok.generate(PROMPT, SamplingParams(max_new_tokens=2, temperature=0))).output_ids
        await ok.close()
        anon = SGLangEngine(url, max_retries=0)
        with pytest.raises(EngineError, match="401"):
            await anon.generate(PROMPT, SamplingParams(max_new_tokens=2))
        await anon.close()
        server.load_weights(str(tiny_ckpt), "v2")  # the launcher's weight reload carries it too
    finally:
        server.shutdown()


def test_startup_failure_reports_the_log_tail(tmp_path):
    """The server dies while starting: the error says so, with the last lines of its log."""
    server = SGLangServer(
        SGLangLaunch(str(tmp_path / "no-such-model"), binary="agentrl", log_dir=str(tmp_path), startup_timeout=60)
    )
    with pytest.raises(RuntimeError, match=r"exited with code \d+ during startup") as info:
        server.start()
    assert "no-such-model" in str(info.value) and server.pid() is None
    server.shutdown()


# -- engines as Ray actors --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def group(ray_local, tiny_ckpt, tmp_path_factory):
    launch = SGLangLaunch(
        str(tiny_ckpt),
        binary="agentrl",
        seed=0,
        startup_timeout=120,
        log_dir=str(tmp_path_factory.mktemp("engine_logs")),
    )
    g = SGLangEngineGroup.start(launch, 2, num_cpus=0.25)
    yield g
    g.shutdown()


async def test_two_engines_route_stick_and_spread(group):
    assert len(set(group.urls)) == 2 and not group.supports_tensors
    assert group.check_and_restart() == []
    router = Router([SGLangEngine(u) for u in group.urls])
    try:
        out = await router.generate(PROMPT, SamplingParams(max_new_tokens=4, temperature=0), key="ep")
        assert out.output_ids and out.engine_url in group.urls
        again = await router.generate(PROMPT + out.output_ids, SamplingParams(max_new_tokens=4), key="ep")
        assert again.engine_url == out.engine_url  # sticky: the episode stays where its prefix is cached
        outs = await asyncio.gather(*(router.generate(PROMPT, LongSampling(max_new_tokens=300)) for _ in range(4)))
        assert {o.engine_url for o in outs} == set(group.urls)  # least outstanding spreads them
    finally:
        await router.close()


async def test_pause_aborts_holds_and_serves_new_weights(group, tmp_path):
    from agentrl.tiny import build_model

    new_ckpt = build_model(tmp_path / "v2", mean_turn_tokens=10.0, seed=1)
    router = Router([SGLangEngine(u) for u in group.urls])
    try:
        long = asyncio.create_task(router.generate(PROMPT, LongSampling(max_new_tokens=3500)))
        await asyncio.sleep(0.5)
        async with paused_for_update(router, group=group) as restarted:
            assert restarted == []
            cut = await asyncio.wait_for(long, 10)
            assert cut.finish_reason == "abort" and len(cut.output_ids) < 3500  # partial output
            held = asyncio.create_task(router.generate(PROMPT, SamplingParams(max_new_tokens=4)))
            await asyncio.sleep(1.0)
            assert not held.done()  # new requests wait while paused
            await router.update_weights_from_disk(str(new_ckpt), "v2")
        out = await asyncio.wait_for(held, 30)
        assert out.weight_version == "v2" and out.finish_reason in ("stop", "length")
        with pytest.raises(Exception, match="mode 'abort'"):
            await router.pause_generation("in_place")  # the embedded engine cannot hold running requests
    finally:
        await router.close()


async def test_killed_server_fails_over_and_is_restarted(group, tiny_ckpt):
    victim = 1
    pid, url = group.pids()[victim], group.urls[victim]
    group.record_weights(str(tiny_ckpt), "after-restart")
    group.start_monitor(interval=0.5)
    router = Router([SGLangEngine(u, max_retries=1, backoff=0.2) for u in group.urls], cooldown=2.0)
    try:
        tasks = [asyncio.create_task(router.generate(PROMPT, LongSampling(max_new_tokens=2500))) for _ in range(4)]
        await asyncio.sleep(0.5)
        assert router.outstanding == [2, 2]
        os.killpg(pid, signal.SIGKILL)  # mid-rollout
        outs = await asyncio.wait_for(asyncio.gather(*tasks), 60)
        assert all(o.finish_reason == "length" and len(o.output_ids) == 2500 for o in outs)
        assert all(o.engine_url == group.urls[0] for o in outs)  # the killed engine's requests failed over
        await asyncio.to_thread(wait_until, lambda: group.restarts[victim] == 1, 60, "the monitor's restart")
        assert group.urls[victim] == url and group.pids()[victim] not in (None, pid)
        victim_client = router.engines[victim]
        assert (await victim_client.model_info())["weight_version"] == "after-restart"
        await asyncio.sleep(2.0)  # the router's cooldown for the failed engine
        outs = await asyncio.gather(*(router.generate(PROMPT, LongSampling(max_new_tokens=200)) for _ in range(4)))
        assert url in {o.engine_url for o in outs}  # back in rotation at the same URL
    finally:
        await router.close()
    assert group.check_and_restart() == []


def test_server_dies_with_the_process_that_spawned_it(tmp_path):
    """PR_SET_PDEATHSIG alone (no stdin pipe, as for SGLang): the spawner's process exits, the server dies."""
    script = f"""
import os
from agentrl.engines.sglang import SGLangLaunch, SGLangServer
server = SGLangServer(SGLangLaunch("/m", log_dir={str(tmp_path)!r}), port=1)
server.command = ["sleep", "600"]
print(server._spawner.submit(server._spawn).result().pid, flush=True)
os._exit(0)
"""
    root = str(Path(__file__).resolve().parents[1])
    out = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": root},
    )
    pid = int(out.stdout.split()[0])
    try:
        wait_until(lambda: gone(pid), 5, f"orphaned server {pid} to die")
    finally:
        if not gone(pid):
            os.kill(pid, signal.SIGKILL)


def test_ray_kill_leaves_no_server_process(ray_local, tiny_ckpt, tmp_path):
    g = SGLangEngineGroup.start(
        SGLangLaunch(str(tiny_ckpt), binary="agentrl", log_dir=str(tmp_path), startup_timeout=120), 1, num_cpus=0.25
    )
    try:
        (pid,) = g.pids()
        assert pid and not gone(pid)
        ray_local.kill(g.actors[0])  # no shutdown call: the kernel's parent-death signal ends the server
        wait_until(lambda: gone(pid), 15, f"server {pid} to die with its actor")
    finally:
        g.shutdown()  # copes with the dead actor


def test_group_shutdown_leaves_no_server_process(group):
    """Last in this file: it stops the shared group (the fixture's own shutdown is then a no-op)."""
    pids = group.pids()
    assert len(pids) == 2 and all(pids) and not any(gone(p) for p in pids)
    group.shutdown()
    assert all(gone(p) for p in pids) and group.actors == []


async def test_the_runs_embedded_engines_require_a_fresh_key(ray_local, tiny_ckpt):
    """``EngineGroup.embedded`` (the default rollout backend) gives its servers a per-run key; its clients send it."""
    import httpx

    from agentrl.runtime.engine_group import EngineGroup

    g = EngineGroup.embedded(tiny_ckpt, 1, num_cpus=0.25)
    try:
        assert g.api_key and len(g.api_key) >= 24
        url = g.urls[0]
        assert httpx.get(url + "/health").status_code == 200
        assert httpx.post(url + "/generate", json={"input_ids": PROMPT}).status_code == 401
        engine = SGLangEngine(url, api_key=g.api_key)
        assert (await engine.generate(PROMPT, SamplingParams(max_new_tokens=2, temperature=0))).output_ids
        await engine.close()
    finally:
        g.shutdown()
