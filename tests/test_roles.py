"""Several agents in one episode: each role its own token-exact sample, per-role rewards and groups,
a role on a fixed engine, and envs that break the roles contract failing only their episode."""

from __future__ import annotations

import asyncio

import pytest
import torch

import agentrl
from agentrl.chat import ChatTemplate
from agentrl.config import RolloutConfig, RunConfig
from agentrl.engines.base import Engine, GenerateOutput
from agentrl.engines.http import SGLangEngine
from agentrl.envs.tictactoe import TicTacToe, TicTacToeVsBot, render
from agentrl.rollout.episode import EpisodeContext
from agentrl.rollout.generate import generate_rollout
from agentrl.types import Action, Sample, Status
from tests.test_episode import _rescore


class Debate(agentrl.Env):
    """Roles a and b take 4 turns in turn; each sees the other's reply; b earns 0.25 per turn, a 1.0 at the end."""

    roles = ("a", "b")
    turns = 4

    async def reset(self, *, seed=None, options=None):
        self.turn, self.who = 0, "a"
        return {
            "a": [{"role": "user", "content": f"Argue for: {options['prompt']}"}],
            "b": [{"role": "system", "content": "You argue against."}, {"role": "user", "content": "Wait."}],
        }, {}

    def current_role(self):
        return self.who

    async def step(self, action):
        self.turn += 1
        me, other = self.who, "b" if self.who == "a" else "a"
        reward = 0.25 if me == "b" else 0.0
        if self.turn >= self.turns:
            return {}, {"a": 1.0, me: reward} if me == "b" else {"a": 1.0}, True, False, {}
        self.who = other
        return (
            {other: [{"role": "user", "content": f"The other side said {len(action.text)} chars. Reply."}]},
            (reward),
            False,
            False,
            {},
        )


class LongDebate(Debate):
    """Debate over 6 turns: each role takes 3, so its history holds two earlier answers before its last."""

    turns = 6


def _ctx(url, tokenizer, role_engines=None, **cfg) -> EpisodeContext:
    config = RolloutConfig(**{"rollout_max_turn_len": 200, "max_turns": 10, **cfg})
    return EpisodeContext(
        engine=SGLangEngine(url), template=ChatTemplate(tokenizer), config=config, role_engines=role_engines or {}
    )


async def test_each_role_is_its_own_token_exact_sample(tiny_server, tiny_ckpt, tiny_tokenizer):
    from transformers import AutoModelForCausalLM

    ctx = _ctx(tiny_server, tiny_tokenizer, n_samples_per_prompt=2)
    samples, _ = await generate_rollout(ctx, Debate, [{"prompt": "tea"}, {"prompt": "coffee"}])
    await ctx.engine.close()
    model = AutoModelForCausalLM.from_pretrained(tiny_ckpt, dtype=torch.float32).eval()
    assert len(samples) == 8  # 4 episodes x 2 roles
    episodes: dict[str, list[Sample]] = {}
    for s in samples:
        episodes.setdefault(s.metadata["episode_id"], []).append(s)
    for pair in episodes.values():
        a, b = sorted(pair, key=lambda s: s.metadata["role"])
        assert (a.metadata["role"], b.metadata["role"]) == ("a", "b") and a.group_index == b.group_index
        assert {s.status for s in pair} == {Status.COMPLETED}
        assert len(a.turn_spans) == len(b.turn_spans) == 2
        assert a.turn_rewards == [0.0, 1.0] and a.reward == 1.0  # a's end reward lands on its last turn
        assert b.turn_rewards == [0.25, 0.25] and b.reward == 0.5
        for s in pair:
            s.validate()
            assert s.tokens[: s.prompt_length] == ctx.template.prompt(s.prompt, [])[1]
            lp = _rescore(model, s.tokens, 1.0)[s.prompt_length - 1 :]
            mask = torch.tensor(s.loss_mask, dtype=torch.bool)
            assert (lp[mask] - torch.tensor(s.rollout_log_probs)[mask]).abs().max().item() < 1e-4
            # mask-0 spans are exactly what the env showed this role, as the template renders it
            for x, y in s.env_spans:
                text = ctx.template.decode(s.tokens[s.prompt_length + x : s.prompt_length + y])
                assert "<|im_start|>user\nThe other side said " in text and text.endswith("<|im_start|>assistant\n")
        assert b.prompt[0]["content"] == "You argue against."
        # what b was shown before its first turn is part of its prompt (rendered once), not an empty turn + delta
        assert b.prompt[-1]["content"].startswith("The other side said") and len(b.env_spans) == 1


