"""Keep fewer activations for backward: RMSNorm and the SwiGLU MLP as autograd functions that recompute.

Why: after the weights and AdamW state, a CPU train step's peak memory is the activations autograd keeps
for backward, ~1.5 MB per token for SmolLM2 (30 layers) in fp32. Two blocks keep more than they need,
because each elementwise op saves its own inputs:

* RMSNorm keeps its input *and* the normalized copy; here only the input and one scalar per row
  (``rstd``) are kept, and the normalized copy is recomputed in backward;
* the SwiGLU MLP ``down(silu(gate(x)) * up(x))`` keeps ``gate``, ``silu(gate)``, ``up`` and their
  product (four ``[T, intermediate]`` tensors); here ``gate`` and ``up`` only, with ``silu`` and the
  product recomputed in backward (elementwise work, cheap beside the three matmuls).

That is about a third of the activations, at the same speed (Megatron calls this selective
recompute; Liger's fused kernels do it on GPU). :func:`make_lean` swaps the forward of the modules
that qualify and checks, on the model itself, that its outputs and gradients are unchanged: a module
that computes anything else (Gemma's ``1 + weight`` norm, another activation) keeps its own forward.
"""

from __future__ import annotations

import types
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


class _RMSNorm(torch.autograd.Function):
    """``weight * (x * rsqrt(mean(x^2) + eps)).to(x.dtype)`` keeping ``x`` and ``rstd`` only."""

    @staticmethod
    def forward(ctx: Any, x, weight, eps: float):  # type: ignore[override]
        xf = x.float()
        rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        ctx.save_for_backward(x, weight, rstd)
        return weight * (xf * rstd).to(x.dtype)

    @staticmethod
    def backward(ctx: Any, g):  # type: ignore[override]
        x, weight, rstd = ctx.saved_tensors
        xhat = x.float() * rstd
        g_weight = None
        if ctx.needs_input_grad[1]:
            g_weight = (g * xhat.to(x.dtype)).reshape(-1, x.shape[-1]).sum(0).to(weight.dtype)
        g_xhat = (g * weight).float()
        g_x = rstd * (g_xhat - xhat * (g_xhat * xhat).mean(-1, keepdim=True))
        return g_x.to(x.dtype), g_weight, None


class _SwiGLU(torch.autograd.Function):
    """``silu(gate) * up`` keeping ``gate`` and ``up`` only."""

    @staticmethod
    def forward(ctx: Any, gate, up):  # type: ignore[override]
        ctx.save_for_backward(gate, up)
        return F.silu(gate) * up

    @staticmethod
    def backward(ctx: Any, g):  # type: ignore[override]
        gate, up = ctx.saved_tensors
        s = torch.sigmoid(gate)
        g_up = g * (gate * s)
        g_gate = g * up * (s * (1 + gate * (1 - s)))
        return g_gate, g_up


class _SwiGLUDown(torch.autograd.Function):
    """``down(silu(gate) * up)``: the product is recomputed in backward, not kept for ``down``'s weight gradient."""

    @staticmethod
    def forward(ctx: Any, gate, up, weight):  # type: ignore[override]
        ctx.save_for_backward(gate, up, weight)
        return F.linear(F.silu(gate) * up, weight.to(gate.dtype))

    @staticmethod
    def backward(ctx: Any, g):  # type: ignore[override]
        gate, up, weight = ctx.saved_tensors
        s = torch.sigmoid(gate)
        silu = gate * s
        g_prod = g @ weight.to(g.dtype)
        g_weight = None
        if ctx.needs_input_grad[2]:
            prod = silu * up
            g_weight = (g.reshape(-1, g.shape[-1]).t() @ prod.reshape(-1, prod.shape[-1])).to(weight.dtype)
        g_up = g_prod * silu
        g_gate = g_prod * up * (s * (1 + gate * (1 - s)))
        return g_gate, g_up, g_weight


