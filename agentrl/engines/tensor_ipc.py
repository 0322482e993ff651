"""Named tensors handed to another process on the same machine by handle, not by value.

SGLang's ``/update_weights_from_tensor`` (the colocated weight sync slime uses) takes
``serialized_named_tensors``: one base64 string per engine TP rank, each a ``ForkingPickler``
pickle of ``[(hf_name, tensor), ...]``. ``ForkingPickler`` uses torch's multiprocessing reductions:
a CUDA tensor travels as a CUDA IPC handle (the engine maps the trainer's GPU memory, no copy
over the bus), a CPU tensor as the name of a shared-memory file. So the pickle is a few hundred
bytes per tensor whatever the model size, and the sender must keep the tensors alive until the
engine has answered (it copies them into its own parameters before it answers).

CPU tensors need torch's ``file_system`` sharing strategy: the default (``file_descriptor``)
passes file descriptors over a socket between a parent and its children, which two unrelated
processes talking HTTP cannot do. :func:`serialize_named_tensors` switches the strategy for the
process (it only affects tensors shared from then on).

Unpickling calls whatever the pickle names, so :func:`deserialize_named_tensors` resolves only
an exact list: torch's tensor/storage rebuild functions, ``torch.Size``, tensor and storage classes
and dtypes. Anything else (``builtins.eval``, ``torch.load`` behind ``torch.storage._load_from_bytes``,
...) is refused before it runs.
"""

from __future__ import annotations

import base64
import io
import pickle
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

_REBUILDS = (
    "rebuild_tensor",
    "rebuild_typed_storage",
    "rebuild_storage_filename",
    "rebuild_cuda_tensor",
    "rebuild_storage_empty",
)
_ALLOWED = {("torch.multiprocessing.reductions", n) for n in _REBUILDS} | {
    ("torch", "Size"),
    ("torch", "Tensor"),
    ("torch.storage", "UntypedStorage"),
    ("torch.storage", "TypedStorage"),
    ("torch._utils", "_rebuild_tensor_v2"),
    ("torch.nn.parameter", "Parameter"),
}
_MAX_PAYLOAD = 64 << 20  # handles, never values: a few hundred bytes per tensor
_SGLANG_BUCKET_META = ("sglang.srt.weight_sync.tensor_bucket", "FlattenedTensorMetadata")


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


def serialize_named_tensors(named: Iterable[tuple[str, torch.Tensor]]) -> str:
    """``[(name, tensor)]`` as SGLang's ``MultiprocessingSerializer.serialize(..., output_str=True)`` writes it."""
    return _dump([(str(n), t.detach().contiguous()) for n, t in named])


def _dump(obj: Any) -> str:
    from multiprocessing.reduction import ForkingPickler

    import torch.multiprocessing as tmp  # registers torch's reductions with ForkingPickler

    tensors = [t for _, t in obj] if isinstance(obj, list) else [obj["flattened_tensor"]]
    if any(t.device.type == "cpu" for t in tensors) and tmp.get_sharing_strategy() != "file_system":
        tmp.set_sharing_strategy("file_system")
    buf = io.BytesIO()
    ForkingPickler(buf).dump(obj)
    return base64.b64encode(buf.getvalue()).decode("ascii")


class _TorchOnlyUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == _SGLANG_BUCKET_META or (module, name) == (__name__, "FlattenedTensorMetadata"):
            return FlattenedTensorMetadata
        if (module, name) in _ALLOWED or (module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"refusing to load {module}.{name} from serialized tensors")


def _load(data: str | bytes) -> Any:
    import torch.multiprocessing  # noqa: F401 - the rebuild functions the pickle names

    if not isinstance(data, (str, bytes)) or len(data) > _MAX_PAYLOAD:
        raise ValueError("serialized_named_tensors entries must be base64 strings of at most 64 MiB")
    raw = base64.b64decode(data, validate=True) if isinstance(data, str) else data
    return _TorchOnlyUnpickler(io.BytesIO(raw)).load()