async def test_a_role_on_a_fixed_engine_is_recorded_not_trained(tiny_server, tiny_tokenizer):
    from agentrl.runtime.collect import Batch
    from agentrl.runtime.recipes import PolicyGradient

    fixed = SGLangEngine(tiny_server)  # another engine object: the opponent's policy
    ctx = _ctx(tiny_server, tiny_tokenizer, role_engines={"b": fixed}, n_samples_per_prompt=2)
    samples, _ = await generate_rollout(ctx, Debate, [{"prompt": "tea"}])
    await ctx.engine.close()
    await fixed.close()
    assert {s.metadata["role"]: s.metadata.get("trained", True) for s in samples} == {"a": True, "b": False}
    # the policy each seat was played by: the run's own (None) and the fixed engine's address
    assert {s.role: s.policy for s in samples} == {"a": None, "b": tiny_server.rstrip("/")}
    assert all("policy" not in s.metadata for s in samples if s.role == "a")  # the trained seat's JSON: unchanged
    counts: dict[str, int] = {}
    keep = PolicyGradient(RunConfig(), None).select(Batch([samples], 0.0), counts, version=0)
    assert [s.metadata["role"] for s in keep] == ["a", "a"] and counts["dropped_fixed_role"] == 2
    for engines, message in (
        ({"c": fixed}, r"--role-engine-url names role\(s\) \['c'\] the env does not have"),
        (
            {"b": SGLangEngine("http://127.0.0.1:9")},
            r"--role-engine-url b=http://127.0.0.1:9: the engine does not answer",
        ),
    ):
        bad = _ctx(tiny_server, tiny_tokenizer, role_engines=engines)
        with pytest.raises(ValueError, match=message):
            await generate_rollout(bad, Debate, [{"prompt": "x"}])
        await bad.engine.close()
        for e in engines.values():
            await e.close()


def test_role_engine_urls_are_validated():
    assert RolloutConfig(role_engine_url=["o=http://127.0.0.1:9"]).role_engine_urls() == {"o": "http://127.0.0.1:9"}
    for bad, message in (
        (["o"], "NAME=URL"),
        (["o=ftp://x"], "NAME=URL"),
        (["o=http://a", "o=http://b"], r"role\(s\) \['o'\] more than once"),
        (["o=http://"], "NAME=URL"),
    ):
        with pytest.raises(ValueError, match=message):
            RolloutConfig(role_engine_url=bad).validate()


def test_advantages_are_normalised_per_role():

    from agentrl.runtime.recipes import PolicyGradient
    from agentrl.trainer.base import TrainSample

    recipe = PolicyGradient(RunConfig(), None)
    samples = []
    for episode, (ra, rb) in enumerate(((1.0, 0.0), (0.0, 1.0), (1.0, 0.5), (1.0, 0.5))):
        for role, r in (("a", ra), ("b", rb)):
            s = Sample(group_index=0, index=episode, tokens=[1, 2], response_length=1, loss_mask=[1], reward=r)
            s.metadata.update(episode_id=f"e{episode}", role=role)
            samples.append(s)
    batch = [TrainSample(tokens=[1, 2], response_length=1, loss_mask=[1]) for _ in samples]
    recipe.advantages(samples, batch)
    got = {(s.index, s.metadata["role"]): b.advantages[0] for s, b in zip(samples, batch)}
    # role a: rewards 1, 0, 1, 1 (mean 0.75); role b: 0, 1, .5, .5 (mean 0.5): each against its own role
    assert got[(0, "a")] > 0 and got[(1, "a")] < 0 and got[(2, "b")] == pytest.approx(0.0, abs=1e-6)
    assert got[(0, "a")] == pytest.approx(got[(2, "a")])


