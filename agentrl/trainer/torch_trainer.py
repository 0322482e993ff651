"""The ``torch`` backend: any local Hugging Face causal LM, plain PyTorch, FSDP2 when world > 1.

One :class:`TorchTrainer` per rank. A step is the textbook loop, with three RL-specific details:

* **packing**: micro-batches are rows of whole samples packed to ``max_tokens_per_gpu`` tokens
  (:mod:`agentrl.trainer.batching`), isolated from each other by restarting ``position_ids``;
* **logits only where needed**: the LM head runs only at the positions that predict response
  tokens (``logits_to_keep=positions``), and log-probs are ``z[target] - logsumexp(z)``, so no
  ``[T, V]`` log-softmax of the prompt is ever built;
* **global normalization**: :func:`agentrl.algo.loss.policy_loss` divides by the masked-token and
  sample counts of the WHOLE optimizer step on ALL ranks, so gradient accumulation over micro-batches
  and ranks gives exactly the single-batch gradient. FSDP averages gradients over ranks; the loss is
  multiplied by ``world_size`` to turn that average back into the sum the normalization expects.

Sharded ranks must run the same number of forward/backward passes (FSDP's collectives pair up
across ranks), so a rank with fewer micro-batches than the busiest one runs empty ones.

Precision: the trained weights, gradients and AdamW state are fp32; ``dtype`` (``auto`` = fp32 on
CPU, bf16 on GPU) is the *compute* dtype, applied with autocast. Pure-bf16 weights would silently
drop RL-sized updates (lr 1e-6 on a weight of 0.01 is below bf16's resolution). The frozen
reference model is stored in the compute dtype. Checkpoints hold the fp32 weights, so a resume is
exact. Dropout is switched off at load: an RL step must see ratio = 1 on its first pass.

Checkpoint layout written by :meth:`TorchTrainer.save` (a loadable HF folder plus state)::

    config.json, generation_config.json, tokenizer files   (copied from the source checkpoint)
    model.safetensors                                      (full weights, tied copies once)
    trainer_state.pt      {"step", "world_size", "extra_state"}                (rank 0)
    optim_rank{r}.pt      {"optimizer": state_dict (local shards), "rng": ...}  (every rank)
    adapter/              --lora-rank: the adapter in PEFT's format (model.safetensors is then the merged
                          model; the optimizer state is the adapter's; :mod:`agentrl.trainer.lora`)

Resuming needs the same world size (optimizer shards are per rank).
"""

from __future__ import annotations

import contextlib
import math
import random
import shutil
from collections import defaultdict
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from peft import PeftModel
from peft.tuners.lora import LoraLayer
from torch import nn

from agentrl.algo.loss import entropy_from_logits, policy_loss
from agentrl.config import TrainConfig
from agentrl.cpu_share import CoreShare
from agentrl.images import load_image
from agentrl.trainer import packed_attention
from agentrl.trainer.base import (
    LogProbs,
    Trainer,
    TrainSample,
    load_custom_loss,
    mean_over_trained,
    restore_learning_rates,
    run_optimizer_steps,
    with_gradient,
)
from agentrl.trainer.batching import PackedBatch, block_causal_mask, pack_micro_batches, pack_samples
from agentrl.trainer.chunked_logprobs import chunked_log_probs, head_is_plain, plain_head
from agentrl.trainer.lean_activations import make_lean
from agentrl.trainer.lora import (
    ADAPTER_DIR,
    ADAPTER_NAME,
    POLICIES_DIR,
    adapter_config_dict,
    adapter_state,
    add_lora,
    apply_adapter,
    check_adapter,
    check_resume,
    merged_weights,
    read_adapter,
    save_adapter,
    write_peft_folder,
    write_policy_order,
)
from agentrl.trainer.lora_policies import (
    add_policies,
    policies_loss,
    policy_counts,
    policy_lr_metrics,
    policy_param_groups,
    policy_parameters,
    policy_spans,
    refuse_unknown,
    routed,
    sorted_by_policy,
    unknown_policies,
)
from agentrl.vlm import by_key, load_vision_model, vision_for

CHUNK_LOGITS_ABOVE = 64 * 2**20  # elements (256 MiB of fp32 logits)
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".safetensors.index.json", ".bin.index.json")
_WRITTEN_BY_SAVE = ("config.json", "generation_config.json", "trainer_state.pt")


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """``auto`` = fp32 on CPU (bf16 matmuls are >10x slower there), bf16 on an accelerator."""
    if name == "auto":
        return torch.float32 if device.type == "cpu" else torch.bfloat16
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


def load_causal_lm(path: str | Path, dtype: torch.dtype, device: torch.device) -> nn.Module:
    """A local HF causal LM with dropout off (see the module docstring) and no KV cache.

    Dropout rates are zeroed in the config BEFORE the model is built: modules copy them at init.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(str(path), local_files_only=True)
    for key in ("attention_dropout", "hidden_dropout", "dropout", "resid_pdrop", "embd_pdrop", "attn_pdrop"):
        if isinstance(getattr(config, key, None), float):
            setattr(config, key, 0.0)
    config.use_cache = False
    model = AutoModelForCausalLM.from_pretrained(str(path), config=config, dtype=dtype, local_files_only=True)
    for module in model.modules():
        if isinstance(module, nn.Dropout):
            module.p = 0.0
    return model.to(device)


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The transformer blocks (HF names their class in ``_no_split_modules``): FSDP's shard units."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    layers = [m for m in model.modules() if type(m).__name__ in names]
    if not layers:
        layers = [
            block
            for name, mod in model.named_modules()
            if name.endswith("layers") and isinstance(mod, nn.ModuleList)
            for block in mod
        ]
    return layers


def _full(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's full value (a collective: every rank must call it), or the tensor itself."""
    t = t.detach()
    return t.full_tensor() if hasattr(t, "full_tensor") else t


