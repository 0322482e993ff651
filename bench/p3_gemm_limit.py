"""P3 limit: the embedded engine's decode tokens/s as a fraction of what this CPU's fp32 GEMMs allow.

    python bench/p3_gemm_limit.py [--hf-checkpoint PATH] [--batch 32] [--prompt 100] [--new 128] [--reps 3]
                                  [--enable-torch-compile]

At batch 32 both the engine and HF ``generate`` are bound by fp32 matmuls (P3's long-story ratio is
only ~1.2), so the honest yardstick is the machine: how fast can this CPU run the matmuls one decode
step needs? Per step the model multiplies a ``[batch, in]`` activation by every linear weight (q, k,
v, o, gate, up, down in every layer, then the LM head) and, per sequence, the query by its cached keys
and values (attention at the context length reached). This script times exactly those GEMMs, with
``torch`` on random fp32 tensors of the same shapes and the same threads, back to back, and calls
``batch / (their time)`` the GEMM-bound decode rate. The engine decodes ``--batch`` requests of
``--prompt`` random tokens for ``--new`` tokens each (``ignore_eos``); its decode rate excludes
the prefill (a first call generating 1 token measures it). Reported: engine ÷ limit (1.0 = nothing
but matmuls), and the GFLOP/s of the GEMMs themselves. Repetitions interleave engine, GEMMs.
``--enable-torch-compile`` adds a second engine whose decode steps are compiled (``agentrl serve
--enable-torch-compile``), measured in the same repetitions: engine, compiled engine, GEMMs.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402


def gemm_shapes(cfg, batch: int) -> list[tuple[int, int, int, int]]:
    """``(count, m, k, n)`` of the matmuls in one decode step of ``batch`` rows (weights as ``[k, n]``)."""
    h, inter = cfg.hidden_size, cfg.intermediate_size
    heads = cfg.num_attention_heads
    kv = getattr(cfg, "num_key_value_heads", None) or heads
    hd = getattr(cfg, "head_dim", None) or h // heads
    layers = cfg.num_hidden_layers
    return [
        (layers, batch, h, heads * hd),  # q
        (2 * layers, batch, h, kv * hd),  # k, v
        (layers, batch, heads * hd, h),  # o
        (2 * layers, batch, h, inter),  # gate, up
        (layers, batch, inter, h),  # down
        (1, batch, h, cfg.vocab_size),  # LM head
    ]


def time_gemms(cfg, batch: int, context: int, iters: int = 5) -> tuple[float, float]:
    """Seconds of one decode step's GEMMs (median of ``iters``) and their GFLOP/s."""
    heads = cfg.num_attention_heads
    hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    # a weight of its own per use (as the model has one per layer): a reused matrix would stay in cache
    mats = [
        (torch.randn(m, k), [torch.randn(k, n) for _ in range(count)]) for count, m, k, n in gemm_shapes(cfg, batch)
    ]
    # attention per sequence: scores q[heads, 1, hd] @ K^T[heads, hd, ctx], then probs @ V[heads, ctx, hd]
    layers = cfg.num_hidden_layers
    q, p = torch.randn(batch * heads, 1, hd), torch.randn(batch * heads, 1, context)
    kv = [(torch.randn(batch * heads, hd, context), torch.randn(batch * heads, context, hd)) for _ in range(layers)]
    flops = sum(2 * a.shape[0] * a.shape[1] * ws[0].shape[1] * len(ws) for a, ws in mats)
    flops += layers * 2 * (2 * batch * heads * hd * context)
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        for a, ws in mats:
            for w in ws:
                torch.mm(a, w)
        for kt, v in kv:
            torch.bmm(q, kt)
            torch.bmm(p, v)
        times.append(time.perf_counter() - t0)
    t = statistics.median(times)
    return t, flops / t / 1e9


async def engine_decode_rate(engine, batch: int, prompt: int, new: int, vocab: int, seed: int) -> float:
    """Decode tokens/s of ``batch`` concurrent requests, the prefill's time taken out."""
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(10, vocab, (prompt,), generator=g).tolist() for _ in range(batch)]

    async def run(max_new: int) -> float:
        engine.flush_cache()
        sp = {"max_new_tokens": max_new, "temperature": 1.0, "ignore_eos": True}
        t0 = time.perf_counter()
        await asyncio.gather(*(engine.generate(p, dict(sp)) for p in prompts))
        return time.perf_counter() - t0

    prefill = await run(1)
    total = await run(new)
    return batch * (new - 1) / max(total - prefill, 1e-9)


async def main() -> None:
    from agentrl.checkpoint import resolve_hf_checkpoint
    from agentrl.engines.local import LocalEngine

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hf-checkpoint", default=None)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--prompt", type=int, default=100)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument(
        "--enable-torch-compile",
        action="store_true",
        help="also a second engine with the compiled decode step (agentrl serve --enable-torch-compile), "
        "measured in the same reps",
    )
    a = ap.parse_args()
    path = resolve_hf_checkpoint(a.hf_checkpoint)
    engines = {"engine": LocalEngine(path, max_running_requests=a.batch, seed=0)}
    if a.enable_torch_compile:
        t0 = time.perf_counter()
        engines["compiled"] = LocalEngine(
            path, max_running_requests=a.batch, seed=0, enable_torch_compile=True, torch_compile_max_bs=a.batch
        )
        print(f"compiled engine ready in {time.perf_counter() - t0:.1f}s (load + compile)")
    cfg = engines["engine"].model.config
    context = a.prompt + a.new // 2  # the mean context length over the decode
    print(f"model {path}, torch threads {torch.get_num_threads()}, batch {a.batch}, mean context {context}")
    for engine in engines.values():
        await engine_decode_rate(engine, 4, 16, 8, cfg.vocab_size, 99)  # warm-up
    time_gemms(cfg, a.batch, context, iters=2)
    rates: dict[str, list[float]] = {name: [] for name in engines}
    fractions: dict[str, list[float]] = {name: [] for name in engines}
    limits, gflops = [], []
    for r in range(a.reps):
        got = {
            name: await engine_decode_rate(e, a.batch, a.prompt, a.new, cfg.vocab_size, r)
            for name, e in engines.items()
        }
        t, gf = time_gemms(cfg, a.batch, context)
        limit = a.batch / t
        limits.append(limit)
        gflops.append(gf)
        for name, rate in got.items():
            rates[name].append(rate)
            fractions[name].append(rate / limit)
        shown = ", ".join(f"{name} {rate:.1f} tok/s ({rate / limit:.2f})" for name, rate in got.items())
        print(f"rep {r}: {shown}; GEMM limit {limit:.1f} tok/s ({gf:.1f} GFLOP/s)")
    for engine in engines.values():
        await engine.close()
    for name in engines:
        print(
            f"P3 limit ({name}): decode {statistics.median(rates[name]):.1f} tok/s / GEMM-bound "
            f"{statistics.median(limits):.1f} tok/s = {statistics.median(fractions[name]):.2f} of this CPU's fp32 "
            f"GEMM limit (median of {a.reps}; GEMMs at {statistics.median(gflops):.1f} GFLOP/s)"
        )
    if "compiled" in engines:
        ratios = [c / e for c, e in zip(rates["compiled"], rates["engine"])]
        print(f"compiled / eager decode, median of {a.reps}: {statistics.median(ratios):.3f}")


if __name__ == "__main__":
    asyncio.run(main())
