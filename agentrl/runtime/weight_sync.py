"""Weight transports: how the trainer's new weights reach the inference engines after a step.

A transport has one verb, ``push(named_tensors, version)``: every engine serves ``version`` of the
weights once it returns. Which one to use depends on where trainer and engines run:

- :class:`DiskTransport`: a safetensors checkpoint in a folder every engine can read, then SGLang's
  ``/update_weights_from_disk``. Works everywhere (separate machines with a shared filesystem, any
  engine that speaks SGLang's API); costs a write and a read of the whole model.
- :class:`DistributedTransport`: SGLang's broadcast path, as slime drives it. The trainer (rank 0)
  and every engine GPU form a process group of their own; per bucket of tensors the trainer posts
  ``/update_weights_from_distributed`` (names, dtypes, shapes) to every engine and broadcasts the
  tensors meanwhile. NCCL between GPUs; gloo on CPU, where the embedded engine takes part the same
  way. Nothing touches the disk.
- :class:`TensorTransport`: SGLang's colocated path (``/update_weights_from_tensor``). The trainer
  rank and the engine share a machine (and, on GPUs, the device): tensors travel as CUDA IPC
  handles or shared-memory file names (:mod:`agentrl.engines.tensor_ipc`), bucket by bucket.
- :class:`SharedMemoryTransport`: embedded engines (Ray actors) on the trainer's node. The trainer
  writes the weights once into a shared-memory slot (``/dev/shm``); every engine points its
  parameters at it. Falls back to the object store when the slot cannot be written.
- :class:`ObjectStoreTransport`: embedded engines anywhere in the Ray cluster: the weights go into
  Ray's object store once (numpy, zero-copy on one node) and every engine loads them.

All five are built by one selector, :func:`make_transport`, and pushed from the trainer's rank 0
(``tensor``: from each rank to the engines on its device), so the run's weight sync is one call,
:meth:`agentrl.runtime.trainer_group.TrainerGroup.push_weights`; the run picks the kind
(:meth:`agentrl.runtime.train._Runtime.weight_route`).

Names are Hugging Face parameter names (``model.layers.0.self_attn.q_proj.weight``), the names a
checkpoint on disk has and the names SGLang's ``load_weights`` expects.
"""

from __future__ import annotations

import abc
import asyncio
import functools
import json
import logging
import re
import shutil
import uuid
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from agentrl.engines.base import EngineError
from agentrl.engines.http import EngineRequestError, SGLangEngine
from agentrl.engines.ipc_folder import IpcFolder
from agentrl.engines.tensor_ipc import TensorStash, serialize_named_tensors
from agentrl.engines.weight_group import (
    DEFAULT_GROUP_NAME,
    comm_device,
    init_custom_process_group,
    resolve_backend,
    run_in_thread,
)
from agentrl.ports import free_port
from agentrl.runtime.engine_group import tensors_to_numpy
from agentrl.runtime.shm_weights import SharedWeightsWriter

log = logging.getLogger(__name__)

NamedTensors = Iterable[tuple[str, torch.Tensor]]


class WeightTransport(abc.ABC):
    """Moves a full set of named weights from the trainer into every engine.

    ``push`` returns once every engine serves the new weights and reports ``version`` as its
    ``weight_version`` (the version samples are stamped with); it raises ``EngineError`` if any
    engine did not take them. ``close`` releases what the transport holds.
    """

    route: str = ""
    """The route the last push took (a transport that falls back says so: shared memory -> object store)."""

    @abc.abstractmethod
    async def push(self, named_tensors: NamedTensors, version: str, *, finite: bool = False) -> None:
        """Send ``named_tensors`` (HF names) to every engine as weight version ``version``.

        ``finite``: the caller knows every value is finite (:attr:`agentrl.trainer.base.Trainer.weights_finite`),
        so a transport that would otherwise read every byte to refuse NaN or inf may skip that pass."""

    async def close(self) -> None:
        """Release groups, folders or connections the transport holds (default: nothing)."""


