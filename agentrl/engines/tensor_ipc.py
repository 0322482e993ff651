"""Named tensors handed to another process on the same machine by handle, not by value.

SGLang's ``/update_weights_from_tensor`` (the colocated weight sync slime uses) takes
``serialized_named_tensors``: one base64 string per engine TP rank, each a ``ForkingPickler``
pickle of ``[(hf_name, tensor), ...]`` (or, with ``load_format: "flattened_bucket"``, of one flat
buffer and each tensor's range in it). A CUDA tensor travels as a CUDA IPC handle (the engine maps
the trainer's GPU memory, no copy over the bus); a CPU tensor as the name of a shared-memory file.
So the pickle is a few hundred bytes per tensor whatever the model size.

A handle is a request to read memory the *engine* can reach, so the engine accepts only handles
of memory the run's own trainer wrote, and builds nothing from the pickle until every view is
checked (:class:`Receiver`):

- CPU tensors name a file in the engine's **private folder** (:class:`IpcFolder`: a directory
  only its owner can enter, ``agentrl serve --weight-ipc-dir``), never a file anywhere else. The
  sender writes each tensor's bytes there (:class:`TensorStash`) and deletes them once the engine
  has answered; the engine opens a plain name inside that folder (no ``/``, no symlink, a regular
  file of its own user, of exactly the announced size), reads it into its own memory, and never
  unlinks, truncates or maps it. torch's own ``file_system`` machinery is never run: it would open
  any ``/dev/shm`` name, connect to a client-chosen ``torch_shm_manager`` socket, and delete the
  file when the engine lets go of it. An engine without the folder refuses CPU handles.
- CUDA tensors (what slime sends) are accepted by an engine on CUDA only, only when it was started
  with the folder (``--weight-ipc-dir`` is the opt-in to tensor handles of any kind: torch maps a CUDA
  handle and updates a ``/dev/shm`` counter the payload names), and only after their view is checked
  against the storage size they announce; their reference counter must be one of torch's own
  ``/dev/shm/torch_*`` files of the engine's user. (Not checked: that the announced size is the real
  allocation's; no GPU was at hand to test this path.)
- Every view (size, stride, offset) must lie inside its storage and must not overlap itself (no
  stride-0 "expanded" tensor a later copy would blow up); each tensor must have the dtype and shape
  of the parameter it replaces; and the bytes one update reads are capped by the model's own
  parameter bytes. All of this is checked on the unpickled *description*, before a byte is read.

Unpickling calls whatever the pickle names, so the unpickler resolves only an exact list (torch's
rebuild functions, mapped to the inert descriptions above, ``torch.Size``, dtypes, and SGLang's
bucket metadata). Anything else (``builtins.eval``, ``torch.load`` behind
``torch.storage._load_from_bytes``, ...) is refused before it runs.
"""

from __future__ import annotations

import base64
import io
import math
import os
import pickle
import re
import reprlib
import stat
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from agentrl.engines.ipc_folder import IpcFolder, TensorHandleError, TensorStash, check_name

_MAX_PAYLOAD = 64 << 20  # handles, never values: a few hundred bytes per tensor
_MAX_DIMS = 64
_MAX_INDEX = 1 << 62  # sizes, strides and offsets beyond this are no tensor this machine holds
_TORCH_REF_COUNTER = re.compile(r"/torch_\d{1,10}_\d{1,20}_\d{1,20}")
_SGLANG_BUCKET_META = ("sglang.srt.weight_sync.tensor_bucket", "FlattenedTensorMetadata")
_REDUCTIONS = "torch.multiprocessing.reductions"


# ------------------------------------------------------------------------------------- sending


@dataclass
class FlattenedTensorMetadata:
    """One tensor's place in a flattened bucket, with the fields of SGLang's class of the same name.

    slime's colocated sync (``load_format: "flattened_bucket"``) pickles SGLang's own dataclass; the
    unpickler here builds this one instead, so neither side needs the other's package. Offsets are
    bytes into a ``uint8`` bucket (current SGLang) or elements into a bucket of the tensors' dtype
    (older SGLang); :func:`deserialize_flattened_bucket` reads both.
    """

    name: str
    shape: Any
    dtype: torch.dtype
    start_idx: int
    end_idx: int
    numel: int


