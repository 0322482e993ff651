"""``import agentrl`` stays light: writing an env or a tool must not pay for Ray or torch.

Users import the SDK in their env modules, in Ray workers that never train and in ``check-env``;
Ray and torch (seconds to import, hundreds of MB) are loaded only by what needs them (the trainer,
the engines, ``agentrl train``). Run in a fresh interpreter, so nothing another test imported counts.
"""

from __future__ import annotations

import json
import subprocess
import sys

HEAVY = ("ray", "torch", "megatron", "docker", "fastapi", "uvicorn", "matplotlib")


def test_import_agentrl_pulls_in_neither_ray_nor_torch():
    code = f"import json, sys, agentrl; print(json.dumps([m for m in {HEAVY!r} if m in sys.modules]))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert json.loads(out.stdout.strip().splitlines()[-1]) == []


def _agentrl_imports(path: str) -> set[str]:
    """Every agentrl module a source file imports, at top level or inside a function."""
    import ast
    from pathlib import Path

    tree = ast.parse((Path(__file__).resolve().parents[1] / path).read_text())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
        elif isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
    return {n for n in names if n.startswith("agentrl")}


def test_config_is_a_leaf_and_the_loss_math_stands_alone():
    """config.py imports only the small contract modules (no backend, runtime or launcher); the loss
    math imports no config (issue 17, item 2): both can be read, and lifted out, alone."""
    assert _agentrl_imports("agentrl/config.py") == {
        "agentrl.algo.spec",
        "agentrl.engines.base",
        "agentrl.sandbox.base",
    }
    for path in ("agentrl/algo/loss.py", "agentrl/algo/advantages.py", "agentrl/algo/spec.py"):
        assert _agentrl_imports(path) <= {"agentrl.algo.spec"}, path
    for path in ("agentrl/algo/spec.py", "agentrl/engines/base.py", "agentrl/sandbox/base.py"):
        assert not {m for m in _agentrl_imports(path) if m.startswith(("agentrl.runtime", "agentrl.config"))}, path


# -- the package's import graph (issue 39, item 6) ------------------------------------------------------


def _modules(root) -> dict:
    """The package's modules under ``root``: dotted name -> file (a package is its ``__init__.py``)."""
    from pathlib import Path

    root = Path(root)
    modules = {}
    for path in root.rglob("*.py"):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = path
    return modules


def _from_base(node, package: str) -> str:
    """The module a ``from ... import`` names, its relative dots resolved against ``package``."""
    if not node.level:
        return node.module or ""
    up = package.split(".")[: len(package.split(".")) - (node.level - 1)]
    return ".".join(up + ([node.module] if node.module else []))


def import_graph(root) -> tuple[dict[str, set[str]], list[tuple[str, str, str]]]:
    """The package's import graph read from its source with ``ast``: module -> the package's modules it
    imports (top level, inside functions and under ``TYPE_CHECKING`` alike), and every ``(importer,
    module, name)`` where one module imports another's ``_private`` name."""
    import ast

    modules = _modules(root)
    graph: dict[str, set[str]] = {m: set() for m in modules}
    private: list[tuple[str, str, str]] = []
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        tree = ast.parse(path.read_text(), str(path))
        aliases: dict[str, str] = {}  # a name this module binds to one of the package's modules (`import ... as P`)
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                targets = [(a.name, None) for a in node.names]
                aliases.update({a.asname: a.name for a in node.names if a.asname and a.name in modules})
            elif isinstance(node, ast.ImportFrom):
                base = _from_base(node, package)
                targets = [
                    (f"{base}.{a.name}", None) if f"{base}.{a.name}" in modules else (base, a.name) for a in node.names
                ]
                aliases.update(
                    {a.asname or a.name: f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in modules}
                )
            else:
                continue
            for target, attr in targets:
                while target and target not in modules:  # `from a.b import name`: the module is a.b
                    target = target.rpartition(".")[0]
                if not target or target == name:
                    continue
                graph[name].add(target)
                # importing a.b.c runs a/__init__ and a/b/__init__ first: an edge to each parent package
                # the importer does not live in (its own packages are already running when it runs)
                parent = target.rpartition(".")[0]
                while parent:
                    if parent in modules and parent != name and not name.startswith(parent + "."):
                        graph[name].add(parent)
                    parent = parent.rpartition(".")[0]
                if attr and attr.startswith("_") and not attr.startswith("__"):
                    private.append((name, target, attr))
        for node in ast.walk(tree):  # `P._name` on a module imported as P reaches into it just the same
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Name)
                and node.value.id in aliases
                and aliases[node.value.id] != name
                and node.attr.startswith("_")
                and not node.attr.startswith("__")
            ):
                private.append((name, aliases[node.value.id], node.attr))
    return graph, private


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The graph's strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def _package_graph():
    from pathlib import Path

    return import_graph(Path(__file__).resolve().parents[1] / "agentrl")


def test_the_package_has_no_import_circle():
    """Every import counts, a function's own included: a function-local import may defer a heavy
    dependency, never dodge a circle (then the modules' order is a lie the next change trips on)."""
    graph, _ = _package_graph()
    assert len(graph) > 100  # the walk found the package
    assert cycles(graph) == []


def test_no_module_imports_another_modules_private_name():
    _, private = _package_graph()
    assert private == []


def test_the_cli_is_the_top_floor():
    """Library code never reaches up into the command line (only ``python -m agentrl`` runs it)."""
    graph, _ = _package_graph()
    assert {m for m, deps in graph.items() if "agentrl.cli" in deps} == {"agentrl.__main__"}


