"""Weight-update process groups: how a trainer broadcasts weights into running engines.

SGLang's protocol (``/init_weights_update_group``, ``/update_weights_from_distributed``,
``/destroy_weights_update_group``), which slime drives from its trainer:

1. The trainer picks a free port and posts ``init_weights_update_group`` to every engine with
   ``rank_offset`` (1 + the GPUs of the engines before it) and ``world_size`` (1 + all engine
   GPUs), while it joins the same group itself as rank 0. Engine GPU ``tp_rank`` joins as
   ``rank_offset + tp_rank``. The group is a *separate world*: it has its own TCP store at
   ``master_address:master_port`` and lives beside (not inside) each side's default process group,
   which is why it cannot come from ``torch.distributed.new_group``.
2. Per bucket of tensors the trainer posts ``update_weights_from_distributed`` (names, dtypes,
   shapes) to every engine and, at the same time, broadcasts each tensor from rank 0 in the same
   order. Each engine allocates empty tensors of those dtypes and shapes, receives them, loads them
   into the model and only then answers the HTTP request.
3. ``destroy_weights_update_group`` tears the group down on both sides.

This module holds the pieces both sides share (:func:`init_custom_process_group`,
:func:`resolve_backend`, :func:`run_in_thread`) and the engine side, :class:`WeightUpdateGroups`.
The trainer side is ``agentrl.runtime.weight_sync.DistributedTransport``.

Backend: SGLang uses NCCL. Where CUDA is unavailable (a laptop, CI) an ``nccl`` request is served
with ``gloo`` on CPU tensors instead, on both sides alike, so the same protocol runs for real on
CPU. Both sides must end up on the same backend: an NCCL trainer cannot feed a CPU-only engine.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any, TypeVar

import torch
import torch.distributed as dist

T = TypeVar("T")

DEFAULT_GROUP_NAME = "weight_update_group"
"""SGLang's default ``group_name`` for the weight-update group."""


def resolve_backend(requested: str | None) -> str:
    """The backend actually used: ``nccl`` becomes ``gloo`` where CUDA is unavailable."""
    backend = (requested or "nccl").lower()
    if backend == "nccl" and not torch.cuda.is_available():
        return "gloo"
    return backend


def comm_device(backend: str) -> torch.device:
    """Where tensors must live for ``backend``: the current CUDA device for NCCL, else CPU."""
    if backend == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def init_custom_process_group(
    *,
    backend: str,
    master_address: str,
    master_port: int,
    world_size: int,
    rank: int,
    group_name: str,
    timeout: float = 600.0,
) -> dist.ProcessGroup:
    """Join a process group that is its own world (rank ``rank`` of ``world_size``), not a subgroup.

    ``torch.distributed.new_group`` can only carve subgroups out of the default world; the trainer
    and the engines each have their own default world (or none), so, as SGLang and slime do, we
    rendezvous on a fresh TCP store (rank 0 hosts it) and build the group with c10d's internal
    helper, then register its rank map so collectives can translate ranks. Blocks until every rank
    has joined or ``timeout`` seconds pass; the same timeout then bounds every collective on it.
    """
    from torch.distributed.distributed_c10d import Backend, PrefixStore, _new_process_group_helper, _world, rendezvous

    td = timedelta(seconds=timeout)
    store, rank, world_size = next(rendezvous(f"tcp://{master_address}:{master_port}", rank, world_size, timeout=td))
    store.set_timeout(td)
    store = PrefixStore(group_name, store)  # several groups may share one store without key clashes
    pg, _ = _new_process_group_helper(world_size, rank, [], Backend(backend), store, group_name=group_name, timeout=td)
    _world.pg_group_ranks[pg] = {i: i for i in range(world_size)}  # group rank == "global" rank
    return pg


def run_in_thread(fn: Callable[..., T], *args: Any) -> asyncio.Future:
    """Run blocking ``fn(*args)`` in a fresh daemon thread; return an awaitable future of its result.

    Collectives block until every rank arrives, possibly for the whole group timeout. A daemon
    thread (rather than the loop's default executor) never holds up interpreter exit or an
    executor shutdown when the other side has gone away.
    """
    loop = asyncio.get_running_loop()
    fut = loop.create_future()

    def target() -> None:
        try:
            result = fn(*args)
        except BaseException as exc:  # noqa: BLE001 - handed to the awaiting coroutine
            loop.call_soon_threadsafe(_settle, fut, None, exc)
        else:
            loop.call_soon_threadsafe(_settle, fut, result, None)

    threading.Thread(target=target, name=f"agentrl-{getattr(fn, '__name__', 'dist')}", daemon=True).start()
    return fut


def _settle(fut: asyncio.Future, result: Any, exc: BaseException | None) -> None:
    if fut.done():
        return
    if exc is not None:
        fut.set_exception(exc)
    else:
        fut.set_result(result)


