"""Flags of the scale path: SGLang / Megatron pass-through, backend checks before any work, data layout."""

from __future__ import annotations

import pytest

from agentrl.config import RunConfig, TrainConfig
from agentrl.flags import load_config_file, parse_passthrough_flags, run_config_from_values
from agentrl.runtime.backends import sglang_launch
from agentrl.runtime.preflight import check_values
from agentrl.runtime.trainer_group import DataLayout


def test_passthrough_splits_sglang_and_megatron_flags():
    out = parse_passthrough_flags(
        [
            "--sglang-mem-fraction-static",
            "0.8",
            "--sglang-disable-cuda-graph",
            "--sglang-tp-size",
            "2",
            "--recompute-granularity",
            "full",
            "--sglang-cuda-graph-bs",
            "1",
            "2",
            "4",
            "--attention-softmax-in-fp32",
            "--sglang-log-level=INFO",
            "--init-method-std",
            "-0.5",
        ]
    )
    assert out["sglang_args"] == {
        "mem_fraction_static": 0.8,
        "disable_cuda_graph": True,
        "tp_size": 2,
        "cuda_graph_bs": [1, 2, 4],
        "log_level": "INFO",
    }
    assert out["megatron_args"] == {
        "recompute_granularity": "full",
        "attention_softmax_in_fp32": True,
        "init_method_std": -0.5,
    }


def test_passthrough_refuses_a_stray_value():
    with pytest.raises(ValueError, match="unexpected argument"):
        parse_passthrough_flags(["0.8"])


def _values(**kw):
    base = {
        "env": "agentrl.envs.digits:Digits",
        "rollout_batch_size": 2,
        "n_samples_per_prompt": 2,
        "global_batch_size": 4,
    }
    return {**base, **kw}


def test_cli_passes_flags_through_into_the_config(monkeypatch):
    from agentrl import cli

    seen = {}
    monkeypatch.setattr("agentrl.cli.train", lambda cfg: seen.setdefault("cfg", cfg) and {})
    rc = cli.main(
        [
            "train",
            "--env",
            "agentrl.envs.digits:Digits",
            "--rollout-backend",
            "sglang",
            "--sglang-launcher",
            "agentrl",
            "--sglang-mem-fraction-static",
            "0.7",
            "--rollout-batch-size",
            "2",
            "--global-batch-size",
            "2",
        ]
    )
    assert rc == 0
    assert seen["cfg"].sglang_args == {"mem_fraction_static": 0.7}
    assert seen["cfg"].rollout_backend == "sglang" and seen["cfg"].sglang_launcher == "agentrl"


def test_other_commands_refuse_unknown_flags(capsys):
    from agentrl import cli

    with pytest.raises(SystemExit):
        cli.main(["rollout", "--env", "agentrl.envs.digits:Digits", "--sglang-mem-fraction-static", "0.7"])
    assert "unrecognized arguments" in capsys.readouterr().err


