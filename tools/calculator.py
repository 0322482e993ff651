"""A calculator tool: arithmetic on numbers, evaluated safely without ``eval``.

The expression is parsed with :mod:`ast` and walked by a small interpreter that knows numbers,
``+ - * / // % **``, unary signs, parentheses, the constants ``pi`` and ``e`` and the functions
``sqrt abs round min max``. Anything else (names, attributes, strings, comprehensions, ...) is
refused with a :class:`~agentrl.tool.ToolError` the model can read. Because the model controls
the input, sizes are capped: the expression's length, its nesting depth, exponents (``9**9**9``
is refused before it is computed) and every intermediate result's magnitude.
"""

from __future__ import annotations

import ast
import math
import operator
import warnings
from collections.abc import Callable
from typing import Any

from agentrl.tool import Tool, ToolError

__all__ = ["Calculator", "calculator", "evaluate", "format_number"]

Number = int | float

MAX_LENGTH = 1000  # characters of expression
MAX_DEPTH = 50  # nesting of operations
MAX_MAGNITUDE = 10**300  # |any intermediate result|; floats overflow at ~1.8e308 anyway
MAX_POW_BITS = 1000  # 2**1000 ~ 1e301: refuse powers whose result would need more bits

_BINOPS: dict[type[ast.operator], tuple[str, Callable[[Any, Any], Any]]] = {
    ast.Add: ("+", operator.add),
    ast.Sub: ("-", operator.sub),
    ast.Mult: ("*", operator.mul),
    ast.Div: ("/", operator.truediv),
    ast.FloorDiv: ("//", operator.floordiv),
    ast.Mod: ("%", operator.mod),
    ast.Pow: ("**", None),  # checked: see _pow
}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}
_NAMES: dict[str, Number] = {"pi": math.pi, "e": math.e}
_REFUSED_OPS = {ast.BitXor: "'^' is not supported; use ** for powers", ast.MatMult: "'@' is not supported"}
_TRANSLATE = str.maketrans({"×": "*", "÷": "/", "−": "-", "–": "-"})


def _round(x: Number, ndigits: Number | None = None) -> Number:
    if ndigits is None:
        return round(x)
    if not isinstance(ndigits, int) or abs(ndigits) > 100:
        raise ToolError("round(x, n): n must be an integer between -100 and 100")
    return round(x, ndigits)


def _sqrt(x: Number) -> float:
    if x < 0:
        raise ToolError("sqrt of a negative number")
    return math.sqrt(x)


def _min_max(fn: Callable[..., Number], name: str) -> Callable[..., Number]:
    def call(*args: Number) -> Number:
        if not args:
            raise ToolError(f"{name}() needs at least one argument")
        return fn(args)

    return call


_FUNCTIONS: dict[str, tuple[Callable[..., Number], int, int]] = {  # name: (fn, min args, max args)
    "sqrt": (_sqrt, 1, 1),
    "abs": (abs, 1, 1),
    "round": (_round, 1, 2),
    "min": (_min_max(min, "min"), 1, 100),
    "max": (_min_max(max, "max"), 1, 100),
}


def evaluate(expression: str) -> Number:
    """The value of an arithmetic expression (int when exact integer arithmetic, else float).

    Raises :class:`ToolError` for anything that is not a valid, bounded arithmetic expression,
    including division by zero.
    """
    if not isinstance(expression, str):
        raise ToolError(f"expression must be a string, got {type(expression).__name__}")
    if len(expression) > MAX_LENGTH:
        raise ToolError(f"expression is too long ({len(expression)} characters, at most {MAX_LENGTH})")
    source = expression.translate(_TRANSLATE).strip()
    if not source:
        raise ToolError("expression is empty")
    try:
        with warnings.catch_warnings():  # e.g. invalid escapes in a string literal: refused below anyway
            warnings.simplefilter("ignore")
            tree = ast.parse(source, mode="eval")
    except SyntaxError as e:
        raise ToolError(f"invalid expression: {e.msg}") from None
    except (ValueError, RecursionError, MemoryError, OverflowError) as e:
        raise ToolError(f"invalid expression: {type(e).__name__}") from None
    try:
        return _eval(tree.body, 0)
    except ToolError:
        raise
    except ZeroDivisionError:
        raise ToolError("division by zero") from None
    except (OverflowError, MemoryError):
        raise ToolError("result is too large") from None
    except RecursionError:
        raise ToolError("expression is nested too deeply") from None
    except (ValueError, TypeError, ArithmeticError) as e:
        raise ToolError(f"math error: {e}") from None