def parse_dtype(name: Any) -> torch.dtype:
    """``"bfloat16"`` / ``"torch.bfloat16"`` (slime strips the prefix; both are accepted) -> ``torch.bfloat16``."""
    if isinstance(name, torch.dtype):
        return name
    dtype = getattr(torch, str(name).removeprefix("torch."), None) if isinstance(name, str) else None
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return dtype


def check_metadata(names: Any, dtypes: Any, shapes: Any) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
    """Validate an ``update_weights_from_distributed`` body's metadata; raise ``ValueError`` if malformed."""
    if not (isinstance(names, list) and isinstance(dtypes, list) and isinstance(shapes, list)):
        raise ValueError("names, dtypes and shapes must be lists")
    if not len(names) == len(dtypes) == len(shapes):
        raise ValueError(f"names, dtypes and shapes differ in length ({len(names)}, {len(dtypes)}, {len(shapes)})")
    out = []
    for name, dtype, shape in zip(names, dtypes, shapes):
        if not isinstance(name, str):
            raise ValueError(f"parameter name {name!r} is not a string")
        if not (
            isinstance(shape, list) and all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape)
        ):
            raise ValueError(f"shape of {name!r} must be a list of non-negative ints, got {shape!r}")
        out.append((name, parse_dtype(dtype), tuple(shape)))
    return out


class WeightUpdateGroups:
    """The engine side: weight-update groups by name, and the receive half of the broadcast.

    The embedded engine runs one model on one device, so it is a single rank: ``rank_offset``
    (SGLang: ``rank_offset + tp_rank`` with ``tp_rank == 0``). All methods block; the HTTP app runs
    them through :func:`run_in_thread` so the event loop keeps serving ``/generate`` meanwhile.
    """

    def __init__(self, *, timeout: float = 600.0):
        self.timeout = timeout
        self._groups: dict[str, tuple[dist.ProcessGroup, str, threading.Lock]] = {}
        self._lock = threading.Lock()

    def __contains__(self, group_name: str) -> bool:
        return group_name in self._groups

    def init(
        self,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        group_name: str = DEFAULT_GROUP_NAME,
        backend: str = "nccl",
    ) -> tuple[bool, str]:
        """Join group ``group_name`` as rank ``rank_offset``; SGLang's ``(success, message)``."""
        if not group_name:
            return False, "Group name cannot be empty."
        with self._lock:
            if group_name in self._groups:
                return False, f"Failed to initialize custom process group: group {group_name!r} already exists."
        used = resolve_backend(backend)
        try:
            pg = init_custom_process_group(
                backend=used,
                master_address=master_address,
                master_port=int(master_port),
                world_size=int(world_size),
                rank=int(rank_offset),
                group_name=group_name,
                timeout=self.timeout,
            )
        except Exception as exc:  # noqa: BLE001 - reported to the caller as SGLang does
            return False, f"Failed to initialize custom process group: {exc}."
        with self._lock:
            self._groups[group_name] = (pg, used, threading.Lock())
        note = f" (backend {used}; {backend} requested, CUDA unavailable)" if used != backend else ""
        return True, "Succeeded to initialize custom process group." + note

    def receive(
        self, group_name: str, metadata: Sequence[tuple[str, torch.dtype, tuple[int, ...]]]
    ) -> list[tuple[str, torch.Tensor]]:
        """Receive one bucket: an empty tensor per (name, dtype, shape), each filled by a broadcast from rank 0.

        Tensors arrive in the order of ``metadata``, which must be the order the trainer sends
        them in. One bucket at a time per group: the collectives of two buckets must not interleave.
        """
        try:
            pg, backend, lock = self._groups[group_name]
        except KeyError:
            raise KeyError(
                f"Group {group_name} not in {list(self._groups)}. Please call `init_weights_update_group` first."
            ) from None
        device = comm_device(backend)
        with lock:
            received = [(name, torch.empty(shape, dtype=dtype, device=device)) for name, dtype, shape in metadata]
            handles = [dist.broadcast(t, src=0, group=pg, async_op=True) for _, t in received]
            for h in handles:
                h.wait()
        return received

    def destroy(self, group_name: str = DEFAULT_GROUP_NAME) -> tuple[bool, str]:
        """Leave and destroy group ``group_name``; SGLang's ``(success, message)``."""
        with self._lock:
            entry = self._groups.pop(group_name, None)
        if entry is None:
            return False, "The group to be destroyed does not exist."
        try:
            dist.destroy_process_group(entry[0])
        except Exception as exc:  # noqa: BLE001
            return False, f"Failed to destroy custom process group: {exc}."
        return True, "Succeeded to destroy custom process group."
