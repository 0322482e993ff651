"""One preflight (issue 39, item 4): every check of a run once, before Ray or any engine starts; derived values
derived once; the resolved configuration read-only after it, and the caller's configuration left as given."""

from __future__ import annotations

import ast
import dataclasses
import json
import math
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest

from agentrl.config import RolloutConfig, RunConfig, TrainConfig
from agentrl.runtime.preflight import ResolvedRun, preflight
from agentrl.runtime.train import config_dict
from tests.test_sft_conversations import _row

ROOT = Path(__file__).resolve().parents[1]


def _rl(ckpt, **kw) -> RunConfig:
    rollout = kw.pop("rollout", {})
    return RunConfig(
        env="agentrl.envs.digits:Digits",
        hf_checkpoint=str(ckpt),
        rollout_batch_size=2,
        rollout=RolloutConfig(**{"n_samples_per_prompt": 2, "rollout_temperature": 0.7, **rollout}),
        train=TrainConfig(global_batch_size=4),
        **kw,
    )


def test_preflight_resolves_a_read_only_copy_and_leaves_the_callers_config(tiny_ckpt):
    cfg = _rl(tiny_ckpt, num_epoch=3)
    before = config_dict(cfg)
    run = preflight(cfg)
    assert isinstance(run, ResolvedRun)
    assert config_dict(cfg) == before  # the caller's object: untouched
    resolved = run.config
    assert resolved is not cfg and resolved.train is not cfg.train
    # derived values, each derived here once: the trainer's temperature, the run's length, the checkpoint folder
    assert resolved.train.logit_temperature == 0.7 and cfg.train.logit_temperature == 1.0
    assert len(run.rows) > 0 and resolved.num_rollout == math.ceil(3 * len(run.rows) / 2)
    assert resolved.hf_checkpoint == str(run.checkpoint) == str(Path(tiny_ckpt).resolve())
    assert run.args.logit_temperature == 0.7 and run.args.num_rollout == resolved.num_rollout  # args: the resolved run
    assert run.source is not None and run.demos is None and run.resume_from is None and run.resume_step is None
    # read-only from here on, every section; a changed copy is still one dataclasses.replace away
    for obj, name, value in (
        (resolved, "num_rollout", 1),
        (resolved.train, "lr", 0.1),
        (resolved.rollout, "max_turns", 9),
    ):
        with pytest.raises(dataclasses.FrozenInstanceError, match=f"{name}: a run's configuration is read-only"):
            setattr(obj, name, value)
    changed = dataclasses.replace(resolved.rollout, rollout_temperature=1.0)
    changed.max_turns = 9  # a copy is assignable
    again = preflight(resolved)  # a resolved configuration can be checked again (its own copy is writable)
    assert config_dict(again.config) == config_dict(resolved)
    assert resolved.rollout.rollout_temperature == 0.7 and changed.max_turns == 9 != resolved.rollout.max_turns


def test_steps_per_rollout_are_derived_by_the_preflight_for_the_api_and_the_flags_alike(tiny_ckpt, tmp_path):
    """Unset, ``num_steps_per_rollout`` is slime's rollout samples / ``--global-batch-size`` (1 for SFT), derived in
    one place whether the run came from flags or from Python; set, it must agree."""
    from agentrl.flags import run_config_from_values

    cfg = _rl(tiny_ckpt, rollout={"n_samples_per_prompt": 4})  # 2 prompts x 4 samples, global batches of 4
    assert cfg.train.num_steps_per_rollout is None and cfg.steps_per_rollout == 2
    run = preflight(cfg)
    assert run.config.train.num_steps_per_rollout == 2 and run.args.num_steps_per_rollout == 2
    assert cfg.train.num_steps_per_rollout is None  # the caller's: as given
    values = {"env": cfg.env, "hf_checkpoint": str(tiny_ckpt), "rollout_batch_size": 2, "n_samples_per_prompt": 4}
    from_flags = run_config_from_values({**values, "global_batch_size": 4})
    assert from_flags.train.num_steps_per_rollout is None
    assert preflight(from_flags).config.train.num_steps_per_rollout == 2
    explicit = dataclasses.replace(cfg, train=TrainConfig(global_batch_size=4, num_steps_per_rollout=3))
    with pytest.raises(ValueError, match=r"--num-steps-per-rollout \(3\) must equal rollout samples"):
        preflight(explicit)
    sft = RunConfig(sft_data=str(tmp_path / "d.jsonl"), train=TrainConfig(loss_type="sft_loss", global_batch_size=2))
    assert sft.steps_per_rollout == 1
    sft = dataclasses.replace(sft, train=TrainConfig(loss_type="sft_loss", num_steps_per_rollout=2))
    with pytest.raises(ValueError, match="sft_loss makes one optimizer step per --global-batch-size demonstrations"):
        preflight(sft)


