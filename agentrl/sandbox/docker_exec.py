"""Inside a docker sandbox: the shell scripts its processes run under, exec streams, and sessions.

:mod:`agentrl.sandbox.docker` manages containers; this module is what happens in one. Everything
that runs in the container runs as the sandbox user through ``docker exec``, and the engine makes
every exec a session leader (its session id is its pid). That gives the kill rules:

- a call (:data:`CALL`) runs the program as a child, then kills every process of the sandbox user
  except pid 1 and the live sessions' session ids, so backgrounded children and ``setsid``
  escapees never outlive their call; a timeout or a cancelled call does the same from a separate
  exec (:data:`KILL`; it exits 1 when processes keep appearing, and pid 1 then kills everything);
- a session is killed by its session id (``KILL only SID``);
- a reset (:data:`RESET`) kills everything but pid 1 (``kill -9 -1``) and wipes scratch, ``/tmp``
  and ``/dev/shm``, hidden files and ``chmod 000`` dirs included.

The kill loops use shell builtins only (``/proc/*/stat``, ``kill``): no fork, so they work while a
fork bomb holds every pid. Output comes back on the exec's hijacked socket in frames with an
8-byte header (stream id, size); :class:`ExecStream` reads them on the event loop (no thread held
while a program runs) and :class:`Capped` keeps the first ``max_output_bytes`` of each stream;
:func:`settle` finishes such cleanup even when the caller is cancelled meanwhile.
:func:`program_argv`, :func:`env_prefix` and :func:`scratch_tar` build what an exec runs and the
files it is given (owned by the sandbox user, so the program can change and delete them).
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import socket
import tarfile
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, TypeVar

from agentrl.sandbox.base import SandboxError, Session, normalize_files, truncate_output
from agentrl.sandbox.base import program_argv as base_program_argv
from agentrl.sandbox.image import SANDBOX_UID

__all__ = [
    "CALL",
    "KILL",
    "OOM_MARK",
    "PID1",
    "READ",
    "RESET",
    "SESSION",
    "Capped",
    "DockerSession",
    "ExecStream",
    "SandboxGone",
    "container_gone",
    "engine_error",
    "env_prefix",
    "exit_code",
    "open_exec",
    "program_argv",
    "scratch_tar",
    "settle",
]

OOM_MARK = b"\x00agentrl-oom\x00"
"""Written to stderr by :data:`CALL` when the memory cgroup's OOM killer fired during the call."""

# Kill the sandbox user's processes by session id, with shell builtins only (no fork: it must work
# when a fork bomb has used every pid). MODE=except spares SIDS, MODE=only kills just SIDS; returns 1
# when processes still appear after 50 rounds.
REAP_FN = r"""
reap() {
  mode=$1; ids=" $2 "; n=0
  while [ $n -lt 50 ]; do
    hit=0
    for d in /proc/[0-9]*; do
      p=${d#/proc/}
      case "$p" in 1|$$) continue;; esac
      { read -r line < "$d/stat"; } 2>/dev/null || continue
      set -- ${line##*) }
      [ "$1" = Z ] && continue
      case "$ids" in *" $4 "*) k=1;; *) k=0;; esac
      [ "$mode" = only ] && k=$((1 - k))
      [ $k = 1 ] && continue
      kill -9 "$p" 2>/dev/null && hit=1
    done
    [ $hit = 0 ] && return 0
    n=$((n + 1))
  done
  return 1
}
killall_() { n=0; while [ $n -lt 200 ] && kill -9 -1 2>/dev/null; do n=$((n + 1)); done; }
"""
# pid 1: reaps orphans (dash's wait reaps any child), exits at the ttl; SIGUSR1 kills everything
# else of the sandbox user (the fallback when no exec can start because the pids limit is hit).
PID1 = (
    REAP_FN
    + r"""
trap killall_ USR1
trap '' TERM INT HUP
read -r up rest < /proc/uptime; end=$(( ${up%.*} + $1 ))
while :; do
  read -r up rest < /proc/uptime; [ "${up%.*}" -lt "$end" ] || exit 0
  sleep 2 & wait $!
done
"""
)
# A call: run "$@" (first in line for the OOM killer), then kill whatever it left (all but pid 1 and
# the live sessions) and report whether the memory cgroup's OOM killer fired meanwhile.
CALL = (
    REAP_FN
    + r"""
oom() { O=0; for f in /sys/fs/cgroup/memory.events /sys/fs/cgroup/memory/memory.oom_control; do
  [ -r "$f" ] || continue; while read -r k v; do [ "$k" = oom_kill ] && O=$v; done < "$f"; return; done; }
keep=$1; shift
oom; before=$O
( { echo 500 > /proc/self/oom_score_adj; } 2>/dev/null; exec "$@" )
rc=$?
reap except "1 $keep"
oom; [ "$O" = "$before" ] || { printf '\000agentrl-oom\000' >&2; exit 137; }
exit $rc
"""
)
# A session: tell the host its pid (= its session id), then become the program (first in line for the OOM killer).
SESSION = '{ echo 500 > /proc/self/oom_score_adj; } 2>/dev/null; echo "$$"; exec "$@"'
KILL = REAP_FN + '\nreap "$1" "$2"\n'
RESET = (
    REAP_FN
    + r"""
killall_
chmod 0755 /scratch  # the program may have locked its own scratch root
for d in /scratch /tmp /dev/shm; do
  [ -d "$d" ] || continue
  set -- "$d"/* "$d"/.[!.]* "$d"/..?*
  chmod -R u+rwx -- "$@" 2>/dev/null
  rm -rf -- "$@" 2>/dev/null
  set -- "$d"/* "$d"/.[!.]* "$d"/..?*
  for f; do if [ -e "$f" ] || [ -L "$f" ]; then echo "left in $d: $f" >&2; exit 1; fi; done
done
"""
)
READ = r"""
[ -e "$1" ] || exit 3
[ -d "$1" ] && exit 4
[ -r "$1" ] || exit 5
if [ "$2" = all ]; then exec cat -- "$1"; else exec head -c "$2" -- "$1"; fi
"""


