"""The episode loop against the real embedded engine over HTTP: exactness and faults."""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch

import agentrl
from agentrl.chat import ChatTemplate
from agentrl.config import RolloutConfig
from agentrl.engines.base import EngineError, SamplingParams
from agentrl.engines.http import SGLangEngine
from agentrl.engines.router import Router
from agentrl.rollout.episode import EpisodeContext
from agentrl.rollout.generate import generate_rollout
from agentrl.types import Status


class TalkEnv(agentrl.Env):
    """Replies with a user message each turn; terminates after 3 steps with reward = turn count."""

    async def reset(self, *, seed=None, options=None):
        self.n = 0
        return [{"role": "user", "content": str(options["prompt"])}], {"seed": seed}

    async def step(self, action):
        self.n += 1
        done = self.n >= 3
        return (
            [{"role": "user", "content": f"Turn {self.n}: say more about {len(action.text)} chars."}],
            0.5,
            done,
            False,
            {},
        )


@agentrl.tool
def echo(text: str) -> str:
    """Echo the text back.

    Args:
        text: what to echo
    """
    return text


class ToolTalkEnv(agentrl.Env):
    """Offers a tool and answers every turn with two tool results (exercises the built-in tool template)."""

    tools = [echo]

    async def reset(self, *, seed=None, options=None):
        self.n = 0
        return [{"role": "system", "content": "Use tools."}, {"role": "user", "content": str(options["prompt"])}], {}

    async def step(self, action):
        self.n += 1
        obs = [
            {"role": "tool", "tool_call_id": f"c{self.n}", "content": f"result {self.n}"},
            {"role": "tool", "tool_call_id": f"d{self.n}", "content": "ok"},
        ]
        return obs, 1.0, self.n >= 3, False, {}


def _ctx(url_or_engine, tokenizer, **cfg) -> EpisodeContext:
    engine = url_or_engine if not isinstance(url_or_engine, str) else SGLangEngine(url_or_engine)
    # 200 tokens: the tiny model ends a turn after ~10 (P(hitting the limit) ~ 0.9**200), so tests see no length finish
    config = RolloutConfig(**{"rollout_max_turn_len": 200, "max_turns": 5, **cfg})
    return EpisodeContext(engine=engine, template=ChatTemplate(tokenizer), config=config)


def _rescore(model, tokens: list[int], temperature: float) -> torch.Tensor:
    with torch.no_grad():
        logits = model(torch.tensor([tokens])).logits[0].float()
    lp = torch.log_softmax(logits / temperature, dim=-1)
    # log-prob of tokens[p] is read at position p - 1
    return lp[:-1].gather(1, torch.tensor(tokens[1:]).unsqueeze(1)).squeeze(1)


