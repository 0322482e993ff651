"""One episode: reset the env, then alternate engine turns and env steps, recording every token once.

The episode is played by *seats* (:class:`Seat`): one for a single-agent env, one per role for an env
with ``roles`` (:attr:`agentrl.Env.roles`). Each seat has its own engine, conversation, token ledger
and sample; one loop serves both shapes (token in, token out):

1. ``env.reset(seed, options=task)`` gives every seat's first messages; the chat template renders
   them once into the seat's prompt ids.
2. Each turn the acting seat (``current_role()`` with roles) first lays down what the env showed it
   since its last turn, as a template *delta* (mask 0), or, after a history rewrite or a template
   break in ``--history-mode template``, as the conversation rendered again (an extension of its
   ledger, or a new *segment*: a sample of its own). Then its ledger's exact ids go to its engine and
   the returned ids are appended verbatim (mask 1, with log-probs); the text is parsed into an
   :class:`~agentrl.Action`.
3. ``env.step(action)`` answers with messages and rewards for the seats.
4. The episode ends when the env terminates or truncates, at ``max_turns``, when a turn hits its
   length limit (``--rollout-max-turn-len``), when a seat's response reaches its whole budget
   (``--rollout-max-response-len``, turns and observations together), or when the next observation
   would overflow the context or the response budget (it is then not appended). The status is
   every seat's.

Faults never escape: an env that raises, times out or breaks its contract ends the episode's samples
as ``failed``; an engine that cannot serve the turn ends them as ``aborted``. The reason is in
``sample.status_reason`` (and ``metadata["error"]``).
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import dataclasses
import inspect
import itertools
import time
import traceback
import uuid
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import Any

from agentrl.chat import ChatTemplate, TemplateError, TokenLedger
from agentrl.config import RolloutConfig
from agentrl.engines.base import Engine, EngineError, GenerateOutput
from agentrl.env import (
    Env,
    EnvContractError,
    call_env,
    check_messages,
    check_reset,
    check_roles_reset,
    check_roles_step,
    check_step,
)
from agentrl.images import ImageError
from agentrl.parsing import OpenAIToolCallsParser, get_parser, unique_call_ids
from agentrl.rollout.pictures import Pictures, observe, sampled_placeholder
from agentrl.types import Action, Message, Sample, Status
from agentrl.user_code import load_function

_BIG_OBSERVATION = 32_768
"""Observation text (characters) above which it is tokenized in a worker thread, off the event loop."""


_RUN_KEY = uuid.uuid4().hex[:12]
_EPISODE_COUNTER = itertools.count()


class _EndEpisode(Exception):
    def __init__(self, status: Status, reason: str, error: str | None = None):
        super().__init__(reason)
        self.status, self.reason, self.error = status, reason, error


@dataclass
class EpisodeContext:
    """What every episode of a run shares: engine, template, config.

    The engine may be text-in/text-out (:class:`~agentrl.engines.http.ChatCompletionsEngine`, for
    evaluating API models): then the ledger holds its local re-tokenization with zero log-probs and
    samples are marked ``token_exact=False`` (the engine's :attr:`~agentrl.engines.base.Engine.token_exact`).
    """

    engine: Engine
    template: ChatTemplate
    config: RolloutConfig
    executor: Executor | None = None
    """Threads for synchronous env methods (``generate_rollout`` sizes one to the concurrency)."""
    role_engines: dict[str, Engine] = field(default_factory=dict)
    """Roles of multi-role envs played by a fixed policy on their own engine (``--role-engine-url``)."""
    policy_engines: dict[str, Engine] = field(default_factory=dict)
    """The engine of each trained ``--policy`` a role is seated on (``--role-policy``): the run's engines, every
    request naming the policy's adapter (SGLang's ``lora_path``)."""
    role_policies: dict[str, str] = field(init=False)
    """``--role-policy`` parsed once (role -> policy), from ``config``: each seat of each episode reads it."""
    history_rewrite: Callable[..., Any] | None = None
    """The ``--history-rewrite-path`` function, loaded once per rollout (:func:`history_hook`); when None and
    the config names one, each episode loads it."""

    def __post_init__(self) -> None:
        self.role_policies = self.config.role_policies()


def history_hook(path: str | None) -> Callable[..., Any] | None:
    """Load the ``--history-rewrite-path`` function (None without the flag). A path that does not load, or a
    function that cannot take ``(messages, task)``, is a ValueError naming the flag."""
    if path is None:
        return None
    try:
        fn = load_function(path)
        inspect.signature(fn).bind([], {})
    except Exception as exc:  # noqa: BLE001 - a missing file, a syntax error, a wrong signature: one clear error
        raise ValueError(
            f"--history-rewrite-path {path}: expected module:fn, a function fn(messages, task) -> messages or None "
            f"({type(exc).__name__}: {exc})"
        ) from None
    return fn


async def _rewrite_history(
    ctx: EpisodeContext,
    env: Env,
    hook: Callable[..., Any] | None,
    convo: list[Message],
    task: dict[str, Any],
    timeout: float,
    sample: Sample,
) -> list[Message] | None:
    """The conversation after the env's ``rewrite_history()`` and then the ``--history-rewrite-path`` hook
    (each given a deep copy, so one that edits messages in place returns a new history), or None when
    neither rewrote it. What either returns is checked: a list of chat messages, not empty."""
    current: list[Message] | None = None
    steps: list[tuple[Callable[..., Any], tuple[Any, ...], str]] = []
    if type(env).rewrite_history is not Env.rewrite_history:
        steps.append((env.rewrite_history, (), "rewrite_history()"))
    if hook is not None:
        steps.append((hook, (dict(task),), f"--history-rewrite-path {ctx.config.history_rewrite_path}"))
    for fn, extra, what in steps:
        with _env_clock(sample):
            call = call_env(
                fn, copy.deepcopy(current if current is not None else convo), *extra, _executor=ctx.executor
            )
            out = await _timed(call, timeout, what)
        if out is None:
            continue
        out = check_messages(out, what)
        if not out:
            raise _EndEpisode(Status.FAILED, "env_contract", f"{what} returned no messages")
        current = out
    return current


def _turn_text(ctx: EpisodeContext, out: GenerateOutput) -> tuple[str, str | None]:
    """The turn's text without its stop token, and the stop token's text (None if not ended by one)."""
    ids = out.output_ids
    stop_ids = set(ctx.template.eos_token_ids) | set(ctx.config.rollout_stop_token_ids)
    ended_by_token = out.finish_reason == "stop" and ids and not isinstance(out.matched, str) and ids[-1] in stop_ids
    if ended_by_token:
        return ctx.template.decode(ids[:-1]), ctx.template.decode(ids[-1:])
    return ctx.template.decode(ids), None


def parse_turn(
    ctx: EpisodeContext,
    out: GenerateOutput,
    parser: Any,
    turn: int,
    seen_ids: set[str],
    *,
    prompt_length: int | None = None,
) -> tuple[Action, Message, str | None]:
    """The turn as the env receives it (an :class:`Action` with the tool calls read from it, their ids
    unique in the episode, and ``prompt_length``: the tokens the engine read before it), the assistant
    message for the conversation, and the stop token's text."""
    text, last_token_text = _turn_text(ctx, out)
    chat = out.message is not None and bool(out.message.get("tool_calls"))
    if chat:
        assert out.message is not None
        _, calls, errors = OpenAIToolCallsParser().parse_message(out.message)
    else:
        _, calls, errors = parser.parse(text)
    new_ids = unique_call_ids((*calls, *errors), turn, seen_ids)
    if chat:  # the chat message carries the same ids
        assert out.message is not None
        out.message = {
            **out.message,
            "tool_calls": [
                {**tc, "id": new_ids.get(tc.get("id"), tc.get("id"))} if isinstance(tc, dict) else tc
                for tc in out.message["tool_calls"]
            ],
        }
    action = Action(
        text=text,
        tool_calls=calls,
        errors=errors,
        token_ids=list(out.output_ids),
        finish_reason=out.finish_reason,
        prompt_length=prompt_length,
    )
    return action, (out.message if out.message is not None else action.as_message()), last_token_text


