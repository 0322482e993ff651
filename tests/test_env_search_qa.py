"""The search_qa env: shipped data matches its generator, the reward is SQuAD F1, a scripted searcher
solves it, a random policy does not, and ``agentrl rollout`` runs it with the tiny model."""

from __future__ import annotations

import json
import random
import re

import pytest

import agentrl
from agentrl.envs.search_qa import (
    CORPUS_PATH,
    QUESTIONS,
    SearchQA,
    extract_answer,
    generate_world,
    normalize_answer,
    token_f1,
)
from agentrl.rollout.scripted import play
from tests.conftest import cli_rollout

# What the scripted solver knows: for each question kind, where the answer sits in the template sentence.
ANSWER_IN_DOC = {
    "town_year": r"founded in (\d{4})",
    "town_founder": r"founded in \d{4} by ([^.]+)\.",
    "town_river": r"the river (\w+)\.",
    "town_population": r"About ([\d,]+) people",
    "town_product": r"known for its ([^.]+)\.",
    "person_year": r"\(born (\d{4})",
    "person_village": r"village of (\w+)\)",
    "person_work": r"the book (.+?), and",
    "person_award": r"received the (.+?)\.",
    "invention_inventor": r"invented by (.+?) in \d{4}",
    "invention_year": r"invented by .+? in (\d{4})",
    "invention_place": r"the city of (\w+)\.",
}
KIND_OF_QUESTION = [
    (re.compile("^" + re.escape(q).replace(r"\{name\}", "(.+)") + "$"), kind) for kind, (_, q, _) in QUESTIONS.items()
]


def call(name: str, **arguments) -> str:
    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"


def solver(messages, task):
    """Search the question, read the top document, cut the answer out with the template's regex."""
    tool_msgs = [m for m in messages if m["role"] == "tool"]
    question = next(m["content"] for m in messages if m["role"] == "user")
    if not tool_msgs:
        return "Let me look that up.\n" + call("search", query=question)
    kind = next(k for pattern, k in KIND_OF_QUESTION if pattern.match(question))  # the kind from the question alone
    top = tool_msgs[-1]["content"].splitlines()[0]
    m = re.search(ANSWER_IN_DOC[kind], top)
    return f"<answer>{m.group(1) if m else 'unknown'}</answer>"


def random_policy(rng: random.Random):
    words = CORPUS_PATH.read_text().split()

    def policy(messages, task):
        if rng.random() < 0.5 and not any(m["role"] == "tool" for m in messages):
            return call("search", query=" ".join(rng.choices(words, k=3)))
        return f"<answer>{' '.join(rng.choices(words, k=rng.randint(1, 3)))}</answer>"

    return policy


def test_shipped_data_is_the_generators_output_and_each_answer_is_in_exactly_one_doc():
    docs, rows = generate_world(0)
    assert [json.loads(line) for line in CORPUS_PATH.read_text().splitlines()] == docs
    assert SearchQA.tasks() == rows and len(rows) == 200 and len(docs) == 150
    assert len({r["prompt"] for r in rows}) == 200
    assert {r["kind"] for r in rows} == set(QUESTIONS)
    for r in rows:
        pattern = re.compile(r"(?<!\w)" + re.escape(r["label"]) + r"(?!\w)")
        assert [d["id"] for d in docs if pattern.search(d["text"])] == [r["doc_id"]], r
    assert generate_world(1)[0] != docs  # the seed matters


def test_squad_normalization_and_f1():
    assert normalize_answer("The  Copper Almanac!") == "copper almanac"
    assert token_f1("the Copper Almanac", "The Copper Almanac") == 1.0
    assert token_f1("Copper", "The Copper Almanac") == pytest.approx(2 * 1 * 0.5 / 1.5)
    assert token_f1("33,080", "33,080") == 1.0 and token_f1("33080", "33,080") == 1.0
    assert token_f1("nothing", "1642") == 0.0 and token_f1("", "1642") == 0.0
    assert extract_answer("I think <answer>a</answer> no, <answer> 1642 </answer>") == ("1642", True)
    assert extract_answer("just 1642") == ("just 1642", False)


