"""The calculator tool: safe evaluation, canonical output, readable refusals."""

from __future__ import annotations

import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agentrl.tool import Tool, ToolError, call_tool
from agentrl.tools import Calculator, calculator, evaluate
from agentrl.tools.calculator import format_number


@pytest.mark.parametrize(
    ("expression", "expected"),
    [
        ("1 + 2", "3"),
        ("  2 * (3 + 4) ", "14"),
        ("6 / 2", "3"),
        ("7 / 2", "3.5"),
        ("1 / 3", "0.3333333333"),
        ("2 / 3", "0.6666666667"),
        ("0.1 + 0.2", "0.3"),
        ("7 // 2", "3"),
        ("-7 // 2", "-4"),
        ("7 % 3", "1"),
        ("2 ** 10", "1024"),
        ("2 ** -1", "0.5"),
        ("2 ** 100", "1267650600228229401496703205376"),
        ("-3", "-3"),
        ("+-+3", "-3"),
        ("1e3", "1000"),
        ("1.50", "1.5"),
        ("1e-7", "1e-07"),
        ("1e20", "1e+20"),
        ("123456789.123456", "123456789.1"),
        ("sqrt(16)", "4"),
        ("sqrt(2)", "1.414213562"),
        ("abs(-2.5)", "2.5"),
        ("round(2.567, 2)", "2.57"),
        ("round(2.5)", "2"),
        ("min(3, 1, 2)", "1"),
        ("max(3, 1.5)", "3"),
        ("pi", "3.141592654"),
        ("2 * e", "5.436563657"),
        ("3 × 4 ÷ 2 − 1", "5"),
        ("(((1)))", "1"),
        ("-0.0", "0"),
        ("4 ** 0.5", "2"),
        ("(-8) ** 2", "64"),
    ],
)
async def test_calculator_values(expression, expected):
    assert await calculator(expression=expression) == expected


@pytest.mark.parametrize(
    ("expression", "message"),
    [
        ("1 / 0", "division by zero"),
        ("1 // 0", "division by zero"),
        ("1 % 0", "division by zero"),
        ("0 ** -1", "division by zero"),
        ("9 ** 9 ** 9", "exponent too large"),
        ("2 ** 100000", "exponent too large"),
        ("10 ** 200 * 10 ** 200", "result is too large"),
        ("1e308 * 10", "result is too large"),
        ("1e400", "result is too large"),
        ("(-8) ** (1/3)", "not a real number"),
        ("sqrt(-1)", "sqrt of a negative number"),
        ("2 ^ 3", "use ** for powers"),
        ("x + 1", "unknown name 'x'"),
        ("__import__('os').system('ls')", "unsupported call: only the functions sqrt"),
        ("(1).real", "unsupported syntax: Attribute"),
        ("__import__('os')", "unknown function '__import__'"),
        ("open('f')", "unknown function 'open'"),
        ("(lambda: 1)()", "unsupported call"),
        ("lambda: 1", "unsupported syntax: Lambda"),
        ("'a' * 3", "only numbers are allowed, got str"),
        ("True + 1", "only numbers are allowed, got bool"),
        ("1j", "only numbers are allowed, got complex"),
        ("[1, 2]", "unsupported syntax: List"),
        ("1 < 2", "unsupported syntax: Compare"),
        ("1, 2", "unsupported syntax: Tuple"),
        ("not 1", "unary operator Not is not supported"),
        ("1 << 2", "operator LShift is not supported"),
        ("sqrt(1, 2)", "sqrt() takes 1 argument(s), got 2"),
        ("min()", "min() takes 1 to 100 argument(s), got 0"),
        ("round(1.5, x=1)", "plain positional arguments only"),
        ("round(5, -1000)", "n must be an integer between -100 and 100"),
        ("round(5, 1.5)", "n must be an integer"),
        ("1 +", "invalid expression"),
        ("", "expression is empty"),
        ("   ", "expression is empty"),
        ("1 + \x00", "invalid expression"),
        ("(" * 300 + "1" + ")" * 300, "invalid expression"),
        ("-" * 200 + "1", "nested too deeply"),
        ("1+" * 600 + "1", "expression is too long"),
        ("abs(" * 60 + "1" + ")" * 60, "nested too deeply"),
    ],
)
async def test_calculator_refusals(expression, message):
    with pytest.raises(ToolError) as info:
        await calculator(expression=expression)
    assert message in str(info.value)


