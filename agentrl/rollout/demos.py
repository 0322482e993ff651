"""Demonstrations for warm starts: token-exact Samples laid down exactly as a rollout would lay them.

Small models rarely find a tool call by sampling, so RL on them starts from a supervised warm
start (DeepSeek-R1's cold start, ReTool's cold-start SFT, slime's ``--loss-type sft_loss``). What
is trained in that warm start must be what the rollout produces later, token for token, or the
policy learns a format the episode loop never shows it. So every demonstration goes through the
same :class:`~agentrl.chat.TokenLedger` as an episode: the first observation rendered once by the
chat template (mask 0), each assistant turn as the text the model would sample plus its stop token
(mask 1), each observation as a template delta (mask 0).

Three sources, all ending as :class:`~agentrl.Sample` objects with ``token_exact=True``:

- :func:`conversation_samples`: rows in the OpenAI / Hugging Face conversational shape
  (``{"messages": [...], "tools": [...]}``, assistant ``tool_calls``, ``tool`` messages with
  ``tool_call_id``), checked before anything trains (:mod:`agentrl.rollout.demo_checks`): each bad
  row is refused with its file and line. After laying a row down, its tokens are compared with the
  template's own rendering of the whole conversation; a template that rewrites earlier turns is
  refused at the first differing token (or kept as ``token_exact=False`` when the user opts in).
- :func:`scripted_samples`: a Python policy played on the env (:func:`~agentrl.rollout.scripted.play`),
  keeping episodes whose reward reaches ``min_reward``.
- :func:`rejection_samples`: real episodes from an engine (the policy itself, or a teacher that
  shares its tokenizer), ``n`` per task, keeping those at or above ``min_reward`` (best-of-n per
  task optionally): rejection-sampling fine-tuning / expert iteration.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from agentrl.chat import ChatTemplate, TemplateError, TokenLedger
from agentrl.images import ImageError, count_images, normalize
from agentrl.metrics import scalar_reward
from agentrl.rollout.demo_checks import DemoError, check_conversation, check_row
from agentrl.rollout.generate import generate_rollout
from agentrl.rollout.pictures import Pictures
from agentrl.rollout.scripted import play
from agentrl.types import Message, Sample, Status

__all__ = [
    "DemoError",
    "DemoStats",
    "DemoBuilder",
    "conversation_samples",
    "scripted_samples",
    "rejection_samples",
    "check_conversation",
]


@dataclass
class DemoStats:
    """What happened to the demonstrations of a run; printed before training starts."""

    rows: int = 0
    kept: int = 0
    below_min_reward: int = 0
    failed_episodes: int = 0
    not_token_exact: int = 0
    assistant_turns: int = 0
    tokens: int = 0
    trained_tokens: int = 0
    trailing_messages: int = 0
    problems: list[str] = field(default_factory=list)

    def add(self, sample: Sample) -> None:
        self.kept += 1
        self.assistant_turns += len(sample.turn_spans)
        self.tokens += len(sample.tokens)
        self.trained_tokens += sum(sample.loss_mask or [])
        self.not_token_exact += not sample.token_exact

    def summary(self) -> str:
        parts = [
            f"{self.kept} of {self.rows} demonstrations kept",
            f"{self.assistant_turns} assistant turns",
            f"{self.tokens} tokens ({self.trained_tokens} trained)",
        ]
        if self.below_min_reward:
            parts.append(f"{self.below_min_reward} below --demo-min-reward")
        if self.failed_episodes:
            parts.append(f"{self.failed_episodes} episodes failed or aborted")
        if self.not_token_exact:
            parts.append(f"{self.not_token_exact} kept as token_exact=false (--allow-non-token-exact)")
        if self.trailing_messages:
            parts.append(f"{self.trailing_messages} messages after the last assistant turn not trained on")
        return ", ".join(parts)


def _pictures(messages: Sequence[Message]) -> tuple[list[Message], list[Any]]:
    """Messages with their images decoded and checked (data-URL parts), and the images; a bad one is a TemplateError
    (the demonstration is refused with the reason)."""
    if not count_images(messages):
        return list(messages), []
    try:
        return normalize(messages)
    except ImageError as exc:
        raise TemplateError(str(exc)) from None


def _stop_token(template: ChatTemplate, tail: str) -> tuple[int, str]:
    """The end-of-turn token the model samples: the one whose text starts the template's assistant tail."""
    for tid in template.eos_token_ids:
        text = template.decode([tid])
        if text and tail.startswith(text):
            return tid, text
    raise TemplateError(
        f"the chat template ends an assistant turn with {tail!r}, which starts with none of the "
        "tokenizer's end-of-turn tokens; a model could not end its turn as this template writes it"
    )


