"""The recording proxy: unmodified ``openai``-client agents run as agentrl episodes, recorded token-exact.

Everything is real: the embedded engine serving the tiny model over HTTP, the proxy's FastAPI server
on loopback, the ``openai`` package's async client (in-process agents) and agent programs started as
processes, and an OpenAI Agents SDK agent. The tiny model writes text turns; tool calls are
exercised with scripted policies (the model cannot write them yet): played through the same env verbs,
or served as an engine to the episode loop.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest
import torch

from agentrl.chat import ChatTemplate
from agentrl.config import RolloutConfig
from agentrl.engines.base import Engine, GenerateOutput
from agentrl.engines.http import SGLangEngine
from agentrl.proxy import AgentError, ProxyEnv
from agentrl.rollout.episode import EpisodeContext
from agentrl.rollout.generate import generate_rollout
from agentrl.types import Status

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
SEEN: dict[str, list] = {}  # task id -> the messages the agent last sent, with the final reply


def _client(base_url: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=60)


async def calculator_agent(base_url: str, task: dict) -> str:
    """A plain tool loop: call the model; run its calculator calls; else ask it to go on; 3 turns."""
    client = _client(base_url)
    messages: list = [
        {"role": "system", "content": "Use the calculator."},
        {"role": "user", "content": task["prompt"]},
    ]
    text = ""
    for turn in range(task.get("turns", 3)):
        r = await client.chat.completions.create(model="policy", messages=messages, tools=TOOLS, temperature=0.7)
        msg = r.choices[0].message
        messages.append(msg)  # the SDK's own object, as agents do
        text = msg.content or ""
        if turn == task.get("turns", 3) - 1:
            break
        if msg.tool_calls:
            for tc in msg.tool_calls:
                expr = json.loads(tc.function.arguments)["expression"]
                messages.append({"role": "tool", "tool_call_id": tc.id, "content": str(eval(expr))})
        elif turn == task.get("rewrite_at"):  # compact the history: start over with a summary
            messages = messages[:2] + [{"role": "user", "content": "Summary: you said something. Answer now."}]
        else:
            messages.append({"role": "user", "content": "Go on."})
    SEEN[task["id"]] = [m if isinstance(m, dict) else m.model_dump(exclude_none=True) for m in messages]
    await client.close()
    return text


def calc_reward(task: dict, messages: list, output: object) -> float:
    return 1.0 if str(output).strip() == str(task.get("label")) else 0.1


CalcAgent = ProxyEnv.define("CalcAgent", agent=calculator_agent, reward=calc_reward, max_turns=8)


def _ctx(url: str, tokenizer, **cfg) -> EpisodeContext:
    config = RolloutConfig(**{"rollout_max_turn_len": 200, "max_turns": 8, "rollout_temperature": 1.0, **cfg})
    return EpisodeContext(engine=SGLangEngine(url), template=ChatTemplate(tokenizer), config=config)


def _rescore_diff(model, s) -> float:
    with torch.no_grad():
        logits = model(torch.tensor([s.tokens])).logits[0].float()
    lp = torch.log_softmax(logits, dim=-1)[:-1].gather(1, torch.tensor(s.tokens[1:]).unsqueeze(1)).squeeze(1)
    resp = lp[s.prompt_length - 1 :]
    mask = torch.tensor(s.loss_mask, dtype=torch.bool)
    assert mask.sum() > 0
    return (resp[mask] - torch.tensor(s.rollout_log_probs)[mask]).abs().max().item()


@pytest.fixture(scope="module")
def tiny_model(tiny_ckpt):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_ckpt, dtype=torch.float32).eval()


async def test_openai_tool_loops_are_recorded_token_exact_and_isolated(tiny_server, tiny_tokenizer, tiny_model):
    """Concurrent sessions of an openai-client loop: each one sample, exact, re-scoring within 1e-4."""
    ctx = _ctx(tiny_server, tiny_tokenizer)
    tasks = [{"prompt": f"Question {i}: what is {i} * 7?", "label": str(7 * i), "id": f"t{i}"} for i in range(4)]
    samples, summary = await generate_rollout(ctx, CalcAgent, tasks)
    await ctx.engine.close()
    assert summary.samples == 4 and summary.status == {"completed": 4}, [s.metadata.get("error") for s in samples]
    for s in samples:
        s.validate()
        task = s.metadata["task"]
        assert "segment" not in s.metadata and s.metadata["num_turns"] == 3 and len(s.turn_spans) == 3
        # isolation: the prompt is this task's first request, and the conversation is its own
        assert s.prompt[1]["content"] == tasks[s.index]["prompt"] and task["id"] == tasks[s.index]["id"]
        final = SEEN[task["id"]]
        assert sum(m["role"] == "assistant" for m in final) == 3
        # the tokens are the conversation as the agent saw it, rendered by the template
        text = ctx.template.decode(s.tokens)
        assert ctx.template.render(final, TOOLS, add_generation_prompt=False).startswith(text)
        assert _rescore_diff(tiny_model, s) < 1e-4
        assert all(lp == 0.0 for lp, m in zip(s.rollout_log_probs, s.loss_mask) if m == 0)
        assert s.reward == pytest.approx(1.0 if final[-1]["content"].strip() == task.get("label") else 0.1)
        assert s.metadata["env_infos"][0]["request"] == {"model": "policy", "temperature": 0.7}


async def test_tool_calls_reach_the_agent_and_its_echo_extends_the_conversation():
    """A scripted policy writes Hermes tool calls; the example's agent program (plain sync `openai`
    client, its own process) gets them as `tool_calls`, runs its calculator and sends the results back,
    which the proxy recognises as an extension of the conversation (no rewrite)."""
    from agentrl.rollout.scripted import play

    sys.path.insert(0, str(REPO / "examples/openai_agent"))
    try:
        from env import CalculatorAgent  # type: ignore[import-not-found]
    finally:
        sys.path.pop(0)

    def policy(messages, task):
        if messages[-1]["role"] == "tool":
            return f"The answer is {messages[-1]['content']}."
        expr = task["prompt"].removeprefix("What is ").rstrip("?")
        return f'Let me compute.\n<tool_call>\n{{"name": "calculator", "arguments": {{"expression": "{expr}"}}}}\n</tool_call>'

    tasks = [{"prompt": "What is 6 * 7?", "label": "42"}, {"prompt": "What is (17 + 4) * 3?", "label": "63"}]
    results = await play(CalculatorAgent, policy, tasks)
    for r, task in zip(results, tasks):
        assert r.error is None and r.terminated and r.rewrites == 0, r.error
        assert r.reward == 1.0 and r.turns == 2
        tool = [m for m in r.messages if m["role"] == "tool"]
        assert len(tool) == 1 and tool[0]["content"] == task["label"]
        assert r.tools[0]["function"]["name"] == "calculator"


class ScriptedEngine(Engine):
    """A scripted policy served as the engine (the tiny model cannot be made to write chosen tool calls):
    a multiply call first, then an answer quoting the tool's result as the prompt shows it."""

    def __init__(self, tokenizer):
        self.tok, self.requests, self.outputs = tokenizer, [], []

    async def generate(self, input_ids, sampling_params, *, key=None):
        results = re.findall(r"<tool_response>\n(.*?)\n</tool_response>", self.tok.decode(input_ids), re.S)
        call = '<tool_call>\n{"name": "multiply", "arguments": {"a": 6, "b": 7}}\n</tool_call>'
        text = f"The answer is {results[-1]}." if results else f"Let me multiply.\n{call}"
        ids = self.tok.encode(text, add_special_tokens=False) + [self.tok.eos_token_id]
        self.requests.append(list(input_ids))
        self.outputs.append(ids)
        return GenerateOutput(ids, [-0.25] * len(ids), "stop", self.tok.eos_token_id)

    async def health(self):
        return True


