"""The embedded engine's KV cache, prefix store, and the forward pass that writes into them.

Why not ``model(input_ids, past_key_values=DynamicCache())``: HF's dynamic cache ``torch.cat``s the
new keys onto the old ones every step, an O(L) copy per layer per token, and its masks assume one
shared length per batch. Here every running request owns one *row* of preallocated buffers

    k[layer], v[layer]: [rows, kv_heads, capacity, head_dim]

and each step writes the new keys in place at the request's own position. Running requests occupy
rows ``0..B-1`` (the scheduler compacts the rows when one leaves), so a decode step attends over the
view ``k[layer][:B, :, :L]`` without gathering anything; a boolean mask hides each row's unused tail.

We run the decoder layers ourselves, calling the checkpoint's own modules (norms, projections,
rotary embedding, MLP), so any Llama-shaped model works: Llama/SmolLM2, Qwen2 (q/k/v biases),
Qwen3 (q/k norms), Mistral. Grouped-query attention is done without copying keys: the G query heads
that share one kv head are laid out along the sequence axis, ``q: [n, kv_heads, G*T, head_dim]``.

``PrefixStore`` keeps finished sequences' keys/values (compact copies, LRU) so that a later request
sharing a token prefix (the next turn of a multi-turn episode, or a sibling sample of a GRPO group)
only prefills what is new.
"""

from __future__ import annotations

import sys
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F


def common_prefix_len(a: np.ndarray, b: np.ndarray) -> int:
    """Length of the longest common prefix of two 1-D int arrays."""
    n = min(len(a), len(b))
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if len(diff) else n


