"""Adapters: Gymnasium text envs and a real OpenEnv server (openenv-core under uvicorn on loopback), unchanged.

The Gymnasium envs are registered when this module is imported, so the ``agentrl rollout``
subprocess finds them through ``gym:tests.test_adapters:<id>`` (Gymnasium's module:id form).
The OpenEnv tests need openenv-core's server side, which imports fastmcp but not gradio:
``pip install --no-deps openenv-core==0.3.0 && pip install fastapi uvicorn websockets pydantic fastmcp``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import socket
import string
import threading
from collections.abc import Iterator
from typing import Any

import gymnasium
import numpy as np
import pytest
from gymnasium import spaces

import agentrl
from agentrl.adapters import GymnasiumEnv, InvalidAction, OpenEnvEnv, OpenEnvError
from agentrl.adapters.openenv import text_field
from agentrl.check import check_env
from agentrl.env import call_env
from agentrl.types import Action
from tests.conftest import read_samples
from tests.conftest import run_cli as run
from tests.serving import serve_app

# -- Gymnasium envs under test ----------------------------------------------------------------------


class GuessNumber(gymnasium.Env):
    """Guess a number in 1..high (both drawn from the seed): hints, +1 when right, -0.1 per wrong guess."""

    metadata = {"render_modes": []}

    def __init__(self) -> None:
        self.observation_space = spaces.Text(max_length=200, charset=string.printable)
        self.action_space = spaces.Text(max_length=16, charset=string.ascii_letters + string.digits + " ")
        self.steps, self.closed, self.threads = 0, False, set()

    def reset(self, *, seed: int | None = None, options: dict | None = None) -> tuple[str, dict]:
        super().reset(seed=seed)
        self.threads.add(threading.get_ident())
        self.high = int(self.np_random.integers(20, 100))
        self.secret = int((options or {}).get("secret", self.np_random.integers(1, self.high + 1)))
        self.steps = 0
        return f"Guess my number between 1 and {self.high}.", {"high": np.int64(self.high)}

    def step(self, action: str) -> tuple[str, float, bool, bool, dict]:
        self.threads.add(threading.get_ident())
        self.steps += 1
        found = re.search(r"\d+", action)
        if found is None:
            return "Say a number.", -0.1, False, False, {}
        guess = int(found.group())
        if guess == self.secret:
            return "Correct!", 1.0, True, False, {"guesses": self.steps}
        hint = "higher" if guess < self.secret else "lower"
        return f"{guess} is wrong: go {hint}.", -0.1, False, False, {"hint": hint, "guess": np.int32(guess)}

    def close(self) -> None:
        self.closed = True


class Corridor(gymnasium.Env):
    """Walk from cell 0 to the last cell: Discrete actions 0 = left, 1 = right; the observation is the cell (an int)."""

    metadata = {"render_modes": []}

    def __init__(self, length: int = 5) -> None:
        self.length = length
        self.observation_space = spaces.Discrete(length)
        self.action_space = spaces.Discrete(2)

    def reset(self, *, seed: int | None = None, options: dict | None = None) -> tuple[Any, dict]:
        super().reset(seed=seed)
        self.pos, self.visited = 0, np.zeros(self.length, dtype=np.int8)
        return np.int64(0), {"length": self.length}

    def step(self, action: int) -> tuple[Any, float, bool, bool, dict]:
        self.pos = min(max(self.pos + (1 if action == 1 else -1), 0), self.length - 1)
        self.visited[self.pos] = 1
        done = self.pos == self.length - 1
        info = {
            "visited": self.visited.copy(),
            "progress": np.float32(self.pos / (self.length - 1)),
            "undefined": float("nan"),
        }
        return np.int64(self.pos), float(done), done, False, info


class BoxControl(gymnasium.Env):
    """An env with a continuous action space: no default text parser exists for it."""

    observation_space = spaces.Discrete(1)
    action_space = spaces.Box(low=-1.0, high=1.0, shape=(2,))

    def reset(self, *, seed=None, options=None):
        return 0, {}


gymnasium.register("agentrl-test/GuessNumber-v0", entry_point=GuessNumber, max_episode_steps=8)
gymnasium.register("agentrl-test/Corridor-v0", entry_point=Corridor)
GUESS = "gym:agentrl-test/GuessNumber-v0"
CORRIDOR = "gym:agentrl-test/Corridor-v0"


# -- Gymnasium ---------------------------------------------------------------------------------------


async def test_gym_text_env_plays_a_scripted_game_off_the_event_loop():
    env = agentrl.load_env(GUESS)(system_prompt="Play the game.")
    obs, info = await call_env(env.reset, seed=123, options={"prompt": "", "seed": 7})
    high = info["high"]
    assert type(high) is int and obs == [
        {"role": "system", "content": "Play the game."},
        {"role": "user", "content": f"Guess my number between 1 and {high}."},
    ]
    lo, hi, rewards = 1, high, []
    for _ in range(8):  # binary search: at most 7 guesses below 100, inside the TimeLimit of 8
        guess = (lo + hi) // 2
        msgs, reward, terminated, truncated, info = await call_env(env.step, Action(text=f"  I guess {guess}\n"))
        rewards.append(reward)
        if terminated:
            break
        assert info["guess"] == guess and type(info["guess"]) is int and not truncated
        lo, hi = (guess + 1, hi) if "higher" in msgs[0]["content"] else (lo, guess - 1)
    assert terminated and msgs == [{"role": "user", "content": "Correct!"}] and info == {"guesses": len(rewards)}
    assert rewards == [-0.1] * (len(rewards) - 1) + [1.0]
    inner = env.gym_env.unwrapped
    assert inner.secret == guess and inner.threads and threading.get_ident() not in inner.threads
    await call_env(env.close)
    assert inner.closed and env.gym_env is None
    # the task row's seed (not the episode seed) picks the game, so a GRPO group plays one game
    again = agentrl.load_env(GUESS)()
    obs2, _ = await call_env(again.reset, seed=999, options={"seed": 7})
    assert obs2[0]["content"] == obs[1]["content"]


async def test_gym_invalid_reply_costs_a_turn_but_no_env_step():
    env = agentrl.load_env(GUESS)(invalid_action_reward=-0.5)
    await call_env(env.reset, options={"seed": 3, "options": {"secret": 0}})  # options reach gymnasium: never guessed
    replies = {
        "x" * 40: "reply with 1 to 16 characters; yours had 40",
        "12; go": "yours contained ';'",
        "   ": "yours had 0",
    }
    for text, why in replies.items():
        msgs, reward, terminated, truncated, info = await call_env(env.step, Action(text=text))
        assert (
            msgs[0]["role"] == "user"
            and msgs[0]["content"].startswith("Invalid action: ")
            and why in msgs[0]["content"]
        )
        assert (reward, terminated, truncated) == (-0.5, False, False) and why in info["invalid_action"]
    assert env.gym_env.unwrapped.steps == 0
    results = [await call_env(env.step, Action(text="1")) for _ in range(8)]
    assert [r[3] for r in results] == [False] * 7 + [True]  # the TimeLimit of 8 counts valid actions only
    assert all(r[1] == -0.1 for r in results)


async def test_gym_discrete_actions_and_non_text_observations():
    env = agentrl.load_env(CORRIDOR)()
    obs, info = await call_env(env.reset, seed=0)
    assert obs == [{"role": "user", "content": "0"}] and info == {"length": 5}
    msgs, reward, *_, info = await call_env(env.step, Action(text="Step 1: move right"))  # the first integer: 1
    assert msgs == [{"role": "user", "content": "1"}] and reward == 0.0
    assert info == {"visited": [0, 1, 0, 0, 0], "progress": 0.25, "undefined": "nan"}
    json.dumps(info, allow_nan=False)
    for text, why in [
        ("go left", "reply with one whole number from 0 to 1; 'go left' contains none"),
        ("7", "7 is not an action here: reply with one whole number from 0 to 1"),
    ]:
        msgs, reward, terminated, _, _ = await call_env(env.step, Action(text=text))
        assert msgs[0]["content"] == f"Invalid action: {why}" and not terminated
    for _ in range(3):
        msgs, reward, terminated, truncated, _ = await call_env(env.step, Action(text="1"))
    assert (msgs[0]["content"], reward, terminated, truncated) == ("4", 1.0, True, False)


async def test_gym_custom_render_and_parse_and_refusals():
    def parse(text: str) -> int:
        if "right" in text or "left" in text:
            return int("right" in text)
        raise InvalidAction("say left or right")

    env = agentrl.load_env(CORRIDOR)(render_observation=lambda cell: f"You are in cell {cell}.", parse_action=parse)
    obs, _ = await call_env(env.reset)
    assert obs[0]["content"] == "You are in cell 0."
    assert (await call_env(env.step, Action(text="right!")))[0][0]["content"] == "You are in cell 1."
    assert (await call_env(env.step, Action(text="1")))[0][0]["content"] == "Invalid action: say left or right"
    with pytest.raises(TypeError, match="no default parser for the action space Box.*parse_action"):
        await call_env(GymnasiumEnv(BoxControl()).reset)
    with pytest.raises(ValueError, match="NoSuch.* doesn't exist.*gym:MODULE:ID"):
        agentrl.load_env("gym:agentrl-test/NoSuch-v0")
    with pytest.raises(ImportError, match="no module named 'no_such_module'"):
        agentrl.load_env("gym:no_such_module:Thing-v0")
    with pytest.raises(TypeError, match="max_episode_steps"):
        GymnasiumEnv(Corridor(), max_episode_steps=3)


@pytest.mark.parametrize("spec", [GUESS, CORRIDOR])
async def test_gym_envs_pass_check_env(spec):
    factory = agentrl.load_env(spec)
    report = await check_env(factory, factory.tasks()[:2])
    assert report.ok, report.format()
    assert len(report.results) == 2 * 5  # first observation; label, empty, huge, random text per task


def test_gym_rollout_end_to_end(tiny_server, tiny_ckpt, tmp_path):
    out = tmp_path / "samples.jsonl"
    r = run(
        "rollout",
        "--env",
        "gym:tests.test_adapters:agentrl-test/GuessNumber-v0",
        "--num-tasks",
        "2",
        "--n-samples-per-prompt",
        "2",
        "--max-turns",
        "3",
        "--rollout-max-turn-len",
        "48",
        "--engine-url",
        tiny_server,
        "--hf-checkpoint",
        str(tiny_ckpt),
        "--output",
        str(out),
    )
    assert r.returncode == 0, r.stderr
    samples = read_samples(out)
    assert len(samples) == 4 and sorted(s["group_index"] for s in samples) == [0, 0, 1, 1]
    for s in samples:
        game = GuessNumber()
        first, _ = game.reset(seed=s["group_index"])  # task i carries seed i: both samples of a group play it
        assert s["prompt"] == [{"role": "user", "content": first}]
        assert s["status"] in ("completed", "truncated"), s["metadata"].get("error")
        assert set(s["metadata"]["turn_rewards"]) <= {-0.1, 0.0, 1.0}  # invalid replies 0.0, wrong guesses -0.1
        assert s["reward"] == pytest.approx(sum(s["metadata"]["turn_rewards"]))
        assert len(s["loss_mask"]) == s["response_length"] > 0
    assert any(s["metadata"]["turn_rewards"] for s in samples)  # a turn may also run out of tokens first
    feedback = ("Invalid action: ", "is wrong: go", "Say a number.")  # the env's replies, in the model's context
    for s in samples:
        if len(s["metadata"]["turn_rewards"]) > 1:
            assert any(f in s["response"] for f in feedback), s["response"]


# -- a real OpenEnv server -----------------------------------------------------------------------------

SERVER_STATS = {"created": 0, "closed": 0}


def _word_game_app(max_envs: int) -> Any:
    """An openenv-core app: say words, the transcript comes back; 'stop' or 4 words end it; 1.0 for 'w<seed>'."""
    from openenv.core.env_server import Environment, create_app
    from openenv.core.env_server.types import Action as OEAction
    from openenv.core.env_server.types import Observation as OEObservation
    from openenv.core.env_server.types import State
    from pydantic import Field

    class WordAction(OEAction):
        word: str = Field(..., max_length=1000)

    class WordObservation(OEObservation):
        transcript: str = ""

    class WordGame(Environment):
        SUPPORTS_CONCURRENT_SESSIONS = True

        def __init__(self) -> None:
            super().__init__()
            SERVER_STATS["created"] += 1
            self._seed, self._words, self._state = None, [], State(step_count=0)

        def reset(self, seed=None, episode_id=None, **kwargs) -> WordObservation:
            self._seed, self._words, self._state = seed, [], State(episode_id=episode_id, step_count=0)
            return WordObservation(
                transcript=f"seed {seed}: say words about {kwargs.get('topic', 'anything')}; 'stop' ends"
            )

        def step(self, action: WordAction, timeout_s=None, **kwargs) -> WordObservation:
            word = action.word.strip()
            if word == "crash":
                raise RuntimeError("the game broke")
            self._words.append(word)
            self._state.step_count += 1
            done = word.lower() == "stop" or len(self._words) >= 4
            return WordObservation(
                transcript=" ".join(self._words), reward=1.0 if word == f"w{self._seed}" else 0.1, done=done
            )

        @property
        def state(self) -> State:
            return self._state

        def close(self) -> None:
            SERVER_STATS["closed"] += 1

    return create_app(WordGame, WordAction, WordObservation, env_name="word_game", max_concurrent_envs=max_envs)


def require_openenv() -> None:
    """Skip (or, with AGENTRL_REQUIRE_OPENENV=1, fail) when openenv-core's server side is not installed."""
    try:
        import openenv.core.env_server  # noqa: F401
    except ImportError:
        reason = (
            "openenv-core is not installed (pip install --no-deps openenv-core==0.3.0 && "
            "pip install fastapi uvicorn websockets pydantic fastmcp)"
        )
        if os.environ.get("AGENTRL_REQUIRE_OPENENV") == "1":
            pytest.fail(reason + " and AGENTRL_REQUIRE_OPENENV=1")
        pytest.skip(reason)