def _norm_forward(self: nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
    return _RMSNorm.apply(hidden_states, self.weight, self.variance_epsilon)


def _mlp_forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    # the plain path for these; and for a down projection that is no plain linear (a LoRA layer: its adapter
    # keeps the product for its own gradient, gate and up are still kept once instead of twice)
    if (
        not isinstance(self.down_proj, nn.Linear)
        or self.down_proj.bias is not None
        or torch.is_autocast_enabled(x.device.type)
    ):
        return self.down_proj(_SwiGLU.apply(self.gate_proj(x), self.up_proj(x)))
    return _SwiGLUDown.apply(self.gate_proj(x), self.up_proj(x), self.down_proj.weight)


def _is_rmsnorm(m: nn.Module) -> bool:
    w = getattr(m, "weight", None)
    return (
        type(m).__name__.endswith("RMSNorm")
        and isinstance(w, nn.Parameter)
        and w.dim() == 1
        and isinstance(getattr(m, "variance_epsilon", None), float)
    )


def _is_swiglu(m: nn.Module) -> bool:
    parts = [getattr(m, n, None) for n in ("gate_proj", "up_proj", "down_proj")]
    act = getattr(m, "act_fn", None)  # nn.SiLU, or transformers' SiLUActivation (the check below confirms it)
    # linear layers, or layers wrapping one (PEFT's LoRA layers keep theirs as base_layer); the check below confirms
    linear = all(isinstance(p, nn.Linear) or isinstance(getattr(p, "base_layer", None), nn.Linear) for p in parts)
    return linear and isinstance(act, nn.Module) and "SiLU" in type(act).__name__


def make_lean(model: nn.Module) -> int:
    """Swap in the lean forward on every RMSNorm and SwiGLU MLP of ``model`` that computes the same thing.

    Each candidate is checked once on a random input (forward values and input/weight gradients within
    float rounding of its own forward) before it is swapped. Returns how many modules were swapped.
    """
    swapped = 0
    for module in model.modules():
        if _is_rmsnorm(module):
            lean = _norm_forward
            width = module.weight.shape[0]
        elif _is_swiglu(module):
            lean = _mlp_forward
            width = module.gate_proj.in_features
        else:
            continue
        if _same(module, types.MethodType(lean, module), width):
            module.forward = types.MethodType(lean, module)  # type: ignore[method-assign]
            swapped += 1
    return swapped


def _same(module: nn.Module, lean: Any, width: int) -> bool:
    """Whether ``lean`` matches ``module``'s own forward on a random [2, 5, width] input, gradients included."""
    params = [p for p in module.parameters() if p.requires_grad]
    g = torch.Generator().manual_seed(0)
    weight = next(iter(module.parameters()))
    x = torch.randn(2, 5, width, generator=g).to(weight.device, weight.dtype)
    results = []
    with torch.enable_grad():  # a trainer built under no_grad still checks with gradients
        for fn in (module.forward, lean):
            out = _forward_and_grads(fn, x, params)
            if out is None:
                return False
            results.append(out)
    return all(
        (a is None and b is None) or (a is not None and b is not None and _close(a, b)) for a, b in zip(*results)
    )


def _forward_and_grads(fn: Any, x: torch.Tensor, params: list[torch.Tensor]) -> list[Any] | None:
    xi = x.clone().requires_grad_(True)
    try:
        y = fn(xi)
    except Exception:  # noqa: BLE001 - a forward with other arguments: not ours to replace
        return None
    up = torch.randn(y.shape, generator=torch.Generator().manual_seed(1)).to(y.device, y.dtype)
    return [y.detach(), *torch.autograd.grad((y * up).sum(), [xi, *params], allow_unused=True)]


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal up to float rounding, relative to the tensor's scale (a sum over 1,536 products rounds differently)."""
    a, b = a.float(), b.float()
    return a.shape == b.shape and bool((a - b).abs().max() <= 1e-5 + 1e-4 * b.abs().max())
