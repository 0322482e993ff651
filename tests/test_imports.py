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
