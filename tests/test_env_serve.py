"""``agentrl env-serve``: agentrl envs served over OpenEnv's protocol, for real, on loopback.

Each server is uvicorn in a thread on a socket bound before it starts (``tests/serving.py``, the
helper the OpenEnv adapter's tests use too), or the CLI in a subprocess. Clients: agentrl's own
``openenv:`` adapter, openenv-core's ``GenericEnvClient`` / ``MCPToolClient`` and its
``validate_running_environment`` check, and raw WebSocket messages.
openenv-core's client side needs ``pip install --no-deps openenv-core==0.3.0 && pip install fastmcp``
(its tests skip without it unless ``AGENTRL_REQUIRE_OPENENV=1``). The guards (key, caps, idle sessions,
host files, the process sandbox) are tested in ``tests/test_env_serve_guards.py``, the README's setup
alone in ``tests/test_env_serve_install.py``.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import json
import os
import re
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import aiohttp
import httpx
import pytest

import agentrl
from agentrl.adapters.openenv import text_field
from agentrl.adapters.openenv_actions import served_result
from agentrl.adapters.openenv_server import EnvServer, build_server
from agentrl.envs import calculator, guess_number
from agentrl.rollout.scripted import play
from tests.serving import serve_app

# -- servers ----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def guess_url() -> Iterator[str]:
    with serve_app(build_server("agentrl/GuessNumber-v0", max_sessions=16).app()) as url:
        yield url


CLOSED: list[str] = []


class Fragile(agentrl.Env):
    """Echoes the reply; ``explode`` raises in step, ``bad`` returns a broken 5-tuple; records closes."""

    max_turns = 3

    @staticmethod
    def tasks() -> list[dict[str, Any]]:
        return [{"prompt": "say something", "label": None}]

    async def reset(self, *, seed=None, options=None):
        self.name = (options or {}).get("prompt", "")
        return [{"role": "user", "content": f"{self.name} (seed {seed})"}], {"seed": seed}

    async def step(self, action):
        if action.text == "explode":
            raise RuntimeError("boom in step")
        if action.text == "bad":
            return [{"role": "user", "content": "x"}], float("nan"), False, False, {}
        return [{"role": "user", "content": f"you said {action.text}"}], 0.5, action.text == "stop", False, {}

    async def close(self):
        CLOSED.append(self.name if hasattr(self, "name") else "")
        await super().close()


@pytest.fixture(scope="module")
def fragile_url() -> Iterator[str]:
    with serve_app(EnvServer(Fragile, tasks=Fragile.tasks(), max_sessions=4).app()) as url:
        yield url


class Session:
    """A raw ``/ws`` session: send a message (dict or text), read the reply as a dict."""

    def __init__(self, http: aiohttp.ClientSession, ws: aiohttp.ClientWebSocketResponse) -> None:
        self.http, self.ws = http, ws

    async def ask(self, message: dict | str) -> dict[str, Any]:
        await self.ws.send_str(message if isinstance(message, str) else json.dumps(message))
        msg = await asyncio.wait_for(self.ws.receive(), 10)
        assert msg.type == aiohttp.WSMsgType.TEXT, msg
        return json.loads(msg.data)


@contextlib.asynccontextmanager
async def session(url: str):
    async with aiohttp.ClientSession() as http, http.ws_connect(url.replace("http", "ws") + "/ws") as ws:
        yield Session(http, ws)


def _need_openenv() -> None:
    try:
        import openenv.core  # noqa: F401
    except ImportError:
        reason = "openenv-core is not installed (pip install --no-deps openenv-core==0.3.0 && pip install fastmcp)"
        if os.environ.get("AGENTRL_REQUIRE_OPENENV") == "1":
            pytest.fail(reason + " and AGENTRL_REQUIRE_OPENENV=1")
        pytest.skip(reason)


# -- (a) agentrl's openenv: adapter plays a served env as it plays it in process --------------------


def _recording(policy, views: dict[int, list]):
    """``policy``, recording every conversation it is shown under its task row's id."""

    def wrapped(messages, task):
        views.setdefault(id(task), []).append(copy.deepcopy(messages))
        return policy(messages, task)

    return wrapped