async def test_reward_is_f1_and_info_records_exact_match():
    async def final(text: str, label="The Copper Almanac"):
        env = SearchQA()
        await env.reset(options={"prompt": "Which book?", "label": label})
        obs, reward, done, truncated, info = await env.step(agentrl.Action(text=text))
        assert obs == [] and done and not truncated
        return reward, info

    assert await final("<answer>the copper almanac.</answer>") == (
        1.0,
        {"f1": 1.0, "exact_match": True, "answer_tag": True},
    )
    reward, info = await final("<answer>Copper Almanac Doom</answer>")
    assert reward == pytest.approx(0.8) and info["exact_match"] is False
    reward, info = await final("It is the Copper Almanac, I believe, after reading many documents about it.")
    assert 0 < reward < 0.4 and info["answer_tag"] is False  # untagged: the whole text is scored
    assert (await final("<answer>x</answer>", label=["1642", "x"]))[0] == 1.0  # a list of accepted answers


async def test_exact_match_metric_pays_nothing_for_a_hedge():
    class StrictSearchQA(SearchQA):
        reward_metric = "exact_match"

    async def final(env_cls, text: str):
        env = env_cls()
        await env.reset(options={"prompt": "When?", "label": "1642"})
        _, reward, _, _, info = await env.step(agentrl.Action(text=text))
        return reward, info

    hedge = "<answer>1642 1700</answer>"
    assert (await final(SearchQA, hedge))[0] == pytest.approx(2 / 3)  # F1 partly pays a hedge
    reward, info = await final(StrictSearchQA, hedge)
    assert reward == 0.0 and info["f1"] == pytest.approx(2 / 3)
    assert (await final(StrictSearchQA, "<answer>1642</answer>"))[0] == 1.0


async def test_search_tool_answers_inside_an_episode():
    env = SearchQA()
    task = SearchQA.tasks(1)[0]
    await env.reset(options=task)
    action = agentrl.Action(text="", tool_calls=[agentrl.ToolCall("search", {"query": task["prompt"], "k": 2}, "c0")])
    obs, reward, done, _, _ = await env.step(action)
    assert not done and reward == 0.0 and obs[0]["tool_call_id"] == "c0"
    assert obs[0]["content"].startswith(f"[{task['doc_id']}] ") and task["label"] in obs[0]["content"].splitlines()[0]


async def test_check_env_finds_no_violations():
    report = await agentrl.check_env(SearchQA, SearchQA.tasks(3))
    assert report.ok, report.format()
    assert len(report.results) >= 3 * 8


async def test_scripted_solver_earns_the_reward_and_random_policy_does_not():
    tasks = SearchQA.tasks()
    solved = await play(SearchQA, solver, tasks)
    assert not [r.error for r in solved if r.error]
    mean = sum(r.reward for r in solved) / len(solved)
    assert mean >= 0.95, [(r.task["prompt"], r.messages[-1]) for r in solved if r.reward < 1][:5]
    assert all(r.turns == 2 and r.terminated for r in solved)
    rand = await play(SearchQA, random_policy(random.Random(0)), tasks)
    rand_mean = sum(r.reward for r in rand) / len(rand)
    assert rand_mean < 0.1 and mean - rand_mean > 0.85


@pytest.mark.e2e
def test_rollout_cli_with_the_tiny_model(tiny_ckpt, tmp_path):
    _, samples = cli_rollout(
        "agentrl.envs.search_qa:SearchQA", tiny_ckpt, tmp_path, num_tasks=2, max_turns=2, turn_len=24
    )
    assert len(samples) == 4 and sorted({s["group_index"] for s in samples}) == [0, 1]
    labels = {t["label"] for t in SearchQA.tasks(2)}
    for s in samples:
        assert s["status"] in ("completed", "truncated")
        assert len(s["loss_mask"]) == len(s["rollout_log_probs"]) == s["response_length"] > 0
        assert s["label"] in labels and s["prompt"][0]["role"] == "system"
        assert 0.0 <= s["reward"] <= 1.0 and s["reward"] == sum(s["metadata"]["turn_rewards"])
