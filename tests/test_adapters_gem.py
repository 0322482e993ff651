"""GEM envs (PyPI ``gem-llm`` 0.1.0) through ``gem:<id>``: its guess-the-number game, unchanged.

Install (GEM's own requirements pull vllm-free but heavy extras; these are the ones its games need):
``pip install --no-deps gem-llm==0.1.0 && pip install reasoning-gym==0.1.23``.
"""

from __future__ import annotations

import asyncio
import os
import random
import re
import time

import numpy as np
import pytest

import agentrl
from agentrl.check import check_env
from agentrl.env import call_env
from agentrl.types import Action
from tests.conftest import cli_rollout

try:
    import gem  # noqa: F401
except ImportError:
    if os.environ.get("AGENTRL_REQUIRE_GEM") == "1":
        raise
    pytest.skip(
        "gem-llm is not installed (pip install --no-deps gem-llm==0.1.0 && pip install reasoning-gym==0.1.23)",
        allow_module_level=True,
    )

EASY = "gem:game:GuessTheNumber-v0-easy"  # 1..10 within 4 turns; the guess is read from \boxed{}


async def _play(seed: int, guesses: list[int]) -> list[tuple]:
    env = agentrl.load_env(EASY)()
    obs, info = await call_env(env.reset, seed=999, options={"seed": seed})
    steps = [obs]
    for g in guesses:
        result = await call_env(env.step, Action(text=f"My guess: \\boxed{{{g}}}"))
        steps.append(result)
        if result[2] or result[3]:
            break
    await call_env(env.close)
    return steps


async def test_gem_game_is_played_through_its_own_text_protocol():
    env = agentrl.load_env(EASY)(system_prompt="Play well.")
    obs, info = await call_env(env.reset, seed=0, options={"seed": 3})
    assert obs[0] == {"role": "system", "content": "Play well."} and obs[1]["role"] == "user"
    assert obs[1]["content"].startswith("You are playing Guess The Number.")
    assert obs[1]["content"].endswith(
        "Enter your first guess to start the game.\nEnter your next guess."
    )  # GEM's suffix
    assert info == {"suffix": "Enter your next guess."}
    lo, hi = 1, 10
    for _ in range(4):  # binary search finds it within GEM's 4 turns
        guess = (lo + hi) // 2
        msgs, reward, terminated, truncated, info = await call_env(env.step, Action(text=f"\\boxed{{{guess}}}"))
        if terminated:
            break
        assert msgs[0]["content"].endswith("\nEnter your next guess.") and reward == 0.0
        lo, hi = (guess + 1, hi) if "higher" in msgs[0]["content"] else (lo, guess - 1)
    assert terminated and not truncated and reward == 1.0 and msgs[0]["content"].startswith("Congratulations!")
    await call_env(env.close)
    assert env.gem_env is None
    # a reply without \boxed{} is GEM's format error: it scores -0.1 and ends the game, as GEM decides
    env = agentrl.load_env(EASY)()
    await call_env(env.reset, options={"seed": 3})
    msgs, reward, terminated, *_ = await call_env(env.step, Action(text="five"))
    assert (reward, terminated) == (-0.1, True) and "did not provide a valid guess" in msgs[0]["content"]


async def test_gem_seeds_pick_the_game_whatever_runs_beside_it():
    """GEM seeds the process-wide random module; concurrent episodes (threads) still play their seed's game."""
    state = random.getstate(), np.random.get_state()[1][:4].tolist()
    alone = [await _play(seed, list(range(1, 11))) for seed in (1, 2)]
    together = await asyncio.gather(*(_play(seed, list(range(1, 11))) for seed in (1, 2, 1, 2)))
    assert together == [alone[0], alone[1], alone[0], alone[1]]
    found = [int(re.search(r"number (\d+)", s[-1][0][0]["content"]).group(1)) for s in alone if s[-1][1] == 1.0]
    assert found, [s[-1] for s in alone]
    assert (random.getstate(), np.random.get_state()[1][:4].tolist()) == state  # the caller's generators untouched


async def test_gem_env_passes_check_env():
    factory = agentrl.load_env(EASY)
    report = await check_env(factory, factory.tasks()[:2])
    assert report.ok, report.format()
    assert len(report.results) == 2 * 5


def test_gem_rollout_end_to_end(tiny_server, tiny_ckpt, tmp_path):
    _, samples = cli_rollout(EASY, tiny_ckpt, tmp_path, num_tasks=1, max_turns=2, engine_url=tiny_server)
    assert len(samples) == 2
    for s in samples:
        assert s["status"] in ("completed", "truncated"), s["metadata"].get("error")
        assert s["prompt"][0]["content"].startswith("You are playing Guess The Number.")
        # the tiny model writes no \boxed{}: GEM scores its first reply a format error and ends the game
        assert s["metadata"]["turn_rewards"] in ([-0.1], []), s["metadata"]["turn_rewards"]


class _SlowGame(gem.Env):
    """A GEM game that draws its number at reset and can take its time over a step (running code, say)."""

    def reset(self, seed=None):
        super().reset(seed)
        self.number = random.randint(0, 10**9)
        return f"number {self.number}", {}

    def step(self, action):
        if action == "slow":
            time.sleep(1.5)
        return "ok", 0.0, False, False, {}


gem.register("agentrl-test/Slow-v0", _SlowGame)


async def test_unseeded_games_differ_and_a_slow_step_holds_up_no_other_episode():
    factory = agentrl.load_env("gem:agentrl-test/Slow-v0")
    firsts = []
    for _ in range(4):
        env = factory()
        obs, _ = await call_env(env.reset)
        firsts.append(obs[0]["content"])
    assert len(set(firsts)) == 4, firsts  # no seed: a fresh game each time, not one replayed state

    slow, other = factory(), factory()
    await call_env(slow.reset, seed=1)
    done: dict[str, float] = {}

    async def timed(name, fn, *args, **kwargs):
        await call_env(fn, *args, **kwargs)
        done[name] = time.monotonic()

    start = time.monotonic()
    await asyncio.gather(
        timed("slow step", slow.step, Action(text="slow")),
        timed("reset", other.reset, seed=2),
    )
    assert done["reset"] - start < 1.0 < done["slow step"] - start, done  # the reset did not wait for the step
    again = factory()
    assert (await call_env(again.reset, seed=2))[0] == (await call_env(other.reset, seed=2))[0]
