"""Log-probs and entropy of target tokens straight from hidden states, ``chunk`` rows of logits at a time.

Why: a packed micro-batch of ``N`` response tokens over a vocabulary of ``V`` builds ``[N, V]``
logits, then their log-softmax and entropy temporaries, and autograd keeps the logits for the
backward pass. For SmolLM2 (V = 49,152) and N ≈ 1,900 that is ~0.4 GB per copy and several copies
at once: the largest single item of the trainer's peak memory after the weights. Here the LM head
runs ``chunk`` rows at a time inside one autograd function; only ``[N]`` log-probs, entropies and
log-sum-exps are kept, and the backward pass recomputes each chunk's logits (one extra head matmul,
cheap beside the decoder) to form ``d loss / d logits`` and push it into the hidden states and the
head weight. TRL's fused LM head and Liger's fused linear cross-entropy do the same for SFT.

Only a *plain* head qualifies (``logits = hidden @ W.T (+ b)``, no soft-capping or logit scale):
:func:`head_is_plain` checks that numerically on the model itself, so a model that does anything else
keeps the ordinary path.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


class _ChunkedHead(torch.autograd.Function):
    """``(hidden [N, H], weight [V, H], bias [V] | None, targets [N])`` -> ``(logp [N], entropy [N])``."""

    @staticmethod
    def forward(ctx: Any, hidden, weight, bias, targets, temperature: float, chunk: int, with_entropy: bool):  # type: ignore[override]
        n = hidden.shape[0]
        logp = hidden.new_empty(n, dtype=torch.float32)
        entropy = hidden.new_zeros(n if with_entropy else 0, dtype=torch.float32)
        lse = hidden.new_empty(n, dtype=torch.float32)
        w = weight.to(hidden.dtype)
        b = bias.to(hidden.dtype) if bias is not None else None
        for s in range(0, n, chunk):
            z = _chunk_logits(hidden[s : s + chunk], w, b, temperature)
            c_lse = torch.logsumexp(z, dim=-1)
            lse[s : s + chunk] = c_lse
            logp[s : s + chunk] = z.gather(1, targets[s : s + chunk, None])[:, 0] - c_lse
            if with_entropy:
                entropy[s : s + chunk] = c_lse - (torch.exp(z - c_lse[:, None]) * z).sum(-1)
        ctx.save_for_backward(hidden, weight, bias, targets, lse, entropy)
        ctx.temperature, ctx.chunk = temperature, chunk
        # the backward pass recomputes the logits exactly as the forward made them: under the same
        # autocast (bf16 on GPU), so p = exp(z - lse) is the distribution the log-probs came from
        dev = hidden.device.type
        ctx.autocast = (dev, torch.is_autocast_enabled(dev), torch.get_autocast_dtype(dev))
        ctx.set_materialize_grads(False)  # an unused output (entropy as a metric only) costs no backward work
        return logp, entropy

    @staticmethod
    def backward(ctx: Any, g_logp, g_entropy):  # type: ignore[override]
        dev, enabled, dtype = ctx.autocast
        with torch.autocast(dev, dtype=dtype, enabled=enabled):
            return _ChunkedHead._backward(ctx, g_logp, g_entropy)

    @staticmethod
    def _backward(ctx: Any, g_logp, g_entropy):
        hidden, weight, bias, targets, lse, entropy = ctx.saved_tensors
        t, chunk = ctx.temperature, ctx.chunk
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        if entropy.numel() == 0:
            g_entropy = None  # not computed, so nothing can depend on it
        w = weight.to(hidden.dtype)
        b = bias.to(hidden.dtype) if bias is not None else None
        g_hidden = torch.empty_like(hidden) if need_h else None
        g_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
        g_bias = (
            torch.zeros(bias.shape, dtype=torch.float32, device=bias.device) if need_b and bias is not None else None
        )
        for s in range(0, hidden.shape[0], chunk):
            h = hidden[s : s + chunk]
            z = _chunk_logits(h, w, b, t)
            log_p = z - lse[s : s + chunk, None]
            p = torch.exp(log_p)
            # d logp_target / dz = onehot - p;  d H / dz = -p * (log p + H)
            dz = torch.zeros_like(z)
            if g_logp is not None:
                gl = g_logp[s : s + chunk].float()
                dz -= p * gl[:, None]
                dz.scatter_add_(1, targets[s : s + chunk, None], gl[:, None])
            if g_entropy is not None:
                ge = g_entropy[s : s + chunk].float()
                dz -= p * (log_p + entropy[s : s + chunk, None]) * ge[:, None]
            if t not in (0.0, 1.0):
                dz /= t
            if g_hidden is not None:
                g_hidden[s : s + chunk] = (dz @ w).to(hidden.dtype)
            if g_weight is not None:
                g_weight += (dz.t() @ h).float()
            if g_bias is not None:
                g_bias += dz.sum(0)
        g_weight = g_weight.to(weight.dtype) if g_weight is not None else None
        g_bias = g_bias.to(bias.dtype) if g_bias is not None else None
        return g_hidden, g_weight, g_bias, None, None, None, None


def _chunk_logits(h: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, temperature: float) -> torch.Tensor:
    z = (h @ w.t() if b is None else torch.addmm(b, h, w.t())).float()
    return z if temperature in (0.0, 1.0) else z / temperature


def chunked_log_probs(
    hidden: torch.Tensor,
    head: nn.Linear,
    targets: torch.Tensor,
    *,
    temperature: float = 1.0,
    chunk: int = 256,
    with_entropy: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(log p(target), entropy)`` per row of ``hidden`` under ``softmax(head(hidden) / temperature)``.

    Equal (to float rounding) to ``log_softmax(head(hidden) / T).gather(targets)`` and the softmax
    entropy, gradients included, without ever holding more than ``chunk`` rows of logits. Both
    outputs are fp32 (entropy None unless ``with_entropy``). A temperature of 0 or 1 means none (the
    engine's greedy decode has no scale). Under autocast the logits are made in its dtype, forward and
    backward alike.
    """
    if hidden.dim() != 2 or targets.shape != hidden.shape[:1]:
        raise ValueError(f"hidden must be [N, H] and targets [N]; got {tuple(hidden.shape)} and {tuple(targets.shape)}")
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1, got {chunk}")
    out = _ChunkedHead.apply(hidden, head.weight, head.bias, targets, float(temperature), int(chunk), with_entropy)
    return out[0], (out[1] if with_entropy else None)


