"""Tools: the functions an environment offers to the model, and how they are called.

A tool is a name, a description and a JSON schema for its arguments (exactly what the OpenAI
``tools`` field and every open model's chat template expect), plus an async ``__call__`` that does
the work. Two ways to write one:

- subclass :class:`Tool` and set ``name`` / ``description`` / ``parameters``;
- decorate a typed, documented function with :func:`tool`, which builds the schema from the type
  hints and the Google-style docstring.

During RL the model *will* call tools with wrong arguments, hang them, and make them raise. None of
that may crash an episode: :func:`call_tool` validates the arguments, applies the timeout and turns
every failure into a :class:`ToolResult` with ``is_error=True`` whose text the model reads on its
next turn. Tools signal expected failures by raising :class:`ToolError`; its message goes to the
model verbatim.
"""

from __future__ import annotations

import abc
import asyncio
import functools
import inspect
import json
import re
import types
import typing
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from agentrl.rollout.threads import SyncPool
from agentrl.sandbox.base import SandboxError

__all__ = ["Tool", "ToolError", "ToolResult", "call_tool", "find_tool", "tool"]


class ToolError(Exception):
    """An error whose message is meant for the model ("add: missing required argument 'b'").

    Raise it from a tool for expected failures (bad input, nothing found, ...). :func:`call_tool`
    shows the message as is, without the exception type, so write it as a sentence the model can
    act on.
    """


class ToolCrashed(RuntimeError):
    """A tool raised ``SystemExit``/``KeyboardInterrupt``/``GeneratorExit``: the sample fails (not shown to the model)."""


@dataclass
class ToolResult:
    """What a tool call produced: the text the model sees, whether it is an error, and extras.

    ``metadata`` is for the environment and the logs (timings, exit codes, ...), never shown to the
    model.
    """

    content: str
    is_error: bool = False
    metadata: dict[str, Any] = field(default_factory=dict)


class Tool(abc.ABC):
    """A function the model can call: ``name``, ``description``, ``parameters``, ``__call__``.

    ``parameters`` is a JSON schema of type ``object`` (``properties``, ``required``); it is sent to
    the model through the chat template and used by :meth:`validate` to check the model's arguments
    before the call. ``timeout`` (seconds) overrides the environment's default for this tool.

    ``__call__`` receives the validated arguments as keyword arguments and returns the text for the
    model (or a :class:`ToolResult` when it wants to set ``is_error`` or ``metadata``). It is async so
    that an environment can run many calls concurrently; blocking work belongs in a thread
    (``asyncio.to_thread``) or a sandbox.

    ``sandboxed = True`` asks for the episode's :class:`agentrl.sandbox.Sandbox`: the environment
    then passes it as the keyword argument ``sandbox`` (never part of the schema the model sees), the
    same one for every call of an episode, so files and sessions persist between turns. Calls of
    sandboxed tools in one episode run one at a time.
    """

    name: str
    description: str = ""
    parameters: dict[str, Any] = {"type": "object", "properties": {}}
    timeout: float | None = None
    sandboxed: bool = False

    @abc.abstractmethod
    async def __call__(self, **arguments: Any) -> str | ToolResult:
        """Run the tool on validated arguments."""

    def schema(self) -> dict[str, Any]:
        """The OpenAI tool spec ``{"type": "function", "function": {name, description, parameters}}``."""
        return {
            "type": "function",
            "function": {"name": self.name, "description": self.description, "parameters": self.parameters},
        }

    def validate(self, arguments: dict[str, Any]) -> dict[str, Any]:
        """Check ``arguments`` against ``parameters`` and return them coerced (int -> float for numbers).

        Raises :class:`ToolError` with a message the model can read, naming the tool and the
        argument: ``"add: argument 'a' must be a number, got string '3'"``. Strings are never
        converted to numbers: a model that writes ``"3"`` for a number should learn not to.
        """
        if not isinstance(arguments, dict):
            raise ToolError(f"{self.name}: arguments must be a JSON object, got {_describe(arguments)}")
        try:
            return _check_object(arguments, self.parameters, path="", top=True)
        except _Invalid as e:
            raise ToolError(f"{self.name}: {e}") from None

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {getattr(self, 'name', '?')!r}>"


