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

What runs where, and what is refused when the spec loads (:func:`agentrl.adapters.verifiers_taskset.load_taskset`):

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
- tool servers and judges off this machine are refused: a toolset with a ``url`` or a runtime other than
  ``subprocess``, and a judge (a client config in the task or taskset config, e.g. ``judges``) whose
  ``base_url`` is not loopback (:func:`agentrl.adapters.verifiers_taskset.check_loopback`, both paths). A judge
  that reward code builds from a literal config is not visible at load and is not checked.
- verifiers' chat program (the ``null`` harness's, and any harness that subclasses it) is a PEP 723
  script verifiers would prepare with ``uv`` (installing uv with pip or curl, then downloading its
  packages). It always runs on this interpreter instead (:func:`~agentrl.adapters.verifiers_harness.use_host_interpreter`), uv or no uv;
  the spec is refused at load when a package its header declares is missing here. A harness that
  brings another PEP 723 program of its own is still prepared by verifiers (with uv): not checked.
- the whole run (setup, harness, scoring) is bounded by ``agent_timeout`` (ProxyEnv's 600 s unless
  given: ``adapter_factory("verifiers:ID", agent_timeout=S)``, or a subclass's attribute); verifiers'
  own ``timeout.rollout`` is set to it (a role's own shorter one stands) and ``timeout.scoring`` to
  :data:`~agentrl.proxy.proxy_env.REWARD_SECONDS` (at most it), so no stage of verifiers waits past it.
  Either deadline fails the sample (verifiers scores a timed-out trace as ok; agentrl, as for any
  ProxyEnv agent, does not reward a run that did not finish).
- retries are off (``retries.max_retries = 0``, no rules, for every role and the env): a retried run
  restarts the harness, whose new conversation the proxy would record as a rewrite (a new segment),
  the failed attempt's turns trained with the retry's reward. A taskset's own retries are overridden.
- success is verifiers' own ``ok`` stamp on the episode (every trace completed without failing; a
  recovered error in ``errors`` does not fail it), and no verifiers deadline stopped a trace.
- verifiers' ``serving()`` (shared tool servers, the interception pool, the env's ``start``/``stop``)
  is entered once per event loop for all concurrent episodes (:func:`serving`), on a shallow copy of
  the loaded env, and left when the last of them ends.
- processes: each rollout's harness and tool servers run in their own process group
  (``start_new_session``) in a workdir under verifiers' cache; verifiers kills the groups and removes
  the workdir when the rollout ends, fails or is cancelled, and agentrl's ``serving`` holder does the
  same for shared servers when the last episode leaves. A hard kill (SIGKILL) of the agentrl
  process runs none of this: those processes and workdirs outlive it (verifiers' atexit backstop
  covers only a normal interpreter exit); kill their process groups by hand
  (``~/.cache/verifiers/runtimes/subprocess``). verifiers itself leaves one small
  ``/tmp/vf-port-<id>`` file per local tool server it starts (its port file, outside the workdir).
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from agentrl.adapters.verifiers_harness import (
    AGENT_HARNESS,
    AGENT_TIMEOUT,
    SUPPORTED_VERIFIERS,
    agent_config,
    check_tasks,
    script_packages,
    use_host_interpreter,
)
from agentrl.adapters.verifiers_taskset import load_taskset, settings_key, task_for
from agentrl.proxy.proxy_env import ProxyEnv

__all__ = [
    "AGENT_HARNESS",
    "AGENT_TIMEOUT",
    "SUPPORTED_VERIFIERS",
    "Outcome",
    "VerifiersAgentEnv",
    "agent_config",
    "check_tasks",
    "outcome",
    "script_packages",
    "serving",
    "use_host_interpreter",
]
"""The agent path's config helpers live in :mod:`agentrl.adapters.verifiers_harness` (the loader uses them
too); they are re-exported here, where they were first."""

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Outcome:
    """What verifiers made of the rollout: its reward, each trace's rewards and metrics (the step's ``info``)."""

    reward: float
    rewards: list[dict[str, float | None]] = field(default_factory=list)
    metrics: list[dict[str, Any]] = field(default_factory=list)
    turns: list[int] = field(default_factory=list)


class _Serving:
    """verifiers' ``serving()`` held open for one event loop's episodes of one loaded env.

    A task of its own enters and leaves it (its tool servers and interception pool use cancel scopes
    that must be left by the task that entered them); episodes only count themselves in and out.
    It serves a shallow copy of the loaded env: ``serving()`` stores the live resources on the env
    object, so two loops (or a new holder starting while the last one stops) never share them.
    """

    def __init__(self, vf_env: Any) -> None:
        self.env = copy.copy(vf_env)
        self.users = 0
        self.ready: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.release = asyncio.Event()
        self.task = asyncio.create_task(self._hold(), name="verifiers-serving")

    async def _hold(self) -> None:
        try:
            async with self.env.serving():
                self.ready.set_result(None)
                await self.release.wait()
        except BaseException as exc:
            if not self.ready.done():
                self.ready.set_exception(exc if isinstance(exc, Exception) else RuntimeError(repr(exc)))
            raise


