"""verifiers' own rollout of a task as an agentrl episode: its harness, tools and rubric, its model calls recorded.

A taskset the single-reply path (:mod:`agentrl.adapters.verifiers`) cannot stand in for (its own
``Harness``, tool servers, a custom single-agent ``Env``, rewards that read the runtime)
is played by verifiers itself: ``env.run_episode(task, ctx)`` inside ``env.serving()``, exactly as
``vf eval`` runs it, with the model client (``ctx``) pointed at an agentrl recording-proxy session
(:class:`~agentrl.proxy.ProxyEnv`). verifiers' harness program calls its interception server,
which relays each model call to that session; the episode loop generates the turn on the run's
engines and records every token (sampled ids verbatim with their log-probs, the tool results and
user turns the harness sends back as mask-0 deltas, a rewritten history as a new segment). The
reward is verifiers' own score of that rollout: the mean ``trace.reward`` over the episode's traces
(one trace for a single-agent env, so exactly its weighted ``@vf.reward`` sum).

What runs where, and what is refused when the spec loads (:func:`load_agent_env`):

- every agent runs in verifiers' ``subprocess`` runtime on this machine (its default, Prime's
  remote sandboxes, is replaced); tool servers run there too (``python -m`` of the toolset's module).
  Nothing leaves loopback: the interception server, the tool servers and the proxy bind 127.0.0.1.
- the agent is the taskset's own harness when it ships one, else verifiers' ``null`` harness (a chat
  loop offering the taskset's MCP tools). Not ``bash``, the default of ``vf eval``: in a subprocess
  runtime the model's shell commands would run unsandboxed on the host. A harness that executes
  model-written code (``EXECUTES_CODE``) or needs a container (``NEEDS_CONTAINER``, like tasks that
  do) is refused: verifiers' container runtimes reach its interception server over a network, which
  agentrl's sandboxes (``--network none``) do not give them.
- a role that pins its own model endpoint (``client``) is refused: its calls would not be the policy's
  and would leave the machine.
- harness programs that verifiers builds as ``uv`` scripts (``null``, ``bash``) need ``uv``; where
  ``uv`` is not installed and this interpreter already has the program's packages, the program runs on
  this interpreter instead of downloading them (:func:`use_host_interpreter`).
"""

from __future__ import annotations

import hashlib
import importlib.util
import math
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agentrl.proxy.env import ProxyEnv

AGENT_HARNESS = "null"
"""The harness played for a taskset that ships none (see the module docstring for why not ``bash``)."""

_LOCAL_RUNTIMES = {"subprocess"}
_CHAT_PROGRAM_PACKAGES = ("openai", "mcp", "httpx", "httpx2", "tenacity", "certifi")


@dataclass(frozen=True)
class Outcome:
    """What verifiers made of the rollout: its reward, each trace's rewards and metrics (the step's ``info``)."""

    reward: float
    rewards: list[dict[str, float | None]] = field(default_factory=list)
    metrics: list[dict[str, Any]] = field(default_factory=list)
    turns: list[int] = field(default_factory=list)


def agent_config(taskset_id: str, reasons: list[str]) -> Any:
    """The env config verifiers runs the taskset under: each role on the local ``subprocess`` runtime
    with its harness (its pin, else the taskset's own, else ``null``); ValueError naming what cannot run
    here. ``reasons``: why the single-reply path does not cover the taskset (for the error's context)."""
    import verifiers.v1 as vf
    from verifiers.v1.configs.agent import agent_config_fields
    from verifiers.v1.utils.loaders import default_harness_id, harness_class

    base = vf.resolve_env_config({"taskset": {"id": taskset_id}})
    roles: dict[str, Any] = {}
    for name, spec in agent_config_fields(base).items():
        where = f"taskset {taskset_id!r} ({'; '.join(reasons)}): role {name!r}"
        if spec.client is not None:
            raise ValueError(
                f"{where} pins its own model endpoint ({spec.client.base_url}); every role must be the policy"
            )
        harness = spec.harness.id if spec.harness is not None else default_harness_id(taskset_id)
        if spec.harness is None and harness == "bash":
            harness = AGENT_HARNESS
        cls = harness_class(harness)
        if cls.NEEDS_CONTAINER or cls.EXECUTES_CODE:
            why = "needs a container" if cls.NEEDS_CONTAINER else "runs model-written code"
            raise ValueError(
                f"{where}: its harness {harness!r} {why}; agentrl runs verifiers agents only in the local "
                "subprocess runtime, where that code would run unsandboxed (verifiers' container runtimes reach "
                "their interception server over a network, which agentrl's sandboxes do not allow): "
                "pin a harness that runs no code (EXECUTES_CODE = False), or use `vf eval` for it"
            )
        harness_cfg = spec.harness.model_dump() if spec.harness is not None else {"id": harness}
        roles[name] = {"runtime": {"type": "subprocess"}, "harness": harness_cfg}
    return vf.resolve_env_config({**base.model_dump(exclude_unset=True), **roles, "taskset": {"id": taskset_id}})


