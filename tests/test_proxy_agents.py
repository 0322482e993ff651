"""Agents built with agent frameworks, unmodified, as episodes: the OpenAI Agents SDK, LangChain (a
``create_agent`` agent, invoked and streamed), and the bundled example program, through ``play`` and
``agentrl train``. Tool calls come from a scripted engine; the frameworks parse, run and echo them.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import openai
import pytest

from agentrl.chat import ChatTemplate
from agentrl.config import RolloutConfig
from agentrl.proxy import ProxyEnv
from agentrl.rollout.episode import EpisodeContext
from agentrl.rollout.generate import generate_rollout
from agentrl.types import Status
from tests.test_proxy import REPO, ScriptedEngine


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


def _require(modules: tuple[str, ...], env_var: str, install: str) -> None:
    """Import ``modules``; where one is missing the test skips, or fails when CI sets ``env_var=1``."""
    import importlib

    try:
        for name in modules:
            importlib.import_module(name)
    except ImportError as exc:
        if os.environ.get(env_var) == "1":
            pytest.fail(f"{modules[0]} is not installed ({exc}) and {env_var}=1")
        pytest.skip(f"{modules[0]} is not installed ({exc}): {install}")


def _agents_sdk() -> None:
    """The OpenAI Agents SDK; skipped where it is not installed (CI: AGENTRL_REQUIRE_AGENTS_SDK=1 fails instead)."""
    _require(("agents",), "AGENTRL_REQUIRE_AGENTS_SDK", "pip install openai-agents==0.24.0")


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


def _one_two_turn_sample(samples: list, engine: ScriptedEngine) -> Any:
    """The one completed sample of a 6 * 7 agent episode, checked token-exact: two turns, no rewrite,
    every engine request a prefix of its tokens, every turn the engine's ids verbatim."""
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
    return s


async def test_an_openai_agents_sdk_agent_is_recorded_token_exact(tiny_tokenizer):
    """The SDK parses the reply's tool_calls, runs its function tool and sends the result back as an
    extension of the conversation: one sample, every engine request a prefix of its tokens, every turn
    the engine's ids verbatim, the tool's result in the ledger and in the agent's final output."""
    _agents_sdk()
    engine = ScriptedEngine(tiny_tokenizer)
    ctx = EpisodeContext(engine=engine, template=ChatTemplate(tiny_tokenizer), config=RolloutConfig(max_turns=4))
    samples, _ = await generate_rollout(ctx, SDKAgent, [{"prompt": "What is 6 * 7?", "label": "42"}])
    s = _one_two_turn_sample(samples, engine)
    assert all(lp == -0.25 for a, b in s.turn_spans for lp in s.rollout_log_probs[a:b])
    text = ctx.template.decode(s.tokens)
    assert '"name": "multiply"' in text.split("<|im_start|>user")[0]  # the SDK's tool schema, rendered
    assert "<tool_response>\n42\n</tool_response>" in text
    assert s.metadata["env_infos"][-1]["output"] == "The answer is 42."


def _langchain() -> None:
    """LangChain (langchain, langchain-openai); skipped where not installed (AGENTRL_REQUIRE_LANGCHAIN=1 fails)."""
    _require(
        ("langchain.agents", "langchain_openai"),
        "AGENTRL_REQUIRE_LANGCHAIN",
        "pip install langchain==1.4.2 langchain-openai==1.6.6",
    )


LC: dict[str, list] = {}  # task id -> the agent's final messages (LangChain message objects)


async def langchain_agent(base_url: str, task: dict) -> str:
    """An unmodified LangChain agent: ``create_agent`` with a ``@tool`` and a default ``ChatOpenAI`` on the
    session, run as its user chooses (``ainvoke``, or ``astream`` of LangGraph's messages stream)."""
    from langchain.agents import create_agent
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    @tool
    def multiply(a: int, b: int) -> int:
        """Multiply two integers."""
        return a * b

    settings = {"stream_usage": True} if task["mode"] == "stream_usage" else {}
    model = ChatOpenAI(model="policy", base_url=base_url, api_key="unused", max_retries=0, timeout=60, **settings)
    agent = create_agent(model, tools=[multiply], system_prompt="Use the tools.")
    inputs = {"messages": [{"role": "user", "content": task["prompt"]}]}
    if task["mode"] == "invoke":
        state = await agent.ainvoke(inputs)
    else:  # token streaming, as chat UIs run agents: every model call is a stream=True request
        chunks = 0
        async for mode, data in agent.astream(inputs, stream_mode=["messages", "values"]):
            chunks += mode == "messages"
            state = data if mode == "values" else state
        assert chunks >= 2
    LC[task["id"]] = state["messages"]
    return state["messages"][-1].content


LangChainAgent = ProxyEnv.define(
    "LangChainAgent", agent=langchain_agent, reward=lambda t, m, o: float(o == f"The answer is {t['label']}.")
)


@pytest.mark.parametrize("mode", ["invoke", "stream", "stream_usage"])
async def test_a_langchain_agent_is_recorded_token_exact(tiny_tokenizer, monkeypatch, mode):
    """LangChain parses the reply's tool_calls into AIMessage.tool_calls, runs its tool and sends the
    ToolMessage back as an extension of the conversation: one sample, the engine's ids verbatim (mask 1)
    and the observations between them (mask 0); the reply's usage reaches usage_metadata exactly."""
    _langchain()
    monkeypatch.setenv("LANGSMITH_TRACING", "false")  # no trace export: nothing leaves loopback
    engine = ScriptedEngine(tiny_tokenizer)
    ctx = EpisodeContext(engine=engine, template=ChatTemplate(tiny_tokenizer), config=RolloutConfig(max_turns=4))
    samples, _ = await generate_rollout(
        ctx, LangChainAgent, [{"prompt": "What is 6 * 7?", "label": "42", "mode": mode, "id": mode}]
    )
    s = _one_two_turn_sample(samples, engine)
    masked = [i for i, m in enumerate(s.loss_mask) if m]
    assert masked == [i for a, b in s.turn_spans for i in range(a, b)]  # the assistant turns, nothing else
    (between,) = s.env_spans
    obs = ctx.template.decode(s.tokens[s.prompt_length + between[0] : s.prompt_length + between[1]])
    assert "<tool_response>\n42\n</tool_response>" in obs  # the tool's result, fed back by LangChain
    assert '"name": "multiply"' in ctx.template.decode(s.tokens[: s.prompt_length])  # its tool schema, rendered
    ai, tool_msg, final = LC[mode][-3:]
    assert [(c["name"], c["args"]) for c in ai.tool_calls] == [("multiply", {"a": 6, "b": 7})]
    assert ai.content == "Let me multiply." and tool_msg.content == "42" and final.content == "The answer is 42."
    for msg, read, sampled in zip((ai, final), engine.requests, engine.outputs):
        if mode == "stream":  # LangChain asks a custom base_url for no usage when streaming
            assert msg.usage_metadata is None
            continue
        usage = (msg.usage_metadata["input_tokens"], msg.usage_metadata["output_tokens"])
        assert usage == (len(read), len(sampled)), msg.usage_metadata


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
