"""Every flag of every ``agentrl`` subcommand says what it does (``--help`` is the flag reference)."""

from __future__ import annotations

import argparse

from agentrl import cli


def _parsers(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()):
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _parsers(sub, (*path, name))


def test_every_flag_of_every_subcommand_has_help():
    missing = []
    for path, parser in _parsers(cli.build_parser()):
        parser.format_help()  # a stray % in a help text fails here
        for action in parser._actions:
            if action.option_strings and action.dest != "help" and not (action.help or "").strip():
                missing.append(f"agentrl {' '.join(path)} {action.option_strings[0]}")
    assert not missing, "flags without help: " + ", ".join(missing)


def test_train_help_lists_the_algorithm_knobs():
    train = dict(_parsers(cli.build_parser()))[("train",)].format_help()
    for flag in ("--eps-clip", "--kl-loss-coef", "--use-tis", "--advantage-estimator", "--lr"):
        assert flag in train


def _option(parser: argparse.ArgumentParser, flag: str) -> argparse.Action:
    return next(a for a in parser._actions if flag in a.option_strings)


def test_subcommands_take_config_flags_from_the_same_fields():
    """rollout/eval/check-env declare no config flag by hand: help, choices and type are the field's."""
    import dataclasses

    from agentrl.flags import flag_fields

    parsers = dict(_parsers(cli.build_parser()))
    fields = flag_fields()
    seen = 0
    for path in (("rollout",), ("eval",), ("check-env",), ("serve",), ("view",)):
        for action in parsers[path]._actions:
            # serve's own flags are SGLang's server flags (its --seed is the engine's): only the model is shared
            if (
                action.dest in fields
                and action.option_strings
                and (path[0] not in ("serve", "view") or action.dest == "hf_checkpoint")
            ):
                f = fields[action.dest]
                seen += 1
                assert action.option_strings[0] == "--" + f.name.replace("_", "-"), (path, action.dest)
                assert action.choices == f.metadata["choices"], (path, action.dest)
                if not (path == ("eval",) and f.name == "eval_prompt_data"):
                    assert action.help == f.metadata["help"], (path, action.dest)
                train = _option(parsers[("train",)], action.option_strings[0])
                assert (train.type, train.nargs, train.choices) == (action.type, action.nargs, action.choices)
                if f.default is not dataclasses.MISSING:  # rollout/eval defaults are the dataclass's
                    assert action.default == f.default, (path, action.dest)
    assert seen > 60
    # every RolloutConfig field is a rollout and an eval flag
    from agentrl.config import RolloutConfig

    for path in (("rollout",), ("eval",)):
        dests = {a.dest for a in parsers[path]._actions}
        assert {f.name for f in dataclasses.fields(RolloutConfig)} <= dests


def test_choices_live_in_field_metadata_and_validate_uses_them():
    import pytest

    from agentrl.config import RolloutConfig, RunConfig, TrainConfig

    p = cli.build_parser()
    with pytest.raises(SystemExit):
        p.parse_args(["rollout", "--env", "x:Y", "--sandbox", "vm"])
    with pytest.raises(SystemExit):
        p.parse_args(["train", "--advantage-estimator", "ppo2"])
    with pytest.raises(ValueError, match="--sandbox must be auto, docker, local or process"):
        RolloutConfig(sandbox="vm").validate()
    with pytest.raises(ValueError, match="--kl-loss-type must be k1, k2 or k3"):
        TrainConfig(kl_loss_type="k4").validate()
    with pytest.raises(ValueError, match="--weight-sync must be auto, tensor, disk, nccl or adapter"):
        RunConfig(env="agentrl.envs.digits:Digits", weight_sync="rdma").validate()


def test_rollout_flags_build_the_rollout_config():
    from agentrl.flags import rollout_config_from_args

    args = cli.build_parser().parse_args(
        ["rollout", "--env", "x:Y", "--rollout-stop", "###", "--rollout-stop-token-ids", "7", "--max-turns", "3"]
    )
    cfg = rollout_config_from_args(args)
    assert cfg.rollout_stop == ["###"] and cfg.rollout_stop_token_ids == [7] and cfg.max_turns == 3
    assert cli.build_parser().parse_args(["rollout"]).engine_max_running_requests == 32


def test_derived_values_come_from_one_place():
    """``logit_temperature`` and the critic-only rule are written once (config.py), read by the preflight
    (which sets ``TrainConfig.logit_temperature`` from it: tests/test_preflight.py) and by ``problems()``."""
    from agentrl.config import RolloutConfig, RunConfig, TrainConfig
    from agentrl.flags import run_config_from_values

    rl = RunConfig(rollout=RolloutConfig(rollout_temperature=0.7))
    sft = RunConfig(rollout=RolloutConfig(rollout_temperature=0.7), train=TrainConfig(loss_type="sft_loss"))
    assert rl.trainer_logit_temperature == 0.7 and sft.trainer_logit_temperature == 1.0
    # the flags build the configuration as given; the derived temperature is the preflight's to set
    assert run_config_from_values({"rollout_temperature": 0.7}).trainer_logit_temperature == 0.7
    assert (
        run_config_from_values({"rollout_temperature": 0.7, "loss_type": "sft_loss"}).trainer_logit_temperature == 1.0
    )
    ppo = RunConfig(num_rollout=3, train=TrainConfig(advantage_estimator="ppo", num_critic_only_steps=3))
    ok, problem = ppo.critic_only_rule(ppo.num_rollout)
    assert not ok and problem in ppo.problems()
    assert ppo.critic_only_rule(4)[0] and not ppo.critic_only_rule(2, ", from --num-epoch 1")[0]
    assert "(2, from --num-epoch 1): the actor would never train" in ppo.critic_only_rule(2, ", from --num-epoch 1")[1]
    assert RunConfig(num_rollout=1, train=TrainConfig(num_critic_only_steps=3)).critic_only_rule(1)[
        0
    ]  # grpo: no critic


def test_a_checkpoint_without_a_critic_is_refused_for_ppo(tmp_path):
    import pytest

    from agentrl.runtime import run_folder

    ckpt = tmp_path / "iter_0000001"
    ckpt.mkdir()
    run_folder.check_critic(ckpt, ppo=False)  # a grpo resume needs none
    with pytest.raises(ValueError, match=r"holds no critic \(critic/\): it was not a ppo run"):
        run_folder.check_critic(ckpt, ppo=True)
    (ckpt / run_folder.CRITIC_DIR).mkdir()
    run_folder.check_critic(ckpt, ppo=True)
