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


def serialize_named_tensors(named: Iterable[tuple[str, torch.Tensor]]) -> str:
    """``[(name, tensor)]`` as SGLang's ``MultiprocessingSerializer.serialize(..., output_str=True)`` writes it."""
    from multiprocessing.reduction import ForkingPickler

    import torch.multiprocessing as tmp  # registers torch's reductions with ForkingPickler

    items = [(str(n), t.detach().contiguous()) for n, t in named]
    if any(t.device.type == "cpu" for _, t in items) and tmp.get_sharing_strategy() != "file_system":
        tmp.set_sharing_strategy("file_system")
    buf = io.BytesIO()
    ForkingPickler(buf).dump(items)
    return base64.b64encode(buf.getvalue()).decode("ascii")


class _TorchOnlyUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ALLOWED or (module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"refusing to load {module}.{name} from serialized tensors")


def deserialize_named_tensors(data: str | bytes) -> list[tuple[str, torch.Tensor]]:
    """Inverse of :func:`serialize_named_tensors` (tensors map the sender's memory); checks the shape of the data."""
    import torch.multiprocessing  # noqa: F401 - the rebuild functions the pickle names

    if not isinstance(data, (str, bytes)) or len(data) > _MAX_PAYLOAD:
        raise ValueError("serialized_named_tensors entries must be base64 strings of at most 64 MiB")
    raw = base64.b64decode(data, validate=True) if isinstance(data, str) else data
    items = _TorchOnlyUnpickler(io.BytesIO(raw)).load()
    if not isinstance(items, list) or not all(
        isinstance(x, tuple) and len(x) == 2 and isinstance(x[0], str) and isinstance(x[1], torch.Tensor) for x in items
    ):
        raise ValueError("serialized_named_tensors must hold a list of (name, tensor) pairs")
    return items


__all__ = ["deserialize_named_tensors", "serialize_named_tensors"]
