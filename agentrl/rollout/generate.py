"""Generate a rollout: many episodes concurrently, grouped per task, with a summary.

Each task row yields ``n_samples_per_prompt`` samples sharing a ``group_index`` (the row's
position, plus the train loop's ``group_base``) with consecutive ``index`` values, each carrying the
row as ``metadata["task"]``; seeds are ``rollout_seed + index`` so a rerun with the same seed gives
each episode the same env seed. At most ``rollout_concurrency`` episodes run
at once. A sample that fails, aborts or truncates is counted and kept; the run itself only stops
on a bad configuration.

slime users can replace the env-driven loop with ``--custom-generate-function-path`` (slime's
signature ``async def generate(args, sample, sampling_params) -> Sample``): ``args`` carries the
run's flags plus ``engine`` (an :class:`~agentrl.engines.base.Engine`), ``tokenizer`` and
``chat_template``.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
import traceback
from collections import Counter
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from agentrl.config import RolloutConfig
from agentrl.data import untrusted_row_code
from agentrl.engines.base import Engine
from agentrl.env import Env, call_env
from agentrl.rollout.episode import EpisodeContext, history_hook, run_episode
from agentrl.rollout.reward import RewardFn, apply_custom_reward, share_outcome
from agentrl.rollout.threads import SyncPool
from agentrl.types import Sample, Status
from agentrl.user_code import load_function

log = logging.getLogger(__name__)

GenerateFn = Callable[[Any, Sample, dict], Awaitable[Sample]]


def bind_engine_args(args: Any, engine: Any, tokenizer: Any, template: Any, urls: list[str]) -> None:
    """Give slime-style user functions what they reach for on ``args``.

    ``args.engine``, ``args.tokenizer``, ``args.chat_template_obj``, ``args.engine_urls``, slime's
    ``args.sglang_router_ip``/``sglang_router_port`` (the first engine's address),
    ``args.engine_headers`` to send with any request of one's own to those URLs (the engines' API key), and
    ``args.lora_path``: the adapter such a request must name as its ``lora_path`` to sample the policy (a
    ``--weight-sync adapter`` run on launched servers; None otherwise: the engines serve the policy by default).
    """
    from agentrl.engines.http import auth_headers

    args.engine, args.tokenizer, args.chat_template_obj, args.engine_urls = engine, tokenizer, template, urls
    first = (getattr(engine, "engines", None) or [engine])[0]
    args.engine_headers = auth_headers(getattr(first, "api_key", None))
    host, _, port = urls[0].split("://", 1)[-1].rstrip("/").rpartition(":")
    args.sglang_router_ip, args.sglang_router_port = host, int(port) if port.isdigit() else port
    args.lora_path = getattr(first, "lora_path", None)


@dataclass
class RolloutSummary:
    """Counts and means over a rollout, printed at the end and written by the CLI."""

    samples: int = 0
    status: Counter = field(default_factory=Counter)
    reasons: Counter = field(default_factory=Counter)
    reward_sum: float = 0.0
    turns_sum: int = 0
    response_tokens: int = 0
    sampled_tokens: int = 0
    seconds: float = 0.0
    sink_errors: int = 0
    hung_threads: int = 0  # sync env calls that timed out and had not returned by the end

    def add(self, s: Sample) -> None:
        self.samples += 1
        self.status[s.status.value] += 1
        self.reasons[s.status_reason] += 1
        self.reward_sum += float(s.reward or 0.0) if not isinstance(s.reward, dict) else 0.0
        self.turns_sum += int(s.metadata.get("num_turns", 0))
        self.response_tokens += s.response_length
        self.sampled_tokens += sum(s.loss_mask or [])

    def to_dict(self) -> dict[str, Any]:
        n = max(self.samples, 1)
        return {
            "samples": self.samples,
            "status": dict(self.status),
            "status_reasons": dict(self.reasons),
            "reward_mean": self.reward_sum / n,
            "turns_mean": self.turns_sum / n,
            "response_tokens_mean": self.response_tokens / n,
            "sampled_tokens": self.sampled_tokens,
            "seconds": round(self.seconds, 3),
            "sampled_tokens_per_s": self.sampled_tokens / self.seconds if self.seconds > 0 else 0.0,
            "sink_errors": self.sink_errors,
            "hung_threads": self.hung_threads,
        }


async def _custom_episode(
    fn: GenerateFn | None, args: Any, ctx: EpisodeContext, task: dict[str, Any], group_index: int, index: int
) -> Sample:
    """One sample from a custom generate function: the task row's ``generate_function_path``, else ``fn``."""
    sample = _pending_sample(task, group_index, index)
    try:
        _apply_chat_template(sample, task, ctx)
        if sample.generate_function_path:  # the row's own function wins over the run's (as in slime)
            fn = load_function(sample.generate_function_path)
        assert fn is not None, "a custom generate episode needs a function"
        out = await fn(args, sample, ctx.config.sampling().to_json())
        if not isinstance(out, Sample):
            raise TypeError(f"the custom generate function returned {type(out).__name__}, not a Sample")
        if (out.group_index, out.index) != (group_index, index):
            raise ValueError(
                f"the custom generate function moved the sample to group {out.group_index}, index {out.index} "
                f"(given {group_index}, {index}): groups are the run's"
            )
        if out.status == Status.PENDING:
            out.status = Status.COMPLETED
        out.validate()
        out.status_reason = out.status_reason or "custom_generate"
        return _with_row(out, task)
    except asyncio.CancelledError:
        raise
    except BaseException as exc:  # SystemExit included: the user's function fails its sample only
        return _with_row(_fail(sample, "custom_generate_error", exc), task)


