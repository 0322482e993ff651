"""A verifiers environment (package ``verifiers`` >= 0.4, its ``verifiers.v1`` stack) as an agentrl env.

In verifiers 0.4 an environment is a **taskset** (a package exporting a ``Taskset`` subclass,
named by its id, e.g. ``reverse-text`` or a hub id ``owner/name``) whose tasks carry the prompt
and score a finished conversation with their ``@vf.reward`` methods (``Task.score(trace)``); an
``Env`` pairs it with agents, each a *harness* program (a CLI agent in a runtime box) that calls
the model through an OpenAI-compatible interception server. ``verifiers:<taskset id>`` loads it
through verifiers' own entry point, ``vf.load_environment(vf.resolve_env_config(...))``.

**Which path a spec takes, and why.** A plain taskset (the ``SingleAgentEnv``, no harness of its own,
no tool servers, no task ``setup``/``finalize`` hooks, rewards that read only the conversation) is
mapped onto agentrl's Env contract directly (:class:`VerifiersEnv`): the task's ``system_prompt`` and
``prompt`` are the first observation, the model's reply is the assistant turn, and the reward is what
the task's own ``score`` gives for a verifiers ``Trace`` of that conversation (every ``@vf.reward``,
weighted, as ``vf eval`` sums them). That is what verifiers' tool-less ``null`` harness would do with
such a task (one reply), with no harness process, interception server or proxy in between: agentrl's
episode loop samples and records every token itself. Every other taskset (:func:`~agentrl.adapters.verifiers_taskset.load_taskset` says
why, and the step's env says which class it is) takes the **agent path**
(:mod:`agentrl.adapters.verifiers_agent`): verifiers runs its own rollout (harness program, tool
servers, rubric) on the local subprocess runtime with its model client pointed at an agentrl
recording-proxy session, and the reward is verifiers' own score of that rollout. What cannot run
here is refused when the spec loads, in one line naming why and what to do: envs of several agents or
rollouts (user simulators, best-of-n: their other roles would be recorded as the policy), tasks or harnesses that
need a container or execute model-written code, roles that pin their own model endpoint, verifiers'
chat program when this interpreter lacks a package it declares (it never downloads them), tool servers
given by ``url`` or placed in a non-local runtime and judges whose endpoint is not loopback (on both
paths: :func:`check_loopback`), and a taskset that is not installed (verifiers downloads nothing at
load: a hub id names an installed package). ``adapter_factory("verifiers:ID", agent_timeout=S)`` (or
a :class:`~agentrl.adapters.verifiers_agent.VerifiersAgentEnv` subclass setting ``agent_timeout``)
sets the agent path's deadline (600 s by default).

Settings: a taskset's config fields (its ``TasksetConfig``, what ``vf eval --taskset.FIELD`` sets) follow
the id as a query, ``verifiers:openenv?base_url=http://127.0.0.1:8000&resets=[{"seed":1}]`` (a value is
JSON when it parses as JSON its field accepts, else text), or come as ``adapter_factory("verifiers:ID",
taskset={...})``; the taskset's own config class validates them when the spec loads (a bad field is one
line naming it), and they key the load and travel with the factory. verifiers' bundled ``openenv``
taskset (its env has one seat, fed the OpenEnv server's observations) plays a server on loopback given
by ``base_url`` (``agentrl env-serve`` serves any agentrl env); it needs the ``openenv`` package its
extra pins (openenv-core's older client lacks what it reads), and starting an env itself (uv, Docker)
or a server off this machine is refused.

Task rows: ``tasks()`` lists the taskset's tasks (``{"prompt", "label": None, "vf_idx": i}``);
``--prompt-data`` rows without ``vf_idx`` are validated as the taskset's own task data (its
``TaskData`` model: ``prompt`` plus fields such as ``answer``), so a dataset file of the taskset's
shape works too. The step's ``info`` has each reward's score and each metric.
"""

from __future__ import annotations

from typing import Any

from agentrl.adapters.verifiers_agent import VerifiersAgentEnv
from agentrl.adapters.verifiers_taskset import (
    OPENENV_MODULE,
    Loaded,
    check_loopback,
    load_taskset,
    resolve_verifiers_env,
    settings_key,
    task_for,
    task_messages,
    taskset_settings,
    verifiers_tasks,
    vf_module,
)
from agentrl.env import Env, StepResult
from agentrl.types import Action, Message

__all__ = [
    "OPENENV_MODULE",
    "Loaded",
    "VerifiersEnv",
    "check_loopback",
    "resolve_verifiers_env",
    "settings_key",
    "task_for",
    "taskset_settings",
    "verifiers_tasks",
]


class VerifiersEnv(Env):
    """One episode of a verifiers taskset task: prompt, one reply, the task's own score (module docstring).

    Constructing it for a taskset one reply does not cover gives the agent path's env instead
    (:class:`~agentrl.adapters.verifiers_agent.VerifiersAgentEnv`): verifiers' own rollout, recorded.
    """

    def __new__(cls, taskset_id: str, agent_timeout: float | None = None, taskset: dict | None = None) -> Any:
        if load_taskset(taskset_id, None, settings_key(taskset)).agent_reasons:
            return VerifiersAgentEnv(taskset_id, agent_timeout=agent_timeout, taskset=taskset)
        return super().__new__(cls)

    def __init__(self, taskset_id: str, agent_timeout: float | None = None, taskset: dict | None = None) -> None:
        """``agent_timeout``: seconds for the agent path's whole rollout (ignored here: one reply, no agent);
        ``taskset``: the taskset's settings (:func:`taskset_settings` validated them when the spec loaded)."""
        self.taskset_id = taskset_id
        loaded = load_taskset(taskset_id, None, settings_key(taskset))
        self.vf_env, self.tasks = loaded.env, loaded.tasks
        self.task: Any = None
        self.messages: list[Message] = []

    async def reset(self, *, seed: int | None = None, options: dict | None = None) -> tuple[list[Message], dict]:
        self.task = task_for(self.tasks, options or {})
        self.messages = task_messages(self.task.data)
        if not self.messages or self.messages[-1]["role"] != "user":
            raise ValueError(f"verifiers task {self.task.data.idx}: its prompt has no user message to answer")
        return [dict(m) for m in self.messages], {"task_key": self.task.key}  # type: ignore[misc]

    async def step(self, action: Action) -> StepResult:
        if self.task is None:
            raise RuntimeError("VerifiersEnv.step() before reset()")
        vf = vf_module()
        from verifiers.v1.graph import MessageNode
        from verifiers.v1.trace import AgentInfo, Trace, TraceTask

        convo = [*self.messages, {"role": "assistant", "content": action.text}]
        messages = [vf.AssistantMessage(content=m["content"]) if m["role"] == "assistant" else m for m in convo]
        nodes = [
            MessageNode.model_validate({"message": m, "parent": i - 1 if i else None, "sampled": i == len(convo) - 1})
            for i, m in enumerate(messages)
        ]
        task = self.task
        trace = Trace(
            task=TraceTask(type=type(task).__name__, data=task.data, key=task.key, hash=task.hash),
            agent=AgentInfo(config=vf.AgentConfig()),
            nodes=nodes,
            is_completed=True,
            ok=True,
        )
        await task.score(trace)
        info = {
            "rewards": {k: (r.score if r is not None else None) for k, r in trace.rewards.items()},
            "metrics": dict(trace.metrics),
        }
        return [], float(trace.reward), True, False, info
