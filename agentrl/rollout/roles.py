"""Episodes with several agents: each role has its own conversation, token ledger and sample.

An env that declares ``roles`` (``("x", "o")``, ``("proposer", "solver")``) runs here instead of
:func:`agentrl.rollout.episode.run_episode`; the contract (documented on :class:`agentrl.Env`):

- ``reset`` returns ``({role: messages}, info)``: every role's first conversation (non-empty);
- before every turn the loop asks ``current_role()`` whose turn it is;
- ``step(action)`` answers the acting role's turn with ``({role: messages}, reward, terminated,
  truncated, info)``: each role's new messages (what it will see before its next turn; the acting
  role's own turn is already in its conversation), and ``reward`` a float for the acting role or a
  ``{role: float}`` dict (a game's outcome for both players).

Each role's tokens form their own token-exact sample (the chat template renders that role's
conversation: its turns are the assistant's, the rest is what the env showed it), linked by
``metadata["episode_id"]`` and tagged ``metadata["role"]``. Roles played by a fixed policy on
another engine (``--role-engine-url NAME=URL``) get ``metadata["trained"] = False``: the train loop
leaves them out. A role's reward is the sum of what it earned; each of its turns keeps its
``turn_rewards`` entry (a reward given to a role between its turns is added to its last one).
Group advantages are normalised per role (``(group_index, role)`` groups).

``--rollout-max-turn-len`` and ``--rollout-max-response-len`` apply to each role's own turns and response.
Not (yet) with roles, refused before the rollout starts: ``--partial-rollout``, ``--history-mode template``
and ``rewrite_history``. The episode's status is every role's: a turn one role runs to a length limit
ends the episode ``truncated`` for all (``--mask-truncated-samples`` masks them all).

Faults fail every role's sample of the episode, as a single-agent episode fails its one: an unknown
role, a role asked to act with nothing new to read, a turn that leaves tool calls unanswered while
another role takes over, or the env's own errors and timeouts.
"""

from __future__ import annotations

import asyncio
import time
import traceback
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from agentrl.chat import TemplateError, TokenLedger
from agentrl.engines.base import Engine, EngineError
from agentrl.env import Env, EnvContractError, call_env, check_messages
from agentrl.images import count_images
from agentrl.parsing import get_parser
from agentrl.rollout.pictures import sampled_placeholder
from agentrl.types import Action, Message, Sample, Status


@dataclass
class _Seat:
    """One role's side of the episode."""

    role: str
    sample: Sample
    convo: list[Message]
    ledger: TokenLedger
    tools: list[dict]
    engine: Engine
    delta_context: Any
    prompt_len: int = 0
    pending: list[Message] = field(default_factory=list)  # shown to the role since its last turn
    last_token_text: str | None = None
    seen_ids: set[str] = field(default_factory=set)
    early_reward: float = 0.0  # earned before its first turn


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
        msgs = _text_only(check_messages(obs.get(role), f"reset() for role {role!r}"), f"reset() for role {role!r}")
        if not msgs:
            raise EnvContractError(f"reset() gave role {role!r} no messages")
        out[role] = msgs
    return out, info


def _text_only(messages: list[Any], where: str) -> list[Any]:
    """Multi-agent episodes lay down text only (their per-role ledgers have no picture bookkeeping yet)."""
    if count_images(messages):
        raise EnvContractError(f"{where}: an image part; multi-agent (roles) episodes take text observations only")
    return messages


def check_roles_step(
    result: Any, roles: tuple[str, ...], acting: str
) -> tuple[dict, dict[str, float], bool, bool, dict]:
    """``step()``'s return for an env with roles; a float reward is the acting role's."""
    import math

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
    if not isinstance(terminated, bool) or not isinstance(truncated, bool):
        raise EnvContractError("step() terminated and truncated must be bools")
    if not isinstance(info, dict):
        raise EnvContractError(f"step() info must be a dict, got {type(info).__name__}")
    checked = {
        role: _text_only(check_messages(msgs, f"step() for role {role!r}"), f"step() for role {role!r}")
        for role, msgs in obs.items()
    }
    return checked, {k: float(v) for k, v in rewards.items()}, terminated, truncated, info


