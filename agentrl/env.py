"""Environments: the Gymnasium-style async interface users implement, and how they are found.

An :class:`Env` has Gymnasium's verbs and 5-tuple, made async because agent environments wait on
tools, sandboxes and services: ``reset(seed=, options=) -> (messages, info)`` and
``step(action) -> (messages, reward, terminated, truncated, info)``. Observations are lists of
OpenAI-style chat messages; the action is the assistant turn (:class:`agentrl.Action`).
``options`` is the task row: every key of the JSONL line, with ``prompt`` and ``label`` always
present (taken from ``--input-key`` / ``--label-key``).

Users may write ``reset``/``step`` as plain (synchronous) functions: the SDK runs those in a worker
thread so a slow environment never blocks the other episodes sharing the event loop.

:class:`ToolEnv` is the common case: offer tools, run the model's tool calls, end the episode when
the model answers without one, and score that answer with ``reward(action)``.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import importlib
import importlib.util
import inspect
import sys
from collections.abc import Callable, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agentrl.parsing import format_tool_error
from agentrl.sandbox import Sandbox, SandboxPool, default_pool
from agentrl.tool import Tool, ToolResult, call_tool, find_tool
from agentrl.types import Action, Message

StepResult = tuple[list[Message], float, bool, bool, dict]


class Env:
    """Base class for multi-turn text environments (async; sync overrides also work).

    Class attributes tune the episode loop: ``tools`` are offered to the model through the chat
    template; ``max_turns`` caps assistant turns (the run's ``--max-turns`` may lower it);
    ``step_timeout`` fails a sample whose ``reset``/``step`` takes longer (None: the run's
    ``--env-step-timeout``); ``tool_parser`` names the wire format tool calls are parsed from.
    """

    tools: Sequence[Tool] = ()
    max_turns: int | None = None
    step_timeout: float | None = None
    tool_parser: str = "hermes"

    async def reset(self, *, seed: int | None = None, options: dict | None = None) -> tuple[list[Message], dict]:
        """Start an episode for the task in ``options``; return the first messages and an info dict."""
        raise NotImplementedError(f"{type(self).__name__} must implement reset()")

    async def step(self, action: Action) -> StepResult:
        """Answer the assistant turn: ``(messages, reward, terminated, truncated, info)``."""
        raise NotImplementedError(f"{type(self).__name__} must implement step()")

    async def close(self) -> None:
        """Release what the episode held (sandboxes, connections). Called once per episode."""

    def tool_schemas(self) -> list[dict]:
        """The OpenAI tool specs of ``tools``, as the chat template receives them."""
        return [t.schema() for t in self.tools]


class ToolEnv(Env):
    """An Env that answers tool calls with its tools and scores the final answer.

    ``reset`` turns the task's ``prompt`` (a string or a list of messages) into the first
    observation, after ``system_prompt`` when set, and keeps the task row in ``self.task``.
    ``step`` runs every tool call of the turn concurrently (each with its ``timeout`` or
    ``tool_timeout``) and returns one ``tool`` message per call; malformed calls, unknown tools,
    bad arguments, exceptions and timeouts become error messages the model reads. A turn with no
    tool call ends the episode (``terminated``) with reward ``reward(action)``, which subclasses
    write (sync or async).

    Tools with ``sandboxed = True`` share the episode's sandbox, taken from ``sandbox_pool`` (None:
    the process's :func:`agentrl.sandbox.default_pool`) on first use and returned, reset, by
    :meth:`release_sandbox` (called by :meth:`close`, and by the episode loop after ``close`` even
    when a subclass forgets ``super().close()``). ``await self.sandbox()`` gives it to the subclass
    too (e.g. to run hidden tests).

    ``turn_budget`` (seconds) bounds all tool calls of one turn together: each call's limit is cut
    to what is left, and calls past it get an error. Keep it below ``--env-step-timeout``: a turn
    that runs out the *step* timeout fails its sample, which is dropped from training, so a model
    that could run tools past it would learn to hide its bad samples; a tool timeout is instead an
    error the model reads and is scored for.
    """

    system_prompt: str | None = None
    tool_timeout: float = 30.0
    turn_budget: float = 50.0
    sandbox_pool: SandboxPool | None = None

    def __init__(self) -> None:
        self.task: dict[str, Any] = {}
        self.seed: int | None = None
        self._sandbox: Sandbox | None = None
        self._sandbox_pool: SandboxPool | None = None
        self._sandbox_lock = asyncio.Lock()

    async def sandbox(self) -> Sandbox:
        """The episode's sandbox (acquired from the pool on first call; the same one afterwards)."""
        sandbox = getattr(self, "_sandbox", None)
        if sandbox is None:
            pool = self.sandbox_pool or default_pool()
            sandbox = self._sandbox = await pool.acquire()
            self._sandbox_pool = pool
        return sandbox

    async def release_sandbox(self) -> None:
        """Return the episode's sandbox to its pool, which resets it. Idempotent."""
        sandbox, self._sandbox = getattr(self, "_sandbox", None), None
        pool = getattr(self, "_sandbox_pool", None)
        if sandbox is not None and pool is not None:
            await pool.release(sandbox)

    async def close(self) -> None:
        """Release the episode's sandbox; subclasses that override this call ``super().close()``."""
        await self.release_sandbox()

    async def reset(self, *, seed: int | None = None, options: dict | None = None) -> tuple[list[Message], dict]:
        self.task = dict(options or {})
        self.seed = seed
        prompt = self.task.get("prompt", "")
        messages: list[Message] = []
        if self.system_prompt:
            messages.append({"role": "system", "content": self.system_prompt})
        if isinstance(prompt, list):
            messages.extend(dict(m) for m in prompt)
        else:
            messages.append({"role": "user", "content": str(prompt)})
        return messages, {}

    async def step(self, action: Action) -> StepResult:
        if action.tool_calls or action.errors:
            messages = await self.call_tools(action)
            return (
                messages,
                0.0,
                False,
                False,
                {"tool_calls": len(action.tool_calls), "tool_errors": len(action.errors)},
            )
        reward = await maybe_await(self.reward(action))
        return [], float(reward), True, False, {}

    async def reward(self, action: Action) -> float:
        """Score the final answer (a turn without tool calls). Override this."""
        return 0.0

    async def call_tools(self, action: Action) -> list[Message]:
        """Run the turn's tool calls concurrently; one ``tool`` message per call or parse error."""

        deadline = asyncio.get_running_loop().time() + self.turn_budget

        async def one(call) -> Message:
            tool = find_tool(self.tools, call.name)
            if tool is None:
                known = ", ".join(t.name for t in self.tools) or "none"
                content = f"Error: unknown tool '{call.name}'. Available tools: {known}."
            else:
                result = await self._call(tool, call.arguments, deadline)
                content = result.content  # errors arrive as "Error: ..." text the model reads
            return {"role": "tool", "name": call.name, "tool_call_id": call.id, "content": content}

        results = list(await asyncio.gather(*(one(c) for c in action.tool_calls)))
        for err in action.errors:
            results.append({"role": "tool", "tool_call_id": err.id, "content": format_tool_error(err)})
        return results

    async def _call(self, tool: Tool, arguments: dict[str, Any], deadline: float) -> ToolResult:
        if not getattr(tool, "sandboxed", False):
            return await call_tool(tool, arguments, timeout=self.tool_timeout, max_time=self._left(deadline))
        lock = self.__dict__.setdefault("_sandbox_lock", asyncio.Lock())
        async with lock:  # one program at a time in the episode's sandbox
            sandbox = await self.sandbox()
            return await call_tool(
                tool, arguments, timeout=self.tool_timeout, sandbox=sandbox, max_time=self._left(deadline)
            )

    @staticmethod
    def _left(deadline: float) -> float:
        return max(0.0, deadline - asyncio.get_running_loop().time())


async def maybe_await(value: Any) -> Any:
    """Await ``value`` if it is awaitable (lets users write sync or async hooks)."""
    if inspect.isawaitable(value):
        return await value
    return value


async def call_env(fn: Callable[..., Any], /, *args: Any, _executor: Executor | None = None, **kwargs: Any) -> Any:
    """Call an env method: async ones directly, sync ones in a worker thread (never blocking the loop).

    ``_executor`` is the thread pool for sync methods; the episode loop passes a
    :class:`~agentrl.rollout.threads.SyncPool` as large as the rollout's concurrency, because in
    asyncio's default pool (cores + 4 threads) sync steps would queue for a thread, and that wait
    would count against their step timeout; a step that times out there is written off and replaced.
    """
    if inspect.iscoroutinefunction(fn):
        return await fn(*args, **kwargs)
    run = getattr(_executor, "run", None)  # a SyncPool: a call abandoned on timeout gives its thread back
    if run is not None:
        return await maybe_await(await run(fn, *args, **kwargs))
    call = functools.partial(contextvars.copy_context().run, fn, *args, **kwargs)
    return await maybe_await(await asyncio.get_running_loop().run_in_executor(_executor, call))


# -- finding environments -------------------------------------------------------------------------


@dataclass
class EnvSpec:
    """A registered environment id: where its class lives and default constructor kwargs."""

    id: str
    entry_point: str | Callable[..., Env]
    kwargs: dict[str, Any] = field(default_factory=dict)


registry: dict[str, EnvSpec] = {}


def register(id: str, entry_point: str | Callable[..., Env], **kwargs: Any) -> None:
    """Register an environment id (Gymnasium style), e.g. ``register("agentrl/Calculator-v0", "envs.calculator:Calculator")``."""
    registry[id] = EnvSpec(id, entry_point, kwargs)


def _import_object(spec: str) -> Any:
    module_name, sep, attr = spec.rpartition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"{spec!r}: expected MODULE:NAME, path/to/file.py:NAME or a registered id")
    if module_name.endswith(".py") or "/" in module_name:
        path = Path(module_name).expanduser().resolve()
        if not path.is_file():
            raise FileNotFoundError(f"{spec!r}: no such file {path}")
        mod_name = f"agentrl_user_{path.stem}_{abs(hash(str(path)))}"
        module = sys.modules.get(mod_name)
        if module is None:
            file_spec = importlib.util.spec_from_file_location(mod_name, path)
            assert file_spec and file_spec.loader
            module = importlib.util.module_from_spec(file_spec)
            sys.modules[mod_name] = module
            file_spec.loader.exec_module(module)
    else:
        if "" not in sys.path and str(Path.cwd()) not in sys.path:
            sys.path.insert(0, str(Path.cwd()))
        module = importlib.import_module(module_name)
    try:
        return getattr(module, attr)
    except AttributeError:
        raise AttributeError(f"{spec!r}: module {module_name!r} has no attribute {attr!r}") from None