@contextlib.contextmanager
def serve_openenv(max_envs: int) -> Iterator[str]:
    """The word game (openenv-core's app) on loopback."""
    require_openenv()
    with serve_app(_word_game_app(max_envs)) as url:
        yield url


@pytest.fixture(scope="module")
def openenv_url() -> Iterator[str]:
    with serve_openenv(max_envs=64) as url:
        yield url


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def test_openenv_episode_speaks_the_session_protocol(openenv_url):
    env = agentrl.load_env(f"openenv:{openenv_url}")(system_prompt="Talk.")
    obs, info = await env.reset(seed=123, options={"prompt": "", "seed": 5, "options": {"topic": "cats"}})
    first = "seed 5: say words about cats; 'stop' ends"
    assert obs == [{"role": "system", "content": "Talk."}, {"role": "user", "content": first}]
    assert info == {"observation": {"transcript": first}}
    steps = [await env.step(Action(text=t)) for t in ("w5", "hello", "stop")]
    assert [s[0][0]["content"] for s in steps] == ["w5", "w5 hello", "w5 hello stop"]
    assert [(s[1], s[2], s[3]) for s in steps] == [(1.0, False, False), (0.1, False, False), (0.1, True, False)]
    assert steps[1][4] == {"observation": {"transcript": "w5 hello"}}
    await env.close()