def _agents_sdk():
    """The OpenAI Agents SDK; skipped where it is not installed (CI: AGENTRL_REQUIRE_AGENTS_SDK=1 fails instead)."""
    try:
        import agents
    except ImportError as exc:
        if os.environ.get("AGENTRL_REQUIRE_AGENTS_SDK") == "1":
            pytest.fail(f"openai-agents is not installed ({exc}) and AGENTRL_REQUIRE_AGENTS_SDK=1")
        pytest.skip(f"openai-agents is not installed ({exc}): pip install openai-agents==0.24.0")
    return agents


async def agents_sdk_agent(base_url: str, task: dict) -> str:
    """An unmodified Agents SDK agent: Agent + function_tool, its Chat Completions model on the session."""
    from agents import Agent, OpenAIChatCompletionsModel, Runner, function_tool, set_tracing_disabled

    set_tracing_disabled(True)  # no trace export: nothing leaves loopback

    @function_tool
    def multiply(a: int, b: int) -> int:
        """Multiply two integers."""
        return a * b

    client = openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=60)
    model = OpenAIChatCompletionsModel(model="policy", openai_client=client)
    agent = Agent(name="calculator", instructions="Use the tools.", tools=[multiply], model=model)
    result = await Runner.run(agent, task["prompt"], max_turns=4)
    await client.close()
    return str(result.final_output)


