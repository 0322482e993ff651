"""Tool-call parsers: the model's text -> (content, tool calls, parse errors), one per wire format.

Open models write tool calls as text in a format their chat template taught them: Hermes / Qwen
wrap a JSON object in ``<tool_call>...</tool_call>``; Llama 3.x answers with a bare JSON object
(optionally after ``<|python_tag|>``); API models return OpenAI ``tool_calls``. A parser turns one
assistant turn into what :class:`~agentrl.types.Action` carries.

Parsers never raise on model output, whatever it is. During RL a malformed call is ordinary
behaviour, not a bug: it becomes a :class:`~agentrl.types.ParseError` with a message the model reads
on its next turn (see :func:`format_tool_error`), so the policy can learn to write calls correctly.

Ids: the model rarely writes call ids, so the parser numbers the calls ``call_0, call_1, ...`` in
order over calls *and* errors (an error is answered with a tool message too, so it needs an id).
An ``"id"`` the model did write is kept unless it is already taken; ids are unique per turn.
"""

from __future__ import annotations

import abc
import json
import re
from collections.abc import Sequence
from typing import Any

from agentrl.types import ParseError, ToolCall

__all__ = [
    "unique_call_ids",
    "PARSERS",
    "HermesParser",
    "Llama3JsonParser",
    "OpenAIToolCallsParser",
    "ToolCallParser",
    "format_tool_error",
    "get_parser",
    "last_tag",
]

ParseResult = tuple[str, list[ToolCall], list[ParseError]]

_DECODER = json.JSONDecoder()
_JSON_FAILURES = (ValueError, RecursionError)  # JSONDecodeError, int-digit limits, absurd nesting


class ToolCallParser(abc.ABC):
    """Turns an assistant turn's text into ``(content, tool_calls, errors)``.

    ``content`` is the text with the tool-call markup removed and stripped. Implementations must
    never raise on any input string.
    """

    name: str

    @abc.abstractmethod
    def parse(self, text: str) -> ParseResult:
        """Split ``text`` into content, well-formed calls and malformed ones."""

    def call_prefix(self, name: str | None = None) -> str | None:
        """The text a call in this format begins with (of tool ``name``, or of any tool), so that a
        server can make the model call one (OpenAI ``tool_choice: "required"`` or a named function)
        by starting its answer with it; None where the format has no text form."""
        return None

    def call_marker(self) -> str | None:
        """Text whose appearance means a call may be starting (a streaming server holds content back
        from there); None: no marker, anything may be a call."""
        return None


def format_tool_error(err: ParseError) -> str:
    """The message the model sees for a call it got wrong (sent as the tool result for ``err.id``)."""
    return f"Error: could not parse tool call: {err.message}"


# ---------------------------------------------------------------------------------------------
# shared pieces: a decoded JSON object -> ToolCall | ParseError; id assignment


def _describe(value: Any) -> str:
    if value is None:
        return "null"
    for kind, word in ((bool, "boolean"), (str, "string"), (dict, "object"), (list, "array"), ((int, float), "number")):
        if isinstance(value, kind):
            return word
    return type(value).__name__


def _json_error(e: Exception, where: str = "") -> str:
    """``invalid JSON<where>: <reason> at line L column C (char P)``."""
    if isinstance(e, json.JSONDecodeError):
        return f"invalid JSON{where}: {e.msg} at line {e.lineno} column {e.colno} (char {e.pos})"
    if isinstance(e, RecursionError):
        return f"invalid JSON{where}: nested too deeply"
    return f"invalid JSON{where}: {e}"