@pytest.mark.parametrize(
    "spec,module,seed_rows",
    [("agentrl/GuessNumber-v0", guess_number, True), ("agentrl/Calculator-v0", calculator, False)],
)
async def test_adapter_shows_the_model_the_in_process_conversation(spec, module, seed_rows):
    """Through ``openenv:`` the policy sees what it sees in process, turn by turn: the env's own messages
    with their roles (tool results as ``tool`` messages answering its calls), the same tools, the same
    limits. GuessNumber plays the adapter's seed rows (the server picks task i), Calculator sends its rows."""
    local = agentrl.load_env(spec)
    tasks = local.tasks()[:4]
    here_views: dict[int, list] = {}
    here = await play(local, _recording(module.solver_policy, here_views), tasks)
    with serve_app(build_server(spec, max_sessions=8).app()) as url:
        remote = agentrl.load_env(f"openenv:{url}")
        env = remote()
        assert env.tool_schemas() == local().tool_schemas() and env.tools  # before any reset: what the rollout reads
        assert (env.max_turns, env.tool_parser) == (local.max_turns, local.tool_parser)
        await env.close()
        rows = remote.tasks()[: len(tasks)] if seed_rows else tasks
        there_views: dict[int, list] = {}
        there = await play(remote, _recording(module.solver_policy, there_views), rows)
    assert [r.error for r in here + there] == [None] * 8
    for task, row, a, b in zip(tasks, rows, here, there):
        assert here_views[id(task)] == there_views[id(row)]  # every turn's view, roles and call ids included
        assert (b.messages, b.tools, b.rewards) == (a.messages, a.tools, a.rewards)
        assert (b.terminated, b.truncated) == (a.terminated, a.truncated)
    assert min(r.reward for r in here) > 0.5  # the solver earns it: the comparison is not of empty episodes
    at = next(i for i, m in enumerate(there[0].messages) if m["role"] == "tool")  # the calculator's answer, run
    assert there[0].messages[at]["tool_call_id"] == there[0].messages[at - 1]["tool_calls"][0]["id"]  # server-side


async def test_adapter_maps_truncated_and_sends_rows(fragile_url):
    env = agentrl.load_env(f"openenv:{fragile_url}")()
    assert env.served is not None and env.max_turns == 3 and env.tools == []
    obs, info = await env.reset(seed=4, options={"prompt": "my own row", "label": None})
    assert (obs, info) == ([{"role": "user", "content": "my own row (seed 4)"}], {"seed": 4})
    steps = [await env.step(agentrl.Action(text=f"t{i}")) for i in range(3)]
    assert [s[1:4] for s in steps] == [(0.5, False, False), (0.5, False, False), (0.5, False, True)]
    assert steps[0][0] == [{"role": "user", "content": "you said t0"}]
    await env.close()


def test_served_results_are_checked_field_by_field():
    ok = {"observation": {"messages": [{"role": "tool", "tool_call_id": "call_0_0", "content": "5"}]}, "done": False}
    assert served_result(ok, "step", {"call_0_0": "call_0"}) == (
        [{"role": "tool", "tool_call_id": "call_0", "content": "5"}],
        0.0,
        False,
        False,
        {},
    )
    bad = [
        ({"messages": "hi"}, "step observation.messages must return a list"),
        ({"messages": [{"role": "robot", "content": "x"}]}, "message 0 has role 'robot'"),
        ({"messages": [{"role": "user", "content": 3}]}, "message 0 content must be a str"),
        ({"messages": [], "info": [1]}, "observation.info=[1]"),
        ({"messages": [], "truncated": "yes"}, "observation.truncated='yes'"),
    ]
    for observation, match in bad:
        with pytest.raises(ValueError, match=re.escape(match)):
            served_result({"observation": observation}, "step", {})
    with pytest.raises(ValueError, match="reward='1'"):
        served_result({"observation": {"messages": []}, "reward": "1"}, "step", {})
    for broken in ({}, {"observation": None}, {"observation": [1]}):  # no KeyError/TypeError: the field named
        with pytest.raises(ValueError, match="answered observation=.*not an object"):
            served_result(broken, "reset", {})


