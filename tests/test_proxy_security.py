"""The recording proxy against hostile clients: sessions only their token reaches (another client cannot write a
turn into one, end it or score it), the cap on open sessions, API keys from a file or the environment (never in
``/proc/PID/cmdline``), bounded bodies, JSON of any depth, and liveness while a many-MiB message is tokenized.
Real servers on loopback (in-process uvicorn, or ``agentrl proxy`` as a subprocess); scripted engines.
"""

from __future__ import annotations

import asyncio
import io
import json
import os
import secrets
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest

from agentrl.chat import ChatTemplate
from agentrl.config import RolloutConfig
from agentrl.engines.base import GenerateOutput
from agentrl.rollout.episode import EpisodeContext
from tests.test_proxy import REPO, TextEngine, _client, open_session, proxy_url

HELLO = [{"role": "user", "content": "hello"}]
DEEP = b"[" * 5000 + b"]" * 5000


def _recorder(tokenizer, **server):
    from agentrl.proxy.external import Recorder

    ctx = EpisodeContext(engine=TextEngine(tokenizer), template=ChatTemplate(tokenizer), config=RolloutConfig())
    return Recorder(ctx, io.StringIO(), idle_timeout=30.0, **server)


async def test_another_client_cannot_write_into_end_or_score_a_session(tiny_tokenizer):
    """Client B knows session alpha's id (it is in the samples) and its own session's token: every request it aims
    at alpha is refused, and alpha's sample is A's conversation and A's reward. The token is in no sample."""
    rec = _recorder(tiny_tokenizer)
    await rec.server.start()
    try:
        async with httpx.AsyncClient(base_url=rec.server.url, timeout=30) as http:
            a = (await http.post("/sessions", json={"name": "alpha"})).json()
            b = (await http.post("/sessions", json={"name": "beta"})).json()
            msgs: list = list(HELLO)
            r = await http.post(f"{a['base_url']}/chat/completions", json={"messages": msgs})
            msgs += [r.json()["choices"][0]["message"], {"role": "user", "content": "more"}]
            guess = secrets.token_urlsafe(32)
            for path, headers in (
                ("/s/alpha/v1/chat/completions", {}),  # the id is not the key
                ("/v1/chat/completions", {"X-Agentrl-Session": "alpha"}),
                (f"/s/{guess}/v1/chat/completions", {}),
                ("/v1/chat/completions", {"X-Agentrl-Session": guess}),
            ):
                body = {"messages": msgs + [{"role": "user", "content": "INJECTED by B"}]}
                r = await http.post(path, json=body, headers=headers)
                assert r.status_code == 404 and "alpha" not in r.text and guess not in r.text, (path, r.text)
            for path in ("/s/alpha/end", f"/s/{guess}/end", f"/s/{b['session']}/end"):
                r = await http.post(path, json={"reward": 1e6})
                assert r.status_code == 404, (path, r.text)
            assert (await http.get("/s/alpha/v1/models")).status_code == 404
            r = await http.post("/v1/chat/completions", json={"messages": msgs})  # no token at all
            assert r.status_code == 400 and "X-Agentrl-Session" in r.text
            assert rec.server.sessions["alpha"].requests == 1 and not rec.server.sessions["alpha"].ended.done()
            r = await http.post(f"{a['base_url']}/chat/completions", json={"messages": msgs})
            assert r.status_code == 200, r.text
            assert (await http.post(a["end_url"], json={"reward": 0.5})).json() == {"ended": "alpha"}
            assert (await http.post(b["end_url"], json={})).json() == {"ended": "beta"}  # B never asked anything
            await asyncio.gather(*rec.episodes)
    finally:
        await rec.server.stop()
    out = rec.out.getvalue()
    (row,) = map(json.loads, out.splitlines())  # beta ended before its first request: nothing written
    assert row["metadata"]["task"]["session"] == "alpha" and row["reward"] == 0.5
    assert row["metadata"]["num_turns"] == 2 and row["prompt"] == HELLO
    assert "INJECTED" not in tiny_tokenizer.decode(row["tokens"])
    assert a["token"] not in out and b["token"] not in out


GIVEN: dict[str, str] = {}  # task id -> the base URL its agent was given


async def token_agent(base_url: str, task: dict) -> str:
    GIVEN[task["id"]] = base_url
    client = _client(base_url)
    r = await client.chat.completions.create(model="m", messages=HELLO)
    await client.close()
    return r.choices[0].message.content or ""