class WrongRole(Debate):
    async def reset(self, *, seed=None, options=None):
        self.kind = options["prompt"]
        obs, info = await super().reset(seed=seed, options=options)
        if self.kind == "reset-missing":
            del obs["b"]
        return obs, info

    def current_role(self):
        return "referee" if self.kind == "unknown" else super().current_role()

    async def step(self, action):
        obs, reward, done, trunc, info = await super().step(action)
        if self.kind == "step-unknown":
            return {"c": [{"role": "user", "content": "?"}]}, reward, done, trunc, info
        if self.kind == "silent":
            self.who = "a"  # a acts again, shown nothing new
            return {}, reward, done, trunc, info
        return obs, reward, done, trunc, info


async def test_an_env_that_breaks_the_roles_contract_fails_only_its_episode(tiny_server, tiny_tokenizer):
    ctx = _ctx(tiny_server, tiny_tokenizer)
    kinds = ["unknown", "reset-missing", "step-unknown", "silent", "fine"]
    samples, _ = await generate_rollout(ctx, WrongRole, [{"prompt": k} for k in kinds])
    await ctx.engine.close()
    by_kind: dict[str, list[Sample]] = {}
    for s in samples:
        by_kind.setdefault(kinds[s.group_index], []).append(s)
    for kind, text in (
        ("unknown", "current_role() returned 'referee'"),
        ("reset-missing", "reset() for role 'b' must return a list of messages"),
        ("step-unknown", "step() named unknown role(s) 'c'"),
        ("silent", "role 'a' was asked to act again with nothing new to read"),
    ):
        for s in by_kind[kind]:
            assert (s.status, s.status_reason) == (Status.FAILED, "env_contract"), (kind, s.metadata)
            assert text in s.metadata["error"]
    assert {s.status for s in by_kind["fine"]} == {Status.COMPLETED} and len(by_kind["fine"]) == 2


class ToolCallingEngine(Engine):
    """A fake of a model that writes a tool call on demand (the tiny random model cannot): every turn is
    one hermes call of ``look``, ending with the end-of-turn token."""

    def __init__(self, template: ChatTemplate):
        self.ids = template.encode('<tool_call>{"name": "look", "arguments": {}}</tool_call>')
        self.eos = template.eos_token_ids[0]

    async def generate(self, input_ids, sampling_params, *, key=None):
        ids = [*self.ids, self.eos]
        return GenerateOutput(ids, [-0.1] * len(ids), "stop", self.eos)

    async def health(self):
        return True


async def test_unanswered_tool_calls_when_the_turn_passes_fail_the_episode(tiny_tokenizer):
    from agentrl.env import EnvContractError, check_roles_step

    template = ChatTemplate(tiny_tokenizer)
    ctx = EpisodeContext(engine=ToolCallingEngine(template), template=template, config=RolloutConfig(max_turns=4))
    (s, *_), _ = await generate_rollout(ctx, Debate, [{"prompt": "x"}])  # Debate answers no call, passes the turn
    assert (s.status, s.status_reason) == (Status.FAILED, "env_contract")
    assert "role 'a' made tool call(s) ['call_0_0'] that step() left unanswered" in s.metadata["error"]
    with pytest.raises(EnvContractError, match="unknown role"):
        check_roles_step(({"z": []}, 0.0, False, False, {}), ("a",), "a")
    with pytest.raises(EnvContractError, match="unknown role"):  # not a string: refused, not a sorting crash
        check_roles_step(({}, {1: 0.0, "a": 1.0}, False, False, {}), ("a",), "a")
    with pytest.raises(EnvContractError, match="reward for role 'a' must be a finite number"):
        check_roles_step(({}, {"a": float("nan")}, False, False, {}), ("a",), "a")


