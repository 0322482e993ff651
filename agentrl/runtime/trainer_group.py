"""N trainer ranks as Ray actors, driven as one trainer.

:class:`TrainerGroup` owns ``world_size`` :class:`TrainerActor` s, each holding one
:class:`~agentrl.trainer.torch_trainer.TorchTrainer` rank. The actors form their own
``torch.distributed`` group (gloo on CPU, nccl on GPU) when ``world_size > 1``; the driver never
joins it. Every public method fans the call out to all ranks (sharded models need every rank in
every collective) and gathers the answer:

* ``compute_log_probs``: samples cut into contiguous, token-balanced shards; results re-joined in
  the original order;
* ``train_step``: each of the ``num_steps_per_rollout`` global batches cut into ``world_size``
  equal contiguous shards, so every rank steps on its share of the same global batch; the
  metrics are rank 0's, which are already global (the trainer sums them over ranks);
* ``named_weights_ref``: rank 0's full weights as one Ray ObjectRef (name -> CPU tensor) that
  engines fetch from the object store for weight sync;
* ``save`` / ``load`` / ``shutdown``.

Ray is not initialised here: the caller (train loop, tests) owns ``ray.init``.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path
from typing import Any, Sequence

import ray

from agentrl.config import TrainConfig
from agentrl.trainer.base import LogProbs, TrainSample


class TrainerActor:
    """One rank: joins the process group, then wraps a ``TorchTrainer``. Made remote by the group."""

    def __init__(self, num_threads: int):
        import torch

        torch.set_num_threads(max(1, num_threads))
        self.trainer = None

    def address(self) -> tuple[str, int]:
        """This node's IP and a free port on it: the rendezvous point when this actor is rank 0."""
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        return ray.util.get_node_ip_address(), port

    def setup(self, checkpoint: str, cfg: TrainConfig, rank: int, world_size: int, master: tuple[str, int],
              device: str) -> None:
        """Join the process group (``world_size > 1``) and load this rank's model."""
        import torch.distributed as dist

        from agentrl.trainer.torch_trainer import TorchTrainer

        if world_size > 1:
            os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = master[0], str(master[1])
            dist.init_process_group("gloo" if device == "cpu" else "nccl", rank=rank, world_size=world_size)
        self.trainer = TorchTrainer(checkpoint, cfg, rank=rank, world_size=world_size, device=device)
        self.checkpoint = checkpoint

    def compute_log_probs(self, samples: list[TrainSample], ref: bool) -> LogProbs:
        return self.trainer.compute_log_probs(samples, ref=ref)

    def train_step(self, samples: list[TrainSample]) -> dict[str, float]:
        return self.trainer.train_step(samples)

    def full_weights(self) -> dict[str, Any] | None:
        """Full CPU weights on rank 0 as numpy arrays, None elsewhere (every rank takes part in the gather).

        numpy, not torch tensors: Ray stores numpy arrays in shared memory with one copy and hands
        readers zero-copy views, so an engine on the same node loads them with one more copy.
        """
        from agentrl.runtime.engines import tensors_to_numpy

        weights = {name: t.cpu() for name, t in self.trainer.named_weights()}
        return tensors_to_numpy(weights) if self.trainer.rank == 0 else None

    def node_id(self) -> str:
        return ray.get_runtime_context().get_node_id()

    def write_shared_weights(self) -> tuple[str, Any] | None:
        """Rank 0 writes the full weights into the next shared-memory slot; returns (path, layout).

        Every rank takes part in gathering the weights; other ranks return None.
        """
        from agentrl.runtime.shm_weights import SharedWeightsWriter

        named = [(name, t) for name, t in self.trainer.named_weights()]
        if self.trainer.rank != 0:
            return None
        if getattr(self, "_shm", None) is None:
            self._shm = SharedWeightsWriter()
        return self._shm.write(named)

    def push_weights(self, kind: str, urls: list[str], version: str, folder: str | None = None) -> None:
        """Send the full weights to SGLang-compatible engines from rank 0 (``disk`` or ``nccl``).

        Every rank takes part in gathering the weights; rank 0 keeps one transport (and, for NCCL,
        one process group with the engines) and one event loop for the actor's lifetime.
        """
        import asyncio

        from agentrl.engines.http import SGLangEngine
        from agentrl.runtime.weight_sync import make_transport

        named = [(name, t) for name, t in self.trainer.named_weights()]
        if self.trainer.rank != 0:
            return
        if getattr(self, "_transport", None) is None:
            self._push_loop = asyncio.new_event_loop()
            engines = [SGLangEngine(u) for u in urls]
            extra = {"folder": folder, "config": self.checkpoint} if kind == "disk" else {}
            self._transport = make_transport(kind, engines, **extra)
        self._push_loop.run_until_complete(self._transport.push(named, version))

    def save(self, path: str, extra_state: dict[str, Any] | None) -> None:
        self.trainer.save(path, extra_state)

    def load(self, path: str) -> dict[str, Any]:
        return self.trainer.load(path)

    def shutdown(self) -> None:
        import torch.distributed as dist

        if getattr(self, "_shm", None) is not None:
            self._shm.close()

        if dist.is_initialized():
            dist.destroy_process_group()


