"""Countdown: reach a target number with + - * / over a few given numbers (single turn, verified).

The model gets 3-6 numbers and a target and answers with one arithmetic expression inside
``<answer>...</answer>`` (the *last* such tag counts; anything outside it is free reasoning). The
verifier parses the expression with :mod:`ast`, never ``eval``: only integer literals, the binary
operators ``+ - * /`` and parentheses are accepted (no ``**``, no unary minus, no decimals, no
names or calls), each given number may be used at most once (a multiset check, done *before*
evaluating, so an answer can never make the verifier compute something huge), and division is
exact (:class:`fractions.Fraction`, so ``6 / (1 - 3 / 4)`` is 24). A trailing ``= ...`` is ignored.

Reward (one step, then the episode ends):

- 1.0 when the expression is valid and equals the target;
- ``FORMAT_CREDIT`` (0.1, as in TinyZero's Countdown reward) when it is a valid expression over the
  given numbers that misses the target: enough signal for a small model to learn the format first;
- 0.0 otherwise (no tag, a disallowed token, a number not given or used too often, division by 0).

Tasks are generated locally and are solvable by construction: the target is the value of a random
expression over (most of) the numbers, kept to positive integers along the way, so the game-show
rules (positive whole intermediate results) also reach it. :func:`solve` searches those
expressions exhaustively with memoisation; :func:`solver_policy` wraps it as a scripted policy.
Measured with ``agentrl.rollout.scripted.play`` on ``tasks(100)``: the solver scores 1.00 (~1 ms a
task, 11 ms at worst; a full search that finds nothing takes ~0.2 s for 6 numbers), a policy writing
random expressions over the numbers 0.10-0.15 (format credit plus a few lucky hits), random text 0.0.
"""

from __future__ import annotations

import ast
import random
import re
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

import agentrl
from agentrl.parsing import last_tag

FORMAT_CREDIT = 0.1
MAX_ANSWER_CHARS = 200
"""Longer answers are refused before parsing: six numbers need ~40 characters, and a cap keeps a
model's runaway parentheses from costing the verifier time or recursion depth."""

_ALLOWED_CHARS = re.compile(r"[0-9+\-*/()\s]*")
_OPS = {ast.Add: "+", ast.Sub: "-", ast.Mult: "*", ast.Div: "/"}
_LARGE = (25, 50, 75, 100)


class AnswerError(ValueError):
    """Why an answer is not a valid expression over the given numbers (the message says what to fix)."""


@dataclass
class Verdict:
    """The verifier's judgement of one answer: its reward, value and the reason it failed, if it did."""

    reward: float
    correct: bool = False
    value: Fraction | None = None
    error: str | None = None


def extract_answer(text: str) -> str | None:
    """The content of the last ``<answer>...</answer>`` tag, or None when there is none."""
    return last_tag(text, "answer")


