"""PPO with a critic (``--advantage-estimator ppo``): the value model, its sharded group, the loop, the flags.

The GAE and value-loss formulas are checked by hand in ``test_algo.py``; the learning run is in
``test_learning.py``; the megatron critic's agreement with this one in ``test_megatron_trainer.py``.
Here: the critic reads its values where the policy reads logits, learns a fixed target, saves and
resumes exactly, shards over two Ray actors like the actor does, trains beside the actor in the loop
(critic-only warm-up included), resumes with the run, and every bad flag is refused before Ray starts.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import time
from pathlib import Path

import pytest
import torch

from agentrl.cli import main
from agentrl.config import RolloutConfig, RunConfig, TrainConfig
from agentrl.trainer.torch_critic import TorchCritic

from .test_trainer import cfg, make_samples


def ppo_cfg(**kw) -> TrainConfig:
    return cfg(**{"advantage_estimator": "ppo", **kw})


def with_targets(samples, values, target: float = 1.0):
    """Samples with the critic's values and a fixed return on every policy token."""
    return [
        dataclasses.replace(s, values=v, returns=[target if m else 0.0 for m in s.loss_mask])
        for s, v in zip(samples, values)
    ]


def test_values_are_read_where_the_policy_reads_logits(tiny_ckpt):
    """Value of response token t = head(hidden state of the token before it), packed or alone."""
    critic = TorchCritic(tiny_ckpt, ppo_cfg(max_tokens_per_gpu=64))
    head = critic.model.get_output_embeddings()
    assert tuple(head.weight.shape) == (1, critic.model.config.hidden_size)
    samples = make_samples(6, seed=3)
    packed = critic.compute_values(samples)
    with torch.no_grad():
        for s, v in zip(samples, packed):
            hidden = critic.model.model(input_ids=torch.tensor([s.tokens])).last_hidden_state[0]  # [L, h]
            expected = head(hidden[s.prompt_length - 1 : -1])[:, 0]
            torch.testing.assert_close(torch.tensor(v), expected, atol=1e-5, rtol=0)
    with pytest.raises(TypeError, match="compute_values"):
        critic.compute_log_probs(samples, ref=False)


def test_critic_learns_a_fixed_target_saves_and_resumes(tied_ckpt, tmp_path):
    """Value loss falls toward a fixed return; the head is its own weight (embeddings untied, kept);
    a reloaded critic continues exactly; the saved folder says it is a value head."""
    critic = TorchCritic(tied_ckpt, ppo_cfg(lr=1e-3, critic_lr=1e-2, use_kl_loss=True, kl_loss_coef=0.1))
    assert critic.ref_model is None and critic.cfg.lr == 1e-2  # --critic-lr; no reference model for a critic
    embed = critic.model.get_input_embeddings().weight
    assert critic.model.get_output_embeddings().weight is not embed
    before = embed.detach().clone()
    samples = make_samples(8, seed=4)
    losses = []
    for _ in range(8):
        batch = with_targets(samples, critic.compute_values(samples))
        losses.append(critic.train_step(batch)["value_loss"])
    assert losses[-1] < 0.2 * losses[0], losses
    assert not torch.equal(before, embed.detach())  # the trunk trains too, not the head alone
    critic.save(tmp_path / "critic", extra_state={"k": 2})
    assert json.loads((tmp_path / "critic" / "config.json").read_text())["agentrl_value_head"] is True

    again = TorchCritic(tied_ckpt, ppo_cfg(lr=1e-3, critic_lr=1e-2))
    assert again.load(tmp_path / "critic") == {"k": 2}
    assert again.compute_values(samples) == critic.compute_values(samples)
    batch = with_targets(samples, critic.compute_values(samples))
    torch.manual_seed(0)
    a = critic.train_step(batch)
    torch.manual_seed(0)
    b = again.train_step(batch)
    assert a["value_loss"] == pytest.approx(b["value_loss"], abs=1e-7)
    for x, y in zip(again.compute_values(samples), critic.compute_values(samples)):
        assert x == pytest.approx(y, abs=1e-6)