TRANSPORTS = ("disk", "nccl", "tensor", "shm", "object_store")
"""Every weight route: ``disk``, ``nccl`` (alias ``distributed``) and ``tensor`` (handles) reach engines
over SGLang's HTTP API (``engines`` are :class:`SGLangEngine` s); ``shm`` and ``object_store`` reach
embedded engines through Ray (``engines`` are their actor handles)."""


def make_transport(kind: str, engines: Sequence[Any], **kwargs: Any) -> WeightTransport:
    """The transport called ``kind`` (one of :data:`TRANSPORTS`) to ``engines``."""
    builders: dict[str, Any] = {
        "disk": DiskTransport,
        "nccl": DistributedTransport,
        "distributed": DistributedTransport,
        "tensor": TensorTransport,
        "shm": SharedMemoryTransport,
        "object_store": ObjectStoreTransport,
    }
    if kind not in builders:
        raise ValueError(f"unknown weight transport {kind!r}: expected one of {', '.join(TRANSPORTS)}")
    return builders[kind](engines, **kwargs)


# ------------------------------------------------------------------------------------------- disk


class DiskTransport(WeightTransport):
    """Write a safetensors checkpoint to ``folder/weights-<version>`` and have every engine load it.

    ``config``: a Hugging Face checkpoint folder whose non-weight files (``config.json``, tokenizer,
    generation config) are copied next to the weights, or an object with ``save_pretrained`` (a
    ``PretrainedConfig``), so each folder is a complete checkpoint; None writes weights only
    (enough for ``/update_weights_from_disk``). Shards hold at most ``shard_bytes`` each, with
    Hugging Face's index file when there is more than one. Only the latest folder is kept.
    ``engines`` are ``SGLangEngine``s, a ``Router`` or in-process ``LocalEngine``s; ``folder`` must be
    readable by all of them at the same path.
    """

    route = "disk"

    def __init__(
        self,
        engines: Sequence[Any],
        folder: str | Path,
        *,
        config: str | Path | Any | None = None,
        shard_bytes: int = 5 << 30,
    ):
        self.engines = list(engines)
        self.folder = Path(folder)
        self.config = config
        self.shard_bytes = shard_bytes

    async def push(self, named_tensors: NamedTensors, version: str, *, finite: bool = False) -> None:
        path = await asyncio.to_thread(self._write, named_tensors, str(version))
        try:
            results = await asyncio.gather(
                *(e.update_weights_from_disk(str(path), str(version)) for e in self.engines), return_exceptions=True
            )
            failed = [f"{e!r}: {r}" for e, r in zip(self.engines, results) if _failed(r)]
            if failed:
                raise EngineRequestError("update_weights_from_disk failed on " + " | ".join(failed))
        finally:
            for old in self.folder.glob("weights-*"):
                if old != path:
                    shutil.rmtree(old, ignore_errors=True)

    def _write(self, named_tensors: NamedTensors, version: str) -> Path:
        from safetensors.torch import save_file

        self.folder.mkdir(parents=True, exist_ok=True)
        final = self.folder / f"weights-{re.sub(r'[^A-Za-z0-9._-]', '_', version)}"
        tmp = self.folder / f".tmp-{uuid.uuid4().hex}"
        tmp.mkdir()
        files: list[tuple[str, list[str]]] = []
        total = 0
        for i, shard in enumerate(_buckets(named_tensors, self.shard_bytes, device=torch.device("cpu"), copy=True)):
            name = f"shard-{i}.safetensors"
            save_file(dict(shard), str(tmp / name), metadata={"format": "pt"})
            files.append((name, [n for n, _ in shard]))
            total += sum(t.nbytes for _, t in shard)
        n = len(files)
        weight_map = {}
        for i, (name, names) in enumerate(files):
            final_name = "model.safetensors" if n == 1 else f"model-{i + 1:05d}-of-{n:05d}.safetensors"
            (tmp / name).rename(tmp / final_name)
            weight_map.update(dict.fromkeys(names, final_name))
        if n > 1:
            (tmp / "model.safetensors.index.json").write_text(
                json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1)
            )
        self._write_config(tmp)
        if final.exists():
            shutil.rmtree(final)
        tmp.rename(final)
        return final

    def _write_config(self, out: Path) -> None:
        if self.config is None:
            return
        if hasattr(self.config, "save_pretrained"):
            self.config.save_pretrained(out)
            return
        for f in Path(self.config).iterdir():
            if f.is_file() and not re.search(r"\.(safetensors|bin|pt|pth|gguf)$|safetensors\.index\.json$", f.name):
                shutil.copy2(f, out / f.name)