_SERVING: dict[tuple[asyncio.AbstractEventLoop, int], _Serving] = {}


@contextlib.asynccontextmanager
async def serving(vf_env: Any) -> AsyncIterator[Any]:
    """The env to run an episode on, inside verifiers' ``serving()``: entered by the first concurrent
    episode of this event loop, left (``stop()``, tool servers and interception torn down) when the
    last one ends, however it ends. verifiers' ``start``/``stop`` bracket a whole eval, not an episode."""
    key = (asyncio.get_running_loop(), id(vf_env))
    held = _SERVING.get(key)
    if held is None:
        held = _SERVING[key] = _Serving(vf_env)
    held.users += 1
    try:
        await asyncio.shield(held.ready)
        yield held.env
    finally:
        held.users -= 1
        if held.users == 0:
            if _SERVING.get(key) is held:
                del _SERVING[key]
            held.release.set()
            try:
                await asyncio.shield(held.task)
            except Exception as exc:  # the episode is over; stop()'s failure is the env's to report
                if held.ready.done() and not held.ready.cancelled() and held.ready.exception() is None:
                    logger.warning("verifiers env %s: leaving serving() failed: %s", type(vf_env).__name__, exc)


class VerifiersAgentEnv(ProxyEnv):
    """One verifiers rollout of a task (its harness, tools, rubric), recorded through the proxy (module docstring).

    ``max_turns`` is None: the harness and the run's limits (``--max-turns``, the context) end the
    episode; a turn cut off ends it, and the harness's next request is refused, failing the rollout.
    ``agent_timeout`` (seconds, default :data:`AGENT_TIMEOUT`) bounds the whole rollout, scoring included.
    """

    max_turns: int | None = None
    agent_timeout: float = AGENT_TIMEOUT

    def __init__(self, taskset_id: str, agent_timeout: float | None = None, taskset: dict | None = None) -> None:
        """``taskset``: the taskset's settings, validated when the spec loaded."""
        if agent_timeout is not None:
            if isinstance(agent_timeout, bool) or not isinstance(agent_timeout, int | float) or not agent_timeout > 0:
                raise ValueError(f"agent_timeout: expected seconds > 0 (math.inf: no limit), got {agent_timeout!r}")
            self.agent_timeout = float(agent_timeout)
        self.taskset_id = taskset_id
        timeout = None if self.agent_timeout == AGENT_TIMEOUT else self.agent_timeout
        loaded = load_taskset(taskset_id, timeout, settings_key(taskset))  # one load per timeout and settings
        self.vf_env, self.tasks = loaded.env, loaded.tasks

    async def run_agent(self, base_url: str, task: dict[str, Any]) -> Outcome:
        """verifiers' ``run_episode`` for the row's task, its model client on ``base_url``."""
        from verifiers.v1.clients import EvalClientConfig, ModelContext
        from verifiers.v1.types import SamplingConfig

        vf_task = task_for(self.tasks, task)
        client = EvalClientConfig(base_url=base_url, api_key_var="AGENTRL_VERIFIERS_API_KEY")
        ctx = ModelContext(model="agentrl-policy", client=client, sampling=SamplingConfig())
        async with serving(self.vf_env) as vf_env:
            episode = await vf_env.run_episode(vf_task, ctx)
        return outcome(episode)

    def reward(self, task: dict[str, Any], messages: list, output: Any) -> float:
        """verifiers' own score of the rollout (computed by ``run_agent``)."""
        return float(output.reward)


def outcome(episode: Any) -> Outcome:
    """verifiers' score of a finished episode; RuntimeError (the sample fails) unless verifiers stamped
    it ``ok`` and no trace ran into a deadline (module docstring)."""
    traces = episode.traces
    timed_out = [t.stop_condition for t in traces if t.is_timeout] + (
        ["episode deadline"] if episode.is_timeout else []
    )
    if not episode.ok or not traces or timed_out:
        errors = [*episode.errors, *(e for t in traces if not t.ok for e in t.errors)]
        why = "; ".join(f"{e.type}: {' '.join(e.message.split())[:500]}" for e in errors)
        why = why or (
            f"verifiers' deadline expired ({', '.join(map(str, timed_out))})" if timed_out else "no agent ran"
        )
        raise RuntimeError(f"verifiers' rollout failed: {why}")
    return Outcome(
        reward=sum(float(t.reward) for t in traces) / len(traces),
        rewards=[{k: (r.score if r is not None else None) for k, r in t.rewards.items()} for t in traces],
        metrics=[dict(t.metrics) for t in traces],
        turns=[t.num_turns for t in traces],
    )
