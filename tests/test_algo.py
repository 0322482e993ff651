"""Regression tests for agentrl.algo on hand-computed numbers (the arithmetic is in the comments)."""

from __future__ import annotations

import math

import pytest
import torch

from agentrl.algo.advantages import (
    compute_advantages,
    discounted_returns,
    gae,
    grpo,
    masked_whiten,
    per_turn_grpo,
    per_turn_returns,
    ppo_advantages,
    ppo_token_rewards,
    reinforce_plus_plus,
    reinforce_plus_plus_baseline,
    rloo,
)
from agentrl.algo.loss import (
    aggregate,
    entropy_from_logits,
    gspo_loss,
    kl_penalty,
    policy_loss,
    ppo_clip_loss,
    tis_weights,
    value_loss,
)
from agentrl.config import TrainConfig

T = torch.tensor


def close(a, b, tol: float = 1e-5) -> bool:
    return torch.allclose(
        torch.as_tensor(a, dtype=torch.float32), torch.as_tensor(b, dtype=torch.float32), atol=tol, rtol=tol
    )


# ---------------------------------------------------------------------------------------------
# GRPO / Dr.GRPO / RLOO
# ---------------------------------------------------------------------------------------------


def test_grpo_unbiased_std():
    # one group, r = [1, 0, 0, 1]: mean 0.5, deviations ±0.5,
    # unbiased std = sqrt(4 * 0.25 / (4 - 1)) = sqrt(1/3) = 0.57735
    # A = ±0.5 / sqrt(1/3) = ±sqrt(3)/2 = ±0.866025 (eps 1e-6 is below the tolerance)
    a = grpo(T([1.0, 0, 0, 1]), [0, 0, 0, 0])
    s = math.sqrt(3) / 2
    assert close(a, [s, -s, -s, s])


def test_dr_grpo_no_std():
    # Dr.GRPO: A = r - mean = [0.5, -0.5, -0.5, 0.5]
    assert close(grpo(T([1.0, 0, 0, 1]), [0, 0, 0, 0], std_normalize=False), [0.5, -0.5, -0.5, 0.5])


def test_grpo_groups_by_id_not_position():
    # ids [7, 3, 7, 3]: group 7 = r [1, 0] (mean .5, std sqrt(.5/1) = .7071) -> A = [.7071, -.7071]
    #                   group 3 = r [0, 2] (mean 1,  std sqrt(2/1) = 1.4142) -> A = [-.7071, .7071]
    r, ids = [1.0, 0.0, 0.0, 2.0], [7, 3, 7, 3]
    h = math.sqrt(0.5)
    assert close(grpo(T(r), ids), [h, -h, -h, h])
    assert close(grpo(T(r), ids, std_normalize=False), [0.5, -1.0, -0.5, 1.0])
    # shuffled order: each sample keeps its own advantage
    perm = [2, 0, 3, 1]
    shuffled = grpo(T([r[i] for i in perm]), [ids[i] for i in perm])
    assert close(shuffled, [[h, -h, -h, h][i] for i in perm])


def test_grpo_singleton_and_constant_groups():
    # id 5 is alone -> 0 (no NaN from the n-1 std); group 0 all equal -> 0 / (0 + eps) = 0
    a = grpo(T([1.0, 1.0, 1.0]), [0, 0, 5])
    assert close(a, [0.0, 0.0, 0.0]) and not torch.isnan(a).any()
    assert close(grpo(T([3.0]), [1], std_normalize=False), [0.0])


def test_rloo():
    # r = [1, 0, 0, 1]: A_0 = 1 - (0+0+1)/3 = 2/3, A_1 = 0 - (1+0+1)/3 = -2/3
    # (= n/(n-1) * (r - mean) = 4/3 * ±0.5); a singleton (id 9) gets 0
    a = rloo(T([0.0, 1.0, 0.0, 0.0, 1.0]), [9, 1, 1, 1, 1])
    assert close(a, [0.0, 2 / 3, -2 / 3, -2 / 3, 2 / 3])
    # shuffled ids still group correctly: [1, 9, 1, 1, 1]
    assert close(rloo(T([1.0, 0.0, 0.0, 0.0, 1.0]), [1, 9, 1, 1, 1]), [2 / 3, 0.0, -2 / 3, -2 / 3, 2 / 3])


# ---------------------------------------------------------------------------------------------
# REINFORCE++ and REINFORCE++-baseline
# ---------------------------------------------------------------------------------------------


def test_discounted_returns_skip_masked_tokens():
    # masked positions 0 and 2; rewards there [0, 2], gamma .5:
    # G_2 = 2, G_0 = 0 + .5 * 2 = 1 (the mask-0 token 1 is not a discount step), G_1 = 0
    assert close(discounted_returns(T([0.0, 5.0, 2.0]), T([1.0, 0, 1]), 0.5), [1.0, 0.0, 2.0])