@pytest.mark.parametrize(
    "env_cls,temperature,stop", [(TalkEnv, 1.0, []), (ToolTalkEnv, 0.8, []), (TalkEnv, 1.0, ["e", "a"])]
)
async def test_multi_turn_samples_are_token_exact(tiny_server, tiny_ckpt, tiny_tokenizer, env_cls, temperature, stop):
    """Turns ending on the sampled EOS (the template's tail minus the stop token is bridged) and on a
    stop string (the whole tail is written by the environment's delta) are both exact."""
    from transformers import AutoModelForCausalLM

    ctx = _ctx(tiny_server, tiny_tokenizer, rollout_temperature=temperature, n_samples_per_prompt=3, rollout_stop=stop)
    tasks = [{"prompt": f"Question {i}: what is {i} + {i}?", "label": str(2 * i)} for i in range(2)]
    samples, summary = await generate_rollout(ctx, env_cls, tasks)
    await ctx.engine.close()
    model = AutoModelForCausalLM.from_pretrained(tiny_ckpt, dtype=torch.float32).eval()
    template = ctx.template
    multi_turn, stop_string_turns = 0, 0
    for s in samples:
        s.validate()
        assert s.status in (Status.COMPLETED, Status.TRUNCATED), s.metadata
        assert s.tokens[: s.prompt_length] == template.prompt(s.prompt, [t.schema() for t in env_cls.tools])[1]
        # 1. every sampled position re-scores to the engine's log-prob
        full = _rescore(model, s.tokens, temperature)
        resp_lp = full[s.prompt_length - 1 :]
        mask = torch.tensor(s.loss_mask, dtype=torch.bool)
        assert mask.sum() > 0
        diff = (resp_lp[mask] - torch.tensor(s.rollout_log_probs)[mask]).abs().max().item()
        assert diff < 1e-4, f"sample {s.index}: max |rescored - rollout| = {diff}"
        assert all(lp == 0.0 for lp, m in zip(s.rollout_log_probs, s.loss_mask) if m == 0)
        # 2. the decoded sample is exactly the template's rendering of the conversation
        convo = list(s.prompt)
        env_iter = iter(s.env_spans)
        for a, b in s.turn_spans:
            ids = s.tokens[s.prompt_length + a : s.prompt_length + b]
            ended = ids[-1:] == [tiny_tokenizer.eos_token_id]
            stop_string_turns += not ended
            bridge = "\n" if ended else "<|im_end|>\n"
            convo.append({"role": "assistant", "content": template.decode(ids[:-1] if ended else ids)})
            span = next(env_iter, None)
            if span is not None:
                env_text = template.decode(s.tokens[s.prompt_length + span[0] : s.prompt_length + span[1]])
                # 3. each mask-0 span is exactly the observation as the template renders it
                if env_cls is TalkEnv:
                    body = env_text.removeprefix(bridge + "<|im_start|>user\n").removesuffix(
                        "<|im_end|>\n<|im_start|>assistant\n"
                    )
                    assert env_text == f"{bridge}<|im_start|>user\n{body}<|im_end|>\n<|im_start|>assistant\n"
                    assert body.startswith(f"Turn {len(convo) // 2}: say more")
                    convo.append({"role": "user", "content": body})
                else:
                    n = (len(convo) - 2 + 1) // 3 + 1
                    assert env_text == (
                        f"{bridge}<|im_start|>user\n<tool_response>\nresult {n}\n</tool_response>\n"
                        "<tool_response>\nok\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
                    )
                    convo += [{"role": "tool", "content": f"result {n}"}, {"role": "tool", "content": "ok"}]
        rendered = template.render(convo, [t.schema() for t in env_cls.tools], add_generation_prompt=False)
        decoded = template.decode(s.tokens)
        assert rendered.startswith(decoded) and rendered[len(decoded) :] in ("\n", "<|im_end|>\n")
        assert s.reward == pytest.approx(sum(s.turn_rewards))
        multi_turn += len(s.turn_spans) >= 2
    assert multi_turn >= 3, "the tiny model should produce several multi-turn episodes"
    assert (stop_string_turns > 0) == bool(stop), "stop strings should end some turns, and only when set"
    assert summary.samples == 6


class FlakyEnv(TalkEnv):
    """Raises in step() for odd-numbered tasks."""

    async def reset(self, *, seed=None, options=None):
        self.task_id = int(options["prompt"].split()[-1])
        return await super().reset(seed=seed, options=options)

    async def step(self, action):
        if self.task_id % 2 == 1:
            raise RuntimeError("env exploded")
        return await super().step(action)


async def test_env_that_raises_fails_only_its_sample(tiny_server, tiny_tokenizer):
    ctx = _ctx(tiny_server, tiny_tokenizer)
    samples, summary = await generate_rollout(ctx, FlakyEnv, [{"prompt": f"task {i}"} for i in range(4)])
    await ctx.engine.close()
    failed = [s for s in samples if s.status == Status.FAILED]
    assert len(failed) == 2 and summary.status["failed"] == 2
    assert all("env exploded" in s.metadata["error"] and s.status_reason == "env_error" for s in failed)
    assert all(s.status != Status.FAILED for s in samples if s.group_index % 2 == 0)
    for s in failed:  # what was generated before the failure is kept, still consistent
        s.validate()


