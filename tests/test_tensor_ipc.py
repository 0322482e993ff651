"""Tensors by handle between processes (SGLang's /update_weights_from_tensor format), and its guard."""

from __future__ import annotations

import base64
import pickle
import subprocess
import sys
import textwrap

import pytest
import torch

from agentrl.engines.tensor_ipc import deserialize_named_tensors, serialize_named_tensors


@pytest.mark.e2e
def test_round_trip_into_an_unrelated_process():
    a = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    b = torch.tensor([1.5, -2.0], dtype=torch.bfloat16)
    payload = serialize_named_tensors([("a", a), ("b", b)])
    assert len(payload) < 2000  # handles, not values
    code = (
        "from agentrl.engines.tensor_ipc import deserialize_named_tensors as d\n"
        f"print([(n, str(t.dtype), t.float().tolist()) for n, t in d({payload!r})])"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == str([("a", "torch.float32", a.tolist()), ("b", "torch.bfloat16", b.float().tolist())])


class _Evil:
    def __reduce__(self):
        import os

        return (os.system, ("echo pwned",))


class _EvalBuiltin:
    def __reduce__(self):
        return (eval, ("__import__('os').system('echo pwned')",))


class _TorchLoad:
    """torch.storage._load_from_bytes runs torch.load(weights_only=False): a full unpickle."""

    def __reduce__(self):
        import torch.storage

        return (torch.storage._load_from_bytes, (pickle.dumps(_Evil()),))


@pytest.mark.parametrize(
    "obj, message",
    [
        (_Evil(), "refusing to load"),
        (_EvalBuiltin(), "refusing to load builtins.eval"),
        (_TorchLoad(), "refusing to load torch.storage._load_from_bytes"),
        ([("x", 1)], "list of \\(name, tensor\\) pairs"),
    ],
)
def test_payloads_that_are_not_named_tensors_are_refused(obj, message, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    payload = base64.b64encode(pickle.dumps(obj)).decode()
    with pytest.raises((pickle.UnpicklingError, ValueError), match=message):
        deserialize_named_tensors(payload)
    with pytest.raises(ValueError, match="base64 strings"):
        deserialize_named_tensors(10**9)


@pytest.mark.e2e
async def test_engine_loads_weights_by_handle_and_refuses_garbage(tiny_ckpt, tmp_path):
    from safetensors.torch import load_file

    from agentrl.engines.http import EngineRequestError, SGLangEngine
    from agentrl.engines.local.process import local_server
    from agentrl.runtime.weight_sync import TensorTransport

    weights = load_file(str(tiny_ckpt / "model.safetensors"))
    with local_server(tiny_ckpt, startup_timeout=120) as url:
        engine = SGLangEngine(url)
        try:
            prompt = [1, 2, 3, 4]
            greedy = {"max_new_tokens": 6, "temperature": 0.0}
            from agentrl.engines.base import SamplingParams

            before = await engine.generate(prompt, SamplingParams(**greedy))
            with pytest.raises(EngineRequestError, match="could not read"):
                await engine.update_weights_from_tensor([base64.b64encode(pickle.dumps(_Evil())).decode()])
            changed = {n: (t * 0 if "embed" in n or "lm_head" in n else t) for n, t in weights.items()}
            await TensorTransport([engine], bucket_bytes=1 << 16).push(changed.items(), "v7")
            assert (await engine.model_info())["weight_version"] == "v7"
            after = await engine.generate(prompt, SamplingParams(**greedy))
            assert after.output_ids != before.output_ids or len(set(after.output_ids)) == 1
            await TensorTransport([engine]).push(weights.items(), "v8")
            again = await engine.generate(prompt, SamplingParams(**greedy))
            assert again.output_ids == before.output_ids
        finally:
            await engine.close()


def test_a_push_that_never_arrives_leaves_no_shared_memory():
    """Each pickle holds a /dev/shm reference until unpickled; an undelivered one is taken back by the sender.

    Run in a fresh process: the files are named by pid, and in the test process any other thread
    (an earlier test's leftovers) could create or hold one while this runs.
    """
    code = textwrap.dedent("""
        import asyncio, gc, glob, os
        import torch
        from agentrl.engines.base import EngineError
        from agentrl.engines.http import SGLangEngine
        from agentrl.engines.local.process import free_port
        from agentrl.runtime.weight_sync import TensorTransport

        def shm_files():
            return {f for f in glob.glob("/dev/shm/torch_*") if f.startswith(f"/dev/shm/torch_{os.getpid()}_")}

        async def main():
            engine = SGLangEngine(f"http://127.0.0.1:{free_port()}", max_retries=0)  # nothing listens there
            weights = {f"w{i}": torch.randn(64, 64) for i in range(3)}
            try:
                await TensorTransport([engine], bucket_bytes=20_000, ranks_per_engine=2).push(weights.items(), "1")
            except EngineError:
                print("refused")
            finally:
                await engine.close()

        before = shm_files()
        asyncio.run(main())
        gc.collect()
        print(len(shm_files() - before), "left")
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["refused", "0", "left"], r.stdout
