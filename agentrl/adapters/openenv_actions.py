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

**Served agentrl envs** (``agentrl env-serve``; ``/metadata`` carries an ``agentrl`` marker, read by
:func:`served_env`) need no mapping: the action is the assistant turn itself. Their tools are shown
verbatim (:class:`ServedTool`), the reply travels as text for the server to parse with the env's
``tool_parser`` (:func:`served_step`), and the observation's chat messages are passed on with their
roles (:func:`served_messages`), so the model reads what it reads when the env runs in process.
"""

from __future__ import annotations

import copy
import json
import re
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from agentrl.adapters.base import InvalidAction
from agentrl.adapters.gymnasium import json_safe
from agentrl.env import EnvContractError, StepResult, check_messages
from agentrl.parsing import OpenAIToolCallsParser, get_parser, unique_call_ids
from agentrl.tool import Tool, ToolResult
from agentrl.types import Action, Message, ParseError, ToolCall

_SHOWN = 80  # characters of a bad reply quoted back to the model
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
    found = _NUMBER.search(text)
    if found is None:
        raise InvalidAction(f"reply with a whole number; {_quote(text)} contains none")
    value = float(found.group())
    if not value.is_integer():  # 3.7 is not 3: the model asked for something the field cannot hold
        raise InvalidAction(f"reply with a whole number; {found.group()} is not one")
    return int(value)


def _parse_number(text: str) -> float:
    found = _NUMBER.search(text)
    if found is None:
        raise InvalidAction(f"reply with a number; {_quote(text)} contains none")
    return float(found.group())


def _parse_boolean(text: str) -> bool:
    found = re.findall(r"[a-z]+", text.lower())
    words = {w for w in found if w in _BOOLEANS}
    negated = any(w in ("not", "never") for w in found) or "n't" in text.lower()
    if len({_BOOLEANS[w] for w in words}) != 1 or negated:  # "not true" is no clear answer
        raise InvalidAction(f"reply with yes or no (true or false); {_quote(text)} is neither")
    return _BOOLEANS[words.pop()]


@dataclass(frozen=True)
class ActionMapping:
    """The action field the reply fills, its kind and the hint shown with the first observation."""

    field: str
    kind: str  # "string" | "enum" | "integer" | "number" | "boolean"
    values: tuple[Any, ...] = ()
    description: str = ""
    fixed: tuple[tuple[str, Any], ...] = ()  # required single-value fields (a Literal discriminator), filled as is

    def __call__(self, text: str) -> dict[str, Any]:
        """The step's action fields for a reply; raises :class:`InvalidAction` for one that does not fit."""
        parse: dict[str, Callable[[str], Any]] = {
            "string": lambda t: t,
            "enum": lambda t: parse_choice(list(self.values), t),
            "integer": _parse_integer,
            "number": _parse_number,
            "boolean": _parse_boolean,
        }
        return {**dict(self.fixed), self.field: parse[self.kind](text)}

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


_NO_VALUE = object()


def _single_value(prop: Any, root: dict[str, Any]) -> Any:
    """The one value a field may take (``const``, a one-value enum: a ``Literal['move']`` tag), else a sentinel."""
    if not isinstance(prop, dict):
        return _NO_VALUE
    prop = _non_null(resolve(prop, root), root)
    if "const" in prop:
        return prop["const"]
    values = prop.get("enum")
    return values[0] if isinstance(values, list) and len(values) == 1 else _NO_VALUE


def action_mapping(action_schema: dict[str, Any]) -> ActionMapping:
    """The one field of an OpenEnv action schema that the model's reply fills (see the module docstring).

    It is the only required field besides ``metadata`` and fields with a single allowed value (a
    ``Literal`` tag, filled in as is) or, with none required, the only such field; it must be a string, enum, integer, number or boolean (``$ref``\\ s and
    ``Optional`` followed). Anything else raises ValueError saying to pass ``action_from_text``.
    """
    props = action_schema.get("properties") or {}
    required = [k for k in action_schema.get("required", []) if k != "metadata"]
    fixed = tuple((k, v) for k in required if (v := _single_value(props.get(k), action_schema)) is not _NO_VALUE)
    required = [k for k in required if k not in dict(fixed)]
    candidates = required if required else [k for k in props if k != "metadata" and k not in dict(fixed)]
    if len(candidates) == 1 and isinstance(props.get(candidates[0]), dict):
        prop = _non_null(resolve(props[candidates[0]], action_schema), action_schema)
        found = _kind(prop)
        if found is not None:
            return ActionMapping(candidates[0], found[0], found[1], str(prop.get("description") or ""), fixed)
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


# -- agentrl envs served by ``agentrl env-serve`` ----------------------------------------------------

