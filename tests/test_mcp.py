"""MCP tools (agentrl.mcp) against a real MCP server written with the official SDK, over stdio and
streamable HTTP on 127.0.0.1: listing, calls, errors, timeouts, a dying server, session scopes,
closing (also of a plain Env's tools), an episode played through the rollout's scripted-policy loop,
and (Docker) the server started inside each episode's sandbox."""

from __future__ import annotations

import asyncio
import hashlib
import importlib.metadata
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("mcp")

from agentrl.env import Env  # noqa: E402
from agentrl.mcp import MCPServerError, MCPServerSpec, MCPToolEnv, mcp_tools  # noqa: E402
from agentrl.rollout.scripted import play  # noqa: E402
from agentrl.sandbox import SandboxConfig, SandboxPool, create_sandbox  # noqa: E402
from agentrl.tool import call_tool, find_tool  # noqa: E402

SERVER = str(Path(__file__).parent / "mcp_servers" / "demo_server.py")
STDIO = [sys.executable, SERVER]


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


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie is gone for our purposes
        return f.read().split(") ", 1)[1][0] != "Z"


async def _call(tools, name, arguments=None, timeout=20.0, sandbox=None):
    return await call_tool(find_tool(tools, name), arguments or {}, timeout=timeout, sandbox=sandbox)


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
        assert (await _call(tools, "add", {"a": 2, "b": 3})).content == "5"
        bad = await _call(tools, "add", {"a": "2"})  # checked against the listed schema before any call
        assert bad.is_error and bad.content == "Error: add: missing required argument 'b'"
        note = await _call(tools, "read_note", {"name": "todo"})
        assert note.is_error and note.content.startswith("Error: ")  # the server's own words follow
        assert note.content.endswith("no note called 'todo'; list the notes first")
        crash = await _call(tools, "crash")
        assert crash.is_error and crash.content.startswith("Error: ") and "crash" in crash.content
        slow = await _call(tools, "slow", {"seconds": 5}, timeout=0.5)
        assert slow.is_error and slow.content == "Error: tool 'slow' timed out after 0.5s"
        assert (await _call(tools, "add", {"a": 1, "b": 1})).content == "2"  # the session survives a timeout
        picture = await _call(tools, "picture")
        assert picture.content == "a red dot\n[image: image/png, 4 bytes]" and not picture.is_error
    finally:
        await tools.aclose()


async def test_sessions_per_episode_are_isolated_and_shared_ones_share(server):
    one, two = mcp_tools(server).bind(), mcp_tools(server).bind()
    await asyncio.gather(one.open(), two.open())  # two servers start at once (stdio)
    try:
        assert [(await _call(one, "bump")).content for _ in range(2)] == ["1", "2"]
        assert (await _call(two, "bump")).content == "1"  # another episode: a session of its own
    finally:
        await one.aclose()
        await two.aclose()
    shared_a, shared_b = mcp_tools(server, shared=True).bind(), mcp_tools(server, shared=True).bind()
    from agentrl.mcp import close_shared_sessions

    try:
        first = int((await _call(shared_a, "bump")).content)
        assert int((await _call(shared_b, "bump")).content) == first + 1
        await shared_a.aclose()  # an episode's close leaves the shared session open
        assert int((await _call(shared_b, "bump")).content) == first + 2
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
    pid_a = int((await _call(a.tools, "pid")).content)
    pid_b = int((await _call(b.tools, "pid")).content)
    assert pid_a != pid_b and _alive(pid_a) and _alive(pid_b)
    assert a.tools is a.tools and a.tools is not AddEnv.tools  # bound once per instance
    await a.close()
    await b.close()
    assert not _alive(pid_a) and not _alive(pid_b)


def _policy(calls):
    """Turn i: the i-th scripted text; tool calls in the Hermes format the env parses."""

    def policy(messages, task):
        turn = sum(m["role"] == "assistant" for m in messages)
        name, args = calls[turn]
        if name is None:
            return args
        return f"<tool_call>{json.dumps({'name': name, 'arguments': args})}</tool_call>"

    return policy


