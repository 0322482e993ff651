"""Audit a sandbox backend with hostile programs, checked from the host.

A sandbox is only as good as what it stops, and isolation claims are cheap. This module runs the
programs a misbehaving (or reward-hacking) model would write — connect to the host, fork-bomb,
hog memory, spin forever, write and read host files, read the run's secrets, kill or trace host
processes, mount/chroot/unshare, fill the disk, flood stdout — each in a freshly reset sandbox,
and judges each one **on the host**: did a connection arrive, did a canary file change, did the
secret appear in the output, is the victim process alive, did host memory grow. What the program
says about itself is only used for the detail column; the verdict comes from outside wherever the
host can see it.

    agentrl sandbox check --backend docker     # or: python -m agentrl.sandbox.audit --backend local

``await audit(config)`` returns an :class:`AuditReport` (the tests assert every check per
backend); the programs and their verdicts live in :mod:`agentrl.sandbox.hostile`. The
``process`` backend does not isolate the filesystem and says so: its filesystem checks are marked
"expected (weak isolation)" in the report instead of being hidden. All network traffic of the audit
stays on 127.0.0.1; every canary it plants is removed afterwards.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import secrets
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from agentrl.sandbox import create_sandbox, resolve_backend
from agentrl.sandbox.base import DEFAULT_IMAGE, Sandbox, SandboxConfig, SandboxError
from agentrl.sandbox.hostile import CHECKS, MARK_PREFIX, SECRET_ENV, WEAK_ON_PROCESS, Hostile, leftovers
from agentrl.sandbox.image import ensure_image

__all__ = ["CHECKS", "MARK_PREFIX", "SECRET_ENV", "WEAK_ON_PROCESS", "AuditReport", "CheckResult", "audit", "main"]


@dataclass
class CheckResult:
    """One hostile program's verdict. ``expected_escape``: the backend is documented as weak here."""

    name: str
    contained: bool
    detail: str
    ms: float
    expected_escape: bool = False

    @property
    def status(self) -> str:
        if self.contained:
            return "contained"
        return "expected (weak isolation)" if self.expected_escape else "ESCAPED"


@dataclass
class AuditReport:
    """All checks of one backend, plus the median cost of a trivial call (``call_ms``, None if not measured)."""

    backend: str
    isolation: str
    checks: list[CheckResult]
    call_ms: float | None

    @property
    def contained(self) -> int:
        return sum(c.contained for c in self.checks)

    @property
    def total(self) -> int:
        return len(self.checks)

    @property
    def escapes(self) -> list[CheckResult]:
        """Every check that was not contained, the documented weaknesses included."""
        return [c for c in self.checks if not c.contained]

    @property
    def unexpected(self) -> list[CheckResult]:
        """Escapes the backend does not document: these are bugs."""
        return [c for c in self.escapes if not c.expected_escape]

    def summary(self) -> str:
        cost = f", {self.call_ms:.1f} ms per trivial call" if self.call_ms is not None else ""
        weak = sum(c.expected_escape and not c.contained for c in self.checks)
        note = f" ({weak} expected: weak isolation)" if weak else ""
        return f"{self.backend} [{self.isolation}]: {self.contained}/{self.total} contained{note}{cost}"

    def table(self):  # -> rich.table.Table (rich imported lazily: only the CLI prints)
        from rich.markup import escape
        from rich.table import Table

        styles = {"contained": "green", "ESCAPED": "bold red", "expected (weak isolation)": "yellow"}
        t = Table(title=escape(self.summary()))
        t.add_column("check", no_wrap=True)
        t.add_column("result", no_wrap=True)
        t.add_column("ms", justify="right", no_wrap=True)
        t.add_column("detail", overflow="fold")
        for c in self.checks:
            t.add_row(c.name, f"[{styles[c.status]}]{c.status}[/]", f"{c.ms:.0f}", escape(c.detail))
        return t


# -- running the audit ------------------------------------------------------------------------------


async def _fresh(sandbox: Sandbox | None, config: SandboxConfig) -> Sandbox:
    """The sandbox reset for the next check; a new one if the reset fails (a check may have broken it)."""
    if sandbox is not None:
        try:
            await sandbox.reset()
            return sandbox
        except Exception:
            with contextlib.suppress(Exception):
                await sandbox.close()
    return await create_sandbox(config)


