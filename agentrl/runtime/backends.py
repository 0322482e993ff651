"""What the chosen backends need from this machine, checked before a run starts; how SGLang servers launch.

:meth:`agentrl.config.RunConfig.problems` checks values alone (the config is a leaf, it imports no
backend). :func:`backend_problems` adds what only the chosen backends can say: is megatron-core importable
and does it know every pass-through Megatron flag, is SGLang installed where it is asked for, does
the server command line build. Each probe imports its backend only when that backend is chosen.
"""

from __future__ import annotations

from typing import Any

from agentrl.config import RunConfig, agentrl_flag_names, did_you_mean, lora_target_suffixes

ROUTER_ONLY_SGLANG_ARGS = ("router_ip", "router_port", "server_concurrency", "config")
"""slime's ``--sglang-*`` flags that configure its router, not the servers (SGLang would refuse them)."""

_ARCH = "from the checkpoint's config.json"
MEGATRON_DERIVED_FIELDS = {
    **dict.fromkeys(
        (
            "num_layers",
            "hidden_size",
            "ffn_hidden_size",
            "num_attention_heads",
            "num_query_groups",
            "kv_channels",
            "normalization",
            "layernorm_epsilon",
            "gated_linear_unit",
            "activation_func",
            "add_bias_linear",
            "add_qkv_bias",
            "qk_layernorm",
        ),
        _ARCH,
    ),
    "tensor_model_parallel_size": "--tensor-model-parallel-size",
    "pipeline_model_parallel_size": "--pipeline-model-parallel-size",
    "context_parallel_size": "--context-parallel-size",
    **dict.fromkeys(
        (
            "virtual_pipeline_model_parallel_size",
            "expert_model_parallel_size",
            "expert_tensor_parallel_size",
            "num_moe_experts",
        ),
        "not supported by this backend",
    ),
    **dict.fromkeys(("params_dtype", "pipeline_dtype"), "use --dtype"),
    **dict.fromkeys(("variable_seq_lengths", "calculate_per_token_loss"), "packed rows and the global loss need it"),
}
"""Megatron flags agentrl derives itself (a pass-through value would silently fight it), with where they come from."""


def _precision_flag_problem(cfg: RunConfig, name: str, value: Any) -> list[str]:
    """slime's ``--bf16`` / ``--fp16`` accepted where they agree with ``--dtype`` (``auto``: bf16 on GPUs)."""
    want = {"bf16": "bfloat16", "fp16": "float16"}[name]
    dtype = cfg.train.dtype
    effective = dtype if dtype != "auto" else ("bfloat16" if cfg.actor_num_gpus_per_node else "float32")
    if value is True and effective == want:
        return []
    if value is False and effective != want:
        return []
    return [f"--{name} disagrees with --dtype {dtype} (training in {effective}); set --dtype {want} or drop --{name}"]


def sglang_installed() -> bool:
    import importlib.util

    return importlib.util.find_spec("sglang") is not None