def test_masked_whiten():
    # masked values [1, 3] (the 100 is masked out): mean 2, population var 1 -> [-1, 0(masked), 1]
    out = masked_whiten([T([1.0, 100.0]), T([3.0])], [T([1.0, 0]), T([1.0])])
    assert close(out[0], [-1.0, 0.0]) and close(out[1], [1.0])


def test_reinforce_plus_plus():
    # sample 0: mask [1,1,1], reward 1 on the last token, gamma .5 -> G = [.25, .5, 1]
    # sample 1: mask [1,0,1], reward 2 on token 2 -> G_2 = 2, G_0 = .5 * 2 = 1, token 1 -> 0
    # masked G pooled: [.25, .5, 1, 1, 2]: mean .95; squared deviations .49 .2025 .0025 .0025 1.1025
    # sum 1.8, var 1.8/5 = .36, std .6 -> A = (G - .95) / .6
    a = reinforce_plus_plus(T([1.0, 2.0]), [T([1.0, 1, 1]), T([1.0, 0, 1])], gamma=0.5)
    assert close(a[0], [-0.7 / 0.6, -0.45 / 0.6, 0.05 / 0.6])
    assert close(a[1], [0.05 / 0.6, 0.0, 1.05 / 0.6])


def test_reinforce_plus_plus_kl_shaping():
    # kl_coef .5, kl [1, 0, 2], reward 1, gamma 1:
    # token rewards = [-.5, 0, -1 + 1] = [-.5, 0, 0] -> G = [-.5, 0, 0]
    # mean -1/6, deviations [-1/3, 1/6, 1/6], var = (1/9 + 1/36 + 1/36)/3 = 1/18
    # A = dev / sqrt(1/18) = [-sqrt(2), 1/sqrt(2), 1/sqrt(2)]
    a = reinforce_plus_plus(T([1.0]), [T([1.0, 1, 1])], kl=[T([1.0, 0, 2])], kl_coef=0.5, gamma=1.0)
    r2 = math.sqrt(2)
    assert close(a[0], [-r2, 1 / r2, 1 / r2])


def test_reinforce_plus_plus_baseline():
    # one group r = [1, 0, 0, 1] -> r - mean = ±.5 broadcast; masked tokens:
    # .5 .5 | -.5 -.5 | -.5 | .5 -> mean 0, var .25, std .5 -> ±1; mask-0 tokens -> 0
    masks = [T([1.0, 1]), T([1.0, 1, 0]), T([1.0]), T([0.0, 1])]
    a = reinforce_plus_plus_baseline(T([1.0, 0, 0, 1]), [4, 4, 4, 4], masks)
    assert close(a[0], [1, 1]) and close(a[1], [-1, -1, 0]) and close(a[2], [-1]) and close(a[3], [0, 1])


# ---------------------------------------------------------------------------------------------
# Per-turn credit
# ---------------------------------------------------------------------------------------------


def test_per_turn_returns():
    # G_2 = 3; G_1 = 0 + .5 * 3 = 1.5; G_0 = 1 + .5 * 1.5 = 1.75
    assert per_turn_returns([1.0, 0.0, 3.0], 0.5) == [1.75, 1.5, 3.0]


def _per_turn_example():
    # sample a (group 0): response of 7 tokens = turn0 [0,2) | observation [2,4) (mask 0) |
    #   turn1 [4,6) | token 6 (mask 1, but in no turn span -> 0); turn rewards [0, 1]
    # sample c (group 1): alone in its group -> all 0
    # sample b (group 0): 3 tokens = turn0 [0,3), token 2 has mask 0; turn rewards [.5]
    # sample d (group 0): 3 tokens = turn0 [0,1) | observation [1,2) | turn1 [2,3); rewards [1, 0]
    turn_rewards = [[0.0, 1.0], [2.0], [0.5], [1.0, 0.0]]
    turn_spans = [[(0, 2), (4, 6)], [(0, 2)], [(0, 3)], [(0, 1), (2, 3)]]
    group_ids = [0, 1, 0, 0]
    masks = [T([1.0, 1, 0, 0, 1, 1, 1]), T([1.0, 1]), T([1.0, 1, 0]), T([1.0, 0, 1])]
    return turn_rewards, turn_spans, group_ids, masks


