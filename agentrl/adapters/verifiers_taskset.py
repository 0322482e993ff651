"""A verifiers taskset loaded and checked: which path plays it (one reply, or verifiers' own rollout), its
tasks as agentrl rows, its settings validated, and what cannot run here refused in one line.

The paths and the refusals are described in :mod:`agentrl.adapters.verifiers`; the agent path's config
comes from :mod:`agentrl.adapters.verifiers_harness`.
"""

from __future__ import annotations

import functools
import importlib.metadata
import inspect
import ipaddress
import json
import urllib.parse
from dataclasses import dataclass
from typing import Any, cast
from urllib.parse import urlsplit

from agentrl.adapters import verifiers_harness
from agentrl.types import Message

_TASK_LIMIT = 10_000  # tasks listed from an infinite taskset


def vf_module() -> Any:
    """``verifiers.v1``, or an ImportError saying what to install."""
    try:
        import verifiers.v1 as vf
    except ImportError as exc:
        raise ImportError(f"the verifiers: adapter needs verifiers >= 0.4: pip install verifiers ({exc})") from None
    return vf


@dataclass(frozen=True)
class Loaded:
    """A loaded taskset: the verifiers env, its tasks, and why one reply does not cover it (empty: it does)."""

    env: Any
    tasks: list[Any]
    agent_reasons: tuple[str, ...]


@functools.lru_cache(maxsize=16)
def load_taskset(taskset_id: str, agent_timeout: float | None = None, settings: str = "{}") -> Loaded:
    """The verifiers env for ``taskset_id`` and its tasks (loaded once per process, ``agent_timeout`` (the
    agent path's deadline: None is its default) and ``settings`` (the taskset's settings, canonical JSON:
    :func:`settings_key`), on the path that plays it."""
    vf = vf_module()
    taskset = {**json.loads(settings), "id": taskset_id}
    try:
        env = vf.load_environment(vf.resolve_env_config({"taskset": taskset}))
        _check_single_agent(taskset_id, env)
        tasks = _tasks(taskset_id, env)
        check_loopback(taskset_id, env, tasks)
        reasons = _needs_agent(taskset_id, env, tasks[0])
        if reasons:
            env, tasks = _agent_env(taskset, reasons, tasks, agent_timeout)
    except (ImportError, AttributeError, TypeError, ValueError) as exc:
        why = " ".join(str(exc).split())  # verifiers' own message, which names the taskset mostly
        raise ValueError(why if repr(taskset_id) in why else f"taskset {taskset_id!r}: {why}") from None
    return Loaded(env, tasks, tuple(reasons))


def _agent_env(taskset: dict[str, Any], reasons: list[str], tasks: list[Any], agent_timeout: float | None) -> tuple:
    """The env verifiers' own rollout runs on (:func:`~agentrl.adapters.verifiers_harness.agent_config`)."""
    taskset_id = taskset["id"]
    timeout = verifiers_harness.AGENT_TIMEOUT if agent_timeout is None else agent_timeout
    config = verifiers_harness.agent_config(taskset_id, reasons, timeout, taskset)
    verifiers_harness.check_tasks(taskset_id, tasks)
    why = verifiers_harness.use_host_interpreter()  # whatever the harness: its chat program never downloads
    if why:
        raise ValueError(f"taskset {taskset_id!r}: {why}")
    env = vf_module().load_environment(config)
    return env, _tasks(taskset_id, env)


def check_loopback(taskset_id: str, env: Any, tasks: list[Any]) -> None:
    """Refuse what would send traffic off this machine: a tool server (taskset- or task-level toolset)
    given by ``url`` or placed in a runtime other than ``subprocess``, and a judge or other client
    config in the taskset's or a task's config whose ``base_url`` is not loopback (verifiers' judges
    default to Prime's hosted endpoint). Each distinct task config is read once."""
    distinct: dict[tuple[type, str], tuple[int, Any]] = {}
    for i, task in enumerate(tasks):
        distinct.setdefault((type(task), task.config.model_dump_json()), (i, task))
    toolsets = list(type(env.taskset).toolsets(env.taskset.config))
    for _, task in distinct.values():
        toolsets += type(task).toolsets(task.config)
    for toolset in toolsets:
        _check_toolset(taskset_id, toolset)
    configs = [("taskset config", env.taskset.config)]
    configs += [(f"task {i} config", t.config) for i, t in distinct.values() if t.config != env.taskset.config.task]
    for where, cfg in configs:
        for path, client in _clients(cfg, where):
            host = (urlsplit(client.base_url).hostname or "").lower()
            if host != "localhost" and not _loopback_ip(host):
                kind = f"judge {client.id!r}" if getattr(client, "id", None) else "model client"
                raise ValueError(
                    f"taskset {taskset_id!r}: {kind} at {path} calls {client.base_url}, off this machine; agentrl "
                    "keeps verifiers' traffic on loopback: point its base_url at a server on 127.0.0.1, or drop it"
                )


