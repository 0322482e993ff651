"""The sandbox contract: where model-written code runs, and what comes back.

Agentic RL runs model-written programs millions of times. Each must stay away from the host, the
network, the run's secrets and the reward, and must not outlive its episode. A :class:`Sandbox` is
one isolated workspace: a writable scratch directory (``/scratch`` inside) plus the rest of the
filesystem read-only, no network, and limits on memory, processes, CPU and file size. An episode
holds one sandbox for all its tool calls (so files and a Python session persist between turns);
between episodes the pool :meth:`Sandbox.reset` s it, which kills every process it started and
wipes its scratch.

Backends (one ABC, the same tests): ``docker`` (:mod:`agentrl.sandbox.docker`, a container per
sandbox through the Docker Engine API) and ``local`` (:mod:`agentrl.sandbox.local`: bubblewrap,
or, loudly marked as weaker, a plain process with rlimits and no network).

Every call returns an :class:`ExecResult`; a call never raises for what the *program* did (a crash,
a timeout, 100 MB of output). :class:`SandboxError` is for the sandbox itself failing (the engine
went away, the image is missing) and says what to do next.
"""

from __future__ import annotations

import abc
import posixpath
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

__all__ = [
    "DEFAULT_IMAGE",
    "ExecResult",
    "Sandbox",
    "SandboxConfig",
    "SandboxError",
    "Session",
    "check_relative_path",
    "normalize_files",
    "program_argv",
    "truncate_output",
]

DEFAULT_IMAGE = "agentrl-sandbox:py3.11"
"""The image ``agentrl sandbox build`` makes from the host's own Python (no registry needed)."""

SCRATCH = "/scratch"


class SandboxError(RuntimeError):
    """The sandbox itself failed (not the program in it); the message says what to do next."""


@dataclass(frozen=True)
class SandboxConfig:
    """Limits and placement of every sandbox a pool makes. Defaults suit one tool call of an agent.

    ``backend``: ``auto`` (docker when an engine answers, else bubblewrap, else a plain process with a
    warning), ``docker``, ``local`` (bubblewrap, or the process fallback when bwrap is missing) or
    ``process`` (the weak fallback, explicitly). ``timeout`` is the default wall limit of one call;
    the whole process tree is killed when it passes. ``max_output_bytes`` caps each of stdout and
    stderr as the caller receives them (the program may write more; the rest is counted and dropped).
    ``scratch_mb`` caps the scratch directory, ``file_size_mb`` any single file a program writes
    (on docker scratch and /tmp are memory-backed and count toward ``memory_mb`` as well).
    ``max_concurrency`` is how many sandboxes may be alive at once (callers wait for a free one);
    ``create_rate`` how many may be created per second (engines fall over under creation storms).
    ``ttl`` bounds a sandbox's life even if its owner is SIGKILLed (the reaper removes expired ones).
    """

    backend: str = "auto"
    image: str = DEFAULT_IMAGE
    memory_mb: int = 512
    pids: int = 128
    cpus: float = 1.0
    file_size_mb: int = 64
    scratch_mb: int = 256
    timeout: float = 10.0
    max_output_bytes: int = 16_384
    max_concurrency: int = 8
    create_rate: float = 10.0
    ttl: float = 6 * 3600.0
    env: Mapping[str, str] = field(default_factory=dict)

    def validate(self) -> None:
        """Refuse impossible limits before any sandbox is made (names the field to change)."""
        if self.backend not in ("auto", "docker", "local", "process"):
            raise ValueError(f"sandbox backend {self.backend!r}: choose auto, docker, local or process")
        for name in ("memory_mb", "pids", "file_size_mb", "scratch_mb", "max_output_bytes", "max_concurrency"):
            if int(getattr(self, name)) <= 0:
                raise ValueError(f"sandbox {name} must be > 0, got {getattr(self, name)}")
        for name in ("cpus", "timeout", "create_rate", "ttl"):
            if float(getattr(self, name)) <= 0:
                raise ValueError(f"sandbox {name} must be > 0, got {getattr(self, name)}")