# ---------------------------------------------------------------------------------------------
# argument validation: the JSON-schema subset tools use (types, enum, required, properties, items)


class _Invalid(Exception):
    """Internal: a validation failure; :meth:`Tool.validate` prefixes the tool name."""


_TYPE_WORDS = {
    "string": "a string",
    "number": "a number",
    "integer": "an integer",
    "boolean": "a boolean",
    "array": "an array",
    "object": "an object",
    "null": "null",
}


def _describe(value: Any) -> str:
    """``string '3'``, ``integer 5``, ``boolean true``, ``null``, ``array``, ``object``: for error text."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return f"boolean {'true' if value else 'false'}"
    if isinstance(value, int):
        return f"integer {value}" if abs(value) < 10**30 else "integer"
    if isinstance(value, float):
        return f"number {value!r}"
    if isinstance(value, str):
        shown = value if len(value) <= 40 else value[:37] + "..."
        return f"string {shown!r}"
    if isinstance(value, (list, tuple)):
        return "array"
    if isinstance(value, dict):
        return "object"
    return type(value).__name__


def _matches_type(value: Any, type_: str) -> bool:
    if type_ == "string":
        return isinstance(value, str)
    if type_ == "boolean":
        return isinstance(value, bool)
    if type_ == "integer":
        return (isinstance(value, int) and not isinstance(value, bool)) or (
            isinstance(value, float) and value.is_integer()
        )
    if type_ == "number":
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if type_ == "array":
        return isinstance(value, (list, tuple))
    if type_ == "object":
        return isinstance(value, dict)
    if type_ == "null":
        return value is None
    return True  # unknown type names are not ours to police


def _label(path: str) -> str:
    return f"argument '{path}'" if path else "arguments"


def _check(value: Any, schema: Any, path: str) -> Any:
    """Validate one value against a schema; return it coerced. Raises ``_Invalid``."""
    if not isinstance(schema, dict) or not schema:
        return value
    for key in ("anyOf", "oneOf"):
        if key in schema:
            return _check_any(value, schema[key], path)
    types_ = schema.get("type")
    if types_ is not None:
        names = [types_] if isinstance(types_, str) else list(types_)
        matched = next((t for t in names if _matches_type(value, t)), None)
        if matched is None:
            wanted = " or ".join(_TYPE_WORDS.get(t, t) for t in names)
            raise _Invalid(f"{_label(path)} must be {wanted}, got {_describe(value)}")
        if matched == "number" and isinstance(value, int):
            value = float(value)
        elif matched == "integer" and isinstance(value, float):
            value = int(value)
    if "enum" in schema and not any(_same(value, e) for e in schema["enum"]):
        allowed = ", ".join(json.dumps(e, ensure_ascii=False) for e in schema["enum"])
        raise _Invalid(f"{_label(path)} must be one of {allowed}, got {_describe(value)}")
    if isinstance(value, dict):
        return _check_object(value, schema, path)
    if isinstance(value, (list, tuple)) and "items" in schema:
        return [_check(v, schema["items"], f"{path}[{i}]") for i, v in enumerate(value)]
    return value


def _same(value: Any, enum_value: Any) -> bool:
    """Enum membership where ``True`` is not ``1`` (JSON has distinct booleans)."""
    return value == enum_value and isinstance(value, bool) == isinstance(enum_value, bool)


def _check_any(value: Any, options: list[Any], path: str) -> Any:
    first: _Invalid | None = None
    for option in options:
        try:
            return _check(value, option, path)
        except _Invalid as e:
            first = first or e
    if first is None:
        return value
    raise first


def _check_object(value: dict[str, Any], schema: dict[str, Any], path: str, top: bool = False) -> dict[str, Any]:
    """Required keys, unknown keys (rejected when ``properties`` is given and extras are not allowed)."""
    props = schema.get("properties")
    props = props if isinstance(props, dict) else ({} if top else None)
    for key in schema.get("required", ()):
        if key not in value:
            where = f" '{key}'" if not path else f" '{path}.{key}'"
            raise _Invalid(f"missing required argument{where}")
    extra = schema.get("additionalProperties", props is None)
    out: dict[str, Any] = {}
    for key, v in value.items():
        sub = f"{path}.{key}" if path else str(key)
        if props is not None and key in props:
            out[key] = _check(v, props[key], sub)
        elif extra is False:
            known = ", ".join(repr(k) for k in props) if props else "none"
            raise _Invalid(f"unknown argument '{sub}' (expected: {known})")
        else:
            out[key] = _check(v, extra, sub) if isinstance(extra, dict) else v
    return out


# ---------------------------------------------------------------------------------------------
# calling a tool safely


async def call_tool(
    tool: Tool, arguments: dict[str, Any], *, timeout: float | None, sandbox: Any = None, max_time: float | None = None
) -> ToolResult:
    """Validate, call and time-limit one tool call; raises only ``CancelledError``, ``SandboxError`` and
    :class:`ToolCrashed`.

    ``timeout`` is the environment's default; the tool's own ``timeout`` wins when set. Every
    failure becomes ``ToolResult(is_error=True)`` whose content starts with ``"Error: "`` and is
    what the model should see: a :class:`ToolError`'s message as is; any other exception as its type
    and text (no traceback); a timeout as ``"tool 'x' timed out after Ns"``. A sync tool that times
    out keeps running in its thread (Python cannot kill threads); put such tools in a sandbox.

    ``max_time`` caps the limit whatever its source (the caller's budget left for the turn); with
    nothing left the tool is not called and the model reads why.

    ``sandbox`` is passed to tools with ``sandboxed = True``. A :class:`agentrl.sandbox.SandboxError`
    (the sandbox itself broke: engine gone, image missing) is raised, not shown to the model: it is
    not the model's doing, so the sample fails and is counted instead of teaching the model a lie.
    """
    name = getattr(tool, "name", type(tool).__name__)
    try:
        validated = tool.validate(arguments)
    except ToolError as e:
        return _error(str(e), "validation")
    except asyncio.CancelledError:
        raise
    except BaseException as e:  # a broken custom validate() (even sys.exit) must not kill the episode either
        return _error(f"tool '{name}' could not validate its arguments: {type(e).__name__}: {e}", "validation")
    limit = tool.timeout if tool.timeout is not None else timeout
    if max_time is not None:
        if max_time <= 0:
            return _error(
                f"tool '{name}' was not run: this turn's time for tool calls is used up; make fewer or faster calls",
                "timeout",
            )
        limit = max_time if limit is None else min(limit, max_time)
    try:
        if getattr(tool, "sandboxed", False):
            if sandbox is None:
                return _error(f"tool '{name}' needs a sandbox and none was given", "exception")
            validated = {**validated, "sandbox": sandbox}
        return await asyncio.wait_for(_invoke(tool, name, validated), limit)
    except TimeoutError:  # only wait_for's own: _invoke catches the tool's exceptions
        return _error(f"tool '{name}' timed out after {limit:.3g}s", "timeout")


async def _invoke(tool: Tool, name: str, arguments: dict[str, Any]) -> ToolResult:
    try:
        out = await tool(**arguments)
    except SandboxError:
        raise
    except ToolError as e:
        return _error(str(e), "tool_error")
    except Exception as e:
        return _error(f"tool '{name}' raised {type(e).__name__}: {e}", "exception")
    except asyncio.CancelledError:
        raise
    except BaseException as e:  # SystemExit, KeyboardInterrupt, GeneratorExit: not the model's doing
        # caught here, inside wait_for's task: an asyncio task re-raises these out of the event loop itself
        raise ToolCrashed(f"tool '{name}' raised {type(e).__name__}: {e}") from e
    try:
        return _to_result(out)
    except Exception as e:
        return _error(f"tool '{name}' returned an unprintable {type(out).__name__}: {type(e).__name__}", "exception")


def _error(message: str, kind: str) -> ToolResult:
    return ToolResult(content=f"Error: {message}", is_error=True, metadata={"error": kind})


def _to_result(out: Any) -> ToolResult:
    if isinstance(out, ToolResult):
        return out
    if isinstance(out, str):
        return ToolResult(out)
    if out is None:
        return ToolResult("")
    if isinstance(out, (dict, list, tuple)):
        return ToolResult(json.dumps(out, ensure_ascii=False, default=str))
    if isinstance(out, bytes):
        return ToolResult(out.decode("utf-8", errors="replace"))
    return ToolResult(str(out))


def find_tool(tools: Iterable[Tool], name: str) -> Tool | None:
    """The first tool in ``tools`` called ``name``, or ``None``."""
    return next((t for t in tools if getattr(t, "name", None) == name), None)


# ---------------------------------------------------------------------------------------------
# @tool: a typed, documented function -> Tool


class FunctionTool(Tool):
    """A :class:`Tool` made by :func:`tool` from a function; calling it calls the function.

    Sync functions run in a worker thread of the process's tool pool (a
    :class:`~agentrl.rollout.threads.SyncPool`) so a slow tool never blocks the event loop that
    drives the other episodes, and one that times out is written off and replaced instead of
    holding one of asyncio's few default threads for good.
    """

    def __init__(
        self,
        fn: Callable[..., Any],
        *,
        name: str | None = None,
        description: str | None = None,
        timeout: float | None = None,
    ) -> None:
        functools.update_wrapper(self, fn)
        doc_description, arg_docs = _parse_docstring(inspect.getdoc(fn) or "")
        self.fn = fn
        self.name = name or fn.__name__
        self.description = description if description is not None else doc_description
        self.parameters = _function_schema(fn, arg_docs)
        self.timeout = timeout
        self._is_async = inspect.iscoroutinefunction(fn)

    async def __call__(self, *args: Any, **arguments: Any) -> Any:
        if self._is_async:
            return await self.fn(*args, **arguments)
        out = await tool_pool().run(self.fn, *args, **arguments)
        return await out if inspect.isawaitable(out) else out


_TOOL_POOL: Any = None


def tool_pool() -> Any:
    """The process's pool for sync tools: 32 threads, up to 64 written off (see :class:`SyncPool`)."""
    global _TOOL_POOL
    if _TOOL_POOL is None:
        _TOOL_POOL = SyncPool(32, max_hung=64, name="agentrl-tool")
    return _TOOL_POOL


