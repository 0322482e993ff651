"""GSM8K with the calculator: the shipped data, the reward, and its annotations as demonstrations."""

from __future__ import annotations

import asyncio
import json

import agentrl
from agentrl.chat import ChatTemplate
from agentrl.data import read_rows
from agentrl.envs.gsm8k import (
    DATA,
    GSM8K,
    GSM8KFormat,
    annotation_policy,
    annotations,
    reference_answer,
    write_conversations,
)
from agentrl.registry import load_env
from agentrl.rollout.demos import conversation_samples
from agentrl.rollout.scripted import play_sync


def test_the_published_splits_ship_with_their_licence():
    assert len(GSM8K.tasks(split="train")) == 7473 and len(GSM8K.tasks(split="test")) == 1319
    assert "MIT License" in (DATA / "LICENSE").read_text() and "OpenAI" in (DATA / "LICENSE").read_text()
    first = GSM8K.tasks(1, split="train")[0]
    assert first["label"] == "72" and first["prompt"].startswith("Natalia sold clips")
    assert annotations(first["answer"]) == ["48/2", "48+24"]
    assert reference_answer("so\n#### 1,234") == "1234"
    assert load_env("agentrl/GSM8K-v0")().max_turns == 8


def test_annotation_chains_earn_the_reward_and_guessing_does_not():
    tasks = GSM8K.tasks(60, split="test")
    solved = play_sync(GSM8K, annotation_policy, tasks, max_turns=8)
    rate = sum(r.reward == 1.0 for r in solved) / len(solved)
    assert rate >= 0.85, rate  # the rest: chains whose last step is not the answer, or the calculator refuses
    assert all(r.error is None for r in solved)
    assert max(r.turns for r in solved) > 2  # several calculator calls, one per turn
    guessed = play_sync(GSM8K, lambda m, t: "The answer is 7.", tasks, max_turns=8)
    assert sum(r.reward for r in guessed) <= 3


def test_exact_match_is_reported_and_format_credit_is_optional():
    async def final(env_cls, text):
        env = env_cls()
        await env.reset(options={"prompt": "q", "label": "Natalia ...\n#### 72"})  # a raw row via --label-key answer
        _, reward, terminated, _, info = await env.step(agentrl.Action(text=text))
        await env.close()
        return reward, terminated, info

    assert asyncio.run(final(GSM8K, "The answer is 72.")) == (1.0, True, {"exact_match": True})
    assert asyncio.run(final(GSM8K, "The answer is 71."))[:2] == (0.0, True)
    assert asyncio.run(final(GSM8KFormat, "The answer is 71."))[0] == 0.1
    assert asyncio.run(final(GSM8KFormat, "seventy-one"))[0] == 0.0


def test_written_conversations_load_as_token_exact_demonstrations(tmp_path, tiny_tokenizer):
    out = tmp_path / "gsm8k_sft.jsonl"
    counts = write_conversations("train", out, limit=40)
    assert counts["played"] == 40 and 34 <= counts["written"] <= 40
    rows = list(read_rows(out))
    first = rows[0][1]["messages"]
    assert [m["role"] for m in first] == ["system", "user", "assistant", "tool", "assistant", "tool", "assistant"]
    assert json.loads(first[2]["tool_calls"][0]["function"]["arguments"]) == {"expression": "48/2"}
    assert first[3] == {
        "role": "tool",
        "content": "24",
        "name": "calculator",
        "tool_call_id": first[2]["tool_calls"][0]["id"],
    }
    samples, stats = conversation_samples(rows, ChatTemplate(tiny_tokenizer), env_tools=GSM8K().tool_schemas())
    assert stats.kept == counts["written"] and all(s.token_exact for s in samples)
    assert stats.assistant_turns == sum(sum(m["role"] == "assistant" for m in r["messages"]) for _, r in rows)