class _Reduced:
    """Pickles as ``fn(*args)`` by reference, exactly as torch's reductions write it."""

    def __init__(self, fn: Any, args: tuple):
        self.fn, self.args = fn, args

    def __reduce__(self) -> tuple:
        return self.fn, self.args


class HandlePickler:
    """``ForkingPickler`` (the format SGLang reads) with CPU tensors written into a :class:`TensorStash`.

    A CUDA tensor is reduced by torch (a CUDA IPC handle). A CPU tensor pickles as torch's
    ``rebuild_tensor(Tensor, rebuild_typed_storage(rebuild_storage_filename(...), dtype), meta)``
    whose handle is the stash file's plain name: the wire shape of torch's ``file_system`` sharing,
    without torch's shared-memory files, manager process or reference counts.
    """

    def __init__(self, file: io.BytesIO, stash: TensorStash | None):
        from multiprocessing.reduction import ForkingPickler

        import torch.multiprocessing  # noqa: F401 - registers torch's reductions with ForkingPickler

        self._pickler = ForkingPickler(file)
        self._stash = stash
        for cls in (torch.Tensor, torch.nn.parameter.Parameter):
            self._pickler.dispatch_table[cls] = self._reduce_tensor

    def dump(self, obj: Any) -> None:
        self._pickler.dump(obj)

    def _reduce_tensor(self, t: torch.Tensor) -> tuple:
        from torch.multiprocessing import reductions as R

        if t.device.type != "cpu":
            return R.reduce_tensor(t.detach())
        if t.layout != torch.strided or t.is_nested:
            raise ValueError(f"only dense tensors travel by handle, not {t.layout}")
        t = t.detach()
        if t.numel() == 0:
            storage = _Reduced(R.rebuild_storage_empty, (torch.UntypedStorage,))
        elif self._stash is None:
            raise ValueError(
                "CPU tensors travel through the engine's private weight folder: pass a TensorStash "
                "(TensorTransport(ipc_dir=...)), or send CUDA tensors"
            )
        else:
            name, nbytes = self._stash.put(t)  # the stash writes the tensor's contiguous bytes
            storage = _Reduced(R.rebuild_storage_filename, (torch.UntypedStorage, b"", name.encode(), nbytes))
        typed = _Reduced(R.rebuild_typed_storage, (storage, t.dtype))
        return R.rebuild_tensor, (torch.Tensor, typed, (0, t.size(), _contiguous_strides(t.shape), False))


def _contiguous_strides(shape: torch.Size) -> tuple[int, ...]:
    """The strides of a contiguous tensor of ``shape`` (what the stash's file holds)."""
    strides, step = [], 1
    for n in reversed(shape):
        strides.append(step)
        step *= max(n, 1)
    return tuple(reversed(strides))


def _dump(obj: Any, stash: TensorStash | None) -> str:
    buf = io.BytesIO()
    HandlePickler(buf, stash).dump(obj)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def serialize_named_tensors(named: Iterable[tuple[str, torch.Tensor]], stash: TensorStash | None = None) -> str:
    """``[(name, tensor)]`` as SGLang's ``MultiprocessingSerializer.serialize(..., output_str=True)`` writes it.

    CPU tensors need ``stash`` (the engine's private folder); keep it open until the engine answered.
    """
    return _dump([(str(n), t.detach()) for n, t in named], stash)


def serialize_flattened_bucket(named: Iterable[tuple[str, torch.Tensor]], stash: TensorStash | None = None) -> str:
    """``[(name, tensor)]`` as slime sends ``load_format: "flattened_bucket"``: one ``uint8`` buffer
    holding every tensor's bytes (one handle for the whole bucket) and each tensor's byte range."""
    flats, meta, pos = [], [], 0
    for name, t in named:
        b = t.detach().contiguous().flatten().view(torch.uint8)
        meta.append(FlattenedTensorMetadata(str(name), t.shape, t.dtype, pos, pos + b.numel(), t.numel()))
        flats.append(b)
        pos += b.numel()
    flat = torch.cat(flats) if flats else torch.empty(0, dtype=torch.uint8)
    return _dump({"flattened_tensor": flat, "metadata": meta}, stash)