def test_a_broken_or_foreign_marker_is_refused_naming_the_field():
    class Marked(EnvServer):
        def __init__(self, marker: dict, tools: list | None = None) -> None:
            super().__init__(Fragile, tasks=Fragile.tasks())
            self.marker, self.extra = marker, tools

        def metadata(self) -> dict[str, Any]:
            meta = {**super().metadata(), "agentrl": {**super().metadata()["agentrl"], **self.marker}}
            return meta if self.extra is None else {**meta, "tools": self.extra}

    cases = [
        (Marked({"protocol": 99}), "agentrl.protocol is 99; this agentrl speaks protocol 1"),
        (Marked({"tool_parser": "yaml"}), "agentrl.tool_parser 'yaml': unknown tool-call parser"),
        (Marked({"max_turns": 0}), "agentrl.max_turns must be a positive whole number"),
        (
            Marked({}, [{"type": "function", "function": {"name": "f", "parameters": {}}}]),
            "tools[0].function.description",
        ),
    ]
    for server, match in cases:
        with serve_app(server.app()) as url, pytest.raises(ValueError, match=re.escape(match)):
            agentrl.load_env(f"openenv:{url}")


def test_a_run_with_another_tool_parser():
    from agentrl.adapters.openenv_actions import served_step
    from agentrl.parsing import get_parser

    text = '<tool_call>{"name": "calculator", "arguments": {"expression": "1+1"}}</tool_call>'
    _, calls, errors = get_parser("hermes").parse(text)
    payload, ids = served_step(agentrl.Action(text, calls, errors), "hermes", 2, set())
    assert payload == {"text": text} and ids == {"call_2_0": "call_0"}  # the server parses it as the run did
    chat = [agentrl.ToolCall("calculator", {"expression": "2"}, "abc")]  # a chat engine's structured call
    payload, ids = served_step(agentrl.Action("", chat), "hermes", 0, set())
    assert payload["tool_calls"][0]["function"]["name"] == "calculator" and ids == {"abc": "abc"}
    broken = get_parser("hermes").parse("<tool_call>{oops</tool_call>")[2]
    with pytest.raises(ValueError, match="run with --tool-parser llama3_json"):
        served_step(agentrl.Action("<tool_call>{oops</tool_call>", [], broken), "llama3_json", 0, set())


async def test_max_turns_truncates_and_the_env_is_closed(fragile_url):
    CLOSED.clear()
    async with session(fragile_url) as s:
        first = await s.ask({"type": "reset", "data": {"seed": 7, "prompt": "hello", "label": "x"}})
        assert first["data"]["observation"]["messages"] == [{"role": "user", "content": "hello (seed 7)"}]
        assert first["data"]["observation"]["info"] == {"seed": 7} and first["data"]["done"] is False
        for turn in range(3):
            reply = await s.ask({"type": "step", "data": {"text": f"t{turn}"}})
        assert reply["data"]["done"] is True and reply["data"]["observation"]["truncated"] is True
        assert reply["data"]["reward"] == 0.5 and CLOSED == ["hello"]  # closed when the episode ended
        state = await s.ask({"type": "state"})
        assert state["data"]["step_count"] == 3 and state["data"]["done"] is True
        late = await s.ask({"type": "step", "data": {"text": "more"}})
        assert late["data"]["code"] == "EXECUTION_ERROR" and "send reset" in late["data"]["message"]
        again = await s.ask({"type": "reset", "data": {}})  # the server's own task row
        assert again["data"]["observation"]["messages"][0]["content"] == "say something (seed None)"
    for _ in range(100):  # the disconnect closes the second episode's env
        if len(CLOSED) == 2:
            break
        await asyncio.sleep(0.02)
    assert CLOSED == ["hello", "say something"]


def test_cli_rollout_through_openenv_renders_the_served_tools(
    guess_url, tiny_server, tiny_ckpt, tiny_tokenizer, tmp_path
):
    """``agentrl rollout --env openenv:URL`` shows the model the prompt an in-process run shows: the
    served env's first message and its tools, rendered by the chat template, token for token."""
    from tests.conftest import read_samples
    from tests.conftest import run_cli as run

    common = ["--num-tasks", "1", "--max-turns", "2", "--rollout-max-turn-len", "16", "--engine-url", tiny_server]
    common += ["--hf-checkpoint", str(tiny_ckpt)]
    prompts = []
    for env in (f"openenv:{guess_url}", "agentrl/GuessNumber-v0"):
        out = tmp_path / f"{len(prompts)}.jsonl"
        r = run("rollout", "--env", env, *common, "--output", str(out))
        assert r.returncode == 0, r.stderr
        (sample,) = read_samples(out)
        assert sample["status"] in ("completed", "truncated"), sample["metadata"].get("error")
        prompts.append(sample["tokens"][: len(sample["tokens"]) - sample["response_length"]])
    text = tiny_tokenizer.decode(prompts[0])
    assert "<tools>" in text and '"name": "calculator"' in text and "<guess>N</guess>" in text  # tools, the game
    assert prompts[0] == prompts[1]