class TorchTrainer(Trainer):
    """HF transformers + AdamW (+ FSDP2 when ``world_size > 1``), one instance per rank.

    With ``world_size > 1`` the process group must be initialised (the runtime's
    :class:`~agentrl.runtime.trainer_group.TrainerGroup` does it), or ``MASTER_ADDR``/``MASTER_PORT``
    must be set for ``env://`` (torchrun does that); this rank's samples are its shard.
    """

    def __init__(
        self,
        checkpoint_path: str | Path,
        cfg: TrainConfig,
        *,
        rank: int = 0,
        world_size: int = 1,
        device: str | torch.device | None = None,
        resident_state: bool | None = None,
    ):
        """``resident_state``: fused AdamW over gradients and moments allocated at load and kept for the
        whole run (see below); None = on for a CPU trainer in one process, the only place it was measured
        (True elsewhere is refused). It lowers the step's peak memory; the gradients (one more copy of the
        weights) then also stay allocated between steps, while rollouts run."""
        cfg.validate()
        self.custom_loss_fn = load_custom_loss(cfg)
        self.cfg, self.rank, self.world_size = cfg, rank, world_size
        self.checkpoint_path = Path(checkpoint_path)
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.dtype = resolve_dtype(cfg.dtype, self.device)  # compute dtype; trained weights stay fp32
        measured = self.device.type == "cpu" and world_size == 1
        if resident_state not in (None, True, False):
            raise TypeError(f"resident_state must be True, False or None, not {resident_state!r}")
        if resident_state and not measured:
            raise ValueError(
                f"resident_state=True is for a CPU trainer in one process (this one: {self.device.type}, "
                f"{world_size} ranks): leave it None there"
            )
        torch.manual_seed(cfg.seed + rank)
        if world_size > 1 and not dist.is_initialized():
            dist.init_process_group("gloo" if self.device.type == "cpu" else "nccl", rank=rank, world_size=world_size)
        # a vision-language checkpoint: its family computes image features, merged here as inputs_embeds
        self.vision = vision_for(self.checkpoint_path)
        if self.vision is not None and world_size > 1:
            raise ValueError(
                f"a vision-language policy trains on one rank here, not {world_size} (FSDP2 is not wired in)"
            )
        self.model = self._load(torch.float32)
        if self.vision is not None and cfg.freeze_vision_tower:
            for module in self.vision.vision_modules(self.model):
                module.requires_grad_(False)
        # LoRA: PEFT's layers replace the targeted linears in place; self.model stays the HF model that runs
        self.peft: PeftModel | None = None
        # several policies (--policy): one adapter each, a token's adapter chosen by its sample's policy
        self.policies: list[str] = list(cfg.policy) if cfg.lora_rank and self._takes_lora() else []
        self._routing = False
        self._policy_grad_norms: dict[str, float] = {}
        if cfg.lora_rank and self._takes_lora():
            if self.vision is not None:
                raise ValueError("--lora-rank adapts text-only causal LMs here, not a vision-language model")
            # every rank draws the same adapter (the seed is per rank); every generator comes back as it was
            cuda = list(range(torch.cuda.device_count())) if torch.cuda.is_available() else []
            with torch.random.fork_rng(devices=cuda):
                torch.manual_seed(cfg.seed)
                if cfg.policy:  # several policies: an adapter each, trained from one mixed stream
                    self.peft = add_policies(self.model, cfg, self.checkpoint_path)
                else:
                    self.peft = add_lora(self.model, cfg, self.checkpoint_path)
            if cfg.lora_adapter_path:  # continue an adapter (a LoRA warm start's) instead of a fresh one
                adapter = Path(cfg.lora_adapter_path)
                check_adapter(adapter, cfg, self.checkpoint_path, what=f"--lora-adapter-path {adapter}")
                apply_adapter(self.model, read_adapter(self.model, adapter), world_size)
        # per-sample attention inside packed rows (no cross-sample T x T work), where transformers allows
        self.packed_attention = packed_attention.enable(self.model)
        self.explicit_mask = not self.packed_attention and not _packing_is_isolated(self.model, self.device)
        self._adapt_model()
        # RMSNorm and SwiGLU keep fewer activations for backward (one process: FSDP2 frees a layer's
        # unsharded weights after its forward, and these functions hold them for backward)
        self.lean_modules = make_lean(self.model) if world_size == 1 else 0
        if cfg.gradient_checkpointing:
            _enable_activation_checkpointing(self.model)
        self.ref_model = None
        if cfg.needs_ref_model and self.peft is None:  # a KL loss, or KL-shaped rewards (--kl-coef); LoRA: the base
            self.ref_model = self._load(self.dtype).eval()
            self.ref_model.requires_grad_(False)
            if self.packed_attention and not packed_attention.enable(self.ref_model):
                self.packed_attention, self.explicit_mask = False, not _packing_is_isolated(self.model, self.device)
        # log-probs and entropy straight from hidden states, never the [N, V] logits (one process: a
        # sharded head would need its full weight gathered per chunk)
        self.chunked_logprobs = world_size == 1 and head_is_plain(self.model, self.device)
        # ...when a micro-batch's [N, V] logits would hold at least this many elements: below it the one
        # big head matmul is faster and the logits are small (bench P4: -7..10% speed for ~120 MiB at
        # 1024-token rows of SmolLM2; +7% speed and -0.9 GiB at 4096)
        self.chunk_logits_above = CHUNK_LOGITS_ABOVE
        if world_size > 1:
            self._shard()
        # Resident state (CPU, one process): AdamW's fused kernel instead of torch's per-tensor loop, and
        # the gradients and moments allocated at load, zeroed rather than freed between steps. Allocated
        # during the first step they lie among its activations and glibc's heap fragments (bench P4, 16
        # samples, 512-token rows: 3,705 MiB peak against 3,848-3,861, and faster; bench/README.md).
        # GPUs keep torch's defaults (the caching allocator reuses blocks; not measured there).
        self.fused_adamw = self.keep_grads = measured if resident_state is None else bool(resident_state)
        params: Any = [p for p in self.model.parameters() if p.requires_grad]
        if self.policies:  # a parameter group per policy: its own learning rate (AdamW's state is per tensor anyway)
            params = policy_param_groups(cfg, lambda n: policy_parameters(self.model, n))
        self.optimizer = torch.optim.AdamW(
            params,
            lr=cfg.lr,
            betas=(cfg.adam_beta1, cfg.adam_beta2),
            weight_decay=cfg.weight_decay,
            eps=1e-8,
            fused=self.fused_adamw or None,
        )
        # the parameters that received a gradient in this step: a kept (zeroed) gradient of one that
        # received none is dropped before the optimizer steps, so AdamW skips it exactly as with freed
        # gradients (a mixture-of-experts layer leaves its unrouted experts without a gradient)
        self._got_grad: set[int] = set()
        if self.keep_grads:
            self._allocate_step_state()
        self.step = 0
        self._check_weights_finite()
        # CPU: a CoreShare re-sizing torch's threads before every micro-batch (the trainer actor sets it
        # with --cpu-threads adaptive); None keeps the threads as they are
        self.core_share: CoreShare | None = None

    def _load(self, dtype: torch.dtype) -> nn.Module:
        if self.vision is not None:
            return load_vision_model(self.checkpoint_path, dtype, self.device)
        return load_causal_lm(self.checkpoint_path, dtype, self.device)

    def _inputs(self, model: nn.Module, batch: PackedBatch) -> dict[str, torch.Tensor]:
        """The row as the model reads it: its ids, or (images in it) embeddings with the image features
        written at the placeholders (:mod:`agentrl.vlm` says why the SDK merges them itself)."""
        if not batch.images:
            return {"input_ids": batch.input_ids}
        assert self.vision is not None and batch.image_positions is not None
        with packed_attention.no_segments():
            feats = torch.cat([self.vision.features(model, px) for px in batch.images])
        pos = batch.image_positions
        if feats.shape[0] != pos.numel():
            raise ValueError(
                f"the row's {len(batch.images)} image(s) give {feats.shape[0]} feature rows for {pos.numel()} "
                "placeholder tokens: the samples' multimodal_train_inputs do not match their tokens"
            )
        embeds = model.get_input_embeddings()(batch.input_ids)  # [1, T, hidden]
        embeds = embeds.index_put((torch.zeros_like(pos), pos), feats.to(embeds.dtype))
        return {"inputs_embeds": embeds}

    def _process_images(self, samples: Sequence[TrainSample]) -> None:
        """Fill ``multimodal_train_inputs`` of samples that carry only their images (read from a dump, or
        made by a custom generate function) with the processor's arrays, as the rollout would have. The
        samples are changed in place (this rank's copies), so later passes over them reuse the arrays; a
        sample whose images cannot be used stops the step naming it."""
        for i, s in enumerate(samples):
            urls = (s.multimodal_inputs or {}).get("images")
            if s.multimodal_train_inputs or not urls:
                continue
            assert self.vision is not None
            if not isinstance(urls, list) or not all(isinstance(u, str) for u in urls):
                raise ValueError(f"sample {i}: multimodal_inputs['images'] must be a list of image URLs (str)")
            try:
                pixels = [self.vision.pixels(load_image(u)) for u in urls]
            except ValueError as exc:  # ImageError, or the processor refusing it
                raise ValueError(f"sample {i}: {exc}") from None
            s.multimodal_train_inputs = by_key(pixels)  # kept: later passes reuse it

    def _adapt_model(self) -> None:
        """A subclass's change to the architecture, before sharding and the optimizer (the critic's value head)."""

    def _takes_lora(self) -> bool:
        """Whether ``--lora-rank`` adapts this model (the policy does; ppo's critic trains in full)."""
        return True

    @property
    def has_reference(self) -> bool:
        """A reference policy to score against: the frozen model, or (LoRA) the base with the adapter off."""
        return self.ref_model is not None or (self.peft is not None and self.cfg.needs_ref_model)

    def _reference(self) -> tuple[nn.Module, Any]:
        """The reference model and a fresh context to run it in (LoRA: the policy's own model, adapter disabled)."""
        if self.ref_model is not None:
            return self.ref_model, contextlib.nullcontext()
        assert self.peft is not None and self.cfg.needs_ref_model
        if self.policies:
            return self.model, self._every_adapter_off()
        return self.model, self.peft.disable_adapter()

    @contextlib.contextmanager
    def _every_adapter_off(self) -> Iterator[None]:
        """Several policies' reference: every adapter off (PEFT's ``disable_adapter``), and afterwards every
        policy's adapter trainable again (PEFT's exit re-enables only the active adapter's gradients)."""
        assert self.peft is not None
        try:
            with self.peft.disable_adapter():
                yield
        finally:
            for group in self.optimizer.param_groups:
                for p in group["params"]:
                    p.requires_grad_(True)

    def _with_gradient(self, samples: Sequence[TrainSample]) -> list[TrainSample]:
        """The samples a step must run forward and backward (:func:`with_gradient`)."""
        return with_gradient(samples, self.cfg)

    def _builtin_metrics(self) -> set[str]:
        """Metric names every rank reports, even one that ran only empty passes."""
        if self.cfg.loss_type == "custom_loss":  # a custom loss reports its own, not zeros for terms it never computed
            return {"loss"}
        return {"loss", "pg_loss", "kl", "entropy", "clipfrac"}

    def _shard(self) -> None:
        """FSDP2: each decoder layer is one all-gather unit, the root holds embeddings and head."""
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh(self.device.type, (self.world_size,))
        for model in filter(None, (self.model, self.ref_model)):
            for layer in decoder_layers(model):
                fully_shard(layer, mesh=mesh)
            fully_shard(model, mesh=mesh)

    # ------------------------------------------------------------------ forward passes

    def _autocast(self):
        """bf16/fp16 compute over fp32 master weights: a 1e-6 AdamW update vanishes in bf16 weights."""
        return torch.autocast(self.device.type, dtype=self.dtype, enabled=self.dtype != torch.float32)

    @contextlib.contextmanager
    def _segments(self, batch: PackedBatch) -> Iterator[None]:
        """Announce the row's samples to the per-sample attention (re-entering it is harmless) and, with several
        policies, route each token through its sample's adapter (:func:`routed`; entered once, however nested)."""
        with contextlib.ExitStack() as stack:
            if self.packed_attention:
                stack.enter_context(packed_attention.segments(batch.position_ids))
            if self.policies and not self._routing:
                spans = policy_spans(batch.policies, batch.lengths, self.policies)
                stack.enter_context(routed(self.model, spans))
                self._routing = True
                stack.callback(setattr, self, "_routing", False)
            yield

    def _logits(self, model: nn.Module, batch: PackedBatch) -> torch.Tensor:
        """Logits [N, V] at the positions that predict the batch's response tokens."""
        mask = block_causal_mask(batch.position_ids, self.dtype) if self.explicit_mask else None
        with self._autocast(), self._segments(batch):
            out = model(
                **self._inputs(model, batch),
                position_ids=batch.position_ids,
                attention_mask=mask,
                use_cache=False,
                logits_to_keep=batch.logit_positions,
            )
        logits = out.logits[0]
        # the engine's log-probs are log_softmax(logits / T) (SGLang); train on the same distribution
        t = self.cfg.logit_temperature
        return logits if t in (0.0, 1.0) else logits / t

    def _log_probs(
        self, model: nn.Module, batch: PackedBatch, *, entropy: bool
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Log-probs [N] of the batch's targets, and their entropies [N] when ``entropy`` (fp32 both).

        With a plain LM head (:mod:`agentrl.trainer.chunked_logprobs`) and logits of at least
        ``chunk_logits_above`` elements, the head runs a chunk of rows at a time and no ``[N, V]``
        tensor is kept for backward; otherwise from the full logits.
        """
        head = plain_head(model) if self.chunked_logprobs else None
        if head is None or batch.targets.numel() * head.out_features < self.chunk_logits_above:
            logits = self._logits(model, batch)
            logp = _target_log_probs(logits, batch.targets)
            if not entropy:
                return logp, None
            if self.cfg.entropy_coef > 0:
                return logp, entropy_from_logits(logits)
            with torch.no_grad():  # a metric only: keep no [N, V] graph for it
                return logp, entropy_from_logits(logits.detach())
        mask = block_causal_mask(batch.position_ids, self.dtype) if self.explicit_mask else None
        with self._autocast(), self._segments(batch):
            hidden = model.get_decoder()(
                **self._inputs(model, batch), position_ids=batch.position_ids, attention_mask=mask, use_cache=False
            ).last_hidden_state[0, batch.logit_positions]
            return chunked_log_probs(
                hidden, head, batch.targets, temperature=self.cfg.logit_temperature, with_entropy=entropy
            )

    def _dummy_pass(self, model: nn.Module, *, backward: bool) -> None:
        """A one-token pass that contributes nothing, so FSDP collectives stay paired across ranks (several
        policies: the token on the first policy's adapter, every other adapter on no token, so each gets its zero
        gradient as on the ranks with rows)."""
        ids = torch.zeros(1, 1, dtype=torch.long, device=self.device)
        routing = contextlib.nullcontext()
        if self.policies and model is self.model and not self._routing:
            routing = routed(self.model, policy_spans([self.policies[0]], [1], self.policies))
        with routing:  # around the backward too: activation checkpointing runs the forward again there
            with self._autocast():
                out = model(input_ids=ids, position_ids=ids, use_cache=False, logits_to_keep=1)
            if backward:
                (out.logits.sum() * 0.0).backward()

    def _micro_batches(self, samples: Sequence[TrainSample], *, train: bool) -> list[PackedBatch | None]:
        """Packed micro-batches of this rank, padded with ``None`` (empty passes) to the busiest rank's count."""
        groups = pack_micro_batches(
            [len(s.tokens) for s in samples], self.cfg.token_budget(self.device.type), self.cfg.micro_batch_size
        )
        n = len(groups)
        unknown = unknown_policies([s.policy for s in samples], self.policies) if self.policies else []
        bad = len(unknown)
        if self.world_size > 1:  # the busiest rank's count, and whether any rank holds a sample of no policy
            t = torch.tensor([n, bad], dtype=torch.long, device=self.device)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            n, bad = int(t[0]), int(t[1])
        refuse_unknown(unknown, bad, self.policies)
        image_token = self.vision.image_token_id if self.vision is not None else None
        if self.vision is not None:
            self._process_images(samples)
        if self.policies:  # each policy's samples side by side in a row: one adapter span a policy (:func:`routed`)
            groups = sorted_by_policy(groups, [s.policy for s in samples], self.policies)
        batches: list[PackedBatch | None] = [
            pack_samples(samples, g, need_advantages=train, image_token_id=image_token) for g in groups
        ]
        return batches + [None] * (n - len(groups))

    @torch.no_grad()
    def compute_log_probs(self, samples: list[TrainSample], *, ref: bool) -> LogProbs:
        """Per-response-token log-probs under the current weights (and the reference model when ``ref``).

        ``ref`` needs ``--use-kl-loss`` or ``--kl-coef`` (only then is a reference model loaded).
        """
        if ref and not self.has_reference:
            raise ValueError("reference log-probs need a reference model: set --use-kl-loss or --kl-coef")
        self.model.eval()
        old: list[list[float]] = [[] for _ in samples]
        refs: list[list[float]] = [[] for _ in samples]
        for batch in self._micro_batches(samples, train=False):
            if self.core_share is not None:
                self.core_share.apply()
            passes = [(self.model, contextlib.nullcontext(), old)] + ([(*self._reference(), refs)] if ref else [])
            for model, context, out in passes:
                with context:
                    if batch is None:
                        self._dummy_pass(model, backward=False)
                        continue
                    b = batch.to(self.device)
                    logp, _ = self._log_probs(model, b, entropy=False)
                for i, values in zip(b.indices, b.split(logp)):
                    out[i] = values
        return LogProbs(old=old, ref=refs if ref else None)

    # ------------------------------------------------------------------ training

    def train_step(self, samples: list[TrainSample]) -> dict[str, float]:
        """``num_steps_per_rollout`` optimizer steps over ``samples`` cut into equal consecutive chunks.

        Normally each chunk holds ``global_batch_size // world_size`` samples (this rank's shard of
        one global batch). Metrics are step means, global over ranks; ``train_tokens`` counts the
        masked response tokens trained on, ``tokens_per_s`` every token through the model.
        """
        self.model.train()
        try:
            metrics = run_optimizer_steps(
                samples,
                self.cfg.num_steps_per_rollout,
                self._optimizer_step,
                self._sum_over_ranks,
                self.optimizer.param_groups[0]["lr"],
            )
        finally:
            self.model.eval()
        return {**metrics, **policy_lr_metrics(self.optimizer)}  # each --policy's own (--policy-lr)

    def _optimizer_step(self, samples: Sequence[TrainSample]) -> dict[str, float] | None:
        """One global batch: accumulate micro-batch gradients, clip, step. None if no rank had samples."""
        live = self._with_gradient(samples)
        num_tokens, num_seqs, live_tokens, live_seqs = self._sum_over_ranks(
            [sum(sum(s.loss_mask) for s in samples), len(samples), sum(sum(s.loss_mask) for s in live), len(live)]
        )
        if num_seqs == 0:
            return None
        counts = self._policy_counts(samples)
        self.optimizer.zero_grad(set_to_none=not self.keep_grads)
        self._got_grad.clear()
        sums: dict[str, float] = defaultdict(float)
        # no rank has a sample with a gradient: one empty pass still gives every weight a zero gradient,
        # so the optimizer steps exactly as over the full batch (AdamW's moments and decay move it)
        batches = self._micro_batches(live, train=True) or [None]
        for batch in batches:
            if self.core_share is not None:
                self.core_share.apply()
            if batch is None:
                self._dummy_pass(self.model, backward=True)
                continue
            batch = batch.to(self.device)
            with self._segments(batch):  # activation checkpointing recomputes the forward in backward
                if counts is None:  # (a critic's override takes no policies)
                    loss, metrics = self._micro_batch_loss(batch, num_tokens, num_seqs)
                else:
                    loss, metrics = self._micro_batch_loss(batch, num_tokens, num_seqs, counts)
                (loss * self.world_size).backward()
            sums["loss"] += float(loss.detach())
            for k, v in metrics.items():
                sums[k] += v
        if self.policies:  # each adapter steps as if trained alone: a zero gradient where none of its rows had one
            for group in self.optimizer.param_groups:
                for p in group["params"]:
                    if p.grad is None:
                        p.grad = torch.zeros_like(p)
                    self._got_grad.add(id(p))
        if self.keep_grads:
            self._drop_unused_grads()
        grad_norm = self._clip_grad()
        self.optimizer.step()
        if not self.keep_grads:
            self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        self._check_weights_finite()
        keys = self._metric_names(sums)
        totals = self._sum_over_ranks([sums[k] for k in keys])  # each rank's share is globally normalized
        metrics = mean_over_trained(dict(zip(keys, totals)), self.cfg, (num_tokens, num_seqs), (live_tokens, live_seqs))
        return dict(metrics, grad_norm=grad_norm, skipped_samples=num_seqs - live_seqs, **self._policy_grad_norms)

    def _policy_counts(self, samples: Sequence[TrainSample]) -> dict[str, tuple[float, float]] | None:
        """Several policies: each policy's ``(trained tokens, samples)`` of the step over every rank, its loss's
        normalizers (None for one policy)."""
        if not self.policies:
            return None
        return policy_counts(
            [s.policy for s in samples], [s.loss_mask for s in samples], self.policies, self._sum_over_ranks
        )

    def _micro_batch_loss(
        self,
        b: PackedBatch,
        num_tokens: float,
        num_seqs: float,
        counts: dict[str, tuple[float, float]] | None = None,
    ):
        """Forward one packed micro-batch and return :func:`policy_loss`'s ``(loss, metrics)``.

        Several policies (``counts``): one forward, then each policy's loss over its own tokens, normalized by its
        own counts (as if it trained alone); their sum is backpropagated, so each adapter's gradient is its own
        loss's. The metrics are the policies' weighted by their share of the step (the whole-batch means), plus
        ``pg_loss/<policy>``."""
        logp, entropy = self._log_probs(self.model, b, entropy=True)  # [N] each
        assert entropy is not None
        if self.cfg.entropy_coef <= 0:
            entropy = entropy.detach()  # a metric only: no gradient through it
        ref_logp = b.ref_log_probs
        if self.cfg.use_kl_loss and ref_logp is None:
            ref_model, context = self._reference()
            with torch.no_grad(), context:
                ref_logp, _ = self._log_probs(ref_model, b, entropy=False)
        old_logp = b.old_log_probs if b.old_log_probs is not None else logp.detach()
        if counts is not None:
            return policies_loss(
                self.policies, b, self.cfg, counts, (num_tokens, num_seqs), logp, old_logp, ref_logp, entropy
            )
        return policy_loss(
            logp,
            old_logp,
            b.advantages,
            b.mask,
            b.seq_ids,
            self.cfg,
            num_tokens=num_tokens,
            num_seqs=num_seqs,
            ref_logp=ref_logp,
            rollout_logp=b.rollout_log_probs,
            entropy=entropy,
            custom_fn=self.custom_loss_fn,
            batch=b,
        )

    def _allocate_step_state(self) -> None:
        """Gradients and AdamW's moments, allocated now and for the whole run (``keep_grads``).

        Allocated before the first forward, the 1.6 GB of state every step keeps (for SmolLM2 fp32) lies
        together in memory instead of among the first step's activations (bench P4: ~60 MiB lower peak
        than allocating it during that step). The moments are those AdamW creates at its first step
        (``step`` 0, zeros): the first update is unchanged.
        """
        for group in self.optimizer.param_groups:
            if group["amsgrad"]:  # no flag sets it today: a guard for whoever adds one
                raise ValueError("resident AdamW state is written for AdamW without amsgrad")
            for p in group["params"]:
                if not p.requires_grad:
                    continue
                p.grad = torch.zeros_like(p)
                p.register_post_accumulate_grad_hook(self._mark_grad)
                self.optimizer.state[p] = {
                    "step": torch.zeros((), dtype=torch.float32, device=p.device),
                    "exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format),
                    "exp_avg_sq": torch.zeros_like(p, memory_format=torch.preserve_format),
                }

    def _mark_grad(self, p: torch.Tensor) -> None:
        self._got_grad.add(id(p))

    def _drop_unused_grads(self) -> None:
        """Free the kept gradient of every parameter no backward of this step reached (see ``keep_grads``)."""
        for p in self.model.parameters():
            if p.grad is not None and id(p) not in self._got_grad:
                p.grad = None

    def _clip_grad(self) -> float:
        """Clip to ``clip_grad`` (0 = off) and return the pre-clip global norm. Several policies: each policy's
        adapter is clipped alone (one policy's large step does not shrink another's), its norm kept as
        ``grad_norm/<policy>``; the returned norm is over all of them."""
        max_norm = self.cfg.clip_grad if self.cfg.clip_grad > 0 else float("inf")
        if self.policies:
            norms = {}
            for group in self.optimizer.param_groups:
                params = [p for p in group["params"] if p.grad is not None]
                norms[group["policy"]] = (
                    float(_full(torch.nn.utils.clip_grad_norm_(params, max_norm))) if params else 0.0
                )
            self._policy_grad_norms = {f"grad_norm/{k}": v for k, v in norms.items()}
            return math.sqrt(sum(v * v for v in norms.values()))
        params = [p for p in self.model.parameters() if p.grad is not None]
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
        return float(_full(norm))

    def _check_weights_finite(self) -> None:
        """Set :attr:`weights_finite`: no NaN or inf in any rank's weights (every rank calls it together).

        Run where the weights change (load, optimizer step): one reduction per tensor, ~1% of a CPU
        step, which the shared-memory push then does not repeat while it copies (bench P5)."""
        bad = 0
        for t in self.model.state_dict(keep_vars=True).values():
            local = t.detach().to_local() if hasattr(t, "to_local") else t.detach()
            if local.is_floating_point() and local.numel():
                lo, hi = torch.aminmax(local)
                bad += not bool(torch.isfinite(lo) & torch.isfinite(hi))
        self.weights_finite = self._sum_over_ranks([bad])[0] == 0

    def _metric_names(self, sums: dict[str, float]) -> list[str]:
        """The same sorted names on every rank (one that ran only empty passes has none of its own)."""
        names = set(sums) | self._builtin_metrics()
        if self.world_size > 1:
            gathered: list[Any] = [None] * self.world_size
            dist.all_gather_object(gathered, sorted(names))
            names = set().union(*gathered)
        return sorted(names)

    def _sum_over_ranks(self, values: Sequence[float]) -> list[float]:
        """Element-wise sum over ranks (identity when unsharded)."""
        if self.world_size == 1:
            return [float(v) for v in values]
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        dist.all_reduce(t)
        return t.tolist()

    # ------------------------------------------------------------------ weights and checkpoints

    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Full weights in HF names, on this rank's device; tied weights once (the first name).

        Sharded: a collective (each DTensor is all-gathered), so EVERY rank must iterate it in
        lockstep, and every rank receives the full tensors.
        """
        if self.peft is not None:  # the engines serve the base with the adapter folded in (several: the base alone)
            yield from merged_weights(self.model, None if self.policies else ADAPTER_NAME)
            return
        seen: set[int] = set()
        for name, t in self.model.state_dict(keep_vars=True).items():
            if id(t) not in seen:
                seen.add(id(t))
                yield name, _full(t)

    def adapter_weights(self, policy: str | None = None) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """A LoRA policy's adapter (PEFT's names, full, on CPU) and its PEFT config: what a LoRA run's engines load
        instead of the merged weights (a collective when sharded: every rank must call it). ``policy``: which
        ``--policy`` (None: the run's one adapter)."""
        assert self.peft is not None, "adapter_weights: this trainer has no adapter (--lora-rank 0)"
        name = self._adapter_name(policy)
        return adapter_state(self.model, name), adapter_config_dict(self.peft, name)

    def _adapter_name(self, policy: str | None) -> str:
        if policy is None and not self.policies:
            return ADAPTER_NAME
        if policy not in self.policies:
            raise ValueError(f"no adapter of policy {policy!r}: this trainer trains the policies {self.policies}")
        return policy

    def adapted_modules(self) -> set[str]:
        """The adapted modules' last names (``q_proj``); empty without an adapter."""
        if self.peft is None:
            return set()
        return {n.rsplit(".", 1)[-1] for n, m in self.model.named_modules() if isinstance(m, LoraLayer)}

    def save(self, path: str | Path, extra_state: dict[str, Any] | None = None) -> None:
        """Write the checkpoint layout of the module docstring. Sharded: every rank must call it."""
        from safetensors.torch import save_file

        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)  # every rank: its optimizer shard goes here too, maybe on its own node
        weights = {name: t.cpu().contiguous() for name, t in self.named_weights()}
        if self.rank == 0:
            path.mkdir(parents=True, exist_ok=True)
            save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})
            save_hf_metadata(self.model, self.checkpoint_path, path, torch.float32)
            torch.save(
                {"step": self.step, "world_size": self.world_size, "extra_state": extra_state or {}},
                path / "trainer_state.pt",
            )
        del weights
        if self.policies:  # each policy's adapter in PEFT's format: iter_N/adapters/NAME, and their order
            for name in self.policies:
                tensors = adapter_state(self.model, name)
                if self.rank == 0:
                    write_peft_folder(path / POLICIES_DIR / name, tensors, self.peft.peft_config[name])
            if self.rank == 0:
                write_policy_order(path, self.policies)
        elif self.peft is not None:
            save_adapter(self.peft, self.model, path, write=self.rank == 0)
        self._barrier()
        torch.save({"optimizer": self.optimizer.state_dict(), "rng": rng_state()}, path / f"optim_rank{self.rank}.pt")
        self._barrier()

    def load(self, path: str | Path) -> dict[str, Any]:
        """Restore weights, optimizer, RNG and step from :meth:`save`; return its ``extra_state``."""
        from safetensors.torch import load_file

        path = Path(path)
        state = torch.load(path / "trainer_state.pt", weights_only=False)
        if state["world_size"] != self.world_size:
            raise ValueError(
                f"{path} was saved by {state['world_size']} ranks; resuming needs the same number "
                f"(this run has {self.world_size})"
            )
        optim_file = path / f"optim_rank{self.rank}.pt"
        if not optim_file.is_file():  # refused before anything of this trainer is replaced
            raise FileNotFoundError(f"{optim_file} is missing: {path} is not a complete checkpoint of this trainer")
        # a LoRA run's base stays as loaded, and the adapter (below, its optimizer) resumes: the adapter must be
        # this run's, on this base (the preflight checked it too); all refused before anything here is replaced
        check_resume(path, self.cfg, self.checkpoint_path, what=str(path), adapted=self.peft is not None)
        if self.policies:
            adapters = {}
            for name in self.policies:
                adapters.update(read_adapter(self.model, path / POLICIES_DIR / name, name))
            self.optimizer.state.clear()
            apply_adapter(self.model, adapters, self.world_size)
            del adapters
        elif self.peft is not None:
            adapter = read_adapter(self.model, path / ADAPTER_DIR)
            self.optimizer.state.clear()
            apply_adapter(self.model, adapter, self.world_size)
            del adapter
        else:
            # the resident moments go first: never two sets of moments, nor moments beside the weights being read
            self.optimizer.state.clear()
            full: dict[str, torch.Tensor] = {}
            for f in sorted(path.glob("*.safetensors")):
                full.update(load_file(str(f)))
            self._load_full_weights(full)
            del full
        self._check_weights_finite()
        ranked = torch.load(optim_file, weights_only=False)
        self.optimizer.load_state_dict(ranked["optimizer"])
        for group in self.optimizer.param_groups:  # the saved groups carry the saving process's kernel choice
            group["fused"] = self.fused_adamw or None
        restore_learning_rates(self.optimizer, self.cfg)
        set_rng_state(ranked["rng"])
        self.step = state["step"]
        return state["extra_state"]

    def _load_full_weights(self, full: dict[str, torch.Tensor]) -> None:
        """Copy full HF-named tensors into the (possibly sharded) model; tied copies may be absent."""
        names = self.model.state_dict(keep_vars=True)
        tied = {n for n, t in names.items() if sum(t is u for u in names.values()) > 1}
        missing = set(names) - set(full) - tied
        if missing:
            raise ValueError(f"checkpoint lacks weights: {sorted(missing)[:5]}")
        if self.world_size > 1:
            from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

            full = {k: v.to(self.device) for k, v in full.items() if k in names}
            set_model_state_dict(self.model, full, options=StateDictOptions(full_state_dict=True, strict=False))
        else:
            self.model.load_state_dict(full, strict=False)

    def _barrier(self) -> None:
        if self.world_size > 1:
            dist.barrier()