# ----------------------------------------------------------------------------------- receiving


@dataclass(frozen=True)
class Receiver:
    """What one engine accepts: its parameters' ``(shape, dtype)`` by name, a byte cap, its device, its folder.

    ``params`` None accepts any name, dtype and shape (tools, tests); ``max_bytes`` caps the bytes one
    payload makes the engine read (CPU files) or copy (CUDA views); ``folder`` None refuses CPU handles.
    """

    params: Mapping[str, tuple[tuple[int, ...], torch.dtype]] | None
    max_bytes: int
    device: torch.device = torch.device("cpu")
    folder: IpcFolder | None = None

    @classmethod
    def for_model(cls, model: torch.nn.Module, folder: IpcFolder | None = None) -> Receiver:
        """The receiver for ``model``: its state dict and buffers, capped at their total bytes."""
        named = {**dict(model.named_buffers()), **model.state_dict()}
        params = {k: (tuple(v.shape), v.dtype) for k, v in named.items()}
        device = next(iter(named.values())).device if named else torch.device("cpu")
        return cls(params, sum(v.nbytes for v in named.values()), device, folder)


_NOTHING = Receiver(params=None, max_bytes=0)


class _Token:
    """A class a pickle names only as an argument (``torch.Tensor``, ...): never called, never built."""

    def __init__(self, name: str):
        self.name = name

    def __repr__(self) -> str:
        return self.name


@dataclass
class _FileStorage:
    """``rebuild_storage_filename(cls, manager, handle, size, dtype=None)``, not run: ``manager`` is ignored."""

    cls: Any
    manager: Any
    handle: Any
    size: Any
    dtype: Any = None

    def nbytes(self) -> int:
        n = _index(self.size, "storage size")
        return n * _dtype(self.dtype).itemsize if self.dtype is not None else n


@dataclass
class _EmptyStorage:
    """``rebuild_storage_empty(cls)``."""

    cls: Any


@dataclass
class _TypedStorage:
    """``rebuild_typed_storage(storage, dtype)``."""

    storage: Any
    dtype: Any


@dataclass
class _TensorRef:
    """``rebuild_tensor(cls, storage, (offset, size, stride, requires_grad))``, not run."""

    cls: Any
    storage: Any
    metadata: Any


class _CudaTensorRef:
    """``rebuild_cuda_tensor(...)`` (torch's 15 arguments), not run until checked."""

    FIELDS = (
        "tensor_cls tensor_size tensor_stride tensor_offset storage_cls dtype storage_device storage_handle "
        "storage_size_bytes storage_offset_bytes requires_grad ref_counter_handle ref_counter_offset "
        "event_handle event_sync_required"
    ).split()

    def __init__(self, *args: Any):
        if len(args) != len(self.FIELDS):
            raise TypeError(f"rebuild_cuda_tensor takes {len(self.FIELDS)} arguments, got {len(args)}")
        self.__dict__.update(zip(self.FIELDS, args))


_REBUILDS: dict[str, Any] = {
    "rebuild_tensor": _TensorRef,
    "rebuild_typed_storage": _TypedStorage,
    "rebuild_storage_filename": _FileStorage,
    "rebuild_storage_empty": _EmptyStorage,
    "rebuild_cuda_tensor": _CudaTensorRef,
}
_TOKENS = {
    ("torch", "Tensor"),
    ("torch.nn.parameter", "Parameter"),
    ("torch.storage", "UntypedStorage"),
    ("torch.storage", "TypedStorage"),
}


_DTYPES = {k: v for k, v in vars(torch).items() if isinstance(v, torch.dtype)}
_SHORT = reprlib.Repr()  # keyword arguments need Python 3.12
_SHORT.maxstring, _SHORT.maxother, _SHORT.maxlist, _SHORT.maxtuple, _SHORT.maxdict, _SHORT.maxlevel = 60, 60, 6, 6, 4, 3


def _short(v: Any) -> str:
    """A client's value in a refusal: bounded in length and depth (a refusal must not echo megabytes back)."""
    return _SHORT.repr(v)


