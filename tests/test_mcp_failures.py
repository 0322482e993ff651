"""MCP servers that misbehave, and which deadline a failure names: a server stuck before its
handshake (stdio) or an endpoint that takes the request and never answers (HTTP), one that answers
the handshake but never its tool listing, one that starts slowly; cancellation while closing, and
shared sessions on several event loops. Real server processes on 127.0.0.1 (tests/mcp_servers/)."""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("mcp")

from agentrl.mcp import MCPServerError, MCPServerSpec, mcp_tools  # noqa: E402
from agentrl.mcp.sessions import Sessions  # noqa: E402
from tests.mcp_servers.support import SERVER, SILENT, STDIO, alive, call  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


def test_a_server_that_never_answers_fails_the_call_and_leaves_nothing(tmp_path):
    """A server stuck before its handshake: getting its session (what a call does first) fails the
    sample naming the deadline and what it waited for (the process ran; initialize had no answer),
    per episode and shared; no server process survives, and the process
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
        survivors = [pid for pid in pids if alive(pid)]
        for pid in survivors:
            os.kill(pid, 9)
    said = "did not answer initialize within 2s (connect_timeout): its process started but never answered the handshake"
    assert out.stdout.count(said) == 2, out.stdout + out.stderr
    assert out.stdout.rstrip().endswith("RETURNED") and pids and survivors == []


async def test_closing_keeps_the_callers_cancellation():
    """An episode cancelled while its server takes long to exit stays cancelled; the session's own
    task still ends the server (awaited here, so no process outlives this test's event loop)."""
    slow_exit = ["/bin/sh", "-c", f"trap '' TERM; {sys.executable} {SERVER}; sleep 3"]
    tools = mcp_tools(slow_exit).bind()
    await tools.open()
    [conn] = tools._members[0].sessions._conns.values()

    async def episode():
        await tools.aclose()
        await asyncio.sleep(0)
        return "returned"

    task = asyncio.create_task(episode())
    await asyncio.sleep(0.5)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await asyncio.wait([conn._task], timeout=20)
    assert conn._task.done() and conn.client is None


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
                    await call(tools, "slow", {"seconds": 0.2})
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


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def test_an_http_endpoint_that_never_answers_initialize_is_named_so(tmp_path):
    """The endpoint accepts the connection and the request, and never replies: the error says
    initialize had no answer within connect_timeout (not that the server did not start)."""
    port = _free_port()
    proc = subprocess.Popen([sys.executable, SILENT, str(tmp_path), "--http", str(port)])
    try:
        deadline = time.monotonic() + 30
        while True:
            with socket.socket() as probe:
                if probe.connect_ex(("127.0.0.1", port)) == 0:
                    break
            assert proc.poll() is None and time.monotonic() < deadline, "the silent HTTP server did not listen"
            await asyncio.sleep(0.05)
        url = f"http://127.0.0.1:{port}/mcp"
        sessions = Sessions(MCPServerSpec(url=url, connect_timeout=1.0), False)
        t0 = time.monotonic()
        with pytest.raises(MCPServerError) as failed:
            await sessions.get(None)
        assert time.monotonic() - t0 < 5
        assert str(failed.value) == (
            f"MCP server {url!r} did not answer initialize within 1s (connect_timeout): nothing came back from {url}"
        )
        await sessions.aclose()
    finally:
        proc.kill()
        proc.wait(10)


async def test_a_server_that_answers_the_handshake_but_not_its_listing(tmp_path):
    """Slow past the handshake: ``mcp_tools`` fails naming tools/list (it used to wait for good), and
    the server process is gone."""
    (tmp_path / "slow_list").touch()
    # 8 s: the child's start and its import of mcp (2-3 s on a busy machine) come out of it before the listing
    spec = MCPServerSpec(command=(sys.executable, SILENT, str(tmp_path)), connect_timeout=8.0)
    listing = asyncio.to_thread(mcp_tools, spec)
    with pytest.raises(
        MCPServerError, match=r"did not answer tools/list within 8s \(connect_timeout\): it answered the handshake"
    ):
        await asyncio.wait_for(listing, 30)
    pids = [int(p.name.split(".")[1]) for p in tmp_path.glob("pid.*")]
    assert len(pids) == 1 and not alive(pids[0])


async def test_a_call_that_times_out_while_the_server_starts_is_that_calls_timeout(tmp_path):
    """A server that takes 1.5 s to start (connect_timeout 10 s): a first call limited to 0.5 s fails
    as that call's timeout, the model reads it, and the handshake goes on: the next call is answered
    by the same process (one for the listing, one for the episode: none restarted)."""
    (tmp_path / "slow_start").write_text("1.5")
    spec = MCPServerSpec(command=(sys.executable, SILENT, str(tmp_path)), connect_timeout=10.0)
    tools = mcp_tools(spec, include=["add", "pid"]).bind()
    try:
        first = await call(tools, "add", {"a": 2, "b": 3}, timeout=0.5)
        assert first.is_error and first.content == "Error: tool 'add' timed out after 0.5s"
        assert (await call(tools, "add", {"a": 2, "b": 3})).content == "5"
        pid = int((await call(tools, "pid")).content)
    finally:
        await tools.aclose()
    assert len(list(tmp_path.glob("pid.*"))) == 2 and (tmp_path / f"pid.{pid}").exists()


async def test_an_sdk_that_does_not_import_is_named_at_once(monkeypatch):
    """The ``mcp`` SDK (an optional extra) broken or missing: the session fails at once naming the
    import, not after connect_timeout + 10 s as a transport that would not stop."""
    monkeypatch.setitem(sys.modules, "mcp.client.streamable_http", None)
    sessions = Sessions(MCPServerSpec(command=STDIO, connect_timeout=1.0), False)
    t0 = time.monotonic()
    with pytest.raises(MCPServerError, match=r"did not start: .*ModuleNotFoundError.*mcp\.client\.streamable_http"):
        await asyncio.wait_for(sessions.get(None), 30)
    await sessions.aclose()
    assert time.monotonic() - t0 < 5
