"""The embedded engine's request bodies as pydantic models: every field typed and bounded.

A body is validated here (on the event loop, or in a worker thread when it is large) before anything
reaches the engine's worker thread: a bad value is one HTTP 400 naming the field (``messages.0.content.1.text: Input should be a
valid string``) instead of an exception inside a shared loop. Names follow SGLang's
``GenerateReqInput`` and OpenAI's completions / chat completions. Unknown fields are refused (a
typo must not be served as if it were the default); fields SGLang or OpenAI define and the
embedded engine does not implement are accepted only at their neutral value.
``sampling_params`` themselves are :class:`~agentrl.engines.local.sampling.SamplingConfig`.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from agentrl.engines.local.sampling import INT32, Flag, InvalidRequestError, validation_message
from agentrl.engines.weight_group import DEFAULT_GROUP_NAME

TokenIds = Annotated[list[Annotated[int, Field(strict=True, ge=0, le=INT32)]], Field(min_length=1)]
Count = Annotated[int, Field(strict=True, ge=0, le=INT32)]
StartLen = Annotated[int, Field(strict=True, ge=-1, le=INT32)]
ImageItem = Annotated[str, Field(strict=True, min_length=1)]
LoraName = Annotated[str, Field(strict=True, min_length=1, max_length=256)]


class _Body(BaseModel):
    """Unknown fields refused; fields in ``NEUTRAL`` accepted only at their neutral value."""

    model_config = ConfigDict(extra="allow", allow_inf_nan=False)
    NEUTRAL: ClassVar[dict[str, tuple[Any, ...] | None]] = {}
    """Defined elsewhere, not implemented here: name -> the values that change nothing (None: any value)."""

    @model_validator(mode="after")
    def _no_unknown(self) -> _Body:
        for key, value in (self.model_extra or {}).items():
            if key not in self.NEUTRAL:
                raise ValueError(f"unknown field {key!r}")
            allowed = self.NEUTRAL[key]
            if allowed is not None and not any(value == a and type(value) is type(a) for a in allowed):
                raise ValueError(f"{key}={value!r} is not supported by the embedded engine")
        return self

    @classmethod
    def parse(cls, body: Any):
        """``body`` validated, or :class:`InvalidRequestError` (HTTP 400) naming the field."""
        if not isinstance(body, dict):
            raise InvalidRequestError("request body must be a JSON object")
        try:
            return cls(**body)
        except ValidationError as exc:
            raise InvalidRequestError(validation_message(exc, "")) from None
        except TypeError as exc:  # a key that is not a string
            raise InvalidRequestError(str(exc)) from None


class GenerateRequest(_Body):
    """SGLang's native ``/generate`` body (one request or a batch: lists of inputs)."""

    NEUTRAL = {
        "token_ids_logprob": (None,),
        "return_hidden_states": (None, False),
        "return_routed_experts": (None, False),
        "audio_data": (None,),
        "video_data": (None,),
        "custom_logit_processor": (None,),
        "modalities": (None,),
        "session_params": (None,),
        "data_parallel_rank": (None,),
        "bootstrap_host": (None,),
        "bootstrap_port": (None,),
        "bootstrap_room": (None,),
        "log_metrics": (None, True),
    }

    text: (
        Annotated[str, Field(strict=True)]
        | Annotated[list[Annotated[str, Field(strict=True)]], Field(min_length=1)]
        | None
    ) = None
    input_ids: TokenIds | Annotated[list[TokenIds], Field(min_length=1)] | None = None
    sampling_params: dict | list[dict] | None = None
    rid: Annotated[str, Field(strict=True, max_length=256)] | list[Annotated[str, Field(max_length=256)]] | None = None
    return_logprob: Flag | list[Flag] | None = None
    logprob_start_len: StartLen | list[StartLen] | None = None
    top_logprobs_num: Count | list[Count] | None = None
    image_data: ImageItem | list[ImageItem | None] | list[list[ImageItem] | None] | None = None
    """SGLang's images: one request's list (or one image), or per batch entry a list; each a data:/file:// URL or
    base64 (decoded and checked by the engine; a text-only model refuses them)."""
    return_text_in_logprobs: Flag = False
    stream: Flag = False
    lora_path: LoraName | list[LoraName | None] | None = None
    """SGLang's field: the name of a loaded LoRA adapter (``/load_lora_adapter``, ``--lora-paths``), or per batch
    entry a name or None (the base model)."""

    @model_validator(mode="after")
    def _one_input(self) -> GenerateRequest:
        if (self.input_ids is None) == (self.text is None):
            raise ValueError("exactly one of input_ids and text is required")
        return self


class ContentPart(BaseModel):
    """An OpenAI text content part."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["text"]
    text: Annotated[str, Field(strict=True)]


class ImageUrl(BaseModel):
    """OpenAI's ``image_url`` object: a data: or file:// URL (remote URLs are refused when decoded)."""

    model_config = ConfigDict(extra="forbid")
    url: Annotated[str, Field(strict=True, min_length=1)]
    detail: Literal["auto", "low", "high"] | None = None


