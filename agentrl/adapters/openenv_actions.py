"""How an assistant turn becomes an OpenEnv action, read from the server's action JSON schema.

OpenEnv actions are pydantic models; ``GET /schema`` gives their JSON schema. Two shapes occur:

- **MCP-style** envs (openenv-core's ``MCPEnvironment``, e.g. its ``echo_env``) take
  ``CallToolAction`` (``{"type": "call_tool", "tool_name": ..., "arguments": {...}}``) and list
  their tools with a ``{"type": "list_tools"}`` step. Their tools become agentrl :class:`Tool`\\ s
  (:class:`ServerTool`), so the chat template shows them to the model, and the model's parsed tool
  calls become call-tool steps (:func:`is_tool_call_schema`, :func:`tool_result_text`).
- **Field** envs take one field the reply fills: a string (the reply as is), an enum (OpenEnv's
  grid world: ``{"$ref": "#/$defs/MoveAction"}`` whose ``enum`` is the moves), an integer, a
  number or a boolean. :func:`action_mapping` follows local ``$ref``\\ s and ``allOf`` wrappers
  (pydantic writes enums and nested models that way) and picks the field.

A reply that does not fit (no such enum value, no number in it) raises
:class:`~agentrl.adapters.InvalidAction`, whose message the model reads: it lists what is allowed.
"""

from __future__ import annotations

import json
import re
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from agentrl.adapters import InvalidAction
from agentrl.tool import Tool, ToolResult

_SHOWN = 80  # characters of a bad reply quoted back to the model
_INTEGER = re.compile(r"-?\d+")
_NUMBER = re.compile(r"-?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?")
_BOOLEANS = {"true": True, "yes": True, "false": False, "no": False}


def resolve(schema: Any, root: dict[str, Any]) -> dict[str, Any]:
    """``schema`` with local ``$ref``\\ s (``#/$defs/X``, ``#/definitions/X``) followed and a one-entry
    ``allOf`` merged in; keys next to a ``$ref`` (a field's ``description``) win over the target's.

    Raises ValueError for a remote ref, a ref that points nowhere, or a cycle.
    """
    seen: set[str] = set()
    while isinstance(schema, dict):
        if "$ref" in schema:
            ref = schema["$ref"]
            if not isinstance(ref, str) or not ref.startswith("#/") or ref in seen:
                raise ValueError(f"action schema: cannot follow $ref {ref!r} (only local, acyclic #/... refs)")
            seen.add(ref)
            target: Any = root
            for part in ref[2:].split("/"):
                part = part.replace("~1", "/").replace("~0", "~")
                if not isinstance(target, dict) or part not in target:
                    raise ValueError(f"action schema: $ref {ref!r} points nowhere")
                target = target[part]
            schema = {**target, **{k: v for k, v in schema.items() if k != "$ref"}}
        elif isinstance(schema.get("allOf"), list) and len(schema["allOf"]) == 1:
            schema = {**schema["allOf"][0], **{k: v for k, v in schema.items() if k != "allOf"}}
        else:
            return schema
    return {}


def _non_null(prop: dict[str, Any], root: dict[str, Any]) -> dict[str, Any]:
    """An ``Optional[X]`` field (``anyOf: [X, {"type": "null"}]``) as ``X``; anything else as is."""
    options = prop.get("anyOf") or prop.get("oneOf")
    if isinstance(options, list):
        real = [resolve(o, root) for o in options if resolve(o, root).get("type") != "null"]
        if len(real) == 1:
            return {**real[0], **{k: v for k, v in prop.items() if k not in ("anyOf", "oneOf")}}
    return prop


def _quote(text: str) -> str:
    return repr(text if len(text) <= _SHOWN else text[:_SHOWN] + "...")


def parse_choice(values: list[Any], text: str) -> Any:
    """The enum value the reply names: the whole reply (stripped, any case), else the one value that
    appears in it as a word; else :class:`InvalidAction` listing the allowed values."""
    allowed = ", ".join(str(v) for v in values)
    reply = text.strip().strip(".!`'\"*").strip()
    exact = [v for v in values if str(v) == reply] or [v for v in values if str(v).lower() == reply.lower()]
    if len(exact) == 1:
        return exact[0]
    named = {str(v).lower(): v for v in values if re.search(rf"(?<!\w){re.escape(str(v))}(?!\w)", text, re.I)}
    if len(named) == 1:
        return next(iter(named.values()))
    how = "names several of them" if named else "names none of them"
    raise InvalidAction(f"reply with exactly one of: {allowed}; {_quote(text)} {how}")


def _parse_integer(text: str) -> int:
    found = _INTEGER.search(text)
    if found is None:
        raise InvalidAction(f"reply with a whole number; {_quote(text)} contains none")
    return int(found.group())


def _parse_number(text: str) -> float:
    found = _NUMBER.search(text)
    if found is None:
        raise InvalidAction(f"reply with a number; {_quote(text)} contains none")
    return float(found.group())


def _parse_boolean(text: str) -> bool:
    words = {w for w in re.findall(r"[a-z]+", text.lower()) if w in _BOOLEANS}
    if len({_BOOLEANS[w] for w in words}) != 1:
        raise InvalidAction(f"reply with yes or no (true or false); {_quote(text)} is neither")
    return _BOOLEANS[words.pop()]


