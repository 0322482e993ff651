"""SGLang's native ``/generate`` body as ``LocalEngine.generate`` jobs: one request or a batch, ids or text.

Cheap refusals come first: a prompt longer than the engine's context (by its length, or for a text by
:meth:`~.text_prompts.TextPrompts.check_fits`) is refused before pydantic walks its tokens and before any
text is tokenized, so a body of millions of ids costs its parse and little more. The server calls
:func:`generate_jobs` in a worker thread for a large body or one with pictures.
"""

from __future__ import annotations

from typing import Any

from agentrl.engines.local import protocol as P
from agentrl.engines.local.engine import InvalidRequestError, LocalEngine
from agentrl.engines.local.text_prompts import TextPrompts
from agentrl.images import ImageError, load_image

MAX_JOBS_PER_REQUEST = 4096
"""Most generations one request may ask for (its prompts times ``n``): each is a job with its own state and
output, so a 10 KB body of short prompts could otherwise ask for millions. A larger batch is split by the client."""


def check_job_count(inputs: int, n: int = 1) -> None:
    """Refuse a request for more than :data:`MAX_JOBS_PER_REQUEST` generations, before any is built."""
    if inputs * n > MAX_JOBS_PER_REQUEST:
        what = f"{inputs} inputs" + (f" x n={n}" if n != 1 else "")
        raise InvalidRequestError(
            f"the request asks for {inputs * n} generations ({what}); at most {MAX_JOBS_PER_REQUEST} per request: "
            "send the batch as several requests"
        )


def generate_jobs(engine: LocalEngine, prompts: TextPrompts, body: dict) -> tuple[bool, list[dict]]:
    """A ``/generate`` body checked (the number of inputs and a prompt longer than the context first, before the
    per-token checks) and unpacked into ``engine.generate`` keyword arguments."""
    inputs, text = body.get("input_ids"), body.get("text")
    if isinstance(inputs, list) and inputs and isinstance(inputs[0], list):
        check_job_count(len(inputs))
    elif inputs is None and isinstance(text, list):
        check_job_count(len(text))
    for ids in _id_lists(body.get("input_ids")):
        engine.check_prompt_length(len(ids))
    text = body.get("text")
    for t in text if isinstance(text, list) else [text]:
        if isinstance(t, str) and body.get("input_ids") is None:
            prompts.check_fits(t)
    P.GenerateRequest.parse(body)
    return _unpack(engine, prompts, body)


def _id_lists(inputs: Any) -> list[list]:
    """The token-id lists of an ``input_ids`` value (one or a batch); anything else: none (refused later)."""
    if not isinstance(inputs, list) or not inputs:
        return []
    return [x for x in inputs if isinstance(x, list)] if isinstance(inputs[0], list) else [inputs]


def _unpack(engine: LocalEngine, prompts: TextPrompts, body: dict) -> tuple[bool, list[dict]]:
    """Unpack a (possibly batched) ``/generate`` body, already checked by :class:`~.protocol.GenerateRequest`,
    into ``engine.generate`` keyword arguments."""
    if body.get("input_ids") is not None:
        inputs = body["input_ids"]
        batch = isinstance(inputs, list) and bool(inputs) and isinstance(inputs[0], list)
        ids = inputs if batch else [inputs]
    else:
        text = body["text"]
        batch = isinstance(text, list)
        texts = text if batch else [text]
        ids = [prompts.encode(t) for t in texts]
    images = _image_items(body.get("image_data"), batch, len(ids))
    if body.get("input_ids") is None and engine.vision is not None:  # text in: the processor expands the markers
        ids = [_expand_text(engine, t, imgs) if imgs else i for t, i, imgs in zip(texts, ids, images)]

    def per_item(key: str, default: Any) -> list:
        value = body.get(key, default)
        if batch and isinstance(value, list) and (key != "sampling_params" or value and isinstance(value[0], dict)):
            if len(value) != len(ids):
                raise InvalidRequestError(f"{key} has {len(value)} entries for {len(ids)} inputs")
            return value
        return [value] * len(ids)

    if not batch and isinstance(body.get("lora_path"), list):
        raise InvalidRequestError("lora_path: one request takes one adapter name (a list is for a batch of inputs)")
    rids = per_item("rid", None)
    if batch and isinstance(body.get("rid"), str):
        rids = [f"{body['rid']}_{i}" for i in range(len(ids))]
    jobs = [
        {
            "input_ids": i,
            "sampling_params": sp or {},
            "rid": rid,
            "return_logprob": bool(lp),
            "return_text_in_logprobs": bool(body.get("return_text_in_logprobs")),
            "logprob_start_len": -1 if start is None else start,
            "top_logprobs_num": top or 0,
            "image_data": imgs,
            "lora_path": lora,
        }
        for i, sp, rid, lp, start, top, imgs, lora in zip(
            ids,
            per_item("sampling_params", {}),
            rids,
            per_item("return_logprob", False),
            per_item("logprob_start_len", -1),
            per_item("top_logprobs_num", 0),
            images,
            per_item("lora_path", None),
        )
    ]
    return batch, jobs


def _image_items(value: Any, batch: bool, n: int) -> list[list[str] | None]:
    """SGLang's ``image_data`` as one list (or None) per input."""
    if value is None:
        return [None] * n
    if not batch:
        return [value if isinstance(value, list) else [value]]
    if not isinstance(value, list) or len(value) != n:
        raise InvalidRequestError(f"image_data: a batch of {n} inputs needs a list of {n} entries (one per input)")
    return [None if v is None else v if isinstance(v, list) else [v] for v in value]


def _expand_text(engine: LocalEngine, text: str, items: list[str]) -> list[int]:
    """A text prompt holding the model's image markers, expanded by its processor for ``items``."""
    assert engine.vision is not None
    try:
        images = [load_image(x, url=False, files=False) for x in items]
        ids = engine.vision.family.expand(text, images).ids
    except (ImageError, ValueError) as exc:
        raise InvalidRequestError(f"image_data: {exc}") from None
    # the special tokens (BOS, EOS) the tokenizer adds to a text prompt without pictures, added here too
    plain, bare = engine.tokenizer.encode(text), engine.tokenizer.encode(text, add_special_tokens=False)
    at = next((i for i in range(len(plain) - len(bare) + 1) if plain[i : i + len(bare)] == bare), None)
    if at is None:
        return ids
    return plain[:at] + ids + plain[at + len(bare) :]
