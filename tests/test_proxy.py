"""The recording proxy's server and protocol: request validation and refusals, API keys, sessions of
`agentrl proxy`, streamed replies, ``usage``, agent commands. Agents as whole episodes are in
tests/test_proxy_episodes.py; agent frameworks (Agents SDK, LangChain) and the example in
tests/test_proxy_agents.py. The helpers here (tool schemas, scripted engines) serve all three files.
"""

from __future__ import annotations

import asyncio
import json
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest

from agentrl.chat import ChatTemplate
from agentrl.config import RolloutConfig
from agentrl.engines.base import Engine, GenerateOutput
from agentrl.proxy import AgentError
from agentrl.rollout.episode import EpisodeContext

REPO = Path(__file__).resolve().parents[1]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "calculator",
            "description": "Evaluate an arithmetic expression.",
            "parameters": {
                "type": "object",
                "properties": {"expression": {"type": "string"}},
                "required": ["expression"],
            },
        },
    }
]

MUL = [
    {
        "type": "function",
        "function": {
            "name": "multiply",
            "description": "Multiply two integers.",
            "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}},
        },
    }
]


def _client(base_url: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=60)


class ScriptedEngine(Engine):
    """A scripted policy served as the engine (the tiny model cannot be made to write chosen tool calls):
    a multiply call first, then an answer quoting the tool's result as the prompt shows it."""

    CALL = 'Let me multiply.\n<tool_call>\n{"name": "multiply", "arguments": {"a": 6, "b": 7}}\n</tool_call>'

    def __init__(self, tokenizer):
        self.tok, self.requests, self.outputs, self.texts = tokenizer, [], [], []

    async def generate(self, input_ids, sampling_params, *, key=None):
        results = re.findall(r"<tool_response>\n(.*?)\n</tool_response>", self.tok.decode(input_ids), re.S)
        text = f"The answer is {results[-1]}." if results else self.CALL
        ids = self.tok.encode(text, add_special_tokens=False) + [self.tok.eos_token_id]
        self.texts.append(text)
        self.requests.append(list(input_ids))
        self.outputs.append(ids)
        return GenerateOutput(ids, [-0.25] * len(ids), "stop", self.tok.eos_token_id)

    async def health(self):
        return True


class TextEngine(Engine):
    """Answers every turn with the same short text."""

    def __init__(self, tokenizer):
        self.tok = tokenizer

    async def generate(self, input_ids, sampling_params, *, key=None):
        ids = self.tok.encode("Fine.", add_special_tokens=False) + [self.tok.eos_token_id]
        return GenerateOutput(ids, [-0.5] * len(ids), "stop", self.tok.eos_token_id)

    async def health(self):
        return True


def _recorder(tokenizer, engine, **config):
    import io

    from agentrl.proxy.external import Recorder

    ctx = EpisodeContext(engine=engine, template=ChatTemplate(tokenizer), config=RolloutConfig(**config))
    return Recorder(ctx, io.StringIO(), idle_timeout=30.0)


def _alive(pid: int) -> bool:
    """A process that still runs (a zombie awaiting its reaper does not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (FileNotFoundError, ProcessLookupError):
        return False


def test_refusals_name_the_parameter():
    from pydantic import ValidationError

    from agentrl.proxy import ChatRequest, validation_message

    for body, field in (
        ({"n": 3}, "n=3 is not supported"),
        ({"stream_options": {"include_usage": True}}, "stream_options is only allowed with stream: true"),
        ({"stream": True, "stream_options": {"include_obfuscation": True}}, "stream_options.include_obfuscation"),
        ({"stream": True, "stream_options": {"include_sizes": True}}, "stream_options.include_sizes"),
        ({"logprobs": True}, "logprobs=True"),
        ({"messages": []}, "messages:"),
        ({"tools": [{"type": "code"}]}, "tools.0.type"),
        ({"temperature": 3}, "temperature"),
    ):
        with pytest.raises(ValidationError) as err:
            ChatRequest.model_validate({"messages": [{"role": "user", "content": "x"}], **body})
        assert field in validation_message(err.value)


def test_stream_options_a_client_sends_by_default_are_accepted():
    """``include_obfuscation: false`` (honoured: no padding) and ``include_usage`` pass; an echoed streamed
    tool call's ``index`` is dropped, so the echo compares equal to the reply it came from."""
    from agentrl.proxy import ChatRequest

    body = ChatRequest.model_validate(
        {
            "messages": [
                {"role": "user", "content": "x"},
                {
                    "role": "assistant",
                    "tool_calls": [{"id": "c1", "index": 0, "function": {"name": "f", "arguments": "{}"}}],
                },
            ],
            "stream": True,
            "stream_options": {"include_usage": True, "include_obfuscation": False},
        }
    )
    assert body.stream_options is not None and body.stream_options.include_usage is True
    assert "index" not in body.messages[1].model_dump()["tool_calls"][0]


