"""P12: the embedded engine's decode throughput with LoRA adapters mixed in one batch (issue 40).

Same model, same prompts, same run, rounds interleaved so the machine's drift hits every side alike:

  none    an engine started without LoRA (no hooks at all)
  base    the LoRA engine, every request on the base model (lora_path None: what the hooks cost when idle)
  one     the LoRA engine, every request on one adapter
  mixed   the LoRA engine, requests spread round-robin over 4 adapters, so every decode step mixes them

Each round sends ``--requests`` requests at once (``--max-running`` decode together), ``max_new_tokens``
``--tokens`` with ``ignore_eos`` (every row decodes the same length), temperature 1. Throughput = completion
tokens / wall time of the round (prefill included); the prefix cache is flushed before each round. The adapters are
PEFT LoRAs (``--rank``, all linear layers, random B) made here on the model. Goal (issue 40): mixed >= 0.85 x one.
Peak RSS of the process and the adapters' stacked bytes are printed beside the speeds.

Run: ``python bench/p12_lora_serving.py [--hf-checkpoint PATH] [--reps 3]`` (~5 min on 2 cores with SmolLM2).
"""

from __future__ import annotations

import argparse
import asyncio
import resource
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_adapters(base: Path, out: Path, n: int, rank: int) -> list[Path]:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    paths = []
    for i in range(n):
        torch.manual_seed(i)
        model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
        peft = get_peft_model(model, LoraConfig(r=rank, lora_alpha=rank, target_modules=ALL, init_lora_weights=False))
        for name, p in peft.named_parameters():
            if "lora_B" in name:
                p.data.mul_(0.01)  # a small change to the model, as a trained adapter is
        peft.save_pretrained(out / f"a{i}")
        paths.append(out / f"a{i}")
    return paths


async def round_(engine, prompts: list[list[int]], names: list[str | None], tokens: int) -> float:
    engine.flush_cache()
    sp = {"max_new_tokens": tokens, "temperature": 1.0, "ignore_eos": True}
    t0 = time.perf_counter()
    outs = await asyncio.gather(*[engine.generate(p, sp, lora_path=n) for p, n in zip(prompts, names)])
    wall = time.perf_counter() - t0
    return sum(o["meta_info"]["completion_tokens"] for o in outs) / wall


async def main() -> None:
    from agentrl.checkpoint import resolve_hf_checkpoint
    from agentrl.engines.local.engine import LocalEngine
    from bench.p3_engine import make_prompts

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--hf-checkpoint", default=None)
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--max-running", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    path = resolve_hf_checkpoint(args.hf_checkpoint)
    with tempfile.TemporaryDirectory() as tmp:
        # made in a thread that ends: PEFT's parallel ops would leave this thread OpenMP workers that slow the
        # engines' own (see LocalEngine.__init__)
        made: list[list[Path]] = []
        maker = threading.Thread(target=lambda: made.append(make_adapters(path, Path(tmp), 4, args.rank)))
        maker.start()
        maker.join()
        adapters = made[0]
        # one engine alive at a time: two engines' worker threads in one process, each with its OpenMP workers,
        # outnumber 2 cores and slow each other (see LocalEngine.__init__), so each rep starts and closes them in turn
        names_of = {
            "none": [None] * args.requests,
            "base": [None] * args.requests,
            "one": ["a0"] * args.requests,
            "mixed": [f"a{i % 4}" for i in range(args.requests)],
        }
        speeds: dict[str, list[float]] = {k: [] for k in names_of}
        stacks = mixed_forwards = 0
        prompts: list[list[int]] = []
        for rep in range(args.reps):
            plain = LocalEngine(path, max_running_requests=args.max_running, seed=0)
            prompts = prompts or make_prompts(plain.tokenizer, args.requests)
            await round_(plain, prompts[:4], [None] * 4, 4)  # warm-up: first-call costs off the clock
            speeds["none"].append(await round_(plain, prompts, names_of["none"], args.tokens))
            await plain.close()
            lora = LocalEngine(
                path,
                max_running_requests=args.max_running,
                seed=0,
                lora_paths=[f"a{i}={p}" for i, p in enumerate(adapters)],
            )
            await round_(lora, prompts[:4], ["a0", "a1", "a2", None], 4)
            for name in ("base", "one", "mixed"):
                speeds[name].append(await round_(lora, prompts, names_of[name], args.tokens))
            assert lora.lora is not None
            stacks = sum(layer.A.nbytes + layer.B.nbytes for layer in lora.lora.layers.values())
            mixed_forwards = lora.lora.mixed_forwards
            await lora.close()
            print(f"rep {rep + 1}: " + ", ".join(f"{k} {v[-1]:.0f} tok/s" for k, v in speeds.items()), flush=True)
    med = {k: statistics.median(v) for k, v in speeds.items()}
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"\nP12 ({path.name}, {args.requests} requests, {args.tokens} tokens, rank {args.rank}, {args.reps} reps)")
    for k, v in speeds.items():
        print(f"  {k:6s} median {med[k]:7.1f} tok/s  runs {', '.join(f'{x:.1f}' for x in v)}")
    ratios = {
        "mixed / one": [m / o for m, o in zip(speeds["mixed"], speeds["one"])],
        "one / none": [o / n for o, n in zip(speeds["one"], speeds["none"])],
        "base / none": [b / n for b, n in zip(speeds["base"], speeds["none"])],
    }
    for k, v in ratios.items():
        print(f"  {k:12s} median {statistics.median(v):.3f}  per rep {', '.join(f'{x:.3f}' for x in v)}")
    print(f"  goal: mixed / one >= 0.85 -> {'met' if statistics.median(ratios['mixed / one']) >= 0.85 else 'NOT met'}")
    print(f"  adapters' stacked A/B: {stacks / 2**20:.1f} MiB; forwards that mixed adapters: {mixed_forwards}")
    print(f"  peak RSS of the process (one engine at a time, 4 adapters): {peak:.0f} MiB")


if __name__ == "__main__":
    asyncio.run(main())
