"""``check_env``: exercise an environment without a model and report contract violations.

First it looks at each task's first observation: the message the model answers must say something
(not empty, not a bare ``{}``), and an env that says its actions are tool calls (an ``action_schema`` attribute with
``tool_name`` and ``arguments``, as OpenEnv's MCP-style envs have) must offer the model tools, or
the model could never act. Then it plays scripted actions (the label as a final answer, a valid
call of every tool the env offers after reset, with arguments made from its schema), random text,
and malformed ones (broken JSON, an unknown tool, wrong argument types, empty and huge text)
against fresh env instances, and checks what comes back:
the shapes of ``reset``/``step`` results, exceptions, timeouts, and *blocking calls*: an async
``reset``/``step`` that holds the event loop (e.g. ``time.sleep`` or a synchronous HTTP call)
stalls every other episode of a rollout, so a loop stall above ``block_threshold`` seconds is a
violation (the scenario is replayed once first: a busy machine stalls a loop now and then, a
blocking env every time). Synchronous methods run in worker threads and cannot block the loop.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import json
import random
import string
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from agentrl.adapters.openenv_actions import is_tool_call_schema
from agentrl.env import (
    Env,
    EnvContractError,
    call_env,
    check_reset,
    check_roles_reset,
    check_roles_step,
    check_step,
    reset_once,
)
from agentrl.images import ImageError, count_images, normalize, text_of
from agentrl.parsing import Llama3JsonParser, get_parser
from agentrl.types import Action


@dataclass
class CheckResult:
    """One scenario's outcome: ``ok`` False means a contract violation (``detail`` says which)."""

    scenario: str
    ok: bool
    detail: str = ""


@dataclass
class CheckReport:
    results: list[CheckResult] = field(default_factory=list)

    @property
    def violations(self) -> list[CheckResult]:
        return [r for r in self.results if not r.ok]

    @property
    def ok(self) -> bool:
        return not self.violations

    def to_dict(self) -> dict[str, Any]:
        return {"ok": self.ok, "violations": len(self.violations), "results": [r.__dict__ for r in self.results]}

    def format(self) -> str:
        lines = [
            f"{'ok  ' if r.ok else 'FAIL'} {r.scenario}" + (f": {r.detail}" if r.detail else "") for r in self.results
        ]
        lines.append(
            f"{len(self.results) - len(self.violations)}/{len(self.results)} scenarios passed; "
            f"{len(self.violations)} contract violation(s)"
        )
        return "\n".join(lines)


def _value_for(schema: dict[str, Any], rng: random.Random) -> Any:
    t: Any = schema.get("type")
    if "enum" in schema:
        return schema["enum"][0]
    if isinstance(t, list):
        t = next((x for x in t if x != "null"), "string")
    return {
        "string": lambda: "1 + 2",
        "number": lambda: round(rng.uniform(1, 10), 2),
        "integer": lambda: rng.randint(1, 10),
        "boolean": lambda: True,
        "array": lambda: [_value_for(schema.get("items", {"type": "string"}), rng)],
        "object": lambda: {},
        "null": lambda: None,
    }.get(t, lambda: "x")()


def _wrong_value(schema: dict[str, Any]) -> Any:
    return 12345 if schema.get("type") == "string" else "not-a-" + str(schema.get("type", "value"))


def _call_writer(parser_name: str) -> Callable[[str, Any], str]:
    """How a model writes one tool call in the env's wire format (Hermes for unknown names: ``_play`` reports those)."""
    try:
        parser = get_parser(parser_name)
    except ValueError:
        parser = None
    if isinstance(parser, Llama3JsonParser):
        return lambda name, arguments: json.dumps({"name": name, "parameters": arguments})
    return lambda name, arguments: f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


def scenarios(env: Env, task: dict[str, Any], rng: random.Random) -> list[tuple[str, str]]:
    """(name, assistant text) pairs to play against ``env`` for ``task``."""
    _call_text = _call_writer(env.tool_parser)
    out = [("final answer (label)", str(task.get("label", "42")))]
    for t in env.tools:
        props = t.parameters.get("properties", {})
        good = {k: _value_for(v, rng) for k, v in props.items()}
        out.append((f"valid call of {t.name}", _call_text(t.name, good)))
        if props:
            out.append(
                (
                    f"wrong argument types for {t.name}",
                    _call_text(t.name, {k: _wrong_value(v) for k, v in props.items()}),
                )
            )
            out.append((f"missing arguments for {t.name}", _call_text(t.name, {})))
    if env.tools:  # an env without tools need not answer tool-call text with tool messages
        out += [
            ("broken JSON tool call", _call_text("calc", {"x": 1})[:-9] + "{</tool_call>"),
            ("unclosed tool call", _call_text("calc", {})[:14]),
            ("unknown tool", _call_text("no_such_tool", {"a": 1})),
        ]
    out += [
        ("empty text", ""),
        ("huge text", "lorem ipsum " * 20000),
        ("random text", "".join(rng.choice(string.printable + "éü中🙂") for _ in range(300))),
    ]
    return out


