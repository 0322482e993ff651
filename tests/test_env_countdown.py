"""The Countdown env: a safe exact verifier, solvable tasks, a solver near 1 and random play near 0."""

from __future__ import annotations

import json
import statistics

import pytest

import agentrl
from agentrl.envs.countdown import FORMAT_CREDIT, Countdown, random_policy, score, solve, solver_policy
from agentrl.rollout.scripted import play
from tests.conftest import cli_rollout

NUMBERS = [1, 3, 4, 6]


@pytest.mark.parametrize(
    "text,reward",
    [
        ("<answer>6 / (1 - 3 / 4)</answer>", 1.0),  # exact fractions: 3/4 is not rounded away
        ("I think... <answer>4 * 6</answer> no wait <answer>(3 - 1) * (6 + 4) + 4</answer>", 0.0),  # last tag, 4 twice
        ("<answer>4 * 6 = 24</answer>", 1.0),  # a trailing '= ...' is ignored
        ("<answer>4 × 6</answer>", 1.0),
        ("<answer>(6 + 4) * 3 - 1</answer>", FORMAT_CREDIT),  # valid but 29
        ("<answer>6 / (4 - 4)</answer>", 0.0),  # 4 used twice (checked before evaluating)
        ("<answer>8 * 3</answer>", 0.0),  # 8 is not given
        ("<answer>6 ** 4</answer>", 0.0),
        ("<answer>-1 + 25</answer>", 0.0),
        ("<answer>24.0</answer>", 0.0),
        ("<answer>__import__('os')</answer>", 0.0),
        ("<answer>" + "(" * 500 + "6" + ")" * 500 + "</answer>", 0.0),
        ("<answer></answer>", 0.0),
        ("24", 0.0),  # no tag
    ],
)
def test_verifier(text, reward):
    assert score(text, NUMBERS, 24).reward == reward


def test_verifier_explains_failures():
    assert "divides by zero" in score("<answer>6 / (4 - 4)</answer>", [4, 4, 6], 1).error
    assert "used 2 time(s) but given 1" in score("<answer>6 / (4 - 4)</answer>", NUMBERS, 1).error
    assert "Pow" in score("<answer>6 ** 4</answer>", NUMBERS, 1).error
    assert "not 24" in score("<answer>6 + 4</answer>", NUMBERS, 24).error


def test_tasks_are_deterministic_and_solvable_by_their_label():
    tasks = Countdown.tasks(200, seed=3)
    assert tasks == Countdown.tasks(200, seed=3) and tasks != Countdown.tasks(200, seed=4)
    assert {len(t["numbers"]) for t in tasks} == {3, 4, 5, 6}
    for t in tasks:
        assert score(f"<answer>{t['label']}</answer>", t["numbers"], t["target"]).correct, t
        assert str(t["target"]) in t["prompt"] and "<answer>" in t["prompt"]


def test_solver_finds_fraction_free_solutions_and_reports_impossible_ones():
    assert score(f"<answer>{solve([100, 75, 50, 25, 6, 3], 997)}</answer>", [100, 75, 50, 25, 6, 3], 997).correct
    assert solve([1, 1, 1], 100) is None


async def test_bad_task_rows_get_a_clear_error():
    with pytest.raises(ValueError, match="needs 'numbers'"):
        await Countdown().reset(options={"prompt": "What is 1 + 2?", "label": "3"})
    with pytest.raises(ValueError, match="needs 'numbers'"):
        await Countdown().reset(options={"prompt": "x", "numbers": [1.5, 2], "target": 3})


async def test_check_env_finds_no_violations():
    report = await agentrl.check_env(Countdown, Countdown.tasks(3))
    assert report.ok, report.format()


async def test_solver_scores_high_and_random_policies_low():
    tasks = Countdown.tasks(100, seed=1)
    solved = await play(Countdown, solver_policy, tasks)
    assert not [r.error for r in solved if r.error]
    assert all(r.turns == 1 and r.terminated for r in solved)
    solver_mean = statistics.mean(r.reward for r in solved)
    random_mean = statistics.mean(r.reward for r in await play(Countdown, random_policy(0), tasks))
    junk_mean = statistics.mean(
        r.reward for r in await play(Countdown, lambda m, t: "<answer>" + t["prompt"][-90:], tasks)
    )
    assert solver_mean >= 0.95, solver_mean
    assert FORMAT_CREDIT * 0.9 <= random_mean < 0.2, random_mean  # mostly format credit
    assert junk_mean == 0.0


@pytest.mark.e2e
def test_rollout_end_to_end_with_the_tiny_model(tiny_ckpt, tmp_path):
    r, samples = cli_rollout("agentrl.envs.countdown:Countdown", tiny_ckpt, tmp_path, num_tasks=2, turn_len=48)
    assert json.loads(r.stdout)["samples"] == len(samples) == 4
    targets = {t["target"] for t in Countdown.tasks()[:2]}
    for s in samples:
        assert s["status"] in ("completed", "truncated"), s["metadata"]
        assert len(s["loss_mask"]) == len(s["rollout_log_probs"]) == s["response_length"] > 0
        # one turn, scored once; a turn cut at the length limit never reaches the env and earns 0
        tr = s["metadata"]["turn_rewards"]
        assert len(tr) == 1 and s["reward"] == sum(tr)
        if s["status"] == "truncated":
            assert tr == [0.0]
        assert s["reward"] in (0.0, FORMAT_CREDIT, 1.0)
        assert any(str(t) in s["prompt"][0]["content"] for t in targets)
    assert any(s["status"] == "completed" for s in samples)  # the tiny model ends most turns within 48 tokens
