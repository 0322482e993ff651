"""What the agent gets back (an OpenAI ``ChatCompletion``), and how its next request is read against it.

The reply's ``content`` is the turn's text without the tool-call markup, stripped by the same format
the episode loop parsed the calls with (:func:`reply_content`). The agent sends the reply back in
its next request, re-serialised by its own client: :func:`same_history` compares that echo by
meaning (tool-call arguments as parsed JSON, absent/``None``/``""`` content alike), so an agent that
writes JSON compactly (``JSON.stringify``, ``separators=(",", ":")``) still extends its episode
instead of starting a new segment every turn.
"""

from __future__ import annotations

import json
import secrets
import time
from typing import Any

from agentrl.parsing import PARSERS, get_parser
from agentrl.proxy.requests import ChatRequest
from agentrl.types import Action, Message

__all__ = ["completion", "reply_content", "same_history"]


def completion(
    request: ChatRequest, action: Action, message: Message, prompt_tokens: int | None = None
) -> dict[str, Any]:
    """The OpenAI ``ChatCompletion`` answering ``request`` with the assistant ``message``.

    ``usage`` counts the turn's sampled tokens (``completion_tokens``) and the request's rendered prompt
    (``prompt_tokens``); it is left out (``None``, as OpenAI's schema allows) when the prompt could not
    be counted, rather than reported wrong.
    """
    calls = message.get("tool_calls") or []
    finish = "length" if action.finish_reason == "length" else "tool_calls" if calls else "stop"
    out: dict[str, Any] = {
        "role": "assistant",
        "content": message["content"] if not calls else message["content"] or None,
        "refusal": None,
    }
    if calls:
        out["tool_calls"] = calls
    usage = None
    if prompt_tokens is not None:
        n = len(action.token_ids)
        usage = {"prompt_tokens": prompt_tokens, "completion_tokens": n, "total_tokens": prompt_tokens + n}
    return {
        "id": f"chatcmpl-{secrets.token_hex(12)}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": request.model or "agentrl-policy",
        "system_fingerprint": None,
        "choices": [{"index": 0, "message": out, "finish_reason": finish, "logprobs": None}],
        "usage": usage,
    }


def reply_content(action: Action, parser: str) -> str:
    """The turn's text as the reply's ``content``: without the markup of its tool calls.

    The episode loop parsed the calls with the run's ``--tool-parser`` or else the env's; the action does
    not say which, so the format is the one whose parse of the text gives exactly the action's calls
    (``parser`` tried first). A turn without calls, with a call the parser could not read (the agent
    gets the whole text to see what went wrong), or whose calls no format reproduces (a chat-completions
    engine returned them apart from the text) keeps its text as it is.
    """
    if not action.tool_calls or action.errors:
        return action.text
    wanted = [(c.name, c.arguments) for c in action.tool_calls]
    for name in dict.fromkeys((parser, *PARSERS)):
        content, calls, errors = get_parser(name).parse(action.text)
        if not errors and [(c.name, c.arguments) for c in calls] == wanted:
            return content
    return action.text


def same_history(echoed: list[Message], ours: list[Message]) -> bool:
    """Whether the agent's messages are ours, as its client re-serialised them."""
    return len(echoed) == len(ours) and all(_canonical(a) == _canonical(b) for a, b in zip(echoed, ours))


def _canonical(message: Message) -> dict[str, Any]:
    m: dict[str, Any] = {k: v for k, v in message.items() if v is not None}
    m["content"] = m.get("content") or ""
    calls = m.pop("tool_calls", None) or []
    if calls:
        m["tool_calls"] = [_call(c) for c in calls]
    return m


def _call(call: dict[str, Any]) -> tuple[Any, ...]:
    fn = call.get("function") or {}
    args = fn.get("arguments")
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            pass  # not JSON: compared as written
    return call.get("id"), call.get("type") or "function", fn.get("name"), args