def test_per_turn_grpo_hand_computed():
    tr, spans, ids, masks = _per_turn_example()
    # gamma .5: a: G = [.5, 1];  b: G = [.5];  d: G = [1, 0]
    # turn 0 (a, b, d reached it), baseline = mean of the two others:
    #   a: .5 - (.5 + 1) / 2 = -.25;  b: .5 - (.5 + 1) / 2 = -.25;  d: 1 - (.5 + .5) / 2 = .5
    # turn 1 (a, d): a: 1 - 0 = 1;  d: 0 - 1 = -1
    a = per_turn_grpo(tr, spans, ids, masks, gamma=0.5, std_normalize=False)
    assert close(a[0], [-0.25, -0.25, 0, 0, 1, 1, 0])
    assert close(a[1], [0, 0])
    assert close(a[2], [-0.25, -0.25, 0])
    assert close(a[3], [0.5, 0, -1])
    # with std: the only other group (c alone) has one value, no spread, so each sample of group 0 is
    # scaled by the spread of its group's other samples, zero-padded to the longest episode (2 turns):
    #   a: b, d = [.5, 0, 1, 0]: var .6875 / 3;  b: a, d = [.5, 1, 1, 0]: the same;  d: a, b = [.5, 1, .5, 0]: .5 / 3
    a = per_turn_grpo(tr, spans, ids, masks, gamma=0.5, std_normalize=True)
    s1, s2 = math.sqrt(0.6875 / 3), math.sqrt(0.5 / 3)
    assert close(a[0], [-0.25 / s1, -0.25 / s1, 0, 0, 1 / s1, 1 / s1, 0]) and close(a[1], [0, 0])
    assert close(a[2], [-0.25 / s1, -0.25 / s1, 0]) and close(a[3], [0.5 / s2, 0, -1 / s2])
    # same thing through the entry point
    b = compute_advantages(
        "gspo",
        rewards=[1.0, 2.0, 0.5, 1.0],
        group_ids=ids,
        loss_masks=masks,
        turn_rewards=tr,
        turn_spans=spans,
        gamma=0.5,
        per_turn=True,
    )
    assert all(close(u, v) for u, v in zip(a, b))


def test_per_turn_grpo_unmatched_turn_and_scale_from_other_groups():
    # b stops after one turn, a goes on: a's turn 1 has no other sample to compare with, so its
    # baseline is 0 (A = G)
    masks = [T([1.0, 1]), T([1.0])]
    a = per_turn_grpo([[0.0, 1.0], [1.0]], [[(0, 1), (1, 2)], [(0, 1)]], [0, 0], masks, std_normalize=False)
    assert close(a[0], [0, 1]) and close(a[1], [0])
    # with other groups in the batch the scale is their spread, never the sample's own group's:
    # group 1 = [0], [2] (std sqrt(2)); a tiny spread in group 0 does not blow anything up
    tr = [[1.0], [1.0], [1.001], [0.0, 1.0], [0.0], [2.0]]
    spans = [[(0, 1)]] * 3 + [[(0, 1), (1, 2)]] + [[(0, 1)]] * 2
    masks = [T([1.0])] * 3 + [T([1.0, 1])] + [T([1.0])] * 2
    a = per_turn_grpo(tr, spans, [0, 0, 0, 0, 1, 1], masks)
    import statistics

    # group 0 zero-padded to its longest episode = [1, 0] [1, 0] [1.001, 0] [1, 1]: it scales group 1
    s0 = statistics.stdev([1, 0, 1, 0, 1.001, 0, 1, 1])
    assert close(a[4], [(0 - 2) / s0]) and close(a[5], [(2 - 0) / s0])
    # and group 1's spread sqrt(2) scales group 0: the unmatched turn gets 1 / sqrt(2), not 1 / 0.0005
    assert close(a[3], [(0 + 1 - (1 + 1 + 1.001) / 3) / math.sqrt(2), 1 / math.sqrt(2)])
    assert max(abs(float(x)) for x in torch.cat(a)) < 4


def _pooled_baseline(turn_rewards, group_ids):
    """The estimator this project had before (verl issue 7244's failure): one mean over every
    turn return of the group, the sample's own included. Kept here to show the test can tell."""
    returns = [per_turn_returns(r) for r in turn_rewards]
    pool = [g for gid, r in zip(group_ids, returns) for g in r if gid == 0]
    mean = sum(pool) / len(pool)
    return [[g - mean for g in r] for r in returns]


def _two_turn_game(th0: float, th1: float, s: float, c: float):
    """Turn 0 stops (reward s, one turn) with probability 1 - p0 or goes on (intermediate reward c)
    with p0 = sigmoid(th0); a second turn then succeeds (reward 1) with p1 = sigmoid(th1).
    J = (1 - p0) s + p0 (c + p1). Returns the exact gradient of J and, per outcome, its
    probability, turn rewards and grad log pi of each turn as (d th0, d th1)."""
    p0, p1 = 1 / (1 + math.exp(-th0)), 1 / (1 + math.exp(-th1))
    true = (p0 * (1 - p0) * (c + p1 - s), p0 * p1 * (1 - p1))
    outcomes = {
        "stop": (1 - p0, [s], [(-p0, 0.0)]),
        "good": (p0 * p1, [c, 1.0], [(1 - p0, 0.0), (0.0, 1 - p1)]),
        "bad": (p0 * (1 - p1), [c, 0.0], [(1 - p0, 0.0), (0.0, -p1)]),
    }
    return true, outcomes


def _expected_update(outcomes, advantages_of, group_ids):
    """E[ sum_i sum_t A_{i,t} grad log pi(a_{i,t}) ] / N over every joint outcome of the batch."""
    import itertools

    n = len(group_ids)
    e = [0.0, 0.0]
    for joint in itertools.product(outcomes, repeat=n):
        prob = math.prod(outcomes[o][0] for o in joint)
        adv = advantages_of([outcomes[o][1] for o in joint], group_ids)
        for o, a in zip(joint, adv):
            for a_t, (g0, g1) in zip(a, outcomes[o][2]):
                e[0] += prob * a_t * g0 / n
                e[1] += prob * a_t * g1 / n
    return e