class _HandleUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == _SGLANG_BUCKET_META or (module, name) == (__name__, "FlattenedTensorMetadata"):
            return FlattenedTensorMetadata
        if module == _REDUCTIONS and name in _REBUILDS:
            return _REBUILDS[name]
        if (module, name) in _TOKENS:
            return _Token(f"{module}.{name}")
        if (module, name) == ("torch", "Size"):
            return torch.Size
        if module == "torch" and name in _DTYPES:  # a fixed table: getattr(torch, name) would import submodules
            return _DTYPES[name]
        raise pickle.UnpicklingError(f"refusing to load {module}.{name} from serialized tensors")


def _load(data: str | bytes) -> Any:
    if not isinstance(data, (str, bytes)) or len(data) > _MAX_PAYLOAD:
        raise TensorHandleError("serialized_named_tensors entries must be base64 strings of at most 64 MiB")
    try:
        raw = base64.b64decode(data, validate=True) if isinstance(data, str) else data
        return _HandleUnpickler(io.BytesIO(raw)).load()
    except pickle.UnpicklingError:
        raise
    except Exception as exc:  # noqa: BLE001 - any malformed pickle is the client's error
        raise TensorHandleError(f"not a tensor payload: {type(exc).__name__}: {exc}") from None


def _index(v: Any, what: str) -> int:
    if not isinstance(v, int) or isinstance(v, bool) or not 0 <= v < _MAX_INDEX:
        raise TensorHandleError(f"{what} must be a non-negative integer, got {_short(v)}")
    return v


def _dtype(v: Any) -> torch.dtype:
    if not isinstance(v, torch.dtype):
        raise TensorHandleError(f"dtype must be a torch dtype, got {_short(v)}")
    return v


@dataclass
class _View:
    """A checked tensor description: which storage, where in it, and what it becomes."""

    name: str
    key: Any  # the storage: its file name, ("empty",) or the CUDA reference itself
    storage: Any
    dtype: torch.dtype
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int


def _view(name: str, ref: Any, receiver: Receiver) -> _View:
    """Check ``ref`` (an unpickled description) without touching memory: types, bounds, no self-overlap."""
    if isinstance(ref, _CudaTensorRef):
        if receiver.device.type != "cuda":
            raise TensorHandleError(
                f"tensor {name!r} is a CUDA IPC handle, but this engine runs on {receiver.device.type}: "
                "send CPU tensors through its weight folder, or use /update_weights_from_disk"
            )
        if receiver.folder is None:  # torch maps the handle and updates a /dev/shm counter the payload names
            raise TensorHandleError(
                f"tensor {name!r} is a CUDA IPC handle, but this engine was started without --weight-ipc-dir: "
                "tensor handles are taken only by an engine its run started for colocated sync "
                "(or use /update_weights_from_disk)"
            )
        dtype = _dtype(ref.dtype)
        size, stride = _shape(name, ref.tensor_size, ref.tensor_stride)
        offset = _index(ref.tensor_offset, f"tensor {name!r} offset")
        storage_nbytes = _index(ref.storage_size_bytes, f"tensor {name!r} storage size")
        view = _View(name, ref, ref, dtype, size, stride, offset)
    elif isinstance(ref, _TensorRef):
        meta = ref.metadata
        if not isinstance(ref.cls, _Token) or not isinstance(meta, tuple) or len(meta) != 4:
            raise TensorHandleError(f"tensor {name!r}: not a tensor description")
        storage, dtype = ref.storage, torch.uint8
        if isinstance(storage, _TypedStorage):
            storage, dtype = storage.storage, _dtype(storage.dtype)
        elif isinstance(storage, _FileStorage) and storage.dtype is not None:
            dtype = _dtype(storage.dtype)
        if isinstance(storage, _FileStorage):
            if not isinstance(storage.handle, (bytes, str)):
                raise TensorHandleError(f"tensor {name!r}: storage handle must be a name")
            handle = storage.handle.decode("utf-8", "replace") if isinstance(storage.handle, bytes) else storage.handle
            storage_nbytes, key = storage.nbytes(), handle
        elif isinstance(storage, _EmptyStorage):
            storage_nbytes, key = 0, ("empty",)
        else:
            raise TensorHandleError(f"tensor {name!r}: its storage is not a shared-memory handle")
        size, stride = _shape(name, meta[1], meta[2])
        view = _View(name, key, storage, dtype, size, stride, _index(meta[0], f"tensor {name!r} offset"))
    else:
        raise TensorHandleError(f"{name!r} is not a tensor")
    _check_bounds(view, storage_nbytes)
    return view