async def _within(coro: Any, timeout: float) -> Any:
    """``await coro`` with a deadline (``asyncio.timeout``: unlike ``wait_for`` it creates no extra task)."""
    async with asyncio.timeout(timeout):
        return await coro


async def _timed(coro: Any, timeout: float, what: str) -> Any:
    try:
        return await _within(coro, timeout)
    except TimeoutError:
        raise _EndEpisode(Status.FAILED, "env_timeout", f"{what} took longer than {timeout:g}s") from None
    except (_EndEpisode, asyncio.CancelledError):
        raise
    except EnvContractError as exc:
        raise _EndEpisode(Status.FAILED, "env_contract", str(exc)) from None
    except BaseException as exc:  # the user's env raised (SystemExit included): fail this sample only
        tb = traceback.format_exception(type(exc), exc, exc.__traceback__, limit=-3)
        raise _EndEpisode(
            Status.FAILED, "env_error", f"{what} raised {type(exc).__name__}: {exc}\n{''.join(tb)}"
        ) from None


@dataclass(eq=False)
class Seat:
    """One agent's side of an episode: its engine, conversation, token ledger and sample.

    A single-agent env has one seat (``role`` None); an env with ``roles`` has one per role, each with its
    own conversation as the chat template renders it (its turns are the assistant's, the rest is what the
    env showed it). :func:`run_episode` works on whichever seat acts, so every turn mechanic (budgets,
    partial rollouts, pictures, history rewrites and segments, routed experts, timing) serves every shape.
    """

    role: str | None
    engine: Engine
    """The engine of the policy that plays the seat (the run's, or a role's ``--role-engine-url``; the sample's
    :attr:`~agentrl.types.Sample.policy` names it)."""
    key: str
    """The routing key of the seat's requests: one engine serves a seat's whole episode (its prefix cache)."""
    sample: Sample
    tools: list[dict] = field(default_factory=list)
    convo: list[Message] = field(default_factory=list)
    images: list[Any] = field(default_factory=list)
    """Every image of the conversation, in order (a new segment's prompt holds them all)."""
    ledger: TokenLedger | None = None
    pictures: Pictures = field(default_factory=Pictures)
    delta_context: Any = None
    prompt_len: int = 0
    pending: list[Message] = field(default_factory=list)
    """What the env showed the seat since its last turn: laid down before its next one."""
    owed: bool = False
    """Whether a step answered the seat since its last turn (a single agent's step may show it nothing)."""
    last_token_text: str | None = None
    seen_ids: set[str] = field(default_factory=set)
    """Tool-call ids of this seat's turns (:func:`~agentrl.parsing.unique_call_ids`)."""
    checking: bool = True
    """Exact mode: whether the live segment is still checked for template breaks."""
    early_reward: float = 0.0
    """Reward given to the seat before its first turn: added to that turn."""
    done: list[tuple[Sample, TokenLedger]] = field(default_factory=list)
    """Finished segments, before the live one."""

    @property
    def who(self) -> str:
        """How errors name the seat (nothing for the single agent)."""
        return "" if self.role is None else f"role {self.role!r}: "


