"""Tool base class, @tool schema generation, argument validation and call_tool's error handling."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any, Literal, Optional

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agentrl.tool import Tool, ToolError, ToolResult, call_tool, find_tool, tool


@tool
async def add(a: float, b: float) -> str:
    """Add two numbers.

    Args:
        a: first addend
        b: second addend
    """
    return str(a + b)


@tool(name="web_search", description="Search the web.", timeout=3.0)
def search(
    query: str,
    k: int = 5,
    mode: Literal["web", "news"] = "web",
    tags: list[str] | None = None,
    site: Optional[str] = None,  # noqa: UP045 (the old spelling must give the same schema)
    filters: dict[str, int] | None = None,
    exact: bool = False,
) -> dict:
    """Ignored because description= is given.

    Args:
        query (str): what to search
            for, across lines.
        k: how many results
        mode: which index
    """
    return {"query": query, "k": k, "mode": mode, "thread": threading.current_thread().name}


class Echo(Tool):
    name = "echo"
    description = "Echo the text."
    parameters = {
        "type": "object",
        "properties": {
            "text": {"type": "string"},
            "times": {"type": "integer"},
            "point": {
                "type": "object",
                "properties": {"x": {"type": "number"}, "y": {"type": "number"}},
                "required": ["x", "y"],
            },
            "anything": {},
        },
        "required": ["text"],
    }

    async def __call__(self, text: str, times: int = 1, point: dict | None = None, anything: Any = None) -> str:
        return text * times


# --- schema ---------------------------------------------------------------------------------


def test_decorated_async_function_schema():
    assert isinstance(add, Tool)
    assert add.schema() == {
        "type": "function",
        "function": {
            "name": "add",
            "description": "Add two numbers.",
            "parameters": {
                "type": "object",
                "properties": {
                    "a": {"type": "number", "description": "first addend"},
                    "b": {"type": "number", "description": "second addend"},
                },
                "required": ["a", "b"],
            },
        },
    }
    assert add.timeout is None


def test_decorator_keeps_function_identity():
    assert add.__name__ == "add"
    assert add.__doc__.startswith("Add two numbers.")
    assert callable(add.__wrapped__)
    assert search.name == "web_search" and search.__name__ == "search"


def test_decorator_with_options_and_rich_types():
    assert search.description == "Search the web."
    assert search.timeout == 3.0
    params = search.parameters
    assert params["required"] == ["query"]
    props = params["properties"]
    assert props["query"] == {"type": "string", "description": "what to search for, across lines."}
    assert props["k"] == {"type": "integer", "description": "how many results"}
    assert props["mode"] == {"type": "string", "enum": ["web", "news"], "description": "which index"}
    assert props["tags"] == {"type": ["array", "null"], "items": {"type": "string"}}
    assert props["site"] == {"type": ["string", "null"]}
    assert props["filters"] == {"type": ["object", "null"], "additionalProperties": {"type": "integer"}}
    assert props["exact"] == {"type": "boolean"}


def test_docstring_first_paragraph_only():
    @tool
    def f(x: int) -> int:
        """First line
        continues here.

        Second paragraph is not part of the description.

        Args:
            x: the x.

        Returns:
            x itself
        """
        return x

    assert f.description == "First line continues here."
    assert f.parameters["properties"]["x"]["description"] == "the x."


def test_untyped_and_literal_int():
    @tool
    def f(x, level: Literal[1, 2, 3] = 1):
        return x

    assert f.parameters["properties"] == {"x": {}, "level": {"type": "integer", "enum": [1, 2, 3]}}
    assert f.description == ""

    @tool
    def g(choice: Literal[1, "a"] | None = None) -> str:
        return ""

    assert g.parameters["properties"]["choice"] == {"anyOf": [{"enum": [1, "a"]}, {"type": "null"}]}
    assert g.validate({"choice": None}) == {"choice": None}
    assert g.validate({"choice": "a"}) == {"choice": "a"}
    with pytest.raises(ToolError, match="must be one of 1, \"a\", got string 'b'"):
        g.validate({"choice": "b"})


def test_unsupported_hints_fail_at_decoration():
    with pytest.raises(TypeError, match="parameter 'x'"):

        @tool
        def f(x: complex) -> str:
            return ""

    with pytest.raises(TypeError, match="keyword"):

        @tool
        def g(*args: int) -> str:
            return ""


def test_subclass_schema_and_find_tool():
    echo = Echo()
    assert echo.schema()["function"]["name"] == "echo"
    assert find_tool([add, echo], "echo") is echo
    assert find_tool([add, echo], "nope") is None
    assert find_tool([], "add") is None


# --- calling --------------------------------------------------------------------------------


async def test_decorated_tool_is_callable():
    assert await add(a=1.0, b=2.0) == "3.0"
    assert await add(1.0, 2.0) == "3.0"


async def test_sync_tool_runs_in_a_thread():
    result = await call_tool(search, {"query": "x"}, timeout=5)
    assert not result.is_error
    assert '"query": "x"' in result.content
    assert threading.current_thread().name not in result.content


async def test_call_tool_success_and_coercion():
    result = await call_tool(add, {"a": 1, "b": 2}, timeout=5)
    assert result == ToolResult("3.0")


async def test_call_tool_validation_errors():
    r = await call_tool(add, {"a": 1}, timeout=5)
    assert r.is_error and r.content == "Error: add: missing required argument 'b'"
    r = await call_tool(add, {"a": "3", "b": 1}, timeout=5)
    assert r.is_error and r.content == "Error: add: argument 'a' must be a number, got string '3'"


async def test_tool_error_message_is_shown_verbatim():
    @tool
    async def fail(x: int) -> str:
        raise ToolError("nothing found for 3")

    r = await call_tool(fail, {"x": 3}, timeout=5)
    assert r == ToolResult("Error: nothing found for 3", is_error=True, metadata={"error": "tool_error"})


async def test_other_exceptions_become_error_results():
    @tool
    def crash(x: int) -> str:
        return str(1 // x)

    r = await call_tool(crash, {"x": 0}, timeout=5)
    assert r.is_error
    assert r.content == "Error: tool 'crash' raised ZeroDivisionError: integer division or modulo by zero"
    assert "Traceback" not in r.content


async def test_timeout_uses_env_default_then_tool_override():
    @tool
    async def slow() -> str:
        await asyncio.sleep(10)
        return "done"

    t0 = time.monotonic()
    r = await call_tool(slow, {}, timeout=0.05)
    assert r.is_error and r.content == "Error: tool 'slow' timed out after 0.05s"
    assert r.metadata["error"] == "timeout"
    slow.timeout = 0.02
    r = await call_tool(slow, {}, timeout=100)
    assert r.content == "Error: tool 'slow' timed out after 0.02s"
    assert time.monotonic() - t0 < 2


async def test_timeout_raised_inside_tool_is_not_a_timeout():
    @tool
    async def raises_timeout() -> str:
        raise TimeoutError("upstream")

    r = await call_tool(raises_timeout, {}, timeout=5)
    assert r.content == "Error: tool 'raises_timeout' raised TimeoutError: upstream"


async def test_no_timeout():
    r = await call_tool(add, {"a": 1, "b": 1}, timeout=None)
    assert r.content == "2.0"


@pytest.mark.parametrize(
    ("value", "content"),
    [
        ({"a": [1, "é"]}, '{"a": [1, "é"]}'),
        ([1, 2], "[1, 2]"),
        (None, ""),
        (42, "42"),
        (b"bytes", "bytes"),
        (ToolResult("custom", is_error=True, metadata={"k": 1}), "custom"),
    ],
)
async def test_return_values_are_converted(value, content):
    @tool
    async def f() -> Any:
        return value

    r = await call_tool(f, {}, timeout=5)
    assert r.content == content
    if isinstance(value, ToolResult):
        assert r is value


async def test_cancellation_propagates():
    @tool
    async def slow() -> str:
        await asyncio.sleep(10)
        return ""

    task = asyncio.create_task(call_tool(slow, {}, timeout=None))
    await asyncio.sleep(0.01)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


async def test_broken_validate_is_contained():
    class Broken(Echo):
        def validate(self, arguments):
            raise KeyError("oops")

    r = await call_tool(Broken(), {"text": "x"}, timeout=5)
    assert r.is_error and "KeyError" in r.content


# --- validation -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ({}, "echo: missing required argument 'text'"),
        ({"text": 3}, "echo: argument 'text' must be a string, got integer 3"),
        ({"text": None}, "echo: argument 'text' must be a string, got null"),
        ({"text": "a", "times": True}, "echo: argument 'times' must be an integer, got boolean true"),
        ({"text": "a", "times": 1.5}, "echo: argument 'times' must be an integer, got number 1.5"),
        ({"text": "a", "times": "2"}, "echo: argument 'times' must be an integer, got string '2'"),
        (
            {"text": "a", "colour": 1},
            "echo: unknown argument 'colour' (expected: 'text', 'times', 'point', 'anything')",
        ),
        ({"text": "a", "point": [1, 2]}, "echo: argument 'point' must be an object, got array"),
        ({"text": "a", "point": {"x": 1}}, "echo: missing required argument 'point.y'"),
        ({"text": "a", "point": {"x": 1, "y": "2"}}, "echo: argument 'point.y' must be a number, got string '2'"),
        ({"text": "a", "point": {"x": 1, "y": 2, "z": 3}}, "echo: unknown argument 'point.z' (expected: 'x', 'y')"),
        ([], "echo: arguments must be a JSON object, got array"),
        ("text", "echo: arguments must be a JSON object, got string 'text'"),
    ],
)
def test_validation_errors(args, message):
    with pytest.raises(ToolError) as info:
        Echo().validate(args)
    assert str(info.value) == message


def test_validation_coerces_and_copies():
    args = {"text": "a", "times": 2.0, "point": {"x": 1, "y": 2.5}, "anything": [object()]}
    out = Echo().validate(args)
    assert out["times"] == 2 and isinstance(out["times"], int)
    assert out["point"] == {"x": 1.0, "y": 2.5} and isinstance(out["point"]["x"], float)
    assert args["point"]["x"] == 1 and isinstance(args["point"]["x"], int)  # input untouched


def test_validation_enum_nullable_and_nested_arrays():
    v = search.validate
    assert v({"query": "q", "tags": None, "site": None, "filters": {"a": 1}}) == {
        "query": "q",
        "tags": None,
        "site": None,
        "filters": {"a": 1},
    }
    with pytest.raises(ToolError, match=r"argument 'mode' must be one of \"web\", \"news\", got string 'blog'"):
        v({"query": "q", "mode": "blog"})
    with pytest.raises(ToolError, match=r"argument 'tags\[1\]' must be a string, got integer 2"):
        v({"query": "q", "tags": ["a", 2]})
    with pytest.raises(ToolError, match=r"argument 'tags' must be an array or null, got string"):
        v({"query": "q", "tags": "a"})
    with pytest.raises(ToolError, match=r"argument 'filters.a' must be an integer, got string"):
        v({"query": "q", "filters": {"a": "1"}})
    with pytest.raises(ToolError, match="must be a boolean, got integer 1"):
        v({"query": "q", "exact": 1})


def test_enum_distinguishes_bool_from_int():
    @tool
    def f(level: Literal[1, 2]) -> str:
        return ""

    assert f.validate({"level": 1}) == {"level": 1}
    with pytest.raises(ToolError):
        f.validate({"level": True})


def test_tool_without_parameters_rejects_arguments():
    class NoArgs(Tool):
        name = "now"

        async def __call__(self) -> str:
            return "12:00"

    assert NoArgs().validate({}) == {}
    with pytest.raises(ToolError, match="unknown argument 'x'"):
        NoArgs().validate({"x": 1})


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=5),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=10,
)


@settings(max_examples=200, deadline=None)
@given(st.dictionaries(st.sampled_from(["text", "times", "point", "anything", "x"]), json_values) | json_values)
def test_validate_raises_only_tool_error(args):
    for t in (Echo(), search, add):
        try:
            out = t.validate(args)
        except ToolError as e:
            assert str(e).startswith(f"{t.name}: ")
        else:
            assert isinstance(out, dict)
