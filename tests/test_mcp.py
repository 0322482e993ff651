"""MCP tools (agentrl.mcp) against a real MCP server written with the official SDK, over stdio and
streamable HTTP on 127.0.0.1: listing, calls, errors, timeouts, a dying server, session scopes,
closing (also of a plain Env's tools) and an episode played through the rollout's scripted-policy loop.
Servers that misbehave and deadlines: tests/test_mcp_failures.py; the server in each episode's Docker
sandbox: tests/test_mcp_sandbox.py."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import time

import pytest

pytest.importorskip("mcp")

from agentrl.env import Env  # noqa: E402
from agentrl.mcp import MCPServerError, MCPServerSpec, MCPToolEnv, mcp_tools  # noqa: E402
from agentrl.rollout.scripted import play  # noqa: E402
from tests.mcp_servers.support import SERVER, STDIO, alive, call, scripted  # noqa: E402


@pytest.fixture(scope="module")
def http_url():
    """The demo server on a free loopback port, one process for the module."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, SERVER, "--http", str(port)], stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                break
        assert proc.poll() is None, "the HTTP MCP server exited"
        time.sleep(0.1)
    yield f"http://127.0.0.1:{port}/mcp"
    proc.terminate()
    proc.wait(10)


@pytest.fixture(params=["stdio", "http"])
def server(request):
    return STDIO if request.param == "stdio" else request.getfixturevalue("http_url")


def test_listing_and_schemas(server):
    tools = mcp_tools(server)
    assert [t.name for t in tools] == [
        "add",
        "read_note",
        "crash",
        "slow",
        "bump",
        "pid",
        "where",
        "save",
        "die",
        "picture",
        "mismatch",
        "box",
        "big",
    ]
    add = tools[0]
    assert add.description.startswith("Add two integers.")
    assert add.parameters["type"] == "object" and add.parameters["required"] == ["a", "b"]
    assert add.parameters["properties"]["a"]["type"] == "integer"
    assert add.schema()["function"]["name"] == "add"
    t0 = time.monotonic()
    again = mcp_tools(server, prefix="demo_", include=["add", "slow"])  # the listing is cached per server
    assert time.monotonic() - t0 < 0.5
    assert [t.name for t in again] == ["demo_add", "demo_slow"]
    with pytest.raises(ValueError, match="not tools of"):
        mcp_tools(server, include=["nope"])


def test_bad_specs_are_refused_naming_the_field():
    with pytest.raises(ValueError, match="exactly one of command"):
        MCPServerSpec()
    with pytest.raises(ValueError, match="url must be an http"):
        MCPServerSpec(url="ftp://x")
    with pytest.raises(TypeError, match="command must be a list"):
        MCPServerSpec(command=["python", ""])
    with pytest.raises(ValueError, match="protocol"):
        MCPServerSpec(command=["x"], protocol="newest")
    with pytest.raises(ValueError, match="cannot be shared"):
        mcp_tools(STDIO, sandboxed=True, shared=True)
    with pytest.raises(ValueError, match="needs a stdio command"):
        mcp_tools("http://127.0.0.1:1/mcp", sandboxed=True)
    with pytest.raises(MCPServerError, match="did not start"):
        mcp_tools([sys.executable, "-c", "import sys; sys.exit(2)"])


async def test_calls_errors_and_timeouts(server):
    tools = mcp_tools(server).bind()
    await tools.open()
    try:
        assert (await call(tools, "add", {"a": 2, "b": 3})).content == "5"
        bad = await call(tools, "add", {"a": "2"})  # checked against the listed schema before any call
        assert bad.is_error and bad.content == "Error: add: missing required argument 'b'"
        note = await call(tools, "read_note", {"name": "todo"})
        assert note.is_error and note.content.startswith("Error: ")  # the server's own words follow
        assert note.content.endswith("no note called 'todo'; list the notes first")
        crash = await call(tools, "crash")
        assert crash.is_error and crash.content.startswith("Error: ") and "crash" in crash.content
        slow = await call(tools, "slow", {"seconds": 5}, timeout=0.5)
        assert slow.is_error and slow.content == "Error: tool 'slow' timed out after 0.5s"
        assert (await call(tools, "add", {"a": 1, "b": 1})).content == "2"  # the session survives a timeout
        picture = await call(tools, "picture")
        assert picture.content == "a red dot\n[image: image/png, 4 bytes]" and not picture.is_error
    finally:
        await tools.aclose()


async def test_sessions_per_episode_are_isolated_and_shared_ones_share(server):
    one, two = mcp_tools(server).bind(), mcp_tools(server).bind()
    await asyncio.gather(one.open(), two.open())  # two servers start at once (stdio)
    try:
        assert [(await call(one, "bump")).content for _ in range(2)] == ["1", "2"]
        assert (await call(two, "bump")).content == "1"  # another episode: a session of its own
    finally:
        await one.aclose()
        await two.aclose()
    shared_a, shared_b = mcp_tools(server, shared=True).bind(), mcp_tools(server, shared=True).bind()
    from agentrl.mcp import close_shared_sessions

    try:
        first = int((await call(shared_a, "bump")).content)
        assert int((await call(shared_b, "bump")).content) == first + 1
        await shared_a.aclose()  # an episode's close leaves the shared session open
        assert int((await call(shared_b, "bump")).content) == first + 2
    finally:
        await close_shared_sessions()


class AddEnv(MCPToolEnv):
    tools = mcp_tools(STDIO, include=["add", "pid", "die"])
    system_prompt = "Use the tools."

    def reward(self, action):
        return float(action.text.strip() == self.task["label"])