@dataclass(frozen=True)
class ActionMapping:
    """The action field the reply fills, its kind and the hint shown with the first observation."""

    field: str
    kind: str  # "string" | "enum" | "integer" | "number" | "boolean"
    values: tuple[Any, ...] = ()
    description: str = ""

    def __call__(self, text: str) -> dict[str, Any]:
        """The step's action fields for a reply; raises :class:`InvalidAction` for one that does not fit."""
        parse: dict[str, Callable[[str], Any]] = {
            "string": lambda t: t,
            "enum": lambda t: parse_choice(list(self.values), t),
            "integer": _parse_integer,
            "number": _parse_number,
            "boolean": _parse_boolean,
        }
        return {self.field: parse[self.kind](text)}

    def hint(self) -> str | None:
        """What to reply, for the first observation (None for free text: the env's text says it)."""
        what = {
            "enum": "exactly one of: " + ", ".join(str(v) for v in self.values),
            "integer": "a whole number",
            "number": "a number",
            "boolean": "yes or no",
        }.get(self.kind)
        if what is None:
            return None
        about = f" ({self.field}: {self.description.rstrip('.')})" if self.description else f" ({self.field})"
        return f"Reply with {what}{about}."


def _kind(prop: dict[str, Any]) -> tuple[str, tuple[Any, ...]] | None:
    if isinstance(prop.get("enum"), list) and prop["enum"]:
        return "enum", tuple(prop["enum"])
    if "const" in prop:
        return "enum", (prop["const"],)
    kind = prop.get("type")
    if kind in ("string", "integer", "number", "boolean"):
        return str(kind), ()
    return None


def action_mapping(action_schema: dict[str, Any]) -> ActionMapping:
    """The one field of an OpenEnv action schema that the model's reply fills (see the module docstring).

    It is the only required field besides ``metadata`` or, with none required, the only field
    besides ``metadata``; it must be a string, enum, integer, number or boolean (``$ref``\\ s and
    ``Optional`` followed). Anything else raises ValueError saying to pass ``action_from_text``.
    """
    props = action_schema.get("properties") or {}
    required = [k for k in action_schema.get("required", []) if k != "metadata"]
    candidates = required if required else [k for k in props if k != "metadata"]
    if len(candidates) == 1 and isinstance(props.get(candidates[0]), dict):
        prop = _non_null(resolve(props[candidates[0]], action_schema), action_schema)
        found = _kind(prop)
        if found is not None:
            return ActionMapping(candidates[0], found[0], found[1], str(prop.get("description") or ""))
    raise ValueError(
        f"cannot tell which action field takes the model's text (fields {sorted(props)}, required "
        f"{required}): pass OpenEnvEnv(..., action_from_text=lambda text: {{'<field>': text, ...}})"
    )


def is_tool_call_schema(action_schema: dict[str, Any]) -> bool:
    """True for MCP-style actions: a string ``tool_name`` and an object ``arguments`` (``CallToolAction``)."""
    props = action_schema.get("properties") or {}
    name = resolve(props.get("tool_name", {}), action_schema)
    arguments = resolve(props.get("arguments", {}), action_schema)
    return name.get("type") == "string" and arguments.get("type", "object") == "object" and "arguments" in props


def tool_result_text(observation: dict[str, Any]) -> tuple[str, bool]:
    """A ``CallToolObservation`` as ``(text for the model, is_error)``.

    ``error`` (the framework's: unknown tool, bad arguments, timeout) and a result flagged
    ``is_error`` read ``"Error: ..."``; an MCP result's text parts are joined; other results are JSON.
    """
    error = observation.get("error")
    if error:
        message = error.get("message") if isinstance(error, dict) else None
        return f"Error: {message or json.dumps(error, ensure_ascii=False, default=str)}", True
    result = observation.get("result")
    if isinstance(result, dict) and isinstance(result.get("content"), list):
        parts = [
            c["text"]
            if isinstance(c, dict) and c.get("type") == "text" and isinstance(c.get("text"), str)
            else json.dumps(c, ensure_ascii=False, default=str)
            for c in result["content"]
        ]
        text = "\n".join(parts)
        failed = bool(result.get("is_error") or result.get("isError"))
        return (f"Error: {text}" if failed else text), failed
    if result is None:
        return "", False
    return (result if isinstance(result, str) else json.dumps(result, ensure_ascii=False, default=str)), False


class ServerTool(Tool):
    """One tool of an MCP-style OpenEnv env: its name, description and input schema as the server
    lists them, shown to the model through the chat template. Calling it runs a call-tool step in
    the episode's session (``call``), and returns what the model would read."""

    def __init__(self, spec: dict[str, Any], call: Callable[[str, dict[str, Any]], Awaitable[tuple[str, bool]]]):
        if not isinstance(spec, dict) or not isinstance(spec.get("name"), str) or not spec["name"]:
            raise ValueError(f"the server listed a tool without a name: {str(spec)[:200]}")
        schema = spec.get("input_schema", spec.get("inputSchema")) or {}
        if not isinstance(schema, dict):
            raise ValueError(f"tool {spec['name']!r}: input_schema is {type(schema).__name__}, expected an object")
        self.name = spec["name"]
        self.description = str(spec.get("description") or "")
        self.parameters = {"type": "object", "properties": {}, **schema}
        self._call = call

    async def __call__(self, **arguments: Any) -> ToolResult:
        text, failed = await self._call(self.name, arguments)
        return ToolResult(text, is_error=failed)