def _with_row(sample: Sample, task: dict[str, Any]) -> Sample:
    """Record the task row as ``metadata["task"]`` on a custom-generated sample once its function is done (the
    function sees the row's columns in ``metadata``, as in slime; what it returns, a new object or not, carries
    the row, as an env episode's sample does from the start: a retried group runs it again)."""
    sample.metadata["task"] = dict(task)
    return sample


@dataclasses.dataclass(frozen=True)
class BatchGenerate:
    """slime's ``--rollout-function-path`` with the reference's batch signature, as ``custom_generate``:
    ``async def fn(args, samples: list[Sample], evaluation: bool = False) -> list[Sample]``.

    The function gets every sample of the rollout at once (prompt, label, ``group_index``, ``index``
    and the task row in ``metadata``) and returns them completed. It must return the same samples
    (same ``index`` values; it may return new objects); an exception, or a list that adds, drops or
    repeats samples, fails every sample of the call (recorded in ``metadata["error"]``), not the run.
    """

    fn: Callable[..., Any]
    evaluation: bool = False

    @classmethod
    def load(cls, spec: str) -> BatchGenerate:
        """``module:fn``, checked: an ``async def`` taking ``(args, samples, evaluation)``. slime's own
        ``--rollout-function-path`` is the synchronous ``generate_rollout(args, rollout_id, data_source,
        evaluation)``; given one, say so instead of failing every sample of the run."""
        import inspect

        fn = load_function(spec)
        try:
            inspect.signature(fn).bind(None, [], False)
            binds = True
        except (TypeError, ValueError):
            binds = False
        if not inspect.iscoroutinefunction(fn) or not binds:
            raise TypeError(
                f"{spec!r} must be `async def fn(args, samples, evaluation=False) -> list[Sample]` (the reference's "
                "batch signature); slime's generate_rollout(args, rollout_id, data_source, evaluation) is a "
                "different function: wrap it, or use --custom-generate-function-path for one sample at a time"
            )
        return cls(fn)


def _units(samples: list[Sample]) -> list[list[Sample]]:
    """An episode's samples by role (one list for a single-agent episode), segments in order."""
    units: dict[Any, list[Sample]] = {}
    for s in samples:
        units.setdefault(s.role, []).append(s)
    return list(units.values())


def check_rollout_features(
    config: RolloutConfig, rows: Iterable[dict[str, Any]] = (), *, custom: bool = False
) -> Callable[..., Any] | None:
    """Refuse, before any engine starts, what the env-driven episode loop cannot honour: a
    ``--history-rewrite-path`` that does not load, or that episodes it does not run (a custom generate or
    rollout function, rows with their own ``generate_function_path``) would silently skip. Returns the loaded
    hook (None without the flag)."""
    hook = history_hook(config.history_rewrite_path)
    if hook is not None:
        if custom or any(isinstance(r, dict) and r.get("generate_function_path") for r in rows):
            raise ValueError(
                "--history-rewrite-path rewrites the env-driven episode loop's conversations; a custom generate or "
                "rollout function (or a row's generate_function_path) runs its own: drop one of them"
            )
    return hook


async def check_roles_config(ctx: EpisodeContext, env_factory: Callable[[], Env]) -> None:
    """Refuse, before any episode, a ``--role-engine-url`` or ``--role-policy`` the env cannot use
    (:func:`check_role_engines`, :func:`check_role_policies`)."""
    await check_role_engines(ctx.role_engines, env_factory)
    await check_role_policies(ctx.config, env_factory)


