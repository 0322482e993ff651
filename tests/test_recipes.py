"""Recipes over phases (issue 39, item 5): one TrainLoop orders collect -> select/update -> push -> log/checkpoint
for every recipe; GRPO family, PPO and SFT differ only in their recipe (and SFT in its rollout side).

The SFT run here is in-process with real parts: demonstrations loaded by the SDK, a real torch trainer on a tiny
checkpoint, a real metrics logger and run folder; only the engines' push and the evaluator are recorders (there is
no engine to push to in-process; the end-to-end runs in test_sft.py / test_train.py push to real engines)."""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import json

import pytest

from agentrl.config import RolloutConfig, RunConfig, TrainConfig
from agentrl.runtime.collect import DemoCollector
from agentrl.runtime.loop import EngineHooks, Observers, TrainLoop
from agentrl.runtime.recipes import PPO, SFT, PolicyGradient, Recipe, recipe_for
from tests.test_sft_conversations import _row


def test_the_recipe_is_chosen_by_the_configuration_and_a_critic_goes_with_ppo_only():
    assert type(recipe_for(RunConfig(), None)) is PolicyGradient
    ppo = RunConfig(train=TrainConfig(advantage_estimator="ppo"))
    assert type(recipe_for(ppo, None, critic=object())) is PPO
    sft = RunConfig(num_rollout=1, train=TrainConfig(loss_type="sft_loss"))  # 3 demonstrations, one global batch
    assert type(recipe_for(sft, None, n_demos=3)) is SFT
    with pytest.raises(ValueError, match="pass critic= \\(and only then\\)"):
        recipe_for(ppo, None)
    with pytest.raises(ValueError, match="pass critic= \\(and only then\\)"):
        recipe_for(RunConfig(), None, critic=object())
    with pytest.raises(ValueError, match="pass n_demos"):
        recipe_for(sft, None)
    # steps per rollout: the recipe and the trainers read the one resolved value (unset, the trainers make one step)
    two = RunConfig(rollout_batch_size=4, rollout=RolloutConfig(n_samples_per_prompt=4), train=TrainConfig())
    with pytest.raises(ValueError, match="makes 2 optimizer steps per rollout: pass the configuration preflight"):
        PolicyGradient(two, None)
    set_ = dataclasses.replace(two, train=TrainConfig(num_steps_per_rollout=2))
    assert PolicyGradient(set_, None).needs_log_probs()[0]  # a second step trains on the first's weights
    # one base: the checkpoint verbs are written once (the actor); PPO alone adds its critic
    assert all(issubclass(cls, Recipe) for cls in (PolicyGradient, PPO, SFT))
    assert SFT.save is PolicyGradient.save is Recipe.save and SFT.load is PolicyGradient.load is Recipe.load
    assert PPO.save is not Recipe.save and SFT.moves_policy is Recipe.moves_policy
    # built by hand, each recipe refuses a configuration that is not its own
    with pytest.raises(ValueError, match="is not PolicyGradient's"):
        PolicyGradient(ppo, None)
    with pytest.raises(ValueError, match="is not PPO's"):
        PPO(RunConfig(), None, object())
    with pytest.raises(ValueError, match="sft_loss"):
        SFT(RunConfig(), None, 3)
    with pytest.raises(ValueError, match="not derived yet: pass the configuration preflight"):
        SFT(RunConfig(train=TrainConfig(loss_type="sft_loss")), None, 3)
    with pytest.raises(ValueError, match="is not this warm start's length \\(2 steps for 3 demonstrations\\)"):
        SFT(
            RunConfig(num_epoch=1, num_rollout=5, train=TrainConfig(loss_type="sft_loss", global_batch_size=2)), None, 3
        )


def test_the_loop_takes_a_handful_of_objects():
    params = list(inspect.signature(TrainLoop.__init__).parameters)
    assert params == ["self", "cfg", "collector", "recipe", "engines", "observers"]


class _Pushes:
    def __init__(self):
        self.versions: list[int] = []

    def __call__(self, version: int) -> None:
        self.versions.append(version)


def _sft_loop(ckpt, tmp_path, demos, pushes, evals):
    from agentrl.metrics import MetricsLogger
    from agentrl.trainer.torch_trainer import TorchTrainer

    cfg = RunConfig(
        sft_data="unused.jsonl",
        hf_checkpoint=str(ckpt),
        num_rollout=3,
        eval_interval=2,
        save=str(tmp_path / "run"),
        train=TrainConfig(loss_type="sft_loss", global_batch_size=2, lr=1e-3),
    )

    async def evaluator(step: int) -> dict[str, float]:
        evals.append(step)
        return {"eval/demo/reward_mean": 0.5}

    trainer = TorchTrainer(str(ckpt), cfg.train, device="cpu")
    return TrainLoop(
        cfg,
        collector=DemoCollector(cfg, demos),
        recipe=recipe_for(cfg, trainer, n_demos=len(demos)),
        engines=EngineHooks(push=pushes),
        observers=Observers(metrics=MetricsLogger(cfg.save, console=False, total_steps=3), evaluator=evaluator),
    )


def test_sft_runs_the_same_phases_pushing_only_before_an_evaluation(tiny_ckpt, tmp_path):
    from agentrl.runtime import run_folder
    from agentrl.runtime.sft import load_demonstrations

    data = tmp_path / "demos.jsonl"
    data.write_text("".join(json.dumps(_row()) + "\n" for _ in range(4)))
    demos = load_demonstrations(RunConfig(sft_data=str(data)), None, [], tiny_ckpt)
    pushes, evals = _Pushes(), []
    loop = _sft_loop(tiny_ckpt, tmp_path, demos, pushes, evals)
    lines = asyncio.run(loop.run())
    assert len(lines) == 3 and all("loss" in line for line in lines)
    for line in lines:  # an SFT line: the update, its epoch, what it trained, its time; no weight-push or rollout keys
        assert {"epoch", "train_samples", "step_train_seconds"} <= set(line)
        assert not {"weight_version", "weight_sync_seconds", "hung_threads", "dropped_stale"} & set(line)
    assert [line["epoch"] for line in lines] == [0.5, 1.0, 1.5]  # 4 demos, 2 per step
    # pushed (and evaluated) at the --eval-interval step and after the last step, never in between
    assert evals == [1, 2] and pushes.versions == [2, 3]
    assert "eval/demo/reward_mean" in lines[1] and "eval/demo/reward_mean" not in lines[0]
    assert not (tmp_path / "run" / "rollouts").exists()  # demonstrations are not dumped as rollouts
    final = run_folder.latest_checkpoint(tmp_path / "run")
    assert final is not None and final.name == "iter_0000003"
    state = run_folder.read_loop_state(final)
    assert state["loss_type"] == "sft_loss" and state["step"] == 3 and state["weight_version"] == 3
    # resumed: the step, version and data cursor come back; an SFT resume pushes nothing until it evaluates
    again = _sft_loop(tiny_ckpt, tmp_path, demos, _Pushes(), [])
    again.resume(final)
    assert again.start_step == 3 and again.version == 3 and again.engines.push.versions == []
    assert again.collector.state_dict() == loop.collector.state_dict()