def _failed(result: Any) -> bool:
    """An engine's answer to ``update_weights_from_disk``: an exception, or LocalEngine's ``success: False`` dict."""
    return isinstance(result, BaseException) or (isinstance(result, dict) and result.get("success") is False)


# ----------------------------------------------------------------------------------------- tensor


class TensorTransport(WeightTransport):
    """Hand the weights to engines on this machine by handle: SGLang's ``/update_weights_from_tensor``.

    What slime does when trainer and engine are colocated on one GPU: nothing is copied over a
    bus or written to disk; the engine maps the trainer's CUDA tensors (CUDA IPC) and copies them
    into its own parameters. Without CUDA the tensors go as files in ``ipc_dir``, the private folder
    the engines were started with (``agentrl serve --weight-ipc-dir``, which an embedded engine needs for CUDA
    handles too; a run gives its launched ``agentrl serve`` engines one,
    :class:`agentrl.engines.ipc_folder.IpcFolder`): written once per bucket, read by every engine,
    deleted once every engine has answered (engines never take names from anywhere else). Per
    bucket (at most ``bucket_bytes``) every engine gets the bucket's handles, ``ranks_per_engine``
    times (one per engine TP rank, all reading the same full tensors); only the last bucket carries
    ``weight_version``. Each bucket's tensors are kept alive until every engine has answered.
    """

    def __init__(
        self,
        engines: Sequence[SGLangEngine],
        *,
        bucket_bytes: int = 512 << 20,
        ranks_per_engine: int = 1,
        ipc_dir: str | Path | None = None,
    ):
        if not engines:
            raise ValueError("TensorTransport needs at least one engine")
        self.engines = list(engines)
        self.bucket_bytes = bucket_bytes
        self.ranks_per_engine = ranks_per_engine
        self.cuda = torch.cuda.is_available()
        if not self.cuda and ipc_dir is None:
            raise ValueError(
                "TensorTransport without CUDA hands CPU tensors over as files in the engines' private folder: "
                "pass ipc_dir= the folder they were started with (agentrl serve --weight-ipc-dir), "
                "or use the disk transport"
            )
        self.folder = IpcFolder(ipc_dir) if ipc_dir is not None and not self.cuda else None

    route = "tensor"

    async def push(self, named_tensors: NamedTensors, version: str, *, finite: bool = False) -> None:
        device = torch.device("cuda", torch.cuda.current_device()) if self.cuda else torch.device("cpu")
        # CPU tensors are not copied here: the stash writes each one's bytes straight into its file
        for bucket, last in _with_last(_buckets(named_tensors, self.bucket_bytes, device=device)):
            await self._send(bucket, str(version) if last else None)

    async def _send(self, bucket: list[tuple[str, torch.Tensor]], version: str | None) -> None:
        """CUDA: one pickle per receiving rank (each takes its own IPC reference, as slime sends); CPU: one
        payload for all, its files written once and deleted once every engine has answered."""
        stash = TensorStash(self.folder) if self.folder is not None and not self.cuda else None
        ranks = range(self.ranks_per_engine)
        try:
            if stash is not None:
                payload = await asyncio.to_thread(serialize_named_tensors, bucket, stash)
                payloads = [[payload for _ in ranks] for _ in self.engines]
            else:
                payloads = await asyncio.to_thread(
                    lambda: [[serialize_named_tensors(bucket) for _ in ranks] for _ in self.engines]
                )
            answers = await asyncio.gather(
                *(
                    e.update_weights_from_tensor(p, flush_cache=version is not None, weight_version=version)
                    for e, p in zip(self.engines, payloads)
                ),
                return_exceptions=True,
            )
        finally:
            if stash is not None:
                stash.close()
        failed = [f"{e!r}: {a}" for e, a in zip(self.engines, answers) if isinstance(a, BaseException)]
        if failed:
            raise EngineRequestError("update_weights_from_tensor failed on " + " | ".join(failed))