class DemoBuilder:
    """One demonstration laid into a :class:`TokenLedger` as :func:`~agentrl.rollout.episode.run_episode` would.

    ``first`` is the first observation (what ``env.reset`` returns), ``tools`` the OpenAI schemas
    the template renders. :meth:`assistant` appends a turn's text plus the stop token (mask 1,
    log-prob 0.0: these tokens were not sampled); :meth:`observe` appends the template delta of an
    observation (mask 0).
    """

    def __init__(self, template: ChatTemplate, first: Sequence[Message], tools: Sequence[dict] | None):
        self.tools = list(tools or []) or None
        self.first, images = _pictures(first)
        self.template, self.pictures = template, Pictures()
        if images or template.vision is not None:  # a vision-language model: placeholders as the rollout lays them
            _, expanded = template.prompt_images(self.first, images, self.tools)
            prompt_ids = expanded.ids
            self.pictures.add(images, expanded)
        else:
            _, prompt_ids = template.prompt(self.first, self.tools)
        self.context = template.delta_context(self.tools, self.first)
        self.stop_id, self.stop_text = _stop_token(template, self.context[2])
        self.ledger = TokenLedger(prompt_ids)

    def assistant_text(self, message: Message) -> str:
        """What the model writes for an assistant message (content plus tool calls in the template's wire format)."""
        head = self.first[:1] if self.first and self.first[0].get("role") == "system" else []
        base: list[Message] = [*head, {"role": "user", "content": "x"}]
        before = self.template.render(base, self.tools, add_generation_prompt=True)
        after = self.template.render([*base, message], self.tools, add_generation_prompt=False)
        tail = self.context[2]
        if not after.startswith(before) or not after.endswith(tail):
            raise TemplateError(
                "the chat template does not render an assistant message as generation prompt + "
                "content + end of turn; it cannot be trained turn by turn"
            )
        return after[len(before) : len(after) - len(tail)]

    def assistant(self, text: str) -> None:
        ids = self.template.encode(text) + [self.stop_id]
        self.ledger.append_model(ids, [0.0] * len(ids))

    def observe(self, messages: Sequence[Message]) -> None:
        messages, images = _pictures(messages)
        delta = self.template.observation_delta(
            messages, self.tools, last_token_text=self.stop_text, context=self.context
        )
        if images or self.template.vision is not None:
            expanded = self.template.encode_images(delta, images)
            self.ledger.append_env(expanded.ids)
            self.pictures.add(images, expanded)
        else:
            self.ledger.append_env(self.template.encode(delta))

    def difference(self, conversation: Sequence[Message]) -> str | None:
        """Where the ledger differs from the template's rendering of ``conversation`` (None: it does not).

        The ledger must be a prefix of the tokenized whole rendering, followed only by the part of
        the assistant tail after the stop token (e.g. ChatML's ``\\n``), which a rollout writes at
        the start of the next observation.
        """
        conversation, images = _pictures(conversation)
        text = self.template.render(conversation, self.tools, add_generation_prompt=False)
        if images or self.template.vision is not None:
            full = self.template.encode_images(text, images).ids
        else:
            full = self.template.encode(text)
        ours = self.ledger.tokens
        bridge = self.context[2][len(self.stop_text) :]
        if full[: len(ours)] == ours and self.template.decode(full[len(ours) :]) == bridge:
            return None
        i = next((k for k, (a, b) in enumerate(zip(ours, full)) if a != b), min(len(ours), len(full)))
        show = lambda ids: repr(self.template.decode(ids[i : i + 8])) if i < len(ids) else "(end)"  # noqa: E731
        return (
            f"the chat template does not reproduce this conversation turn by turn: first difference at token {i} "
            f"of {len(ours)}: laid down {show(ours)}, whole rendering {show(full)}"
        )

    def sample(
        self,
        *,
        prompt: list[Message],
        label: Any = None,
        reward: float = 0.0,
        turn_rewards: Sequence[float] = (),
        token_exact: bool = True,
        **metadata: Any,
    ) -> Sample:
        led = self.ledger
        meta = {
            "num_turns": len(led.model_spans),
            "demo": True,
            **metadata,
        }
        s = Sample(
            prompt=prompt,
            tokens=led.tokens,
            response=self.template.decode(led.response_ids),
            response_length=len(led.response_ids),
            label=label,
            reward=float(reward),
            loss_mask=list(led.loss_mask),
            status=Status.COMPLETED,
            metadata=meta,
            rollout_log_probs=list(led.log_probs),
            weight_versions=["demo"] * len(led.model_spans),
            token_exact=token_exact,
        )
        s.turn_rewards, s.turn_spans, s.env_spans = turn_rewards, led.model_spans, led.env_spans
        self.pictures.write(s)
        s.status_reason = "demonstration"
        s.validate()
        return s