SDKAgent = ProxyEnv.define(
    "SDKAgent", agent=agents_sdk_agent, reward=lambda t, m, o: float(o == f"The answer is {t['label']}.")
)


async def test_an_openai_agents_sdk_agent_is_recorded_token_exact(tiny_tokenizer):
    """The SDK parses the reply's tool_calls, runs its function tool and sends the result back as an
    extension of the conversation: one sample, every engine request a prefix of its tokens, every turn
    the engine's ids verbatim, the tool's result in the ledger and in the agent's final output."""
    _agents_sdk()
    engine = ScriptedEngine(tiny_tokenizer)
    ctx = EpisodeContext(engine=engine, template=ChatTemplate(tiny_tokenizer), config=RolloutConfig(max_turns=4))
    samples, _ = await generate_rollout(ctx, SDKAgent, [{"prompt": "What is 6 * 7?", "label": "42"}])
    (s,) = samples
    assert s.status == Status.COMPLETED and s.reward == 1.0, s.metadata.get("error")
    s.validate()
    assert s.metadata["num_turns"] == 2 and "segment" not in s.metadata
    assert not any(i.get("rewritten") for i in s.metadata["env_infos"])
    assert s.prompt == [{"role": "system", "content": "Use the tools."}, {"role": "user", "content": "What is 6 * 7?"}]
    for req in engine.requests:  # token in: each request is a prefix of the sample
        assert s.tokens[: len(req)] == req
    turns = [s.tokens[s.prompt_length + a : s.prompt_length + b] for a, b in s.turn_spans]
    assert turns == engine.outputs
    assert all(lp == -0.25 for a, b in s.turn_spans for lp in s.rollout_log_probs[a:b])
    text = ctx.template.decode(s.tokens)
    assert '"name": "multiply"' in text.split("<|im_start|>user")[0]  # the SDK's tool schema, rendered
    assert "<tool_response>\n42\n</tool_response>" in text
    assert s.metadata["env_infos"][-1]["output"] == "The answer is 42."


