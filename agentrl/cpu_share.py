"""CPU threads sized to the cores a process can actually use now, for torch on CPU.

Why: torch's OpenMP team defaults to every core of the machine, and every parallel region ends at a
barrier that waits for the slowest thread. When another busy process (a second job, the engine actor
of an ``--async`` run, a sandbox) holds one of two cores, one of our two threads keeps being
descheduled and every matmul waits for it: a train step measured 3.5-7x slower, where sharing the
cores fairly should cost about 2x. Two things fix it:

* :func:`usable_cores`: the cores this process may run on (CPU affinity, ``taskset``) and the CPU
  quota of its cgroup (Docker ``--cpus``, Kubernetes limits), not ``os.cpu_count()``;
* :class:`CoreShare`: how many of those cores the *other* processes kept busy over a recent window
  (the busy time of the CPUs in this process's affinity, from ``/proc/stat``, minus this process's own
  ``/proc/self/stat`` time), and a thread count of the rest, never below a floor (an ``--async`` run's
  fixed split, so two adaptive processes cannot starve one another). The trainer asks before each
  micro-batch and the embedded engine every ~0.2 s of decoding, so each phase of an ``--async`` run
  takes every core while the other is idle.

Linux only (``/proc``); elsewhere :class:`CoreShare` keeps the fixed count it was given.
"""

from __future__ import annotations

import math
import os
import time
from pathlib import Path

_CGROUP = Path("/sys/fs/cgroup")


def usable_cores() -> int:
    """Cores this process may use: its CPU affinity, capped by its cgroup's CPU quota (rounded up)."""
    cores = len(_affinity()) or (os.cpu_count() or 1)
    quota = cgroup_cpu_quota()
    if quota is not None:
        cores = min(cores, max(1, math.ceil(quota)))
    return max(1, cores)