# ------------------------------------------------------------------------- embedded engines (Ray)


def _check_answers(answers: Sequence[Any], what: str) -> None:
    bad = [a for a in answers if not (isinstance(a, dict) and a.get("success"))]
    if bad:
        raise EngineError(
            f"{what} failed on {len(bad)} engine(s): {bad[0].get('message') if isinstance(bad[0], dict) else bad[0]}"
        )


class ObjectStoreTransport(WeightTransport):
    """Embedded engines (``EngineServer`` Ray actors) anywhere in the cluster: one ``ray.put`` of the weights.

    numpy, not torch tensors: Ray stores numpy arrays in shared memory with one copy and hands
    readers on the same node zero-copy views (:func:`agentrl.runtime.engine_group.tensors_to_numpy`).
    """

    route = "object_store"

    def __init__(self, engines: Sequence[Any]):
        if not engines:
            raise ValueError("ObjectStoreTransport needs at least one engine actor")
        self.engines = list(engines)

    async def push(self, named_tensors: NamedTensors, version: str, *, finite: bool = False) -> None:
        await self.push_list([(name, t.cpu()) for name, t in named_tensors], version)

    async def push_list(self, named: list[tuple[str, torch.Tensor]], version: str) -> None:
        import ray

        ref = ray.put(tensors_to_numpy(dict(named)))
        answers = await asyncio.gather(*(e.update_weights_from_tensors.remote(ref, str(version)) for e in self.engines))
        _check_answers(answers, "weight update")


class SharedMemoryTransport(WeightTransport):
    """Embedded engines on the trainer's node: the weights are written once into a shared-memory slot
    (:class:`agentrl.runtime.shm_weights.SharedWeightsWriter`) and every engine maps it, no copy.

    A slot that cannot be written (a small ``/dev/shm``) sends this and every later push through the
    object store instead, with one warning; :attr:`route` then says ``object_store``.
    """

    route = "shm"

    def __init__(self, engines: Sequence[Any]):
        if not engines:
            raise ValueError("SharedMemoryTransport needs at least one engine actor")
        self.engines = list(engines)
        self._writer: Any = None
        self._fallback: ObjectStoreTransport | None = None

    async def push(self, named_tensors: NamedTensors, version: str, *, finite: bool = False) -> None:
        named = list(named_tensors)
        if self._fallback is None:
            try:
                if self._writer is None:
                    self._writer = SharedWeightsWriter()
                path, layout = self._writer.write(named, checked=finite)
            except ValueError as exc:  # NaN or inf in the weights: no engine saw them
                raise EngineError(f"weight update refused before it reached the engines: {exc}") from None
            except OSError as exc:
                log.warning("shared-memory weight sync unavailable (%s); using Ray's object store", exc)
                if self._writer is not None:
                    self._writer.close()  # its slots would hold ~2x the weights in /dev/shm for nothing
                    self._writer = None
                self._fallback = ObjectStoreTransport(self.engines)
                self.route = "object_store"
            else:
                answers = await asyncio.gather(
                    *(e.update_weights_from_shared.remote(path, layout, str(version)) for e in self.engines)
                )
                _check_answers(answers, "weight update")
                return
        await self._fallback.push_list([(n, t.cpu()) for n, t in named], version)

    async def close(self) -> None:
        """Unlink the shared-memory slots (engines that mapped them keep their pages until they move on)."""
        if self._writer is not None:
            self._writer.close()
            self._writer = None


# ------------------------------------------------------------------------------------ distributed