# what a function-local import may defer: a dependency that costs seconds or hundreds of MB to import, or
# one ``import agentrl`` must not need (the web stack, an HTTP client, pydantic)
DEFERRED = (*HEAVY, "transformers", "httpx", "pydantic", "mcp")


def imports_deferring_nothing(root, deferred=DEFERRED) -> list[tuple[str, str, int]]:
    """Every ``(importer, module, line)`` where a function imports one of the package's modules without
    deferring one of ``deferred``: the module (with what it imports at its top, transitively) brings in no
    such dependency that the importer's own top does not already bring. Such an import hides the real
    graph and defers nothing; it belongs at the top of the file."""
    import ast
    from pathlib import Path

    root = Path(root)
    modules = _modules(root)
    top: dict[str, set[str]] = {m: set() for m in modules}  # the package's modules run by importing m
    outside: dict[str, set[str]] = {m: set() for m in modules}  # top-level names of other distributions m imports
    local: list[tuple[str, str, int]] = []
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        parent = name.rpartition(".")[0]
        while parent:  # importing a.b.c runs a and a.b first
            top[name].add(parent)
            parent = parent.rpartition(".")[0]

        def walk(node, in_function, name=name, package=package):
            for child in ast.iter_child_nodes(node):
                if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                    continue  # never runs
                if isinstance(child, ast.Import):
                    targets = [a.name for a in child.names]
                elif isinstance(child, ast.ImportFrom):
                    base = _from_base(child, package)
                    targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in child.names]
                else:
                    walk(child, in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)))
                    continue
                for target in targets:
                    if target.split(".")[0] != root.name:
                        if not in_function:
                            outside[name].add(target.split(".")[0])
                        continue
                    while target and target not in modules:
                        target = target.rpartition(".")[0]
                    if in_function:
                        local.append((name, target, child.lineno))
                        continue
                    while target:
                        top[name].add(target)
                        target = target.rpartition(".")[0]

        walk(ast.parse(path.read_text(), str(path)), False)

    def brings(module: str) -> set[str]:
        seen, todo = set(), [module]
        while todo:
            m = todo.pop()
            if m not in seen:
                seen.add(m)
                todo.extend(top.get(m, ()))
        return {d for m in seen for d in outside[m] if d in deferred}

    return [(m, t, line) for m, t, line in local if not brings(t) - brings(m)]


def test_a_function_local_import_defers_a_heavy_dependency():
    """Issue 39, item 6: a function imports one of the package's modules only to defer what that module
    brings (torch, Ray, megatron, the web stack), never to dodge a circle or out of habit."""
    from pathlib import Path

    assert imports_deferring_nothing(Path(__file__).resolve().parents[1] / "agentrl") == []


def test_the_graph_checks_can_fail(tmp_path):
    """The checker sees a circle made of a function-local import and a private name across modules."""
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from pkg.sub.b import _helper\n")
    (pkg / "sub" / "b.py").write_text("def _helper():\n    from .. import a\n")
    (pkg / "c.py").write_text("import pkg.a\nfrom . import a\n")
    graph, private = import_graph(pkg)
    assert cycles(graph) == [["pkg.a", "pkg.sub.b"]]
    assert private == [("pkg.a", "pkg.sub.b", "_helper")]
    assert graph["pkg.c"] == {"pkg.a"}  # pkg itself is already running when pkg.c runs
    assert graph["pkg.a"] == {"pkg.sub", "pkg.sub.b"}
    # a private name reached through a module alias (`from pkg.sub import b as B; B._helper`) counts as well
    (pkg / "d.py").write_text(
        "from pkg.sub import b as B\nimport pkg.a as A\n\n\ndef f():\n    return B._helper, A.x\n"
    )
    _, private = import_graph(pkg)
    assert ("pkg.d", "pkg.sub.b", "_helper") in private and not [p for p in private if p[2] == "x"]
    # a function-local import defers nothing when the module brings no heavy dependency the importer lacks
    (pkg / "heavy.py").write_text("import torch\n")
    (pkg / "e.py").write_text(
        "import pkg.c\n\n\ndef f():\n    from pkg import a\n    from pkg.sub import b\n    from pkg import heavy\n"
    )
    # (b's own `from .. import a` dodges the circle above: it defers nothing either)
    found = sorted(imports_deferring_nothing(pkg))
    assert found == [("pkg.e", "pkg.a", 5), ("pkg.e", "pkg.sub.b", 6), ("pkg.sub.b", "pkg.a", 2)]


def test_the_graph_sees_a_circle_through_a_package_init(tmp_path):
    """``from pkg.adapters.base import X`` runs ``pkg/adapters/__init__.py`` first: a circle through it counts
    (the registry <-> adapters circle would come back unseen otherwise)."""
    pkg = tmp_path / "pkg"
    (pkg / "adapters").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "registry.py").write_text("from pkg.adapters.base import PREFIXES\n")
    (pkg / "adapters" / "__init__.py").write_text("from pkg.adapters.gym import GymEnv\n")
    (pkg / "adapters" / "base.py").write_text("PREFIXES = ()\n")
    (pkg / "adapters" / "gym.py").write_text("from pkg.registry import load\n")
    graph, _ = import_graph(pkg)
    assert cycles(graph) == [["pkg.adapters", "pkg.adapters.gym", "pkg.registry"]]
