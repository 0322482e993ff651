"""LoRA on the ``megatron`` backend: adapters on megatron-core's tensor-parallel linears, A and B sharded as TP needs.

Megatron-Bridge's PEFT, the field's LoRA for megatron-core, does not install beside this stack (its releases pin
``transformers<5``, Transformer Engine built for CUDA 13 and ``mamba-ssm``), so the adapter math is here, kept to
what parity with the ``torch`` backend (PEFT) needs. It is the same adapter, seen through megatron's layout:

* **one adapter per Hugging Face module** (``q_proj``, ``k_proj``, ``v_proj``, ``o_proj``, ``gate_proj``, ``up_proj``,
  ``down_proj``), as PEFT holds them, although megatron fuses q/k/v into ``linear_qkv`` and gate/up into
  ``linear_fc1``: a fused linear's delta is its parts' deltas laid out as megatron lays out the fused weight
  (per query group for q/k/v; ``[gate; up]`` per rank for fc1). So a PEFT adapter loads, and saves, unchanged.
* **column-parallel** linears (``linear_qkv``, ``linear_fc1``: the output split over TP): ``A`` [r, in] is whole on
  every TP rank, ``B`` [out/tp, r] is split like the weight's rows. ``x A^T`` is computed on every rank and passes
  megatron's ``copy_to_tensor_model_parallel_region`` (identity forward, all-reduce backward), so ``A``'s gradient
  and the input's gradient through it are the whole sums.
* **row-parallel** linears (``linear_proj``, ``linear_fc2``: the input split over TP): ``A`` [r, in/tp] is split like
  the weight's columns, ``B`` [out, r] is whole; ``x A^T`` is summed over TP
  (``reduce_from_tensor_model_parallel_region``) before ``B``.

The delta ``(alpha / r) B A x`` is added to the linear's output by a forward hook, so the model, its state dict and
the HF conversion stay as they are; the adapter's parameters live in :class:`MegatronLora`, outside the model. Split
parameters carry megatron's ``tensor_model_parallel`` attributes, so the gradient norm counts each once.
The KL reference is the same model with the hooks switched off (:meth:`MegatronLora.disabled`); the engines get
``W + (alpha / r) B A`` (:meth:`MegatronLora.merge`); checkpoints and adapter pushes use PEFT's names and files
(:meth:`MegatronLora.peft_state`, :meth:`MegatronLora.load_peft_state`).
"""

from __future__ import annotations

import contextlib
import math
import zlib
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from peft import LoraConfig
from torch import nn

from agentrl.config import TrainConfig, megatron_lora_problems
from agentrl.trainer.lora import PEFT_PREFIX, lora_config