async def env_roles(env_factory: Callable[[], Env]) -> tuple[str, ...]:
    """The env's roles: its class's ``roles``, else one constructed env's (closed again); () when the factory fails
    (the episodes report that)."""
    roles = getattr(env_factory, "roles", None) if isinstance(env_factory, type) else None
    if roles is None:
        try:
            probe = env_factory()
        except Exception:  # noqa: BLE001 - the episodes report a factory that fails
            return ()
        roles = getattr(probe, "roles", ())
        with contextlib.suppress(Exception):
            await call_env(probe.close)
    return tuple(roles or ())


async def check_role_engines(role_engines: dict[str, Engine], env_factory: Callable[[], Env]) -> None:
    """Refuse a ``--role-engine-url`` the env cannot use: an engine that does not answer, or a role the env
    does not have. An env built by a function (or a partial) is constructed once to read its roles (only
    when the run names role engines)."""
    if not role_engines:
        return
    roles = await env_roles(env_factory)
    for role, engine in role_engines.items():  # a wrong URL is one clear error, not every episode aborted
        if not await engine.health():
            raise ValueError(
                f"--role-engine-url {role}={getattr(engine, 'url', engine)}: the engine does not answer /health"
            )
    unknown = sorted(set(role_engines) - set(roles))
    if unknown:
        raise ValueError(
            f"--role-engine-url names role(s) {unknown} the env does not have; its roles are {list(roles)}"
        )


async def check_role_policies(
    config: RolloutConfig, env_factory: Callable[[], Env], *, every_role: bool = False
) -> None:
    """Refuse a ``--role-policy`` the env cannot use: a role it does not have, or (``every_role``: a run training
    several policies) one of its roles seated on no policy and no fixed engine, which would otherwise play on the
    base model untrained. Elsewhere (``eval``, ``rollout``) an unseated role plays on the engine's own model."""
    seats = config.role_policies()
    if not seats:
        return
    roles = await env_roles(env_factory)
    if not roles:
        raise ValueError("--role-policy seats roles, but the env has none (an env with roles declares `roles`)")
    unknown = sorted(set(seats) - set(roles))
    if unknown:
        raise ValueError(f"--role-policy names role(s) {unknown} the env does not have; its roles are {list(roles)}")
    unseated = [r for r in roles if r not in seats and r not in config.role_engine_urls()]
    if unseated and every_role:
        raise ValueError(
            f"--role-policy: role(s) {unseated} of the env are played by no policy: seat each with --role-policy "
            "ROLE=NAME or on a fixed engine with --role-engine-url ROLE=URL"
        )


def check_row_code(config: RolloutConfig, rows: Iterable[dict[str, Any]]) -> None:
    """Refuse rows naming code (``generate_function_path``) unless ``config.trust_row_code``.

    Rows read from files are checked when they are read (:func:`agentrl.data.task_from_row`); this is the
    same rule where the code would run, for rows that came another way (a ``--data-source-path`` source,
    the Python API), so no path imports a row's module without the opt-in."""
    if config.trust_row_code:
        return
    for i, row in enumerate(rows):
        spec = row.get("generate_function_path") if isinstance(row, dict) else None
        if spec:
            raise ValueError(untrusted_row_code(f"task row {i} of the rollout", str(spec)))


def _pending_sample(task: dict[str, Any], group_index: int, index: int) -> Sample:
    return Sample(
        group_index=group_index,
        index=index,
        prompt=task["prompt"],
        label=task.get("label"),
        metadata={k: v for k, v in task.items() if k not in ("prompt", "label", "generate_function_path")},
        generate_function_path=task.get("generate_function_path"),
    )


def check_apply_chat_template(config: Any, *, custom: bool, rows: Iterable[dict[str, Any]]) -> None:
    """Refuse ``--apply-chat-template`` where nothing would use it: it renders the prompt custom generate
    functions receive (the run's, or rows' own ``generate_function_path``); env episodes always render."""
    if config.apply_chat_template and not custom and not any(r.get("generate_function_path") for r in rows):
        raise ValueError(
            "--apply-chat-template renders the prompt a custom generate function receives (slime's sample.prompt); "
            "env episodes always go through the chat template: pass --custom-generate-function-path or "
            "--rollout-function-path (or rows with their own generate_function_path), or drop --apply-chat-template"
        )