def test_value_clip_stops_the_gradient_past_the_clip(tiny_ckpt):
    """Rollout values 1 below the current ones, returns 5 above: the clipped value (rollout + 0.2) is
    further from the return than the current one, so the loss takes the clipped branch, which has no
    gradient: with ``--value-clip 0.2`` the step leaves the critic exactly as it was; with 10 it moves."""
    samples = make_samples(8, seed=5)
    for clip in (0.2, 10.0):
        critic = TorchCritic(tiny_ckpt, ppo_cfg(critic_lr=1e-2, value_clip=clip, weight_decay=0.0))
        v0 = critic.compute_values(samples)
        batch = [
            dataclasses.replace(s, values=[x - 1.0 for x in v], returns=[x + 5.0 for x in v])
            for s, v in zip(samples, v0)
        ]
        m = critic.train_step(batch)
        v1 = critic.compute_values(samples)
        if clip < 1:
            assert m["value_clipfrac"] == pytest.approx(1.0) and v1 == v0
        else:
            assert m["value_clipfrac"] == 0.0 and v1 != v0


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--critic-lr", "1e-5"], "need --advantage-estimator ppo"),
        (["--lambd", "0.9"], "need --advantage-estimator ppo"),
        (["--num-critic-only-steps", "1"], "need --advantage-estimator ppo"),
        (["--critic-hf-checkpoint", "/nowhere"], "--critic-hf-checkpoint is the critic's start"),
        (["--advantage-estimator", "ppo", "--per-turn-credit"], "--per-turn-credit is for grpo/gspo"),
        (["--advantage-estimator", "ppo", "--num-critic-only-steps", "2"], "must be below --num-rollout"),
        (["--advantage-estimator", "ppo", "--lambd", "1.5"], "--lambd must be in [0, 1]"),
        (["--advantage-estimator", "ppo", "--value-clip", "0"], "--value-clip must be > 0"),
        (["--kl-coef", "0.1"], "--kl-coef folds the KL into the rewards"),
        (["--advantage-estimator", "ppo", "--initial-megatron-checkpoint", "/x"], "pass --critic-hf-checkpoint"),
        (["--initial-megatron-checkpoint", ""], "--initial-megatron-checkpoint needs a folder"),
    ],
)
def test_bad_ppo_flags_are_refused_before_ray_starts(tmp_path, capsys, argv, message):
    save = tmp_path / "run"
    rc = main(["train", "--env", "agentrl.envs.digits:Digits", "--num-rollout", "2", "--save", str(save), *argv])
    assert rc == 2
    assert message in capsys.readouterr().err
    assert not save.exists()


def test_critic_checkpoints_are_checked_before_ray_starts(tiny_ckpt, tied_ckpt, tmp_path, capsys):
    """A critic from another tokenizer, or a saved critic passed as a model to start from, is refused."""
    other = tmp_path / "other"
    other.mkdir()
    config = json.loads((tied_ckpt / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**config, "vocab_size": config["vocab_size"] + 1}))
    base = ["train", "--env", "agentrl.envs.digits:Digits", "--hf-checkpoint", str(tied_ckpt)]
    assert main([*base, "--advantage-estimator", "ppo", "--critic-hf-checkpoint", str(other)]) == 2
    assert "differs from the policy's" in capsys.readouterr().err
    saved = tmp_path / "saved_critic"
    TorchCritic(tiny_ckpt, ppo_cfg()).save(saved)
    assert main([*base, "--advantage-estimator", "ppo", "--critic-hf-checkpoint", str(saved)]) == 2
    assert "a ppo run's saved critic" in capsys.readouterr().err
    assert main(["train", "--env", "agentrl.envs.digits:Digits", "--hf-checkpoint", str(saved)]) == 2
    assert "not a policy" in capsys.readouterr().err


