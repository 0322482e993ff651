"""N trainer ranks as Ray actors, driven as one trainer.

:class:`TrainerGroup` owns ``world_size`` :class:`TrainerActor` s, each holding one rank of a
backend: :class:`~agentrl.trainer.torch_trainer.TorchTrainer` (``torch``) or
:class:`~agentrl.trainer.megatron_trainer.MegatronTrainer` (``megatron``); with ``role="critic"``
their value-model counterparts (:class:`~agentrl.trainer.torch_critic.TorchCritic`,
:class:`~agentrl.trainer.megatron_critic.MegatronCritic`), which answer ``compute_values``
instead of ``compute_log_probs`` (ppo runs one group of each). The actors form their own
``torch.distributed`` group (gloo on CPU, nccl on GPU) when ``world_size > 1``; the driver never
joins it. Every public method fans the call out to all ranks (sharded models need every rank in
every collective) and gathers the answer:

Data goes to *data-parallel* ranks: with Megatron's tensor/pipeline/context parallelism the
ranks of one model copy (Megatron's rank order ``tp-cp-dp-pp``, TP fastest) receive the same
samples; with ``torch`` every rank is its own data-parallel rank.

* ``compute_log_probs``: samples cut into contiguous, token-balanced shards, one per data-parallel
  rank; results (from the last pipeline stage) re-joined in the original order;
* ``train_step``: each of the ``num_steps_per_rollout`` global batches cut into equal contiguous
  shards, one per data-parallel rank, so every rank steps on its share of the same global batch;
  the metrics are the last rank's (a last pipeline stage), already global (the trainer sums them
  over ranks);
* ``push_weights``: the full weights to every engine by one of the routes of
  :mod:`agentrl.runtime.weight_sync` (``named_weights_ref``: rank 0's as one Ray ObjectRef, for checks);
* ``save`` / ``load`` / ``shutdown``.

Ray is not initialised here: the caller (train loop, tests) owns ``ray.init``.
"""

from __future__ import annotations

import json
import os
import socket
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import ray

from agentrl.config import TrainConfig
from agentrl.cpu_share import CoreShare
from agentrl.runtime.cluster import peak_rss_mb
from agentrl.trainer.base import LogProbs, TrainSample
from agentrl.trainer.megatron_critic import MegatronCritic
from agentrl.trainer.megatron_trainer import MegatronTrainer
from agentrl.trainer.torch_critic import TorchCritic
from agentrl.trainer.torch_trainer import TorchTrainer

ROLES = ("actor", "critic")
"""What a trainer group trains: the policy (``actor``) or ppo's value model (``critic``)."""


def make_trainer(
    backend: str,
    checkpoint: str,
    cfg: TrainConfig,
    *,
    rank: int = 0,
    world_size: int = 1,
    device: str | None = None,
    role: str = "actor",
) -> Any:
    """One rank of the ``torch`` or ``megatron`` backend (the process group must already exist)."""
    if role not in ROLES:
        raise ValueError(f"unknown trainer role {role!r}: expected actor or critic")
    if backend == "torch":
        if role == "critic":
            return TorchCritic(checkpoint, cfg, rank=rank, world_size=world_size, device=device)
        return TorchTrainer(checkpoint, cfg, rank=rank, world_size=world_size, device=device)
    if backend == "megatron":  # layout from cfg
        if role == "critic":
            return MegatronCritic(checkpoint, cfg, rank=rank, world_size=world_size, device=device)
        return MegatronTrainer(checkpoint, cfg, rank=rank, world_size=world_size, device=device)
    raise ValueError(f"unknown train backend {backend!r}: expected torch or megatron")