class DistributedTransport(WeightTransport):
    """Broadcast weights from this process (rank 0) into SGLang engines, bucket by bucket.

    The group: rank 0 is this process; engine ``i`` holds ranks ``rank_offset_i .. + ranks_i - 1``
    where ``rank_offset_i = 1 + sum(ranks of engines before it)``; ``ranks_per_engine`` defaults to
    each engine's ``tp_size`` from ``/get_server_info`` (1 when it does not say). It is built on the
    first ``push`` (every engine's ``/init_weights_update_group`` runs concurrently with this
    process joining) and reused by later pushes until :meth:`close`.

    Per bucket (at most ``bucket_bytes`` of tensors; a larger tensor travels alone) every engine
    gets ``/update_weights_from_distributed`` with the bucket's names, dtypes and shapes while this
    process broadcasts the tensors in that order; the engines answer once they have loaded them.
    Only the last bucket carries ``weight_version``, so an engine reports the new version only when
    it holds all of it.

    ``backend`` defaults to NCCL where CUDA is available, else gloo (CPU tensors); engines on a
    machine without CUDA also fall back to gloo. ``timeout`` (seconds) bounds joining and each
    collective. If an engine refuses a bucket before receiving it (unknown group, malformed
    metadata), the group is out of step. So whenever an engine refuses a bucket, the transport
    drops the group (waiting at most ``refusal_grace`` seconds for the broadcast) and raises; the
    next ``push`` builds a new one, on a new port and named ``<group_name>.<n>`` (a broadcast stuck
    on the old group keeps its name registered until the group timeout). A refused bucket leaves
    the buckets before it applied, as in SGLang: push the full weights again.
    """

    refusal_grace = 10.0

    route = "nccl"

    def __init__(
        self,
        engines: Sequence[SGLangEngine],
        *,
        master_address: str = "127.0.0.1",
        master_port: int | None = None,
        backend: str | None = None,
        bucket_bytes: int = 512 << 20,
        group_name: str = DEFAULT_GROUP_NAME,
        ranks_per_engine: Sequence[int] | None = None,
        timeout: float = 600.0,
    ):
        if not engines:
            raise ValueError("DistributedTransport needs at least one engine")
        self.engines = list(engines)
        self.master_address = master_address
        self.master_port = master_port
        self.backend = resolve_backend(backend or ("nccl" if torch.cuda.is_available() else "gloo"))
        self.bucket_bytes = bucket_bytes
        self.group_name = group_name
        self.ranks_per_engine = list(ranks_per_engine) if ranks_per_engine is not None else None
        self.timeout = timeout
        self._pg: dist.ProcessGroup | None = None
        self._name = group_name  # the current group's name; a new one per connection attempt
        self._attempts = 0

    @property
    def connected(self) -> bool:
        return self._pg is not None

    async def connect(self) -> None:
        """Build the group: every engine joins over HTTP while this process joins as rank 0."""
        if self._pg is not None:
            return
        ranks = self.ranks_per_engine or [await _tp_size(e) for e in self.engines]
        if len(ranks) != len(self.engines):
            raise ValueError(f"ranks_per_engine has {len(ranks)} entries for {len(self.engines)} engines")
        offsets = [1 + sum(ranks[:i]) for i in range(len(ranks))]
        world = 1 + sum(ranks)
        port = self.master_port if self.master_port and not self._attempts else free_port(self.master_address)
        self._name = self.group_name if not self._attempts else f"{self.group_name}.{self._attempts}"
        self._attempts += 1
        local = run_in_thread(
            functools.partial(
                init_custom_process_group,
                backend=self.backend,
                master_address=self.master_address,
                master_port=port,
                world_size=world,
                rank=0,
                group_name=self._name,
                timeout=self.timeout,
            )
        )
        remote = [
            asyncio.ensure_future(
                e.init_weights_update_group(
                    self.master_address, port, off, world, group_name=self._name, backend=self.backend
                )
            )
            for e, off in zip(self.engines, offsets)
        ]
        try:
            await asyncio.gather(*remote)
            self._pg = await local
        except BaseException:
            for r in remote:
                r.cancel()
            local.add_done_callback(_destroy_if_built)  # it may still be waiting for the missing ranks
            raise

    async def push(self, named_tensors: NamedTensors, version: str, *, finite: bool = False) -> None:
        await self.connect()
        for bucket, last in _with_last(_buckets(named_tensors, self.bucket_bytes, device=comm_device(self.backend))):
            await self._send(bucket, str(version) if last else None)

    async def _send(self, bucket: list[tuple[str, torch.Tensor]], version: str | None) -> None:
        names = [n for n, _ in bucket]
        dtypes = [t.dtype for _, t in bucket]
        shapes = [list(t.shape) for _, t in bucket]
        # flush the prefix cache once, with the last bucket: SGLang asserts a flush succeeds, and one
        # between buckets would run while the engine may still be busy
        posts = [
            asyncio.ensure_future(
                e.update_weights_from_distributed(
                    names,
                    dtypes,
                    shapes,
                    group_name=self._name,
                    weight_version=version,
                    flush_cache=version is not None,
                )
            )
            for e in self.engines
        ]
        sending = run_in_thread(_broadcast, self._pg, [t for _, t in bucket])
        answers = await asyncio.gather(*posts, return_exceptions=True)
        errors = [f"{e!r}: {a}" for e, a in zip(self.engines, answers) if isinstance(a, BaseException)]
        if not errors:
            try:
                await sending
                return
            except RuntimeError as exc:  # a rank went away mid-broadcast
                await self._drop(sending)
                raise EngineError(f"weight broadcast failed; the group is dropped: {exc}") from exc
        # An engine refused the bucket. It may have done so before receiving it (unknown group,
        # malformed metadata), so the group cannot be trusted: drop it; the next push builds a new one.
        try:
            await asyncio.wait_for(asyncio.shield(sending), self.refusal_grace)
        except (TimeoutError, RuntimeError):
            pass
        await self._drop(sending)
        raise EngineRequestError("update_weights_from_distributed failed on " + " | ".join(errors))

    async def _drop(self, sending: asyncio.Future) -> None:
        """Forget the current group: destroy it here once no broadcast uses it, and on the engines."""
        pg, self._pg = self._pg, None
        if sending.done():
            _destroy(pg)
        else:  # still blocked on a rank that never came: destroyed when the group timeout ends it
            sending.add_done_callback(lambda _: _destroy(pg))
        await asyncio.gather(
            *(e.destroy_weights_update_group(self._name) for e in self.engines), return_exceptions=True
        )

    async def close(self) -> None:
        """Destroy the group on every engine and here."""
        if self._pg is None:
            return
        pg, self._pg = self._pg, None
        await asyncio.gather(
            *(e.destroy_weights_update_group(self._name) for e in self.engines), return_exceptions=True
        )
        _destroy(pg)


