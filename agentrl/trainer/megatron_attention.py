"""Megatron core attention over a packed row, one sample at a time: no T x T work across samples.

The megatron trainer packs several samples into one row (:mod:`agentrl.trainer.batching`). Megatron's
local ``DotProductAttention`` can only keep them apart with a block-causal ``[1, 1, T, T]`` mask, and
it materializes every one of the T x T scores, masked ones included: a 4k-token row of 400-token
samples pays ten times the attention it needs, and on a GPU the score memory grows with T^2.
:class:`PackedCoreAttention` is a drop-in ``core_attention`` for megatron's layer spec that runs causal
``scaled_dot_product_attention`` on each sample's slice of the row instead, which is what
flash-attention's ``cu_seqlens`` does (the torch backend does the same in
:mod:`agentrl.trainer.packed_attention`).

Where the sample boundaries come from: megatron's own ``PackedSeqParams``, built by
:func:`packed_seq_params` and passed as ``model(..., packed_seq_params=...)``, not a context variable.
Megatron hands that object through every layer to ``core_attention``, including when it re-runs a
layer's forward during backward (``recompute_granularity`` full or selective): a context variable
set around the forward would be gone by then and the recomputed attention would silently see one
sequence. With ``qkv_format="sbhd"`` nothing else in megatron 0.16 reacts to the params: the tensors
keep their ``[s, b, ...]`` layout and RoPE is applied as without them, for positions 0..T-1 of the
row (``max_seqlen_*`` must therefore be T: megatron sizes the rotary table by it). RoPE is relative,
so inside one sample that is exact.

Without params the module is plain attention over the whole row: causal when no mask is given,
the given mask otherwise (True = masked out, and the mask replaces causality, as in megatron's torch
softmax path), so forwards without packing (tests, :func:`~agentrl.trainer.megatron_model.
packed_attention_mask`) behave as with ``DotProductAttention``.
"""

from __future__ import annotations

import contextlib
import math
from typing import Any

import torch
import torch.nn.functional as F
from megatron.core import tensor_parallel
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.utils import is_layer_window_attention

_SDPA_HAS_GQA = torch.torch_version.TorchVersion(torch.__version__) >= (2, 5)  # SDPA's enable_gqa


def packed_seq_params(position_ids: torch.Tensor) -> PackedSeqParams:
    """Segments of a packed row (``[T]`` or ``[1, T]`` positions, restarting at 0 per sample) for megatron.

    ``cu_seqlens`` ``[k + 1]`` int32 = sample starts plus T, kept on the CPU: the attention reads the
    boundaries as Python ints in every layer, and a CPU tensor costs no device synchronisation.
    """
    pos = position_ids.reshape(-1)
    total = pos.numel()
    starts = (pos == 0).nonzero().flatten().cpu().tolist()
    if not starts or starts[0] != 0:
        starts = [0, *starts]
    cu = torch.tensor([*starts, total], dtype=torch.int32)
    return PackedSeqParams(
        qkv_format="sbhd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=total, max_seqlen_kv=total
    )


def segment_bounds(params: PackedSeqParams, seq_len: int) -> list[tuple[int, int]]:
    """``[(start, end), ...]`` covering ``0..seq_len``; a tail after the last sample is its own segment."""
    if params.qkv_format != "sbhd":
        raise ValueError(
            f"PackedCoreAttention takes packed rows in 'sbhd' layout, got qkv_format="
            f"{params.qkv_format!r}; build the params with megatron_attention.packed_seq_params"
        )
    cu = params.cu_seqlens_q.tolist()
    if (
        params.cu_seqlens_kv is not None
        and params.cu_seqlens_kv is not params.cu_seqlens_q
        and params.cu_seqlens_kv.tolist() != cu
    ):
        raise NotImplementedError(
            "PackedCoreAttention is self-attention over one packed row: cu_seqlens_kv must equal cu_seqlens_q"
        )
    if not cu or cu[0] != 0 or cu[-1] > seq_len or any(b <= a for a, b in zip(cu, cu[1:])):
        raise ValueError(f"cu_seqlens {cu} must rise strictly from 0 to at most the row length {seq_len}")
    if cu[-1] < seq_len:
        cu = [*cu, seq_len]
    return list(zip(cu, cu[1:]))


