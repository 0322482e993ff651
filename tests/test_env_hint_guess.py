"""HintGuess: the cooperative two-role game (a hinter and a guesser) that two policies learn together."""

from __future__ import annotations

import statistics

import pytest

import agentrl
from agentrl.chat import ChatTemplate
from agentrl.envs.hint_guess import HintGuess, convention_policy, last_digit
from agentrl.rollout.demos import scripted_samples
from agentrl.rollout.scripted import play
from agentrl.types import Action


async def _game(hint: str, guess: str, secret: str = "4"):
    env = HintGuess()
    views, _ = await env.reset(options={"prompt": "hint and guess", "label": secret})
    assert env.current_role() == "hinter" and f"The secret is {secret}." in views["hinter"][-1]["content"]
    assert secret not in views["guesser"][-1]["content"]  # the guesser never sees the secret
    shown, rewards, done, _, info = await env.step(Action(text=hint))
    assert not done and rewards == {} and set(shown) == {"guesser"} and env.current_role() == "guesser"
    shown2, rewards2, done2, _, info2 = await env.step(Action(text=guess))
    assert done2 and shown2 == {}
    return shown["guesser"][0]["content"], rewards2, info, info2


async def test_both_players_score_when_the_guess_is_the_secret():
    shown, rewards, hint_info, guess_info = await _game("My hint: 5", "I guess 4")
    assert shown == "The hint is 5. Your guess?" and rewards == {"hinter": 1.0, "guesser": 1.0}
    assert hint_info == {"role": "hinter", "hint": 5, "kept_rule": True} and guess_info["won"] is True
    _, rewards, _, _ = await _game("5", "6")
    assert rewards == {"hinter": 0.0, "guesser": 0.0}
    _, rewards, _, _ = await _game("0", "9", secret="9")  # 9 is followed by 0
    assert rewards == {"hinter": 1.0, "guesser": 1.0}


async def test_a_hint_off_the_rule_or_no_digit_scores_nothing_whatever_the_guess():
    for hint in ("4", "3", "7"):  # the secret itself, or another digit than the next one: a private convention
        _, rewards, info, _ = await _game(hint, "4")
        assert rewards == {"hinter": 0.0, "guesser": 0.0} and info["kept_rule"] is False
    shown, rewards, info, _ = await _game("no idea", "4")
    assert shown == "The hint is no digit. Your guess?" and rewards == {"hinter": 0.0, "guesser": 0.0}
    assert info["hint"] is None and last_digit("12 then 3") == 3 and last_digit("none") is None


async def test_a_task_without_a_one_digit_label_is_refused_naming_the_field():
    for bad in (None, "", "10", "x", 4, "²", "٣", " 4"):
        with pytest.raises(ValueError, match="'label' must be the secret, one digit"):
            await HintGuess().reset(options={"prompt": "p", "label": bad})
    with pytest.raises(ValueError, match="follow must be a probability"):
        convention_policy(1.5)


async def test_check_env_scripted_figures_and_a_demonstration_per_seat(tiny_tokenizer):
    report = await agentrl.check_env(HintGuess, HintGuess.tasks(4))
    assert report.ok, report.format()
    tasks = HintGuess.tasks(400, seed=1)
    assert {t["label"] for t in tasks} == {str(d) for d in range(10)}
    means = []
    for follow in (1.0, 0.5, 0.0):  # the module docstring's figures: 1.00, 0.31, 0.01 (by the odds 1, 0.31, 0.011)
        results = await play(HintGuess, convention_policy(follow), tasks)
        assert all(r.error is None and r.role_rewards["hinter"] == r.role_rewards["guesser"] for r in results)
        means.append(statistics.mean(r.role_rewards["hinter"] for r in results))
    assert means[0] == 1.0 and 0.22 < means[1] < 0.4 and means[2] < 0.05, means
    samples, stats = await scripted_samples(HintGuess, convention_policy(1.0), tasks[:3], ChatTemplate(tiny_tokenizer))
    assert [s.role for s in samples] == ["hinter", "guesser"] * 3 and stats.kept == 6
    for s, task in zip(samples[::2], tasks):  # the hinter's reply is the digit after the secret
        secret = int(task["label"])
        assert s.response.strip().startswith(str((secret + 1) % 10)) and s.reward == 1.0