async def test_episode_shows_the_tool_result_in_the_conversation():
    policy = _policy([("add", {"a": 19, "b": 23}), (None, "42")])
    [result] = await play(AddEnv, policy, [{"prompt": "What is 19 + 23?", "label": "42"}])
    assert result.error is None and result.terminated and result.reward == 1.0
    assert {"role": "tool", "name": "add", "content": "42"}.items() <= result.messages[3].items()
    assert [t["function"]["name"] for t in result.tools] == ["add", "pid", "die"]


async def test_a_server_that_dies_fails_the_sample_not_the_run():
    policy = _policy([("die", {}), (None, "done")])
    died, fine = await play(
        AddEnv,
        lambda m, t: policy(m, t) if t["label"] == "x" else _policy([(None, "2")])(m, t),
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
        pid = await _call(self.tools, "pid")
        return [{"role": "user", "content": pid.content}], 1.0, True, False, {}


async def test_a_plain_envs_mcp_sessions_end_with_its_episode():
    [result] = await play(PidEnv, lambda m, t: "go", [{"prompt": "x"}])
    assert result.error is None and result.reward == 1.0
    pid = int(result.messages[-1]["content"])
    assert pid != os.getpid() and not _alive(pid)  # closed by the episode loop, not by a finalizer later


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


# -- servers that misbehave, cancellation, several loops ------------------------------------------------

SILENT = str(Path(__file__).parent / "mcp_servers" / "silent_server.py")
REPO = Path(__file__).resolve().parents[1]


def test_a_server_that_never_answers_fails_the_call_and_leaves_nothing(tmp_path):
    """A server stuck before its handshake: getting its session (what a call does first) fails the
    sample naming the timeout, per episode and shared; no server process survives, and the process
    ends (the stuck child used to be leaked and hang it at exit)."""
    (tmp_path / "silent").touch()
    script = f"""
import asyncio, sys
from agentrl.mcp import MCPServerError, MCPServerSpec, close_shared_sessions
from agentrl.mcp.sessions import Sessions, shared_sessions
spec = MCPServerSpec(command=(sys.executable, {SILENT!r}, {str(tmp_path)!r}), connect_timeout=2.0)
async def main():
    for sessions in (Sessions(spec, False), shared_sessions(spec)):
        try:
            await sessions.get(None)
        except MCPServerError as e:
            print("ERROR", e)
        await sessions.aclose()
asyncio.run(main())
print("RETURNED")
"""
    try:
        out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=40, cwd=REPO)
    finally:
        pids = [int(p.name.split(".")[1]) for p in tmp_path.glob("pid.*")]
        survivors = [pid for pid in pids if _alive(pid)]
        for pid in survivors:
            os.kill(pid, 9)
    assert out.stdout.count("did not start: no answer within 2s (connect_timeout)") == 2, out.stdout + out.stderr
    assert out.stdout.rstrip().endswith("RETURNED") and pids and survivors == []


async def test_bad_arguments_and_bad_replies_are_the_models_to_read(server):
    """A lone surrogate (valid JSON, not UTF-8) and a reply that breaks its own output schema are tool
    errors; the session goes on. A long result is cut to what the model may read."""
    from agentrl.mcp.connection import MAX_RESULT_CHARS

    tools = mcp_tools(server).bind()
    try:
        bad = await _call(tools, "save", json.loads('{"name": "n.txt", "text": "caf\\ud800e"}'))
        assert bad.is_error and "save: the arguments cannot be sent as JSON (UnicodeEncodeError" in bad.content
        mismatch = await _call(tools, "mismatch")
        assert (
            mismatch.is_error and "mismatch: the server's reply was invalid: RuntimeError: Invalid" in mismatch.content
        )
        assert (await _call(tools, "add", {"a": 2, "b": 3})).content == "5"  # the same session, still alive
        big = await _call(tools, "big", {"n": 200_000})
        assert big.content.startswith("x" * MAX_RESULT_CHARS + "\n[... cut: the result had 200000 characters")
        assert len(big.content) < MAX_RESULT_CHARS + 200 and big.metadata["truncated"]
        assert (await _call(tools, "box", {"sandbox": "mine"})).content == "box mine"  # not agentrl's sandbox
    finally:
        await tools.aclose()


