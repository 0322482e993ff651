"""Weight sync through shared memory: one copy per step, engines on the same node copy nothing.

The trainer (rank 0) writes its full weights into one of two files in ``/dev/shm`` (alternating
per push) and tells each embedded engine on its node the file and the layout; the engine re-points
its parameters at views of that file (``LocalEngine.update_weights_from_tensors(assign=True)``).
So a push costs one memory copy (a ``pwrite`` of each CPU tensor's bytes into the slot; the trainer
maps no slot itself, so the engines' weights do not count in its memory too), however many engines
there are. Double buffering is what makes this safe: push k writes slot ``k % 2`` while engines
still read slot ``(k - 1) % 2``; by the time push k + 1 overwrites that slot, every engine has
acknowledged moving to slot ``k % 2``.

A trainer killed without :meth:`SharedWeightsWriter.close` (``ray.kill`` is a SIGKILL) leaves its
slot files behind; every new writer deletes the files of writers that are gone. A live writer holds
a lock on each of its files (processes in another pid namespace sharing ``/dev/shm`` see it too), so
only files nobody locks, of a process not alive here, are deleted.

Space is reserved with ``posix_fallocate`` when the files are created, so a full ``/dev/shm`` (64 MB
in a default Docker container) is an ``OSError`` at setup, and the run falls back to Ray's object
store, instead of a SIGBUS in the middle of a write.
"""

from __future__ import annotations

import errno
import fcntl
import os
import re
import uuid
import weakref
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch

ALIGN = 64


@dataclass(frozen=True)
class Layout:
    """Where each tensor lives in a slot file: ``(name, byte offset, shape, dtype name)``."""

    entries: tuple[tuple[str, int, tuple[int, ...], str], ...]
    nbytes: int

    @classmethod
    def of(cls, named: Iterable[tuple[str, torch.Tensor]]) -> Layout:
        entries, offset = [], 0
        for name, t in named:
            entries.append((name, offset, tuple(t.shape), str(t.dtype).removeprefix("torch.")))
            offset += -(-t.nbytes // ALIGN) * ALIGN
        return cls(tuple(entries), max(offset, ALIGN))


def _map(path: Path, nbytes: int) -> torch.Tensor:
    return torch.from_file(str(path), shared=True, size=nbytes, dtype=torch.uint8)


def views(buffer: torch.Tensor, layout: Layout) -> dict[str, torch.Tensor]:
    """The tensors of ``layout`` as views into ``buffer`` (no copies)."""
    out = {}
    for name, offset, shape, dtype in layout.entries:
        dt = getattr(torch, dtype)
        n = torch.Size(shape).numel() * dt.itemsize
        out[name] = buffer[offset : offset + n].view(dt).view(shape)
    return out


def open_weights(path: str, layout: Layout) -> dict[str, torch.Tensor]:
    """Engine side: map a slot file written by :class:`SharedWeightsWriter` and return its tensors."""
    return views(_map(Path(path), layout.nbytes), layout)


class SharedWeightsWriter:
    """Trainer side: two slot files under ``folder`` (default ``/dev/shm``), written alternately."""

    def __init__(self, folder: str | Path = "/dev/shm"):
        self.folder = Path(folder)
        self.tag = f"agentrl-weights-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.layout: Layout | None = None
        self.paths: list[Path] = []
        self.fds: list[int] = []  # one open, locked descriptor per slot file: "this writer is alive"
        self.pushes = 0
        reap_stale_slots(self.folder)
        weakref.finalize(self, _unlink, self.paths, self.fds)  # the lists are filled in place by _setup

    def _setup(self, layout: Layout) -> None:
        self.close()
        self.layout = layout
        for slot in range(2):
            path = self.folder / f"{self.tag}-{slot}"
            fd = os.open(path, os.O_CREAT | os.O_RDWR | os.O_TRUNC, 0o600)
            fcntl.flock(fd, fcntl.LOCK_SH)
            try:
                os.posix_fallocate(fd, 0, layout.nbytes)  # ENOSPC now, not SIGBUS mid-write
            except OSError:
                os.close(fd)
                self.close()
                path.unlink(missing_ok=True)
                raise
            self.fds.append(fd)
            self.paths.append(path)

    def write(self, named: list[tuple[str, torch.Tensor]]) -> tuple[str, Layout]:
        """Copy ``named`` into the next slot; return its path and layout for the engines.

        The bytes go in with ``pwrite`` on the slot's descriptor, not through a mapping: the trainer
        never maps a slot, so the weights the engines read do not also count (twice, one per slot) in
        the trainer's resident memory, as they did when both slots stayed mapped here (1.1 GB on
        SmolLM2-135M in fp32).
        """
        layout = Layout.of(named)
        if layout != self.layout:
            self._setup(layout)
        assert self.layout is not None
        slot = self.pushes % 2
        fd = self.fds[slot]
        for (_, t), (_, offset, _, _) in zip(named, self.layout.entries, strict=True):
            _pwrite_all(fd, _host_bytes(t), offset)
        self.pushes += 1
        return str(self.paths[slot]), self.layout

    def close(self) -> None:
        """Delete the slot files (engines that mapped them keep their pages until they let go)."""
        _unlink(self.paths, self.fds)
        self.layout = None


def _host_bytes(t: torch.Tensor) -> memoryview:
    """The bytes of ``t`` in host memory, contiguous, as a flat byte view.

    No copy for a contiguous CPU tensor (the trainer's parameters); a GPU or strided tensor is first
    copied to a contiguous host tensor, one tensor at a time.
    """
    t = t.detach().contiguous()  # on the device: then one device-to-host copy of contiguous bytes
    flat = t.cpu().reshape(-1)
    return memoryview(flat.view(torch.uint8).numpy()) if flat.numel() else memoryview(b"")


def _pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    """``pwrite`` until every byte is written (one call moves at most ~2 GiB on Linux)."""
    while len(data):
        n = os.pwrite(fd, data, offset)
        if n <= 0:  # cannot happen on a reserved tmpfs file; never spin on it
            raise OSError(errno.EIO, f"pwrite into a weight slot wrote nothing at byte {offset}")
        data, offset = data[n:], offset + n


def _unlink(paths: list[Path], fds: list[int]) -> None:
    for p in paths:
        p.unlink(missing_ok=True)
    for fd in fds:
        os.close(fd)
    paths.clear()
    fds.clear()


def reap_stale_slots(folder: str | Path = "/dev/shm") -> int:
    """Delete slot files whose writer process no longer exists; return how many were deleted."""
    removed = 0
    for path in Path(folder).glob("agentrl-weights-*"):
        m = re.match(r"agentrl-weights-(\d+)-", path.name)
        if m is None or _alive(int(m.group(1))) or _locked(path):
            continue
        path.unlink(missing_ok=True)
        removed += 1
    return removed


def _locked(path: Path) -> bool:
    """Does a live writer (anywhere) hold this slot file's lock?"""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return True  # gone already, or not ours to judge
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return False
    except BlockingIOError:
        return True
    finally:
        os.close(fd)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's live process
        return True
    return True
