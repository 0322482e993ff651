"""Lean RMSNorm / SwiGLU: the same values and gradients as the modules' own forward, fewer saved tensors.

Each function is checked against the obvious autograd computation; :func:`make_lean` must swap every
Llama norm and MLP, leave modules that compute something else alone, and a whole train step must be
the same with and without the swap.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from agentrl.trainer.lean_activations import _RMSNorm, _SwiGLU, _SwiGLUDown, make_lean
from agentrl.trainer.torch_trainer import TorchTrainer
from tests.test_trainer import cfg, make_samples


def _grads(fn, *inputs):
    inputs = [t.detach().clone().requires_grad_(True) for t in inputs]
    y = fn(*inputs)
    up = torch.randn(y.shape, generator=torch.Generator().manual_seed(5))
    return [y.detach(), *torch.autograd.grad((y * up).sum(), inputs)]


def test_functions_match_plain_autograd():
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(3, 7, 16, generator=g), torch.randn(16, generator=g)

    def norm(x, w):
        xf = x.float()
        return w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype)

    gate, up, down = (
        torch.randn(3, 7, 24, generator=g),
        torch.randn(3, 7, 24, generator=g),
        torch.randn(16, 24, generator=g),
    )
    pairs = [
        (lambda x, w: _RMSNorm.apply(x, w, 1e-6), norm, (x, w)),
        (_SwiGLU.apply, lambda a, b: F.silu(a) * b, (gate, up)),
        (_SwiGLUDown.apply, lambda a, b, d: F.linear(F.silu(a) * b, d), (gate, up, down)),
    ]
    for lean, plain, inputs in pairs:
        for a, b in zip(_grads(lean, *inputs), _grads(plain, *inputs)):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_make_lean_swaps_llama_modules_and_leaves_others(tiny_ckpt):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_ckpt)
    layers = model.config.num_hidden_layers
    assert make_lean(model) == 3 * layers + 1  # two norms and an MLP per layer, and the final norm

    class OnePlusNorm(nn.Module):  # Gemma's (1 + weight) scale: same attributes, another function
        def __init__(self):
            super().__init__()
            self.weight, self.variance_epsilon = nn.Parameter(torch.randn(8)), 1e-6

        def forward(self, x):
            return (1 + self.weight) * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)

    OnePlusNorm.__name__ = "OnePlusRMSNorm"

    class GeluMLP(nn.Module):
        def __init__(self):
            super().__init__()
            self.gate_proj, self.up_proj, self.down_proj = nn.Linear(8, 12), nn.Linear(8, 12), nn.Linear(12, 8)
            self.act_fn = nn.GELU()

        def forward(self, x):
            return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))

    assert make_lean(nn.Sequential(OnePlusNorm(), GeluMLP())) == 0


def _plain(trainer: TorchTrainer) -> None:
    for m in trainer.model.modules():
        m.__dict__.pop("forward", None)  # back to the class's own forward


@pytest.mark.parametrize("kw", [{}, {"gradient_checkpointing": True, "entropy_coef": 0.01}])
def test_a_train_step_is_the_same_with_lean_modules(tiny_ckpt, kw):
    results = []
    for lean in (True, False):
        trainer = TorchTrainer(tiny_ckpt, cfg(**kw))
        assert trainer.lean_modules > 0
        if not lean:
            _plain(trainer)
        samples = make_samples(8, seed=4)
        metrics = trainer.train_step(samples)
        results.append((metrics, {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}))
    (ma, wa), (mb, wb) = results
    for k in ("loss", "pg_loss", "entropy", "grad_norm"):
        assert ma[k] == pytest.approx(mb[k], rel=1e-4, abs=1e-6), k
    for k in wa:
        torch.testing.assert_close(wa[k], wb[k], atol=1e-6, rtol=1e-5)