def evaluate(expression: str, numbers: Sequence[int]) -> Fraction:
    """The exact value of ``expression``; :class:`AnswerError` if it breaks the rules.

    Rules: integer literals, ``+ - * /`` and parentheses only; every literal must be one of
    ``numbers``, each used at most as often as it is given; no division by zero.
    """
    expression = expression.replace("×", "*").replace("÷", "/").replace("−", "-").split("=", 1)[0].strip()
    if not expression:
        raise AnswerError("the answer is empty")
    if len(expression) > MAX_ANSWER_CHARS:
        raise AnswerError(f"the expression is longer than {MAX_ANSWER_CHARS} characters")
    if not _ALLOWED_CHARS.fullmatch(expression):
        bad = sorted({c for c in expression if not _ALLOWED_CHARS.fullmatch(c)})
        raise AnswerError(f"only digits, + - * / and parentheses are allowed (found {''.join(bad)!r})")
    try:
        tree = ast.parse(expression, mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        raise AnswerError(f"{expression!r} is not a well-formed arithmetic expression") from None
    used = _literals(tree.body)
    extra = Counter(used) - Counter(numbers)
    if extra:
        n = sorted(extra)[0]
        raise AnswerError(f"{n} is used {used.count(n)} time(s) but given {list(numbers).count(n)} time(s)")
    try:
        return _value(tree.body)
    except ZeroDivisionError:
        raise AnswerError("the expression divides by zero") from None


def _literals(node: ast.AST) -> list[int]:
    """The integer literals of an expression tree made only of allowed nodes (AnswerError otherwise)."""
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return [node.value]
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        return _literals(node.left) + _literals(node.right)
    what = f"operator {type(node.op).__name__}" if isinstance(node, (ast.BinOp, ast.UnaryOp)) else type(node).__name__
    raise AnswerError(f"only whole numbers joined by + - * / are allowed (found {what})")


def _value(node: ast.AST) -> Fraction:
    if isinstance(node, ast.Constant):
        return Fraction(node.value)
    assert isinstance(node, ast.BinOp)
    a, b = _value(node.left), _value(node.right)
    op = type(node.op)
    return a + b if op is ast.Add else a - b if op is ast.Sub else a * b if op is ast.Mult else a / b


def score(text: str, numbers: Sequence[int], target: int) -> Verdict:
    """Score a whole assistant turn: find its answer tag, verify it, and assign the reward."""
    expression = extract_answer(text)
    if expression is None:
        return Verdict(0.0, error="no <answer>...</answer> tag")
    try:
        value = evaluate(expression, numbers)
    except AnswerError as exc:
        return Verdict(0.0, error=str(exc))
    if value == target:
        return Verdict(1.0, correct=True, value=value)
    return Verdict(FORMAT_CREDIT, value=value, error=f"the expression equals {value}, not {target}")


def make_prompt(numbers: Sequence[int], target: int) -> str:
    """The task text: the numbers, the target, the rules and the answer format."""
    return (
        f"Using the numbers {list(numbers)}, write an arithmetic expression that equals {target}. "
        "You may use +, -, * and / and parentheses, and each number at most once (you need not use all of them). "
        "Think briefly if you like, then give only the expression inside answer tags, for example "
        "<answer>(1 + 2) * 3</answer>."
    )


# -- tasks ------------------------------------------------------------------------------------------


def _combine(rng: random.Random, a: tuple[int, str], b: tuple[int, str]) -> tuple[int, str]:
    """One random positive-integer operation on two (value, expression) pairs."""
    (x, ex), (y, ey) = (a, b) if a[0] >= b[0] else (b, a)
    ops = ["+", "*"] + (["-"] if x > y else []) + (["/"] if y > 1 and x % y == 0 else [])
    op = rng.choice(ops)
    value = x + y if op == "+" else x * y if op == "*" else x - y if op == "-" else x // y
    return value, f"({ex} {op} {ey})"


def _make_task(rng: random.Random, k: int) -> dict[str, Any]:
    while True:
        numbers = [rng.choice(_LARGE) if rng.random() < 0.25 else rng.randint(1, 10) for _ in range(k)]
        items = [(n, str(n)) for n in rng.sample(numbers, rng.randint(max(2, k - 1), k))]
        while len(items) > 1:
            i, j = sorted(rng.sample(range(len(items)), 2))
            b, a = items.pop(j), items.pop(i)
            items.append(_combine(rng, a, b))
        target, expr = items[0]
        if 10 <= target <= 999 and target not in numbers:
            label = expr[1:-1] if expr.startswith("(") else expr
            return {"prompt": make_prompt(numbers, target), "label": label, "numbers": numbers, "target": target}


# -- scripted solver ------------------------------------------------------------------------------


def solve(numbers: Sequence[int], target: int) -> str | None:
    """An expression over ``numbers`` equal to ``target`` with positive whole intermediates, or None.

    Depth-first over "replace two values by one result", remembering every multiset of values
    already explored (the order values were made in does not matter), and skipping ``x * 1`` and
    ``x / 1`` (dropping the 1 reaches the same values, since numbers may go unused).
    """
    seen: set[tuple[int, ...]] = set()

    def search(items: list[tuple[int, str]]) -> str | None:
        for value, expr in items:
            if value == target:
                return expr
        key = tuple(sorted(v for v, _ in items))
        if len(items) < 2 or key in seen:
            return None
        seen.add(key)
        for i in range(len(items)):
            for j in range(i + 1, len(items)):
                rest = items[:i] + items[i + 1 : j] + items[j + 1 :]
                for made in _results(items[i], items[j]):
                    found = search(rest + [made])
                    if found is not None:
                        return found
        return None

    found = search([(n, str(n)) for n in numbers])
    return found[1:-1] if found is not None and found.startswith("(") else found


def _results(a: tuple[int, str], b: tuple[int, str]) -> list[tuple[int, str]]:
    (x, ex), (y, ey) = (a, b) if a[0] >= b[0] else (b, a)
    out = [(x + y, f"({ex} + {ey})")]
    if y > 1:
        out.append((x * y, f"({ex} * {ey})"))
        if x % y == 0:
            out.append((x // y, f"({ex} / {ey})"))
    if x > y:
        out.append((x - y, f"({ex} - {ey})"))
    return out


def solver_policy(messages: list[agentrl.Message], task: dict[str, Any]) -> str:
    """Scripted policy for :func:`agentrl.rollout.scripted.play`: answer with :func:`solve`'s expression."""
    numbers, target = task_numbers(task)
    found = solve(numbers, target)
    return f"<answer>{found}</answer>" if found is not None else "I cannot find an expression."


def random_policy(seed: int = 0) -> Callable[[list[agentrl.Message], dict[str, Any]], str]:
    """Baseline policy: a random well-formed expression over a random subset of the numbers."""

    def policy(messages: list[agentrl.Message], task: dict[str, Any]) -> str:
        rng = random.Random(f"{seed}:{task.get('prompt')}")
        numbers, _ = task_numbers(task)
        picked = rng.sample(numbers, rng.randint(2, len(numbers)))
        expr = str(picked[0])
        for n in picked[1:]:
            expr = f"({expr} {rng.choice('+-*/')} {n})"
        return f"<answer>{expr}</answer>"

    return policy


def task_numbers(task: dict[str, Any]) -> tuple[list[int], int]:
    """``(numbers, target)`` of a task row; ValueError naming the row's keys when they are missing or not integers."""
    numbers, target = task.get("numbers"), task.get("target")
    try:
        if not isinstance(numbers, (list, tuple)) or not numbers:
            raise TypeError
        parsed = [int(n) for n in numbers]
        if any(str(p) != str(n).strip() for p, n in zip(parsed, numbers)) or str(int(target)) != str(target).strip():
            raise TypeError
    except (TypeError, ValueError):
        raise ValueError(
            "a Countdown task needs 'numbers' (a non-empty list of integers) and 'target' (an integer); "
            f"got numbers={numbers!r}, target={target!r} (row keys: {sorted(task)})"
        ) from None
    return parsed, int(target)


class Countdown(agentrl.Env):
    """Write one expression over the given numbers that equals the target (reward in the module docstring)."""

    max_turns = 1

    @staticmethod
    def tasks(n: int = 64, seed: int = 0, min_numbers: int = 3, max_numbers: int = 6) -> list[dict[str, Any]]:
        """``n`` solvable tasks (deterministic for a seed): rows with prompt, label (a solution), numbers, target."""
        if not 2 <= min_numbers <= max_numbers:
            raise ValueError(f"need 2 <= min_numbers <= max_numbers, got {min_numbers}, {max_numbers}")
        rng = random.Random(seed)
        return [_make_task(rng, rng.randint(min_numbers, max_numbers)) for _ in range(n)]

    async def reset(self, *, seed: int | None = None, options: dict | None = None):
        self.task = dict(options or {})
        self.numbers, self.target = task_numbers(self.task)
        prompt = self.task.get("prompt") or make_prompt(self.numbers, self.target)
        return [{"role": "user", "content": str(prompt)}], {"numbers": self.numbers, "target": self.target}

    async def step(self, action: agentrl.Action):
        verdict = score(action.text, self.numbers, self.target)
        info = {
            "correct": verdict.correct,
            "error": verdict.error,
            "value": None if verdict.value is None else str(verdict.value),
        }
        return [], verdict.reward, True, False, info