class TrainerActor:
    """One rank: joins the process group, then wraps a ``TorchTrainer``. Made remote by the group."""

    def __init__(self, num_threads: int, adaptive_threads: bool = False, min_threads: int = 1):
        import torch

        torch.set_num_threads(max(1, num_threads))
        self.trainer = None
        self.num_threads, self.adaptive_threads, self.min_threads = max(1, num_threads), adaptive_threads, min_threads
        self.cores: Any = None  # CoreShare on CPU with adaptive threads (set up with the trainer)

    def _share_cores(self) -> None:
        """At the start of a phase: torch threads = the cores other processes leave free now."""
        if self.cores is not None:
            self.cores.settle()
            self.cores.apply()

    def address(self) -> tuple[str, int]:
        """This node's IP and a free port on it: the rendezvous point when this actor is rank 0."""
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        return ray.util.get_node_ip_address(), port

    def setup(
        self,
        checkpoint: str,
        cfg: TrainConfig,
        rank: int,
        world_size: int,
        master: tuple[str, int],
        device: str,
        backend: str = "torch",
        role: str = "actor",
    ) -> None:
        """Join the process group (``world_size > 1``) and load this rank's model."""
        import torch.distributed as dist

        if world_size > 1:
            os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = master[0], str(master[1])
            dist.init_process_group("gloo" if device == "cpu" else "nccl", rank=rank, world_size=world_size)
        self.trainer = make_trainer(
            backend, checkpoint, cfg, rank=rank, world_size=world_size, device=device, role=role
        )
        self.checkpoint = checkpoint
        if self.adaptive_threads and device == "cpu":
            self.cores = CoreShare(self.num_threads, min_threads=self.min_threads)
            if hasattr(self.trainer, "core_share"):  # the torch trainer re-checks before every micro-batch
                self.trainer.core_share = self.cores

    def compute_log_probs(self, samples: list[TrainSample], ref: bool) -> LogProbs:
        self._share_cores()
        return self.trainer.compute_log_probs(samples, ref=ref)

    def compute_values(self, samples: list[TrainSample]) -> list[list[float]]:
        self._share_cores()
        return self.trainer.compute_values(samples)

    def train_step(self, samples: list[TrainSample]) -> dict[str, float]:
        self._share_cores()
        return self.trainer.train_step(samples)

    def peak_rss_mb(self) -> float:
        return peak_rss_mb()

    def full_weights(self) -> dict[str, Any] | None:
        """Full CPU weights on rank 0 as numpy arrays, None elsewhere (every rank takes part in the gather).

        numpy, not torch tensors: Ray stores numpy arrays in shared memory with one copy and hands
        readers zero-copy views, so an engine on the same node loads them with one more copy.
        """
        from agentrl.runtime.engine_group import tensors_to_numpy

        if self.trainer.rank != 0:
            _drain(self.trainer.named_weights())  # take part in the gathers, keep nothing
            return None
        return tensors_to_numpy({name: t.cpu() for name, t in self.trainer.named_weights()})

    def node_id(self) -> str:
        return ray.get_runtime_context().get_node_id()

    def adapted_modules(self) -> set[str]:
        return self.trainer.adapted_modules()

    def adapter_weights(self, policy: str | None = None) -> tuple[dict[str, Any], dict[str, Any]] | None:
        """A LoRA policy's adapter (``policy``: that ``--policy``'s) as numpy arrays and its PEFT config on rank 0, None
        elsewhere (every rank gathers)."""
        from agentrl.runtime.engine_group import tensors_to_numpy

        state, config = self.trainer.adapter_weights(policy)
        return (tensors_to_numpy(state), config) if self.trainer.rank == 0 else None

    def push_weights(
        self, kind: str, targets: list[Any], version: str, folder: str | None = None, api_key: str | None = None
    ) -> str | None:
        """Send the full weights to the engines by route ``kind`` (:data:`agentrl.runtime.weight_sync.TRANSPORTS`).

        ``targets``: engine URLs for ``disk``, ``nccl`` and ``tensor``; embedded engine actor handles
        for ``shm`` and ``object_store``. ``folder``: the run's folder for ``disk``; for ``tensor`` the
        engines' private weight folder (``agentrl serve --weight-ipc-dir``), where tensors without CUDA go.
        Every rank takes part in gathering the weights; rank 0
        pushes, except ``tensor`` (by handle, colocated), where each rank pushes to the engines on its
        own device (``targets`` is then this rank's share). The pushing rank keeps one transport (and,
        for NCCL, one process group with the engines) and one event loop for the actor's lifetime.
        Returns the route the push took on a pushing rank (``shm`` may fall back to ``object_store``).
        """
        import asyncio

        from agentrl.engines.http import SGLangEngine
        from agentrl.runtime.weight_sync import make_transport

        pushes = bool(targets) if kind == "tensor" else self.trainer.rank == 0
        if not pushes:
            _drain(self.trainer.named_weights())
            return None
        # streamed: each full tensor is gathered (a collective the other ranks join in _drain), sent and dropped;
        # whatever fails here still walks the rest of the gathers, or the other ranks would wait in them forever
        weights = iter(self.trainer.named_weights())
        try:
            if getattr(self, "_transport", None) is None or self._transport_kind != kind:
                self.reset_weight_transport()
                self._push_loop = asyncio.new_event_loop()
                extra: dict[str, Any] = {}
                if kind in ("shm", "object_store"):
                    engines: list[Any] = list(targets)  # actor handles
                else:
                    engines = [SGLangEngine(u, api_key=api_key) for u in targets]
                if kind == "disk":
                    extra = {"folder": folder, "config": self.checkpoint}
                if kind == "tensor" and folder is not None:
                    extra = {"ipc_dir": folder}
                if kind == "nccl" and not all(
                    _loopback(u) for u in targets
                ):  # engines on other nodes dial rank 0's node
                    extra["master_address"] = ray.util.get_node_ip_address()
                self._transport = make_transport(kind, engines, **extra)
                self._transport_kind = kind
            finite = bool(getattr(self.trainer, "weights_finite", False))
            self._push_loop.run_until_complete(self._transport.push(weights, version, finite=finite))
            return self._transport.route
        finally:
            _drain(weights)

    def reset_weight_transport(self) -> None:
        """Forget the push transport (an engine was restarted and left the NCCL group): the next push builds one."""
        transport = getattr(self, "_transport", None)
        self._transport = None
        if transport is not None:
            import contextlib

            with contextlib.suppress(Exception):  # the group may already be broken; a new one replaces it
                self._push_loop.run_until_complete(transport.close())
            self._push_loop.close()

    def save(self, path: str, extra_state: dict[str, Any] | None) -> None:
        self.trainer.save(path, extra_state)

    def load(self, path: str) -> dict[str, Any]:
        return self.trainer.load(path)

    def shutdown(self) -> None:
        import torch.distributed as dist

        self.reset_weight_transport()  # closes its shared-memory slots or process group
        if hasattr(self.trainer, "close"):  # megatron: its global parallel state
            self.trainer.close()

        if dist.is_initialized():
            dist.destroy_process_group()