@agentrl.tool
def quit_tool() -> str:
    """Calls sys.exit, as model-written code run in-process might."""
    raise SystemExit(3)


class ExitingEnv(TalkEnv):
    """Odd tasks raise a BaseException (not an Exception) from where ``where`` says."""

    where = "step"

    def __init__(self):
        if self.where == "init" and ExitingEnv.count_init():
            raise SystemExit(2)

    @staticmethod
    def count_init() -> bool:
        ExitingEnv.made = getattr(ExitingEnv, "made", 0) + 1
        return ExitingEnv.made % 2 == 0

    async def reset(self, *, seed=None, options=None):
        self.task_id = int(options["prompt"].split()[-1])
        if self.where == "reset" and self.task_id % 2:
            raise KeyboardInterrupt
        return await super().reset(seed=seed, options=options)

    async def step(self, action):
        if self.task_id % 2:
            if self.where == "step":
                raise SystemExit(2)
            if self.where == "tool":
                from agentrl.tool import call_tool

                await call_tool(quit_tool, {}, timeout=5)
        return await super().step(action)


class ExitingSyncEnv(agentrl.Env):
    def reset(self, *, seed=None, options=None):
        self.task_id = int(options["prompt"].split()[-1])
        return [{"role": "user", "content": "hi"}], {}

    def step(self, action):
        if self.task_id % 2:
            raise SystemExit(4)  # raised in a worker thread
        return [], 1.0, True, False, {}


@pytest.mark.parametrize("where", ["init", "reset", "step", "tool", "sync", "reward"])
async def test_system_exit_anywhere_fails_only_its_sample(tiny_server, tiny_tokenizer, where):
    """SystemExit / KeyboardInterrupt from an env, a tool or a reward function used to end the whole rollout."""
    ctx = _ctx(tiny_server, tiny_tokenizer)
    env_cls = ExitingSyncEnv if where == "sync" else type("E", (ExitingEnv,), {"where": where})
    ExitingEnv.made = 0

    def reward(args, sample):
        if int(sample.prompt[-1]["content"].split()[-1]) % 2:
            raise SystemExit(5)
        return 0.0

    samples, summary = await generate_rollout(
        ctx,
        env_cls if where != "reward" else TalkEnv,
        [{"prompt": f"task {i}"} for i in range(4)],
        custom_reward=reward if where == "reward" else None,
    )
    await ctx.engine.close()
    failed = [s for s in samples if s.status == Status.FAILED]
    assert len(samples) == 4 and len(failed) == 2 and summary.status["failed"] == 2, [s.metadata for s in samples]
    reason = {"reward": "reward_error"}.get(where, "env_error")
    assert all(s.status_reason == reason for s in failed), [s.metadata for s in failed]
    assert any(x in failed[0].metadata["error"] for x in ("SystemExit", "KeyboardInterrupt"))


