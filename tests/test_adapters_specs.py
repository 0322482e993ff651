"""Every bad ``--env`` spec is refused in one line that names the spec and the fix, never a traceback.

Each case runs the real CLI in a subprocess (``check-env``; ``rollout`` and ``train`` for some),
several at a time so the module stays quick. The "not an OpenEnv server" case is a plain HTTP
server on loopback; the "down" case a loopback port nothing listens on.
"""

from __future__ import annotations

import http.server
import importlib.util
import json
import socket
import textwrap
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.conftest import REPO, run_cli


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
    (tmp_path / "boom.py").write_text("raise RuntimeError('boom at import')\n")
    (tmp_path / "quits.py").write_text("import sys\nsys.exit(3)\n")
    (tmp_path / "depmod.py").write_text("import no_such_dependency\n")
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
        (("check-env",), "openenv:http://HOST:PORT", ["bad port", "'http://HOST:PORT'"]),
        (("check-env",), "openenv:localhost:abc", ["bad port", "'localhost:abc'"]),
        (("check-env",), "openenv:localhost:99999", ["bad port", "'localhost:99999'"]),
        (("check-env",), f"{tmp_path}/missing.py:Env", ["no such file", "missing.py"]),
        (("check-env",), f"{tmp_path}/boom.py:Env", ["importing", "RuntimeError: boom at import"]),
        (("check-env",), f"{tmp_path}/quits.py:Env", ["importing", "SystemExit: 3"]),
        (("check-env",), "gym:depmod:Foo-v0", ["'no_such_dependency'", "a dependency of 'depmod'"]),
        (("check-env",), "gym:boom:Foo-v0", ["importing 'boom'", "RuntimeError: boom at import"]),
        (("check-env",), "boom:Env", ["importing 'boom'", "RuntimeError: boom at import"]),
        (("check-env",), "quits:Env", ["importing 'quits'", "SystemExit: 3"]),
        (("check-env",), f"{tmp_path}/plain.py:NotAnEnv", ["not an agentrl.Env", "subclass agentrl.Env"]),
        (("check-env",), f"{tmp_path}/gymish.py:Walker", ["not an agentrl.Env", "--env gym:MODULE:ID"]),
        (("check-env",), "agentrl.types:ROLES", ["is a tuple, not an env class"]),
        (("rollout", "--engine-url", down), "gym:UnknownId", ["doesn't exist"]),
        (("rollout", "--engine-url", down), f"openenv:{down}", ["cannot reach the OpenEnv server"]),
        (("train",), "gym:UnknownId", ["doesn't exist"]),
    ]
    if importlib.util.find_spec("gem") is not None:
        cases.append((("check-env",), "gem:game:GuessTheNumber-v0-esy", ["did you mean game:GuessTheNumber-v0-easy"]))
    if importlib.util.find_spec("verifiers") is not None and importlib.util.find_spec("verifiers.v1") is not None:
        cases.append((("check-env",), "verifiers:no-such-taskset", ["taskset 'no-such-taskset' not found"]))
    env = {"PYTHONPATH": str(REPO)}  # run from tmp_path, some specs still name tests.test_adapters
    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda c: run_cli(*c[0][:1], "--env", c[1], *c[0][1:], cwd=tmp_path, env=env), cases))
    for (command, spec, wanted), r in zip(cases, results):
        lines = _error_lines(r.stderr)
        where = f"{command[0]} --env {spec}: rc {r.returncode}, stderr {r.stderr!r}"
        assert r.returncode != 0 and "Traceback" not in r.stderr and len(lines) == 1, where
        assert lines[0].startswith(f"agentrl {command[0]}: error: --env {spec}: "), where
        for text in wanted:
            assert text in lines[0], f"{where}: missing {text!r}"
        if spec.startswith(("gem:", "verifiers:", "gym:")):  # the spec is named once, by the flag
            assert lines[0].count(spec) == 1, where


def test_probe_goes_to_the_server_directly_whatever_http_proxy_says(monkeypatch):
    """Episodes (aiohttp) never use HTTP_PROXY, so the probe must not either: a proxy that is down
    (or one that cannot reach loopback) would refuse a live server the episodes could play."""
    from agentrl.adapters.openenv import probe_server

    class Schema(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = json.dumps({"action": {"type": "object"}} if self.path == "/schema" else {}).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Schema)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        down = f"http://127.0.0.1:{_closed_port()}"
        for name in ("HTTP_PROXY", "http_proxy", "HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy"):
            monkeypatch.setenv(name, down)
        for name in ("NO_PROXY", "no_proxy"):
            monkeypatch.delenv(name, raising=False)
        assert probe_server(f"http://127.0.0.1:{server.server_address[1]}")["action"] == {"type": "object"}
    finally:
        server.shutdown()


def test_a_metadata_answer_that_breaks_is_not_cached_as_no_metadata():
    """A served agentrl env read once as a plain OpenEnv server (its /metadata timed out or broke) would
    lose its tools for the rest of the process: such a probe fails and caches nothing; a 404 is 'none'."""
    from agentrl.adapters.openenv_probe import SERVER_INFO, probe_server

    answers = {"/metadata": (200, b"{not json")}

    class Server(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            code, body = answers.get(self.path, (200, json.dumps({"action": {"type": "object"}}).encode()))
            self.send_response(code)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Server)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        with pytest.raises(ValueError, match="/metadata did not answer"):
            probe_server(url)
        assert url not in SERVER_INFO
        answers["/metadata"] = (404, b"")
        probe_server(url)
        assert SERVER_INFO[url][1] == {}
    finally:
        server.shutdown()
        SERVER_INFO.pop(url, None)
