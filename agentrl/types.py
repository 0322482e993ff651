"""The plain data that flows through agentrl: messages, tool calls, actions, samples.

These are dataclasses with no behaviour beyond their invariants, so every module (engine client,
episode loop, trainer, viewer) can rely on the same shapes. Field names follow slime's ``Sample`` so
slime users find what they expect (``tokens``, ``response_length``, ``loss_mask``,
``rollout_log_probs``, ``status`` ...).
"""

from __future__ import annotations

import dataclasses
import enum
import json
import numbers
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, TypedDict


class Message(TypedDict, total=False):
    """One OpenAI-style chat message, as envs return them and chat templates render them.

    ``role`` and ``content`` are what every env writes (the loop checks both; ``content`` is a string, or a
    list of OpenAI content parts, text and images, for a vision-language policy: :mod:`agentrl.images`); ``tool_calls`` (the
    OpenAI shape: ``{"id", "type": "function", "function": {"name", "arguments"}}``) is set on
    assistant messages, ``tool_call_id`` and ``name`` on tool results. At run time it is a plain
    dict (a TypedDict only types it), so templates that read other keys still get them.
    """

    role: Literal["system", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]]
    tool_calls: list[dict[str, Any]]
    tool_call_id: str
    name: str


ROLES = ("system", "user", "assistant", "tool")
"""The chat roles a message may have."""


@dataclass
class ToolCall:
    """One tool call parsed from the model's text: ``name``, ``arguments`` (a dict) and an ``id``.

    The id is what the tool result's ``tool_call_id`` points back to; the parser makes one up
    (``call_<turn>_<n>``) because open models rarely emit ids themselves.
    """

    name: str
    arguments: dict[str, Any]
    id: str = ""

    def to_openai(self) -> dict[str, Any]:
        """The OpenAI ``tool_calls`` entry for this call (arguments as a JSON string).

        A lone UTF-16 surrogate the model wrote as the escape ``\\ud800`` stays that escape in the string, so the
        string is valid UTF-8: a client sends it back on its next turn (a raw surrogate would be refused there).
        """
        args = json.dumps(self.arguments, ensure_ascii=False)
        try:
            args.encode("utf-8")
        except UnicodeEncodeError:
            args = json.dumps(self.arguments)
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": args}}


@dataclass
class ParseError:
    """A tool call the model tried to write but got wrong (broken JSON, missing name, ...).

    Kept on the action (``Action.errors``) instead of raising, because a malformed call is normal
    model behaviour during RL: the environment answers it with an error message the model sees.
    ``id`` is the tool_call_id the error message is sent under.
    """

    message: str
    raw: str = ""
    id: str = ""


@dataclass
class Action:
    """The assistant's turn as the environment sees it.

    ``text`` is the decoded turn without the end-of-turn token; ``tool_calls`` are the calls parsed
    from it; ``errors`` the calls that could not be parsed. ``token_ids`` are the exact ids the
    engine sampled (including the stop token), for environments that want them. ``prompt_length``
    is how many tokens the engine read before sampling the turn (the episode's ledger so far: what
    an OpenAI server reports as ``usage.prompt_tokens``); None where no engine sampled the turn
    (:func:`agentrl.rollout.scripted.play`).
    """

    text: str
    tool_calls: list[ToolCall] = field(default_factory=list)
    errors: list[ParseError] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str = "stop"
    prompt_length: int | None = None

    def as_message(self) -> Message:
        """This turn as an assistant chat message (text plus OpenAI-style tool_calls)."""
        msg: Message = {"role": "assistant", "content": self.text}
        if self.tool_calls:
            msg["tool_calls"] = [c.to_openai() for c in self.tool_calls]
        return msg


class Status(str, enum.Enum):
    """How a sample ended (slime's values).

    ``completed``: the environment terminated the episode. ``truncated``: a limit ended it (max
    turns, response length, context length, or the env's own ``truncated``). ``aborted``: the
    engine could not serve it (dead engine after retries, abort request). ``failed``: the
    environment or a user function raised or timed out. Only completed and truncated samples are
    trainable.
    """

    PENDING = "pending"
    COMPLETED = "completed"
    TRUNCATED = "truncated"
    ABORTED = "aborted"
    FAILED = "failed"


CONTRACT_FIELDS = ("turn_rewards", "turn_spans", "env_spans", "status_reason")
"""The episode loop's record beyond slime's fields: typed :class:`Sample` attributes kept in ``metadata``."""