class BigObsEnv(TalkEnv):
    """Answers the first turn with a big observation (``size`` characters)."""

    size = 1_000_000

    async def step(self, action):
        return [{"role": "user", "content": "x y " * (self.size // 4)}], 0.0, False, False, {}


@pytest.mark.parametrize("size", [1_000_000, 40_000])
async def test_a_huge_observation_is_never_tokenized_on_the_event_loop(tiny_server, tiny_tokenizer, size):
    """Issue 18 item 7. 1 MB cannot fit the 4,096-token context even at the most bytes a token can hold: refused
    before tokenizing. 40,000 characters might (at most 52 bytes a token for this tokenizer): tokenized, in a
    worker thread, so the event loop keeps serving every other episode meanwhile; then it does not fit either."""
    ctx = _ctx(tiny_server, tiny_tokenizer, max_turns=2)
    encoded: list[tuple[int, bool]] = []
    real = ctx.template.encode

    def encode(text):
        encoded.append((len(text), threading.current_thread() is threading.main_thread()))
        return real(text)

    ctx.template.encode = encode
    samples, _ = await generate_rollout(ctx, type("E", (BigObsEnv,), {"size": size}), [{"prompt": "hi"}])
    await ctx.engine.close()
    assert samples[0].status_reason == "context_length", samples[0].metadata.get("error")
    big = [on_loop for n, on_loop in encoded if n >= size]
    assert big == ([] if size == 1_000_000 else [False]), encoded


class HangingSyncEnv(agentrl.Env):
    """A blocking step() that never returns for tasks named 'hang' (until the test releases it)."""

    release = threading.Event()

    def reset(self, *, seed=None, options=None):
        self.hang = options["prompt"].startswith("hang")
        return [{"role": "user", "content": "hi"}], {}

    def step(self, action):
        if self.hang:
            HangingSyncEnv.release.wait()
        return [], 1.0, True, False, {}


async def test_hung_sync_steps_never_starve_healthy_episodes(tiny_server, tiny_tokenizer):
    """Issue 18 item 6: more hung sync steps than the pool's threads (concurrency 2 + 4) used to make every later
    episode fail env_timeout waiting for a thread; now each hung one is written off and replaced."""
    ctx = _ctx(tiny_server, tiny_tokenizer, rollout_concurrency=2, env_step_timeout=0.5)
    tasks = [{"prompt": f"hang {i}"} for i in range(8)] + [{"prompt": f"ok {i}"} for i in range(4)]
    try:
        samples, summary = await generate_rollout(ctx, HangingSyncEnv, tasks)
    finally:
        HangingSyncEnv.release.set()
        await ctx.engine.close()
    reasons = [s.status_reason for s in sorted(samples, key=lambda s: s.index)]
    assert reasons[:8] == ["env_timeout"] * 8 and reasons[8:] == ["terminated"] * 4, reasons
    assert summary.hung_threads == 8 and summary.to_dict()["hung_threads"] == 8


class SlowEnv(TalkEnv):
    step_timeout = 0.2

    async def step(self, action):
        await asyncio.sleep(5)


async def test_step_timeout_fails_the_sample(tiny_server, tiny_tokenizer):
    ctx = _ctx(tiny_server, tiny_tokenizer)
    samples, _ = await generate_rollout(ctx, SlowEnv, [{"prompt": "x"}])
    await ctx.engine.close()
    assert samples[0].status == Status.FAILED and samples[0].status_reason == "env_timeout"


class SyncEnv(agentrl.Env):
    """Written with plain (blocking) methods: the SDK must run them off the event loop."""

    threads: set = set()

    def reset(self, *, seed=None, options=None):
        SyncEnv.threads.add(threading.get_ident())
        return [{"role": "user", "content": "hi"}], {}

    def step(self, action):
        SyncEnv.threads.add(threading.get_ident())
        return [], 1.0, True, False, {}


async def test_sync_env_methods_run_in_worker_threads(tiny_server, tiny_tokenizer):
    ctx = _ctx(tiny_server, tiny_tokenizer)
    samples, _ = await generate_rollout(ctx, SyncEnv, [{"prompt": "x"}] * 3)
    await ctx.engine.close()
    assert all(s.status == Status.COMPLETED and s.reward == 1.0 for s in samples), [s.metadata for s in samples]
    assert SyncEnv.threads and threading.get_ident() not in SyncEnv.threads


async def test_context_overflow_truncates(tiny_server, tiny_tokenizer):
    ctx = _ctx(tiny_server, tiny_tokenizer, rollout_max_context_len=40, max_turns=10)
    samples, _ = await generate_rollout(ctx, TalkEnv, [{"prompt": "a fairly long opening question here"}] * 3)
    await ctx.engine.close()
    for s in samples:
        assert s.status == Status.TRUNCATED and s.status_reason == "context_length", s.metadata
        assert len(s.tokens) <= 40
        s.validate()


async def test_a_turn_cut_off_at_the_length_limit_earns_zero(tiny_server, tiny_tokenizer):
    # 2 tokens a turn: most turns hit the limit before the tiny model ends them; such a turn never
    # reaches env.step, yet --per-turn-credit needs one reward per turn span
    ctx = _ctx(tiny_server, tiny_tokenizer, rollout_max_turn_len=2)
    samples, _ = await generate_rollout(ctx, TalkEnv, [{"prompt": "hi"}] * 6)
    await ctx.engine.close()
    cut = [s for s in samples if s.status_reason == "response_length"]
    assert cut, [s.status_reason for s in samples]
    for s in cut:
        tr, spans = s.turn_rewards, s.turn_spans
        assert len(tr) == len(spans) and tr[-1] == 0.0 and s.reward == pytest.approx(sum(tr))
    from agentrl.algo.advantages import compute_advantages

    adv = compute_advantages(
        "grpo",
        rewards=[s.reward for s in samples],
        group_ids=[0] * len(samples),
        loss_masks=[s.loss_mask for s in samples],
        per_turn=True,
        turn_rewards=[s.turn_rewards for s in samples],
        turn_spans=[[tuple(x) for x in s.turn_spans] for s in samples],
    )
    assert [len(a) for a in adv] == [s.response_length for s in samples]


class OneTurnEnv(TalkEnv):
    async def step(self, action):
        return [], 1.0, True, False, {}


async def test_dead_engine_fails_over_to_a_live_one(tiny_server, tiny_tokenizer):
    from agentrl.ports import free_port

    dead = SGLangEngine(f"http://127.0.0.1:{free_port()}", max_retries=1, backoff=0.01)
    router = Router([dead, SGLangEngine(tiny_server)])
    ctx = _ctx(router, tiny_tokenizer)
    samples, _ = await generate_rollout(ctx, OneTurnEnv, [{"prompt": "x"}] * 4)
    assert all(s.status == Status.COMPLETED for s in samples)
    assert router.failed_until[0] > 0 and router.failed_until[1] == 0
    await router.close()


async def test_no_engine_left_aborts_samples_not_the_run(tiny_tokenizer):
    from agentrl.ports import free_port

    ctx = _ctx(Router([SGLangEngine(f"http://127.0.0.1:{free_port()}", max_retries=2, backoff=0.01)]), tiny_tokenizer)
    samples, summary = await generate_rollout(ctx, TalkEnv, [{"prompt": "x"}] * 2)
    await ctx.engine.close()
    assert summary.status == {"aborted": 2}
    assert all(s.status_reason == "engine_error" and "failed after 3 tries" in s.metadata["error"] for s in samples)


async def test_chat_completions_path_marks_samples_not_token_exact(tiny_server, tiny_tokenizer):
    from agentrl.engines.http import ChatCompletionsEngine

    ctx = _ctx(tiny_server, tiny_tokenizer)
    await ctx.engine.close()
    chat = ChatCompletionsEngine(tiny_server, ctx.template)
    assert await chat.health() and not chat.token_exact
    with pytest.raises(EngineError, match="takes messages, not token ids"):
        await chat.generate([1, 2, 3], SamplingParams())
    ctx.engine = Router([chat])  # a router over API endpoints routes the turn (messages) and is not token-exact
    assert not ctx.engine.token_exact
    samples, summary = await generate_rollout(ctx, TalkEnv, [{"prompt": "hello"}] * 2)
    await ctx.engine.close()
    for s in samples:
        s.validate()
        assert s.status in (Status.COMPLETED, Status.TRUNCATED), s.metadata
        assert s.token_exact is False and set(s.weight_versions) == {"api"}
        assert all(lp == 0.0 for lp in s.rollout_log_probs)
    assert all(
        s.token_exact
        for s in (await generate_rollout(_ctx(tiny_server, tiny_tokenizer), OneTurnEnv, [{"prompt": "x"}]))[0]
    )


async def test_tool_calls_errors_and_ids_through_the_loop(tiny_tokenizer):
    """A scripted policy (a fake: an untrained model cannot be made to write chosen tool calls)
    drives a ToolEnv: valid and malformed calls are answered, ids are unique per episode, and every
    request carries exactly the ledger's ids."""
    from agentrl.engines.base import Engine, GenerateOutput
    from agentrl.envs.calculator import Calculator

    tok = tiny_tokenizer
    turns = [
        '<tool_call>\n{"name": "calculator", "arguments": {"expression": "6*7"}}\n</tool_call>'
        '<tool_call>\n{"name": "calculator", "arguments": {"expression": </tool_call>',
        '<tool_call>\n{"name": "calculator", "arguments": {"expression": "42+0"}}\n</tool_call>',
        "The answer is 42",
    ]

    class Scripted(Engine):
        def __init__(self):
            self.requests: list[list[int]] = []

        async def generate(self, input_ids, sampling_params, *, key=None):
            self.requests.append(list(input_ids))
            ids = tok.encode(turns[len(self.requests) - 1], add_special_tokens=False) + [tok.eos_token_id]
            return GenerateOutput(ids, [-0.25] * len(ids), "stop", tok.eos_token_id)

        async def health(self):
            return True

    answered: list[str] = []

    class RecordingCalculator(Calculator):
        async def step(self, action):
            result = await super().step(action)
            answered.extend(m["tool_call_id"] for m in result[0])
            return result

    engine = Scripted()
    ctx = _ctx(engine, tok)
    samples, _ = await generate_rollout(ctx, RecordingCalculator, [{"prompt": "6 times 7?", "label": "42"}])
    assert answered == ["call_0_0", "call_0_1", "call_1_0"]
    s = samples[0]
    s.validate()
    assert s.status == Status.COMPLETED and s.reward == 1.0 and s.turn_rewards == [0.0, 0.0, 1.0]
    assert s.metadata["tool_calls"] == 2 and s.metadata["parse_errors"] == 1
    for req in engine.requests:  # token in: each request is a prefix of the final sample
        assert s.tokens[: len(req)] == req
    text = ctx.template.decode(s.tokens)
    assert "<tool_response>\n42\n</tool_response>" in text
    assert "Error: could not parse tool call" in text
    assert text.count("<tool_response>") == 3
    assert [sum(s.loss_mask[a:b]) == b - a for a, b in s.turn_spans] == [True] * 3


@pytest.mark.e2e
async def test_engine_context_length_truncates_instead_of_aborting(tiny_ckpt, tiny_tokenizer, tmp_path):
    """Without --rollout-max-context-len the loop learns the engine's limit and stops before it."""
    from agentrl.engines.local.process import local_server

    class LongTalk(TalkEnv):
        async def step(self, action):
            obs, r, _, trunc, info = await super().step(action)
            return obs, r, False, trunc, info  # never terminates: only the context can end it

    with local_server(
        tiny_ckpt, extra_args=["--context-length", "96", "--seed", "1"], log_path=tmp_path / "e.log"
    ) as url:
        ctx = _ctx(url, tiny_tokenizer, max_turns=50)
        assert ctx.config.rollout_max_context_len is None
        samples, summary = await generate_rollout(ctx, LongTalk, [{"prompt": "go"}] * 4)
        await ctx.engine.close()
    assert summary.status == {"truncated": 4}, [s.metadata.get("error") for s in samples]
    for s in samples:
        assert s.status_reason == "context_length" and len(s.tokens) < 96
        s.validate()


async def test_unserializable_env_info_does_not_stop_the_run(tiny_server, tiny_tokenizer):
    class LockInfo(OneTurnEnv):
        async def step(self, action):
            obs, r, term, trunc, _ = await super().step(action)
            return obs, r, term, trunc, {"lock": threading.Lock()}

    lines = []
    ctx = _ctx(tiny_server, tiny_tokenizer)
    samples, summary = await generate_rollout(
        ctx, LockInfo, [{"prompt": "x"}] * 2, on_sample=lambda s: lines.append(s.to_json())
    )
    await ctx.engine.close()
    assert len(lines) == 2 and summary.sink_errors == 0 and "<unlocked _thread.lock" in lines[0]


@pytest.mark.e2e
async def test_malformed_engine_replies_abort_after_retries(tiny_tokenizer, tmp_path):
    """A server answering /generate with the wrong shape is retried, then the sample aborts (never 'failed')."""
    import subprocess
    import sys

    from agentrl.ports import free_port

    port = free_port()
    app = tmp_path / "bad_server.py"
    app.write_text(
        "import uvicorn\n"
        "async def app(scope, receive, send):\n"
        "    if scope['type'] != 'http':\n        return\n"
        "    await receive()\n"
        "    body = b'{\"text\": \"hi\", \"meta_info\": {}}' if scope['path'] == '/generate' else b'not json'\n"
        "    await send({'type': 'http.response.start', 'status': 200, 'headers': [(b'content-type', b'application/json')]})\n"
        "    await send({'type': 'http.response.body', 'body': body})\n"
        f"uvicorn.run(app, host='127.0.0.1', port={port}, log_level='warning')\n"
    )
    proc = subprocess.Popen([sys.executable, str(app)])
    try:
        engine = SGLangEngine(f"http://127.0.0.1:{port}", max_retries=2, backoff=0.01)
        for _ in range(100):
            if await engine.health():
                break
            await asyncio.sleep(0.1)
        ctx = _ctx(engine, tiny_tokenizer)
        samples, summary = await generate_rollout(ctx, TalkEnv, [{"prompt": "x"}] * 2)
        await engine.close()
    finally:
        proc.terminate()
        proc.wait()
    assert summary.status == {"aborted": 2}
    assert all("no meta_info.output_token_logprobs" in s.metadata["error"] for s in samples)


class ManySyncSleepers(agentrl.Env):
    def reset(self, *, seed=None, options=None):
        return [{"role": "user", "content": "hi"}], {}

    def step(self, action):
        import time

        time.sleep(0.3)  # blocking: must run in a worker thread, and many at once
        return [], 1.0, True, False, {}


async def test_many_sync_envs_do_not_time_out_waiting_for_threads(tiny_server, tiny_tokenizer):
    ctx = _ctx(tiny_server, tiny_tokenizer, env_step_timeout=1.5, rollout_concurrency=48)
    samples, summary = await generate_rollout(ctx, ManySyncSleepers, [{"prompt": "x"}] * 48)
    await ctx.engine.close()
    assert summary.status.get("completed") == 48, summary.to_dict()


async def test_chat_mode_shows_tools_to_a_model_whose_template_ignores_them(tiny_server, tiny_tokenizer):
    """/v1/chat/completions renders tools with the built-in template when the model's ignores them."""
    import aiohttp

    tools = [echo.schema()]
    async with aiohttp.ClientSession() as s:
        async with s.post(
            tiny_server + "/v1/chat/completions",
            json={"model": "m", "messages": [{"role": "user", "content": "hi"}], "tools": tools, "max_tokens": 4},
        ) as r:
            body = await r.json()
    expected = ChatTemplate(tiny_tokenizer).prompt([{"role": "user", "content": "hi"}], tools)[1]
    assert body["usage"]["prompt_tokens"] == len(expected)
    assert "<tools>" in ChatTemplate(tiny_tokenizer).decode(expected)


@pytest.mark.e2e
async def test_abort_request_aborts_the_sample(tmp_path, tiny_tokenizer):
    """POST /abort_request while a turn is generating: that sample ends ``aborted`` (engine_abort)."""
    import aiohttp

    from agentrl.engines.local.process import local_server
    from agentrl.tiny import build_model

    ckpt = build_model(tmp_path / "long", mean_turn_tokens=100000.0)  # practically never ends a turn by itself
    with local_server(ckpt, log_path=tmp_path / "e.log") as url:
        ctx = _ctx(url, tiny_tokenizer, rollout_max_turn_len=3000)
        rollout = asyncio.create_task(generate_rollout(ctx, TalkEnv, [{"prompt": "x"}]))
        await asyncio.sleep(1.0)
        async with aiohttp.ClientSession() as s:
            async with s.post(url + "/abort_request", json={"abort_all": True}) as r:
                assert r.status == 200
        samples, summary = await rollout
        await ctx.engine.close()
    s = samples[0]
    assert s.status == Status.ABORTED and s.status_reason == "engine_abort", s.metadata
    s.validate()


class BudgetRecordingEngine(SGLangEngine):
    """The real client to the real server, remembering each call's ``max_new_tokens``."""

    def __init__(self, url: str):
        super().__init__(url)
        self.asked: list[int] = []

    async def generate(self, input_ids, sampling_params, *, key=None):
        self.asked.append(sampling_params.max_new_tokens)
        return await super().generate(input_ids, sampling_params, key=key)


async def test_whole_response_budget_spans_every_turn(tiny_server, tiny_tokenizer):
    """--rollout-max-response-len (slime's meaning): each turn may sample what the response has left after
    the earlier turns AND observations; --rollout-max-turn-len still caps a single turn."""
    engine = BudgetRecordingEngine(tiny_server)
    ctx = _ctx(engine, tiny_tokenizer, rollout_max_response_len=90, rollout_max_turn_len=25, max_turns=10)
    samples = []
    for prompt in ("hello there", "hi", "what now", "go on"):  # one at a time: the calls come in order
        samples += (await generate_rollout(ctx, TalkEnv, [{"prompt": prompt}]))[0]
    await engine.close()
    asked = iter(engine.asked)
    for s in samples:
        s.validate()
        for start, _ in s.turn_spans:  # a turn starts after the earlier turns and observations (~40 tokens each)
            assert next(asked) == min(25, 90 - start)
        if s.status == Status.TRUNCATED:
            assert s.status_reason in ("response_budget", "response_length"), s.metadata
        assert s.response_length <= 90  # an observation that would pass the budget is not appended
        # a turn the budget cut off ends the episode there: the env is not stepped for it (or after it)
        assert len(s.metadata["env_infos"]) == sum(r != "length" for r in s.metadata["finish_reasons"])
        if s.status_reason == "response_budget":  # the budget ran out: at a turn's end, or no room for the next
            assert s.turn_spans[-1][1] == 90 or s.response_length < 90
    assert next(asked, None) is None
    assert any(len(s.turn_spans) >= 2 for s in samples)  # some turn got less than a whole turn's budget
    assert any(s.status_reason == "response_budget" for s in samples), [s.status_reason for s in samples]


async def test_a_custom_generate_function_gets_the_whole_budget_as_max_new_tokens(tiny_tokenizer):
    seen = []

    async def generate(args, sample, sampling_params):
        seen.append(sampling_params["max_new_tokens"])
        sample.tokens, sample.response_length, sample.loss_mask, sample.rollout_log_probs = [1, 2], 1, [1], [-1.0]
        return sample

    for cfg, want in (({"rollout_max_response_len": 300}, 300), ({}, 200)):
        ctx = _ctx(SGLangEngine("http://127.0.0.1:9"), tiny_tokenizer, **cfg)  # never called
        await generate_rollout(ctx, None, [{"prompt": "x"}], custom_generate=generate)
        assert seen.pop() == want


async def test_an_episodes_group_and_task_are_written_once(tiny_server, tiny_tokenizer):
    """The row is ``metadata["task"]`` from the episode loop on; ``group_base`` moves the groups (the train
    loop's ids, unique across steps), not the indices or the env seeds."""
    ctx = _ctx(tiny_server, tiny_tokenizer, n_samples_per_prompt=2, rollout_seed=7)
    rows = [{"prompt": "a", "label": "1", "kind": "x"}, {"prompt": "b"}]
    samples, _ = await generate_rollout(ctx, TalkEnv, rows, group_base=2_000_000)
    await ctx.engine.close()
    assert [(s.group_index, s.index) for s in samples] == [
        (2_000_000, 0),
        (2_000_000, 1),
        (2_000_001, 2),
        (2_000_001, 3),
    ]
    assert [s.metadata["task"] for s in samples] == [rows[0], rows[0], rows[1], rows[1]]
    assert [s.metadata["reset_info"]["seed"] for s in samples] == [7, 8, 9, 10]  # rollout_seed + index
