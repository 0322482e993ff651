"""A verifiers environment (package ``verifiers`` >= 0.4, its ``verifiers.v1`` stack) as an agentrl env.

In verifiers 0.4 an environment is a **taskset** (a package exporting a ``Taskset`` subclass,
named by its id, e.g. ``reverse-text`` or a hub id ``owner/name``) whose tasks carry the prompt
and score a finished conversation with their ``@vf.reward`` methods (``Task.score(trace)``); an
``Env`` pairs it with agents, each a *harness* program (a CLI agent in a runtime box) that calls
the model through an OpenAI-compatible interception server. ``verifiers:<taskset id>`` loads it
through verifiers' own entry point, ``vf.load_environment(vf.resolve_env_config(...))``.

**How it is driven, and why.** :class:`VerifiersEnv` maps the taskset onto agentrl's Env
contract instead of running verifiers' harness: the task's ``system_prompt`` and ``prompt`` are
the first observation, the model's reply is the assistant turn, and the reward is what the task's
own ``score`` gives for a verifiers ``Trace`` of that conversation (every ``@vf.reward``, weighted,
as ``vf eval`` would sum them). Running the harness instead would need a runtime box (the default
is Prime's remote sandboxes) and would see the model only through an OpenAI API, so tokens would
have to be re-recorded through a proxy; this way agentrl's own episode loop samples and records
every token exactly, and the rubric is verifiers' own code. **The agent is one model reply** to
the task's prompt: not the harness program ``vf eval`` runs (its default ``bash`` agent, or the
taskset's own), so scores are comparable to ``vf eval`` only for tasksets answered in one reply.
What this does not cover is refused when the spec loads, in one line: env classes other than the
plain ``SingleAgentEnv`` (multi-agent, user simulators, best-of-n), tasksets that export their own
``Harness`` (verifiers runs that program as the agent, so one reply would be a different agent),
tasksets with tool servers (``toolsets``), and tasks that need a container or score with a
runtime. For those agents, use agentrl's recording proxy.

Task rows: ``tasks()`` lists the taskset's tasks (``{"prompt", "label": None, "vf_idx": i}``);
``--prompt-data`` rows without ``vf_idx`` are validated as the taskset's own task data (its
``TaskData`` model: ``prompt`` plus fields such as ``answer``), so a dataset file of the taskset's
shape works too. The step's ``info`` has each reward's score and each metric.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any, cast

from agentrl.env import Env, StepResult
from agentrl.types import Action, Message

_TASK_LIMIT = 10_000  # tasks listed from an infinite taskset


def _vf() -> Any:
    try:
        import verifiers.v1 as vf
    except ImportError as exc:
        raise ImportError(f"the verifiers: adapter needs verifiers >= 0.4: pip install verifiers ({exc})") from None
    return vf


@functools.lru_cache(maxsize=16)
def _load(taskset_id: str) -> tuple[Any, list[Any]]:
    """The verifiers env for ``taskset_id`` and its tasks (loaded once per process)."""
    vf = _vf()
    try:
        env = vf.load_environment(vf.resolve_env_config({"taskset": {"id": taskset_id}}))
    except (ImportError, AttributeError, TypeError, ValueError) as exc:
        why = " ".join(str(exc).split())  # verifiers' own message, which names the taskset mostly
        raise ValueError(why if repr(taskset_id) in why else f"taskset {taskset_id!r}: {why}") from None
    if type(env).__name__ != "SingleAgentEnv":
        raise ValueError(
            f"taskset {taskset_id!r}: its env class {type(env).__name__} runs its own multi-agent episode; "
            "only single-agent tasksets map onto an agentrl env (drive other agents through agentrl's proxy)"
        )
    harness = _own_harness(taskset_id)
    if harness:
        raise ValueError(
            f"taskset {taskset_id!r}: it ships its own harness {harness} (the agent program `vf eval` runs on its "
            "tasks); this adapter's agent is one model reply, so it would score a different agent: run that "
            "program through agentrl's recording proxy instead"
        )
    taskset = env.taskset
    if type(taskset).toolsets(taskset.config):
        raise ValueError(
            f"taskset {taskset_id!r}: the taskset serves tools (toolsets); this adapter offers none: "
            "wrap its tools as agentrl Tools (agentrl.mcp_tools) in an agentrl env"
        )
    tasks = list(taskset if taskset.bounded else taskset.take(_TASK_LIMIT))
    if not tasks:
        raise ValueError(f"taskset {taskset_id!r}: the taskset has no tasks")
    _check_task(taskset_id, tasks[0])
    return env, tasks


def _own_harness(taskset_id: str) -> str | None:
    """The name of the ``Harness`` subclass the taskset's package exports (verifiers then runs it as the
    agent), else None. Several exported is verifiers' own error; it is reported as such."""
    from verifiers.v1.harness import Harness
    from verifiers.v1.utils.loaders import import_taskset

    module = import_taskset(taskset_id)  # already imported by load_environment: a dict lookup
    exported = [getattr(module, name, None) for name in getattr(module, "__all__", None) or ()]
    found = [c.__name__ for c in exported if isinstance(c, type) and issubclass(c, Harness) and c is not Harness]
    return ", ".join(found) or None


