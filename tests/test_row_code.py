"""Task rows are data (issue 38 §6): a row's ``generate_function_path`` runs only behind ``--trust-row-code``.

Every command that reads task rows (check-env, rollout, env-serve, train; eval and sft read them the
same way) is given a hostile row whose module writes a marker file when it is imported: without the
flag the command refuses, naming the row's line, the key and the flag, and the marker never appears;
with it the row's function is imported and runs, as slime's per-row generate function does.
"""

from __future__ import annotations

import contextlib
import json
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from agentrl.adapters.openenv_server import build_server
from agentrl.chat import ChatTemplate
from agentrl.config import RolloutConfig
from agentrl.envs.calculator import Calculator
from agentrl.rollout.episode import EpisodeContext
from agentrl.rollout.generate import generate_rollout
from tests.conftest import read_samples, run_cli
from tests.test_data import hostile_helper
from tests.test_sample_fields import NoEngine

CALC = "agentrl/Calculator-v0"


def _hostile_rows(folder: Path) -> tuple[Path, str, Path]:
    """Two Calculator rows, the second naming a module that writes ``folder/MARKER`` when imported."""
    folder.mkdir(parents=True, exist_ok=True)
    spec, marker = hostile_helper(folder)
    rows = Calculator.tasks()[:2]
    rows[1] = {**rows[1], "generate_function_path": spec}
    path = folder / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path, spec, marker


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _assert_refused(r: subprocess.CompletedProcess, rows: Path, marker: Path) -> None:
    assert r.returncode == 2, r.stdout + r.stderr
    assert f"{rows}:2: 'generate_function_path'" in r.stderr and "--trust-row-code" in r.stderr, r.stderr
    assert not marker.exists(), "the row's module was imported"


@pytest.mark.e2e
def test_check_env_imports_a_rows_module_only_with_the_flag(tmp_path):
    rows, _, marker = _hostile_rows(tmp_path)
    _assert_refused(run_cli("check-env", "--env", CALC, "--prompt-data", str(rows)), rows, marker)
    r = run_cli("check-env", "--env", CALC, "--prompt-data", str(rows), "--trust-row-code")
    assert r.returncode == 0 and "0 contract violation(s)" in r.stdout, r.stdout + r.stderr
    assert marker.exists()


@pytest.mark.e2e
def test_rollout_refuses_a_rows_module_before_anything_starts(tiny_ckpt, tmp_path):
    rows, _, marker = _hostile_rows(tmp_path)
    out = tmp_path / "samples.jsonl"
    flags = ["--env", CALC, "--prompt-data", str(rows), "--hf-checkpoint", str(tiny_ckpt), "--output", str(out)]
    _assert_refused(run_cli("rollout", *flags, timeout=120), rows, marker)
    assert not out.exists()


