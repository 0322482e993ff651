"""User code named by a spec: ``MODULE:NAME`` or ``path/to/file.py:NAME``, imported with one-line errors.

The env registry (:mod:`agentrl.registry`), the adapters (a Gymnasium id's module) and the rollout's
custom functions (``--custom-generate-function-path``, ``--custom-rm-path``, ...) all import the user's
code here, so every kind of spec fails the same way: one line naming the spec and the fix.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from agentrl.env import Env

__all__ = [
    "bundled_alias",
    "import_failed",
    "import_object",
    "import_spec_module",
    "import_user_module",
    "load_function",
]

_ALIASES = {"envs": "agentrl.envs", "tools": "agentrl.tools"}
"""Old top-level names of the bundled packages, kept working in specs (``--env envs.calculator:Calculator``)."""


def bundled_alias(module_name: str) -> str:
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


def import_spec_module(spec: str, module_name: str) -> Any:
    """The module of an env spec (``envs.X`` aliased to the bundled ``agentrl.envs.X``)."""
    _cwd_importable()  # before the alias: a user's own ``envs`` package in the current directory wins
    return import_user_module(bundled_alias(module_name), spec=spec, hint="or give path/to/file.py:NAME")


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


def import_object(spec: str) -> Any:
    """The object ``spec`` names (``MODULE:NAME`` or ``path/to/file.py:NAME``); one-line errors naming the spec."""
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
        module = import_spec_module(spec, module_name)
    try:
        return getattr(module, attr)
    except AttributeError:
        envs = sorted(k for k, v in vars(module).items() if isinstance(v, type) and issubclass(v, Env) and v is not Env)
        there = f"; its Env classes: {', '.join(envs)}" if envs else ""
        raise AttributeError(f"{spec!r}: module {module_name!r} has no attribute {attr!r}{there}") from None


def load_function(spec: str) -> Callable[..., Any]:
    """Load a user function given as ``module:fn`` or ``path/to/file.py:fn`` (custom generate / reward)."""
    fn = import_object(spec)
    if not callable(fn):
        raise TypeError(f"{spec!r} is not callable")
    return fn
