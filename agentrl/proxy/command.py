"""``agentrl proxy``: its flags and its entry point (light to import: the CLI builds every parser)."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

from agentrl.checkpoint import resolve_hf_checkpoint
from agentrl.config import RolloutConfig
from agentrl.flags import add_field_flags
from agentrl.http_guard import DEFAULT_MAX_BODY_MB, max_body_bytes, resolve_api_key, warn_if_open

__all__ = ["API_KEY_ENV", "DEFAULT_MAX_SESSIONS", "PROXY_FIELDS", "add_proxy_parser", "cmd_proxy"]

PROXY_FIELDS = (
    "max_turns",
    "rollout_max_turn_len",
    "rollout_max_response_len",
    "rollout_max_context_len",
    "partial_rollout",
    "history_mode",
    "history_rewrite_path",
    "rollout_temperature",
    "rollout_top_p",
    "rollout_top_k",
    "rollout_stop",
    "rollout_stop_token_ids",
    "tool_parser",
    "tool_template",
)
"""The :class:`~agentrl.config.RolloutConfig` fields a recorded session uses, the only ones ``agentrl proxy``
takes as flags: the others (a task file's keys, samples per prompt, concurrency, sandboxes, role engines,
seeds, the step timeout) mean nothing to agents that bring their own conversations, tools and pace, so
argparse refuses them instead of ignoring them. Sessions wait ``--idle-timeout`` for a request."""

DEFAULT_MAX_TURNS = 32
"""``--max-turns`` of ``agentrl proxy`` (its sessions' turns; the env-driven commands default to the env's)."""

DEFAULT_MAX_SESSIONS = 256
"""``--max-sessions``: open sessions at once. Each holds an episode (its conversation and token ledger) until
its agent ends it or ``--idle-timeout`` passes; the cap bounds what clients can make the proxy hold."""

API_KEY_ENV = "AGENTRL_PROXY_API_KEY"
"""The environment variable holding ``agentrl proxy``'s key when neither ``--api-key`` nor ``--api-key-file``
is given (a flag's value is in ``/proc/PID/cmdline``, readable by every local user)."""


def add_proxy_parser(sub: Any) -> None:
    """``agentrl proxy``: the flags (the rollout flags of :data:`PROXY_FIELDS`, generated from RolloutConfig,
    and the server's)."""
    p = sub.add_parser(
        "proxy",
        help="an OpenAI-compatible recording proxy: agents call /s/TOKEN/v1, every session becomes samples",
        description='POST /sessions (body {"name": ID}, optional) opens a session and answers its base_url '
        "(/s/TOKEN/v1: the agent's OPENAI_BASE_URL; TOKEN is the session's unguessable capability, required on "
        "every call) and end_url. Agents' /s/TOKEN/v1/chat/completions are answered by the engine(s) "
        "(--engine-url, else an embedded engine for --hf-checkpoint); each session is recorded token-exact and "
        'written to --output when it ends (POST /s/TOKEN/end {"reward": R}, --idle-timeout, or Ctrl-C). With '
        f"an API key (--api-key, --api-key-file or ${API_KEY_ENV}) every route but GET /health requires "
        "'Authorization: Bearer KEY'; GET /health is open and says only that the proxy is up.",
    )
    max_turns = {"default": DEFAULT_MAX_TURNS, "help": f"assistant turns per session (default {DEFAULT_MAX_TURNS})"}
    add_field_flags(
        p, ("hf_checkpoint", "engine_url", "engine_max_running_requests", *PROXY_FIELDS), max_turns=max_turns
    )
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (set --api-key when not loopback)")
    p.add_argument("--port", type=int, default=8000, help="port to listen on (0: any free port)")
    p.add_argument("--output", default="proxy_samples.jsonl", help="JSONL file the samples are appended to")
    p.add_argument(
        "--api-key",
        default=None,
        help="require 'Authorization: Bearer KEY' on every route but GET /health (a flag's value is visible in "
        f"/proc/PID/cmdline to every local user: prefer --api-key-file or ${API_KEY_ENV}, used when neither flag "
        "is given)",
    )
    p.add_argument("--api-key-file", default=None, help="a file holding the key (chmod 600 it); instead of --api-key")
    p.add_argument(
        "--max-sessions",
        type=int,
        default=DEFAULT_MAX_SESSIONS,
        help=f"sessions open at once; POST /sessions beyond it is refused 429 (default {DEFAULT_MAX_SESSIONS})",
    )
    p.add_argument(
        "--max-body-mb",
        type=float,
        default=DEFAULT_MAX_BODY_MB,
        help=f"largest request body in MiB, at most 4096; a larger one is refused 413 (default {DEFAULT_MAX_BODY_MB})",
    )
    p.add_argument("--idle-timeout", type=float, default=600.0, help="seconds without a request that end a session")
    p.add_argument("--chat-template", default=None, help="jinja2 chat template file overriding the tokenizer's")
    p.add_argument("--engine-log", default=None, help="file for the embedded engine's log")
    p.set_defaults(engine_api="generate", model=None, api_key_env="OPENAI_API_KEY")


def cmd_proxy(args: Any) -> int:
    """Serve the proxy until SIGINT/SIGTERM; every ended session's samples go to ``--output``."""
    from agentrl.proxy.external import check_config, serve
    from agentrl.rollout.context import command_engine_urls, load_tokenizer

    if args.idle_timeout <= 0:
        raise ValueError("--idle-timeout must be > 0")
    if args.max_sessions < 1:
        raise ValueError(f"--max-sessions must be at least 1, got {args.max_sessions}")
    args.max_body_bytes = max_body_bytes(args.max_body_mb)
    args.api_key = resolve_api_key(args.api_key, file=args.api_key_file, env=API_KEY_ENV)
    warn_if_open(
        args.host, args.api_key, exposes="can open sessions and drive the policy engine through them", env=API_KEY_ENV
    )
    cfg = RolloutConfig(**{name: getattr(args, name) for name in PROXY_FIELDS})
    cfg.validate()
    hook = check_config(cfg)  # before any engine starts: a bad flag is one error, not every session failed
    ckpt = resolve_hf_checkpoint(args.hf_checkpoint)
    tokenizer, template_src = load_tokenizer(ckpt, args.chat_template)
    with contextlib.ExitStack() as stack:
        urls = command_engine_urls(args, ckpt, stack)
        asyncio.run(serve(args, cfg, urls, tokenizer, template_src, hook))
    return 0
