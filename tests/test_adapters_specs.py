"""Every bad ``--env`` spec is refused in one line that names the spec and the fix, never a traceback.

Each case runs the real CLI in a subprocess (``check-env``; ``rollout`` and ``train`` for some),
several at a time so the module stays quick. The "not an OpenEnv server" case is a plain HTTP
server on loopback; the "down" case a loopback port nothing listens on.
"""

from __future__ import annotations

import http.server
import importlib.util
import socket
import subprocess
import sys
import textwrap
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.test_cli import REPO


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "agentrl", *args], cwd=REPO, capture_output=True, text=True, timeout=300
    )


def _error_lines(stderr: str) -> list[str]:
    """stderr without other libraries' warning lines (none are expected, but they are not ours to forbid)."""
    return [line for line in stderr.splitlines() if line.strip() and "Warning" not in line]


@pytest.fixture(scope="module")
def not_openenv() -> str:
    """A loopback HTTP server that is not an OpenEnv server (it answers no GET)."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), http.server.BaseHTTPRequestHandler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def test_bad_env_specs_are_one_line_naming_the_fix(tmp_path: Path, not_openenv: str):
    (tmp_path / "plain.py").write_text("class NotAnEnv:\n    pass\n")
    (tmp_path / "gymish.py").write_text(
        textwrap.dedent("""
        import gymnasium

        class Walker(gymnasium.Env):
            pass
        """)
    )
    down = f"http://127.0.0.1:{_closed_port()}"
    cases: list[tuple[tuple[str, ...], str, list[str]]] = [
        # (command, --env spec, what the one line must say)
        (("check-env",), "gym:UnknownId", ["Environment `UnknownId` doesn't exist", "gym:MODULE:ID"]),
        (("check-env",), "gym:CartPol-v1", ["Did you mean: `CartPole`?"]),
        (("check-env",), "gym:no_such_pkg:Thing-v0", ["no module named 'no_such_pkg'", "gymnasium.register"]),
        (("check-env",), "agentrl/Calculatr-v0", ["registered env id", "did you mean agentrl/Calculator-v0"]),
        (("check-env",), "tests.test_adapters:agentrl-test/Nope-v0", ["registered no env id 'agentrl-test/Nope-v0'"]),
        (("check-env",), "no_such_module:Env", ["no module named 'no_such_module'", "install the package"]),
        (("check-env",), "agentrl.envs.calculator:Calc", ["has no attribute 'Calc'", "its Env classes: Calculator"]),
        (("check-env",), "openenv:ftp://127.0.0.1:1", ["expected http://HOST:PORT"]),
        (("check-env",), f"openenv:{down}", ["cannot reach the OpenEnv server", "start it"]),
        (("check-env",), f"openenv:{not_openenv}", ["answered GET /schema with HTTP", "not an OpenEnv server"]),
        (("check-env",), f"{tmp_path}/missing.py:Env", ["no such file", "missing.py"]),
        (("check-env",), f"{tmp_path}/plain.py:NotAnEnv", ["not an agentrl.Env", "subclass agentrl.Env"]),
        (("check-env",), f"{tmp_path}/gymish.py:Walker", ["not an agentrl.Env", "--env gym:MODULE:ID"]),
        (("check-env",), "agentrl.types:ROLES", ["is a tuple, not an env class"]),
        (("rollout", "--engine-url", down), "gym:UnknownId", ["doesn't exist"]),
        (("rollout", "--engine-url", down), f"openenv:{down}", ["cannot reach the OpenEnv server"]),
        (("train",), "gym:UnknownId", ["doesn't exist"]),
    ]
    if importlib.util.find_spec("gem") is not None:
        cases.append((("check-env",), "gem:game:GuessTheNumber-v0-esy", ["did you mean game:GuessTheNumber-v0-easy"]))
    if importlib.util.find_spec("verifiers.v1") is not None:
        cases.append((("check-env",), "verifiers:no-such-taskset", ["taskset 'no-such-taskset' not found"]))
    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda c: _cli(*c[0][:1], "--env", c[1], *c[0][1:]), cases))
    for (command, spec, wanted), r in zip(cases, results):
        lines = _error_lines(r.stderr)
        where = f"{command[0]} --env {spec}: rc {r.returncode}, stderr {r.stderr!r}"
        assert r.returncode != 0 and "Traceback" not in r.stderr and len(lines) == 1, where
        assert lines[0].startswith(f"agentrl {command[0]}: error: --env {spec}: "), where
        for text in wanted:
            assert text in lines[0], f"{where}: missing {text!r}"