class Capped:
    """The first ``limit`` bytes of a stream and its total length (the rest is counted, then dropped)."""

    def __init__(self, limit: int) -> None:
        self.limit, self.head, self.total, self.tail = limit, bytearray(), 0, b""

    def add(self, data: bytes) -> None:
        room = self.limit - len(self.head)
        if room > 0:
            self.head += data[:room]
        self.total += len(data)
        self.tail = (self.tail + data)[-len(OOM_MARK) :]

    def text(self) -> tuple[str, bool]:
        return truncate_output(bytes(self.head), self.limit, self.total)


def open_exec(api: Any, container_id: str, argv: list[str], *, stdin: bool, user: str, workdir: str) -> ExecStream:
    """Blocking: create and start an exec on a hijacked connection (what ``exec_start(socket=True)``
    does, but keeping the bytes that http.client read past the ``101`` headers into its buffer: a
    fast program's first output can arrive with them, and the raw socket alone would lose it)."""
    exec_id = api.exec_create(container_id, argv, stdin=stdin, user=user, workdir=workdir)["Id"]
    res = api._post_json(
        api._url("/exec/{0}/start", exec_id),
        headers={"Connection": "Upgrade", "Upgrade": "tcp"},
        data={"Tty": False, "Detach": False},
        stream=True,
    )
    api._raise_for_status(res)
    return ExecStream(exec_id, res)


async def exit_code(api: Any, exec_id: str) -> int | None:
    """The exit code of an exec whose stream ended (None if it still runs after a second)."""
    for _ in range(50):
        info = await asyncio.to_thread(api.exec_inspect, exec_id)
        if not info.get("Running"):
            return info.get("ExitCode")
        await asyncio.sleep(0.02)
    return None


