"""Per-request sampling for the embedded engine, with SGLang's parameters and log-prob semantics.

Every row of a decode batch may carry its own temperature / top-p / top-k / min-p. The log-prob
returned for a sampled token is ``log_softmax(logits / temperature)`` taken *before* filtering
(greedy: ``log_softmax(logits)``), which is what SGLang returns by default and what a trainer
re-scoring the sequence at the same temperature computes.
"""

from __future__ import annotations

from typing import Annotated, Any

import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator
from pydantic import Field as PydanticField


class InvalidRequestError(ValueError):
    """The request cannot be served as given (bad sampling params, prompt too long, ...): HTTP 400."""


_NEUTRAL = {
    "frequency_penalty": 0.0,
    "presence_penalty": 0.0,
    "repetition_penalty": 1.0,
    "min_new_tokens": 0,
    "n": 1,
    "json_schema": None,
    "regex": None,
    "ebnf": None,
    "structural_tag": None,
    "stop_regex": None,
}

CUSTOM_PARAMS = ("return_top_p_token_ids",)
"""``custom_params`` keys the embedded engine acts on (SGLang passes the dict to a custom logit
processor, which the embedded engine does not run; slime's top-p replay asks for the nucleus)."""


INT32 = 2**31 - 1
Flag = Annotated[bool, Field(strict=True)]