# -- conversations -----------------------------------------------------------------------------------


def conversation_sample(
    template: ChatTemplate,
    messages: Sequence[Message],
    tools: Sequence[dict] | None,
    where: str,
    *,
    allow_non_token_exact: bool = False,
    label: Any = None,
) -> tuple[Sample, int]:
    """One checked conversation as a Sample; also returns how many trailing messages were not trained on."""
    first_assistant = next(i for i, m in enumerate(messages) if m["role"] == "assistant")
    last_assistant = max(i for i, m in enumerate(messages) if m["role"] == "assistant")
    first = list(messages[:first_assistant])
    try:
        b = DemoBuilder(template, first, tools)
        i = first_assistant
        while i <= last_assistant:
            b.assistant(b.assistant_text(messages[i]))
            j = i + 1
            while j <= last_assistant and messages[j]["role"] != "assistant":
                j += 1
            if j <= last_assistant:
                b.observe(messages[i + 1 : j])
            i = j
        problem = b.difference(messages[: last_assistant + 1])
    except TemplateError as exc:
        raise DemoError(f"{where}: {exc}") from None
    if problem is not None and not allow_non_token_exact:
        raise DemoError(f"{where}: {problem} (pass --allow-non-token-exact to keep such rows as token_exact=false)")
    sample = b.sample(prompt=b.first, label=label, token_exact=problem is None, source=where)
    return sample, len(messages) - last_assistant - 1


def conversation_samples(
    rows: Iterable[tuple[str, dict[str, Any]]],
    template: ChatTemplate,
    *,
    env_tools: Sequence[dict] | None = None,
    allow_non_token_exact: bool = False,
    max_problems: int = 20,
) -> tuple[list[Sample], DemoStats]:
    """Conversational rows (``(where, row)``, e.g. from :func:`agentrl.data.read_rows`) as Samples.

    With ``env_tools`` (the env's schemas) every row renders with the env's tools, exactly as its
    rollouts do; a row's own ``tools`` must then name the same tools. Without, each row renders with
    its own ``tools``; either way each tool call's arguments must fit the schema rendered (rows read
    from Parquet, CSV or a datasets folder: store arguments and ``tools`` as JSON strings, since a
    column holds one type and fills other rows' keys with null). Every row is checked first
    (:func:`~agentrl.rollout.demo_checks.check_row`); any problem stops the load with up to
    ``max_problems`` of them listed, so nothing trains on half a file.
    """
    stats = DemoStats()
    samples: list[Sample] = []
    for where, row in rows:
        stats.rows += 1
        try:
            messages, schemas = check_row(row, where, env_tools)
            sample, trailing = conversation_sample(
                template, messages, schemas, where, allow_non_token_exact=allow_non_token_exact, label=row.get("label")
            )
        except DemoError as exc:
            stats.problems.append(str(exc))
            if len(stats.problems) >= max_problems:
                break
            continue
        stats.trailing_messages += trailing
        stats.add(sample)
        samples.append(sample)
    if stats.problems:
        more = f" (stopped at the first {max_problems})" if len(stats.problems) >= max_problems else ""
        raise DemoError(f"{len(stats.problems)} demonstration(s) refused{more}:\n  " + "\n  ".join(stats.problems))
    if not samples:
        raise DemoError("no demonstrations: the file has no rows")
    return samples, stats


# -- scripted policies ---------------------------------------------------------------------------------


def played_sample(template: ChatTemplate, result: Any, where: str, role: str | None = None) -> Sample:
    """A :class:`~agentrl.rollout.scripted.PlayResult` as a Sample: the policy's texts verbatim, the env's
    observations as deltas (the last observation, after the final turn, is not part of an episode).

    ``role`` (an env with roles): that seat's demonstration, from its own conversation, texts and rewards
    (``result.role_plays``); the sample's ``role`` names it."""
    play = result.role_plays[role] if role is not None else result
    msgs, texts = play.messages, play.texts
    turn_rewards = play.turn_rewards if role is not None else result.rewards
    first_assistant = next(i for i, m in enumerate(msgs) if m.get("role") == "assistant")
    try:
        b = DemoBuilder(template, msgs[:first_assistant], result.tools)
        conversation = list(msgs[:first_assistant])
        asst = [i for i, m in enumerate(msgs) if m.get("role") == "assistant"]
        if len(asst) != len(texts):  # the conversation's turns must be the texts played (never another seat's)
            raise DemoError(f"{where}: {len(asst)} assistant turns in the conversation, {len(texts)} texts played")
        for k, (i, text) in enumerate(zip(asst, texts)):
            b.assistant(text)
            conversation.append({"role": "assistant", "content": text})
            if k + 1 < len(asst):
                obs = msgs[i + 1 : asst[k + 1]]
                b.observe(obs)
                conversation.extend(obs)
        problem = b.difference(conversation)
    except TemplateError as exc:
        raise DemoError(f"{where}: {exc}") from None
    if problem is not None:
        raise DemoError(f"{where}: {problem}")
    s = b.sample(
        prompt=b.first,
        label=result.task.get("label"),
        reward=float(sum(turn_rewards)),
        turn_rewards=list(turn_rewards),
        source=where,
    )
    if role is not None:
        s.role = role
    return s


