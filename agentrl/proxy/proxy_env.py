"""ProxyEnv: an agent program that calls the OpenAI API, as an agentrl episode.

Control is inverted at the env boundary: the agent owns its loop, the episode loop
(:func:`agentrl.rollout.episode.run_episode`) owns the tokens.

- ``reset`` starts the agent (a command, or ``async def run_agent(base_url, task)``) on a new session
  of the proxy and waits for its first request; the request's messages (and tools) are the first
  observation.
- the loop generates the turn on the run's engines; ``step(action)`` answers the waiting request with
  a ``ChatCompletion`` (``tool_calls`` parsed by the run's parser) and waits for the agent's next
  request, or for it to finish.
- a next request whose messages extend the conversation (the previous request + the reply, as the
  agent echoes it) is an observation: the new messages are appended to the ledger as a delta (mask 0).
  One that does not (the agent truncated, summarised or edited its history) is returned from
  :meth:`ProxyEnv.rewrite_history`: the loop renders it, keeps one sample if the rendering still
  extends the ledger's tokens, and otherwise starts a new segment (``metadata`` ``episode_id``,
  ``segment``, ``num_segments``).
- when the agent finishes (process exit, function return) ``reward(task, messages, output)`` scores
  the episode; a crash, a non-zero exit or ``agent_timeout`` fails the sample (``env_error``).
  Between two requests the agent runs its tools, so each wait is bounded by ``agent_timeout`` (the
  whole run's), not by the run's ``--env-step-timeout`` (:attr:`ProxyEnv.step_timeout`).
- a turn cut off by the run's length limit ends the episode (``truncated``): the agent still gets that
  reply, truncated, with ``finish_reason`` ``"length"`` (:meth:`ProxyEnv.turn_cut_off`), and has
  ``end_grace`` seconds to finish; any later request of its session is refused (409).
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import math
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from agentrl.env import Env, call_env
from agentrl.proxy.agent_process import AgentError, run_command
from agentrl.proxy.endpoint import Call, ProxyServer, Session, answer
from agentrl.proxy.replies import completion, reply_content, same_history
from agentrl.proxy.requests import Refusal
from agentrl.types import Action, Message

__all__ = ["REWARD_SECONDS", "AgentError", "ProxyEnv", "run_command"]

REWARD_SECONDS = 60.0
"""What :attr:`ProxyEnv.step_timeout` allows beyond ``agent_timeout``: time for ``reward()``."""


class ProxyEnv(Env):
    """An agent program written against the OpenAI API, as an episode (see :mod:`agentrl.proxy.proxy_env`).

    Give the agent as ``command`` (argv; it gets ``OPENAI_BASE_URL``/``OPENAI_API_KEY`` pointing at its
    session, the task row as JSON in ``AGENTRL_TASK`` and on stdin; its stdout is the output) or override
    :meth:`run_agent` (an ``async`` function using ``openai.AsyncOpenAI``: it shares the event loop, so
    it must not block it). Score the episode with :meth:`reward`. :meth:`define` builds such a class
    from functions. The episode ends when the agent finishes; ``max_turns`` (and the run's limits) end
    it earlier, and the agent's waiting request is then answered 409 (a turn the length limit cut off
    is answered with its truncated text, ``finish_reason`` ``"length"``).

    A tool call the policy wrote but the parser could not read (broken JSON, a missing name) reaches the
    agent as plain text: the reply's ``content`` is the whole turn, markup included, with no
    ``tool_calls`` and ``finish_reason`` ``"stop"``, as an OpenAI model's answer without a call would.
    The agent's own loop decides what that means (most treat it as the final answer); the sample keeps
    the parse error (``Action.errors``, counted in ``metadata["parse_errors"]``), so the reward can
    score it. OpenAI's API has no answer meaning "a call that did not parse".

    Every reply carries ``usage`` as the engine saw the turn (``prompt_tokens``: the tokens it read, the
    episode's ledger, which keeps the sampled tokens where a re-rendering would differ; ``completion_tokens``: the tokens
    it sampled), so agents that budget by usage (LangChain's ``usage_metadata``, the Agents SDK's
    ``Usage``) read true counts. A request with ``stream: true`` gets the same reply as server-sent events.
    """

    command: Sequence[str] | None = None
    cwd: str | None = None
    agent_timeout: float = 600.0
    """Seconds the whole agent run may take before its sample fails (``math.inf``: no limit)."""
    end_grace: float = 5.0
    """Seconds the agent may take to finish after a reply cut off by the length limit, before it is stopped."""
    max_turns: int | None = 32
    _step_timeout: float | None = None

    @property
    def step_timeout(self) -> float | None:  # type: ignore[override]
        """How long ``reset``/``step`` may wait for the agent: ``agent_timeout`` plus
        :data:`REWARD_SECONDS` for ``reward()`` (unless set). Not the run's ``--env-step-timeout``: between
        two requests the agent runs its tools, for as long as its whole run may take; its own deadline
        (``agent_timeout``) ends every wait first, failing the sample with an error naming it."""
        if self._step_timeout is not None:
            return self._step_timeout
        # inf, not None: the loop reads None as "use --env-step-timeout", which would cut the agent off
        return self.agent_timeout + REWARD_SECONDS if math.isfinite(self.agent_timeout) else math.inf

    @step_timeout.setter
    def step_timeout(self, value: float | None) -> None:
        self._step_timeout = value

    async def run_agent(self, base_url: str, task: dict[str, Any]) -> Any:
        """Run the agent against ``base_url`` (an OpenAI ``base_url``) and return its final output."""
        if not self.command:
            raise NotImplementedError(f"{type(self).__name__}: set `command` or override run_agent()")
        return await run_command(list(self.command), base_url, task, cwd=self.cwd)

    def reward(self, task: dict[str, Any], messages: list[Message], output: Any) -> float | Awaitable[float]:
        """Score a finished episode: the task row, the conversation as the agent last saw it (its last
        request plus the final reply) and the agent's output (a command's stdout). Override this, sync
        (run in a worker thread, so it may block) or ``async`` (run on the event loop: never block it)."""
        return 0.0

    @classmethod
    def define(
        cls,
        name: str,
        *,
        agent: Callable[[str, dict[str, Any]], Awaitable[Any]] | Sequence[str],
        reward: Callable[..., Any] | None = None,
        **attrs: Any,
    ) -> type[ProxyEnv]:
        """A ProxyEnv subclass from an ``async def agent(base_url, task)`` (or a command) and
        ``reward(task, messages, output)``, usable as ``--env module:Name``."""
        ns: dict[str, Any] = dict(attrs)
        if callable(agent):
            fn = agent

            async def run_agent(self: ProxyEnv, base_url: str, task: dict[str, Any]) -> Any:
                return await fn(base_url, task)

            ns["run_agent"] = run_agent
        else:
            ns["command"] = list(agent)
        if reward is not None:
            ns["reward"] = staticmethod(reward)
        return type(name, (cls,), ns)

    # -- the Env verbs ----------------------------------------------------------------------------
    async def reset(self, *, seed: int | None = None, options: dict | None = None) -> tuple[list[Message], dict]:
        self.task = dict(options or {})
        self._pending: Call | None = None
        self._rewrite: list[Message] | None = None
        self._cut_off = False
        self._server, self._session = await self.open_session()
        base = self._server.base_url(self._session)  # holds the session's token: only this agent gets it
        self._agent = asyncio.create_task(self._run(base))
        call = await self._next()
        if call is None:
            await self._finished()  # raises what the agent raised
            raise AgentError("the agent finished without calling the model")
        self._pending, self._tools = call, call.tools
        self._convo = list(call.messages)
        return copy.deepcopy(call.messages), {
            "session": self._session.id,
            "request": call.request.record(),
        }

    async def open_session(self) -> tuple[ProxyServer, Session]:
        """The session the agent talks to: a new one on the event loop's shared server. Its agent alone is
        given its base URL (which holds its token); the id in the episode's info is no credential."""
        server = await ProxyServer.shared()
        return server, server.open()

    def tool_schemas(self) -> list[dict]:
        """The tools of the agent's first request (what the chat template renders)."""
        return list(getattr(self, "_tools", []))

    async def step(self, action: Action) -> tuple[list[Message], float, bool, bool, dict]:
        await self._reply(action)
        nxt = await self._next()
        if nxt is None:
            output = await self._finished()
            reward = await call_env(self.reward, self.task, self._convo, output)
            return [], float(reward), True, False, {"output": _short(output)}
        self._pending = nxt
        if nxt.tools != self._tools:
            raise AgentError("the agent changed its tools in mid-episode; the proxy records one tool set per episode")
        info: dict[str, Any] = {"request": nxt.request.record()}
        n = len(self._convo)
        if len(nxt.messages) > n and same_history(nxt.messages[:n], self._convo):
            self._rewrite, obs = None, nxt.messages[n:]
        else:
            self._rewrite, obs, info["rewritten"] = list(nxt.messages), [], True
        self._convo = list(nxt.messages)
        return copy.deepcopy(obs), 0.0, False, False, info

    async def turn_cut_off(self, action: Action) -> None:
        """The run's length limit cut this turn off and ended the episode (the episode loop calls this
        instead of :meth:`step`): the waiting request is answered with the truncated turn,
        ``finish_reason`` ``"length"``, as an OpenAI server answers a reply that ran out of
        ``max_tokens``. The sample is ``truncated`` (``response_length``) whatever the agent does next.
        (``async``: it answers on the event loop, which a sync env method, run in a worker thread, must not.)"""
        if self._pending is not None:
            await self._reply(action)
            self._cut_off = True

    async def rewrite_history(self, messages: list[Message]) -> list[Message] | None:
        """The agent's own history when its last request did not extend the conversation."""
        rewrite, self._rewrite = self._rewrite, None
        return rewrite

    async def close(self) -> None:
        session, cut = getattr(self, "_session", None), getattr(self, "_cut_off", False)
        why = "the episode ended (a turn, length or context limit, or an error)"
        if cut:
            why = "the episode ended when a reply hit the length limit (finish_reason 'length')"
        if session is not None:
            if self._pending is not None:
                answer(self._pending, Refusal(409, why))
            self._server.drop(session, why)
        agent = getattr(self, "_agent", None)
        if agent is not None and not agent.done():
            if cut:  # let it read its last reply and finish on its own
                await asyncio.wait({agent}, timeout=self.end_grace)
            agent.cancel()
            with contextlib.suppress(BaseException):
                await agent
        await super().close()

    # -- helpers ----------------------------------------------------------------------------------
    def reply_message(self, action: Action) -> Message:
        """The assistant message the agent gets: the turn's text without the call markup (all of it
        when a call could not be parsed: see the class docstring) and its ``tool_calls``."""
        calls = [c.to_openai() for c in action.tool_calls]
        msg: Message = {"role": "assistant", "content": reply_content(action, self.tool_parser)}
        if calls:
            msg["tool_calls"] = calls
        return msg

    async def _reply(self, action: Action) -> None:
        """Answer the waiting request with the turn; the conversation is now that request + the reply."""
        call, self._pending = self._pending, None
        assert call is not None, "a turn without a waiting request"
        message = self.reply_message(action)
        answer(call, completion(call.request, action, message))
        self._convo = list(call.messages) + [_normal(message)]

    async def _run(self, base_url: str) -> Any:
        async with asyncio.timeout(self.agent_timeout if math.isfinite(self.agent_timeout) else None):
            return await self.run_agent(base_url, self.task)

    async def _next(self) -> Call | None:
        """The agent's next request, or None when it finished (or ended its session)."""
        get = asyncio.ensure_future(self._session.queue.get())
        try:
            await asyncio.wait({get, self._agent, self._session.ended}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not get.done():
                get.cancel()
        return get.result() if get.done() and not get.cancelled() else None

    async def _finished(self) -> Any:
        if not self._agent.done():  # the session was ended (POST /s/TOKEN/end): its body's output
            return self._session.ended.result().output
        exc = self._agent.exception()
        if isinstance(exc, TimeoutError):
            raise AgentError(f"the agent did not finish within agent_timeout={self.agent_timeout:g}s")
        if exc is not None:
            body = getattr(exc, "body", None)  # an openai APIStatusError: what the server said
            detail = f" ({_short(body, 500)})" if body else ""
            raise AgentError(f"the agent raised {type(exc).__name__}: {exc}{detail}") from exc
        return self._agent.result()


def _normal(message: Message) -> Message:
    """A reply as the agent sends it back (arguments as given, content a string)."""
    return {k: v for k, v in message.items() if v is not None}  # type: ignore[return-value]


def _short(value: Any, limit: int = 2000) -> Any:
    text = value if isinstance(value, str) else repr(value)
    return text if len(text) <= limit else text[:limit] + "..."