def backend_problems(cfg: RunConfig) -> list[str]:
    """What the chosen backends need that this machine or these flags lack (imports only when chosen)."""
    problems: list[str] = []
    if cfg.train.initial_megatron_checkpoint and cfg.train_backend != "megatron":
        problems.append(
            "--initial-megatron-checkpoint is a megatron-core checkpoint: it needs --train-backend megatron"
        )
    if cfg.train_backend == "megatron":
        from agentrl.trainer.megatron_compat import megatron_available

        reason = megatron_available()
        if reason:
            return [f"--train-backend megatron: {reason}"]
        from agentrl.trainer.megatron_model import MODEL_FLAGS, megatron_field_names

        known = megatron_field_names()
        for name, value in cfg.train.megatron_args.items():
            if name in MODEL_FLAGS:
                continue  # slime's MODEL_ARGS: checked against config.json when the model config is built
            if name in ("bf16", "fp16"):
                problems += _precision_flag_problem(cfg, name, value)
            elif name in MEGATRON_DERIVED_FIELDS:
                problems.append(
                    f"--{name.replace('_', '-')} is set by agentrl ({MEGATRON_DERIVED_FIELDS[name]}); drop it"
                )
            elif name not in known:
                problems.append(
                    f"unknown flag --{name.replace('_', '-')}: neither agentrl's nor Megatron's"
                    + (
                        did_you_mean(name, known | agentrl_flag_names(), n=3)
                        or " (Megatron pass-through flags are TransformerConfig fields)"
                    )
                )
        if cfg.train.initial_megatron_checkpoint:
            from agentrl.trainer.megatron_model import resolve_megatron_checkpoint

            try:
                resolve_megatron_checkpoint(cfg.train.initial_megatron_checkpoint)
            except (ValueError, OSError) as exc:
                problems.append(f"--initial-megatron-checkpoint: {exc}")
        if cfg.train.context_parallel_size > 1:  # megatron's CP needs Transformer Engine's attention
            problems.append(
                "--context-parallel-size > 1 is not implemented by the megatron backend yet (it "
                "needs Transformer Engine attention); use 1 and tensor/pipeline parallelism"
            )
        recompute = sorted(k for k, v in cfg.train.megatron_args.items() if k.startswith("recompute") and v)
        if cfg.train.gradient_checkpointing or recompute:
            problems.append(
                "activation recompute (--gradient-checkpointing, --recompute-*) is not supported by "
                "the megatron backend yet; lower --max-tokens-per-gpu instead"
            )
        if not cfg.actor_num_gpus_per_node and cfg.train.dtype not in ("auto", "float32"):
            problems.append(f"--dtype {cfg.train.dtype} with the megatron backend needs GPUs; use float32 on CPU")
        if cfg.train.megatron_args.get("sequence_parallel"):
            problems.append(
                "--sequence-parallel is not supported by the megatron backend yet (its LM head "
                "runs only at response positions); drop it"
            )
    if cfg.rollout_backend == "sglang":
        if cfg.sglang_launcher == "sglang" and not sglang_installed():
            return problems + [
                "--sglang-launcher sglang: the sglang package is not installed (pip install "
                "'sglang[all]' on a GPU node), or use --sglang-launcher agentrl"
            ]
        if cfg.sglang_launcher == "sglang" and not cfg.rollout_num_gpus:
            return problems + [
                "--sglang-launcher sglang needs GPUs for its servers: set --rollout-num-gpus "
                "(and --rollout-num-gpus-per-engine), or use --sglang-launcher agentrl on CPU"
            ]
        if cfg.rollout_return_routed_experts:
            launch = sglang_launch(cfg, "<checkpoint>", engine_gpus=cfg.rollout_num_gpus)
            if launch.binary != "sglang":
                problems.append(
                    "--rollout-return-routed-experts: the servers would be agentrl serve (dense models, no experts); "
                    "it needs --sglang-launcher sglang with GPUs (--rollout-num-gpus)"
                )
            elif not cfg.sglang_args.get("enable_return_routed_experts"):
                problems.append(
                    "--rollout-return-routed-experts: the launched SGLang servers must report them: add "
                    "--sglang-enable-return-routed-experts"
                )
        from agentrl.engines.sglang import build_launch_command

        try:  # the server command line, built once here so a bad --sglang-* flag stops the run now
            build_launch_command(sglang_launch(cfg, "<checkpoint>", engine_gpus=cfg.rollout_num_gpus), port=1)
        except ValueError as exc:
            problems.append(str(exc))
    return problems


def adapter_server_args(cfg: RunConfig) -> dict[str, Any]:
    """SGLang's LoRA server args for the engines of a ``--weight-sync adapter`` run (else none): they serve the
    trainer's adapter on their unchanged base, and each weight sync sends the adapter alone.

    Not the default: on CPU the adapter's matmuls cost more decode time (~12% at r16, bench/README.md P12) than a
    shared-memory push of the merged weights on one node saves (~0.1 s a step for SmolLM2); bytes matter across
    nodes and on GPUs. The same args reach embedded engine actors (as keyword arguments) and launched servers (as
    ``--enable-lora --max-lora-rank R --lora-target-modules ...``).
    """
    train = cfg.train
    if cfg.weight_sync != "adapter":
        return {}
    targets = lora_target_suffixes(train) or ["all"]
    return {"enable_lora": True, "max_lora_rank": int(train.lora_rank), "lora_target_modules": targets}


def sglang_launch(cfg: RunConfig, checkpoint: str, *, engine_gpus: float = 0, log_dir: str | None = None) -> Any:
    """How ``--rollout-backend sglang`` starts each server (an :class:`~agentrl.engines.sglang.SGLangLaunch`).

    ``--sglang-launcher auto`` is SGLang where it is installed and the run has GPUs for it
    (``--rollout-num-gpus``), else the embedded engine (``agentrl serve``) behind the same
    launcher, monitor and pause protocol. slime's router-only flags (``--sglang-router-ip`` ...)
    are not server flags and are dropped.
    """
    from agentrl.engines.sglang import SGLangLaunch

    binary = cfg.sglang_launcher
    if binary == "auto":
        binary = "sglang" if sglang_installed() and cfg.rollout_num_gpus else "agentrl"
    args = {k: v for k, v in cfg.sglang_args.items() if k not in ROUTER_ONLY_SGLANG_ARGS}
    if binary == "agentrl":
        args.setdefault("max_running_requests", cfg.engine_max_running_requests)
    args.update(adapter_server_args(cfg))  # SGLang's LoRA flags: the servers load the policy's adapter by name
    return SGLangLaunch(
        checkpoint,
        binary=binary,
        tp_size=cfg.rollout_num_gpus_per_engine if engine_gpus else 1,
        server_args=args,
        colocate=cfg.colocate,
        seed=cfg.rollout.rollout_seed,
        log_dir=log_dir,
        host=cfg.engine_host,
    )