class ImagePart(BaseModel):
    """An OpenAI image content part; served by a vision-language model only."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["image_url"]
    image_url: ImageUrl


class ChatMessage(BaseModel):
    """An OpenAI chat message. Extra keys (e.g. ``reasoning_content``) go to the chat template as given."""

    model_config = ConfigDict(extra="allow")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: (
        Annotated[str, Field(strict=True)]
        | list[Annotated[ContentPart | ImagePart, Field(discriminator="type")]]
        | None
    ) = None
    name: Annotated[str, Field(strict=True)] | None = None
    tool_calls: list[dict] | None = None
    tool_call_id: Annotated[str, Field(strict=True)] | None = None


class StreamOptions(BaseModel):
    """OpenAI ``stream_options``."""

    model_config = ConfigDict(extra="forbid")
    include_usage: Flag = False


class _Function(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: Annotated[str, Field(strict=True, min_length=1, max_length=256)]


class NamedToolChoice(BaseModel):
    """OpenAI ``tool_choice: {"type": "function", "function": {"name": ...}}``."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    function: _Function


class _OpenAIBody(_Body):
    """Fields shared by OpenAI completions and chat completions; sampling fields go to :class:`SamplingConfig`."""

    NEUTRAL = {
        "user": None,
        "frequency_penalty": (None, 0, 0.0),
        "presence_penalty": (None, 0, 0.0),
        "repetition_penalty": (None, 1, 1.0),
        "response_format": (None, {"type": "text"}),
        "parallel_tool_calls": (None, True, False),
        "metadata": None,
        "store": (None, False),
        "service_tier": (None, "auto", "default"),
    }

    model: Annotated[str, Field(strict=True, max_length=4096)] | None = None
    """With LoRA on, ``base:adapter`` (SGLang's syntax) runs the named adapter; otherwise any name is the served model."""
    lora_path: LoraName | None = None
    """SGLang's extension: the adapter to run (``model``'s ``:adapter`` wins when both name one)."""
    max_tokens: Count | None = None
    max_completion_tokens: Count | None = None
    temperature: Any = None
    top_p: Any = None
    top_k: Any = None
    min_p: Any = None
    stop: Any = None
    stop_token_ids: Any = None
    ignore_eos: Any = None
    skip_special_tokens: Any = None
    no_stop_trim: Any = None
    seed: Any = None  # OpenAI's name for SGLang's sampling_seed
    n: Annotated[int, Field(strict=True, ge=1, le=128)] = 1
    logit_bias: (
        Annotated[
            dict[Annotated[str, Field(pattern=r"^[0-9]{1,10}$")], Annotated[float, Field(ge=-100, le=100)]],
            Field(max_length=4096),
        ]
        | None
    ) = None
    stream: Flag = False
    stream_options: StreamOptions | None = None

    @model_validator(mode="after")
    def _stream_options_need_stream(self) -> _OpenAIBody:
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed with stream: true")
        return self

    def sampling(self, default_max: int | None) -> dict:
        """SGLang ``sampling_params`` (validated by the engine, errors naming ``sampling_params.<field>``)."""
        max_tokens = self.max_tokens if self.max_tokens is not None else self.max_completion_tokens
        sp: dict[str, Any] = {"max_new_tokens": max_tokens if max_tokens is not None else (default_max or 1 << 30)}
        for key in (
            "temperature",
            "top_p",
            "top_k",
            "min_p",
            "stop",
            "stop_token_ids",
            "ignore_eos",
            "skip_special_tokens",
            "no_stop_trim",
        ):
            if getattr(self, key) is not None:
                sp[key] = getattr(self, key)
        if self.seed is not None:
            sp["sampling_seed"] = self.seed
        if self.logit_bias:
            sp["logit_bias"] = dict(self.logit_bias)
        return sp


class CompletionRequest(_OpenAIBody):
    """OpenAI ``/v1/completions``: a string, token ids, or a list of either."""

    prompt: (
        Annotated[str, Field(strict=True)]
        | TokenIds
        | Annotated[list[Annotated[str, Field(strict=True)]], Field(min_length=1)]
        | Annotated[list[TokenIds], Field(min_length=1)]
    )
    # the sampled tokens' log-probs; top alternatives (logprobs > 1) are not implemented
    logprobs: Annotated[int, Field(strict=True, ge=0, le=1)] | None = None
    echo: Literal[False] = False


