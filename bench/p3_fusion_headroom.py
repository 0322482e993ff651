"""P3 headroom: how much of the embedded engine's decode step fusing every op outside the matmuls would win back.

    python bench/p3_fusion_headroom.py [--tiny] [--batch 32] [--context 160] [--reps 8] [--threads N]

``bench/p3_gemm_limit.py`` puts the engine's decode at 0.8-1.0 of this CPU's fp32 GEMM limit; the rest is the
norms, rotary, SiLU, residual adds, KV writes, sampling and the Python that dispatches ~1,000 small ops a
step. The most any rewrite of those can win back is what a compiler that fuses all of them and removes
the Python wins. This script measures exactly that: the engine's own cached forward
(``CachedForward.forward``, one decode step of ``--batch`` rows at ``--context`` cached tokens) eager,
against the same step compiled as ``--enable-torch-compile`` compiles it (``CachedForward.compile_decode``:
``torch.compile(dynamic=True)``, inductor's C++ kernels for every elementwise chain, matmuls left to oneDNN
as in eager), interleaved (eager, compiled, eager, ...), median of ``--reps`` rounds of 5 steps each. Also
printed: the compile time, whether another batch size compiled again (it should not), the largest logit and
log-prob difference between the two on the same inputs, and from ``torch.profiler`` the share of an eager
step spent in matmuls and attention.

The engine offers the compiled step opt-in (``agentrl serve --enable-torch-compile``, SGLang's flag): at these
numbers (~9% of a SmolLM2-135M step for 1-3 minutes of compiling, bench/README.md, P3) it does not pay for
itself in a run the size of the main job, so it is off by default.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402


def main() -> None:
    from agentrl.checkpoint import resolve_hf_checkpoint
    from agentrl.engines.local import LocalEngine
    from agentrl.tiny import build_model

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hf-checkpoint", default=None, help="default: the default model (SmolLM2-135M-Instruct)")
    ap.add_argument("--tiny", action="store_true", help="P6's tiny Llama (hidden 256, 3 layers) instead")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--context", type=int, default=160, help="tokens already cached per row")
    ap.add_argument("--reps", type=int, default=8)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's own)")
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    tmp = tempfile.TemporaryDirectory(prefix="p3f_")
    path = build_model(Path(tmp.name) / "tiny", hidden_size=256, num_layers=3) if a.tiny else None
    path = path or resolve_hf_checkpoint(a.hf_checkpoint)
    engine = LocalEngine(path, max_running_requests=a.batch, seed=0)
    runner, vocab = engine.runner, engine.vocab_size
    B, ctx = a.batch, a.context
    g = torch.Generator().manual_seed(0)
    print(f"model {path}, torch threads {torch.get_num_threads()}, batch {B}, context {ctx}", flush=True)
    with torch.inference_mode():
        prompt = torch.randint(0, vocab, (B, ctx), generator=g)
        zeros = torch.zeros(B, dtype=torch.long)
        runner.forward(prompt, torch.arange(B), zeros, torch.full((B,), ctx - 1))  # fill the rows' KV
        ids, start = torch.randint(0, vocab, (B, 1), generator=g), torch.full((B,), ctx)

        t0 = time.perf_counter()
        runner.compile_decode(B)  # what `agentrl serve --enable-torch-compile` does at start-up: one graph
        first = time.perf_counter() - t0
        graph = runner._compiled

        def compiled() -> torch.Tensor:  # one decode step; it rewrites the same KV slot each time
            return runner.forward(ids, slice(0, B), start, zeros)

        def eager() -> torch.Tensor:
            runner._compiled = None
            try:
                return runner.forward(ids, slice(0, B), start, zeros)
            finally:
                runner._compiled = graph

        from torch._dynamo.utils import counters

        graphs = counters["stats"]["unique_graphs"]
        b2 = max(2, B // 2 + 1)
        runner.forward(ids[:b2], slice(0, b2), start[:b2], zeros[:b2])  # another batch size: the same graph
        out, ref = compiled(), eager()
        dlogit = (out - ref).abs().max().item()
        dlogp = (out.log_softmax(-1) - ref.log_softmax(-1)).abs().max().item()
        print(
            f"compile: {first:.1f}s (the warm-up's graphs; batch {b2} then compiled "
            f"{counters['stats']['unique_graphs'] - graphs} more); max |d logit| {dlogit:.2e}, max |d log-prob| {dlogp:.2e}",
            flush=True,
        )
        for _ in range(3):
            eager(), compiled()
        times: dict[str, list[float]] = {"eager": [], "compiled": []}
        for _ in range(a.reps):
            for name, fn in (("eager", eager), ("compiled", compiled)):
                ts = []
                for _ in range(5):
                    t0 = time.perf_counter()
                    fn()
                    ts.append(time.perf_counter() - t0)
                times[name].append(statistics.median(ts))
        ratios = [e / c for e, c in zip(times["eager"], times["compiled"])]
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(5):
                eager()
        events = prof.key_averages()
        total = sum(e.self_cpu_time_total for e in events)
        mm = sum(e.self_cpu_time_total for e in events if e.key in ("aten::mm", "aten::addmm", "aten::bmm"))
        attn = sum(e.self_cpu_time_total for e in events if "scaled_dot_product" in e.key)
    print(
        f"eager step {1000 * statistics.median(times['eager']):.2f} ms, compiled {1000 * statistics.median(times['compiled']):.2f} "
        f"ms; eager / compiled, median of {a.reps}: {statistics.median(ratios):.3f} "
        f"({min(ratios):.3f}-{max(ratios):.3f}); eager step under the profiler: matmuls {mm / total:.0%}, "
        f"attention {attn / total:.0%}, everything else {1 - (mm + attn) / total:.0%}"
    )
    tmp.cleanup()


if __name__ == "__main__":
    main()
