"""Logits and per-token statistics of a tensor-parallel LM head (megatron-core ``GPTModel``).

With tensor parallelism (TP) Megatron shards the vocabulary: each of the ``tp`` ranks holds the
logits of ``V/tp`` consecutive token ids, and no rank ever sees a whole softmax. RL needs two numbers
per response token from that head, the log-prob of the sampled token and the entropy of the
distribution, so both are computed from partial sums that are all-reduced over the TP group:

* ``log p_y = z_y - logsumexp_v z_v = -CE(z, y)``: megatron's ``vocab_parallel_cross_entropy``
  (a max, a sum-exp and a target-logit all-reduce);
* ``H = logsumexp_v z_v - sum_v p_v z_v``: :func:`vocab_parallel_entropy` (a max and two sums).

The head is also cheaper than megatron runs it by default: :func:`logits_at` projects only the hidden
states at the positions whose next token is scored (response tokens), and :func:`head_logits` applies
the sampling temperature and hides the rows Megatron adds when it pads the vocabulary to a multiple of
``128 * tp`` (they get ``-inf``: probability 0, entropy contribution 0).

Shapes: ``s`` tokens in a packed row, ``h`` hidden size, ``N`` scored positions, ``V/tp`` this rank's
vocabulary slice (padded). At ``tp == 1`` every function here equals its plain single-device version.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import nn

from agentrl.algo.loss import entropy_from_logits
from agentrl.trainer.megatron_model import padded_vocab_size


@contextlib.contextmanager
def logits_at(model: nn.Module, positions: torch.Tensor) -> Iterator[None]:
    """Run the LM head only on the hidden states at ``positions`` (the rest of the row is never projected).

    GPTModel calls ``output_layer(hidden [s, b, h], ...)`` then returns ``[b, s', V/tp]``; the pre-hook
    replaces the hidden states by ``hidden[positions]`` (b = 1), so the model returns ``[1, N, V/tp]``.
    On a pipeline stage without the head (``post_process`` False) nothing is hooked.
    """
    layer = getattr(model, "output_layer", None) if getattr(model, "post_process", False) else None
    if layer is None:
        yield
        return

    def keep(_module: nn.Module, args: tuple, kwargs: dict):  # type: ignore[no-untyped-def]
        return (args[0].index_select(0, positions), *args[1:]), kwargs  # [s, 1, h] -> [N, 1, h]

    handle = layer.register_forward_pre_hook(keep, with_kwargs=True)
    try:
        yield
    finally:
        handle.remove()


def padded_vocab_mask(vocab_size: int, tp_rank: int, tp_size: int, device: torch.device | str) -> torch.Tensor | None:
    """``[V/tp]`` bool, True at this rank's padding rows (ids >= ``vocab_size``); None when it has none.

    Megatron pads the vocabulary to a multiple of ``128 * tp`` (:func:`~agentrl.trainer.megatron_model.
    padded_vocab_size`) and splits it evenly, so rank ``r`` holds ids ``[r * V/tp, (r + 1) * V/tp)``; the
    padding rows sit at the end of the last rank(s). Their weights are meaningless and must never be sampled
    or scored, hence ``-inf`` in :func:`head_logits`.
    """
    local = padded_vocab_size(vocab_size, tp_size) // tp_size
    ids = torch.arange(tp_rank * local, (tp_rank + 1) * local, device=device)
    return ids >= vocab_size if ids[-1] >= vocab_size else None


def head_logits(output: torch.Tensor, temperature: float, pad_mask: torch.Tensor | None) -> torch.Tensor:
    """The model's ``[1, N, V/tp]`` head output -> ``[N, V/tp]`` logits as the engine samples from them.

    ``z / T`` for a sampling temperature ``T`` (0 and 1 mean unscaled: greedy decoding has no temperature
    to match), then the padded vocabulary rows (``pad_mask`` of :func:`padded_vocab_mask`) at ``-inf``.
    """
    logits = output[0]
    logits = logits if temperature in (0.0, 1.0) else logits / temperature
    if pad_mask is not None:
        logits = logits.masked_fill(pad_mask, float("-inf"))
    return logits


def vocab_parallel_entropy(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of softmax over a TP-sharded vocabulary. logits [N, V/tp] (this rank's slice) -> [N] fp32.

        H = lse - sum_v p_v z_v,   lse = m + log sum_v e_v,   e_v = exp(z_v - m),   p_v = e_v / sum e

    ``m`` (the global max) is a constant shift (detached, MAX all-reduce); the two sums are all-reduced
    with megatron's reduce-forward / identity-backward mapping: every TP rank holds the SAME loss, so
    the gradient of a sum's input is the sum's gradient (a differentiable all-reduce whose backward also
    sums, like ``torch.distributed.nn.all_reduce``, would scale it by tp). Vocabulary at -inf adds 0.
    """
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region as tp_sum

    z = logits.float()
    m = z.detach().max(dim=-1).values  # [N]
    dist.all_reduce(m, op=dist.ReduceOp.MAX, group=ps.get_tensor_model_parallel_group())
    e = torch.exp(z - m[:, None])  # [N, V/tp]
    finite = z.masked_fill(torch.isinf(z), 0.0)  # 0 * -inf would be nan
    s = tp_sum(e.sum(dim=-1))  # [N]
    ez = tp_sum((e * finite).sum(dim=-1))  # [N]
    return m + torch.log(s) - ez / s


def token_stats(
    logits: torch.Tensor, targets: torch.Tensor, *, tp_size: int, entropy: bool, entropy_grad: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``log p(target)`` [N] and, when ``entropy``, the entropy [N] of ``logits`` [N, V/tp] (``targets`` [N] ids).

    ``log p_y = -vocab_parallel_cross_entropy(z, y)`` (exact at any tp). The entropy carries a gradient
    only when ``entropy_grad`` (an entropy bonus is trained) and grad mode is on; otherwise it is a
    metric and its graph is not built. At ``tp_size == 1`` it is the chunked single-device
    :func:`~agentrl.algo.loss.entropy_from_logits`, else :func:`vocab_parallel_entropy`.
    """
    from megatron.core import tensor_parallel

    ent = None
    if entropy:
        with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
            ent = entropy_from_logits(logits) if tp_size == 1 else vocab_parallel_entropy(logits)
    # megatron's CE subtracts the max IN PLACE from fp32 logits, which the entropy's graph may hold
    ce_input = logits.clone() if entropy_grad else logits
    return -tensor_parallel.vocab_parallel_cross_entropy(ce_input, targets), ent


__all__ = ["head_logits", "logits_at", "padded_vocab_mask", "token_stats", "vocab_parallel_entropy"]