async def test_history_rewrite_starts_a_new_segment(tiny_server, tiny_tokenizer, tiny_model):
    ctx = _ctx(tiny_server, tiny_tokenizer)
    tasks = [{"prompt": "What is 3 * 7?", "label": "21", "id": "rw", "turns": 3, "rewrite_at": 1}]
    samples, summary = await generate_rollout(ctx, CalcAgent, tasks)
    await ctx.engine.close()
    assert [s.status for s in samples] == [Status.COMPLETED] * 2, [s.metadata.get("error") for s in samples]
    first, second = samples
    assert first.metadata["episode_id"] == second.metadata["episode_id"]
    assert [s.metadata["segment"] for s in samples] == [0, 1] and second.metadata["num_segments"] == 2
    assert len(first.turn_spans) == 2 and len(second.turn_spans) == 1
    assert second.prompt[-1]["content"].startswith("Summary:") and len(second.prompt) == 3
    assert first.reward == second.reward  # the episode's outcome, on every segment
    for s in samples:
        s.validate()
        assert _rescore_diff(tiny_model, s) < 1e-4
    assert second.tokens[: second.prompt_length] == ctx.template.prompt(second.prompt, TOOLS)[1]


async def length_agent(base_url: str, task: dict) -> str:
    """Talks until a reply comes back cut off (finish_reason "length"), then asks once more."""
    client = _client(base_url)
    msgs: list = [{"role": "user", "content": task["prompt"]}]
    for _ in range(8):
        r = await client.chat.completions.create(model="m", messages=msgs)
        msgs.append(r.choices[0].message)
        if r.choices[0].finish_reason == "length":
            break
        msgs.append({"role": "user", "content": "Go on."})
    SEEN[task["id"]] = [m if isinstance(m, dict) else m.model_dump(exclude_none=True) for m in msgs]
    try:
        await client.chat.completions.create(model="m", messages=[*msgs, {"role": "user", "content": "And?"}])
    except openai.APIStatusError as exc:
        SEEN[task["id"] + "/late"] = [exc.status_code, exc.message]
    await client.close()
    return r.choices[0].finish_reason


LengthAgent = ProxyEnv.define("LengthAgent", agent=length_agent, max_turns=8)


async def test_a_reply_cut_off_by_the_length_limit_reaches_the_agent(tiny_server, tiny_tokenizer):
    """2 tokens a turn (the tiny model ends ~1 turn in 5 by then): the turn cut off ends the episode
    (truncated, as for any env), and the agent still gets it as OpenAI sends it, its truncated text with
    finish_reason "length"; a later request of the session is refused, saying why."""
    ctx = _ctx(tiny_server, tiny_tokenizer, rollout_max_turn_len=2)
    samples, _ = await generate_rollout(ctx, LengthAgent, [{"prompt": "Hello", "id": "len"}])
    await ctx.engine.close()
    (s,) = samples
    assert s.status == Status.TRUNCATED and s.status_reason == "response_length", s.metadata
    s.validate()
    seen, (a, b) = SEEN["len"], s.turn_spans[-1]
    assert sum(m["role"] == "assistant" for m in seen) == len(s.turn_spans) == s.metadata["num_turns"]
    assert seen[-1]["content"] == ctx.template.decode(s.tokens[s.prompt_length + a : s.prompt_length + b])
    status, message = SEEN["len/late"]
    assert status == 409 and "length limit" in message, message


async def careful_agent(base_url: str, task: dict) -> str:
    """Sends bad bodies first (each refused naming its field), then a good request that must still work."""
    client = _client(base_url)
    msgs = [{"role": "user", "content": task["prompt"]}]
    refused = []
    for kwargs in ({"n": 2}, {"stream": True}, {"stop": ["x"]}, {"tool_choice": "required", "tools": TOOLS}):
        with pytest.raises(openai.UnprocessableEntityError) as err:
            await client.chat.completions.create(model="m", messages=msgs, **kwargs)
        refused.append(err.value.body["message"])
    async with httpx.AsyncClient() as http:
        bad = await http.post(f"{base_url}/chat/completions", json={"messages": [{"role": "robot", "content": "x"}]})
        typo = await http.post(f"{base_url}/chat/completions", json={"messages": msgs, "temprature": 0.5})
        other = await http.post(base_url.rsplit("/s/", 1)[0] + "/s/nobody/v1/chat/completions", json={"messages": msgs})
    assert bad.status_code == 422 and "messages.0.role" in bad.json()["error"]["message"], bad.text
    assert typo.status_code == 422 and "temprature" in typo.json()["error"]["message"], typo.text
    assert other.status_code == 404  # another session's URL: not this episode's
    r = await client.chat.completions.create(model="m", messages=msgs)
    await client.close()
    assert r.choices[0].finish_reason == "stop"
    return json.dumps(refused)