async def _run_check(name: str, ctx: Hostile, weak: bool) -> CheckResult:
    t0 = time.perf_counter()
    try:
        contained, detail = await CHECKS[name](ctx)
    except Exception as e:  # the audit cannot vouch for what it could not check
        contained, detail = False, f"check failed to run: {type(e).__name__}: {e}"
    ms = (time.perf_counter() - t0) * 1000  # the whole check: program, host-side verdict and cleanup
    return CheckResult(name, bool(contained), detail, ms, expected_escape=weak and name in WEAK_ON_PROCESS)


async def _call_cost(sandbox: Sandbox, calls: int) -> float:
    times = []
    for _ in range(calls):
        t0 = time.perf_counter()
        await sandbox.run(["true"])
        times.append((time.perf_counter() - t0) * 1000)
    return statistics.median(times)


async def audit(config: SandboxConfig, *, checks: Sequence[str] | None = None, calls: int = 10) -> AuditReport:
    """Run the hostile programs (all of :data:`CHECKS`, or the named ``checks``) on ``config``'s backend.

    One sandbox is made (after the canary secret is put in this process's environment, so a leaking
    backend would pass it on) and reset before every check; ``calls`` trivial calls (``true``) give the
    median cost per call. Every canary is removed and the environment restored before returning.
    Raises :class:`SandboxError` only when no sandbox can be made at all.
    """
    names = list(CHECKS) if checks is None else list(checks)
    unknown = [n for n in names if n not in CHECKS]
    if unknown:
        raise ValueError(f"unknown audit checks {unknown}; choose from {', '.join(CHECKS)}")
    backend = resolve_backend(config.backend)
    token = secrets.token_hex(8)
    saved = os.environ.get(SECRET_ENV)
    os.environ[SECRET_ENV] = f"env-secret-{secrets.token_hex(8)}"
    tmp = Path(tempfile.mkdtemp(prefix=MARK_PREFIX))
    tmp.chmod(0o777)  # the canaries' permissions allow everything: only isolation stands in the way
    sandbox: Sandbox | None = None
    try:
        results = []
        for name in names:
            sandbox = await _fresh(sandbox, config)
            results.append(await _run_check(name, Hostile(sandbox, config, tmp, token), backend == "process"))
        sandbox = await _fresh(sandbox, config)
        call_ms = await _call_cost(sandbox, calls) if calls > 0 else None
        return AuditReport(backend, sandbox.isolation, results, call_ms)
    finally:
        if saved is None:
            os.environ.pop(SECRET_ENV, None)
        else:
            os.environ[SECRET_ENV] = saved
        if sandbox is not None:
            with contextlib.suppress(Exception):
                await sandbox.close()
        await leftovers(MARK_PREFIX + token, grace=0.0)
        shutil.rmtree(tmp, ignore_errors=True)


def main(argv: Sequence[str] | None = None) -> int:
    """``agentrl sandbox check``: print the audit table; exit 1 if anything escaped (the process backend's
    documented filesystem escapes too: it is not safe for model-written code), 2 if no sandbox could run."""
    ap = argparse.ArgumentParser(prog="agentrl sandbox check", description=__doc__.split("\n")[0])
    ap.add_argument(
        "--backend",
        default="auto",
        choices=["auto", "docker", "local", "process"],
        help="local = bubblewrap (or the weak process fallback when bwrap is missing)",
    )
    ap.add_argument("--image", default=DEFAULT_IMAGE, help="docker image to audit")
    ap.add_argument("--check", action="append", choices=list(CHECKS), help="run only this check (repeatable)")
    ap.add_argument("--calls", type=int, default=10, help="trivial calls timed for the cost per call")
    a = ap.parse_args(argv)
    from rich.console import Console

    try:
        if resolve_backend(a.backend) == "docker":
            ensure_image(a.image)  # the default image is built locally on first use
        report = asyncio.run(audit(SandboxConfig(backend=a.backend, image=a.image), checks=a.check, calls=a.calls))
    except SandboxError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    console = Console()
    console.print(report.table())
    if report.escapes:
        weak = [c.name for c in report.escapes if c.expected_escape]
        if weak:
            console.print(
                f"[yellow]{', '.join(weak)}: the process backend does not isolate the filesystem, mounts or pids "
                "(documented); use --backend docker or local (bubblewrap) for model-written code.[/]"
            )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
