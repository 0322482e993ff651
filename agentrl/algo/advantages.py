"""Advantage estimators: per-sample rewards in, per-response-token advantages out.

Every function here is pure (no state, no config object) and works on the rollout as a whole,
because group baselines and whitening need every sample. Shapes: ``N`` samples, sample ``i`` has
``L_i`` response tokens; ``loss_masks[i]`` is 1 where the policy sampled the token and 0 where the
environment or the chat template wrote it.

Groups are the ``n_samples_per_prompt`` samples of one prompt (``Sample.group_index``). They are
always formed by id, never by position: the rollout may finish (and hand back) samples in any order.

Estimators (``--advantage-estimator``):

* ``grpo``   A_i = (r_i - mean_g) / (std_g + eps); ``--disable-grpo-std-normalization`` gives
  Dr.GRPO, A_i = r_i - mean_g.
* ``gspo``   the same advantages as ``grpo``; GSPO differs only in the *loss* (a sequence-level
  importance ratio, see :func:`agentrl.algo.loss.gspo_loss`).
* ``rloo``   A_i = r_i - mean of the other samples of the group.
* ``reinforce_plus_plus_baseline``  r_i - mean_g broadcast to tokens, whitened over the batch.
* ``reinforce_plus_plus``  discounted token-level returns (KL-shaped), whitened over the batch.
* ``ppo``    GAE over a learned value function (the critic): see :func:`ppo_advantages`.

``--per-turn-credit`` (grpo/gspo only) replaces the one reward per episode by one return per
assistant turn: see :func:`per_turn_grpo`.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Hashable, Sequence

import torch
from torch import Tensor

from agentrl.algo.spec import ADVANTAGE_ESTIMATORS

Rewards = Tensor | Sequence[float]


# ---------------------------------------------------------------------------------------------
# Group statistics
# ---------------------------------------------------------------------------------------------


def episode_weights(values: Tensor, episode_ids: Sequence[Hashable] | None) -> Tensor:
    """[N] weights 1/k for a sample of an episode split into k samples (segments), 1 without ids.

    Why: an episode whose history was rewritten is several samples (its segments) with one reward;
    group statistics must count the episode once however many segments it has, or an episode that
    compacted its context often would pull its group's baseline toward itself. Refuses segments of
    one episode with different rewards (the reward is the episode's).
    """
    if episode_ids is None:
        return torch.ones_like(values)
    if len(episode_ids) != values.numel():
        raise ValueError(f"{len(episode_ids)} episode ids for {values.numel()} rewards")
    seen: dict[Hashable, list[int]] = {}
    for i, e in enumerate(episode_ids):
        seen.setdefault(e, []).append(i)
    w = torch.ones_like(values)
    for e, idx in seen.items():
        if len(idx) > 1:
            if len({float(values[i]) for i in idx}) > 1:
                raise ValueError(
                    f"the segments of episode {e!r} have different rewards {[float(values[i]) for i in idx]}: "
                    "every segment carries its episode's reward"
                )
            w[idx] = 1.0 / len(idx)
    return w


def _group_stats(
    values: Tensor, group_ids: Sequence[int], episode_ids: Sequence[Hashable] | None = None
) -> tuple[Tensor, Tensor, Tensor]:
    """Per-sample group mean, unbiased group std and group size, grouped by id.

    values: [N]. Returns three [N] tensors (each sample gets its own group's statistics).
    std_g = sqrt(sum_{j in g} (r_j - mean_g)^2 / (n_g - 1)), i.e. ``torch.std``'s default
    (Bessel-corrected), the same as slime; it is NaN for n_g = 1, which callers map to 0.
    With ``episode_ids`` the statistics are over episodes: a sample of an episode in k segments
    weighs 1/k (:func:`episode_weights`), so n_g counts episodes.

    A group whose rewards are all equal gets exactly its reward as mean and 0 as std: weights such as
    1/3 do not sum exactly in floating point, and a mean off by one rounding step divided by a std of
    rounding noise would otherwise hand a group with no signal advantages of ~0.1. Sums run in float64.
    """
    if len(group_ids) != values.numel():
        raise ValueError(f"{len(group_ids)} group ids for {values.numel()} rewards")
    if any(g is None for g in group_ids):
        raise ValueError("every sample needs a group id (Sample.group_index is None)")
    v = values.double()
    w = episode_weights(v, episode_ids)
    ids = torch.as_tensor(list(group_ids), dtype=torch.long, device=values.device)
    _, inv = torch.unique(ids, return_inverse=True)  # [N] in 0..G-1
    num_groups = int(inv.max()) + 1 if inv.numel() else 0
    count = v.new_zeros(num_groups).index_add_(0, inv, w)  # [G]
    mean = v.new_zeros(num_groups).index_add_(0, inv, w * v) / count  # [G]
    lo = v.new_full((num_groups,), float("inf")).scatter_reduce_(0, inv, v, "amin")
    hi = v.new_full((num_groups,), float("-inf")).scatter_reduce_(0, inv, v, "amax")
    tie = lo == hi  # [G]: every reward of the group is the same
    mean = torch.where(tie, lo, mean)
    sq_dev = w * (v - mean[inv]) ** 2  # [N]
    var = v.new_zeros(num_groups).index_add_(0, inv, sq_dev) / (count - 1)  # [G]
    var = torch.where(tie & (count > 1), torch.zeros_like(var), var)
    dtype = values.dtype
    return mean[inv].to(dtype), var.sqrt()[inv].to(dtype), count[inv].to(dtype)


def _as_rewards(rewards: Rewards) -> Tensor:
    return torch.as_tensor(rewards, dtype=torch.float32).reshape(-1)  # [N]


def _as_masks(loss_masks: Sequence[Tensor | Sequence[int]]) -> list[Tensor]:
    return [torch.as_tensor(m, dtype=torch.float32).reshape(-1) for m in loss_masks]


# ---------------------------------------------------------------------------------------------
# Sequence-level estimators: one scalar per sample
# ---------------------------------------------------------------------------------------------


def grpo(
    rewards: Rewards,
    group_ids: Sequence[int],
    *,
    std_normalize: bool = True,
    eps: float = 1e-6,
    episode_ids: Sequence[Hashable] | None = None,
) -> Tensor:
    """GRPO (Shao et al. 2024): A_i = (r_i - mean_g) / (std_g + eps).

    ``std_g`` is the unbiased (n-1) group std, as ``torch.std`` and slime compute it. With
    ``std_normalize=False`` this is Dr.GRPO (Liu et al. 2025): A_i = r_i - mean_g. A group of
    one sample has no baseline to compare against: its advantage is 0. GSPO uses these same
    advantages (its difference is the sequence-level ratio in the loss).

    rewards: [N] -> [N]
    """
    r = _as_rewards(rewards)
    mean, std, count = _group_stats(r, group_ids, episode_ids)
    adv = r - mean
    if std_normalize:
        adv = adv / (std.nan_to_num(0.0) + eps)
    return torch.where(count > 1, adv, torch.zeros_like(adv))


def rloo(rewards: Rewards, group_ids: Sequence[int], *, episode_ids: Sequence[Hashable] | None = None) -> Tensor:
    """RLOO (Ahmadian et al. 2024): A_i = r_i - (1/(n-1)) sum_{j != i} r_j = n/(n-1) (r_i - mean_g).

    The leave-one-out baseline makes the estimator unbiased. Singleton groups get 0.
    rewards: [N] -> [N]
    """
    r = _as_rewards(rewards)
    mean, _, count = _group_stats(r, group_ids, episode_ids)
    adv = count / (count - 1).clamp_min(1) * (r - mean)
    return torch.where(count > 1, adv, torch.zeros_like(adv))


# ---------------------------------------------------------------------------------------------
# Token-level estimators (REINFORCE++)
# ---------------------------------------------------------------------------------------------


def masked_whiten(values: Sequence[Tensor], masks: Sequence[Tensor], eps: float = 1e-8) -> list[Tensor]:
    """Whiten over every masked token of the batch: x' = (x - mu) / sqrt(var + eps), then x' *= mask.

    mu and var (population, 1/n) are taken over the tokens with mask 1 of *all* samples together,
    so a long sample weighs more than a short one (slime's ``distributed_masked_whiten``).
    values[i], masks[i]: [L_i]
    """
    masks = _as_masks(masks)
    flat_v = torch.cat([v.float() for v in values]) if values else torch.zeros(0)  # [sum L_i]
    flat_m = torch.cat(masks) if masks else torch.zeros(0)  # [sum L_i]
    n = flat_m.sum()
    if n == 0:
        return [torch.zeros_like(m) for m in masks]
    mu = (flat_v * flat_m).sum() / n
    var = (((flat_v - mu) ** 2) * flat_m).sum() / n
    inv_std = torch.rsqrt(var + eps)
    return [(v.float() - mu) * inv_std * m for v, m in zip(values, masks)]


def discounted_returns(token_rewards: Tensor, mask: Tensor, gamma: float) -> Tensor:
    """Returns-to-go over the masked tokens only: G_t = r_t + gamma * G_{t'}, t' = next masked token.

    Tokens the environment wrote (mask 0) are skipped, so gamma discounts per *policy* token and
    an observation in between does not shrink the return; they get G = 0.
    token_rewards, mask: [L] -> [L]
    """
    out = torch.zeros(token_rewards.shape, dtype=torch.float32)  # [L]
    idx = mask.nonzero(as_tuple=True)[0]  # [K] masked positions
    rewards_k = token_rewards[idx].tolist()
    returns_k, running = [0.0] * len(rewards_k), 0.0
    for k in range(len(rewards_k) - 1, -1, -1):
        running = rewards_k[k] + gamma * running
        returns_k[k] = running
    out[idx] = torch.tensor(returns_k, dtype=torch.float32)
    return out


def reinforce_plus_plus(
    rewards: Rewards,
    loss_masks: Sequence[Tensor],
    *,
    kl: Sequence[Tensor] | None = None,
    kl_coef: float = 0.0,
    gamma: float = 1.0,
    eps: float = 1e-8,
) -> list[Tensor]:
    """REINFORCE++ (Hu 2025, arXiv 2501.03262), as slime's ``get_reinforce_plus_plus_returns``.

    1. token rewards  r_t = -kl_coef * kl_t on every masked token, plus the scalar reward r_i
       on the *last* masked token (kl_t = per-token KL to the reference, e.g. k1 = logp - ref);
    2. returns        G_t = sum_{k >= t, masked} gamma^(#masked tokens from t to k) r_k
       (:func:`discounted_returns`; slime also steps over mask-0 tokens, which only differs in
       multi-turn samples with gamma < 1);
    3. advantages     A = whiten(G) over all masked tokens of the batch (:func:`masked_whiten`).

    A sample with no masked token gets all zeros. rewards: [N]; loss_masks[i], kl[i]: [L_i].
    """
    r = _as_rewards(rewards)
    masks = _as_masks(loss_masks)
    returns = []
    for i, m in enumerate(masks):
        tok = torch.zeros_like(m) if kl is None else -kl_coef * kl[i].detach().float() * m  # [L_i]
        idx = m.nonzero(as_tuple=True)[0]
        if idx.numel():
            tok[idx[-1]] += r[i]
        returns.append(discounted_returns(tok, m, gamma))
    return masked_whiten(returns, masks, eps)


def reinforce_plus_plus_baseline(
    rewards: Rewards,
    group_ids: Sequence[int],
    loss_masks: Sequence[Tensor],
    eps: float = 1e-8,
    *,
    kl: Sequence[Tensor] | None = None,
    kl_coef: float = 0.0,
    episode_ids: Sequence[Hashable] | None = None,
) -> list[Tensor]:
    """REINFORCE++-baseline: A_t = whiten(r_i - mean_g - kl_coef * kl_t) over the batch's masked tokens.

    The group mean is the baseline (no std division); the scalar is broadcast to every response
    token, an optional per-token KL penalty is subtracted (slime does the same), and the result is
    whitened over all masked tokens of the batch. Singleton groups have r_i - mean_g = 0.
    rewards: [N]; loss_masks[i], kl[i]: [L_i].
    """
    r = _as_rewards(rewards)
    mean, _, _ = _group_stats(r, group_ids, episode_ids)
    masks = _as_masks(loss_masks)
    raw = []
    for i, m in enumerate(masks):
        a = torch.full_like(m, float(r[i] - mean[i]))  # [L_i]
        if kl is not None:
            a = a - kl_coef * kl[i].detach().float()
        raw.append(a)
    return masked_whiten(raw, masks, eps)


# ---------------------------------------------------------------------------------------------
# Per-turn credit assignment (multi-turn episodes)
# ---------------------------------------------------------------------------------------------


def per_turn_returns(turn_rewards: Sequence[float], gamma: float = 1.0) -> list[float]:
    """Per-turn returns-to-go of one episode: G_t = sum_{k >= t} gamma^(k - t) r_k.

    ``turn_rewards[t]`` is the environment reward of step t (answer to assistant turn t).
    """
    out, running = [0.0] * len(turn_rewards), 0.0
    for t in range(len(turn_rewards) - 1, -1, -1):
        running = float(turn_rewards[t]) + gamma * running
        out[t] = running
    return out


def _std(total: float, squares: float, count: int) -> float:
    """Unbiased standard deviation from a sum, a sum of squares and a count (0 below two values)."""
    if count < 2:
        return 0.0
    return math.sqrt(max(0.0, (squares - total * total / count) / (count - 1)))


def per_turn_grpo(
    turn_rewards: Sequence[Sequence[float]],
    turn_spans: Sequence[Sequence[tuple[int, int]]],
    group_ids: Sequence[int],
    loss_masks: Sequence[Tensor],
    *,
    gamma: float = 1.0,
    std_normalize: bool = True,
    eps: float = 1e-6,
) -> list[Tensor]:
    """GRPO with one return per assistant turn instead of one reward per episode.

    For sample i with turn returns G_{i,t} (:func:`per_turn_returns`), the tokens of turn t
    (``turn_spans[i][t] = (start, end)``, half-open offsets into the response) get

        A_{i,t} = (G_{i,t} - b_{i,t}) / s_i      (s_i = 1 without std normalization)

    **Baseline.** b_{i,t} is the mean of G_{j,t} over the *other* samples j of the group that
    reached turn t (leave-one-out, at the same turn index), 0 if none did. Why not one mean over
    every turn of the group (what this function did before): such a baseline contains the
    sample's own returns, and how many of them depends on when its own actions ended the episode.
    A baseline that depends on the action is biased (verl issue 7244: a hidden bonus or penalty
    for "take another turn" whenever intermediate rewards are non-zero). Built from other,
    independent episodes only, the expected update is the policy gradient; with one turn per
    episode it is RLOO, ``n / (n - 1)`` times GRPO's ``r_i - mean_g``. (Giving an unmatched turn 0
    instead of G_{i,t} would shrink late turns' gradient by the chance that another episode
    lasted as long: a bias of its own.)

    **Scale.** s_i is the standard deviation of the returns of the batch's *other groups*: every
    turn index of every episode up to its group's longest, 0 after an episode ended (a finished
    episode earns nothing more). A scale that contains the sample's own returns brings the bias
    back through the division (the pooled std of the group gave "go on" a bonus in the test game
    of ``tests/test_algo.py``), and the leave-one-out std of the group alone explodes when the
    sample is the group's outlier (one solve among near-equal failures). With other groups the
    update is a positive multiple of the policy gradient; a batch of one group falls back to the
    group's other samples, and a spread <= ``eps`` to 1.

    A group of one sample gets 0 everywhere, as in :func:`grpo`, and so do mask-0 tokens and
    tokens outside every turn span. Returns a list of [L_i] tensors.
    """
    masks = _as_masks(loss_masks)
    n = len(masks)
    if not (len(turn_rewards) == len(turn_spans) == len(group_ids) == n):
        raise ValueError("turn_rewards, turn_spans, group_ids and loss_masks must have one entry per sample")
    returns = [per_turn_returns(tr, gamma) for tr in turn_rewards]
    group_size = Counter(group_ids)
    longest: dict[int, int] = {}
    for gid, g in zip(group_ids, returns):
        longest[gid] = max(longest.get(gid, 0), len(g))
    # per group and turn index: sum and count of the returns of the samples that reached it
    sums: dict[tuple[int, int], float] = {}
    counts: Counter[tuple[int, int]] = Counter()
    # per sample and per group: sum, sum of squares and count of the zero-padded returns (for the scale)
    padded = [(sum(g), sum(x * x for x in g), longest[gid]) for gid, g in zip(group_ids, returns)]
    group_stats: dict[int, list[float]] = {}
    for gid, g, (total, squares, count) in zip(group_ids, returns, padded):
        for t, value in enumerate(g):
            sums[gid, t] = sums.get((gid, t), 0.0) + value
            counts[gid, t] += 1
        st = group_stats.setdefault(gid, [0.0, 0.0, 0])
        st[0] += total
        st[1] += squares
        st[2] += count
    batch = [sum(st[k] for st in group_stats.values()) for k in range(3)]

    out = []
    for i, m in enumerate(masks):
        adv = torch.zeros_like(m)  # [L_i]
        gid = group_ids[i]
        if len(turn_spans[i]) != len(returns[i]):
            raise ValueError(f"sample {i}: {len(turn_spans[i])} turn spans for {len(returns[i])} turn rewards")
        scale = 1.0
        if std_normalize:
            st = group_stats[gid]
            std = _std(batch[0] - st[0], batch[1] - st[1], int(batch[2] - st[2]))  # the other groups
            if std <= eps:  # the group's other samples
                std = _std(st[0] - padded[i][0], st[1] - padded[i][1], int(st[2] - padded[i][2]))
            scale = std + eps if std > eps else 1.0
        for t, ((start, end), g) in enumerate(zip(turn_spans[i], returns[i])):
            if not 0 <= start <= end <= m.numel():
                raise ValueError(f"sample {i}: turn span ({start}, {end}) outside 0..{m.numel()}")
            if group_size[gid] < 2:
                continue  # a group of one: no baseline
            others = counts[gid, t] - 1
            a = g - (sums[gid, t] - g) / others if others else g
            adv[start:end] = a / scale
        out.append(adv * m)
    return out


# ---------------------------------------------------------------------------------------------
# PPO: generalized advantage estimation over a critic's values
# ---------------------------------------------------------------------------------------------


def ppo_token_rewards(
    reward: float,
    mask: Tensor,
    *,
    turn_rewards: Sequence[float] = (),
    turn_spans: Sequence[tuple[int, int]] = (),
    kl: Tensor | None = None,
    kl_coef: float = 0.0,
) -> Tensor:
    """Per-token rewards r_t of one sample for GAE. mask [L] -> [L].

    * ``turn_rewards[t]`` (what the env returned after assistant turn t) sits on the LAST policy token
      of that turn (``turn_spans[t]``, half-open response offsets), so the value of a later turn never
      sees an earlier turn's reward as its own;
    * the rest of the episode reward, ``reward - sum(turn_rewards)`` (a reward model's score, or the
      whole reward when the env reports no turns), sits on the last policy token of the response;
    * ``-kl_coef * kl_t`` on every policy token when ``kl`` (per-token KL to the reference) is given.

    A turn reward whose span has no policy token (a turn cut off before it sampled anything) joins the
    end-of-episode rest. Tokens the env or the template wrote (mask 0) get 0.
    """
    m = mask.float()
    out = torch.zeros_like(m)  # [L]
    idx = m.nonzero(as_tuple=True)[0]
    if idx.numel() == 0:
        return out
    rest = float(reward) - sum(float(r) for r in turn_rewards)
    for t, r in enumerate(turn_rewards):
        if t < len(turn_spans):
            start, end = turn_spans[t]
            inside = idx[(idx >= start) & (idx < end)]
            if inside.numel():
                out[inside[-1]] += float(r)
                continue
        rest += float(r)
    out[idx[-1]] += rest
    if kl is not None and kl_coef:
        out = out - kl_coef * kl.detach().float() * m
    return out


def gae(token_rewards: Tensor, values: Tensor, mask: Tensor, gamma: float, lambd: float) -> tuple[Tensor, Tensor]:
    """Generalized advantage estimation (Schulman et al. 2016) over the POLICY tokens of one sample.

    Let k_0 < k_1 < ... < k_{K-1} be the response positions with mask 1 (tokens the policy sampled);
    env/tool tokens (mask 0) are not decisions and are skipped. With V_j = values[k_j] (the critic's
    value of the state before token k_j) and r_j = token_rewards[k_j]:

        delta_j = r_j + gamma * V_{j+1} - V_j          (V_K = 0: the episode ends after the last token)
        A_j     = delta_j + gamma * lambd * A_{j+1}    (A_K = 0)
        R_j     = A_j + V_j                            (the critic's regression target)

    So the value at the end of one assistant turn bootstraps from the value at the first token of the
    next turn, and gamma discounts per policy token (an observation in between does not shrink it).
    Mask-0 positions get A = R = 0. token_rewards, values, mask: [L] -> (advantages [L], returns [L]).
    """
    m = mask.float()
    adv = torch.zeros_like(m)
    ret = torch.zeros_like(m)
    idx = m.nonzero(as_tuple=True)[0]
    r = token_rewards.float()[idx].tolist()
    v = values.float()[idx].tolist()
    a_k = [0.0] * len(idx)
    running = 0.0
    for j in range(len(idx) - 1, -1, -1):
        next_v = v[j + 1] if j + 1 < len(idx) else 0.0
        running = r[j] + gamma * next_v - v[j] + gamma * lambd * running
        a_k[j] = running
    if len(idx):
        a = torch.tensor(a_k, dtype=torch.float32)
        adv[idx] = a
        ret[idx] = a + torch.tensor(v, dtype=torch.float32)
    return adv, ret


def ppo_advantages(
    rewards: Rewards,
    loss_masks: Sequence[Tensor],
    values: Sequence[Tensor],
    *,
    turn_rewards: Sequence[Sequence[float]] | None = None,
    turn_spans: Sequence[Sequence[tuple[int, int]]] | None = None,
    kl: Sequence[Tensor] | None = None,
    kl_coef: float = 0.0,
    gamma: float = 1.0,
    lambd: float = 1.0,
) -> tuple[list[Tensor], list[Tensor]]:
    """``--advantage-estimator ppo``: (advantages, returns) per sample, each a list of [L_i] tensors.

    Token rewards from :func:`ppo_token_rewards` (per-turn rewards at the end of their turn, KL
    shaping with ``kl_coef``), then :func:`gae` with the critic's ``values``. Advantages are not
    whitened here: ``--normalize-advantages`` does that for every estimator (slime's flag).
    """
    r = _as_rewards(rewards)
    masks = _as_masks(loss_masks)
    if not (len(masks) == len(values) == r.numel()):
        raise ValueError(f"{r.numel()} rewards, {len(masks)} loss masks and {len(values)} value lists: one per sample")
    advs, rets = [], []
    for i, m in enumerate(masks):
        v = torch.as_tensor(values[i], dtype=torch.float32).reshape(-1)
        if v.numel() != m.numel():
            raise ValueError(f"sample {i}: {v.numel()} values for a {m.numel()}-token response")
        tok = ppo_token_rewards(
            float(r[i]),
            m,
            turn_rewards=turn_rewards[i] if turn_rewards is not None else (),
            turn_spans=turn_spans[i] if turn_spans is not None else (),
            kl=kl[i] if kl is not None else None,
            kl_coef=kl_coef,
        )
        a, ret = gae(tok, v, m, gamma, lambd)
        advs.append(a)
        rets.append(ret)
    return advs, rets


# ---------------------------------------------------------------------------------------------
# Entry point
# ---------------------------------------------------------------------------------------------


def compute_advantages(
    estimator: str,
    *,
    rewards: Rewards,
    group_ids: Sequence[int],
    loss_masks: Sequence[Tensor],
    turn_rewards: Sequence[Sequence[float]] | None = None,
    turn_spans: Sequence[Sequence[tuple[int, int]]] | None = None,
    kl: Sequence[Tensor] | None = None,
    gamma: float = 1.0,
    kl_coef: float = 0.0,
    std_normalize: bool = True,
    per_turn: bool = False,
    episode_ids: Sequence[Hashable] | None = None,
) -> list[Tensor]:
    """Per-token advantages of every sample for ``--advantage-estimator``: a list of [L_i] tensors.

    ``episode_ids`` (``metadata["episode_id"]``) say which samples are segments of one episode: group
    statistics count each episode once (:func:`episode_weights`) and every segment gets its episode's
    advantage. Per-turn credit needs whole episodes (turn returns run across segments): refused for
    an episode in several segments.

    Sequence-level estimators (grpo, gspo, rloo) are broadcast over the response; every result is
    multiplied by the loss mask, so tokens the policy did not sample have advantage 0.
    ``per_turn`` (``--per-turn-credit``) needs grpo/gspo plus ``turn_rewards`` and ``turn_spans``.
    ``kl`` (per-token KL to the reference) is only used by the REINFORCE++ estimators.
    """
    if estimator not in ADVANTAGE_ESTIMATORS:
        raise ValueError(
            f"unknown --advantage-estimator {estimator!r}; choose one of {', '.join(ADVANTAGE_ESTIMATORS)}"
        )
    if estimator == "ppo":
        raise ValueError("--advantage-estimator ppo needs the critic's values: call ppo_advantages")
    masks = _as_masks(loss_masks)
    if len(masks) != _as_rewards(rewards).numel():
        raise ValueError(f"{len(masks)} loss masks for {_as_rewards(rewards).numel()} rewards")
    if kl_coef and kl is None and estimator.startswith("reinforce_plus_plus"):
        raise ValueError("--kl-coef > 0 needs per-token KL (reference log-probs) for REINFORCE++")
    if per_turn:
        if episode_ids is not None and len(set(episode_ids)) < len(episode_ids):
            raise ValueError(
                "--per-turn-credit needs each episode as one sample: a history rewrite (or --history-mode template) "
                "split some into segments; drop one of them"
            )
        if estimator not in ("grpo", "gspo"):
            raise ValueError(f"--per-turn-credit works only with --advantage-estimator grpo or gspo, not {estimator!r}")
        if turn_rewards is None or turn_spans is None:
            raise ValueError("--per-turn-credit needs turn_rewards and turn_spans for every sample")
        return per_turn_grpo(turn_rewards, turn_spans, group_ids, masks, gamma=gamma, std_normalize=std_normalize)

    if estimator in ("grpo", "gspo"):
        seq = grpo(rewards, group_ids, std_normalize=std_normalize, episode_ids=episode_ids)  # [N]
    elif estimator == "rloo":
        seq = rloo(rewards, group_ids, episode_ids=episode_ids)  # [N]
    elif estimator == "reinforce_plus_plus":
        return reinforce_plus_plus(rewards, masks, kl=kl, kl_coef=kl_coef, gamma=gamma)
    else:  # reinforce_plus_plus_baseline
        return reinforce_plus_plus_baseline(rewards, group_ids, masks, kl=kl, kl_coef=kl_coef, episode_ids=episode_ids)
    return [seq[i] * m for i, m in enumerate(masks)]
