"""The weight-update process group both sides share: how a trainer broadcasts weights into running engines.

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

This module holds what both sides use: joining a group that is its own world
(:func:`init_custom_process_group`), the backend a request ends up on (:func:`resolve_backend`) and a
blocking collective run off the event loop (:func:`run_in_thread`). The engine side is
:class:`agentrl.engines.local.distributed.WeightUpdateGroups`; the trainer side is
``agentrl.runtime.weight_sync.DistributedTransport``.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Callable
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
    collective_timeout: float | None = None,
) -> dist.ProcessGroup:
    """Join a process group that is its own world (rank ``rank`` of ``world_size``), not a subgroup.

    ``torch.distributed.new_group`` can only carve subgroups out of the default world; the trainer
    and the engines each have their own default world (or none), so, as SGLang and slime do, we
    rendezvous on a fresh TCP store (rank 0 hosts it) and build the group with c10d's internal
    helper, then register its rank map so collectives can translate ranks. Blocks until every rank
    has joined or ``timeout`` seconds pass; ``collective_timeout`` (default: ``timeout``) then bounds
    every collective on it.
    """
    from torch.distributed import distributed_c10d as c10d

    td = timedelta(seconds=timeout)
    url = f"tcp://{master_address}:{master_port}"
    store, rank, world_size = next(c10d.rendezvous(url, rank, world_size, timeout=td))
    store.set_timeout(td)
    prefixed = c10d.PrefixStore(group_name, store)  # several groups may share one store without key clashes
    pg, _ = c10d._new_process_group_helper(
        world_size, rank, [], c10d.Backend(backend), prefixed, group_name=group_name, timeout=td
    )
    c10d._world.pg_group_ranks[pg] = {i: i for i in range(world_size)}  # group rank == "global" rank
    if collective_timeout is not None and collective_timeout != timeout:
        later = timedelta(seconds=collective_timeout)
        store.set_timeout(later)
        if hasattr(c10d, "_set_pg_timeout"):  # torch >= 2.3; older ones keep the join's timeout
            c10d._set_pg_timeout(later, pg)
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
            result, exc = fn(*args), None
        except BaseException as caught:  # noqa: BLE001 - handed to the awaiting coroutine
            result, exc = None, caught
        with contextlib.suppress(RuntimeError):  # the loop closed meanwhile: nobody awaits the result
            loop.call_soon_threadsafe(settle_future, fut, result, exc)

    threading.Thread(target=target, name=f"agentrl-{getattr(fn, '__name__', 'dist')}", daemon=True).start()
    return fut


def settle_future(fut: asyncio.Future, result: Any, exc: BaseException | None) -> None:
    """Hand a thread's ``result`` (or ``exc``) to ``fut`` on its loop, unless it is already done."""
    if fut.done():
        return
    if exc is not None:
        fut.set_exception(exc)
    else:
        fut.set_result(result)
