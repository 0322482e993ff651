"""Environments: the Gymnasium-style async interface users implement, and how they are found.

An :class:`Env` has Gymnasium's verbs and 5-tuple, made async because agent environments wait on
tools, sandboxes and services: ``reset(seed=, options=) -> (messages, info)`` and
``step(action) -> (messages, reward, terminated, truncated, info)``. Observations are lists of
OpenAI-style chat messages; the action is the assistant turn (:class:`agentrl.Action`).
``options`` is the task row: every key of the JSONL line, with ``prompt`` and ``label`` always
present (taken from ``--input-key`` / ``--label-key``).

Users may write ``reset``/``step`` as plain (synchronous) functions: the SDK runs those in a worker
thread so a slow environment never blocks the other episodes sharing the event loop.

Any env may offer ``tools`` and run the model's calls with the SDK's dispatch, ``await
self.call_tools(action)`` (unknown tools, bad arguments, exceptions and timeouts become error
messages the model reads; a per-turn budget; a sandbox for sandboxed tools), and still decide for
itself when the episode ends: a game with a lookup tool is a plain :class:`Env`. :class:`ToolEnv` is
the special case that ends the episode at the first turn without a tool call and scores that answer
with ``reward(action)``.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import functools
import inspect
import math
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from concurrent.futures import Executor
from typing import Any, cast

from agentrl.images import ImageError, check_content
from agentrl.parsing import format_tool_error
from agentrl.sandbox import Sandbox, SandboxPool, default_pool
from agentrl.tool import Tool, ToolResult, call_tool, find_tool
from agentrl.types import ROLES, Action, Message

StepResult = tuple[list[Message], float, bool, bool, dict]


# -- the contract's checks (the episode loop and check-env apply them to every return) ---------


class EnvContractError(TypeError):
    """The environment returned something the Env contract does not allow."""


def check_messages(obs: Any, where: str) -> list[Message]:
    """Validate an observation (list of chat message dicts); raise :class:`EnvContractError`."""
    if not isinstance(obs, (list, tuple)):
        raise EnvContractError(f"{where} must return a list of messages, got {type(obs).__name__}")
    for i, m in enumerate(obs):
        if not isinstance(m, dict):
            raise EnvContractError(f"{where}: message {i} is {type(m).__name__}, expected a dict")
        if m.get("role") not in ROLES:
            raise EnvContractError(f"{where}: message {i} has role {m.get('role')!r}; expected one of {sorted(ROLES)}")
        if not isinstance(m.get("content"), str):
            try:  # a list of OpenAI content parts (text, images); images are decoded later, per sample
                check_content(m.get("content"), f"{where}: message {i}")
            except ImageError as exc:
                raise EnvContractError(str(exc)) from None
    return list(obs)


def check_reset(result: Any) -> tuple[list[Message], dict]:
    """``reset()``'s return, checked against the contract: ``(messages, info)``, at least one message."""
    if not isinstance(result, tuple) or len(result) != 2:
        raise EnvContractError("reset() must return (messages, info)")
    obs, info = result
    if not isinstance(info, dict):
        raise EnvContractError(f"reset() info must be a dict, got {type(info).__name__}")
    obs = check_messages(obs, "reset()")
    if not obs:
        raise EnvContractError("reset() returned no messages")
    return obs, info


def check_step(result: Any) -> StepResult:
    """``step()``'s return, checked against the contract: the 5-tuple, a finite reward, bool flags."""
    if not isinstance(result, tuple) or len(result) != 5:
        raise EnvContractError("step() must return (messages, reward, terminated, truncated, info)")
    obs, reward, terminated, truncated, info = result
    if isinstance(reward, bool) or not isinstance(reward, (int, float)) or not math.isfinite(float(reward)):
        raise EnvContractError(f"step() reward must be a finite number, got {reward!r}")
    _check_step_ending(terminated, truncated, info)
    return check_messages(obs, "step()"), float(reward), terminated, truncated, info


def _check_step_ending(terminated: Any, truncated: Any, info: Any) -> None:
    """``step()``'s flags and info, for one agent and for roles alike: two bools and a dict."""
    if not isinstance(terminated, bool) or not isinstance(truncated, bool):
        raise EnvContractError("step() terminated and truncated must be bools")
    if not isinstance(info, dict):
        raise EnvContractError(f"step() info must be a dict, got {type(info).__name__}")