@typing.overload
def tool(fn: Callable[..., Any], /) -> FunctionTool: ...
@typing.overload
def tool(
    *, name: str | None = None, description: str | None = None, timeout: float | None = None
) -> Callable[[Callable[..., Any]], FunctionTool]: ...


def tool(
    fn: Callable[..., Any] | None = None,
    /,
    *,
    name: str | None = None,
    description: str | None = None,
    timeout: float | None = None,
) -> Any:
    """Turn a typed function into a :class:`Tool`: ``@tool`` or ``@tool(name=..., timeout=...)``.

    The JSON schema comes from the type hints (``str``, ``int``, ``float``, ``bool``, ``list[X]``,
    ``dict``, ``X | None``, ``Literal[...]``); parameters with defaults are optional. The description
    is the docstring's first paragraph, and each parameter's description comes from its ``Args:``
    section (Google style). Raises ``TypeError`` at decoration time for hints it cannot express.
    """
    if fn is None:
        return lambda f: FunctionTool(f, name=name, description=description, timeout=timeout)
    return FunctionTool(fn, name=name, description=description, timeout=timeout)


def _function_schema(fn: Callable[..., Any], arg_docs: dict[str, str]) -> dict[str, Any]:
    sig = inspect.signature(fn)
    try:
        hints = typing.get_type_hints(fn)
    except Exception as e:
        raise TypeError(f"@tool {fn.__name__}: cannot resolve type hints: {e}") from e
    props: dict[str, Any] = {}
    required: list[str] = []
    for pname, param in sig.parameters.items():
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD, param.POSITIONAL_ONLY):
            raise TypeError(f"@tool {fn.__name__}: parameter '{pname}' must be a named (keyword) parameter")
        hint = hints.get(pname, Any)
        try:
            prop = _type_schema(hint)
        except TypeError as e:
            raise TypeError(f"@tool {fn.__name__}: parameter '{pname}': {e}") from None
        if pname in arg_docs:
            prop["description"] = arg_docs[pname]
        props[pname] = prop
        if param.default is param.empty:
            required.append(pname)
    return {"type": "object", "properties": props, "required": required}