async def run_episode(
    ctx: EpisodeContext,
    env_factory: Callable[[], Env],
    task: dict[str, Any],
    *,
    group_index: int | None = None,
    index: int | None = None,
    seed: int | None = None,
) -> list[Sample]:
    """Run one episode of a fresh env on ``task``; never raises.

    Returns the episode's samples: one per seat that acted (one for a single-agent env, one per role for an
    env with ``roles``), and per seat one per *segment* when its history was rewritten
    (:meth:`Env.rewrite_history`, the ``--history-rewrite-path`` hook, or ``--history-mode template`` at a
    template break). A seat's segments share ``metadata["episode_id"]`` and the seat's reward;
    ``metadata["segment"]`` orders them. Every sample carries the episode's status.
    """
    cfg = ctx.config
    t0 = time.monotonic()
    key = f"{_RUN_KEY}-{next(_EPISODE_COUNTER)}"  # routing key: sticky engine per episode; the episode id
    first = _task_sample(task, group_index, index)  # the single agent's; reports an episode no seat of which acted
    env: Env | None = None
    roles: tuple[str, ...] = ()
    seats: dict[str | None, Seat] = {}
    order: list[Seat] = []  # the seats that acted, in the order they first did
    status, reason, error = Status.TRUNCATED, "max_turns", None
    closing: dict[str, Any] = {}  # close()'s errors, every sample's
    close_seconds = 0.0
    try:
        with _env_clock(first):
            env = _construct(env_factory)
        roles = tuple(env.roles)
        step_timeout = env.step_timeout or cfg.env_step_timeout
        parser = get_parser(cfg.tool_parser or env.tool_parser)
        hook = ctx.history_rewrite if ctx.history_rewrite is not None else history_hook(cfg.history_rewrite_path)
        rewrites = type(env).rewrite_history is not Env.rewrite_history or hook is not None
        with _env_clock(first):
            reset = call_env(env.reset, seed=seed, options=dict(task), _executor=ctx.executor)
            raw = await _timed(reset, step_timeout, "reset()")
            views, info = check_roles_reset(raw, roles) if roles else _one_view(check_reset(raw))
        tools = env.tool_schemas()
        for role, obs in views.items():
            seats[role] = seat = _seat(ctx, role, key, first, task)
            await _open(ctx, seat, obs, info, tools)
        if not roles:
            order.append(seats[None])
        max_turns = cfg.turn_limit(env.max_turns)
        context_len, whole = cfg.rollout_max_context_len, cfg.rollout_max_response_len
        for turn in range(max_turns):
            seat = seats[_current_role(env, roles)] if roles else seats[None]
            if seat not in order:  # a role's first turn: what it was shown before is part of its prompt
                order.append(seat)
                if seat.pending:
                    await _reopen(ctx, seat)
            elif roles and not seat.pending:
                raise EnvContractError(
                    f"role {seat.role!r} was asked to act again with nothing new to read since its last turn: "
                    "give it a message in step()'s {role: messages} first"
                )
            if seat.owed:
                await _lay_down(ctx, env, seat, hook, rewrites, task, step_timeout)
            sample, ledger = seat.sample, seat.ledger
            assert ledger is not None
            budget = cfg.rollout_max_turn_len
            if whole is not None:  # slime's budget over the whole response: this turn gets what is left
                left = whole - (len(ledger) - seat.prompt_len)
                if left < 1:
                    raise _EndEpisode(Status.TRUNCATED, "response_budget")
                budget = min(budget, left)
            if context_len is not None:
                # prompt + output stays below the context length (SGLang refuses a request that reaches it)
                budget = min(budget, context_len - 1 - len(ledger))
                if budget < 1:
                    raise _EndEpisode(Status.TRUNCATED, "context_length")
            out = await _generate_turn(ctx, seat, budget)
            meta = sample.metadata
            meta["finish_reasons"].append(out.finish_reason)
            if out.finish_reason == "length":
                hit_context = context_len is not None and len(ledger) >= context_len - 1
                spent = whole is not None and len(ledger) - seat.prompt_len >= whole
                reason = "context_length" if hit_context else "response_budget" if spent else "response_length"
                await _cut_off(ctx, env, out, parser, turn, seat, step_timeout)
                raise _EndEpisode(Status.TRUNCATED, reason)
            turn_prompt = len(ledger) - len(out.output_ids)  # what the engine read (usage.prompt_tokens)
            action, message, seat.last_token_text = parse_turn(
                ctx, out, parser, turn, seat.seen_ids, prompt_length=turn_prompt
            )
            calls, errors = action.tool_calls, action.errors
            seat.convo.append(message)
            meta["tool_calls"] += len(calls)
            meta["parse_errors"] += len(errors)
            with _env_clock(sample):
                step = call_env(env.step, action, _executor=ctx.executor)
                raw = await _timed(step, step_timeout, "step()")
                if roles:
                    shown, rewards, terminated, truncated, info = check_roles_step(raw, roles, seat.role or "")
                else:
                    obs, reward, terminated, truncated, info = check_step(raw)
                    shown, rewards = {None: obs}, {None: reward}
            sample.turn_rewards.append(0.0)
            meta["env_infos"].append(info)
            for r, value in rewards.items():
                _credit(seats[r], value)
            for r, msgs in shown.items():
                seats[r].pending += msgs
                seats[r].owed = not roles or bool(seats[r].pending)
            if terminated:
                status, reason = Status.COMPLETED, "terminated"
                break
            if truncated:
                status, reason = Status.TRUNCATED, "env_truncated"
                break
            if roles and (calls or errors):  # the acting role's calls are answered to it before anyone else acts
                answered = {m.get("tool_call_id") for m in seat.pending if m.get("role") == "tool"}
                missing = [c.id for c in (*calls, *errors) if c.id not in answered]
                if missing:
                    raise EnvContractError(
                        f"role {seat.role!r} made tool call(s) {missing} that step() left unanswered: a turn's "
                        "calls are answered in that role's messages before another role acts"
                    )
    except _EndEpisode as end:
        status, reason, error = end.status, end.reason, end.error or None
    except EnvContractError as exc:  # reset()/step()/rewrite_history()/current_role() returned the wrong shapes
        status, reason, error = Status.FAILED, "env_contract", str(exc)
    except ImageError as exc:  # an undecodable or oversized image fails its sample only
        status, reason, error = Status.FAILED, "image", str(exc)
    except asyncio.CancelledError:
        raise
    except BaseException as exc:  # an SDK bug, a parser/template surprise, a stray SystemExit: fail the sample only
        status, reason = Status.FAILED, "internal_error"
        error = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    finally:
        if env is not None:
            c0 = time.monotonic()
            await _close_env(env, closing, cfg.env_step_timeout, ctx.executor)
            close_seconds = time.monotonic() - c0
        for seat in seats.values():
            release = getattr(seat.engine, "release", None)
            if release is not None:
                release(seat.key)
    return _episode_samples(ctx, key, first, order, roles, status, reason, error, closing, close_seconds, t0)