def _check_task(taskset_id: str, task: Any) -> None:
    if task.NEEDS_CONTAINER:
        raise ValueError(f"taskset {taskset_id!r}: its tasks need a container runtime, which this adapter does not run")
    for fn in task.hooks("reward"):
        param = inspect.signature(fn).parameters.get("runtime")
        if param is not None and param.default is inspect.Parameter.empty:
            raise ValueError(
                f"taskset {taskset_id!r}: reward {fn.__name__!r} scores inside a runtime box, "
                "which this adapter does not run"
            )


def resolve_verifiers_env(taskset_id: str) -> None:
    """Load ``taskset_id`` now (cached), so an unknown or unsupported one fails with one line."""
    _load(taskset_id)


def verifiers_tasks(taskset_id: str, **_: Any) -> list[dict[str, Any]]:
    """The taskset's tasks as agentrl task rows (``vf_idx`` picks the task in reset)."""
    _, tasks = _load(taskset_id)
    return [{"prompt": _messages(t.data), "label": None, "vf_idx": i} for i, t in enumerate(tasks)]


def _messages(data: Any) -> list[Message]:
    """A task's system prompt and prompt as chat messages (a Messages prompt keeps its roles)."""
    out: list[Message] = []
    if data.system_prompt:
        out.append({"role": "system", "content": data.system_prompt})
    prompt = data.prompt
    if isinstance(prompt, str):
        out.append({"role": "user", "content": prompt})
    else:
        for m in prompt or []:
            dumped = m.model_dump(mode="json", exclude_none=True)
            content = dumped.get("content")
            if not isinstance(content, str):  # content parts: the text ones, joined
                content = "\n\n".join(p.get("text", "") for p in content or [] if isinstance(p, dict))
            out.append(cast(Message, {**dumped, "content": content}))
    return out


class VerifiersEnv(Env):
    """One episode of a verifiers taskset task: prompt, one reply, the task's own score (module docstring)."""

    def __init__(self, taskset_id: str) -> None:
        self.taskset_id = taskset_id
        self.vf_env, self.tasks = _load(taskset_id)
        self.task: Any = None
        self.messages: list[Message] = []

    def _task_for(self, row: dict[str, Any]) -> Any:
        if row.get("vf_idx") is not None:
            idx = int(row["vf_idx"])
            if not 0 <= idx < len(self.tasks):
                raise ValueError(f"vf_idx {idx}: the taskset has {len(self.tasks)} tasks")
            return self.tasks[idx]
        task_cls = type(self.tasks[0])
        data = task_cls.data_type().model_validate({k: v for k, v in row.items() if k != "label"})
        return task_cls(data, self.tasks[0].config)

    async def reset(self, *, seed: int | None = None, options: dict | None = None) -> tuple[list[Message], dict]:
        self.task = self._task_for(options or {})
        self.messages = _messages(self.task.data)
        if not self.messages or self.messages[-1]["role"] != "user":
            raise ValueError(f"verifiers task {self.task.data.idx}: its prompt has no user message to answer")
        return [dict(m) for m in self.messages], {"task_key": self.task.key}  # type: ignore[misc]

    async def step(self, action: Action) -> StepResult:
        if self.task is None:
            raise RuntimeError("VerifiersEnv.step() before reset()")
        vf = _vf()
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