def test_sft_preflight_derives_its_length_and_temperature_from_its_demonstrations(tiny_ckpt, tmp_path):
    data = tmp_path / "demos.jsonl"
    data.write_text("".join(json.dumps(_row()) + "\n" for _ in range(5)))
    cfg = RunConfig(
        sft_data=str(data),
        hf_checkpoint=str(tiny_ckpt),
        num_epoch=2,
        rollout=RolloutConfig(rollout_temperature=0.7),
        train=TrainConfig(loss_type="sft_loss", global_batch_size=2, logit_temperature=0.5),
    )
    run = preflight(cfg)
    assert run.demos is not None and len(run.demos) == 5 and run.source is None and run.rows == []
    assert run.config.train.logit_temperature == 1.0  # SFT fits the model itself, whatever the sampling temperature
    assert run.config.num_rollout == 2 * math.ceil(5 / 2)
    assert cfg.train.logit_temperature == 0.5 and cfg.num_rollout == RunConfig().num_rollout  # the caller's: as given


def test_checks_run_by_concern_values_first(tiny_ckpt, tmp_path):
    """A bad value is reported before the env or any file is loaded (the env here does not exist)."""
    cfg = RunConfig(env="no_such_module_anywhere:Env", hf_checkpoint=str(tiny_ckpt), rollout_batch_size=0)
    with pytest.raises(ValueError, match="bad configuration: .*--rollout-batch-size"):
        preflight(cfg)
    # values fine, the env missing: the data concern names --env
    with pytest.raises(Exception, match="no_such_module_anywhere"):
        preflight(RunConfig(env="no_such_module_anywhere:Env", hf_checkpoint=str(tiny_ckpt)))
    # data fine, a user function missing: the rollout concern names its flag, before any checkpoint is read
    cfg = _rl(tmp_path / "no-checkpoint-here", custom_rm_path="tests.no_such_module:reward")
    with pytest.raises(Exception, match="no_such_module"):
        preflight(cfg)
    cfg = _rl(tmp_path / "no-checkpoint-here", data_source_path="tests.no_such_source:build")
    with pytest.raises(Exception, match="no_such_source"):
        preflight(cfg)
    # the run's length, args for rollout workers and the fixed opponents' engines are checked before a model file
    cfg = _rl(tmp_path / "no-checkpoint-here", rollout_num_workers=2)
    with pytest.raises(ValueError, match="cannot be pickled: bad"):
        preflight(cfg, args=SimpleNamespace(bad=threading.Lock()))
    cfg = RunConfig(
        env="agentrl.envs.tictactoe:TicTacToe",
        hf_checkpoint=str(tmp_path / "no-checkpoint-here"),
        rollout=RolloutConfig(role_engine_url=["o=http://127.0.0.1:9"]),
    )
    with pytest.raises(ValueError, match=r"--role-engine-url o=http://127.0.0.1:9: the engine does not answer"):
        preflight(cfg)
    # everything before fine: the checkpoint is checked last, and named
    with pytest.raises(Exception, match="no-checkpoint-here"):
        preflight(_rl(tmp_path / "no-checkpoint-here"))


def test_the_runs_length_is_derived_by_the_preflight_for_the_api_and_the_flags_alike(tiny_ckpt, tmp_path):
    """Unset, ``num_rollout`` is 10 for RL, ``--num-epoch`` passes over the rows, or one epoch of an SFT run's
    demonstrations: the same value whether the run came from flags or from Python."""
    from agentrl.config import DEFAULT_NUM_ROLLOUT
    from agentrl.flags import run_config_from_values

    rl = _rl(tiny_ckpt)
    assert rl.num_rollout is None and preflight(rl).config.num_rollout == DEFAULT_NUM_ROLLOUT == 10
    assert preflight(_rl(tiny_ckpt, num_rollout=3)).config.num_rollout == 3
    data = tmp_path / "demos.jsonl"
    data.write_text("".join(json.dumps(_row()) + "\n" for _ in range(5)))
    sft = RunConfig(sft_data=str(data), hf_checkpoint=str(tiny_ckpt), train=TrainConfig(loss_type="sft_loss"))
    sft = dataclasses.replace(sft, train=TrainConfig(loss_type="sft_loss", global_batch_size=2))
    assert preflight(sft).config.num_rollout == math.ceil(5 / 2)  # neither given: one epoch
    assert preflight(dataclasses.replace(sft, num_rollout=4)).config.num_rollout == 4
    from_flags = run_config_from_values(
        {"sft_data": str(data), "hf_checkpoint": str(tiny_ckpt), "loss_type": "sft_loss", "global_batch_size": 2}
    )
    assert from_flags.num_epoch is None and from_flags.num_rollout is None  # the flags derive nothing
    assert preflight(from_flags).config.num_rollout == math.ceil(5 / 2)
    with pytest.raises(ValueError, match="--num-epoch and --num-rollout both set the run's length"):
        run_config_from_values({"num_epoch": 1, "num_rollout": 3})
    # a loop is built from a resolved configuration: one whose length is not derived yet is refused
    from agentrl.runtime.loop import EngineHooks, Observers, TrainLoop

    with pytest.raises(ValueError, match="pass the configuration preflight\\(\\) resolved"):
        TrainLoop(rl, collector=None, recipe=None, engines=EngineHooks(push=None), observers=Observers(metrics=None))


