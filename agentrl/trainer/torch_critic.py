"""The ``torch`` backend's critic: a :class:`~agentrl.trainer.torch_trainer.TorchTrainer` whose LM head is a value head.

Everything else is the actor's machinery unchanged: packed micro-batches, the head run only at the
positions that score response tokens (``logits_to_keep``), FSDP2 at world > 1, fp32 master weights,
global normalization over the step, the same checkpoint layout (``model.safetensors`` holds the trunk
and ``lm_head.weight`` of shape ``[1, hidden]`` plus its bias; ``config.json`` says
``agentrl_value_head: true`` and unties the embeddings).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch

from agentrl.algo.loss import value_loss
from agentrl.config import TrainConfig
from agentrl.trainer.base import Critic, TrainSample
from agentrl.trainer.batching import PackedBatch
from agentrl.trainer.critic import CRITIC_METRICS, critic_config, value_head
from agentrl.trainer.torch_trainer import TorchTrainer


def config_vocab(model: torch.nn.Module) -> int:
    return int(model.get_input_embeddings().weight.shape[0])


class TorchCritic(TorchTrainer, Critic):
    """HF causal LM trunk + scalar value head, trained on the clipped value loss; one instance per rank."""

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
        super().__init__(
            checkpoint_path,
            critic_config(cfg),
            rank=rank,
            world_size=world_size,
            device=device,
            resident_state=resident_state,
        )

    def _takes_lora(self) -> bool:
        """The critic trains in full under ``--lora-rank`` (its value head is new: nothing frozen to adapt it to)."""
        return False

    def _adapt_model(self) -> None:
        """Swap the LM head for the value head (the packing check above ran on the real logits).

        Some architectures transform the head's output in their forward (Gemma2's logit soft-capping,
        Granite's ``logits_scaling``, Cohere's ``logit_scale``): those knobs are set to identity, and a
        check refuses a model whose forward still changes the head's output, so a value is always
        ``head(final hidden state)`` as on the megatron backend.
        """
        config = self.model.config
        for attr, identity in (("final_logit_softcapping", None), ("logits_scaling", 1.0), ("logit_scale", 1.0)):
            if getattr(config, attr, identity) != identity:
                setattr(config, attr, identity)
        if isinstance(getattr(self.model, "logit_scale", None), float):  # Cohere copies it at init
            self.model.logit_scale = 1.0
        self.model.set_output_embeddings(value_head(config.hidden_size, self.cfg.seed).to(self.device))
        config.tie_word_embeddings = False  # the embeddings stay; the head is its own weight now
        config.agentrl_value_head = True
        self._check_plain_head()

    @torch.no_grad()
    def _check_plain_head(self) -> None:
        ids = torch.randint(0, config_vocab(self.model), (1, 6), generator=torch.Generator().manual_seed(0))
        ids = ids.to(self.device)
        out = self.model(input_ids=ids, output_hidden_states=True, use_cache=False)
        head = self.model.get_output_embeddings()
        if out.hidden_states is None or not torch.allclose(
            head(out.hidden_states[-1]).float(), out.logits.float(), atol=1e-4, rtol=1e-4
        ):
            raise ValueError(
                f"{type(self.model).__name__} transforms its head's output in its forward: a value head on it would "
                "not give head(hidden state); start the critic from another architecture (--critic-hf-checkpoint)"
            )

    def _values(self, b: PackedBatch) -> torch.Tensor:
        """The value head's output at the positions that score the batch's response tokens: [N] fp32."""
        return self._logits(self.model, b)[:, 0].float()

    @torch.no_grad()
    def compute_values(self, samples: list[TrainSample]) -> list[list[float]]:
        """Per-response-token values under the current critic (every rank runs the same number of passes)."""
        self.model.eval()
        out: list[list[float]] = [[] for _ in samples]
        for batch in self._micro_batches(samples, train=False):
            if self.core_share is not None:
                self.core_share.apply()
            if batch is None:
                self._dummy_pass(self.model, backward=False)
                continue
            b = batch.to(self.device)
            for i, values in zip(b.indices, b.split(self._values(b))):
                out[i] = values
        return out

    def compute_log_probs(self, samples: list[TrainSample], *, ref: bool):  # type: ignore[override]
        raise TypeError("a critic has values, not log-probs: call compute_values")

    def _with_gradient(self, samples: Sequence[TrainSample]) -> list[TrainSample]:
        return list(samples)  # every sample's values are regressed, whatever its advantages

    def _builtin_metrics(self) -> set[str]:
        return set(CRITIC_METRICS)

    def _micro_batch_loss(self, b: PackedBatch, num_tokens: float, num_seqs: float):
        if b.values is None or b.returns is None:
            raise ValueError("the critic trains on TrainSample.values and .returns (the train loop sets them)")
        return value_loss(
            self._values(b),
            b.values,
            b.returns,
            b.mask,
            b.seq_ids,
            value_clip=self.cfg.value_clip,
            per_token=self.cfg.calculate_per_token_loss,
            num_tokens=num_tokens,
            num_seqs=num_seqs,
        )


__all__ = ["TorchCritic"]