class SamplingConfig(BaseModel):
    """SGLang's ``sampling_params``, validated: strict types and bounds, one 400 naming the field.

    Strict because a value the worker thread cannot use (``top_k`` past int64, a temperature no
    float holds, ``skip_special_tokens: "no"``) would otherwise fail inside the shared decode loop,
    for every request in the batch. Penalties and constrained decoding are refused (not supported).
    """

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    max_new_tokens: Annotated[int, Field(strict=True, ge=0, le=INT32)] = 128
    temperature: Annotated[float, Field(strict=True, ge=0, le=1e6)] = 1.0
    top_p: Annotated[float, Field(strict=True, gt=0, le=1)] = 1.0
    top_k: Annotated[int, Field(strict=True, ge=-1, le=INT32)] = -1
    min_p: Annotated[float, Field(strict=True, ge=0, le=1)] = 0.0
    stop: Annotated[list[Annotated[str, Field(strict=True, min_length=1, max_length=512)]], Field(max_length=64)] = (
        PydanticField(default_factory=list)
    )
    stop_token_ids: Annotated[list[Annotated[int, Field(strict=True, ge=0, le=INT32)]], Field(max_length=1024)] = (
        PydanticField(default_factory=list)
    )
    ignore_eos: Flag = False
    skip_special_tokens: Flag = True
    no_stop_trim: Flag = False
    sampling_seed: Annotated[int, Field(strict=True, ge=0, le=2**64 - 1)] | None = None
    logit_bias: (
        Annotated[
            dict[Annotated[str, Field(pattern=r"^[0-9]{1,10}$")], Annotated[float, Field(ge=-1e9, le=1e9)]],
            Field(max_length=4096),
        ]
        | None
    ) = None
    """Token id (as a string, SGLang's and OpenAI's key format) -> a value added to that token's logit
    before sampling; the returned log-probs are those of the biased distribution that was sampled."""
    custom_params: dict[str, Any] | None = None
    """SGLang's free-form dict for custom logit processors; only :data:`CUSTOM_PARAMS` are accepted here."""
    stream_interval: Annotated[int, Field(strict=True, ge=1, le=INT32)] = 1
    """With ``stream: true``: tokens per streamed chunk (SGLang's ``stream_interval``)."""
    spaces_between_special_tokens: Flag = True
    """Passed to the tokenizer's ``decode`` (slow tokenizers honour it; fast ones have no such option)."""

    @field_validator("custom_params")
    @classmethod
    def _custom(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        for key, value in (v or {}).items():
            if key not in CUSTOM_PARAMS:
                raise ValueError(
                    f"custom_params key {key!r} is not supported by the embedded engine (it runs no custom "
                    f"logit processor); supported: {list(CUSTOM_PARAMS)}"
                )
            if not isinstance(value, bool):
                raise ValueError(f"custom_params.{key} must be a boolean, got {value!r}")
        return v

    @property
    def return_top_p_token_ids(self) -> bool:
        """slime's top-p replay: return each output token's kept set (``top_p_token_ids`` / ``_offsets``)."""
        return bool((self.custom_params or {}).get("return_top_p_token_ids"))

    @property
    def filtered(self) -> bool:
        """Whether top-k, top-p or min-p removes tokens before sampling."""
        return self.top_k != -1 or self.top_p < 1 or self.min_p > 0

    @field_validator("stop", mode="before")
    @classmethod
    def _one_stop(cls, v: Any) -> Any:
        return [v] if isinstance(v, str) else v

    @field_validator("top_k")
    @classmethod
    def _top_k(cls, v: int) -> int:
        if v == 0:
            raise ValueError("top_k must be -1 (disabled) or >= 1")
        return v

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-6

    @property
    def stop_window(self) -> int:
        """Output tokens to decode when looking for a stop string (a char may span 4 byte tokens)."""
        return 4 * max(len(s) for s in self.stop) + 2

    @classmethod
    def from_dict(cls, d: Any) -> SamplingConfig:
        """Validate a request's ``sampling_params`` (None values mean the default, as in SGLang)."""
        if not isinstance(d, dict):
            raise InvalidRequestError(f"sampling_params must be an object, got {type(d).__name__}")
        given: dict[str, Any] = {}
        for key, value in d.items():
            if key in _NEUTRAL:
                if value is not None and value != _NEUTRAL[key]:
                    raise InvalidRequestError(f"sampling param {key}={value!r} is not supported by the embedded engine")
            elif key in cls.model_fields:
                if value is not None:
                    given[key] = value
            else:
                raise InvalidRequestError(f"unknown sampling param {key!r}")
        try:
            return cls(**given)
        except ValidationError as exc:
            raise InvalidRequestError(validation_message(exc, "sampling_params")) from None


def validation_message(exc: ValidationError, prefix: str) -> str:
    """A pydantic error as one line naming the field: ``sampling_params.top_k: Input should be ...``."""
    parts = []
    for e in exc.errors()[:3]:
        loc = ".".join(str(x) for x in (prefix, *e["loc"]) if x != "")
        value = repr(e.get("input"))
        parts.append(f"{loc}: {e['msg']} (got {value[:60]})")
    return "; ".join(parts)


def biased(logits: torch.Tensor, params: list[SamplingConfig]) -> torch.Tensor:
    """``logits`` ``[B, V]`` in fp32 with each row's ``logit_bias`` added (ids checked by the engine)."""
    out = logits.float()
    rows = [i for i, p in enumerate(params) if p.logit_bias]
    if rows:
        out = out.clone()
        for i in rows:
            bias = params[i].logit_bias or {}
            idx = torch.tensor([int(k) for k in bias], device=out.device)
            out[i].index_add_(0, idx, torch.tensor(list(bias.values()), device=out.device, dtype=out.dtype))
    return out


def _drop_mask(probs: torch.Tensor, params: list[SamplingConfig]) -> torch.Tensor:
    """``[F, V]`` True where top-k / top-p / min-p remove a token; ``probs`` sorted descending per row."""
    dev = probs.device
    rank = torch.arange(probs.shape[1], device=dev)[None, :]
    top_k = torch.tensor([p.top_k if p.top_k > 0 else probs.shape[1] for p in params], device=dev)
    top_p = torch.tensor([float(p.top_p) for p in params], device=dev)
    min_p = torch.tensor([float(p.min_p) for p in params], device=dev)
    drop = (rank >= top_k[:, None]) | ((probs.cumsum(-1) - probs) > top_p[:, None])
    return drop | (probs < min_p[:, None] * probs[:, :1])


def kept_tokens(logits: torch.Tensor, sp: SamplingConfig, sampled: int) -> list[int]:
    """The token ids one draw could have picked (slime's top-p replay nucleus), in descending probability.

    ``logits`` is one row ``[V]``, already biased. Greedy keeps the sampled token only; an unfiltered
    request keeps the whole vocabulary.
    """
    if sp.greedy:
        return [sampled]
    scaled = logits.float() / float(sp.temperature)
    probs, order = (scaled - torch.logsumexp(scaled, -1)).exp().sort(descending=True)  # as sample_batch
    kept = order[~_drop_mask(probs[None], [sp])[0]].tolist()
    # the draw's own token is in the set by construction; a float tie at the edge must not say otherwise
    return kept if sampled in kept else [*kept, sampled]


def sample_batch(
    logits: torch.Tensor, params: list[SamplingConfig], gens: list[torch.Generator]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row with that row's params and generator; return ``(ids [B], logprobs [B])``.

    A request with a ``sampling_seed`` brings its own generator, so its draws do not depend on
    which other requests share the batch: the same request replays to the same tokens.

    ``logprob = log_softmax(logits / T)[id]`` (greedy: ``T = 1``), before top-k/top-p/min-p
    filtering and never renormalized: SGLang's default, the quantity the trainer's re-score matches.
    ``logits`` are taken as given: the caller adds ``logit_bias`` first (:func:`biased`).
    Sampling inverts the CDF (``cumsum`` + ``searchsorted``), ~50x cheaper than ``torch.multinomial``
    over a 50k vocabulary on CPU.
    """
    dev = logits.device
    temps = torch.tensor([1.0 if p.greedy else float(p.temperature) for p in params], device=dev)
    scaled = logits.float() / temps[:, None]  # [B, V]
    lse = torch.logsumexp(scaled, dim=-1)  # [B]
    ids = logits.argmax(dim=-1)
    rows = [i for i, p in enumerate(params) if not p.greedy]
    plain = [i for i in rows if not params[i].filtered]
    if plain:
        ids[plain] = _inverse_cdf((scaled[plain] - lse[plain, None]).exp(), [gens[i] for i in plain])
    filtered = [i for i in rows if i not in set(plain)]
    if filtered:
        probs, order = (scaled[filtered] - lse[filtered, None]).exp().sort(dim=-1, descending=True)  # [F, V]
        drop = _drop_mask(probs, [params[i] for i in filtered])
        pick = _inverse_cdf(probs.masked_fill(drop, 0.0), [gens[i] for i in filtered])  # [F], in sorted order
        ids[filtered] = order.gather(1, pick[:, None])[:, 0]
    return ids, scaled.gather(1, ids[:, None])[:, 0] - lse


def _inverse_cdf(probs: torch.Tensor, gens: list[torch.Generator]) -> torch.Tensor:
    """One draw per row from unnormalized non-negative weights ``[R, V]``, row ``i`` drawing from ``gens[i]``."""
    cdf = probs.cumsum(dim=-1)  # [R, V]
    if all(g is gens[0] for g in gens):
        u = torch.rand(probs.shape[0], 1, generator=gens[0], device=probs.device)
    else:
        u = torch.cat([torch.rand(1, 1, generator=g, device=probs.device) for g in gens])
    u = u * cdf[:, -1:]
    idx = torch.searchsorted(cdf, u, right=True)[:, 0].clamp_(max=probs.shape[1] - 1)
    # A zero-weight token can only be hit through float ties at the top end: step back onto mass.
    while bool((probs.gather(1, idx[:, None])[:, 0] <= 0).any()):
        bad = probs.gather(1, idx[:, None])[:, 0] <= 0
        idx = torch.where(bad, idx - 1, idx).clamp_(min=0)
    return idx