def _affinity() -> set[int]:
    try:
        return set(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return set()


def cgroup_cpu_quota(root: Path = _CGROUP, paths: list[str] | None = None) -> float | None:
    """The CPU quota of this process's cgroup in cores, None if unlimited.

    cgroup v2: the smallest ``cpu.max`` of the cgroup and its ancestors (a parent's limit binds its
    children). v1: ``cpu.cfs_quota_us / cpu.cfs_period_us`` of the cgroup, or of the ``cpu`` mount
    itself (inside a container the mount *is* the container's cgroup, though ``/proc/self/cgroup``
    names the host's path). ``paths``: the cgroup paths (default: this process's, ``/proc/self/cgroup``).
    """
    quotas: list[float] = []
    for name in _own_cgroups() if paths is None else paths:
        parts = [p for p in name.split("/") if p]
        for depth in range(len(parts), -1, -1):  # v2: the cgroup and every ancestor
            q = _read_v2(root.joinpath(*parts[:depth], "cpu.max"))
            if q is not None:
                quotas.append(q)
        for v1 in (root.joinpath("cpu", *parts), root / "cpu"):  # v1: the named cgroup, else the mount
            q = _read_v1(v1)
            if q is not None:
                quotas.append(q)
                break
    return min(quotas) if quotas else None


def _read_v2(path: Path) -> float | None:
    try:
        quota, _, period = path.read_text().strip().partition(" ")
        return None if quota == "max" else int(quota) / int(period or 100000)
    except (OSError, ValueError):
        return None


def _read_v1(folder: Path) -> float | None:
    try:
        quota_us = int((folder / "cpu.cfs_quota_us").read_text())
        period_us = int((folder / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        return None
    return None if quota_us <= 0 or period_us <= 0 else quota_us / period_us


def _own_cgroups() -> list[str]:
    """This process's cgroup paths (the v2 one and v1's cpu controller), from ``/proc/self/cgroup``."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return []
    out = []
    for line in lines:
        fields = line.split(":", 2)
        if len(fields) == 3 and (fields[1] == "" or "cpu" in fields[1].split(",")):
            out.append(fields[2])
    return out or ["/"]


def _busy_seconds(cpus: set[int]) -> tuple[float, float] | None:
    """(busy CPU seconds of the CPUs in ``cpus`` (all when empty), CPU seconds of this process), since boot."""
    try:
        hz = os.sysconf("SC_CLK_TCK")
        busy = 0
        for line in Path("/proc/stat").read_text().splitlines():
            if not line.startswith("cpu") or line.startswith("cpu "):
                continue
            name, *fields = line.split()
            if cpus and int(name[3:]) not in cpus:
                continue
            values = [int(v) for v in fields[:8]]  # user nice system idle iowait irq softirq steal
            busy += sum(values) - values[3] - values[4]
        own = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
        return busy / hz, (int(own[11]) + int(own[12])) / hz  # utime, stime of every thread
    except (OSError, ValueError, IndexError):
        return None


class CoreShare:
    """The torch thread count for this process: usable cores minus the cores other processes keep busy.

    Between ``min_threads`` and ``max_threads`` (both capped by :func:`usable_cores`). ``threads()``
    measures over the time since its last measurement once that window is at least ``min_window``
    seconds (else it keeps its last answer and reads nothing), so call it at natural boundaries (a
    micro-batch, a decode step). ``settle()`` measures a fresh short window first (the start of a phase,
    whose previous window was another phase's: it sleeps ``window`` seconds, 50 ms by default, since
    ``/proc/stat`` counts in 10 ms ticks). ``apply()`` sets ``torch.set_num_threads`` in the calling
    thread (torch's OpenMP count is per thread) when the count changes.
    """

    def __init__(
        self,
        max_threads: int | None = None,
        *,
        min_threads: int = 1,
        min_window: float = 0.2,
        enabled: bool = True,
    ):
        self.cores = cores = usable_cores()
        self.max_threads = max(1, min(max_threads or cores, cores))
        self.min_threads = max(1, min(min_threads, self.max_threads))
        self.min_window = min_window
        self._cpus = _affinity()
        self.enabled = enabled and _busy_seconds(self._cpus) is not None
        self.current = self.max_threads
        self.others = 0.0  # cores the other processes used in the last window
        self._last = (time.monotonic(), _busy_seconds(self._cpus) if self.enabled else None)

    def threads(self) -> int:
        """The count for the next stretch of work (unchanged while the window is still too short)."""
        if not self.enabled:
            return self.current
        now = time.monotonic()
        t0, before = self._last
        if now - t0 < self.min_window:
            return self.current
        sample = _busy_seconds(self._cpus)
        self._last = (now, sample)
        if sample is None or before is None:
            return self.current
        others = max(0.0, (sample[0] - before[0]) - (sample[1] - before[1])) / (now - t0)
        self.others = others
        # a core counts as taken when others kept it busy over half the window (Ray's and the driver's
        # background work stays well under that)
        free = self.cores - math.floor(others + 0.5)
        self.current = max(self.min_threads, min(self.max_threads, free))
        return self.current

    def restart(self) -> None:
        """Start a new window now: the time since the last measurement says nothing about what comes next."""
        if self.enabled:
            self._last = (time.monotonic(), _busy_seconds(self._cpus))

    def settle(self, window: float = 0.05) -> int:
        """Measure a fresh ``window`` (the phase before this one is no guide) and return :meth:`threads`."""
        if not self.enabled:
            return self.current
        self.restart()
        time.sleep(window)
        saved, self.min_window = self.min_window, 0.0
        try:
            return self.threads()
        finally:
            self.min_window = saved

    def apply(self, n: int | None = None) -> int:
        """Set torch's intra-op threads of the calling thread to ``n`` (default: :meth:`threads`) if that changes them."""
        import torch

        n = self.threads() if n is None else n
        if torch.get_num_threads() != n:
            torch.set_num_threads(n)
        return n
