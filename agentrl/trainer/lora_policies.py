"""Several policies in one trainer: a PEFT adapter per ``--policy`` on the shared base, trained from one mixed stream.

A run with ``--policy solver --policy judge`` holds one frozen base and one LoRA adapter per policy, each added by
PEFT under the policy's name (``add_adapter``; agentrl writes no LoRA layer). A packed micro-batch may hold rows of
several policies; one forward and one backward run them all, each token through its own policy's adapter only:

    y_t = W x_t + s * B_p(t) A_p(t) x_t          p(t): the policy of the sample token t belongs to

so adapter ``p``'s gradient comes from ``p``'s rows alone (packed attention keeps rows apart, and the base is frozen).
The routing is PEFT's own mixed-batch path (``adapter_names``, one name per batch row, as S-LoRA serving batches
rows of different adapters), entered per *token*: each adapted linear sees the packed row ``[1, T, H]`` as ``T`` rows
of one token (:func:`routed`). PEFT refuses ``adapter_names`` in training mode at the model level only because its
generic path cannot know about dropout across adapters; the layer-level path trains like any other forward
(dropout per adapter, gradients through ``index_put``), and the parity test checks every adapter's gradient
against a forward of that policy's rows alone.

What each policy keeps of its own (:class:`~agentrl.trainer.torch_trainer.TorchTrainer` does the bookkeeping): an
AdamW parameter group (its ``--policy-lr``), its loss normalized over its own tokens or sequences, its gradient
clipped alone, its checkpoint folder ``iter_N/adapters/NAME`` in PEFT's format, its push to the engines under its
name. The reference of a KL term is the base with every adapter off (``disable_adapter``), as for one policy.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from pathlib import Path

import torch
from peft import PeftModel, get_peft_model
from peft.tuners.lora import Linear as LoraLinear
from peft.tuners.lora import LoraLayer
from torch import nn

from agentrl.config import TrainConfig
from agentrl.trainer.lora import POLICIES_DIR, lora_config, target_problems


def add_policies(model: nn.Module, cfg: TrainConfig, base_path: str | Path) -> PeftModel:
    """Wrap ``model`` (its layers in place) in one LoRA adapter per ``cfg.policy``, every one trainable.

    Each adapter draws its own initialisation (B = 0: every policy starts as the base). A target the model lacks is
    refused naming ``--lora-target-modules`` (as for one adapter).
    """
    problems = target_problems(model, cfg)
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if head is not None and any(
        n.endswith(t) and m is head for n, m in model.named_modules() for t in cfg.lora_target_modules
    ):
        problems.append(
            "--lora-target-modules: with --policy the LM head is not adapted (it sees only the scored positions, not "
            "the packed row each token's policy is routed on); adapt the decoder's linears"
        )
    if problems:
        raise ValueError("; ".join(problems))
    names = list(cfg.policy)
    peft_model = get_peft_model(model, lora_config(cfg), adapter_name=names[0])
    for name in names[1:]:
        peft_model.add_adapter(name, lora_config(cfg))
    base = str(Path(base_path).resolve())
    for name in names:
        peft_model.peft_config[name].base_model_name_or_path = base
    # PEFT leaves only the active adapter trainable; here every policy trains (each from its own rows)
    for pname, p in model.named_parameters():
        if ".lora_" in pname:
            p.requires_grad_(True)
    wrong = sorted(
        {type(m).__name__ for m in model.modules() if isinstance(m, LoraLayer) and not isinstance(m, LoraLinear)}
    )
    if wrong:
        raise ValueError(f"--policy: several policies route linear layers' adapters per token, not {', '.join(wrong)}")
    return peft_model


def policy_parameters(model: nn.Module, name: str) -> list[nn.Parameter]:
    """The trainable tensors of policy ``name``'s adapter (its ``lora_A`` and ``lora_B`` in every adapted layer)."""
    keys = (f".lora_A.{name}.", f".lora_B.{name}.")
    return [p for n, p in model.named_parameters() if any(k in n for k in keys)]


def token_policies(policies: Sequence[str | None], lengths: Sequence[int], known: Sequence[str]) -> list[str]:
    """One adapter name per token of a packed row: sample ``i``'s ``lengths[i]`` tokens carry ``policies[i]``.

    A sample of no known policy is refused: training it on no adapter (the frozen base) would silently train nothing.
    """
    out: list[str] = []
    for policy, n in zip(policies, lengths, strict=True):
        if policy not in known:
            raise ValueError(f"a TrainSample of policy {policy!r}: this trainer trains the policies {list(known)}")
        out.extend([policy] * n)
    return out


@contextlib.contextmanager
def routed(model: nn.Module, names: list[str]) -> Iterator[None]:
    """Run every adapted linear of ``model`` with token ``t`` of the packed row on adapter ``names[t]``.

    Held around a forward *and* its backward (activation checkpointing runs the forward again in backward). An
    adapted linear that sees anything but the packed row ``[1, T, H]`` is refused (its tokens could not be told
    apart); passes outside a packed row (a one-token pass keeping ranks in step) run outside this context.
    """
    handles = []
    n = len(names)

    def before(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        if kwargs.get("adapter_names") is names:  # (entered twice: the outer hook has routed it)
            return None
        if not args:
            raise RuntimeError(f"{type(module).__name__}: routed per policy, it takes its input positionally")
        x = args[0]
        if not (x.dim() == 3 and x.shape[:2] == (1, n)):  # the packed row [1, T, H]: T rows of one token each
            raise RuntimeError(
                f"an adapted linear got input {tuple(x.shape)} while the packed row has {n} tokens: several policies "
                "route adapters per token of the row, which this layer does not see (a router or gate of a "
                "mixture of experts, say): leave it out of --lora-target-modules"
            )
        return (x.reshape(n, 1, x.shape[-1]), *args[1:]), {**kwargs, "adapter_names": names}

    def after(module: nn.Module, args: tuple, kwargs: dict, out: torch.Tensor) -> torch.Tensor | None:
        if kwargs.get("adapter_names") is not names:
            return None
        return out.reshape(1, n, out.shape[-1])

    for module in model.modules():
        if isinstance(module, LoraLinear):
            handles.append(module.register_forward_pre_hook(before, with_kwargs=True))
            handles.append(module.register_forward_hook(after, with_kwargs=True))
    try:
        yield
    finally:
        for h in handles:
            h.remove()


__all__ = ["POLICIES_DIR", "add_policies", "policy_parameters", "routed", "token_policies"]