_PRIMITIVES = {str: "string", int: "integer", float: "number", bool: "boolean", type(None): "null"}


def _type_schema(hint: Any) -> dict[str, Any]:
    """JSON schema for one type hint (a fresh dict; the caller may add a description)."""
    if hint is Any or hint is inspect.Parameter.empty:
        return {}
    if hint in _PRIMITIVES:
        return {"type": _PRIMITIVES[hint]}
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint in (list, tuple, set) or origin in (list, tuple, set, frozenset):
        if origin is tuple and len(args) == 2 and args[1] is Ellipsis:
            args = args[:1]
        if origin is tuple and len(args) > 1:
            return {"type": "array", "prefixItems": [_type_schema(a) for a in args], "minItems": len(args)}
        return {"type": "array", "items": _type_schema(args[0])} if args else {"type": "array"}
    if hint is dict or origin is dict:
        if len(args) == 2 and args[1] is not Any:
            return {"type": "object", "additionalProperties": _type_schema(args[1])}
        return {"type": "object"}
    if origin is typing.Literal:
        kinds = {_PRIMITIVES.get(type(a)) for a in args}
        out: dict[str, Any] = {"enum": list(args)}
        if len(kinds) == 1 and None not in kinds:
            out = {"type": kinds.pop(), **out}
        return out
    if origin in (typing.Union, types.UnionType):
        return _union_schema(args)
    raise TypeError(f"unsupported type hint {hint!r} (use str, int, float, bool, list, dict, Literal, X | None)")