async def test_closing_keeps_the_callers_cancellation():
    """An episode cancelled while its server takes long to exit stays cancelled."""
    slow_exit = ["/bin/sh", "-c", f"trap '' TERM; {sys.executable} {SERVER}; sleep 3"]
    tools = mcp_tools(slow_exit).bind()
    await tools.open()

    async def episode():
        await tools.aclose()
        await asyncio.sleep(0)
        return "returned"

    task = asyncio.create_task(episode())
    await asyncio.sleep(0.5)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


def test_shared_sessions_serve_several_event_loops():
    """Episodes on two threads (two loops) share a server without closing each other's session."""
    import threading

    from agentrl.mcp import close_shared_sessions

    tools = mcp_tools(STDIO, shared=True, include=["slow"])
    failures: dict[int, list[str]] = {}

    def worker(k: int) -> None:
        async def main() -> None:
            failures[k] = []
            for _ in range(3):
                try:
                    await _call(tools, "slow", {"seconds": 0.2})
                except MCPServerError as e:
                    failures[k].append(str(e))
            await close_shared_sessions()

        asyncio.run(main())

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert failures == {0: [], 1: []}


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


# -- the server inside each episode's Docker sandbox --------------------------------------------------


def _dists(name: str) -> dict[str, importlib.metadata.Distribution]:
    """``name`` and every distribution it needs (extras off), as installed here."""
    from packaging.requirements import Requirement

    found: dict[str, importlib.metadata.Distribution] = {}
    todo = [(name, ("",))]
    while todo:
        dist_name, extras = todo.pop()
        key = re.sub(r"[-_.]+", "-", dist_name).lower()
        if key in found:
            continue
        dist = found[key] = importlib.metadata.distribution(dist_name)
        for line in dist.requires or []:
            req = Requirement(line)
            if req.marker is None or any(req.marker.evaluate({"extra": e}) for e in extras):
                todo.append((req.name, ("", *req.extras)))
    return found


_GLIBC = re.compile(r"(libc|libm|libdl|libpthread|librt|libresolv|libutil|ld-linux[^.]*)\.so")


def _copy_shared_libraries(site: Path, dest: Path) -> None:
    """The host libraries the compiled modules load that the image lacks (glibc it has): libgcc_s for
    the Rust-built ones (pydantic-core, rpds-py, cryptography)."""
    dest.mkdir()
    for module in site.rglob("*.so"):
        out = subprocess.run(["ldd", str(module)], capture_output=True, text=True).stdout
        for name, path in re.findall(r"^\s*(\S+) => (/\S+)", out, re.M):
            if not _GLIBC.match(name) and not (dest / name).exists():
                shutil.copy2(path, dest / name)


@pytest.fixture(scope="session")
def mcp_sandbox_image(docker_image, tmp_path_factory):
    """The sandbox image plus the host's ``mcp`` and its dependencies (/opt/site) and the demo server
    (/opt/demo_server.py). The host's Python is 3.11 like the image's Debian one (same ABI, same libc),
    so the installed files are copied as they are: no registry. Tagged by content: built once."""
    import docker

    from agentrl.sandbox.docker import docker_client

    client = docker_client()
    dists = _dists("mcp")
    dockerfile = (
        f"FROM {docker_image}\nCOPY site/ /opt/site/\nCOPY lib/ /opt/lib/\nCOPY demo_server.py /opt/demo_server.py\n"
        "ENV PYTHONPATH=/opt/site LD_LIBRARY_PATH=/opt/lib\n# bytecode: unchecked-hash\n"
    )
    digest = hashlib.sha256((client.images.get(docker_image).id + dockerfile).encode())
    digest.update(Path(SERVER).read_bytes())
    for key in sorted(dists):
        digest.update(f"{key}=={dists[key].version};".encode())
    tag = f"agentrl-test-mcp:{digest.hexdigest()[:12]}"
    try:
        client.images.get(tag)
        return tag
    except docker.errors.ImageNotFound:
        pass
    t0 = time.monotonic()
    ctx = tmp_path_factory.mktemp("mcp-image")
    for dist in dists.values():
        for f in dist.files or []:
            src = Path(str(dist.locate_file(f)))
            if f.parts[0] != ".." and "__pycache__" not in f.parts and src.is_file():
                (ctx / "site" / f).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(src, ctx / "site" / f)
    _copy_shared_libraries(ctx / "site", ctx / "lib")
    # compiled now (3.11 bytecode is the image's too): the read-only image could not cache it, and
    # every server start would compile mcp again (~2 s)
    compile_ = [sys.executable, "-m", "compileall", "-q", "-j0", "--invalidation-mode", "unchecked-hash"]
    subprocess.run([*compile_, str(ctx / "site")], check=True, stdout=subprocess.DEVNULL)
    shutil.copy2(SERVER, ctx / "demo_server.py")
    (ctx / "Dockerfile").write_text(dockerfile)
    client.images.build(path=str(ctx), tag=tag, rm=True, forcerm=True)
    print(f"built {tag} in {time.monotonic() - t0:.1f}s")
    return tag