def _apply_chat_template(sample: Sample, task: dict[str, Any], ctx: EpisodeContext) -> None:
    """``--apply-chat-template``: the prompt as the model sees it, rendered text (slime's Dataset does the same).

    A string is one user message, a list is the conversation; the row's ``tools`` (OpenAI schemas) go to
    the template too; the generation prompt is added. Without the flag the prompt stays as the row has it.
    """
    if not ctx.config.apply_chat_template:
        return
    prompt = task["prompt"]
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
    if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
        raise ValueError(
            f"--apply-chat-template: the prompt must be a string or a list of messages, not {prompt!r:.80}"
        )
    tools = task.get("tools")
    if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
        raise ValueError(
            f"--apply-chat-template: the row's tools must be a list of OpenAI tool schemas, not {tools!r:.80}"
        )
    sample.prompt = ctx.template.render(messages, tools, add_generation_prompt=True)


def _fail(sample: Sample, reason: str, exc: BaseException) -> Sample:
    sample.status = Status.FAILED
    sample.status_reason = reason
    sample.metadata["error"] = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__, limit=-3))
    sample.loss_mask, sample.rollout_log_probs = [], []
    return sample


async def _batch_episodes(
    batch: BatchGenerate, args: Any, pending: list[Sample], rows: list[dict[str, Any]]
) -> list[Sample]:
    """Every sample through one call of the batch function, checked; a failure fails them all. ``rows[i]`` is
    ``pending[i]``'s task row (matched to what the function returns by the ids given, read before the call)."""
    given = [(s.group_index, s.index) for s in pending]
    by_key = dict(zip(given, rows))
    want = sorted(given)
    try:
        out = await batch.fn(args, pending, batch.evaluation)
        if not isinstance(out, list) or not all(isinstance(s, Sample) for s in out):
            raise TypeError(f"the rollout function returned {type(out).__name__}, not a list of Samples")
        got = sorted((s.group_index, s.index) for s in out if isinstance(s.index, int))
        if len(got) != len(out) or got != want:
            raise ValueError(
                f"the rollout function returned (group_index, index) pairs {got[:6]}... for the {len(want)} "
                f"samples {want[:6]}... it was given: it must return the same samples, in their groups "
                "(none added, dropped, repeated or moved)"
            )
        done = []
        for s in out:
            _with_row(s, by_key[(s.group_index, s.index)])
            if s.status == Status.PENDING:
                s.status = Status.COMPLETED
            try:
                s.validate()
            except Exception as exc:  # noqa: BLE001 - one bad sample fails itself
                done.append(_fail(s, "rollout_function_error", exc))
                continue
            s.status_reason = s.status_reason or "rollout_function"
            done.append(s)
        return done
    except asyncio.CancelledError:
        raise
    except BaseException as exc:  # SystemExit included: the user's function fails its samples only
        return [_with_row(_fail(s, "rollout_function_error", exc), row) for s, row in zip(pending, rows)]