class PackedCoreAttention(MegatronModule):
    """``core_attention`` for megatron's GPT layer spec: per-sample causal SDPA inside a packed row.

    The constructor is the one megatron 0.16 calls for ``SelfAttentionSubmodules.core_attention``
    (``DotProductAttention``'s); ``forward`` takes and returns what ``DotProductAttention.forward`` does:
    query ``[sq, b, np, hn]``, key/value ``[sk, b, ng, hn]`` (ng query groups per TP rank, ng divides
    np) -> context ``[sq, b, np * hn]``. With ``b > 1`` every row is cut at the same boundaries.
    """

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        cp_comm_type: str | None = None,
        pg_collection: Any = None,
    ):
        super().__init__(config=config)
        if config.context_parallel_size != 1:
            raise NotImplementedError(
                "PackedCoreAttention does not split sequences over context-parallel ranks; use context_parallel_size 1"
            )
        if config.softmax_type != "vanilla":
            raise NotImplementedError(
                f"softmax_type={config.softmax_type!r} (softmax offsets) is not supported by "
                "PackedCoreAttention; build the model with packed_attention=False"
            )
        if is_layer_window_attention(config.window_size, config.window_attn_skip_freq, layer_number):
            raise NotImplementedError(
                "sliding-window attention is not supported by PackedCoreAttention; build the "
                "model with packed_attention=False"
            )
        self.layer_number = max(1, layer_number)
        self.attn_mask_type = attn_mask_type
        self.attention_type = attention_type
        # DotProductAttention divides this scale by layer_number under apply_query_key_layer_scaling and its
        # softmax multiplies the scores back by layer_number (in fp32): the net scale is this one.
        self.softmax_scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(config.kv_channels)
        self.dropout_p = config.attention_dropout if attention_dropout is None else attention_dropout

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        attn_mask_type: AttnMaskType | None = None,
        attention_bias: torch.Tensor | None = None,
        packed_seq_params: PackedSeqParams | None = None,
    ) -> torch.Tensor:
        """Attention of ``query`` over ``key``/``value``, per sample of ``packed_seq_params`` when given."""
        if attention_bias is not None:
            raise NotImplementedError("attention_bias is not supported by PackedCoreAttention")
        sq, b, heads, hn = query.shape
        sk = key.shape[0]
        causal = (attn_mask_type or self.attn_mask_type) == AttnMaskType.causal and attention_mask is None
        if causal and sq > 1 and sq != sk:
            raise NotImplementedError(
                f"causal attention of {sq} queries over {sk} keys (a KV cache) is not "
                "supported by PackedCoreAttention; it trains on whole rows"
            )
        causal = causal and sq > 1  # one query attends to every key, as in megatron's softmax
        # [s, b, n, hn] -> [b, n, s, hn]; grouped-query attention: each kv group serves heads / ng query heads
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        sdpa_kw: dict[str, Any] = {}
        if heads != k.shape[1]:
            if q.device.type == "cpu" and _SDPA_HAS_GQA:
                sdpa_kw["enable_gqa"] = True  # CPU: ~25% faster than expanding k/v (and no copy)
            else:  # every CUDA SDPA kernel (flash, memory-efficient) takes expanded heads
                k, v = (t.repeat_interleave(heads // k.shape[1], dim=1) for t in (k, v))
        p = self.dropout_p if self.training else 0.0
        # dropout draws from megatron's model-parallel RNG stream, as in DotProductAttention
        rng = (
            tensor_parallel.get_cuda_rng_tracker().fork()
            if p > 0 and not self.config.sequence_parallel
            else contextlib.nullcontext()
        )
        with rng:
            if packed_seq_params is None:
                mask = None if attention_mask is None else ~attention_mask  # SDPA: True = may attend
                out = F.scaled_dot_product_attention(
                    q, k, v, attn_mask=mask, dropout_p=p, is_causal=causal, scale=self.softmax_scale, **sdpa_kw
                )
            elif attention_mask is not None:
                raise ValueError("give PackedCoreAttention either packed_seq_params or an attention mask, not both")
            else:
                out = self._per_sample(q, k, v, segment_bounds(packed_seq_params, sq), causal, p, sdpa_kw)
        return out.permute(2, 0, 1, 3).reshape(sq, b, heads * hn)  # [b, n, s, hn] -> [s, b, n * hn]

    def _per_sample(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        bounds: list[tuple[int, int]],
        causal: bool,
        dropout_p: float,
        sdpa_kw: dict[str, Any],
    ) -> torch.Tensor:
        """SDPA on each segment of ``[b, n, s, hn]`` tensors, equal-length segments stacked into one call."""
        b = q.shape[0]
        by_length: dict[int, list[int]] = {}
        for i, (s, e) in enumerate(bounds):
            by_length.setdefault(e - s, []).append(i)
        outs: list[torch.Tensor | None] = [None] * len(bounds)
        for length, idx in by_length.items():
            starts = [bounds[i][0] for i in idx]

            def take(t: torch.Tensor, starts: list[int] = starts, length: int = length) -> torch.Tensor:
                # -> [len(idx) * b, n, length, hn]
                if len(starts) == 1:
                    return t[:, :, starts[0] : starts[0] + length]
                return torch.cat([t[:, :, s : s + length] for s in starts])

            out = F.scaled_dot_product_attention(
                take(q), take(k), take(v), dropout_p=dropout_p, is_causal=causal, scale=self.softmax_scale, **sdpa_kw
            )
            for i, chunk in zip(idx, out.split(b)):
                outs[i] = chunk
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)  # type: ignore[arg-type]


__all__ = ["PackedCoreAttention", "packed_seq_params", "segment_bounds"]