def test_echoed_fields_and_unhonoured_parameters():
    from pydantic import ValidationError

    from agentrl.proxy import ChatRequest
    from agentrl.proxy.requests import parse_request

    msgs = [
        {"role": "user", "content": "x"},
        {"role": "assistant", "content": None, "refusal": "I cannot help with that."},
        {"role": "user", "content": "y"},
    ]
    req, messages, _ = parse_request(json.dumps({"messages": msgs, "metadata": {"k": 1}, "store": False}).encode())
    assert messages[1] == {"role": "assistant", "content": "I cannot help with that."}
    assert req.record() == {"metadata": {"k": 1}, "store": False}
    refused = parse_request(json.dumps({"messages": [{"role": "user", "content": "x", "refusal": "no"}]}).encode())
    assert refused.status == 422 and "refusal" in refused.message
    both = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "Sure.", "refusal": "No."}]
    refused = parse_request(json.dumps({"messages": both}).encode())
    assert refused.status == 422 and "both content and a refusal" in refused.message
    with pytest.raises(ValidationError, match="parallel_tool_calls=False is not supported"):
        ChatRequest.model_validate({"messages": msgs[:1], "parallel_tool_calls": False})
    assert ChatRequest.model_validate({"messages": msgs[:1], "parallel_tool_calls": True}).parallel_tool_calls


def proxy_url(proc: subprocess.Popen) -> str:
    """The URL an `agentrl proxy` subprocess announces on its first stdout line."""
    line = proc.stdout.readline()
    assert "POST " in line and "/sessions" in line, proc.stderr.read() if proc.poll() is not None else line
    return line.split("POST ", 1)[1].split("/sessions", 1)[0]


def open_session(url: str, name: str | None = None, key: str | None = "k") -> dict:
    """``POST /sessions``: the new session's id, token, base_url and end_url."""
    headers = {"authorization": f"Bearer {key}"} if key else {}
    r = httpx.post(f"{url}/sessions", json={"name": name} if name else {}, headers=headers)
    assert r.status_code == 200, r.text
    return r.json()