def _call_from_obj(obj: Any, raw: str) -> ToolCall | ParseError:
    """``{"name": str, "arguments"|"parameters": object | JSON string, "id"?: str}`` -> ToolCall.

    The id is left as the model wrote it (or empty); :func:`_assign_ids` settles it afterwards.
    """
    if not isinstance(obj, dict):
        return ParseError(f'a tool call must be a JSON object with "name" and "arguments", got {_describe(obj)}', raw)
    model_id = obj.get("id") if isinstance(obj.get("id"), str) else ""
    name = obj.get("name")
    if name is None:
        return ParseError('tool call is missing "name"', raw, model_id)
    if not isinstance(name, str) or not name.strip():
        return ParseError(f'"name" must be a non-empty string, got {_describe(name)}', raw, model_id)
    key = "arguments" if "arguments" in obj else "parameters"
    args = obj.get(key)
    if isinstance(args, str):
        if not args.strip():
            args = {}
        else:
            try:
                args = json.loads(args)
            except _JSON_FAILURES as e:
                message = f'"{key}" of {name!r} is a string but not valid JSON ({_json_error(e)})'
                return ParseError(message, raw, model_id)
    if args is None:
        args = {}
    if not isinstance(args, dict):
        return ParseError(f'"{key}" of {name!r} must be a JSON object, got {_describe(args)}', raw, model_id)
    return ToolCall(name=name.strip(), arguments=args, id=model_id)


def _assign_ids(items: list[ToolCall | ParseError]) -> tuple[list[ToolCall], list[ParseError]]:
    """Give every item a unique id (``call_{n}`` by position unless the model wrote a free one)."""
    used: set[str] = set()
    calls: list[ToolCall] = []
    errors: list[ParseError] = []
    for n, item in enumerate(items):
        candidate = item.id if item.id and item.id not in used else f"call_{n}"
        k = 1
        while candidate in used:
            candidate, k = f"call_{n}_{k}", k + 1
        item.id = candidate
        used.add(candidate)
        (calls if isinstance(item, ToolCall) else errors).append(item)
    return calls, errors


def _find(text: str, tag: str, start: int, found: dict[str, int]) -> int:
    """``text.find(tag, start)`` for non-decreasing ``start``s, remembering the last answer."""
    pos = found.get(tag)
    if pos is None or (0 <= pos < start):
        pos = found[tag] = text.find(tag, start)
    return pos


def _skip_ws(text: str, i: int) -> int:
    while i < len(text) and text[i].isspace():
        i += 1
    return i


# ---------------------------------------------------------------------------------------------
# Hermes / Qwen: <tool_call>{...}</tool_call>


class HermesParser(ToolCallParser):
    """``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, any number of them (Hermes, Qwen 2.5/3).

    ``arguments`` may be an object or a JSON string holding one; ``parameters`` is accepted as an
    alias. A ``<tool_call>`` never closed (the turn hit its length limit, or the model forgot) is
    still parsed if a complete JSON object follows it, else it is an error. A stray
    ``</tool_call>`` is plain text. Text outside the tags is the content.
    """

    name = "hermes"
    open_tag = "<tool_call>"
    close_tag = "</tool_call>"

    def call_prefix(self, name: str | None = None) -> str:
        # the built-in tool template's own layout: <tool_call>\n{"name": "...", "arguments": ...}
        head = self.open_tag + '\n{"name": "'
        return head if name is None else head + json.dumps(name)[1:-1] + '", "arguments": '

    def call_marker(self) -> str:
        return self.open_tag

    def parse(self, text: str) -> ParseResult:
        if not isinstance(text, str):
            return "", [], [ParseError(f"expected text, got {type(text).__name__}", id="call_0")]
        content: list[str] = []
        items: list[ToolCall | ParseError] = []
        pos = 0
        found: dict[str, int] = {}  # tag -> next position; keeps many unclosed tags linear
        while True:
            start = _find(text, self.open_tag, pos, found)
            if start < 0:
                content.append(text[pos:])
                break
            content.append(text[pos:start])
            item, pos = self._parse_tag(text, start, found)
            items.append(item)
        calls, errors = _assign_ids(items)
        return "".join(content).strip(), calls, errors

    def _parse_tag(self, text: str, start: int, found: dict[str, int]) -> tuple[ToolCall | ParseError, int]:
        """Parse the call opened at ``start``; return it and the position after its markup."""
        body_start = start + len(self.open_tag)
        i = _skip_ws(text, body_start)
        try:  # decode in place first, so a "</tool_call>" inside a JSON string does not cut the call short
            obj, j = _DECODER.raw_decode(text, i) if text.startswith("{", i) else (None, -1)
        except _JSON_FAILURES:
            j = -1
        if j >= 0:
            k = _skip_ws(text, j)
            if text.startswith(self.close_tag, k):
                end = k + len(self.close_tag)
                return _call_from_obj(obj, text[start:end]), end
            if k == len(text):  # unclosed but complete
                return _call_from_obj(obj, text[start:]), len(text)
        # malformed: the body runs to the closing tag, the next opening tag, or the end of the text
        close = _find(text, self.close_tag, body_start, found)
        reopen = _find(text, self.open_tag, body_start, found)
        closed = close >= 0 and (reopen < 0 or close < reopen)
        stop = close if closed else (reopen if reopen >= 0 else len(text))
        body = text[body_start:stop]
        end = stop + len(self.close_tag) if closed else stop
        raw = text[start:end]
        if not body.strip():
            return ParseError(f"empty {self.open_tag}", raw), end
        try:
            obj = json.loads(body)
        except _JSON_FAILURES as e:
            where = f" in {self.open_tag}" if closed else f" after an unclosed {self.open_tag}"
            return ParseError(_json_error(e, where), raw), end
        # a complete object cut short by the next <tool_call>: unclosed, but parse it anyway
        return _call_from_obj(obj, raw), end