@dataclass
class ExecResult:
    """What one call produced. ``exit_code`` is None when the sandbox killed the program (timeout,
    out of memory: stderr then says which); other deaths by a signal N report 128+N, as a shell does.

    ``truncated`` says some of stdout or stderr was dropped (the text then ends with a marker the
    model can read); ``duration`` is wall seconds of the call as the caller saw it.
    """

    stdout: str
    stderr: str
    exit_code: int | None
    timed_out: bool = False
    duration: float = 0.0
    truncated: bool = False

    @property
    def ok(self) -> bool:
        """The program ran to the end and exited 0."""
        return self.exit_code == 0 and not self.timed_out

    def text(self) -> str:
        """The result as a tool shows it to the model: output, then errors and how it ended."""
        parts = []
        if self.stdout:
            parts.append(self.stdout.rstrip("\n"))
        if self.stderr:
            parts.append(self.stderr.rstrip("\n"))
        if self.timed_out:
            parts.append(f"[timed out after {self.duration:.1f}s; the process was killed]")
        elif self.exit_code is None:
            parts.append("[killed]")
        elif self.exit_code != 0:
            parts.append(f"[exit code {self.exit_code}]")
        return "\n".join(parts) if parts else "[no output]"


def truncate_output(data: bytes, limit: int, total: int | None = None) -> tuple[str, bool]:
    """Decode ``data`` (the first bytes of a stream of ``total`` bytes) cut at ``limit`` bytes.

    Returns the text and whether it was cut. A cut text ends with
    ``[... output truncated: N bytes in total, the first M shown]`` so the model knows it saw only
    part of it (and can ask for less).
    """
    total = len(data) if total is None else total
    if total <= limit and len(data) <= limit:
        return data.decode("utf-8", errors="replace"), False
    head = data[:limit].decode("utf-8", errors="ignore")
    return f"{head}\n[... output truncated: {total} bytes in total, the first {limit} shown]", True


def check_relative_path(path: str) -> str:
    """Normalize a path inside the scratch dir; refuse absolute paths and ``..`` escapes.

    ``"a/./b.txt"`` -> ``"a/b.txt"``; ``"/etc/passwd"`` or ``"../x"`` raise ``ValueError`` with a
    message fit for the model. A leading ``/scratch/`` is accepted and stripped.
    """
    if not isinstance(path, str) or not path.strip():
        raise ValueError("path must be a non-empty string")
    p = path.strip()
    if p == SCRATCH or p.startswith(SCRATCH + "/"):
        p = p[len(SCRATCH) :].lstrip("/") or "."
    if p.startswith("/"):
        raise ValueError(f"path {path!r} is outside the scratch directory; use a path relative to {SCRATCH}")
    norm = posixpath.normpath(p)
    if norm == ".." or norm.startswith("../") or "\x00" in norm:
        raise ValueError(f"path {path!r} leaves the scratch directory")
    return norm


def program_argv(command: str | Sequence[str] | None, code: str | None) -> list[str]:
    """The argv of ``run(command | code)``: ``/bin/sh -c`` for a string, ``python3 -c`` for code.

    ``ValueError`` unless exactly one is given; ``TypeError`` for a non-str code or an argv that is
    not a non-empty list of str. Backends add their own limits (e.g. docker's argument size).
    """
    if (command is None) == (code is None):
        raise ValueError("run() takes exactly one of command (shell string or argv list) or code (Python source)")
    if code is not None:
        if not isinstance(code, str):
            raise TypeError(f"code must be a str of Python source, got {type(code).__name__}")
        return ["python3", "-c", code]
    if isinstance(command, str):
        return ["/bin/sh", "-c", command]
    argv = list(command or ())  # not None: exactly one of command and code was given
    if not argv or not all(isinstance(a, str) for a in argv):
        raise TypeError(f"command must be a shell string or a non-empty list of str (an argv), got {command!r}")
    return argv


