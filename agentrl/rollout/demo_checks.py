"""What a conversational demonstration row must be, checked before anything is laid down or trained.

A row is the OpenAI / Hugging Face conversational shape (``{"messages": [...], "tools": [...]}``,
assistant ``tool_calls``, ``tool`` messages with ``tool_call_id``), read from any file
:func:`agentrl.data.read_rows` reads. It is checked here as plain data (no tokenizer): roles and
contents, the tools offered, each tool call's arguments against the schema it is rendered with,
and every ``tool`` message against the call it answers. A bad row is refused with its file and
line; :mod:`agentrl.rollout.demos` then lays the checked messages down token by token.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from agentrl.images import ImageError, check_content
from agentrl.tool import Tool, ToolError
from agentrl.types import ROLES, Message

__all__ = ["DemoError", "check_conversation", "check_row"]


class DemoError(ValueError):
    """A demonstration that cannot be trained on as it is; the message names its file and row."""


def _tool_names(schemas: Sequence[dict] | None) -> set[str]:
    names = set()
    for t in schemas or []:
        f = t.get("function", t) if isinstance(t, dict) else None
        if isinstance(f, dict) and isinstance(f.get("name"), str):
            names.add(f["name"])
    return names


def _check_tools(tools: Any, where: str) -> list[dict]:
    if tools is None or (isinstance(tools, str) and not tools.strip()):  # an empty CSV cell: no tools
        return []
    if isinstance(tools, str):  # datasets keep tool schemas as JSON text (Arrow cannot hold varied ones), as TRL does
        try:
            tools = json.loads(tools)
        except json.JSONDecodeError as exc:
            raise DemoError(f"{where}: 'tools' is a string but not valid JSON ({exc})") from None
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        raise DemoError(f"{where}: 'tools' must be a list of OpenAI tool schemas")
    for i, t in enumerate(tools):
        f = t.get("function", t)
        if not isinstance(f, dict) or not isinstance(f.get("name"), str) or not f["name"]:
            raise DemoError(
                f"{where}: tools[{i}] has no function name (expected {{'type': 'function', "
                "'function': {'name': ..., 'parameters': {...}}}})"
            )
    return tools


def _check_parameters(tools: list[dict], where: str) -> None:
    """Refuse a row's tool that declares a parameter with a null schema (only when the row's tools are rendered)."""
    for i, t in enumerate(tools):
        f = t.get("function", t)
        params = f.get("parameters")
        props = params.get("properties") if isinstance(params, dict) else None
        nulls = [k for k, v in props.items() if v is None] if isinstance(props, dict) else []
        if nulls:
            raise DemoError(
                f"{where}: tools[{i}] ({f['name']}) declares {', '.join(map(repr, nulls))} with no schema (null): "
                "a columnar file (Parquet, CSV, a datasets folder) keeps one type per column, so each tool gets "
                "every other tool's parameter names as null; store 'tools' as a JSON string (json.dumps(tools))"
            )


_COLUMNAR = (
    "a columnar file (Parquet, CSV, a datasets folder) keeps one type per column, so object arguments get "
    "every other row's argument names as null; store function.arguments as a JSON string, as OpenAI's "
    "format does (json.dumps(arguments) before writing the file)"
)


class _Schema(Tool):
    """A tool that is only its schema: :meth:`Tool.validate` checks a demonstration's arguments as a rollout would."""

    def __init__(self, name: str, parameters: dict[str, Any]):
        self.name, self.parameters = name, parameters

    async def __call__(self, **arguments: Any) -> str:
        raise NotImplementedError("a schema is not called")


def _argument_schemas(schemas: Sequence[dict] | None) -> dict[str, _Schema]:
    """Tool name -> its argument schema, for the tools whose spec gives ``parameters``."""
    out = {}
    for t in schemas or []:
        f = t.get("function", t) if isinstance(t, dict) else None
        if isinstance(f, dict) and isinstance(f.get("name"), str) and isinstance(f.get("parameters"), dict):
            out[f["name"]] = _Schema(f["name"], f["parameters"])
    return out


def _has_null(value: Any) -> bool:
    if isinstance(value, dict):
        return any(v is None or _has_null(v) for v in value.values())
    return isinstance(value, list) and any(_has_null(v) for v in value)


def _check_call(
    call: Any, offered: set[str] | None, where: str, schemas: dict[str, _Schema] | None = None
) -> str | None:
    """Validate one OpenAI ``tool_calls`` entry in place; return its id (None when it has none).

    JSON-string arguments (the OpenAI shape) are replaced by the parsed object: templates that
    write ``arguments | tojson`` would otherwise teach the model a doubly encoded string. With
    ``schemas``, the arguments must fit the called tool's schema as :meth:`Tool.validate` checks a
    rollout's (no unknown argument, no wrong type, every required one): a demonstration teaches the
    model to write exactly these arguments. They are checked, never rewritten (an ``int`` for a
    ``number`` stays as written).

    Null values are not dropped: a null the schema does not allow is refused, and the message says
    the likely cause (object arguments stored in a columnar file: Parquet, CSV or a datasets folder
    give every row the union of all rows' argument names, as null) and the fix (arguments as a JSON
    string). Dropping them instead would also drop a null the author really wrote, and could not
    tell an optional argument filled in by the file format from one the demonstration passed.
    """
    if not isinstance(call, dict):
        raise DemoError(f"{where}: expected a tool call object, got {type(call).__name__}")
    f = call.get("function", call)
    name = f.get("name") if isinstance(f, dict) else None
    if not isinstance(name, str) or not name:
        raise DemoError(f"{where}: a tool call needs function.name")
    args = f.get("arguments", {})
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except json.JSONDecodeError as exc:
            raise DemoError(f"{where}: arguments of {name!r} are not valid JSON ({exc})") from None
    if not isinstance(args, dict):
        raise DemoError(f"{where}: arguments of {name!r} must be a JSON object, got {type(args).__name__}")
    f["arguments"] = args
    if offered is not None and name not in offered:
        raise DemoError(f"{where}: calls tool {name!r}, which is not offered (offered: {sorted(offered) or 'none'})")
    if schemas and name in schemas:
        try:
            schemas[name].validate(args)
        except ToolError as exc:
            hint = f"; it has null values: {_COLUMNAR}" if _has_null(args) else ""
            raise DemoError(
                f"{where}: arguments {json.dumps(args)} do not fit the tool's schema: {exc}{hint}"
            ) from None
    cid = call.get("id")
    if cid is not None and not isinstance(cid, str):
        raise DemoError(f"{where}: tool call id must be a string")
    return cid