def _eval(node: ast.AST, depth: int) -> Number:
    if depth > MAX_DEPTH:
        raise ToolError(f"expression is nested too deeply (more than {MAX_DEPTH} levels)")
    if isinstance(node, ast.Constant):
        value = node.value
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ToolError(f"only numbers are allowed, got {type(value).__name__} {value!r:.40}")
        return _checked(value)
    if isinstance(node, ast.BinOp):
        op = _BINOPS.get(type(node.op))
        if op is None:
            raise ToolError(_REFUSED_OPS.get(type(node.op), f"operator {type(node.op).__name__} is not supported"))
        left, right = _eval(node.left, depth + 1), _eval(node.right, depth + 1)
        return _checked(_pow(left, right) if op[1] is None else op[1](left, right))
    if isinstance(node, ast.UnaryOp):
        fn = _UNARY.get(type(node.op))
        if fn is None:
            raise ToolError(f"unary operator {type(node.op).__name__} is not supported")
        return fn(_eval(node.operand, depth + 1))
    if isinstance(node, ast.Name):
        if node.id in _NAMES:
            return _NAMES[node.id]
        raise ToolError(f"unknown name {node.id!r} (allowed constants: {', '.join(_NAMES)})")
    if isinstance(node, ast.Call):
        return _call(node, depth)
    raise ToolError(
        f"unsupported syntax: {type(node).__name__} (only numbers, + - * / // % **, "
        f"parentheses and {', '.join(_FUNCTIONS)})"
    )


def _call(node: ast.Call, depth: int) -> Number:
    if not isinstance(node.func, ast.Name):
        raise ToolError(f"unsupported call: only the functions {', '.join(_FUNCTIONS)} can be called")
    if node.func.id not in _FUNCTIONS:
        raise ToolError(f"unknown function {node.func.id!r} (allowed: {', '.join(_FUNCTIONS)})")
    name = node.func.id
    fn, lo, hi = _FUNCTIONS[name]
    if node.keywords or any(isinstance(a, ast.Starred) for a in node.args):
        raise ToolError(f"{name}() takes plain positional arguments only")
    if not lo <= len(node.args) <= hi:
        want = str(lo) if lo == hi else f"{lo} to {hi}"
        raise ToolError(f"{name}() takes {want} argument(s), got {len(node.args)}")
    return _checked(fn(*(_eval(a, depth + 1) for a in node.args)))


def _pow(base: Number, exponent: Number) -> Number:
    """``base ** exponent`` refused when the result would exceed ~2**MAX_POW_BITS or be complex."""
    if abs(base) > 1 and exponent > 0 and exponent * math.log2(abs(base)) > MAX_POW_BITS:
        raise ToolError(f"exponent too large: {_short(base)} ** {_short(exponent)}")
    if base == 0 and exponent < 0:
        raise ToolError("division by zero (zero to a negative power)")
    if base < 0 and isinstance(exponent, float) and not exponent.is_integer():
        raise ToolError("a negative number to a fractional power is not a real number")
    return base**exponent


def _checked(value: Any) -> Number:
    if isinstance(value, complex):
        raise ToolError("result is not a real number")
    if isinstance(value, float) and math.isnan(value):
        raise ToolError("result is not a number (NaN)")
    if abs(value) > MAX_MAGNITUDE:
        raise ToolError("result is too large (magnitude above 1e300)")
    return value


def _short(x: Number) -> str:
    s = str(x) if not isinstance(x, int) or abs(x) < 10**20 else f"{float(x):.3g}"
    return s if len(s) <= 24 else s[:21] + "..."


def format_number(value: Number) -> str:
    """Canonical text: integers without ``.0``, floats to 10 significant digits without trailing zeros."""
    if isinstance(value, int) and not isinstance(value, bool):
        return str(value)
    if value.is_integer() and abs(value) < 1e15:
        return str(int(value))
    text = f"{value:.10g}"
    return "0" if text == "-0" else text


class Calculator(Tool):
    """Evaluates an arithmetic expression; see the module docstring for what is allowed."""

    name = "calculator"
    description = (
        "Evaluate an arithmetic expression and return the result. Supports numbers, + - * / // % ** "
        "(power), parentheses, pi, e and the functions sqrt, abs, round, min, max."
    )
    parameters = {
        "type": "object",
        "properties": {
            "expression": {"type": "string", "description": 'the expression, e.g. "(2 + 3) * 4 / sqrt(16)"'},
        },
        "required": ["expression"],
    }

    async def __call__(self, expression: str) -> str:  # type: ignore[override]
        return format_number(evaluate(expression))


calculator = Calculator()