def _episode_samples(
    ctx: EpisodeContext,
    key: str,
    first: Sample,
    order: list[Seat],
    roles: tuple[str, ...],
    status: Status,
    reason: str,
    error: str | None,
    closing: dict[str, Any],
    close_seconds: float,
    t0: float,
) -> list[Sample]:
    """Every seat's finished samples, segments in order; the episode's status, error and close errors on
    each; a seat's reward (the sum of its segments' turns) on each of its segments. An episode none of
    whose seats acted (a failed construct or reset) is reported by ``first``."""
    seconds = time.monotonic() - t0
    out: list[Sample] = []
    for seat in order:
        segments = [*seat.done, (seat.sample, seat.ledger)]
        if seat.early_reward:  # given before the seat's first turn: that turn's (even one cut before its step)
            s, led = segments[0]
            spans = len(led.model_spans) if led is not None else 0
            s.turn_rewards.extend([0.0] * (max(spans, 1) - len(s.turn_rewards)))
            s.turn_rewards[0] += seat.early_reward
        finished = [_finish(s, led, ctx, status, reason, seconds) for s, led in segments]
        if len(finished) > 1:
            total = float(sum(sum(s.turn_rewards) for s in finished))
            for k, s in enumerate(finished):
                s.reward = total
                s.episode_id, s.segment, s.num_segments = key, k, len(finished)
        finished[-1].non_generation_time += close_seconds
        out += finished
    if not out:
        if roles:
            first.episode_id = key
        first.non_generation_time += close_seconds
        out = [_finish(first, None, ctx, status, reason, seconds)]
    for s in out:
        if error is not None:
            s.metadata["error"] = error
        for k, v in closing.items():
            s.metadata.setdefault(k, v)
        if roles:
            s.metadata["num_roles"] = max(len(order), 1)
    return out


def _task_sample(task: dict[str, Any], group_index: int | None, index: int | None) -> Sample:
    """A sample of ``task`` before anything happened: the row's prompt and label, the row itself as
    ``metadata["task"]`` (written here only: what a retry of an aborted group runs again), empty per-turn
    records."""
    sample = Sample(group_index=group_index, index=index, prompt=task.get("prompt", ""), label=task.get("label"))
    sample.metadata = _segment_metadata()
    sample.metadata["task"] = dict(task)
    return sample


def _one_view(reset: tuple[list[Message], dict]) -> tuple[dict[str | None, list[Message]], dict]:
    """A single agent's reset as the seats' view: its one seat's messages."""
    obs, info = reset
    return {None: obs}, info