def test_proxy_command_records_external_agents_sessions(tiny_server, tiny_ckpt, tmp_path):
    """`agentrl proxy`: a client opens a session (POST /sessions) and gives its agent the base URL it gets back (or
    the token in a header); each session's samples are written when it ends (POST its end_url with a reward, or at
    shutdown: truncated)."""
    out = tmp_path / "proxy.jsonl"
    cmd = [sys.executable, "-m", "agentrl", "proxy", "--engine-url", tiny_server, "--hf-checkpoint", str(tiny_ckpt)]
    cmd += ["--port", "0", "--output", str(out), "--rollout-max-turn-len", "64", "--api-key", "k"]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        url = proxy_url(proc)
        opened = {sid: open_session(url, sid) for sid in ("alpha", "beta", "hdr")}
        assert {o["session"] for o in opened.values()} == set(opened)
        assert all(o["base_url"] == f"{url}/s/{o['token']}/v1" and o["token"] not in opened for o in opened.values())
        for sid in ("alpha", "beta", "hdr"):  # hdr sends its token in the X-Agentrl-Session header instead
            client = openai.OpenAI(
                base_url=opened[sid]["base_url"] if sid != "hdr" else f"{url}/v1",
                api_key="k",
                max_retries=0,
                default_headers={"X-Agentrl-Session": opened[sid]["token"]} if sid == "hdr" else None,
            )
            msgs: list = [{"role": "user", "content": f"hello from {sid}"}]
            for _ in range(2):
                msgs.append(client.chat.completions.create(model="m", messages=msgs).choices[0].message)
                msgs.append({"role": "user", "content": "more"})
        with pytest.raises(openai.BadRequestError, match="X-Agentrl-Session"):  # no session named at all
            openai.OpenAI(base_url=f"{url}/v1", api_key="k", max_retries=0).chat.completions.create(
                model="m", messages=msgs
            )
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=opened["beta"]["base_url"], api_key="wrong", max_retries=0).chat.completions.create(
                model="m", messages=msgs
            )
        end = opened["alpha"]["end_url"]
        assert httpx.post(end, json={"reward": 0.5}).status_code == 401  # the key, on every route
        key = {"authorization": "Bearer k"}
        assert httpx.post(end, json={"reward": 0.5}, headers=key).json() == {"ended": "alpha"}
        deadline = time.monotonic() + 30
        while not (out.exists() and out.read_text().strip()) and time.monotonic() < deadline:
            time.sleep(0.1)
        with pytest.raises(openai.ConflictError):  # alpha has ended: its token reaches nothing any more
            openai.OpenAI(base_url=opened["alpha"]["base_url"], api_key="k", max_retries=0).chat.completions.create(
                model="m", messages=msgs
            )
        r = httpx.post(f"{url}/sessions", json={"name": "alpha"}, headers=key)  # nor is its name taken again
        assert r.status_code == 409 and "name" in r.json()["error"]["message"], r.text
        proc.send_signal(signal.SIGINT)  # beta is still open: written as truncated on shutdown
        assert proc.wait(timeout=60) == 0, proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
    rows = {r["metadata"]["task"]["session"]: r for r in map(json.loads, out.read_text().splitlines())}
    assert set(rows) == {"alpha", "beta", "hdr"}
    assert rows["alpha"]["status"] == "completed" and rows["alpha"]["reward"] == 0.5
    assert rows["beta"]["status"] == rows["hdr"]["status"] == "truncated" and rows["beta"]["reward"] == 0.0
    for r in rows.values():
        assert r["metadata"]["num_turns"] == 2 and r["prompt"][0]["content"].startswith("hello from")
        assert len(r["loss_mask"]) == len(r["rollout_log_probs"]) == r["response_length"] > 0


async def test_an_agent_command_returns_when_it_exits_and_leaves_nothing_running():
    """The agent starts two helpers (one keeps the agent's stdout open, one is detached from it) and exits:
    run_command returns at once with its output, and both helpers are killed with its process group."""
    from agentrl.proxy import run_command

    code = (
        "import subprocess, sys\n"
        "a = subprocess.Popen(['sleep', '300'])\n"  # inherits stdout: a pipe reader would wait 300 s
        "b = subprocess.Popen(['sleep', '300'], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)\n"
        "print(a.pid, b.pid, 'done')\n"
    )
    t0 = time.monotonic()
    async with asyncio.timeout(20):
        out = await run_command([sys.executable, "-c", code], "http://127.0.0.1:9/v1", {"prompt": "x"})
    assert time.monotonic() - t0 < 10 and out.endswith("done"), out
    pids = [int(x) for x in out.split()[:2]]
    for _ in range(50):
        if not any(map(_alive, pids)):
            break
        await asyncio.sleep(0.1)
    assert not any(map(_alive, pids)), [p for p in pids if _alive(p)]
    with pytest.raises(AgentError, match="status 3: oops"):  # a failure quotes the end of stderr
        await run_command(
            [
                sys.executable,
                "-c",
                "import sys; print('oops', file=sys.stderr); sys.exit(3)",
            ],
            "http://127.0.0.1:9/v1",
            {},
        )