def check_roles_reset(result: Any, roles: tuple[str, ...]) -> tuple[dict[str, list[Message]], dict]:
    """``reset()``'s return for an env with roles: ``({role: messages}, info)``, every role present."""
    if not isinstance(result, tuple) or len(result) != 2:
        raise EnvContractError("reset() must return ({role: messages}, info)")
    obs, info = result
    if not isinstance(info, dict):
        raise EnvContractError(f"reset() info must be a dict, got {type(info).__name__}")
    if not isinstance(obs, Mapping):
        raise EnvContractError(f"an env with roles {list(roles)} must return {{role: messages}} from reset()")
    unknown = sorted({repr(r) for r in obs if not isinstance(r, str) or r not in roles})
    if unknown:
        raise EnvContractError(f"reset() named unknown role(s) {', '.join(unknown)}; the env's roles are {list(roles)}")
    out = {}
    for role in roles:
        msgs = check_messages(obs.get(role), f"reset() for role {role!r}")
        if not msgs:
            raise EnvContractError(f"reset() gave role {role!r} no messages")
        out[role] = msgs
    return out, info


def check_roles_step(
    result: Any, roles: tuple[str, ...], acting: str
) -> tuple[dict, dict[str, float], bool, bool, dict]:
    """``step()``'s return for an env with roles; a float reward is the acting role's."""
    if not isinstance(result, tuple) or len(result) != 5:
        raise EnvContractError("step() must return ({role: messages}, reward, terminated, truncated, info)")
    obs, reward, terminated, truncated, info = result
    if not isinstance(obs, Mapping):
        raise EnvContractError(
            f"an env with roles must return {{role: messages}} from step(), got {type(obs).__name__}"
        )
    named = list(obs) + (list(reward) if isinstance(reward, Mapping) else [])
    unknown = sorted({repr(r) for r in named if not isinstance(r, str) or r not in roles})
    if unknown:
        raise EnvContractError(f"step() named unknown role(s) {', '.join(unknown)}; the env's roles are {list(roles)}")
    rewards = dict(reward) if isinstance(reward, Mapping) else {acting: reward}
    for role, r in rewards.items():
        if isinstance(r, bool) or not isinstance(r, (int, float)) or not math.isfinite(float(r)):
            raise EnvContractError(f"step() reward for role {role!r} must be a finite number, got {r!r}")
    _check_step_ending(terminated, truncated, info)
    checked = {role: check_messages(msgs, f"step() for role {role!r}") for role, msgs in obs.items()}
    return checked, {k: float(v) for k, v in rewards.items()}, terminated, truncated, info