def test_rollout_runs_a_rows_own_function_with_the_flag(tiny_server, tiny_ckpt, tmp_path):
    rows, spec, marker = _hostile_rows(tmp_path)
    out = tmp_path / "samples.jsonl"
    r = run_cli(
        "rollout", "--env", CALC, "--prompt-data", str(rows), "--trust-row-code", "--engine-url", tiny_server,
        "--hf-checkpoint", str(tiny_ckpt), "--max-turns", "1", "--rollout-max-turn-len", "8", "--output", str(out),
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    env_sample, own = sorted(read_samples(out), key=lambda s: s["index"])
    reason = own["metadata"]["status_reason"]
    assert (own["generate_function_path"], own["reward"], reason) == (spec, 2.0, "custom_generate")
    assert env_sample["generate_function_path"] is None and marker.exists()


def test_env_serve_build_server_imports_a_rows_module_only_with_the_flag(tmp_path):
    rows, spec, marker = _hostile_rows(tmp_path)
    with pytest.raises(ValueError) as err:
        build_server(CALC, prompt_data=str(rows))
    assert str(err.value).startswith(f"{rows}:2: 'generate_function_path' {spec!r}")
    assert "--trust-row-code" in str(err.value) and not marker.exists()
    server = build_server(CALC, prompt_data=str(rows), trust_row_code=True)
    assert server.tasks is not None and server.tasks[1]["generate_function_path"] == spec and marker.exists()


@pytest.mark.e2e
def test_env_serve_command_refuses_a_rows_module_before_binding_and_serves_with_the_flag(tmp_path):
    rows, _, marker = _hostile_rows(tmp_path)
    port = _free_port()
    flags = ["--env", CALC, "--prompt-data", str(rows), "--port", str(port)]
    _assert_refused(run_cli("env-serve", *flags, timeout=120), rows, marker)
    cmd = [sys.executable, "-m", "agentrl", "env-serve", *flags, "--trust-row-code"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline, meta = time.monotonic() + 60, None
        while time.monotonic() < deadline and proc.poll() is None:
            with contextlib.suppress(httpx.HTTPError):
                meta = httpx.get(f"http://127.0.0.1:{port}/metadata", timeout=1).json()
                break
            time.sleep(0.1)
        assert meta is not None and meta["num_tasks"] == 2, proc.stderr.read() if proc.poll() is not None else meta
        assert marker.exists()
    finally:
        proc.terminate()
        proc.wait(15)


def _train_config(folder: Path, rows: Path, ckpt: Path, **extra: object) -> Path:
    path = folder / "run.yaml"
    values = {"env": CALC, "prompt_data": str(rows), "hf_checkpoint": str(ckpt), "save": str(folder / "run")}
    path.write_text("".join(f"{k}: {json.dumps(v)}\n" for k, v in {**values, **extra}.items()))
    return path


@pytest.mark.e2e
def test_train_refuses_a_rows_module_from_its_config_file_before_anything_starts(tiny_ckpt, tmp_path):
    rows, _, marker = _hostile_rows(tmp_path)
    config = _train_config(tmp_path, rows, tiny_ckpt)
    _assert_refused(run_cli("train", "--config", str(config), timeout=120), rows, marker)
    assert not (tmp_path / "run").exists()


def test_train_accepts_rows_naming_code_when_its_config_file_trusts_them(tiny_ckpt, tmp_path, monkeypatch):
    """The run goes past every preflight check to start its runtime (stopped there: Ray is not the point)."""
    from agentrl.flags import load_config_file, run_config_from_values
    from agentrl.runtime import train as train_mod

    class Started(Exception):
        pass

    def started(*args, **kwargs):
        raise Started

    monkeypatch.setattr(train_mod._Runtime, "__init__", started)
    rows, _, marker = _hostile_rows(tmp_path)
    cfg = run_config_from_values(load_config_file(_train_config(tmp_path, rows, tiny_ckpt, trust_row_code=True)))
    assert cfg.rollout.trust_row_code is True
    with pytest.raises(Started):
        train_mod.train(cfg)
    assert marker.exists()


async def test_the_rollout_loop_runs_no_rows_module_without_the_flag(tiny_tokenizer, tmp_path):
    """Rows that did not come through the readers (a --data-source-path source, the Python API) meet the
    same rule where their code would run."""
    spec, marker = hostile_helper(tmp_path)
    rows = [{"prompt": "a", "label": None, "generate_function_path": spec}]

    def ctx(**kw: object) -> EpisodeContext:
        return EpisodeContext(engine=NoEngine(), template=ChatTemplate(tiny_tokenizer), config=RolloutConfig(**kw))

    with pytest.raises(ValueError, match=r"^task row 0 of the rollout: 'generate_function_path'.*--trust-row-code"):
        await generate_rollout(ctx(), None, rows)
    assert not marker.exists()
    samples, _ = await generate_rollout(ctx(trust_row_code=True), None, rows)
    assert [s.reward for s in samples] == [2.0] and marker.exists()
