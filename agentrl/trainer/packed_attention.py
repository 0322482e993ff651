"""Attention over a packed row, one sample at a time: no T x T work across samples.

A packed micro-batch is one row holding several samples back to back. Masking them apart with a
block-diagonal mask is correct, but CPU SDPA still computes every score of the T x T matrix, masked
ones included, so a 4k-token row of 400-token samples pays ten times the attention it needs. This
attention function (registered with transformers as ``"agentrl_packed"``) runs causal SDPA on each
sample's slice of the row instead, which is what flash-attention's ``cu_seqlens`` does on GPUs.

The trainer announces the row's segments with :func:`segments` around each forward; outside that
context the function falls back to transformers' own SDPA path, so a model switched to it still
works anywhere else (generation, evaluation).
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F

NAME = "agentrl_packed"
_SEGMENTS: contextvars.ContextVar[list[tuple[int, int]] | None] = contextvars.ContextVar(
    "agentrl_segments", default=None
)


@contextlib.contextmanager
def segments(position_ids: torch.Tensor) -> Iterator[None]:
    """Within this block, attention treats each run of restarting positions as its own sequence."""
    pos = position_ids.reshape(-1)
    starts = (pos == 0).nonzero().flatten().tolist()
    if not starts or starts[0] != 0:
        starts = [0, *starts]
    bounds = list(zip(starts, starts[1:] + [pos.numel()]))
    token = _SEGMENTS.set(bounds)
    try:
        yield
    finally:
        _SEGMENTS.reset(token)


@contextlib.contextmanager
def no_segments() -> Iterator[None]:
    """Within this block attention is plain SDPA again (a vision tower's patches are not the row's samples)."""
    token = _SEGMENTS.set(None)
    try:
        yield
    finally:
        _SEGMENTS.reset(token)


def packed_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention signature: q [1, H, T, D], k/v [1, Hkv, T, D] -> ([1, T, H, D], None)."""
    bounds = _SEGMENTS.get()
    if bounds is None or query.shape[0] != 1:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    rep = query.shape[1] // key.shape[1]
    p = dropout if module.training else 0.0
    outs = []
    for s, e in bounds:
        k, v = key[:, :, s:e], value[:, :, s:e]
        if rep > 1:  # grouped-query attention: each kv head serves `rep` query heads
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        outs.append(F.scaled_dot_product_attention(query[:, :, s:e], k, v, is_causal=True, dropout_p=p, scale=scaling))
    return torch.cat(outs, dim=2).transpose(1, 2).contiguous(), None


def enable(model: torch.nn.Module) -> bool:
    """Switch ``model`` to per-sample attention; False if this transformers version cannot."""
    try:
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

        AttentionInterface.register(NAME, packed_attention)
        # the usual SDPA mask, so the fallback path (no segments announced) stays exactly SDPA
        AttentionMaskInterface.register(NAME, sdpa_mask)
        model.set_attn_implementation(NAME)
    except Exception:  # noqa: BLE001 - older transformers or a model that refuses: keep SDPA + mask
        return False
    return True