# ---------------------------------------------------------------- Ray: a sharded critic, the loop


@pytest.mark.e2e
def test_critic_group_fsdp2_matches_single_rank(tiny_ckpt, ray_local):
    """Two critic ranks (FSDP2 over gloo) give the values and the value step of one unsharded rank."""
    from agentrl.runtime.trainer_group import TrainerGroup

    samples = make_samples(8, seed=6)
    config = ppo_cfg(critic_lr=1e-2, global_batch_size=8, max_tokens_per_gpu=32)
    group = TrainerGroup(tiny_ckpt, config, world_size=2, num_cpus=1, role="critic")
    try:
        single = TorchCritic(tiny_ckpt, config)
        v_group, v_single = group.compute_values(samples), single.compute_values(samples)
        for a, b in zip(v_group, v_single):
            torch.testing.assert_close(torch.tensor(a), torch.tensor(b), atol=1e-5, rtol=0)
        batch = with_targets(samples, v_single)
        m_group, m_single = group.train_step(batch), single.train_step(batch)
        assert m_group["value_loss"] == pytest.approx(m_single["value_loss"], abs=1e-5)
        assert m_group["grad_norm"] == pytest.approx(m_single["grad_norm"], rel=1e-4)
        for a, b in zip(group.compute_values(samples), single.compute_values(samples)):
            torch.testing.assert_close(torch.tensor(a), torch.tensor(b), atol=1e-4, rtol=0)
    finally:
        group.shutdown()
    with pytest.raises(ValueError, match="role"):
        TrainerGroup(tiny_ckpt, config, role="judge")


def _run(ckpt, save, **kw) -> RunConfig:
    train_kw = {"lr": 1e-3, "global_batch_size": 8, "advantage_estimator": "ppo", **kw.pop("train", {})}
    return RunConfig(
        env="agentrl.envs.digits:Digits",
        hf_checkpoint=str(ckpt),
        rollout_batch_size=2,
        save=str(save),
        rollout=RolloutConfig(n_samples_per_prompt=4, max_turns=2, rollout_max_turn_len=8),
        train=TrainConfig(**train_kw),
        **kw,
    )


def _lines(save: Path) -> list[dict]:
    return [json.loads(line) for line in open(save / "metrics.jsonl")]


@pytest.mark.e2e
@pytest.mark.parametrize("backend", ["torch", "megatron"])
def test_ppo_run_trains_both_saves_the_critic_and_resumes_it(tiny_ckpt, tmp_path, ray_local, backend):
    """Critic-only warm-up leaves the policy (and its version) alone; the critic is saved with the run and
    ``--load`` resumes it; resuming a run without a critic as ppo is refused. (Both backends: the critic
    group is a TrainerGroup of the run's --train-backend.)"""
    from agentrl.runtime.train import train

    if backend == "megatron":
        from agentrl.trainer.megatron_compat import megatron_available

        if megatron_available():
            pytest.skip(megatron_available())
    run = tmp_path / "run"
    t0 = time.monotonic()
    train(_run(tiny_ckpt, run, num_rollout=3, train_backend=backend, train={"num_critic_only_steps": 1}))
    lines = _lines(run)
    assert [line["weight_version"] for line in lines] == [0, 1, 2]  # step 0 trained the critic alone
    assert lines[0]["critic_only_step"] == 1.0 and "pg_loss" not in lines[0]
    assert all("pg_loss" in line for line in lines[1:])
    assert all(line["critic/value_loss"] > 0 for line in lines), lines
    # explained variance wherever the returns varied (sampling decides whether a step's all tie)
    assert all(("critic/explained_variance" in line) == (line["returns_std"] > 0) for line in lines), lines
    assert any("critic/explained_variance" in line for line in lines), lines
    critic_dir = run / "iter_0000003" / "critic"
    assert (critic_dir / "trainer_state.pt").is_file()
    # --load resumes actor and critic: one more step from the saved critic
    summary = train(_run(tiny_ckpt, run, num_rollout=4, train_backend=backend, load=str(run)))
    assert summary["weight_version"] == 3 and (run / "iter_0000004" / "critic").is_dir()
    assert [line["step"] for line in _lines(run)] == [0, 1, 2, 3]
    # the critic took up where it was: 3 optimizer steps saved, 4 after the resumed step (a fresh one would say 1)
    steps = [torch.load(run / f"iter_{k:07d}" / "critic" / "trainer_state.pt")["step"] for k in (3, 4)]
    assert steps == [3, 4]
    # a checkpoint without a critic cannot silently grow a fresh one on resume: refused before Ray starts
    plain = tmp_path / "plain"
    shutil.copytree(run / "iter_0000004", plain / "iter_0000004", ignore=shutil.ignore_patterns("critic"))
    (plain / "latest_checkpointed_iteration.txt").write_text("4")
    with pytest.raises(ValueError, match="holds no critic"):
        train(_run(tiny_ckpt, plain, num_rollout=5, train_backend=backend, load=str(plain)))
    print(f"{backend}: {time.monotonic() - t0:.1f}s")


