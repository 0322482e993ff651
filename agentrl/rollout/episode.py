"""One episode: reset the env, then alternate engine turns and env steps, recording every token once.

The loop (token in, token out):

1. ``env.reset(seed, options=task)`` gives the first messages; the chat template renders them once
   into the prompt ids.
2. Each turn sends the ledger's exact ids to the engine and appends the returned ids verbatim
   (mask 1, with log-probs). The turn's text is parsed into an :class:`~agentrl.Action`.
3. ``env.step(action)`` answers; its messages are appended as a template *delta* (mask 0).
4. The episode ends when the env terminates or truncates, at ``max_turns``, when a turn hits its
   length limit (``--rollout-max-turn-len``), when the response reaches its whole budget
   (``--rollout-max-response-len``, turns and observations together), or when the next observation
   would overflow the context or the response budget (it is then not appended).

Faults never escape: an env that raises, times out or breaks its contract ends the sample as
``failed``; an engine that cannot serve the turn ends it as ``aborted``. The reason is in
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
from agentrl.env import Env, EnvContractError, call_env, check_messages, check_reset, check_step
from agentrl.images import ImageError
from agentrl.parsing import OpenAIToolCallsParser, get_parser, unique_call_ids
from agentrl.rollout.pictures import Pictures, observe, sampled_placeholder
from agentrl.types import Action, Message, Sample, Status

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
    history_rewrite: Callable[..., Any] | None = None
    """The ``--history-rewrite-path`` function, loaded once per rollout (:func:`history_hook`); when None and
    the config names one, each episode loads it."""


def history_hook(path: str | None) -> Callable[..., Any] | None:
    """Load the ``--history-rewrite-path`` function (None without the flag). A path that does not load, or a
    function that cannot take ``(messages, task)``, is a ValueError naming the flag."""
    if path is None:
        return None
    from agentrl.user_code import load_function

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

    Returns the episode's samples: one, or one per *segment* when the history was rewritten
    (:meth:`Env.rewrite_history`, or ``--history-mode template`` at a template break). Segments share
    ``metadata["episode_id"]``, the episode's status and reward; ``metadata["segment"]`` orders them.
    """
    cfg = ctx.config
    t0 = time.monotonic()
    key = f"{_RUN_KEY}-{next(_EPISODE_COUNTER)}"  # routing key: sticky engine per episode; the episode id
    sample = Sample(group_index=group_index, index=index, prompt=task.get("prompt", ""), label=task.get("label"))
    sample.metadata = _segment_metadata()
    extra = {k: v for k, v in task.items() if k not in ("prompt", "label")}
    if extra:
        sample.metadata["task"] = extra
    done: list[tuple[Sample, TokenLedger]] = []  # finished segments, before the live one
    ledger: TokenLedger | None = None
    env: Env | None = None
    status, reason = Status.TRUNCATED, "max_turns"
    try:
        with _env_clock(sample):
            env = _construct(env_factory)
        if env.roles:
            roles_env, env = env, None  # that loop closes it itself
            return await _roles_episode(ctx, roles_env, task, key, group_index, index, seed, t0)
        max_turns = cfg.turn_limit(env.max_turns)
        step_timeout = env.step_timeout or cfg.env_step_timeout
        parser = get_parser(cfg.tool_parser or env.tool_parser)
        hook = ctx.history_rewrite if ctx.history_rewrite is not None else history_hook(cfg.history_rewrite_path)
        rewrites = type(env).rewrite_history is not Env.rewrite_history or hook is not None
        with _env_clock(sample):
            reset = call_env(env.reset, seed=seed, options=dict(task), _executor=ctx.executor)
            obs, info = check_reset(await _timed(reset, step_timeout, "reset()"))
        obs, images = await _observe(obs)
        sample.prompt = obs
        sample.metadata["reset_info"] = info
        tools = env.tool_schemas()
        pictures = Pictures()
        try:
            if images or ctx.template.vision is not None:  # the processor, in a worker thread
                try:
                    _, expanded = await asyncio.to_thread(ctx.template.prompt_images, obs, images, tools)
                except TemplateError as exc:
                    raise _EndEpisode(Status.FAILED, "image" if images else "template", str(exc)) from None
                prompt_ids = expanded.ids
                pictures.add(images, expanded, sample)
            elif _long(obs, tools):  # seconds of tokenizing (a many-MiB first message) must not stall every episode
                _, prompt_ids = await asyncio.to_thread(ctx.template.prompt, obs, tools)
            else:
                _, prompt_ids = ctx.template.prompt(obs, tools)
            delta_context = ctx.template.delta_context(tools, obs)
        except TemplateError as exc:
            raise _EndEpisode(Status.FAILED, "template", str(exc)) from None
        convo_images = list(images)  # every image of the conversation, in order (a new segment's prompt holds them all)
        ledger = TokenLedger(prompt_ids)
        convo = list(obs)
        seen_ids: set[str] = set()  # tool-call ids of this episode (unique_call_ids)
        sample.token_exact = ctx.engine.token_exact
        context_len = cfg.rollout_max_context_len
        if context_len is not None and len(ledger) >= context_len:
            raise _EndEpisode(Status.TRUNCATED, "context_length")
        prompt_len, whole = len(ledger), cfg.rollout_max_response_len
        checking = True  # exact mode: is this sample still checked for template breaks
        for turn in range(max_turns):
            meta = sample.metadata
            budget = cfg.rollout_max_turn_len
            if whole is not None:  # slime's budget over the whole response: this turn gets what is left
                left = whole - (len(ledger) - prompt_len)
                if left < 1:
                    raise _EndEpisode(Status.TRUNCATED, "response_budget")
                budget = min(budget, left)
            if context_len is not None:
                # prompt + output stays below the context length (SGLang refuses a request that reaches it)
                budget = min(budget, context_len - 1 - len(ledger))
                if budget < 1:
                    raise _EndEpisode(Status.TRUNCATED, "context_length")
            out = await _generate_turn(ctx, sample, ledger, budget, key, convo, tools, pictures.urls)
            meta["finish_reasons"].append(out.finish_reason)
            if out.finish_reason == "length":
                hit_context = context_len is not None and len(ledger) >= context_len - 1
                spent = whole is not None and len(ledger) - prompt_len >= whole
                reason = "context_length" if hit_context else "response_budget" if spent else "response_length"
                await _cut_off(ctx, env, out, parser, turn, seen_ids, sample, step_timeout, len(ledger))
                raise _EndEpisode(Status.TRUNCATED, reason)
            turn_prompt = len(ledger) - len(out.output_ids)  # what the engine read (usage.prompt_tokens)
            action, message, last_token_text = parse_turn(ctx, out, parser, turn, seen_ids, prompt_length=turn_prompt)
            calls, errors = action.tool_calls, action.errors
            convo.append(message)
            meta["tool_calls"] += len(calls)
            meta["parse_errors"] += len(errors)
            with _env_clock(sample):
                step = call_env(env.step, action, _executor=ctx.executor)
                obs, reward, terminated, truncated, info = check_step(await _timed(step, step_timeout, "step()"))
            sample.turn_rewards.append(reward)
            meta["env_infos"].append(info)
            if terminated:
                status, reason = Status.COMPLETED, "terminated"
                break
            if truncated:
                status, reason = Status.TRUNCATED, "env_truncated"
                break
            if turn == max_turns - 1:
                break
            obs, images = await _observe(obs)
            convo.extend(obs)
            convo_images.extend(images)
            rewritten = None
            if rewrites:
                rewritten = await _rewrite_history(ctx, env, hook, convo, task, step_timeout, sample)
                if rewritten is not None:
                    rewritten, rewritten_images = await _observe(rewritten)  # its pictures as data URLs, as convo's
                    if rewritten == convo:
                        rewritten = None  # nothing changed: the sample goes on as if there was no rewrite
                    else:
                        convo, convo_images = rewritten, rewritten_images
                        meta["history_rewrites"] = meta.get("history_rewrites", 0) + 1
            if rewritten is None:
                try:
                    delta = ctx.template.observation_delta(
                        obs, tools, last_token_text=last_token_text, context=delta_context
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
                if whole is not None and len(ledger) + len(delta_ids) - prompt_len >= whole:
                    raise _EndEpisode(Status.TRUNCATED, "response_budget")  # no room left for the next turn's answer
                ledger.append_env(delta_ids)
                if expanded is not None:
                    pictures.add(images, expanded, sample)
            # what the chat template makes of the conversation now: the rewritten history's prompt, or (to
            # detect a template break) the whole conversation re-rendered; in exact mode only until the first
            # break of the sample (the ledger differs from then on anyway), and never when rendering fails
            if rewritten is None and not (cfg.history_mode == "template" or checking):
                continue
            try:
                rendered, rendered_expanded = await _render_prompt(ctx, convo, tools, convo_images)
            except _EndEpisode:
                if rewritten is not None or cfg.history_mode == "template":
                    raise
                meta["template_check_error"] = True  # the template cannot re-render this history: keep the tokens
                checking = False
                continue
            same_pictures = [im.digest for im in convo_images[: len(pictures.images)]] == [
                im.digest for im in pictures.images
            ]  # a picture swapped for another of its size leaves the placeholder ids as they were
            if rendered[: len(ledger)] == ledger.tokens and same_pictures:  # an extension of the ledger: one sample
                if rewritten is not None:
                    extra_ids = rendered[len(ledger) :]
                    if context_len is not None and len(rendered) >= context_len:
                        raise _EndEpisode(Status.TRUNCATED, "context_length")
                    if whole is not None and len(rendered) - prompt_len >= whole:
                        raise _EndEpisode(Status.TRUNCATED, "response_budget")
                    ledger.append_env(extra_ids)
                    if rendered_expanded is not None and len(rendered_expanded.pixels) > len(pictures.images):
                        new = len(pictures.images)  # the rewrite's new images sit in the appended tail
                        tail = dataclasses.replace(
                            rendered_expanded,
                            pixels=rendered_expanded.pixels[new:],
                            num_tokens=rendered_expanded.num_tokens[new:],
                        )
                        pictures.add(convo_images[new:], tail, sample)
                continue
            if rewritten is None:
                meta["template_breaks"] = meta.get("template_breaks", 0) + 1
                if cfg.history_mode != "template":
                    checking = False
                    continue  # keep the rollout's exact tokens (the default)
            # a new segment: its prompt is the conversation as the template renders it now
            if context_len is not None and len(rendered) >= context_len:
                raise _EndEpisode(Status.TRUNCATED, "context_length")
            done.append((sample, ledger))
            sample = _next_segment(sample, convo)
            ledger = TokenLedger(rendered)
            pictures = Pictures()
            if rendered_expanded is not None:
                pictures.add(convo_images, rendered_expanded, sample)
            prompt_len, checking = len(ledger), True
            try:
                delta_context = ctx.template.delta_context(tools, convo)
            except TemplateError as exc:
                raise _EndEpisode(Status.FAILED, "template", str(exc)) from None
    except _EndEpisode as end:
        status, reason = end.status, end.reason
        if end.error:
            sample.metadata["error"] = end.error
    except EnvContractError as exc:  # reset()/step()/rewrite_history() returned the wrong shapes
        status, reason = Status.FAILED, "env_contract"
        sample.metadata["error"] = str(exc)
    except ImageError as exc:  # an undecodable or oversized image fails its sample only
        status, reason = Status.FAILED, "image"
        sample.metadata["error"] = str(exc)
    except asyncio.CancelledError:
        raise
    except BaseException as exc:  # an SDK bug, a parser/template surprise, a stray SystemExit: fail the sample only
        status, reason = Status.FAILED, "internal_error"
        sample.metadata["error"] = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    finally:
        if env is not None:
            with _env_clock(sample):
                await _close_env(env, sample.metadata, cfg.env_step_timeout, ctx.executor)
        release = getattr(ctx.engine, "release", None)
        if release is not None:
            release(key)
    seconds = time.monotonic() - t0
    segments = [_finish(s, led, ctx, status, reason, seconds) for s, led in done]
    segments.append(_finish(sample, ledger, ctx, status, reason, seconds))
    if len(segments) > 1:  # the episode's reward and outcome are every segment's
        total = float(sum(sum(s.turn_rewards) for s in segments))
        error = segments[-1].metadata.get("error")
        for k, s in enumerate(segments):
            s.reward = total
            s.episode_id, s.segment = key, k
            s.metadata["num_segments"] = len(segments)
            if error is not None:
                s.metadata.setdefault("error", error)
    return segments


async def _cut_off(
    ctx: EpisodeContext,
    env: Env,
    out: GenerateOutput,
    parser: Any,
    turn: int,
    seen_ids: set[str],
    sample: Sample,
    timeout: float,
    ledger_length: int,
) -> None:
    """Hand a turn the length limit cut off to an env that overrides :meth:`Env.turn_cut_off` (``step`` never
    sees such a turn): :class:`~agentrl.proxy.ProxyEnv`'s agent is waiting for it, as an OpenAI reply with
    ``finish_reason`` ``"length"``. The episode ends ``truncated`` either way."""
    if type(env).turn_cut_off is not Env.turn_cut_off:
        prompt_length = ledger_length - len(out.output_ids)
        action = parse_turn(ctx, out, parser, turn, seen_ids, prompt_length=prompt_length)[0]
        with _env_clock(sample):
            await _timed(call_env(env.turn_cut_off, action, _executor=ctx.executor), timeout, "turn_cut_off()")


MAX_RESUMES = 16
"""``--partial-rollout``: how many aborts one turn may survive (a push per resume) before it ends aborted."""


async def _generate_turn(
    ctx: EpisodeContext,
    sample: Sample,
    ledger: TokenLedger,
    budget: int,
    key: str,
    convo: list[Message],
    tools: list[dict],
    image_data: list[str],
) -> GenerateOutput:
    """One assistant turn into ``ledger``: the engine's ids verbatim (mask 1, log-probs) and its
    weight version in ``sample.weight_versions``.

    ``--partial-rollout`` on a token-exact engine: an aborted request (a weight push pausing the
    engine) keeps what it sampled and the turn continues from there with the same budget minus those
    tokens, on whatever weights the engine then serves; ``metadata["version_spans"]`` maps each
    ``weight_versions`` entry to its tokens. The returned output is the whole turn.
    """
    cfg = ctx.config
    resume = cfg.partial_rollout and ctx.engine.token_exact
    turn_ids: list[int] = []
    turn_lps: list[float] = []
    for attempt in range(MAX_RESUMES + 1):
        try:
            out = await ctx.engine.generate_turn(
                ledger.tokens,
                cfg.sampling(budget - len(turn_ids)),
                key=key,
                messages=convo,
                tools=tools,
                **({"image_data": image_data} if image_data else {}),
            )
        except EngineError as exc:
            raise _EndEpisode(Status.ABORTED, "engine_error", str(exc)) from None
        if out.finish_reason == "abort" and not resume:
            raise _EndEpisode(Status.ABORTED, "engine_abort", str(out.matched or ""))
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
                f"the policy sampled the image placeholder token {ctx.template.vision.marker!r}: later requests "
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


async def _roles_episode(
    ctx: EpisodeContext,
    env: Env,
    task: dict[str, Any],
    key: str,
    group_index: int | None,
    index: int | None,
    seed: int | None,
    t0: float,
) -> list[Sample]:
    """An env with ``roles``: one sample per role that acted (:mod:`agentrl.rollout.roles`)."""
    from agentrl.rollout.roles import run_roles_episode

    cfg = ctx.config
    acted: list[tuple[Sample, TokenLedger | None]] = []
    meta: dict[str, Any] = {}
    try:
        acted, status, reason, error = await run_roles_episode(
            ctx,
            env,
            task,
            key=key,
            group_index=group_index,
            index=index,
            seed=seed,
            timed=_timed,
            end_episode=_EndEpisode,
            parse_turn=parse_turn,
        )
    finally:
        await _close_env(env, meta, cfg.env_step_timeout, ctx.executor)
        for role in env.roles:  # each role's requests had their own routing key
            for engine in (ctx.engine, *ctx.role_engines.values()):
                release = getattr(engine, "release", None)
                if release is not None:
                    release(f"{key}-{role}")
    seconds = time.monotonic() - t0
    out = []
    for s, led in acted:
        s.metadata.update(meta)
        if error is not None:
            s.metadata["error"] = error
        s.metadata["num_roles"] = len(acted)
        out.append(_finish(s, led, ctx, status, reason, seconds))
    return out


def _segment_metadata() -> dict[str, Any]:
    """A segment's own per-turn records (the sample's ``metadata`` starts with these)."""
    return {"turn_rewards": [], "finish_reasons": [], "env_infos": [], "tool_calls": 0, "parse_errors": 0}


def _next_segment(prev: Sample, convo: list[Message]) -> Sample:
    """The sample that continues an episode after a history rewrite: same group, index and task, the
    rewritten conversation as its prompt, fresh per-turn records."""
    meta = _segment_metadata()
    for k in ("task", "reset_info"):
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