def load_function(spec: str) -> Callable[..., Any]:
    """Load a user function given as ``module:fn`` or ``path/to/file.py:fn`` (custom generate / reward)."""
    fn = _import_object(spec)
    if not callable(fn):
        raise TypeError(f"{spec!r} is not callable")
    return fn


def _registered(spec: str) -> EnvSpec | None:
    """The registered spec for ``spec``: an id, or ``module:id`` (import module, then look up id).

    Bundled ids (``agentrl/Calculator-v0``, ...) are registered by the ``envs`` package, imported
    on first lookup of an unknown id.
    """
    if spec in registry:
        return registry[spec]
    if spec.startswith(("gym:", "openenv:")):  # adapter specs (load_env), never a module named gym/openenv
        return None
    module_name, sep, env_id = spec.partition(":")
    if sep and "/" in env_id:
        if "" not in sys.path and str(Path.cwd()) not in sys.path:
            sys.path.insert(0, str(Path.cwd()))
        importlib.import_module(module_name)
        return registry.get(env_id)
    if not sep and "/" in spec:
        try:
            importlib.import_module("envs")
        except ImportError:
            return None
        return registry.get(spec)
    return None


def load_env(spec: str | type[Env]) -> Callable[[], Env]:
    """Resolve ``MODULE:CLASS``, ``path/to/file.py:CLASS``, a registered id or ``module:id`` to an env factory.

    The factory builds one fresh env per episode, so episodes never share state. Attributes of the
    class (``tasks()``, ``tools``) stay reachable on the returned factory for registered ids too.
    Environments of other frameworks run unchanged through :mod:`agentrl.adapters`:
    ``gym:<gymnasium id>`` (optionally ``gym:module:<id>``) and ``openenv:<http://host:port>``.
    """
    if isinstance(spec, type):
        return spec
    if spec.startswith(("gym:", "openenv:")):
        from agentrl.adapters import adapter_factory

        return adapter_factory(spec)
    reg = _registered(spec)
    if reg is not None:
        target = _import_object(reg.entry_point) if isinstance(reg.entry_point, str) else reg.entry_point
        if not reg.kwargs:
            return target
        return functools.partial(target, **reg.kwargs)
    if ":" not in spec:
        known = ", ".join(sorted(registry)) or "none"
        raise ValueError(
            f"{spec!r} is neither MODULE:CLASS, path/to/file.py:CLASS, gym:ID, openenv:URL "
            f"nor a registered env id (known: {known})"
        )
    target = _import_object(spec)
    if not callable(target):
        raise TypeError(f"{spec!r} is not a class or factory")
    return target


def make(id: str, **kwargs: Any) -> Env:
    """Build one env from a registered id or a ``MODULE:CLASS`` spec (Gymnasium's ``make``)."""
    return load_env(id)(**kwargs)  # type: ignore[call-arg]