async def test_openenv_concurrent_episodes_get_their_own_sessions(openenv_url):
    factory = agentrl.load_env(f"openenv:{openenv_url}")
    created, closed = SERVER_STATS["created"], SERVER_STATS["closed"]

    async def episode(i: int) -> tuple[str, list[str], list[float]]:
        env = factory()
        try:
            obs, _ = await env.reset(seed=i)
            steps = [await env.step(Action(text=w)) for w in (f"w{i}", f"a{i}", f"b{i}")]
            return obs[0]["content"], [s[0][0]["content"] for s in steps], [s[1] for s in steps]
        finally:
            await env.close()

    results = await asyncio.gather(*(episode(i) for i in range(8)))
    for i, (first, texts, rewards) in enumerate(results):
        assert first.startswith(f"seed {i}:")
        assert texts == [f"w{i}", f"w{i} a{i}", f"w{i} a{i} b{i}"] and rewards == [1.0, 0.1, 0.1]
    # one server environment per episode, each closed on the server by the time env.close() returned
    assert SERVER_STATS["created"] - created == SERVER_STATS["closed"] - closed == 8


async def test_openenv_bad_actions_are_shown_to_the_model(openenv_url):
    env = agentrl.load_env(f"openenv:{openenv_url}")()
    await env.reset(seed=0)
    msgs, reward, terminated, truncated, info = await env.step(Action(text="x" * 2000))
    assert msgs == [{"role": "user", "content": "Invalid action: word: String should have at most 1000 characters"}]
    assert (reward, terminated, truncated) == (0.0, False, False) and "1000 characters" in info["invalid_action"]
    assert (await env.step(Action(text="w0")))[0][0]["content"] == "w0"  # the rejected reply did not count
    await env.close()

    def last_word(text: str) -> dict:
        if not text.split():
            raise InvalidAction("say at least one word")
        return {"word": text.split()[-1]}

    env = OpenEnvEnv(openenv_url, action_from_text=last_word, observation_to_text=lambda o: o["transcript"].upper())
    assert (await env.reset(seed=1))[0][0]["content"].startswith("SEED 1:")
    assert (await env.step(Action(text="  ")))[0][0]["content"] == "Invalid action: say at least one word"
    assert (await env.step(Action(text="my word is w1")))[:2] == ([{"role": "user", "content": "W1"}], 1.0)
    await env.close()