def test_softcapped_architectures_get_a_plain_value_head(tiny_ckpt, tmp_path):
    """Gemma2 soft-caps its logits in forward: the critic turns that off, so a value is head(hidden state)."""
    import shutil as sh

    from transformers import Gemma2Config, Gemma2ForCausalLM

    for f in tiny_ckpt.iterdir():
        if f.name.startswith("tokenizer") or f.name.endswith(".jinja") or f.name == "special_tokens_map.json":
            sh.copy(f, tmp_path / f.name)
    config = Gemma2Config(
        vocab_size=400,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        final_logit_softcapping=0.5,  # |logit| < 0.5: a value of 3 could never be fitted
        attn_logit_softcapping=None,  # (sdpa cannot cap attention scores)
    )
    Gemma2ForCausalLM(config).save_pretrained(tmp_path)
    critic = TorchCritic(tmp_path, ppo_cfg(critic_lr=5e-2))
    assert critic.model.config.final_logit_softcapping is None
    samples = make_samples(4, seed=9)
    for _ in range(30):
        critic.train_step(with_targets(samples, critic.compute_values(samples), target=3.0))
    values = [v for s, vs in zip(samples, critic.compute_values(samples)) for v, m in zip(vs, s.loss_mask) if m]
    assert max(values) > 1.0  # not capped at 0.5


def test_a_forward_that_still_transforms_the_head_is_refused(tiny_ckpt):
    """A model whose forward changes the head's output after the identity knobs are set is refused by name."""
    critic = TorchCritic(tiny_ckpt, ppo_cfg())
    critic._check_plain_head()  # the plain Llama passes
    forward = critic.model.forward

    def scaled(*args, **kwargs):  # what a logit scale the knobs do not reach would do
        out = forward(*args, **kwargs)
        out.logits = out.logits * 2.0 + 0.5
        return out

    critic.model.forward = scaled
    with pytest.raises(ValueError, match="transforms its head's output"):
        critic._check_plain_head()


def test_a_failing_critic_fails_the_step_naming_it():
    """Either critic call failing fails the step with the critic named (the actor never trains alone silently)."""
    import asyncio

    from agentrl.runtime.recipes import PPO
    from agentrl.trainer.base import LogProbs
    from agentrl.types import Sample

    class Actor:  # the actor side works: only the critic is broken here
        trained = 0

        def compute_log_probs(self, batch, ref=False):
            return LogProbs(old=[[-1.0] * b.response_length for b in batch])

        def train_step(self, batch):
            Actor.trained += 1
            return {"loss": 0.0}

    class BrokenCritic:
        def __init__(self, where):
            self.where = where

        def compute_values(self, batch):
            if self.where == "values":
                raise MemoryError("out of memory")
            return [[0.0] * b.response_length for b in batch]

        def train_step(self, batch):
            raise RuntimeError("nan in the value loss")

    cfg = RunConfig(train=TrainConfig(advantage_estimator="ppo", global_batch_size=1, num_steps_per_rollout=1))
    sample = Sample(group_index=0, index=0, tokens=[1, 2, 3], response_length=2, loss_mask=[1, 1], reward=1.0)
    sample.rollout_log_probs = [-1.0, -1.0]
    for where, message in (("values", "the critic's values failed: MemoryError"), ("train", "the critic's train step")):
        recipe = PPO(cfg, Actor(), BrokenCritic(where))
        with pytest.raises(RuntimeError, match=message):
            asyncio.run(recipe.update([sample], step=0))


