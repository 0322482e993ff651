"""Shared fixtures: a tiny chatty model built locally, and the embedded engine serving it over HTTP.

Nothing is downloaded: ``agentrl.tiny`` trains a byte-level BPE tokenizer and builds a 2-layer
Llama in about a second. The engine fixture starts the real ``agentrl serve`` process on a
loopback port, the same path ``agentrl rollout`` takes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

# Ray on Linux puts its own services on the host's interface address (it turns 127.0.0.1 into that
# address); with this every Ray process the tests start, and every child they spawn, stays on loopback.
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")

# -- tiers ----------------------------------------------------------------------------------------
# The unit tier (`pytest -m "not e2e"`, about a minute) is everything that needs no service: no
# engine process, no Ray, no sandbox, no browser. The e2e tier is what does, or trains end to end.
# A test is e2e when it uses one of these fixtures (directly or through another fixture), sits in
# a module marked `pytestmark = pytest.mark.e2e`, or carries `@pytest.mark.e2e` itself.
E2E_FIXTURES = frozenset(
    {"tiny_server", "tiny_vlm_server", "ray_local", "docker_image", "sandbox_backend", "openenv_url"}
)


@pytest.hookimpl(tryfirst=True)  # before -m deselects
def pytest_collection_modifyitems(config, items):
    for item in items:
        slow_or_gpu = item.get_closest_marker("slow") or item.get_closest_marker("gpu")
        if slow_or_gpu or E2E_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.e2e)  # slow/gpu too: `-m "not e2e"` replaces the default -m


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory) -> Path:
    from agentrl.tiny import build_model

    return build_model(tmp_path_factory.mktemp("tiny") / "model", mean_turn_tokens=10.0)


@pytest.fixture(scope="session")
def tied_ckpt(tiny_ckpt, tmp_path_factory) -> Path:
    """The tiny tokenizer with a 2-layer Llama (vocab 400) that ties embeddings and head (as SmolLM2 does)."""
    import shutil

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    out = tmp_path_factory.mktemp("tied")
    for f in tiny_ckpt.iterdir():
        if f.name.startswith("tokenizer") or f.name.endswith(".jinja") or f.name == "special_tokens_map.json":
            shutil.copy(f, out / f.name)
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=400,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=True,
    )
    LlamaForCausalLM(config).save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_ckpt):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_ckpt)


@pytest.fixture(scope="session")
def tiny_server(tiny_ckpt, tmp_path_factory):
    """URL of ``agentrl serve`` running the tiny model (session-wide, seeded)."""
    from agentrl.engines.local.process import local_server

    log = tmp_path_factory.mktemp("logs") / "engine.log"
    with local_server(tiny_ckpt, log_path=log, extra_args=["--seed", "0"], startup_timeout=120) as url:
        yield url


@pytest.fixture(scope="session")
def tiny_vlm(tmp_path_factory) -> Path:
    """A tiny Idefics3 (SmolVLM's architecture) with its processor: 4 placeholder tokens per image."""
    from agentrl.tiny import build_vlm

    return build_vlm(tmp_path_factory.mktemp("tiny_vlm") / "model", mean_turn_tokens=10.0)


@pytest.fixture(scope="session")
def tiny_vlm_server(tiny_vlm, tmp_path_factory):
    """URL of ``agentrl serve`` running the tiny VLM (session-wide, seeded)."""
    from agentrl.engines.local.process import local_server

    log = tmp_path_factory.mktemp("logs") / "vlm_engine.log"
    with local_server(tiny_vlm, log_path=log, extra_args=["--seed", "0"], startup_timeout=120) as url:
        yield url


@pytest.fixture(scope="session")
def ray_local():
    """A local Ray cluster shared by the tests that start actors (started once: ~4 s)."""
    import ray

    from agentrl.runtime.cluster import init_ray

    started = not ray.is_initialized()
    init_ray(num_cpus=2)
    yield ray
    if started:
        ray.shutdown()


# -- the agentrl command --------------------------------------------------------------------------
# Tests that run the CLI do it as a user would: `python -m agentrl ...` in a child process (its own
# event loop, engine and Ray), reading what it wrote. One helper so a timeout or an env var is set
# in one place.

REPO = Path(__file__).resolve().parent.parent


def run_cli(
    *args: str, cwd: Path = REPO, timeout: float = 300, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    """``python -m agentrl ARGS`` in ``cwd``; ``env`` adds variables to (or overrides) this process's environment."""
    argv, child_env = [sys.executable, "-m", "agentrl", *args], {**os.environ, **env} if env is not None else None
    return subprocess.run(argv, cwd=cwd, env=child_env, capture_output=True, text=True, timeout=timeout)


def read_samples(path: Path) -> list[dict]:
    """The samples a rollout wrote, one JSON object a line."""
    return [json.loads(line) for line in path.read_text().splitlines()]


def cli_rollout(
    spec: str,
    ckpt: Path,
    folder: Path,
    *flags: str,
    num_tasks: int | None = None,
    n_samples: int = 2,
    max_turns: int | None = None,
    turn_len: int = 32,
    engine_url: str | None = None,
    env: dict[str, str] | None = None,
) -> tuple[subprocess.CompletedProcess, list[dict]]:
    """``agentrl rollout --env SPEC`` with the checkpoint ``ckpt``, asserting it succeeded; its result and samples.

    The samples go to ``folder/samples.jsonl``. Without ``engine_url`` the command starts the embedded
    engine itself; ``flags`` go through as written, ``env`` as for :func:`run_cli`.
    """
    output = folder / "samples.jsonl"
    args = ["rollout", "--env", spec, "--n-samples-per-prompt", str(n_samples), "--rollout-max-turn-len", str(turn_len)]
    if num_tasks is not None:
        args += ["--num-tasks", str(num_tasks)]
    if max_turns is not None:
        args += ["--max-turns", str(max_turns)]
    if engine_url is not None:
        args += ["--engine-url", engine_url]
    r = run_cli(*args, *flags, "--hf-checkpoint", str(ckpt), "--output", str(output), env=env)
    assert r.returncode == 0, r.stderr
    return r, read_samples(output)


# -- sandboxes ------------------------------------------------------------------------------------
# Tests that need a backend skip with the reason only when it cannot exist on this machine; CI sets
# AGENTRL_REQUIRE_DOCKER=1 / AGENTRL_REQUIRE_BWRAP=1 so a missing engine fails there instead.

SANDBOX_BACKENDS = [pytest.param("docker", marks=pytest.mark.docker), "bubblewrap", "process"]


def _need(reason: str | None, env_var: str) -> None:
    if reason is None:
        return
    if os.environ.get(env_var) == "1":
        pytest.fail(f"{reason} ({env_var}=1: this backend must be tested here)")
    pytest.skip(reason)


@pytest.fixture(scope="session")
def docker_image():
    """The default sandbox image, built locally from the host's Python when missing (~2 s)."""
    from agentrl.sandbox import docker as docker_backend

    _need(docker_backend.unavailable_reason(), "AGENTRL_REQUIRE_DOCKER")
    from agentrl.sandbox.image import ensure_image

    return ensure_image()


def sandbox_config(backend: str, **overrides):
    """A SandboxConfig for ``backend`` (docker, bubblewrap or process), skipping when it cannot run here."""
    from agentrl.sandbox import SandboxConfig
    from agentrl.sandbox import local as local_backend

    if backend == "bubblewrap":
        _need(local_backend.bubblewrap_unavailable_reason(), "AGENTRL_REQUIRE_BWRAP")
        return SandboxConfig(backend="local", **overrides)
    return SandboxConfig(backend=backend, **overrides)


@pytest.fixture(params=SANDBOX_BACKENDS)
def sandbox_backend(request) -> str:
    """Each backend name in turn; the docker one builds/ensures the image first."""
    if request.param == "docker":
        request.getfixturevalue("docker_image")
    sandbox_config(request.param)  # skips when unavailable
    return request.param
