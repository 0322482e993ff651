"""OpenEnv servers whose actions are not one string: MCP-style tool calls and enums behind ``$ref``.

Real openenv-core apps under uvicorn on loopback: an ``MCPEnvironment`` with FastMCP tools served
with ``CallToolAction`` (as openenv-core's ``echo_env`` is), and a grid world whose action is an
``Enum`` field (pydantic writes it as ``{"$ref": "#/$defs/Move"}``, as OpenEnv's grid world does).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from enum import Enum
from typing import Any

import pytest

import agentrl
from agentrl.adapters import InvalidAction, OpenEnvEnv
from agentrl.adapters.openenv_actions import action_mapping, parse_choice, resolve
from agentrl.check import check_env
from agentrl.parsing import get_parser
from agentrl.types import Action
from tests.conftest import cli_rollout
from tests.test_adapters import require_openenv, serve_app

SECRET = "tulip"


def _notes_app() -> Any:
    """An MCP-style env: tools write_note / read_notes / submit; submitting the secret word scores 1 and ends it."""
    from fastmcp import FastMCP
    from openenv.core.env_server import create_app
    from openenv.core.env_server.mcp_environment import MCPEnvironment
    from openenv.core.env_server.mcp_types import CallToolAction, CallToolObservation
    from openenv.core.env_server.types import Observation, State

    class Notes(MCPEnvironment):
        SUPPORTS_CONCURRENT_SESSIONS = True

        def __init__(self) -> None:
            mcp = FastMCP("notes")
            notes: list[str] = []

            @mcp.tool
            def write_note(text: str) -> str:
                """Write a note.

                Args:
                    text: what to write
                """
                notes.append(text)
                return f"noted ({len(notes)} notes)"

            @mcp.tool
            def read_notes() -> str:
                """Read every note written so far."""
                return " | ".join(notes) or "no notes"

            @mcp.tool
            def submit(word: str) -> str:
                """Submit the secret word; ends the episode.

                Args:
                    word: your guess
                """
                return "right" if word == SECRET else "wrong"

            super().__init__(mcp)
            self._state = State(step_count=0)

        def reset(self, seed=None, episode_id=None, **kwargs) -> Observation:
            return Observation(done=False, reward=0.0, metadata={"status": "ready"})  # the server drops metadata

        def _step_impl(self, action, timeout_s=None, **kwargs) -> Observation:
            return Observation(done=False, reward=0.0, metadata={"error": "call a tool"})

        async def step_async(self, action, timeout_s=None, **kwargs) -> Observation:
            obs = await super().step_async(action, timeout_s=timeout_s, **kwargs)
            if isinstance(action, CallToolAction) and action.tool_name == "submit" and obs.error is None:
                obs.reward, obs.done = (1.0 if action.arguments.get("word") == SECRET else 0.0), True
            return obs

        @property
        def state(self) -> State:
            return self._state

    return create_app(Notes, CallToolAction, CallToolObservation, env_name="notes", max_concurrent_envs=32)


def _grid_app() -> Any:
    """A 3x3 grid world whose action is an Enum field; reaching (2, 2) scores 1 and ends it."""
    from openenv.core.env_server import Environment, create_app
    from openenv.core.env_server.types import Action as OEAction
    from openenv.core.env_server.types import Observation as OEObservation
    from openenv.core.env_server.types import State
    from pydantic import Field

    class Move(str, Enum):
        UP = "UP"
        DOWN = "DOWN"
        LEFT = "LEFT"
        RIGHT = "RIGHT"

    class GridAction(OEAction):
        action: Move = Field(..., description="The direction to move the agent.")

    class GridObservation(OEObservation):
        x: int = 0
        y: int = 0
        message: str = ""

    class Grid(Environment):
        SUPPORTS_CONCURRENT_SESSIONS = True

        def reset(self, seed=None, episode_id=None, **kwargs) -> GridObservation:
            self.x = self.y = 0
            return GridObservation(x=0, y=0, message="Reach (2, 2).")

        def step(self, action: GridAction, timeout_s=None, **kwargs) -> GridObservation:
            dx, dy = {"UP": (0, -1), "DOWN": (0, 1), "LEFT": (-1, 0), "RIGHT": (1, 0)}[action.action.value]
            self.x, self.y = min(max(self.x + dx, 0), 2), min(max(self.y + dy, 0), 2)
            done = (self.x, self.y) == (2, 2)
            return GridObservation(x=self.x, y=self.y, message="goal" if done else "", reward=float(done), done=done)

        @property
        def state(self) -> State:
            return State(step_count=0)

    return create_app(Grid, GridAction, GridObservation, env_name="grid", max_concurrent_envs=32)


@contextlib.contextmanager
def _serving(make_app: Any) -> Iterator[str]:
    require_openenv()
    with serve_app(make_app()) as url:
        yield url


@pytest.fixture(scope="module")
def notes_url() -> Iterator[str]:
    with _serving(_notes_app) as url:
        yield url


@pytest.fixture(scope="module")
def grid_url() -> Iterator[str]:
    with _serving(_grid_app) as url:
        yield url


def _turn(text: str) -> Action:
    """The assistant turn as the episode loop builds it: text plus the Hermes calls parsed from it."""
    _, calls, errors = get_parser("hermes").parse(text)
    return Action(text=text, tool_calls=calls, errors=errors)


def _call(name: str, **arguments: Any) -> str:
    import json

    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


# -- MCP-style envs ------------------------------------------------------------------------------------


async def test_mcp_env_offers_its_tools_and_plays_tool_calls(notes_url):
    env = agentrl.load_env(f"openenv:{notes_url}")()
    obs, info = await env.reset(seed=0, options={"prompt": f"openenv:{notes_url} seed 0", "seed": 0})
    assert info == {"observation": {}}  # the reset message lives in the dropped metadata
    assert [t.name for t in env.tools] == ["write_note", "read_notes", "submit"]
    assert (
        len(obs) == 1
        and obs[0]["content"] == "Notes environment. Act by calling its tools (write_note, read_notes, submit)."
    )
    schemas = {s["function"]["name"]: s["function"] for s in env.tool_schemas()}
    assert schemas["write_note"]["parameters"]["properties"]["text"] == {
        "type": "string",
        "description": "what to write",
    }
    assert schemas["submit"]["description"].startswith("Submit the secret word")

    msgs, reward, terminated, truncated, _ = await env.step(_turn("Let me write. " + _call("write_note", text="hi")))
    assert msgs == [{"role": "tool", "name": "write_note", "tool_call_id": "call_0", "content": "noted (1 notes)"}]
    assert (reward, terminated, truncated) == (0.0, False, False)
    two = _call("write_note", text="there") + _call("read_notes") + _call("nope", a=1) + _call("write_note", text=3)
    msgs, *_ = await env.step(_turn(two + "<tool_call>{broken</tool_call>"))
    assert [m["content"] for m in msgs] == [
        "noted (2 notes)",
        "hi | there",  # the server env's state persists across the episode's calls (one session)
        "Error: unknown tool 'nope'. Available tools: write_note, read_notes, submit.",
        "Error: write_note: argument 'text' must be a string, got integer 3",
        msgs[4]["content"],
    ]
    assert msgs[4]["content"].startswith("Error: could not parse tool call") and msgs[4]["tool_call_id"]
    msgs, reward, terminated, *_ = await env.step(_turn("I am done"))  # plain text is not an action here
    assert msgs[0]["content"] == (
        "Invalid action: this environment is played with tool calls: call one of its tools (write_note, read_notes, submit)"
    )
    assert (reward, terminated) == (0.0, False)
    msgs, reward, terminated, *_ = await env.step(_turn(_call("submit", word=SECRET) + _call("read_notes")))
    assert (reward, terminated) == (1.0, True) and msgs[0]["content"] == "right"
    assert msgs[1]["content"] == "Error: not run: the episode ended at an earlier call of this turn"
    await env.close()

    own = OpenEnvEnv(notes_url, text_ends_episode=True)  # ToolEnv's convention, on request; a task's own prompt
    obs, _ = await own.reset(seed=1, options={"prompt": "Find the secret flower and submit it."})
    assert obs == [{"role": "user", "content": "Find the secret flower and submit it."}]
    assert await own.step(_turn("no idea")) == ([], 0.0, True, False, {"final_text": True})
    assert await own.tools[1]() is not None  # a listed tool is callable on its own, in the episode's session
    await own.close()
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Find the flower."}]
    verl = OpenEnvEnv(notes_url)  # verl's layout: the task's prompt is a list of chat messages
    obs, _ = await verl.reset(seed=1, options={"prompt": chat})
    assert obs == chat and obs[0] is not chat[0]
    await verl.close()


async def test_check_env_passes_mcp_envs_and_catches_a_text_mapping(notes_url):
    factory = agentrl.load_env(f"openenv:{notes_url}")
    report = await check_env(factory, factory.tasks()[:1])
    assert report.ok, report.format()
    names = [r.scenario for r in report.results]
    assert "task 0: first observation" in names and "task 0: valid call of submit" in names
    assert "3 tool(s) offered" in report.results[0].detail

    def old_mapping() -> OpenEnvEnv:  # what the adapter did before: the whole reply as the tool name, no tools
        return OpenEnvEnv(notes_url, action_from_text=lambda text: {"tool_name": text})

    report = await check_env(old_mapping, [{"prompt": "", "label": "x"}])
    assert [v.scenario for v in report.violations] == ["task 0: first observation"]
    assert "(CallToolAction) takes tool calls, but the env offers the model no tools" in report.violations[0].detail

    class BlankFirst(agentrl.ToolEnv):  # what the old adapter showed first: the dropped observation as '{}'
        async def reset(self, *, seed=None, options=None):
            return [{"role": "system", "content": "Be brief."}, {"role": "user", "content": " {} "}], {}

    report = await check_env(BlankFirst, [])
    assert [v.scenario for v in report.violations] == ["task 0: first observation"]
    assert "reset() shows the model nothing to act on: its last message reads [' {} ']" in report.violations[0].detail


# -- enums behind $ref -----------------------------------------------------------------------------


def test_schema_refs_and_enum_replies():
    schema = {
        "$defs": {"Move": {"enum": ["UP", "DOWN"], "type": "string"}},
        "properties": {
            "metadata": {"type": "object"},
            "action": {"$ref": "#/$defs/Move", "description": "Where to go."},
        },
        "required": ["action"],
    }
    mapping = action_mapping(schema)
    assert (mapping.field, mapping.kind, mapping.values) == ("action", "enum", ("UP", "DOWN"))
    assert mapping.hint() == "Reply with exactly one of: UP, DOWN (action: Where to go)."
    assert [mapping(t) for t in ("up", " Down.", "I move UP now")] == [
        {"action": "UP"},
        {"action": "DOWN"},
        {"action": "UP"},
    ]
    for text, how in [("jump", "names none of them"), ("up or down", "names several of them")]:
        with pytest.raises(InvalidAction, match=f"reply with exactly one of: UP, DOWN; '{text}' {how}"):
            mapping(text)
    assert parse_choice([1, 2, 3], "2") == 2
    optional_int = {"properties": {"n": {"anyOf": [{"type": "integer"}, {"type": "null"}]}}}
    assert action_mapping(optional_int)("pick 7 please") == {"n": 7}
    wrapped = {"$defs": {"D": {"type": "boolean"}}, "properties": {"ok": {"allOf": [{"$ref": "#/$defs/D"}]}}}
    assert action_mapping(wrapped)("Yes!") == {"ok": True}
    with pytest.raises(InvalidAction, match="3.7 is not one"):  # not silently 3
        action_mapping(optional_int)("3.7")
    assert action_mapping(optional_int)("3.0") == {"n": 3}
    for unclear in ("not true", "I don't think yes", "yes and no"):
        with pytest.raises(InvalidAction, match="reply with yes or no"):
            action_mapping(wrapped)(unclear)
    tagged = {  # a Literal discriminator beside the enum: filled as is, the reply picks the direction
        "$defs": {"Move": {"enum": ["UP", "DOWN"], "type": "string"}},
        "properties": {"type": {"const": "move", "type": "string"}, "direction": {"$ref": "#/$defs/Move"}},
        "required": ["type", "direction"],
    }
    assert action_mapping(tagged)("down") == {"type": "move", "direction": "DOWN"}
    one_value_enum = {
        "properties": {"kind": {"enum": ["say"]}, "text": {"type": "string"}},
        "required": ["kind", "text"],
    }
    assert action_mapping(one_value_enum)("hello") == {"kind": "say", "text": "hello"}
    with pytest.raises(ValueError, match="cannot follow \\$ref '#/\\$defs/A'"):
        resolve({"$ref": "#/$defs/A"}, {"$defs": {"A": {"$ref": "#/$defs/A"}}})
    with pytest.raises(ValueError, match="points nowhere"):
        action_mapping({"properties": {"a": {"$ref": "#/$defs/Missing"}}, "required": ["a"]})


async def test_enum_action_env_is_played_from_text(grid_url):
    env = agentrl.load_env(f"openenv:{grid_url}")()
    obs, _ = await env.reset(seed=0)
    assert obs[0]["content"] == (
        '{"x": 0, "y": 0, "message": "Reach (2, 2)."}\n\n'
        "Reply with exactly one of: UP, DOWN, LEFT, RIGHT (action: The direction to move the agent)."
    )
    msgs, reward, terminated, _, info = await env.step(Action(text="jump"))
    assert (
        msgs[0]["content"]
        == "Invalid action: reply with exactly one of: UP, DOWN, LEFT, RIGHT; 'jump' names none of them"
    )
    assert (reward, terminated) == (0.0, False) and "invalid_action" in info
    results = [await env.step(Action(text=t)) for t in ("right", "I go RIGHT", "down", "Down.")]
    assert [r[4]["observation"]["x"] for r in results] == [1, 2, 2, 2]
    assert [(r[1], r[2]) for r in results] == [(0.0, False)] * 3 + [(1.0, True)]
    await env.close()
    factory = agentrl.load_env(f"openenv:{grid_url}")
    report = await check_env(factory, factory.tasks()[:1])
    assert report.ok, report.format()


def test_mcp_rollout_shows_the_tools_and_a_real_prompt(notes_url, tiny_server, tiny_ckpt, tiny_tokenizer, tmp_path):
    spec = f"openenv:{notes_url}"
    _, samples = cli_rollout(spec, tiny_ckpt, tmp_path, num_tasks=1, max_turns=2, engine_url=tiny_server)
    assert len(samples) == 2
    for s in samples:
        assert s["status"] in ("completed", "truncated"), s["metadata"].get("error")
        assert s["prompt"] == [
            {"role": "user", "content": "Notes environment. Act by calling its tools (write_note, read_notes, submit)."}
        ]
        prompt_text = tiny_tokenizer.decode(s["tokens"][: len(s["tokens"]) - s["response_length"]])
        assert '"name": "write_note"' in prompt_text and "<tools>" in prompt_text  # the template lists the tools
        assert s["response_length"] > 0 and set(s["metadata"]["turn_rewards"]) <= {0.0}
        if len(s["metadata"]["turn_rewards"]) > 1:  # the env's answer to turn 1 is in the context of turn 2
            assert "played with tool calls" in s["response"] or "<tool_response>" in s["response"], s["response"]