def _seat(ctx: EpisodeContext, role: str | None, key: str, first: Sample, task: dict[str, Any]) -> Seat:
    """The seat of ``role`` (None: the single agent, whose sample is ``first``): its engine (a role played on
    ``--role-engine-url`` is recorded, not trained), routing key and sample."""
    if role is None:
        return Seat(None, ctx.engine, key, first)
    policy = ctx.role_policies.get(role)
    if policy is not None and role not in ctx.role_engines and policy not in ctx.policy_engines:
        raise ValueError(
            f"--role-policy {role}={policy}: the episode context has no engine for policy {policy!r} (build it with "
            "agentrl.rollout.context.episode_context, which gives each policy's adapter its engine)"
        )
    engine = ctx.role_engines.get(role) or (ctx.policy_engines[policy] if policy is not None else ctx.engine)
    sample = _task_sample(task, first.group_index, first.index)
    sample.role, sample.episode_id = role, key
    sample.non_generation_time = first.non_generation_time  # constructing and resetting the env: every role waited
    if role in ctx.role_engines:  # played by another policy: that engine's
        sample.trained = False
        sample.policy = getattr(engine, "url", None) or repr(engine)  # an SGLang client's address
    elif policy is not None:  # a trained --policy: its adapter, its samples
        sample.policy = policy
    return Seat(role, engine, f"{key}-{role}", sample)


async def _open(ctx: EpisodeContext, seat: Seat, obs: list[Message], info: dict, tools: list[dict]) -> None:
    """Render the seat's first conversation into its prompt ids (a worker thread for a long one, the
    processor's for one with images) and start its ledger."""
    obs, images = await _observe(obs)
    sample = seat.sample
    sample.prompt = obs
    sample.metadata["reset_info"] = info
    sample.token_exact = seat.engine.token_exact
    seat.tools = tools
    try:
        if images or ctx.template.vision is not None:  # the processor, in a worker thread
            try:
                _, expanded = await asyncio.to_thread(ctx.template.prompt_images, obs, images, tools)
            except TemplateError as exc:
                raise _EndEpisode(Status.FAILED, "image" if images else "template", str(exc)) from None
            prompt_ids = expanded.ids
            seat.pictures.add(images, expanded, sample)
        elif _long(obs, tools):  # seconds of tokenizing (a many-MiB first message) must not stall every episode
            _, prompt_ids = await asyncio.to_thread(ctx.template.prompt, obs, tools)
        else:
            _, prompt_ids = ctx.template.prompt(obs, tools)
        seat.delta_context = ctx.template.delta_context(tools, obs)
    except TemplateError as exc:
        raise _EndEpisode(Status.FAILED, "template", str(exc)) from None
    seat.convo, seat.images = list(obs), list(images)
    seat.ledger = TokenLedger(prompt_ids)
    seat.prompt_len = len(seat.ledger)


async def _reopen(ctx: EpisodeContext, seat: Seat) -> None:
    """A role shown messages before its first turn: they join its prompt, which is rendered again (once)."""
    obs, images = await _observe(seat.pending)
    seat.pending, seat.owed = [], False
    seat.convo += obs
    seat.images += images
    seat.sample.prompt = list(seat.convo)
    _restart(ctx, seat, *await _render_prompt(ctx, seat.convo, seat.tools, seat.images))


def _restart(ctx: EpisodeContext, seat: Seat, rendered: list[int], expanded: Any) -> None:
    """Start the seat's ledger over from its conversation as the template renders it (``rendered``, and the
    processor's :class:`~agentrl.vlm.Expanded` for a vision model, else None): a role's first prompt after it
    was shown messages, or a new segment's. Its pictures and delta context follow the new prompt."""
    seat.ledger = TokenLedger(rendered)
    seat.prompt_len, seat.checking = len(rendered), True
    seat.pictures = Pictures()
    if expanded is not None:
        seat.pictures.add(seat.images, expanded, seat.sample)
    try:
        seat.delta_context = ctx.template.delta_context(seat.tools, seat.convo)
    except TemplateError as exc:
        raise _EndEpisode(Status.FAILED, "template", str(exc)) from None


def _current_role(env: Env, roles: tuple[str, ...]) -> str:
    """Whose turn it is (``current_role()``, the user's code: one that raises fails the episode)."""
    try:
        role = env.current_role()
    except Exception as exc:
        raise _EndEpisode(Status.FAILED, "env_error", f"current_role() raised {type(exc).__name__}: {exc}") from None
    if not isinstance(role, str) or role not in roles:
        raise EnvContractError(f"current_role() returned {role!r}; the env's roles are {list(roles)}")
    return role


def _credit(seat: Seat, value: float) -> None:
    """A reward the env gave the seat: its last turn's (the turn just stepped, or the last one before
    another role's step rewarded it), or its first turn's when it has not acted yet."""
    for s in (seat.sample, *(done for done, _ in reversed(seat.done))):
        if s.turn_rewards:
            s.turn_rewards[-1] += value
            return
    seat.early_reward += value


