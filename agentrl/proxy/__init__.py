"""A recording proxy: unmodified agent programs call it as their OpenAI model; every token is recorded.

Agents written against the OpenAI API (a plain ``openai`` client tool loop, the Agents SDK,
LangChain) own their loop: they send the whole conversation on every request and run their tools
themselves. The proxy turns such a program into an agentrl episode without changing a line of it.

Why an :class:`~agentrl.Env` (:class:`ProxyEnv`) and not a custom generate function: the episode
loop (:func:`agentrl.rollout.episode.run_episode`) already does everything a recording needs and a
custom generate function would have to redo: the token ledger (sampled ids verbatim with their
log-probs, observations as template deltas), tool-call parsing with the run's parser, context and
length limits, routing one episode to one engine, ``--partial-rollout``, and *segments* when the
agent rewrites its history (a custom generate function returns one Sample; an episode of several
segments comes only from the loop). So the proxy inverts control at the env boundary.

A request's way through the package::

    agent --POST /s/{token}/v1/chat/completions--> server.ProxyServer     (FastAPI on 127.0.0.1)
        http_guard                    API key (constant time), body cap (413); JSON of any shape a 400
        server.ProxyServer.find       the session the token reaches (a capability only its agent was given)
        requests.parse_request        the body validated (pydantic; off the event loop when large): a 422 naming a bad field
        server.Session / Call         queued on its session, held open until the turn is generated
    env.ProxyEnv.reset / step         the Call's messages as observations (deltas) or a rewrite
    episode loop                      generates the turn on the run's engines, records every token
    env.ProxyEnv.step                 answers the Call: a ChatCompletion with tool_calls and usage
                                      (replies.completion; server-sent events when stream: replies.Streamed)
    agent                             runs its tools, sends the next request ... or finishes: reward()
    replies.same_history              the next request read against the reply, as the agent re-serialised it

An agent given as a command runs through :func:`~agentrl.proxy.agent_process.run_command` (its own process
group, killed when it exits). ``command`` is ``agentrl proxy`` (:mod:`agentrl.proxy.external`: sessions
that clients open for agents started elsewhere, their samples appended to a JSONL file). Everything is imported on first use: importing this package
costs nothing until a name is used.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from agentrl.proxy.endpoint import SESSION_HEADER, ProxyServer, Session, SessionsFull
    from agentrl.proxy.external import ExternalSession
    from agentrl.proxy.proxy_env import AgentError, ProxyEnv, run_command
    from agentrl.proxy.requests import ChatRequest, Refusal, validation_message

__all__ = [
    "SESSION_HEADER",
    "AgentError",
    "ChatRequest",
    "ExternalSession",
    "ProxyEnv",
    "ProxyServer",
    "Refusal",
    "Session",
    "SessionsFull",
    "run_command",
    "validation_message",
]

_WHERE = {
    "AgentError": "proxy_env",
    "ProxyEnv": "proxy_env",
    "run_command": "proxy_env",
    "ExternalSession": "external",
    "ChatRequest": "requests",
    "Refusal": "requests",
    "validation_message": "requests",
    "SESSION_HEADER": "endpoint",
    "ProxyServer": "endpoint",
    "Session": "endpoint",
    "SessionsFull": "endpoint",
}


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
