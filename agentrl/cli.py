"""The ``agentrl`` command: ``train``, ``sft``, ``rollout``, ``eval``, ``view``, ``serve``, ``check-env``,
``env-serve`` (an env over OpenEnv's protocol), ``proxy`` (record agents written against the OpenAI API), ``sandbox``.

Flag names follow slime where the concept is the same (``--hf-checkpoint``, ``--prompt-data``,
``--input-key``, ``--label-key``, ``--n-samples-per-prompt``, ``--rollout-max-turn-len``,
``--rollout-temperature``, ``--custom-generate-function-path``, ``--custom-rm-path``, ...).
Bad flags are refused before any model is loaded, with the flag to change in the message.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import logging
import os
import sys
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from agentrl import sandbox
from agentrl.check import check_env
from agentrl.checkpoint import resolve_hf_checkpoint
from agentrl.config import RolloutConfig
from agentrl.data import load_tasks, task_rows
from agentrl.engines.http import API_KEY_ENV
from agentrl.flags import (
    ROLLOUT_FIELDS,
    add_config_flags,
    add_field_flags,
    load_config_file,
    naming_flag,
    parse_passthrough_flags,
    rollout_config_from_args,
    run_config_from_values,
)
from agentrl.http_guard import DEFAULT_MAX_BODY_MB, max_body_bytes, resolve_api_key
from agentrl.proxy.command import add_proxy_parser, cmd_proxy
from agentrl.registry import load_env
from agentrl.rollout.context import command_context, command_engine_urls, load_tokenizer
from agentrl.rollout.eval import evaluate, format_eval
from agentrl.rollout.generate import BatchGenerate, check_apply_chat_template, check_rollout_features, generate_rollout
from agentrl.runtime.train import train
from agentrl.sandbox import audit, close_default_pool
from agentrl.sandbox import docker as docker_backend
from agentrl.sandbox.base import DEFAULT_IMAGE, SandboxError
from agentrl.sandbox.image import build_image
from agentrl.user_code import load_function
from agentrl.view import cmd_view

log = logging.getLogger("agentrl")


def _add_model_args(p: argparse.ArgumentParser) -> None:
    add_field_flags(p, ["hf_checkpoint"])


# the run fields a rollout or eval uses besides RolloutConfig's (same flags, help and defaults as train's)
_ROLLOUT_RUN_FIELDS = (
    "hf_checkpoint",
    "env",
    "prompt_data",
    "engine_url",
    "custom_generate_function_path",
    "rollout_function_path",
    "custom_rm_path",
    "engine_max_running_requests",
)


def _add_rollout_args(p: argparse.ArgumentParser) -> None:
    """``rollout``/``eval``: every RolloutConfig field and the run fields above, generated from the
    dataclasses (:func:`agentrl.flags.add_field_flags`); then the flags only these commands have."""
    add_field_flags(p, (*_ROLLOUT_RUN_FIELDS, *ROLLOUT_FIELDS))
    p.add_argument("--num-tasks", type=int, default=None, help="use only the first N tasks")
    p.add_argument(
        "--engine-api",
        default="generate",
        choices=["generate", "chat"],
        help="generate: SGLang-native token in/out (exact); chat: OpenAI chat completions, text in/out, "
        "samples marked token_exact=false (for evaluating API models)",
    )
    p.add_argument(
        "--model", default=None, help="model name sent to a chat-completions API (default: the first of /v1/models)"
    )
    p.add_argument("--api-key-env", default="OPENAI_API_KEY", help="environment variable holding the chat API key")
    p.add_argument("--chat-template", default=None, help="jinja2 chat template file overriding the tokenizer's")
    p.add_argument("--engine-log", default=None, help="file for the embedded engine's log")


def _config_from_args(a: argparse.Namespace) -> RolloutConfig:
    cfg = rollout_config_from_args(a)
    cfg.validate()
    sandbox.configure(cfg.sandbox_config())
    return cfg


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="agentrl", description=__doc__.split("\n")[0])
    parser.add_argument("--log-level", default="WARNING", help="DEBUG, INFO, WARNING or ERROR")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("rollout", help="run episodes and write one JSON Sample per line")
    _add_rollout_args(p)
    p.add_argument("--output", default="samples.jsonl", help="JSONL file the samples are written to")

    s = sub.add_parser(
        "serve",
        help="serve the embedded engine (SGLang-compatible HTTP API)",
        description="Serve the embedded engine: SGLang's native API and OpenAI's. With an API key (--api-key-file, "
        "$AGENTRL_ENGINE_API_KEY or --api-key) every route needs 'Authorization: Bearer KEY' except the open ones, "
        "SGLang's set: /health, /health_generate (every /health* path) and /metrics (every /metrics* path).",
    )
    _add_model_args(s)
    s.add_argument("--host", default="127.0.0.1", help="address to listen on (set an API key when not loopback)")
    s.add_argument("--port", type=int, default=30000, help="port to listen on")
    s.add_argument("--max-running-requests", type=int, default=32, help="requests decoded together in one batch")
    s.add_argument(
        "--context-length", type=int, default=None, help="max tokens per request (default: the model's, or its window)"
    )
    s.add_argument("--seed", type=int, default=None, help="seed of the engine's sampling generator")
    s.add_argument(
        "--enable-memory-saver",
        action="store_true",
        help="let /release_memory_occupation free the KV cache (SGLang's flag; without it a release frees nothing)",
    )
    s.add_argument(
        "--enable-torch-compile",
        action="store_true",
        help="run decode steps through torch.compile (SGLang's flag): compiled before serving (1-3 minutes on CPU, "
        "which needs a C++ compiler), up to ~10%% of a CPU decode step (~4%% measured end to end); for long runs",
    )
    s.add_argument(
        "--torch-compile-max-bs",
        type=int,
        default=32,
        help="largest decode batch the compiled step serves (SGLang's flag); bigger ones run eager",
    )
    s.add_argument(
        "--enable-lora",
        action="store_true",
        help="serve LoRA adapters (SGLang's flag; on by itself with --lora-paths): chosen per request by lora_path "
        "(/generate, per batch row too) or the OpenAI model 'base:adapter', several in one batch",
    )
    s.add_argument(
        "--lora-paths",
        nargs="+",
        default=None,
        metavar="ADAPTER",
        help="PEFT adapter folders loaded at start (SGLang's forms): PATH, NAME=PATH or "
        '\'{"lora_name": ..., "lora_path": ..., "pinned": ...}\'',
    )
    s.add_argument(
        "--max-loras-per-batch",
        type=int,
        default=8,
        help="adapters the running rows may use at once, no adapter counting as one (SGLang's flag, default 8)",
    )
    s.add_argument(
        "--max-loaded-loras", type=int, default=None, help="adapters loaded at once (SGLang's flag; default: no limit)"
    )
    s.add_argument(
        "--max-lora-rank",
        type=int,
        default=None,
        help="largest rank /load_lora_adapter takes (SGLang's flag; default: the largest of --lora-paths)",
    )
    s.add_argument(
        "--lora-target-modules",
        nargs="+",
        default=None,
        metavar="MODULE",
        help="layers adapters may target: q_proj k_proj v_proj o_proj gate_proj up_proj down_proj, or all "
        "(SGLang's flag; default: those of --lora-paths, or all)",
    )
    s.add_argument(
        "--tool-call-parser",
        default="hermes",
        help="parse tool calls in /v1/chat/completions replies (SGLang's flag; SGLang has none by default): "
        "hermes (default, the built-in tool template's format), qwen, llama3_json, none",
    )
    s.add_argument(
        "--api-key",
        default=None,
        help="require 'Authorization: Bearer KEY' on every route but the open ones, /health* and /metrics* "
        "(SGLang's flag and set). Every local user can read a key given here in /proc/PID/cmdline: prefer "
        "--api-key-file or $AGENTRL_ENGINE_API_KEY (read when neither flag is given). Set one whenever --host is "
        "not loopback",
    )
    s.add_argument(
        "--api-key-file",
        default=None,
        metavar="PATH",
        help="read the API key from this file (one line; chmod 600 it) instead of --api-key",
    )
    s.add_argument(
        "--max-body-mb",
        type=float,
        default=DEFAULT_MAX_BODY_MB,
        help=f"largest request body in MiB (default {DEFAULT_MAX_BODY_MB}, at most 4096); a larger one is answered 413. "
        "Raise it for pictures sent inline as data URLs",
    )
    s.add_argument(
        "--weight-ipc-dir",
        default=None,
        metavar="DIR",
        help="opt in to /update_weights_from_tensor (colocated sync): a private folder (yours, mode 0700; e.g. "
        "mktemp -d -p /dev/shm) where a trainer without CUDA writes the CPU tensors it hands over "
        "(TensorTransport(ipc_dir=DIR)). Without it every tensor handle, CPU or CUDA, is refused; "
        "/update_weights_from_disk needs no folder",
    )
    s.add_argument(
        "--dist-timeout",
        type=float,
        default=60.0,
        metavar="SECONDS",
        help="longest wait of /init_weights_update_group for the other ranks of a weight-update group (SGLang's "
        "flag for its torch.distributed timeouts; default 60, at most 3600): the trainer joins as rank 0 within "
        "seconds. One group joins at a time; another call meanwhile is refused at once",
    )
    s.add_argument("--exit-with-stdin", action="store_true", help=argparse.SUPPRESS)

    e = sub.add_parser(
        "eval", help="mean reward and pass@k per eval set, against the embedded engine or any engine URL"
    )
    _add_rollout_args(e)
    add_field_flags(
        e,
        ["eval_prompt_data", "n_samples_per_eval_prompt"],
        eval_prompt_data={"required": True, "help": "an eval set: NAME PATH (repeatable)"},
    )
    e.add_argument("--success-threshold", type=float, default=1.0, help="a sample passes when reward >= this")
    e.add_argument("--output", default=None, help="write the results as JSON here")

    for name, help_, description in (
        (
            "train",
            "GRPO-family training: rollout on engines, train on Ray actors, sync weights",
            "Flags follow slime's names; --config FILE.yaml|.toml holds the same keys (flags on the command line "
            "win). Pass-through: --sglang-NAME VALUE goes to every SGLang server as --NAME VALUE (--rollout-backend "
            "sglang); any other unknown --NAME VALUE is a Megatron flag (a megatron-core TransformerConfig field, "
            "--train-backend megatron).",
        ),
        (
            "sft",
            "warm start: supervised fine-tuning on token-exact demonstrations (= train --loss-type sft_loss)",
            "The flags of `agentrl train` (slime's names); demonstrations come from exactly one of --sft-data FILE "
            "(conversations {messages, tools}), --demo-policy MODULE:FN (a scripted policy played on --env) or "
            "--demo-engine-url URL (rejection sampling). --num-epoch passes (default 1); --save keeps iter_* HF "
            "checkpoints that `agentrl train --hf-checkpoint RUN_DIR` starts RL from.",
        ),
    ):
        t = sub.add_parser(name, help=help_, description=description, allow_abbrev=False)
        t.add_argument("--config", default=None, help="YAML or TOML file of flag values")
        add_config_flags(t)

    c = sub.add_parser("check-env", help="exercise an env without a model; exit 1 on contract violations")
    add_field_flags(
        c, ["env", "prompt_data", "input_key", "label_key", "trust_row_code", "sandbox"], env={"required": True}
    )
    c.add_argument("--num-tasks", type=int, default=3, help="tasks to play (scripted, random, malformed actions)")
    c.add_argument(
        "--step-timeout", type=float, default=30.0, help="seconds a reset/step may take before it counts as hanging"
    )
    c.add_argument("--json", action="store_true", help="print the report as JSON")

    es = sub.add_parser(
        "env-serve", help="serve an env over OpenEnv's protocol (/ws sessions, /schema, /health) to OpenEnv/TRL clients"
    )
    add_field_flags(
        es, ["env", "prompt_data", "input_key", "label_key", "trust_row_code", "sandbox"], env={"required": True}
    )
    es.add_argument("--host", default="127.0.0.1", help="address to listen on (the env runs what clients send)")
    es.add_argument("--port", type=int, default=8000, help="port to listen on")
    es.add_argument("--max-sessions", type=int, default=8, help="sessions at once; one more gets CAPACITY_REACHED")
    es.add_argument(
        "--step-timeout",
        type=float,
        default=60.0,
        help="seconds a reset/step may take (an env's own step_timeout wins)",
    )
    es.add_argument(
        "--idle-timeout",
        type=float,
        default=300.0,
        help="seconds a session may wait for its client's next message before it is closed (its env too): "
        "abandoned connections cannot hold every slot; raise it when a client's model may think longer on one turn",
    )
    es.add_argument(
        "--api-key",
        default=None,
        help="require 'Authorization: Bearer KEY' on every route but /health (OpenEnv clients, which send no "
        "headers, put it in the address: http://agentrl:KEY@HOST:PORT); prefer --api-key-file or "
        "$AGENTRL_ENV_SERVE_API_KEY (the default), which stay out of the process list. Set one whenever "
        "--host is not loopback",
    )
    es.add_argument("--api-key-file", default=None, help="read the key from this file (chmod 600) instead")
    es.add_argument(
        "--max-body-mb",
        type=float,
        default=DEFAULT_MAX_BODY_MB,
        help="largest request body and WebSocket message, in MiB, at most 4096 (one more is refused: 413, or the session "
        "closed with 1009); raise it for envs whose actions carry large payloads",
    )
    es.add_argument(
        "--allow-host-sandbox",
        action="store_true",
        help="serve an env whose tools run model code even when its sandboxes are the 'process' backend, which "
        "lets that code read this machine's files (refused without this flag: use --sandbox docker or local)",
    )

    v = sub.add_parser("view", help="write a self-contained HTML page showing samples token by token")
    v.add_argument("samples", help="JSONL of Samples (agentrl rollout output or a training rollout dump)")
    v.add_argument("-o", "--output", default=None, help="HTML file to write (default: SAMPLES with .html)")
    _add_model_args(v)
    v.add_argument("--limit", type=int, default=None, help="show only the first N samples")
    m = sub.add_parser(
        "merge-lora",
        help="fold a LoRA adapter into its base and write a plain Hugging Face checkpoint",
        description="Fold a PEFT LoRA adapter (a policy's iter_N/adapters/NAME, a run's iter_N/adapter, a one-policy "
        "run's iter_N) into its base model and write an HF checkpoint (fp32 safetensors, config, tokenizer) that "
        "--hf-checkpoint, engines without LoRA and from_pretrained load.",
    )
    m.add_argument("adapter", help="the PEFT adapter folder (adapter_config.json + adapter_model.safetensors)")
    m.add_argument("--out", required=True, help="the folder to write (new or empty: nothing is overwritten)")
    m.add_argument(
        "--base", default=None, help="the base model folder (default: the adapter's base_model_name_or_path)"
    )
    _add_sandbox_parser(sub)
    add_proxy_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    if rest and args.command not in ("train", "sft"):  # only train/sft pass flags through (to SGLang / Megatron)
        parser.parse_args(argv)  # exits with argparse's own "unrecognized arguments" message
    args.passthrough = rest
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        if args.command == "rollout":
            return cmd_rollout(args)
        if args.command == "eval":
            return cmd_eval(args)
        if args.command in ("train", "sft"):
            return cmd_train(args)
        if args.command == "serve":
            return cmd_serve(args)
        if args.command == "check-env":
            return cmd_check_env(args)
        if args.command == "env-serve":
            from agentrl.adapters.openenv_server import cmd_env_serve

            return cmd_env_serve(args)
        if args.command == "view":
            return cmd_view(args)
        if args.command == "proxy":
            return cmd_proxy(args)
        if args.command == "sandbox":
            return cmd_sandbox(args)
        if args.command == "merge-lora":
            return cmd_merge_lora(args)
    except (ValueError, FileNotFoundError, ImportError, AttributeError, TypeError) as exc:
        print(f"agentrl {args.command}: error: {exc}", file=sys.stderr)
        return 2
    return 2


def cmd_merge_lora(args: argparse.Namespace) -> int:
    """``agentrl merge-lora``: :func:`agentrl.trainer.lora_merge.merge_adapter`, its refusals as exit code 2."""
    from agentrl.trainer.lora_merge import merge_adapter

    try:
        out = merge_adapter(args.adapter, args.out, args.base)
    except (OSError, RuntimeError) as exc:  # (FileExistsError is an OSError; ValueError: main's handler)
        print(f"agentrl merge-lora: error: {exc}", file=sys.stderr)
        return 2
    print(f"merged {args.adapter} into its base: {out}")
    return 0


# -- sandbox ----------------------------------------------------------------------------------------


def _add_sandbox_parser(sub: Any) -> None:
    sb = sub.add_parser("sandbox", help="the Docker sandbox: build its image, remove leftover containers, audit it")
    actions = sb.add_subparsers(dest="sandbox_action", required=True)
    b = actions.add_parser("build", help="build the sandbox image from this host's Debian Python (no registry needed)")
    b.add_argument("--image", default=DEFAULT_IMAGE, help="name:tag to build")
    b.add_argument("--python", default="/usr/bin/python3.11", help="the host's Debian Python interpreter to copy")
    r = actions.add_parser("reap", help="remove sandbox containers of dead or expired runs (--all: every one)")
    r.add_argument("--all", action="store_true", help="remove every agentrl sandbox container, live runs' too")
    # every argument after "check" (options included) belongs to the audit: no '-' options here
    c = actions.add_parser(
        "check",
        help="run hostile programs against a backend (agentrl sandbox check --help)",
        add_help=False,
        prefix_chars="\x01",
    )
    c.add_argument("rest", nargs=argparse.REMAINDER)


def cmd_sandbox(args: argparse.Namespace) -> int:
    """``agentrl sandbox build|reap|check``; check hands its arguments to ``agentrl.sandbox.audit.main``."""
    try:
        if args.sandbox_action == "check":
            return int(audit.main(list(args.rest)) or 0)
        reason = docker_backend.unavailable_reason()
        if reason:
            raise SandboxError(reason)
        if args.sandbox_action == "build":
            logging.getLogger("agentrl.sandbox").setLevel(logging.INFO)
            print(build_image(args.image, python=args.python))
            return 0
        removed = docker_backend.reap(everything=args.all)
        print(f"removed {removed} sandbox container(s)")
        return 0
    except SandboxError as exc:
        print(f"agentrl sandbox {args.sandbox_action}: error: {exc}", file=sys.stderr)
        return 1


# -- serve ------------------------------------------------------------------------------------------


def _exit_when_stdin_closes() -> None:
    def watch() -> None:
        try:
            while sys.stdin.buffer.read(1024):
                pass
        finally:
            os._exit(0)

    threading.Thread(target=watch, daemon=True, name="agentrl-parent-watch").start()


def cmd_serve(args: argparse.Namespace) -> int:
    from agentrl.engines.local.distributed import check_rendezvous_timeout
    from agentrl.engines.local.openai_routes import openai_tool_parser
    from agentrl.engines.local.server import serve

    api_key = resolve_api_key(args.api_key, file=args.api_key_file, env=API_KEY_ENV)  # before the model loads
    max_body_bytes(args.max_body_mb)
    check_rendezvous_timeout(args.dist_timeout)
    if args.weight_ipc_dir:
        from agentrl.engines.ipc_folder import IpcFolder

        IpcFolder(args.weight_ipc_dir)  # a folder other users could write into: refused before the model loads
    ckpt = resolve_hf_checkpoint(args.hf_checkpoint)
    tool_parser = openai_tool_parser(args.tool_call_parser)
    if args.exit_with_stdin:
        _exit_when_stdin_closes()
    serve(
        ckpt,
        host=args.host,
        port=args.port,
        max_running_requests=args.max_running_requests,
        context_length=args.context_length,
        seed=args.seed,
        enable_memory_saver=args.enable_memory_saver,
        enable_torch_compile=args.enable_torch_compile,
        torch_compile_max_bs=args.torch_compile_max_bs,
        enable_lora=args.enable_lora,
        lora_paths=args.lora_paths,
        max_loras_per_batch=args.max_loras_per_batch,
        max_loaded_loras=args.max_loaded_loras,
        max_lora_rank=args.max_lora_rank,
        lora_target_modules=args.lora_target_modules,
        tool_parser=tool_parser,
        api_key=api_key,
        max_body_mb=args.max_body_mb,
        weight_ipc_dir=args.weight_ipc_dir,
        dist_timeout=args.dist_timeout,
    )
    return 0


# -- train ----------------------------------------------------------------------------------------


def cmd_train(args: argparse.Namespace) -> int:
    values = dict(vars(args))
    passthrough = parse_passthrough_flags(values.pop("passthrough", None) or [])
    if args.config:
        file_values = load_config_file(args.config)
        for mine, other in (("num_epoch", "num_rollout"), ("num_rollout", "num_epoch")):
            if values.get(mine) is not None:  # both set the run's length: the command line's choice wins
                file_values.pop(other, None)
        # flags given on the command line win over the file; a flag left unset is None here
        values = {**values, **{k: v for k, v in file_values.items() if values.get(k) is None}}
    for key, given in passthrough.items():  # command-line pass-through flags win over the file's
        values[key] = {**(values.get(key) or {}), **given}
    if args.command == "sft":
        if values.get("loss_type") not in (None, "sft_loss"):
            raise ValueError(
                f"agentrl sft trains with --loss-type sft_loss, not {values['loss_type']}; use agentrl train for RL"
            )
        values["loss_type"] = "sft_loss"
    cfg = run_config_from_values(values)
    summary = train(cfg)
    print(json.dumps(summary, indent=2, default=str))
    return 0


# -- check-env --------------------------------------------------------------------------------------


def cmd_check_env(args: argparse.Namespace) -> int:
    sandbox.configure(sandbox.SandboxConfig(backend=args.sandbox))
    with naming_flag("--env", args.env):
        factory = load_env(args.env)
    if args.prompt_data or getattr(factory, "tasks", None) is not None:
        tasks = _load_task_rows(args, factory)  # a broken tasks() is an error to report, not to skip
    else:
        tasks = []  # no task source: check_env plays a generic arithmetic task
    report = asyncio.run(_check_env(factory, tasks[: args.num_tasks], args.step_timeout))
    print(json.dumps(report.to_dict(), indent=2) if args.json else report.format())
    return 0 if report.ok else 1


async def _check_env(factory: Any, tasks: list[dict[str, Any]], step_timeout: float) -> Any:
    try:
        return await check_env(factory, tasks, step_timeout=step_timeout)
    finally:
        await close_default_pool()


# -- rollout ----------------------------------------------------------------------------------------


def _load_task_rows(args: argparse.Namespace, factory: Any) -> list[dict[str, Any]]:
    with naming_flag("--prompt-data" if args.prompt_data else "--env", args.prompt_data or args.env):
        rows = task_rows(
            factory,
            args.prompt_data,
            input_key=args.input_key,
            label_key=args.label_key,
            env_name=args.env,
            trust_row_code=args.trust_row_code,
        )
    return rows[: args.num_tasks] if getattr(args, "num_tasks", None) else rows


def cmd_rollout(args: argparse.Namespace) -> int:
    cfg = _config_from_args(args)
    if not args.env and not args.custom_generate_function_path and not args.rollout_function_path:
        raise ValueError(
            "pass --env MODULE:CLASS (or --custom-generate-function-path / --rollout-function-path module:fn)"
        )
    if args.custom_generate_function_path and args.rollout_function_path:
        raise ValueError("pass one of --custom-generate-function-path (one sample) and --rollout-function-path (all)")
    with naming_flag("--env", args.env):
        factory = load_env(args.env) if args.env else None
    tasks = _load_task_rows(args, factory) if (factory or args.prompt_data) else []
    if not tasks:
        raise ValueError("no tasks: pass --prompt-data FILE.jsonl")
    custom_generate = _custom_generate(args, evaluation=False)
    check_apply_chat_template(cfg, custom=custom_generate is not None, rows=tasks)
    check_rollout_features(cfg, tasks, custom=custom_generate is not None)  # before any engine starts
    custom_rm = load_function(args.custom_rm_path) if args.custom_rm_path else None
    ckpt = resolve_hf_checkpoint(args.hf_checkpoint)
    tokenizer, template_src = load_tokenizer(ckpt, args.chat_template)
    with contextlib.ExitStack() as stack:
        urls = command_engine_urls(args, ckpt, stack)
        summary = asyncio.run(
            _rollout(args, cfg, factory, tasks, urls, tokenizer, template_src, custom_generate, custom_rm)
        )
    print(json.dumps(summary, indent=2))
    return 0


# -- eval -------------------------------------------------------------------------------------------


def _custom_generate(args: argparse.Namespace, *, evaluation: bool) -> Any:
    """``--custom-generate-function-path`` (one sample) or ``--rollout-function-path`` (the batch, told whether
    it evaluates, as slime's), loaded and checked; None when neither is given."""
    if args.custom_generate_function_path and args.rollout_function_path:
        raise ValueError("pass one of --custom-generate-function-path (one sample) and --rollout-function-path (all)")
    if args.custom_generate_function_path:
        with naming_flag("--custom-generate-function-path", args.custom_generate_function_path):
            return load_function(args.custom_generate_function_path)
    if args.rollout_function_path:
        with naming_flag("--rollout-function-path", args.rollout_function_path):
            return dataclasses.replace(BatchGenerate.load(args.rollout_function_path), evaluation=evaluation)
    return None


def cmd_eval(args: argparse.Namespace) -> int:
    cfg = _config_from_args(args)
    if args.n_samples_per_eval_prompt < 1:
        raise ValueError("--n-samples-per-eval-prompt must be >= 1")
    custom_generate = _custom_generate(args, evaluation=True)  # the run's episodes, as agentrl train evaluates
    if not args.env and custom_generate is None:
        raise ValueError("pass --env MODULE:CLASS (or --custom-generate-function-path / --rollout-function-path)")
    with naming_flag("--env", args.env):
        factory = load_env(args.env) if args.env else None
    datasets = {}
    for name, path in args.eval_prompt_data:
        with naming_flag("--eval-prompt-data", f"{name} {path}"):
            loaded = load_tasks(
                path, input_key=args.input_key, label_key=args.label_key, trust_row_code=args.trust_row_code
            )
            datasets[name] = loaded[: args.num_tasks]
    eval_rows = [r for rows in datasets.values() for r in rows]
    check_apply_chat_template(cfg, custom=custom_generate is not None, rows=eval_rows)
    check_rollout_features(cfg, eval_rows, custom=custom_generate is not None)  # before any engine starts
    custom_rm = load_function(args.custom_rm_path) if args.custom_rm_path else None
    ckpt = resolve_hf_checkpoint(args.hf_checkpoint)
    tokenizer, template_src = load_tokenizer(ckpt, args.chat_template)
    with contextlib.ExitStack() as stack:
        urls = command_engine_urls(args, ckpt, stack)
        results = asyncio.run(
            _eval(args, cfg, factory, datasets, urls, tokenizer, template_src, custom_rm, custom_generate)
        )
    print(format_eval(results))
    if args.output:
        Path(args.output).write_text(json.dumps(results, indent=2, default=str))
    return 0


async def _eval(
    args, cfg, factory, datasets, urls, tokenizer, template_src, custom_rm, custom_generate=None
) -> dict[str, Any]:
    ctx, closers = await command_context(args, cfg, urls, tokenizer, template_src)
    try:
        return await evaluate(
            ctx,
            factory,
            datasets,
            n_samples=args.n_samples_per_eval_prompt,
            success_threshold=args.success_threshold,
            custom_reward=custom_rm,
            args=args,
            custom_generate=custom_generate,
        )
    finally:
        for close in closers:
            await close()


async def _rollout(
    args, cfg, factory, tasks, urls, tokenizer, template_src, custom_generate, custom_rm
) -> dict[str, Any]:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    ctx, closers = await command_context(args, cfg, urls, tokenizer, template_src)
    try:
        out_path = Path(args.output)
        out_path.parent.mkdir(parents=True, exist_ok=True)
        total = len(tasks) * cfg.n_samples_per_prompt
        rewards: list[float] = []
        with (
            open(out_path, "w", encoding="utf-8") as out,
            Progress(
                TextColumn("rollout"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("reward {task.fields[reward]:.3f}"),
                TimeElapsedColumn(),
                transient=False,
                disable=not sys.stderr.isatty(),
            ) as progress,
        ):
            bar = progress.add_task("rollout", total=total, reward=0.0)

            every = max(1, total // 10)

            def on_sample(s) -> None:
                out.write(s.to_json() + "\n")
                out.flush()
                rewards.append(float(s.reward or 0.0) if not isinstance(s.reward, dict) else 0.0)
                progress.update(bar, advance=1, reward=sum(rewards) / len(rewards))
                if progress.disable and (len(rewards) % every == 0 or len(rewards) == total):
                    # no terminal (CI, nohup): a plain line every 10%
                    print(
                        f"rollout {len(rewards)}/{total} samples, reward mean {sum(rewards) / len(rewards):.3f}",
                        file=sys.stderr,
                        flush=True,
                    )

            _, summary = await generate_rollout(
                ctx,
                factory,
                tasks,
                args=args,
                custom_generate=custom_generate,
                custom_reward=custom_rm,
                on_sample=on_sample,
            )
        result = summary.to_dict()
        result["output"] = str(out_path)
        return result
    finally:
        for close in closers:
            await close()


if __name__ == "__main__":
    raise SystemExit(main())
