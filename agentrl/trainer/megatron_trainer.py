"""The ``megatron`` backend: a megatron-core ``GPTModel`` trained on HF checkpoints, with TP / PP / DP.

One :class:`MegatronTrainer` per rank. It computes exactly what :class:`~agentrl.trainer.torch_trainer.TorchTrainer`
computes (same packing, same :func:`~agentrl.algo.loss.policy_loss`, same global normalization, same
AdamW and clipping), only the model is split the Megatron way:

* **tensor parallel (TP)**: every linear is sharded; so is the vocabulary, so log-probs use megatron's
  vocab-parallel cross entropy (``log p_y = -CE``, a max / sum-exp / target-logit all-reduce over TP)
  and the entropy a vocab-parallel logsumexp (both in :mod:`~agentrl.trainer.megatron_logits`);
* **pipeline parallel (PP)**: the layers are split into stages and micro-batches flow through
  megatron's own schedule (``get_forward_backward_func``: 1F1B when ``pp > 1``, a plain loop at
  ``pp == 1``); only the last stage sees logits, so it alone computes the loss and its results are
  broadcast to the other stages;
* **data parallel (DP)**: ``world / (tp * pp)`` model replicas, each given its own samples. Every
  rank of one replica (its TP and PP peers) must be given the SAME samples (checked). Gradients are
  SUMMED over the DP group after the step's micro-batches: each micro-batch loss is already divided
  by the global token/sample counts, so the sum is the whole-batch gradient (TorchTrainer's FSDP
  averages and multiplies the loss by ``world_size``; a sum needs no such factor).

Packed micro-batches are one row of whole samples (:mod:`agentrl.trainer.batching`). The model is the
local spec with :class:`~agentrl.trainer.megatron_attention.PackedCoreAttention`, given the row's sample
boundaries as megatron ``PackedSeqParams`` (``sbhd``, ``cu_seqlens``) so that attention runs per sample,
never over T x T scores (Transformer Engine's THD format is not used). The LM head runs only at
``logit_positions``, with ``logit_temperature`` and the padded vocabulary masked
(:mod:`~agentrl.trainer.megatron_logits`).

Precision, as in the torch backend: weights, gradients and AdamW state are fp32; ``dtype`` (``auto`` =
fp32 on CPU, bf16 on GPU) is the compute dtype, applied with ``torch.autocast`` around the forward.
Megatron's own ``bf16=True`` would need bf16 parameters plus its mixed-precision optimizer holding fp32
main copies; autocast over fp32 parameters keeps fp32 master weights with a plain ``torch.optim.AdamW``
and one precision policy for both backends. Under bf16 the two backends are close, not equal: megatron's
bias-dropout-add casts the residual stream to the layer's (bf16) output dtype, where HF keeps it fp32
(so pipeline stages exchange bf16, ``pipeline_dtype``). The frozen reference model is stored in the
compute dtype (with ``--lora-rank`` there is none: the reference is the base, the adapter off). Megatron's DDP and distributed optimizer are not used (a coalesced all-reduce does DP);
activation recompute is refused (megatron recomputes outside autocast).

Checkpoint layout written by :meth:`MegatronTrainer.save` (a loadable HF folder plus state)::

    config.json, generation_config.json, tokenizer files   (copied from the source checkpoint)
    model.safetensors                                      (full HF weights, written by rank 0; LoRA: merged)
    adapter/              --lora-rank: the adapter in PEFT's format (:mod:`~agentrl.trainer.megatron_lora`)
    adapters/NAME/        --policy NAME (several policies): each policy's adapter in PEFT's format, and their order
    trainer_state.pt      {"step", "world_size", "layout", "extra_state"}        (rank 0)
    optim_rank{r}.pt      {"optimizer": this rank's shard state, "rng", "megatron_rng"}  (every rank)

Resuming needs the same world size and the same (tp, pp, cp) layout; a LoRA run resumes its adapter on the base.
"""

from __future__ import annotations

import contextlib
import dataclasses
import socket
import zlib
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from safetensors.torch import load_file
from torch import nn

from agentrl.algo.loss import policy_loss
from agentrl.config import TrainConfig, megatron_lora_problems
from agentrl.trainer.base import (
    LogProbs,
    Trainer,
    TrainSample,
    load_custom_loss,
    restore_learning_rates,
    run_optimizer_steps,
)
from agentrl.trainer.batching import PackedBatch, pack_micro_batches, pack_samples
from agentrl.trainer.lora import (
    ADAPTER_DIR,
    POLICIES_DIR,
    adapter_config_dict,
    check_adapter,
    check_lora,
    check_resume,
    write_adapter,
    write_peft_folder,
    write_policy_order,
)
from agentrl.trainer.lora_policies import (
    policies_loss,
    policy_counts,
    policy_lr_metrics,
    policy_param_groups,
    policy_spans,
    refuse_unknown,
    sorted_by_policy,
    unknown_policies,
)
from agentrl.trainer.megatron_compat import (
    cpu_schedule,
    destroy_megatron_parallel,
    init_megatron_parallel,
    megatron_available,
)
from agentrl.trainer.megatron_logits import head_logits, logits_at, padded_vocab_mask, token_stats
from agentrl.trainer.megatron_lora import MegatronLora, MegatronPolicies
from agentrl.trainer.megatron_model import (
    build_gpt_model,
    iter_hf_weights,
    load_hf_checkpoint,
    load_megatron_checkpoint,
    transformer_config_from_hf,
)
from agentrl.trainer.torch_trainer import resolve_dtype, rng_state, save_hf_metadata, set_rng_state