class TrainerGroup:
    """``world_size`` trainer ranks as Ray actors, with the :class:`~agentrl.trainer.base.Trainer` verbs.

    ``num_cpus`` per actor also sets its torch/OMP thread count unless ``num_threads`` is given (the
    synchronous loop lets training use every core, since the engines idle meanwhile). On a GPU machine each actor asks
    for one GPU (``num_gpus=1``, or ``num_gpus`` if given). ``placement_group`` (optional) pins
    rank ``r`` to its bundle ``bundle_indices[r]`` (default: bundle ``r``).
    """

    def __init__(self, checkpoint: str | Path, cfg: TrainConfig, *, world_size: int = 1, num_cpus: float = 1,
                 num_gpus: float | None = None, placement_group: Any | None = None,
                 bundle_indices: Sequence[int] | None = None, num_threads: int | None = None):
        if num_gpus is None:
            num_gpus = 1 if _cluster_has_gpus() else 0
        self.cfg, self.world_size = cfg, world_size
        threads = num_threads or max(1, int(num_cpus))
        remote = ray.remote(TrainerActor)
        self.actors = []
        for rank in range(world_size):
            options: dict[str, Any] = dict(num_cpus=num_cpus, num_gpus=num_gpus,
                                           runtime_env={"env_vars": {"OMP_NUM_THREADS": str(threads)}})
            if placement_group is not None:
                from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

                options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
                    placement_group=placement_group,
                    placement_group_bundle_index=rank if bundle_indices is None else bundle_indices[rank])
            self.actors.append(remote.options(**options).remote(threads))
        master = ray.get(self.actors[0].address.remote())
        device = "cuda" if num_gpus > 0 else "cpu"  # Ray shows each actor its GPU as cuda:0
        ray.get([a.setup.remote(str(checkpoint), cfg, r, world_size, master, device)
                 for r, a in enumerate(self.actors)])

    def compute_log_probs(self, samples: Sequence[TrainSample], ref: bool = False) -> LogProbs:
        """Log-probs of every sample (token-balanced contiguous shards), in the original order."""
        bounds = _token_balanced_bounds([len(s.tokens) for s in samples], self.world_size)
        parts = ray.get([a.compute_log_probs.remote(list(samples[lo:hi]), ref)
                         for a, (lo, hi) in zip(self.actors, bounds)])
        old = [lp for part in parts for lp in part.old]
        refs = [lp for part in parts for lp in part.ref] if ref else None
        return LogProbs(old=old, ref=refs)

    def train_step(self, samples: Sequence[TrainSample]) -> dict[str, float]:
        """``num_steps_per_rollout`` steps; each global batch is split evenly over the ranks."""
        n_steps = self.cfg.num_steps_per_rollout
        if not samples or len(samples) % (n_steps * self.world_size):
            raise ValueError(
                f"train_step got {len(samples)} samples: it needs a positive multiple of num_steps_per_rollout "
                f"({n_steps}) x world_size ({self.world_size}) so every step's global batch splits evenly over "
                "the ranks (drop or duplicate samples, or set global_batch_size accordingly)")
        step = len(samples) // n_steps
        shard = step // self.world_size
        shards = [[s for k in range(n_steps) for s in samples[k * step + r * shard:k * step + (r + 1) * shard]]
                  for r in range(self.world_size)]
        results = ray.get([a.train_step.remote(part) for a, part in zip(self.actors, shards)])
        return results[0]

    def named_weights_ref(self) -> ray.ObjectRef:
        """An ObjectRef to rank 0's ``{name: full weights as numpy}`` (HF names, tied weights once).

        :func:`agentrl.runtime.engines.numpy_to_tensors` turns it back into tensors without a copy.
        """
        refs = [a.full_weights.remote() for a in self.actors]
        ray.get(refs[1:])  # the other ranks return None; this surfaces their errors
        return refs[0]

    def node_id(self) -> str:
        """The Ray node of rank 0 (shared-memory weight sync reaches only engines on the same node)."""
        return ray.get(self.actors[0].node_id.remote())

    def write_shared_weights(self) -> tuple[str, Any]:
        """Full weights into rank 0's next shared-memory slot: ``(path, layout)`` for the engines."""
        return ray.get([a.write_shared_weights.remote() for a in self.actors])[0]

    def push_weights(self, kind: str, urls: Sequence[str], version: str, folder: str | None = None) -> None:
        """Weights to engines by ``disk`` (``/update_weights_from_disk`` of ``folder``) or ``nccl`` broadcast."""
        ray.get([a.push_weights.remote(kind, list(urls), version, folder) for a in self.actors])

    def save(self, path: str | Path, extra_state: dict[str, Any] | None = None) -> None:
        ray.get([a.save.remote(str(path), extra_state) for a in self.actors])

    def load(self, path: str | Path) -> dict[str, Any]:
        return ray.get([a.load.remote(str(path)) for a in self.actors])[0]

    def shutdown(self) -> None:
        """Leave the process group and kill the actors (safe to call twice)."""
        try:
            ray.get([a.shutdown.remote() for a in self.actors], timeout=30)
        except Exception:  # noqa: BLE001 - tearing down: a dead actor is already shut down
            pass
        for a in self.actors:
            ray.kill(a)
        self.actors = []


def _token_balanced_bounds(lengths: Sequence[int], parts: int) -> list[tuple[int, int]]:
    """Cut ``lengths`` into ``parts`` contiguous ranges of roughly equal token totals (some may be empty)."""
    total = sum(lengths)
    bounds, lo, acc = [], 0, 0
    for r in range(1, parts):
        target = total * r / parts
        hi = lo
        while hi < len(lengths) and acc + lengths[hi] / 2 <= target:
            acc += lengths[hi]
            hi += 1
        bounds.append((lo, hi))
        lo = hi
    bounds.append((lo, len(lengths)))
    return bounds


def _cluster_has_gpus() -> bool:
    return ray.cluster_resources().get("GPU", 0) > 0