class Env:
    """Base class for multi-turn text environments (async; sync overrides also work).

    Class attributes tune the episode loop: ``tools`` are offered to the model through the chat
    template; ``max_turns`` caps assistant turns (the run's ``--max-turns`` may lower it);
    ``step_timeout`` fails a sample whose ``reset``/``step`` takes longer (None: the run's
    ``--env-step-timeout``); ``tool_parser`` names the wire format tool calls are parsed from.

    Tools: ``step`` runs a turn's calls with ``await self.call_tools(action)``, which returns one
    ``tool`` message per call (and per call the parser could not read), and decides itself what the
    turn means for the episode, so a game can mix tool turns with moves::

        async def step(self, action):
            if action.tool_calls or action.errors:
                return await self.call_tools(action), 0.0, False, False, {}
            ...  # a move: score it, answer it, end the game or not

    Every call gets ``tool_timeout`` seconds (a tool's own ``timeout`` wins) and all calls of one turn
    together ``turn_budget`` seconds: calls past it get an error. Keep the budget below
    ``--env-step-timeout``: a turn that runs out the *step* timeout fails its sample, which is dropped
    from training, so a model that could run tools past it would learn to hide its bad samples; a
    tool timeout is instead an error the model reads and is scored for. Tools with ``sandboxed =
    True`` share the episode's sandbox, taken from ``sandbox_pool`` (None: the process's
    :func:`agentrl.sandbox.default_pool`) on first use and returned, reset, by
    :meth:`release_sandbox` (called by :meth:`close`, and by the episode loop after ``close`` even
    when a subclass forgets ``super().close()``). ``await self.sandbox()`` gives it to the subclass
    too (e.g. to run hidden tests). None of this needs ``Env.__init__`` to have run.
    """

    tools: Sequence[Tool] = ()
    max_turns: int | None = None
    step_timeout: float | None = None
    tool_parser: str = "hermes"
    roles: Sequence[str] = ()
    """Several agents in one episode (``("x", "o")``), each a *seat* of :func:`agentrl.rollout.episode.run_episode`
    with its own conversation, token ledger and sample. Then ``reset`` returns ``({role: messages}, info)``
    (every role's first conversation, non-empty); :meth:`current_role` is asked before every turn whose
    turn it is; ``step`` answers the acting role's turn with ``({role: messages}, reward, terminated,
    truncated, info)``: each role's new messages (what it reads before its next turn; the acting role's
    own turn is already in its conversation) and a reward for the acting role or a ``{role: reward}`` dict
    (a game's outcome for both players). A role's reward lands on its last turn (before its first turn:
    on that one). A role asked to act with nothing new to read, or a turn whose tool calls are not
    answered in that role's own messages of the same step, fails the episode. :meth:`rewrite_history`
    and :meth:`turn_cut_off` are called for the role about to act / the role whose turn was cut.
    ``--rollout-max-turn-len`` and ``--rollout-max-response-len`` apply to each role's own turns and
    response; the status is every role's (one role's turn cut at a length limit truncates them all, and
    ``--mask-truncated-samples`` masks them all). Empty (the default): one agent, the contract below."""
    tool_timeout: float = 30.0
    turn_budget: float = 50.0
    sandbox_pool: SandboxPool | None = None
    _sandbox: Sandbox | None = None  # the episode's, once taken (instance attributes shadow these)
    _sandbox_pool: SandboxPool | None = None

    async def reset(self, *, seed: int | None = None, options: dict | None = None) -> tuple[list[Message], dict]:
        """Start an episode for one task and return what the model sees first.

        Args:
            seed: this episode's seed, derived from ``--rollout-seed`` (``agentrl rollout``/``eval``:
                plus the sample's index; in training also offset by the step), so a rerun with the same
                seed gives each episode the same one; seed your own RNG from it.
            options: the task row: every key of its line in ``--prompt-data`` (or of the dict your
                ``tasks()`` yielded), with ``prompt`` and ``label`` always present (taken from
                ``--input-key`` / ``--label-key``).

        Returns:
            ``(messages, info)``: a non-empty list of chat messages (``role`` one of system, user,
            assistant, tool; ``content`` a str, or a list of OpenAI content parts: text and images, see
            :mod:`agentrl.images`), rendered through the chat template as the prompt
            (its tokens get loss mask 0); and a dict the loop keeps in ``sample.metadata["reset_info"]``.

        A wrong shape fails the sample with ``status_reason`` ``env_contract``; an exception (any,
        ``SystemExit`` included) fails it with ``env_error``; taking longer than ``step_timeout``
        fails it with ``env_timeout``. The run goes on in every case.
        """
        raise NotImplementedError(f"{type(self).__name__} must implement reset()")

    async def step(self, action: Action) -> StepResult:
        """Answer one assistant turn.

        Args:
            action: the model's turn: ``text`` (without the stop token), ``tool_calls`` the parser
                read from it, ``errors`` for calls it could not read (answer them too: the model
                learns from the error text), ``token_ids`` and ``finish_reason``.

        Returns:
            ``(messages, reward, terminated, truncated, info)`` as in Gymnasium:

            - ``messages``: what the model sees next (tool results as ``role: tool`` with the
              call's ``tool_call_id``, or a user turn); appended to the token ledger with loss
              mask 0. Ignored when the episode ends (terminated, truncated or its last turn).
            - ``reward``: a finite float for this turn. The sample's ``reward`` is the sum over
              turns (plus a ``--custom-rm-path`` score); each turn's is kept in
              ``Sample.turn_rewards`` (``metadata["turn_rewards"]``; for per-turn credit).
            - ``terminated``: the task is over (solved, failed, answered): the loop stops and the
              sample is ``completed`` (also when ``truncated`` is set too).
            - ``truncated``: stopped for a limit of the env's own (a budget, a timer): the loop
              stops and the sample is marked ``truncated``.
            - ``info``: a dict kept per turn in ``metadata["env_infos"]``.

        The loop also stops at ``max_turns`` or when the context is full (``truncated``). Errors are
        handled as for :meth:`reset`.
        """
        raise NotImplementedError(f"{type(self).__name__} must implement step()")

    def current_role(self) -> str:
        """With ``roles``: the role that takes the next turn (asked before every turn). Override it."""
        raise NotImplementedError(f"{type(self).__name__} declares roles: it must implement current_role()")

    async def rewrite_history(self, messages: list[Message]) -> list[Message] | None:
        """Rewrite the conversation before the next turn, or return None to keep it (the default).

        Called after every ``step`` that continues the episode, with the whole conversation so far
        (the step's observation included); with ``roles``, before a role's next turn when it was shown
        something, with that role's conversation (:meth:`current_role` names it). An env that does not
        override it costs nothing. Return a
        new list of messages to compact the context: summarise old turns, drop old tool outputs
        (:func:`agentrl.rollout.history.drop_tool_outputs`), strip earlier reasoning
        (:func:`~agentrl.rollout.history.strip_thinking`). The next turn is then prompted with the
        new conversation as the chat template renders it. When that rendering still starts with every
        token the episode holds (the rewrite only appended), the sample simply goes on; otherwise the
        episode starts a new **segment**: its own token-exact sample whose prompt is the new
        conversation, linked to the others by ``metadata["episode_id"]`` and ``metadata["segment"]``.
        Every segment carries the episode's status and reward (the sum of all turns'; with roles, the
        role's); each keeps its own turns' ``turn_rewards``; group advantages count the episode once.

        Anything but a list of chat messages fails the sample (``env_contract``), as a bad ``step``
        return does.
        """
        return None

    async def turn_cut_off(self, action: Action) -> None:
        """A turn the run's length limit cut off, which ends the episode ``truncated``; ``step`` never sees
        it. Does nothing by default (the loop then skips it): an env whose counterpart waits for every turn
        overrides it (:class:`~agentrl.proxy.ProxyEnv` answers its agent's request, ``finish_reason``
        ``"length"``). ``action`` is the turn as ``step`` would have had it."""
        return None

    async def close(self) -> None:
        """Release what the episode held (the sandbox, connections). Called once per episode;
        subclasses that override this call ``super().close()``."""
        await self.release_sandbox()

    def tool_schemas(self) -> list[dict]:
        """The OpenAI tool specs of ``tools``, as the chat template receives them."""
        return [t.schema() for t in self.tools]

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