@dataclass
class MegatronParallel:
    """How one model is split over ranks (Megatron's flag names); the rest of the world is data parallel.

    ``micro_batch_size`` caps the samples packed into one micro-batch (None: the token budget
    ``max_tokens_per_gpu`` alone decides, slime's ``--use-dynamic-batch-size``). ``overrides`` are
    TransformerConfig fields passed through unchanged (e.g. ``{"recompute_granularity": "full"}``).
    """

    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    context_parallel_size: int = 1
    micro_batch_size: int | None = None
    overrides: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_config(cls, cfg: TrainConfig) -> MegatronParallel:
        """The layout a TrainConfig asks for (its megatron fields, where this version of it has them)."""
        return cls(
            tensor_model_parallel_size=getattr(cfg, "tensor_model_parallel_size", 1),
            pipeline_model_parallel_size=getattr(cfg, "pipeline_model_parallel_size", 1),
            context_parallel_size=getattr(cfg, "context_parallel_size", 1),
            micro_batch_size=getattr(cfg, "micro_batch_size", None),
            overrides=dict(getattr(cfg, "megatron_args", None) or {}),
        )

    @property
    def model_parallel_size(self) -> int:
        return self.tensor_model_parallel_size * self.pipeline_model_parallel_size * self.context_parallel_size