@pytest.mark.parametrize(
    "values, message",
    [
        ({"sglang_args": {"mem_fraction_static": 0.8}}, "--sglang-mem-fraction-static needs --rollout-backend sglang"),
        ({"tensor_model_parallel_size": 2, "trainer_num_procs": 2}, "need --train-backend megatron"),
        ({"megatron_args": {"recompute_granularity": "full"}}, "Megatron flags, which need --train-backend megatron"),
        ({"megatron_args": {"rollout_batchsize": 4}}, "--rollout-batchsize (did you mean --rollout-batch-size"),
        (
            {"train_backend": "megatron", "megatron_args": {"rollout_batchsize": 4}},
            "unknown flag --rollout-batchsize: neither agentrl's nor Megatron's (did you mean --rollout-batch-size",
        ),
        ({"colocate": True, "num_engines": 2}, "--colocate puts each engine on one trainer rank's device"),
        (
            {
                "rollout_backend": "sglang",
                "sglang_launcher": "agentrl",
                "sglang_args": {"tp_size": 2},
                "rollout_num_gpus_per_engine": 1,
            },
            "--sglang-tp-size 2 disagrees with --rollout-num-gpus-per-engine 1",
        ),
        ({"rollout_backend": "vllm"}, "--rollout-backend must be embedded or sglang"),
        ({"rollout_backend": "sglang", "engine_url": ["http://127.0.0.1:1"]}, "drop --engine-url"),
        ({"train_backend": "megatron", "tensor_model_parallel_size": 2}, "must be a multiple of tensor x pipeline"),
        (
            {"rollout_backend": "sglang", "sglang_launcher": "agentrl", "sglang_args": {"port": 1234}},
            "--sglang-port is set by the launcher",
        ),
        ({"rollout_backend": "sglang", "sglang_launcher": "agentrl", "sglang_args": {"tp_size": 2}}, "tp"),
        (
            {
                "train_backend": "megatron",
                "trainer_num_procs": 4,
                "tensor_model_parallel_size": 2,
                "global_batch_size": 3,
                "rollout_batch_size": 3,
                "n_samples_per_prompt": 1,
            },
            "divisible by the trainer's data-parallel size (2)",
        ),
        (
            {"train_backend": "megatron", "megatron_args": {"recompute_granularty": "full"}},
            "unknown flag --recompute-granularty: neither agentrl's nor Megatron's (did you mean --recompute-granularity",
        ),
        (
            {"train_backend": "megatron", "context_parallel_size": 2, "trainer_num_procs": 2},
            "--context-parallel-size > 1 is not implemented",
        ),
        ({"train_backend": "megatron", "megatron_args": {"sequence_parallel": True}}, "--sequence-parallel is not"),
        ({"train_backend": "megatron", "megatron_args": {"recompute_granularity": "full"}}, "activation recompute"),
        ({"train_backend": "megatron", "gradient_checkpointing": True}, "activation recompute"),
        ({"train_backend": "megatron", "dtype": "bfloat16"}, "--dtype bfloat16 with the megatron backend needs GPUs"),
        (
            {"train_backend": "megatron", "megatron_args": {"bf16": True}},
            "--bf16 disagrees with --dtype auto (training in float32); set --dtype bfloat16",
        ),
        (
            {"train_backend": "megatron", "megatron_args": {"activation_func": "gelu"}},
            "--activation-func is set by agentrl (from",
        ),
        (
            {
                "rollout_backend": "sglang",
                "sglang_launcher": "agentrl",
                "rollout_num_gpus": 4,
                "rollout_num_gpus_per_engine": 2,
            },
            "no model parallelism",
        ),
    ],
)
def test_bad_scale_configs_are_refused_before_any_work(values, message):
    pytest.importorskip("megatron.core")
    cfg = run_config_from_values(_values(**values))
    with pytest.raises(ValueError, match="bad configuration") as err:
        check_values(cfg)
    assert message in str(err.value)


def test_sglang_launcher_needs_gpus(monkeypatch):
    import agentrl.runtime.backends as backends

    monkeypatch.setattr(backends, "sglang_installed", lambda: True)
    cfg = run_config_from_values(_values(rollout_backend="sglang", sglang_launcher="sglang"))
    cfg.validate()  # the values alone are fine: only the backend check knows about this machine
    with pytest.raises(ValueError, match="needs GPUs for its servers"):
        check_values(cfg)
    auto = run_config_from_values(_values(rollout_backend="sglang"))
    assert sglang_launch(auto, "ckpt").binary == "agentrl"  # auto on a CPU-only run: the embedded engine
    gpus = run_config_from_values(_values(rollout_backend="sglang", rollout_num_gpus=2, actor_num_gpus_per_node=2))
    assert sglang_launch(gpus, "ckpt", engine_gpus=1).binary == "sglang"


def test_sglang_launcher_needs_sglang_installed():
    import importlib.util

    if importlib.util.find_spec("sglang") is not None:
        pytest.skip("sglang is installed here")
    cfg = run_config_from_values(_values(rollout_backend="sglang", sglang_launcher="sglang"))
    with pytest.raises(ValueError, match="the sglang package is not installed"):
        check_values(cfg)


def test_good_megatron_config_validates_and_derives_data_parallel():
    pytest.importorskip("megatron.core")
    cfg = run_config_from_values(
        _values(
            train_backend="megatron",
            trainer_num_procs=4,
            tensor_model_parallel_size=2,
            megatron_args={"attention_softmax_in_fp32": True},
        )
    )
    check_values(cfg)
    assert cfg.data_parallel_size == 2 and cfg.train.model_parallel_size == 2
    assert run_config_from_values(_values(backend=None, train_backend="megatron")).train_backend == "megatron"


