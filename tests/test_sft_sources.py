"""Demonstrations played or sampled: a scripted policy on the env, and rejection sampling from an engine.

Real parts: the calculator and tic-tac-toe envs, the tiny model's tokenizer and chat template, the
embedded engine over HTTP for rejection sampling (best-of-n per task, per role, whole segments).
"""

from __future__ import annotations

import asyncio

import pytest

from agentrl.chat import ChatTemplate
from agentrl.config import RolloutConfig
from agentrl.envs.calculator import Calculator, random_policy, solver_policy
from agentrl.rollout.demos import rejection_samples, scripted_samples
from tests.test_sft_conversations import _spans


@pytest.fixture(scope="module")
def template(tiny_tokenizer):
    return ChatTemplate(tiny_tokenizer)


def test_scripted_demos_equal_the_rollout_ledger_and_earn_the_env_reward(template):
    tasks = Calculator.tasks(6)
    samples, stats = asyncio.run(scripted_samples(Calculator, solver_policy, tasks, template, min_reward=1.0))
    assert stats.kept == 6 and all(s.reward == 1.0 and s.token_exact for s in samples)
    spans = _spans(template, samples[0])
    assert spans[0].startswith("<tool_call>") and spans[1] == f"The answer is {tasks[0]['label']}.<|im_end|>"
    # a policy that guesses earns nothing: with --demo-min-reward 1 nothing of it is kept
    kept, stats = asyncio.run(scripted_samples(Calculator, random_policy(0), tasks, template, min_reward=1.0))
    assert kept == [] and stats.below_min_reward == 6


class _Scored(__import__("agentrl").Env):
    """One turn; the reward is the task's own ``score`` whatever the model wrote (sampling is not seeded)."""

    max_turns = 1

    async def reset(self, *, seed=None, options=None):
        self.score = float(options["score"])
        return [{"role": "user", "content": options["prompt"]}], {}

    async def step(self, action):
        return [], self.score, True, False, {}


def test_rejection_sampling_keeps_only_episodes_at_or_above_the_threshold(tiny_server, tiny_tokenizer):
    from agentrl.engines.http import SGLangEngine
    from agentrl.rollout.episode import EpisodeContext

    engine = SGLangEngine(tiny_server)
    cfg = RolloutConfig(n_samples_per_prompt=6, max_turns=1, rollout_max_turn_len=48, rollout_seed=3)
    ctx = EpisodeContext(engine=engine, template=ChatTemplate(tiny_tokenizer), config=cfg)
    tasks = [{"prompt": f"task {i}", "score": score} for i, score in enumerate((0.0, 0.5, 1.0, 0.2))]

    async def run(**kw):
        try:
            return await rejection_samples(ctx, _Scored, tasks, **kw)
        finally:
            await engine.close()

    kept, stats = asyncio.run(run(min_reward=0.5))
    assert stats.rows == 24 and stats.kept + stats.below_min_reward + stats.failed_episodes == 24
    assert stats.kept == len(kept) > 0 and stats.below_min_reward > 0
    assert {s.group_index for s in kept} <= {1, 2} and all(s.reward >= 0.5 and s.token_exact for s in kept)
    # a turn cut off by the length limit never becomes a demonstration; the others of groups 1 and 2 are kept
    assert all(s.status_reason == "terminated" for s in kept)
    assert stats.kept + stats.failed_episodes >= 12
    best, stats = asyncio.run(run(min_reward=0.0, best_of_n=True))
    assert sorted(s.group_index for s in best) == sorted({s.group_index for s in best}) and 0 < len(best) <= 4


def test_best_of_n_keeps_the_chosen_episode_whole(tiny_server, tiny_tokenizer):
    from agentrl.engines.http import SGLangEngine
    from agentrl.rollout.episode import EpisodeContext
    from tests.test_segments import SummarizingTalk

    engine = SGLangEngine(tiny_server)
    cfg = RolloutConfig(n_samples_per_prompt=3, max_turns=5, rollout_max_turn_len=200, rollout_seed=3)
    ctx = EpisodeContext(engine=engine, template=ChatTemplate(tiny_tokenizer), config=cfg)

    async def run():
        try:
            return await rejection_samples(
                ctx, SummarizingTalk, [{"prompt": "a"}, {"prompt": "b"}], min_reward=0.0, best_of_n=True
            )
        finally:
            await engine.close()

    kept, _ = asyncio.run(run())
    by_task: dict = {}
    for s in kept:  # every episode of SummarizingTalk is two segments: the chosen one comes whole
        by_task.setdefault(s.group_index, []).append(s)
    assert sorted(by_task) == [0, 1]
    for segs in by_task.values():
        assert len({s.metadata["episode_id"] for s in segs}) == 1 and [s.metadata["segment"] for s in segs] == [0, 1]


def test_best_of_n_chooses_each_role_of_a_multi_role_env_apart(tiny_server, tiny_tokenizer, monkeypatch):
    import agentrl.rollout.demos as demos
    import agentrl.rollout.generate as generate
    from agentrl.engines.http import SGLangEngine
    from agentrl.envs.tictactoe import TicTacToe
    from agentrl.rollout.episode import EpisodeContext

    real, played = generate.generate_rollout, []

    async def spy(*a, **kw):  # the real rollout, recorded: what best-of-n chose from
        out = await real(*a, **kw)
        played.extend(out[0])
        return out

    monkeypatch.setattr(demos, "generate_rollout", spy)  # the name rejection sampling calls
    engine = SGLangEngine(tiny_server)
    cfg = RolloutConfig(n_samples_per_prompt=6, max_turns=9, rollout_max_turn_len=48, rollout_seed=5)
    ctx = EpisodeContext(engine=engine, template=ChatTemplate(tiny_tokenizer), config=cfg)

    async def run():
        try:
            return await rejection_samples(ctx, TicTacToe, TicTacToe.tasks(4), min_reward=0.0, best_of_n=True)
        finally:
            await engine.close()

    kept, _ = asyncio.run(run())
    keys = [(s.group_index, s.metadata["role"]) for s in kept]
    assert kept and len(keys) == len(set(keys))  # one sample per task and role
    for s in kept:  # each role's own best, not the sample of whichever role won the episode
        rivals = [
            p.reward for p in played if (p.group_index, p.metadata.get("role")) == (s.group_index, s.metadata["role"])
        ]
        assert s.reward == max(r for r in rivals if r is not None), (s.metadata["role"], s.reward, rivals)