class _BlockedLoop(EnvContractError):
    """An async method stalled the event loop past the threshold (replayed once before it is reported)."""


class _LoopWatch:
    """Measures the longest event-loop stall while it runs (a 5 ms heartbeat)."""

    def __init__(self) -> None:
        self.max_lag = 0.0
        self._task: asyncio.Task | None = None

    async def _beat(self) -> None:
        while True:
            t = time.perf_counter()
            await asyncio.sleep(0.005)
            self.max_lag = max(self.max_lag, time.perf_counter() - t - 0.005)

    async def __aenter__(self) -> _LoopWatch:
        self._task = asyncio.create_task(self._beat())
        await asyncio.sleep(0)
        return self

    async def __aexit__(self, *exc: Any) -> None:
        assert self._task is not None
        await asyncio.sleep(0.01)  # let the heartbeat wake once more and record a stall that just ended
        self._task.cancel()
        try:
            await self._task
        except asyncio.CancelledError:
            pass


async def _guarded(
    what: str, fn: Callable[..., Any], *args: Any, timeout: float, block_threshold: float, **kwargs: Any
) -> Any:
    async with _LoopWatch() as watch:
        try:  # in this task (not wait_for's): a SystemExit raised in another task would stop the loop
            async with asyncio.timeout(timeout):
                result = await call_env(fn, *args, **kwargs)
        except TimeoutError:
            raise EnvContractError(f"{what} did not return within {timeout:g}s") from None
        except EnvContractError:
            raise
        except (Exception, SystemExit) as exc:
            raise EnvContractError(f"{what} raised {type(exc).__name__}: {exc}") from None
    if inspect.iscoroutinefunction(fn) and watch.max_lag > block_threshold:
        raise _BlockedLoop(f"{what} blocked the event loop for {watch.max_lag:.2f}s (use await / asyncio.to_thread)")
    return result


def _construct(factory: Callable[[], Env]) -> Env:
    """A fresh env from ``factory``; a factory that raises or returns something else is a violation."""
    try:
        env = factory()
    except (Exception, SystemExit) as exc:
        raise EnvContractError(f"constructing the env raised {type(exc).__name__}: {exc}") from None
    if not isinstance(env, Env):
        raise EnvContractError(f"the env factory returned {type(env).__name__}, not an agentrl.Env")
    return env


async def _play(
    factory: Callable[[], Env],
    task: dict,
    text: str,
    *,
    seed: int,
    max_steps: int,
    timeout: float,
    block_threshold: float,
    rng: random.Random,
) -> str:
    env = _construct(factory)
    try:
        parser = get_parser(env.tool_parser)
    except ValueError as exc:
        raise EnvContractError(f"tool_parser {env.tool_parser!r}: {exc}") from None
    steps = 0
    roles = tuple(env.roles)
    try:
        reset = await _guarded(
            "reset()", env.reset, seed=seed, options=dict(task), timeout=timeout, block_threshold=block_threshold
        )
        check_roles_reset(reset, roles) if roles else check_reset(reset)
        while True:
            role = ""
            if roles:  # a multi-role env: the scenario's text is played by whoever's turn it is
                try:
                    role = env.current_role()
                except Exception as exc:
                    raise EnvContractError(f"current_role() raised {type(exc).__name__}: {exc}") from None
                if not isinstance(role, str) or role not in roles:
                    raise EnvContractError(f"current_role() returned {role!r}; the env's roles are {list(roles)}")
            _, calls, errors = parser.parse(text)
            raw = await _guarded(
                "step()",
                env.step,
                Action(text=text, tool_calls=calls, errors=errors),
                timeout=timeout,
                block_threshold=block_threshold,
            )
            steps += 1
            if roles:
                by_role, _, terminated, truncated, _ = check_roles_step(raw, roles, role)
                for r, msgs in by_role.items():  # every role's pictures are laid down in its own ledger
                    _decodable(msgs, f"step() for role {r!r}")
                obs = by_role.get(role, [])
            else:
                obs, _, terminated, truncated, _ = check_step(raw)
                _decodable(obs, "step()")
            if calls or errors:
                answered = {m.get("tool_call_id") for m in obs if m.get("role") == "tool"}
                missing = [c.id for c in calls if c.id not in answered]
                if missing and not (terminated or truncated):
                    raise EnvContractError(f"step() answered no tool message for call id(s) {missing}")
            if terminated or truncated or steps >= max_steps:
                return f"{steps} step(s), " + (
                    "terminated" if terminated else "truncated" if truncated else "still running"
                )
            text = str(task.get("label", "done")) if rng.random() < 0.5 else "thinking..."
    finally:
        await _guarded("close()", env.close, timeout=timeout, block_threshold=block_threshold)


_BLANK = ("", "{}", "[]", "null", '""')


def _last_messages(reset: Any, roles: tuple[str, ...]) -> list[Any]:
    """The message each agent answers first (the last of its first observation)."""
    obs = reset[0]
    if roles and isinstance(obs, dict):
        return [msgs[-1] for msgs in obs.values() if msgs]
    return [obs[-1]]