# ---------------------------------------------------------------------------------------------
# Llama 3.x JSON: the whole turn is {"name": ..., "parameters": {...}} (";"-separated for several)


class Llama3JsonParser(ToolCallParser):
    """Llama 3.x JSON tool calls: the turn (after an optional ``<|python_tag|>``) is the call.

    ``{"name": ..., "parameters": {...}}``; several calls are separated by ``;``. A turn that is not
    JSON-looking is plain content. A JSON answer without any ``"name"`` is content too (the model
    answered in JSON). A turn that starts with ``{`` and mentions ``"name"`` but does not parse is
    an error.
    """

    name = "llama3_json"
    python_tag = "<|python_tag|>"

    def call_prefix(self, name: str | None = None) -> str:
        return '{"name": "' if name is None else '{"name": "' + json.dumps(name)[1:-1] + '", "parameters": '

    def call_marker(self) -> str:
        return "{"

    def parse(self, text: str) -> ParseResult:
        if not isinstance(text, str):
            return "", [], [ParseError(f"expected text, got {type(text).__name__}", id="call_0")]
        prefix, tag, body = text.partition(self.python_tag)
        if not tag:
            prefix, body = "", text
        body = body.strip()
        if not body.startswith("{"):
            return text.strip(), [], []
        objs, failure = self._decode_all(body)
        if failure is not None:
            if '"name"' not in body:
                return text.strip(), [], []
            _, errors = _assign_ids([ParseError(failure, body)])
            return prefix.strip(), [], errors
        if not any(isinstance(o, dict) and "name" in o for o, _ in objs):
            return text.strip(), [], []
        calls, errors = _assign_ids([_call_from_obj(o, raw) for o, raw in objs])
        return prefix.strip(), calls, errors

    @staticmethod
    def _decode_all(body: str) -> tuple[list[tuple[Any, str]], str | None]:
        """Decode ``obj ; obj ; ...``; return [(obj, raw)] and an error message (None when clean)."""
        objs: list[tuple[Any, str]] = []
        i = 0
        while True:
            i = _skip_ws(body, i)
            if i == len(body):
                return objs, None
            try:
                obj, j = _DECODER.raw_decode(body, i)
            except _JSON_FAILURES as e:
                return objs, _json_error(e)
            objs.append((obj, body[i:j]))
            i = _skip_ws(body, j)
            if i == len(body):
                return objs, None
            if body[i] != ";":
                return objs, f"unexpected text after a JSON tool call at char {i} (separate calls with ';')"
            i += 1


# ---------------------------------------------------------------------------------------------
# OpenAI chat completions: message["tool_calls"]


