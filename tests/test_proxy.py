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
from agentrl.proxy import ProxyEnv
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
        assert httpx.post(f"{url}/s/alpha/end", json={"reward": 0.5}).json() == {"ended": "alpha"}
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
