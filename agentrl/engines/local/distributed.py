"""Weight-update process groups, the engine side: :class:`WeightUpdateGroups` joins the groups a trainer
opens (:mod:`agentrl.engines.weight_group` holds the protocol and what both sides share).

Joining is bounded on the engine side, because the address comes from an HTTP body: one rendezvous
at a time (a second ``init_weights_update_group`` while one is joining is refused at once, as
SGLang's one-call-at-a-time communicator does), at most :data:`MAX_GROUPS` groups, and a deadline
(``agentrl serve --dist-timeout``, :data:`DEFAULT_RENDEZVOUS_TIMEOUT`) that holds even against a
peer c10d's own timeout does not bound (:class:`_Join`).

Backend: SGLang uses NCCL. Where CUDA is unavailable (a laptop, CI) an ``nccl`` request is served
with ``gloo`` on CPU tensors instead, on both sides alike, so the same protocol runs for real on
CPU. Both sides must end up on the same backend: an NCCL trainer cannot feed a CPU-only engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import stat
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from agentrl.engines.weight_group import (
    DEFAULT_GROUP_NAME,
    comm_device,
    init_custom_process_group,
    resolve_backend,
    run_in_thread,
    settle_future,
)

T = TypeVar("T")


DEFAULT_RENDEZVOUS_TIMEOUT = 60.0
"""Seconds an engine waits for the other ranks of a weight-update group (``--dist-timeout``). slime's and
agentrl's trainers join as rank 0 within seconds of posting ``init_weights_update_group``; the HTTP request
waits this long at most."""

ABANDON_S = 10.0
"""Seconds past its deadline after which a join that has not returned gives up the one join slot."""

MAX_STUCK = 2
"""Abandoned joins whose threads may still be running before further joins are refused (each holds a thread)."""

MAX_GROUPS = 8
"""Weight-update groups an engine holds at once, joined and joining together. SGLang keeps several named
groups (slime opens one per pipeline stage, ``slime-pp_<i>``); each holds sockets and buffers."""


def parse_dtype(name: Any) -> torch.dtype:
    """``"bfloat16"`` / ``"torch.bfloat16"`` (slime strips the prefix; both are accepted) -> ``torch.bfloat16``."""
    if isinstance(name, torch.dtype):
        return name
    dtype = getattr(torch, str(name).removeprefix("torch."), None) if isinstance(name, str) else None
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return dtype


def check_metadata(names: Any, dtypes: Any, shapes: Any) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
    """Validate an ``update_weights_from_distributed`` body's metadata; raise ``ValueError`` if malformed."""
    if not (isinstance(names, list) and isinstance(dtypes, list) and isinstance(shapes, list)):
        raise ValueError("names, dtypes and shapes must be lists")
    if not len(names) == len(dtypes) == len(shapes):
        raise ValueError(f"names, dtypes and shapes differ in length ({len(names)}, {len(dtypes)}, {len(shapes)})")
    out = []
    for name, dtype, shape in zip(names, dtypes, shapes):
        if not isinstance(name, str):
            raise ValueError(f"parameter name {name!r} is not a string")
        if not (
            isinstance(shape, list) and all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape)
        ):
            raise ValueError(f"shape of {name!r} must be a list of non-negative ints, got {shape!r}")
        out.append((name, parse_dtype(dtype), tuple(shape)))
    return out


