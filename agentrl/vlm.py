"""Vision-language model families: how a model's processor turns images into tokens and features.

One small interface, one implementation per family, picked by the checkpoint's ``model_type``:

* :meth:`VisionFamily.expand` -- template text holding the model's image marker (``<image>`` for
  Idefics3/SmolVLM) plus the images, to the token ids the model reads. The ids come from the
  processor itself (``processor(text=..., images=...)``), so the placeholder tokens are exactly what
  transformers (and SGLang, which runs the same processor) would produce.
* :meth:`VisionFamily.pixels` -- one image's processed tensors (``pixel_values`` ...), computed per
  image so the rollout, the engine and the trainer all hold the same arrays for the same picture.
* :meth:`VisionFamily.features` -- those tensors through the model's vision tower and connector:
  ``[num_placeholder_tokens, hidden]``, the rows that replace the placeholders' embeddings.

Why the SDK merges image features itself (``inputs_embeds``) instead of handing ``pixel_values`` to
the model's ``forward``: the engine and the trainer see the same merge (one function, per picture, with
the trainer's packing), and the count of placeholders is checked against the features with a message
naming both. The placeholders are found by token id, as transformers finds them: an episode whose policy
*sampled* the placeholder token fails there (``image_token_sampled``), so no sampled id is taken for one.

Families: Idefics3 / SmolVLM (SigLIP encoder, pixel-shuffle connector, a Llama text model with
plain 1-D rotary positions, which the embedded engine's cached forward already serves). Qwen2-VL's
3-D rotary positions are not implemented: such a checkpoint is refused with that reason (rollouts
against an engine that serves it still run text-only episodes: :func:`vision_for` with ``strict=False``).
"""

from __future__ import annotations

import abc
import logging
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from agentrl.images import Image

log = logging.getLogger(__name__)


class VisionError(ValueError):
    """A vision-language model or processor this SDK cannot serve or train, or inputs that do not fit it."""


@dataclass
class Expanded:
    """Template text after the processor expanded its image markers."""

    ids: list[int]
    pixels: list[dict[str, np.ndarray]]  # per image, :meth:`VisionFamily.pixels`
    num_tokens: list[int]  # per image: placeholder tokens it occupies


class VisionFamily(abc.ABC):
    """A vision-language model family: its processor's expansion and its model's vision features."""

    model_types: tuple[str, ...] = ()

    cache_bytes = 1 << 30
    """Processed pictures kept by digest, up to this many bytes of arrays: an episode's every turn (and its
    template check) renders them all, and a split SmolVLM picture is ~55 MB of float32 crops."""

    def __init__(self, processor: Any):
        self.processor = processor
        self.tokenizer = processor.tokenizer
        self.marker: str = processor.image_token
        self.image_token_id = int(self.tokenizer.convert_tokens_to_ids(self.marker))
        self._pixels: OrderedDict[str, dict[str, np.ndarray]] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()  # episodes process pictures in worker threads

    def expand(self, text: str, images: Sequence[Image]) -> Expanded:
        """Ids of ``text`` with each image marker expanded for ``images`` (in order), and their pixels."""
        count = text.count(self.marker)
        if count != len(images):
            raise VisionError(
                f"the rendered text holds {count} image marker(s) {self.marker!r} for {len(images)} image(s): "
                "the chat template must render each image part (and an observation's text must not contain "
                "the marker itself)"
            )
        if not images:
            return Expanded(list(self.tokenizer.encode(text, add_special_tokens=False)), [], [])
        enc = self.processor(text=text, images=[im.pil for im in images], add_special_tokens=False)
        ids = [int(x) for x in np.asarray(enc["input_ids"]).reshape(-1)]
        pixels = [self.pixels(im) for im in images]
        num_tokens = [self.tokens_for(p) for p in pixels]
        found = sum(1 for x in ids if x == self.image_token_id)
        if found != sum(num_tokens):
            raise VisionError(f"the processor wrote {found} placeholder tokens for {sum(num_tokens)} feature rows")
        return Expanded(ids, pixels, num_tokens)

    def pixels(self, image: Image) -> dict[str, np.ndarray]:
        """One image's processed tensors, as numpy arrays without a batch axis (cached by the image's digest;
        the arrays are shared: read them, never write them)."""
        with self._lock:
            hit = self._pixels.get(image.digest)
            if hit is not None:
                self._pixels.move_to_end(image.digest)
                return hit
        out = self.process(image)
        for a in out.values():
            a.setflags(write=False)  # shared by every sample that holds this picture
        size = sum(a.nbytes for a in out.values())
        with self._lock:
            self._pixels[image.digest] = out
            self._bytes += size
            while self._bytes > self.cache_bytes and len(self._pixels) > 1:
                _, old = self._pixels.popitem(last=False)
                self._bytes -= sum(a.nbytes for a in old.values())
        return out

    @abc.abstractmethod
    def process(self, image: Image) -> dict[str, np.ndarray]:
        """One image through the processor's image half (:meth:`pixels` caches it)."""

    @abc.abstractmethod
    def tokens_for(self, pixels: dict[str, np.ndarray]) -> int:
        """Placeholder tokens (= feature rows) one image's tensors give."""

    @abc.abstractmethod
    def features(self, model: Any, pixels: dict[str, Any]) -> Any:
        """One image's features ``[tokens_for(pixels), hidden]`` (a torch tensor on the model's device)."""

    def vision_modules(self, model: Any) -> list[Any]:
        """The modules ``--freeze-vision-tower`` freezes."""
        return [model.model.vision_model]