def serialize_flattened_bucket(named: Iterable[tuple[str, torch.Tensor]]) -> str:
    """``[(name, tensor)]`` as slime sends ``load_format: "flattened_bucket"``: one ``uint8`` buffer
    holding every tensor's bytes (one handle for the whole bucket) and each tensor's byte range."""
    flats, meta, pos = [], [], 0
    for name, t in named:
        b = t.detach().contiguous().flatten().view(torch.uint8)
        meta.append(FlattenedTensorMetadata(str(name), t.shape, t.dtype, pos, pos + b.numel(), t.numel()))
        flats.append(b)
        pos += b.numel()
    flat = torch.cat(flats) if flats else torch.empty(0, dtype=torch.uint8)
    return _dump({"flattened_tensor": flat, "metadata": meta})


def deserialize_flattened_bucket(data: str | bytes) -> list[tuple[str, torch.Tensor]]:
    """The named tensors of a flattened bucket (SGLang's ``FlattenedTensorBucket``), checked: every
    range inside the buffer, its length the tensor's bytes (or elements), its shape its element count."""
    obj = _load(data)
    if not isinstance(obj, dict) or set(obj) != {"flattened_tensor", "metadata"}:
        raise ValueError("a flattened bucket must be a dict with keys 'flattened_tensor' and 'metadata'")
    flat, metas = obj["flattened_tensor"], obj["metadata"]
    if not isinstance(flat, torch.Tensor) or flat.dim() != 1:
        raise ValueError("flattened_tensor must be a 1-D tensor")
    if not isinstance(metas, list) or not all(isinstance(m, FlattenedTensorMetadata) for m in metas):
        raise ValueError("metadata must be a list of FlattenedTensorMetadata")
    out = []
    for m in metas:
        offsets = (m.start_idx, m.end_idx, m.numel)
        if not isinstance(m.dtype, torch.dtype) or not all(
            isinstance(v, int) and not isinstance(v, bool) for v in offsets
        ):
            raise ValueError(f"bucket entry {m.name!r}: dtype must be a torch dtype and offsets integers")
        shape = torch.Size(m.shape)
        by_bytes = flat.dtype == torch.uint8 and m.dtype != torch.uint8
        if not by_bytes and flat.dtype != m.dtype:  # the older layout holds one dtype: no silent conversion
            raise ValueError(f"bucket entry {m.name!r}: {m.dtype} in a {flat.dtype} buffer")
        width = m.dtype.itemsize if by_bytes else 1
        if not 0 <= m.start_idx <= m.end_idx <= flat.numel() or m.end_idx - m.start_idx != m.numel * width:
            raise ValueError(
                f"bucket entry {m.name!r}: range {m.start_idx}..{m.end_idx} does not hold {m.numel} elements "
                f"of {m.dtype} in a buffer of {flat.numel()}"
            )
        if shape.numel() != m.numel:
            raise ValueError(
                f"bucket entry {m.name!r}: shape {list(shape)} has {shape.numel()} elements, not {m.numel}"
            )
        part = flat[m.start_idx : m.end_idx]
        if by_bytes:
            try:
                t = part.view(m.dtype)
            except RuntimeError:  # a range not aligned to the dtype: copy it first
                t = part.clone().view(m.dtype)
        else:
            t = part
        out.append((str(m.name), t.reshape(shape)))
    return out


def deserialize_named_tensors(data: str | bytes) -> list[tuple[str, torch.Tensor]]:
    """Inverse of :func:`serialize_named_tensors` (tensors map the sender's memory); checks the shape of the data."""
    items = _load(data)
    if not isinstance(items, list) or not all(
        isinstance(x, tuple) and len(x) == 2 and isinstance(x[0], str) and isinstance(x[1], torch.Tensor) for x in items
    ):
        raise ValueError("serialized_named_tensors must hold a list of (name, tensor) pairs")
    return items


__all__ = [
    "FlattenedTensorMetadata",
    "deserialize_flattened_bucket",
    "deserialize_named_tensors",
    "serialize_flattened_bucket",
    "serialize_named_tensors",
]