async def test_tictactoe_rules_and_rewards():
    env = TicTacToe()
    obs, _ = await env.reset(options={"prompt": "x"})
    assert set(obs) == {"x", "o"} and env.current_role() == "x"
    moves = ["I take 5", "1", "9", "3", "2"]  # x: 5, 9, 2 -> 2-5-8? no: x has 5, 9, 2; o has 1, 3
    results = []
    for text in moves:
        results.append(await env.step(Action(text=text)))
    obs, reward, done, _, info = results[-1]
    assert not done and set(obs) == {"o"} and "X played 2." in obs["o"][0]["content"]
    obs, reward, done, _, info = await env.step(Action(text="7"))  # o
    obs, reward, done, _, info = await env.step(Action(text="8"))  # x: 2-5-8 wins
    assert done and reward == {"x": 1.0, "o": 0.0} and info["result"] == "x wins"
    env = TicTacToe()
    await env.reset(options={"prompt": "x"})
    await env.step(Action(text="5"))
    _, reward, done, _, info = await env.step(Action(text="5"))  # o plays a taken cell: forfeit
    assert done and reward == {"o": 0.0, "x": 1.0} and info["forfeit"]
    assert render([" "] * 9).startswith(" 1 | 2 | 3")


async def test_tictactoe_lists_free_cells_and_can_reward_legal_moves():
    env = TicTacToe()
    obs, _ = await env.reset(options={"prompt": "x", "legal_move_reward": 0.1})
    assert obs["x"][-1]["content"].endswith("Free cells: 1 2 3 4 5 6 7 8 9. Your move.")
    obs, reward, *_ = await env.step(Action(text="5"))
    assert reward == {"x": 0.1, "o": 0.0} and "Free cells: 1 2 3 4 6 7 8 9." in obs["o"][0]["content"]
    _, reward, done, _, _ = await env.step(Action(text="5"))  # o forfeits: no bonus for it
    assert done and reward == {"o": 0.0, "x": 1.0}
    bot = TicTacToeVsBot()
    await bot.reset(seed=1, options={"opponent": "random", "legal_move_reward": 0.2})
    obs, reward, done, _, _ = await bot.step(Action(text="1"))
    assert not done and reward == 0.2 and "Free cells:" in obs[0]["content"] and "1 |" not in obs[0]["content"]
    for bad in (-0.1, 0.5, "0.1", True):
        with pytest.raises(ValueError, match="'legal_move_reward' must be a number from 0 to 0.2"):
            await TicTacToeVsBot().reset(options={"legal_move_reward": bad})


async def test_tictactoe_check_env_and_scripted_play():
    import statistics

    from agentrl.envs.tictactoe import random_policy, solver_policy
    from agentrl.rollout.scripted import play

    for env in (TicTacToe, TicTacToeVsBot):
        report = await agentrl.check_env(env, env.tasks(2))
        assert report.ok, report.format()
    solved = await play(TicTacToeVsBot, solver_policy, TicTacToeVsBot.tasks(32, "greedy"))
    rand = await play(TicTacToeVsBot, random_policy(), TicTacToeVsBot.tasks(32, "greedy"))
    assert min(r.reward for r in solved) >= 0.5  # perfect play never loses
    assert statistics.mean(r.reward for r in rand) < 0.5 < statistics.mean(r.reward for r in solved)
    (selfplay,) = await play(TicTacToe, solver_policy, TicTacToe.tasks(1))  # perfect play on both sides: a draw
    assert selfplay.error is None and selfplay.role_rewards == {"x": 0.5, "o": 0.5} and selfplay.turns == 9
    with pytest.raises(ValueError, match="'opponent' must be one of"):
        await TicTacToeVsBot().reset(options={"opponent": "god"})


async def test_a_custom_reward_scores_each_role_once(tiny_server, tiny_tokenizer):
    calls = []

    def rm(args, sample):
        calls.append(sample.metadata["role"])
        return 100.0 if sample.metadata["role"] == "b" else 0.0

    ctx = _ctx(tiny_server, tiny_tokenizer)
    samples, _ = await generate_rollout(ctx, Debate, [{"prompt": "tea"}], custom_reward=rm)
    await ctx.engine.close()
    assert sorted(calls) == ["a", "b"]
    assert {s.metadata["role"]: s.reward for s in samples} == {"a": 1.0, "b": 100.5}


# -- every feature of the episode loop works with roles (one loop over seats) --------------------------------