def _check_toolset(taskset_id: str, toolset: Any) -> None:
    cfg, name = toolset.config, getattr(toolset, "server_name", type(toolset).__name__)
    where = f"taskset {taskset_id!r}: toolset {name!r}"
    if getattr(cfg, "url", None):
        raise ValueError(
            f"{where} is served at {cfg.url}, off this machine; agentrl keeps verifiers' traffic on loopback: "
            "leave its url unset so verifiers starts it locally"
        )
    runtime = getattr(getattr(cfg, "runtime", None), "type", "subprocess")
    if runtime != "subprocess" and not getattr(cfg, "colocated", False):  # colocated: the harness's runtime
        raise ValueError(
            f"{where} runs in the {runtime!r} runtime; agentrl runs verifiers' tool servers only in the local "
            "subprocess runtime: set its runtime to subprocess (or colocate it with the harness)"
        )


def _clients(value: Any, path: str) -> list[tuple[str, Any]]:
    """Every verifiers client config (``BaseClientConfig``, judges' too) inside a config, with its path."""
    from pydantic import BaseModel
    from verifiers.v1.configs.client import BaseClientConfig

    if isinstance(value, BaseClientConfig):
        return [(path, value)]
    if isinstance(value, BaseModel):
        return [c for name in type(value).model_fields for c in _clients(getattr(value, name), f"{path}.{name}")]
    if isinstance(value, list | tuple):
        return [c for i, v in enumerate(value) for c in _clients(v, f"{path}[{i}]")]
    if isinstance(value, dict):
        return [c for k, v in value.items() for c in _clients(v, f"{path}[{k!r}]")]
    return []


