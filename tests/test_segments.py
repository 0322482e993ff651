"""Episodes whose history is rewritten (compaction, summaries, a template that re-renders earlier turns):
linked segments, each its own token-exact sample, against the real embedded engine over HTTP."""

from __future__ import annotations

import json

import pytest
import torch

import agentrl
from agentrl.algo.advantages import compute_advantages, grpo
from agentrl.chat import ChatTemplate
from agentrl.config import RolloutConfig
from agentrl.engines.http import SGLangEngine
from agentrl.rollout.episode import EpisodeContext
from agentrl.rollout.eval import score_samples
from agentrl.rollout.generate import generate_rollout
from agentrl.rollout.history import drop_tool_outputs, strip_thinking
from agentrl.types import Sample, Status
from tests.test_episode import TalkEnv, _rescore

SUMMARY = "Summary of the conversation so far: the user asked twice."


class SummarizingTalk(TalkEnv):
    """TalkEnv (3 steps, 0.5 each) that replaces the history by a summary once it is 5 messages long."""

    async def rewrite_history(self, messages):
        if len(messages) < 5:
            return None
        return [{"role": "user", "content": SUMMARY}, messages[-1]]


class SameHistory(TalkEnv):
    async def rewrite_history(self, messages):
        return list(messages)  # a "rewrite" that changes nothing: the sample goes on


class BadRewrite(TalkEnv):
    async def rewrite_history(self, messages):
        kind = self.prompt
        if kind == "text":
            return "not a list"
        if kind == "role":
            return [{"role": "wizard", "content": "x"}]
        if kind == "empty":
            return []
        if kind == "raise":
            raise SystemExit(3)
        return None

    async def reset(self, *, seed=None, options=None):
        self.prompt = options["prompt"]
        return await super().reset(seed=seed, options=options)