class ExecStream:
    """A started ``docker exec``: frames (1 = stdout, 2 = stderr) read on the event loop."""

    def __init__(self, exec_id: str, response: Any) -> None:
        self.id, self._res = exec_id, response
        self._fp = response.raw._fp.fp  # the buffered reader the status line and headers came from
        raw = getattr(self._fp.raw, "_sock", None)
        if type(raw) is not socket.socket:
            response.close()
            raise SandboxError(
                f"the docker backend reads exec streams from a plain socket; got {type(raw).__name__} "
                "(TLS/ssh DOCKER_HOST): use a unix or tcp DOCKER_HOST, or --sandbox local"
            )
        raw.setblocking(False)
        early = self._fp.peek()  # only what is buffered already: the socket is non-blocking now
        self.raw, self.buf, self.eof = raw, bytearray(early), False
        self._recv: asyncio.Future[bytes] | None = None  # survives a cancelled wait: no byte is lost

    async def frame(self) -> tuple[int, bytes] | None:
        """The next (stream, payload), or None at the end of the stream."""
        loop = asyncio.get_running_loop()
        while True:
            if len(self.buf) >= 8:
                size = int.from_bytes(self.buf[4:8], "big")
                if len(self.buf) >= 8 + size:
                    kind, data = self.buf[0], bytes(self.buf[8 : 8 + size])
                    del self.buf[: 8 + size]
                    return kind, data
            if self.eof:
                return None
            if self._recv is None:
                self._recv = asyncio.ensure_future(loop.sock_recv(self.raw, 1 << 18))
            try:
                chunk = await asyncio.shield(self._recv)
            except (ConnectionError, OSError):
                chunk = b""
            self._recv = None
            if not chunk:
                self.eof = True
            self.buf += chunk

    async def pump(self, out: Capped, err: Capped, stdin: bytes | None = None) -> None:
        """Read every frame into ``out`` (stdout) and ``err`` (stderr), feeding ``stdin`` meanwhile."""
        writer = None if stdin is None else asyncio.ensure_future(self._feed(stdin))
        try:
            while (frame := await self.frame()) is not None:
                (out if frame[0] == 1 else err).add(frame[1])
        finally:
            if writer is not None:
                writer.cancel()

    async def _feed(self, data: bytes) -> None:
        try:
            await self.send(data, close=True)
        except OSError:
            pass  # the program exited without reading all of its stdin

    def ended(self) -> bool:
        """Whether the stream has ended, from what the socket holds now: never waits, and keeps what it
        reads for :meth:`frame` (at most 1 MiB a look; a session still writing that much is alive)."""
        budget = 1 << 20
        while not self.eof and self._recv is None and budget > 0:  # a pending receive owns the next bytes
            try:
                chunk = self.raw.recv(1 << 16)
            except BlockingIOError:
                break
            except OSError:
                chunk = b""
            self.eof = not chunk
            self.buf += chunk
            budget -= len(chunk)
        return self.eof

    async def send(self, data: bytes, close: bool) -> None:
        await asyncio.get_running_loop().sock_sendall(self.raw, data)
        if close:
            self.raw.shutdown(socket.SHUT_WR)

    def close(self) -> None:
        self.eof = True
        if self._recv is not None:
            self._recv.cancel()
        for s in (self.raw, self._fp):
            try:
                s.close()
            except (OSError, ValueError):
                pass


T = TypeVar("T")


async def settle(cleanup: Awaitable[T]) -> T:
    """Await ``cleanup`` to its end even if the caller is cancelled meanwhile, then re-raise that.

    A cancelled call (a tool's timeout shorter than the sandbox's) must kill what it started before
    its sandbox's lock is released, or the program would overlap the next call.
    """
    task = asyncio.ensure_future(cleanup)
    cancelled = False
    while not task.done():
        try:
            await asyncio.wait({task})  # cancelling this wait leaves the task running
        except asyncio.CancelledError:
            cancelled = True
    error = task.exception()
    if cancelled:
        raise asyncio.CancelledError
    if error is not None:
        raise error
    return task.result()


class SandboxGone(SandboxError):
    """The container no longer exists or runs (its ttl passed, or someone removed it)."""


def container_gone(e: Exception) -> bool:
    """Whether an engine error says the container is gone (not that a path or argument was wrong)."""
    import docker

    if not isinstance(e, docker.errors.APIError):
        return False
    text = str(e.explanation or e).lower()
    return e.status_code == 409 or (e.status_code == 404 and "no such container" in text)


def engine_error(e: Exception, what: str) -> SandboxError:
    """The :class:`SandboxError` for an engine failure during ``what`` (:class:`SandboxGone` when it is that)."""
    if container_gone(e):
        return SandboxGone(f"{what}: the sandbox container is gone (its ttl passed or it was removed): {e}")
    return SandboxError(f"{what}: the Docker engine failed: {e}")