async def _lay_down(
    ctx: EpisodeContext,
    env: Env,
    seat: Seat,
    hook: Callable[..., Any] | None,
    rewrites: bool,
    task: dict[str, Any],
    timeout: float,
) -> None:
    """What the env showed the seat since its last turn, into its ledger before its next turn.

    The messages are appended as the chat template's *delta* (mask 0), unless the history is rewritten
    (the env's ``rewrite_history()``, then the hook) or, with ``--history-mode template``, the template
    renders the conversation differently from the tokens held (a template break): then the conversation
    as rendered now either extends the ledger (the same sample goes on) or starts a new segment. Raises
    :class:`_EndEpisode` when the observation cannot fit the context or the response budget."""
    cfg = ctx.config
    context_len, whole = cfg.rollout_max_context_len, cfg.rollout_max_response_len
    obs, images = await _observe(seat.pending)
    seat.pending, seat.owed = [], False
    sample, ledger = seat.sample, seat.ledger
    assert ledger is not None
    meta = sample.metadata
    seat.convo.extend(obs)
    seat.images.extend(images)
    rewritten = None
    if rewrites:
        rewritten = await _rewrite_history(ctx, env, hook, seat.convo, task, timeout, sample)
        if rewritten is not None:
            rewritten, rewritten_images = await _observe(rewritten)  # its pictures as data URLs, as convo's
            if rewritten == seat.convo:
                rewritten = None  # nothing changed: the sample goes on as if there was no rewrite
            else:
                seat.convo, seat.images = rewritten, rewritten_images
                meta["history_rewrites"] = meta.get("history_rewrites", 0) + 1
    if rewritten is None:
        try:
            delta = ctx.template.observation_delta(
                obs, seat.tools, last_token_text=seat.last_token_text, context=seat.delta_context
            )
        except TemplateError as exc:
            raise _EndEpisode(Status.FAILED, "template", str(exc)) from None
        if context_len is not None and len(ledger) + ctx.template.min_tokens(delta) >= context_len:
            raise _EndEpisode(Status.TRUNCATED, "context_length")  # cannot fit: not worth tokenizing
        expanded = None
        if images or ctx.template.vision is not None:
            expanded = await _encode_images(ctx, delta, images)
            delta_ids = expanded.ids
        else:
            delta_ids = await _encode(ctx, delta)
        if context_len is not None and len(ledger) + len(delta_ids) >= context_len:
            raise _EndEpisode(Status.TRUNCATED, "context_length")
        if whole is not None and len(ledger) + len(delta_ids) - seat.prompt_len >= whole:
            raise _EndEpisode(Status.TRUNCATED, "response_budget")  # no room left for the next turn's answer
        ledger.append_env(delta_ids)
        if expanded is not None:
            seat.pictures.add(images, expanded, sample)
    # what the chat template makes of the conversation now: the rewritten history's prompt, or (to detect a
    # template break) the whole conversation re-rendered; in exact mode only until the first break of the
    # sample (the ledger differs from then on anyway), and never when rendering fails
    if rewritten is None and not (cfg.history_mode == "template" or seat.checking):
        return
    try:
        rendered, rendered_expanded = await _render_prompt(ctx, seat.convo, seat.tools, seat.images)
    except _EndEpisode:
        if rewritten is not None or cfg.history_mode == "template":
            raise
        meta["template_check_error"] = True  # the template cannot re-render this history: keep the tokens
        seat.checking = False
        return
    pictures = seat.pictures
    same_pictures = [im.digest for im in seat.images[: len(pictures.images)]] == [
        im.digest for im in pictures.images
    ]  # a picture swapped for another of its size leaves the placeholder ids as they were
    if rendered[: len(ledger)] == ledger.tokens and same_pictures:  # an extension of the ledger: one sample
        if rewritten is not None:
            if context_len is not None and len(rendered) >= context_len:
                raise _EndEpisode(Status.TRUNCATED, "context_length")
            if whole is not None and len(rendered) - seat.prompt_len >= whole:
                raise _EndEpisode(Status.TRUNCATED, "response_budget")
            ledger.append_env(rendered[len(ledger) :])
            if rendered_expanded is not None and len(rendered_expanded.pixels) > len(pictures.images):
                new = len(pictures.images)  # the rewrite's new images sit in the appended tail
                tail = dataclasses.replace(
                    rendered_expanded,
                    pixels=rendered_expanded.pixels[new:],
                    num_tokens=rendered_expanded.num_tokens[new:],
                )
                pictures.add(seat.images[new:], tail, sample)
        return
    if rewritten is None:
        meta["template_breaks"] = meta.get("template_breaks", 0) + 1
        if cfg.history_mode != "template":
            seat.checking = False
            return  # keep the rollout's exact tokens (the default)
    # a new segment: its prompt is the conversation as the template renders it now
    if context_len is not None and len(rendered) >= context_len:
        raise _EndEpisode(Status.TRUNCATED, "context_length")
    seat.done.append((sample, ledger))
    seat.sample = _next_segment(sample, seat.convo)
    _restart(ctx, seat, rendered, rendered_expanded)


async def _cut_off(
    ctx: EpisodeContext, env: Env, out: GenerateOutput, parser: Any, turn: int, seat: Seat, timeout: float
) -> None:
    """Hand a turn the length limit cut off to an env that overrides :meth:`Env.turn_cut_off` (``step`` never
    sees such a turn): :class:`~agentrl.proxy.ProxyEnv`'s agent is waiting for it, as an OpenAI reply with
    ``finish_reason`` ``"length"``. The episode ends ``truncated`` either way."""
    if type(env).turn_cut_off is not Env.turn_cut_off:
        assert seat.ledger is not None
        prompt_length = len(seat.ledger) - len(out.output_ids)
        action = parse_turn(ctx, out, parser, turn, seat.seen_ids, prompt_length=prompt_length)[0]
        with _env_clock(seat.sample):
            await _timed(call_env(env.turn_cut_off, action, _executor=ctx.executor), timeout, "turn_cut_off()")


MAX_RESUMES = 16
"""``--partial-rollout``: how many aborts one turn may survive (a push per resume) before it ends aborted."""


