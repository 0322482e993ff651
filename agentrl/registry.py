"""Finding environments: ``--env`` specs, the id registry and the ``agentrl.envs`` entry points.

Kept apart from the contract in :mod:`agentrl.env` (as Gymnasium keeps ``registration.py`` apart
from ``core.py``): an env author reads ``env.py``; this file is how the CLI and :func:`load_env`
turn a string into a factory. A spec is one of

- ``MODULE:CLASS`` (imported; the current directory is on the path) or ``path/to/file.py:CLASS``;
  the bundled envs are ``agentrl.envs.NAME:CLASS`` (``envs.NAME:CLASS`` is kept as an alias);
- a registered id (``agentrl/Calculator-v0``) or ``module:id`` (import ``module``, which registers it);
- ``gym:<gymnasium id>``, ``openenv:<url>``, ``gem:<id>`` or ``verifiers:<id>``, through :mod:`agentrl.adapters`.

A spec that cannot be loaded (no such module, file, class or id; something that is not an env)
raises one exception whose one-line message names the spec and the fix; the CLI prints just that.

Third-party packages register their ids without being imported first: an entry point in the
``agentrl.envs`` group names a module (imported on the first lookup of an unknown id) or a
callable (called then), which calls :func:`register`; the bundled envs are registered this way::

    [project.entry-points."agentrl.envs"]
    mypkg = "mypkg.envs"
"""

from __future__ import annotations

import difflib
import functools
import importlib
import importlib.metadata
import importlib.util
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from agentrl.adapters import adapter_factory
from agentrl.adapters.base import ADAPTER_PREFIXES
from agentrl.env import Env
from agentrl.user_code import import_failed, import_object, import_spec_module, import_user_module, load_function

if TYPE_CHECKING:
    from agentrl.env import Env

__all__ = [
    "ENTRY_POINT_GROUP",
    "EnvSpec",
    "import_failed",
    "import_user_module",
    "load_env",
    "load_function",
    "load_plugins",
    "make",
    "register",
]
"""``load_function``, ``import_user_module`` and ``import_failed`` live in :mod:`agentrl.user_code` (user code
named by a spec, for envs and custom functions alike); they are re-exported here, where they were first."""

log = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "agentrl.envs"
"""The entry-point group packages use to register env ids (see the module docstring)."""

BUNDLED = "agentrl.envs"
"""The bundled envs' module (its entry point is ``bundled = "agentrl.envs"``); loaded before any other."""


_plugins_loaded = False
_plugins_lock = threading.RLock()  # re-entrant: a plugin may look an id up while it loads


def load_plugins() -> None:
    """Load every ``agentrl.envs`` entry point once (each registers its ids).

    The bundled envs load first, so a package that registers one of their ids on purpose replaces
    it (with a warning from :func:`register`), whatever order the packages are found in. An entry
    point names a module (imported) or a function (called); one that fails, ``SystemExit``
    included, is logged and skipped, so one bad package cannot hide the others' envs. Without the
    bundled entry point in the installed metadata, ``agentrl.envs`` is imported directly (it exists
    only once the package is installed: the wheel and ``pip install -e .`` map the repository's
    ``envs/`` folder to it; a warning says so when it cannot be imported).
    Concurrent callers wait for the first one to finish.
    """
    global _plugins_loaded
    with _plugins_lock:
        if _plugins_loaded:
            return
        points = sorted(importlib.metadata.entry_points(group=ENTRY_POINT_GROUP), key=lambda ep: ep.value != BUNDLED)
        if not any(ep.value == BUNDLED for ep in points):
            try:
                importlib.import_module(BUNDLED)
            except ImportError as exc:
                log.warning(
                    "the bundled envs (%s) cannot be imported (%s): the agentrl/... ids are unknown. "
                    "Install the package (pip install -e . in a source checkout; again after an upgrade) "
                    "so that the repository's envs/ and tools/ folders become agentrl.envs / agentrl.tools",
                    BUNDLED,
                    exc,
                )
        for ep in points:
            try:
                target = ep.load()
                if callable(target) and not isinstance(target, type):
                    target()
            except (Exception, SystemExit) as exc:  # a third party's bug: say which, keep the rest
                log.warning("the %s entry point %r (%s) failed to load: %r", ENTRY_POINT_GROUP, ep.name, ep.value, exc)
        _plugins_loaded = True


@dataclass
class EnvSpec:
    """A registered environment id: where its class lives and default constructor kwargs."""

    id: str
    entry_point: str | Callable[..., Env]
    kwargs: dict[str, Any] = field(default_factory=dict)


