"""Hostile programs per backend: every check of :mod:`agentrl.sandbox.audit`, judged on the host.

One test per backend × check, so each escape shows up by name. The ``process`` backend has no
filesystem isolation (documented): its filesystem read/write checks are ``xfail(strict=True)``,
so they must really escape there — if that backend ever starts containing them, the xfail turns
into a failure and the documentation has to change with it.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest

from agentrl.sandbox.audit import CHECKS, MARK_PREFIX, SECRET_ENV, WEAK_ON_PROCESS, audit
from tests.conftest import sandbox_config

pytestmark = pytest.mark.e2e  # real sandboxes (docker, bubblewrap, process): see conftest

BACKENDS = [pytest.param("docker", marks=pytest.mark.docker), "bubblewrap", "process"]
# small limits keep the hostile programs cheap on a shared machine (the audit tries 2-4x each limit)
LIMITS = dict(memory_mb=256, pids=64, scratch_mb=32, file_size_mb=16, timeout=10.0, max_output_bytes=4096)
PROJECT = Path(__file__).resolve().parents[1]


def _audit_traces() -> set[str]:
    """Everything an audit could leave on the host: canary files, marked processes, the secret variable."""
    found = set()
    for folder in (Path("/etc"), Path.home(), PROJECT, Path(tempfile.gettempdir())):
        found |= {str(p) for p in folder.glob(f"{MARK_PREFIX}*")} | {str(p) for p in folder.glob(f".{MARK_PREFIX}*")}
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            try:
                if MARK_PREFIX.encode() in (p / "cmdline").read_bytes():
                    found.add(f"pid {p.name}")
            except OSError:
                pass
    if SECRET_ENV in os.environ:
        found.add(f"env {SECRET_ENV}")
    return found


def _my_containers(backend: str) -> set[str]:
    """Containers and volumes this test process owns (docker labels them with the owner's pid)."""
    if backend != "docker":
        return set()
    from agentrl.sandbox.docker import docker_client

    label = {"label": f"agentrl.owner_pid={os.getpid()}"}
    client = docker_client()
    return {c.id for c in client.containers.list(all=True, filters=label, ignore_removed=True)} | {
        v.name for v in client.volumes.list(filters=label)
    }


@pytest.mark.parametrize("check", list(CHECKS))
@pytest.mark.parametrize("sandbox_backend", BACKENDS, indirect=True)
async def test_hostile_program_is_contained(sandbox_backend: str, check: str, request):
    if sandbox_backend == "process" and check in WEAK_ON_PROCESS:
        request.applymarker(
            pytest.mark.xfail(strict=True, reason="process backend: no filesystem isolation (documented)")
        )
    before, containers = _audit_traces(), _my_containers(sandbox_backend)
    report = await audit(sandbox_config(sandbox_backend, **LIMITS), checks=[check], calls=0)
    (result,) = report.checks
    assert result.name == check and result.ms > 0
    assert _audit_traces() <= before, "the audit left traces on the host"
    assert _my_containers(sandbox_backend) <= containers, "the audit's sandbox was not removed"
    assert result.expected_escape == (sandbox_backend == "process" and check in WEAK_ON_PROCESS)
    assert result.contained, f"{check} escaped on {sandbox_backend}: {result.detail}"


@pytest.mark.parametrize("sandbox_backend", BACKENDS, indirect=True)
async def test_full_audit_in_one_sandbox(sandbox_backend: str):
    """All checks back to back in one sandbox, reset in between (as ``agentrl sandbox check`` runs them):
    what one hostile program leaves behind (zombies, a used-up pids budget, files) must not break the next."""
    report = await audit(sandbox_config(sandbox_backend, **LIMITS), calls=3)
    assert report.total == len(CHECKS)
    assert not report.unexpected, "\n".join(f"{c.name}: {c.detail}" for c in report.unexpected)
    weak = {c.name for c in report.escapes}
    assert weak == (set(WEAK_ON_PROCESS) if sandbox_backend == "process" else set())
    assert report.contained == report.total - len(weak)
    assert f"{report.contained}/{report.total} contained" in report.summary()
    assert report.call_ms is not None and 0 < report.call_ms < 5000
    assert report.isolation in ("docker", "bubblewrap", "process (weak: no filesystem isolation)")


async def test_unknown_check_is_refused():
    with pytest.raises(ValueError, match="unknown audit checks"):
        await audit(sandbox_config("process"), checks=["no_such_check"])


def test_cli_exit_code_reports_the_weak_backend(capsys):
    """The process backend escapes the filesystem checks (documented): the CLI says so and exits 1."""
    from agentrl.sandbox.audit import main

    rc = main(
        ["--backend", "process", "--check", "read_outside_scratch", "--check", "network_loopback", "--calls", "1"]
    )
    out = capsys.readouterr().out
    assert rc == 1
    assert "expected (weak isolation)" in out and "contained" in out
    assert "read_outside_scratch" in out and "does not isolate the filesystem" in out
    assert SECRET_ENV not in os.environ


@pytest.mark.skipif(os.geteuid() != 0, reason="only as root does each process sandbox get a uid of its own")
async def test_process_backend_removes_its_host_shm_files_on_reset_and_close():
    """The process backend writes the host's /dev/shm (no mount namespace): what its uid left goes on reset
    and on close (issue 18 item 13: 300 MB used to survive both)."""
    from agentrl.sandbox.local import LocalSandbox

    sb = await LocalSandbox.create(sandbox_config("process", **LIMITS), bubblewrap=False)
    names = [Path(f"/dev/shm/agentrl-test-{os.getpid()}-{i}") for i in range(2)]
    try:
        for i, p in enumerate(names):
            r = await sb.run(["python3", "-c", f"open({str(p)!r}, 'wb').write(b'x' * 4096)"], timeout=15)
            assert r.exit_code == 0 and p.exists(), r.stderr
            if i == 0:
                await sb.reset()
                assert not p.exists()
        await sb.close()
        assert not names[1].exists()
    finally:
        for p in names:
            p.unlink(missing_ok=True)
        await sb.close()
