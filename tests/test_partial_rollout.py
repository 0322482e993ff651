"""--partial-rollout: a turn aborted by a weight push keeps its tokens and continues on the new weights.

A real ``agentrl serve`` of the tiny model; while episodes run, the test pushes weights the way the
train loop's guard does for SGLang (pause with mode abort, update from disk, continue), alternating two
checkpoints. Every span of every sample must re-score against the weights that sampled it.
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from agentrl.chat import ChatTemplate, TokenLedger
from agentrl.config import RolloutConfig
from agentrl.engines.http import SGLangEngine
from agentrl.rollout.episode import EpisodeContext
from agentrl.rollout.generate import generate_rollout
from agentrl.runtime.buffer import staleness
from agentrl.types import Status
from tests.test_episode import TalkEnv, _rescore

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def two_checkpoints(tiny_ckpt, tmp_path_factory):
    """The tiny model and a perturbed copy (different log-probs everywhere), both in safetensors."""
    from transformers import AutoModelForCausalLM

    a = AutoModelForCausalLM.from_pretrained(tiny_ckpt, dtype=torch.float32).eval()
    b = AutoModelForCausalLM.from_pretrained(tiny_ckpt, dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in b.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    path_b = tmp_path_factory.mktemp("perturbed")
    b.save_pretrained(path_b)
    return {"a": (str(tiny_ckpt), a), "b": (str(path_b), b)}


@pytest.fixture
def own_server(tiny_ckpt, tmp_path):
    """A server of its own: this test changes its weights."""
    from agentrl.engines.local.process import local_server

    with local_server(tiny_ckpt, log_path=tmp_path / "engine.log", extra_args=["--seed", "0"]) as url:
        yield url


async def _rollout_with_pushes(url, tokenizer, ckpts, *, partial: bool):
    """32 episodes of 3 turns while the weights are pushed every 0.1 s (up to 8 times) (versions 1, 2, ... alternate b, a)."""
    engine = SGLangEngine(url)
    cfg = RolloutConfig(
        rollout_max_turn_len=60, max_turns=5, n_samples_per_prompt=4, partial_rollout=partial, rollout_concurrency=32
    )
    ctx = EpisodeContext(engine=engine, template=ChatTemplate(tokenizer), config=cfg)
    tasks = [{"prompt": f"Question {i}: count to {i + 5}"} for i in range(8)]
    rollout = asyncio.create_task(generate_rollout(ctx, TalkEnv, tasks))
    versions = {}
    pusher = SGLangEngine(url)
    k = 0
    while not rollout.done() and k < 8:  # a push per train step in a run; here 8, close together
        await asyncio.sleep(0.1)
        k += 1
        name = "b" if k % 2 else "a"
        await pusher.pause_generation("abort")  # running requests end with their partial output
        await pusher.update_weights_from_disk(ckpts[name][0], weight_version=str(k))
        await pusher.continue_generation()
        versions[str(k)] = name
    samples, _ = await rollout
    await engine.close()
    await pusher.close()
    return samples, versions, k


async def test_aborted_turns_continue_on_the_new_weights_token_exact(own_server, tiny_tokenizer, two_checkpoints):
    samples, versions, pushes = await _rollout_with_pushes(own_server, tiny_tokenizer, two_checkpoints, partial=True)
    assert pushes >= 2
    resumed = [s for s in samples if s.metadata.get("partial_resumes")]
    assert resumed, "no turn was caught by a push"
    # no sample ends aborted (a perturbed model may run a turn to the length limit: truncated)
    assert all(s.status in (Status.COMPLETED, Status.TRUNCATED) for s in samples), [
        (s.status, s.status_reason, s.metadata.get("error")) for s in samples
    ]
    models = {v: two_checkpoints[name][1] for v, name in versions.items()}
    split_turns = 0
    for s in samples:
        s.validate()
        spans = s.metadata["version_spans"]
        assert len(spans) == len(s.weight_versions)
        # the spans tile the sampled tokens: every mask-1 position is in exactly one span
        covered = sorted(p for a, b in spans for p in range(a, b))
        assert covered == [p for p, m in enumerate(s.loss_mask) if m]
        split_turns += sum(sum(1 for a, b in spans if ta <= a and b <= tb) > 1 for ta, tb in s.turn_spans)
        rescored = {}
        for (a, b), v in zip(spans, s.weight_versions):
            model = models.get(str(v), two_checkpoints["a"][1])  # the launch weights report a name: a
            if id(model) not in rescored:
                rescored[id(model)] = _rescore(model, s.tokens, 1.0)[s.prompt_length - 1 :]
            got = rescored[id(model)][a:b]
            want = torch.tensor(s.rollout_log_probs[a:b])
            if b > a:
                assert (got - want).abs().max().item() < 1e-4, (s.index, v, a, b)
        oldest = min(int(v) if str(v).isdigit() else 0 for v in s.weight_versions)
        assert staleness([s], pushes) == pushes - oldest  # staleness (and the buffer) see the oldest span
    assert split_turns > 0  # some turn holds tokens of two weight versions
    assert any(s.metadata.get("partial_tokens_saved", 0) > 0 for s in resumed)
    print(
        f"{pushes} pushes, {len(resumed)}/{len(samples)} samples resumed, {split_turns} turns over two versions, "
        f"{sum(s.metadata['partial_tokens_saved'] for s in resumed)} sampled tokens kept instead of resampled"
    )


async def test_without_partial_rollout_an_aborted_turn_ends_its_sample(own_server, tiny_tokenizer, two_checkpoints):
    samples, _, _ = await _rollout_with_pushes(own_server, tiny_tokenizer, two_checkpoints, partial=False)
    aborted = [s for s in samples if s.status == Status.ABORTED]
    assert aborted and all(s.status_reason == "engine_abort" for s in aborted)
    assert not any("version_spans" in s.metadata for s in samples)


def test_a_continued_turn_must_follow_an_assistant_turn():
    led = TokenLedger([1, 2])
    with pytest.raises(ValueError, match="does not end with an assistant turn"):
        led.append_model([3], [-0.1], continues_turn=True)
    led.append_model([3], [-0.1])
    led.append_model([4, 5], [-0.2, -0.3], continues_turn=True)
    assert led.model_spans == [(0, 3)] and led.loss_mask == [1, 1, 1]
    led.append_env([6])
    with pytest.raises(ValueError, match="does not end with an assistant turn"):
        led.append_model([7], [-0.1], continues_turn=True)