async def crashing_agent(base_url: str, task: dict) -> str:
    client = _client(base_url)
    await client.chat.completions.create(model="m", messages=[{"role": "user", "content": task["prompt"]}])
    raise RuntimeError("the agent fell over")


async def slow_agent(base_url: str, task: dict) -> str:
    await asyncio.sleep(30)
    return ""


def _agent_by_task(kind: str):
    return {"careful": careful_agent, "crash": crashing_agent, "slow": slow_agent, "ok": calculator_agent}[kind]


async def dispatch_agent(base_url: str, task: dict) -> str:
    return await _agent_by_task(task["kind"])(base_url, task)


Mixed = ProxyEnv.define(
    "Mixed",
    agent=dispatch_agent,
    reward=lambda t, m, o: float(len(json.loads(o))) if t["kind"] == "careful" else 0.5,
    agent_timeout=3.0,
)


async def test_bad_bodies_are_refused_and_crashes_fail_only_their_sample(tiny_server, tiny_tokenizer):
    ctx = _ctx(tiny_server, tiny_tokenizer)
    tasks = [
        {"prompt": "Hello", "kind": "careful", "id": "c"},
        {"prompt": "Hello", "kind": "crash", "id": "x"},
        {"prompt": "Hello", "kind": "slow", "id": "s"},
        {"prompt": "What is 2 * 7?", "label": "14", "kind": "ok", "id": "ok", "turns": 2},
    ]
    samples, summary = await generate_rollout(ctx, Mixed, tasks)
    await ctx.engine.close()
    careful, crash, slow, ok = samples
    assert careful.status == Status.COMPLETED and careful.reward == 4.0, careful.metadata.get("error")
    assert careful.metadata["num_turns"] == 1  # the refused requests left the session as it was
    careful.validate()
    assert crash.status == Status.FAILED and crash.status_reason == "env_error"
    assert "the agent fell over" in crash.metadata["error"]
    assert slow.status == Status.FAILED and "agent_timeout" in slow.metadata["error"]
    assert ok.status == Status.COMPLETED and ok.metadata["num_turns"] == 2


def test_refusals_name_the_parameter():
    from pydantic import ValidationError

    from agentrl.proxy import ChatRequest, validation_message

    for body, field in (
        ({"n": 3}, "n=3 is not supported"),
        ({"stream": True}, "stream=True"),
        ({"logprobs": True}, "logprobs=True"),
        ({"messages": []}, "messages:"),
        ({"tools": [{"type": "code"}]}, "tools.0.type"),
        ({"temperature": 3}, "temperature"),
    ):
        with pytest.raises(ValidationError) as err:
            ChatRequest.model_validate({"messages": [{"role": "user", "content": "x"}], **body})
        assert field in validation_message(err.value)