def _ours(std_normalize: bool):
    def advantages(turn_rewards, group_ids):
        spans = [[(t, t + 1) for t in range(len(r))] for r in turn_rewards]
        masks = [torch.ones(len(r)) for r in turn_rewards]
        adv = per_turn_grpo(turn_rewards, spans, group_ids, masks, std_normalize=std_normalize)
        return [a.tolist() for a in adv]

    return advantages


def test_per_turn_grpo_is_unbiased_when_the_policy_chooses_when_to_stop():
    """The expected update is the exact policy gradient (a positive multiple of it with std
    normalization), summed over every joint outcome of the batch, when the episodes of a group have
    different numbers of turns chosen by the policy: the case where a baseline or a scale that
    contains the sample's own turns is biased (verl issue 7244)."""
    true, outcomes = _two_turn_game(0.0, 0.0, 1.0, 0.5)  # stopping is worth s = 1 = c + p1, going on too
    assert true[0] == pytest.approx(0.0) and true[1] == pytest.approx(0.125)
    one_group = [0, 0, 0]
    assert _expected_update(outcomes, _ours(False), one_group) == pytest.approx(true, abs=1e-6)
    # the pooled baseline gives "go on" a bonus it has not earned, and shrinks the second turn's
    pooled = _expected_update(outcomes, lambda tr, ids: _pooled_baseline(tr, ids), one_group)
    assert pooled[0] > 0.015 and pooled[1] < 0.1
    # with std normalization: a positive multiple of the gradient, in one group and across two
    for ids in (one_group, [0, 0, 1, 1]):
        got = _expected_update(outcomes, _ours(True), ids)
        assert got[0] == pytest.approx(0.0, abs=1e-6) and got[1] > 0.1, (ids, got)
    true, outcomes = _two_turn_game(0.3, -0.4, 0.6, 0.5)  # both components non-zero
    for ids in ([0, 0, 0], [0, 0, 1, 1]):
        got = _expected_update(outcomes, _ours(True), ids)
        assert got[0] / true[0] == pytest.approx(got[1] / true[1], rel=1e-4) and got[0] / true[0] > 0, (ids, got)


def test_per_turn_grpo_bad_spans():
    tr, spans, ids, masks = _per_turn_example()
    with pytest.raises(ValueError):
        per_turn_grpo(tr, [[(0, 2)], [(0, 2)], [(0, 3)]], ids, masks)  # 1 span for 2 rewards
    with pytest.raises(ValueError):
        per_turn_grpo(tr, [[(0, 2), (4, 9)], [(0, 2)], [(0, 3)]], ids, masks)  # past the response


# ---------------------------------------------------------------------------------------------
# PPO: GAE over a critic's values
# ---------------------------------------------------------------------------------------------


def test_gae_multi_turn_hand_computed():
    """Two assistant turns (tokens 0-2 and 5-6) around two env tokens (3-4, mask 0).

    Token rewards: turn 1's 0.5 on token 2, turn 2's 1.0 plus the rest of the episode reward
    (2.0 - 1.5 = 0.5) on token 6. Policy tokens k = 0, 1, 2, 5, 6 with V = .1 .2 .3 .4 .5 (the env
    tokens' values, 9, are never read); gamma .9, lambda .5 (gamma * lambda = .45):
      delta = r + .9 V_next - V:  .08, .07, .56 (turn 1's end bootstraps from token 5), .05, 1.0
      A (from the end):           1.0, .05 + .45 = .5, .56 + .225 = .785, .07 + .35325 = .42325,
                                  .08 + .1904625 = .2704625
      R = A + V
    """
    mask = T([1.0, 1, 1, 0, 0, 1, 1])
    tok = ppo_token_rewards(2.0, mask, turn_rewards=[0.5, 1.0], turn_spans=[(0, 3), (5, 7)])
    assert close(tok, [0, 0, 0.5, 0, 0, 0, 1.5])
    values = T([0.1, 0.2, 0.3, 9.0, 9.0, 0.4, 0.5])
    adv, ret = gae(tok, values, mask, gamma=0.9, lambd=0.5)
    assert close(adv, [0.2704625, 0.42325, 0.785, 0, 0, 0.5, 1.0])
    assert close(ret, [0.3704625, 0.62325, 1.085, 0, 0, 0.9, 1.5])
    # the same through the batch entry point, with a second sample that has no turn record
    advs, rets = ppo_advantages(
        [2.0, 1.0],
        [mask, T([0.0, 1, 1])],
        [values, T([0.0, 0.25, 0.5])],
        turn_rewards=[[0.5, 1.0], []],
        turn_spans=[[(0, 3), (5, 7)], []],
        gamma=0.9,
        lambd=0.5,
    )
    assert close(advs[0], adv) and close(rets[0], ret)
    # sample 2: reward 1.0 on its last token; delta = (.9 * .5 - .25, 1 - .5) = (.2, .5); A = (.2 + .45 * .5, .5)
    assert close(advs[1], [0, 0.425, 0.5]) and close(rets[1], [0, 0.675, 1.0])