class ChatCompletionRequest(_OpenAIBody):
    """OpenAI ``/v1/chat/completions``."""

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    tools: list[dict] | None = None
    tool_choice: Literal["auto", "none", "required"] | NamedToolChoice | None = None
    logprobs: Flag = False
    top_logprobs: Annotated[int, Field(strict=True, ge=0, le=0)] | None = None
    chat_template_kwargs: dict | None = None

    def message_dicts(self) -> list[dict]:
        """The messages for the chat template: text parts joined into one string; a message with images keeps
        its parts (``image_url`` parts, in order)."""
        out = []
        for m in self.messages:
            content: Any = m.content
            if isinstance(m.content, list):
                if any(isinstance(p, ImagePart) for p in m.content):
                    content = [p.model_dump(exclude_none=True) for p in m.content]
                else:
                    content = "".join(p.text for p in m.content if isinstance(p, ContentPart))
            d: dict[str, Any] = {"role": m.role, "content": content, **(m.model_extra or {})}
            for key in ("name", "tool_calls", "tool_call_id"):
                if getattr(m, key) is not None:
                    d[key] = getattr(m, key)
            out.append(d)
        return out


# ---------------------------------------------------------------- weight and control endpoints (SGLang's bodies)

Version = Annotated[str, Field(strict=True, max_length=256)] | Annotated[int, Field(strict=True)] | None


class UpdateWeightsFromDiskRequest(_Body):
    """``/update_weights_from_disk``: a checkpoint folder (SGLang's ``UpdateWeightFromDiskReqInput``)."""

    NEUTRAL = {"load_format": (None, "auto", "safetensors")}
    model_path: Annotated[str, Field(strict=True, min_length=1, max_length=4096)]
    weight_version: Version = None
    abort_all_requests: Flag = False
    flush_cache: Flag = True  # either way: the embedded engine drops its prefix cache on every weight change


class UpdateWeightVersionRequest(_Body):
    """``/update_weight_version`` (SGLang's ``UpdateWeightVersionReqInput``): the version responses report."""

    new_version: Annotated[str, Field(strict=True, min_length=1, max_length=256)]
    abort_all_requests: Flag = False


class LoadLoraAdapterRequest(_Body):
    """``/load_lora_adapter`` (SGLang's ``LoadLoRAAdapterReqInput``): a PEFT adapter folder served as ``lora_name``."""

    NEUTRAL = {"lora_id": (None,)}
    lora_name: LoraName
    lora_path: Annotated[str, Field(strict=True, min_length=1, max_length=4096)]
    pinned: Flag = False


class UnloadLoraAdapterRequest(_Body):
    """``/unload_lora_adapter`` (SGLang's ``UnloadLoRAAdapterReqInput``)."""

    NEUTRAL = {"lora_id": (None,)}
    lora_name: LoraName


class InitWeightsUpdateGroupRequest(_Body):
    """``/init_weights_update_group``: join the trainer's process group as one rank."""

    master_address: Annotated[str, Field(strict=True, min_length=1, max_length=255)]
    master_port: Annotated[int, Field(strict=True, ge=1, le=65535)]
    rank_offset: Annotated[int, Field(strict=True, ge=1, le=65535)]
    world_size: Annotated[int, Field(strict=True, ge=2, le=65536)]
    group_name: Annotated[str, Field(strict=True, min_length=1, max_length=256)] = DEFAULT_GROUP_NAME
    backend: Literal["nccl", "gloo"] = "nccl"


class UpdateWeightsFromDistributedRequest(_Body):
    """``/update_weights_from_distributed``: one broadcast bucket's metadata (checked by ``check_metadata``)."""

    names: list[Any]
    dtypes: list[Any]
    shapes: list[Any]
    group_name: Annotated[str, Field(strict=True, max_length=256)] = DEFAULT_GROUP_NAME
    weight_version: Version = None
    load_format: None = None
    abort_all_requests: Flag = False
    flush_cache: Flag = True  # either way: the embedded engine drops its prefix cache on every weight change


class UpdateWeightsFromTensorRequest(_Body):
    """``/update_weights_from_tensor``: serialized handles, one payload per TP rank (one here)."""

    NEUTRAL = {"abort_all_requests": (None, False)}
    serialized_named_tensors: Annotated[list[Annotated[str, Field(strict=True)]], Field(min_length=1, max_length=1)]
    load_format: Literal["direct", "flattened_bucket"] | None = None  # flattened_bucket: what slime sends colocated
    weight_version: Version = None
    flush_cache: Flag = True  # either way: the embedded engine drops its prefix cache on every weight change


class GroupRequest(_Body):
    """``/destroy_weights_update_group``."""

    group_name: Annotated[str, Field(strict=True, max_length=256)] = DEFAULT_GROUP_NAME


class PauseRequest(_Body):
    """``/pause_generation`` (the embedded engine implements mode ``abort`` only)."""

    mode: Annotated[str, Field(strict=True, max_length=32)] = (
        "abort"  # checked against SGLang's modes by the pause gate
    )


class AbortRequest(_Body):
    """``/abort_request``: one request by ``rid``, or all."""

    rid: Annotated[str, Field(strict=True, max_length=256)] | None = None
    abort_all: Flag = False


class MemoryRequest(_Body):
    """``/release_memory_occupation`` and ``/resume_memory_occupation``."""

    tags: list[Literal["weights", "kv_cache", "cuda_graph"]] | None = None