registry: dict[str, EnvSpec] = {}


def register(id: str, entry_point: str | Callable[..., Env], **kwargs: Any) -> None:
    """Register an environment id (Gymnasium style), e.g. ``register("agentrl/Calculator-v0", "agentrl.envs.calculator:Calculator")``.

    Registering an id again with a different entry point replaces it and says so (a re-import of
    the same module registering the same thing is silent).
    """
    old = registry.get(id)
    if old is not None and (old.entry_point, old.kwargs) != (entry_point, kwargs):
        log.warning("env id %r re-registered: %r replaces %r", id, entry_point, old.entry_point)
    registry[id] = EnvSpec(id, entry_point, kwargs)


def _registered(spec: str) -> EnvSpec | None:
    """The registered spec for ``spec``: an id, or ``module:id`` (import module, then look up id).

    Ids of installed packages (the bundled ``agentrl/Calculator-v0``, ...) are registered by the
    ``agentrl.envs`` entry points, loaded on the first lookup of an unknown id.
    """
    if spec in registry:
        return registry[spec]
    if spec.startswith(ADAPTER_PREFIXES):  # adapter specs (load_env), never a module named gym/openenv/...
        return None
    module_name, sep, env_id = spec.partition(":")
    if sep and "/" in env_id:
        import_spec_module(spec, module_name)
        if env_id not in registry:
            raise ValueError(f"{spec!r}: importing {module_name!r} registered no env id {env_id!r}{_suggest(env_id)}")
        return registry[env_id]
    if not sep and "/" in spec:
        load_plugins()
        return registry.get(spec)
    return None


def _suggest(env_id: str) -> str:
    close = difflib.get_close_matches(env_id, list(registry), n=3, cutoff=0.5)
    return f" (did you mean {', '.join(close)}?)" if close else ""


def _check_env_class(spec: str, target: Any) -> None:
    """A class that is not an agentrl Env is refused now, naming what would work instead."""
    if not isinstance(target, type) or issubclass(target, Env):
        return
    bases = {f"{c.__module__}.{c.__qualname__}" for c in target.__mro__}
    if "gymnasium.core.Env" in bases:
        fix = "register it with gymnasium.register(ID, ...) and pass --env gym:MODULE:ID"
    elif "gem.core.Env" in bases:
        fix = "register it with gem.register(ID, ...) and pass --env gem:ID"
    else:
        fix = "subclass agentrl.Env (reset/step/close), or pass a function that returns one"
    raise TypeError(f"{spec!r} is the class {target.__qualname__}, not an agentrl.Env: {fix}")


def load_env(spec: str | type[Env]) -> Callable[[], Env]:
    """Resolve ``MODULE:CLASS``, ``path/to/file.py:CLASS``, a registered id or ``module:id`` to an env factory.

    The factory builds one fresh env per episode, so episodes never share state. Attributes of the
    class (``tasks()``, ``tools``) stay reachable on the returned factory for registered ids too.
    Environments of other frameworks run unchanged through :mod:`agentrl.adapters`:
    ``gym:<gymnasium id>`` (optionally ``gym:module:<id>``), ``openenv:<http://host:port>``,
    ``gem:<id>`` and ``verifiers:<id>``. A spec that cannot load raises one exception (ValueError,
    ImportError, FileNotFoundError, AttributeError or TypeError) whose message names the fix.
    """
    if isinstance(spec, type):
        return spec
    if spec.startswith(ADAPTER_PREFIXES):
        return adapter_factory(spec)
    reg = _registered(spec)
    if reg is not None:
        target = import_object(reg.entry_point) if isinstance(reg.entry_point, str) else reg.entry_point
        _check_env_class(spec, target)
        if not reg.kwargs:
            return target  # type: ignore[no-any-return]
        return functools.partial(target, **reg.kwargs)
    if ":" not in spec:
        known = ", ".join(sorted(registry)) or "none"
        raise ValueError(
            f"{spec!r} is neither MODULE:CLASS, path/to/file.py:CLASS, gym:ID, openenv:URL, gem:ID, verifiers:ID "
            f"nor a registered env id{_suggest(spec)} (known: {known})"
        )
    target = import_object(spec)
    if not callable(target):
        raise TypeError(f"{spec!r} is a {type(target).__name__}, not an env class or a function that returns an env")
    _check_env_class(spec, target)
    return target  # type: ignore[no-any-return]


def make(id: str, **kwargs: Any) -> Env:
    """Build one env from a registered id or a ``MODULE:CLASS`` spec (Gymnasium's ``make``)."""
    return load_env(id)(**kwargs)  # type: ignore[call-arg]
