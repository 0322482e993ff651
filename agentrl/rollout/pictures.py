"""Images in an episode: decoded once per observation, expanded into the ledger, carried on the sample.

The episode loop calls three things here. :func:`observe` decodes and checks an observation's images
(in a worker thread: PNG encoding a large screenshot takes milliseconds) and rewrites its image parts
as data-URL ``image_url`` parts, so the conversation stays JSON-safe. :class:`Pictures` holds one
segment's images and their processed pixels, in the order their placeholders appear in the ledger,
and writes them to the sample (``multimodal_inputs["images"]``: PNG data URLs;
``multimodal_train_inputs``: per-image ``pixel_values`` ... arrays, what the trainer feeds the vision
tower). :func:`sampled_placeholder` catches a turn in which the policy sampled the image placeholder
token: the engine and the trainer would take it for a picture that does not exist.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from agentrl.images import Image, count_images, normalize
from agentrl.types import Message, Sample
from agentrl.vlm import by_key


@dataclass
class Pictures:
    """One segment's images and pixels, in ledger order; mirrored into its sample as they arrive."""

    images: list[Image] = field(default_factory=list)
    pixels: list[dict[str, Any]] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)  # placeholder tokens per image

    def add(self, images: Sequence[Image], expanded: Any, sample: Sample | None = None) -> None:
        """Record ``images`` whose placeholders were just appended (``expanded``: :class:`~agentrl.vlm.Expanded`),
        and :meth:`write` them to ``sample`` when given."""
        if not images:
            return
        self.images.extend(images)
        self.pixels.extend(expanded.pixels)
        self.tokens.extend(expanded.num_tokens)
        if sample is not None:
            self.write(sample)

    def write(self, sample: Sample) -> None:
        """Set the sample's ``multimodal_inputs`` and ``multimodal_train_inputs`` (left None without images)."""
        if not self.images:
            return
        sample.multimodal_inputs = {"images": [im.url for im in self.images]}
        sample.metadata["image_tokens"] = list(self.tokens)  # placeholders per picture (agentrl view places them)
        sample.multimodal_train_inputs = by_key(self.pixels)

    @property
    def urls(self) -> list[str]:
        """The images as SGLang's ``image_data`` (one entry per image, in placeholder order)."""
        return [im.url for im in self.images]


async def observe(messages: list[Message]) -> tuple[list[Message], list[Image]]:
    """``messages`` with their images decoded, checked and rewritten as data URLs (raises ImageError)."""
    if not count_images(messages):
        return messages, []
    return await asyncio.to_thread(normalize, messages)


def sampled_placeholder(ctx: Any, output_ids: Sequence[int]) -> bool:
    """Whether the policy sampled the model's image placeholder token in this turn."""
    vision = ctx.template.vision
    return vision is not None and vision.image_token_id in output_ids
