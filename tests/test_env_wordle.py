"""The Wordle env: exact feedback, per-turn rewards where any solve beats any loss, a solver that wins."""

from __future__ import annotations

import json
import statistics

import pytest

import agentrl
from agentrl.envs.wordle import (
    INFO_CREDIT,
    MAX_GUESSES,
    SOLVE_DECAY,
    SOLVE_REWARD,
    Wordle,
    feedback,
    load_words,
    random_policy,
    solver_policy,
)
from agentrl.rollout.scripted import play
from tests.conftest import cli_rollout


@pytest.mark.parametrize(
    "guess,secret,marks",
    [
        ("crane", "crane", "GGGGG"),
        ("paper", "apple", "YYGY-"),
        ("bobby", "abbey", "Y-G-G"),  # the third b has no unmatched copy left
        ("speed", "abide", "--Y-Y"),  # one e in the secret: only the first e gets a mark
        ("eerie", "crane", "--Y-G"),  # the green e uses up the secret's only e
    ],
)
def test_feedback_marks_repeated_letters_like_wordle(guess, secret, marks):
    assert feedback(guess, secret) == marks


def test_word_list_is_clean_and_sized():
    words = load_words()
    assert 1000 <= len(words) <= 2000 and len(set(words)) == len(words)
    assert all(len(w) == 5 and w.isascii() and w.isalpha() and w.islower() for w in words)


async def _play(secret: str, texts: list[str]) -> tuple[list[float], list[list[dict]], bool, dict]:
    env = Wordle()
    await env.reset(options={"prompt": "play", "label": secret})
    rewards, observations, done, info = [], [], False, {}
    for text in texts:
        assert not done, "episode ended early"
        obs, reward, done, truncated, info = await env.step(agentrl.Action(text=text))
        assert not truncated
        rewards.append(reward)
        observations.append(obs)
    return rewards, observations, done, info


async def test_per_turn_rewards_for_new_information_and_the_solve():
    rewards, obs, done, info = await _play(
        "crane", ["<guess>slate</guess>", "<guess>trace</guess>", "<GUESS> Crane </GUESS>"]
    )
    # slate: a (G), e (G) -> 2 letters + 2 positions; trace: r, c new letters, r position new.
    assert rewards[0] == pytest.approx(4 * INFO_CREDIT)
    assert rewards[1] == pytest.approx(3 * INFO_CREDIT)
    assert rewards[2] == pytest.approx(
        INFO_CREDIT * 3 + SOLVE_REWARD - 2 * SOLVE_DECAY
    )  # n: letter + position; c: position
    assert done and info["solved"] and info["secret"] == "crane" and obs[2] == []
    assert obs[0][0]["content"] == "Guess 1 of 6: SLATE -> - - G - G\n5 guesses left."


async def test_first_guess_solve_is_worth_exactly_one():
    rewards, _, done, _ = await _play("crane", ["<guess>crane</guess>"])
    assert done and sum(rewards) == pytest.approx(1.0)


async def test_invalid_guesses_cost_a_turn_and_earn_nothing():
    texts = [
        "crane",
        "<guess>cran</guess>",
        "<guess>zzzzz</guess>",
        "<guess>" + "x" * 5000 + "</guess>",
        "\x00\ufffd<guess>🙂🙂🙂🙂🙂</guess>",
        "<guess>slate</guess>",
    ]
    rewards, obs, done, info = await _play("crane", texts)
    assert rewards[:5] == [0.0] * 5 and done and not info["solved"] and info["guesses_used"] == MAX_GUESSES
    assert "Write your guess as <guess>word</guess>" in obs[0][0]["content"]
    assert "'cran' is not a 5-letter word" in obs[1][0]["content"] and "not in the word list" in obs[2][0]["content"]
    assert len(obs[3][0]["content"]) < 200 and obs[4][0]["content"].endswith("1 guess left.")


async def test_any_solve_beats_any_loss():
    late_solve, _, _, _ = await _play("crane", ["x"] * 5 + ["<guess>crane</guess>"])
    # A loss that finds every letter and every position of the secret (3 letters, 5 positions).
    loss, _, done, info = await _play(
        "geese", [f"<guess>{w}</guess>" for w in ["green", "seedy", "raise", "green", "seedy", "raise"]]
    )
    assert done and not info["solved"]
    assert sum(late_solve) == pytest.approx(SOLVE_REWARD - 5 * SOLVE_DECAY + 10 * INFO_CREDIT)
    assert sum(loss) == pytest.approx(8 * INFO_CREDIT) and 10 * INFO_CREDIT < sum(late_solve)


async def test_bad_task_rows_get_a_clear_error():
    with pytest.raises(ValueError, match="secret 5-letter word"):
        await Wordle().reset(options={"prompt": "What is 1 + 2?", "label": "3"})


async def test_check_env_finds_no_violations():
    report = await agentrl.check_env(Wordle, Wordle.tasks(3))
    assert report.ok, report.format()


async def test_solver_solves_and_random_policies_score_low():
    tasks = Wordle.tasks(100, seed=1)
    solved = await play(Wordle, solver_policy, tasks)
    assert not [r.error for r in solved if r.error]
    solve_rate = statistics.mean(r.reward >= SOLVE_REWARD - 5 * SOLVE_DECAY for r in solved)  # a loss is <= 0.2
    assert solve_rate >= 0.95 and statistics.mean(r.reward for r in solved) >= 0.6, solve_rate
    words = await play(Wordle, random_policy(0), tasks)
    strings = await play(Wordle, random_policy(0, strings=True), tasks)
    assert all(r.turns == MAX_GUESSES and r.terminated for r in strings)
    assert 0.0 < statistics.mean(r.reward for r in words) < 0.2
    assert statistics.mean(r.reward for r in strings) == 0.0


@pytest.mark.e2e
def test_rollout_end_to_end_with_the_tiny_model(tiny_ckpt, tmp_path):
    r, samples = cli_rollout("agentrl.envs.wordle:Wordle", tiny_ckpt, tmp_path, num_tasks=2, max_turns=6, turn_len=48)
    assert json.loads(r.stdout)["samples"] == len(samples) == 4
    for s in samples:
        assert s["status"] in ("completed", "truncated"), s["metadata"]
        assert len(s["loss_mask"]) == len(s["rollout_log_probs"]) == s["response_length"] > 0
        assert len(s["metadata"]["turn_rewards"]) <= MAX_GUESSES  # a turn cut at the length limit is not scored
        assert s["reward"] == pytest.approx(sum(s["metadata"]["turn_rewards"])) and 0.0 <= s["reward"] <= 1.0
        assert s["label"] in load_words()
    # The tiny model ends its turns well within 48 tokens, so games run on: feedback turns are masked out.
    multi = [s for s in samples if len(s["metadata"]["turn_rewards"]) > 1]
    assert multi and all(0 in s["loss_mask"] and "guesses left." in s["response"] for s in multi)