def test_gae_lambda_one_zero_values_is_reward_to_go():
    """gamma = lambda = 1 and V = 0: A_t = R_t = the sum of the rewards from t on (Monte Carlo)."""
    mask = T([1.0, 0, 1, 1])
    tok = T([0.25, 0.0, 0.5, 1.0])
    adv, ret = gae(tok, torch.zeros(4), mask, gamma=1.0, lambd=1.0)
    assert close(adv, [1.75, 0, 1.5, 1.0]) and close(ret, adv)


def test_ppo_token_rewards_kl_and_unplaceable_turns():
    mask = T([0.0, 1, 1, 0])
    # turn 2's span holds no policy token: its reward joins the rest on the last policy token
    tok = ppo_token_rewards(3.0, mask, turn_rewards=[1.0, 2.0], turn_spans=[(0, 2), (3, 4)])
    assert close(tok, [0, 1.0, 2.0, 0])
    tok = ppo_token_rewards(1.0, mask, kl=T([5.0, 0.2, 0.4, 5.0]), kl_coef=0.5)
    assert close(tok, [0, -0.1, 1.0 - 0.2, 0])  # KL only on policy tokens
    assert close(ppo_token_rewards(1.0, torch.zeros(3)), [0, 0, 0])  # nothing sampled: nothing to credit
    with pytest.raises(ValueError, match="values for a"):
        ppo_advantages([1.0], [T([1.0, 1])], [T([0.0])])


def test_value_loss_clip_hand_computed():
    """v = (1.0, 0.1), old = (0.5, 0.0), R = (2.0, 0.0), clip 0.2:
    token 0: clipped value .7, losses (1-2)^2 = 1 and (.7-2)^2 = 1.69 -> .5 * 1.69 = .845, the clipped
    branch (no gradient: v moved further than the clip); token 1: both .01 -> .005. Mean .425."""
    v = T([1.0, 0.1], requires_grad=True)
    loss, m = value_loss(
        v,
        T([0.5, 0.0]),
        T([2.0, 0.0]),
        T([1.0, 1.0]),
        torch.zeros(2, dtype=torch.long),
        value_clip=0.2,
        per_token=True,
        num_tokens=2,
        num_seqs=1,
    )
    assert close(loss, 0.425) and close(m["value_loss"], 0.425)
    assert close(m["value_clipfrac"], 0.5) and close(m["values_mean"], 0.55)
    loss.backward()
    assert close(v.grad, [0.0, 0.05])  # token 1: .5 * 2 * (.1 - 0) / 2 tokens


# ---------------------------------------------------------------------------------------------
# compute_advantages
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("estimator", ["grpo", "gspo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline"])
def test_compute_advantages_masked_tokens_zero(estimator):
    torch.manual_seed(5)
    masks = [T([0.0, 1, 1, 0]), T([1.0, 0, 1]), T([1.0, 1]), T([0.0, 1])]
    out = compute_advantages(
        estimator,
        rewards=T([1.0, 0, 0, 1]),
        group_ids=[1, 1, 2, 2],
        loss_masks=masks,
        kl=[torch.rand(len(m)) for m in masks],
        kl_coef=0.1,
        gamma=0.9,
    )
    assert [len(a) for a in out] == [4, 3, 2, 2]
    for a, m in zip(out, masks):
        assert torch.all(a[m == 0] == 0)
        assert torch.all(a[m == 1] != 0)


def test_compute_advantages_broadcast_grpo():
    # group [1, 0]: std sqrt(.5) -> A = ±.7071, broadcast over each sample's masked tokens
    out = compute_advantages("grpo", rewards=[1.0, 0.0], group_ids=[3, 3], loss_masks=[T([1.0, 0, 1]), T([1.0])])
    h = math.sqrt(0.5)
    assert close(out[0], [h, 0, h]) and close(out[1], [-h])
    out = compute_advantages(
        "grpo", rewards=[1.0, 0.0], group_ids=[3, 3], loss_masks=[T([1.0]), T([1.0])], std_normalize=False
    )
    assert close(out[0], [0.5]) and close(out[1], [-0.5])


def test_compute_advantages_errors():
    kw = dict(rewards=[1.0], group_ids=[0], loss_masks=[T([1.0])])
    with pytest.raises(ValueError, match="--advantage-estimator"):
        compute_advantages("ppo", **kw)
    with pytest.raises(ValueError, match="--per-turn-credit"):
        compute_advantages("rloo", per_turn=True, turn_rewards=[[1.0]], turn_spans=[[(0, 1)]], **kw)
    with pytest.raises(ValueError, match="--per-turn-credit"):
        compute_advantages("grpo", per_turn=True, **kw)


# ---------------------------------------------------------------------------------------------
# Loss terms
# ---------------------------------------------------------------------------------------------


