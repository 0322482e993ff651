"""Chat templates and the token ledger: how messages become the exact ids the policy sees.

The exactness contract lives here. The prompt is rendered once with the chat template and tokenized
once. After that the ledger only ever *appends*: the engine's sampled ids verbatim (loss mask 1,
with their log-probs), then each observation as a *delta* of template text tokenized on its own
(mask 0). Nothing already in the ledger is re-rendered or re-tokenized, so the ids the trainer
scores are the ids the engine was conditioned on, turn after turn.

How an observation delta is found without re-rendering the conversation: render a fixed two-message
stand-in history (user, assistant) with and without the new messages appended; the difference is
what the template writes for those messages plus the next generation prompt. What the template
writes *after* an assistant message's content (e.g. ``<|im_end|>\\n`` in ChatML) is split in two:
the part the model already sampled (its stop token) and the rest (the "bridge", e.g. ``\\n``),
which becomes the start of the delta.

Why a built-in tool template: many small models (SmolLM2 among them) ship a plain ChatML template
that silently ignores ``tools``. When tools are offered and the model's template never mentions
them, the SDK renders with a Hermes/Qwen2.5-style ChatML template that lists the tools in the
system prompt and wraps results in ``<tool_response>``; the matching parser is ``hermes``.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from agentrl.images import Image, count_images, flat_text, template_messages
from agentrl.types import Message
from agentrl.vlm import Expanded

BUILTIN_TOOL_TEMPLATE = """\
{%- if tools %}
{{- '<|im_start|>system\\n' }}
{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] }}{%- else %}{{- 'You are a helpful assistant.' }}{%- endif %}
{{- '\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}
{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}
{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\\n</tool_call><|im_end|>\\n' }}
{%- elif messages[0]['role'] == 'system' %}
{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
{%- if message['role'] == 'system' and loop.first %}
{%- elif message['role'] == 'user' or message['role'] == 'system' %}
{{- '<|im_start|>' + message['role'] + '\\n' + (message['content'] or '') + '<|im_end|>\\n' }}
{%- elif message['role'] == 'assistant' %}
{{- '<|im_start|>assistant\\n' + (message['content'] or '') }}
{%- for tc in message.get('tool_calls') or [] %}
{%- set f = tc['function'] if tc.get('function') else tc %}
{{- '\\n<tool_call>\\n{\"name\": \"' + f['name'] + '\", \"arguments\": ' + (f['arguments'] if f['arguments'] is string else (f['arguments'] | tojson)) + '}\\n</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>\\n' }}
{%- elif message['role'] == 'tool' %}
{%- if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}
{{- '\\n<tool_response>\\n' + (message['content'] or '') + '\\n</tool_response>' }}
{%- if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}
"""

_SENTINEL = "\u2063AGENTRL_ASSISTANT_SENTINEL\u2063"
_TAIL_CACHE_CHARS = 32 << 20
"""Characters :meth:`ChatTemplate.delta_context` keeps cached (keys and renderings counted twice)."""
_PLAIN_KEYS = frozenset({"role", "content", "name", "tool_call_id", "tool_calls"})
_GIL_FREE_CHARS = 32_768
"""Text length above which :meth:`ChatTemplate.encode` tokenizes without holding the GIL."""

try:  # transformers' own (cached) compiler: same jinja2 environment, filters and globals
    from transformers.utils.chat_template_utils import _compile_jinja_template
except ImportError:  # pragma: no cover - other transformers versions: always use apply_chat_template
    _compile_jinja_template = None


def _plain(message: Message) -> bool:
    """Whether transformers' message preprocessing would leave ``message`` as it is (minus None values)."""
    return (
        isinstance(message.get("content"), str)
        and message.keys() <= _PLAIN_KEYS
        and all(type(v) in (str, list, dict, type(None)) for v in message.values())
    )


class TemplateError(ValueError):
    """The chat template cannot render observations as an append-only delta."""


def _template_source(tokenizer: Any, override: str | None) -> str | None:
    if override is not None:
        return override
    tpl = getattr(tokenizer, "chat_template", None)
    if isinstance(tpl, dict):
        tpl = tpl.get("tool_use") or tpl.get("default") or next(iter(tpl.values()), None)
    return tpl


class ChatTemplate:
    """Renders messages with a tokenizer's jinja2 chat template (or a given one) into token ids.

    ``tool_template``: ``"auto"`` uses the model's template when it mentions ``tools`` and the
    built-in Hermes-style template otherwise (only when tools are offered); ``"native"`` always uses
    the model's; ``"builtin"`` always the built-in one.
    """

    def __init__(self, tokenizer: Any, *, template: str | None = None, tool_template: str = "auto", vision: Any = None):
        """``vision``: the checkpoint's :class:`~agentrl.vlm.VisionFamily` (its processor expands image
        markers into placeholder tokens); None for a text-only model, which refuses image parts."""
        if tool_template not in ("auto", "native", "builtin"):
            raise ValueError(f"tool_template must be auto, native or builtin, not {tool_template!r}")
        self.tokenizer = tokenizer
        if template is None and vision is not None and getattr(vision.processor, "chat_template", None):
            # the processor's (multimodal) template wins over the tokenizer's, as transformers' processors
            # render: VLM repos keep it in chat_template.json, which AutoTokenizer does not read
            template = vision.processor.chat_template
        self.native = _template_source(tokenizer, template)
        self.tool_template = tool_template
        self.vision = vision
        if self.native is None and tool_template == "native":
            raise TemplateError("the tokenizer has no chat template; pass --chat-template FILE")
        self.native_supports_tools = bool(self.native) and "tools" in self.native
        self.eos_token_ids = self._end_token_ids()
        # The Rust tokenizer behind a fast tokenizer: same ids, without transformers' per-call overhead.
        self._backend = getattr(tokenizer, "backend_tokenizer", None) if getattr(tokenizer, "is_fast", False) else None
        self._special_tokens = dict(getattr(tokenizer, "special_tokens_map", {}) or {})
        self._tail_cache: dict[str, tuple[list[Message], str, str]] = {}
        self._tail_cache_chars = 0

    # -- rendering ---------------------------------------------------------------------------
    def template_for(self, tools: Sequence[dict] | None) -> str:
        """The jinja2 source used for a conversation offering ``tools``."""
        if self.tool_template == "builtin" or self.native is None:
            return BUILTIN_TOOL_TEMPLATE
        if tools and self.tool_template == "auto" and not self.native_supports_tools:
            return BUILTIN_TOOL_TEMPLATE
        return self.native

    def prepared(self, messages: Sequence[Any], tools: Sequence[dict] | None) -> tuple[str, list[Any]]:
        """The template source for ``tools`` and ``messages`` as it reads them: content parts in transformers'
        form (an image part as ``{"type": "image"}``); for the built-in tool template, which writes contents
        as strings, each content as one string with images as the model's marker."""
        source = self.template_for(tools)
        if self.vision is not None and source is not BUILTIN_TOOL_TEMPLATE:
            # a VLM's own template may read only part lists (SmolVLM's chat_template.json): every string
            # content becomes one text part, as transformers' processors do
            wrapped = [
                {**m, "content": [{"type": "text", "text": m["content"]}]} if isinstance(m.get("content"), str) else m
                for m in messages
            ]
            return source, template_messages(wrapped, join_text=False)
        if not any(isinstance(m.get("content"), list) for m in messages):
            return source, list(messages)
        out = template_messages(messages)
        if source is BUILTIN_TOOL_TEMPLATE:
            marker = self.vision.marker if self.vision is not None else "<image>"
            out = [{**m, "content": flat_text(m.get("content"), marker)} for m in out]
        return source, out

    def render(
        self, messages: Sequence[Message], tools: Sequence[dict] | None = None, *, add_generation_prompt: bool
    ) -> str:
        """Render ``messages`` (and ``tools``, OpenAI schema dicts) to template text.

        Plain messages (string content, the usual OpenAI keys) are rendered by the compiled template
        directly, with the same jinja2 environment and variables transformers uses: the episode loop
        renders every observation, and ``apply_chat_template``'s generic preprocessing cost more
        than the rendering itself. Anything else goes through ``apply_chat_template``.
        """
        source, messages = self.prepared(messages, tools)
        if _compile_jinja_template is not None and all(_plain(m) for m in messages):
            return _compile_jinja_template(source).render(
                messages=[{k: v for k, v in m.items() if v is not None} for m in messages],
                tools=list(tools) if tools else None,
                documents=None,
                add_generation_prompt=add_generation_prompt,
                **self._special_tokens,
            )
        kwargs: dict[str, Any] = {}
        if tools:
            kwargs["tools"] = list(tools)
        return self.tokenizer.apply_chat_template(
            list(messages),
            chat_template=source,
            add_generation_prompt=add_generation_prompt,
            tokenize=False,
            **kwargs,
        )

    def encode(self, text: str) -> list[int]:
        """Tokenize template text as is (the template already wrote every special token).

        A long text goes through the Rust tokenizer's ``encode_batch``, which releases the GIL while it
        works (its ``encode`` holds it, so a many-MiB text tokenized in a worker thread would still stall
        the event loop for seconds); both give the same ids."""
        if self._backend is not None:
            if len(text) > _GIL_FREE_CHARS:
                return self._backend.encode_batch([text], add_special_tokens=False)[0].ids
            return self._backend.encode(text, add_special_tokens=False).ids
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def min_tokens(self, text: str) -> int:
        """A lower bound on ``len(self.encode(text))`` without tokenizing (a token covers at most
        :attr:`max_token_bytes` UTF-8 bytes): lets the episode refuse a huge observation that cannot
        fit the context before spending seconds tokenizing it."""
        return -(-len(text.encode("utf-8", errors="surrogatepass")) // self.max_token_bytes)

    @functools.cached_property
    def max_token_bytes(self) -> int:
        """The most UTF-8 bytes one vocabulary entry can stand for (4 per character of its longest piece)."""
        vocab = self.tokenizer.get_vocab()
        return 4 * max((len(t) for t in vocab), default=1)

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = False) -> str:
        """Token ids back to text, byte-exact (no clean-up of spaces around punctuation)."""
        if self._backend is not None:
            return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)
        return self.tokenizer.decode(
            list(ids), skip_special_tokens=skip_special_tokens, clean_up_tokenization_spaces=False
        )

    def prompt(self, messages: Sequence[Message], tools: Sequence[dict] | None = None) -> tuple[str, list[int]]:
        """The first observation as prompt text and ids, ending with the generation prompt.

        Text only: a conversation with images goes through :meth:`prompt_images`.
        """
        if not messages:
            raise TemplateError("the first observation has no messages")
        if count_images(messages):
            raise TemplateError("the messages hold images: render them with prompt_images()")
        text = self.render(messages, tools, add_generation_prompt=True)
        return text, self.encode(text)

    def prompt_images(
        self, messages: Sequence[Message], images: Sequence[Image], tools: Sequence[dict] | None = None
    ) -> tuple[str, Any]:
        """The prompt of a conversation whose image parts are ``images`` (decoded, in order): its text and
        :class:`~agentrl.vlm.Expanded` (ids with every image's placeholder tokens, and the images' pixels)."""
        if not messages:
            raise TemplateError("the first observation has no messages")
        if images and self.vision is None:
            self.encode_images("", images)  # the text-only refusal, before a template meets part lists
        text = self.render(messages, tools, add_generation_prompt=True)
        return text, self.encode_images(text, images)

    def encode_images(self, text: str, images: Sequence[Image]) -> Any:
        """Template text holding image markers, tokenized with each marker expanded by the model's processor."""
        if self.vision is None:
            if not images:
                return Expanded(self.encode(text), [], [])
            raise TemplateError(
                f"the observation holds {len(images)} image(s) but the model is text-only (no image processor): "
                "serve a vision-language checkpoint (--hf-checkpoint) whose processor agentrl supports"
            )
        try:
            return self.vision.expand(text, images)
        except ValueError as exc:
            raise TemplateError(str(exc)) from None

    # -- deltas --------------------------------------------------------------------------------
    def _stand_in(self, messages: Sequence[Message]) -> list[Message]:
        head: list[Message] = []
        if messages and messages[0].get("role") == "system":
            head.append(messages[0])
        return head + [{"role": "user", "content": "x"}, {"role": "assistant", "content": _SENTINEL}]

    def delta_context(
        self, tools: Sequence[dict] | None, first_messages: Sequence[Message] = ()
    ) -> tuple[list[Message], str, str]:
        """The stand-in history, its rendering and the assistant tail for a conversation.

        The same for every turn of an episode (and cached across episodes with the same tools and
        system message): the episode loop computes it once and passes it to
        :meth:`observation_delta` as ``context``.
        """
        # the stand-in reads only a system message: a user message (a picture's data URL) must not key the cache
        head = [m for m in first_messages[:1] if m.get("role") == "system"]
        key = json.dumps([tools or [], head], sort_keys=True, default=str)
        cached = self._tail_cache.get(key)
        if cached is not None:
            return cached
        stand_in = self._stand_in(first_messages)
        r0 = self.render(stand_in, tools, add_generation_prompt=False)
        idx = r0.rfind(_SENTINEL)
        if idx < 0:
            raise TemplateError("the chat template drops assistant content; cannot build deltas")
        entry = (stand_in, r0, r0[idx + len(_SENTINEL) :])
        # bounded in entries and in characters (a served conversation's system message can be megabytes)
        size = 2 * len(key) + 2 * len(r0)
        if size <= _TAIL_CACHE_CHARS // 8:
            while self._tail_cache and (
                len(self._tail_cache) >= 256 or self._tail_cache_chars + size > _TAIL_CACHE_CHARS
            ):
                old_key = next(iter(self._tail_cache))
                _, old_r0, _ = self._tail_cache.pop(old_key)
                self._tail_cache_chars -= 2 * len(old_key) + 2 * len(old_r0)
            self._tail_cache[key] = entry
            self._tail_cache_chars += size
        return entry

    def observation_delta(
        self,
        messages: Sequence[Message],
        tools: Sequence[dict] | None = None,
        *,
        last_token_text: str | None,
        first_messages: Sequence[Message] = (),
        context: tuple[list[Message], str, str] | None = None,
    ) -> str:
        """Template text to append after an assistant turn so the conversation continues with ``messages``.

        ``last_token_text`` is the text of the stop token the model sampled (None when the turn
        ended on a stop string or the token is not an end-of-turn token): the part of the
        assistant tail the model already wrote is not written again.
        ``first_messages`` is the conversation's first observation (its system message shapes
        the template's header in some templates); ``context`` is :meth:`delta_context` for them,
        when the caller already has it.
        """
        stand_in, r0, tail = context or self.delta_context(tools, first_messages)
        r1 = self.render(stand_in + list(messages), tools, add_generation_prompt=True)
        if not r1.startswith(r0):
            raise TemplateError(
                "the chat template re-renders earlier turns when messages are appended; "
                "pass a template that renders history append-only (--chat-template FILE)"
            )
        bridge = tail
        if last_token_text and tail.startswith(last_token_text):
            bridge = tail[len(last_token_text) :]
        return bridge + r1[len(r0) :]

    # -- end-of-turn tokens ----------------------------------------------------------------------
    def _end_token_ids(self) -> list[int]:
        ids: list[int] = []
        tok = self.tokenizer
        if tok.eos_token_id is not None:
            ids.append(int(tok.eos_token_id))
        for t in ("<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>"):
            tid = tok.convert_tokens_to_ids(t) if t in tok.get_vocab() else None
            if tid is not None and tid not in ids:
                ids.append(int(tid))
        return ids


@dataclass
class TokenLedger:
    """The append-only record of one episode's tokens.

    ``prompt_ids`` come first; the response is a sequence of spans, each either sampled by the
    model (mask 1, real log-probs) or written by the environment/template (mask 0, log-prob 0.0).
    ``model_spans`` holds ``(start, end)`` in response coordinates for each assistant turn.
    """

    prompt_ids: list[int]
    response_ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    log_probs: list[float] = field(default_factory=list)
    model_spans: list[tuple[int, int]] = field(default_factory=list)
    env_spans: list[tuple[int, int]] = field(default_factory=list)

    @property
    def tokens(self) -> list[int]:
        return self.prompt_ids + self.response_ids

    def __len__(self) -> int:
        return len(self.prompt_ids) + len(self.response_ids)

    def append_model(self, ids: Sequence[int], log_probs: Sequence[float], *, continues_turn: bool = False) -> None:
        """Append ids the policy sampled, verbatim, with their log-probs (mask 1).

        ``continues_turn``: the ids continue the last assistant turn (a turn resumed after an engine
        abort, ``--partial-rollout``): its span grows instead of a new turn starting.
        """
        if len(ids) != len(log_probs):
            raise ValueError(f"{len(ids)} sampled ids but {len(log_probs)} log-probs")
        start = len(self.response_ids)
        if continues_turn and not (self.model_spans and self.model_spans[-1][1] == start):
            raise ValueError("continues_turn: the ledger does not end with an assistant turn")
        self.response_ids.extend(int(i) for i in ids)
        self.log_probs.extend(float(x) for x in log_probs)
        self.loss_mask.extend([1] * len(ids))
        if continues_turn:
            self.model_spans[-1] = (self.model_spans[-1][0], len(self.response_ids))
        else:
            self.model_spans.append((start, len(self.response_ids)))

    def append_env(self, ids: Sequence[int]) -> None:
        """Append ids the environment/template wrote (mask 0, log-prob 0.0)."""
        start = len(self.response_ids)
        self.response_ids.extend(int(i) for i in ids)
        self.log_probs.extend([0.0] * len(ids))
        self.loss_mask.extend([0] * len(ids))
        self.env_spans.append((start, len(self.response_ids)))
