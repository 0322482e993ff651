"""Shared fixtures: a tiny chatty model built locally, and the embedded engine serving it over HTTP.

Nothing is downloaded: ``agentrl.tiny`` trains a byte-level BPE tokenizer and builds a 2-layer
Llama in about a second. The engine fixture starts the real ``agentrl serve`` process on a
loopback port, the same path ``agentrl rollout`` takes.
"""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory) -> Path:
    from agentrl.tiny import build_model

    return build_model(tmp_path_factory.mktemp("tiny") / "model", mean_turn_tokens=10.0)


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
def ray_local():
    """A local Ray cluster shared by the tests that start actors (started once: ~4 s)."""
    from agentrl.runtime.cluster import init_ray

    import ray

    started = not ray.is_initialized()
    init_ray(num_cpus=2)
    yield ray
    if started:
        ray.shutdown()
