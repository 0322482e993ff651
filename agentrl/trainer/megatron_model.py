"""Hugging Face decoder checkpoints as megatron-core ``GPTModel``s, and their weights both ways.

The ``megatron`` trainer trains a Megatron model but reads and publishes Hugging Face weights: the
inference engines and every checkpoint on disk speak HF names. This module is the translation:
``transformer_config_from_hf`` + ``build_gpt_model`` make the model, ``load_hf_checkpoint`` fills it,
``iter_hf_weights`` streams it back out as full HF tensors for weight sync and saving.

Supported: ``llama`` (SmolLM2 too), ``mistral`` (without an active sliding window), ``qwen2`` (q/k/v
bias) and ``qwen3`` (per-head q/k RMSNorm), with GQA and tied or untied embeddings. Anything else is
refused with a ValueError rather than converted approximately.

Megatron state-dict names (local spec, found by building the model; layer numbers are local to the
pipeline stage) and how each HF tensor maps to a tensor-parallel (TP) shard::

    embedding.word_embeddings.weight                  model.embed_tokens.weight    vocab rows, dim 0
    decoder.layers.{i}.input_layernorm.weight         input_layernorm.weight       replicated
    decoder.layers.{i}.self_attention.linear_qkv.weight/.bias   q/k/v_proj         fused per group, dim 0
    decoder.layers.{i}.self_attention.q_layernorm.weight        q_norm (qwen3)     replicated
    decoder.layers.{i}.self_attention.k_layernorm.weight        k_norm (qwen3)     replicated
    decoder.layers.{i}.self_attention.linear_proj.weight        o_proj             dim 1
    decoder.layers.{i}.pre_mlp_layernorm.weight       post_attention_layernorm     replicated
    decoder.layers.{i}.mlp.linear_fc1.weight          [gate_r; up_r] per rank      dim 0
    decoder.layers.{i}.mlp.linear_fc2.weight          down_proj                    dim 1
    decoder.final_layernorm.weight                    model.norm.weight            replicated
    output_layer.weight                               lm_head.weight               vocab rows, dim 0
    (every linear also has an ``_extra_state`` entry: None, ignored)

Fused QKV rows, per query group g (G groups, H heads, head dim d): ``[q heads of g (H/G*d); k_g (d);
v_g (d)]``, groups in order; a TP rank holds G/tp consecutive groups. With tied embeddings and one
pipeline stage there is no ``output_layer.weight``; with several, the last stage holds a copy.

Vocabulary padding: like Megatron-LM the vocabulary is padded to a multiple of 128*tp (GEMM-friendly
and always divisible by tp). Padded rows are zero, are stripped on export, and their logits (0, not
-inf) must be masked by the caller: the trainer masks logits >= the true vocab size.

Packed rows: by default the core attention is :class:`~agentrl.trainer.megatron_attention.PackedCoreAttention`,
which attends per sample when the forward gets ``packed_seq_params`` (the trainer's path, no T x T
scores). The T x T alternative is a boolean mask, True = masked out, which both it and megatron's
local attention (DotProductAttention, ``packed_attention=False``) take. With ``attn_mask_type=causal``
and no mask they are causal; when a mask *is* passed the torch softmax path uses that mask alone (the
causal one is not added), so the mask must carry causality itself, which :func:`packed_attention_mask`
does. The fused CUDA softmax kernel (``masked_softmax_fusion``) ignores the passed mask for causal
attention, so that fusion is refused. RoPE is computed for positions 0..s-1 of the row whatever
``position_ids`` says; as RoPE is relative and attention keeps samples apart, a packed sample's logits
equal its logits alone.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from agentrl.flags import parse_literal
from agentrl.trainer.megatron_compat import apply_cpu_workarounds

if TYPE_CHECKING:
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
EMBED, NORM, LM_HEAD = "model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"


@dataclasses.dataclass(frozen=True)
class _Dims:
    """What the conversion needs from an HF config, validated once."""

    num_layers: int
    hidden: int
    ffn: int
    heads: int
    groups: int
    head_dim: int
    vocab: int
    eps: float
    rope_theta: float
    max_positions: int
    tied: bool
    qkv_bias: bool
    qk_norm: bool


def _unsupported(what: str) -> ValueError:
    return ValueError(
        f"{what}; the megatron backend supports model types {', '.join(SUPPORTED_MODEL_TYPES)} "
        "(SmolLM2 is llama) with SiLU-gated MLPs, default RoPE and full attention; "
        "use --train-backend torch for other models"
    )


def _rope_theta(cfg: Any) -> float:
    """theta of plain RoPE from old (rope_theta/rope_scaling) or new (rope_parameters) HF configs."""
    params = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {}
    kind = params.get("rope_type", params.get("type", "default"))
    if kind != "default":
        raise _unsupported(f"rope scaling {kind!r} is not supported")
    if float(params.get("partial_rotary_factor", getattr(cfg, "partial_rotary_factor", 1.0)) or 1.0) != 1.0:
        raise _unsupported("partial rotary embeddings are not supported")
    theta = params.get("rope_theta", getattr(cfg, "rope_theta", None))
    return float(theta if theta is not None else 10000.0)


def _check_full_attention(cfg: Any) -> None:
    layer_types = getattr(cfg, "layer_types", None) or []
    window = getattr(cfg, "sliding_window", None)
    uses_window = getattr(cfg, "use_sliding_window", None)
    if any(t != "full_attention" for t in layer_types) or uses_window:
        raise _unsupported("sliding-window attention layers are not supported")
    if uses_window is None and window is not None and window < cfg.max_position_embeddings:
        raise _unsupported(
            f"sliding window {window} < max_position_embeddings {cfg.max_position_embeddings} "
            "(set sliding_window=null in config.json if the model does not use it)"
        )


def _dims(cfg: Any) -> _Dims:
    model_type = getattr(cfg, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise _unsupported(f"model_type {model_type!r} is not supported")
    if getattr(cfg, "hidden_act", "silu") != "silu":
        raise _unsupported(f"hidden_act {cfg.hidden_act!r} is not supported")
    if getattr(cfg, "mlp_bias", False):
        raise _unsupported("MLP biases (mlp_bias=True) are not supported")
    if model_type != "qwen2" and getattr(cfg, "attention_bias", False):
        # HF adds a bias to o_proj too; megatron can only add one to every linear (add_bias_linear)
        raise _unsupported("attention_bias=True (biased o_proj) is not supported")
    _check_full_attention(cfg)
    heads = cfg.num_attention_heads
    return _Dims(
        num_layers=cfg.num_hidden_layers,
        hidden=cfg.hidden_size,
        ffn=cfg.intermediate_size,
        heads=heads,
        groups=getattr(cfg, "num_key_value_heads", None) or heads,
        head_dim=getattr(cfg, "head_dim", None) or cfg.hidden_size // heads,
        vocab=cfg.vocab_size,
        eps=cfg.rms_norm_eps,
        rope_theta=_rope_theta(cfg),
        max_positions=cfg.max_position_embeddings,
        tied=bool(getattr(cfg, "tie_word_embeddings", False)),
        qkv_bias=model_type == "qwen2",
        qk_norm=model_type == "qwen3",
    )


# -- slime's MODEL_ARGS ---------------------------------------------------------------------------

MODEL_FLAGS: dict[str, Callable[[_Dims], Any]] = {
    "num_layers": lambda d: d.num_layers,
    "hidden_size": lambda d: d.hidden,
    "ffn_hidden_size": lambda d: d.ffn,
    "num_attention_heads": lambda d: d.heads,
    "num_query_groups": lambda d: d.groups,
    "group_query_attention": lambda d: True,  # megatron reads num_query_groups only with it; always agreeable
    "kv_channels": lambda d: d.head_dim,
    "vocab_size": lambda d: d.vocab,
    "max_position_embeddings": lambda d: d.max_positions,
    "swiglu": lambda d: True,
    "normalization": lambda d: "RMSNorm",
    "norm_epsilon": lambda d: d.eps,
    "layernorm_epsilon": lambda d: d.eps,
    "use_rotary_position_embeddings": lambda d: True,
    "position_embedding_type": lambda d: "rope",
    "rotary_base": lambda d: d.rope_theta,
    "rotary_percent": lambda d: 1.0,
    "use_rope_scaling": lambda d: False,  # a scaled RoPE checkpoint is refused by the architecture check
    "disable_bias_linear": lambda d: True,
    "add_qkv_bias": lambda d: d.qkv_bias,
    "qk_layernorm": lambda d: d.qk_norm,
    "untie_embeddings_and_output_weights": lambda d: not d.tied,
    "attention_dropout": lambda d: 0.0,  # agentrl trains without dropout (the first ratio must be 1)
    "hidden_dropout": lambda d: 0.0,
}
"""Megatron-LM's model flags as slime's ``scripts/models/*.sh`` pass them (``MODEL_ARGS``), and the value
each must have for the checkpoint: agentrl derives the architecture from config.json, so a pasted
flag is checked against it (a disagreement is refused, naming both) and then has nothing left to set."""


def check_model_flags(hf_config: Any, flags: dict[str, Any]) -> None:
    """Refuse a ``MODEL_ARGS`` flag that disagrees with the checkpoint's ``config.json``, naming both values.

    A flag given without a value (``--swiglu``) is True; numbers compare within float rounding.
    """
    d = _dims(hf_config)
    for name, given in flags.items():
        if name not in MODEL_FLAGS:
            continue
        if isinstance(given, str):  # a config file's "1e-6" (YAML reads it as text)
            given = parse_literal(given)
        want = MODEL_FLAGS[name](d)
        same = isinstance(given, bool) == isinstance(want, bool) and (  # --num-layers with no value is True, not 1
            given == want
            if isinstance(want, bool) or isinstance(given, bool) or isinstance(want, str)
            else isinstance(given, int | float) and math.isclose(float(given), float(want), rel_tol=1e-9)
        )
        if not same:
            flag = "--" + name.replace("_", "-")
            shown = "" if given is True else f" {given}"
            raise ValueError(
                f"{flag}{shown} disagrees with the checkpoint's config.json, which gives {want!r}: agentrl builds "
                "the model from the checkpoint; fix the flag or drop it"
            )


# -- config and model ----------------------------------------------------------------------------


def megatron_field_names() -> set[str]:
    """Every TransformerConfig field (ModelParallelConfig's included), for validating pass-through flags."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    return {f.name for f in dataclasses.fields(TransformerConfig)}


def transformer_config_from_hf(
    hf_config: Any,
    *,
    tp: int = 1,
    pp: int = 1,
    cp: int = 1,
    params_dtype: torch.dtype = torch.float32,
    overrides: dict[str, Any] | None = None,
) -> TransformerConfig:
    """The TransformerConfig that makes a GPTModel compute what the HF model computes.

    Dropout is 0 (the first policy-gradient pass must see ratio == 1) and every fusion that needs CUDA
    kernels or changes numerics is off; ``overrides`` sets any other field (e.g. recompute_granularity).
    """
    from megatron.core.transformer.transformer_config import TransformerConfig

    d = _dims(hf_config)
    _check_tp(d, tp)
    if d.num_layers % pp:
        raise ValueError(
            f"{d.num_layers} layers do not split evenly over {pp} pipeline stages; choose a "
            "--pipeline-model-parallel-size that divides the number of layers"
        )
    kwargs: dict[str, Any] = dict(
        num_layers=d.num_layers,
        hidden_size=d.hidden,
        ffn_hidden_size=d.ffn,
        num_attention_heads=d.heads,
        num_query_groups=d.groups,
        kv_channels=d.head_dim,
        normalization="RMSNorm",
        layernorm_epsilon=d.eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=d.qkv_bias,
        qk_layernorm=d.qk_norm,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        persist_layer_norm=False,
        gradient_accumulation_fusion=False,
        sequence_parallel=False,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        context_parallel_size=cp,
        params_dtype=params_dtype,
        pipeline_dtype=params_dtype,
        bf16=params_dtype == torch.bfloat16,
        fp16=params_dtype == torch.float16,
        init_method_std=getattr(hf_config, "initializer_range", 0.02),
    )
    overrides = dict(overrides or {})
    check_model_flags(hf_config, overrides)  # slime's MODEL_ARGS: checked, then nothing left to set
    overrides = {k: v for k, v in overrides.items() if k not in MODEL_FLAGS}
    known = megatron_field_names()
    for name in overrides:
        if name not in known:
            close = difflib.get_close_matches(name, sorted(known), n=5)
            hint = f"; did you mean {', '.join(close)}?" if close else ""
            raise ValueError(f"unknown Megatron setting {name!r} (not a TransformerConfig field){hint}")
    if overrides.get("masked_softmax_fusion"):
        raise ValueError(
            "masked_softmax_fusion=True is refused: megatron's fused causal softmax ignores the "
            "attention mask that keeps packed samples apart; leave it off"
        )
    kwargs.update(overrides)
    return TransformerConfig(**kwargs)


def padded_vocab_size(vocab_size: int, tp: int, divisible_by: int = 128) -> int:
    """Megatron-LM's rule: round the vocabulary up to a multiple of ``divisible_by * tp``."""
    multiple = divisible_by * tp
    return -(-vocab_size // multiple) * multiple


def build_gpt_model(
    hf_config: Any,
    config: TransformerConfig,
    *,
    pre_process: bool | None = None,
    post_process: bool | None = None,
    vocab_divisible_by: int = 128,
    packed_attention: bool = True,
) -> GPTModel:
    """A GPTModel (local megatron-core spec) shaped like ``hf_config``, on the current device.

    Needs megatron's parallel state (:func:`~agentrl.trainer.megatron_compat.init_megatron_parallel`);
    the pipeline stage decides ``pre_process`` (embedding) / ``post_process`` (final norm + head) unless
    given. The local spec is used everywhere: its names and attention-mask semantics are the ones this
    module converts and tests (Transformer Engine's fused layers would rename the norms).
    ``packed_attention`` swaps the spec's ``DotProductAttention`` for
    :class:`~agentrl.trainer.megatron_attention.PackedCoreAttention` (same inputs, no parameters): given
    ``packed_seq_params`` it attends per sample of a packed row instead of over T x T masked scores.
    """
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    apply_cpu_workarounds()
    if not ps.model_parallel_is_initialized():
        raise RuntimeError(
            "megatron parallel state is not initialised: call "
            "agentrl.trainer.megatron_compat.init_megatron_parallel(tp, pp, cp) first"
        )
    if config.context_parallel_size > 1:
        raise ValueError(
            "context parallelism needs Transformer Engine attention, which this backend does not "
            "use yet; run with context parallel size 1"
        )
    from megatron.core.transformer.torch_norm import WrappedTorchNorm
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build

    d = _dims(hf_config)
    spec = get_gpt_layer_local_spec(qk_layernorm=config.qk_layernorm, normalization=config.normalization)
    # megatron picks its norms by what is installed (apex's FusedLayerNorm, which refuses RMSNorm, or
    # Transformer Engine's TENorm, with other parameter names): pin torch's RMSNorm everywhere, so the
    # model and its state-dict names do not depend on the packages of the machine
    layer, attention = spec.submodules, spec.submodules.self_attention.submodules
    layer.input_layernorm = layer.pre_mlp_layernorm = WrappedTorchNorm
    if config.qk_layernorm:
        attention.q_layernorm = attention.k_layernorm = WrappedTorchNorm
    if packed_attention:
        from agentrl.trainer.megatron_attention import PackedCoreAttention

        attention.core_attention = PackedCoreAttention  # a fresh spec per call
    block = TransformerBlockSubmodules(
        layer_specs=[spec] * get_num_layers_to_build(config), layer_norm=WrappedTorchNorm
    )
    model = GPTModel(
        config,
        block,
        vocab_size=padded_vocab_size(d.vocab, config.tensor_model_parallel_size, vocab_divisible_by),
        max_sequence_length=d.max_positions,
        pre_process=ps.is_pipeline_first_stage() if pre_process is None else pre_process,
        post_process=ps.is_pipeline_last_stage() if post_process is None else post_process,
        parallel_output=True,
        share_embeddings_and_output_weights=d.tied,
        position_embedding_type="rope",
        rotary_base=d.rope_theta,
    )
    if torch.cuda.is_available():
        model = model.cuda(torch.cuda.current_device())
    return model


def packed_attention_mask(
    lengths_or_position_ids: Sequence[int] | torch.Tensor,
    *,
    seq_len: int | None = None,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """Block-causal mask for packed rows, megatron's convention: bool, True = masked out.

    ``lengths_or_position_ids`` is either a list of sample lengths (one row; a tail up to ``seq_len``
    is padding and forms its own block) or a position-id tensor ``[s]`` / ``[b, s]`` in which every 0
    starts a new sample. Returns ``[b, 1, s, s]``: token t attends to t' iff t' <= t in the same sample.
    """
    if isinstance(lengths_or_position_ids, torch.Tensor):
        pos = lengths_or_position_ids.reshape(-1, lengths_or_position_ids.shape[-1])  # [b, s]
        starts = pos == 0
        starts[:, 0] = True
        segment = starts.long().cumsum(dim=1)  # [b, s]: sample index of each token
    else:
        lengths = [int(n) for n in lengths_or_position_ids]
        total = sum(lengths) if seq_len is None else seq_len
        if sum(lengths) > total or any(n <= 0 for n in lengths):
            raise ValueError(f"sample lengths {lengths} must be positive and sum to at most seq_len={total}")
        segment = torch.repeat_interleave(
            torch.arange(len(lengths) + 1), torch.tensor([*lengths, total - sum(lengths)])
        )[None]
    s = segment.shape[1]
    causal = torch.ones(s, s, dtype=torch.bool, device=segment.device).tril()
    allowed = (segment[:, :, None] == segment[:, None, :]) & causal  # [b, s, s]
    return (~allowed).unsqueeze(1).to(device if device is not None else segment.device)


# -- HF -> megatron ------------------------------------------------------------------------------


def _check_tp(d: _Dims, tp: int) -> None:
    for what, n in (("attention heads", d.heads), ("key/value heads", d.groups), ("intermediate_size", d.ffn)):
        if n % tp:
            raise ValueError(f"{what} ({n}) is not divisible by tensor-parallel size {tp}; choose a tp that divides it")


def _stage_layers(num_layers: int, pp_rank: int, pp_size: int) -> list[int]:
    """HF layer indices of a pipeline stage under megatron's default even split."""
    if num_layers % pp_size:
        raise ValueError(f"{num_layers} layers do not split evenly over {pp_size} pipeline stages; pass layers=")
    per = num_layers // pp_size
    return list(range(pp_rank * per, (pp_rank + 1) * per))


def _fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, d: _Dims) -> torch.Tensor:
    """[H*d, ...], [G*d, ...], [G*d, ...] -> [G*(H/G+2)*d, ...] in megatron's per-group order."""
    rest = q.shape[1:]
    per = d.heads // d.groups
    q = q.reshape(d.groups, per * d.head_dim, *rest)
    k, v = (t.reshape(d.groups, d.head_dim, *rest) for t in (k, v))
    return torch.cat([q, k, v], dim=1).reshape(-1, *rest)


def _split_qkv(fused: torch.Tensor, d: _Dims) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inverse of :func:`_fuse_qkv` (for the full fused tensor, all TP shards concatenated)."""
    rest = fused.shape[1:]
    per = d.heads // d.groups
    g = fused.reshape(d.groups, per + 2, d.head_dim, *rest)
    return (g[:, :per].reshape(-1, *rest), g[:, per].reshape(-1, *rest), g[:, per + 1].reshape(-1, *rest))


def _pad_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    if t.shape[0] > rows:
        raise ValueError(f"vocabulary tensor has {t.shape[0]} rows, more than the model's {rows}")
    return t if t.shape[0] == rows else torch.cat([t, t.new_zeros(rows - t.shape[0], *t.shape[1:])])


def _layer_to_megatron(get: Any, d: _Dims, i: int, local: int, shard: Any) -> dict[str, torch.Tensor]:
    p, m = f"model.layers.{i}.", f"decoder.layers.{local}."
    a = p + "self_attn."

    def qkv(kind: str) -> torch.Tensor:  # fused per query group, then split by groups over TP
        return shard(_fuse_qkv(*(get(a + f"{x}_proj.{kind}") for x in "qkv"), d), 0)

    out = {
        m + "input_layernorm.weight": get(p + "input_layernorm.weight"),
        m + "pre_mlp_layernorm.weight": get(p + "post_attention_layernorm.weight"),
        m + "self_attention.linear_qkv.weight": qkv("weight"),
        m + "self_attention.linear_proj.weight": shard(get(a + "o_proj.weight"), 1),
        # fc1 = [gate; up] on every rank: each of the two is split over TP first
        m + "mlp.linear_fc1.weight": torch.cat(
            [shard(get(p + "mlp.gate_proj.weight"), 0), shard(get(p + "mlp.up_proj.weight"), 0)]
        ),
        m + "mlp.linear_fc2.weight": shard(get(p + "mlp.down_proj.weight"), 1),
    }
    if d.qkv_bias:
        out[m + "self_attention.linear_qkv.bias"] = qkv("bias")
    if d.qk_norm:
        out[m + "self_attention.q_layernorm.weight"] = get(a + "q_norm.weight")
        out[m + "self_attention.k_layernorm.weight"] = get(a + "k_norm.weight")
    return out


def hf_to_megatron(
    hf_state: Mapping[str, torch.Tensor],
    hf_config: Any,
    *,
    tp_rank: int = 0,
    tp_size: int = 1,
    pp_rank: int = 0,
    pp_size: int = 1,
    padded_vocab: int | None = None,
    layers: Sequence[int] | None = None,
) -> dict[str, torch.Tensor]:
    """This rank's GPTModel state dict (no ``_extra_state``) cut from full HF tensors.

    ``layers``: the HF layer indices this pipeline stage holds (default: megatron's even split);
    ``padded_vocab``: the model's vocabulary size (default :func:`padded_vocab_size` with 128).
    ``hf_state`` is only indexed, so a lazy mapping over safetensors files keeps memory to one stage.
    """
    d = _dims(hf_config)
    _check_tp(d, tp_size)
    layers = list(layers) if layers is not None else _stage_layers(d.num_layers, pp_rank, pp_size)
    padded = padded_vocab or padded_vocab_size(d.vocab, tp_size)

    def get(name: str) -> torch.Tensor:
        if name not in hf_state:
            raise ValueError(
                f"the HF checkpoint has no tensor {name!r}; is it a {hf_config.model_type} checkpoint "
                "matching its config.json?"
            )
        return hf_state[name]

    def shard(t: torch.Tensor, dim: int) -> torch.Tensor:
        return t.chunk(tp_size, dim)[tp_rank].contiguous()

    first, last = pp_rank == 0, pp_rank == pp_size - 1
    out: dict[str, torch.Tensor] = {}
    if first:
        out["embedding.word_embeddings.weight"] = shard(_pad_rows(get(EMBED), padded), 0)
    for local, i in enumerate(layers):
        out.update(_layer_to_megatron(get, d, i, local, shard))
    if last:
        out["decoder.final_layernorm.weight"] = get(NORM)
        if not d.tied:
            out["output_layer.weight"] = shard(_pad_rows(get(LM_HEAD), padded), 0)
        elif not first:  # tied and pipelined: the last stage keeps its own copy of the embedding
            out["output_layer.weight"] = shard(_pad_rows(get(EMBED), padded), 0)
    return out


# -- megatron -> HF ------------------------------------------------------------------------------

_REPLICATED = {
    "input_layernorm.weight": "input_layernorm.weight",
    "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
    "self_attention.q_layernorm.weight": "self_attn.q_norm.weight",
    "self_attention.k_layernorm.weight": "self_attn.k_norm.weight",
}
_ROW_PARALLEL = {
    "self_attention.linear_proj.weight": "self_attn.o_proj.weight",
    "mlp.linear_fc2.weight": "mlp.down_proj.weight",
}


def _merge_key(name: str, parts: Sequence[torch.Tensor], d: _Dims, layer_offset: int) -> list[tuple[str, torch.Tensor]]:
    """One megatron tensor, given as its TP shards, as the HF tensor(s) it holds."""
    if name == "embedding.word_embeddings.weight":
        return [(EMBED, torch.cat(list(parts))[: d.vocab])]
    if name == "output_layer.weight":  # tied: the embedding already carries it
        return [] if d.tied else [(LM_HEAD, torch.cat(list(parts))[: d.vocab])]
    if name == "decoder.final_layernorm.weight":
        return [(NORM, parts[0])]
    match = re.fullmatch(r"decoder\.layers\.(\d+)\.(.+)", name)
    if match is None:
        raise ValueError(f"unexpected megatron tensor {name!r}: this converter knows the local GPT spec only")
    p, rest = f"model.layers.{int(match[1]) + layer_offset}.", match[2]
    if rest in _REPLICATED:
        return [(p + _REPLICATED[rest], parts[0])]
    if rest in _ROW_PARALLEL:
        return [(p + _ROW_PARALLEL[rest], torch.cat(list(parts), dim=1))]
    if rest in ("self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias"):
        kind = rest.rsplit(".", 1)[1]
        q, k, v = _split_qkv(torch.cat(list(parts)), d)
        return [(p + f"self_attn.{x}_proj.{kind}", t) for x, t in zip("qkv", (q, k, v))]
    if rest == "mlp.linear_fc1.weight":
        halves = [t.chunk(2) for t in parts]  # each rank: [gate_r; up_r]
        return [
            (p + "mlp.gate_proj.weight", torch.cat([h[0] for h in halves])),
            (p + "mlp.up_proj.weight", torch.cat([h[1] for h in halves])),
        ]
    raise ValueError(f"unexpected megatron tensor {name!r}: this converter knows the local GPT spec only")


def megatron_to_hf(
    shards: Sequence[Mapping[str, torch.Tensor]], hf_config: Any, *, layer_offset: int = 0
) -> dict[str, torch.Tensor]:
    """Full HF tensors from one pipeline stage's TP shards (``shards[r]`` = tp rank r's state dict).

    ``layer_offset`` is the HF index of the stage's first layer (megatron numbers layers per stage).
    ``_extra_state`` entries are ignored, vocabulary padding is stripped, a tied ``lm_head`` is omitted.
    """
    d = _dims(hf_config)
    keys = [k for k in shards[0] if not k.endswith("_extra_state") and shards[0][k] is not None]
    for r, s in enumerate(shards[1:], start=1):
        theirs = [k for k in s if not k.endswith("_extra_state") and s[k] is not None]
        if sorted(theirs) != sorted(keys):
            raise ValueError(
                f"tp rank {r}'s state dict has different keys than rank 0's: {sorted(set(theirs) ^ set(keys))}"
            )
    out: dict[str, torch.Tensor] = {}
    for k in keys:
        out.update(_merge_key(k, [s[k] for s in shards], d, layer_offset))
    return out


def _layer_offset(model: torch.nn.Module) -> int:
    layers = getattr(getattr(model, "decoder", None), "layers", None)
    return layers[0].layer_number - 1 if layers else 0  # layer_number is global and 1-based


def _model_groups(model: torch.nn.Module, tp_group: Any, pp_group: Any) -> tuple[Any, Any]:
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return None, None
    pgs = getattr(model, "pg_collection", None)
    return (
        tp_group if tp_group is not None else getattr(pgs, "tp", None),
        pp_group if pp_group is not None else getattr(pgs, "pp", None),
    )


def iter_hf_weights(
    model: GPTModel,
    hf_config: Any,
    *,
    tp_group: Any = None,
    pp_group: Any = None,
    merge: Callable[[str, torch.Tensor], torch.Tensor] | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(hf_name, full tensor)`` for the whole model, one megatron tensor at a time.

    A collective: every rank of the model-parallel groups (default: the model's own) must iterate it to
    the end, in lockstep. TP shards are all-gathered; with several pipeline stages each stage's tensors
    are broadcast to the others, so every rank yields every tensor (embedding first, lm_head last; a tied
    lm_head is not yielded). Tensors keep the model's dtype and device; at world size 1 they may share
    memory with the parameters, so clone what must outlive the next optimizer step. ``merge(name, local)``, when
    given, replaces each local tensor before it is gathered (a LoRA adapter folds its delta into its shard).
    """
    import torch.distributed as dist

    d = _dims(hf_config)
    tp_group, pp_group = _model_groups(model, tp_group, pp_group)
    tp = dist.get_world_size(tp_group) if tp_group is not None else 1
    pp = dist.get_world_size(pp_group) if pp_group is not None else 1
    state = {k: v for k, v in model.state_dict().items() if not k.endswith("_extra_state") and v is not None}
    offset = _layer_offset(model)

    def merged() -> Iterator[list[tuple[str, torch.Tensor]]]:  # per megatron tensor: its HF tensors
        for name, t in state.items():
            if merge is not None:
                t = merge(name, t)
            parts = [t]
            if tp > 1:
                t = t.contiguous()
                parts = [torch.empty_like(t) for _ in range(tp)]
                dist.all_gather(parts, t, group=tp_group)
            yield _merge_key(name, parts, d, offset)

    if pp == 1:
        for items in merged():
            yield from items
        return
    me = dist.get_rank(pp_group)
    device = next(iter(state.values())).device
    for stage in range(pp):  # stage by stage; the owner broadcasts names+shapes, then the tensors
        src = dist.get_global_rank(pp_group, stage)
        count = [len(state) if me == stage else None]
        dist.broadcast_object_list(count, src=src, group=pp_group)
        owned = merged() if me == stage else None
        for _ in range(count[0]):
            items = next(owned) if owned is not None else None
            meta = [[(n, tuple(t.shape), t.dtype) for n, t in items] if items is not None else None]
            dist.broadcast_object_list(meta, src=src, group=pp_group)
            for j, (n, shape, dtype) in enumerate(meta[0]):
                t = items[j][1].contiguous() if items is not None else torch.empty(shape, dtype=dtype, device=device)
                dist.broadcast(t, src=src, group=pp_group)
                yield n, t


# -- loading a checkpoint ------------------------------------------------------------------------


class _Safetensors(Mapping[str, torch.Tensor]):
    """Lazy read-only view of a safetensors checkpoint (one file, a folder, or an index with shards)."""

    def __init__(self, path: str | Path) -> None:
        from safetensors import safe_open

        path = Path(path)
        index = path / "model.safetensors.index.json"
        if path.is_file():
            files = {path}
        elif index.is_file():
            files = {path / f for f in json.loads(index.read_text())["weight_map"].values()}
        else:
            files = set(path.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(
                f"no safetensors weights at {path}; give an HF checkpoint folder saved with "
                "save_pretrained(safe_serialization=True) or a .safetensors file"
            )
        self._where = {}
        for f in sorted(files):
            handle = safe_open(str(f), framework="pt")
            self._where.update({k: handle for k in handle.keys()})
        self.used: set[str] = set()

    def __contains__(self, name: object) -> bool:
        return name in self._where

    def __getitem__(self, name: str) -> torch.Tensor:
        tensor = self._where[name].get_tensor(name)
        self.used.add(name)
        return tensor

    def __iter__(self) -> Iterator[str]:
        return iter(self._where)

    def __len__(self) -> int:
        return len(self._where)


def _unused_for_stage(reader: _Safetensors, d: _Dims, layers: Sequence[int]) -> list[str]:
    """Checkpoint tensors this stage should have consumed but did not (e.g. biases we cannot map)."""
    unused = []
    for k in sorted(set(reader) - reader.used):
        layer = re.match(r"model\.layers\.(\d+)\.", k)
        if k.endswith("rotary_emb.inv_freq") or (layer is None and k in (EMBED, NORM, LM_HEAD)):
            continue  # a recomputed buffer, or a tensor another stage (or the tied embedding) holds
        if layer is None or int(layer[1]) in layers:
            unused.append(k)
    return unused


def load_hf_checkpoint(
    model: GPTModel,
    path: str | Path,
    hf_config: Any,
    *,
    tp_rank: int = 0,
    tp_size: int = 1,
    pp_rank: int = 0,
    pp_size: int = 1,
) -> None:
    """Fill ``model`` (this rank's shard) from an HF safetensors checkpoint, strictly.

    Every model tensor must come from the checkpoint and every checkpoint tensor of this stage must be
    used; otherwise a ValueError names the keys. Megatron's ``_extra_state`` entries are ignored.
    """
    d = _dims(hf_config)
    reader = _Safetensors(path)
    layers = [layer.layer_number - 1 for layer in getattr(getattr(model, "decoder", None), "layers", [])]
    shard = hf_to_megatron(
        reader,
        hf_config,
        tp_rank=tp_rank,
        tp_size=tp_size,
        pp_rank=pp_rank,
        pp_size=pp_size,
        padded_vocab=model.vocab_size,
        layers=layers,
    )
    expected = {k: v for k, v in model.state_dict().items() if not k.endswith("_extra_state")}
    missing, unexpected = sorted(set(expected) - set(shard)), sorted(set(shard) - set(expected))
    if missing or unexpected:
        raise ValueError(
            f"checkpoint {path} does not fit the megatron model (pp_rank={pp_rank}/{pp_size}, "
            f"tp_rank={tp_rank}/{tp_size}): missing {missing}, unexpected {unexpected}"
        )
    wrong = [
        f"{k}: {tuple(shard[k].shape)} vs {tuple(v.shape)}" for k, v in expected.items() if shard[k].shape != v.shape
    ]
    unused = _unused_for_stage(reader, d, layers)
    if wrong or unused:
        raise ValueError(
            f"checkpoint {path} does not fit the megatron model: shape mismatches {wrong}, "
            f"tensors this converter cannot place {unused}"
        )
    with torch.no_grad():
        for k, v in expected.items():
            v.copy_(shard[k])


def resolve_megatron_checkpoint(path: str | Path) -> Path:
    """The megatron-core distributed checkpoint folder ``path`` names (``--initial-megatron-checkpoint``).

    Either the folder itself (``metadata.json`` written by ``megatron.core.dist_checkpointing.save``) or a
    Megatron-LM save folder: its ``latest_checkpointed_iteration.txt`` names ``iter_NNNNNNN`` (or ``release``).
    Only the ``torch_dist`` format is read (megatron-core deprecated zarr); anything else is refused, saying why.
    """
    root = Path(path)
    found = root
    tracker = root / "latest_checkpointed_iteration.txt"
    if not (root / "metadata.json").is_file() and tracker.is_file():
        text = tracker.read_text().strip()
        found = (
            root / ("release" if text == "release" else f"iter_{int(text):07d}")
            if text.isdigit() or text == "release"
            else root
        )
    meta = found / "metadata.json"
    if not meta.is_file():
        raise ValueError(
            f"{path} is not a megatron-core distributed checkpoint (no metadata.json, nor a "
            "latest_checkpointed_iteration.txt naming one): pass the folder megatron saved with --ckpt-format torch_dist"
        )
    backend = json.loads(meta.read_text()).get("sharded_backend")
    if backend != "torch_dist":
        raise ValueError(f"{found}: a {backend!r} checkpoint; the installed megatron-core reads torch_dist here")
    return found


def load_megatron_checkpoint(model: Any, path: str | Path) -> None:
    """Load this rank's shard of ``model`` from a megatron-core distributed checkpoint (Megatron-LM's layout:
    the model's sharded state dict under ``"model"``). A collective over the model's ranks.

    The sharded keys are megatron's (layers stacked, Transformer Engine names such as
    ``self_attention.linear_qkv.layer_norm_weight``: the local spec maps its norms onto them), so a
    checkpoint written by Megatron-LM or slime's converter for the same architecture loads into the local-spec
    model built from the HF config. A mismatch (another architecture, parallel layout megatron cannot reshard)
    is refused with megatron's reason.
    """
    from megatron.core import dist_checkpointing
    from torch.distributed.checkpoint.api import CheckpointException

    folder = resolve_megatron_checkpoint(path)
    try:
        loaded = dist_checkpointing.load({"model": model.sharded_state_dict()}, str(folder))
        model.load_state_dict(loaded["model"], strict=True)
    except (Exception, CheckpointException) as exc:  # megatron's and torch's (a BaseException): which, and why
        raise ValueError(
            f"{folder} could not be loaded into the model built from --hf-checkpoint's config (another architecture "
            f"or layout, or an unreadable file): {type(exc).__name__}: {exc}"
        ) from exc
