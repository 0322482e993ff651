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

Every value is proven finite on the trainer's side, so the engine re-points its parameters without
reading a page (``finite_checked``; the engine mapping every page just to look for a NaN cost more than
the copy itself, bench P5): by the trainer where its weights change (``write(..., checked=True)``:
:attr:`agentrl.trainer.base.Trainer.weights_finite`), else by the writer as it writes
(:func:`write_checked`: each chunk checked right after it is copied, while it is still in cache; the
slot being written is one no engine reads, and a refused push does not count).

A large slot is several *part* files written in parallel, one thread each: tmpfs serializes the
writers of one file (its inode lock), so one file is written at one core's ``pwrite`` speed (~3
GB/s), well below a multi-threaded in-memory copy. Tensors stay whole, each in one part.
"""

from __future__ import annotations

import errno
import fcntl
import os
import re
import stat
import uuid
import weakref
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from agentrl.engines.ipc_folder import pwrite_all

ALIGN = 64
CHUNK = 1 << 20
"""Bytes written then checked at a time: small enough to stay in cache between the two."""
MIN_PART = 32 << 20
"""A slot gets one more part (and writer thread) per this many bytes, up to the trainer's threads."""


@dataclass(frozen=True)
class Layout:
    """Where each tensor lives in a slot: ``(name, byte offset in its part, shape, dtype name, part)``.

    ``parts`` holds each part file's size (``nbytes`` is their sum); part 0 is the slot's own path,
    part ``p > 0`` the same path with ``.p`` appended.
    """

    entries: tuple[tuple[str, int, tuple[int, ...], str, int], ...]
    nbytes: int
    parts: tuple[int, ...] = ()

    @classmethod
    def of(cls, named: Iterable[tuple[str, torch.Tensor]], parts: int = 1) -> Layout:
        """Tensors in order, cut into at most ``parts`` runs of about equal bytes (a tensor is never split)."""
        named = list(named)
        sizes = [-(-t.nbytes // ALIGN) * ALIGN for _, t in named]
        share = max(sum(sizes), 1) / max(parts, 1)
        entries, part_sizes, offset, done = [], [0], 0, 0
        for (name, t), size in zip(named, sizes):
            if offset and done >= share * len(part_sizes) and len(part_sizes) < parts:
                part_sizes.append(0)  # this part is full: the next tensor starts the next one
                offset = 0
            entries.append((name, offset, tuple(t.shape), str(t.dtype).removeprefix("torch."), len(part_sizes) - 1))
            offset += size
            done += size
            part_sizes[-1] = offset
        part_sizes = [max(n, ALIGN) for n in part_sizes]
        return cls(tuple(entries), sum(part_sizes), tuple(part_sizes))

    def part_path(self, path: str | Path, part: int) -> Path:
        return Path(path) if part == 0 else Path(f"{path}.{part}")


def _map(path: Path, nbytes: int) -> torch.Tensor:
    """Map a slot file: a regular file of this user (no symlink followed) of at least ``nbytes`` bytes.

    Checked on the open descriptor before mapping: torch would grow a shorter file to ``nbytes``,
    and a mapping past the end of a file faults the reader (SIGBUS) on first touch.
    """
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
            raise OSError(errno.EINVAL, f"weight slot {str(path)!r} is not a regular file of this user")
        if st.st_size < nbytes:
            raise OSError(errno.EINVAL, f"weight slot {str(path)!r} holds {st.st_size} bytes, not {nbytes}")
        return torch.from_file(f"/proc/self/fd/{fd}", shared=True, size=nbytes, dtype=torch.uint8)
    finally:
        os.close(fd)


def views(buffers: list[torch.Tensor], layout: Layout) -> dict[str, torch.Tensor]:
    """The tensors of ``layout`` as views into its parts' ``buffers`` (no copies)."""
    out = {}
    for name, offset, shape, dtype, part in layout.entries:
        dt = getattr(torch, dtype)
        n = torch.Size(shape).numel() * dt.itemsize
        out[name] = buffers[part][offset : offset + n].view(dt).view(shape)
    return out


def open_weights(path: str, layout: Layout) -> dict[str, torch.Tensor]:
    """Engine side: map a slot written by :class:`SharedWeightsWriter` (all its parts) and return its tensors.

    Every value was proven finite before the slot was written (the trainer after its step, or
    :func:`write_checked`), so the engine may load these with ``finite_checked=True``.
    """
    sizes = layout.parts or (layout.nbytes,)
    return views([_map(layout.part_path(path, p), n) for p, n in enumerate(sizes)], layout)


class SharedWeightsWriter:
    """Trainer side: two slots under ``folder`` (default ``/dev/shm``), written alternately.

    ``threads``: writer threads, one per part file of a large slot (default: torch's intra-op
    threads, at most 8; a slot gets one part per :data:`MIN_PART` bytes).
    """

    def __init__(self, folder: str | Path = "/dev/shm", threads: int | None = None):
        self.folder = Path(folder)
        self.tag = f"agentrl-weights-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.threads = max(1, threads or min(torch.get_num_threads(), 8))
        self.layout: Layout | None = None
        self.paths: list[Path] = []  # slot s, part p at index s * parts + p
        self.fds: list[int] = []  # one open, locked descriptor per slot file: "this writer is alive"
        self.pushes = 0
        self._pool: ThreadPoolExecutor | None = None
        reap_stale_slots(self.folder)
        weakref.finalize(self, _unlink, self.paths, self.fds)  # the lists are filled in place by _setup

    def _setup(self, layout: Layout) -> None:
        self.close()
        self.layout = layout
        for slot in range(2):
            for part, nbytes in enumerate(layout.parts):
                path = layout.part_path(self.folder / f"{self.tag}-{slot}", part)
                fd = os.open(path, os.O_CREAT | os.O_RDWR | os.O_TRUNC, 0o600)
                fcntl.flock(fd, fcntl.LOCK_SH)
                try:
                    os.posix_fallocate(fd, 0, nbytes)  # ENOSPC now, not SIGBUS mid-write
                except OSError:
                    os.close(fd)
                    self.close()
                    path.unlink(missing_ok=True)
                    raise
                self.fds.append(fd)
                self.paths.append(path)

    def write(self, named: list[tuple[str, torch.Tensor]], *, checked: bool = False) -> tuple[str, Layout]:
        """Copy ``named`` into the next slot; return its path and layout for the engines.

        ``checked``: the caller proved every value finite (the trainer does after each step,
        :attr:`agentrl.trainer.base.Trainer.weights_finite`), so the copy skips its own check.

        The bytes go in with ``pwrite`` on the slot's descriptor, not through a mapping: the trainer
        never maps a slot, so the weights the engines read do not also count (twice, one per slot) in
        the trainer's resident memory, as they did when both slots stayed mapped here (1.1 GB on
        SmolLM2-135M in fp32). Raises ``ValueError`` (before the slot counts as written) when a
        tensor holds NaN or inf: engines never see it, and keep serving the slot before.
        """
        total = sum(t.nbytes for _, t in named)
        layout = Layout.of(named, max(1, min(self.threads, total // MIN_PART)))
        if layout != self.layout:
            self._setup(layout)
        assert self.layout is not None
        slot = self.pushes % 2
        n = len(self.layout.parts)
        jobs: list[list[tuple[str, torch.Tensor, int]]] = [[] for _ in range(n)]
        for (name, t), (_, offset, _, _, part) in zip(named, self.layout.entries, strict=True):
            jobs[part].append((name, t, offset))

        def write_part(part: int) -> None:
            for name, t, offset in jobs[part]:
                write_checked(self.fds[slot * n + part], name, t, offset, check=not checked)

        if n == 1:
            write_part(0)
        else:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="agentrl-shm-write")
            futures = [self._pool.submit(write_part, p) for p in range(n)]
            wait(futures)  # every part finishes (or fails) before this returns or raises
            for f in futures:
                f.result()
        self.pushes += 1
        return str(self.paths[slot * n]), self.layout

    def close(self) -> None:
        """Delete the slot files (engines that mapped them keep their pages until they let go)."""
        _unlink(self.paths, self.fds)
        self.layout = None
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None


def write_checked(fd: int, name: str, t: torch.Tensor, offset: int, *, check: bool = True) -> None:
    """Write ``t``'s bytes at ``offset`` of ``fd``, :data:`CHUNK` bytes at a time, each chunk of a
    floating tensor checked finite right after it is written, from cache (one pass over memory, not
    two). A ``ValueError`` leaves the slot half written: callers write only a slot no engine reads.

    No copy for a contiguous CPU tensor (the trainer's parameters); a GPU or strided tensor is first
    copied to a contiguous host tensor, one tensor at a time.
    """
    t = t.detach().contiguous()  # on the device: then one device-to-host copy of contiguous bytes
    flat = t.cpu().reshape(-1)
    check = check and (flat.is_floating_point() or flat.is_complex())
    if not check:  # nothing to do while the bytes are in cache: one write of the whole tensor
        if flat.numel():
            pwrite_all(fd, memoryview(flat.view(torch.uint8).numpy()), offset)
        return
    step = max(1, CHUNK // max(flat.element_size(), 1))
    with np.errstate(all="ignore"):  # a NaN or an overflowing dot is an answer here, not a warning
        for start in range(0, flat.numel(), step):
            part = flat[start : start + step]
            pwrite_all(fd, memoryview(part.view(torch.uint8).numpy()), offset + start * flat.element_size())
            if check and not _finite(part):  # the chunk is in cache now
                raise ValueError(f"weight {name!r} holds NaN or infinite values: not pushed; the engines keep theirs")


_EXPONENT = {torch.float16: 0x7C00, torch.bfloat16: 0x7F80}  # a 16-bit float is inf or NaN iff these bits are all set


def _finite(t: torch.Tensor) -> bool:
    """No NaN or inf in ``t`` (a contiguous 1-D CPU chunk), computed by numpy on this one core.

    Not a torch reduction: that runs on every intra-op thread of the trainer and, on a busy
    machine, waits for all of them (700 ms instead of 20 for a 74 MiB model, bench P5). float32/64:
    the dot product with itself is finite (one pass, ~1.5x faster than max and min, which settle
    the rare overflow exactly); 16-bit floats: no value has an all-ones exponent (exactly the
    infinities and NaNs).
    """
    if t.is_complex():
        t = torch.view_as_real(t).reshape(-1)
    if t.dtype in (torch.float32, torch.float64):
        a = t.numpy()
        if np.isfinite(np.dot(a, a)):  # one pass; squares never cancel, so any NaN or inf shows
            return True
        return bool(np.isfinite(a.max()) and np.isfinite(a.min()))  # exact: the dot may only have overflowed
    if t.dtype in _EXPONENT:
        mask = _EXPONENT[t.dtype]
        bits = t.view(torch.int16).numpy().view(np.uint16)
        return not bool(((bits & mask) == mask).any())
    return bool(torch.isfinite(t.float()).all())  # float8 and other rare formats: exact, if slower


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
        m = re.match(r"agentrl-weights-(\d{1,10})-", path.name)  # a pid; a longer number is nobody's slot
        if m is None or _alive(int(m.group(1))) or _locked(path):
            continue
        try:
            path.unlink(missing_ok=True)
        except OSError:  # not ours after all (another user's, in a sticky /dev/shm): leave it
            continue
        removed += 1
    return removed


def _locked(path: Path) -> bool:
    """Does a live writer (anywhere) hold this slot file's lock? Anything but a regular file of this user is
    not ours to judge (and is never opened in a way that could block: another user may have left a FIFO here)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return True  # gone already, a symlink, or not ours to judge
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
            return True
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
    except (OverflowError, ValueError):  # no pid at all: nothing of ours to reap
        return True
    return True