def test_evaluate_returns_numbers():
    assert evaluate("2 + 3") == 5 and isinstance(evaluate("2 + 3"), int)
    assert evaluate("6 / 2") == 3.0 and isinstance(evaluate("6 / 2"), float)
    with pytest.raises(ToolError, match="expression must be a string"):
        evaluate(3)  # type: ignore[arg-type]


def test_format_number():
    assert format_number(3) == "3"
    assert format_number(3.0) == "3"
    assert format_number(-2.50) == "-2.5"
    assert format_number(1 / 3) == "0.3333333333"
    assert format_number(2.9999999999999996) == "3"
    assert format_number(1e15) == "1e+15"
    assert format_number(10**20) == "100000000000000000000"


def test_calculator_is_a_tool():
    assert isinstance(calculator, Tool) and isinstance(calculator, Calculator)
    spec = calculator.schema()["function"]
    assert spec["name"] == "calculator"
    assert spec["parameters"]["required"] == ["expression"]


async def test_calculator_through_call_tool():
    r = await call_tool(calculator, {"expression": "2 * 21"}, timeout=5)
    assert (r.content, r.is_error) == ("42", False)
    r = await call_tool(calculator, {"expression": "1/0"}, timeout=5)
    assert (r.content, r.is_error) == ("Error: division by zero", True)


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        ({}, "Error: calculator: missing required argument 'expression'"),
        ({"expression": 2}, "Error: calculator: argument 'expression' must be a string, got integer 2"),
        ({"expression": None}, "Error: calculator: argument 'expression' must be a string, got null"),
        (
            {"expression": "1", "precision": 3},
            "Error: calculator: unknown argument 'precision' (expected: 'expression')",
        ),
        ({"expr": "1"}, "Error: calculator: missing required argument 'expression'"),
    ],
)
async def test_calculator_bad_arguments(arguments, message):
    r = await call_tool(calculator, arguments, timeout=5)
    assert r.is_error and r.content == message


def test_large_but_allowed_values_are_fast():
    t0 = time.monotonic()
    assert len(format_number(evaluate("2 ** 990 * 3 ** 2"))) > 250
    for expr in ["9 ** 9 ** 9", "(10 ** 300) ** 2", "1.0000001 ** 1e20", "0.5 ** -1e300", "2 ** -(10 ** 100)"]:
        try:
            evaluate(expr)
        except ToolError:
            pass
    assert time.monotonic() - t0 < 1


ARITH = [
    "1",
    "0",
    "2.5",
    "1e308",
    "9",
    "(",
    ")",
    "+",
    "-",
    "*",
    "/",
    "//",
    "%",
    "**",
    " ",
    "sqrt(",
    "round(",
    "min(",
    ",",
    "pi",
    "x",
    "'",
    "^",
    "j",
    ".",
    "e",
    "1e-300",
    "abs(",
    "max(",
]


@settings(max_examples=500, deadline=None)
@given(st.text(max_size=60) | st.lists(st.sampled_from(ARITH), max_size=25).map("".join))
def test_evaluate_raises_only_tool_error(expression):
    try:
        value = evaluate(expression)
    except ToolError as e:
        assert str(e)
    else:
        assert isinstance(value, (int, float)) and not isinstance(value, bool)
        assert isinstance(format_number(value), str)


@settings(max_examples=200, deadline=None)
@given(st.integers(-(10**6), 10**6), st.integers(-(10**6), 10**6), st.sampled_from(["+", "-", "*"]))
def test_integer_arithmetic_is_exact(a, b, op):
    expected = {"+": a + b, "-": a - b, "*": a * b}[op]
    assert evaluate(f"({a}) {op} ({b})") == expected
    assert format_number(evaluate(f"({a}) {op} ({b})")) == str(expected)