def test_proxy_command_records_external_agents_sessions(tiny_server, tiny_ckpt, tmp_path):
    """`agentrl proxy`: agents started elsewhere name their session in the URL; each session's samples
    are written when it ends (POST /s/ID/end with a reward, or at shutdown: truncated)."""
    out = tmp_path / "proxy.jsonl"
    cmd = [sys.executable, "-m", "agentrl", "proxy", "--engine-url", tiny_server, "--hf-checkpoint", str(tiny_ckpt)]
    cmd += ["--port", "0", "--output", str(out), "--rollout-max-turn-len", "64", "--api-key", "k"]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        assert "OPENAI_BASE_URL=" in line, proc.stderr.read() if proc.poll() is not None else line
        url = line.split("OPENAI_BASE_URL=", 1)[1].split("/s/<SESSION>", 1)[0]
        for sid in ("alpha", "beta"):
            client = openai.OpenAI(base_url=f"{url}/s/{sid}/v1", api_key="k", max_retries=0)
            msgs: list = [{"role": "user", "content": f"hello from {sid}"}]
            for _ in range(2):
                msgs.append(client.chat.completions.create(model="m", messages=msgs).choices[0].message)
                msgs.append({"role": "user", "content": "more"})
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=f"{url}/s/gamma/v1", api_key="wrong", max_retries=0).chat.completions.create(
                model="m", messages=msgs
            )
        assert httpx.post(f"{url}/s/alpha/end", json={"reward": 0.5}).status_code == 401  # the key, on every route
        key = {"authorization": "Bearer k"}
        assert httpx.post(f"{url}/s/alpha/end", json={"reward": 0.5}, headers=key).json() == {"ended": "alpha"}
        deadline = time.monotonic() + 30
        while not (out.exists() and out.read_text().strip()) and time.monotonic() < deadline:
            time.sleep(0.1)
        with pytest.raises(openai.ConflictError):  # alpha has ended: no new episode under its id
            openai.OpenAI(base_url=f"{url}/s/alpha/v1", api_key="k", max_retries=0).chat.completions.create(
                model="m", messages=msgs
            )
        proc.send_signal(signal.SIGINT)  # beta is still open: written as truncated on shutdown
        assert proc.wait(timeout=60) == 0, proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
    rows = {r["metadata"]["task"]["session"]: r for r in map(json.loads, out.read_text().splitlines())}
    assert set(rows) == {"alpha", "beta"}
    assert rows["alpha"]["status"] == "completed" and rows["alpha"]["reward"] == 0.5
    assert rows["beta"]["status"] == "truncated" and rows["beta"]["reward"] == 0.0
    for r in rows.values():
        assert r["metadata"]["num_turns"] == 2 and r["prompt"][0]["content"].startswith("hello from")
        assert len(r["loss_mask"]) == len(r["rollout_log_probs"]) == r["response_length"] > 0


def test_example_agent_program_runs_through_agentrl_train(tiny_ckpt, tmp_path, ray_local):
    """The bundled example end to end: `agentrl train --env examples/openai_agent/env.py:CalculatorAgent`."""
    from agentrl.cli import main

    save = tmp_path / "run"
    args = ["train", "--env", "examples/openai_agent/env.py:CalculatorAgent"]
    args += ["--prompt-data", "examples/openai_agent/tasks.jsonl", "--hf-checkpoint", str(tiny_ckpt)]
    args += ["--num-rollout", "1", "--rollout-batch-size", "2", "--n-samples-per-prompt", "2"]
    args += ["--global-batch-size", "4", "--rollout-max-turn-len", "16", "--save", str(save)]
    cwd = os.getcwd()
    os.chdir(REPO)
    try:
        assert main(args) == 0
    finally:
        os.chdir(cwd)
    dump = [json.loads(x) for x in open(save / "rollouts" / "rollout_000000.jsonl")]
    assert len(dump) == 4 and all(s["status"] in ("completed", "truncated") for s in dump), dump[0]["metadata"]
    assert all(s["prompt"][1]["content"].startswith("What is") for s in dump)
    assert (save / "iter_0000001" / "model.safetensors").is_file()


# -- the protocol's edges (issue 14 §2 review): each test below failed before its fix ---------------------------

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
GOT: dict[str, list] = {}  # task id -> what the agent received / how it was called


