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
