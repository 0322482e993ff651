"""The ``megatron`` backend's critic: a :class:`~agentrl.trainer.megatron_trainer.MegatronTrainer` with a value head.

The trunk is the actor's megatron-core ``GPTModel`` (TP / PP / DP, packed rows, megatron's schedule)
loaded from the HF checkpoint; on the last pipeline stage the vocab-parallel ``output_layer`` is
replaced by :class:`ValueHead`, a ``[1, hidden]`` projection every TP rank holds whole (slime's
critic does the same). The hidden states entering the head are TP-replicated, so each TP rank
computes the full value and the full gradient into the trunk: nothing to all-reduce, and the head
counts once in the gradient norm (it carries no ``tensor_model_parallel`` attribute). The
embeddings are untied from the head on every stage, so the pipelined tied-embedding gradient sum
is skipped.

Checkpoints are per rank (the head is not an HF weight): ``trainer_state.pt`` (rank 0) and
``critic_rank{r}.pt`` {"model": this rank's shard, "optimizer", "rng", "megatron_rng"}; resuming needs
the same world size and (tp, pp, cp) layout, as the actor's.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from agentrl.algo.loss import value_loss
from agentrl.config import TrainConfig
from agentrl.trainer.base import Critic, TrainSample
from agentrl.trainer.batching import PackedBatch
from agentrl.trainer.critic import CRITIC_METRICS, critic_config, value_head
from agentrl.trainer.megatron_trainer import MegatronTrainer


class ValueHead(nn.Module):
    """Stands in for GPTModel's ``output_layer``: ``(hidden [s, b, h], weight=..., ...) -> ([s, b, 1], None)``.

    ``weight``/``bias`` are its own parameters (see :func:`agentrl.trainer.critic.value_head`); the
    ``weight`` argument GPTModel passes for tied embeddings is ignored.
    """

    def __init__(self, hidden_size: int, seed: int):
        super().__init__()
        head = value_head(hidden_size, seed)
        self.weight = nn.Parameter(head.weight.detach().clone())  # [1, h]
        self.bias = nn.Parameter(head.bias.detach().clone())  # [1]

    def forward(self, hidden: torch.Tensor, weight: Any = None, runtime_gather_output: Any = None):  # noqa: ARG002
        return F.linear(hidden, self.weight, self.bias), None


class MegatronCritic(MegatronTrainer, Critic):
    """megatron-core GPTModel trunk + :class:`ValueHead`, trained on the clipped value loss; one instance per rank."""

    def __init__(
        self,
        checkpoint_path: str | Path,
        cfg: TrainConfig,
        *,
        rank: int = 0,
        world_size: int = 1,
        device: str | torch.device | None = None,
        parallel: Any = None,
    ):
        super().__init__(
            checkpoint_path, critic_config(cfg), rank=rank, world_size=world_size, device=device, parallel=parallel
        )

    def _takes_lora(self) -> bool:
        return False  # ppo's critic trains in full, as the torch backend's

    def _build(self, params_dtype: torch.dtype) -> nn.Module:
        model = super()._build(params_dtype)
        model.share_embeddings_and_output_weights = False  # every stage: no tied-gradient sum with the head
        if getattr(model, "post_process", False):
            model.output_layer = ValueHead(self.hf_config.hidden_size, self.cfg.seed).to(self.device)
        return model

    def _builtin_metrics(self) -> set[str]:
        return set(CRITIC_METRICS)

    @staticmethod
    def _value_output(b: PackedBatch, output: torch.Tensor, non_loss_data: bool = True) -> torch.Tensor:
        return output[0, :, 0].float()  # [1, N, 1] -> [N]

    @torch.no_grad()
    def compute_values(self, samples: list[TrainSample]) -> list[list[float]]:
        """Per-response-token values; every rank of a replica gets the same result."""
        return self._score(self.model, samples, self._value_output)

    def compute_log_probs(self, samples: list[TrainSample], *, ref: bool):  # type: ignore[override]
        raise TypeError("a critic has values, not log-probs: call compute_values")

    def _train_loss(self, num_tokens: float, num_seqs: float, b: PackedBatch, output: torch.Tensor):
        """Last stage: :func:`value_loss` of one micro-batch, as megatron's ``(loss, num_tokens, metrics)``."""
        if b.values is None or b.returns is None:
            raise ValueError("the critic trains on TrainSample.values and .returns (the train loop sets them)")
        loss, metrics = value_loss(
            output[0, :, 0],
            b.values,
            b.returns,
            b.mask,
            b.seq_ids,
            value_clip=self.cfg.value_clip,
            per_token=self.cfg.calculate_per_token_loss,
            num_tokens=num_tokens,
            num_seqs=num_seqs,
        )
        metrics["loss"] = float(loss.detach())
        return loss, torch.tensor(int(b.mask.sum()), dtype=torch.int, device=loss.device), metrics

    def named_weights(self):  # type: ignore[override]
        raise TypeError("a critic's weights are not a policy: nothing syncs them to an engine")

    def save(self, path: str | Path, extra_state: dict[str, Any] | None = None) -> None:
        """Per-rank shards (see the module docstring). A collective: every rank must call it."""
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        if self.rank == 0:
            torch.save(self._trainer_state(extra_state), path / "trainer_state.pt")
        self._barrier()
        model = {k: v.detach().cpu() if isinstance(v, torch.Tensor) else v for k, v in self.model.state_dict().items()}
        torch.save({"model": model, **self._rank_state()}, path / f"critic_rank{self.rank}.pt")
        self._barrier()

    def load(self, path: str | Path) -> dict[str, Any]:
        """Restore this rank's shard, optimizer, RNG and step from :meth:`save`; return its ``extra_state``."""
        path = Path(path)
        state = self._read_trainer_state(path, "critic")
        ranked = torch.load(path / f"critic_rank{self.rank}.pt", weights_only=False)
        self.model.load_state_dict(ranked["model"], strict=True)
        return self._restore_rank_state(ranked, state)


__all__ = ["MegatronCritic", "ValueHead"]