class WeightUpdateGroups:
    """The engine side: weight-update groups by name, and the receive half of the broadcast.

    The embedded engine runs one model on one device, so it is a single rank: ``rank_offset``
    (SGLang: ``rank_offset + tp_rank`` with ``tp_rank == 0``). All methods block; the HTTP app runs
    them in threads of their own (:func:`run_in_thread`, :meth:`init_async`) so the event loop keeps
    serving ``/generate`` meanwhile.

    Any client may name the address to join, so joining is bounded: one join at a time (another
    :meth:`init` meanwhile is refused at once; otherwise each call parks a thread for the whole
    timeout), at most ``max_groups`` groups, and ``rendezvous_timeout`` seconds per join, held by
    :class:`_Join` even where c10d's own timeout is not. ``timeout`` bounds each collective of a
    joined group (one bucket's broadcast). :meth:`abort` (server shutdown) answers a pending join at once.
    """

    def __init__(
        self,
        *,
        timeout: float = 600.0,
        rendezvous_timeout: float = DEFAULT_RENDEZVOUS_TIMEOUT,
        max_groups: int = MAX_GROUPS,
    ):
        check_rendezvous_timeout(rendezvous_timeout)
        self.timeout = timeout
        self.rendezvous_timeout = float(rendezvous_timeout)
        self.max_groups = max_groups
        self._groups: dict[str, tuple[dist.ProcessGroup, str, threading.Lock]] = {}
        self._joining: _Join | None = None
        self._stuck: set[_Join] = set()  # abandoned joins whose threads c10d still holds
        self._lock = threading.Lock()
        self._answers: set[asyncio.Future] = set()  # the HTTP requests awaiting an init

    def __contains__(self, group_name: str) -> bool:
        return group_name in self._groups

    @property
    def joining(self) -> str | None:
        """The name of the group whose rendezvous is in progress, or None."""
        join = self._joining
        return join.group_name if join is not None else None

    def init(
        self,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        group_name: str = DEFAULT_GROUP_NAME,
        backend: str = "nccl",
    ) -> tuple[bool, str]:
        """Join group ``group_name`` as rank ``rank_offset``; SGLang's ``(success, message)``.

        Refused at once while another group is joining, when the group exists or when ``max_groups``
        are held; otherwise it blocks until every rank joined, ``rendezvous_timeout`` seconds at most.
        """
        if not group_name:
            return False, "Group name cannot be empty."
        if not 0 < int(rank_offset) < int(world_size):
            return False, (
                f"Failed to initialize custom process group: rank_offset ({rank_offset}) must lie in "
                f"1..world_size-1 ({int(world_size) - 1}): rank 0 is the trainer, the engine one of the others."
            )
        with self._lock:
            refusal = self._refusal(group_name)
            if refusal is None:
                join = self._joining = _Join(group_name, master_address, int(master_port), self.rendezvous_timeout)
        if refusal is not None:
            return False, f"Failed to initialize custom process group: {refusal}"
        used = resolve_backend(backend)
        pg: dist.ProcessGroup | None = None
        failure = ""
        try:
            pg = join.run(
                lambda seconds: init_custom_process_group(
                    backend=used,
                    master_address=master_address,
                    master_port=int(master_port),
                    world_size=int(world_size),
                    rank=int(rank_offset),
                    group_name=group_name,
                    timeout=seconds,
                    collective_timeout=self.timeout,
                )
            )
        except Exception as exc:  # noqa: BLE001 - reported to the caller as SGLang does
            failure = f"Failed to initialize custom process group: {exc}."
        finally:  # the slot frees once the joining thread is done, or at the latest ABANDON_S past its deadline
            with self._lock:
                if self._joining is join:
                    self._joining = None
                self._stuck.discard(join)
                if pg is not None:  # (a join cut short at its deadline raised in run(): never registered)
                    self._groups[group_name] = (pg, used, threading.Lock())
        if pg is None:
            return False, failure
        note = f" (backend {used}; {backend} requested, CUDA unavailable)" if used != backend else ""
        return True, "Succeeded to initialize custom process group." + note

    async def init_async(self, *args: Any) -> tuple[bool, str]:
        """:meth:`init` in a thread of its own, awaited; :meth:`abort` answers it at once (the thread, a
        daemon, ends by itself by the deadline)."""
        answer = run_in_thread(self.init, *args)
        self._answers.add(answer)
        answer.add_done_callback(self._answers.discard)
        return await answer

    def _refusal(self, group_name: str) -> str | None:
        """Why a join of ``group_name`` cannot start now (called under the lock), or None."""
        join = self._joining
        if join is not None and join.abandoned():  # stuck in c10d past its deadline: it gives up the slot
            self._stuck.add(join)
            self._joining = join = None
        if len(self._stuck) >= MAX_STUCK:
            return (
                f"{len(self._stuck)} earlier joins are stuck in the rendezvous past their deadline (a peer that "
                "never completes c10d's handshake); restart the engine to free their threads."
            )
        if join is not None:
            return (
                f"group {join.group_name!r} is still joining its rendezvous at {join.address} "
                f"(at most {join.remaining():.0f} s more, --dist-timeout {join.timeout:g}); one group joins at a "
                "time: retry when it has ended."
            )
        if group_name in self._groups:
            return f"group {group_name!r} already exists."
        if len(self._groups) >= self.max_groups:
            return (
                f"the engine already holds {len(self._groups)} weight-update groups, its limit; "
                "destroy one with /destroy_weights_update_group first."
            )
        return None

    def receive(
        self, group_name: str, metadata: Sequence[tuple[str, torch.dtype, tuple[int, ...]]]
    ) -> list[tuple[str, torch.Tensor]]:
        """Receive one bucket: an empty tensor per (name, dtype, shape), each filled by a broadcast from rank 0.

        Tensors arrive in the order of ``metadata``, which must be the order the trainer sends
        them in. One bucket at a time per group: the collectives of two buckets must not interleave.
        """
        try:
            pg, backend, lock = self._groups[group_name]
        except KeyError:
            raise KeyError(
                f"Group {group_name} not in {list(self._groups)}. Please call `init_weights_update_group` first."
            ) from None
        device = comm_device(backend)
        with lock:
            received = [(name, torch.empty(shape, dtype=dtype, device=device)) for name, dtype, shape in metadata]
            handles = [dist.broadcast(t, src=0, group=pg, async_op=True) for _, t in received]
            for h in handles:
                h.wait()
        return received

    def destroy(self, group_name: str = DEFAULT_GROUP_NAME) -> tuple[bool, str]:
        """Leave and destroy group ``group_name``; SGLang's ``(success, message)``."""
        with self._lock:
            entry = self._groups.pop(group_name, None)
        if entry is None:
            return False, "The group to be destroyed does not exist."
        try:
            dist.destroy_process_group(entry[0])
        except Exception as exc:  # noqa: BLE001
            return False, f"Failed to destroy custom process group: {exc}."
        return True, "Succeeded to destroy custom process group."

    def abort(self) -> None:
        """Cut a rendezvous in progress short (the server is stopping) and answer every :meth:`init_async` now.

        The joining thread ends as soon as c10d lets go: at once while it waits for a listener or for
        the other ranks, at the deadline while c10d retries its handshake.
        """
        reason = "the engine is shutting down"
        join = self._joining
        if join is not None:
            join.cancel(reason)
        refusal = (False, f"Failed to initialize custom process group: {reason}.")
        for answer in list(self._answers):
            with contextlib.suppress(RuntimeError):  # its loop is closed: nobody is waiting
                answer.get_loop().call_soon_threadsafe(settle_future, answer, refusal, None)