async def test_an_episodes_session_id_is_not_its_key(tiny_tokenizer):
    """A ProxyEnv's agent gets a base URL holding its session's token; the sample names the session by an id that
    reaches nothing."""
    from agentrl.proxy import ProxyEnv, ProxyServer
    from agentrl.rollout.generate import generate_rollout

    env = ProxyEnv.define("TokenAgent", agent=token_agent)
    ctx = EpisodeContext(
        engine=TextEngine(tiny_tokenizer), template=ChatTemplate(tiny_tokenizer), config=RolloutConfig()
    )
    samples, _ = await generate_rollout(ctx, env, [{"prompt": "", "id": "tok"}])
    (s,) = samples
    assert s.status.value == "completed", s.metadata.get("error")
    token = GIVEN["tok"].split("/s/", 1)[1].split("/", 1)[0]
    sid = s.metadata["reset_info"]["session"]
    assert len(token) >= 43 and token != sid and token not in s.to_json()
    server = await ProxyServer.shared()
    live = server.open()  # an open session, to check what reaches one
    async with httpx.AsyncClient(base_url=server.url) as http:
        assert (await http.get(f"/s/{live.id}/v1/models")).status_code == 404
        assert (await http.get(f"/s/{live.token}/v1/models")).status_code == 200
        assert (await http.post("/sessions", json={})).status_code == 404  # an episode's server: no client opens any
    server.drop(live)


async def test_open_sessions_are_capped_and_a_refusal_opens_nothing(tiny_tokenizer):
    from agentrl.proxy import ProxyServer

    with pytest.raises(ValueError, match="--max-sessions"):
        ProxyServer(max_sessions=0)
    rec = _recorder(tiny_tokenizer, max_sessions=2)
    await rec.server.start()
    try:
        async with httpx.AsyncClient(base_url=rec.server.url, timeout=30) as http:
            first = (await http.post("/sessions", json={})).json()
            assert (await http.post("/sessions", json={"name": "second"})).status_code == 200
            for _ in range(3):
                r = await http.post("/sessions", json={"name": "third"})
                assert r.status_code == 429 and "--max-sessions 2" in r.json()["error"]["message"], r.text
            assert sorted(rec.server.sessions) == sorted([first["session"], "second"]) and len(rec.episodes) == 2
            assert (await http.post(first["end_url"], json={})).status_code == 200
            async with asyncio.timeout(30):
                while first["session"] in rec.server.sessions:  # its episode ends, and drops it
                    await asyncio.sleep(0.05)
            assert (await http.post("/sessions", json={"name": "third"})).status_code == 200  # a slot came free
            r = await http.post("/sessions", json={"name": "bad name\n"})
            assert r.status_code == 422 and "name" in r.json()["error"]["message"]
    finally:
        await rec.server.stop()


async def test_a_body_over_the_cap_is_413_and_changes_nothing(tiny_tokenizer):
    rec = _recorder(tiny_tokenizer, max_body_bytes=1 << 20)
    await rec.server.start()
    try:
        async with httpx.AsyncClient(base_url=rec.server.url, timeout=30) as http:
            a = (await http.post("/sessions", json={"name": "a"})).json()
            chat = f"{a['base_url']}/chat/completions"
            big = {"messages": [{"role": "user", "content": "x" * (2 << 20)}]}
            for url in (chat, a["end_url"], "/sessions"):
                r = await http.post(url, json=big)
                assert r.status_code == 413, (url, r.text)
                assert "--max-body-mb" in r.json()["error"]["message"] and "1 MiB" in r.json()["error"]["message"]
            assert rec.server.sessions["a"].requests == 0 and not rec.server.sessions["a"].ended.done()
            assert len(rec.server.sessions) == 1
            assert (await http.post(chat, json={"messages": HELLO})).status_code == 200
    finally:
        await rec.server.stop()


async def test_deep_json_is_400_on_every_post_route(tiny_tokenizer):
    rec = _recorder(tiny_tokenizer)
    await rec.server.start()
    try:
        async with httpx.AsyncClient(base_url=rec.server.url, timeout=30) as http:
            a = (await http.post("/sessions", json={"name": "a"})).json()
            chat, hdr = f"{a['base_url']}/chat/completions", {"X-Agentrl-Session": a["token"]}
            deep_inside = b'{"messages": [{"role": "user", "content": "x"}], "metadata": {"k": ' + DEEP + b"}}"
            for url, body, headers in (
                ("/sessions", DEEP, {}),
                (chat, DEEP, {}),
                ("/v1/chat/completions", DEEP, hdr),
                (a["end_url"], DEEP, {}),
                (chat, deep_inside, {}),
                (a["end_url"], b'{"output": ' + DEEP + b"}", {}),
                ("/sessions", b'{"name": ' + DEEP + b"}", {}),
            ):
                r = await http.post(url, content=body, headers=headers)
                assert r.status_code == 400 and "nested" in r.json()["error"]["message"], (url, body[:60], r.text)
            assert rec.server.sessions["a"].requests == 0 and not rec.server.sessions["a"].ended.done()
            assert list(rec.server.sessions) == ["a"]
            deep_ok: dict = {}  # as deep as is accepted: recorded, rendered into the prompt, answered
            for _ in range(120):
                deep_ok = {"a": deep_ok}
            fn = {"name": "f", "parameters": {"type": "object", "properties": {"x": deep_ok}}}
            body = {"messages": HELLO, "metadata": deep_ok, "tools": [{"type": "function", "function": fn}]}
            r = await http.post(chat, json=body)
            assert r.status_code == 200, r.text
    finally:
        await rec.server.stop()