def test_the_reward_kl_uses_the_kl_loss_type():
    """--kl-coef's KL in the rewards is --kl-loss-type's estimator (slime's compute_approx_kl), not always k1."""
    from agentrl.runtime.recipes import PPO
    from agentrl.trainer.base import TrainSample
    from agentrl.types import Sample

    out = {}
    for kind in ("k1", "k2"):
        cfg = RunConfig(train=TrainConfig(advantage_estimator="ppo", kl_coef=1.0, kl_loss_type=kind, gamma=1.0))
        recipe = PPO(cfg, None, object())
        sample = Sample(group_index=0, index=0, tokens=[1, 2, 3], response_length=2, loss_mask=[1, 1], reward=0.0)
        batch = [
            TrainSample(
                tokens=[1, 2, 3],
                response_length=2,
                loss_mask=[1, 1],
                old_log_probs=[-1.0, -1.0],
                ref_log_probs=[-2.0, -2.0],
                values=[0.0, 0.0],
            )
        ]
        recipe.advantages([sample], batch)
        out[kind] = batch[0].advantages
    assert out["k1"] == pytest.approx([-2.0, -1.0])  # k1 = 1 per token, returns -2, -1
    assert out["k2"] == pytest.approx([-1.0, -0.5])  # k2 = 0.5 * 1^2 per token


def test_critic_only_steps_are_checked_against_the_epoch_count(tmp_path, capsys):
    rows = tmp_path / "tasks.jsonl"
    rows.write_text("".join(json.dumps({"prompt": str(i)}) + "\n" for i in range(8)))
    argv = ["train", "--env", "agentrl.envs.digits:Digits", "--prompt-data", str(rows), "--rollout-batch-size", "4"]
    argv += ["--n-samples-per-prompt", "2", "--global-batch-size", "8", "--advantage-estimator", "ppo"]
    assert main([*argv, "--num-epoch", "1", "--num-critic-only-steps", "5"]) == 2  # 8 / 4 = 2 steps
    assert "--num-critic-only-steps (5) must be below --num-rollout (2, from --num-epoch 1)" in capsys.readouterr().err
    assert main(["sft", "--sft-data", str(rows), "--normalize-advantages"]) == 2
    assert "RL flags" in capsys.readouterr().err


def test_ppo_refuses_episodes_split_into_segments():
    """GAE bootstraps along one token sequence: segments of a rewritten history are refused, naming the way out."""
    from agentrl.runtime.recipes import PPO
    from agentrl.trainer.base import TrainSample
    from agentrl.types import Sample

    recipe = PPO(RunConfig(train=TrainConfig(advantage_estimator="ppo")), None, object())
    samples = []
    for k in range(2):
        s = Sample(group_index=0, index=0, tokens=[1, 2, 3], response_length=2, loss_mask=[1, 1], reward=1.0)
        s.metadata.update(episode_id="e0", segment=k, num_segments=2)
        samples.append(s)
    batch = [TrainSample(tokens=[1, 2, 3], response_length=2, loss_mask=[1, 1], values=[0.0, 0.0]) for _ in samples]
    with pytest.raises(ValueError, match="ppo bootstraps values along one token sequence"):
        recipe.advantages(samples, batch)
