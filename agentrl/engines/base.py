"""The engine interface: token ids in, token ids and log-probs out.

Every engine the SDK drives (SGLang on a GPU cluster, the embedded engine on a laptop, a router
over several of them) is reached through this small interface, so the episode loop never knows
which one it talks to. Implementations speak HTTP (see ``agentrl.engines.http``); the request and
response shapes are SGLang's native ``/generate`` shapes.
"""

from __future__ import annotations

import abc
import binascii
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any


class EngineError(RuntimeError):
    """An engine could not serve a request after the retries it was allowed.

    The episode that made the request ends as ``aborted``; the run goes on.
    """


class EngineRequestError(EngineError):
    """The engine answered but refused the request (HTTP 4xx); retrying would not help."""

    def __init__(self, message: str, status: int | None = None):
        super().__init__(message)
        self.status = status  # the HTTP status, where there was one


@dataclass
class SamplingParams:
    """SGLang's ``sampling_params`` subset the SDK uses (same names, same meaning).

    ``temperature == 0`` means greedy. ``top_k == -1`` means the whole vocabulary.
    ``stop`` strings and ``stop_token_ids`` end a turn in addition to the tokenizer's EOS.
    ``sampling_seed`` makes one request's draws reproducible (SGLang honours it in its
    deterministic-inference mode; the embedded engine always does).
    """

    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    skip_special_tokens: bool = False
    no_stop_trim: bool = True
    sampling_seed: int | None = None

    def to_json(self) -> dict[str, Any]:
        """The JSON object sent as ``sampling_params``."""
        d: dict[str, Any] = {
            "max_new_tokens": self.max_new_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "skip_special_tokens": self.skip_special_tokens,
            "no_stop_trim": self.no_stop_trim,
        }
        if self.stop:
            d["stop"] = list(self.stop)
        if self.stop_token_ids:
            d["stop_token_ids"] = list(self.stop_token_ids)
        if self.sampling_seed is not None:
            d["sampling_seed"] = self.sampling_seed
        return d


_SPEC_KEYS = ("spec_verify_ct", "spec_accept_token_num", "spec_draft_token_num")
"""The ``meta_info`` keys SGLang adds when it decodes speculatively (slime's ``Sample.SpecInfo`` reads them)."""