async def _tp_size(engine: Any) -> int:
    """How many ranks an engine contributes: SGLang's ``tp_size`` (1 for the embedded engine)."""
    try:
        return int((await engine.server_info()).get("tp_size") or 1)
    except Exception:  # noqa: BLE001 - no such method or endpoint, or no tp_size: one rank
        return 1


def _broadcast(pg: dist.ProcessGroup, tensors: list[torch.Tensor]) -> None:
    handles = [dist.broadcast(t, src=0, group=pg, async_op=True) for t in tensors]
    for h in handles:
        h.wait()


def _destroy(pg: dist.ProcessGroup | None) -> None:
    if pg is not None:
        try:
            dist.destroy_process_group(pg)
        except Exception:  # noqa: BLE001 - already gone
            pass


def _destroy_if_built(fut: asyncio.Future) -> None:
    if not fut.cancelled() and fut.exception() is None:
        _destroy(fut.result())


def _with_last(buckets: Iterator[list[tuple[str, torch.Tensor]]]) -> Iterator[tuple[list, bool]]:
    """``(bucket, is_last)`` looking one bucket ahead (the last one carries the version); no buckets: one empty."""
    bucket = next(buckets, [])
    for following in buckets:
        yield bucket, False
        bucket = following
    yield bucket, True


def _buckets(
    named_tensors: NamedTensors, max_bytes: int, *, device: torch.device, copy: bool = False
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Group ``(name, tensor)`` pairs into lists of at most ``max_bytes`` (a larger tensor goes alone).

    Tensors are detached, moved to ``device`` and made contiguous (copied when ``copy``: safetensors
    refuses tensors that share storage, like tied embeddings).
    """
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, t in named_tensors:
        t = t.detach().to(device, copy=copy).contiguous()
        if bucket and size + t.nbytes > max_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, t))
        size += t.nbytes
    if bucket:
        yield bucket


__all__ = ["DiskTransport", "DistributedTransport", "TensorTransport", "WeightTransport", "make_transport"]