async def test_every_route_checks_the_key_and_end_bodies_are_validated():
    from agentrl.proxy import ProxyServer

    server = ProxyServer(api_key="secret")
    await server.start()
    own, external = server.open("own"), server.open("ext", external=True)
    o, x = own.token, external.token
    key = {"authorization": "Bearer secret"}
    try:
        async with httpx.AsyncClient(base_url=server.url) as http:
            for method, path in (
                ("POST", f"/s/{x}/end"),
                ("GET", f"/s/{x}/v1/models"),
                ("POST", f"/s/{x}/v1/chat/completions"),
                ("POST", "/v1/chat/completions"),
            ):
                r = await http.request(method, path, json={"reward": 1.0})
                assert r.status_code == 401, (path, r.text)
            assert (await http.get(f"/s/{x}/v1/models", headers=key)).json()["data"][0]["id"] == "agentrl-policy"
            assert (await http.get("/health")).json() == {"status": "ok"}  # the one route open without the key
            for body, field in (
                (b'{"reward": NaN}', "reward"),
                (b'{"reward": Infinity}', "reward"),
                (b'{"reward": true}', "reward"),
                (b'{"reward": "1"}', "reward"),
                (b'{"rewardz": 1}', "rewardz"),
            ):
                r = await http.post(f"/s/{x}/end", content=body, headers=key)
                assert r.status_code == 422 and field in r.json()["error"]["message"], (body, r.text)
            r = await http.post(f"/s/{o}/end", json={"reward": 1.0}, headers=key)  # scored by its env's reward()
            assert r.status_code == 422 and "reward()" in r.json()["error"]["message"], r.text
            assert not own.ended.done() and not external.ended.done()
            r = await http.post(f"/s/{o}/end", json={"output": "done"}, headers=key)
            assert r.status_code == 200 and own.ended.result().output == "done"
            r = await http.post(f"/s/{x}/end", json={"reward": 0.5, "output": [1, 2]}, headers=key)
            assert r.json() == {"ended": "ext"} and external.ended.result().reward == 0.5
    finally:
        await server.stop()