async def test_each_env_has_its_own_server_and_close_ends_it():
    a, b = AddEnv(), AddEnv()
    await a.reset(options={"prompt": "x"})
    await b.reset(options={"prompt": "x"})
    pid_a = int((await call(a.tools, "pid")).content)
    pid_b = int((await call(b.tools, "pid")).content)
    assert pid_a != pid_b and alive(pid_a) and alive(pid_b)
    assert a.tools is a.tools and a.tools is not AddEnv.tools  # bound once per instance
    await a.close()
    await b.close()
    assert not alive(pid_a) and not alive(pid_b)


async def test_episode_shows_the_tool_result_in_the_conversation():
    policy = scripted([("add", {"a": 19, "b": 23}), (None, "42")])
    [result] = await play(AddEnv, policy, [{"prompt": "What is 19 + 23?", "label": "42"}])
    assert result.error is None and result.terminated and result.reward == 1.0
    assert {"role": "tool", "name": "add", "content": "42"}.items() <= result.messages[3].items()
    assert [t["function"]["name"] for t in result.tools] == ["add", "pid", "die"]


async def test_a_server_that_dies_fails_the_sample_not_the_run():
    policy = scripted([("die", {}), (None, "done")])
    died, fine = await play(
        AddEnv,
        lambda m, t: policy(m, t) if t["label"] == "x" else scripted([(None, "2")])(m, t),
        [{"prompt": "crash it", "label": "x"}, {"prompt": "1+1?", "label": "2"}],
    )
    assert died.error is not None and "MCPServerError" in died.error and "connection closed" in died.error
    assert fine.error is None and fine.reward == 1.0


class PidEnv(Env):
    """A plain Env (not an MCPToolEnv) that calls an MCP tool itself and never closes its sessions."""

    tools = mcp_tools(STDIO, include=["pid"])

    async def reset(self, *, seed=None, options=None):
        return [{"role": "user", "content": options["prompt"]}], {}

    async def step(self, action):
        pid = await call(self.tools, "pid")
        return [{"role": "user", "content": pid.content}], 1.0, True, False, {}


async def test_a_plain_envs_mcp_sessions_end_with_its_episode():
    [result] = await play(PidEnv, lambda m, t: "go", [{"prompt": "x"}])
    assert result.error is None and result.reward == 1.0
    pid = int(result.messages[-1]["content"])
    assert pid != os.getpid() and not alive(pid)  # closed by the episode loop, not by a finalizer later


async def test_a_failing_tools_close_is_recorded_not_raised():
    from agentrl.rollout.episode import release_episode

    class Broken(list):
        async def aclose(self):
            raise OSError("the server's pipe broke")

    env = PidEnv()
    env.tools = Broken()
    meta: dict = {}
    await release_episode(env, meta)
    assert meta["close_error"] == "tools close: OSError: the server's pipe broke"


async def test_bad_arguments_and_bad_replies_are_the_models_to_read(server):
    """A lone surrogate (valid JSON, not UTF-8) and a reply that breaks its own output schema are tool
    errors; the session goes on. A long result is cut to what the model may read."""
    from agentrl.mcp.connection import MAX_RESULT_CHARS

    tools = mcp_tools(server).bind()
    try:
        bad = await call(tools, "save", json.loads('{"name": "n.txt", "text": "caf\\ud800e"}'))
        assert bad.is_error and "save: the arguments cannot be sent as JSON (UnicodeEncodeError" in bad.content
        mismatch = await call(tools, "mismatch")
        assert (
            mismatch.is_error and "mismatch: the server's reply was invalid: RuntimeError: Invalid" in mismatch.content
        )
        assert (await call(tools, "add", {"a": 2, "b": 3})).content == "5"  # the same session, still alive
        big = await call(tools, "big", {"n": 200_000})
        assert big.content.startswith("x" * MAX_RESULT_CHARS + "\n[... cut: the result had 200000 characters")
        assert len(big.content) < MAX_RESULT_CHARS + 200 and big.metadata["truncated"]
        assert (await call(tools, "box", {"sandbox": "mine"})).content == "box mine"  # not agentrl's sandbox
    finally:
        await tools.aclose()


def test_listing_options_and_failures_are_handled_once(server):
    one, two = mcp_tools(server, include="add"), mcp_tools(server, include=["add"])
    assert [t.name for t in one] == ["add"]  # one str is one name, not letters
    one[0].parameters["properties"]["a"]["type"] = "string"
    assert two[0].parameters["properties"]["a"]["type"] == "integer"  # no toolset shares another's schema
    with pytest.raises(ValueError, match="stderr"):
        mcp_tools(MCPServerSpec(command=("python3", "x.py"), stderr="/tmp/x"), sandboxed=True)
    dead = [sys.executable, "-c", "import sys; sys.exit(3)"]
    with pytest.raises(MCPServerError, match="did not start"):
        mcp_tools(dead)
    t0 = time.monotonic()
    with pytest.raises(MCPServerError, match="not retried for 30s"):
        mcp_tools(dead)  # not asked again: every env built meanwhile fails at once
    assert time.monotonic() - t0 < 0.1


async def test_an_episodes_tools_close_before_its_sandbox_goes_back():
    from agentrl.rollout.episode import release_episode

    order: list[str] = []

    class Tools(list):
        async def aclose(self):
            order.append("tools")

    class Held(PidEnv):
        async def release_sandbox(self):
            order.append("sandbox")

    env = Held()
    env.tools = Tools()
    await release_episode(env, {})
    assert order == ["tools", "sandbox"]