SANDBOXED_TOOLS = ["add", "read_note", "crash", "bump", "where", "save"]


def _sandboxed_env(image: str) -> type[MCPToolEnv]:
    config = SandboxConfig(backend="docker", image=image, timeout=30.0)

    class SandboxedEnv(MCPToolEnv):
        tools = mcp_tools(
            ["python3", "/opt/demo_server.py"], sandboxed=True, sandbox_config=config, include=SANDBOXED_TOOLS
        )
        sandbox_pool = SandboxPool(lambda: create_sandbox(config), config)

        def reward(self, action):
            return float(action.text.strip() == "done")

    return SandboxedEnv


async def _ps(sandbox) -> str:
    return (await sandbox.run(["ps", "-eo", "args"])).stdout


@pytest.mark.docker
async def test_a_sandboxed_server_runs_in_the_episodes_container(mcp_sandbox_image):
    env_class = _sandboxed_env(mcp_sandbox_image)
    assert [t.name for t in env_class.tools] == SANDBOXED_TOOLS  # listed in a sandbox
    config = SandboxConfig(backend="docker", image=mcp_sandbox_image, timeout=30.0)
    with pytest.raises(ValueError, match=r"\['box'\] .* take an argument called 'sandbox'"):
        mcp_tools(["python3", "/opt/demo_server.py"], sandboxed=True, sandbox_config=config)
    assert all(t.sandboxed for t in env_class.tools)
    a, b = env_class(), env_class()
    try:
        await asyncio.gather(a.reset(options={"prompt": "x"}), b.reset(options={"prompt": "y"}))
        box_a, box_b = await a.sandbox(), await b.sandbox()
        assert box_a is not box_b
        host, cwd = (await _call(a.tools, "where", sandbox=box_a)).content.split()
        assert cwd == "/scratch" and host != socket.gethostname()
        assert host == (await box_a.run(code="import socket; print(socket.gethostname())")).stdout.strip()
        saved = await _call(a.tools, "save", {"name": "note.txt", "text": "hello"}, sandbox=box_a)
        assert saved.content == "/scratch/note.txt"
        assert (await box_a.run(["cat", "note.txt"])).stdout == "hello"
        assert (await box_b.run(["ls", "-A"])).stdout == ""  # another episode, another container
        assert [(await _call(a.tools, "bump", sandbox=box_a)).content for _ in range(2)] == ["1", "2"]
        assert (await _call(b.tools, "bump", sandbox=box_b)).content == "1"
        assert (await _call(a.tools, "add", {"a": 2, "b": 3}, sandbox=box_a)).content == "5"
        assert "/opt/demo_server.py" in await _ps(box_a)
    finally:
        await a.close()
        await b.close()
    again = await env_class.sandbox_pool.acquire()  # the released sandbox, reset: no server left in it
    try:
        assert again in (box_a, box_b) and "demo_server" not in await _ps(again)
    finally:
        await env_class.sandbox_pool.release(again)
        await env_class.sandbox_pool.close()


@pytest.mark.docker
async def test_an_episode_with_a_sandboxed_server(mcp_sandbox_image):
    env_class = _sandboxed_env(mcp_sandbox_image)
    policy = _policy([("save", {"name": "a.txt", "text": "x"}), ("where", {}), (None, "done")])
    try:
        [result] = await play(env_class, policy, [{"prompt": "save a note"}])
    finally:
        await env_class.sandbox_pool.close()
    assert result.error is None and result.reward == 1.0, result.error
    saved, where = [m["content"] for m in result.messages if m["role"] == "tool"]
    assert saved == "/scratch/a.txt" and where.endswith(" /scratch")