async def _generate_turn(ctx: EpisodeContext, seat: Seat, budget: int) -> GenerateOutput:
    """One assistant turn of ``seat`` on its engine, into its ledger: the engine's ids verbatim (mask 1,
    log-probs) and its weight version in the sample's ``weight_versions``.

    ``--partial-rollout`` on a token-exact engine: an aborted request (a weight push pausing the
    engine) keeps what it sampled and the turn continues from there with the same budget minus those
    tokens, on whatever weights the engine then serves; ``metadata["version_spans"]`` maps each
    ``weight_versions`` entry to its tokens. The returned output is the whole turn.
    """
    cfg = ctx.config
    sample, ledger, engine, image_data = seat.sample, seat.ledger, seat.engine, seat.pictures.urls
    assert ledger is not None
    resume = cfg.partial_rollout and engine.token_exact
    turn_ids: list[int] = []
    turn_lps: list[float] = []
    for attempt in range(MAX_RESUMES + 1):
        try:
            out = await engine.generate_turn(
                ledger.tokens,
                cfg.sampling(budget - len(turn_ids)),
                key=seat.key,
                messages=seat.convo,
                tools=seat.tools,
                **({"image_data": image_data} if image_data else {}),
            )
        except EngineError as exc:
            raise _EndEpisode(Status.ABORTED, "engine_error", f"{seat.who}{exc}") from None
        if out.finish_reason == "abort" and not resume:
            raise _EndEpisode(Status.ABORTED, "engine_abort", f"{seat.who}{out.matched or ''}")
        start = len(ledger.response_ids)
        ledger.append_model(out.output_ids, out.output_logprobs, continues_turn=attempt > 0)
        turn_ids += out.output_ids
        turn_lps += out.output_logprobs
        if out.routed_experts is not None:  # the reply covers every token forwarded so far: keep the latest
            sample.rollout_routed_experts = out.routed_experts.reshape(max(len(ledger) - 1, 0), -1)
        if out.output_ids or out.finish_reason != "abort":
            sample.weight_versions.append(out.weight_version)
            if resume:  # which tokens each version sampled (without resumes: one entry per turn_spans entry)
                sample.metadata.setdefault("version_spans", []).append([start, len(ledger.response_ids)])
        if out.spec is not None:
            sample.spec_info.add(out.spec)
        if sampled_placeholder(ctx, out.output_ids):  # after the turn's bookkeeping, before a resume sends it back
            raise _EndEpisode(
                Status.FAILED,
                "image_token_sampled",
                f"{seat.who}the policy sampled the image placeholder token {ctx.template.vision.marker!r}: later requests "
                "and the trainer would take it for a picture that does not exist",
            )
        if out.finish_reason != "abort":
            return dataclasses.replace(out, output_ids=turn_ids, output_logprobs=turn_lps)
        # what a restart would have sampled again: every token of the episode so far (earlier turns included)
        meta = sample.metadata
        meta["partial_resumes"] = meta.get("partial_resumes", 0) + 1
        meta["partial_tokens_saved"] = meta.get("partial_tokens_saved", 0) + sum(ledger.loss_mask)
        if len(turn_ids) >= budget:  # the abort came at the budget: the turn is as long as it may be
            return dataclasses.replace(out, output_ids=turn_ids, output_logprobs=turn_lps, finish_reason="length")
    raise _EndEpisode(
        Status.ABORTED, "engine_abort", f"the turn was aborted {MAX_RESUMES + 1} times (--partial-rollout)"
    )


def _segment_metadata() -> dict[str, Any]:
    """A segment's own per-turn records (the sample's ``metadata`` starts with these)."""
    return {"turn_rewards": [], "finish_reasons": [], "env_infos": [], "tool_calls": 0, "parse_errors": 0}


def _next_segment(prev: Sample, convo: list[Message]) -> Sample:
    """The sample that continues a seat's episode after a history rewrite: same group, index, task and seat,
    the rewritten conversation as its prompt, fresh per-turn records."""
    meta = _segment_metadata()
    for k in ("task", "reset_info", "role", "trained", "policy", "episode_id"):
        if k in prev.metadata:
            meta[k] = prev.metadata[k]
    nxt = Sample(group_index=prev.group_index, index=prev.index, prompt=list(convo), label=prev.label)
    nxt.metadata = meta
    nxt.token_exact = prev.token_exact
    return nxt


async def _observe(obs: list[Message]) -> tuple[list[Message], list[Any]]:
    """:func:`~agentrl.rollout.pictures.observe`; an image that cannot be used fails the sample."""
    try:
        return await observe(obs)
    except ImageError as exc:
        raise _EndEpisode(Status.FAILED, "image", str(exc)) from None


async def _encode_images(ctx: EpisodeContext, text: str, images: list[Any]) -> Any:
    """An observation delta's ids with its images' placeholders (the processor, in a worker thread)."""
    try:
        return await asyncio.to_thread(ctx.template.encode_images, text, images)
    except TemplateError as exc:
        raise _EndEpisode(Status.FAILED, "image" if images else "template", str(exc)) from None


async def _encode(ctx: EpisodeContext, text: str) -> list[int]:
    if len(text) > _BIG_OBSERVATION:  # seconds of tokenizing must not stall every other episode
        return await asyncio.to_thread(ctx.template.encode, text)
    return ctx.template.encode(text)


def _long(messages: Sequence[Message], tools: Sequence[dict]) -> bool:
    """Whether a conversation's text, its tool schemas included, is over :data:`_BIG_OBSERVATION`
    characters: long enough that rendering and tokenizing it belong in a worker thread."""
    size = sum(len(str(m.get("content") or "")) for m in messages)
    return size > _BIG_OBSERVATION or bool(tools) and size + len(str(tools)) > _BIG_OBSERVATION