class MegatronTrainer(Trainer):
    """megatron-core GPTModel + AdamW, TP/PP/DP over ``torch.distributed``; one instance per rank.

    With ``world_size > 1`` the process group must be initialised (the runtime does it) or
    ``MASTER_ADDR``/``MASTER_PORT`` set for ``env://``; at world size 1 a private one is started on a
    free loopback port when none exists. Call :meth:`close` to release megatron's global state.
    """

    def __init__(
        self,
        checkpoint_path: str | Path,
        cfg: TrainConfig,
        *,
        rank: int = 0,
        world_size: int = 1,
        device: str | torch.device | None = None,
        parallel: MegatronParallel | None = None,
    ):
        from transformers import AutoConfig

        cfg.validate()
        if cfg.lora_rank and self._takes_lora():  # refused before any process group, model or weight
            problems = megatron_lora_problems(cfg)
            if problems:
                raise ValueError("; ".join(problems))
            check_lora(checkpoint_path, cfg)  # the targets and rank against the model's layers (meta device)
        self.custom_loss_fn = load_custom_loss(cfg)
        reason = megatron_available()
        if reason:
            raise RuntimeError(f"the megatron backend cannot start: {reason}")
        self.cfg, self.rank, self.world_size = cfg, rank, world_size
        self.parallel = parallel or MegatronParallel.from_config(cfg)
        self.checkpoint_path = Path(checkpoint_path)
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.dtype = resolve_dtype(cfg.dtype, self.device)  # compute dtype; trained weights stay fp32
        self._check_layout()
        torch.manual_seed(cfg.seed + rank)
        if self.device.type == "cuda" and self.device.index is not None:
            torch.cuda.set_device(self.device)  # megatron allocates and NCCL communicates on the current device
        self._owns_group = _init_process_group(rank, world_size, self.device)
        p = self.parallel
        init_megatron_parallel(
            p.tensor_model_parallel_size, p.pipeline_model_parallel_size, p.context_parallel_size, seed=cfg.seed
        )
        self.hf_config = AutoConfig.from_pretrained(str(self.checkpoint_path), local_files_only=True)
        self._topology()
        self.model = self._build(torch.float32)
        self.lora: MegatronLora | None = None
        # several policies (--policy): an adapter each on the shared base, a row's spans routed to their own
        self.policies: list[str] = list(cfg.policy) if cfg.lora_rank and self._takes_lora() else []
        self.routes: MegatronPolicies | None = None
        self._policy_grad_norms: dict[str, float] = {}
        if self.policies:
            self.routes = MegatronPolicies(self.model, self.hf_config, cfg, tp_rank=self.tp_rank, tp_size=self.tp_size)
        elif cfg.lora_rank and self._takes_lora():
            self.lora = self._add_lora()
        self.ref_model = None
        if cfg.needs_ref_model and not self._adapted():  # a KL loss, or KL-shaped rewards (--kl-coef); LoRA: the base
            self.ref_model = self._build(self.dtype).eval()
            self.ref_model.requires_grad_(False)
        if cfg.initial_megatron_checkpoint:  # the starting policy is the checkpoint's: the reference too
            for model in filter(None, (self.model, self.ref_model)):
                load_megatron_checkpoint(model, cfg.initial_megatron_checkpoint)
        params: Any = self._trained()
        if self.routes is not None:  # a parameter group per policy: its own learning rate (--policy-lr)
            params = policy_param_groups(cfg, self.routes.trainable)
        self.optimizer = torch.optim.AdamW(
            params,
            lr=cfg.lr,
            betas=(cfg.adam_beta1, cfg.adam_beta2),
            weight_decay=cfg.weight_decay,
            eps=1e-8,
        )
        self.step = 0

    def _takes_lora(self) -> bool:
        """Whether ``--lora-rank`` adapts this model (the policy does; ppo's critic trains in full)."""
        return True

    def _add_lora(self) -> MegatronLora:
        """The adapter over this stage (fresh, or ``--lora-adapter-path``'s, sharded); the base stops training."""
        cfg = self.cfg
        lora = MegatronLora(self.model, self.hf_config, cfg, tp_rank=self.tp_rank, tp_size=self.tp_size)
        if cfg.lora_adapter_path:  # continue an adapter (a LoRA warm start's) instead of a fresh one
            adapter = Path(cfg.lora_adapter_path)
            what = f"--lora-adapter-path {adapter}"
            check_adapter(adapter, cfg, self.checkpoint_path, what=what)
            lora.load_peft_state(load_file(str(adapter / "adapter_model.safetensors")), source=what)
        return lora

    def _adapted(self) -> bool:
        """Whether the policy model trains adapters (one, or one per ``--policy``) on a frozen base."""
        return self.lora is not None or self.routes is not None

    def _trained(self) -> list[nn.Parameter]:
        """What the optimizer steps: the adapters' A and B under LoRA, else every weight of the stage."""
        if self.routes is not None:
            return self.routes.trainable()
        if self.lora is not None:
            return self.lora.trainable()
        return [p for p in self.model.parameters() if p.requires_grad]

    def _ref_scores(self, samples: Sequence[TrainSample]) -> list[list[float]]:
        """Reference log-probs: the reference model's, or (LoRA) the base's, every adapter switched off."""
        adapters = self.routes if self.routes is not None else self.lora
        if adapters is not None:
            with adapters.disabled():
                return self._score(self.model, samples)
        return self._score(self.ref_model, samples)

    def _builtin_metrics(self) -> set[str]:
        """Metric names every rank reports (only last stages compute any)."""
        if self.cfg.loss_type == "custom_loss":  # a custom loss reports its own, not zeros for terms it never computed
            return {"loss"}
        return {"loss", "pg_loss", "kl", "entropy", "clipfrac"}

    def _check_layout(self) -> None:
        p = self.parallel
        if self.world_size % p.model_parallel_size:
            raise ValueError(
                f"world size {self.world_size} is not a multiple of tp*pp*cp = {p.model_parallel_size}; "
                "change the parallel sizes or the number of trainer processes"
            )
        if p.context_parallel_size > 1:
            raise NotImplementedError(
                "context parallelism is not implemented by the megatron backend (it needs "
                "Transformer Engine attention and a per-rank sequence split); use "
                "--context-parallel-size 1"
            )
        if p.overrides.get("sequence_parallel"):
            raise NotImplementedError(
                "sequence_parallel is not supported yet: the LM head runs only at response "
                "positions of the full row; drop --sequence-parallel"
            )
        recompute = sorted(k for k in p.overrides if k.startswith("recompute") and p.overrides[k])
        if self.cfg.gradient_checkpointing or recompute:
            # megatron's CheckpointFunction recomputes outside autocast, so with bf16 compute over fp32 weights
            # the recompute multiplies bf16 activations by fp32 weights; not supported until that is handled
            raise NotImplementedError(
                "activation recompute (--gradient-checkpointing, --recompute-*) is not "
                "supported by the megatron backend yet; lower --max-tokens-per-gpu instead"
            )
        if self.device.type == "cpu" and self.dtype != torch.float32:
            raise ValueError(
                f"--dtype {self.cfg.dtype} with the megatron backend needs CUDA (megatron's custom "
                "autograd functions restore only CUDA autocast in backward); use float32 on CPU"
            )

    def _topology(self) -> None:
        """Who is who in megatron's groups, and which rank reports a replica's numbers."""
        from megatron.core import parallel_state as ps

        self.tp_rank, self.tp_size = ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size()
        self.pp_rank, self.pp_size = ps.get_pipeline_model_parallel_rank(), ps.get_pipeline_model_parallel_world_size()
        self.dp_rank, self.dp_size = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
        self.is_last_stage = self.pp_rank == self.pp_size - 1
        # one rank per model replica contributes to cross-rank sums (it holds the loss: last stage, tp 0)
        self._reporter = self.is_last_stage and self.tp_rank == 0
        # this rank's vocabulary slice; Megatron's padding rows (ids >= the true vocab) get -inf logits
        self._pad_vocab = padded_vocab_mask(self.hf_config.vocab_size, self.tp_rank, self.tp_size, self.device)

    def _build(self, params_dtype: torch.dtype) -> nn.Module:
        """This rank's shard of the model, loaded from the HF checkpoint, on ``self.device``."""
        p = self.parallel
        overrides = dict(p.overrides)
        # perform_initialization is deliberately left at megatron's default (True), although the checkpoint
        # below overwrites every weight and the random init is wasted work: megatron 0.16 sets the
        # ``tensor_model_parallel`` / ``partition_dim`` attributes of TP-sharded weights only inside its init
        # (tensor_parallel.layers._initialize_affine_weight_gpu). With perform_initialization=False every
        # shard would look TP-replicated, param_is_not_tensor_parallel_duplicate would count it on tp rank 0
        # only, and the gradient norm of :meth:`_clip_grad` would be wrong at tp > 1.
        config = transformer_config_from_hf(
            self.hf_config,
            tp=p.tensor_model_parallel_size,
            pp=p.pipeline_model_parallel_size,
            cp=p.context_parallel_size,
            params_dtype=params_dtype,
            overrides=overrides,
        )
        # set after construction: TransformerConfig refuses variable lengths with its default MoE dispatcher
        config.variable_seq_lengths = True  # packed rows differ in length; PP sends shapes first
        config.calculate_per_token_loss = True  # the schedule must not rescale our globally normalized loss
        # what flows between pipeline stages is the compute dtype: under bf16 autocast a stage sends bf16
        # activations, and receive buffers of another dtype would reinterpret them
        config.pipeline_dtype = self.dtype
        model = build_gpt_model(self.hf_config, config)
        load_hf_checkpoint(
            model,
            self.checkpoint_path,
            self.hf_config,
            tp_rank=self.tp_rank,
            tp_size=self.tp_size,
            pp_rank=self.pp_rank,
            pp_size=self.pp_size,
        )
        return model.to(self.device)

    # ------------------------------------------------------------------ forward passes

    def _autocast(self):
        """bf16/fp16 compute over fp32 master weights: a 1e-6 AdamW update vanishes in bf16 weights."""
        return torch.autocast(self.device.type, dtype=self.dtype, enabled=self.dtype != torch.float32)

    def _forward(self, model: nn.Module, b: PackedBatch) -> torch.Tensor:
        """One packed row through this stage: hidden states [s, 1, h], or logits [1, N, V/tp] on the last stage."""
        from agentrl.trainer.megatron_attention import packed_seq_params

        # the row's sample boundaries: PackedCoreAttention attends per sample, no [s, s] mask is built
        params = packed_seq_params(b.position_ids)
        routing = contextlib.nullcontext()
        if self.routes is not None and model is self.model:  # several policies: each span on its own adapter
            routing = self.routes.routing(policy_spans(b.policies, b.lengths, self.policies))
        with self._autocast(), logits_at(model, b.logit_positions), routing:
            return model(
                input_ids=b.input_ids, position_ids=b.position_ids, attention_mask=None, packed_seq_params=params
            )

    def _schedule(
        self, model: nn.Module, batches: list[PackedBatch], loss_func: Callable, *, forward_only: bool
    ) -> list[Any]:
        """Run megatron's forward(-backward) schedule over ``batches``; what ``loss_func`` returned, on the last stage.

        ``loss_func(batch, output)`` gets the last stage's output. Forward-only passes collect its
        return value as-is (``collect_non_loss_data``); training ones expect ``(loss, n, metrics)``.
        """
        from megatron.core.pipeline_parallel import get_forward_backward_func

        def forward_step(data_iterator: Iterator[PackedBatch], stage: nn.Module):
            b = next(data_iterator)
            return self._forward(stage, b), partial(loss_func, b)

        with cpu_schedule():
            return get_forward_backward_func()(
                forward_step_func=forward_step,
                data_iterator=iter(batches),
                model=[model],
                num_microbatches=len(batches),
                seq_length=max(b.num_tokens for b in batches),
                micro_batch_size=1,
                forward_only=forward_only,
                collect_non_loss_data=forward_only,
            )

    def _micro_batches(self, samples: Sequence[TrainSample], *, train: bool) -> list[PackedBatch]:
        """This replica's packed micro-batches, on the device (no empty passes: nothing spans DP inside a step)."""
        self._check_same_samples(samples)
        groups = pack_micro_batches(
            [len(s.tokens) for s in samples], self.cfg.token_budget(self.device.type), self.parallel.micro_batch_size
        )
        if self.policies:  # each policy's samples side by side in a row: one adapter span a policy
            policies = [s.policy for s in samples]
            unknown = unknown_policies(policies, self.policies)
            bad = torch.tensor([len(unknown)], dtype=torch.long, device=self.device)
            if self.world_size > 1:  # every rank refuses together, before any pass
                dist.all_reduce(bad, op=dist.ReduceOp.MAX)
            refuse_unknown(unknown, int(bad.item()), self.policies)
            groups = sorted_by_policy(groups, policies, self.policies)
        return [pack_samples(samples, g, need_advantages=train).to(self.device) for g in groups]

    def _score(
        self, model: nn.Module, samples: Sequence[TrainSample], output_fn: Callable | None = None
    ) -> list[list[float]]:
        """Per-sample response log-probs under ``model`` (forward only), on every rank.

        ``output_fn(batch, output) -> [N]`` turns the last stage's output into the per-token numbers
        (default: log-probs of the targets; the critic's values for a critic).
        """
        batches = self._micro_batches(samples, train=False)
        out: list[list[float]] = [[] for _ in samples]
        if not batches:
            return out
        model.eval()
        with torch.no_grad():
            results = self._schedule(model, batches, output_fn or self._log_prob_output, forward_only=True)
        total = sum(sum(b.response_lengths) for b in batches)
        flat = self._from_last_stage(torch.cat(results) if self.is_last_stage else None, total)
        for b, chunk in zip(batches, flat.split([sum(b.response_lengths) for b in batches])):
            for i, values in zip(b.indices, b.split(chunk)):
                out[i] = values
        return out

    def _log_prob_output(self, b: PackedBatch, output: torch.Tensor, non_loss_data: bool = True) -> torch.Tensor:
        logits = head_logits(output, self.cfg.logit_temperature, self._pad_vocab)  # [N, V/tp]
        logp, _ = token_stats(logits, b.targets, tp_size=self.tp_size, entropy=False, entropy_grad=False)
        return logp.float()

    @torch.no_grad()
    def compute_log_probs(self, samples: list[TrainSample], *, ref: bool) -> LogProbs:
        """Per-response-token log-probs under the current weights (and the reference model when ``ref``).

        ``ref`` needs ``--use-kl-loss`` or ``--kl-coef`` (only then is a reference model built; with LoRA the reference
        is the base, the adapter off). Every rank of a replica gets the same result.
        """
        if ref and self.ref_model is None and not (self._adapted() and self.cfg.needs_ref_model):
            raise ValueError("reference log-probs need a reference model: set --use-kl-loss or --kl-coef")
        old = self._score(self.model, samples)
        return LogProbs(old=old, ref=self._ref_scores(samples) if ref else None)

    # ------------------------------------------------------------------ training

    def train_step(self, samples: list[TrainSample]) -> dict[str, float]:
        """``num_steps_per_rollout`` optimizer steps over ``samples`` (this replica's shard) cut into equal chunks.

        Metrics as TorchTrainer's: step means, global over data-parallel replicas; ``train_tokens``
        counts masked response tokens trained on, ``tokens_per_s`` every token through the model.
        """
        if self.cfg.use_tis and any(s.rollout_log_probs is None for s in samples):
            # checked on every rank: raised inside the schedule it would come from the last pipeline stage
            # alone while the others wait for it forever
            raise ValueError("--use-tis needs the engine's rollout log-probs on every sample")
        try:
            metrics = run_optimizer_steps(
                samples,
                self.cfg.num_steps_per_rollout,
                self._optimizer_step,
                self._sum_replicas,
                self.optimizer.param_groups[0]["lr"],
            )
        finally:
            self.model.eval()
        return {**metrics, **policy_lr_metrics(self.optimizer)}  # each --policy's own (--policy-lr)

    def _optimizer_step(self, samples: Sequence[TrainSample]) -> dict[str, float] | None:
        """One global batch: the schedule accumulates micro-batch gradients; DP sum, clip, step."""
        num_tokens, num_seqs = self._sum_replicas([sum(sum(s.loss_mask) for s in samples), len(samples)])
        if num_seqs == 0:
            return None
        if self.cfg.use_kl_loss and any(s.ref_log_probs is None for s in samples):
            refs = self._ref_scores(samples)  # the schedule cannot interleave two pipelined models
            samples = [dataclasses.replace(s, ref_log_probs=r) for s, r in zip(samples, refs)]
        counts = None
        if self.policies:  # each policy's loss is normalized over its own tokens (or samples) of the step
            counts = policy_counts(
                [s.policy for s in samples], [s.loss_mask for s in samples], self.policies, self._sum_replicas
            )
        batches = self._micro_batches(samples, train=True)
        self.optimizer.zero_grad(set_to_none=True)
        sums: dict[str, float] = defaultdict(float)
        if batches:
            self.model.train()
            loss_func = partial(self._train_loss, float(num_tokens), float(num_seqs))
            if counts is not None:  # (a critic's override takes no policies)
                loss_func = partial(loss_func, counts=counts)
            for metrics in self._schedule(self.model, batches, loss_func, forward_only=False):
                for k, v in metrics.items():
                    sums[k] += v
        self._reduce_grads()
        grad_norm = self._clip_grad()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        keys = self._metric_names(sums)
        totals = self._sum_replicas([sums[k] for k in keys])  # each replica's share is globally normalized
        return dict(zip(keys, totals), grad_norm=grad_norm, **self._policy_grad_norms)

    def _train_loss(
        self,
        num_tokens: float,
        num_seqs: float,
        b: PackedBatch,
        output: torch.Tensor,
        *,
        counts: dict[str, tuple[float, float]] | None = None,
    ):
        """Last stage: :func:`policy_loss` of one micro-batch, as megatron's ``(loss, num_tokens, metrics)``."""
        logits = head_logits(output, self.cfg.logit_temperature, self._pad_vocab)  # [N, V/tp]
        logp, entropy = token_stats(
            logits, b.targets, tp_size=self.tp_size, entropy=True, entropy_grad=self.cfg.entropy_coef > 0
        )
        old_logp = b.old_log_probs if b.old_log_probs is not None else logp.detach()
        if counts is not None:  # several policies: each policy's loss over its own tokens
            loss, metrics = policies_loss(
                self.policies, b, self.cfg, counts, (num_tokens, num_seqs), logp, old_logp, b.ref_log_probs, entropy
            )
            metrics["loss"] = float(loss.detach())
            return loss, torch.tensor(int(b.mask.sum()), dtype=torch.int, device=loss.device), metrics
        loss, metrics = policy_loss(
            logp,
            old_logp,
            b.advantages,
            b.mask,
            b.seq_ids,
            self.cfg,
            num_tokens=num_tokens,
            num_seqs=num_seqs,
            ref_logp=b.ref_log_probs,
            rollout_logp=b.rollout_log_probs,
            entropy=entropy,
            custom_fn=self.custom_loss_fn,
            batch=b,
        )
        metrics["loss"] = float(loss.detach())
        # with calculate_per_token_loss the schedule leaves the loss as is; the count is only logged by it
        return loss, torch.tensor(int(b.mask.sum()), dtype=torch.int, device=loss.device), metrics

    def _reduce_grads(self) -> None:
        """Sum gradients over DP replicas (and the tied embedding's two copies when pipelined)."""
        from megatron.core import parallel_state as ps

        params = self._trained()
        for p in params:
            if p.grad is None:  # a replica without samples still joins the sum
                p.grad = torch.zeros_like(p)
        if self.dp_size > 1:
            group = ps.get_data_parallel_group()
            for bucket in _buckets([p.grad for p in params]):
                flat = torch._utils._flatten_dense_tensors(bucket)
                dist.all_reduce(flat, group=group)
                for g, reduced in zip(bucket, torch._utils._unflatten_dense_tensors(flat, bucket)):
                    g.copy_(reduced)
        if (
            self.pp_size > 1
            and not self._adapted()
            and getattr(self.model, "share_embeddings_and_output_weights", False)
            and ps.is_rank_in_embedding_group()
        ):
            # first stage (embedding) and last stage (head) hold one logical weight: add their gradients
            dist.all_reduce(self.model.shared_embedding_or_output_weight().grad, group=ps.get_embedding_group())

    def _clip_grad(self) -> float:
        """Global L2 norm over the whole model (each TP-replicated or tied tensor counted once); clip like torch.

        Several policies: each policy's adapter is clipped alone (one policy's large step does not shrink another's),
        its norm kept as ``grad_norm/<policy>``; the returned norm is over all of them."""
        from megatron.core import parallel_state as ps
        from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate
        from megatron.core.transformer.module import param_is_not_shared

        groups = [g["params"] for g in self.optimizer.param_groups] if self.policies else [self._trained()]
        squares = []
        for params in groups:
            # TP shards are told from TP-replicated tensors by their ``tensor_model_parallel`` attribute (see _build)
            counted = [
                p.grad.float() for p in params if param_is_not_shared(p) and param_is_not_tensor_parallel_duplicate(p)
            ]
            squares.append(
                torch.stack([g.pow(2).sum() for g in counted]).sum() if counted else torch.zeros((), device=self.device)
            )
        sq = torch.stack(squares)
        if self.tp_size * self.pp_size > 1:
            dist.all_reduce(sq, group=ps.get_model_parallel_group())
        norms = sq.sqrt().tolist()
        if self.cfg.clip_grad > 0:
            for params, norm in zip(groups, norms):
                coef = min(1.0, self.cfg.clip_grad / (norm + 1e-6))  # torch.nn.utils.clip_grad_norm_'s formula
                torch._foreach_mul_([p.grad for p in params], coef)
        if self.policies:
            self._policy_grad_norms = {f"grad_norm/{n}": v for n, v in zip(self.policies, norms)}
        return float(sum(v * v for v in norms) ** 0.5) if self.policies else norms[0]

    # ------------------------------------------------------------------ cross-rank helpers

    def _sum_replicas(self, values: Sequence[float]) -> list[float]:
        """Element-wise sum over DP replicas (one reporting rank each); every rank gets the totals."""
        if self.world_size == 1:
            return [float(v) for v in values]
        t = torch.tensor(values, dtype=torch.float64, device=self.device) * float(self._reporter)
        dist.all_reduce(t)
        return t.tolist()

    def _metric_names(self, sums: dict[str, float]) -> list[str]:
        """The same sorted names on every rank (only last stages computed any)."""
        names = set(sums) | self._builtin_metrics()
        if self.world_size > 1:
            gathered: list[Any] = [None] * self.world_size
            dist.all_gather_object(gathered, sorted(names))
            names = set().union(*gathered)
        return sorted(names)

    def _from_last_stage(self, flat: torch.Tensor | None, n: int) -> torch.Tensor:
        """The last pipeline stage's ``[n]`` tensor, on every stage."""
        from megatron.core import parallel_state as ps

        if self.pp_size == 1:
            return flat
        buf = flat.float() if flat is not None else torch.empty(n, dtype=torch.float32, device=self.device)
        dist.broadcast(
            buf, src=ps.get_pipeline_model_parallel_last_rank(), group=ps.get_pipeline_model_parallel_group()
        )
        return buf

    def _check_same_samples(self, samples: Sequence[TrainSample]) -> None:
        """TP/PP peers compute one model together, so they must hold the same samples: refuse otherwise."""
        from megatron.core import parallel_state as ps

        if self.tp_size * self.pp_size == 1:
            return
        h = 0
        for s in samples:
            h = zlib.crc32(np.asarray(s.tokens + s.loss_mask + [s.response_length], dtype=np.int64).tobytes(), h)
            h = zlib.crc32(repr(s.policy).encode(), h)  # several policies: peers must route the same spans
        t = torch.tensor([h, -h, len(samples), -len(samples)], dtype=torch.int64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=ps.get_model_parallel_group())
        if t[0] != -t[1] or t[2] != -t[3]:
            raise ValueError(
                f"rank {self.rank}: the tensor/pipeline-parallel ranks of one model replica were given "
                f"different samples; give every rank of data-parallel rank {self.dp_rank} the same shard "
                f"(shard the batch over the {self.dp_size} data-parallel replicas, not over all ranks)"
            )

    # ------------------------------------------------------------------ weights and checkpoints

    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Full weights in HF names on every rank; a collective (all ranks iterate in lockstep)."""
        from megatron.core import parallel_state as ps

        yield from iter_hf_weights(
            self.model,
            self.hf_config,
            tp_group=ps.get_tensor_model_parallel_group(),
            pp_group=ps.get_pipeline_model_parallel_group(),
            # the engines serve W + (alpha/r) B A; several policies: the base, each adapter pushed by its name
            merge=self.lora.merge() if self.lora is not None else None,
        )

    def adapter_weights(self, policy: str | None = None) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """A LoRA policy's whole adapter (PEFT's names, full, on CPU) and its PEFT config, on every rank: what a
        LoRA run's engines load instead of the merged weights. A collective over TP and PP. ``policy``: which
        ``--policy`` (None: the run's one adapter)."""
        assert self._adapted(), "adapter_weights: this trainer has no adapter (--lora-rank 0)"
        lora = self._lora_of(policy)
        return self._adapter_state(policy=policy), adapter_config_dict(lora.peft_config(self.checkpoint_path))

    def _lora_of(self, policy: str | None) -> MegatronLora:
        """The run's one adapter (``policy`` None) or a ``--policy``'s; refused naming what this trainer trains."""
        if self.routes is None and policy is None and self.lora is not None:
            return self.lora
        if self.routes is None or policy is None:
            raise ValueError(
                f"no adapter of policy {policy!r}: this trainer trains "
                + (f"the policies {self.policies}" if self.policies else "one adapter (no --policy)")
            )
        return self.routes.of(policy)

    def adapted_modules(self) -> set[str]:
        """The adapted modules' last names (``q_proj``); empty without an adapter."""
        if self.routes is not None:
            return self.routes.adapted_modules()
        return self.lora.adapted_modules() if self.lora is not None else set()

    def _adapter_state(
        self, of: Callable[[nn.Parameter], torch.Tensor | None] | None = None, *, policy: str | None = None
    ) -> dict[str, torch.Tensor]:
        """The whole adapter (or what ``of`` picks of each parameter: ``lambda p: p.grad``) in PEFT's names."""
        from megatron.core import parallel_state as ps

        return self._lora_of(policy).peft_state(
            of or (lambda p: p.detach()),
            tp_group=ps.get_tensor_model_parallel_group(),
            pp_group=ps.get_pipeline_model_parallel_group(),
        )

    def _layout(self) -> dict[str, int]:
        p = self.parallel
        return {
            "world_size": self.world_size,
            "tp": p.tensor_model_parallel_size,
            "pp": p.pipeline_model_parallel_size,
            "cp": p.context_parallel_size,
        }

    def _trainer_state(self, extra_state: dict[str, Any] | None) -> dict[str, Any]:
        """What rank 0 writes as ``trainer_state.pt``."""
        return {
            "step": self.step,
            "world_size": self.world_size,
            "layout": self._layout(),
            "extra_state": extra_state or {},
        }

    def _rank_state(self) -> dict[str, Any]:
        """What every rank writes of its own: optimizer shard, RNG states (torch, python, numpy, megatron's)."""
        from megatron.core import tensor_parallel

        return {
            "optimizer": self.optimizer.state_dict(),
            "rng": rng_state(),
            "megatron_rng": tensor_parallel.get_cuda_rng_tracker().get_states(),
        }

    def _read_trainer_state(self, path: Path, what: str) -> dict[str, Any]:
        """``trainer_state.pt``, refused when its layout is not this run's (optimizer shards are per rank)."""
        state = torch.load(path / "trainer_state.pt", weights_only=False)
        if state.get("layout") != self._layout():
            raise ValueError(
                f"{path} was saved with layout {state.get('layout') or 'of the torch backend'}; resuming "
                f"the megatron {what} needs the same world size and tp/pp/cp ({self._layout()}). "
                "Start a new run from its HF weights with --hf-checkpoint instead"
            )
        return state

    def _restore_rank_state(self, ranked: dict[str, Any], state: dict[str, Any]) -> dict[str, Any]:
        """Put back what :meth:`_rank_state` wrote and the step; return the checkpoint's ``extra_state``."""
        from megatron.core import tensor_parallel

        self.optimizer.load_state_dict(ranked["optimizer"])
        restore_learning_rates(self.optimizer, self.cfg)
        set_rng_state(ranked["rng"])
        tensor_parallel.get_cuda_rng_tracker().set_states(ranked["megatron_rng"])
        self.step = state["step"]
        return state["extra_state"]

    def save(self, path: str | Path, extra_state: dict[str, Any] | None = None) -> None:
        """Write the checkpoint layout of the module docstring. A collective: every rank must call it."""
        from safetensors.torch import save_file
        from transformers import GenerationConfig

        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)  # every rank: its optimizer shard goes here too, maybe on its own node
        weights = {}
        for name, t in self.named_weights():
            if self.rank == 0:
                weights[name] = t.detach().cpu().contiguous()
        if self.rank == 0:
            save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})
            gen = (
                GenerationConfig.from_pretrained(str(self.checkpoint_path))
                if (self.checkpoint_path / "generation_config.json").is_file()
                else None
            )
            save_hf_metadata(
                SimpleNamespace(config=self.hf_config, generation_config=gen), self.checkpoint_path, path, torch.float32
            )
            torch.save(self._trainer_state(extra_state), path / "trainer_state.pt")
        del weights
        if self.lora is not None:  # beside the merged model: the adapter in PEFT's format (a collective)
            tensors = self._adapter_state()
            if self.rank == 0:
                write_adapter(path, tensors, self.lora.peft_config(self.checkpoint_path))
        for name in self.policies:  # each policy's adapter in PEFT's format: iter_N/adapters/NAME, and their order
            tensors = self._adapter_state(policy=name)
            if self.rank == 0:
                write_peft_folder(
                    path / POLICIES_DIR / name, tensors, self._lora_of(name).peft_config(self.checkpoint_path)
                )
        if self.policies and self.rank == 0:
            write_policy_order(path, self.policies)
        self._barrier()
        torch.save(self._rank_state(), path / f"optim_rank{self.rank}.pt")
        self._barrier()

    def load(self, path: str | Path) -> dict[str, Any]:
        """Restore weights, optimizer, RNG and step from :meth:`save`; return its ``extra_state``."""
        path = Path(path)
        state = self._read_trainer_state(path, "backend")
        # a LoRA run's base stays as loaded and its adapter resumes: this run's adapter, on this base; refused
        # before anything here is replaced
        check_resume(path, self.cfg, self.checkpoint_path, what=str(path), adapted=self._adapted())
        ranked = torch.load(path / f"optim_rank{self.rank}.pt", weights_only=False)
        if self.routes is not None:  # every policy's adapter checked against this run before any is replaced
            checked = [
                self.routes.of(name).checked_shards(
                    load_file(str(path / POLICIES_DIR / name / "adapter_model.safetensors")),
                    source=str(path / POLICIES_DIR / name),
                )
                for name in self.policies
            ]
            for shards in checked:
                MegatronLora.copy_shards(shards)
        elif self.lora is not None:
            adapter = path / ADAPTER_DIR
            self.lora.load_peft_state(load_file(str(adapter / "adapter_model.safetensors")), source=str(adapter))
        else:
            load_hf_checkpoint(
                self.model,
                path,
                self.hf_config,
                tp_rank=self.tp_rank,
                tp_size=self.tp_size,
                pp_rank=self.pp_rank,
                pp_size=self.pp_size,
            )
        return self._restore_rank_state(ranked, state)

    def close(self) -> None:
        """Forget megatron's parallel state (and the process group, if this trainer started it)."""
        destroy_megatron_parallel()
        if self._owns_group and dist.is_initialized():
            dist.destroy_process_group()
        self._owns_group = False

    def _barrier(self) -> None:
        if self.world_size > 1:
            dist.barrier()


# ---------------------------------------------------------------------- module helpers


def _buckets(tensors: Sequence[torch.Tensor], max_elems: int = 1 << 26) -> Iterator[list[torch.Tensor]]:
    """Consecutive groups of same-dtype tensors of at most ``max_elems`` elements (one all-reduce each)."""
    bucket: list[torch.Tensor] = []
    size = 0
    for t in tensors:
        if bucket and (size + t.numel() > max_elems or t.dtype != bucket[0].dtype):
            yield bucket
            bucket, size = [], 0
        bucket.append(t)
        size += t.numel()
    if bucket:
        yield bucket


def _init_process_group(rank: int, world_size: int, device: torch.device) -> bool:
    """Make sure torch.distributed is up; True if this call started it (world 1: a private loopback group)."""
    if dist.is_initialized():
        return False
    backend = "gloo" if device.type == "cpu" else "nccl"
    if world_size > 1:
        dist.init_process_group(backend, rank=rank, world_size=world_size)  # env://, as TorchTrainer
        return True
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    return True


__all__ = ["MegatronParallel", "MegatronTrainer"]