def test_every_bad_value_of_both_sections_is_named_at_once():
    cfg = RunConfig(rollout=RolloutConfig(n_samples_per_prompt=0, max_turns=0), train=TrainConfig(global_batch_size=0))
    with pytest.raises(ValueError) as caught:
        preflight(cfg)
    message = str(caught.value)
    for flag in ("--n-samples-per-prompt", "--max-turns", "--global-batch-size"):
        assert f"{flag} must be >= 1" in message, message
    assert cfg.problems() == cfg.rollout.problems() + cfg.train.problems() and len(cfg.problems()) == 3


def test_num_epoch_rule_is_checked_against_the_derived_length(tiny_ckpt, tmp_path):
    rows = preflight(_rl(tiny_ckpt, num_epoch=1)).rows
    length = math.ceil(len(rows) / 2)
    ppo = dataclasses.replace(
        _rl(tmp_path / "no-checkpoint-here", num_epoch=1),  # refused before the checkpoint is read
        train=TrainConfig(global_batch_size=4, advantage_estimator="ppo", num_critic_only_steps=length),
    )
    with pytest.raises(ValueError, match=rf"must be below --num-rollout \({length}, from --num-epoch 1\)"):
        preflight(ppo)


CONFIG_CLASSES = (RunConfig, RolloutConfig, TrainConfig)
FIELDS = {f.name for cls in CONFIG_CLASSES for f in dataclasses.fields(cls)} - {"rollout", "train"}
# where a configuration may be assigned: the flags that build it, and the preflight that resolves it
BUILDERS = {"agentrl/flags.py", "agentrl/runtime/preflight.py"}


def _config_holder(node: ast.expr) -> bool:
    """``cfg``, ``self.cfg``, ``ctx.config``, ``run.config`` or a section of one (``cfg.train``, ``self.cfg.rollout``);
    a bare ``config`` is left out: HF and megatron-core model configs go by that name."""
    if isinstance(node, ast.Name):
        return node.id == "cfg"
    if isinstance(node, ast.Attribute):
        if node.attr == "cfg":
            return True
        if node.attr == "config":
            inner = node.value
            return (isinstance(inner, ast.Name) and inner.id in ("ctx", "run")) or (
                isinstance(inner, ast.Attribute) and inner.attr == "ctx"
            )
        if node.attr in ("train", "rollout"):
            return _config_holder(node.value)
    return False


def _assignments(tree: ast.AST) -> list[tuple[int, str]]:
    """Every assignment to a config field on a config holder: (line, target)."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        else:
            continue
        for t in targets:
            if isinstance(t, ast.Attribute) and t.attr in FIELDS and _config_holder(t.value):
                found.append((node.lineno, ast.unparse(t)))
    return found


def test_no_module_assigns_a_run_configuration_after_the_preflight():
    """Source check: only the flags and the preflight assign a config field; every other module reads.

    It sees the names the code gives a configuration (``cfg``, ``self.cfg``, ``ctx.config``, ``run.config`` and their
    ``train`` / ``rollout`` sections), not aliases or ``setattr``; the read-only configuration catches those at run
    time (every end-to-end run trains on one)."""
    found = [
        f"{path.relative_to(ROOT).as_posix()}:{line} {target}"
        for path in sorted((ROOT / "agentrl").rglob("*.py"))
        if path.relative_to(ROOT).as_posix() not in BUILDERS
        for line, target in _assignments(ast.parse(path.read_text()))
    ]
    assert found == []


def test_the_source_check_sees_an_assignment():
    """The check above can fail: it flags the shapes train() used to write, and not a model's own config."""
    tree = ast.parse(
        "cfg.num_rollout = 3\ncfg.train.logit_temperature = 1.0\nself.cfg.rollout.max_turns += 1\n"
        "self.ctx.config.max_turns = 2\nmodel.config.dtype = 'x'\nconfig.calculate_per_token_loss = True"
    )
    assert [t for _, t in _assignments(tree)] == [
        "cfg.num_rollout",
        "cfg.train.logit_temperature",
        "self.cfg.rollout.max_turns",
        "self.ctx.config.max_turns",
    ]
