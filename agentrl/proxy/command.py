"""``agentrl proxy``: its flags and its entry point (light to import: the CLI builds every parser)."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

__all__ = ["PROXY_FIELDS", "add_proxy_parser", "cmd_proxy"]

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


def add_proxy_parser(sub: Any) -> None:
    """``agentrl proxy``: the flags (the rollout flags of :data:`PROXY_FIELDS`, generated from RolloutConfig,
    and the server's)."""
    from agentrl.flags import add_field_flags

    p = sub.add_parser(
        "proxy",
        help="an OpenAI-compatible recording proxy: agents call /s/SESSION/v1, every session becomes samples",
        description="Serve /s/SESSION/v1/chat/completions against the engine(s) (--engine-url, else an embedded "
        "engine for --hf-checkpoint); each session is recorded token-exact and written to --output when it ends "
        '(POST /s/SESSION/end {"reward": R}, --idle-timeout, or Ctrl-C).',
    )
    max_turns = {"default": DEFAULT_MAX_TURNS, "help": f"assistant turns per session (default {DEFAULT_MAX_TURNS})"}
    add_field_flags(
        p, ("hf_checkpoint", "engine_url", "engine_max_running_requests", *PROXY_FIELDS), max_turns=max_turns
    )
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (set --api-key when not loopback)")
    p.add_argument("--port", type=int, default=8000, help="port to listen on (0: any free port)")
    p.add_argument("--output", default="proxy_samples.jsonl", help="JSONL file the samples are appended to")
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on every request")
    p.add_argument("--idle-timeout", type=float, default=600.0, help="seconds without a request that end a session")
    p.add_argument("--chat-template", default=None, help="jinja2 chat template file overriding the tokenizer's")
    p.add_argument("--engine-log", default=None, help="file for the embedded engine's log")
    p.set_defaults(engine_api="generate", model=None, api_key_env="OPENAI_API_KEY")


def cmd_proxy(args: Any) -> int:
    """Serve the proxy until SIGINT/SIGTERM; every ended session's samples go to ``--output``."""
    from agentrl.checkpoint import resolve_hf_checkpoint
    from agentrl.cli import _engine_urls, _load_tokenizer
    from agentrl.config import RolloutConfig
    from agentrl.proxy.external import check_config, serve

    if args.idle_timeout <= 0:
        raise ValueError("--idle-timeout must be > 0")
    cfg = RolloutConfig(**{name: getattr(args, name) for name in PROXY_FIELDS})
    cfg.validate()
    hook = check_config(cfg)  # before any engine starts: a bad flag is one error, not every session failed
    ckpt = resolve_hf_checkpoint(args.hf_checkpoint)
    tokenizer, template_src = _load_tokenizer(ckpt, args.chat_template)
    with contextlib.ExitStack() as stack:
        urls = _engine_urls(args, ckpt, stack)
        asyncio.run(serve(args, cfg, urls, tokenizer, template_src, hook))
    return 0