def _shape(name: str, size: Any, stride: Any) -> tuple[tuple[int, ...], tuple[int, ...]]:
    if not isinstance(size, (tuple, list)) or not isinstance(stride, (tuple, list)) or len(size) != len(stride):
        raise TensorHandleError(f"tensor {name!r}: size and stride must be sequences of the same length")
    if len(size) > _MAX_DIMS:
        raise TensorHandleError(f"tensor {name!r}: {len(size)} dimensions")
    return tuple(_index(s, f"tensor {name!r} size") for s in size), tuple(
        _index(s, f"tensor {name!r} stride") for s in stride
    )


def _check_bounds(v: _View, storage_nbytes: int) -> None:
    """Inside its storage and no two indices on one element (a stride-0 or overlapping view is refused)."""
    if math.prod(v.size) == 0:
        if v.offset * v.dtype.itemsize > storage_nbytes:
            raise TensorHandleError(f"tensor {v.name!r}: offset {v.offset} is past its storage")
        return
    dims = sorted((st, sz) for sz, st in zip(v.size, v.stride) if sz > 1)
    span = 1  # elements the dimensions so far cover: the next stride must step past all of them
    for st, sz in dims:
        if st < span:
            raise TensorHandleError(
                f"tensor {v.name!r}: stride {list(v.stride)} for size {list(v.size)} reads one element "
                "more than once (an expanded or overlapping view)"
            )
        span = st * (sz - 1) + span
    end = (v.offset + sum((sz - 1) * st for sz, st in zip(v.size, v.stride)) + 1) * v.dtype.itemsize
    if end > storage_nbytes:
        raise TensorHandleError(
            f"tensor {v.name!r}: size {list(v.size)}, stride {list(v.stride)}, offset {v.offset} of "
            f"{v.dtype} reach byte {end} of a {storage_nbytes}-byte storage"
        )


def _check_param(name: str, dtype: torch.dtype, shape: tuple[int, ...], receiver: Receiver) -> None:
    if receiver.params is None:
        return
    if name not in receiver.params:
        raise TensorHandleError(f"tensor {name!r} is not a parameter of the model")
    want_shape, want_dtype = receiver.params[name]
    if dtype != want_dtype or tuple(shape) != tuple(want_shape):
        raise TensorHandleError(
            f"tensor {name!r} is {dtype} {list(shape)}; the model's is {want_dtype} {list(want_shape)} "
            "(tensors by handle are not converted: send the engine's dtype and shape)"
        )


def _materialize(views: list[_View], receiver: Receiver) -> list[torch.Tensor]:
    """Cap the bytes, then read each CPU storage once from the folder (or map each CUDA handle) and build the views."""
    files: dict[str, int] = {}
    for v in views:
        if isinstance(v.storage, _FileStorage) and files.setdefault(v.key, v.storage.nbytes()) != v.storage.nbytes():
            raise TensorHandleError(f"tensor {v.name!r}: handle {v.key!r} is given two different sizes")
    cuda = sum(math.prod(v.size) * v.dtype.itemsize for v in views if isinstance(v.storage, _CudaTensorRef))
    total = sum(files.values()) + cuda
    if total > receiver.max_bytes:
        raise TensorHandleError(
            f"the payload names {total} bytes; one update of this model reads at most {receiver.max_bytes}"
        )
    if files and receiver.folder is None:
        raise TensorHandleError(
            "CPU tensor handles are refused: this engine was started without a private weight folder. "
            "Use /update_weights_from_disk, or start it with --weight-ipc-dir DIR (a 0700 folder) and "
            "send with TensorTransport(ipc_dir=DIR)"
        )
    buffers: dict[Any, torch.Tensor] = {}
    for key, nbytes in files.items():
        assert receiver.folder is not None
        check_name(key)
        buffers[key] = receiver.folder.read(key, nbytes)
    out = []
    for v in views:
        if isinstance(v.storage, _CudaTensorRef):
            out.append(_cuda_tensor(v))
            continue
        buf = buffers.get(v.key, torch.empty(0, dtype=torch.uint8))
        t = torch.empty(0, dtype=v.dtype).set_(buf.untyped_storage(), v.offset, v.size, v.stride)
        assert t.untyped_storage().nbytes() == buf.nbytes  # checked above: set_ never grew it
        out.append(t)
    return out


