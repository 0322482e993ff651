"""P5: weight sync bytes/s (trainer actor -> embedded engine actor) / an in-memory copy of the same tensors.

What is timed, interleaved A, B, A, B ... (median ratio reported; the machine is noisy):

- **baseline**: ``dst.copy_(src)`` for every weight tensor, in one process (the floor any transport
  that ends with the engine owning a copy must pay);
- **shared memory**: what ``agentrl train`` does after each step when the embedded engines share
  the trainer's node: rank 0 writes its full weights into a ``/dev/shm`` slot (one copy, one writer
  thread per part file; the trainer proved them finite when it loaded them, as after each step) and the engine
  re-points its parameters at it between batches without reading a page, until the engine answers
  (``TrainerGroup.push_weights("shm", engine actors, ...)``, the route ``agentrl train`` picks);
- **object store**: the fallback for engines on other nodes — Ray stores the weights (numpy, one
  copy), the engine maps them zero-copy and copies them into its model
  (``TrainerGroup.push_weights("object_store", engine actors, ...)``);
- **disk** (for reference): the same weights through ``--weight-sync disk`` (safetensors written by
  the trainer, ``/update_weights_from_disk`` on the engine).

    python bench/p5_weight_sync.py                # the default model (SmolLM2-135M, 540 MB fp32)
    python bench/p5_weight_sync.py --model tiny   # a small local model (quick)

With ``--lora-rank R`` (issue 40) the trainer holds a LoRA policy (all-linear, rank R) and the engine serves adapters:
the full routes push the merged weights, and an **adapter** side pushes what a LoRA run pushes, the adapter alone
(``TrainerGroup.push_adapter``: object store, the engine replacing its policy adapter); printed as time and bytes
against the shared-memory push of the merged weights, same run, interleaved.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="default", help="default | tiny | PATH to a HF checkpoint")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--no-disk", action="store_true")
    ap.add_argument("--lora-rank", type=int, default=0, help="a LoRA policy: also time the adapter-only push")
    a = ap.parse_args()

    import ray
    import torch

    from agentrl.checkpoint import resolve_hf_checkpoint
    from agentrl.config import TrainConfig
    from agentrl.runtime.cluster import init_ray
    from agentrl.runtime.engine_group import EngineGroup, numpy_to_tensors
    from agentrl.runtime.trainer_group import TrainerGroup

    tmp = Path(tempfile.mkdtemp(prefix="p5-"))
    if a.model == "tiny":
        from agentrl.tiny import build_model

        ckpt = build_model(tmp / "model", hidden_size=512, num_layers=8)
    else:
        ckpt = resolve_hf_checkpoint(None if a.model == "default" else a.model)
    init_ray(num_cpus=2)
    # the threads `agentrl train` gives each actor in a synchronous run (every core: one phase at a time),
    # the same as the baseline copy below, which runs with torch's default thread count
    cores = os.cpu_count() or 1
    train_cfg = TrainConfig(lora_rank=a.lora_rank) if a.lora_rank else TrainConfig()
    trainers = TrainerGroup(ckpt, train_cfg, world_size=1, num_cpus=1, num_gpus=0, num_threads=cores)
    lora = {"enable_lora": True, "max_lora_rank": a.lora_rank, "lora_target_modules": ["all"]} if a.lora_rank else {}
    engines = EngineGroup.embedded(ckpt, 1, num_cpus=1, max_running_requests=4, num_threads=cores, **lora)
    src = numpy_to_tensors(ray.get(trainers.named_weights_ref()))
    src = {k: v.clone() for k, v in src.items()}
    dst = {k: torch.empty_like(v) for k, v in src.items()}
    nbytes = sum(t.nbytes for t in src.values())
    print(f"model {ckpt}: {len(src)} tensors, {nbytes / 2**20:.0f} MiB")

    def baseline() -> float:
        t0 = time.perf_counter()
        for k, t in src.items():
            dst[k].copy_(t)
        return time.perf_counter() - t0

    version = [0]

    def object_store() -> float:
        version[0] += 1
        t0 = time.perf_counter()
        assert trainers.push_weights("object_store", engines.actors, str(version[0])) == "object_store"
        return time.perf_counter() - t0

    def shared() -> float:
        version[0] += 1
        t0 = time.perf_counter()
        assert trainers.push_weights("shm", engines.actors, str(version[0])) == "shm"
        return time.perf_counter() - t0

    def disk() -> float:
        version[0] += 1
        t0 = time.perf_counter()
        trainers.push_weights("disk", engines.urls, str(version[0]), folder=str(tmp / "sync"), api_key=engines.api_key)
        return time.perf_counter() - t0

    def adapter() -> float:
        version[0] += 1
        t0 = time.perf_counter()
        trainers.push_adapter(engines.actors, str(version[0]))
        return time.perf_counter() - t0

    baseline(), object_store(), shared(), shared()  # warm-up (both shared slots touched once)
    if a.lora_rank:
        adapter()
        named, _ = ray.get(trainers.actors[0].adapter_weights.remote())
        abytes = sum(v.nbytes for v in named.values())
        pairs = [(shared(), adapter()) for _ in range(a.reps)]
        ratios = [t_ad / t_sh for t_sh, t_ad in pairs]
        print(
            f"adapter (r{a.lora_rank}) {abytes / 2**20:.1f} MiB vs merged {nbytes / 2**20:.0f} MiB "
            f"(bytes {abytes / nbytes:.4f}); push seconds adapter "
            + " ".join(f"{t:.3f}" for _, t in pairs)
            + " vs shared memory "
            + " ".join(f"{t:.3f}" for t, _ in pairs)
            + f"; time adapter / full: median {statistics.median(ratios):.3f} "
            f"({min(ratios):.3f}-{max(ratios):.3f})"
        )
    # Each transport is interleaved with the baseline on its own: a slower transport's memory churn
    # (object-store allocation, disk page cache) would otherwise slow whatever runs right after it.
    results = {}
    for name, fn in (("shared memory", shared), ("object store", object_store), ("disk", disk)):
        if name == "disk" and a.no_disk:
            continue
        pairs = [(baseline(), fn()) for _ in range(a.reps)]
        results[name] = statistics.median(b / t for b, t in pairs)
        print(
            f"{name:14s} "
            + "  ".join(f"{nbytes / t / 1e9:5.2f}" for _, t in pairs)
            + " GB/s   copy "
            + "  ".join(f"{nbytes / b / 1e9:5.2f}" for b, _ in pairs)
            + " GB/s"
        )
    print(
        f"P5 weight sync / in-memory copy, median of {a.reps} (goal >= 0.5): "
        + "   ".join(f"{k} {v:.3f}" for k, v in results.items())
    )
    trainers.shutdown()
    engines.shutdown()
    ray.shutdown()


if __name__ == "__main__":
    main()