def normalize_files(files: Mapping[str, str | bytes]) -> list[tuple[str, bytes]]:
    """``write_files``' argument as ``(relative path, bytes)`` pairs, checked before anything is written.

    Raises ``TypeError`` for a non-mapping or non-text/bytes content and ``ValueError`` for paths
    outside scratch (or scratch itself), so a bad batch writes nothing.
    """
    if not isinstance(files, Mapping):
        raise TypeError(f"files must be a mapping of relative path -> str | bytes, got {type(files).__name__}")
    items = []
    for path, content in files.items():
        rel = check_relative_path(path)
        if rel == ".":
            raise ValueError(f"path {path!r} is the scratch directory itself; name a file in it")
        if isinstance(content, str):
            content = content.encode()
        if not isinstance(content, (bytes, bytearray, memoryview)):
            raise TypeError(f"file {path!r}: content must be str or bytes, got {type(content).__name__}")
        items.append((rel, bytes(content)))
    return items


class Session(abc.ABC):
    """A long-lived process inside a sandbox (e.g. a Python interpreter that keeps its variables).

    It speaks newline-delimited messages on its stdin/stdout; stderr is discarded. It lives until
    :meth:`kill`, or until its sandbox is reset or closed. A tool that times out on a session
    kills it and starts a new one on its next call (state is lost; tell the model so).
    """

    @abc.abstractmethod
    async def send(self, data: bytes) -> None:
        """Write ``data`` to the process's stdin. Raises ``EOFError`` when it has exited."""

    @abc.abstractmethod
    async def readline(self, timeout: float, limit: int = 1 << 20) -> bytes:
        """One line from stdout (with its newline). ``TimeoutError`` after ``timeout`` s;
        ``EOFError`` if the process exited; ``ValueError`` if a line exceeds ``limit`` bytes."""

    @abc.abstractmethod
    async def kill(self) -> None:
        """Kill the process and everything it started. Idempotent."""

    @property
    @abc.abstractmethod
    def alive(self) -> bool:
        """Whether the process is still running."""


class Sandbox(abc.ABC):
    """One isolated workspace: scratch at ``/scratch``, read-only elsewhere, no network, limits.

    Calls on one sandbox are serialized by the caller (an episode); different sandboxes run
    concurrently. ``isolation`` names what backs it (``"docker"``, ``"bubblewrap"``,
    ``"process (weak: no filesystem isolation)"``) so logs and reports can say it.
    """

    config: SandboxConfig
    isolation: str = "unknown"

    @abc.abstractmethod
    async def run(
        self,
        command: str | Sequence[str] | None = None,
        *,
        code: str | None = None,
        stdin: str | bytes | None = None,
        timeout: float | None = None,
        files: Mapping[str, str | bytes] | None = None,
        env: Mapping[str, str] | None = None,
    ) -> ExecResult:
        """Run one program in ``/scratch`` and wait for it (at most ``timeout``, default the config's).

        ``command``: a shell string (``/bin/sh -c``) or an argv list; ``code``: Python source run by
        the sandbox's ``python3`` (exactly one of the two). ``files`` are written into scratch first
        (relative paths). ``env`` adds variables; nothing of the host's environment is passed.
        No process started by a call outlives it (background and ``setsid`` children are killed
        when it returns): a program that must keep running between calls is a :meth:`session`.
        Calls on one sandbox must not overlap (the episode's lock in ToolEnv ensures it).
        """

    @abc.abstractmethod
    async def write_files(self, files: Mapping[str, str | bytes]) -> None:
        """Write files into scratch (relative paths; parent dirs made). ``ValueError`` for escapes."""

    @abc.abstractmethod
    async def read_file(self, path: str, *, max_bytes: int | None = None) -> bytes:
        """Read a file from scratch (at most ``max_bytes``). ``FileNotFoundError`` if missing,
        ``IsADirectoryError`` for a directory, ``ValueError`` for paths outside scratch (symlinks a
        program planted included)."""

    @abc.abstractmethod
    async def session(self, name: str, argv: Sequence[str], env: Mapping[str, str] | None = None) -> Session:
        """The live session called ``name``, started with ``argv`` if it is missing or dead."""

    @abc.abstractmethod
    async def reset(self) -> None:
        """Make it as new for the next episode: kill all its processes and sessions, wipe scratch."""

    @abc.abstractmethod
    async def close(self) -> None:
        """Destroy it (container removed, scratch deleted). Idempotent."""

    async def __aenter__(self) -> Sandbox:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