class RewritingDebate(LongDebate):
    """LongDebate whose own rewrite_history() compacts role a's conversation (called for the role about to act)."""

    async def rewrite_history(self, messages):
        if self.who != "a" or len(messages) < 5:
            return None
        return [{"role": "user", "content": "Summary: you argued twice."}, messages[-1]]


async def test_a_roles_rewrite_history_segments_that_role_only(tiny_server, tiny_ckpt, tiny_tokenizer):
    from transformers import AutoModelForCausalLM

    from tests.test_segments import _assert_token_exact

    ctx = _ctx(tiny_server, tiny_tokenizer)
    samples, _ = await generate_rollout(ctx, RewritingDebate, [{"prompt": "tea"}])
    await ctx.engine.close()
    model = AutoModelForCausalLM.from_pretrained(tiny_ckpt, dtype=torch.float32).eval()
    a = [s for s in samples if s.role == "a"]
    b = [s for s in samples if s.role == "b"]
    assert {s.status for s in samples} == {Status.COMPLETED}, [s.metadata.get("error") for s in samples]
    assert [s.segment for s in a] == [0, 1] and len(b) == 1 and b[0].segment == 0
    assert a[1].prompt[0]["content"] == "Summary: you argued twice." and a[0].metadata["history_rewrites"] == 1
    assert [len(s.turn_spans) for s in a] == [2, 1] and {s.reward for s in a} == {1.0} and b[0].reward == 0.75
    assert {s.episode_id for s in samples} == {samples[0].episode_id} and all(s.trained for s in samples)
    for s in samples:
        _assert_token_exact(model, ctx.template, s)


async def test_roles_follow_the_template_in_template_history_mode(tiny_server, tiny_ckpt, tiny_tokenizer):
    from transformers import AutoModelForCausalLM

    from tests.test_segments import EARLIER, FORGETFUL_TEMPLATE, _assert_token_exact

    model = AutoModelForCausalLM.from_pretrained(tiny_ckpt, dtype=torch.float32).eval()
    for mode in ("exact", "template"):
        config = RolloutConfig(rollout_max_turn_len=200, max_turns=10, history_mode=mode)
        ctx = EpisodeContext(
            engine=SGLangEngine(tiny_server),
            template=ChatTemplate(tiny_tokenizer, template=FORGETFUL_TEMPLATE),
            config=config,
        )
        samples, _ = await generate_rollout(ctx, LongDebate, [{"prompt": "tea"}])
        await ctx.engine.close()
        assert {s.status for s in samples} == {Status.COMPLETED}, [s.metadata.get("error") for s in samples]
        for role in ("a", "b"):
            segs = [s for s in samples if s.role == role]
            # a role's third turn follows two of its answers: the template renders the first as a placeholder
            assert sum(len(s.turn_spans) for s in segs) == 3, (mode, role)
            if mode == "exact":  # the break is counted once: the sample differs from then on anyway
                assert len(segs) == 1 and segs[0].metadata["template_breaks"] == 1
            else:  # a new segment at each break (a random model's reply may itself re-tokenize differently)
                assert len(segs) >= 2 and {s.episode_id for s in segs} == {samples[0].episode_id}
                assert EARLIER in ctx.template.decode(segs[-1].tokens[: segs[-1].prompt_length])
                for s in segs:
                    _assert_token_exact(model, ctx.template, s)


class SlowDebate(Debate):
    """Debate whose reset and steps each take 50 ms of the env's time."""

    async def reset(self, *, seed=None, options=None):
        await asyncio.sleep(0.05)
        return await super().reset(seed=seed, options=options)

    async def step(self, action):
        await asyncio.sleep(0.05)
        return await super().step(action)


