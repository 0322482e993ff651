"""Token-budget packing: many samples in one row, no padding, no cross-talk.

A micro-batch is ONE row of concatenated samples (``input_ids [1, sum L]``) whose
``position_ids`` restart at 0 at every sample start. Two reasons:

* no padding: a rollout mixes 50-token and 5,000-token episodes; padding to the longest wastes
  most of the compute, packing to a token budget (``max_tokens_per_gpu``) wastes none;
* no cross-talk: Hugging Face transformers (>= 4.5x, checked on 5.24 ``masking_utils``) detects
  restarting ``position_ids`` when ``attention_mask is None`` and no KV cache is used
  (``find_packed_sequence_indices``) and builds a block-diagonal causal mask, for sdpa, eager and
  flex attention alike (flash-attention gets ``cu_seqlens`` from the same positions). So a
  sample's log-probs inside a packed row equal its log-probs alone; the trainer verifies this once
  per model at start-up and falls back to an explicit 4-D mask (:func:`block_causal_mask`) for a
  model that does not honour it.

Alignment (the one off-by-one in RL training): the logits at position ``p`` predict token
``p + 1``. Response token ``j`` of a sample that starts at offset ``P0`` in the row sits at
``P0 + prompt_len + j`` and is predicted by the logits at ``P0 + prompt_len + j - 1``. All
per-token tensors of a :class:`PackedBatch` are FLAT over the response tokens of the row, in
that order, so ``logits[logit_positions]`` lines up with ``targets``, ``mask`` and friends.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, fields, replace

import torch

from agentrl.trainer.base import TrainSample
from agentrl.vlm import image_positions


def pack_micro_batches(lengths: Sequence[int], max_tokens: int, max_samples: int | None = None) -> list[list[int]]:
    """Group sample indices into micro-batches of at most ``max_tokens`` tokens (and ``max_samples`` samples) each.

    First-fit decreasing: take samples longest first (ties: lower index first) and put each into
    the first micro-batch with room, opening a new one when none has. FFD is within 11/9 of the
    optimal bin count and fully deterministic, so every rank and every rerun packs alike. A sample
    longer than the budget cannot be split (attention spans the whole episode), so it gets a
    micro-batch of its own. Indices inside a micro-batch are ascending. ``max_samples`` (Megatron's
    ``--micro-batch-size``) also caps the samples per micro-batch; None = the token budget alone.
    """
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    if max_samples is not None and max_samples < 1:
        raise ValueError(f"max_samples must be >= 1, got {max_samples}")
    cap = max_samples or len(lengths) or 1
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    bins: list[list[int]] = []
    room: list[int] = []
    for i in order:
        n = lengths[i]
        for b, free in enumerate(room):
            if n <= free and len(bins[b]) < cap:
                bins[b].append(i)
                room[b] -= n
                break
        else:
            bins.append([i])
            room.append(max_tokens - n)  # negative when the sample alone is over budget
    return [sorted(b) for b in bins]


@dataclass
class PackedBatch:
    """One packed row plus the flat per-response-token tensors aligned with its logits.

    Shapes: ``input_ids``/``position_ids`` are ``[1, T]`` (T = total tokens of the row); every other
    tensor is ``[N]`` (N = total response tokens of the row). ``seq_ids`` numbers the samples of
    this micro-batch 0..k-1 (for per-sequence loss normalization); ``indices`` are the samples'
    positions in the list that was packed. Optional log-probs are None when any sample lacks them.
    """

    input_ids: torch.Tensor  # [1, T] long
    position_ids: torch.Tensor  # [1, T] long, restarts at 0 per sample
    logit_positions: torch.Tensor  # [N] long: row positions whose logits predict the targets
    targets: torch.Tensor  # [N] long: the response token ids
    mask: torch.Tensor  # [N] float: 1 = trained on (sampled by the policy)
    advantages: torch.Tensor  # [N] float
    seq_ids: torch.Tensor  # [N] long: 0..k-1, which sample of this micro-batch
    indices: list[int]
    response_lengths: list[int]
    old_log_probs: torch.Tensor | None = None  # [N]
    ref_log_probs: torch.Tensor | None = None  # [N]
    rollout_log_probs: torch.Tensor | None = None  # [N]
    train_metadata: list[dict | None] = field(default_factory=list)  # per packed sample, for a custom loss
    values: torch.Tensor | None = None  # [N] ppo: the critic's values at advantage time
    returns: torch.Tensor | None = None  # [N] ppo: the critic's targets
    images: list[dict] = field(default_factory=list)  # per image, in row order: its processed arrays
    image_positions: torch.Tensor | None = None  # [M] long: row positions of the images' placeholders
    policies: list[str | None] = field(default_factory=list)  # per packed sample: its --policy (several policies)
    lengths: list[int] = field(default_factory=list)  # per packed sample: its tokens in the row

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[1])

    def to(self, device: torch.device | str) -> PackedBatch:
        """A copy with every tensor on ``device``."""
        moved = {
            f.name: getattr(self, f.name).to(device)
            for f in fields(self)
            if isinstance(getattr(self, f.name), torch.Tensor)
        }
        return replace(self, **moved)

    def split(self, values: torch.Tensor) -> list[list[float]]:
        """Cut a flat ``[N]`` tensor back into one list per packed sample (in ``indices`` order)."""
        return [chunk.tolist() for chunk in values.detach().float().cpu().split(self.response_lengths)]


def _flat(samples: Sequence[TrainSample], attr: str, *, required: bool) -> torch.Tensor | None:
    """Concatenate one per-response-token field of every sample; None if optional and missing."""
    values: list[float] = []
    for s in samples:
        v = getattr(s, attr)
        if v is None or (attr == "advantages" and not v and s.response_length):
            if required:
                raise ValueError(f"TrainSample.{attr} is missing (needed for training)")
            return None
        if len(v) != s.response_length:
            raise ValueError(f"TrainSample.{attr} has {len(v)} values for a {s.response_length}-token response")
        values.extend(v)
    return torch.tensor(values, dtype=torch.float32)


def pack_samples(
    samples: Sequence[TrainSample],
    indices: Sequence[int] | None = None,
    *,
    need_advantages: bool = False,
    image_token_id: int | None = None,
) -> PackedBatch:
    """Build one packed row from ``samples`` (or the subset ``indices`` of it, in that order).

    ``need_advantages`` makes missing advantages an error (training) instead of zeros (scoring).
    ``image_token_id`` (a vision-language model): the row's images and their placeholders' positions.
    """
    idx = list(range(len(samples))) if indices is None else list(indices)
    chosen = [samples[i] for i in idx]
    ids: list[int] = []
    pos: list[int] = []
    logit_pos: list[int] = []
    seq: list[int] = []
    images: list[dict] = []
    image_pos: list[int] = []
    for k, s in enumerate(chosen):
        if s.prompt_length < 1:
            raise ValueError(
                "a TrainSample needs at least one prompt token (the first response token "
                "is predicted from the token before it)"
            )
        if len(s.loss_mask) != s.response_length:
            raise ValueError(f"loss_mask has {len(s.loss_mask)} values for a {s.response_length}-token response")
        start = len(ids) + s.prompt_length - 1  # logits here predict the first response token
        logit_pos.extend(range(start, start + s.response_length))
        seq.extend([k] * s.response_length)
        if image_token_id is not None:
            _pack_images(s, len(ids), image_token_id, images, image_pos)
        ids.extend(s.tokens)
        pos.extend(range(len(s.tokens)))
    targets = [t for s in chosen for t in s.tokens[s.prompt_length :]]
    advantages = _flat(chosen, "advantages", required=need_advantages)
    if advantages is None:
        advantages = torch.zeros(len(targets))
    return PackedBatch(
        input_ids=torch.tensor([ids], dtype=torch.long),
        position_ids=torch.tensor([pos], dtype=torch.long),
        logit_positions=torch.tensor(logit_pos, dtype=torch.long),
        targets=torch.tensor(targets, dtype=torch.long),
        mask=torch.tensor([m for s in chosen for m in s.loss_mask], dtype=torch.float32),
        advantages=advantages,
        seq_ids=torch.tensor(seq, dtype=torch.long),
        indices=idx,
        response_lengths=[s.response_length for s in chosen],
        old_log_probs=_flat(chosen, "old_log_probs", required=False),
        ref_log_probs=_flat(chosen, "ref_log_probs", required=False),
        rollout_log_probs=_flat(chosen, "rollout_log_probs", required=False),
        train_metadata=[s.train_metadata for s in chosen],
        values=_flat(chosen, "values", required=False),
        returns=_flat(chosen, "returns", required=False),
        images=images,
        image_positions=torch.tensor(image_pos, dtype=torch.long) if images else None,
        policies=[s.policy for s in chosen],
        lengths=[len(s.tokens) for s in chosen],
    )


def _pack_images(s: TrainSample, offset: int, image_token_id: int, images: list[dict], positions: list[int]) -> None:
    """Append one sample's images (per-image dicts of arrays) and its placeholders' row positions."""
    found = image_positions(s.tokens, image_token_id)
    mm = s.multimodal_train_inputs or {}
    lists = [v for v in mm.values() if isinstance(v, list)]
    n = len(lists[0]) if lists else 0
    if any(len(v) != n for v in lists):
        raise ValueError("TrainSample.multimodal_train_inputs: its per-image lists differ in length")
    if n == 0 and len(found):
        raise ValueError(f"a TrainSample holds {len(found)} image placeholder tokens but no multimodal_train_inputs")
    images.extend({k: v[j] for k, v in mm.items() if isinstance(v, list)} for j in range(n))
    positions.extend(int(p) + offset for p in found)


def block_causal_mask(position_ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Explicit additive ``[1, 1, T, T]`` mask: causal within a sample, blocked across samples.

    Only for models that ignore packed ``position_ids``; it costs O(T^2) memory, which is why the
    implicit detection is preferred.
    """
    pos = position_ids[0]
    doc = torch.cumsum((pos == 0).long(), 0)  # [T] which sample each token belongs to
    t = torch.arange(pos.numel(), device=pos.device)
    allowed = (doc[:, None] == doc[None, :]) & (t[:, None] >= t[None, :])
    mask = torch.zeros(allowed.shape, dtype=dtype, device=pos.device)
    mask.masked_fill_(~allowed, torch.finfo(dtype).min)
    return mask[None, None]