def test_ppo_clip_asymmetric_bounds():
    # eps_clip .2, eps_clip_high .28 -> ratio clipped to [0.8, 1.28]
    ratio = T([1.5, 1.25, 0.5, 0.5, 1.5])
    adv = T([1.0, 1.0, -1.0, 1.0, -1.0])
    loss, clipped = ppo_clip_loss(ratio.log(), torch.zeros(5), adv, 0.2, 0.28)
    # 1.5, A=+1: min(1.5, 1.28) -> loss -1.28, clipped (above 1 + eps_high)
    # 1.25, A=+1: inside [0.8, 1.28] (would be clipped by a symmetric .2) -> -1.25, not clipped
    # 0.5, A=-1: min(-0.5, -0.8) = -0.8 -> loss 0.8, clipped (below 1 - eps)
    # 0.5, A=+1: min(0.5, 0.8) = 0.5 -> -0.5, not clipped (pessimistic branch)
    # 1.5, A=-1: min(-1.5, -1.28) = -1.5 -> 1.5, not clipped
    assert close(loss, [-1.28, -1.25, 0.8, -0.5, 1.5])
    assert clipped.tolist() == [True, False, True, False, False]


def test_gspo_gradient_matches_sequence_formula():
    torch.manual_seed(0)
    seq_ids = T([0, 0, 0, 1, 1, 2])
    mask = T([1.0, 1, 0, 1, 1, 1])
    old = torch.randn(6) - 1
    adv = T([1.0, 1, 1, -0.5, -0.5, 2.0])
    delta = T([0.1, -0.05, 3.0, 0.02, 0.01, 0.6])  # seq 2: s = e^.6 = 1.82 > 1.28 -> clipped
    logp = (old + delta).requires_grad_(True)
    loss_t, clipped = gspo_loss(logp, old, adv, mask, seq_ids, 3, 0.2, 0.28)
    total = aggregate(loss_t, mask, seq_ids, per_token=False, num_tokens=5, num_seqs=3)
    (g_tok,) = torch.autograd.grad(total, logp)

    # reference: s_i = exp(mean_{masked t in i}(logp - old)) with full autograd,
    # L = (1/3) sum_i -min(s_i A_i, clip(s_i, .8, 1.28) A_i)
    x = (old + delta).requires_grad_(True)
    ref = 0.0
    for idx in [[0, 1], [3, 4], [5]]:
        s = torch.exp((x[idx] - old[idx]).mean())
        a = adv[idx[0]]
        ref = ref - torch.minimum(s * a, s.clamp(0.8, 1.28) * a) / 3
    (g_ref,) = torch.autograd.grad(ref, x)
    assert close(total, ref) and close(g_tok, g_ref)
    assert g_tok[2] == 0 and g_tok[5] == 0  # masked token; clipped sequence
    assert clipped.tolist() == [False] * 5 + [True]


def test_gspo_equals_ppo_for_one_token_sequences():
    logp, old, adv = T([-1.0, -2.0, -0.5]), T([-1.2, -1.9, -0.5]), T([1.0, -1.0, 0.5])
    ids, m = T([0, 1, 2]), torch.ones(3)
    a, ca = gspo_loss(logp, old, adv, m, ids, 3, 0.2, 0.2)
    b, cb = ppo_clip_loss(logp, old, adv, 0.2, 0.2)
    assert close(a, b) and torch.equal(ca, cb)


def test_kl_estimators():
    logp, ref = T([0.0, -1.0]), T([-1.0, 0.0])
    # log ratio = logp - ref = [1, -1]
    assert close(kl_penalty(logp, ref, "k1"), [1.0, -1.0])
    assert close(kl_penalty(logp, ref, "k2"), [0.5, 0.5])  # .5 * 1^2
    # k3: ref - logp = [-1, 1] -> e^-1 + 1 - 1 = .367879; e^1 - 1 - 1 = .718282
    assert close(kl_penalty(logp, ref, "k3"), [math.exp(-1), math.e - 2])
    torch.manual_seed(1)
    a, b = torch.randn(1000) * 3, torch.randn(1000) * 3
    assert (kl_penalty(a, b, "k3") >= 0).all() and (kl_penalty(a, b, "k2") >= 0).all()
    assert close(kl_penalty(a, a, "k3"), torch.zeros(1000))
    with pytest.raises(ValueError, match="--kl-loss-type"):
        kl_penalty(a, b, "k4")


def test_tis_truncation():
    # exp(old - rollout) = [.5, 3, 1] -> min(., 2) = [.5, 2, 1]; detached
    old = T([math.log(0.5), math.log(3.0), 0.0], requires_grad=True)
    w = tis_weights(old, torch.zeros(3), 2.0)
    assert close(w, [0.5, 2.0, 1.0]) and not w.requires_grad