EARLIER = "[earlier answer]"
FORGETFUL_TEMPLATE = (
    "{% set ns = namespace(last=-1) %}"
    "{% for m in messages %}{% if m['role'] == 'assistant' %}{% set ns.last = loop.index0 %}{% endif %}{% endfor %}"
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + ('" + EARLIER + "' if message['role'] == 'assistant' and "
    "loop.index0 < ns.last else (message['content'] or '')) + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
"""ChatML that renders every assistant turn but the last as a placeholder (as Qwen3's drops earlier reasoning)."""


def _ctx(url, tokenizer, template=None, **cfg) -> EpisodeContext:
    config = RolloutConfig(**{"rollout_max_turn_len": 200, "max_turns": 5, **cfg})
    return EpisodeContext(engine=SGLangEngine(url), template=ChatTemplate(tokenizer, template=template), config=config)


def _episodes(samples: list[Sample]) -> dict[str, list[Sample]]:
    out: dict[str, list[Sample]] = {}
    for s in samples:
        out.setdefault(s.metadata.get("episode_id", f"single-{id(s)}"), []).append(s)
    return out


def _assert_token_exact(model, template: ChatTemplate, s: Sample, temperature: float = 1.0) -> None:
    s.validate()
    assert s.tokens[: s.prompt_length] == template.prompt(s.prompt, [])[1]  # the prompt is its conversation
    full = _rescore(model, s.tokens, temperature)[s.prompt_length - 1 :]
    mask = torch.tensor(s.loss_mask, dtype=torch.bool)
    assert mask.sum() > 0
    diff = (full[mask] - torch.tensor(s.rollout_log_probs)[mask]).abs().max().item()
    assert diff < 1e-4, f"segment {s.metadata.get('segment')}: max |rescored - rollout| = {diff}"
    assert all(lp == 0.0 for lp, m in zip(s.rollout_log_probs, s.loss_mask) if m == 0)


@pytest.fixture(scope="module")
def tiny_model(tiny_ckpt):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_ckpt, dtype=torch.float32).eval()


async def test_a_rewrite_starts_a_linked_token_exact_segment(tiny_server, tiny_tokenizer, tiny_model):
    ctx = _ctx(tiny_server, tiny_tokenizer, n_samples_per_prompt=2)
    samples, _ = await generate_rollout(ctx, SummarizingTalk, [{"prompt": "hello"}, {"prompt": "tell me more"}])
    await ctx.engine.close()
    episodes = _episodes(samples)
    assert len(episodes) == 4 and len(samples) == 8
    for segs in episodes.values():
        first, second = segs
        assert [s.metadata["segment"] for s in segs] == [0, 1] and {s.metadata["num_segments"] for s in segs} == {2}
        assert [(s.segment, s.num_segments) for s in segs] == [(0, 2), (1, 2)]  # the typed view of the same keys
        assert first.group_index == second.group_index and first.index == second.index
        assert {s.status for s in segs} == {Status.COMPLETED} and {s.reward for s in segs} == {1.5}
        assert first.turn_rewards == [0.5, 0.5] and second.turn_rewards == [0.5]  # each keeps its own turns
        assert first.metadata["history_rewrites"] == 1
        assert second.prompt[0] == {"role": "user", "content": SUMMARY}
        assert second.prompt[1]["content"].startswith("Turn 2: say more")
        for s in segs:
            _assert_token_exact(tiny_model, ctx.template, s)
        # the first segment's mask-0 span is exactly the observation it answered, as the template renders it
        (a, b) = first.env_spans[0]
        env_text = ctx.template.decode(first.tokens[first.prompt_length + a : first.prompt_length + b])
        assert "<|im_start|>user\nTurn 1: say more" in env_text and env_text.endswith("<|im_start|>assistant\n")
    # group advantages count each episode once: here every episode earned the same, so all are 0
    rewards = torch.tensor([s.reward for s in samples])
    ids = [s.metadata["episode_id"] for s in samples]
    adv = grpo(rewards, [s.group_index for s in samples], episode_ids=ids)
    assert torch.equal(adv, torch.zeros(8))


async def test_a_rewrite_that_changes_nothing_keeps_one_sample(tiny_server, tiny_tokenizer, tiny_model):
    ctx = _ctx(tiny_server, tiny_tokenizer, n_samples_per_prompt=2)
    samples, _ = await generate_rollout(ctx, SameHistory, [{"prompt": "hello"}])
    await ctx.engine.close()
    assert len(samples) == 2
    for s in samples:
        assert "episode_id" not in s.metadata and "history_rewrites" not in s.metadata
        assert len(s.turn_spans) == 3 and s.reward == 1.5
        _assert_token_exact(tiny_model, ctx.template, s)


async def test_a_bad_rewrite_fails_only_its_sample(tiny_server, tiny_tokenizer):
    ctx = _ctx(tiny_server, tiny_tokenizer)
    kinds = ["text", "role", "empty", "raise", "fine"]
    samples, _ = await generate_rollout(ctx, BadRewrite, [{"prompt": k} for k in kinds])
    await ctx.engine.close()
    by_kind = {s.metadata["reset_info"] and s.prompt[0]["content"]: s for s in samples}
    for kind, reason, text in (
        ("text", "env_contract", "rewrite_history() must return a list of messages"),
        ("role", "env_contract", "rewrite_history(): message 0 has role 'wizard'"),
        ("empty", "env_contract", "rewrite_history() returned no messages"),
        ("raise", "env_error", "rewrite_history() raised SystemExit"),
    ):
        s = by_kind[kind]
        assert (s.status, s.status_reason) == (Status.FAILED, reason), s.metadata
        assert text in s.metadata["error"]
    assert by_kind["fine"].status == Status.COMPLETED


async def test_a_template_that_rerenders_history_is_counted_or_followed(tiny_server, tiny_tokenizer, tiny_model):
    tasks = [{"prompt": "hello"}, {"prompt": "what now"}]
    ctx = _ctx(tiny_server, tiny_tokenizer, template=FORGETFUL_TEMPLATE, n_samples_per_prompt=2)
    exact, _ = await generate_rollout(ctx, TalkEnv, tasks)
    assert len(exact) == 4  # default: the rollout's exact tokens, one sample per episode
    for s in exact:
        assert s.metadata["template_breaks"] == 1  # counted once: the sample differs from then on anyway
        assert "episode_id" not in s.metadata and len(s.turn_spans) == 3

    ctx = _ctx(
        tiny_server, tiny_tokenizer, template=FORGETFUL_TEMPLATE, n_samples_per_prompt=2, history_mode="template"
    )
    followed, _ = await generate_rollout(ctx, TalkEnv, tasks)
    await ctx.engine.close()
    episodes = _episodes(followed)
    assert len(episodes) == 4 and len(followed) > 4
    for segs in episodes.values():
        assert sum(len(s.turn_spans) for s in segs) == 3 and {s.reward for s in segs} == {1.5}
        for s in segs:
            _assert_token_exact(tiny_model, ctx.template, s)
        last = segs[-1]  # its prompt is the template's rendering: turn 1 as the placeholder
        assert any(m["role"] == "assistant" for m in last.prompt)
        assert EARLIER in ctx.template.decode(last.tokens[: last.prompt_length])


def test_group_advantages_count_each_episode_once():
    # group 0: episode A (3 segments, reward 1) and episode B (1 sample, reward 0); group 1: C=1, D=1
    rewards = torch.tensor([1.0, 1.0, 1.0, 0.0, 1.0, 1.0])
    groups = [0, 0, 0, 0, 1, 1]
    episodes = ["A", "A", "A", "B", "C", "D"]
    adv = grpo(rewards, groups, episode_ids=episodes)
    # over episodes: mean 0.5, unbiased std sqrt(0.5) -> A: +0.7071 on each segment, B: -0.7071
    assert adv[:4].tolist() == pytest.approx([0.5**0.5] * 3 + [-(0.5**0.5)], abs=1e-5)
    assert adv[4:].tolist() == [0.0, 0.0]
    per_sample = grpo(rewards, groups)  # without ids the 3 segments would count 3 times
    assert per_sample[3] != pytest.approx(adv[3])
    masks = [torch.ones(2)] * 6
    rloo = compute_advantages("rloo", rewards=rewards, group_ids=groups, loss_masks=masks, episode_ids=episodes)
    assert rloo[0].tolist() == pytest.approx([1.0, 1.0]) and rloo[3].tolist() == pytest.approx([-1.0, -1.0])
    with pytest.raises(ValueError, match="segments of episode 'A' have different rewards"):
        grpo(torch.tensor([1.0, 0.0]), [0, 0], episode_ids=["A", "A"])
    with pytest.raises(ValueError, match="--per-turn-credit needs each episode as one sample"):
        compute_advantages(
            "grpo",
            rewards=rewards,
            group_ids=groups,
            loss_masks=masks,
            turn_rewards=[[1.0]] * 6,
            turn_spans=[[(0, 2)]] * 6,
            per_turn=True,
            episode_ids=episodes,
        )


@pytest.mark.parametrize("reward", [3 / 7, 5 / 7, 0.1, 1 / 3])
def test_a_group_of_equal_rewards_gets_no_advantage_whatever_its_segments(reward):
    """Episode weights of 1/3 do not sum exactly in floating point; a tie group must still get exactly 0 (before
    the fix a mean one rounding step off, over a std of rounding noise, gave every sample ~-0.03 to -0.1)."""
    rewards = torch.full((6,), reward)
    groups, episodes = [0] * 6, ["a", "a", "a", "b", "c", "c"]
    assert grpo(rewards, groups, episode_ids=episodes).tolist() == [0.0] * 6
    masks = [torch.ones(2)] * 6
    for estimator in ("rloo", "grpo"):
        adv = compute_advantages(estimator, rewards=rewards, group_ids=groups, loss_masks=masks, episode_ids=episodes)
        assert all(a.abs().max().item() == 0.0 for a in adv), estimator
    # one reward apart, the same weights: the usual GRPO values (two episodes above the mean, one below)
    rewards[3] = reward + 0.5
    adv = grpo(rewards, groups, episode_ids=episodes)
    assert adv[3].item() > 1.0 and adv[0].item() < 0 and adv[0].item() == pytest.approx(adv[4].item(), abs=1e-6)


def test_eval_counts_an_episode_in_segments_once():
    def seg(k: int, n: int, reward: float, group: int) -> Sample:
        s = Sample(group_index=group, index=group, status=Status.COMPLETED, reward=reward)
        s.metadata.update(episode_id=f"e{group}", segment=k, num_segments=n)
        return s

    samples = [seg(0, 3, 1.0, 0), seg(1, 3, 1.0, 0), seg(2, 3, 1.0, 0), Sample(group_index=1, index=1, reward=0.0)]
    samples[-1].status = Status.COMPLETED
    out = score_samples(samples, n_samples=1)
    assert out["num_samples"] == 2 and out["pass@1"] == 0.5 and out["reward_mean"] == 0.5


def test_history_helpers_copy_and_compact():
    convo = [
        {"role": "user", "content": "q1"},
        {"role": "assistant", "content": "<think>long\nreasoning</think>\nA1"},
        {"role": "tool", "tool_call_id": "c0", "content": "out 0"},
        {"role": "tool", "tool_call_id": "c1", "content": "out 1"},
        {"role": "user", "content": "q2"},
        {"role": "assistant", "content": "<think>now</think>A2"},
    ]
    stripped = strip_thinking(convo)
    assert stripped[1]["content"] == "A1" and stripped[5]["content"] == "<think>now</think>A2"  # after the last user
    assert convo[1]["content"].startswith("<think>")  # the input is not changed
    dropped = drop_tool_outputs(convo, keep_last=1)
    assert [m["content"] for m in dropped if m["role"] == "tool"] == ["[tool output removed to save context]", "out 1"]
    assert dropped[2]["tool_call_id"] == "c0" and convo[2]["content"] == "out 0"
    assert drop_tool_outputs(dropped, keep_last=1) == dropped  # idempotent: compaction every turn is stable
    with pytest.raises(ValueError, match="keep_last"):
        drop_tool_outputs(convo, keep_last=-1)


async def test_compact_search_qa_plays_with_rewrites():
    from agentrl.envs.search_qa import CompactSearchQA
    from agentrl.rollout.scripted import play

    def policy(messages, task):
        if sum(m["role"] == "tool" for m in messages) < 3:
            call = {"name": "search", "arguments": {"query": task["prompt"][:40]}}
            return f"<tool_call>{json.dumps(call)}</tool_call>"
        return "<answer>x</answer>"

    (r,) = await play(CompactSearchQA, policy, CompactSearchQA.tasks(1))
    assert r.error is None and r.turns == 4 and r.rewrites == 2
    report = await agentrl.check_env(CompactSearchQA, CompactSearchQA.tasks(1))
    assert report.ok, report.format()


class TrimmingTalk(TalkEnv):
    """Rewrites by editing the messages it is given in place (and returning them)."""

    async def rewrite_history(self, messages):
        for m in messages:
            if m["role"] == "user":
                m["content"] = m["content"][:3]
        return messages


async def test_play_gives_a_rewrite_a_copy_as_the_rollout_does():
    from agentrl.rollout.scripted import play

    seen = []

    def policy(messages, task):
        seen.append([m["content"] for m in messages if m["role"] == "user"])
        return "hi"

    (r,) = await play(TrimmingTalk, policy, [{"prompt": "hello there"}])
    assert r.error is None and r.turns == 3 and r.rewrites >= 1
    assert all(len(c) <= 3 for c in seen[1])  # the policy read the trimmed history
    assert r.messages[0]["content"] == "hello there"  # the episode as played is not edited by the rewrite


async def test_play_counts_rewrites_as_the_rollout_does():
    """``play`` walks the episode loop's seats: a rewrite before the agent's next turn counts only when it
    changes the history (as a rollout's ``history_rewrites``); the whole episode stays in ``messages``."""
    from agentrl.rollout.scripted import play

    same, summarized = await play(SameHistory, lambda m, t: "hi", [{"prompt": "hello"}]) + await play(
        SummarizingTalk, lambda m, t: "hi", [{"prompt": "hello"}]
    )
    assert same.error is None and same.turns == 3 and same.rewrites == 0 and len(same.messages) == 7
    assert summarized.error is None and summarized.turns == 3 and summarized.rewrites == 1
    assert len(summarized.messages) == 7 and summarized.reward == 1.5 and summarized.terminated


@pytest.mark.e2e
def test_training_on_segmented_episodes(tiny_ckpt, tmp_path, ray_local):
    """A run whose env summarises its history: every segment is trained, each with its episode's advantage,
    and the metrics count the episode once."""
    from pathlib import Path

    from agentrl.config import RunConfig, TrainConfig
    from agentrl.runtime.train import train

    save = tmp_path / "run"
    cfg = RunConfig(
        env=f"{Path(__file__).resolve()}:ScoredSummarizingTalk",
        hf_checkpoint=str(tiny_ckpt),
        num_rollout=1,
        rollout_batch_size=2,
        save=str(save),
        rollout=RolloutConfig(n_samples_per_prompt=4, max_turns=5, rollout_max_turn_len=48),
        train=TrainConfig(lr=1e-3, global_batch_size=8),
    )
    train(cfg)
    (line,) = [json.loads(x) for x in open(save / "metrics.jsonl")]
    dump = [json.loads(x) for x in open(save / "rollouts" / "rollout_000000.jsonl")]
    by_episode: dict[str, list[dict]] = {}
    for s in dump:
        by_episode.setdefault(s["metadata"].get("episode_id", str(id(s))), []).append(s)
    split = [e for e in by_episode.values() if len(e) > 1]
    assert split and line["count_extra_segments"] == sum(len(e) - 1 for e in split)
    assert line["samples"] == len(dump) and line["train_samples"] == len(dump)
    rewards = {e[0]["reward"] for e in by_episode.values()}
    assert len(rewards) > 1  # the episodes differ, so the advantages are not all 0
    # GRPO over episodes, each counted once however many segments it has, on every one of its segments
    groups: dict[int, list[list[dict]]] = {}
    for episode in by_episode.values():
        groups.setdefault(episode[0]["group_index"], []).append(episode)
    for episodes in groups.values():
        r = torch.tensor([e[0]["reward"] for e in episodes])
        want = (r - r.mean()) / (r.std() + 1e-6) if len(episodes) > 1 else torch.zeros(len(episodes))
        for episode, adv in zip(episodes, want.tolist()):
            for s in episode:
                got = next(a for a, m in zip(s["advantages"], s["loss_mask"]) if m)
                assert got == pytest.approx(adv, abs=1e-4), (s["group_index"], s["metadata"].get("segment"))


class ScoredSummarizingTalk(SummarizingTalk):
    """SummarizingTalk whose last step is scored by the length of the answer (so episodes differ)."""

    @staticmethod
    def tasks():
        return [{"prompt": f"question {i}", "label": ""} for i in range(4)]

    async def step(self, action):
        obs, reward, done, truncated, info = await super().step(action)
        return obs, (len(action.text) % 7) / 7 if done else reward, done, truncated, info


RAISING_TEMPLATE = (  # raises on any re-rendered history; the SDK's delta stand-in (first user message "x") passes
    "{% if messages|length > 2 and messages[0]['content'] != 'x' %}"
    "{{ raise_exception('this template renders no earlier assistant turns') }}{% endif %}"
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + (message['content'] or '') + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


async def test_a_template_that_cannot_rerender_history_keeps_the_exact_tokens(tiny_server, tiny_tokenizer):
    """jinja's raise_exception while re-rendering (Llama-3's single-tool-call check): exact mode keeps going."""
    ctx = _ctx(tiny_server, tiny_tokenizer, template=RAISING_TEMPLATE)
    (s,), _ = await generate_rollout(ctx, TalkEnv, [{"prompt": "hello"}])
    assert s.status == Status.COMPLETED and len(s.turn_spans) == 3, s.metadata
    assert s.metadata.get("template_check_error") is True
    ctx = _ctx(tiny_server, tiny_tokenizer, template=RAISING_TEMPLATE, history_mode="template")
    (s,), _ = await generate_rollout(ctx, TalkEnv, [{"prompt": "hello"}])
    await ctx.engine.close()
    assert (s.status, s.status_reason) == (Status.FAILED, "template") and "earlier assistant" in s.metadata["error"]


class MutatingRewrite(TalkEnv):
    async def rewrite_history(self, messages):
        messages[0]["content"] = "MUTATED"  # in place, returning the same list
        return messages


async def test_an_in_place_rewrite_is_a_rewrite_and_leaves_earlier_prompts_alone(tiny_server, tiny_tokenizer):
    ctx = _ctx(tiny_server, tiny_tokenizer)
    samples, _ = await generate_rollout(ctx, MutatingRewrite, [{"prompt": "hello"}])
    await ctx.engine.close()
    assert len(samples) >= 2 and samples[0].prompt[0]["content"] == "hello"
    assert samples[1].prompt[0]["content"] == "MUTATED" and samples[0].metadata["history_rewrites"] == 1


HOOKS = """
import asyncio
SUMMARY = {summary!r}
seen = []

def summarize(messages, task):
    seen.append((task["prompt"], [m["content"] for m in messages]))
    if len(messages) < 5:
        return None
    return [{{"role": "user", "content": SUMMARY + " (" + task["prompt"] + ")"}}, messages[-1]]

async def after_env(messages, task):
    seen.append((task["prompt"], [m["content"] for m in messages]))
    await asyncio.sleep(0)
    return None

def bad(messages, task):
    if task["prompt"] == "text":
        return "not a list"
    if task["prompt"] == "raise":
        raise SystemExit(4)
    return None

def one_arg(messages):
    return None

async def gen(args, sample, sampling_params):
    return sample
"""


@pytest.fixture
def hooks(tmp_path, monkeypatch):
    import importlib

    (tmp_path / "my_hooks.py").write_text(HOOKS.format(summary=SUMMARY))
    monkeypatch.syspath_prepend(str(tmp_path))
    import my_hooks

    return importlib.reload(my_hooks)


async def test_a_history_rewrite_hook_compacts_an_env_it_does_not_own(tiny_server, tiny_tokenizer, tiny_model, hooks):
    ctx = _ctx(tiny_server, tiny_tokenizer, history_rewrite_path="my_hooks:summarize")
    samples, _ = await generate_rollout(ctx, TalkEnv, [{"prompt": "hello"}])
    await ctx.engine.close()
    first, second = samples  # TalkEnv has no rewrite_history(): the hook alone segments it
    assert [s.metadata["segment"] for s in samples] == [0, 1] and first.metadata["history_rewrites"] == 1
    assert second.prompt[0] == {"role": "user", "content": f"{SUMMARY} (hello)"}  # the hook saw the task row
    assert {s.reward for s in samples} == {1.5} and {s.status for s in samples} == {Status.COMPLETED}
    for s in samples:
        _assert_token_exact(tiny_model, ctx.template, s)
    assert [len(contents) for _, contents in hooks.seen] == [3, 5]  # after each step that went on


async def test_the_hook_runs_after_the_envs_own_rewrite(tiny_server, tiny_tokenizer, hooks):
    ctx = _ctx(tiny_server, tiny_tokenizer, history_rewrite_path="my_hooks:after_env")
    samples, _ = await generate_rollout(ctx, SummarizingTalk, [{"prompt": "hi"}])
    await ctx.engine.close()
    assert len(samples) == 2  # the env's summary still segments the episode; the hook kept it
    assert hooks.seen[1][1][0] == SUMMARY  # the hook was given the env's rewrite, not the original


async def test_a_bad_history_hook_fails_only_its_sample(tiny_server, tiny_tokenizer, hooks):
    ctx = _ctx(tiny_server, tiny_tokenizer, history_rewrite_path="my_hooks:bad")
    samples, _ = await generate_rollout(ctx, TalkEnv, [{"prompt": k} for k in ("text", "raise", "fine")])
    await ctx.engine.close()
    by_prompt = {s.prompt[0]["content"]: s for s in samples}
    assert len(by_prompt) == 3, list(by_prompt)
    for kind, reason, text in (
        ("text", "env_contract", "--history-rewrite-path my_hooks:bad must return a list of messages"),
        ("raise", "env_error", "--history-rewrite-path my_hooks:bad raised SystemExit"),
    ):
        s = by_prompt[kind]
        assert (s.status, s.status_reason) == (Status.FAILED, reason), s.metadata
        assert text in s.metadata["error"]
    assert by_prompt["fine"].status == Status.COMPLETED


def test_a_history_hook_that_cannot_run_is_refused_before_anything_starts(hooks, tmp_path):
    from agentrl.config import RunConfig
    from agentrl.rollout.generate import check_rollout_features

    (tmp_path / "broken_hook.py").write_text("def fn(messages, task)\n")  # a syntax error
    for path, text in (
        ("my_hooks:missing", "--history-rewrite-path my_hooks:missing: expected module:fn"),
        ("my_hooks:one_arg", "TypeError: too many positional arguments"),
        ("no_such_module_here:fn", "--history-rewrite-path no_such_module_here:fn"),
        (f"{tmp_path}/absent.py:fn", "--history-rewrite-path .*absent.py:fn"),
        (f"{tmp_path}/broken_hook.py:fn", "SyntaxError"),
    ):
        with pytest.raises(ValueError, match=text.replace("(", r"\(").replace(")", r"\)")):
            check_rollout_features(RolloutConfig(history_rewrite_path=path), [{"prompt": "x"}])
    hook = RolloutConfig(history_rewrite_path="my_hooks:summarize")
    check_rollout_features(hook, [{"prompt": "x"}])  # a hook that loads
    assert check_rollout_features(hook, [{"prompt": "x"}]) is hooks.summarize  # loaded once, for every episode
    with pytest.raises(ValueError, match="a row's generate_function_path"):
        check_rollout_features(hook, [{"prompt": "x", "generate_function_path": "my_hooks:summarize"}])
    with pytest.raises(ValueError, match="custom generate or rollout function"):
        check_rollout_features(hook, [], custom=True)
    cfg = RunConfig(
        env="agentrl/Digits-v0",
        custom_generate_function_path="my_hooks:summarize",
        rollout=RolloutConfig(history_rewrite_path="my_hooks:summarize"),
    )
    with pytest.raises(ValueError, match="--history-rewrite-path rewrites the env-driven episode loop"):
        cfg.validate()


async def test_the_hook_rewrites_each_roles_history(tiny_server, tiny_tokenizer, tiny_model, hooks):
    from tests.test_roles import LongDebate

    ctx = _ctx(tiny_server, tiny_tokenizer, history_rewrite_path="my_hooks:summarize", max_turns=10)
    samples, _ = await generate_rollout(ctx, lambda: LongDebate(), [{"prompt": "tea"}])  # built by a function
    await ctx.engine.close()
    assert {s.status for s in samples} == {Status.COMPLETED}, [s.metadata.get("error") for s in samples]
    by_role = {r: [s for s in samples if s.role == r] for r in ("a", "b")}
    for role, segs in by_role.items():  # each role's history reached 5 messages before its third turn
        assert [s.segment for s in segs] == [0, 1] and segs[0].metadata["history_rewrites"] == 1, role
        assert segs[1].prompt[0]["content"] == f"{SUMMARY} (tea)"
        assert {s.episode_id for s in segs} == {samples[0].episode_id} and {s.reward for s in segs} == {
            sum(sum(x.turn_rewards) for x in segs)
        }
        assert sum(len(s.turn_spans) for s in segs) == 3
        for s in segs:
            _assert_token_exact(tiny_model, ctx.template, s)
    assert by_role["a"][0].reward == 1.0 and by_role["b"][0].reward == 0.75
    assert len(hooks.seen) == 4  # before each role's second and third turns


def test_the_cli_refuses_a_hook_that_cannot_run_before_starting_an_engine(tmp_path, capsys, hooks, monkeypatch):
    import agentrl.checkpoint
    from agentrl.cli import main

    def no_model(*a, **kw):
        raise AssertionError("the checkpoint was resolved: the refusal came too late")

    monkeypatch.setattr(agentrl.checkpoint, "resolve_hf_checkpoint", no_model)
    monkeypatch.setattr("agentrl.cli.resolve_hf_checkpoint", no_model)  # the name the command calls

    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"prompt": "x"}\n')
    code = main(["rollout", "--env", "agentrl/TicTacToe-v0", "--prompt-data", str(rows),
                 "--history-rewrite-path", "my_hooks:one_arg"])  # fmt: skip
    assert code != 0 and "--history-rewrite-path my_hooks:one_arg: expected module:fn" in capsys.readouterr().err


def test_train_refuses_a_hook_its_eval_rows_would_skip_before_anything_starts(tiny_ckpt, tmp_path, hooks, monkeypatch):
    from agentrl.config import RunConfig
    from agentrl.runtime import train as train_mod

    def too_late(*a, **kw):
        raise AssertionError("the runtime (Ray, engines) started before the refusal")

    monkeypatch.setattr(train_mod._Runtime, "__init__", too_late)
    held = tmp_path / "held.jsonl"
    held.write_text(json.dumps({"prompt": "x", "generate_function_path": "my_hooks:gen"}) + "\n")
    rows = tmp_path / "rows.jsonl"
    rows.write_text(json.dumps({"prompt": "x"}) + "\n")  # the training rows are fine: only the eval set is not
    cfg = RunConfig(
        env="tests.test_episode:TalkEnv",
        prompt_data=str(rows),
        hf_checkpoint=str(tiny_ckpt),
        save=str(tmp_path / "run"),
        eval_prompt_data=[("held", str(held))],
        eval_interval=1,
        rollout=RolloutConfig(history_rewrite_path="my_hooks:summarize", trust_row_code=True),
    )
    with pytest.raises(ValueError, match="a row's generate_function_path"):
        train_mod.train(cfg)