AGENTRL_PROTOCOL = 1
"""The version of what ``/metadata``'s ``agentrl`` marker promises a client: observations hold the env's
own chat messages (``messages``), ``info`` and ``truncated``; a ``{"text"}`` action is parsed with the
marker's ``tool_parser`` and its calls numbered as the rollout loop numbers them (``call_{turn}_{n}``);
``tools`` lists the env's OpenAI tool specs verbatim. agentrl's ``openenv:`` adapter then shows the model
the conversation an in-process run shows, and refuses a marker of another protocol."""


@dataclass(frozen=True)
class ServedEnv:
    """What an ``agentrl env-serve`` server says about its env (``/metadata``, checked by :func:`served_env`)."""

    tool_specs: tuple[dict[str, Any], ...]
    tool_parser: str
    max_turns: int | None
    version: str


def served_env(metadata: dict[str, Any]) -> ServedEnv | None:
    """The served agentrl env a ``/metadata`` answer describes, or None when it has no ``agentrl`` marker
    (any other OpenEnv server). A marker of another protocol or a malformed field raises ValueError
    naming the field, so a broken server is refused before an episode is played against it."""
    marker = metadata.get("agentrl")
    if marker is None:
        return None
    if not isinstance(marker, dict) or marker.get("protocol") != AGENTRL_PROTOCOL:
        got = marker.get("protocol") if isinstance(marker, dict) else marker
        raise ValueError(
            f"/metadata agentrl.protocol is {got!r}; this agentrl speaks protocol {AGENTRL_PROTOCOL}: "
            "run the same agentrl version on both hosts"
        )
    parser, max_turns, tools = marker.get("tool_parser"), marker.get("max_turns"), metadata.get("tools")
    if not isinstance(parser, str):
        raise ValueError(f"/metadata agentrl.tool_parser must be a parser name, got {parser!r}")
    try:
        get_parser(parser)
    except (KeyError, ValueError) as exc:
        raise ValueError(f"/metadata agentrl.tool_parser {parser!r}: {exc}") from None
    if max_turns is not None and (isinstance(max_turns, bool) or not isinstance(max_turns, int) or max_turns < 1):
        raise ValueError(f"/metadata agentrl.max_turns must be a positive whole number or null, got {max_turns!r}")
    if not isinstance(tools, list):
        raise ValueError(f"/metadata tools must be a list of OpenAI tool specs, got {type(tools).__name__}")
    for i, spec in enumerate(tools):
        fn = spec.get("function") if isinstance(spec, dict) else None
        if not isinstance(fn, dict) or spec.get("type") != "function":
            raise ValueError(
                f"/metadata tools[{i}] must be {{'type': 'function', 'function': {{...}}}}, got {spec!r:.200}"
            )
        for key, kind in (("name", str), ("description", str), ("parameters", dict)):
            if not isinstance(fn.get(key), kind) or (key == "name" and not fn[key]):
                raise ValueError(
                    f"/metadata tools[{i}].function.{key} must be a {kind.__name__}, got {fn.get(key)!r:.100}"
                )
    return ServedEnv(tuple(tools), parser, max_turns, str(marker.get("version", "")))


class ServedTool(Tool):
    """One tool of a served agentrl env: its OpenAI spec as the server lists it, rendered verbatim (so
    the chat template shows what an in-process run shows). In an episode the model's calls travel in
    the reply's text and the server runs them; calling the tool directly runs one ``call_tool`` turn
    in the episode's session (``call``)."""

    def __init__(self, spec: dict[str, Any], call: Callable[[str, dict[str, Any]], Awaitable[tuple[str, bool]]]):
        fn = spec["function"]
        self.name, self.description, self.parameters = fn["name"], fn["description"], fn["parameters"]
        self._spec, self._call = copy.deepcopy(spec), call

    def schema(self) -> dict[str, Any]:
        return copy.deepcopy(self._spec)

    async def __call__(self, **arguments: Any) -> ToolResult:
        text, failed = await self._call(self.name, arguments)
        return ToolResult(text, is_error=failed)