def test_entropy_matches_categorical():
    torch.manual_seed(2)
    logits = torch.randn(7, 11) * T([[1.0]] * 3 + [[50.0]] * 4)  # include very peaked rows
    ref = torch.distributions.Categorical(logits=logits).entropy()
    assert close(entropy_from_logits(logits, chunk_size=3), ref, 1e-4)
    assert close(entropy_from_logits(torch.zeros(2, 4)), [math.log(4)] * 2)  # uniform: log V
    # -inf entries (banned tokens) contribute 0 and keep gradients finite
    z = T([[0.0, 0.0, -float("inf")]], requires_grad=True)
    h = entropy_from_logits(z)
    h.sum().backward()
    assert close(h, [math.log(2)]) and torch.isfinite(z.grad).all()


def test_aggregate_hand_computed_and_micro_batches():
    v = T([1.0, 2, 3, 4, 5, 6])
    seq = T([0, 0, 0, 1, 1, 2])
    m = T([1.0, 1, 0, 1, 0, 0])
    # per-token: (1 + 2 + 4) / 3 masked tokens = 7/3
    assert close(aggregate(v, m, seq, per_token=True, num_tokens=3, num_seqs=3), 7 / 3)
    # per-seq: seq0 mean (1+2)/2 = 1.5, seq1 4, seq2 no masked token -> 0; (1.5 + 4 + 0)/3 = 11/6
    assert close(aggregate(v, m, seq, per_token=False, num_tokens=3, num_seqs=3), 11 / 6)

    # two micro-batches (seq ids re-based per micro-batch) sum to the whole-batch value
    torch.manual_seed(3)
    v, m = torch.randn(10), (torch.rand(10) > 0.3).float()
    seq = T([0, 0, 0, 1, 1, 2, 2, 2, 2, 3])
    n_tok, n_seq = float(m.sum()), 4
    for per_token in (True, False):
        whole = aggregate(v, m, seq, per_token=per_token, num_tokens=n_tok, num_seqs=n_seq)
        parts = aggregate(v[:5], m[:5], seq[:5], per_token=per_token, num_tokens=n_tok, num_seqs=n_seq) + aggregate(
            v[5:], m[5:], seq[5:] - 2, per_token=per_token, num_tokens=n_tok, num_seqs=n_seq
        )
        assert close(whole, parts)


def test_policy_loss_takes_any_loss_config_not_only_train_config():
    """The loss math needs only agentrl.algo.spec.LossConfig's attributes: a plain namespace works."""
    from types import SimpleNamespace

    knobs = dict(
        loss_type="policy_loss",
        advantage_estimator="grpo",
        eps_clip=0.2,
        use_tis=False,
        tis_threshold=2.0,
        use_kl_loss=True,
        kl_loss_coef=0.1,
        kl_loss_type="k3",
        entropy_coef=0.01,
        calculate_per_token_loss=False,
    )
    old = T([-1.0, -2.0, -3.0])
    logp = old + T([0.3, -0.4, 0.1])
    adv, m, seq, ref, ent = T([1.0, -3.0, 5.0]), T([1.0, 1, 1]), T([0, 0, 1]), old - 0.2, T([1.0, 2.0, 3.0])
    kw = dict(num_tokens=3, num_seqs=2, ref_logp=ref, entropy=ent)
    a, ma = policy_loss(logp, old, adv, m, seq, TrainConfig(**knobs, eps_clip_high=0.28), **kw)
    b, mb = policy_loss(logp, old, adv, m, seq, SimpleNamespace(**knobs, clip_high=0.28), **kw)
    assert close(a, b) and ma == mb
    c, _ = policy_loss(logp, old, adv, m, seq, SimpleNamespace(**knobs, clip_high=0.2), **kw)
    assert not close(a, c)  # clip_high is read: the clip-higher bound changes this batch's loss


def test_policy_loss_hand_computed():
    cfg = TrainConfig(
        use_kl_loss=True, kl_loss_coef=0.1, kl_loss_type="k1", entropy_coef=0.01, calculate_per_token_loss=True
    )
    old = T([-1.0, -2.0, -3.0])
    logp = old.clone().requires_grad_(True)  # ratio 1 everywhere
    adv, m, seq = T([1.0, 3.0, 5.0]), T([1.0, 1, 0]), T([0, 0, 1])
    ref = old - T([0.5, 0.1, 9.0])
    ent = T([1.0, 2.0, 100.0])
    loss, met = policy_loss(logp, old, adv, m, seq, cfg, num_tokens=2, num_seqs=2, ref_logp=ref, entropy=ent)
    # pg = -(1 + 3)/2 = -2; kl (k1) = (.5 + .1)/2 = .3; entropy = (1 + 2)/2 = 1.5
    # loss = -2 + .1 * .3 - .01 * 1.5 = -1.985
    assert close(loss, -1.985)
    assert met["pg_loss"] == pytest.approx(-2.0) and met["kl"] == pytest.approx(0.3)
    assert met["entropy"] == pytest.approx(1.5) and met["clipfrac"] == 0.0 and met["ratio_mean"] == pytest.approx(1.0)
    # TIS: exp(old - rollout) = [.5, 4 -> 2] -> pg = -(.5 * 1 + 2 * 3)/2 = -3.25
    cfg2 = TrainConfig(use_tis=True, tis_threshold=2.0, calculate_per_token_loss=True)
    rollout = old - T([math.log(0.5), math.log(4.0), 0.0])
    loss, met = policy_loss(logp, old, adv, m, seq, cfg2, num_tokens=2, num_seqs=2, rollout_logp=rollout)
    assert close(loss, -3.25)
    with pytest.raises(ValueError, match="--use-tis"):
        policy_loss(logp, old, adv, m, seq, cfg2, num_tokens=2, num_seqs=2)