# megatron linear (inside decoder.layers.N) -> (parallel kind, the HF modules it fuses, in megatron's order)
_LINEARS: dict[str, tuple[str, tuple[str, ...]]] = {
    "self_attention.linear_qkv": ("column", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
    "self_attention.linear_proj": ("row", ("self_attn.o_proj",)),
    "mlp.linear_fc1": ("column", ("mlp.gate_proj", "mlp.up_proj")),
    "mlp.linear_fc2": ("row", ("mlp.down_proj",)),
}


def targeted(hf_module: str, cfg: TrainConfig) -> bool:
    """Whether ``--lora-target-modules`` names the HF module (PEFT's rule: the full name or a dotted suffix)."""
    wanted = [t for t in cfg.lora_target_modules if t != "all-linear"]
    if not wanted:  # all-linear: every decoder linear (megatron's LM head is never adapted)
        return True
    return any(hf_module == t or hf_module.endswith("." + t) for t in wanted)


@dataclass
class _Part:
    """One HF module's adapter inside a megatron linear: its PEFT name stem and this rank's A and B."""

    hf: str  # model.layers.{i}.self_attn.q_proj
    a: nn.Parameter
    b: nn.Parameter


class _Adapted:
    """The adapters of one megatron linear: its delta (which :class:`MegatronLora`'s hook adds) and merged weight."""

    def __init__(self, kind: str, parts: list[_Part | None], rows: list[int], layout: Callable, in_local: int) -> None:
        self.kind, self.parts, self.rows, self.layout, self.in_local = kind, parts, rows, layout, in_local

    def delta(self, x: torch.Tensor, scale: float) -> torch.Tensor:
        """``scale * B A x`` over the parts, in the linear's output layout (a part not adapted gives zeros)."""
        from megatron.core.tensor_parallel import (
            copy_to_tensor_model_parallel_region,
            reduce_from_tensor_model_parallel_region,
        )

        outs = []
        for part, rows in zip(self.parts, self.rows):
            if part is None:
                outs.append(x.new_zeros(*x.shape[:-1], rows))
                continue
            h = F.linear(x, part.a)
            if self.kind == "column":
                h = copy_to_tensor_model_parallel_region(h)  # whole A on every rank: its gradient is the TP sum
            else:
                h = reduce_from_tensor_model_parallel_region(h)  # split A: x A^T is the TP sum
            outs.append(F.linear(h, part.b) * scale)
        return self.layout(outs)

    def weight_delta(self, scale: float) -> torch.Tensor:
        """``scale * B A`` laid out as this rank's shard of the fused weight (rows = outputs)."""
        device = next(p.a.device for p in self.parts if p is not None)
        outs = [  # each part [rows, in] -> transposed, so the layout's last dim is the output
            (p.b @ p.a * scale).t() if p is not None else torch.zeros(self.in_local, rows, device=device)
            for p, rows in zip(self.parts, self.rows)
        ]
        return self.layout(outs).t()


def _qkv_layout(groups: int, q_rows: int, kv_rows: int) -> Callable[[list[torch.Tensor]], torch.Tensor]:
    """Megatron's linear_qkv output: per local query group, its q heads, then its k, then its v (last dim)."""

    def layout(parts: list[torch.Tensor]) -> torch.Tensor:
        q, k, v = parts
        lead = q.shape[:-1]
        fused = torch.cat(
            [q.reshape(*lead, groups, q_rows), k.reshape(*lead, groups, kv_rows), v.reshape(*lead, groups, kv_rows)],
            dim=-1,
        )
        return fused.reshape(*lead, -1)

    return layout


def _concat(parts: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat(parts, dim=-1)


class MegatronLora(nn.Module):
    """This rank's LoRA adapter over a megatron-core GPTModel stage: parameters, hooks, merge and PEFT state.

    Built on the stage's model after its base weights are loaded; the model's parameters stop training and only
    this module's go to the optimizer. ``cfg.seed`` draws ``A`` (PEFT's Kaiming-uniform bound, or ``gaussian``) whole
    and identically on every rank, from a generator per module name, then each rank keeps its shard; ``B`` starts at
    zero, so the policy starts as the base. (PEFT draws from the global RNG, so the two backends' fresh adapters
    differ for one seed; the same adapter file gives the same numbers on both.)
    """

    def __init__(
        self,
        model: nn.Module,
        hf_config: Any,
        cfg: TrainConfig,
        *,
        tp_rank: int,
        tp_size: int,
        policy: str | None = None,
        hooks: bool = True,
    ) -> None:
        """``policy``: the ``--policy`` this adapter is (its ``A`` is drawn apart from the other policies'); ``hooks``
        False: the delta is added by a router over several adapters (:class:`MegatronPolicies`), not by this one."""
        from megatron.core.tensor_parallel import set_tensor_model_parallel_attributes

        super().__init__()
        problems = megatron_lora_problems(cfg)
        adaptable = {hf.rsplit(".", 1)[-1] for _, parts in _LINEARS.values() for hf in parts}
        unknown = sorted({t.rsplit(".", 1)[-1] for t in cfg.lora_target_modules} - {"all-linear", *adaptable})
        if unknown:  # what the config's list (the engines' served targets) lets through but no megatron linear holds
            problems.append(f"--lora-target-modules {' '.join(unknown)}: no megatron linear of this model holds it")
        if problems:
            raise ValueError("; ".join(problems))
        self.cfg, self.tp_rank, self.tp_size, self.policy = cfg, tp_rank, tp_size, policy
        self.rank_r = cfg.lora_rank
        self.scale = (cfg.lora_alpha if cfg.lora_alpha is not None else cfg.lora_rank) / cfg.lora_rank
        self.enabled = True
        self.params = nn.ParameterDict()
        self.adapted: dict[nn.Module, _Adapted] = {}
        self._by_weight: dict[str, _Adapted] = {}  # the model's state-dict name of an adapted weight
        self.num_layers = hf_config.num_hidden_layers
        self._hooks: list[Any] = []
        heads, groups = hf_config.num_attention_heads, hf_config.num_key_value_heads
        head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads
        local_groups = groups // tp_size
        layers = model.decoder.layers
        offset = layers[0].layer_number - 1 if len(layers) else 0
        for local, layer in enumerate(layers):
            for mname, (kind, hf_parts) in _LINEARS.items():
                module = layer.get_submodule(mname)
                out_local, in_local = module.weight.shape
                if kind == "column" and len(hf_parts) == 3:
                    q_rows = heads // groups * head_dim
                    rows = [local_groups * q_rows, local_groups * head_dim, local_groups * head_dim]
                    layout = _qkv_layout(local_groups, q_rows, head_dim)
                elif kind == "column":
                    rows, layout = [out_local // 2, out_local // 2], _concat
                else:
                    rows, layout = [out_local], _concat
                parts: list[_Part | None] = []
                for hf_part, part_rows in zip(hf_parts, rows):
                    hf = f"model.layers.{local + offset}.{hf_part}"
                    if not targeted(hf, cfg):
                        parts.append(None)
                        continue
                    in_full = in_local * (tp_size if kind == "row" else 1)
                    a_full = self._draw_a(hf, in_full, module.weight.device)
                    a = a_full.chunk(tp_size, 1)[tp_rank] if kind == "row" else a_full
                    b = torch.zeros(part_rows, self.rank_r, device=module.weight.device)
                    pa, pb = nn.Parameter(a.contiguous()), nn.Parameter(b)
                    if kind == "row":
                        set_tensor_model_parallel_attributes(pa, True, 1, 1)
                    else:
                        set_tensor_model_parallel_attributes(pb, True, 0, 1)
                    self.params[_key(hf, "A")], self.params[_key(hf, "B")] = pa, pb
                    parts.append(_Part(hf, pa, pb))
                if any(p is not None for p in parts):
                    self.adapted[module] = _Adapted(kind, parts, rows, layout, in_local)
                    self._by_weight[f"decoder.layers.{local}.{mname}.weight"] = self.adapted[module]
        if not self.adapted and len(layers):  # the config refuses one-layer targets with pipeline stages; a backstop
            raise ValueError(
                f"--lora-target-modules {' '.join(cfg.lora_target_modules)}: no linear layer of the pipeline stage "
                f"holding layers {offset}-{offset + len(layers) - 1} is targeted, and every stage must train one"
            )
        model.requires_grad_(False)
        for module in self.adapted if hooks else ():
            self._hooks.append(module.register_forward_hook(self._hook, with_kwargs=True))

    def _draw_a(self, hf: str, in_features: int, device: torch.device) -> torch.Tensor:
        """``A`` of one module, whole: the same on every rank for one seed (a generator per module name)."""
        key = hf if self.policy is None else f"{self.policy}/{hf}"  # each policy its own draw; one adapter as before
        g = torch.Generator().manual_seed(self.cfg.seed * 1_000_003 + zlib.crc32(key.encode()))
        a = torch.empty(self.rank_r, in_features)
        if self.cfg.lora_init == "gaussian":
            a.normal_(0.0, 1.0 / self.rank_r, generator=g)
        else:  # PEFT's default: nn.Linear's own init, kaiming_uniform_(a=sqrt(5)), bound 1/sqrt(in)
            bound = 1.0 / math.sqrt(in_features)
            a.uniform_(-bound, bound, generator=g)
        return a.to(device)

    def _hook(self, module: nn.Module, args: tuple, kwargs: dict, output: tuple) -> tuple:
        if not self.enabled:
            return output
        x = args[0] if args else kwargs["input_"]
        out, bias = output
        return out + self.adapted[module].delta(x, self.scale).to(out.dtype), bias

    def disabled(self) -> contextlib.AbstractContextManager[None]:
        """The base model: the KL reference, with no second model in memory."""
        return _switched_off(self)

    def trainable(self) -> list[nn.Parameter]:
        """This rank's A and B tensors: all the optimizer steps."""
        return list(self.params.values())

    def merge(self) -> Callable[[str, torch.Tensor], torch.Tensor]:
        """For :func:`~agentrl.trainer.megatron_model.iter_hf_weights`: a local tensor, merged where adapted."""

        def merged(name: str, t: torch.Tensor) -> torch.Tensor:
            adapted = self._by_weight.get(name)
            if adapted is None:
                return t
            with torch.no_grad():
                return (t.float() + adapted.weight_delta(self.scale).to(t.device)).to(t.dtype)

        return merged

    # ------------------------------------------------------------ PEFT state

    def _shards(self) -> Iterator[tuple[str, str, nn.Parameter, int | None]]:
        """(PEFT name, kind, this rank's parameter, its TP split dim or None) for every adapter tensor."""
        for adapted in self.adapted.values():
            for part in adapted.parts:
                if part is None:
                    continue
                split_a, split_b = (1, None) if adapted.kind == "row" else (None, 0)
                yield f"{PEFT_PREFIX}{part.hf}.lora_A.weight", "A", part.a, split_a
                yield f"{PEFT_PREFIX}{part.hf}.lora_B.weight", "B", part.b, split_b

    def peft_state(
        self,
        of: Callable[[nn.Parameter], torch.Tensor | None] = lambda p: p.detach(),
        *,
        tp_group: Any,
        pp_group: Any,
    ) -> dict[str, torch.Tensor]:
        """The whole adapter (every stage's layers) in PEFT's names, full tensors on CPU, on every rank.

        A collective over TP and PP. ``of`` picks what to gather of each parameter (``lambda p: p.grad`` for the
        gradients, in the same names).
        """
        mine: dict[str, torch.Tensor] = {}
        tp = dist.get_world_size(tp_group) if tp_group is not None and self.tp_size > 1 else 1
        for name, _, param, split in self._shards():
            t = of(param)
            t = torch.zeros_like(param) if t is None else t.detach()
            if split is not None and tp > 1:
                parts = [torch.empty_like(t) for _ in range(tp)]
                dist.all_gather(parts, t.contiguous(), group=tp_group)
                t = torch.cat(parts, dim=split)
            mine[name] = t.cpu().contiguous()
        if pp_group is None or dist.get_world_size(pp_group) == 1:
            return mine
        stages: list[Any] = [None] * dist.get_world_size(pp_group)
        dist.all_gather_object(stages, mine, group=pp_group)
        return {k: v for stage in stages for k, v in stage.items()}

    def load_peft_state(self, tensors: Mapping[str, torch.Tensor], *, source: str) -> None:
        """Take this stage's shards of a whole PEFT adapter (``source`` names it in errors); checked before any copy.

        The file must adapt exactly this run's modules of every layer (each stage checks the whole file).
        """
        self.copy_shards(self.checked_shards(tensors, source=source))

    def checked_shards(
        self, tensors: Mapping[str, torch.Tensor], *, source: str
    ) -> list[tuple[nn.Parameter, torch.Tensor]]:
        """This stage's ``(parameter, shard)`` pairs of a whole PEFT adapter, every name and shape checked (nothing
        copied: several policies check every adapter before any is replaced)."""
        expected = self._all_names()
        missing, extra = sorted(expected - set(tensors)), sorted(set(tensors) - expected)
        if missing or extra:
            raise ValueError(
                f"{source} adapts other modules than this run's --lora-target-modules "
                f"(missing {missing[:3]}, extra {extra[:3]})"
            )
        shards = {}
        for name, _, param, split in self._shards():
            t = tensors[name]
            whole = list(param.shape)
            if split is not None:
                whole[split] *= self.tp_size
            if list(t.shape) != whole:
                raise ValueError(f"{source}: {name} has shape {list(t.shape)}, this run's adapter {whole}")
            shards[name] = (param, t.chunk(self.tp_size, split)[self.tp_rank] if split is not None else t)
        return list(shards.values())

    @staticmethod
    @torch.no_grad()
    def copy_shards(shards: list[tuple[nn.Parameter, torch.Tensor]]) -> None:
        """Copy :meth:`checked_shards`' tensors into their parameters."""
        for param, t in shards:
            param.copy_(t.to(param.device, param.dtype))

    def peft_config(self, base: str | Path) -> LoraConfig:
        """The adapter's PEFT config, as the torch backend saves it: ``all-linear`` resolved to module names."""
        config = lora_config(self.cfg)
        if config.target_modules == "all-linear":  # PEFT resolves it so when it wraps a model; so do we
            config.target_modules = {hf.rsplit(".", 1)[-1] for hf in self._adapted_hf_modules()}
        config.base_model_name_or_path = str(Path(base).resolve())
        return config

    def _adapted_hf_modules(self) -> list[str]:
        """Every stage's adapted HF modules (the whole model's layers)."""
        return [
            hf
            for i in range(self.num_layers)
            for _, hf_parts in _LINEARS.values()
            for hf in (f"model.layers.{i}.{part}" for part in hf_parts)
            if targeted(hf, self.cfg)
        ]

    def _all_names(self) -> set[str]:
        """Every stage's adapter tensor names, as PEFT's file holds them."""
        return {f"{PEFT_PREFIX}{hf}.lora_{x}.weight" for hf in self._adapted_hf_modules() for x in "AB"}

    def adapted_modules(self) -> set[str]:
        """The adapted modules' last names (``q_proj``), as the engines' adapter flags name them."""
        return {hf.rsplit(".", 1)[-1] for hf in self._adapted_hf_modules()}


class MegatronPolicies(nn.Module):
    """Several policies (``--policy``) over one megatron-core stage: a :class:`MegatronLora` adapter each on the shared
    frozen base, trained from one mixed stream, as :mod:`agentrl.trainer.lora_policies` does with PEFT.

    One forward hook per adapted linear adds, for each span of the packed row (:meth:`routing`, set per micro-batch:
    ``(policy, tokens)`` runs of the row's samples sorted by policy), that policy's delta on its slice of the row
    (megatron's activations are ``[s, b, h]``: the slice is along ``s``). So each adapter's gradient comes from its own
    rows alone; the tensor-parallel collectives inside a delta pair up because every TP rank of a replica routes the
    same row. A forward with no spans set is refused (it would silently run the base). Pipeline stages route the same
    way: a micro-batch's spans are set where its forward runs, and its backward needs none (nothing is recomputed).
    """

    def __init__(self, model: nn.Module, hf_config: Any, cfg: TrainConfig, *, tp_rank: int, tp_size: int) -> None:
        super().__init__()
        self.names = list(cfg.policy)
        self.adapters = nn.ModuleDict(
            {
                n: MegatronLora(model, hf_config, cfg, tp_rank=tp_rank, tp_size=tp_size, policy=n, hooks=False)
                for n in self.names
            }
        )
        self.enabled = True
        self.spans: list[tuple[str, int]] | None = None
        first = self.of(self.names[0])
        self._hooks = [m.register_forward_hook(self._hook, with_kwargs=True) for m in first.adapted]

    def of(self, name: str) -> MegatronLora:
        """Policy ``name``'s adapter (refused naming the policies this stage trains)."""
        if name not in self.adapters:
            raise ValueError(f"no adapter of policy {name!r}: this trainer trains the policies {self.names}")
        lora = self.adapters[name]
        assert isinstance(lora, MegatronLora)
        return lora

    def _hook(self, module: nn.Module, args: tuple, kwargs: dict, output: tuple) -> tuple:
        if not self.enabled:
            return output
        if self.spans is None:
            raise RuntimeError("several policies: a forward of the policy model outside routing() (no spans set)")
        x = args[0] if args else kwargs["input_"]
        out, bias = output
        live = [(p, n) for p, n in self.spans if n]
        if sum(n for _, n in live) != x.shape[0]:
            raise RuntimeError(
                f"an adapted linear got {x.shape[0]} tokens while the packed row's spans hold "
                f"{sum(n for _, n in live)}: several policies route adapters by spans of the row"
            )
        parts = x.split([n for _, n in live], dim=0)
        deltas = [self.of(p).adapted[module].delta(part, self.of(p).scale) for (p, _), part in zip(live, parts)]
        return out + torch.cat(deltas, dim=0).to(out.dtype), bias

    @contextmanager
    def routing(self, spans: list[tuple[str, int]]) -> Iterator[None]:
        """Route the row of one forward: ``spans`` is :func:`~agentrl.trainer.lora_policies.policy_spans` of it."""
        self.spans = spans
        try:
            yield
        finally:
            self.spans = None

    def disabled(self) -> contextlib.AbstractContextManager[None]:
        """The base model with every adapter off: the KL reference."""
        return _switched_off(self)

    def trainable(self, name: str | None = None) -> list[nn.Parameter]:
        """Policy ``name``'s A and B tensors on this rank (None: every policy's)."""
        return [p for n in ([name] if name else self.names) for p in self.of(n).trainable()]

    def adapted_modules(self) -> set[str]:
        return self.of(self.names[0]).adapted_modules()


@contextmanager
def _switched_off(adapters: MegatronLora | MegatronPolicies) -> Iterator[None]:
    """``adapters``' hooks pass the base's output through (``enabled`` False) for the context."""
    adapters.enabled = False
    try:
        yield
    finally:
        adapters.enabled = True


def _key(hf: str, which: str) -> str:
    return hf.replace(".", "__") + "__" + which


__all__ = ["MegatronLora", "MegatronPolicies", "targeted"]
