"""LoRA adapters served by the embedded engine as SGLang serves them: several adapters in one batch.

SGLang's server args and endpoints (``--enable-lora``, ``--lora-paths``, ``--max-loras-per-batch``,
``--max-loaded-loras``, ``--max-lora-rank``, ``--lora-target-modules``, ``/load_lora_adapter``,
``/unload_lora_adapter``, ``lora_path`` per request and per batch row) are kept with their names and meaning; the
HTTP side is in ``server.py``, the scheduling (which rows share a decode step, the prefix cache per adapter) in
``engine.py``. This module holds the adapters' weights and runs them.

How a batch mixes adapters (S-LoRA / punica batching, in plain torch): every targeted ``nn.Linear`` of the decoder
gets a forward hook (:class:`LoraLinear`) holding all loaded adapters stacked, ``A: [slots, R, in]`` and
``B: [slots, out, R]`` (``R`` the largest rank, smaller ranks zero-padded; slot 0 is all zeros: "no adapter").
Before each forward the engine says which slot each row uses (:meth:`LoraAdapters.select`). A batch on one adapter
adds ``(x @ A[s]^T) @ B[s]^T``; a mixed batch runs every row through the batch's adapters side by side (two dense
matmuls with ``k * R`` columns, ``k`` adapters in the batch) and zeroes, per row, the columns of the adapters that
are not its own, so each row gets exactly its own adapter's sum (zero for a row without one: the base model's
forward). On CPU this costs far less than gathering each row's ``A`` and ``B`` (batched matrix-vector products,
punica's BGMV): ``bench/p12_lora_serving.py``. Each adapter's scale (``lora_alpha / r``, or ``/ sqrt(r)`` with
rsLoRA) is folded into its ``B`` when it is loaded.

What the embedded engine does not take (refused with the field named, never served as something else): DoRA,
``modules_to_save``, biases, per-module rank or alpha patterns, ``layers_to_transform``, ``fan_in_fan_out``
(Conv1D models), adapters on embeddings or the LM head; ``--enable-lora`` with a vision-language checkpoint or with
``--enable-torch-compile``.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from agentrl.config import LORA_SERVED_TARGETS
from agentrl.engines.local.weights import (
    WeightUpdateError,
    all_finite,
    check_against_model,
    open_regular,
    read_source,
)

SUPPORTED_TARGETS = LORA_SERVED_TARGETS
"""The decoder's linear layers an adapter may target (SGLang's names for a Llama-shaped model; the config's check of
``--weight-sync adapter`` reads the same tuple)."""

MAX_LORA_RANK = 1024
"""The largest rank the embedded engine takes (as the trainer's ``--lora-rank`` bound)."""

DEFAULT_MAX_LORAS_PER_BATCH = 8
"""SGLang's default: distinct adapters (no adapter counts as one) the running rows may use at once."""

PEFT_PREFIX = "base_model.model."
_CONFIG_BYTES = 1 << 20  # an adapter_config.json larger than this is no adapter config


class LoraError(ValueError):
    """An adapter or a LoRA setting the engine refuses; the message names the field or the file."""


@dataclass(frozen=True)
class LoraSource:
    """One ``--lora-paths`` entry: an adapter folder and the name requests use for it."""

    name: str
    path: str
    pinned: bool = False


def _check_name(name: Any, what: str) -> str:
    if not isinstance(name, str) or not name or len(name) > 256 or name.strip() != name:
        raise LoraError(f"{what}: an adapter name is a non-empty string of at most 256 characters, got {name!r}")
    return name


def parse_lora_paths(values: Iterable[str]) -> list[LoraSource]:
    """SGLang's ``--lora-paths`` forms: ``PATH`` (named after itself), ``NAME=PATH``, or JSON
    ``{"lora_name": str, "lora_path": str, "pinned": bool}``; names must be unique."""
    out: list[LoraSource] = []
    for raw in values:
        if not isinstance(raw, str) or not raw:
            raise LoraError(f"--lora-paths: an entry is a PATH, NAME=PATH or a JSON object, got {raw!r}")
        if raw.lstrip().startswith("{"):
            try:
                obj = json.loads(raw)
            except ValueError as exc:
                raise LoraError(f"--lora-paths: {raw!r} is not valid JSON ({exc})") from None
            if not isinstance(obj, dict):
                raise LoraError(f"--lora-paths: {raw!r} is JSON but not an object")
            extra = set(obj) - {"lora_name", "lora_path", "pinned"}
            if extra:
                raise LoraError(
                    f"--lora-paths: {raw!r} has unknown fields {sorted(extra)} (lora_name, lora_path, pinned)"
                )
            pinned = obj.get("pinned", False)
            if not isinstance(pinned, bool):
                raise LoraError(f"--lora-paths: pinned must be true or false in {raw!r}")
            path = obj.get("lora_path")
            if not isinstance(path, str):
                raise LoraError(f"--lora-paths: lora_path must be a string in {raw!r}")
            src = LoraSource(_check_name(obj.get("lora_name"), "--lora-paths"), path, pinned)
        elif "=" in raw:
            name, path = raw.split("=", 1)
            src = LoraSource(_check_name(name, "--lora-paths"), path)
        else:
            src = LoraSource(_check_name(raw, "--lora-paths"), raw)
        if not src.path:
            raise LoraError(f"--lora-paths: {raw!r} names no adapter folder")
        if any(o.name == src.name for o in out):
            raise LoraError(f"--lora-paths: the name {src.name!r} is given twice")
        out.append(src)
    return out


def parse_target_modules(values: Sequence[str] | None) -> frozenset[str] | None:
    """``--lora-target-modules``: module names (SGLang's, e.g. ``q_proj``; space- or comma-separated) or ``all``;
    None when not given (then the adapters of ``--lora-paths`` decide, or every supported module)."""
    if not values:
        return None
    names = {n for v in values for n in str(v).replace(",", " ").split()}
    if "all" in names or "all-linear" in names:
        return frozenset(SUPPORTED_TARGETS)
    bad = sorted(names - set(SUPPORTED_TARGETS))
    if bad:
        raise LoraError(
            f"--lora-target-modules: {bad} are not modules the embedded engine adapts "
            f"(one of {', '.join(SUPPORTED_TARGETS)}, or all)"
        )
    return frozenset(names)


@dataclass
class AdapterConfig:
    """The part of a PEFT ``adapter_config.json`` that serving needs, checked."""

    rank: int
    scale: float
    base: str | None
    targets: frozenset[str] = field(default_factory=frozenset)


def check_adapter_config(cfg: Any, *, what: str, max_rank: int | None) -> AdapterConfig:
    """Refuse a PEFT config the engine would serve as another model (each field named); the rank and scale."""
    if not isinstance(cfg, dict):
        raise LoraError(f"{what}: adapter_config must be a JSON object")
    if cfg.get("peft_type", "LORA") != "LORA":
        raise LoraError(f"{what}: peft_type {cfg.get('peft_type')!r} is not LORA")
    r, alpha = cfg.get("r", 8), cfg.get("lora_alpha", 8)  # PEFT's defaults, as PeftModel reads such a config
    limit = max_rank if max_rank is not None else MAX_LORA_RANK
    if isinstance(r, bool) or not isinstance(r, int) or not 1 <= r <= limit:
        flag = " (--max-lora-rank)" if max_rank is not None else ""
        raise LoraError(f"{what}: r must be an integer in [1, {limit}]{flag}, got {r!r}")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not math.isfinite(alpha) or alpha <= 0:
        raise LoraError(f"{what}: lora_alpha must be a positive number, got {alpha!r}")
    for key, neutral in (
        ("use_dora", (False, None)),
        ("bias", ("none", None)),
        ("modules_to_save", (None, [])),
        ("rank_pattern", ({}, None)),
        ("alpha_pattern", ({}, None)),
        ("layers_to_transform", (None, [])),
        ("fan_in_fan_out", (False, None)),
        ("use_qalora", (False, None)),
        ("target_parameters", (None, [])),
        ("trainable_token_indices", (None, [], {})),
        ("lora_bias", (False, None)),
        ("alora_invocation_tokens", (None, [])),
        ("layer_replication", (None, [])),
    ):
        if key in cfg and cfg[key] not in neutral:
            raise LoraError(f"{what}: {key}={cfg[key]!r} is not served by the embedded engine (only plain LoRA)")
    rslora = cfg.get("use_rslora", False)
    if not isinstance(rslora, bool):
        raise LoraError(f"{what}: use_rslora must be true or false, got {rslora!r}")
    base = cfg.get("base_model_name_or_path")
    targets = cfg.get("target_modules")
    names = (
        frozenset(t.rsplit(".", 1)[-1] for t in targets)  # PEFT matches a name by its suffix: q_proj, self_attn.q_proj
        if isinstance(targets, list) and all(isinstance(t, str) for t in targets)
        else frozenset()
    )
    scale = alpha / math.sqrt(r) if rslora else alpha / r
    return AdapterConfig(r, scale, base if isinstance(base, str) else None, names)


def read_adapter_config(path: str, *, what: str) -> Any:
    """An adapter folder's ``adapter_config.json`` (a regular file, at most 1 MiB); its tensors are read later,
    against the shapes the config implies (:meth:`LoraAdapters.prepare`). Raises :class:`LoraError` naming the file."""
    folder = Path(path)
    cfg_file = folder / "adapter_config.json"
    # is_file(): regular files only (symlinks followed), so a FIFO or a device is never opened
    if not folder.is_dir() or not cfg_file.is_file() or not (folder / "adapter_model.safetensors").is_file():
        raise LoraError(f"{what}: {path!r} is no PEFT adapter folder (adapter_config.json + adapter_model.safetensors)")
    raw = _read_small(cfg_file, what)
    try:
        return json.loads(raw)
    except ValueError as exc:
        raise LoraError(f"{what}: {str(cfg_file)!r} is unreadable ({exc})") from None


def _read_small(path: Path, what: str) -> bytes:
    """A regular file of at most 1 MiB, opened so that a FIFO or a device swapped in is refused, never blocked on."""
    try:
        fd = open_regular(path)
    except WeightUpdateError as exc:
        raise LoraError(f"{what}: {exc}") from None
    try:
        raw = os.read(fd, _CONFIG_BYTES + 1)
    except OSError as exc:
        raise LoraError(f"{what}: {str(path)!r} is unreadable ({exc})") from None
    finally:
        os.close(fd)
    if len(raw) > _CONFIG_BYTES:
        raise LoraError(f"{what}: {str(path)!r} is larger than {_CONFIG_BYTES} bytes")
    return raw


def check_limits(max_rank: int | None, max_loras_per_batch: int, max_loaded_loras: int | None) -> None:
    """SGLang's LoRA limits in bounds (each refusal names its flag); run before the model loads."""
    if isinstance(max_loras_per_batch, bool) or not isinstance(max_loras_per_batch, int):
        raise LoraError(f"--max-loras-per-batch must be an integer, got {max_loras_per_batch!r}")
    if not 1 <= max_loras_per_batch <= 1024:
        raise LoraError(f"--max-loras-per-batch must lie in [1, 1024], got {max_loras_per_batch}")
    if max_loaded_loras is not None and (
        isinstance(max_loaded_loras, bool)
        or not isinstance(max_loaded_loras, int)
        or not max_loras_per_batch <= max_loaded_loras <= 65536
    ):
        raise LoraError(
            f"--max-loaded-loras must be an integer >= --max-loras-per-batch ({max_loras_per_batch}), "
            f"got {max_loaded_loras!r}"
        )
    if max_rank is not None and (isinstance(max_rank, bool) or not isinstance(max_rank, int)):
        raise LoraError(f"--max-lora-rank must be an integer, got {max_rank!r}")
    if max_rank is not None and not 1 <= max_rank <= MAX_LORA_RANK:
        raise LoraError(f"--max-lora-rank must lie in [1, {MAX_LORA_RANK}], got {max_rank}")


@dataclass
class Adapter:
    """A loaded adapter: its name and source, a uid no other load ever gets (the prefix cache's key, so KV computed
    under one adapter, or an earlier load of the same name, is never reused for another), and its slot."""

    name: str
    path: str
    uid: int
    rank: int
    scale: float
    pinned: bool
    slot: int = -1
    version: str | None = None  # what responses under it report as weight_version (a run's policy version)


class _Rows:
    """Which slot each row of the coming forward uses; shared by every :class:`LoraLinear` of a model."""

    def __init__(self) -> None:
        self.single = 0  # the slot of every row when ``mask`` is None (0: no adapter)
        self.sel: tuple[int, ...] = ()  # a mixed forward: the adapters' slots in it, in order
        self.mask: torch.Tensor | None = None  # [n, 1, len(sel) * R]: row i keeps the rank columns of its adapter


class LoraLinear:
    """The stacked adapters of one ``nn.Linear``, added to its output by a forward hook (see the module docstring).

    A hook, not a wrapping module: the layer keeps its type and its state-dict names, so weight updates of the base
    model (``/update_weights_from_*``) and code that inspects the model see it unchanged."""

    def __init__(self, base: nn.Linear, rows: _Rows):
        self.rows = rows
        p = base.weight
        self.A = torch.zeros(1, 0, base.in_features, dtype=p.dtype, device=p.device)
        self.B = torch.zeros(1, base.out_features, 0, dtype=p.dtype, device=p.device)
        self._packed: dict[tuple[int, ...], tuple[torch.Tensor, torch.Tensor]] = {}
        self.handle = base.register_forward_hook(self)

    def __call__(self, module: nn.Module, args: tuple, y: torch.Tensor) -> torch.Tensor:
        rows = self.rows
        if self.A.shape[1] == 0 or (rows.mask is None and rows.single == 0):
            return y
        x = args[0]
        if rows.mask is None:
            a, b = self._pack((rows.single,))
            return y.add_((x @ a) @ b)  # y: the layer's fresh output, written by nothing else
        # a mixed batch: every row through the batch's adapters side by side ([in, k*R] then [k*R, out], two dense
        # matmuls), the rank columns of other adapters zeroed per row in between; far faster on CPU than gathering
        # each row's own A and B (batched matrix-vector products), and exactly the row's own adapter's sum
        a, b = self._pack(rows.sel)
        n = rows.mask.shape[0]
        h = x.reshape(n, -1, x.shape[-1]) @ a  # [n, T, k*R]: the engine's forwards are [rows, tokens, hidden]
        return y.add_((h.mul_(rows.mask) @ b).view_as(y))

    def _pack(self, sel: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
        """The adapters of ``sel`` side by side, contiguous: ``A`` as ``[in, k*R]``, ``B`` as ``[k*R, out]``; kept while
        batches keep that set of adapters (a decode runs many steps with the same rows)."""
        got = self._packed.get(sel)
        if got is None:
            if len(self._packed) >= 2:  # a decode's set and one more (a prefill's): bounded memory
                self._packed.clear()
            idx = torch.tensor(sel, device=self.A.device)
            a = self.A[idx].reshape(-1, self.A.shape[2]).T.contiguous()
            b = self.B[idx].transpose(1, 2).reshape(-1, self.B.shape[1]).contiguous()
            got = self._packed[sel] = (a, b)
        return got

    def resize(self, slots: int, rank: int) -> None:
        """Grow (never shrink) the stacks to ``slots`` slots of rank ``rank``, keeping what they hold."""
        s0, r0 = self.A.shape[0], self.A.shape[1]
        if slots <= s0 and rank <= r0:
            return
        s, r = max(slots, s0), max(rank, r0)
        A = self.A.new_zeros(s, r, self.A.shape[2])
        B = self.B.new_zeros(s, self.B.shape[1], r)
        A[:s0, :r0], B[:s0, :, :r0] = self.A, self.B
        self.A, self.B = A, B
        self._packed.clear()

    def put(self, slot: int, a: torch.Tensor | None, b: torch.Tensor | None) -> None:
        """Write one adapter's ``A [r, in]`` and scaled ``B [out, r]`` into ``slot`` (None: zeros)."""
        self._packed.clear()
        self.A[slot].zero_()
        self.B[slot].zero_()
        if a is not None and b is not None:
            self.A[slot, : a.shape[0]] = a.to(self.A.dtype)
            self.B[slot, :, : b.shape[1]] = b.to(self.B.dtype)


class LoraAdapters:
    """The adapters a model serves, and the wrapped layers that run them.

    Built once at engine start (the constructor hooks the target layers); loads (:meth:`install`) and unloads
    (:meth:`remove`) then change only the stacks, on the engine's worker thread between forwards. The registry of names (:attr:`by_name`) is read and
    written on the event loop: a request names an adapter there, and holds its :class:`Adapter` until it ends.
    """

    def __init__(
        self,
        model: nn.Module,
        layers: Sequence[nn.Module],
        *,
        targets: frozenset[str],
        max_rank: int | None,
        max_loras_per_batch: int = DEFAULT_MAX_LORAS_PER_BATCH,
        max_loaded_loras: int | None = None,
        model_config: Any = None,
    ):
        check_limits(max_rank, max_loras_per_batch, max_loaded_loras)
        self.model_config = model_config
        self.targets = targets
        self.max_rank = max_rank
        self.max_loras_per_batch = max_loras_per_batch
        self.max_loaded_loras = max_loaded_loras
        self.by_name: dict[str, Adapter] = {}
        self.slots: list[Adapter | None] = [None]  # slot 0: no adapter
        self._uid = 0
        self._rows = _Rows()
        self.mixed_forwards = 0  # forwards whose rows used more than one adapter (no adapter counting as one)
        self.most_in_a_forward = 0  # the most distinct adapters one forward has used
        self.layers: dict[str, LoraLinear] = {}
        self.shapes: dict[str, tuple[int, int]] = {}  # module name -> (in, out)
        prefix = {id(m): n for n, m in model.named_modules()}
        for layer in layers:
            base_name = prefix[id(layer)]
            for parent_name, parent in layer.named_modules():
                for child_name, child in list(parent.named_children()):
                    if child_name in targets and type(child) is nn.Linear:
                        name = ".".join(x for x in (base_name, parent_name, child_name) if x)
                        self.layers[name] = LoraLinear(child, self._rows)
                        self.shapes[name] = (child.in_features, child.out_features)
        if not self.layers:
            raise LoraError(f"--lora-target-modules: the model has no linear layer named {sorted(targets)}")

    # ---------------------------------------------------------------- loading (a worker thread, then the engine's)

    def new_uid(self) -> int:
        self._uid += 1
        return self._uid

    def expected_shapes(self, rank: int) -> dict[str, tuple[int, ...]]:
        """PEFT's file name -> shape for every module an adapter of ``rank`` may hold here."""
        out: dict[str, tuple[int, ...]] = {}
        for name, (fan_in, fan_out) in self.shapes.items():
            out[f"{PEFT_PREFIX}{name}.lora_A.weight"] = (rank, fan_in)
            out[f"{PEFT_PREFIX}{name}.lora_B.weight"] = (fan_out, rank)
        return out

    def prepare(
        self, name: str, cfg: Any, source: str | dict[str, torch.Tensor], *, what: str, pinned: bool = False
    ) -> tuple[Adapter, dict[str, tuple[torch.Tensor, torch.Tensor]]]:
        """Check ``cfg`` and read (a folder) or take (a dict) the tensors, each checked against this model's layers:
        the adapter and ``module -> (A, B)`` as given (:meth:`install` checks their values and scales B). Touches no
        served weight (runs in a worker thread)."""
        _check_name(name, what)
        conf = check_adapter_config(cfg, what=what, max_rank=self.max_rank)
        outside = sorted(t for t in conf.targets if t not in self.targets)
        if outside:
            raise LoraError(
                f"{what}: the adapter targets {outside}, which this engine does not adapt "
                f"(--lora-target-modules {' '.join(sorted(self.targets))})"
            )
        self._check_base(conf, what)
        shapes = self.expected_shapes(conf.rank)
        try:
            if isinstance(source, dict):
                for k, t in source.items():
                    check_against_model(shapes, k, tuple(t.shape), what)
                tensors = dict(source)
            else:
                tensors, _ = read_source(source, shapes=shapes)
        except WeightUpdateError as exc:
            raise LoraError(f"{what}: the adapter does not fit this engine's model: {exc}") from None
        modules: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        for mod in self.shapes:
            a = tensors.get(f"{PEFT_PREFIX}{mod}.lora_A.weight")
            b = tensors.get(f"{PEFT_PREFIX}{mod}.lora_B.weight")
            if (a is None) != (b is None):
                raise LoraError(f"{what}: {mod} has lora_{'A' if a is not None else 'B'} without its pair")
            if a is None or b is None:
                continue
            for t, label in ((a, "lora_A"), (b, "lora_B")):
                if not t.is_floating_point():
                    raise LoraError(f"{what}: {mod}.{label} has dtype {t.dtype}, not a floating-point type")
            modules[mod] = (a, b)
        if not modules:
            raise LoraError(f"{what}: the adapter holds no lora_A/lora_B weights for this model's layers")
        path = source if isinstance(source, str) else "__tensor__"
        adapter = Adapter(name, path, 0, conf.rank, conf.scale, pinned)
        return adapter, modules

    def _check_base(self, conf: AdapterConfig, what: str) -> None:
        """An adapter whose ``base_model_name_or_path`` is a local checkpoint of another shape than the served model
        is refused by name (the layer shapes would refuse most such adapters anyway, with a less telling message)."""
        if not conf.base or self.model_config is None:
            return
        cfg_file = Path(conf.base) / "config.json"
        try:
            if not cfg_file.is_file():
                return  # a hub name or a folder not on this machine: the layer shapes decide
            theirs = json.loads(_read_small(cfg_file, what))
        except (OSError, ValueError):
            return  # unreadable: the layer shapes decide
        text_cfg = getattr(self.model_config, "text_config", None) or self.model_config
        for key in ("model_type", "hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size"):
            mine, other = getattr(text_cfg, key, None), theirs.get(key) if isinstance(theirs, dict) else None
            if mine is not None and other is not None and mine != other:
                raise LoraError(
                    f"{what}: the adapter was trained on {conf.base} ({key}={other}); this engine serves "
                    f"a model with {key}={mine}: load it on an engine serving its base"
                )

    def install(self, adapter: Adapter, modules: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Put a prepared adapter into a free slot (the engine's worker thread, between forwards: the tensor math is
        done there, as every parallel torch op of the engine, see ``LocalEngine.__init__``); refused, changing
        nothing, when a value is NaN or infinite or no slot may be added."""
        dtype = next(iter(self.layers.values())).A.dtype
        ready: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        for mod, (a, b) in modules.items():
            for t, label in ((a, "lora_A"), (b, "lora_B")):
                if t.numel() and not all_finite(t):
                    raise LoraError(f"lora adapter {adapter.name!r}: {mod}.{label} holds NaN or infinite values")
            scaled = (b.float() * adapter.scale).to(dtype)
            if scaled.numel() and not all_finite(scaled):
                raise LoraError(
                    f"lora adapter {adapter.name!r}: {mod}.lora_B times the scale {adapter.scale:g} (lora_alpha / r) "
                    f"overflows {dtype}"
                )
            ready[mod] = (a.to(dtype), scaled)
        held = sum(1 for a in self.slots if a is not None)  # counted here, on the worker: loads may race
        if self.max_loaded_loras is not None and held >= self.max_loaded_loras:
            raise LoraError(f"{held} adapters are loaded, --max-loaded-loras {self.max_loaded_loras}: unload one first")
        slot = next((i for i in range(1, len(self.slots)) if self.slots[i] is None), len(self.slots))
        rank = max(self.max_rank or 0, adapter.rank)
        for name, layer in self.layers.items():
            layer.resize(slot + 1, rank)
            a, b = ready.get(name, (None, None))
            layer.put(slot, a, b)
        if slot == len(self.slots):
            self.slots.append(adapter)
        else:
            self.slots[slot] = adapter
        adapter.slot = slot

    def remove(self, adapter: Adapter) -> None:
        """Zero ``adapter``'s slot and free it (the worker thread, once no request holds it)."""
        if 0 < adapter.slot < len(self.slots) and self.slots[adapter.slot] is adapter:
            for layer in self.layers.values():
                layer.put(adapter.slot, None, None)
            self.slots[adapter.slot] = None
        adapter.slot = -1

    # ---------------------------------------------------------------- serving

    def select(self, slots: Sequence[int]) -> None:
        """The slot of each row of the next forward (in row order)."""
        distinct = set(slots)
        self.most_in_a_forward = max(self.most_in_a_forward, len(distinct))
        rows = self._rows
        if len(distinct) <= 1:
            rows.mask, rows.sel, rows.single = None, (), next(iter(distinct), 0)
            return
        self.mixed_forwards += 1
        first = next(iter(self.layers.values())).A
        rank = first.shape[1]
        sel = tuple(sorted(distinct - {0}))
        at = {s: i for i, s in enumerate(sel)}
        mask = torch.zeros(len(slots), len(sel), rank, dtype=first.dtype)
        for i, s in enumerate(slots):
            if s:
                mask[i, at[s]] = 1
        rows.mask, rows.sel, rows.single = mask.view(len(slots), 1, -1).to(first.device), sel, 0

    def nbytes(self) -> int:
        """The memory the adapters' stacks take (every layer's A and B)."""
        return sum(layer.A.nbytes + layer.B.nbytes for layer in self.layers.values())

    def listing(self) -> dict[str, str]:
        """SGLang's ``loaded_adapters``: name -> path (``__tensor__`` for adapters sent as tensors)."""
        return {a.name: a.path for a in self.by_name.values()}

    def server_args(self) -> dict[str, Any]:
        """The LoRA entries of ``/get_server_info`` (SGLang's server-arg names)."""
        return {
            "enable_lora": True,
            "max_loras_per_batch": self.max_loras_per_batch,
            "max_loaded_loras": self.max_loaded_loras,
            "max_lora_rank": self.max_rank,
            "lora_target_modules": sorted(self.targets),
            "lora_paths": [
                {"lora_name": a.name, "lora_path": a.path, "pinned": a.pinned} for a in self.by_name.values()
            ],
            "lora_backend": "agentrl-torch",  # SGLang's own: triton, csgmv
            "lora_mixed_forwards": self.mixed_forwards,  # agentrl's: forwards that mixed adapters in one batch
        }


__all__ = [
    "DEFAULT_MAX_LORAS_PER_BATCH",
    "SUPPORTED_TARGETS",
    "Adapter",
    "LoraAdapters",
    "LoraError",
    "LoraLinear",
    "LoraSource",
    "check_adapter_config",
    "check_limits",
    "parse_lora_paths",
    "parse_target_modules",
    "read_adapter_config",
]