# -- (b) openenv-core's own clients ---------------------------------------------------------------


async def test_openenv_core_clients_play_and_list_tools(guess_url):
    _need_openenv()
    from openenv.cli._validation import validate_running_environment
    from openenv.core import GenericEnvClient
    from openenv.core.mcp_client import MCPToolClient

    report = await asyncio.to_thread(validate_running_environment, guess_url)
    assert report["passed"], [c for c in report["criteria"] if not c["passed"]]
    schema = httpx.get(f"{guess_url}/schema").json()
    assert set(schema) == {"action", "observation", "state"} and text_field(schema["action"]) == "text"
    meta = httpx.get(f"{guess_url}/metadata").json()
    assert meta["name"] == "GuessNumber" and meta["max_turns"] == 20
    assert [t["function"]["name"] for t in meta["tools"]] == ["calculator"]

    task = guess_number.GuessNumber.tasks()[1]
    async with GenericEnvClient(base_url=guess_url) as env:
        first = await env.reset(seed=1)
        assert first.observation["messages"] == [{"role": "user", "content": task["prompt"]}] and not first.done
        low = int(task["label"]) - 1
        result = await env.step({"text": f"<guess>{low}</guess>"})
        assert result.observation["messages"][0]["content"].startswith(f"Guess 1 of 10: {low} is too low.")
        assert result.reward == 0.0 and not result.done
        result = await env.step({"text": "<guess>" + task["label"] + "</guess>"})
        assert result.done and result.reward == pytest.approx(0.95)
        assert (await env.state())["step_count"] == 2

    async with MCPToolClient(base_url=guess_url) as tools_env:
        listed = await tools_env.list_tools()  # before any reset, as OpenEnv allows
        assert [t.name for t in listed] == ["calculator"] and "expression" in str(listed[0].input_schema)
        await tools_env.reset(seed=0)
        assert await tools_env.call_tool("calculator", expression="6 * 7") == "42"


async def test_structured_tool_calls_and_mcp_endpoint(guess_url):
    async with session(guess_url) as s:
        await s.ask({"type": "reset", "data": {"seed": 2}})
        call = {
            "id": "c1",
            "type": "function",
            "function": {"name": "calculator", "arguments": '{"expression": "2+3"}'},
        }
        reply = await s.ask({"type": "step", "data": {"text": "", "tool_calls": [call]}})
        assert reply["data"]["observation"]["messages"][0] == {
            "role": "tool",
            "name": "calculator",
            "tool_call_id": "c1",
            "content": "5",
        }
        rpc = await s.ask({"type": "mcp", "data": {"jsonrpc": "2.0", "id": 3, "method": "tools/list"}})
        assert rpc["type"] == "mcp" and rpc["data"]["result"]["tools"][0]["name"] == "calculator"
    body = httpx.post(f"{guess_url}/mcp", json={"jsonrpc": "2.0", "id": 1, "method": "tools/call"}).json()
    assert body["error"]["code"] == -32601 and "call_tool" in body["error"]["message"]


# -- (c) the session limit ------------------------------------------------------------------------


async def test_capacity_reached_then_a_slot_frees():
    with serve_app(EnvServer(Fragile, tasks=Fragile.tasks(), max_sessions=1).app()) as url:
        async with session(url) as first:
            await first.ask({"type": "reset", "data": {"seed": 0}})
            async with session(url) as second:
                full = await second.ask({"type": "reset", "data": {}})
                assert full["data"]["code"] == "CAPACITY_REACHED"
                assert (full["data"]["active_sessions"], full["data"]["max_sessions"]) == (1, 1)
                assert (await second.ws.receive()).type in (aiohttp.WSMsgType.CLOSE, aiohttp.WSMsgType.CLOSED)
            waiting = agentrl.load_env(f"openenv:{url}")(capacity_wait=10)
            pending = asyncio.ensure_future(waiting.reset(options={"seed": 0}))
            await asyncio.sleep(0.3)
            assert not pending.done()  # the adapter waits for the slot
        obs, _ = await asyncio.wait_for(pending, 10)  # first closed: the slot is free
        assert "say something" in obs[0]["content"]
        await waiting.close()


# -- (d) an env that raises fails its episode, not the server ------------------------------------


