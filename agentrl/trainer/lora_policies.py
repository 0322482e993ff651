"""Several policies in one trainer: a PEFT adapter per ``--policy`` on the shared base, trained from one mixed stream.

A run with ``--policy solver --policy judge`` holds one frozen base and one LoRA adapter per policy, each added by
PEFT under the policy's name (``add_adapter``; agentrl writes no LoRA layer). A packed micro-batch may hold rows of
several policies; one forward and one backward run them all, each token through its own policy's adapter only:

    y_t = W x_t + s * B_p(t) A_p(t) x_t          p(t): the policy of the sample token t belongs to

so adapter ``p``'s gradient comes from ``p``'s rows alone (packed attention keeps rows apart, and the base is frozen).
The trainer sorts each packed row's samples by policy, so the row is one span a policy, and :func:`routed` runs each
adapted linear as the base over the whole row plus, for each span, that policy's PEFT adapter term on a slice of it
(``lora_B(lora_A(dropout(x))) * scaling``, PEFT's modules and formula). PEFT's own mixed-batch path
(``adapter_names``, one name per batch row) was the first router here: entered per token, it built index lists over
all T tokens and gathered and scattered each adapter's tokens in every layer; slices cost one small matmul pair per
span (forward and backward of a mixed row: 0.87x the per-token router's time, bench/README.md P13). The parity tests check every row's
log-probs and every adapter's gradient against a forward of that policy's rows alone.

What each policy keeps of its own (the trainer does the bookkeeping; :func:`policies_loss` and :func:`policy_counts`
are shared with the megatron backend, whose adapters :class:`~agentrl.trainer.megatron_lora.MegatronPolicies` routes
by the same spans on megatron-core's tensor-parallel linears): an
AdamW parameter group (its ``--policy-lr``), its loss normalized over its own tokens or sequences, its gradient
clipped alone, its checkpoint folder ``iter_N/adapters/NAME`` in PEFT's format, its push to the engines under its
name. The reference of a KL term is the base with every adapter off (``disable_adapter``), as for one policy.
"""

from __future__ import annotations

import contextlib
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import torch
from peft import PeftModel, get_peft_model
from peft.tuners.lora import Linear as LoraLinear
from peft.tuners.lora import LoraLayer
from torch import nn

from agentrl.algo.loss import policy_loss
from agentrl.config import TrainConfig
from agentrl.trainer.batching import PackedBatch
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


def policy_spans(policies: Sequence[str | None], lengths: Sequence[int], known: Sequence[str]) -> list[tuple[str, int]]:
    """The packed row as spans of one policy each: ``(policy, tokens)`` for each run of consecutive samples, then
    ``(policy, 0)`` for each known policy with no sample in the row.

    Sample ``i`` contributes ``lengths[i]`` tokens of ``policies[i]``; neighbours of one policy share a span, so a
    row sorted by policy (as the trainer packs one) has one span a policy. The empty spans put every adapter in
    every backward (a zero gradient), so data-parallel ranks whose rows hold different policies still reduce the
    same gradients (FSDP2 reduces only the tensors that got one). A sample of no known policy is refused: training
    it on no adapter (the frozen base) would silently train nothing.
    """
    spans: list[tuple[str, int]] = []
    for policy, n in zip(policies, lengths, strict=True):
        if policy not in known:
            raise ValueError(f"a TrainSample of policy {policy!r}: this trainer trains the policies {list(known)}")
        if spans and spans[-1][0] == policy:
            spans[-1] = (policy, spans[-1][1] + n)
        else:
            spans.append((policy, n))
    present = {p for p, _ in spans}
    return spans + [(p, 0) for p in known if p not in present]


