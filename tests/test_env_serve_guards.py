"""``agentrl env-serve``'s guards, for real on loopback: what a hostile or careless client cannot do.

The API key (flag, file, environment; Bearer, or Basic from the key in an OpenEnv client's address), the
body and message cap, JSON of any shape, idle sessions that end, host files no client can name, and the
``process`` sandbox refused unless the operator allows it. Servers are uvicorn in a thread
(``tests/serving.py``) or the CLI in a subprocess (where uvicorn's ``ws_max_size`` is set).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import io
import json
import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import httpx
import pytest
import websockets
from websockets.asyncio.client import connect as ws_connect

import agentrl
from agentrl.adapters.openenv_server import EnvServer, build_server
from agentrl.sandbox import SandboxConfig
from tests.serving import serve_app, wait_for_health

KEY = "s3cret-key-for-tests"


class Echo(agentrl.Env):
    """Shows its row's prompt; a step answers with the text; records the prompts of the envs it closed."""

    closed: list[str] = []

    async def reset(self, *, seed=None, options=None):
        self.prompt = (options or {}).get("prompt", "")
        return [{"role": "user", "content": self.prompt}], {}

    async def step(self, action):
        return [{"role": "user", "content": f"you said {action.text}"}], 0.0, action.text == "stop", False, {}

    async def close(self):
        Echo.closed.append(getattr(self, "prompt", ""))
        await super().close()


ROWS = [{"prompt": "row zero", "label": None}]


@contextlib.asynccontextmanager
async def session(url: str):
    async with aiohttp.ClientSession() as http, http.ws_connect(url.replace("http", "ws") + "/ws") as ws:
        yield ws


async def ask(ws: aiohttp.ClientWebSocketResponse, message: dict | str | bytes) -> dict[str, Any]:
    if isinstance(message, bytes):
        await ws.send_bytes(message)
    else:
        await ws.send_str(message if isinstance(message, str) else json.dumps(message))
    msg = await asyncio.wait_for(ws.receive(), 30)
    assert msg.type == aiohttp.WSMsgType.TEXT, msg
    return json.loads(msg.data)


# -- JSON of any shape, and the body cap ------------------------------------------------------------


async def test_deep_or_broken_json_is_a_parse_error_and_the_session_goes_on():
    """5,000 levels of nesting on ``/mcp`` is JSON-RPC's -32700 (was an HTTP 500), on ``/ws`` an INVALID_JSON
    reply after which the same session plays on (was a dropped session); so is a message that is not UTF-8."""
    deep = "[" * 5000 + "]" * 5000
    with serve_app(EnvServer(Echo, tasks=ROWS).app()) as url:
        r = httpx.post(f"{url}/mcp", content=deep, headers={"content-type": "application/json"}, timeout=30)
        assert r.status_code == 200, r.text
        assert r.json()["error"]["code"] == -32700 and "nested 5000 levels" in r.json()["error"]["data"]
        async with session(url) as ws:
            for bad in ('{"type": "reset", "data": ' + deep + "}", b'{"type": "\xff"}'):
                reply = await ask(ws, bad)
                assert reply["type"] == "error" and reply["data"]["code"] == "INVALID_JSON", reply
            assert "nested 5001 levels" in (await ask(ws, '{"type": "reset", "data": ' + deep + "}"))["data"]["message"]
            played = await ask(ws, {"type": "reset", "data": {"seed": 0}})
            assert played["data"]["observation"]["messages"][0]["content"] == "row zero"
        assert httpx.post(f"{url}/mcp", json={"jsonrpc": "2.0", "id": 1, "method": "tools/list"}).json()["result"]


async def test_a_body_over_the_cap_is_refused_and_the_server_serves_on():
    with serve_app(EnvServer(Echo, tasks=ROWS, max_body_bytes=1 << 20).app()) as url:
        big = json.dumps({"jsonrpc": "2.0", "id": 1, "method": "tools/list", "params": {"x": "a" * (2 << 20)}})
        r = httpx.post(f"{url}/mcp", content=big, headers={"content-type": "application/json"}, timeout=30)
        assert r.status_code == 413 and "--max-body-mb" in r.json()["error"]["message"], r.text
        assert httpx.get(f"{url}/health").json() == {"status": "healthy"}