async def run_roles_episode(
    ctx: Any,
    env: Env,
    task: dict[str, Any],
    *,
    key: str,
    group_index: int | None,
    index: int | None,
    seed: int | None,
    timed: Callable[..., Any],
    end_episode: type[Exception],
    parse_turn: Callable[..., tuple[Action, Message, str | None]],
) -> tuple[list[tuple[Sample, TokenLedger | None]], Status, str, str | None]:
    """Play one multi-role episode of ``env`` (already constructed); return each role's (sample, ledger)
    in the order the roles first acted, and the episode's status, reason and error.

    The helpers of the single-agent loop are passed in (``timed`` wraps env calls with the step timeout
    and turns faults into ``end_episode``), so both loops fail and time env calls the same way.
    """
    cfg = ctx.config
    roles = tuple(env.roles)
    step_timeout = env.step_timeout or cfg.env_step_timeout
    parser = get_parser(cfg.tool_parser or env.tool_parser)
    role_engines: Mapping[str, Engine] = getattr(ctx, "role_engines", None) or {}
    seats: dict[str, _Seat] = {}
    order: list[str] = []
    status, reason, error = Status.TRUNCATED, "max_turns", None
    first = Sample(group_index=group_index, index=index, prompt=task.get("prompt", ""), label=task.get("label"))
    try:
        if type(env).rewrite_history is not Env.rewrite_history:
            raise EnvContractError("an env with roles cannot rewrite_history() yet (each role would need its segments)")
        reset = call_env(env.reset, seed=seed, options=dict(task), _executor=ctx.executor)
        obs, info = check_roles_reset(await timed(reset, step_timeout, "reset()"), roles)
        tools = env.tool_schemas()
        for role in roles:
            s = Sample(group_index=group_index, index=index, prompt=obs[role], label=task.get("label"))
            s.metadata = {"turn_rewards": [], "finish_reasons": [], "env_infos": [], "tool_calls": 0, "parse_errors": 0}
            s.role = role
            s.metadata["reset_info"] = info
            s.episode_id = key
            extra = {k: v for k, v in task.items() if k not in ("prompt", "label")}
            if extra:
                s.metadata["task"] = extra
            engine = role_engines.get(role, ctx.engine)
            s.token_exact = engine.token_exact
            if role in role_engines:
                s.trained = False
            try:
                prompt_ids = ctx.template.prompt(obs[role], tools)[1]
                dctx = ctx.template.delta_context(tools, obs[role])
            except TemplateError as exc:
                raise end_episode(Status.FAILED, "template", str(exc)) from None
            seats[role] = _Seat(role, s, list(obs[role]), TokenLedger(prompt_ids), tools, engine, dctx, len(prompt_ids))
        max_turns = cfg.turn_limit(env.max_turns)
        context_len, whole = cfg.rollout_max_context_len, cfg.rollout_max_response_len
        for turn in range(max_turns):
            try:
                role = env.current_role()
            except Exception as exc:  # the user's code: fails the episode like a step that raises
                raise end_episode(
                    Status.FAILED, "env_error", f"current_role() raised {type(exc).__name__}: {exc}"
                ) from None
            if not isinstance(role, str) or role not in seats:
                raise EnvContractError(f"current_role() returned {role!r}; the env's roles are {list(roles)}")
            seat = seats[role]
            led, s = seat.ledger, seat.sample
            if role not in order:
                order.append(role)
                if seat.pending:  # shown something before its first turn: that is part of its prompt, rendered once
                    seat.convo += seat.pending
                    seat.pending = []
                    try:
                        seat.ledger = led = TokenLedger(ctx.template.prompt(seat.convo, seat.tools)[1])
                    except TemplateError as exc:
                        raise end_episode(Status.FAILED, "template", str(exc)) from None
                    seat.prompt_len = len(led)
                    s.prompt = list(seat.convo)
            elif not seat.pending:
                raise EnvContractError(
                    f"role {role!r} was asked to act again with nothing new to read since its last turn: "
                    "give it a message in step()'s {role: messages} first"
                )
            if seat.pending:  # what the role was shown since its last turn, as one template delta (mask 0)
                try:
                    delta = ctx.template.observation_delta(
                        seat.pending, seat.tools, last_token_text=seat.last_token_text, context=seat.delta_context
                    )
                except TemplateError as exc:
                    raise end_episode(Status.FAILED, "template", str(exc)) from None
                ids = ctx.template.encode(delta)
                if context_len is not None and len(led) + len(ids) >= context_len:
                    raise end_episode(Status.TRUNCATED, "context_length")
                if whole is not None and len(led) + len(ids) - seat.prompt_len >= whole:
                    raise end_episode(Status.TRUNCATED, "response_budget")  # no room left for this role's answer
                led.append_env(ids)
                seat.convo += seat.pending
                seat.pending = []
            budget = cfg.rollout_max_turn_len
            if whole is not None:  # --rollout-max-response-len: each role's response has its own budget
                budget = min(budget, whole - (len(led) - seat.prompt_len))
                if budget < 1:
                    raise end_episode(Status.TRUNCATED, "response_budget")
            if context_len is not None:
                budget = min(budget, context_len - 1 - len(led))
                if budget < 1:
                    raise end_episode(Status.TRUNCATED, "context_length")
            try:
                out = await seat.engine.generate_turn(
                    led.tokens, cfg.sampling(budget), key=f"{key}-{role}", messages=seat.convo, tools=seat.tools
                )
            except EngineError as exc:
                raise end_episode(Status.ABORTED, "engine_error", f"role {role!r}: {exc}") from None
            if out.finish_reason == "abort":
                raise end_episode(Status.ABORTED, "engine_abort", f"role {role!r}: {out.matched or ''}")
            led.append_model(out.output_ids, out.output_logprobs)
            s.weight_versions.append(out.weight_version)
            s.metadata["finish_reasons"].append(out.finish_reason)
            if sampled_placeholder(ctx, out.output_ids):  # the trainer would take it for a picture
                raise end_episode(Status.FAILED, "image_token_sampled", f"role {role!r} sampled the image placeholder")
            if out.finish_reason == "length":
                hit = context_len is not None and len(led) >= context_len - 1
                spent = whole is not None and len(led) - seat.prompt_len >= whole
                raise end_episode(
                    Status.TRUNCATED, "context_length" if hit else "response_budget" if spent else "response_length"
                )
            read = len(led) - len(out.output_ids)
            action, message, seat.last_token_text = parse_turn(
                ctx, out, parser, turn, seat.seen_ids, prompt_length=read
            )
            calls, errors = action.tool_calls, action.errors
            seat.convo.append(message)
            s.metadata["tool_calls"] += len(calls)
            s.metadata["parse_errors"] += len(errors)
            t0 = time.monotonic()
            step = call_env(env.step, action, _executor=ctx.executor)
            result = await timed(step, step_timeout, "step()")
            s.non_generation_time += time.monotonic() - t0
            new_obs, rewards, terminated, truncated, info = check_roles_step(result, roles, role)
            s.turn_rewards.append(0.0)
            s.metadata["env_infos"].append(info)
            for r, value in rewards.items():
                other = seats[r].sample
                if other.turn_rewards:
                    other.turn_rewards[-1] += value
                else:
                    seats[r].early_reward += value
            for r, msgs in new_obs.items():
                seats[r].pending += msgs
            if terminated:
                status, reason = Status.COMPLETED, "terminated"
                break
            if truncated:
                status, reason = Status.TRUNCATED, "env_truncated"
                break
            if calls or errors:  # the acting role's calls must be answered to it before anyone else acts
                answered = {m.get("tool_call_id") for m in seat.pending if m.get("role") == "tool"}
                missing = [c.id for c in (*calls, *errors) if c.id not in answered]
                if missing:
                    raise EnvContractError(
                        f"role {role!r} made tool call(s) {missing} that step() left unanswered: a turn's "
                        "calls are answered in that role's messages before another role acts"
                    )
    except end_episode as end:
        status, reason, error = end.status, end.reason, end.error  # type: ignore[attr-defined]
    except EnvContractError as exc:
        status, reason, error = Status.FAILED, "env_contract", str(exc)
    except asyncio.CancelledError:
        raise
    except BaseException as exc:  # an SDK bug or a stray SystemExit: fail this episode's samples only
        status, reason = Status.FAILED, "internal_error"
        error = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    acted = [(seats[r].sample, seats[r].ledger) for r in order]
    for r in order:  # a reward given before a role's first turn goes to that turn (even one cut before its step)
        seat = seats[r]
        if seat.early_reward:
            rewards = seat.sample.turn_rewards
            rewards.extend([0.0] * (max(len(seat.ledger.model_spans), 1) - len(rewards)))
            rewards[0] += seat.early_reward
    if not acted:  # nobody acted (a failed reset): one sample reports the episode
        first.metadata = {"turn_rewards": [], "finish_reasons": [], "env_infos": [], "episode_id": key}
        return [(first, None)], status, reason, error
    return acted, status, reason, error