def _union_schema(args: tuple[Any, ...]) -> dict[str, Any]:
    """``X | None`` -> X's schema with ``null`` allowed; other unions -> ``anyOf``."""
    parts = [_type_schema(a) for a in args if a is not type(None)]
    nullable = len(parts) < len(args)
    if len(parts) == 1 and nullable:
        inner = parts[0]
        if isinstance(inner.get("type"), str):
            inner["type"] = [inner["type"], "null"]
            if "enum" in inner:
                inner["enum"] = [*inner["enum"], None]
            return inner
        return {"anyOf": [inner, {"type": "null"}]}
    if all(set(p) == {"type"} and isinstance(p["type"], str) for p in parts):
        return {"type": [p["type"] for p in parts] + (["null"] if nullable else [])}
    return {"anyOf": parts + ([{"type": "null"}] if nullable else [])}


_SECTION = re.compile(
    r"^(Args|Arguments|Parameters|Params|Returns?|Yields?|Raises|Examples?|Notes?|"
    r"Attributes|See Also|Warnings?|Todo)\s*:\s*$",
    re.IGNORECASE,
)
_ARG_LINE = re.compile(r"^(\*{0,2}\w+)\s*(?:\([^)]*\))?\s*:\s*(.*)$")


def _parse_docstring(doc: str) -> tuple[str, dict[str, str]]:
    """Google-style docstring -> (first paragraph as one line, {param: description})."""
    lines = doc.splitlines()
    para: list[str] = []
    for line in lines:
        if not line.strip() or _SECTION.match(line.strip()):
            break
        para.append(line.strip())
    description = " ".join(para)
    args: dict[str, str] = {}
    in_args, current, base_indent = False, None, None
    for line in lines:
        stripped = line.strip()
        header = _SECTION.match(stripped)
        if header and len(line) - len(line.lstrip()) == 0:
            in_args = header.group(1).lower() in ("args", "arguments", "parameters", "params")
            current, base_indent = None, None
            continue
        if not in_args or not stripped:
            continue
        indent = len(line) - len(line.lstrip())
        if base_indent is None:
            base_indent = indent
        m = _ARG_LINE.match(stripped)
        if indent <= base_indent and m:
            current = m.group(1).lstrip("*")
            args[current] = m.group(2).strip()
        elif current is not None and indent > base_indent:
            args[current] = f"{args[current]} {stripped}".strip()
    return description, args