def _decodable(messages: list[Any], where: str) -> None:
    """Decode the pictures as the episode loop will: one it cannot use fails every sample that meets it."""
    if count_images(messages):
        try:
            normalize(messages)
        except ImageError as exc:
            raise EnvContractError(f"{where}: {exc}") from None


async def _first_look(
    factory: Callable[[], Env], task: dict, *, seed: int, timeout: float, block_threshold: float
) -> tuple[Env, str]:
    """Reset a fresh env for ``task``: what the model sees first must say something, and an action
    schema that wants tool calls must come with tools. Returns the env (closed; its ``tools`` are
    the ones offered after reset) and a summary."""
    env = _construct(factory)
    roles = tuple(env.roles)
    guarded = functools.partial(_guarded, timeout=timeout, block_threshold=block_threshold)
    async with reset_once(env, task, seed=seed, call=guarded) as reset:
        check_roles_reset(reset, roles) if roles else check_reset(reset)
    last = _last_messages(reset, roles)
    pictures = count_images(last)
    _decodable(last, "reset()")
    if not pictures and any(text_of(m["content"]).strip() in _BLANK for m in last):
        shown = [text_of(m["content"])[:40] for m in last]
        raise EnvContractError(f"reset() shows the model nothing to act on: its last message reads {shown}")
    schema = getattr(env, "action_schema", None)
    if isinstance(schema, dict):
        if is_tool_call_schema(schema) and not env.tools:
            raise EnvContractError(
                f"the env's action schema ({schema.get('title', 'tool_name, arguments')}) takes tool calls, "
                "but the env offers the model no tools: the model cannot write a valid action"
            )
    tools = f"; {len(env.tools)} tool(s) offered: {', '.join(t.name for t in env.tools)}" if env.tools else ""
    seen = f" and {pictures} image(s)" if pictures else ""
    return env, f"{sum(len(text_of(m['content'])) for m in last)} characters{seen}{tools}"


async def _replayed(label: str, run: Callable[[], Any], rng: random.Random, report: CheckReport) -> Any:
    """Run one scenario, replaying it once after a loop stall (a busy machine can stall the loop
    once; an env that blocks it does so every time, so the replay uses the same follow-up texts)."""
    state = rng.getstate()
    for attempt in range(2):
        try:
            detail, value = await run()
            if attempt:
                detail += " (a loop stall on the first play did not recur)"
            report.results.append(CheckResult(label, True, detail))
            return value
        except _BlockedLoop as exc:
            if attempt == 0:
                rng.setstate(state)
                continue
            report.results.append(CheckResult(label, False, str(exc)))
        except EnvContractError as exc:
            report.results.append(CheckResult(label, False, str(exc)))
        return None
    return None


async def check_env(
    env_factory: Callable[[], Env],
    tasks: list[dict[str, Any]],
    *,
    step_timeout: float = 30.0,
    block_threshold: float = 0.2,
    max_steps: int = 4,
    seed: int = 0,
) -> CheckReport:
    """Look at each task's first observation, then play its :func:`scenarios` against fresh envs; return the report."""
    report = CheckReport()
    rng = random.Random(seed)
    if not tasks:
        tasks = [{"prompt": "What is 1 + 2?", "label": "3"}]
    try:
        probe = env_factory()
    except Exception as exc:
        report.results.append(CheckResult("construct env", False, f"{type(exc).__name__}: {exc}"))
        return report
    if not isinstance(probe, Env):
        report.results.append(
            CheckResult("construct env", False, f"the env factory returned {type(probe).__name__}, not an agentrl.Env")
        )
        return report
    try:
        await _guarded("close()", probe.close, timeout=step_timeout, block_threshold=block_threshold)
    except EnvContractError as exc:
        report.results.append(CheckResult("close() of an unused env", False, str(exc)))
    guard = {"timeout": step_timeout, "block_threshold": block_threshold}
    for ti, task in enumerate(tasks):

        async def look(task: dict = task, ti: int = ti) -> tuple[str, Env]:
            env, detail = await _first_look(env_factory, task, seed=seed + ti, **guard)
            return detail, env

        looked = await _replayed(f"task {ti}: first observation", look, rng, report)
        try:  # the tools the env offers once reset (an adapter learns them from its server)
            plays = scenarios(looked if looked is not None else probe, task, rng)
        except Exception as exc:  # e.g. a tool whose ``parameters`` is not a JSON-schema object
            report.results.append(
                CheckResult("build scenarios from the env's tools", False, f"{type(exc).__name__}: {exc}")
            )
            continue
        for name, text in plays:

            async def play(task: dict = task, ti: int = ti, text: str = text) -> tuple[str, None]:
                detail = await _play(env_factory, task, text, seed=seed + ti, max_steps=max_steps, rng=rng, **guard)
                return detail, None

            await _replayed(f"task {ti}: {name}", play, rng, report)
    return report