async def test_env_errors_fail_the_episode_and_the_server_goes_on(fragile_url):
    async with session(fragile_url) as s:
        await s.ask({"type": "reset", "data": {"seed": 1}})
        boom = await s.ask({"type": "step", "data": {"text": "explode"}})
        assert boom["type"] == "error" and boom["data"]["code"] == "EXECUTION_ERROR"
        assert "step() raised RuntimeError: boom in step" in boom["data"]["message"]
        after = await s.ask({"type": "step", "data": {"text": "hi"}})
        assert "send reset first" in after["data"]["message"]
        await s.ask({"type": "reset", "data": {"seed": 2}})
        broken = await s.ask({"type": "step", "data": {"text": "bad"}})
        assert "reward must be a finite number" in broken["data"]["message"]
    env = agentrl.load_env(f"openenv:{fragile_url}")()  # the next session is served as usual
    await env.reset(options={"seed": 3})
    _, reward, terminated, _, _ = await env.step(agentrl.Action(text="stop"))
    assert (reward, terminated) == (0.5, True)
    await env.close()


class Optioned(agentrl.Env):
    """Shows its row's fields; the factory exits the process (SystemExit) after the server's describe()."""

    built = 0

    def __init__(self) -> None:
        Optioned.built += 1
        if Optioned.built > 1:
            raise SystemExit(5)

    async def reset(self, *, seed=None, options=None):
        return [{"role": "user", "content": json.dumps(options, sort_keys=True)}], {}

    async def step(self, action):
        return [], 0.0, True, False, {}


async def test_reset_options_go_on_the_servers_row_and_a_factory_exit_is_a_factory_error():
    """Reset keys without a ``prompt`` are options (OpenEnv clients send them as reset kwargs): the
    server's row for the seed, with them added. A factory raising SystemExit fails that reset only."""
    rows = [{"prompt": "row zero", "label": None}]
    with serve_app(EnvServer(Optioned, tasks=rows, max_sessions=2).app()) as url:
        async with session(url) as s:
            exited = await s.ask({"type": "reset", "data": {"seed": 0}})
            assert exited["type"] == "error" and exited["data"]["code"] == "FACTORY_ERROR", exited
            assert "SystemExit: 5" in exited["data"]["message"]
            Optioned.built = -10  # the factory works again: the same session goes on
            got = await s.ask({"type": "reset", "data": {"seed": 0, "difficulty": "hard"}})
            shown = json.loads(got["data"]["observation"]["messages"][0]["content"])
            assert shown == {"prompt": "row zero", "label": None, "difficulty": "hard"}
        env = agentrl.load_env(f"openenv:{url}")()  # agentrl's adapter sends a seed row's options the same way
        obs, _ = await env.reset(options={"seed": 0, "options": {"difficulty": "easy"}})
        assert json.loads(obs[0]["content"]) == {"prompt": "row zero", "label": None, "difficulty": "easy"}
        await env.close()


async def test_reset_options_never_replace_the_servers_task_fields():
    """The server's rows are protected from overrides: an option named as a field of any row (or
    ``label``) is refused naming the key, for every seed alike, unless it is the played row's own value.
    Refused before any env is built (the live episode goes on) and before a seedless reset uses up its
    turn; a client's own whole row (with a prompt) still plays."""
    rows = [{"prompt": "row zero", "label": None}, {"prompt": "row one", "label": "7", "difficulty": "easy"}]
    refused = [
        ({"seed": 0, "label": "3"}, "label", 0),
        ({"seed": 0, "difficulty": "hard"}, "difficulty", 0),  # row 0 has no difficulty: row 1's field all the same
        ({"seed": 1, "difficulty": "hard", "x": 1}, "difficulty", 1),
        ({"difficulty": "hard"}, "difficulty", 0),  # no seed: the next row in turn, which stays next
    ]
    Optioned.built = -10
    with serve_app(EnvServer(Optioned, tasks=rows, max_sessions=2).app()) as url:
        async with session(url) as s:
            assert (await s.ask({"type": "reset", "data": {"seed": 1}}))["type"] == "observation"
            for sent, key, row in refused:
                got = await s.ask({"type": "reset", "data": sent})
                assert got["type"] == "error" and got["data"]["code"] == "VALIDATION_ERROR", got
                assert [e["loc"] for e in got["data"]["errors"]] == [[key]]
                said = f"reset data sets '{key}', a field of the server's task rows, to a value other than task row {row}'s"
                assert said in got["data"]["message"], got
            state = await s.ask({"type": "state"})
            assert state["data"]["episode_id"] and not state["data"]["done"]  # the refused resets changed nothing

            async def shown(data: dict) -> dict:
                got = await s.ask({"type": "reset", "data": data})
                assert got["type"] == "observation", got
                return json.loads(got["data"]["observation"]["messages"][0]["content"])

            assert (await shown({}))["prompt"] == "row zero"  # the refused seedless reset used up no turn
            assert (await shown({"label": "7", "difficulty": "easy"})) == rows[1]  # the row's own values
            assert (await shown({"seed": 0, "label": None, "x": 1})) == {**rows[0], "x": 1}
            assert (await shown({"seed": 1, "prompt": "mine", "label": "9"})) == {"prompt": "mine", "label": "9"}
        env = agentrl.load_env(f"openenv:{url}")()
        with pytest.raises(agentrl.adapters.OpenEnvError, match="VALIDATION_ERROR.*reset data sets 'label'"):
            await env.reset(options={"seed": 1, "options": {"label": "anything"}})
        await env.close()


