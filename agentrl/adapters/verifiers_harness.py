"""The config verifiers' own rollout runs under in agentrl: each role's harness on the local subprocess runtime,
no retries, deadlines within the agent's, and verifiers' chat program on this interpreter.

Used when a taskset loads (:mod:`agentrl.adapters.verifiers_taskset`) for the agent path
(:mod:`agentrl.adapters.verifiers_agent`, whose module docstring says what is refused and why).
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import math
import re
import sys
import tomllib
from pathlib import Path
from typing import Any

from agentrl.proxy.proxy_env import REWARD_SECONDS, ProxyEnv

AGENT_HARNESS = "null"
"""The harness played for a taskset that ships none (see the module docstring for why not ``bash``)."""
AGENT_TIMEOUT: float = ProxyEnv.agent_timeout
"""Seconds one verifiers rollout may take, setup and scoring included, unless ``agent_timeout`` is given."""
SUPPORTED_VERIFIERS = "0.4.0"
"""The verifiers release whose private script cache (``SubprocessRuntime._interpreters``) this module fills."""

_PEP_723 = re.compile(r"(?m)^# /// (?P<type>[a-zA-Z0-9-]+)$\s(?P<content>(^#(| .*)$\s)+)^# ///$")


def agent_config(
    taskset_id: str, reasons: list[str], agent_timeout: float = AGENT_TIMEOUT, taskset: dict[str, Any] | None = None
) -> Any:
    """The env config verifiers runs the taskset under: each role on the local ``subprocess`` runtime
    with its harness (its pin, else the taskset's own, else ``null``), no retries, stage deadlines
    within ``agent_timeout`` (module docstring); ValueError naming what cannot run here. ``reasons``:
    why the single-reply path does not cover the taskset (for the error's context); ``taskset``: its
    taskset config data (``id`` and settings, :func:`agentrl.adapters.verifiers_taskset.taskset_settings`)."""
    import verifiers.v1 as vf
    from verifiers.v1.configs.agent import agent_config_fields

    taskset = {**(taskset or {}), "id": taskset_id}
    base = vf.resolve_env_config({"taskset": taskset})
    no_retries = {"max_retries": 0, "rules": []}
    limit = agent_timeout if math.isfinite(agent_timeout) else None
    timeout = {"rollout": limit, "scoring": min(REWARD_SECONDS, agent_timeout)}
    roles: dict[str, Any] = {}
    for name, spec in agent_config_fields(base).items():
        where = f"taskset {taskset_id!r} ({'; '.join(reasons)}): role {name!r}"
        harness = _role_harness(taskset_id, spec, where)
        own = spec.timeout.model_dump(exclude_none=True)  # a role's own shorter deadline stands
        timeouts = {**own, **{k: min(v, own.get(k, v)) if v is not None else own.get(k) for k, v in timeout.items()}}
        roles[name] = {
            "runtime": {"type": "subprocess"},
            "harness": harness,
            "retries": no_retries,
            "timeout": timeouts,
        }
    data = {**base.model_dump(exclude_unset=True), **roles, "retries": no_retries, "taskset": taskset}
    return vf.resolve_env_config(data)


def _role_harness(taskset_id: str, spec: Any, where: str) -> dict[str, Any]:
    """The role's harness config (its pin, else the taskset's own, else :data:`AGENT_HARNESS`), refused
    when it pins a model endpoint or its harness runs code or needs a container."""
    from verifiers.v1.utils.loaders import default_harness_id, harness_class

    if spec.client is not None:
        raise ValueError(f"{where} pins its own model endpoint ({spec.client.base_url}); every role must be the policy")
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
    return spec.harness.model_dump() if spec.harness is not None else {"id": harness}


def check_tasks(taskset_id: str, tasks: list[Any]) -> None:
    """Refuse tasks that need a container (their runtime would be remote or networked)."""
    if tasks and tasks[0].NEEDS_CONTAINER:
        raise ValueError(
            f"taskset {taskset_id!r}: its tasks need a container runtime, which agentrl does not give verifiers "
            "(its container runtimes need network access): run it with `vf eval`"
        )


def script_packages(source: str) -> list[str]:
    """The distribution names a PEP 723 script declares (its ``# /// script`` block's ``dependencies``)."""
    from packaging.requirements import Requirement

    blocks = [m for m in _PEP_723.finditer(source) if m.group("type") == "script"]
    if len(blocks) != 1:
        raise ValueError(f"the program has {len(blocks)} PEP 723 script blocks, not 1")
    lines = blocks[0].group("content").splitlines(keepends=True)
    meta = tomllib.loads("".join(line[2:] if line.startswith("# ") else line[1:] for line in lines))
    return [Requirement(dep).name for dep in meta.get("dependencies", [])]


def use_host_interpreter() -> str | None:
    """Register verifiers' chat program (the ``null`` harness's, and its subclasses') as prepared with
    this interpreter, whether or not ``uv`` is installed, so verifiers never bootstraps uv or downloads
    the program's packages. Returns why it cannot (None when it can), for the refusal at load.

    verifiers prepares the program as a PEP 723 script (``uv sync --script``, after installing uv with
    pip or curl when it is missing) and caches the interpreter per script path in the subprocess
    runtime's class-wide ``_interpreters``; filling that entry first makes the runtime use this
    interpreter. The packages are the script header's (the host's versions stand in for its pins).
    """
    from verifiers.v1.harnesses.utils.launch import CHAT_PROGRAM_SOURCE
    from verifiers.v1.runtimes.subprocess import SubprocessRuntime

    interpreters = getattr(SubprocessRuntime, "_interpreters", None)
    scripts_dir = getattr(SubprocessRuntime, "scripts_dir", None)
    if not isinstance(interpreters, dict) or not isinstance(scripts_dir, str):
        return (
            f"verifiers {_version('verifiers')} changed the subprocess runtime's script cache "
            f"(SubprocessRuntime._interpreters) that agentrl fills to run its chat program without uv; "
            f"agentrl supports verifiers=={SUPPORTED_VERIFIERS}: pip install verifiers=={SUPPORTED_VERIFIERS}"
        )
    try:
        packages = script_packages(CHAT_PROGRAM_SOURCE)
    except ValueError as exc:
        return (
            f"verifiers' chat program header cannot be read ({exc}); agentrl supports verifiers=={SUPPORTED_VERIFIERS}"
        )
    missing = [p for p in packages if _version(p) is None]
    if missing:
        return (
            f"its harness program (verifiers' chat program) needs the packages {', '.join(missing)} in this "
            f"interpreter (agentrl never lets verifiers download them): pip install {' '.join(missing)}"
        )
    data = CHAT_PROGRAM_SOURCE.encode()
    path = Path(scripts_dir) / f"{hashlib.sha256(data).hexdigest()}.py"
    if interpreters.get(str(path)) != sys.executable or not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        interpreters[str(path)] = sys.executable
    return None


def _version(distribution: str) -> str | None:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None