class OpenAIToolCallsParser(ToolCallParser):
    """OpenAI chat-completions assistant messages: calls are structured, arguments a JSON string.

    Use :meth:`parse_message` on the message dict; :meth:`parse` (text only) finds no calls, since
    this format never puts calls in the text. Bad ``arguments`` JSON is a parse error under the
    call's own id.
    """

    name = "openai"

    def parse(self, text: str) -> ParseResult:
        return (text.strip() if isinstance(text, str) else ""), [], []

    def parse_message(self, message: dict[str, Any]) -> ParseResult:
        if not isinstance(message, dict):
            return "", [], [ParseError(f"expected a message object, got {_describe(message)}", id="call_0")]
        content = _message_text(message.get("content"))
        raw_calls = message.get("tool_calls") or []
        if not isinstance(raw_calls, list):
            raw_calls = [raw_calls]
        if not raw_calls and isinstance(message.get("function_call"), dict):  # legacy single call
            raw_calls = [{"function": message["function_call"]}]
        items = [self._one(entry) for entry in raw_calls]
        calls, errors = _assign_ids(items)
        return content, calls, errors

    @staticmethod
    def _one(entry: Any) -> ToolCall | ParseError:
        raw = _dumps(entry)
        if not isinstance(entry, dict):
            return ParseError(f"a tool call must be an object, got {_describe(entry)}", raw)
        call_id = entry.get("id") if isinstance(entry.get("id"), str) else ""
        fn = entry.get("function")
        if not isinstance(fn, dict):
            return ParseError(f'tool call is missing "function", got {_describe(fn)}', raw, call_id)
        item = _call_from_obj({"name": fn.get("name"), "arguments": fn.get("arguments")}, raw)
        item.id = call_id
        return item


def _message_text(content: Any) -> str:
    """``content`` as text: a string, None, or a list of ``{"type": "text", "text": ...}`` parts."""
    if isinstance(content, str):
        return content.strip()
    if isinstance(content, list):
        parts = [p.get("text") for p in content if isinstance(p, dict)]
        return "".join(p for p in parts if isinstance(p, str)).strip()
    return ""


def _dumps(value: Any) -> str:
    try:
        return json.dumps(value, ensure_ascii=False, default=str)
    except (ValueError, TypeError, RecursionError):
        return repr(value)[:1000]


# ---------------------------------------------------------------------------------------------
# registry


PARSERS: dict[str, type[ToolCallParser]] = {
    "hermes": HermesParser,
    "qwen": HermesParser,
    "llama3_json": Llama3JsonParser,
    "openai": OpenAIToolCallsParser,
}
"""Parser classes by name; add your own subclass here to make ``get_parser`` (and configs) find it."""


def last_tag(text: str, tag: str) -> str | None:
    """The stripped content of the last ``<tag>...</tag>`` in ``text`` (case-insensitive), or None.

    Envs read final answers this way (``<answer>``, ``<guess>``): the *last* tag counts, so a model
    that drafts and then corrects itself is scored on its correction.
    """
    found = re.findall(rf"<{re.escape(tag)}>(.*?)</{re.escape(tag)}>", text, re.IGNORECASE | re.DOTALL)
    return found[-1].strip() if found else None


def get_parser(name: str) -> ToolCallParser:
    """A parser instance by name (``"hermes"``, ``"qwen"``, ``"llama3_json"``, ``"openai"``)."""
    key = name.strip().lower().replace("-", "_") if isinstance(name, str) else name
    if key not in PARSERS:
        known = ", ".join(sorted(PARSERS))
        raise ValueError(f"unknown tool-call parser {name!r}; known parsers: {known}")
    return PARSERS[key]()


_PARSER_ID = re.compile(r"call_\d+")


def unique_call_ids(items: Sequence[Any], turn: int, seen: set[str]) -> dict[str, str]:
    """Make the turn's call ids unique in the episode, in place, record them in ``seen``, and return
    the renaming (old id -> new id).

    The parser numbers a turn's calls ``call_0, call_1, ...``; those become ``call_{turn}_{n}``.
    An id the model wrote is kept unless already taken. Any id that would repeat one seen earlier
    in the episode (a model-written ``call_0_1`` beside the parser's ``call_1`` of turn 0) gets a
    ``_k`` suffix, so a tool result can never answer the wrong call.
    """
    renamed: dict[str, str] = {}
    for item in items:
        base = f"call_{turn}_{item.id[5:]}" if _PARSER_ID.fullmatch(item.id) else item.id
        candidate, k = base, 1
        while candidate in seen:
            candidate, k = f"{base}_{k}", k + 1
        renamed[item.id], item.id = candidate, candidate
        seen.add(candidate)
    return renamed
