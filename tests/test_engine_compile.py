"""The embedded engine's compiled decode step: SGLang's ``--enable-torch-compile`` / ``--torch-compile-max-bs``.

Compiling is real (inductor, the machine's C++ compiler), on the tiny model: ~15-40 s per engine on 2 cores,
so those tests are e2e; the refusals are unit tests. What they pin down: the compiled step computes what the eager one does, across batch
sizes, context lengths, a KV buffer that grows, a memory release/resume and a weight update; nothing compiles
again after start-up (a recompile mid-run would stall every request for as long); ``agentrl serve`` takes the
flags and reports them; bad values and a machine without a compiler are refused before the model loads.
"""

from __future__ import annotations

import asyncio
import threading

import httpx
import pytest
import torch

from agentrl.engines.local.engine import LocalEngine


def _in_engine_thread(fn):
    """Run ``fn`` as the engine's worker runs its steps: in a thread of its own, under inference mode."""
    out: dict = {}

    def run() -> None:
        try:
            with torch.inference_mode():
                out["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 - re-raised in the test
            out["error"] = exc

    t = threading.Thread(target=run)
    t.start()
    t.join()
    if "error" in out:
        raise out["error"]
    return out["value"]


@pytest.mark.e2e
def test_compiled_decode_matches_eager_and_never_recompiles_while_serving(tiny_ckpt):
    from torch._dynamo.utils import counters

    torch._dynamo.reset()  # graphs compiled earlier in this process would serve (their guards are shapes)
    before = counters["stats"]["unique_graphs"]
    compiled = LocalEngine(
        tiny_ckpt, max_running_requests=8, enable_torch_compile=True, enable_memory_saver=True, seed=0
    )
    graphs = counters["stats"]["unique_graphs"]
    assert graphs == before + 2, "the warm-up compiles two graphs: a full batch, any smaller one"
    eager = LocalEngine(tiny_ckpt, max_running_requests=8, enable_memory_saver=True, seed=0)
    assert compiled.runner._compiled is not None and eager.runner._compiled is None
    vocab = compiled.vocab_size
    g = torch.Generator().manual_seed(0)

    def prefill(context: int) -> None:
        ids = torch.randint(0, vocab, (8, context), generator=g)
        for e in (compiled, eager):
            e.runner.forward(ids, torch.arange(8), torch.zeros(8, dtype=torch.long), torch.full((8,), context - 1))

    def steps(shapes) -> list[float]:
        diffs = []
        for n, at in shapes:  # rows 0..n-1 decode one token at position `at`
            ids = torch.randint(0, vocab, (n, 1), generator=g)
            start = torch.full((n,), at)
            a, b = (
                e.runner.forward(ids, slice(0, n), start, torch.zeros(n, dtype=torch.long)) for e in (compiled, eager)
            )
            diffs.append((a - b).abs().max().item())
        return diffs

    def sweep() -> list[float]:
        prefill(40)
        # full and partial batches, a single row (eager), and contexts past the buffers' 256 (they grow twice)
        return steps([(8, 40), (5, 41), (2, 100), (1, 120), (8, 255), (7, 300), (3, 700), (8, 41)])

    served = compiled.runner.compiled_steps
    diffs = _in_engine_thread(sweep)
    assert max(diffs) < 1e-4, diffs
    assert compiled.runner.compiled_steps - served == 7, "every step of 2..8 rows ran the compiled graph"
    assert eager.runner.compiled_steps == 0
    assert compiled.runner.cache.capacity >= 701
    # the KV buffers dropped and made again (colocated offload), then new weights through shared-memory-style
    # re-pointing (tensors made outside inference mode, as the trainer's are)
    for e in (compiled, eager):  # both start the second sweep from fresh (zeroed) buffers
        assert asyncio.run(e.release_memory_occupation())["success"]
        assert asyncio.run(e.resume_memory_occupation())["success"]
    new = {k: v.detach().clone() * 1.01 for k, v in eager.model.state_dict().items()}
    for e in (compiled, eager):
        copy = {k: v.clone() for k, v in new.items()}
        assert asyncio.run(e.update_weights_from_tensors(copy, "v1", assign=True))["success"]
    diffs = _in_engine_thread(sweep)
    assert max(diffs) < 1e-4, diffs
    assert counters["stats"]["unique_graphs"] == graphs, "the compiled decode step compiled again while serving"

    async def generate() -> list[dict]:
        sp = {"max_new_tokens": 12, "ignore_eos": True, "temperature": 1.0}
        prompts = [torch.randint(0, vocab, (20 + i,), generator=g).tolist() for i in range(6)]
        return await asyncio.gather(*(compiled.generate(p, dict(sp), return_logprob=True) for p in prompts))

    outs = asyncio.run(generate())
    assert [o["meta_info"]["completion_tokens"] for o in outs] == [12] * 6
    assert all(lp <= 0 for o in outs for lp, _, _ in o["meta_info"]["output_token_logprobs"])
    assert counters["stats"]["unique_graphs"] == graphs
    for e in (compiled, eager):
        asyncio.run(e.close())


@pytest.mark.e2e
def test_no_recompile_when_every_smaller_batch_size_is_a_model_dimension(tiny_ckpt):
    """3 rows on a model with 2 KV heads: the only smaller batch (2) equals a model dimension, which torch would
    trace as that dimension; the warm-up then traces one graph with size sharing off, and 2 and 3 rows both use it."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()  # graphs compiled earlier in this process would serve (their guards are shapes)
    before = counters["stats"]["unique_graphs"]
    engine = LocalEngine(tiny_ckpt, max_running_requests=3, enable_torch_compile=True, seed=0)
    assert engine.runner.kv_heads == 2
    graphs = counters["stats"]["unique_graphs"]
    assert graphs == before + 1

    def steps() -> int:
        served = engine.runner.compiled_steps
        for n, at in [(3, 40), (2, 41), (3, 300), (2, 600)]:
            ids = torch.zeros(n, 1, dtype=torch.long)
            engine.runner.forward(ids, slice(0, n), torch.full((n,), at), torch.zeros(n, dtype=torch.long))
        return engine.runner.compiled_steps - served

    assert _in_engine_thread(steps) == 4
    assert counters["stats"]["unique_graphs"] == graphs, "a batch size compiled again while serving"
    asyncio.run(engine.close())


@pytest.mark.e2e
def test_serve_takes_sglangs_compile_flags_and_reports_them(tiny_ckpt):
    from agentrl.engines.local.process import local_server

    with local_server(
        tiny_ckpt,
        extra_args=["--seed", "0", "--enable-torch-compile", "--torch-compile-max-bs", "4"],
        startup_timeout=300,
    ) as url:
        info = httpx.get(f"{url}/get_server_info", timeout=30).json()
        assert info["enable_torch_compile"] is True and info["torch_compile_max_bs"] == 4
        assert info["torch_compile_steps"] == 2  # the warm-up's (a full batch, a smaller one)
        # 6 rows of 3..13 new tokens: 6 and 5 rows decode eager (above 4), then 4, 3, 2 compiled, the last one eager
        body = {
            "input_ids": [[5, 6, 7, 8 + i] for i in range(6)],
            "sampling_params": [{"max_new_tokens": 3 + 2 * i, "ignore_eos": True} for i in range(6)],
        }
        outs = httpx.post(f"{url}/generate", json=body, timeout=120).json()
        assert [o["meta_info"]["completion_tokens"] for o in outs] == [3 + 2 * i for i in range(6)]
        steps = httpx.get(f"{url}/get_server_info", timeout=30).json()["torch_compile_steps"] - 2
        assert steps >= 4, f"only {steps} decode steps ran the compiled graph"


def test_bad_compile_settings_are_refused_before_the_model_loads(tmp_path):
    missing = tmp_path / "no-such-checkpoint"  # never read: the refusals come first
    with pytest.raises(ValueError, match="enable_torch_compile must be true or false"):
        LocalEngine(missing, enable_torch_compile="yes")  # type: ignore[arg-type]
    for bad in (0, -1, 70000, 2.0, True):
        with pytest.raises(ValueError, match="torch_compile_max_bs must be an integer"):
            LocalEngine(missing, enable_torch_compile=True, torch_compile_max_bs=bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="must both be >= 2"):
        LocalEngine(missing, enable_torch_compile=True, max_running_requests=1)
    with pytest.raises(ValueError, match="must both be >= 2"):
        LocalEngine(missing, enable_torch_compile=True, torch_compile_max_bs=1)
    with pytest.raises(ValueError, match="use fixed threads"):
        LocalEngine(missing, enable_torch_compile=True, adaptive_threads=True)
    import torch._inductor.config as inductor_config

    with inductor_config.patch({"cpp.cxx": (None, str(tmp_path / "no-c++"))}):  # a machine without one
        with pytest.raises(RuntimeError, match="needs a C\\+\\+ compiler"):
            LocalEngine(missing, enable_torch_compile=True)