def served_result(
    result: dict[str, Any], where: str, ids: dict[str, str]
) -> tuple[list[Message], float, bool, bool, dict[str, Any]]:
    """A served env's answer (``{"observation", "reward", "done"}``) as the 5-tuple: the observation's chat
    messages checked as an in-process env's are, each tool result's ``tool_call_id`` written back as the
    action's own id (``ids``: the server's id -> the action's), ``truncated`` the observation's and
    ``terminated`` done without it. Raises ValueError naming the field that is wrong."""
    observation = result.get("observation") if isinstance(result, dict) else None
    if not isinstance(observation, dict):
        raise ValueError(f"the served env's {where} answered observation={observation!r:.100}, which is not an object")
    try:
        messages = check_messages(observation.get("messages"), f"the served env's {where} observation.messages")
    except EnvContractError as exc:
        raise ValueError(str(exc)) from None
    messages = [
        {**m, "tool_call_id": ids[m["tool_call_id"]]} if m.get("tool_call_id") in ids else m  # type: ignore[typeddict-item]
        for m in messages
    ]
    info, truncated = observation.get("info", {}), observation.get("truncated", False)
    done, reward = result.get("done", False), result.get("reward")
    for name, value, ok in (
        ("observation.info", info, isinstance(info, dict)),
        ("observation.truncated", truncated, isinstance(truncated, bool)),
        ("done", done, isinstance(done, bool)),
        ("reward", reward, reward is None or (isinstance(reward, (int, float)) and not isinstance(reward, bool))),
    ):
        if not ok:
            raise ValueError(f"the served env's {where} answered {name}={value!r:.100}, which is not valid there")
    return messages, float(reward or 0.0), done and not truncated, truncated, info


def served_reset_data(task: dict[str, Any], seed: int | None, placeholder: str) -> dict[str, Any]:
    """A served env's reset data: the task row itself (JSON-safe; the server plays it as an in-process
    run would) unless its prompt is the ``placeholder`` of ``tasks()``'s seed rows (the server then
    plays its own task ``seed``), the row's ``options`` and the seed."""
    data: dict[str, Any] = {}
    if "prompt" in task and task["prompt"] != placeholder:
        data = json_safe({k: v for k, v in task.items() if k not in ("seed", "options")})
    data.update(task.get("options") or {})
    if seed is not None:
        data["seed"] = int(seed)
    return data


def served_step(action: Action, parser_name: str, turn: int, seen: set[str]) -> tuple[dict[str, Any], dict[str, str]]:
    """The step data for a served env's turn and the ids its tool results will carry (server id -> the action's).

    The reply travels as ``{"text"}``, the server parsing it with its env's ``tool_parser``, when that
    parse equals the action's (same calls, same number of unparseable ones): then the env gets what it
    gets in process. Otherwise (a run with another ``--tool-parser``, a chat engine's structured calls)
    the action's calls travel as ``tool_calls`` so the env runs the calls the conversation shows; an
    action that also holds unparseable calls cannot travel (the protocol has no field for them) and
    raises ValueError saying which ``--tool-parser`` to use. ``seen`` mirrors the server's ids of the
    episode (the rollout loop's :func:`~agentrl.parsing.unique_call_ids`), ``turn`` its turn count.
    """
    _, calls, errors = get_parser(parser_name).parse(action.text)
    theirs = [(c.name, c.arguments) for c in calls], len(errors)
    if theirs == ([(c.name, c.arguments) for c in action.tool_calls], len(action.errors)):
        payload: dict[str, Any] = {"text": action.text}
    elif not action.errors:
        payload = {"text": action.text, "tool_calls": [c.to_openai() for c in action.tool_calls]}
        _, calls, errors = OpenAIToolCallsParser().parse_message({"content": "", "tool_calls": payload["tool_calls"]})
    else:
        raise ValueError(
            f"the served env parses tool calls as {parser_name!r} but this run read the reply otherwise "
            f"({len(action.tool_calls)} call(s), {len(action.errors)} unparseable) and unparseable calls cannot "
            f"be sent: run with --tool-parser {parser_name} (or without --tool-parser)"
        )
    items: list[ToolCall | ParseError] = [*calls, *errors]
    unique_call_ids(items, turn, seen)
    mine: list[ToolCall | ParseError] = [*action.tool_calls, *action.errors]
    return payload, {item.id: own.id for item, own in zip(items, mine)}


# -- small helpers of the openenv: adapter --------------------------------------------------------


def invalid_step(why: str, reward: float = 0.0) -> StepResult:
    """The step result of an action the model got wrong: it reads ``why``; the env is not stepped."""
    return [{"role": "user", "content": f"Invalid action: {why}"}], reward, False, False, {"invalid_action": why}


def chat_prompt(prompt: Any) -> bool:
    """Whether a task's prompt is chat messages (verl's layout), each a dict with a role and string content."""
    return (
        isinstance(prompt, list)
        and bool(prompt)
        and all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in prompt
        )
    )


def validation_summary(data: dict[str, Any]) -> str:
    """Pydantic's errors as one line a model can act on: ``word: String should have at most 1000 characters``."""
    parts = []
    for err in data.get("errors") or ():
        where = ".".join(str(p) for p in err.get("loc", ())) or "action"
        parts.append(f"{where}: {err.get('msg', 'invalid')}")
    return "; ".join(parts) or str(data.get("message", "invalid action"))
