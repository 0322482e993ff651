"""History rewrites an env returns from :meth:`agentrl.Env.rewrite_history`: compaction helpers.

Each takes the conversation (OpenAI-style messages) and returns a new list, never changing the
messages it was given (the episode's earlier segments keep theirs). The episode loop turns a
rewrite into a new segment of the episode when it changes what the model already saw.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from agentrl.types import Message

__all__ = ["THINK_BLOCK", "drop_tool_outputs", "strip_thinking"]

THINK_BLOCK = re.compile(r"<think>.*?</think>\s*", re.DOTALL)
"""A reasoning block as Qwen3-style models write it."""


def strip_thinking(messages: Sequence[Message]) -> list[Message]:
    """Remove ``<think>...</think>`` blocks from the assistant turns before the last user message.

    Why: Qwen3-style chat templates render earlier turns without their reasoning, so a conversation
    re-rendered by the template differs from the tokens the model produced; an env that strips
    them itself keeps the context small and makes that difference explicit (a new segment).
    """
    last_user = max((i for i, m in enumerate(messages) if m.get("role") == "user"), default=-1)
    out: list[Message] = []
    for i, m in enumerate(messages):
        if i < last_user and m.get("role") == "assistant" and "<think>" in str(m.get("content") or ""):
            m = {**m, "content": THINK_BLOCK.sub("", str(m["content"]))}
        out.append(dict(m))  # type: ignore[arg-type]
    return out


def drop_tool_outputs(
    messages: Sequence[Message], *, keep_last: int = 1, placeholder: str = "[tool output removed to save context]"
) -> list[Message]:
    """Replace the content of every ``tool`` message but the last ``keep_last`` with ``placeholder``.

    The calls and their ids stay (the model still sees what it asked for and that it was answered);
    only the bulky outputs go. Messages already holding the placeholder are left as they are, so
    applying this every turn changes only the output that just fell out of the window.
    """
    if keep_last < 0:
        raise ValueError(f"keep_last must be >= 0, got {keep_last}")
    tool_at = [i for i, m in enumerate(messages) if m.get("role") == "tool"]
    drop = set(tool_at[: max(len(tool_at) - keep_last, 0)])
    return [
        {**m, "content": placeholder} if i in drop else dict(m)  # type: ignore[misc]
        for i, m in enumerate(messages)
    ]
