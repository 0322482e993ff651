"""Images for the embedded engine: SGLang's ``image_data``, checked, keyed by content, turned into features.

A request carries ``input_ids`` in which every image already occupies its placeholder tokens (the
caller ran the model's processor, as slime does before SGLang's ``/generate``) and ``image_data``:
one image per placeholder span, in order. :meth:`EngineVision.prepare` decodes and checks the images
(a bad one refuses the request with HTTP 400 naming ``image_data[i]``), checks that the placeholder
count matches what the processor makes of them, and returns the request's *key*: its ids with each
placeholder replaced by a negative id derived from the image's content digest and the offset in it.
The prefix cache compares keys, so two prompts with the same placeholders but different pictures
share nothing past the first picture (SGLang pads its radix-tree keys with image hashes the same way).

The features (vision tower + connector, the engine's current weights) are computed in the worker
thread when it admits the request, for the images past the prefix it reuses (a picture the vision tower
cannot take fails that request alone), and cached by digest (LRU) for the next turn of the episode; a
weight update clears the cache.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from agentrl.engines.local.sampling import InvalidRequestError
from agentrl.images import Image, ImageError, load_image
from agentrl.vlm import image_positions

MAX_IMAGES_PER_REQUEST = 512
"""More images in one request are refused (HTTP 400): a bound on the work one request can ask for."""

MAX_REQUEST_PIXELS = 1 << 28
"""All of a request's pictures together (width x height summed) are refused past this (HTTP 400)."""


@dataclass
class RequestImages:
    """One request's images and where their placeholder rows sit in its prompt."""

    images: list[Image]
    pixels: list[dict[str, np.ndarray]]
    positions: np.ndarray  # [P] prompt positions of the placeholders, ascending
    owner: np.ndarray  # [P] which image each placeholder belongs to
    offset: np.ndarray  # [P] its row in that image's features
    features: list[torch.Tensor | None] | None = None  # per image, once computed (None: inside a reused prefix)


def _key_id(digest: str, offset: int) -> int:
    """A negative int64 standing for row ``offset`` of the image with ``digest`` (never a real token id)."""
    h = hashlib.blake2b(f"{digest}:{offset}".encode(), digest_size=8).digest()
    return -1 - (int.from_bytes(h, "little") & (2**62 - 1))


class EngineVision:
    """The served VLM's :class:`~agentrl.vlm.VisionFamily`, its model, and a feature cache."""

    def __init__(self, family: Any, model: Any, *, cache_images: int = 256):
        self.family = family
        self.model = model
        self.cache_images = cache_images
        self._features: OrderedDict[str, torch.Tensor] = OrderedDict()

    def clear(self) -> None:
        """Forget cached features (the weights changed)."""
        self._features.clear()

    def prepare(self, input_ids: list[int], image_data: Any) -> tuple[np.ndarray, RequestImages | None]:
        """The request's prefix-cache key and images; :class:`InvalidRequestError` for a bad request."""
        ids = np.asarray(input_ids, dtype=np.int64)
        placeholder = self.family.image_token_id
        where = image_positions(ids, placeholder)
        if image_data is None or (isinstance(image_data, list) and not image_data):
            if len(where):
                raise InvalidRequestError(
                    f"input_ids hold {len(where)} image placeholder token(s) (id {placeholder}) but no image_data"
                )
            return ids, None
        items = image_data if isinstance(image_data, list) else [image_data]
        if len(items) > MAX_IMAGES_PER_REQUEST:
            raise InvalidRequestError(f"image_data: {len(items)} images; at most {MAX_IMAGES_PER_REQUEST} per request")
        images, pixels, counts = [], [], []
        for i, item in enumerate(items):
            if not isinstance(item, str):
                raise InvalidRequestError(f"image_data[{i}] must be a string (data: URL, file:// URL or base64)")
            try:
                img = load_image(item, url=False, files=False)  # pixels and digest only; never the server's disk
                px = self.family.pixels(img)
            except ImageError as exc:
                raise InvalidRequestError(f"image_data[{i}]: {exc}") from None
            except Exception as exc:  # noqa: BLE001 - the processor refusing an image is the request's fault
                raise InvalidRequestError(
                    f"image_data[{i}]: the processor refused it ({type(exc).__name__}: {exc})"
                ) from None
            images.append(img)
            pixels.append(px)
            if sum(im.size[0] * im.size[1] for im in images) > MAX_REQUEST_PIXELS:
                raise InvalidRequestError(f"image_data: the pictures hold over {MAX_REQUEST_PIXELS} pixels together")
            counts.append(self.family.tokens_for(px))
        if sum(counts) != len(where):
            raise InvalidRequestError(
                f"image_data: {len(items)} image(s) take {sum(counts)} placeholder tokens ({counts}), "
                f"input_ids hold {len(where)} (id {placeholder}): expand the prompt with the model's processor"
            )
        owner = np.repeat(np.arange(len(counts)), counts)
        offset = np.concatenate([np.arange(c) for c in counts]) if counts else np.zeros(0, np.int64)
        key = ids.copy()
        key[where] = [_key_id(images[o].digest, int(j)) for o, j in zip(owner, offset)]
        return key, RequestImages(images, pixels, where, owner, offset)

    def compute(self, req: RequestImages, start: int = 0) -> None:
        """The feature rows of every image with a placeholder at or after prompt position ``start`` onto ``req``
        (from the cache by digest, else the vision tower; images wholly inside a reused prefix are skipped).
        The worker calls it when it admits the request, so a failure fails that request alone."""
        at = int(np.searchsorted(req.positions, start))  # the first placeholder at or after start
        first = int(req.owner[at]) if at < len(req.positions) else len(req.images)
        feats: list[torch.Tensor | None] = [None] * first
        for i, image in enumerate(req.images[first:], start=first):
            f = self._features.get(image.digest)
            if f is None:
                f = self.family.features(self.model, req.pixels[i])
                if f.shape[0] != self.family.tokens_for(req.pixels[i]):
                    raise RuntimeError(
                        f"image {i}: {f.shape[0]} feature rows for {self.family.tokens_for(req.pixels[i])} placeholders"
                    )
                self._features[image.digest] = f
                while len(self._features) > self.cache_images:
                    self._features.popitem(last=False)
            else:
                self._features.move_to_end(image.digest)
            feats.append(f)
        req.features = feats

    def rows(self, req: RequestImages, start: int, stop: int) -> tuple[np.ndarray, torch.Tensor] | None:
        """Placeholder positions in ``[start, stop)`` (relative to ``start``) and their feature rows."""
        lo, hi = np.searchsorted(req.positions, [start, stop])
        if lo == hi:
            return None
        owners, offsets = req.owner[lo:hi], req.offset[lo:hi]
        if req.features is None or any(req.features[int(o)] is None for o in np.unique(owners)):
            self.compute(req, int(req.positions[lo]))  # the prefix reused turned out shorter than at admission
        assert req.features is not None
        # placeholders run in image order, each image's rows consecutively: one slice per image, in order
        parts = []
        for o in np.unique(owners):
            rows = offsets[owners == o]
            parts.append(req.features[int(o)][int(rows[0]) : int(rows[-1]) + 1])  # type: ignore[index]
        return req.positions[lo:hi] - start, torch.cat(parts)
