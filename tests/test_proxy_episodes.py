"""Agents written with the plain ``openai`` client, recorded as episodes token-exact: the tiny model
served over HTTP for text turns, scripted engines for tool calls (the model cannot write them yet);
history rewrites, the length limit, bad bodies, crashes, slow tools and compact echoes.
"""

from __future__ import annotations

import asyncio
import json
import math

import httpx
import openai
import pytest
import torch

from agentrl.chat import ChatTemplate
from agentrl.config import RolloutConfig
from agentrl.engines.base import GenerateOutput
from agentrl.engines.http import SGLangEngine
from agentrl.proxy import ProxyEnv
from agentrl.rollout.episode import EpisodeContext
from agentrl.rollout.generate import generate_rollout
from agentrl.types import Status
from tests.test_proxy import MUL, TOOLS, ScriptedEngine, _client

SEEN: dict[str, list] = {}  # task id -> the messages the agent last sent, with the final reply
GOT: dict[str, list] = {}  # task id -> what the agent received / how it was called


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
    for kwargs in ({"n": 2}, {"logprobs": True}, {"stop": ["x"]}, {"tool_choice": "required", "tools": TOOLS}):
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