async def test_openenv_refuses_bad_addresses_and_down_servers():  # needs no openenv-core: the adapter is plain HTTP
    port = _closed_port()
    for env in (
        OpenEnvEnv(f"http://127.0.0.1:{port}"),
        OpenEnvEnv(f"http://127.0.0.1:{port}", action_from_text=lambda t: {"word": t}),
    ):
        with pytest.raises(OpenEnvError, match=f"cannot reach the OpenEnv server at (http|ws)://127.0.0.1:{port}"):
            await env.reset(seed=0)
        await env.close()
    with pytest.raises(ValueError, match="expected http://HOST:PORT"):
        agentrl.load_env("openenv:ftp://127.0.0.1:1")
    with pytest.raises(ValueError, match="nothing after 'openenv:'"):
        agentrl.load_env("openenv:")
    with pytest.raises(ValueError, match="action_from_text"):
        text_field({"properties": {"a": {"type": "string"}, "b": {"type": "string"}}, "required": ["a", "b"]})
    assert (
        text_field({"properties": {"metadata": {"type": "object"}, "code": {"type": "string"}}, "required": ["code"]})
        == "code"
    )


@pytest.mark.e2e
async def test_openenv_server_failures_raise():
    with serve_openenv(max_envs=2) as url:
        env = OpenEnvEnv(url)
        await env.reset(seed=0)
        with pytest.raises(OpenEnvError, match=r"failed step \(EXECUTION_ERROR\): the game broke"):
            await env.step(Action(text="crash"))
        assert (await env.step(Action(text="w0")))[1] == 1.0  # the session survives the env's exception
    with pytest.raises(OpenEnvError, match="closed the session during step"):  # the server is gone now
        await env.step(Action(text="w0"))
    await env.close()