def check_rendezvous_timeout(seconds: Any) -> float:
    """``--dist-timeout`` as seconds, or ValueError naming the flag (checked before a model is loaded)."""
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not 0 < seconds <= 3600:
        raise ValueError(f"--dist-timeout must be a number of seconds in (0, 3600], got {seconds!r}")
    return float(seconds)


class _Join:
    """One rendezvous in progress, held to its deadline even where c10d's own timeout does not hold.

    c10d bounds a refused connection and a store wait by its timeout, but a peer that accepts the
    TCP connection and then says nothing keeps ``TCPStore``'s handshake waiting forever (measured:
    still waiting after 190 s with a 3 s timeout). So :meth:`run` first waits, cancellably, until
    something listens at the address (rank 0 may open its store a moment after posting the call),
    then runs c10d with the time left, while a watchdog thread cuts it short at the deadline or on
    :meth:`cancel`: it shuts down this process's sockets to that address that were not there when
    the join began (a joined group's store stays connected), which fails c10d's blocked read, and
    repeats until the join returns. c10d retries a failed handshake until its own deadline, which is
    the join's (it is given the time left), so the join ends within a second or so of its deadline.
    """

    def __init__(self, group_name: str, host: str, port: int, timeout: float):
        self.group_name, self.host, self.port, self.timeout = group_name, host, port, timeout
        self.deadline = time.monotonic() + timeout
        self.reason: str | None = None  # why it was cut short
        self.finished = threading.Event()
        self._wake = threading.Event()  # cancelled or finished
        self._peers: set[str] = set()
        self._before: set[tuple[int, int]] = set()

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def remaining(self) -> float:
        return max(0.0, self.deadline - time.monotonic())

    def abandoned(self) -> bool:
        """Still running :data:`ABANDON_S` past its deadline (c10d ignoring its own timeout somewhere the
        watchdog cannot reach): it no longer holds the one join slot, and a late success is torn down."""
        return time.monotonic() > self.deadline + ABANDON_S

    def cancel(self, reason: str) -> None:
        if self.reason is None:
            self.reason = reason
        self._wake.set()

    def run(self, connect: Callable[[float], dist.ProcessGroup]) -> dist.ProcessGroup:
        """``connect(seconds_left)`` once a listener answers at the address, under the watchdog."""
        threading.Thread(target=self._watch, name="agentrl-rendezvous-watchdog", daemon=True).start()
        try:
            try:
                infos = socket.getaddrinfo(self.host, self.port, type=socket.SOCK_STREAM)
            except OSError as exc:
                raise ValueError(f"master_address {self.host!r} does not resolve: {exc}") from None
            self._peers = {_plain_ip(str(info[4][0])) for info in infos}
            self._before = {key for key, _ in _sockets_to(self._peers, self.port)}
            self._wait_for_listener()
            pg = connect(max(self.remaining(), 0.1))
            if self.reason is not None:  # cut short just as it completed: its store may be shut down
                with contextlib.suppress(Exception):
                    dist.destroy_process_group(pg)
                raise TimeoutError(self.reason)
            return pg
        except Exception as exc:
            if self.reason is not None and not isinstance(exc, TimeoutError):
                raise TimeoutError(self.reason) from exc
            raise
        finally:
            self.finished.set()
            self._wake.set()

    def _wait_for_listener(self) -> None:
        while True:
            if self.reason is not None:
                raise TimeoutError(self.reason)
            for ip in self._peers:
                try:
                    with socket.create_connection((ip, self.port), timeout=max(0.05, min(self.remaining(), 2.0))):
                        return
                except OSError:
                    pass
            self._wake.wait(0.1)

    def _watch(self) -> None:
        if not self._wake.wait(self.remaining()):
            self.cancel(
                f"no rendezvous at {self.address} within {self.timeout:g} s (--dist-timeout): "
                "rank 0 (the trainer) must host the group's store there and join at the same time"
            )
        while not self.finished.is_set() and not self.abandoned():  # past that, scanning cannot help
            for key, sock in _sockets_to(self._peers, self.port):
                if key not in self._before:
                    with contextlib.suppress(OSError):
                        sock.shutdown(socket.SHUT_RDWR)
            self.finished.wait(0.25)