def _alive(pid: int) -> bool:
    """A process that still runs (a zombie awaiting its reaper does not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (FileNotFoundError, ProcessLookupError):
        return False


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


async def slow_tool_agent(base_url: str, task: dict) -> str:
    """Its tool takes longer than --env-step-timeout between two requests."""
    client = _client(base_url)
    msgs: list = [{"role": "user", "content": "What is 6 * 7?"}]
    r = await client.chat.completions.create(model="m", messages=msgs, tools=MUL)
    msgs.append(r.choices[0].message)
    await asyncio.sleep(2.5)  # a build, a test suite, a web fetch
    msgs += [{"role": "tool", "tool_call_id": tc.id, "content": "42"} for tc in r.choices[0].message.tool_calls]
    r = await client.chat.completions.create(model="m", messages=msgs, tools=MUL)
    await client.close()
    return r.choices[0].message.content


def _threaded_reward(task: dict, messages: list, output: object) -> float:
    import threading

    GOT["reward_thread"] = [threading.current_thread() is threading.main_thread()]
    return 1.0


SlowTool = ProxyEnv.define("SlowTool", agent=slow_tool_agent, reward=_threaded_reward, agent_timeout=30.0)


async def test_a_slow_tool_waits_as_long_as_agent_timeout_and_a_sync_reward_runs_off_the_loop(tiny_tokenizer):
    engine = ScriptedEngine(tiny_tokenizer)
    config = RolloutConfig(max_turns=4, env_step_timeout=1.0)
    ctx = EpisodeContext(engine=engine, template=ChatTemplate(tiny_tokenizer), config=config)
    samples, _ = await generate_rollout(ctx, SlowTool, [{"prompt": ""}])
    (s,) = samples
    assert s.status == Status.COMPLETED and s.reward == 1.0, s.metadata.get("error")
    assert SlowTool().step_timeout == 30.0 + 60.0  # agent_timeout, plus time for reward()
    unlimited = type("Unlimited", (SlowTool,), {"agent_timeout": math.inf})
    assert unlimited().step_timeout == math.inf  # not None: the loop would fall back to --env-step-timeout
    assert GOT["reward_thread"] == [False]  # a sync reward() runs in a worker thread


async def test_every_route_checks_the_key_and_end_bodies_are_validated():
    from agentrl.proxy import ProxyServer

    server = ProxyServer(api_key="secret")
    await server.start()
    own, external = server.open("own"), server.open("ext", external=True)
    key = {"authorization": "Bearer secret"}
    try:
        async with httpx.AsyncClient(base_url=server.url) as http:
            for method, path in (
                ("POST", "/s/ext/end"),
                ("GET", "/s/ext/v1/models"),
                ("POST", "/s/ext/v1/chat/completions"),
            ):
                r = await http.request(method, path, json={"reward": 1.0})
                assert r.status_code == 401, (path, r.text)
            assert (await http.get("/s/ext/v1/models", headers=key)).json()["data"][0]["id"] == "agentrl-policy"
            for body, field in (
                (b'{"reward": NaN}', "reward"),
                (b'{"reward": Infinity}', "reward"),
                (b'{"reward": true}', "reward"),
                (b'{"reward": "1"}', "reward"),
                (b'{"rewardz": 1}', "rewardz"),
            ):
                r = await http.post("/s/ext/end", content=body, headers=key)
                assert r.status_code == 422 and field in r.json()["error"]["message"], (body, r.text)
            r = await http.post("/s/own/end", json={"reward": 1.0}, headers=key)  # scored by its env's reward()
            assert r.status_code == 422 and "reward()" in r.json()["error"]["message"], r.text
            assert not own.ended.done() and not external.ended.done()
            r = await http.post("/s/own/end", json={"output": "done"}, headers=key)
            assert r.status_code == 200 and own.ended.result().output == "done"
            r = await http.post("/s/ext/end", json={"reward": 0.5, "output": [1, 2]}, headers=key)
            assert r.json() == {"ended": "ext"} and external.ended.result().reward == 0.5
    finally:
        await server.stop()


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


async def test_agentrl_proxy_sessions_answer_like_openai_and_honour_max_turns(tiny_tokenizer):
    """An `agentrl proxy` session: an invalid first body opens nothing; every reply carries usage (the
    request's rendered prompt, the turn's sampled tokens), system_fingerprint and refusal as OpenAI's do;
    --max-turns 40 allows 40 turns (ExternalSession caps nothing itself); /end writes the sample."""
    rec = _recorder(tiny_tokenizer, TextEngine(tiny_tokenizer), max_turns=40)
    await rec.server.start()
    try:
        async with httpx.AsyncClient(base_url=rec.server.url, timeout=30) as http:
            r = await http.post("/s/a/v1/chat/completions", json={"messages": [{"role": "robot", "content": "x"}]})
            assert r.status_code == 422 and "a" not in rec.server.sessions and not rec.episodes
            msgs: list = [{"role": "user", "content": "hello"}]
            for turn in range(40):
                r = await http.post("/s/a/v1/chat/completions", json={"model": "m", "messages": msgs, "user": "u1"})
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
            assert (await http.post("/s/a/end", json={"reward": 0.25})).json() == {"ended": "a"}
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
            r = await http.post("/s/b/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}]})
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


class Llama3Engine(ScriptedEngine):
    """Writes its call in Llama 3's JSON format (``--tool-parser llama3_json``) after some text."""

    async def generate(self, input_ids, sampling_params, *, key=None):
        done = "<tool_response>" in self.tok.decode(input_ids)
        text = (
            "The answer is 42." if done else 'Let me.<|python_tag|>{"name": "multiply", "parameters": {"a": 6, "b": 7}}'
        )
        ids = self.tok.encode(text, add_special_tokens=False) + [self.tok.eos_token_id]
        return GenerateOutput(ids, [-0.25] * len(ids), "stop", self.tok.eos_token_id)