def _probe(url: str, stop: threading.Event) -> list[tuple[float, int]]:
    """GET /health every 50 ms from another thread until ``stop``: when each answer came, and its status. (The
    gaps between answers, not each request's latency: a thread holding the GIL would also keep this one from
    sending.)"""
    seen = []
    with httpx.Client(timeout=300) as http:
        while not stop.is_set():
            status = http.get(f"{url}/health").status_code
            seen.append((time.monotonic(), status))
            time.sleep(0.05)
    return seen


async def test_the_proxy_answers_while_an_8_mib_message_is_tokenized(tiny_tokenizer):
    """8 MiB of chat text takes seconds to validate, render and tokenize; all of it happens off the event loop
    (the tokenizer without the GIL), so /health is answered throughout. (Blocking is the issue: a timing relation,
    with a wide margin.)"""
    rec = _recorder(tiny_tokenizer)
    await rec.server.start()
    stop = threading.Event()
    try:
        async with httpx.AsyncClient(base_url=rec.server.url, timeout=300) as http:
            a = (await http.post("/sessions", json={"name": "big"})).json()
            text = " ".join(f"w{i % 997}" for i in range((8 << 20) // 4))[: 8 << 20]
            probe = asyncio.create_task(asyncio.to_thread(_probe, rec.server.url, stop))
            await asyncio.sleep(0.5)
            t0 = time.monotonic()
            r = await http.post(
                f"{a['base_url']}/chat/completions", json={"messages": [{"role": "user", "content": text}]}
            )
            took = time.monotonic() - t0
            stop.set()
            seen = await probe
            assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] > 1_000_000, r.text[:300]
    finally:
        stop.set()
        await rec.server.stop()
    assert all(status == 200 for _, status in seen)
    answered = [t0] + [t for t, _ in seen if t0 < t < t0 + took] + [t0 + took]
    worst = max(b - a for a, b in zip(answered, answered[1:]))  # the longest stretch with no answer
    assert worst < took / 4, (len(answered) - 2, worst, took)


def _serve(cmd: list[str], env: dict[str, str]) -> subprocess.Popen:
    return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.mark.parametrize("source", ["environment", "file"])
def test_agentrl_proxy_takes_its_key_from_a_file_or_the_environment(tiny_server, tiny_ckpt, tmp_path, source):
    """The key is never on the command line (/proc/PID/cmdline is readable by every local user); every route but
    /health wants it."""
    from agentrl.proxy.command import API_KEY_ENV

    key = "proxy-" + secrets.token_hex(16)
    env = {k: v for k, v in os.environ.items() if k != API_KEY_ENV}
    cmd = [sys.executable, "-m", "agentrl", "proxy", "--engine-url", tiny_server, "--hf-checkpoint", str(tiny_ckpt)]
    cmd += ["--port", "0", "--output", str(tmp_path / "out.jsonl"), "--rollout-max-turn-len", "256"]
    if source == "environment":
        env[API_KEY_ENV] = key
    else:
        (tmp_path / "key").write_text(key + "\n")
        (tmp_path / "key").chmod(0o600)
        cmd += ["--api-key-file", str(tmp_path / "key")]
    proc = _serve(cmd, env)
    try:
        url = proxy_url(proc)
        assert key not in Path(f"/proc/{proc.pid}/cmdline").read_bytes().decode()
        assert httpx.get(f"{url}/health").json() == {"status": "ok"}
        for headers in ({}, {"authorization": "Bearer wrong"}, {"authorization": f"Bearer {key}x"}):
            assert httpx.post(f"{url}/sessions", json={}, headers=headers).status_code == 401
        opened = open_session(url, "keyed", key=key)
        assert httpx.post(opened["end_url"], json={"reward": 1}).status_code == 401
        client = openai.OpenAI(base_url=opened["base_url"], api_key=key, max_retries=0)
        assert client.chat.completions.create(model="m", messages=HELLO).choices[0].finish_reason in ("stop", "length")
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=opened["base_url"], api_key="wrong", max_retries=0).chat.completions.create(
                model="m", messages=HELLO
            )
        auth = {"authorization": f"Bearer {key}"}
        assert httpx.post(opened["end_url"], json={"reward": 1}, headers=auth).json() == {"ended": "keyed"}
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == 0, proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
    (row,) = map(json.loads, (tmp_path / "out.jsonl").read_text().splitlines())
    assert row["reward"] == 1.0 and row["metadata"]["task"]["session"] == "keyed"


