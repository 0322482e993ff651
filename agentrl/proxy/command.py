"""``agentrl proxy``: its flags and its entry point (light to import: the CLI builds every parser)."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

__all__ = ["add_proxy_parser", "cmd_proxy"]


def add_proxy_parser(sub: Any) -> None:
    """``agentrl proxy``: the flags (the run's rollout flags, generated from RolloutConfig, and the server's)."""
    from agentrl.flags import ROLLOUT_FIELDS, add_field_flags

    p = sub.add_parser(
        "proxy",
        help="an OpenAI-compatible recording proxy: agents call /s/SESSION/v1, every session becomes samples",
        description="Serve /s/SESSION/v1/chat/completions against the engine(s) (--engine-url, else an embedded "
        "engine for --hf-checkpoint); each session is recorded token-exact and written to --output when it ends "
        '(POST /s/SESSION/end {"reward": R}, --idle-timeout, or Ctrl-C).',
    )
    add_field_flags(p, ("hf_checkpoint", "engine_url", "engine_max_running_requests", *ROLLOUT_FIELDS))
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
    from agentrl.cli import _config_from_args, _engine_urls, _load_tokenizer
    from agentrl.proxy.external import serve

    if args.idle_timeout <= 0:
        raise ValueError("--idle-timeout must be > 0")
    cfg = _config_from_args(args)
    ckpt = resolve_hf_checkpoint(args.hf_checkpoint)
    tokenizer, template_src = _load_tokenizer(ckpt, args.chat_template)
    with contextlib.ExitStack() as stack:
        urls = _engine_urls(args, ckpt, stack)
        asyncio.run(serve(args, cfg, urls, tokenizer, template_src))
    return 0