async def echo_agent(base_url: str, task: dict) -> str:
    """Sends the reply back as a JavaScript agent would: arguments re-serialised compactly, an explicit
    refusal: null."""
    client = _client(base_url)
    msgs: list = [{"role": "user", "content": "What is 6 * 7?"}]
    r = await client.chat.completions.create(model="m", messages=msgs, tools=MUL)
    GOT[task["id"]] = [r.choices[0].message.model_dump()]
    echoed = r.choices[0].message.model_dump()
    for tc in echoed["tool_calls"] or []:
        tc["function"]["arguments"] = json.dumps(json.loads(tc["function"]["arguments"]), separators=(",", ":"))
    msgs.append(echoed)
    msgs += [{"role": "tool", "tool_call_id": tc["id"], "content": "42"} for tc in echoed["tool_calls"] or []]
    r = await client.chat.completions.create(model="m", messages=msgs, tools=MUL)
    await client.close()
    return r.choices[0].message.content


Echo = ProxyEnv.define("Echo", agent=echo_agent, reward=lambda t, m, o: float(o == "The answer is 42."))


@pytest.mark.parametrize("parser", ["hermes", "llama3_json"])
async def test_a_compact_echo_is_one_segment_and_content_is_stripped_by_the_loops_parser(tiny_tokenizer, parser):
    engine = ScriptedEngine(tiny_tokenizer) if parser == "hermes" else Llama3Engine(tiny_tokenizer)
    config = RolloutConfig(max_turns=4, tool_parser=parser)
    ctx = EpisodeContext(engine=engine, template=ChatTemplate(tiny_tokenizer), config=config)
    samples, _ = await generate_rollout(ctx, Echo, [{"prompt": "", "id": parser}])
    (s,) = samples
    assert s.status == Status.COMPLETED and s.reward == 1.0, s.metadata.get("error")
    assert "segment" not in s.metadata and not any(i.get("rewritten") for i in s.metadata["env_infos"])
    (reply,) = GOT[parser]
    assert reply["content"] == ("Let me multiply." if parser == "hermes" else "Let me."), reply
    assert [tc["function"]["name"] for tc in reply["tool_calls"]] == ["multiply"]
    assert reply["refusal"] is None


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
