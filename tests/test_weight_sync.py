"""Weight sync from a trainer into a running engine, over SGLang's HTTP API, for real on CPU.

The trainer side is this test process; the engine is a real ``agentrl serve`` child process. The
broadcast path (``DistributedTransport``) builds its own gloo process group over loopback, exactly
the protocol SGLang's NCCL path follows. After each push, greedy ``/generate`` must return the ids
and log-probs (within 1e-4) of a plain forward of the pushed weights.
"""

from __future__ import annotations

import asyncio

import httpx
import pytest
import torch

from agentrl.engines.base import EngineError
from agentrl.engines.http import EngineRequestError, SGLangEngine
from agentrl.engines.local import InvalidRequestError, LocalEngine
from agentrl.engines.local.process import local_server
from agentrl.runtime.weight_sync import DiskTransport, DistributedTransport, make_transport

pytestmark = pytest.mark.e2e  # engine processes, Ray, several processes or a browser: see conftest

PROMPT = [5, 17, 42, 99, 7, 120, 33, 64]
N_NEW = 6


@pytest.fixture(scope="module")
def server(tiny_ckpt, tmp_path_factory):
    """A server of our own: the pushes below change its weights (the shared tiny_server must not see that)."""
    log = tmp_path_factory.mktemp("weight_sync_logs") / "engine.log"
    with local_server(
        tiny_ckpt, extra_args=["--seed", "0", "--enable-memory-saver"], log_path=log, startup_timeout=120
    ) as url:
        yield url


@pytest.fixture(scope="module")
def ref_model(tiny_ckpt):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_ckpt, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def base(ref_model):
    return {k: v.clone() for k, v in ref_model.state_dict().items()}