def _routed_forward(module: LoraLinear, spans: list[tuple[str, int]]):
    """``module``'s forward over the packed row ``[1, T, H]`` with each span on its own adapter (PEFT's vanilla LoRA
    term ``lora_B(lora_A(dropout(x))) * scaling`` of that adapter, on a slice of the row, added in place)."""
    live = [(name, n) for name, n in spans if n]
    empty = [name for name, n in spans if not n]
    total = sum(n for _, n in live)

    def term(name: str, part: torch.Tensor) -> torch.Tensor:
        a, b = module.lora_A[name], module.lora_B[name]
        return b(a(module.lora_dropout[name](part.to(a.weight.dtype)))) * module.scaling[name]

    def forward(x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        if module.disable_adapters:  # the KL reference: the base with every adapter off, as PEFT's own forward
            return module.base_layer(x, *args, **kwargs)
        if not (x.dim() == 3 and x.shape[:2] == (1, total)):
            raise RuntimeError(
                f"an adapted linear got input {tuple(x.shape)} while the packed row has {total} tokens: several "
                "policies route adapters by spans of the row, which this layer does not see (a router or gate of a "
                "mixture of experts, say): leave it out of --lora-target-modules"
            )
        result = module.base_layer(x, *args, **kwargs)
        # slices of the row by split (its backward is one concatenation; a gather per adapter would scatter into a
        # zeroed copy of the whole row per adapter and layer), each term added in place (no output-sized copies)
        parts = x.split([n for _, n in live], dim=1) if len(live) > 1 else (x,)
        start = 0
        for (name, n), part in zip(live, parts, strict=True):
            result[:, start : start + n] += term(name, part).to(result.dtype)
            start += n
        for name in empty:  # on no token: the adapter stays in the backward with a zero gradient (see policy_spans)
            result[:, total:] += term(name, x.new_empty((1, 0, x.shape[-1]))).to(result.dtype)
        return result

    return forward


@contextlib.contextmanager
def routed(model: nn.Module, spans: list[tuple[str, int]]) -> Iterator[None]:
    """Run every adapted linear of ``model`` with each span of the packed row on its own adapter.

    ``spans`` is :func:`policy_spans` of the row. Held around a forward *and* its backward (activation checkpointing
    runs the forward again in backward); not re-entered. An adapted linear that sees anything but the packed row
    ``[1, T, H]`` is refused (its tokens could not be told apart); passes outside a packed row (a one-token pass
    keeping ranks in step) run outside this context. The cost is per span (one pair of small matmuls on a slice),
    not per token: the trainer sorts each row's samples by policy.
    """
    layers = [m for m in model.modules() if isinstance(m, LoraLinear)]
    for m in layers:
        if "forward" in m.__dict__:
            raise RuntimeError("routed(): already routing this model (enter it once around a forward and backward)")
        if m.merged or any(name in m.lora_variant for name, _ in spans):
            raise RuntimeError(
                "several policies route plain LoRA adapters that are not merged into the base (no DoRA or other "
                "variant)"
            )
    try:
        for m in layers:
            m.forward = _routed_forward(m, spans)  # type: ignore[method-assign]
        yield
    finally:
        for m in layers:
            m.__dict__.pop("forward", None)


def policy_param_groups(
    cfg: TrainConfig, parameters_of: Callable[[str], list[nn.Parameter]]
) -> list[dict[str, object]]:
    """AdamW parameter groups, one per ``--policy`` in order: its adapter's tensors (``parameters_of(name)``) at its
    ``--policy-lr``, the group tagged with its ``policy`` (clipping, metrics and resume read it)."""
    lrs = cfg.policy_lrs()
    return [{"params": parameters_of(n), "lr": lrs[n], "policy": n} for n in cfg.policy]


def policy_lr_metrics(optimizer: torch.optim.Optimizer) -> dict[str, float]:
    """``lr/<policy>`` of each policy's parameter group (none for a run of one policy)."""
    return {f"lr/{g['policy']}": float(g["lr"]) for g in optimizer.param_groups if "policy" in g}


def unknown_policies(policies: Sequence[str | None], known: Sequence[str]) -> list[str]:
    """The policies of samples no adapter of ``known`` trains (``repr``, sorted): a trainer refuses such a step on every
    rank at once (a rank raising alone would leave the others waiting in a collective)."""
    return sorted({repr(p) for p in policies if p not in known})


def refuse_unknown(unknown: list[str], anywhere: int, known: Sequence[str]) -> None:
    """Raise when any rank (``anywhere``: the ranks' largest count) holds a sample of no known policy."""
    if anywhere:
        raise ValueError(
            f"TrainSamples of policy {', '.join(unknown) or '(on another rank)'}: this trainer trains the policies "
            f"{list(known)}; every rank refuses the step"
        )


def sorted_by_policy(groups: list[list[int]], policies: Sequence[str | None], known: Sequence[str]) -> list[list[int]]:
    """Each packed group's sample indices sorted by policy (``known``'s order), so each row is one span a policy."""
    rank = {p: i for i, p in enumerate(known)}
    return [sorted(g, key=lambda i: (rank.get(policies[i] or "", -1), i)) for g in groups]


def policy_counts(
    policies: Sequence[str | None],
    loss_masks: Sequence[Sequence[int]],
    known: Sequence[str],
    sum_over_ranks: Callable[[list[float]], list[float]],
) -> dict[str, tuple[float, float]]:
    """Each policy's ``(trained tokens, samples)`` of one optimizer step over every rank: its loss's normalizers
    (``sum_over_ranks`` sums this rank's numbers with the other data-parallel ranks')."""
    local: list[float] = []
    for name in known:
        mine = [m for p, m in zip(policies, loss_masks, strict=True) if p == name]
        local += [float(sum(sum(m) for m in mine)), float(len(mine))]
    total = sum_over_ranks(local)
    return {name: (total[2 * i], total[2 * i + 1]) for i, name in enumerate(known)}


def policies_loss(
    known: Sequence[str],
    b: PackedBatch,
    cfg: TrainConfig,
    counts: dict[str, tuple[float, float]],
    whole: tuple[float, float],
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    ref_logp: torch.Tensor | None,
    entropy: torch.Tensor | None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """One packed micro-batch's loss when several policies train: the sum of each policy's :func:`policy_loss` over
    its own tokens, normalized by its own ``counts`` (as if it trained alone), so each adapter's gradient is its own
    loss's. The metrics are the policies' weighted by their share of the step (``whole``: the step's tokens and
    samples; the whole-batch means), plus ``pg_loss/<policy>``. Both backends call it."""
    owner = torch.tensor(
        [known.index(p) if p in known else -1 for p in b.policies], device=b.mask.device
    ).repeat_interleave(torch.tensor(b.response_lengths, device=b.mask.device))  # [N] the policy of each token
    per_token = cfg.calculate_per_token_loss
    loss = logp.sum() * 0.0
    metrics: dict[str, float] = defaultdict(float)
    for i, name in enumerate(known):
        mine = owner == i
        if not bool(mine.any()):
            continue
        tokens, seqs = counts[name]
        part, m = policy_loss(
            logp,
            old_logp,
            b.advantages,
            b.mask * mine,
            b.seq_ids,
            cfg,
            num_tokens=tokens,
            num_seqs=seqs,
            ref_logp=ref_logp,
            rollout_logp=b.rollout_log_probs,
            entropy=entropy,
        )
        loss = loss + part
        share = (tokens / whole[0] if whole[0] else 0.0) if per_token else (seqs / whole[1] if whole[1] else 0.0)
        for k, v in m.items():
            metrics[k] += v * share
        metrics[f"pg_loss/{name}"] += m["pg_loss"]
    return loss, dict(metrics)


__all__ = [
    "POLICIES_DIR",
    "add_policies",
    "policies_loss",
    "policy_counts",
    "policy_lr_metrics",
    "policy_param_groups",
    "policy_parameters",
    "policy_spans",
    "refuse_unknown",
    "routed",
    "sorted_by_policy",
    "unknown_policies",
]