# -- (e) bad messages get error replies naming the field -----------------------------------------


async def test_bad_messages_are_answered_and_name_the_field(fragile_url):
    async with session(fragile_url) as s:
        assert (await s.ask("{not json"))["data"]["code"] == "INVALID_JSON"
        assert (await s.ask("[1, 2]"))["data"]["code"] == "VALIDATION_ERROR"
        unknown = await s.ask({"type": "jump"})
        assert unknown["data"]["code"] == "UNKNOWN_TYPE" and "'jump'" in unknown["data"]["message"]
        extra = await s.ask({"type": "reset", "data": {}, "seeed": 1})
        assert extra["data"]["errors"][0]["loc"] == ["seeed"]
        seed = await s.ask({"type": "reset", "data": {"seed": "one"}})
        assert seed["data"]["code"] == "VALIDATION_ERROR" and seed["data"]["errors"][0]["loc"] == ["seed"]
        early = await s.ask({"type": "step", "data": {"text": "hi"}})
        assert early["data"]["code"] == "EXECUTION_ERROR" and "reset first" in early["data"]["message"]
        await s.ask({"type": "reset", "data": {"seed": 0}})
        typo = await s.ask({"type": "step", "data": {"txt": "hi"}})
        locs = sorted(e["loc"][0] for e in typo["data"]["errors"])
        assert typo["data"]["code"] == "VALIDATION_ERROR" and locs == ["text", "txt"]
        assert "text: Field required" in typo["data"]["message"]
        wrong = await s.ask({"type": "step", "data": {"text": 5}})
        assert wrong["data"]["errors"][0]["loc"] == ["text"]
        calls = await s.ask({"type": "step", "data": {"text": "", "tool_calls": [{"function": {}}]}})
        assert calls["data"]["errors"][0]["loc"] == ["tool_calls", 0, "function", "name"]
        fine = await s.ask({"type": "step", "data": {"text": "still here"}})  # bad messages cost no turn
        assert fine["data"]["observation"]["messages"][0]["content"] == "you said still here"
        assert (await s.ask({"type": "state"}))["data"]["step_count"] == 1


# -- (f) the command ------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_cli_env_serve_starts_serves_and_refuses_bad_envs():
    port = _free_port()
    cmd = [sys.executable, "-m", "agentrl", "env-serve", "--env", "agentrl/Calculator-v0", "--port", str(port)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline, health = time.monotonic() + 60, None
        while time.monotonic() < deadline and proc.poll() is None:
            with contextlib.suppress(httpx.HTTPError):
                health = httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).json()
                break
            time.sleep(0.1)
        assert health == {"status": "healthy"}, proc.stderr.read() if proc.poll() is not None else "no answer"
        meta = httpx.get(f"http://127.0.0.1:{port}/metadata").json()
        assert meta["name"] == "Calculator" and meta["num_tasks"] == 64
    finally:
        proc.terminate()
        proc.wait(15)
    roles = subprocess.run(
        [sys.executable, "-m", "agentrl", "env-serve", "--env", "agentrl/TicTacToe-v0", "--port", str(port)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert roles.returncode == 2 and "multi-role envs cannot be served" in roles.stderr
    assert len(roles.stderr.strip().splitlines()) == 1
