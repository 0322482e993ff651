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
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from agentrl.env import Env

log = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "agentrl.envs"
"""The entry-point group packages use to register env ids (see the module docstring)."""

BUNDLED = "agentrl.envs"
"""The bundled envs' module (its entry point is ``bundled = "agentrl.envs"``); loaded before any other."""

ADAPTER_PREFIXES = ("gym:", "openenv:", "gem:", "verifiers:")
"""Specs that name another framework's env (:mod:`agentrl.adapters`), never a module of that name."""

_ALIASES = {"envs": "agentrl.envs", "tools": "agentrl.tools"}
"""Old top-level names of the bundled packages, kept working in specs (``--env envs.calculator:Calculator``)."""


def _bundled_alias(module_name: str) -> str:
    """``envs.X`` / ``tools.X`` -> ``agentrl.envs.X`` / ``agentrl.tools.X``, unless the user has their own.

    The bundled envs and tools install inside the agentrl namespace; specs written before that
    (``envs.calculator:Calculator``) still resolve to the same classes. A package named ``envs`` or
    ``tools`` of the user's (on ``sys.path``, e.g. in the current directory) wins when it holds the
    module asked for; a plain folder of that name without it (or the bundled folder itself, in a
    source checkout) does not, so the bundled classes never load twice under two names.
    """
    top, dot, rest = module_name.partition(".")
    target = _ALIASES.get(top)
    if target is None:
        return module_name
    try:
        own = importlib.util.find_spec(top)
        bundled = importlib.util.find_spec(target)
    except (ImportError, ValueError):
        return module_name
    if bundled is None or bundled.origin is None:
        return module_name
    if own is None or (own.origin is not None and Path(own.origin).resolve() == Path(bundled.origin).resolve()):
        return target + dot + rest
    first = rest.partition(".")[0]
    if not first:  # the package itself: the user's when it is a real one (a plain folder is no package)
        has_it = own.origin is not None
    else:
        places = [Path(loc) for loc in own.submodule_search_locations or []]
        has_it = any((p / f"{first}.py").is_file() or (p / first / "__init__.py").is_file() for p in places)
    return module_name if has_it else target + dot + rest


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


def _import_module(spec: str, module_name: str) -> Any:
    """The module of an env spec (``envs.X`` aliased to the bundled ``agentrl.envs.X``)."""
    _cwd_importable()  # before the alias: a user's own ``envs`` package in the current directory wins
    return import_user_module(_bundled_alias(module_name), spec=spec, hint="or give path/to/file.py:NAME")


def _cwd_importable() -> None:
    if "" not in sys.path and str(Path.cwd()) not in sys.path:
        sys.path.insert(0, str(Path.cwd()))


def import_user_module(module_name: str, *, spec: str = "", hint: str = "") -> Any:
    """Import a user's module by name, the current directory importable as for ``python -m``.

    Any failure is one ImportError line saying what to fix, the same for every kind of spec: a
    module that is not there (install it, or run from its folder; ``hint`` adds the spec's own way
    out), one of its dependencies that is not there, or anything the module raised (see
    :func:`import_failed`). ``spec``, when not empty, starts the line; callers whose message names
    the spec already pass ``""``.
    """
    _cwd_importable()
    where, also = (f"{spec!r}: " if spec else ""), (f" ({hint})" if hint else "")
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name and (module_name == exc.name or module_name.startswith(exc.name + ".")):
            raise ImportError(
                f"{where}no module named {exc.name!r}: install the package that provides it, or run from "
                f"the folder that holds {module_name.replace('.', '/')}.py{also}"
            ) from None
        raise ImportError(
            f"{where}importing {module_name!r} failed: no module named {exc.name!r} "
            f"(a dependency of {module_name!r}: install it)"
        ) from None
    except (Exception, SystemExit) as exc:
        raise import_failed(spec, module_name, exc) from None


def import_failed(spec: str, module_name: str, exc: BaseException, rerun: str | None = None) -> ImportError:
    """A module that raised (``SystemExit`` included) while it was imported, as one line naming the spec
    (when ``spec`` is not empty: callers whose message already names it pass ``""``).

    User env modules run arbitrary code at import; the user needs the spec, the module and what it
    raised (the traceback is theirs to get with ``python -c 'import MODULE'``), never a bare exit.
    """
    why = " ".join(str(exc).split()) or "(no message)"
    rerun = rerun or f"python -c 'import {module_name}'"
    where = f"{spec!r}: " if spec else ""
    return ImportError(
        f"{where}importing {module_name!r} failed: {type(exc).__name__}: {why} ({rerun} shows the traceback)"
    )


def _import_object(spec: str) -> Any:
    module_name, sep, attr = spec.rpartition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"{spec!r}: expected MODULE:NAME, path/to/file.py:NAME or a registered id")
    if module_name.endswith(".py") or "/" in module_name:
        path = Path(module_name).expanduser().resolve()
        if not path.is_file():
            raise FileNotFoundError(f"{spec!r}: no such file {path} (relative paths start at {Path.cwd()})")
        mod_name = f"agentrl_user_{path.stem}_{abs(hash(str(path)))}"
        module = sys.modules.get(mod_name)
        if module is None:
            file_spec = importlib.util.spec_from_file_location(mod_name, path)
            assert file_spec and file_spec.loader
            module = importlib.util.module_from_spec(file_spec)
            sys.modules[mod_name] = module
            try:
                file_spec.loader.exec_module(module)
            except BaseException as exc:
                del sys.modules[mod_name]  # a half-run module must not be found by the next lookup
                if isinstance(exc, (Exception, SystemExit)):
                    raise import_failed(spec, str(path), exc, f"python {path}") from None
                raise
    else:
        module = _import_module(spec, module_name)
    try:
        return getattr(module, attr)
    except AttributeError:
        from agentrl.env import Env

        envs = sorted(k for k, v in vars(module).items() if isinstance(v, type) and issubclass(v, Env) and v is not Env)
        there = f"; its Env classes: {', '.join(envs)}" if envs else ""
        raise AttributeError(f"{spec!r}: module {module_name!r} has no attribute {attr!r}{there}") from None


def load_function(spec: str) -> Callable[..., Any]:
    """Load a user function given as ``module:fn`` or ``path/to/file.py:fn`` (custom generate / reward)."""
    fn = _import_object(spec)
    if not callable(fn):
        raise TypeError(f"{spec!r} is not callable")
    return fn


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
        _import_module(spec, module_name)
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
    from agentrl.env import Env

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
        from agentrl.adapters import adapter_factory

        return adapter_factory(spec)
    reg = _registered(spec)
    if reg is not None:
        target = _import_object(reg.entry_point) if isinstance(reg.entry_point, str) else reg.entry_point
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
    target = _import_object(spec)
    if not callable(target):
        raise TypeError(f"{spec!r} is a {type(target).__name__}, not an env class or a function that returns an env")
    _check_env_class(spec, target)
    return target  # type: ignore[no-any-return]


def make(id: str, **kwargs: Any) -> Env:
    """Build one env from a registered id or a ``MODULE:CLASS`` spec (Gymnasium's ``make``)."""
    return load_env(id)(**kwargs)  # type: ignore[call-arg]
