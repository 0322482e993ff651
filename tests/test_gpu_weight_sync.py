"""DistributedTransport against a real SGLang server on a GPU (``-m gpu``; skipped without CUDA or sglang).

The trainer is this process. With two GPUs it is rank 0 on ``cuda:0`` over NCCL and the server runs
on GPU 1 (NCCL refuses two ranks of one communicator on the same GPU). With one GPU the same
protocol runs over gloo: the trainer broadcasts CPU tensors and SGLang receives them into CUDA
tensors. The pushed weights make one token dominate the output head, so the greedy output and its
log-probs are known exactly whatever SGLang's bf16 rounding does.
"""

from __future__ import annotations

import importlib.util
import os
import socket
import subprocess
import sys
import time

import httpx
import pytest
import torch

from tests.test_weight_sync import N_NEW, PROMPT, reference  # the same greedy reference as the CPU test

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(importlib.util.find_spec("sglang") is None, reason="needs sglang"),
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    from agentrl.tiny import build_model

    # hidden 256 with 4 heads: head_dim 64, which every SGLang attention backend supports.
    return build_model(tmp_path_factory.mktemp("gpu_sync") / "tiny", hidden_size=256, mean_turn_tokens=10.0)


@pytest.fixture(scope="module")
def two_gpus() -> bool:
    return torch.cuda.device_count() >= 2


@pytest.fixture(scope="module")
def sglang_url(ckpt, two_gpus, tmp_path_factory):
    port = _free_port()
    log_path = tmp_path_factory.mktemp("gpu_sync_logs") / "sglang.log"
    cmd = [
        sys.executable,
        "-m",
        "sglang.launch_server",
        "--model-path",
        str(ckpt),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--dtype",
        "bfloat16",
        "--mem-fraction-static",
        "0.2",
        "--disable-cuda-graph",
        "--random-seed",
        "0",
        "--base-gpu-id",
        "1" if two_gpus else "0",
        "--log-level",
        "warning",
    ]
    env = {**os.environ, "NCCL_CUMEM_ENABLE": "0", "NCCL_NVLS_ENABLE": "0"}  # as SGLang's own RL tests set them
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        url = f"http://127.0.0.1:{port}"
        try:
            deadline = time.monotonic() + 600
            while True:
                if proc.poll() is not None:
                    pytest.fail(f"sglang exited ({proc.returncode}):\n{log_path.read_text()[-4000:]}")
                try:
                    if httpx.get(url + "/health_generate", timeout=5).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline:
                    pytest.fail(f"sglang did not start:\n{log_path.read_text()[-4000:]}")
                time.sleep(2)
            yield url
        finally:
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def dominated(model, base: dict, token: int) -> dict:
    """``base`` with the output-head row of ``token`` aligned with the final hidden states (logit ~ +40)."""
    model.load_state_dict(base)
    with torch.no_grad():
        h = model.model(torch.tensor([PROMPT])).last_hidden_state[0]  # [T, hidden], after the final norm
    hbar = h.mean(0)
    state = {k: v.clone() for k, v in base.items()}
    state["lm_head.weight"][token] = 40.0 * hbar / hbar.dot(hbar)
    return state


def generate(url: str) -> tuple[list[int], list[float]]:
    body = {
        "input_ids": PROMPT,
        "return_logprob": True,
        "sampling_params": {"temperature": 0, "max_new_tokens": N_NEW, "ignore_eos": True},
    }
    meta = httpx.post(url + "/generate", json=body, timeout=120).json()["meta_info"]
    return [t for _, t, _ in meta["output_token_logprobs"]], [lp for lp, _, _ in meta["output_token_logprobs"]]


async def test_broadcast_into_sglang(sglang_url, ckpt, two_gpus):
    from transformers import AutoModelForCausalLM

    from agentrl.engines.http import SGLangEngine
    from agentrl.runtime.weight_sync import DistributedTransport

    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    base = {k: v.clone() for k, v in model.state_dict().items()}
    if two_gpus:
        torch.cuda.set_device(0)
        os.environ.setdefault("NCCL_CUMEM_ENABLE", "0")
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    engine = SGLangEngine(sglang_url)
    transport = DistributedTransport(
        [engine], backend="nccl" if two_gpus else "gloo", bucket_bytes=256 << 10, timeout=300
    )
    before = generate(sglang_url)
    try:
        for version, token in (("v1", 10), ("v2", 11)):  # the second push reuses the group
            state = dominated(model, base, token)
            ref_ids, ref_lps = reference(model, state)
            assert ref_ids == [token] * N_NEW  # the construction works in fp32
            await transport.push(state.items(), version)
            ids, lps = generate(sglang_url)
            assert ids == ref_ids != before[0]
            assert max(abs(a - b) for a, b in zip(lps, ref_lps)) < 0.05
            assert httpx.get(sglang_url + "/get_model_info").json()["weight_version"] == version
            row = httpx.post(
                sglang_url + "/get_weights_by_name", json={"name": "lm_head.weight", "truncate_size": 16}
            ).json()
            assert torch.allclose(
                torch.tensor(row, dtype=torch.float32)[token], state["lm_head.weight"][token], rtol=2e-2, atol=1e-3
            )
        await engine.release_memory_occupation()
        await engine.resume_memory_occupation()
        assert generate(sglang_url)[0] == [11] * N_NEW
    finally:
        await transport.close()
        await engine.close()