class ToolEnv(Env):
    """An Env that answers tool calls with its tools and scores the final answer.

    ``reset`` turns the task's ``prompt`` (a string or a list of messages) into the first
    observation, after ``system_prompt`` when set, and keeps the task row in ``self.task``.
    ``step`` runs every tool call of the turn with :meth:`Env.call_tools`; a turn with no tool call
    ends the episode (``terminated``) with reward ``reward(action)``, which subclasses write (sync or
    async). An env whose episode goes on after a turn without a tool call (a game, a dialogue) is a
    plain :class:`Env` that calls :meth:`~Env.call_tools` itself.
    """

    system_prompt: str | None = None

    def __init__(self) -> None:
        self.task: dict[str, Any] = {}
        self.seed: int | None = None
        self._sandbox: Sandbox | None = None
        self._sandbox_pool: SandboxPool | None = None
        self._sandbox_lock = asyncio.Lock()

    async def reset(self, *, seed: int | None = None, options: dict | None = None) -> tuple[list[Message], dict]:
        self.task = dict(options or {})
        self.seed = seed
        prompt = self.task.get("prompt", "")
        messages: list[Message] = []
        if self.system_prompt:
            messages.append({"role": "system", "content": self.system_prompt})
        if isinstance(prompt, list):
            messages.extend(cast(Message, dict(m)) for m in prompt)  # copies: the task row stays as read
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


@contextlib.asynccontextmanager
async def reset_once(
    env: Env,
    task: Mapping[str, Any],
    *,
    seed: int | None,
    call: Callable[..., Awaitable[Any]],
    on_close_error: Callable[[BaseException], None] | None = None,
) -> AsyncIterator[Any]:
    """Reset ``env`` once for ``task``, yield what ``reset`` returned (unchecked), then close the env.

    What the model would be offered is only known once an env is reset: an adapter learns its
    server's tools when it connects, a task decides the first message. So ``check_env`` looks at a
    freshly reset env before it plays, and SFT resets one to read the tools its demonstrations call.
    Inside the block the env is live (its ``tools`` are the ones an episode would offer); it is
    closed however the block or the reset ends.

    ``call(what, method, **kwargs)`` runs ``reset()`` and ``close()``: the caller's timeout and
    error wording (``what`` names the method). A close that fails raises, replacing any error before
    it, unless ``on_close_error`` takes it: then the reset's error, or the block's result, stands.
    """
    try:
        yield await call("reset()", env.reset, seed=seed, options=dict(task))
    finally:
        try:
            await call("close()", env.close)
        except (Exception, SystemExit) as exc:  # SystemExit from a user's env included
            if on_close_error is None:
                raise
            on_close_error(exc)
