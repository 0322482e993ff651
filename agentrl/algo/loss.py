"""Policy-loss terms over the response tokens of one packed micro-batch.

Every tensor is FLAT and 1-D over the micro-batch's response tokens (``T`` of them, samples laid
end to end, no padding): ``logp`` (current policy, with grad), ``old_logp`` (the policy that the
advantages were computed for), ``ref_logp`` (reference model), ``rollout_logp`` (what the inference
engine reported), ``advantages``, ``mask`` (float, 1 = policy-sampled token) and ``seq_ids``
(LongTensor, which sample of the micro-batch each token belongs to, 0..S-1). A sample must lie
whole in one micro-batch.

Normalization. One optimizer step accumulates gradients over several micro-batches, so
:func:`aggregate` divides by *global* counts (``num_tokens`` masked tokens, ``num_seqs`` samples of
the whole step): summing the per-micro-batch losses then gives exactly the whole-batch loss.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from agentrl.algo.spec import LossConfig


def ppo_clip_loss(
    logp: Tensor, old_logp: Tensor, advantages: Tensor, eps_clip: float, eps_clip_high: float
) -> tuple[Tensor, Tensor]:
    """PPO clipped surrogate with asymmetric bounds (DAPO's clip-higher).

        ratio_t = exp(logp_t - old_logp_t)
        loss_t  = -min(ratio_t * A_t, clip(ratio_t, 1 - eps_clip, 1 + eps_clip_high) * A_t)

    ``clipped_t`` is True where the clipped branch is the one taken (and differs), i.e. where the
    token's gradient is zero because the ratio has left the trust region in A's direction.
    All inputs [T] -> (loss [T], clipped [T] bool).
    """
    ratio = torch.exp(logp - old_logp.detach())  # [T]
    adv = advantages.detach()
    unclipped = -ratio * adv
    clipped = -ratio.clamp(1.0 - eps_clip, 1.0 + eps_clip_high) * adv
    return torch.maximum(unclipped, clipped), clipped > unclipped


def _per_seq_sum(values: Tensor, seq_ids: Tensor, num_seqs: int) -> Tensor:
    """values [T] -> [S]: sum of each sequence's values."""
    return torch.zeros(num_seqs, dtype=values.dtype, device=values.device).index_add(0, seq_ids, values)


def gspo_ratio(logp: Tensor, old_logp: Tensor, mask: Tensor, seq_ids: Tensor, num_seqs: int) -> Tensor:
    """GSPO's token-level view of the sequence ratio (Zheng et al. 2025, "GSPO-token").

        s_i     = exp( (1/|y_i|) sum_{t in y_i} (logp_t - old_logp_t) )     (masked tokens only)
        s_{i,t} = sg[s_i] * exp(logp_t - sg[logp_t])

    Its value is s_i on every token of sequence i; its gradient is s_i * grad logp_t, so the
    per-sequence mean of s_{i,t} A_i has the same gradient as s_i A_i.
    [T] -> [T]
    """
    mask = mask.to(logp.dtype)
    delta = (logp - old_logp.detach()).detach() * mask  # [T]
    n_tok = _per_seq_sum(mask, seq_ids, num_seqs).clamp_min(1.0)  # [S]
    seq_log_ratio = _per_seq_sum(delta, seq_ids, num_seqs) / n_tok  # [S]
    return torch.exp(seq_log_ratio[seq_ids] + logp - logp.detach())  # [T]


def gspo_loss(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    seq_ids: Tensor,
    num_seqs: int,
    eps_clip: float,
    eps_clip_high: float,
) -> tuple[Tensor, Tensor]:
    """GSPO: the PPO clip applied to the sequence-level ratio s_i (:func:`gspo_ratio`).

        loss_t = -min(s_{i,t} A_t, clip(s_{i,t}, 1 - eps_clip, 1 + eps_clip_high) A_t)

    Clipping is decided per sequence (every token of a sequence shares s_i). Advantages are
    GRPO's (one per sequence). ``num_seqs`` = number of sequences S in this micro-batch.
    [T] -> (loss [T], clipped [T] bool)
    """
    ratio = gspo_ratio(logp, old_logp, mask, seq_ids, num_seqs)  # [T]
    adv = advantages.detach()
    unclipped = -ratio * adv
    clipped = -ratio.clamp(1.0 - eps_clip, 1.0 + eps_clip_high) * adv
    return torch.maximum(unclipped, clipped), clipped > unclipped


def kl_penalty(logp: Tensor, ref_logp: Tensor, kind: str) -> Tensor:
    """Per-token KL(pi || pi_ref) estimators (Schulman, "Approximating KL divergence"), as slime.

        k1 = logp - ref                               (unbiased, can be negative)
        k2 = 0.5 * (logp - ref)^2                     (biased, low variance, >= 0)
        k3 = exp(ref - logp) - (ref - logp) - 1       (unbiased, low variance, >= 0)

    [T] -> [T]
    """
    log_ratio = logp.float() - ref_logp.detach().float()  # [T]
    if kind == "k1":
        return log_ratio
    if kind == "k2":
        return 0.5 * log_ratio**2
    if kind == "k3":
        return torch.exp(-log_ratio) + log_ratio - 1.0
    raise ValueError(f"unknown --kl-loss-type {kind!r}; choose k1, k2 or k3")


def entropy_from_logits(logits: Tensor, chunk_size: int = 1024) -> Tensor:
    """Entropy of softmax(logits) per row: H = -sum_v p_v log p_v, p = softmax(z).

    Computed from ``log_softmax`` (stable for any logit scale) in float32, ``chunk_size`` rows at a
    time so a bf16 [T, V] batch never has a full float32 [T, V] copy alive at once during the
    forward. Vocabulary entries at -inf (p = 0) contribute 0.
    logits [T, V] -> [T] float32
    """
    out = []
    for chunk in logits.split(chunk_size, dim=0):
        logp = F.log_softmax(chunk.float(), dim=-1)  # [t, V]
        p = logp.exp()
        logp = logp.masked_fill(p == 0, 0.0)  # 0 * -inf -> 0
        out.append(-(p * logp).sum(dim=-1))  # [t]
    return torch.cat(out) if out else logits.new_zeros(0, dtype=torch.float32)


def tis_weights(old_logp: Tensor, rollout_logp: Tensor, threshold: float) -> Tensor:
    """Truncated importance sampling (slime's ``--use-tis``): w_t = min(exp(old_t - rollout_t), C).

    Corrects for the inference engine sampling from a slightly different distribution than the
    trainer computes (kernels, precision). Detached: a weight, not a gradient path. [T] -> [T]
    """
    return torch.exp(old_logp.detach() - rollout_logp.detach()).clamp(max=threshold)


def aggregate(
    values: Tensor, mask: Tensor, seq_ids: Tensor, *, per_token: bool, num_tokens: float, num_seqs: float
) -> Tensor:
    """Reduce per-token values [T] to a scalar with global normalization.

    per_token=True  (``--calculate-per-token-loss``): sum_t m_t v_t / num_tokens, where num_tokens
                    is the masked-token count of the whole step (all micro-batches).
    per_token=False (sample mean):  sum_i [ sum_{t in i} m_t v_t / sum_{t in i} m_t ] / num_seqs,
                    num_seqs = sample count of the whole step; a sample with no masked token adds 0.
    Summing this over the micro-batches of a step gives the whole-batch value.
    """
    mask = mask.to(values.dtype)
    if per_token:
        return (values * mask).sum() / max(float(num_tokens), 1.0)
    if values.numel() == 0:
        return values.sum()
    s = int(seq_ids.max()) + 1
    seq_sum = _per_seq_sum(values * mask, seq_ids, s)  # [S]
    seq_cnt = _per_seq_sum(mask, seq_ids, s).clamp_min(1.0)  # [S]
    return (seq_sum / seq_cnt).sum() / max(float(num_seqs), 1.0)


def sft_loss(
    logp: Tensor, mask: Tensor, seq_ids: Tensor, cfg: LossConfig, *, num_tokens: float, num_seqs: float
) -> tuple[Tensor, dict[str, float]]:
    """Supervised fine-tuning (slime's ``--loss-type sft_loss``): the negative log-likelihood of the
    demonstrated tokens, with the same normalization as the policy loss.

        loss = agg(-logp_t)        over tokens with m_t = 1 (the assistant's turns, stop tokens included)

    ``agg`` is :func:`aggregate` (``--calculate-per-token-loss``: a mean over every trained token of
    the step; else each sample's mean, averaged over samples). The metric ``sft_loss`` is the same
    value; micro-batch values sum to the step's loss.
    """
    nll = aggregate(
        -logp, mask, seq_ids, per_token=cfg.calculate_per_token_loss, num_tokens=num_tokens, num_seqs=num_seqs
    )
    return nll, {"sft_loss": float(nll.detach())}


def value_loss(
    values: Tensor,
    old_values: Tensor,
    returns: Tensor,
    mask: Tensor,
    seq_ids: Tensor,
    *,
    value_clip: float,
    per_token: bool,
    num_tokens: float,
    num_seqs: float,
) -> tuple[Tensor, dict[str, float]]:
    """The critic's clipped value loss (PPO's; slime's ``value_loss`` without the 0.5) over one micro-batch.

        v_clip_t = old_v_t + clip(v_t - old_v_t, -value_clip, value_clip)
        loss     = agg( 0.5 * max((v_t - R_t)^2, (v_clip_t - R_t)^2) )

    ``old_values`` are the critic's values when the rollout's advantages were computed, ``returns``
    the GAE targets R_t = A_t + old_v_t (:func:`agentrl.algo.advantages.gae`); the clip keeps one
    update from moving a value further than ``value_clip`` from where it was. ``agg`` is
    :func:`aggregate` (``per_token``: ``--calculate-per-token-loss``). Metrics: ``value_loss``,
    ``value_clipfrac`` (share of tokens where the clipped branch is the larger, i.e. has no gradient; slime
    counts |v - old_v| > value_clip) and ``values_mean``,
    normalized alike so micro-batches sum. All inputs [T].
    """
    v = values.float()
    old = old_values.detach().float()
    ret = returns.detach().float()
    clipped = old + (v - old).clamp(-value_clip, value_clip)
    l_unclipped = (v - ret) ** 2
    l_clipped = (clipped - ret) ** 2

    def agg(x: Tensor) -> Tensor:
        return aggregate(x, mask, seq_ids, per_token=per_token, num_tokens=num_tokens, num_seqs=num_seqs)

    loss = agg(0.5 * torch.maximum(l_unclipped, l_clipped))
    metrics = {
        "value_loss": float(loss.detach()),
        "value_clipfrac": float(agg((l_clipped > l_unclipped).float())),
        "values_mean": float(agg(v.detach())),
    }
    return loss, metrics


CustomLoss = Callable[..., tuple[Tensor, dict[str, float]]]
"""``fn(args, batch, log_probs, sum_of_sample_mean) -> (loss, metrics)``, see :func:`custom_loss`."""


def custom_loss(
    fn: CustomLoss,
    cfg: LossConfig,
    batch: Any,
    logp: Tensor,
    old_logp: Tensor,
    *,
    num_tokens: float,
    num_seqs: float,
    ref_logp: Tensor | None = None,
    entropy: Tensor | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """``--loss-type custom_loss``: the user's ``fn(args, batch, log_probs, sum_of_sample_mean)``, slime's
    custom loss signature with agentrl's packed layout.

    ``args`` is the training config (slime's flag names); ``log_probs`` the current policy's
    log-probs of the response tokens of this micro-batch (``[N]``, with gradient; slime passes the
    raw logits, which are vocab-parallel under Megatron: both agentrl backends give the same
    log-probs instead). ``batch`` holds, aligned with ``log_probs``: ``loss_masks``, ``advantages``,
    ``log_probs`` (the old policy's), ``ref_log_probs`` / ``rollout_log_probs`` / ``entropy``
    (None when not computed), ``seq_ids`` (which sample of the micro-batch), and per sample
    ``response_lengths`` and ``metadata`` (each sample's ``train_metadata``); ``tokens`` is the packed
    row. ``sum_of_sample_mean(values)`` reduces ``[N]`` values with the step's normalization (the
    same as the built-in losses: ``--calculate-per-token-loss`` or per-sample means), so micro-batch
    losses add up to the step's. The loss must be a finite scalar tensor; metrics a dict of numbers,
    which the trainer SUMS over micro-batches and ranks (as it does the built-in terms): report
    globally normalized values (e.g. through ``sum_of_sample_mean``) or counts, not per-micro-batch
    means. ``loss`` is the trainer's own metric name (the step's loss).
    """
    mask, seq_ids = batch.mask, batch.seq_ids

    def sum_of_sample_mean(values: Tensor) -> Tensor:
        return aggregate(
            values, mask, seq_ids, per_token=cfg.calculate_per_token_loss, num_tokens=num_tokens, num_seqs=num_seqs
        )

    view = {
        "tokens": batch.input_ids[0],
        "loss_masks": mask,
        "advantages": batch.advantages,
        "log_probs": old_logp,
        "ref_log_probs": ref_logp,
        "rollout_log_probs": batch.rollout_log_probs,
        "entropy": entropy,
        "seq_ids": seq_ids,
        "response_lengths": list(batch.response_lengths),
        "metadata": list(batch.train_metadata),
    }
    name = getattr(cfg, "custom_loss_function_path", None) or "the custom loss"
    out = fn(cfg, view, logp, sum_of_sample_mean)
    if not (isinstance(out, tuple) and len(out) == 2):
        raise TypeError(f"--custom-loss-function-path {name}: must return (loss, metrics), got {type(out).__name__}")
    loss, metrics = out
    if not isinstance(loss, Tensor) or loss.numel() != 1:
        raise TypeError(f"--custom-loss-function-path {name}: the loss must be a scalar tensor, got {loss!r:.80}")
    if not bool(torch.isfinite(loss.detach()).all()):
        raise ValueError(f"--custom-loss-function-path {name}: the loss is not finite ({float(loss.detach())})")
    if not isinstance(metrics, dict) or not all(isinstance(k, str) for k in metrics):
        raise TypeError(f"--custom-loss-function-path {name}: metrics must be a dict of name -> number")
    if "loss" in metrics:
        raise ValueError(
            f"--custom-loss-function-path {name}: the metric name 'loss' is the trainer's own (the step's summed "
            "loss); report yours under another name"
        )
    try:
        values = {k: float(v) for k, v in metrics.items()}
    except (TypeError, ValueError) as exc:
        raise TypeError(f"--custom-loss-function-path {name}: metrics must be numbers ({exc})") from None
    return loss.reshape(()), values


def policy_loss(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    seq_ids: Tensor,
    cfg: LossConfig,
    *,
    num_tokens: float,
    num_seqs: float,
    ref_logp: Tensor | None = None,
    rollout_logp: Tensor | None = None,
    entropy: Tensor | None = None,
    custom_fn: CustomLoss | None = None,
    batch: Any = None,
) -> tuple[Tensor, dict[str, float]]:
    """The micro-batch loss to ``backward()`` (:func:`sft_loss` instead with ``--loss-type sft_loss``,
    :func:`custom_loss` of ``custom_fn`` on ``batch`` with ``--loss-type custom_loss``):

        loss = agg(w_t * pg_t) + kl_loss_coef * agg(kl_t) - entropy_coef * agg(H_t)

    pg_t is :func:`gspo_loss` when ``--advantage-estimator gspo``, else :func:`ppo_clip_loss`;
    w_t the TIS weight when ``--use-tis`` (else 1); kl_t is ``--kl-loss-type`` when ``--use-kl-loss``;
    H_t the entropy (only when ``entropy`` is given). ``agg`` is :func:`aggregate` with
    ``--calculate-per-token-loss``. Metrics (pg_loss, kl, entropy, clipfrac, ratio_mean) use the
    same normalization, so the trainer sums them over micro-batches.
    """
    if cfg.loss_type == "sft_loss":
        return sft_loss(logp, mask, seq_ids, cfg, num_tokens=num_tokens, num_seqs=num_seqs)
    if cfg.loss_type == "custom_loss":
        if custom_fn is None or batch is None:
            raise ValueError("--loss-type custom_loss needs the loaded --custom-loss-function-path and the batch")
        return custom_loss(
            custom_fn,
            cfg,
            batch,
            logp,
            old_logp,
            num_tokens=num_tokens,
            num_seqs=num_seqs,
            ref_logp=ref_logp,
            entropy=entropy,
        )

    def agg(v: torch.Tensor) -> torch.Tensor:
        return aggregate(
            v, mask, seq_ids, per_token=cfg.calculate_per_token_loss, num_tokens=num_tokens, num_seqs=num_seqs
        )

    if cfg.advantage_estimator == "gspo":
        s = int(seq_ids.max()) + 1 if seq_ids.numel() else 0
        pg, clipped = gspo_loss(logp, old_logp, advantages, mask, seq_ids, s, cfg.eps_clip, cfg.clip_high)
        ratio = gspo_ratio(logp, old_logp, mask, seq_ids, s).detach()
    else:
        pg, clipped = ppo_clip_loss(logp, old_logp, advantages, cfg.eps_clip, cfg.clip_high)
        ratio = torch.exp(logp - old_logp).detach()
    if cfg.use_tis:
        if rollout_logp is None:
            raise ValueError("--use-tis needs the engine's rollout log-probs")
        pg = pg * tis_weights(old_logp, rollout_logp, cfg.tis_threshold)
    pg_loss = agg(pg)
    loss = pg_loss

    kl_val = torch.zeros(())
    if cfg.use_kl_loss:
        if ref_logp is None:
            raise ValueError("--use-kl-loss needs reference log-probs")
        kl_val = agg(kl_penalty(logp, ref_logp, cfg.kl_loss_type))
        loss = loss + cfg.kl_loss_coef * kl_val
    ent_val = torch.zeros(())
    if entropy is not None:
        ent_val = agg(entropy)
        loss = loss - cfg.entropy_coef * ent_val

    metrics = {
        "pg_loss": float(pg_loss.detach()),
        "kl": float(kl_val.detach()),
        "entropy": float(ent_val.detach()),
        "clipfrac": float(agg(clipped.float())),
        "ratio_mean": float(agg(ratio)),
    }
    return loss, metrics