def test_config_file_sglang_keys_become_server_args(tmp_path):
    f = tmp_path / "run.yaml"
    f.write_text(
        "rollout_backend: sglang\nbackend: megatron\nsglang_args:\nsglang_mem_fraction_static: 0.6\n"
        "sglang_launcher: agentrl\n"
        "megatron_args:\n  recompute_granularity: full\n"
    )
    flat = load_config_file(f)
    assert flat["sglang_args"] == {"mem_fraction_static": 0.6} and flat["sglang_launcher"] == "agentrl"
    assert flat["train_backend"] == "megatron"
    assert flat["megatron_args"] == {"recompute_granularity": "full"}


@pytest.mark.parametrize("world, tp, pp, cp", [(8, 2, 2, 1), (4, 1, 1, 1), (8, 2, 1, 2), (6, 3, 2, 1)])
def test_data_layout_matches_megatron_rank_order(world, tp, pp, cp):
    """Megatron's default order is tp-cp-(ep)-dp-pp, TP fastest; recompute it independently."""
    lay = DataLayout(world, tp * pp * cp, tp * cp)
    dp = world // (tp * pp * cp)
    expected = {}
    for r in range(world):
        tp_rank, rest = r % tp, r // tp
        cp_rank, rest = rest % cp, rest // cp
        dp_rank, pp_rank = rest % dp, rest // dp
        expected[r] = (dp_rank, pp_rank, tp_rank, cp_rank)
        assert lay.dp_rank(r) == dp_rank
    for d in range(dp):
        src = lay.source_rank(d)
        assert expected[src] == (d, pp - 1, 0, 0)


def test_micro_batch_size_caps_samples_per_micro_batch():
    from agentrl.trainer.batching import pack_micro_batches

    groups = pack_micro_batches([5] * 7, max_tokens=100, max_samples=3)
    assert [len(g) for g in groups] == [3, 3, 1] and sorted(i for g in groups for i in g) == list(range(7))
    assert len(pack_micro_batches([5] * 7, max_tokens=100)) == 1
    assert TrainConfig(micro_batch_size=2).micro_batch_size == 2
    with pytest.raises(ValueError, match="--micro-batch-size"):
        TrainConfig(micro_batch_size=0).validate()
    assert RunConfig().rollout_backend == "embedded"


def test_unsupported_architecture_is_refused_before_ray_starts(tmp_path, monkeypatch):
    """A model megatron cannot express (here: a sliding window in use) stops the run before any actor."""
    pytest.importorskip("megatron.core")
    from transformers import MistralConfig

    from agentrl.runtime import train as train_mod

    ckpt = tmp_path / "mistral"
    MistralConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        sliding_window=16,
    ).save_pretrained(ckpt)
    monkeypatch.setattr(train_mod, "_Runtime", lambda *a, **k: pytest.fail("the runtime was started"))
    cfg = run_config_from_values(_values(train_backend="megatron", hf_checkpoint=str(ckpt)))
    with pytest.raises(ValueError, match="sliding"):
        train_mod.train(cfg)


def test_a_layout_the_model_cannot_take_is_refused_before_ray_starts(tiny_ckpt, monkeypatch):
    pytest.importorskip("megatron.core")
    from agentrl.runtime import train as train_mod

    monkeypatch.setattr(train_mod, "_Runtime", lambda *a, **k: pytest.fail("the runtime was started"))
    cfg = run_config_from_values(
        _values(
            train_backend="megatron",
            hf_checkpoint=str(tiny_ckpt),
            trainer_num_procs=3,
            pipeline_model_parallel_size=3,
            global_batch_size=4,
        )
    )
    with pytest.raises(ValueError, match="layers do not split evenly over 3 pipeline stages"):
        train_mod.train(cfg)


def test_max_staleness_below_the_push_interval_is_refused():
    """Between weight pushes every sample is up to interval - 1 versions old (one more with --async):
    a smaller --max-staleness would silently drop whole steps, so the run refuses it before starting."""
    from agentrl.config import RunConfig

    with pytest.raises(ValueError, match="--max-staleness must be >= 2 with --update-weights-interval 3"):
        RunConfig(env="agentrl.envs.calculator:Calculator", update_weights_interval=3).validate()
    with pytest.raises(ValueError, match="--max-staleness must be >= 3 with --update-weights-interval 3 and --async"):
        RunConfig(
            env="agentrl.envs.calculator:Calculator", update_weights_interval=3, async_mode=True, max_staleness=2
        ).validate()
    RunConfig(env="agentrl.envs.calculator:Calculator", update_weights_interval=3, max_staleness=2).validate()
    RunConfig(
        env="agentrl.envs.calculator:Calculator", async_mode=True
    ).validate()  # the defaults: interval 1, staleness 1