def _loopback_ip(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _check_single_agent(taskset_id: str, env: Any) -> None:
    """Refuse envs of several agents or rollouts (user simulators, best-of-n, multi-agent): every model call
    of an episode is recorded as the one policy's, so a simulated user's turns would be trained as the
    policy's own and n rollouts would be scored as one."""
    from verifiers.v1.envs.single_agent import SingleAgentEnv

    if type(env).__name__ == "OpenEnvEnv" and type(env).__module__ == OPENENV_MODULE:
        _check_openenv(taskset_id, env)
    elif not isinstance(env, SingleAgentEnv):
        raise ValueError(
            f"taskset {taskset_id!r}: its env class {type(env).__name__} is not a single-agent env (multi-agent, "
            "user simulators, best-of-n); agentrl records one policy agent per episode and would train the other "
            "roles' turns as the policy's: run it with `vf eval`, or export a SingleAgentEnv"
        )


OPENENV_MODULE = "verifiers.v1.tasksets.openenv.taskset"
"""verifiers' bundled ``openenv`` taskset: its env has one seat (``player``) whose user turns are the
OpenEnv server's observations, computed by code, not by a model, so it is single-agent for agentrl."""


def _check_openenv(taskset_id: str, env: Any) -> None:
    """verifiers' ``openenv`` taskset may only connect to a running server on loopback (``base_url``):
    without one, OpenEnv's provider installs the env with ``uv`` from the network or runs it in Docker."""
    cfg = env.taskset.config
    why = _openenv_client_missing()
    if why:
        raise ValueError(f"taskset {taskset_id!r}: {why}")
    if not cfg.base_url:
        how = "in Docker (use_docker)" if cfg.use_docker else "after downloading it with uv"
        raise ValueError(
            f"taskset {taskset_id!r}: without base_url OpenEnv's provider starts env {cfg.env!r} {how}, which "
            f"agentrl does not let verifiers do: serve it on 127.0.0.1 (`agentrl env-serve`, or the env's own "
            f"server) and give verifiers:{taskset_id}?base_url=http://127.0.0.1:PORT"
        )
    host = (urlsplit(cfg.base_url).hostname or "").lower()
    if host != "localhost" and not _loopback_ip(host):
        raise ValueError(
            f"taskset {taskset_id!r}: base_url {cfg.base_url} is off this machine; agentrl keeps verifiers' traffic "
            f"on loopback: play a remote OpenEnv server with agentrl's own adapter, --env openenv:{cfg.base_url}"
        )


def _openenv_client_missing() -> str | None:
    """Why verifiers' ``openenv`` taskset cannot play here (None: it can). Its env reads the client's
    ``_base_url``, which the ``openenv`` distribution (verifiers' ``openenv`` extra) has and the older
    ``openenv-core`` (the same ``openenv`` module, 0.3.0) does not: every episode would fail."""
    from packaging.requirements import Requirement
    from packaging.specifiers import SpecifierSet

    pins = [Requirement(r) for r in importlib.metadata.requires("verifiers") or () if r.startswith("openenv")]
    spec = next((r.specifier for r in pins if r.name == "openenv"), None) or ">=0.4.1"
    have = _distribution_version("openenv")
    if have is not None and have in SpecifierSet(str(spec)):
        return None
    core = _distribution_version("openenv-core")
    there = f"openenv {have} is installed" if have else "the openenv package is not installed"
    there += f" (openenv-core {core}'s client lacks what it reads)" if core and not have else ""
    return (
        f"verifiers' openenv env needs openenv{spec} (its `openenv` extra), and {there}: "
        f"pip install 'openenv{spec}' (it replaces openenv-core's openenv module)"
    )


def _distribution_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def _tasks(taskset_id: str, env: Any) -> list[Any]:
    taskset = env.taskset
    tasks = list(taskset if taskset.bounded else taskset.take(_TASK_LIMIT))
    if not tasks:
        raise ValueError(f"taskset {taskset_id!r}: the taskset has no tasks")
    return tasks


def _needs_agent(taskset_id: str, env: Any, task: Any) -> list[str]:
    """Why one model reply is not the agent ``vf eval`` would run on the taskset (empty: it is)."""
    from verifiers.v1.task import Task

    reasons = []
    if type(env).__name__ != "SingleAgentEnv":  # a SingleAgentEnv subclass: its own episode, one agent
        reasons.append(f"its env class {type(env).__name__} runs its own episode")
    harness = _own_harness(taskset_id)
    if harness:
        reasons.append(f"it ships its own harness {harness}")
    if type(env.taskset).toolsets(env.taskset.config) or type(task).toolsets(task.config):
        reasons.append("it serves tools (toolsets)")
    if task.NEEDS_CONTAINER:
        reasons.append("its tasks need a container runtime")
    for hook in ("setup", "finalize"):
        if getattr(type(task), hook) is not getattr(Task, hook):
            reasons.append(f"its tasks have a {hook} hook")
    for fn in task.hooks("reward"):
        param = inspect.signature(fn).parameters.get("runtime")
        if param is not None and param.default is inspect.Parameter.empty:
            reasons.append(f"reward {fn.__name__!r} scores inside a runtime box")
    return reasons


def _own_harness(taskset_id: str) -> str | None:
    """The name of the ``Harness`` subclass the taskset's package exports (verifiers then runs it as the
    agent), else None. Several exported is verifiers' own error; it is reported as such."""
    from verifiers.v1.harness import Harness
    from verifiers.v1.utils.loaders import import_taskset

    module = import_taskset(taskset_id)  # already imported by load_environment: a dict lookup
    exported = [getattr(module, name, None) for name in getattr(module, "__all__", None) or ()]
    found = [c.__name__ for c in exported if isinstance(c, type) and issubclass(c, Harness) and c is not Harness]
    return ", ".join(found) or None


def taskset_settings(taskset_id: str, query: str = "", given: Any = None) -> dict[str, Any]:
    """The taskset's settings from a spec's query (``FIELD=VALUE&...``) and ``given`` (a dict, from
    ``adapter_factory(..., taskset={...})``), validated by the taskset's own config class (its
    ``TasksetConfig``, as ``vf eval --taskset.FIELD`` is), so a bad field is refused in one line naming it.

    A query value is JSON when it parses as JSON the field accepts (``use_docker=true``,
    ``resets=[{"seed":1}]``), else the text itself (``base_url=http://127.0.0.1:8000``, ``env=2048``
    for a string field). Returns the settings as given (JSON values), the cache key of the load."""
    vf_module()
    from pydantic import ValidationError
    from verifiers.v1.utils.loaders import taskset_config_type

    where = f"taskset {taskset_id!r}"
    if given is not None and not (isinstance(given, dict) and all(isinstance(k, str) for k in given)):
        raise ValueError(f"{where}: taskset= must be a dict of its settings by field name, got {given!r}")
    try:
        cls = taskset_config_type(taskset_id)
    except (ImportError, AttributeError, TypeError, ValueError) as exc:
        why = " ".join(str(exc).split())
        raise ValueError(why if repr(taskset_id) in why else f"{where}: {why}") from None
    try:
        pairs = urllib.parse.parse_qsl(query, keep_blank_values=True, strict_parsing=True) if query else []
    except ValueError:
        raise ValueError(f"{where}: settings {query!r}: expected FIELD=VALUE&FIELD=VALUE") from None
    settings: dict[str, Any] = {}
    for key, text in pairs:
        key = key.replace("-", "_")  # verifiers' CLI spells fields --taskset.base-url too
        if key in settings:
            raise ValueError(f"{where}: setting {key!r} is given twice")
        settings[key] = _setting_value(cls, key, text)
    both = sorted(set(settings) & set(given or {}))
    if both:
        raise ValueError(f"{where}: setting {both[0]!r} is given both in the spec and as taskset=")
    settings.update(given or {})
    if "id" in settings:
        raise ValueError(f"{where}: 'id' is not a setting: the taskset is the one the spec names")
    try:
        json.dumps(settings, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{where}: settings must be JSON values, as in verifiers' TOML files ({exc})") from None
    try:
        cls.model_validate({**settings, "id": taskset_id})
    except ValidationError as exc:
        raise ValueError(f"{where}: {_first_error(cls, exc)}") from None
    return settings


def _setting_value(cls: Any, key: str, text: str) -> Any:
    """``text`` as JSON when it parses as a JSON value field ``key`` accepts, else the text itself."""
    from pydantic import TypeAdapter

    try:
        value = json.loads(text)
    except ValueError:
        return text
    field = cls.model_fields.get(key)
    if field is None:
        return value  # refused by the config's validation, naming the field
    try:
        TypeAdapter(field.annotation).validate_python(value)
    except Exception:
        return text
    return value


def _first_error(cls: Any, exc: Any) -> str:
    """A pydantic ValidationError of the taskset's config as one line naming the field and the fields there are."""
    err = exc.errors(include_url=False)[0]
    msg = str(err["msg"]).removeprefix("Value error, ")
    fields = ", ".join(f for f in cls.model_fields if f != "id")
    hint = f"its settings ({cls.__name__}): {fields}; give them as verifiers:ID?FIELD=VALUE&... or taskset={{...}}"
    if not err["loc"]:
        return f"{msg} ({hint})"
    field = ".".join(map(str, err["loc"]))
    return f"setting {field!r}: {msg} (got {err.get('input')!r}; {hint})"


def settings_key(settings: dict[str, Any] | None) -> str:
    """The settings as canonical JSON: part of :func:`load_taskset`'s cache key."""
    return json.dumps(settings or {}, sort_keys=True)


def resolve_verifiers_env(taskset_id: str, settings: dict[str, Any] | None = None) -> None:
    """Load ``taskset_id`` with ``settings`` now (cached), so an unknown or unsupported one fails with one line."""
    load_taskset(taskset_id, None, settings_key(settings))


def verifiers_tasks(taskset_id: str, taskset: dict[str, Any] | None = None, **_: Any) -> list[dict[str, Any]]:
    """The taskset's tasks as agentrl task rows (``vf_idx`` picks the task in reset)."""
    tasks = load_taskset(taskset_id, None, settings_key(taskset)).tasks
    return [{"prompt": task_messages(t.data), "label": None, "vf_idx": i} for i, t in enumerate(tasks)]


def task_messages(data: Any) -> list[Message]:
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


def task_for(tasks: list[Any], row: dict[str, Any]) -> Any:
    """The task a row names: ``vf_idx`` (a row of ``tasks()``), else the row validated as the taskset's own
    task data (its ``TaskData`` model; pydantic names a missing or bad field)."""
    if row.get("vf_idx") is not None:
        idx = int(row["vf_idx"])
        if not 0 <= idx < len(tasks):
            raise ValueError(f"vf_idx {idx}: the taskset has {len(tasks)} tasks")
        return tasks[idx]
    task_cls = type(tasks[0])
    data = task_cls.data_type().model_validate({k: v for k, v in row.items() if k != "label"})
    return task_cls(data, tasks[0].config)