def _cuda_tensor(v: _View) -> torch.Tensor:
    """Map a checked CUDA IPC handle (torch's ``rebuild_cuda_tensor``) after checking its reference counter file."""
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    r = v.storage
    if not isinstance(r.storage_handle, bytes) or len(r.storage_handle) > 256:
        raise TensorHandleError(f"tensor {v.name!r}: storage_handle must be CUDA IPC handle bytes")
    _check_ref_counter(v.name, r.ref_counter_handle, _index(r.ref_counter_offset, "ref_counter_offset"))
    device = _index(r.storage_device, f"tensor {v.name!r} device")
    if device >= torch.cuda.device_count():
        raise TensorHandleError(f"tensor {v.name!r}: no CUDA device {device} here")
    if not (r.event_handle is None or isinstance(r.event_handle, bytes)) or not isinstance(r.event_sync_required, bool):
        raise TensorHandleError(f"tensor {v.name!r}: malformed CUDA event")
    storage_cls = torch.storage.TypedStorage if repr(r.storage_cls) == "torch.storage.TypedStorage" else None
    if storage_cls is None and repr(r.storage_cls) != "torch.storage.UntypedStorage":
        raise TensorHandleError(f"tensor {v.name!r}: storage class {r.storage_cls!r}")
    return rebuild_cuda_tensor(
        torch.Tensor,
        torch.Size(v.size),
        v.stride,
        v.offset,
        storage_cls or torch.UntypedStorage,
        v.dtype,
        device,
        r.storage_handle,
        _index(r.storage_size_bytes, "storage_size_bytes"),
        _index(r.storage_offset_bytes, f"tensor {v.name!r} storage offset"),
        False,
        r.ref_counter_handle,
        r.ref_counter_offset,
        r.event_handle,
        r.event_sync_required,
    )


def _check_ref_counter(name: str, handle: Any, offset: int) -> None:
    """torch maps (and, at zero, unlinks) the counter file a CUDA handle names: only torch's own, of this user."""
    text = handle.decode("ascii", "replace") if isinstance(handle, bytes) else ""
    if not _TORCH_REF_COUNTER.fullmatch(text):
        raise TensorHandleError(f"tensor {name!r}: reference counter {handle!r} is not a torch shared-memory name")
    try:
        st = os.lstat("/dev/shm" + text)
    except OSError:
        raise TensorHandleError(f"tensor {name!r}: no reference counter {text!r} in /dev/shm") from None
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_size < (offset + 1) * 8:
        raise TensorHandleError(f"tensor {name!r}: reference counter {text!r} is not a torch file of this user")


def deserialize_named_tensors(data: str | bytes, receiver: Receiver | None = None) -> list[tuple[str, torch.Tensor]]:
    """Inverse of :func:`serialize_named_tensors`, checked against ``receiver`` before anything is read.

    CPU tensors come back as the engine's own copies of the stash files; CUDA tensors map the
    sender's memory. Without ``receiver`` nothing that names memory is accepted.
    """
    receiver = receiver or _NOTHING
    items = _load(data)
    if not isinstance(items, list) or not all(
        isinstance(x, tuple)
        and len(x) == 2
        and isinstance(x[0], str)
        and isinstance(x[1], (_TensorRef, _CudaTensorRef))
        for x in items
    ):
        raise TensorHandleError("serialized_named_tensors must hold a list of (name, tensor) pairs")
    names = [n for n, _ in items]
    if len(set(names)) != len(names):
        raise TensorHandleError("serialized_named_tensors names a tensor twice")
    views = [_view(n, ref, receiver) for n, ref in items]
    for v in views:
        _check_param(v.name, v.dtype, v.size, receiver)
    return list(zip(names, _materialize(views, receiver)))