def _count(value: Any, name: str) -> int:
    """A ``meta_info`` counter: an integer >= 0 (anything else is a malformed reply)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"meta_info.{name}={value!r} is not a count")
    return value


@dataclass
class GenerateOutput:
    """What one ``/generate`` call returned, already unpacked from SGLang's JSON.

    ``finish_reason`` is ``"stop"``, ``"length"`` or ``"abort"``; ``matched`` is the stop token id
    or stop string that ended it (SGLang's ``finish_reason.matched``). ``output_ids`` include the
    stop token when one was sampled, as SGLang returns them.
    """

    output_ids: list[int]
    output_logprobs: list[float]
    finish_reason: str
    matched: int | str | None = None
    text: str = ""
    weight_version: str = "default"
    prompt_tokens: int = 0
    engine_url: str = ""
    message: dict[str, Any] | None = None
    """The assistant message, for text-in/text-out chat completions (then ids are a local re-tokenization)."""
    spec: dict[str, int] | None = None
    """Speculative-decoding counters of this reply (``spec_verify_ct``, ``spec_accept_token_num``,
    ``spec_draft_token_num``, ``completion_tokens``) when the engine reports them (SGLang with a draft model)."""
    routed_experts: Any = None
    """MoE expert ids of every token the engine forwarded (prompt and reply but the last sampled token), flat
    int32, when asked for (``return_routed_experts``): SGLang's ``meta_info.routed_experts``, base64 bytes."""

    @classmethod
    def from_sglang(cls, body: Any, engine_url: str = "") -> GenerateOutput:
        """Parse a (non-batched, non-streamed) SGLang ``/generate`` response.

        A reply that does not have SGLang's shape raises :class:`EngineError` (so the request is
        retried or moved to another engine) instead of corrupting the sample. The ids come from
        ``output_token_logprobs`` when ``output_ids`` is absent, as slime reads them.
        """
        try:
            meta = body.get("meta_info") or {}
            fr = meta.get("finish_reason") or {}
            if isinstance(fr, str):
                fr = {"type": fr}
            lps_raw = meta.get("output_token_logprobs")
            if lps_raw is None:
                raise EngineError(
                    f"{engine_url}: reply has no meta_info.output_token_logprobs (return_logprob ignored?)"
                )
            lp_ids = [int(x[1]) for x in lps_raw]
            lps = [float(x[0]) if x[0] is not None else 0.0 for x in lps_raw]
            out_ids = [int(i) for i in body["output_ids"]] if body.get("output_ids") is not None else lp_ids
            if out_ids != lp_ids:
                raise EngineError(f"{engine_url}: output_token_logprobs ids differ from output_ids")
            spec = None
            if any(k in meta for k in _SPEC_KEYS):
                spec = {k: _count(meta.get(k, 0), k) for k in _SPEC_KEYS}
                spec["completion_tokens"] = _count(meta.get("completion_tokens", len(out_ids)), "completion_tokens")
            routed = None
            if meta.get("routed_experts") is not None:
                import base64

                import numpy as np

                raw = base64.b64decode(str(meta["routed_experts"]).encode("ascii"), validate=True)
                routed = np.frombuffer(raw, dtype=np.int32).copy()
                forwarded = int(meta.get("prompt_tokens", 0) or 0) + len(out_ids) - 1
                if forwarded > 0 and routed.size % forwarded:
                    raise ValueError(
                        f"meta_info.routed_experts holds {routed.size} ids for {forwarded} forwarded tokens"
                    )
            return cls(
                output_ids=out_ids,
                output_logprobs=lps,
                finish_reason=str(fr.get("type", "stop")),
                matched=fr.get("matched"),
                text=body.get("text", ""),
                weight_version=str(meta.get("weight_version", "default")),
                prompt_tokens=int(meta.get("prompt_tokens", 0) or 0),
                engine_url=engine_url,
                spec=spec,
                routed_experts=routed,
            )
        except (AttributeError, KeyError, TypeError, ValueError, IndexError, binascii.Error) as exc:
            raise EngineError(
                f"{engine_url}: malformed /generate reply ({type(exc).__name__}: {exc}): {str(body)[:200]}"
            ) from None


class Engine(abc.ABC):
    """A token-in/token-out generation backend.

    ``key`` lets a router keep one episode on one engine, so the engine's prefix cache hits on
    every turn after the first.

    The episode loop calls :meth:`generate_turn` and nothing else, so every engine, the text-in/
    text-out chat-completions adapter included, is reached through one path.
    """

    token_exact: bool = True
    """False for engines that see text, not ids (the samples they make are flagged, never trained on silently)."""

    accepts_images: bool = False
    """True for engines whose :meth:`generate` takes ``image_data`` (SGLang's field: one entry per image)."""

    @abc.abstractmethod
    async def generate(
        self, input_ids: list[int], sampling_params: SamplingParams, *, key: str | None = None
    ) -> GenerateOutput:
        """Continue ``input_ids``; return the sampled ids with their log-probs."""

    async def generate_turn(
        self,
        input_ids: list[int],
        sampling_params: SamplingParams,
        *,
        key: str | None = None,
        messages: Sequence[Mapping[str, Any]] = (),
        tools: Sequence[Mapping[str, Any]] = (),
        image_data: Sequence[str] = (),
    ) -> GenerateOutput:
        """One assistant turn of an episode.

        The loop hands over both views of the conversation: ``input_ids`` (the ledger's exact ids)
        and ``messages``/``tools`` (the same conversation as chat messages). A token engine
        continues the ids and ignores the messages; an adapter for a text-only API sends the
        messages and re-tokenizes the reply (then :attr:`token_exact` is False). ``image_data``: the
        conversation's images (PNG data URLs) in the order of their placeholder tokens in ``input_ids``;
        passed only when there are some, and refused by an engine that cannot take them.
        """
        if image_data:
            if not self.accepts_images:
                raise EngineRequestError(f"{type(self).__name__} does not take images (image_data)")
            return await self.generate(input_ids, sampling_params, key=key, image_data=list(image_data))  # type: ignore[call-arg]
        return await self.generate(input_ids, sampling_params, key=key)

    @abc.abstractmethod
    async def health(self) -> bool:
        """True when the engine answers."""

    async def update_weights_from_disk(self, model_path: str, weight_version: str | None = None) -> None:
        """Load new weights from a checkpoint folder (``/update_weights_from_disk``)."""
        raise NotImplementedError

    async def context_length(self) -> int | None:
        """The longest sequence (prompt + output) the engine serves, when it says so."""
        return None

    async def close(self) -> None:
        """Release connections."""
