"""Images in observations: what an env may hand over, how it is checked, and how it travels.

An observation message's ``content`` is a string, or a list of OpenAI content parts:

    {"type": "text", "text": "..."}
    {"type": "image_url", "image_url": {"url": "data:image/png;base64,..." | "file:///abs/path.png"}}
    {"type": "image", "image": <PIL.Image.Image> | "<data or file URL>"}      (a Python env's shortcut)

A PIL image on its own is accepted as a part too. Every image is decoded and checked here against
the limits below (a bad image fails its sample with the reason, never the run), and from then on
travels as a lossless PNG data URL (transparent pixels composited onto white, as transformers does): that is what ``Sample.multimodal_inputs["images"]`` keeps, what a
trajectory dump writes, and what SGLang's ``image_data`` carries to an engine (the embedded engine
decodes the same bytes, so both sides see identical pixels). Why not keep PIL objects (as slime
does): samples cross process boundaries (Ray, HTTP, JSONL dumps), and a data URL survives all three.

Remote ``http(s)://`` URLs are refused on purpose: a rollout must not reach the network behind the
env's back (and tests and examples may only talk to loopback); an env that fetches images does so
itself and hands over the bytes.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlparse

MAX_IMAGE_BYTES = 32 * 2**20
"""Largest encoded image accepted (bytes of the PNG/JPEG/... file)."""

MAX_IMAGE_PIXELS = 4096 * 4096
"""Largest decoded image accepted (width x height): a decompression bomb stops here, before decoding."""

MIN_IMAGE_SIDE = 1

FORMATS = ("PNG", "JPEG", "GIF", "WEBP", "BMP")
"""Image formats decoded (PIL would otherwise try every plugin it has, EPS through Ghostscript among them)."""


class ImageError(ValueError):
    """An image that cannot be used: undecodable, oversized, or given in a shape the contract does not allow."""


@dataclass(frozen=True)
class Image:
    """One decoded, checked image: the PNG data URL it travels as, its pixels and their digest.

    ``digest`` (sha256 over mode, size and raw pixels) names the image's *content*: the embedded
    engine keys its prefix cache and feature cache on it, so two requests with the same placeholder
    tokens but different pictures never share keys and values.
    """

    url: str
    pil: Any  # PIL.Image.Image, RGB
    digest: str

    @property
    def size(self) -> tuple[int, int]:
        return self.pil.size


def _pil() -> Any:
    try:
        from PIL import Image as PILImage
    except ImportError as exc:  # pragma: no cover - Pillow is a dependency
        raise ImageError("images need Pillow: pip install pillow") from exc
    return PILImage


def _decode_bytes(raw: bytes, what: str, max_pixels: int) -> Any:
    PILImage = _pil()
    if len(raw) > MAX_IMAGE_BYTES:
        raise ImageError(f"{what}: {len(raw)} bytes is over the {MAX_IMAGE_BYTES}-byte limit")
    try:
        img = PILImage.open(io.BytesIO(raw), formats=FORMATS)
        w, h = img.size  # read from the header: nothing decoded yet
        if w * h > max_pixels:
            raise ImageError(f"{what}: {w}x{h} pixels is over the {max_pixels}-pixel limit")
        img.load()
    except ImageError:
        raise
    except Exception as exc:  # PIL raises many types (UnidentifiedImageError, OSError, DecompressionBombError...)
        raise ImageError(f"{what}: not a decodable image ({type(exc).__name__}: {exc})") from None
    return img


def _from_url(url: str, max_pixels: int, files: bool) -> Any:
    if url.startswith("data:"):
        head, sep, payload = url.partition(",")
        if not sep or ";base64" not in head:
            raise ImageError("image data URL must be data:<mime>;base64,<payload>")
        if len(payload) > MAX_IMAGE_BYTES * 4 // 3 + 4:
            raise ImageError(f"image data URL: over the {MAX_IMAGE_BYTES}-byte limit")
        try:
            raw = base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError) as exc:
            raise ImageError(f"image data URL: bad base64 ({exc})") from None
        return _decode_bytes(raw, "image data URL", max_pixels)
    parsed = urlparse(url)
    if parsed.scheme == "file":
        if not files:
            raise ImageError("file:// image URLs are not read here: send the bytes as a data: URL")
        if parsed.netloc not in ("", "localhost"):
            raise ImageError(f"image file URL {url[:80]!r} names host {parsed.netloc!r}: use file:///absolute/path")
        path = Path(unquote(parsed.path))
        if not path.is_file():
            raise ImageError(f"image file {str(path)!r} does not exist")
        if path.stat().st_size > MAX_IMAGE_BYTES:
            raise ImageError(f"image file {str(path)!r}: over the {MAX_IMAGE_BYTES}-byte limit")
        return _decode_bytes(path.read_bytes(), f"image file {str(path)!r}", max_pixels)
    if parsed.scheme in ("http", "https"):
        raise ImageError("remote image URLs are not fetched: hand over the bytes as a data: URL (or a file:// path)")
    if url and not parsed.scheme:  # SGLang's image_data also takes bare base64
        try:
            raw = base64.b64decode(url, validate=True)
        except (binascii.Error, ValueError):
            raise ImageError(f"image {url[:40]!r}...: neither a data:/file:// URL nor base64") from None
        return _decode_bytes(raw, "base64 image", max_pixels)
    raise ImageError(f"image URL scheme {parsed.scheme!r} is not supported (data: or file://)")


def _rgb(img: Any) -> Any:
    """RGB as transformers' ``convert_to_rgb`` makes it (every other mode through RGBA, composited onto white:
    transparent pixels become white, not black); always a copy, so an env that redraws its canvas in place
    never changes a picture already taken."""
    PILImage = _pil()
    if img.mode == "RGB":
        return img.copy()
    rgba = img.convert("RGBA")
    white = PILImage.new("RGBA", rgba.size, (255, 255, 255, 255))
    return PILImage.alpha_composite(white, rgba).convert("RGB")


def load_image(source: Any, *, max_pixels: int = MAX_IMAGE_PIXELS, url: bool = True, files: bool = True) -> Image:
    """Decode and check one image (a PIL image, a data/file URL, or bare base64); raise :class:`ImageError`.

    ``url=False`` skips the PNG encoding (the image's ``url`` is then empty: an engine needs only pixels and
    digest); ``files=False`` refuses ``file://`` URLs (an HTTP server must not read its own disk for a client).
    """
    PILImage = _pil()
    if isinstance(source, PILImage.Image):
        w, h = source.size
        if w * h > max_pixels:
            raise ImageError(f"image: {w}x{h} pixels is over the {max_pixels}-pixel limit")
        img = source
    elif isinstance(source, str):
        img = _from_url(source, max_pixels, files)
    else:
        raise ImageError(f"an image must be a PIL image or a data:/file:// URL, not {type(source).__name__}")
    if min(img.size) < MIN_IMAGE_SIDE:
        raise ImageError(f"image: {img.size[0]}x{img.size[1]} has no pixels")
    rgb = _rgb(img)
    data = ""
    if url:
        buf = io.BytesIO()
        rgb.save(buf, format="PNG")
        data = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode("ascii")
    digest = hashlib.sha256(f"{rgb.mode}{rgb.size}".encode() + rgb.tobytes()).hexdigest()
    return Image(url=data, pil=rgb, digest=digest)


def _part_image(part: Any, where: str) -> Any:
    """The image source inside one content part (None for a text part); raise on a malformed part."""
    PILImage = _pil()
    if isinstance(part, PILImage.Image):
        return part
    if not isinstance(part, dict):
        raise ImageError(f"{where} is {type(part).__name__}; content parts are dicts (or PIL images)")
    kind = part.get("type")
    if kind == "text":
        if not isinstance(part.get("text"), str):
            raise ImageError(f"{where}: a text part needs 'text' (a str)")
        return None
    if kind == "image_url":
        spec = part.get("image_url")
        url = spec.get("url") if isinstance(spec, dict) else spec
        if not isinstance(url, str):
            raise ImageError(f"{where}: an image_url part needs image_url.url (a str)")
        return url
    if kind == "image":
        src = part.get("image", part.get("url"))
        if src is None:
            raise ImageError(f"{where}: an image part needs 'image' (a PIL image or a URL)")
        return src
    raise ImageError(f"{where}: content part type {kind!r} is not supported (text, image_url or image)")


def check_content(content: Any, where: str) -> None:
    """Raise :class:`ImageError` unless ``content`` is a str or a list of well-formed parts (images not decoded)."""
    if isinstance(content, str):
        return
    if not isinstance(content, list):
        raise ImageError(f"{where} content must be a str or a list of content parts, got {type(content).__name__}")
    for j, part in enumerate(content):
        _part_image(part, f"{where} part {j}")


def count_images(messages: Sequence[Mapping[str, Any]]) -> int:
    """How many image parts ``messages`` hold (cheap: nothing is decoded; malformed parts raise)."""
    n = 0
    for i, m in enumerate(messages):
        content = m.get("content")
        if isinstance(content, list):
            n += sum(_part_image(p, f"message {i} part {j}") is not None for j, p in enumerate(content))
    return n


def normalize(
    messages: Sequence[Mapping[str, Any]], *, max_pixels: int = MAX_IMAGE_PIXELS, files: bool = True
) -> tuple[list[Any], list[Image]]:
    """Decode and check every image of ``messages``; return them with each image part rewritten as an
    OpenAI ``image_url`` part holding the image's PNG data URL (JSON-safe: what the conversation keeps,
    what a chat-completions engine is sent), and the images in order. String contents are untouched."""
    out: list[Any] = []
    images: list[Image] = []
    for i, m in enumerate(messages):
        content = m.get("content")
        if not isinstance(content, list):
            out.append(m)
            continue
        parts: list[dict] = []
        for j, part in enumerate(content):
            src = _part_image(part, f"message {i} part {j}")
            if src is None:
                parts.append({"type": "text", "text": part["text"]})
            else:
                img = load_image(src, max_pixels=max_pixels, files=files)
                images.append(img)
                parts.append({"type": "image_url", "image_url": {"url": img.url}})
        out.append({**m, "content": parts})
    return out, images


def template_messages(messages: Sequence[Mapping[str, Any]], *, join_text: bool = True) -> list[Any]:
    """Messages as transformers' multimodal chat templates read them: each image part becomes
    ``{"type": "image"}`` (rendered as the model's image marker), text parts stay, nothing is decoded.
    ``join_text``: a list of text parts only becomes one string (OpenAI's meaning), which text-only
    templates can render (a VLM's template keeps the list)."""
    out: list[Any] = []
    for i, m in enumerate(messages):
        content = m.get("content")
        if not isinstance(content, list):
            out.append(m)
            continue
        parts = []
        for j, p in enumerate(content):
            parts.append({"type": "image"} if _part_image(p, f"message {i} part {j}") is not None else dict(p))
        if join_text and all(p["type"] == "text" for p in parts):
            out.append({**m, "content": "".join(p["text"] for p in parts)})
        else:
            out.append({**m, "content": parts})
    return out


def flat_text(content: Any, marker: str) -> Any:
    """A template-form content (:func:`template_messages`) as one string, each image part as ``marker``."""
    if not isinstance(content, list):
        return content
    return "".join(marker if p.get("type") == "image" else str(p.get("text", "")) for p in content)


def text_of(content: Any) -> str:
    """A content's text (parts joined, images as ``[image]``): for logs, viewers and text-only tools."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        return "" if content is None else str(content)
    out = []
    for part in content:
        if isinstance(part, dict) and part.get("type") == "text":
            out.append(str(part.get("text", "")))
        else:
            out.append("[image]")
    return "".join(out)