class SlotKVCache:
    """Per-layer key/value buffers ``[rows, kv_heads, capacity, head_dim]``; capacity doubles on demand."""

    def __init__(
        self,
        num_layers: int,
        rows: int,
        kv_heads: int,
        head_dim: int,
        *,
        max_capacity: int,
        dtype: torch.dtype,
        device: torch.device,
        initial_capacity: int = 256,
    ):
        self.max_capacity = max_capacity
        self.capacity = min(initial_capacity, max_capacity)
        shape = (rows, kv_heads, self.capacity, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]

    def ensure(self, length: int) -> None:
        """Grow every buffer (doubling, at most ``max_capacity``) so ``length`` positions fit."""
        if length <= self.capacity:
            return
        cap = self.capacity
        while cap < length:
            cap *= 2
        cap = max(min(cap, self.max_capacity), length)
        for bufs in (self.k, self.v):
            for i, old in enumerate(bufs):
                new = old.new_zeros(old.shape[0], old.shape[1], cap, old.shape[3])
                new[:, :, : self.capacity] = old
                bufs[i] = new
        self.capacity = cap

    def copy_row(self, src: int, dst: int, length: int) -> None:
        """Copy the first ``length`` positions of row ``src`` into row ``dst``."""
        if src == dst or length <= 0:
            return
        for bufs in (self.k, self.v):
            for buf in bufs:
                buf[dst, :, :length] = buf[src, :, :length]

    def extract(self, row: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Compact copies ``[layers, kv_heads, length, head_dim]`` of one row's keys and values."""
        k = torch.stack([buf[row, :, :length] for buf in self.k])
        v = torch.stack([buf[row, :, :length] for buf in self.v])
        return k, v

    def load(self, row: int, k: torch.Tensor, v: torch.Tensor, length: int) -> None:
        """Write the first ``length`` positions of an extracted ``(k, v)`` pair into ``row``."""
        self.ensure(length)
        for i in range(len(self.k)):
            self.k[i][row, :, :length] = k[i, :, :length]
            self.v[i][row, :, :length] = v[i, :, :length]


@dataclass
class CachedSequence:
    """A finished sequence kept for prefix reuse: its tokens and their keys/values."""

    tokens: np.ndarray  # [L] int64: the tokens whose KV is stored
    k: torch.Tensor  # [layers, kv_heads, L, head_dim]
    v: torch.Tensor
    tag: int = 0  # the LoRA adapter load the KV was computed under (0: none); a prefix is reused under its tag only


class PrefixStore:
    """LRU store of finished sequences' KV, looked up by longest common token prefix under the same ``tag``
    (keys and values computed with one LoRA adapter are another model's: never shared across adapters)."""

    def __init__(self, max_sequences: int):
        self.max_sequences = max_sequences
        self._entries: OrderedDict[int, CachedSequence] = OrderedDict()
        self._next_key = 0

    def __len__(self) -> int:
        return len(self._entries)

    def clear(self) -> None:
        self._entries.clear()

    def insert(self, seq: CachedSequence) -> None:
        """Add ``seq``, dropping entries it extends (a conversation keeps one entry), then LRU-evict."""
        if self.max_sequences <= 0 or len(seq.tokens) == 0:
            return
        for key in [
            k
            for k, e in self._entries.items()
            if e.tag == seq.tag
            and len(e.tokens) <= len(seq.tokens)
            and common_prefix_len(e.tokens, seq.tokens) == len(e.tokens)
        ]:
            del self._entries[key]
        self._entries[self._next_key] = seq
        self._next_key += 1
        while len(self._entries) > self.max_sequences:
            self._entries.popitem(last=False)

    def drop(self, tag: int) -> None:
        """Forget every entry computed under ``tag`` (an adapter that was unloaded)."""
        for key in [k for k, e in self._entries.items() if e.tag == tag]:
            del self._entries[key]

    def best_match(self, tokens: np.ndarray, tag: int = 0) -> tuple[CachedSequence | None, int]:
        """The entry of ``tag`` sharing the longest prefix with ``tokens`` and that length (marks it recently used)."""
        best, best_len, best_key = None, 0, None
        for key, e in self._entries.items():
            if e.tag != tag:
                continue
            n = common_prefix_len(e.tokens, tokens)
            if n > best_len:
                best, best_len, best_key = e, n, key
        if best_key is not None:
            self._entries.move_to_end(best_key)
        return best, best_len


class CachedForward:
    """Runs a Llama-shaped HF causal LM over :class:`SlotKVCache` rows.

    ``forward(ids, rows, start, last)`` feeds ``ids: [n, T]`` (right-padded) for rows ``rows`` whose
    first token sits at position ``start[i]``; it writes their keys/values in place and returns the
    fp32 logits ``[n, vocab]`` at token index ``last[i]`` of each row (lm_head runs on those only).
    """

    def __init__(self, model: torch.nn.Module, *, rows: int, max_capacity: int, body: torch.nn.Module | None = None):
        """``body``: the decoder stack (embeddings, layers, norm, rotary); default ``model.model`` (a VLM
        passes its text model)."""
        cfg = getattr(body, "config", None) or model.config
        self.model = model
        self.body = body if body is not None else model.model
        self.layers = list(self.body.layers)
        attn = self.layers[0].self_attn
        for name in ("q_proj", "k_proj", "v_proj", "o_proj", "scaling"):
            if not hasattr(attn, name):
                raise ValueError(f"unsupported architecture {type(model).__name__}: attention has no {name!r}")
        self.apply_rope = sys.modules[type(attn).__module__].apply_rotary_pos_emb
        self.heads = cfg.num_attention_heads
        self.kv_heads = getattr(cfg, "num_key_value_heads", None) or self.heads
        self.head_dim = getattr(attn, "head_dim", None) or cfg.hidden_size // self.heads
        self.groups = self.heads // self.kv_heads
        p = next(model.parameters())
        self.cache = SlotKVCache(
            len(self.layers),
            rows,
            self.kv_heads,
            self.head_dim,
            max_capacity=max_capacity,
            dtype=p.dtype,
            device=p.device,
        )
        self.device = p.device
        self._compiled: Any = None  # compile_decode(): the compiled decode step
        self.compile_max_bs = 0
        self.compiled_steps = 0  # decode steps served by the compiled graph (reported by /get_server_info)

    def forward(
        self,
        ids: torch.Tensor,
        rows: slice | torch.Tensor,
        start: torch.Tensor,
        last: torch.Tensor,
        inject: list[tuple[int, torch.Tensor, torch.Tensor]] | None = None,
    ) -> torch.Tensor:
        """``inject``: ``(i, t, rows)`` replaces the embeddings of row ``i`` at token indices ``t`` with
        ``rows`` (image features at their placeholders; ``ids`` there may be anything >= 0)."""
        n, T = ids.shape
        L = int(start.max()) + T
        # compiled: one token for each of rows 0..n-1 (``last`` is then 0, the only index there is)
        decode = self._compiled is not None and T == 1 and inject is None and isinstance(rows, slice)
        if decode and rows.start in (0, None) and rows.stop == n and 2 <= n <= self.compile_max_bs:
            self.compiled_steps += 1
            # one spare position, so the compiled graph never meets a view as long as its buffer (L == capacity
            # would be a shape case of its own: a recompile mid-run)
            self.cache.ensure(L + 1)
            return self._compiled(ids, start, L, self.cache.k, self.cache.v)
        self.cache.ensure(L)
        return self._layers(ids, rows, start, L, last, inject, self.cache.k, self.cache.v)

    def compile_decode(self, max_bs: int) -> None:
        """Run decode steps of 2..``max_bs`` rows through ``torch.compile`` (SGLang's ``--enable-torch-compile``).

        Inductor fuses every op outside the matmuls (norms, rotary, SiLU, residual adds, KV writes) and
        drops the Python that dispatches them: up to ~10% of a SmolLM2 decode step on CPU
        (``bench/p3_fusion_headroom.py``). The graphs are dynamic in batch, context and the buffers' capacity
        and compiled here, before the first request: one for a full batch, one for any smaller one. Torch
        traces sizes that happen to be equal as one symbol (and a model dimension pins it), so the warm-up
        sizes are picked unlike every other size in play; where no such size exists, one graph for every
        batch is traced with that sharing off (as general, slower to compile). A single row (a size torch always
        specializes) stays eager, so nothing recompiles while serving. Prefill and picture-bearing forwards
        stay eager (their shapes vary far more).
        """
        from torch.fx.experimental import _config as shape_config

        rows = self.cache.k[0].shape[0]
        n = min(int(max_bs), rows)
        if n < 2:
            raise ValueError(f"a compiled decode step serves batches of 2 or more rows; at most {n} run at once here")
        self.compile_max_bs = int(max_bs)
        self._compiled = torch.compile(self._decode, dynamic=True)
        dims = {0, 1, rows, self.kv_heads, self.head_dim}
        L = next(x for x in range(37, 10**6) if x not in dims)  # the warm-up's context
        with torch.inference_mode():
            # the engine grows and re-creates its buffers inside inference mode, and the compiled graph's guards
            # tell such tensors from ordinary ones: start with buffers of that kind, or the first growth recompiles
            self.cache.k = [b.clone() for b in self.cache.k]
            self.cache.v = [b.clone() for b in self.cache.v]
            self.cache.ensure(L + 1)
            while self.cache.capacity in dims | {L} and self.cache.capacity < self.cache.max_capacity:
                self.cache.ensure(self.cache.capacity + 1)
            cap = self.cache.capacity
            smaller = next((m for m in range(n - 1, 1, -1) if m not in dims | {L, cap}), None)
            if cap in dims | {L} or (smaller is None and n > 2):  # no size to spare: one graph, sharing off
                warm = [(n, False)]
            else:  # a full batch (its size is the buffers' rows), then any smaller one
                warm = [(n, True)] + ([(smaller, True)] if smaller is not None else [])
            for m, duck in warm:
                ids = torch.zeros(m, 1, dtype=torch.long, device=self.device)
                start = torch.full((m,), L - 1, dtype=torch.long, device=self.device)
                with shape_config.patch(use_duck_shape=duck):
                    self.forward(ids, slice(0, m), start, ids[:, 0])

    def _decode(
        self, ids: torch.Tensor, start: torch.Tensor, L: int, ks: list[torch.Tensor], vs: list[torch.Tensor]
    ) -> torch.Tensor:
        """One decode step of rows ``0..n-1`` (what :meth:`compile_decode` compiles)."""
        return self._layers(ids, slice(0, ids.shape[0]), start, L, None, None, ks, vs)

    def _layers(
        self,
        ids: torch.Tensor,
        rows: slice | torch.Tensor,
        start: torch.Tensor,
        L: int,
        last: torch.Tensor | None,
        inject: list[tuple[int, torch.Tensor, torch.Tensor]] | None,
        ks: list[torch.Tensor],
        vs: list[torch.Tensor],
    ) -> torch.Tensor:
        """The decoder stack over the KV buffers ``ks``/``vs`` (``last`` None: one token per row)."""
        n, T = ids.shape
        G, KV, H, D = self.groups, self.kv_heads, self.heads, self.head_dim
        pos = start[:, None] + torch.arange(T, device=self.device)[None, :]  # [n, T]
        row_idx = torch.arange(rows.start or 0, rows.stop, device=self.device) if isinstance(rows, slice) else rows
        # mask[i, t, j]: query t of row i may see key position j (causal from its own position).
        mask = torch.arange(L, device=self.device)[None, None, :] <= pos[:, :, None]  # [n, T, L]
        if T > 1 and G > 1:
            mask = mask[:, None, None].expand(n, 1, G, T, L).reshape(n, 1, G * T, L)
        else:
            mask = mask[:, None]  # [n, 1, T, L], broadcast over the G query heads when T == 1
        cap = ks[0].shape[2]
        # Flat row index of (row, kv_head, position) in a buffer viewed as [rows * KV * cap, D]: [n*KV*T]
        flat = (
            (row_idx[:, None, None] * KV + torch.arange(KV, device=self.device)[None, :, None]) * cap + pos[:, None, :]
        ).reshape(-1)
        h = self.body.embed_tokens(ids)  # [n, T, hidden]
        for i, t, feats in inject or ():
            h[i, t] = feats.to(h.dtype)
        cos, sin = self.body.rotary_emb(h, pos)
        for i, layer in enumerate(self.layers):
            a = layer.self_attn
            x = layer.input_layernorm(h)
            q = a.q_proj(x).view(n, T, H, D)
            k = a.k_proj(x).view(n, T, KV, D)
            v = a.v_proj(x).view(n, T, KV, D)
            if hasattr(a, "q_norm"):
                q, k = a.q_norm(q), a.k_norm(k)
            q, k = self.apply_rope(q.transpose(1, 2), k.transpose(1, 2), cos, sin)  # [n, H|KV, T, D]
            kb, vb = ks[i], vs[i]
            kb.view(-1, D).index_copy_(0, flat, k.reshape(-1, D).to(kb.dtype))  # in-place write
            vb.view(-1, D).index_copy_(0, flat, v.transpose(1, 2).reshape(-1, D).to(vb.dtype))
            keys = kb[rows, :, :L] if isinstance(rows, slice) else kb[row_idx, :, :L]  # [n, KV, L, D]
            vals = vb[rows, :, :L] if isinstance(rows, slice) else vb[row_idx, :, :L]
            qg = q.reshape(n, KV, G * T, D)  # query heads of one kv group laid along the sequence axis
            o = F.scaled_dot_product_attention(qg, keys, vals, attn_mask=mask, scale=a.scaling)
            o = o.view(n, KV, G, T, D).reshape(n, H, T, D).transpose(1, 2).reshape(n, T, H * D)
            h = h + a.o_proj(o)
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        h = self.body.norm(h[:, -1] if last is None else h[torch.arange(n, device=self.device), last])  # [n, hidden]
        return self.model.lm_head(h).float()  # [n, vocab]