class Idefics3Family(VisionFamily):
    """Idefics3 and SmolVLM: ``<fake_token_around_image><global-img><image>*N<fake_token_around_image>`` per
    crop layout, SigLIP + pixel-shuffle features, ``image_seq_len`` tokens per crop."""

    model_types = ("idefics3", "smolvlm")

    def __init__(self, processor: Any):
        super().__init__(processor)
        self.seq_len = int(processor.image_seq_len)

    def process(self, image: Image) -> dict[str, np.ndarray]:
        out = self.processor.image_processor(images=[image.pil], return_tensors="np")
        pv = np.asarray(out["pixel_values"], dtype=np.float32)[0]  # [crops, 3, H, W]
        mask = out.get("pixel_attention_mask")
        pam = np.asarray(mask, dtype=np.bool_)[0] if mask is not None else np.ones(pv.shape[:1] + pv.shape[2:], bool)
        return {"pixel_values": pv, "pixel_attention_mask": pam}

    def tokens_for(self, pixels: dict[str, np.ndarray]) -> int:
        return int(pixels["pixel_values"].shape[0]) * self.seq_len

    def features(self, model: Any, pixels: dict[str, Any]) -> Any:
        import torch

        inner = model.model
        dev = next(inner.vision_model.parameters()).device
        pv = torch.as_tensor(pixels["pixel_values"], device=dev)[None]  # [1, crops, 3, H, W]
        pam = torch.as_tensor(pixels["pixel_attention_mask"], device=dev)[None]
        out = inner.get_image_features(pv.to(inner.dtype), pam)
        feats = out.pooler_output if hasattr(out, "pooler_output") else out
        if isinstance(feats, (list, tuple)):
            feats = torch.cat(list(feats), dim=0)
        return feats.reshape(-1, feats.shape[-1])


FAMILIES: tuple[type[VisionFamily], ...] = (Idefics3Family,)


def model_type(checkpoint: str | Path) -> str | None:
    """The checkpoint's ``model_type`` from its config.json (None when it has none)."""
    import json

    cfg = Path(checkpoint) / "config.json"
    if not cfg.is_file():
        return None
    try:
        return json.loads(cfg.read_text()).get("model_type")
    except (OSError, ValueError):
        return None


def is_vision_checkpoint(checkpoint: str | Path) -> bool:
    """Whether the checkpoint is a vision-language model (its config has a ``vision_config``)."""
    import json

    cfg = Path(checkpoint) / "config.json"
    try:
        return cfg.is_file() and "vision_config" in json.loads(cfg.read_text())
    except (OSError, ValueError):
        return False