def _is_int(x: Any) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def _spans(metadata: dict[str, Any], name: str) -> list[tuple[int, int]]:
    """``metadata[name]`` as a list of ``(start, end)`` tuples (JSON rows hold lists: stored back as tuples)."""
    spans = metadata.get(name)
    if spans is None:
        spans = metadata[name] = []
    elif not isinstance(spans, list) or any(not isinstance(x, tuple) for x in spans):
        spans = metadata[name] = [tuple(x) for x in spans]
    return spans


@dataclass
class Sample:
    """One episode, token-exact (slime's field names).

    Invariants (checked by :meth:`validate`): ``tokens`` is the prompt ids followed by the response
    ids; ``len(loss_mask) == len(rollout_log_probs) == response_length``; ``loss_mask`` is 1 where
    the policy sampled the token and 0 where the environment or the chat template wrote it (those
    positions have log-prob 0.0). ``reward`` is the sum of ``turn_rewards`` plus any custom
    reward-model score. ``token_exact`` is False for samples made through text-in/text-out chat
    completions, which training refuses unless the user opts in.

    The episode loop's own record (not slime fields) is typed here too, as properties:
    :attr:`turn_rewards`, :attr:`turn_spans`, :attr:`env_spans`, :attr:`status_reason` and the episode's
    identity (:attr:`episode_id`, :attr:`role`, :attr:`segment`, :attr:`trained`, :attr:`policy`, :attr:`episode_key`). Their
    values live in ``metadata`` under the same keys, where slime's consumers keep custom data, where
    a slime-style custom generate function writes them and where every dump since the first holds
    them; so there is one copy, the JSON is unchanged, and code that reads ``metadata["turn_rewards"]``
    keeps working.
    """

    group_index: int | None = None
    index: int | None = None
    prompt: str | list[Message] = ""
    tokens: list[int] = field(default_factory=list)
    response: str = ""
    response_length: int = 0
    label: Any = None
    reward: float | dict | None = None
    loss_mask: list[int] | None = None
    status: Status = Status.PENDING
    metadata: dict[str, Any] = field(default_factory=dict)
    rollout_log_probs: list[float] | None = None
    weight_versions: list[str] = field(default_factory=list)
    token_exact: bool = True
    multimodal_inputs: dict[str, Any] | None = None
    """Raw multimodal data as slime keeps it: ``{"images": [PNG data URLs]}``, in the order of their placeholder
    tokens in ``tokens`` (:mod:`agentrl.images`); carried through dumps."""
    multimodal_train_inputs: dict[str, Any] | None = None
    """Processed multimodal data as slime keeps it: per-image arrays (``{"pixel_values": [...], ...}``, one entry
    per image). Not written by :meth:`to_dict` (it is the processor's function of the images, often 100x their
    size): a sample read back has None, and the trainer processes its images again."""
    remove_sample: bool = False
    """Set by a custom generate / reward / ``--rollout-sample-filter-path`` function: the sample stays in its
    group's advantage normalization, dumps and metrics, but its loss mask is zeroed for training (as slime)."""
    generate_function_path: str | None = None
    """``module:fn`` generating this sample instead of the run's env or ``--custom-generate-function-path``
    (a task row's ``generate_function_path`` key sets it)."""
    non_generation_time: float = 0.0
    """Seconds the episode spent outside the engine: env ``reset``/``step``/``close`` (tools included)."""
    train_metadata: dict[str, Any] | None = None
    """Data for the trainer (slime's field): set by a custom generate / reward / sample-filter function,
    handed to a ``--loss-type custom_loss`` function as ``batch["metadata"]`` (one entry per sample)."""
    rollout_routed_experts: Any = None
    """MoE routing of the rollout (slime's field): an int32 numpy array ``[tokens covered, layers * top-k]``,
    the expert ids SGLang's router picked for every token it forwarded (``--rollout-return-routed-experts``;
    the last turn's reply covers the episode up to its last sampled token, not a later observation).
    ``.reshape(n, layers, top_k)`` gives slime's 3-d view, which a custom generate function may store too.
    Dumps hold it as ``{"dtype", "shape", "base64"}``."""

    @dataclass
    class SpecInfo:
        """Speculative-decoding counters summed over the episode's turns, from SGLang's ``meta_info``."""

        spec_accept_token_num: int = 0
        spec_draft_token_num: int = 0
        spec_verify_ct: int = 0
        completion_token_num: int = 0

        @property
        def spec_accept_rate(self) -> float:
            return self.spec_accept_token_num / self.spec_draft_token_num if self.spec_draft_token_num else 0.0

        @property
        def spec_accept_length(self) -> float:
            return self.completion_token_num / self.spec_verify_ct if self.spec_verify_ct else 0.0

        def add(self, meta_info: dict[str, Any]) -> None:
            """Add one reply's counters (SGLang reports them only when speculative decoding runs)."""
            self.spec_accept_token_num += int(meta_info.get("spec_accept_token_num", 0) or 0)
            self.spec_draft_token_num += int(meta_info.get("spec_draft_token_num", 0) or 0)
            self.spec_verify_ct += int(meta_info.get("spec_verify_ct", 0) or 0)
            self.completion_token_num += int(meta_info.get("completion_tokens", 0) or 0)

        def to_dict(self) -> dict[str, int]:
            return dataclasses.asdict(self)

        @classmethod
        def from_dict(cls, d: dict[str, Any] | None) -> Sample.SpecInfo:
            """Read slime's dict form; a value that is not a count >= 0, or an unknown key, is refused."""
            d = {} if d is None else d
            if not isinstance(d, dict):
                raise ValueError(f"spec_info must be an object of counts, not {d!r}")
            names = [f.name for f in dataclasses.fields(cls)]
            unknown = sorted(set(d) - set(names))
            if unknown:
                raise ValueError(f"spec_info has unknown keys {unknown} (known: {names})")
            info = cls(**{k: d.get(k, 0) for k in names})
            info.check()
            return info

        def check(self) -> None:
            for f in dataclasses.fields(self):
                v = getattr(self, f.name)
                if not _is_int(v) or v < 0:
                    raise ValueError(f"spec_info.{f.name} must be an integer count >= 0, not {v!r}")

    spec_info: SpecInfo = field(default_factory=SpecInfo)

    @property
    def prompt_length(self) -> int:
        """Number of prompt tokens at the front of ``tokens``."""
        return len(self.tokens) - self.response_length

    @property
    def turn_rewards(self) -> list[float]:
        """The env's reward for each assistant turn (0.0 for a turn cut off before ``step``); what
        ``--per-turn-credit`` reads. The list itself (``append`` records a turn)."""
        return self.metadata.setdefault("turn_rewards", [])

    @turn_rewards.setter
    def turn_rewards(self, value: Sequence[float]) -> None:
        self.metadata["turn_rewards"] = [float(x) for x in value]

    @property
    def turn_spans(self) -> list[tuple[int, int]]:
        """Half-open ``(start, end)`` offsets into the response of each assistant turn (loss mask 1)."""
        return _spans(self.metadata, "turn_spans")

    @turn_spans.setter
    def turn_spans(self, value: Sequence[Sequence[int]]) -> None:
        self.metadata["turn_spans"] = [(int(a), int(b)) for a, b in value]

    @property
    def env_spans(self) -> list[tuple[int, int]]:
        """Half-open ``(start, end)`` offsets into the response of each observation (loss mask 0)."""
        return _spans(self.metadata, "env_spans")

    @env_spans.setter
    def env_spans(self, value: Sequence[Sequence[int]]) -> None:
        self.metadata["env_spans"] = [(int(a), int(b)) for a, b in value]

    @property
    def status_reason(self) -> str:
        """Why the episode ended: ``terminated``, ``max_turns``, ``response_length``, ``env_error``, ...
        (empty until it has)."""
        return str(self.metadata.get("status_reason") or "")

    @status_reason.setter
    def status_reason(self, value: str) -> None:
        self.metadata["status_reason"] = str(value)

    @property
    def episode_id(self) -> str | None:
        """The episode this sample belongs to when the episode made several samples (segments of a rewritten
        history, the seats of a multi-role episode); None for a sample that is a whole episode alone."""
        value = self.metadata.get("episode_id")
        return None if value is None else str(value)

    @episode_id.setter
    def episode_id(self, value: str | None) -> None:
        self.metadata["episode_id"] = value

    @property
    def role(self) -> str | None:
        """The seat this sample played in a multi-role episode (None: the single agent)."""
        value = self.metadata.get("role")
        return None if value is None else str(value)

    @role.setter
    def role(self, value: str | None) -> None:
        self.metadata["role"] = value

    @property
    def segment(self) -> int:
        """This sample's place among its episode's segments (0 for an episode in one piece)."""
        return int(self.metadata.get("segment") or 0)

    @segment.setter
    def segment(self, value: int) -> None:
        self.metadata["segment"] = int(value)

    @property
    def num_segments(self) -> int:
        """How many segments the seat's episode made (1 for an episode in one piece); written with ``segment`` when
        there are several, so a single sample's JSON is unchanged."""
        return int(self.metadata.get("num_segments") or 1)

    @num_segments.setter
    def num_segments(self, value: int) -> None:
        self.metadata["num_segments"] = int(value)

    @property
    def trained(self) -> bool:
        """False for a seat played by a fixed policy (``--role-engine-url``): recorded, never trained or
        counted as the policy's result."""
        return self.metadata.get("trained") is not False

    @trained.setter
    def trained(self, value: bool) -> None:
        self.metadata["trained"] = bool(value)

    @property
    def policy(self) -> str | None:
        """The policy that played this sample's seat, when it is not the engine the episode ran on: for a role played
        on ``--role-engine-url``, that engine's address; for a role seated on a trained ``--policy``
        (``--role-policy``), the policy's name (its adapter, its advantages, its ``reward_mean/<policy>``); None
        otherwise (the run's one trained policy, an evaluated or demonstrating engine). Written only when set, so a
        single agent's JSON is unchanged."""
        value = self.metadata.get("policy")
        return None if value is None else str(value)

    @policy.setter
    def policy(self, value: str | None) -> None:
        if value is None:
            self.metadata.pop("policy", None)
        else:
            self.metadata["policy"] = str(value)

    @property
    def episode_key(self) -> tuple[Hashable, str | None]:
        """``(episode, role)``: what the samples of one seat of one episode share. A sample without an
        :attr:`episode_id` (or an empty one) is an episode of its own (keyed by the object)."""
        return (self.metadata.get("episode_id") or ("sample", id(self)), self.role)

    def validate(self) -> None:
        """Raise ``ValueError`` (naming the field) if the token accounting invariants do not hold."""
        n = self.response_length
        if n < 0 or n > len(self.tokens):
            raise ValueError(f"response_length {n} outside 0..{len(self.tokens)}")
        if self.loss_mask is not None and len(self.loss_mask) != n:
            raise ValueError(f"len(loss_mask)={len(self.loss_mask)} != response_length={n}")
        if self.rollout_log_probs is not None and len(self.rollout_log_probs) != n:
            raise ValueError(f"len(rollout_log_probs)={len(self.rollout_log_probs)} != response_length={n}")
        if self.loss_mask is not None and any(m not in (0, 1) for m in self.loss_mask):
            raise ValueError("loss_mask must hold only 0 and 1")
        for name in ("turn_spans", "env_spans"):
            spans = self.metadata.get(name) or []
            if not isinstance(spans, list | tuple):
                raise ValueError(f"metadata[{name!r}] must be a list of (start, end) pairs, not {type(spans).__name__}")
            for span in spans:
                ok = isinstance(span, list | tuple) and len(span) == 2 and all(_is_int(x) for x in span)
                if not ok or not 0 <= span[0] <= span[1] <= n:
                    raise ValueError(f"{name} entry {span!r} is not a (start, end) inside 0..{n}")
        if not isinstance(self.spec_info, Sample.SpecInfo):
            raise ValueError(f"spec_info must be a Sample.SpecInfo, not {type(self.spec_info).__name__}")
        self.spec_info.check()
        if self.generate_function_path is not None and not isinstance(self.generate_function_path, str):
            raise ValueError(f"generate_function_path must be a module:fn string, not {self.generate_function_path!r}")
        for name in ("multimodal_inputs", "multimodal_train_inputs", "train_metadata"):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), dict):
                raise ValueError(f"{name} must be a dict or None, not {type(getattr(self, name)).__name__}")
        r = self.rollout_routed_experts
        if r is not None and not (getattr(r, "dtype", None) == "int32" and getattr(r, "ndim", 0) in (2, 3)):
            what = (
                f"dtype {getattr(r, 'dtype', None)}, shape {getattr(r, 'shape', None)}"
                if hasattr(r, "shape")
                else type(r).__name__
            )
            raise ValueError(
                "rollout_routed_experts must be an int32 numpy array [tokens, layers * top_k] or slime's "
                f"[tokens, layers, top_k], or None; got {what}"
            )
        if not isinstance(self.remove_sample, bool):
            raise ValueError(f"remove_sample must be True or False, not {self.remove_sample!r}")
        t = self.non_generation_time
        if isinstance(t, bool) or not isinstance(t, numbers.Real) or not 0 <= t < float("inf"):
            raise ValueError(f"non_generation_time must be a finite number of seconds >= 0, not {t!r}")
        rewards = self.metadata.get("turn_rewards") or []
        if not isinstance(rewards, list | tuple) or any(
            isinstance(r, bool) or not isinstance(r, numbers.Real) for r in rewards
        ):
            raise ValueError(f"turn_rewards must be a list of numbers, not {rewards!r}")

    def to_dict(self) -> dict[str, Any]:
        """A shallow dict of the fields (``status`` as its string value), ready for ``json.dumps``; without
        ``multimodal_train_inputs`` (see there).

        Shallow on purpose: ``metadata`` may hold whatever an env put in its ``info`` (locks, arrays);
        a deep copy could fail on those, so serializers pass ``default=str`` instead.
        """
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        d["status"] = self.status.value
        d["spec_info"] = self.spec_info.to_dict()
        if self.rollout_routed_experts is not None:
            d["rollout_routed_experts"] = encode_int32_array(self.rollout_routed_experts)
        if self.multimodal_train_inputs:  # the processor's function of the images, often 100x their size
            d["multimodal_train_inputs"] = None
        return d

    def to_json(self) -> str:
        """One JSON line; values JSON cannot hold are written as their ``str()``."""
        return json.dumps(self.to_dict(), ensure_ascii=False, default=str)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Sample:
        """Inverse of :meth:`to_dict`; unknown keys are kept in ``metadata["extra"]``."""
        names = {f.name for f in dataclasses.fields(cls)}
        known = {k: v for k, v in d.items() if k in names}
        extra = {k: v for k, v in d.items() if k not in names}
        known["metadata"] = dict(known.get("metadata") or {})  # the caller's row is not changed under it
        if not isinstance(known.get("spec_info", {}), Sample.SpecInfo):
            known["spec_info"] = Sample.SpecInfo.from_dict(known.get("spec_info"))
        if isinstance(known.get("rollout_routed_experts"), dict):
            known["rollout_routed_experts"] = decode_int32_array(known["rollout_routed_experts"])
        s = cls(**known)
        s.status = Status(s.status)
        if extra:
            s.metadata.setdefault("extra", {}).update(extra)
        return s