def _target_log_probs(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """log softmax(z)[y] = z_y - logsumexp(z), in fp32, without a [N, V] log-softmax copy. [N, V] -> [N]"""
    logits = logits.float()
    return logits.gather(1, targets[:, None])[:, 0] - torch.logsumexp(logits, dim=-1)


@torch.no_grad()
def _packing_is_isolated(model: nn.Module, device: torch.device) -> bool:
    """Does this model keep packed samples apart given only restarting ``position_ids``?

    Checked once at load on a row of two random sequences: its logits with the implicit mask must
    match those with an explicit block-causal mask (same shapes, so the tolerance can be tight even
    in bf16). Models that fail get the explicit mask on every forward instead.
    """
    g = torch.Generator().manual_seed(0)
    vocab = model.get_input_embeddings().weight.shape[0]
    ids = torch.randint(0, vocab, (1, 12), generator=g).to(device)
    pos = torch.cat([torch.arange(5), torch.arange(7)])[None].to(device)
    dtype = next(model.parameters()).dtype
    implicit = model(input_ids=ids, position_ids=pos, use_cache=False).logits[0].float()
    explicit = (
        model(input_ids=ids, position_ids=pos, attention_mask=block_causal_mask(pos, dtype), use_cache=False)
        .logits[0]
        .float()
    )
    tol = 1e-4 if dtype == torch.float32 else 1e-2
    return bool((implicit - explicit).abs().max() <= tol * max(1.0, float(explicit.abs().max())))


def _enable_activation_checkpointing(model: nn.Module) -> None:
    """Recompute each decoder layer in backward (non-reentrant: works with FSDP2 and frozen inputs)."""
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.2x name
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def save_hf_metadata(model: nn.Module, source: Path, dest: Path, dtype: torch.dtype) -> None:
    """config.json + generation_config.json from the model; tokenizer and other small files from ``source``."""
    model.config.dtype = dtype
    model.config.save_pretrained(dest)
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.save_pretrained(dest)
    if source.resolve() == dest.resolve():
        return
    for f in source.iterdir():
        if (
            f.is_file()
            and not f.name.endswith(_WEIGHT_SUFFIXES)
            and f.name not in _WRITTEN_BY_SAVE
            and not f.name.startswith("optim_rank")
        ):
            shutil.copy2(f, dest / f.name)


def rng_state() -> dict[str, Any]:
    """Every random generator's state (torch, CUDA, Python, NumPy), saved with the optimizer so a resumed run draws the same."""
    state = {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what :func:`rng_state` saved."""
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


__all__ = ["TorchTrainer", "decoder_layers", "load_causal_lm", "resolve_dtype"]