@pytest.mark.e2e
async def test_openenv_waits_for_a_free_session_then_says_why():
    with serve_openenv(max_envs=2) as url:
        factory = agentrl.load_env(f"openenv:{url}")

        async def episode(i: int) -> str:
            env = factory()
            try:
                await env.reset(seed=i)
                await asyncio.sleep(0.2)
                return (await env.step(Action(text=f"w{i}")))[0][0]["content"]
            finally:
                await env.close()

        assert await asyncio.gather(*(episode(i) for i in range(4))) == ["w0", "w1", "w2", "w3"]
        held = [OpenEnvEnv(url), OpenEnvEnv(url)]
        for env in held:
            await env.reset(seed=0)
        late = OpenEnvEnv(url, capacity_wait=0.5)
        with pytest.raises(OpenEnvError, match=r"session limit for 0.5s \(2/2 sessions\).*max_concurrent_envs"):
            await late.reset(seed=0)
        for env in (*held, late):
            await env.close()


async def test_openenv_passes_check_env(openenv_url):
    factory = agentrl.load_env(f"openenv:{openenv_url}")
    report = await check_env(factory, factory.tasks()[:2])
    assert report.ok, report.format()
    assert len(report.results) == 2 * 5


def test_openenv_rollout_end_to_end(openenv_url, tiny_server, tiny_ckpt, tmp_path):
    out = tmp_path / "samples.jsonl"
    common = [
        "--num-tasks",
        "2",
        "--n-samples-per-prompt",
        "2",
        "--max-turns",
        "3",
        "--rollout-max-turn-len",
        "48",
        "--engine-url",
        tiny_server,
        "--hf-checkpoint",
        str(tiny_ckpt),
    ]
    r = run("rollout", "--env", f"openenv:{openenv_url}", *common, "--output", str(out))
    assert r.returncode == 0, r.stderr
    samples = read_samples(out)
    assert len(samples) == 4 and sorted(s["group_index"] for s in samples) == [0, 0, 1, 1]
    for s in samples:
        assert s["prompt"] == [
            {"role": "user", "content": f"seed {s['group_index']}: say words about anything; 'stop' ends"}
        ]
        assert s["status"] in ("completed", "truncated"), s["metadata"].get("error")
        assert set(s["metadata"]["turn_rewards"]) <= {0.0, 0.1, 1.0}
        assert s["reward"] == pytest.approx(sum(s["metadata"]["turn_rewards"]))
    assert any(s["metadata"]["turn_rewards"] for s in samples)  # a turn may also run out of tokens first
    # a server that is down is refused before any episode starts, in one line
    dead = f"openenv:http://127.0.0.1:{_closed_port()}"
    r = run("rollout", "--env", dead, *common, "--output", str(tmp_path / "dead.jsonl"))
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "Traceback" not in r.stderr, r.stderr
    assert f"--env {dead}: cannot reach the OpenEnv server" in r.stderr and "start it" in r.stderr