def check_tasks(taskset_id: str, tasks: list[Any]) -> None:
    """Refuse tasks that need a container (their runtime would be remote or networked)."""
    if tasks and tasks[0].NEEDS_CONTAINER:
        raise ValueError(
            f"taskset {taskset_id!r}: its tasks need a container runtime, which agentrl does not give verifiers "
            "(its container runtimes need network access): run it with `vf eval`"
        )


def use_host_interpreter() -> str | None:
    """Run verifiers' chat-program harnesses (``null``, ``bash``) on this interpreter when ``uv`` is absent.

    verifiers prepares the program as a PEP 723 script with ``uv sync --script`` (installing uv and
    downloading its packages on first use). With no ``uv`` on PATH but every package it declares
    importable here, the script is registered as prepared with this interpreter (the subprocess
    runtime's own cache of prepared scripts), so nothing is downloaded. Returns why it cannot run
    (None when it can), for the refusal at load.
    """
    if shutil.which("uv"):
        return None  # verifiers prepares it as usual (from its cache after the first time)
    missing = [p for p in _CHAT_PROGRAM_PACKAGES if importlib.util.find_spec(p) is None]
    if missing:
        return (
            f"its harness program needs uv (not installed) or the packages {', '.join(missing)} here: "
            f"pip install uv (it fetches them once), or pip install {' '.join(missing)}"
        )
    from verifiers.v1.harnesses.utils.launch import CHAT_PROGRAM_SOURCE
    from verifiers.v1.runtimes.subprocess import SubprocessRuntime

    data = CHAT_PROGRAM_SOURCE.encode()
    path = Path(SubprocessRuntime.scripts_dir) / f"{hashlib.sha256(data).hexdigest()}.py"
    if str(path) not in SubprocessRuntime._interpreters:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        SubprocessRuntime._interpreters[str(path)] = sys.executable
    return None


class VerifiersAgentEnv(ProxyEnv):
    """One verifiers rollout of a task (its harness, tools, rubric), recorded through the proxy (module docstring).

    ``max_turns`` is None: the harness and the run's limits (``--max-turns``, the context) end the
    episode; a turn cut off ends it, and the harness's next request is refused, failing the rollout.
    """

    max_turns: int | None = None
    agent_timeout: float = math.inf

    def __init__(self, taskset_id: str) -> None:
        from agentrl.adapters.verifiers import _load

        self.taskset_id = taskset_id
        loaded = _load(taskset_id)
        self.vf_env, self.tasks = loaded.env, loaded.tasks

    async def run_agent(self, base_url: str, task: dict[str, Any]) -> Outcome:
        """verifiers' ``run_episode`` for the row's task, its model client on ``base_url``."""
        from verifiers.v1.clients import EvalClientConfig, ModelContext
        from verifiers.v1.types import SamplingConfig

        from agentrl.adapters.verifiers import task_for

        vf_task = task_for(self.tasks, task)
        client = EvalClientConfig(base_url=base_url, api_key_var="AGENTRL_VERIFIERS_API_KEY")
        ctx = ModelContext(model="agentrl-policy", client=client, sampling=SamplingConfig())
        async with self.vf_env.serving():
            episode = await self.vf_env.run_episode(vf_task, ctx)
        errors = [e for t in episode.traces for e in ([t.last_error] if t.last_error else [])] + list(episode.errors)
        if errors or not episode.traces:
            why = "; ".join(f"{e.type}: {' '.join(e.message.split())[:500]}" for e in errors) or "no agent ran"
            raise RuntimeError(f"verifiers' rollout failed: {why}")
        traces = episode.traces
        return Outcome(
            reward=sum(float(t.reward) for t in traces) / len(traces),
            rewards=[{k: (r.score if r is not None else None) for k, r in t.rewards.items()} for t in traces],
            metrics=[dict(t.metrics) for t in traces],
            turns=[t.num_turns for t in traces],
        )

    def reward(self, task: dict[str, Any], messages: list, output: Any) -> float:
        """verifiers' own score of the rollout (computed by ``run_agent``)."""
        return float(output.reward)