class DockerSession(Session):
    """A long-lived exec with stdin attached; its first stdout line (from the wrapper) is its session id."""

    def __init__(self, ex: ExecStream, kill_sid: Callable[[int], Awaitable[object]]) -> None:
        self._ex, self._kill_sid = ex, kill_sid
        self._line = bytearray()
        self._skip = False  # dropping the rest of an over-long line
        self._dead = self._killed = False
        self.sid = 0

    async def _start(self, timeout: float) -> None:
        first = await self.readline(timeout)
        self.sid = int(first)

    async def send(self, data: bytes) -> None:
        if self._dead:
            raise EOFError("the session has exited")
        try:
            await self._ex.send(data, close=False)
        except OSError as e:
            self._dead = True
            raise EOFError(f"the session has exited ({e})") from None

    async def readline(self, timeout: float, limit: int = 1 << 20) -> bytes:
        return await asyncio.wait_for(self._readline(limit), timeout)

    async def _readline(self, limit: int) -> bytes:
        while True:
            i = self._line.find(b"\n")
            if i >= 0 and self._skip:
                del self._line[: i + 1]
                self._skip = False
                continue
            if i >= 0 and i < limit:
                line = bytes(self._line[: i + 1])
                del self._line[: i + 1]
                return line
            if i >= limit or len(self._line) > limit:
                self._skip, self._line = i < 0, self._line[i + 1 :] if i >= 0 else bytearray()
                raise ValueError(f"the session wrote a line longer than {limit} bytes")
            if self._dead:
                raise EOFError("the session has exited")
            frame = await self._ex.frame()
            if frame is None:
                self._dead = True
                self._ex.close()
                raise EOFError("the session has exited")
            if frame[0] == 1:  # stderr is discarded
                self._line += frame[1]
                if self._skip and b"\n" not in frame[1]:
                    self._line.clear()

    async def kill(self) -> None:
        if self._killed:
            return
        self._killed = self._dead = True
        self._ex.close()
        if self.sid > 1:
            try:
                await self._kill_sid(self.sid)
            except (SandboxError, TimeoutError):
                pass  # the container is gone (its processes with it), or a reset will kill them

    async def discard(self) -> None:
        """Kill a session whose start was cancelled (its session id, the wrapper's first line, comes at once)."""
        if not self.sid:
            with contextlib.suppress(TimeoutError, EOFError, ValueError):
                await self._start(timeout=5.0)
        await self.kill()

    def mark_killed(self) -> None:
        """Its processes were killed by other means (a reset): close the stream, never kill again."""
        self._killed = self._dead = True
        self._ex.close()

    @property
    def alive(self) -> bool:
        """Not killed, and its exec's stream has not ended (the engine closes it when the process exits)."""
        return not self._dead and not self._ex.ended()


# -- what an exec runs ---------------------------------------------------------------------------------

MAX_CODE_BYTES = 120_000  # one argv string may hold at most 128 KiB (MAX_ARG_STRLEN)


def env_prefix(base: Mapping[str, str], *envs: Mapping[str, str] | None) -> list[str]:
    """``env -i`` and the variables: the image's, then the config's, then the call's (later ones win)."""
    merged: dict[str, str] = dict(base)
    for env in envs:
        for k, v in (env or {}).items():
            if not isinstance(k, str) or not k or "=" in k or "\0" in k or not isinstance(v, str) or "\0" in v:
                raise ValueError(f"environment variable {k!r}={v!r}: names are non-empty without '=', values str")
            merged[k] = v
    return ["env", "-i", *(f"{k}={v}" for k, v in merged.items())]


def program_argv(command: str | Sequence[str] | None, code: str | None) -> list[str]:
    """:func:`agentrl.sandbox.base.program_argv` plus the engine's limit on one exec argument."""
    if isinstance(code, str) and len(code.encode()) > MAX_CODE_BYTES:
        raise ValueError(
            f"code is {len(code.encode())} bytes (max {MAX_CODE_BYTES}): write it to a file with "
            "files={'main.py': code} and run ['python3', 'main.py']"
        )
    return base_program_argv(command, code)


def scratch_tar(files: Mapping[str, str | bytes]) -> bytes:
    """A tar of ``files`` under scratch, owned by the sandbox user (parent dirs included)."""
    items = normalize_files(files)
    buf, now, dirs = io.BytesIO(), int(time.time()), set()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.GNU_FORMAT) as tar:
        for rel, content in items:
            parts = rel.split("/")
            for i in range(1, len(parts)):
                d = "/".join(parts[:i])
                if d not in dirs:
                    dirs.add(d)
                    tar.addfile(_tar_info(d, tarfile.DIRTYPE, 0o755, 0, now))
            tar.addfile(_tar_info(rel, tarfile.REGTYPE, 0o644, len(content), now), io.BytesIO(content))
    return buf.getvalue()


def _tar_info(name: str, kind: bytes, mode: int, size: int, mtime: int) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type, info.mode, info.size, info.mtime = kind, mode, size, mtime
    info.uid = info.gid = SANDBOX_UID
    return info