@pytest.mark.parametrize("estimator", ["grpo", "gspo"])
@pytest.mark.parametrize("per_token", [True, False])
def test_policy_loss_micro_batches_sum(estimator, per_token):
    torch.manual_seed(4)
    cfg = TrainConfig(
        advantage_estimator=estimator,
        calculate_per_token_loss=per_token,
        use_kl_loss=True,
        kl_loss_coef=0.1,
        kl_loss_type="k3",
        entropy_coef=0.01,
        eps_clip=0.1,
    )
    n = 9
    logp, old, ref = torch.randn(n) * 0.2 - 1, torch.randn(n) * 0.2 - 1, torch.randn(n) * 0.2 - 1
    adv, ent, m = torch.randn(n), torch.rand(n), T([1.0, 1, 0, 1, 1, 1, 0, 1, 1])
    seq = T([0, 0, 0, 1, 1, 2, 2, 2, 3])
    kw = dict(num_tokens=float(m.sum()), num_seqs=4)
    whole, mw = policy_loss(logp, old, adv, m, seq, cfg, ref_logp=ref, entropy=ent, **kw)
    a, ma = policy_loss(logp[:5], old[:5], adv[:5], m[:5], seq[:5], cfg, ref_logp=ref[:5], entropy=ent[:5], **kw)
    b, mb = policy_loss(logp[5:], old[5:], adv[5:], m[5:], seq[5:] - 2, cfg, ref_logp=ref[5:], entropy=ent[5:], **kw)
    assert close(whole, a + b)
    for k in mw:
        assert mw[k] == pytest.approx(ma[k] + mb[k], abs=1e-6)


@pytest.mark.parametrize("estimator", ["grpo", "gspo"])
@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_grpo_step_moves_log_prob(estimator, sign):
    # 3-logit toy policy; two samples of one prompt drew tokens 0 and 1.
    # rewards [1, 0] (or flipped) -> GRPO advantages [+.7071, -.7071] (or flipped)
    z = torch.zeros(3, requires_grad=True)
    tokens = T([0, 1])
    rewards = [1.0, 0.0] if sign > 0 else [0.0, 1.0]
    adv = compute_advantages(estimator, rewards=rewards, group_ids=[0, 0], loss_masks=[T([1.0]), T([1.0])])
    cfg = TrainConfig(advantage_estimator=estimator)
    opt = torch.optim.SGD([z], lr=0.5)
    before = torch.log_softmax(z, -1)[0].item()
    logp = torch.log_softmax(z, -1)[tokens]  # [2]
    loss, _ = policy_loss(logp, logp.detach(), torch.cat(adv), torch.ones(2), T([0, 1]), cfg, num_tokens=2, num_seqs=2)
    loss.backward()
    opt.step()
    after = torch.log_softmax(z, -1)[0].item()
    assert (after - before) * sign > 1e-3


def test_imports():
    from agentrl.algo.advantages import compute_advantages as ca  # noqa: F401
    from agentrl.algo.loss import policy_loss as pl  # noqa: F401


@pytest.mark.parametrize("estimator", ["reinforce_plus_plus", "reinforce_plus_plus_baseline"])
def test_kl_in_the_reward_fetches_reference_log_probs_for_both_reinforce_estimators(estimator):
    """--kl-coef folds KL into the reward of both REINFORCE++ variants: the loop must compute reference
    log-probs for either (the baseline variant used to raise at its first train step without them)."""

    from agentrl.config import RunConfig, TrainConfig
    from agentrl.runtime.recipes import PolicyGradient

    cfg = RunConfig(train=TrainConfig(advantage_estimator=estimator, kl_coef=0.1))
    old, ref = PolicyGradient(cfg, None).needs_log_probs()
    assert old and ref
    cfg = RunConfig(train=TrainConfig(advantage_estimator=estimator, kl_coef=0.0))
    assert PolicyGradient(cfg, None).needs_log_probs() == (False, False)
    assert TrainConfig(advantage_estimator=estimator, kl_coef=0.1).needs_ref_model  # the trainers load it


def test_kl_coef_refused_where_it_would_be_ignored():
    """grpo has no token rewards to fold a KL into: --kl-coef was silently ignored there."""
    with pytest.raises(ValueError, match="--kl-coef"):
        TrainConfig(advantage_estimator="grpo", kl_coef=0.1).validate()
    TrainConfig(advantage_estimator="ppo", kl_coef=0.1).validate()