def plain_head(model: nn.Module) -> nn.Linear | None:
    """The model's LM head if it is an ``nn.Linear`` and the decoder is reachable, else None."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
    if not isinstance(head, nn.Linear) or decoder is None or decoder is model:
        return None
    return head


@torch.no_grad()
def head_is_plain(model: nn.Module, device: torch.device) -> bool:
    """Whether ``model``'s logits are exactly ``lm_head(decoder(...))`` (no soft-capping, scale or bias tricks).

    Checked once at load on a short random sequence, like the packing check: models that post-process
    logits (Gemma 2's soft-capping, Cohere's logit scale) keep the ordinary full-logits path.
    """
    head = plain_head(model)
    if head is None:
        return False
    embeddings = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    vocab = int(embeddings.weight.shape[0]) if embeddings is not None else int(head.weight.shape[0])
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (1, 12), generator=g).to(device)
    pos = torch.arange(12, device=device)[None]
    was_training = model.training
    model.eval()
    try:
        full = model(input_ids=ids, position_ids=pos, use_cache=False).logits[0].float()
        hidden = model.get_decoder()(input_ids=ids, position_ids=pos, use_cache=False).last_hidden_state[0]
        mine = head(hidden).float()
    except Exception:  # a decoder that needs other arguments: the ordinary path is always right
        return False
    finally:
        model.train(was_training)
    return bool(torch.allclose(full, mine, atol=1e-4, rtol=1e-4))