def encode_int32_array(array: Any) -> dict[str, Any]:
    """An int32 numpy array as JSON: ``{"dtype": "int32", "shape": [...], "base64": ...}`` (SGLang's wire bytes)."""
    import base64

    import numpy as np

    a = np.ascontiguousarray(array, dtype=np.int32)
    return {"dtype": "int32", "shape": list(a.shape), "base64": base64.b64encode(a.tobytes()).decode("ascii")}


def decode_int32_array(d: dict[str, Any]) -> Any:
    """Inverse of :func:`encode_int32_array`; a row that does not match its shape is refused."""
    import base64
    import binascii

    import numpy as np

    try:
        if d.get("dtype") != "int32":
            raise ValueError(f"dtype {d.get('dtype')!r} (only int32)")
        shape = d["shape"]
        if not isinstance(shape, list) or not all(
            isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in shape
        ):
            raise ValueError(f"shape {shape!r} is not a list of sizes >= 0")
        raw = base64.b64decode(str(d["base64"]).encode("ascii"), validate=True)
        return np.frombuffer(raw, dtype=np.int32).reshape(shape).copy()
    except (KeyError, TypeError, ValueError, binascii.Error) as exc:
        raise ValueError(f"rollout_routed_experts is not an encoded int32 array: {exc}") from None


def episode_units(samples: Iterable[Sample]) -> list[list[Sample]]:
    """``samples`` by :attr:`Sample.episode_key`, in order of first appearance: the segments of one seat of
    one episode together (a sample that is a whole episode alone is a unit of its own). The one grouping the
    train loop, advantages, metrics, eval and demonstrations use."""
    units: dict[Hashable, list[Sample]] = {}
    for s in samples:
        units.setdefault(s.episode_key, []).append(s)
    return list(units.values())