def perturbed(state: dict, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {k: v + 0.5 * v.std() * torch.randn(v.shape, generator=g) for k, v in state.items()}


def reference(model, state: dict) -> tuple[list[int], list[float]]:
    """Greedy continuation of PROMPT and its log-probs from a plain full-sequence forward."""
    model.load_state_dict(state)
    ids, lps = list(PROMPT), []
    with torch.no_grad():
        for _ in range(N_NEW):
            logp = torch.log_softmax(model(torch.tensor([ids])).logits[0, -1].float(), dim=-1)
            tok = int(logp.argmax())
            ids.append(tok)
            lps.append(float(logp[tok]))
    return ids[len(PROMPT) :], lps


def generate(url: str) -> tuple[list[int], list[float], str]:
    body = {
        "input_ids": PROMPT,
        "return_logprob": True,
        "sampling_params": {"temperature": 0, "max_new_tokens": N_NEW, "ignore_eos": True},
    }
    out = httpx.post(url + "/generate", json=body, timeout=60).json()
    meta = out["meta_info"]
    return out["output_ids"], [lp for lp, _, _ in meta["output_token_logprobs"]], meta["weight_version"]


def assert_same_generation(got: tuple[list[int], list[float], str], want: tuple[list[int], list[float], str]) -> None:
    """Ids and weight version exactly, log-probs within 1e-4: the float sums of a decode step depend on
    which other requests share its batch (and on the kernels a reloaded weight tensor picks)."""
    assert got[0] == want[0] and got[2] == want[2]
    assert max(abs(a - b) for a, b in zip(got[1], want[1])) < 1e-4


def assert_serves(url: str, model, state: dict, version: str) -> None:
    ids, lps, served = generate(url)
    ref_ids, ref_lps = reference(model, state)
    assert served == version
    assert ids == ref_ids
    assert max(abs(a - b) for a, b in zip(lps, ref_lps)) < 1e-4


async def test_distributed_broadcast_updates_running_engine(server, ref_model, base):
    engine = SGLangEngine(server)
    # Small buckets: the model travels in several update_weights_from_distributed calls.
    transport = make_transport("distributed", [engine], backend="nccl", bucket_bytes=64 << 10, timeout=60)
    assert isinstance(transport, DistributedTransport) and transport.backend == "gloo"  # no CUDA here
    before = generate(server)
    try:
        state = perturbed(base, 1)
        await transport.push(state.items(), "v1")
        assert_serves(server, ref_model, state, "v1")
        assert generate(server)[1] != before[1]
        pg = transport._pg
        state = perturbed(base, 2)  # a second push reuses the group
        await transport.push(state.items(), "v2")
        assert transport._pg is pg
        assert_serves(server, ref_model, state, "v2")
        # A partial push (SGLang loads whatever names arrive): only the output head goes back.
        state["lm_head.weight"] = base["lm_head.weight"]
        await transport.push([("lm_head.weight", base["lm_head.weight"])], "v3")
        assert_serves(server, ref_model, state, "v3")
    finally:
        await transport.close()
        await engine.close()
    # Back to the checkpoint for the tests that follow, through a fresh group of the same name.
    engine = SGLangEngine(server)
    transport = DistributedTransport([engine], backend="gloo", timeout=60)
    try:
        await transport.push(base.items(), "base")
        assert_serves(server, ref_model, base, "base")
    finally:
        await transport.close()
        await engine.close()


async def test_refused_buckets_leave_the_engine_unchanged(server, ref_model, base):
    engine = SGLangEngine(server)
    transport = DistributedTransport([engine], backend="gloo", timeout=20)  # one bucket per push
    before = generate(server)
    try:
        bad = dict(base)
        bad["model.layers.0.mlp.up_proj.weight"] = base["model.layers.0.mlp.up_proj.weight"].t()
        with pytest.raises(EngineRequestError, match="shape_mismatch=.*up_proj"):
            await transport.push(perturbed(bad, 3).items(), "bad-shape")
        with pytest.raises(EngineRequestError, match="unexpected=.*model.bogus.weight"):
            await transport.push([("model.bogus.weight", torch.ones(3))], "bad-name")
        assert_same_generation(generate(server), before)
        await transport.push(base.items(), "after-refusals")  # a refusal drops the group; a new one is built
        assert_serves(server, ref_model, base, "after-refusals")
        # The engine loses the group (a restart): it refuses before receiving; the next push recovers.
        transport.refusal_grace = 1.0
        async with httpx.AsyncClient(base_url=server) as client:
            r = await client.post("/destroy_weights_update_group", json={"group_name": transport._name})
            assert r.json()["success"]
        with pytest.raises(EngineRequestError, match="init_weights_update_group"):
            await transport.push(base.items(), "lost")
        await transport.push(base.items(), "recovered")
        assert_serves(server, ref_model, base, "recovered")
    finally:
        await transport.close()
        await engine.close()
    async with httpx.AsyncClient(base_url=server) as client:  # SGLang's answers for a missing group
        r = await client.post(
            "/update_weights_from_distributed", json={"names": ["x"], "dtypes": ["float32"], "shapes": [[1]]}
        )
        assert r.status_code == 400 and r.json()["success"] is False
        assert "init_weights_update_group" in r.json()["message"]
        r = await client.post("/destroy_weights_update_group", json={"group_name": "weight_update_group"})
        assert r.status_code == 400
        assert r.json() == {"success": False, "message": "The group to be destroyed does not exist."}


async def test_disk_transport_keeps_only_the_latest_folder(server, ref_model, base, tiny_ckpt, tmp_path):
    engine = SGLangEngine(server)
    try:
        state = perturbed(base, 4)
        await DiskTransport([engine], tmp_path / "sync", config=tiny_ckpt).push(state.items(), "d1")
        assert_serves(server, ref_model, state, "d1")
        assert (tmp_path / "sync/weights-d1/config.json").exists()
        sharded = DiskTransport([engine], tmp_path / "sync", config=tiny_ckpt, shard_bytes=200_000)
        await sharded.push(base.items(), "d2")
        assert_serves(server, ref_model, base, "d2")
        assert [p.name for p in (tmp_path / "sync").iterdir()] == ["weights-d2"]
        files = sorted(p.name for p in (tmp_path / "sync/weights-d2").glob("*.safetensors"))
        assert len(files) > 1 and (tmp_path / "sync/weights-d2/model.safetensors.index.json").exists()
        with pytest.raises(EngineError, match="does not match the model"):
            await DiskTransport([engine], tmp_path / "bad").push([("model.bogus.weight", torch.ones(2))], "d3")
        assert generate(server)[2] == "d2"
    finally:
        await engine.close()


async def test_release_and_resume_memory_over_http(server):
    engine = SGLangEngine(server)
    try:
        before = generate(server)
        await engine.release_memory_occupation()
        pending = asyncio.ensure_future(asyncio.to_thread(generate, server))
        await asyncio.sleep(0.5)
        assert not pending.done()  # requests wait while the KV cache is released
        await engine.resume_memory_occupation(["kv_cache"])
        assert_same_generation(await asyncio.wait_for(pending, 30), before)
        with pytest.raises(EngineRequestError, match="tags"):
            await engine.release_memory_occupation(["bogus"])
        async with httpx.AsyncClient(base_url=server) as client:  # SGLang: 200 and a null body
            r = await client.post("/release_memory_occupation", json={"tags": ["weights"]})
            assert r.status_code == 200 and r.json() is None
            assert (await client.get("/resume_memory_occupation")).status_code == 200
    finally:
        await engine.close()


async def test_local_engine_release_frees_kv_and_partial_updates(tiny_ckpt, base):
    engine = LocalEngine(tiny_ckpt, max_running_requests=4, seed=0, enable_memory_saver=True)
    try:
        sp = {"temperature": 0, "max_new_tokens": 4, "ignore_eos": True}
        first = await engine.generate(PROMPT, sp, return_logprob=True)
        assert len(engine.store) == 1
        out = await engine.release_memory_occupation()
        assert out["freed_bytes"] > 0 and len(engine.store) == 0 and engine.runner.cache.capacity == 1
        assert (await engine.release_memory_occupation())["freed_bytes"] == 0
        await engine.resume_memory_occupation()
        assert engine.runner.cache.capacity == 256
        assert (await engine.generate(PROMPT, sp, return_logprob=True))["output_ids"] == first["output_ids"]
        with pytest.raises(InvalidRequestError):
            await engine.release_memory_occupation(["gpu"])
        one = {"lm_head.weight": base["lm_head.weight"] * 2}
        full = await engine.update_weights_from_tensors(one, "x")
        assert not full["success"] and "missing=" in full["message"] and engine.weight_version == "default"
        assert (await engine.update_weights_from_tensors(one, None, partial=True))["success"]
        assert engine.weight_version == "default"  # a partial update without a version keeps it
        assert torch.equal(engine.model.lm_head.weight, one["lm_head.weight"])
    finally:
        await engine.close()


def test_ray_routes_shared_memory_then_object_store_fallback(ray_local, monkeypatch):
    """The embedded engines' routes are WeightTransports too: shm maps a real /dev/shm slot in the engine
    actor; a slot that cannot be written falls back to the object store (and says so in ``route``)."""
    import ray

    from agentrl.runtime import shm_weights
    from agentrl.runtime.weight_sync import ObjectStoreTransport, SharedMemoryTransport

    @ray.remote(num_cpus=0)
    class Engine:  # a real actor with the two calls EngineServer answers (no model: it checks the tensors)
        def __init__(self):
            self.seen: list[tuple[str, str, float]] = []

        def update_weights_from_shared(self, path, layout, version):
            w = shm_weights.open_weights(path, layout)
            self.seen.append(("shm", version, float(w["w"].sum())))
            return {"success": True}

        def update_weights_from_tensors(self, named, version):
            from agentrl.runtime.engine_group import numpy_to_tensors

            w = numpy_to_tensors(named)
            self.seen.append(("object_store", version, float(w["w"].sum())))
            return {"success": version != "bad", "message": "refused"}

        def log(self):
            return self.seen

    engines = [Engine.remote(), Engine.remote()]
    weights = [("w", torch.arange(6, dtype=torch.float32).reshape(2, 3))]
    shm = SharedMemoryTransport(engines)
    asyncio.run(shm.push(iter(weights), "1"))
    assert shm.route == "shm"
    assert [ray.get(e.log.remote()) for e in engines] == [[("shm", "1", 15.0)]] * 2

    def no_room(self, named, *, checked=False):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(shm_weights.SharedWeightsWriter, "write", no_room)
    small = SharedMemoryTransport(engines)
    asyncio.run(small.push(iter(weights), "2"))
    asyncio.run(small.push(iter([("w", torch.ones(2, 3))]), "3"))
    assert small.route == "object_store"
    assert ray.get(engines[0].log.remote())[1:] == [("object_store", "2", 15.0), ("object_store", "3", 6.0)]
    with pytest.raises(EngineError, match="weight update failed on 2 engine"):
        asyncio.run(ObjectStoreTransport(engines).push(iter(weights), "bad"))
    asyncio.run(shm.close())
    with pytest.raises(ValueError, match="one of disk, nccl, tensor, shm, object_store"):
        make_transport("rdma", engines)


def test_a_tensor_push_names_a_folder_only_for_engines_the_run_gave_one(tmp_path):
    """Real SGLang engines (colocated, CUDA handles) have no private folder: the push must name none (it named
    the run's weight_sync folder, which TensorTransport then refused as not private: every push failed)."""
    from types import SimpleNamespace

    from agentrl.engines.ipc_folder import IpcFolder
    from agentrl.runtime.train import push_folder
    from agentrl.runtime.weight_sync import TensorTransport

    sglang = SimpleNamespace(urls=["http://127.0.0.1:1"])  # an SGLangEngineGroup of real SGLang: no ipc_folder
    assert push_folder("tensor", sglang, str(tmp_path)) is None
    assert push_folder("disk", sglang, str(tmp_path)) == str(tmp_path)
    folder = IpcFolder.create()
    try:
        launched = SimpleNamespace(ipc_folder=folder)
        assert push_folder("tensor", launched, str(tmp_path)) == str(folder.path)
        assert TensorTransport([object()], ipc_dir=push_folder("tensor", launched, str(tmp_path))).folder is not None
    finally:
        folder.remove()