async def test_agentrl_proxy_sessions_answer_like_openai_and_honour_max_turns(tiny_tokenizer):
    """An `agentrl proxy` session: a request without a session's token opens nothing, an invalid first body
    changes nothing; every reply carries usage (the request's rendered prompt, the turn's sampled tokens),
    system_fingerprint and refusal as OpenAI's do; --max-turns 40 allows 40 turns (ExternalSession caps
    nothing itself); /end writes the sample."""
    rec = _recorder(tiny_tokenizer, TextEngine(tiny_tokenizer), max_turns=40)
    await rec.server.start()
    try:
        async with httpx.AsyncClient(base_url=rec.server.url, timeout=30) as http:
            r = await http.post("/s/a/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}]})
            assert r.status_code == 404 and not rec.server.sessions and not rec.episodes
            a = (await http.post("/sessions", json={"name": "a"})).json()
            chat = f"/s/{a['token']}/v1/chat/completions"
            r = await http.post(chat, json={"messages": [{"role": "robot", "content": "x"}]})
            assert r.status_code == 422 and rec.server.sessions["a"].requests == 0
            msgs: list = [{"role": "user", "content": "hello"}]
            for turn in range(40):
                r = await http.post(chat, json={"model": "m", "messages": msgs, "user": "u1"})
                assert r.status_code == 200, (turn, r.text)
                body = r.json()
                assert body["system_fingerprint"] is None and body["choices"][0]["message"]["refusal"] is None
                n_prompt = len(rec.ctx.template.prompt(msgs, [])[1])
                n_out = len(tiny_tokenizer.encode("Fine.", add_special_tokens=False)) + 1
                assert body["usage"] == {
                    "prompt_tokens": n_prompt,
                    "completion_tokens": n_out,
                    "total_tokens": n_prompt + n_out,
                }
                msgs += [body["choices"][0]["message"], {"role": "user", "content": "more"}]
            assert (await http.post(a["end_url"], json={"reward": 0.25})).json() == {"ended": "a"}
            await asyncio.gather(*rec.episodes)
    finally:
        await rec.server.stop()
    (row,) = map(json.loads, rec.out.getvalue().splitlines())
    assert row["status"] == "completed" and row["reward"] == 0.25 and row["metadata"]["num_turns"] == 40
    assert row["metadata"]["env_infos"][0]["request"] == {"model": "m", "user": "u1"}


async def test_an_episode_that_fails_before_reset_answers_its_agent(tiny_tokenizer):
    """(The command refuses such configs up front; a failure before reset() must still not leave the agent's
    request hanging and its session busy.)"""
    rec = _recorder(tiny_tokenizer, TextEngine(tiny_tokenizer), tool_parser="bogus")
    await rec.server.start()
    try:
        async with httpx.AsyncClient(base_url=rec.server.url, timeout=30) as http, asyncio.timeout(20):
            b = (await http.post("/sessions", json={"name": "b"})).json()
            r = await http.post(
                b["base_url"] + "/chat/completions", json={"messages": [{"role": "user", "content": "x"}]}
            )
            assert r.status_code == 409 and "bogus" in r.json()["error"]["message"], r.text
            assert "b" not in rec.server.sessions
    finally:
        await rec.server.stop()
    assert json.loads(rec.out.getvalue())["status"] == "failed"


def test_proxy_command_refuses_flags_it_would_ignore_and_bad_configs_before_serving(tiny_ckpt, capsys):
    from agentrl.cli import build_parser, main
    from agentrl.proxy.external import ExternalSession

    parser = build_parser()
    for flag in (
        ["--n-samples-per-prompt", "2"],
        ["--input-key", "q"],
        ["--label-key", "a"],
        ["--rollout-concurrency", "4"],
        ["--sandbox", "docker"],
        ["--sandbox-image", "x"],
        ["--role-engine-url", "x=http://127.0.0.1:9"],
        ["--apply-chat-template"],
        ["--rollout-seed", "1"],
        ["--env-step-timeout", "5"],
    ):
        with pytest.raises(SystemExit) as exc:
            parser.parse_args(["proxy", *flag])
        assert exc.value.code == 2, flag
    from agentrl.config import RolloutConfig as RC
    from agentrl.proxy.command import PROXY_FIELDS

    for argv, turns in ((["proxy", "--max-turns", "40"], 40), (["proxy"], 32)):
        args = parser.parse_args(argv)
        assert RC(**{k: getattr(args, k) for k in PROXY_FIELDS}).turn_limit(ExternalSession.max_turns) == turns
    base = ["proxy", "--hf-checkpoint", str(tiny_ckpt), "--engine-url", "http://127.0.0.1:9", "--port", "0"]
    t0 = time.monotonic()
    assert main([*base, "--tool-parser", "bogus"]) == 2
    assert main([*base, "--history-rewrite-path", "no_such_module:fn"]) == 2
    err = capsys.readouterr().err
    assert "unknown tool-call parser 'bogus'" in err and "--history-rewrite-path no_such_module:fn" in err, err
    assert time.monotonic() - t0 < 10  # refused before any engine or server


USAGE: dict[str, list] = {}  # task id -> per request: (the messages sent, the reply's message, its usage)


async def _streamed(client: openai.AsyncOpenAI, **kwargs) -> tuple[dict, dict | None, str]:
    """A streamed request as a client joins it: the message, the usage chunk's usage, the finish reason."""
    text, calls, usage, finish = "", {}, None, ""
    async for chunk in await client.chat.completions.create(stream=True, **kwargs):
        if chunk.usage is not None:
            assert not chunk.choices  # the usage chunk has no choices (OpenAI's include_usage)
            usage = chunk.usage.model_dump(exclude_none=True)
        for choice in chunk.choices:
            text += choice.delta.content or ""
            for tc in choice.delta.tool_calls or []:
                calls.setdefault(tc.index, tc.model_dump(exclude_none=True, exclude={"index"}))
            finish = choice.finish_reason or finish
    message = {"role": "assistant", "content": text or None}
    if calls:
        message["tool_calls"] = [calls[i] for i in sorted(calls)]
    return message, usage, finish


async def usage_agent(base_url: str, task: dict) -> str:
    """A tool loop that keeps every reply's usage; ``stream`` asks for streamed replies with usage."""
    client = _client(base_url)
    msgs: list = [{"role": "user", "content": "What is 6 * 7?"}]
    USAGE[task["id"]] = seen = []
    for _ in range(3):
        kwargs = {"model": "m", "messages": list(msgs), "tools": MUL}
        if task["stream"]:
            msg, usage, finish = await _streamed(client, stream_options={"include_usage": True}, **kwargs)
        else:
            r = await client.chat.completions.create(**kwargs)
            msg, usage = r.choices[0].message.model_dump(exclude_none=True), r.usage.model_dump(exclude_none=True)
            finish = r.choices[0].finish_reason
        seen.append((list(msgs), msg, usage))
        msgs.append(msg)
        if finish != "tool_calls":
            break
        msgs += [{"role": "tool", "tool_call_id": tc["id"], "content": "42"} for tc in msg["tool_calls"]]
    await client.close()
    return msg["content"]


@pytest.mark.parametrize("stream", [False, True])
async def test_every_reply_carries_usage_as_the_engine_saw_the_turn(tiny_tokenizer, stream):
    """usage.prompt_tokens is what the engine read (the ledger: the request rendered by the chat
    template), completion_tokens what it sampled, stop token included; a streamed reply (stream_options
    include_usage) joins into the same message, and its echo still extends the episode (one segment)."""
    from agentrl.proxy import ProxyEnv
    from agentrl.rollout.generate import generate_rollout

    env = ProxyEnv.define("Usage", agent=usage_agent, reward=lambda t, m, o: float(o == "The answer is 42."))
    engine = ScriptedEngine(tiny_tokenizer)
    ctx = EpisodeContext(engine=engine, template=ChatTemplate(tiny_tokenizer), config=RolloutConfig(max_turns=4))
    samples, _ = await generate_rollout(ctx, env, [{"prompt": "", "id": f"u{stream}", "stream": stream}])
    (s,) = samples
    assert s.status.value == "completed" and s.reward == 1.0, s.metadata.get("error")
    assert "segment" not in s.metadata and not any(i.get("rewritten") for i in s.metadata["env_infos"])
    seen = USAGE[f"u{stream}"]
    assert len(seen) == 2 and seen[0][1]["tool_calls"][0]["function"]["name"] == "multiply"
    first = ctx.template.render(seen[0][0], MUL, add_generation_prompt=True)  # the tokenizer's template + tools
    assert seen[0][2]["prompt_tokens"] == len(tiny_tokenizer(first, add_special_tokens=False).input_ids)
    assert engine.texts == [ScriptedEngine.CALL, "The answer is 42."]
    for (sent, _, usage), read, text in zip(seen, engine.requests, engine.texts):
        n_out = len(tiny_tokenizer.encode(text, add_special_tokens=False)) + 1  # + the stop token
        assert usage == {"prompt_tokens": len(read), "completion_tokens": n_out, "total_tokens": len(read) + n_out}
        assert usage["prompt_tokens"] == len(ctx.template.prompt(sent, MUL)[1])  # the request, rendered
    assert seen[1][2]["prompt_tokens"] == s.prompt_length + s.turn_spans[0][1] + (s.env_spans[0][1] - s.env_spans[0][0])


async def test_a_streamed_refusal_is_a_plain_error_and_stream_options_need_stream():
    """A refused streamed request gets OpenAI's JSON error (status and message), not an event stream."""
    from agentrl.proxy import ProxyServer

    server = ProxyServer()
    await server.start()
    session = server.open("s")
    try:
        client = _client(server.base_url(session))
        with pytest.raises(openai.UnprocessableEntityError, match="stream_options is only allowed"):
            await client.chat.completions.create(
                model="m", messages=[{"role": "user", "content": "x"}], stream_options={"include_usage": True}
            )
        with pytest.raises(openai.NotFoundError, match="no open session"):
            await _client(f"{server.url}/s/nobody/v1").chat.completions.create(
                model="m", messages=[{"role": "user", "content": "x"}], stream=True
            )
        await client.close()
    finally:
        await server.stop()