@pytest.fixture
def sglang_standin(tiny_tokenizer):
    """A stand-in for an SGLang server (SGLang cannot run on this machine), over HTTP on loopback: every turn is
    first aborted after two tokens (a weight push pausing the engine: weight version 1), then finished from
    there on version 2; every reply carries SGLang's routed-expert ids (2 per forwarded token, base64 int32,
    what an MoE model reports) and speculative-decoding counters."""
    import base64
    import http.server
    import json
    import threading

    import numpy as np

    words = tiny_tokenizer.encode("ok then", add_special_tokens=False)[:3]
    eos = tiny_tokenizer.convert_tokens_to_ids("<|im_end|>")
    requests: list[dict] = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def log_message(self, *a):
            pass

        def do_GET(self):
            self.send_response(200 if self.path == "/health" else 404)
            self.send_header("content-length", "0")
            self.end_headers()

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["content-length"])))
            requests.append(body)
            resumed = len(requests) % 2 == 0
            out = [words[-1], eos] if resumed else words[:2]
            prompt = len(body["input_ids"])
            experts = np.arange((prompt + len(out) - 1) * 2, dtype=np.int32)
            reply = {
                "text": "",
                "output_ids": out,
                "meta_info": {
                    "finish_reason": {"type": "stop", "matched": eos} if resumed else {"type": "abort"},
                    "output_token_logprobs": [[-0.5, t, None] for t in out],
                    "prompt_tokens": prompt,
                    "completion_tokens": len(out),
                    "weight_version": "2" if resumed else "1",
                    "routed_experts": base64.b64encode(experts.tobytes()).decode("ascii"),
                    "spec_verify_ct": 1,
                    "spec_accept_token_num": 1,
                    "spec_draft_token_num": 2,
                },
            }
            data = json.dumps(reply).encode()
            self.send_response(200)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}", requests
    server.shutdown()
    server.server_close()


async def test_roles_resume_aborted_turns_and_keep_routed_experts_spec_info_and_env_time(
    sglang_standin, tiny_tokenizer
):
    url, requests = sglang_standin
    config = RolloutConfig(rollout_max_turn_len=50, max_turns=10, partial_rollout=True)
    ctx = EpisodeContext(
        engine=SGLangEngine(url, return_routed_experts=True), template=ChatTemplate(tiny_tokenizer), config=config
    )
    samples, _ = await generate_rollout(ctx, SlowDebate, [{"prompt": "tea"}])
    await ctx.engine.close()
    assert len(requests) == 8 and all(r["return_routed_experts"] for r in requests)  # 4 turns, each resumed once
    assert {s.role for s in samples} == {"a", "b"}
    for s in samples:
        assert s.status == Status.COMPLETED, s.metadata.get("error")
        s.validate()
        assert s.metadata["partial_resumes"] == 2 and s.weight_versions == ["1", "2", "1", "2"]
        spans = s.metadata["version_spans"]  # each turn: 2 tokens on version 1, then 2 on version 2
        assert [b - a for a, b in spans] == [2, 2, 2, 2]
        assert sorted(p for a, b in spans for p in range(a, b)) == [p for p, m in enumerate(s.loss_mask) if m]
        assert s.rollout_log_probs.count(-0.5) == 8
        # the last reply's expert ids cover every token the role's engine forwarded: all but the last
        assert s.rollout_routed_experts.shape == (len(s.tokens) - 1, 2)
        assert s.spec_info.spec_verify_ct == 4 and s.spec_info.spec_draft_token_num == 8
        # the env's time: reset (every role waited for it) and the role's own two steps
        assert s.non_generation_time >= 0.05 * 3, s.non_generation_time


async def test_scripted_self_play_rewrites_each_roles_history_as_the_episode_loop_does():
    from agentrl.rollout.scripted import play

    (result,) = await play(RewritingDebate, lambda messages, task: "I disagree.", [{"prompt": "tea"}])
    assert result.error is None and result.turns == 6
    assert result.rewrites == 1  # a's third turn (the env rewrites a's history only), as in a rollout
    assert result.role_rewards == {"a": 1.0, "b": 0.75}
    # messages keep a's whole episode as played (its prompt, 3 answers, 2 replies), not the rewritten view
    assert result.messages[0]["content"] == "Argue for: tea" and len(result.messages) == 6


class QuietStep(Debate):
    """a, b, a: b's step shows a nothing (an empty list); a was shown something after its first turn all the same."""

    turns = 3

    async def step(self, action):
        self.turn += 1
        if self.turn == 1:
            self.who = "b"
            return (
                {"a": [{"role": "user", "content": "noted"}], "b": [{"role": "user", "content": "go"}]},
                0.0,
                False,
                False,
                {},
            )
        if self.turn == 2:
            self.who = "a"
            return {"a": [], "b": [{"role": "user", "content": "ok"}]}, 0.0, False, False, {}
        return {}, {"a": 1.0}, True, False, {}

    async def rewrite_history(self, messages):
        return [{"role": "user", "content": "Summary."}, *messages[-1:]] if self.who == "a" else None