def check_conversation(
    row: dict[str, Any], where: str, offered: set[str] | None = None, *, schemas: Sequence[dict] | None = None
) -> list[Message]:
    """The row's messages, validated; :class:`DemoError` naming ``where`` and the message otherwise.

    Checks: a non-empty ``messages`` list (or its JSON text, as a CSV cell holds it) of dicts with a known role and string content (``None``
    allowed for an assistant message with tool calls); it starts with system or user; at least one
    assistant turn; every tool call names an offered tool with JSON-object arguments that fit that
    tool's schema in ``schemas`` (the OpenAI specs rendered with the row; see :func:`_check_call`
    for nulls); every ``tool``
    message answers a call of the assistant turn before it (by ``tool_call_id``, else in order).
    """
    msgs = row.get("messages")
    if isinstance(msgs, str):  # a CSV cell holds text only: the list as JSON text, as 'tools' may be
        try:
            msgs = json.loads(msgs)
        except json.JSONDecodeError as exc:
            raise DemoError(f"{where}: 'messages' is a string but not valid JSON ({exc})") from None
    if not isinstance(msgs, list) or not msgs:
        raise DemoError(
            f'{where}: no \'messages\' list (expected {{"messages": [{{"role": ..., "content": ...}}], '
            f'"tools": [...]}}); keys are {sorted(row)}'
        )
    msgs = json.loads(json.dumps(msgs))  # a copy: validation normalizes tool-call arguments in place
    by_name = _argument_schemas(schemas)
    pending: list[str | None] = []
    for i, m in enumerate(msgs):
        at = f"{where}: messages[{i}]"
        if not isinstance(m, dict):
            raise DemoError(f"{at} is {type(m).__name__}, expected an object")
        role = m.get("role")
        if role not in ROLES:
            raise DemoError(f"{at} has role {role!r}; expected one of {', '.join(ROLES)}")
        content = m.get("content")
        if isinstance(content, list) and role != "assistant":  # text and image parts (decoded when laid down)
            try:
                check_content(content, at)
            except ImageError as exc:
                raise DemoError(str(exc)) from None
        elif not (isinstance(content, str) or (content is None and role == "assistant" and m.get("tool_calls"))):
            raise DemoError(f"{at} ({role}): content must be a string, got {type(content).__name__}")
        if i == 0 and role not in ("system", "user"):
            raise DemoError(f"{at}: a conversation starts with a system or user message, not {role}")
        if role == "assistant":
            calls = m.get("tool_calls") or []
            if not isinstance(calls, list):
                raise DemoError(f"{at}: tool_calls must be a list")
            pending = [_check_call(c, offered, f"{at}.tool_calls[{k}]", by_name) for k, c in enumerate(calls)]
        elif role == "tool":
            cid = m.get("tool_call_id")
            if not pending:
                raise DemoError(f"{at}: a tool message with no unanswered tool call before it")
            if cid is not None and cid in pending:
                pending.remove(cid)
            elif cid is not None and any(p is not None for p in pending):
                raise DemoError(
                    f"{at}: tool_call_id {cid!r} matches no call of the assistant turn before it "
                    f"(unanswered: {[p for p in pending if p is not None]})"
                )
            else:
                pending.pop(0)
        else:
            pending = []
    if not any(m["role"] == "assistant" for m in msgs):
        raise DemoError(f"{where}: no assistant message: nothing to train on")
    return msgs


def check_row(
    row: dict[str, Any], where: str, env_tools: Sequence[dict] | None = None
) -> tuple[list[Message], list[dict]]:
    """A conversational row's checked messages and the tool schemas it renders with.

    With ``env_tools`` (the env's schemas) the row renders with the env's tools, exactly as its
    rollouts do, and its own ``tools``, if any, must name the same tools; without, it renders with
    its own ``tools``. Either way each tool call must fit the schema rendered.
    """
    env_names = _tool_names(env_tools) if env_tools is not None else None
    tools = _check_tools(row.get("tools"), where)
    if env_tools is not None and tools and _tool_names(tools) != env_names:
        raise DemoError(
            f"{where}: its tools {sorted(_tool_names(tools))} differ from the env's "
            f"{sorted(env_names or [])}; demonstrations render with the env's tools"
        )
    if env_tools is None:  # the row's own tools are rendered and check its arguments
        _check_parameters(tools, where)
    schemas = list(env_tools) if env_tools is not None else tools
    offered = env_names if env_tools is not None else _tool_names(tools)
    return check_conversation(row, where, offered, schemas=schemas), schemas