_NOT_YET = {
    "qwen2_vl": "its 3-D (multimodal) rotary positions are not implemented in the embedded engine and trainer",
    "qwen2_5_vl": "its 3-D (multimodal) rotary positions are not implemented in the embedded engine and trainer",
}


def family_class(mtype: str | None) -> type[VisionFamily]:
    """The family serving ``model_type``, or :class:`VisionError` naming the ones that exist."""
    for fam in FAMILIES:
        if mtype in fam.model_types:
            return fam
    known = sorted(t for f in FAMILIES for t in f.model_types)
    why = f": {_NOT_YET[mtype]}" if mtype in _NOT_YET else ""
    raise VisionError(f"vision-language model_type {mtype!r} is not supported{why} (supported: {', '.join(known)})")


def load_family(checkpoint: str | Path, processor: Any = None) -> VisionFamily:
    """The checkpoint's family with its processor (``AutoProcessor``, local files only)."""
    fam = family_class(model_type(checkpoint))
    if processor is None:
        from transformers import AutoProcessor

        try:
            processor = AutoProcessor.from_pretrained(str(checkpoint), local_files_only=True)
        except Exception as exc:  # noqa: BLE001 - transformers raises many kinds for a missing/broken processor
            raise VisionError(f"{checkpoint}: cannot load its processor ({type(exc).__name__}: {exc})") from None
    if not hasattr(processor, "image_token"):
        raise VisionError(f"{checkpoint}: its processor ({type(processor).__name__}) has no image token")
    return fam(processor)


def load_vision_model(path: str | Path, dtype: Any, device: Any) -> Any:
    """A local vision-language checkpoint (``AutoModelForImageTextToText``), dropout off, no KV cache."""
    from transformers import AutoConfig, AutoModelForImageTextToText

    family_class(model_type(path))  # refuse an unsupported family before loading weights
    config = AutoConfig.from_pretrained(str(path), local_files_only=True)
    for sub in (config, getattr(config, "text_config", None), getattr(config, "vision_config", None)):
        if sub is None:
            continue
        for key in ("attention_dropout", "hidden_dropout", "dropout", "resid_pdrop", "embd_pdrop", "attn_pdrop"):
            if isinstance(getattr(sub, key, None), float):
                setattr(sub, key, 0.0)
        if hasattr(sub, "use_cache"):
            sub.use_cache = False
    model = AutoModelForImageTextToText.from_pretrained(str(path), config=config, dtype=dtype, local_files_only=True)
    return model.to(device)


def by_key(pixels: Sequence[dict[str, np.ndarray]]) -> dict[str, list[np.ndarray]]:
    """Per-image arrays as ``multimodal_train_inputs`` holds them: one list per key, one entry per image."""
    return {k: [p[k] for p in pixels] for k in pixels[0]} if pixels else {}


def image_positions(tokens: Sequence[int], image_token_id: int) -> np.ndarray:
    """Positions of the image placeholders in ``tokens`` (an episode whose policy sampled the placeholder
    token fails before it reaches a trainer, so every one of them is a picture's)."""
    return np.flatnonzero(np.asarray(tokens, dtype=np.int64) == image_token_id)


def vision_for(checkpoint: str | Path | None, *, strict: bool = True) -> VisionFamily | None:
    """The checkpoint's :class:`VisionFamily` when it is a vision-language model, else None (text-only).

    An unsupported vision-language family raises :class:`VisionError` (training must build the model);
    ``strict=False`` (rollouts against an engine that serves it) logs a warning and returns None: text
    episodes run as before, and an observation with a picture fails its sample with the reason."""
    if checkpoint is None or not is_vision_checkpoint(checkpoint):
        return None
    try:
        return load_family(checkpoint)
    except VisionError as exc:
        if strict:
            raise
        log.warning("%s; episodes with pictures will fail (text-only episodes run as before)", exc)
        return None