def _plain_ip(ip: str) -> str:
    """``::ffff:1.2.3.4`` -> ``1.2.3.4`` (c10d dials IPv4 from an IPv6 socket); a zone suffix dropped."""
    ip = ip.split("%", 1)[0]
    return ip.removeprefix("::ffff:") if ip.startswith("::ffff:") and "." in ip else ip


def _sockets_to(peers: set[str], port: int) -> Iterator[tuple[tuple[int, int], socket.socket]]:
    """This process's TCP sockets connected to one of ``peers`` on ``port``: ``((fd, inode), duplicate)``.

    Each is a duplicate of the descriptor, valid while the caller holds it (shutting it down shuts
    down the socket itself); the inode is read from the duplicate, so a descriptor closed and
    reused meanwhile is never mistaken for the socket first seen under its number.
    """
    for fd in _open_fds():
        try:
            if not stat.S_ISSOCK(os.fstat(fd).st_mode):
                continue
            dup = socket.socket(fileno=os.dup(fd))
        except OSError:
            continue
        with dup:
            if dup.family not in (socket.AF_INET, socket.AF_INET6) or dup.type != socket.SOCK_STREAM:
                continue
            try:
                host, peer_port = dup.getpeername()[:2]
                inode = os.fstat(dup.fileno()).st_ino
            except OSError:  # not connected
                continue
            if peer_port == port and _plain_ip(host) in peers:
                yield (fd, inode), dup


def _open_fds() -> list[int]:
    for folder in ("/proc/self/fd", "/dev/fd"):
        with contextlib.suppress(OSError):
            return [int(name) for name in os.listdir(folder) if name.isdigit()]
    return []