async def test_scripted_play_keeps_a_rewrite_owed_across_a_step_that_shows_the_role_nothing():
    """As the episode loop's seat: what a role was shown stays owed until its next turn, so an empty list from a
    later step does not cancel the rewrite before it."""
    from agentrl.rollout.scripted import play

    seen = []

    def policy(messages, task):
        seen.append([m["content"] for m in messages])
        return "fine"

    (result,) = await play(QuietStep, policy, [{"prompt": "tea"}])
    assert result.error is None and result.turns == 3 and result.rewrites == 1
    assert seen[2] == ["Summary.", "noted"]  # a's second turn read the rewritten history


class BadPictureDebate(Debate):
    """Debate whose step shows b a picture that cannot be decoded."""

    async def step(self, action):
        obs, reward, done, trunc, info = await super().step(action)
        if "b" in obs:
            obs = {"b": [{"role": "user", "content": [{"type": "image", "image": "data:image/png;base64,AAAA"}]}]}
        return obs, reward, done, trunc, info


async def test_check_env_decodes_every_roles_pictures():
    report = await agentrl.check_env(BadPictureDebate, [{"prompt": "tea"}])
    assert not report.ok and "step() for role 'b'" in report.format(), report.format()
    assert (await agentrl.check_env(Debate, [{"prompt": "tea"}])).ok


async def test_scripted_demonstrations_of_an_env_with_roles_give_each_seat_its_own_turns(tiny_tokenizer):
    """``agentrl sft --demo-policy`` on an env with roles: one demonstration per seat, made of that seat's own
    conversation and texts (X's demonstration once held O's moves as X's turns) and kept by that seat's reward."""
    from agentrl.envs.tictactoe import parse_move, solver_policy
    from agentrl.rollout.demos import scripted_samples
    from agentrl.rollout.scripted import play

    (game,) = await play(TicTacToe, solver_policy, TicTacToe.tasks(1))
    assert [len(game.role_plays[r].texts) for r in "xo"] == [5, 4] and game.texts[0::2] == game.role_plays["x"].texts
    assert game.role_plays["o"].texts == game.texts[1::2] and game.role_plays["x"].reward == 0.5
    template = ChatTemplate(tiny_tokenizer)
    samples, stats = await scripted_samples(TicTacToe, solver_policy, TicTacToe.tasks(3), template, max_turns=9)
    assert stats.rows == 6 and stats.kept == 6 and [s.role for s in samples] == ["x", "o"] * 3
    for s in samples:
        text = template.decode(s.tokens)
        marks = "X" if s.role == "x" else "O"
        assert f"You are {marks}." in text and s.reward == 0.5 and len(s.turn_spans) == (5 if s.role == "x" else 4)
        replies = [template.decode(s.tokens[s.prompt_length + a : s.prompt_length + b]) for a, b in s.turn_spans]
        shown = text.split("played ")[1:]  # the other player's moves, as this seat was shown them
        # each own reply is a cell no one had taken: never the other seat's move
        assert all(parse_move(r) is not None for r in replies)
        assert not {parse_move(r) for r in replies} & {int(m[0]) - 1 for m in shown}

    def lowest_or_highest(messages, task):  # X takes the lowest free cell, O the highest: X wins with 1 2 3
        from agentrl.envs.tictactoe import board_from

        board = board_from(messages)
        free = [i for i, c in enumerate(board) if c == " "]
        return str((min(free) if board.count("X") == board.count("O") else max(free)) + 1)

    won, stats = await scripted_samples(
        TicTacToe, lowest_or_highest, TicTacToe.tasks(2), template, min_reward=1.0, max_turns=9
    )
    assert [s.role for s in won] == ["x", "x"] and stats.below_min_reward == 2 and all(s.reward == 1.0 for s in won)
