"""The private folder CPU tensors travel through when they are handed to an engine by handle.

A colocated trainer and engine on a machine without CUDA share weights through files: the trainer
writes each tensor's bytes into a file (:class:`TensorStash`) and sends the file's *name*
(:mod:`agentrl.engines.tensor_ipc`); the engine reads it. A name is a request to read a file the
engine can reach, so it resolves only inside one directory that nobody but its owner can enter
(:class:`IpcFolder`, ``agentrl serve --weight-ipc-dir``): every file there was written by a process
of the run's own user, which could change the engine's weights anyway. The engine reads, never
maps, truncates or unlinks; the sender deletes exactly the files it wrote.
"""

from __future__ import annotations

import errno
import os
import re
import shutil
import stat
import tempfile
import uuid
from pathlib import Path
from typing import Any

import torch

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


class TensorHandleError(ValueError):
    """A serialized tensor payload that was refused; nothing was read or changed."""


class IpcFolder:
    """The folder CPU tensor handles must name files in: a directory of this user that nobody else can enter.

    Whoever starts the engine and its trainer makes one per run (:meth:`create`) and gives it to
    both (the engine's ``--weight-ipc-dir``, the trainer's ``TensorTransport(ipc_dir=...)``). Only
    processes of the owner can create files in it, so a name resolved inside it is a file the run's
    trainer wrote; the engine only reads them, the sender deletes its own.
    """

    def __init__(self, path: str | Path):
        self.path = Path(path)
        try:
            st = os.lstat(self.path)
        except OSError as exc:
            raise ValueError(f"--weight-ipc-dir {str(path)!r}: {exc.strerror}; create it with mode 0700") from None
        self._check(st)

    def _check(self, st: os.stat_result) -> None:
        where = f"--weight-ipc-dir {str(self.path)!r}"
        if not stat.S_ISDIR(st.st_mode):
            raise ValueError(f"{where} is not a directory (a symlink is refused too)")
        if st.st_uid != os.geteuid():
            raise ValueError(f"{where} belongs to uid {st.st_uid}, not to this user ({os.geteuid()})")
        if st.st_mode & 0o077:
            raise ValueError(
                f"{where} has mode {stat.S_IMODE(st.st_mode):o}: other users could put files in it; chmod 700"
            )

    @classmethod
    def create(cls, base: str | Path | None = None) -> IpcFolder:
        """A new private folder (mode 0700, a random name) under ``base`` (default ``/dev/shm``, else the temp dir)."""
        if base is None:
            base = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
        return cls(tempfile.mkdtemp(prefix="agentrl-ipc-", dir=base))

    def remove(self) -> None:
        """Delete the folder and whatever is left in it: for whoever created it, never for the engine."""
        shutil.rmtree(self.path, ignore_errors=True)

    def _open_dir(self) -> int:
        fd = os.open(self.path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            self._check(os.fstat(fd))
        except BaseException:
            os.close(fd)
            raise
        return fd

    def read(self, name: str, nbytes: int) -> torch.Tensor:
        """The ``nbytes`` bytes of file ``name`` of this folder, copied into a new ``uint8`` tensor.

        Only a plain name, a regular file of this user with one link and exactly ``nbytes`` bytes;
        read with ``pread`` (nothing stays mapped, a later truncation cannot fault the engine), never
        unlinked or changed.
        """
        check_name(name)
        dfd = self._open_dir()
        try:
            fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dfd)
        except FileNotFoundError:
            raise TensorHandleError(
                f"no file {name!r} in the engine's weight folder: the trainer writes CPU tensors there "
                "(TensorTransport(ipc_dir=...) with the engine's --weight-ipc-dir)"
            ) from None
        except OSError as exc:
            raise TensorHandleError(f"{name!r} in the engine's weight folder: {exc.strerror}") from None
        finally:
            os.close(dfd)
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_nlink != 1:
                raise TensorHandleError(f"{name!r} in the engine's weight folder is not a regular file of this user")
            if st.st_size != nbytes:
                raise TensorHandleError(f"{name!r} holds {st.st_size} bytes; the payload says {nbytes}")
            out = torch.empty(nbytes, dtype=torch.uint8)
            view = memoryview(out.numpy()) if nbytes else memoryview(b"")
            done = 0
            while done < nbytes:
                n = os.preadv(fd, [view[done:]], done)
                if n <= 0:
                    raise TensorHandleError(f"{name!r} in the engine's weight folder ended at byte {done}")
                done += n
            return out
        finally:
            os.close(fd)


def check_name(name: str) -> None:
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise TensorHandleError(
            f"shared-memory handle {name!r} is not a plain file name: CPU tensors are read only from the "
            "engine's own weight folder (--weight-ipc-dir), never from a path a client names"
        )


class TensorStash:
    """Sender side: the CPU tensors of one request, written as files into an :class:`IpcFolder`.

    Keep it open until every engine has answered (they read the files while handling the request),
    then :meth:`close` deletes exactly the files it wrote. Use as a context manager.
    """

    def __init__(self, folder: IpcFolder | str | Path):
        self.folder = folder if isinstance(folder, IpcFolder) else IpcFolder(folder)
        self.names: list[str] = []
        # tensor already written -> its file; the tensor itself is kept so that its memory cannot be freed and
        # reused by another tensor (a reused address would otherwise map a later tensor onto an earlier file)
        self._written: dict[tuple, tuple[str, int, torch.Tensor]] = {}

    def put(self, t: torch.Tensor) -> tuple[str, int]:
        """Write ``t``'s bytes (contiguous) into a new file; its name and size. The same tensor (tied weights
        under two names) is written once."""
        t = t.detach()
        key = (t.data_ptr(), t.storage_offset(), t.dtype, tuple(t.shape), tuple(t.stride()))
        if key in self._written:
            name, nbytes, _ = self._written[key]
            return name, nbytes
        data = t.contiguous().reshape(-1).view(torch.uint8)
        name = f"t-{uuid.uuid4().hex}"
        dfd = self.folder._open_dir()
        try:
            fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=dfd)
        finally:
            os.close(dfd)
        self.names.append(name)
        try:
            pwrite_all(fd, memoryview(data.numpy()) if data.numel() else memoryview(b""), 0)
        finally:
            os.close(fd)
        self._written[key] = (name, data.numel(), t)
        return name, data.numel()

    def close(self) -> None:
        """Delete the files this stash wrote (and only those)."""
        dfd = os.open(self.folder.path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            for name in self.names:
                try:
                    os.unlink(name, dir_fd=dfd)
                except FileNotFoundError:
                    pass
        finally:
            os.close(dfd)
        self.names.clear()
        self._written.clear()

    def __enter__(self) -> TensorStash:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    """``pwrite`` until every byte is written (one call moves at most ~2 GiB on Linux)."""
    while len(data):
        n = os.pwrite(fd, data, offset)
        if n <= 0:  # cannot happen on a regular file with room; never spin on it
            raise OSError(errno.EIO, f"pwrite wrote nothing at byte {offset}")
        data, offset = data[n:], offset + n


__all__ = ["IpcFolder", "TensorHandleError", "TensorStash", "check_name", "pwrite_all"]