async def scripted_samples(
    make_env: Callable[[], Any],
    policy: Callable,
    tasks: Sequence[dict[str, Any]],
    template: ChatTemplate,
    *,
    min_reward: float | None = None,
    max_turns: int = 10,
    seed: int = 0,
    concurrency: int = 8,
) -> tuple[list[Sample], DemoStats]:
    """Play ``policy`` once per task; keep episodes without errors whose reward reaches ``min_reward``.

    An env with roles gives one demonstration per seat that played a turn (the policy plays every seat), each
    from that seat's own conversation and kept by that seat's reward: ``min_reward`` keeps the winner's side
    of a game and drops the loser's."""
    results = await play(make_env, policy, tasks, seed=seed, max_turns=max_turns, concurrency=concurrency)
    stats = DemoStats()
    samples: list[Sample] = []
    for i, r in enumerate(results):
        seats: list[str | None] = [role for role, p in r.role_plays.items() if p.texts] if r.role_plays else [None]
        stats.rows += len(r.role_rewards) or 1  # a seat per role of the env (set at reset), played or not
        if r.error is not None or not r.texts:
            stats.failed_episodes += 1
            stats.problems.append(f"task {i}: {r.error or 'no turn played'}")
            continue
        for role in seats:
            reward = r.role_plays[role].reward if role is not None else r.reward
            if min_reward is not None and reward < min_reward:
                stats.below_min_reward += 1
                continue
            s = played_sample(template, r, f"task {i}" + (f", role {role}" if role is not None else ""), role)
            s.group_index, s.index = i, i  # the task's number (the seats of one episode share it, as in a rollout)
            stats.add(s)
            samples.append(s)
    return samples, stats


# -- rejection sampling ----------------------------------------------------------------------------------


async def rejection_samples(
    ctx: Any,
    make_env: Callable[[], Any],
    tasks: Sequence[dict[str, Any]],
    *,
    min_reward: float,
    best_of_n: bool = False,
) -> tuple[list[Sample], DemoStats]:
    """``ctx.config.n_samples_per_prompt`` real episodes per task on ``ctx.engine``; keep the good ones.

    Kept: completed or truncated by the turn limit (not cut off mid-turn), token-exact, reward >=
    ``min_reward``; with ``best_of_n`` only the highest-reward episode of each task (of each role's,
    for an env with roles), with all its segments (a rewritten history). The episodes' ids are the
    engine's own, so the engine must share the trained model's tokenizer (the policy itself, or a
    larger model of the same family).
    """
    rollout, _ = await generate_rollout(ctx, make_env, tasks)
    stats = DemoStats(rows=len(rollout))
    best: dict[tuple[int, Any], tuple[float, Any]] = {}  # per (task, role): the best episode's reward and id
    passed: list[tuple[int, Any, Sample]] = []
    kept: list[Sample] = []
    for s in rollout:
        cut = s.status_reason in ("response_length", "response_budget", "context_length")  # a turn without its end
        if s.status not in (Status.COMPLETED, Status.TRUNCATED) or cut or not s.token_exact or not s.response_length:
            stats.failed_episodes += 1
            continue
        reward = scalar_reward(s)
        if reward is None or reward < min_reward:  # None: a dict reward has no value to compare
            stats.below_min_reward += 1
            continue
        s.metadata["demo"] = True
        g = int(s.group_index or 0)
        if best_of_n:  # an episode in segments (a rewritten history) is chosen, and kept, whole; roles apart
            episode = s.episode_key
            task = (g, episode[1])
            if task not in best or reward > best[task][0]:
                best[task] = (reward, episode)
            passed.append((g, episode, s))
        else:
            kept.append(s)
    if best_of_n:
        chosen = {(task[0], episode) for task, (_, episode) in best.items()}
        kept = [s for g, episode, s in sorted(passed, key=lambda p: p[0]) if (g, episode) in chosen]
    for s in kept:
        stats.add(s)
    return kept, stats