class TrainerGroup:
    """``world_size`` trainer ranks as Ray actors, with the :class:`~agentrl.trainer.base.Trainer` verbs.

    ``num_cpus`` per actor also sets its torch/OMP thread count unless ``num_threads`` is given (the
    synchronous loop lets training use every core, since the engines idle meanwhile). On a GPU machine each actor asks
    for one GPU (``num_gpus=1``, or ``num_gpus`` if given). ``placement_group`` (optional) pins
    rank ``r`` to its bundle ``bundle_indices[r]`` (default: bundle ``r``). ``adaptive_threads`` (CPU):
    each rank's threads follow :class:`~agentrl.cpu_share.CoreShare` (``--cpu-threads adaptive``), never
    below ``min_threads``.
    """

    def __init__(
        self,
        checkpoint: str | Path,
        cfg: TrainConfig,
        *,
        world_size: int = 1,
        num_cpus: float = 1,
        num_gpus: float | None = None,
        placement_group: Any | None = None,
        bundle_indices: Sequence[int] | None = None,
        num_threads: int | None = None,
        backend: str = "torch",
        role: str = "actor",
        adaptive_threads: bool = False,
        min_threads: int = 1,
    ):
        if role not in ROLES:
            raise ValueError(f"unknown trainer role {role!r}: expected actor or critic")
        self.role = role
        if num_gpus is None:
            num_gpus = 1 if _cluster_has_gpus() else 0
        self.cfg, self.world_size, self.backend = cfg, world_size, backend
        mp = cfg.model_parallel_size if backend == "megatron" else 1
        if world_size % mp:
            raise ValueError(f"{world_size} trainer ranks cannot hold tensor x pipeline x context = {mp} model shards")
        self.layout = DataLayout(
            world_size, mp, cfg.tensor_model_parallel_size * cfg.context_parallel_size if backend == "megatron" else 1
        )
        threads = num_threads or max(1, int(num_cpus))
        remote = ray.remote(TrainerActor)
        self.actors = []
        for rank in range(world_size):
            options: dict[str, Any] = dict(
                num_cpus=num_cpus, num_gpus=num_gpus, runtime_env={"env_vars": {"OMP_NUM_THREADS": str(threads)}}
            )
            if placement_group is not None:
                from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

                options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
                    placement_group=placement_group,
                    placement_group_bundle_index=rank if bundle_indices is None else bundle_indices[rank],
                )
            self.actors.append(remote.options(**options).remote(threads, adaptive_threads, min_threads))
        master = ray.get(self.actors[0].address.remote())
        device = "cuda" if num_gpus > 0 else "cpu"  # Ray shows each actor its GPU as cuda:0
        ray.get(
            [
                a.setup.remote(str(checkpoint), cfg, r, world_size, master, device, backend, role)
                for r, a in enumerate(self.actors)
            ]
        )

    def _per_sample(self, method: str, samples: Sequence[TrainSample], *args: Any) -> list[Any]:
        """Call ``method`` on token-balanced contiguous shards (one per data rank); one answer per data rank, in order."""
        lay = self.layout
        bounds = _token_balanced_bounds([len(s.tokens) for s in samples], lay.dp)
        parts = ray.get(
            [
                getattr(a, method).remote(list(samples[slice(*bounds[lay.dp_rank(r)])]), *args)
                for r, a in enumerate(self.actors)
            ]
        )
        return [parts[lay.source_rank(d)] for d in range(lay.dp)]

    def compute_log_probs(self, samples: Sequence[TrainSample], ref: bool = False) -> LogProbs:
        """Log-probs of every sample (token-balanced contiguous shards per data rank), in the original order."""
        parts = self._per_sample("compute_log_probs", samples, ref)
        old = [lp for part in parts for lp in part.old]
        refs = [lp for part in parts for lp in part.ref] if ref else None
        return LogProbs(old=old, ref=refs)

    def compute_values(self, samples: Sequence[TrainSample]) -> list[list[float]]:
        """A critic group's values of every sample, sharded like :meth:`compute_log_probs`, in the original order."""
        return [v for part in self._per_sample("compute_values", samples) for v in part]

    def train_step(self, samples: Sequence[TrainSample]) -> dict[str, float]:
        """``num_steps_per_rollout`` steps; each global batch is split evenly over the data-parallel ranks."""
        n_steps, dp = self.cfg.num_steps_per_rollout or 1, self.layout.dp  # preflight derived it (1: used alone)
        if not samples or len(samples) % (n_steps * dp):
            raise ValueError(
                f"train_step got {len(samples)} samples: it needs a positive multiple of num_steps_per_rollout "
                f"({n_steps}) x data-parallel size ({dp}) so every step's global batch splits evenly over "
                "the ranks (drop or duplicate samples, or set global_batch_size accordingly)"
            )
        step = len(samples) // n_steps
        shard = step // dp
        shards = [
            [s for k in range(n_steps) for s in samples[k * step + d * shard : k * step + (d + 1) * shard]]
            for d in range(dp)
        ]
        results = ray.get([a.train_step.remote(shards[self.layout.dp_rank(r)]) for r, a in enumerate(self.actors)])
        return results[-1]

    def peak_rss_mb(self) -> float:
        """The largest peak resident memory (MiB) of any rank so far."""
        return max(ray.get([a.peak_rss_mb.remote() for a in self.actors]))

    def named_weights_ref(self) -> ray.ObjectRef:
        """An ObjectRef to rank 0's ``{name: full weights as numpy}`` (HF names, tied weights once).

        :func:`agentrl.runtime.engine_group.numpy_to_tensors` turns it back into tensors without a copy.
        """
        refs = [a.full_weights.remote() for a in self.actors]
        ray.get(refs[1:])  # the other ranks return None; this surfaces their errors
        return refs[0]

    def node_id(self) -> str:
        """The Ray node of rank 0 (shared-memory weight sync reaches only engines on the same node)."""
        return ray.get(self.actors[0].node_id.remote())

    def push_weights(
        self, kind: str, targets: Sequence[Any], version: str, folder: str | None = None, api_key: str | None = None
    ) -> str:
        """The run's one weight push: the full weights to every engine as ``version``, by route ``kind``.

        ``disk`` (``/update_weights_from_disk`` of ``folder``), ``nccl`` broadcast, ``tensor`` handles
        (colocated: engine ``i`` shares the device of rank ``i % world_size``, as placed) take engine
        URLs; ``shm`` (shared memory, same node) and ``object_store`` take embedded engine actors.
        Returns the route taken (``shm`` falls back to ``object_store`` when ``/dev/shm`` cannot hold it).
        """
        if kind == "tensor":
            shares = [[u for i, u in enumerate(targets) if i % self.world_size == r] for r in range(self.world_size)]
            routes = ray.get(
                [a.push_weights.remote(kind, shares[r], version, folder, api_key) for r, a in enumerate(self.actors)]
            )
        else:
            routes = ray.get(
                [a.push_weights.remote(kind, list(targets), version, folder, api_key) for a in self.actors]
            )
        return next((r for r in routes if r), kind)

    def push_adapter(self, engines: Sequence[Any], version: str) -> None:
        """A LoRA run's weight push: the adapter alone (bytes: the adapter's, not the model's) through the object
        store to every embedded engine actor, which serves it as the policy from its next request on; with several
        policies, each policy's adapter under its name."""
        for policy in self.cfg.policy or [None]:
            named, config = self._adapter(policy)
            named_ref = ray.put(named)
            answers = ray.get([e.load_policy_adapter.remote(named_ref, config, version, policy) for e in engines])
            failed = [a.get("error_message") for a in answers if not a.get("success")]
            if failed:
                what = "the policy adapter" if policy is None else f"policy {policy}'s adapter"
                raise RuntimeError(
                    f"an engine refused {what} (version {version}): {failed[0]}"
                    + ("; --weight-sync auto pushes the merged weights instead" if policy is None else "")
                )

    def _adapter(self, policy: str | None = None) -> tuple[dict[str, Any], dict[str, Any]]:
        """A policy's whole adapter (numpy arrays, PEFT's names) and its PEFT config, gathered by every rank."""
        refs = [a.adapter_weights.remote(policy) for a in self.actors]
        ray.get(refs[1:])  # the other ranks return None; this surfaces their errors
        return ray.get(refs[0])

    def save_adapter_folder(self, folder: str | Path, policy: str | None = None) -> Path:
        """A LoRA policy's adapter (``policy``: that ``--policy``'s), gathered from every rank, written as a PEFT
        folder (``adapter_config.json`` + ``adapter_model.safetensors``) where the engines read it: what launched
        SGLang servers load by name."""
        from safetensors.torch import save_file

        from agentrl.runtime.engine_group import numpy_to_tensors

        named, config = self._adapter(policy)
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        save_file(numpy_to_tensors(named), str(folder / "adapter_model.safetensors"), metadata={"format": "pt"})
        (folder / "adapter_config.json").write_text(json.dumps(config, indent=2))
        return folder

    def adapted_modules(self) -> set[str]:
        """The module names (last component: ``q_proj``) the policy's adapter adapts (empty: no adapter)."""
        return ray.get(self.actors[0].adapted_modules.remote())

    def reset_weight_transport(self) -> None:
        """Drop rank 0's push transport, so the next ``push_weights`` builds a new one (new NCCL group)."""
        ray.get([a.reset_weight_transport.remote() for a in self.actors])

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