def deserialize_flattened_bucket(data: str | bytes, receiver: Receiver | None = None) -> list[tuple[str, torch.Tensor]]:
    """The named tensors of a flattened bucket (SGLang's ``FlattenedTensorBucket``), checked: every
    range inside the buffer, in order and not overlapping, its length the tensor's bytes (or
    elements), its shape its element count, all before the buffer is read."""
    receiver = receiver or _NOTHING
    obj = _load(data)
    if not isinstance(obj, dict) or set(obj) != {"flattened_tensor", "metadata"}:
        raise TensorHandleError("a flattened bucket must be a dict with keys 'flattened_tensor' and 'metadata'")
    metas = obj["metadata"]
    if not isinstance(metas, list) or not all(isinstance(m, FlattenedTensorMetadata) for m in metas):
        raise TensorHandleError("metadata must be a list of FlattenedTensorMetadata")
    flat = _view("flattened_tensor", obj["flattened_tensor"], receiver)
    if len(flat.size) != 1:
        raise TensorHandleError("flattened_tensor must be a 1-D tensor")
    entries = [_bucket_entry(m, flat, receiver) for m in metas]
    names = [m.name for m in metas]
    if len(set(names)) != len(names):
        raise TensorHandleError("bucket entries must have distinct names")
    spans = sorted((start, end) for start, end, _, _ in entries)
    if any(nxt < end for (_, end), (nxt, _) in zip(spans, spans[1:])):
        raise TensorHandleError("bucket entries overlap: each byte of the buffer belongs to one tensor")
    (buffer,) = _materialize([flat], receiver)
    out = []
    for (start, end, by_bytes, shape), m in zip(entries, metas):
        part = buffer[start:end]
        if by_bytes:
            try:
                t = part.view(m.dtype)
            except RuntimeError:  # a range not aligned to the dtype: copy it first (ranges never overlap)
                t = part.clone().view(m.dtype)
        else:
            t = part
        out.append((str(m.name), t.reshape(shape)))
    return out


def _bucket_entry(m: FlattenedTensorMetadata, flat: _View, receiver: Receiver) -> tuple[int, int, bool, torch.Size]:
    offsets = (m.start_idx, m.end_idx, m.numel)
    if not isinstance(m.name, str) or not isinstance(m.dtype, torch.dtype):
        raise TensorHandleError(f"bucket entry {m.name!r}: dtype must be a torch dtype and offsets integers")
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in offsets):
        raise TensorHandleError(f"bucket entry {m.name!r}: dtype must be a torch dtype and offsets integers")
    try:
        shape = torch.Size(m.shape)
    except (TypeError, ValueError, RuntimeError):
        raise TensorHandleError(f"bucket entry {m.name!r}: shape {m.shape!r} is not a shape") from None
    by_bytes = flat.dtype == torch.uint8 and m.dtype != torch.uint8
    if not by_bytes and flat.dtype != m.dtype:  # the older layout holds one dtype: no silent conversion
        raise TensorHandleError(f"bucket entry {m.name!r}: {m.dtype} in a {flat.dtype} buffer")
    width = m.dtype.itemsize if by_bytes else 1
    if not 0 <= m.start_idx <= m.end_idx <= flat.size[0] or m.end_idx - m.start_idx != m.numel * width:
        raise TensorHandleError(
            f"bucket entry {m.name!r}: range {m.start_idx}..{m.end_idx} does not hold {m.numel} elements "
            f"of {m.dtype} in a buffer of {flat.size[0]}"
        )
    if shape.numel() != m.numel:
        raise TensorHandleError(
            f"bucket entry {m.name!r}: shape {list(shape)} has {shape.numel()} elements, not {m.numel}"
        )
    _check_param(m.name, m.dtype, tuple(shape), receiver)
    return m.start_idx, m.end_idx, by_bytes, shape


__all__ = [
    "FlattenedTensorMetadata",
    "HandlePickler",
    "IpcFolder",
    "Receiver",
    "TensorHandleError",
    "TensorStash",
    "deserialize_flattened_bucket",
    "deserialize_named_tensors",
    "serialize_flattened_bucket",
    "serialize_named_tensors",
]