# -- the API key ------------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@contextlib.contextmanager
def cli_server(args: list[str], env: dict[str, str] | None = None) -> Iterator[tuple[str, subprocess.Popen]]:
    """``agentrl env-serve ARGS`` in a subprocess, until its ``/health`` answers; yields its URL and process."""
    port = _free_port()
    cmd = [sys.executable, "-m", "agentrl", "env-serve", *args, "--port", str(port)]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for_health(proc, url)
        yield url, proc
    finally:
        proc.terminate()
        proc.wait(30)


async def test_the_key_guards_every_route_but_health_and_caps_websocket_messages(tmp_path, monkeypatch):
    """``--api-key-file``: /health open, everything else 401 without the key (or with a wrong one), /ws refused
    before the handshake; the key in Bearer or Basic (an OpenEnv client's ``http://agentrl:KEY@HOST``) plays;
    the key is not on the command line. A WebSocket message over ``--max-body-mb`` closes its session (1009)."""
    key_file = tmp_path / "key"
    key_file.write_text(KEY + "\n")
    key_file.chmod(0o600)
    monkeypatch.delenv("AGENTRL_ENV_SERVE_API_KEY", raising=False)
    args = ["--env", "agentrl/GuessNumber-v0", "--api-key-file", str(key_file), "--max-body-mb", "1"]
    with cli_server(args, env={**os.environ}) as (url, proc):
        assert KEY not in Path(f"/proc/{proc.pid}/cmdline").read_text()
        bearer = {"Authorization": f"Bearer {KEY}"}
        assert httpx.get(f"{url}/health").status_code == 200
        for path in ("/metadata", "/schema", "/docs", "/openapi.json"):
            assert httpx.get(f"{url}{path}").status_code == 401, path
            assert httpx.get(f"{url}{path}", headers={"Authorization": "Bearer wrong"}).status_code == 401, path
        assert httpx.post(f"{url}/mcp", json={"jsonrpc": "2.0", "id": 1, "method": "tools/list"}).status_code == 401
        assert httpx.get(f"{url}/metadata", headers=bearer).json()["name"] == "GuessNumber"
        assert httpx.get(f"{url}/schema", auth=("anyone", KEY)).status_code == 200
        assert httpx.get(f"{url}/schema", auth=("anyone", "wrong")).status_code == 401

        ws_url = url.replace("http://", "ws://") + "/ws"
        with pytest.raises(websockets.InvalidStatus) as refused:
            await ws_connect(ws_url)
        assert refused.value.response.status_code == 403
        async with ws_connect(ws_url.replace("ws://", f"ws://agentrl:{KEY}@")) as ws:  # what openenv-core sends
            await ws.send(json.dumps({"type": "reset", "data": {"seed": 0}}))
            assert json.loads(await ws.recv())["type"] == "observation"
            await ws.send(json.dumps({"type": "step", "data": {"text": "x" * (2 << 20)}}))
            with pytest.raises(websockets.ConnectionClosed) as closed:
                await asyncio.wait_for(ws.recv(), 30)
            assert closed.value.rcvd is not None and closed.value.rcvd.code == 1009
        async with ws_connect(ws_url, additional_headers=bearer) as ws:  # the slot came back; Bearer works too
            await ws.send(json.dumps({"type": "reset", "data": {"seed": 1}}))
            assert json.loads(await ws.recv())["type"] == "observation"

        with pytest.raises(ValueError, match=r"HTTP 401: it wants an API key.*AGENTRL_ENV_SERVE_API_KEY"):
            agentrl.load_env(f"openenv:{url}")
        monkeypatch.setenv("AGENTRL_ENV_SERVE_API_KEY", KEY)  # agentrl's adapter sends the variable's key
        env = agentrl.load_env(f"openenv:{url}")()
        obs, _ = await env.reset(options={"seed": 0})
        assert "Guess" in obs[0]["content"] or "guess" in obs[0]["content"]
        await env.close()
        monkeypatch.setenv("AGENTRL_ENV_SERVE_API_KEY", "wrong")
        with pytest.raises(agentrl.adapters.OpenEnvError, match="HTTP 403.*wants an API key"):
            await agentrl.adapters.OpenEnvEnv(url, server_info=({}, {})).reset(options={"seed": 0})

    with pytest.raises(ValueError, match="user:password@") as leaked:
        agentrl.load_env(f"openenv:http://agentrl:{KEY}@127.0.0.1:1")
    assert KEY not in str(leaked.value)
    both = subprocess.run(
        [sys.executable, "-m", "agentrl", "env-serve", *args, "--api-key", KEY],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert both.returncode == 2 and "--api-key and --api-key-file both given" in both.stderr


def test_help_says_which_routes_are_open_and_where_the_key_comes_from():
    shown = subprocess.run(
        [sys.executable, "-m", "agentrl", "env-serve", "--help"], capture_output=True, text=True, timeout=120
    )
    text = " ".join(shown.stdout.split())
    for said in ("every route but /health", "--api-key-file", "$AGENTRL_ENV_SERVE_API_KEY", "http://agentrl:KEY@"):
        assert said in text, said
    for flag in ("--idle-timeout", "--max-body-mb", "--allow-host-sandbox"):
        assert flag in text, flag


@pytest.mark.parametrize(
    "flags,said",
    [
        (["--idle-timeout", "0"], "--idle-timeout must be a positive number of seconds, got 0.0"),
        (["--idle-timeout", "nan"], "--idle-timeout must be a positive number of seconds, got nan"),
        (["--max-body-mb", "-1"], "--max-body-mb must lie in (0, 4096] MiB, got -1.0"),
        (["--api-key", "two words"], "--api-key: the key must be non-empty and hold no spaces"),
        (["--api-key-file", "/nonexistent/key"], "--api-key-file: cannot read '/nonexistent/key'"),
    ],
)
def test_bad_guard_flags_are_refused_before_anything_starts(flags, said, capsys):
    from agentrl.cli import main

    assert main(["env-serve", "--env", "agentrl/Calculator-v0", *flags]) == 2
    assert said in capsys.readouterr().err


async def test_openenv_core_clients_send_the_key_in_their_address():
    """openenv-core 0.3.0's clients take no headers: a key in their base URL reaches the server as Basic."""
    try:
        from openenv.core import GenericEnvClient
        from openenv.core.mcp_client import MCPToolClient
    except ImportError:
        reason = "openenv-core is not installed (pip install --no-deps openenv-core==0.3.0 && pip install fastmcp)"
        if os.environ.get("AGENTRL_REQUIRE_OPENENV") == "1":
            pytest.fail(reason + " and AGENTRL_REQUIRE_OPENENV=1")
        pytest.skip(reason)
    with serve_app(build_server("agentrl/GuessNumber-v0", api_key=KEY).app()) as url:
        keyed = url.replace("http://", f"http://agentrl:{KEY}@")
        with pytest.raises(ConnectionError):
            await GenericEnvClient(base_url=url).connect()
        async with GenericEnvClient(base_url=keyed) as env:
            first = await env.reset(seed=1)
            assert first.observation["messages"] and not first.done
        async with MCPToolClient(base_url=keyed) as tools_env:
            assert [t.name for t in await tools_env.list_tools()] == ["calculator"]


# -- idle sessions ----------------------------------------------------------------------------------


async def test_idle_sessions_end_and_free_their_slots():
    """Two idle connections fill a 2-slot server (a third gets CAPACITY_REACHED); after ``idle_timeout`` both
    are told why and closed, the live episode's env is closed, and a new client plays."""
    Echo.closed.clear()
    with serve_app(EnvServer(Echo, tasks=ROWS, max_sessions=2, idle_timeout=3.0).app()) as url:
        async with session(url) as playing, session(url) as silent:
            assert (await ask(playing, {"type": "reset", "data": {"seed": 0}}))["type"] == "observation"
            async with session(url) as third:
                assert (await ask(third, {"type": "reset", "data": {}}))["data"]["code"] == "CAPACITY_REACHED"
            for ws in (playing, silent):
                told = await asyncio.wait_for(ws.receive(), 30)
                assert told.type == aiohttp.WSMsgType.TEXT, told
                error = json.loads(told.data)["data"]
                assert error["code"] == "SESSION_ERROR" and "--idle-timeout" in error["message"]
                end = await asyncio.wait_for(ws.receive(), 30)
                assert end.type in (aiohttp.WSMsgType.CLOSE, aiohttp.WSMsgType.CLOSED), end
        assert "row zero" in Echo.closed
        async with session(url) as late:
            assert (await ask(late, {"type": "reset", "data": {"seed": 0}}))["type"] == "observation"
    with pytest.raises(ValueError, match="idle_timeout must be a positive number"):
        EnvServer(Echo, idle_timeout=0)


# -- host files in pictures -------------------------------------------------------------------------


def _png(path: Path, colour: tuple[int, int, int]) -> str:
    from PIL import Image

    Image.new("RGB", (4, 4), colour).save(path)
    return path.as_uri()


class Pictures(agentrl.Env):
    """Shows the picture its row names; a step shows the picture the action's text names."""

    async def reset(self, *, seed=None, options=None):
        return [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": options["picture"]}}]}], {}

    async def step(self, action):
        return [{"role": "user", "content": [{"type": "image", "image": action.text}]}], 0.0, False, False, {}


async def test_a_served_env_shows_no_host_file_a_client_names(tmp_path):
    """The server's own row may show its picture file; a row the client sends, or an action, naming a host
    file ends the episode and the file's pixels never reach the client (a data: URL still works)."""
    from PIL import Image

    mine = _png(tmp_path / "operator.png", (0, 255, 0))
    secret = _png(tmp_path / "secret.png", (255, 0, 0))
    buf = io.BytesIO()
    Image.new("RGB", (4, 4), (0, 0, 255)).save(buf, format="PNG")
    inline = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    rows = [{"prompt": "look", "label": None, "picture": mine}]
    with serve_app(EnvServer(Pictures, tasks=rows).app()) as url:
        async with session(url) as ws:
            shown = await ask(ws, {"type": "reset", "data": {"seed": 0}})
            part = shown["data"]["observation"]["messages"][0]["content"][0]
            assert part["image_url"]["url"].startswith("data:image/png;base64,"), shown
            stepped = await ask(ws, {"type": "step", "data": {"text": inline}})
            assert stepped["type"] == "observation", stepped
            for named in (secret, " " + secret, secret.replace("file://", "FILE://")):
                refused = await ask(ws, {"type": "step", "data": {"text": named}})
                assert refused["data"]["code"] == "EXECUTION_ERROR" and "host file" in refused["data"]["message"]
                assert "data:image" not in json.dumps(refused)
                await ask(ws, {"type": "reset", "data": {"seed": 0}})
            sent = await ask(ws, {"type": "reset", "data": {"prompt": "mine", "picture": secret}})
            assert sent["data"]["code"] == "EXECUTION_ERROR" and "host file" in sent["data"]["message"], sent
            assert "data:image" not in json.dumps(sent)


# -- the process sandbox ----------------------------------------------------------------------------


def test_an_env_whose_tools_run_model_code_is_refused_on_the_process_sandbox():
    """``--sandbox process`` (model code can read the host's files) with a sandboxed tool: refused before the
    port is bound, saying why and what to use; ``--allow-host-sandbox`` serves it."""
    cmd = [sys.executable, "-m", "agentrl", "env-serve", "--env", "agentrl/PythonCode-v0", "--sandbox", "process"]
    refused = subprocess.run([*cmd, "--port", str(_free_port())], capture_output=True, text=True, timeout=120)
    assert refused.returncode == 2, refused.stderr[-2000:]
    line = refused.stderr.strip().splitlines()[-1]
    assert "PythonCode's tools python run model-written code" in line
    for said in ("read this machine's files", "--sandbox docker", "bubblewrap", "--allow-host-sandbox"):
        assert said in line, line
    with cli_server(["--env", "agentrl/PythonCode-v0", "--sandbox", "process", "--allow-host-sandbox"]) as (url, _):
        assert httpx.get(f"{url}/metadata").json()["name"] == "PythonCode"


class TakesASandbox(agentrl.Env):
    """No sandboxed tool, but its step runs the action's text in the episode's sandbox (as hidden tests do)."""

    async def reset(self, *, seed=None, options=None):
        return [{"role": "user", "content": "write a shell command"}], {}

    async def step(self, action):
        result = await (await self.sandbox()).run(action.text, timeout=10)
        return [{"role": "user", "content": result.stdout}], 0.0, True, False, {}


@pytest.mark.e2e
async def test_an_env_taking_a_sandbox_gets_no_process_sandbox_unless_allowed():
    rows = [{"prompt": "p", "label": None}]
    for allowed in (False, True):
        server = EnvServer(
            TakesASandbox, tasks=rows, sandbox=SandboxConfig(backend="process"), allow_host_sandbox=allowed
        )
        with serve_app(server.app()) as url:
            async with session(url) as ws:
                await ask(ws, {"type": "reset", "data": {"seed": 0}})
                reply = await ask(ws, {"type": "step", "data": {"text": "echo ran"}})
        if allowed:
            assert reply["data"]["observation"]["messages"][0]["content"].strip() == "ran", reply
        else:
            assert reply["data"]["code"] == "EXECUTION_ERROR", reply
            assert "--allow-host-sandbox" in reply["data"]["message"] and "ran" not in json.dumps(reply)
