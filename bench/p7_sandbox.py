"""P7 sandbox cost per call: each backend's ``Sandbox.run`` / file round trip divided by a plain
``subprocess.run`` (no isolation at all) of the same program, measured in the same run.

What is timed, interleaved (baseline, docker, bubblewrap, process, baseline, ...; medians reported):

- ``true``: ``sandbox.run(["true"])`` vs ``subprocess.run(["true"], env={})`` — the fixed cost of one call;
- ``python3 -c pass``: the same with an interpreter start, what a python tool call pays at least (the
  baseline runs the ``python3`` of ``/usr/local/bin:/usr/bin:/bin``, the one the sandboxes find, never a
  pyenv shim);
- ``1 MB round trip``: ``write_files({"f": 1 MB})`` then ``read_file("f")`` vs writing and reading the
  same bytes in a host temp dir.

Sandboxes are created once and warm (a pool hands warm ones to episodes); creation and reset are
timed once each for reference.

    python bench/p7_sandbox.py                      # every backend available here, 20 reps
    python bench/p7_sandbox.py --reps 5 --backend bubblewrap --backend process
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from agentrl.sandbox import Sandbox, SandboxConfig, create_sandbox  # noqa: E402

BLOB = os.urandom(1 << 20)
# the interpreter the sandboxes find on their PATH (not a pyenv shim), started with an empty environment as there
PYTHON = shutil.which("python3", path="/usr/local/bin:/usr/bin:/bin") or "python3"


def _available(name: str) -> str | None:
    """None if ``name`` can run here, else why not."""
    if name == "docker":
        from agentrl.sandbox import docker

        return docker.unavailable_reason()
    if name == "bubblewrap":
        from agentrl.sandbox import local

        return local.bubblewrap_unavailable_reason()
    return None


def _config(name: str) -> SandboxConfig:
    return SandboxConfig(backend={"bubblewrap": "local"}.get(name, name))


def _baseline(op: str, tmp: Path) -> float:
    t0 = time.perf_counter()
    if op == "true":
        subprocess.run(["true"], check=True, env={})
    elif op == "python3 -c pass":
        subprocess.run([PYTHON, "-c", "pass"], check=True, env={})
    else:
        (tmp / "f").write_bytes(BLOB)
        assert (tmp / "f").read_bytes() == BLOB
    return time.perf_counter() - t0


async def _sandboxed(op: str, sb: Sandbox) -> float:
    t0 = time.perf_counter()
    if op == "true":
        r = await sb.run(["true"])
    elif op == "python3 -c pass":
        r = await sb.run(["python3", "-c", "pass"])
    else:
        await sb.write_files({"f": BLOB})
        assert await sb.read_file("f") == BLOB
        return time.perf_counter() - t0
    assert r.ok, r.text()
    return time.perf_counter() - t0


async def bench(backends: list[str], reps: int) -> None:
    ops = ["true", "python3 -c pass", "1 MB round trip"]
    boxes: dict[str, Sandbox] = {}
    for name in backends:
        t0 = time.perf_counter()
        boxes[name] = await create_sandbox(_config(name))
        made = time.perf_counter() - t0
        t0 = time.perf_counter()
        await boxes[name].reset()
        print(
            f"{name:10s} create {made * 1000:7.1f} ms, reset {(time.perf_counter() - t0) * 1000:6.1f} ms "
            f"[{boxes[name].isolation}]"
        )
    tmp = Path(tempfile.mkdtemp(prefix="p7-"))
    times: dict[tuple[str, str], list[float]] = {}
    try:
        for op in ops:  # warm-up: page cache, interpreter files, the engine's exec path
            _baseline(op, tmp)
            for sb in boxes.values():
                await _sandboxed(op, sb)
        for _ in range(reps):
            for op in ops:
                times.setdefault(("baseline", op), []).append(_baseline(op, tmp))
                for name, sb in boxes.items():
                    times.setdefault((name, op), []).append(await _sandboxed(op, sb))
    finally:
        for sb in boxes.values():
            await sb.close()
    ms = {k: statistics.median(v) * 1000 for k, v in times.items()}
    # the median of per-repetition ratios (each pair measured back to back), as the other bench/ scripts report
    ratio = {
        (name, op): statistics.median(s / b for s, b in zip(times[name, op], times["baseline", op]))
        for name in boxes
        for op in ops
    }
    print(f"\nmedian ms per call over {reps} reps (median ratio to the subprocess.run baseline):")
    print(f"{'':10s}" + "".join(f"{op:>26s}" for op in ops))
    for name in ["baseline", *boxes]:
        cells = [
            f"{ms[name, op]:8.2f} ms" + (f" (x{ratio[name, op]:6.1f})" if name != "baseline" else " " * 10)
            for op in ops
        ]
        print(f"{name:10s}" + "".join(f"{c:>26s}" for c in cells))
    print(
        "P7 sandbox cost per call / subprocess.run: "
        + "   ".join(
            f"{name} true x{ratio[name, 'true']:.1f}, python x{ratio[name, 'python3 -c pass']:.1f}, "
            f"1 MB x{ratio[name, '1 MB round trip']:.1f}"
            for name in boxes
        )
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument(
        "--backend",
        action="append",
        choices=["docker", "bubblewrap", "process"],
        help="backend to measure (repeatable; default: every one available here)",
    )
    a = ap.parse_args()
    logging.getLogger("agentrl.sandbox").setLevel(logging.ERROR)  # the process backend's warning is known here
    backends = []
    for name in a.backend or ["docker", "bubblewrap", "process"]:
        reason = _available(name)
        if reason:
            print(f"{name}: skipped ({reason})")
        else:
            backends.append(name)
    asyncio.run(bench(backends, a.reps))


if __name__ == "__main__":
    main()
