"""P8: train tokens/s of the ``megatron`` backend / the ``torch`` backend, same samples, same process.

    python bench/p8_megatron.py [--model tiny|default] [--samples 16] [--reps 5] [--max-tokens-per-gpu 1280]
                                [--threads N]

Both backends train P4's samples (prompt 40-120 + response 20-200 random tokens, loss masks with
tool-output gaps, advantage +-1) from the same initial weights, one optimizer step per repetition,
fp32, packed micro-batches of ``--max-tokens-per-gpu`` tokens, repetitions interleaved A,B then B,A;
each side's first (warm-up) step is not counted. Also reported: the largest |delta log-prob| of the
two backends on the samples before training (the same math must give the same numbers).

Both backends attend per sample inside a packed row (``agentrl.trainer.packed_attention`` for
torch, ``agentrl.trainer.megatron_attention`` for megatron), so neither computes scores across
samples. Measured here (2 cores, tiny model, 1280-token budget): 0.39 when megatron's stock local
attention computed all T x T scores of the row; 0.91-0.92 with per-sample attention. On a GPU use
``bench/gpu_check.py``.
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
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=["tiny", "default"], default="tiny")
    p.add_argument("--samples", type=int, default=16)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--max-tokens-per-gpu", type=int, default=1280)
    p.add_argument("--threads", type=int, default=None)
    a = p.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)

    from transformers import AutoConfig

    from agentrl.config import TrainConfig
    from agentrl.trainer.megatron_trainer import MegatronTrainer
    from agentrl.trainer.torch_trainer import TorchTrainer
    from bench.p4_train_throughput import make_samples

    if a.model == "tiny":
        from agentrl.tiny import build_model

        ckpt = build_model(Path(tempfile.mkdtemp(prefix="p8_")) / "tiny", hidden_size=256, num_layers=4)
    else:
        from agentrl.checkpoint import resolve_hf_checkpoint

        ckpt = Path(resolve_hf_checkpoint(None))
    samples = make_samples(a.samples, AutoConfig.from_pretrained(str(ckpt)).vocab_size)
    tokens = sum(len(s.tokens) for s in samples)
    cfg = TrainConfig(
        lr=1e-6, global_batch_size=a.samples, max_tokens_per_gpu=a.max_tokens_per_gpu, dtype="float32", clip_grad=1.0
    )
    sides = {"megatron": MegatronTrainer(ckpt, cfg, device="cpu"), "torch": TorchTrainer(ckpt, cfg, device="cpu")}
    lp = {n: [x for row in t.compute_log_probs(samples, ref=False).old for x in row] for n, t in sides.items()}
    delta = max(abs(x - y) for x, y in zip(lp["megatron"], lp["torch"]))
    print(
        f"model {ckpt}, torch threads {torch.get_num_threads()}, {a.samples} samples, {tokens} tokens, "
        f"budget {a.max_tokens_per_gpu}; max |delta log-prob| megatron vs torch: {delta:.2e}"
    )

    def step(name: str) -> float:
        t0 = time.perf_counter()
        sides[name].train_step(samples)
        return time.perf_counter() - t0

    for name in sides:
        print(f"warm-up {name}: {step(name):.2f}s", flush=True)
    ratios = []
    for r in range(a.reps):
        order = ["megatron", "torch"] if r % 2 == 0 else ["torch", "megatron"]
        secs = {n: step(n) for n in order}
        ratios.append(secs["torch"] / secs["megatron"])
        print(
            f"rep {r}: megatron {tokens / secs['megatron']:.0f} tok/s, torch {tokens / secs['torch']:.0f} tok/s, "
            f"ratio {ratios[-1]:.2f}",
            flush=True,
        )
    print(f"P8 train tokens/s megatron / torch, median of {a.reps}: {statistics.median(ratios):.2f}")
    sides["megatron"].close()


if __name__ == "__main__":
    main()