async def generate_rollout(
    ctx: EpisodeContext,
    env_factory: Callable[[], Env] | None,
    tasks: Iterable[dict[str, Any]],
    *,
    args: Any = None,
    custom_generate: GenerateFn | BatchGenerate | None = None,
    custom_reward: RewardFn | None = None,
    on_sample: Callable[[Sample], None] | None = None,
    first_group: int = 0,
    group_base: int = 0,
) -> tuple[list[Sample], RolloutSummary]:
    """Run ``n_samples_per_prompt`` episodes per task; return samples (by index) and a summary.

    ``on_sample`` is called as each sample finishes (the CLI streams them to the output file and
    advances the progress bar), so a killed run keeps what it finished. ``first_group``: the group
    index of the first task (a rollout worker runs one group of a step: its samples keep the
    ``group_index``, ``index`` and seeds the whole step would give them). ``group_base`` is added to every
    ``group_index`` (not to ``index`` or the seeds): the train loop numbers a run's groups uniquely across its
    steps and rounds, here, so a sample's group is written once.
    """
    cfg = ctx.config
    tasks = list(tasks)
    check_row_code(cfg, tasks)
    if env_factory is None and custom_generate is None and not all(t.get("generate_function_path") for t in tasks):
        raise ValueError("need an env (--env) or a custom generate function (--custom-generate-function-path)")
    if not isinstance(ctx.engine, Engine):
        raise TypeError(f"EpisodeContext.engine must be an agentrl Engine, not {type(ctx.engine).__name__}")
    hook = check_rollout_features(cfg, tasks, custom=custom_generate is not None or env_factory is None)
    if hook is not None and ctx.history_rewrite is None:  # loaded once for the whole rollout
        ctx = dataclasses.replace(ctx, history_rewrite=hook)
    if env_factory is not None:
        await check_roles_config(ctx, env_factory)
    # Episodes must stop (truncated) before the engine's own limit, not be refused by it (aborted).
    limit = await ctx.engine.context_length()
    if limit and (cfg.rollout_max_context_len is None or cfg.rollout_max_context_len > limit):
        cfg = dataclasses.replace(cfg, rollout_max_context_len=limit)
        ctx = dataclasses.replace(ctx, config=cfg)
    own_pool = None
    if ctx.executor is None:
        own_pool = SyncPool.for_rollout(cfg.rollout_concurrency)
        ctx = dataclasses.replace(ctx, executor=own_pool)
    sem = asyncio.Semaphore(cfg.rollout_concurrency)
    summary = RolloutSummary()
    t0 = time.monotonic()

    async def one(task: dict[str, Any], group_index: int, index: int) -> list[Sample]:
        async with sem:  # released before finish(), which takes it again for the reward function
            if custom_generate is not None or task.get("generate_function_path"):
                samples = [await _custom_episode(custom_generate, args, ctx, task, group_index, index)]
            else:
                assert env_factory is not None
                samples = await run_episode(
                    ctx, env_factory, task, group_index=group_index, index=index, seed=cfg.rollout_seed + index
                )
        out: list[Sample] = []
        for unit in _units(samples):  # each role of the episode, its segments together
            out += [await finish(unit[0])] if len(unit) == 1 else await finish_segments(unit)
        return out

    async def finish_segments(segments: list[Sample]) -> list[Sample]:
        """An episode in several segments: the reward function scores the last one (the episode's
        outcome) once, and its score goes to every segment, which all carry the episode's reward."""
        if custom_reward is not None:
            last = segments[-1]
            async with sem:
                await apply_custom_reward(custom_reward, args, last)
            share_outcome(segments)
        return [await finish(s, rewarded=True) for s in segments]

    async def finish(sample: Sample, *, rewarded: bool = False) -> Sample:
        if custom_reward is not None and not rewarded:
            async with sem:
                sample = await apply_custom_reward(custom_reward, args, sample)
        summary.add(sample)
        if on_sample is not None:
            try:
                on_sample(sample)
            except Exception as exc:  # a sink that cannot take one sample must not stop the others
                summary.sink_errors += 1
                log.error("could not record sample %s: %s: %s", sample.index, type(exc).__name__, exc)
        return sample

    jobs = []
    n = cfg.n_samples_per_prompt
    if isinstance(custom_generate, BatchGenerate):  # one call for the rows without their own function
        pending, unrendered = [], []
        rows: list[dict[str, Any]] = []  # pending's task rows, in its order
        for g, task in enumerate(tasks, start=first_group):
            if task.get("generate_function_path"):
                continue
            for j in range(n):
                sample = _pending_sample(task, group_base + g, g * n + j)
                try:
                    _apply_chat_template(sample, task, ctx)
                    pending.append(sample)
                    rows.append(task)
                except Exception as exc:  # noqa: BLE001 - a row the template cannot render fails its samples
                    unrendered.append(_with_row(_fail(sample, "custom_generate_error", exc), task))
        own = [
            one(task, group_base + g, g * n + j)
            for g, task in enumerate(tasks, start=first_group)
            if task.get("generate_function_path")  # a row's own function wins, as with per-sample generation
            for j in range(n)
        ]

        async def batch_then_finish() -> list[Sample]:
            done = await _batch_episodes(custom_generate, args, pending, rows) if pending else []
            return list(await asyncio.gather(*(finish(s) for s in done + unrendered)))

    else:
        for g, task in enumerate(tasks, start=first_group):
            for j in range(n):
                jobs.append(one(task, group_base + g, g * n + j))
    try:
        if isinstance(custom_generate, BatchGenerate):  # the batch and rows with their own function, together
            batched, mine = await asyncio.gather(batch_then_finish(), asyncio.gather(*own))
            samples = batched + [s for episode in mine for s in episode]
        else:
            samples = [s for episode in await asyncio.gather(*jobs) for s in episode]
    finally:
        if own_pool is not None:
            own_pool.shutdown(wait=False)  # a timed-out sync step may still hold its (daemon) thread
            summary.hung_threads = own_pool.hung
    summary.seconds = time.monotonic() - t0
    samples.sort(key=lambda s: s.index if s.index is not None else 0)
    return samples, summary