class DataLayout:
    """Which data-parallel shard each rank trains on, in Megatron's rank order ``tp-cp-dp-pp``.

    ``world`` ranks = ``pp`` stages x ``dp`` copies x ``inner`` (TP x CP) ranks; rank
    ``r = pp_rank * dp * inner + dp_rank * inner + (cp_rank * tp + tp_rank)``. With ``torch``
    (``model_parallel == inner == 1``) the data rank is the rank.
    """

    def __init__(self, world: int, model_parallel: int, inner: int):
        self.world, self.inner = world, inner
        self.dp = world // model_parallel
        self.pp = model_parallel // inner

    def dp_rank(self, rank: int) -> int:
        return (rank // self.inner) % self.dp

    def source_rank(self, dp_rank: int) -> int:
        """The rank whose outputs stand for data rank ``dp_rank``: last pipeline stage, TP/CP rank 0."""
        return (self.pp - 1) * self.dp * self.inner + dp_rank * self.inner


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


def _drain(named: Any) -> None:
    """Iterate a collective weight iterator without keeping its tensors (ranks that do not push)."""
    for _ in named:
        pass


def _loopback(url: str) -> bool:
    from urllib.parse import urlsplit

    return (urlsplit(url).hostname or "") in ("127.0.0.1", "localhost", "::1")


def _cluster_has_gpus() -> bool:
    return ray.cluster_resources().get("GPU", 0) > 0