def test_agentrl_proxy_refuses_bad_limits_and_keys_before_serving(tiny_ckpt, tmp_path, capsys):
    from agentrl.cli import main

    base = ["proxy", "--hf-checkpoint", str(tiny_ckpt), "--engine-url", "http://127.0.0.1:9", "--port", "0"]
    (tmp_path / "key").write_text("k\n")
    for flags, words in (  # each returns 2 at once: serving would block here for good
        (["--max-sessions", "0"], "--max-sessions must be at least 1"),
        (["--max-body-mb", "0"], "--max-body-mb must lie in (0, 4096] MiB, got 0.0"),
        (["--max-body-mb", "nan"], "--max-body-mb must be a number of MiB, got nan"),
        (["--api-key", "k", "--api-key-file", str(tmp_path / "key")], "pass the key one way"),
        (["--api-key-file", str(tmp_path / "missing")], "--api-key-file: cannot read"),
    ):
        assert main([*base, *flags]) == 2, flags
        assert words in capsys.readouterr().err, flags


class SurrogateEngine(TextEngine):
    r"""A model that writes a tool call whose argument is the JSON escape of a lone UTF-16 surrogate (``"\ud800"``):
    valid JSON, but no UTF-8 text, so an encoder with ``ensure_ascii=False`` raised on the reply (a 500)."""

    TEXT = '<tool_call>\n{"name": "echo", "arguments": {"s": "a\\ud800b"}}\n</tool_call>'

    async def generate(self, input_ids, sampling_params, *, key=None):
        ids = self.tok.encode(self.TEXT, add_special_tokens=False) + [self.tok.eos_token_id]
        return GenerateOutput(ids, [-0.5] * len(ids), "stop", self.tok.eos_token_id)


@pytest.mark.parametrize("stream", [False, True])
async def test_a_lone_surrogate_the_model_writes_is_answered_not_a_500(tiny_tokenizer, tmp_path, stream):
    """The reply carries the model's argument as the JSON escape ``\\ud800`` (what the model wrote), plain or
    streamed; the client can send that turn back on its next request; the session's sample is recorded."""
    from agentrl.proxy.external import Recorder

    ctx = EpisodeContext(
        engine=SurrogateEngine(tiny_tokenizer), template=ChatTemplate(tiny_tokenizer), config=RolloutConfig()
    )
    path = tmp_path / "samples.jsonl"
    with open(path, "w", encoding="utf-8") as out:
        rec = Recorder(ctx, out, idle_timeout=30.0)
        await rec.server.start()
        try:
            async with httpx.AsyncClient(base_url=rec.server.url, timeout=30) as http:
                s = (await http.post("/sessions", json={})).json()
                r = await http.post(f"{s['base_url']}/chat/completions", json={"messages": HELLO, "stream": stream})
                assert r.status_code == 200, r.text
                if stream:
                    events = [json.loads(x[6:]) for x in r.text.split("\n\n") if x.startswith("data: {")]
                    calls = [tc for e in events for c in e["choices"] for tc in c["delta"].get("tool_calls", [])]
                else:
                    calls = r.json()["choices"][0]["message"]["tool_calls"]
                assert [json.loads(c["function"]["arguments"]) for c in calls] == [{"s": "a\ud800b"}]
                assert "\\ud800" in calls[0]["function"]["arguments"]  # the escape, as the model wrote it
                call = {k: calls[0][k] for k in ("id", "type", "function")}
                msgs = [*HELLO, {"role": "assistant", "content": "", "tool_calls": [call]}]
                msgs.append({"role": "tool", "tool_call_id": call["id"], "content": "ok"})
                r = await http.post(f"{s['base_url']}/chat/completions", json={"messages": msgs})  # echoed back
                assert r.status_code == 200, r.text
                assert (await http.post(s["end_url"], json={"reward": 0.25})).status_code == 200
                await asyncio.gather(*rec.episodes)
        finally:
            await rec.server.stop()
    rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]
    assert rows and rows[-1]["reward"] == 0.25 and rows[0]["response"].startswith(SurrogateEngine.TEXT)