async def _render_prompt(
    ctx: EpisodeContext, convo: list[Message], tools: list[dict], images: list[Any]
) -> tuple[list[int], Any]:
    """The chat template's prompt ids for the whole conversation (a worker thread when it is long or holds
    images), and for a vision model its :class:`~agentrl.vlm.Expanded` (None for a text-only one)."""
    try:
        if images or ctx.template.vision is not None:
            expanded = (await asyncio.to_thread(ctx.template.prompt_images, convo, images, tools))[1]
            return expanded.ids, expanded
        if _long(convo, tools):
            return (await asyncio.to_thread(ctx.template.prompt, convo, tools))[1], None
        return ctx.template.prompt(convo, tools)[1], None
    except Exception as exc:  # agentrl's TemplateError, or jinja's own (a template's raise_exception)
        raise _EndEpisode(Status.FAILED, "template", f"{type(exc).__name__}: {exc}") from None


@contextlib.contextmanager
def _env_clock(sample: Sample) -> Iterator[None]:
    """Add the seconds the block takes (the env's, raised or not) to ``sample.non_generation_time``."""
    t0 = time.monotonic()
    try:
        yield
    finally:
        sample.non_generation_time += time.monotonic() - t0


def _construct(factory: Callable[[], Env]) -> Env:
    """Build the episode's env (a synchronous call: a constructor cannot be timed out, only failed)."""
    try:
        env = factory()
    except BaseException as exc:  # SystemExit included: constructing one env must not end the run
        raise _EndEpisode(
            Status.FAILED, "env_error", f"constructing the env raised {type(exc).__name__}: {exc}"
        ) from None
    if not isinstance(env, Env):
        raise _EndEpisode(
            Status.FAILED, "env_contract", f"the env factory returned {type(env).__name__}, not an agentrl.Env"
        )
    return env


async def _close_env(env: Env, meta: dict[str, Any], timeout: float, executor: Executor | None) -> None:
    try:
        await _within(call_env(env.close, _executor=executor), timeout)
    except asyncio.CancelledError:
        raise
    except BaseException as exc:  # a failing close is reported, not fatal: the episode's data is kept
        meta["close_error"] = f"{type(exc).__name__}: {exc}"
    await release_episode(env, meta)


async def release_episode(env: Env, meta: dict[str, Any], timeout: float = 30.0) -> None:
    """After ``close``: give back what the episode held even if the env's ``close`` did not.

    First what the env's ``tools`` keep open: a toolset with an async ``aclose`` (MCP tools'
    per-episode sessions, i.e. server processes) is closed, so a plain :class:`~agentrl.env.Env`
    holding ``mcp_tools(...)`` leaves no server behind; then the sandbox (:func:`release_sandbox`).
    In that order because a sandboxed MCP server's transport is a session in the episode's sandbox:
    it must close while the sandbox is still this episode's, not after the pool lent it to another.
    Closing twice is harmless. A failure (or ``aclose`` past ``timeout`` seconds) is recorded in
    ``meta["close_error"]`` and never raised: the episode's data is kept and the run goes on.
    """
    try:
        aclose = getattr(getattr(env, "tools", None), "aclose", None)
        if aclose is not None and inspect.iscoroutinefunction(aclose):
            await asyncio.wait_for(aclose(), timeout)
    except asyncio.CancelledError:
        raise
    except BaseException as exc:  # the sessions are dropped anyway (their finalizer ends the servers)
        meta.setdefault("close_error", f"tools close: {type(exc).__name__}: {exc}")
    finally:
        await release_sandbox(env, meta)


async def release_sandbox(env: Env, meta: dict[str, Any]) -> None:
    """Give back a ToolEnv's sandbox even if its ``close`` override skipped ``super().close()``."""
    release = getattr(env, "release_sandbox", None)
    if release is None:
        return
    try:
        await release()
    except asyncio.CancelledError:
        raise
    except BaseException as exc:  # the pool destroyed it; the episode's data is kept
        meta.setdefault("close_error", f"sandbox release: {type(exc).__name__}: {exc}")


def _finish(
    sample: Sample, ledger: TokenLedger | None, ctx: EpisodeContext, status: Status, reason: str, seconds: float
) -> Sample:
    meta = sample.metadata
    if ledger is not None:
        sample.tokens = ledger.tokens
        sample.response_length = len(ledger.response_ids)
        sample.loss_mask = list(ledger.loss_mask)
        sample.rollout_log_probs = list(ledger.log_probs)
        sample.response = ctx.template.decode(ledger.response_ids)
        sample.turn_spans, sample.env_spans = ledger.model_spans, ledger.env_spans
        # a turn cut off at the length limit never reached env.step: it earned 0, and saying so keeps one
        # reward per turn span (what --per-turn-credit reads)
        sample.turn_rewards.extend([0.0] * (len(sample.turn_spans) - len(sample.turn_rewards)))
    else:
        sample.loss_mask, sample.rollout_log_probs = [], []
    sample.status = status
    sample.status_reason = reason
    meta["num_turns"] = len(meta["finish_reasons"])
    meta["episode_seconds"] = round(seconds, 4)
    sample.reward = float(sum(sample.turn_rewards))
    return sample
