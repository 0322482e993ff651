"""Chunked log-probs/entropy from hidden states: the same values and gradients as full logits, less memory.

The reference is the obvious computation: ``log_softmax(head(h) / T)`` gathered at the targets and the
softmax entropy, differentiated by autograd. The trainer tests then check that a whole train step (loss,
metrics, updated weights) is the same with the chunked head as with full logits, on tied and untied
heads, and that a model whose head is not plain (Gemma 2's soft-capping) keeps the full-logits path.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from agentrl.trainer.chunked_logprobs import chunked_log_probs, head_is_plain
from agentrl.trainer.torch_trainer import TorchTrainer
from tests.test_trainer import capture_grads, cfg, make_samples


def reference(h: torch.Tensor, head: nn.Linear, targets: torch.Tensor, t: float):
    z = head(h).float()
    z = z if t in (0.0, 1.0) else z / t
    logp_all = z.log_softmax(-1)
    return logp_all.gather(1, targets[:, None])[:, 0], -(logp_all.exp() * logp_all).sum(-1)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("chunk", [1, 7, 64])
def test_values_and_gradients_match_full_logits(bias, temperature, chunk):
    torch.manual_seed(0)
    n, hdim, vocab = 23, 16, 97  # 23 rows: chunks of 7 leave a remainder
    head = nn.Linear(hdim, vocab, bias=bias)
    h = torch.randn(n, hdim, requires_grad=True)
    targets = torch.randint(0, vocab, (n,))
    w_logp, w_ent = torch.randn(n), torch.randn(n)  # arbitrary upstream gradients for both outputs

    logp, ent = chunked_log_probs(h, head, targets, temperature=temperature, chunk=chunk)
    ((logp * w_logp).sum() + (ent * w_ent).sum()).backward()
    mine = [h.grad.clone(), head.weight.grad.clone()] + ([head.bias.grad.clone()] if bias else [])
    h.grad = None
    head.zero_grad()

    ref_logp, ref_ent = reference(h, head, targets, temperature)
    ((ref_logp * w_logp).sum() + (ref_ent * w_ent).sum()).backward()
    ref = [h.grad, head.weight.grad] + ([head.bias.grad] if bias else [])

    torch.testing.assert_close(logp, ref_logp, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ent, ref_ent, atol=1e-5, rtol=1e-5)
    for a, b in zip(mine, ref):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_an_unused_entropy_costs_no_gradient_and_changes_nothing():
    torch.manual_seed(1)
    head = nn.Linear(8, 50, bias=False)
    h = torch.randn(9, 8, requires_grad=True)
    targets = torch.randint(0, 50, (9,))
    assert chunked_log_probs(h, head, targets, with_entropy=False)[1] is None
    logp, ent = chunked_log_probs(h, head, targets, chunk=4)
    logp.sum().backward()  # entropy never reaches the loss: a metric only
    ref_logp, _ = reference(h.detach().requires_grad_(), head, targets, 1.0)
    g = torch.autograd.grad(ref_logp.sum(), head.weight)[0]
    torch.testing.assert_close(head.weight.grad, g, atol=1e-5, rtol=1e-5)
    assert ent.grad_fn is not None and not torch.isnan(ent).any()


def test_under_bf16_autocast_the_backward_matches_the_forward_distribution():
    """GPU training runs the head under bf16 autocast: the backward must rebuild the same bf16 logits."""
    torch.manual_seed(2)
    n, hdim, vocab = 10, 32, 300
    head = nn.Linear(hdim, vocab, bias=False)
    h = torch.randn(n, hdim, requires_grad=True)
    targets = torch.randint(0, vocab, (n,))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logp, _ = chunked_log_probs(h, head, targets, chunk=4, with_entropy=False)
    logp.sum().backward()
    mine = h.grad.clone(), head.weight.grad.clone()
    h.grad = None
    head.zero_grad()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        z = head(h)  # bf16 logits, as the full-logits path makes them
    ref = z.float().log_softmax(-1).gather(1, targets[:, None])[:, 0]
    ref.sum().backward()
    torch.testing.assert_close(logp, ref.detach(), atol=1e-4, rtol=1e-4)  # the same bf16 logits, forward
    for a, b in zip(mine, (h.grad, head.weight.grad)):  # and backward, to bf16 rounding of the matmuls
        assert (a - b).abs().max() <= 2e-2 * b.abs().max(), (a - b).abs().max()


def test_bad_shapes_are_refused():
    head = nn.Linear(4, 10)
    with pytest.raises(ValueError, match="hidden must be"):
        chunked_log_probs(torch.randn(3, 4), head, torch.zeros(2, dtype=torch.long))
    with pytest.raises(ValueError, match="chunk must be"):
        chunked_log_probs(torch.randn(3, 4), head, torch.zeros(3, dtype=torch.long), chunk=0)


def _step(ckpt, chunked: bool, **kw):
    trainer = TorchTrainer(ckpt, cfg(**kw))
    assert trainer.chunked_logprobs  # a plain Llama head qualifies
    trainer.chunked_logprobs = chunked
    trainer.chunk_logits_above = 0  # chunk even these tiny logits
    samples = make_samples(8, seed=3)
    logps = trainer.compute_log_probs(samples, ref=False).old
    grads = capture_grads(trainer)
    metrics = trainer.train_step(samples)
    weights = {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}
    return logps, metrics, weights, grads[0]


@pytest.mark.parametrize("ckpt_name", ["tiny_ckpt", "tied_ckpt"])
@pytest.mark.parametrize("kw", [{}, {"entropy_coef": 0.01, "logit_temperature": 0.8}])
def test_a_train_step_is_the_same_with_and_without_chunking(request, ckpt_name, kw):
    ckpt = request.getfixturevalue(ckpt_name)
    logps_a, metrics_a, weights_a, grads_a = _step(ckpt, True, **kw)
    logps_b, metrics_b, weights_b, grads_b = _step(ckpt, False, **kw)
    for a, b in zip(logps_a, logps_b):
        assert a == pytest.approx(b, abs=1e-5)
    for k in ("loss", "pg_loss", "entropy", "clipfrac", "grad_norm"):
        assert metrics_a[k] == pytest.approx(metrics_b[k], rel=1e-4, abs=1e-6), k
    assert grads_a.keys() == grads_b.keys()
    for k in grads_a:  # what chunking computes: the same gradient, to float rounding
        torch.testing.assert_close(grads_a[k], grads_b[k], atol=1e-6, rtol=1e-4)
    trained = {n for n, _ in TorchTrainer(ckpt, cfg()).model.named_parameters()}
    for k in weights_a:
        # AdamW's first step moves a weight by ~lr * g / (|g| + eps): where 0 < |g| <= 10 eps that ratio is
        # ill-conditioned (a 1e-10 difference in g moves the weight by ~1e-6), so those elements (~3% here) are
        # compared through their gradients above; every other element must match as tightly as before
        g = grads_a.get(k) if k in trained else None
        steady = torch.ones_like(weights_a[k], dtype=torch.bool) if g is None else (g == 0) | (g.abs() > 1e-7)
        torch.testing.assert_close(weights_a[k][steady], weights_b[k][steady], atol=1e-6, rtol=1e-5)
    # the step moved the weights (an equality of two no-ops would prove nothing)
    assert any(not torch.equal(weights_a[k], v) for k, v in TorchTrainer(ckpt, cfg()).model.state_dict().items())


def test_a_soft_capped_head_keeps_full_logits(tmp_path):
    from transformers import Gemma2Config, Gemma2ForCausalLM, LlamaConfig, LlamaForCausalLM

    small = dict(vocab_size=60, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2)
    capped = Gemma2ForCausalLM(Gemma2Config(**small, num_key_value_heads=1, head_dim=8, final_logit_softcapping=3.0))
    assert not head_is_plain(capped.eval(), torch.device("cpu"))
    assert head_is_plain(LlamaForCausalLM(LlamaConfig(**small)).eval(), torch.device("cpu"))
