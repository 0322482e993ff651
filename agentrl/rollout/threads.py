"""Worker threads for blocking env methods and tools, where a hung call cannot starve the others.

Python cannot kill a thread. With a ``ThreadPoolExecutor``, every sync ``step()`` or tool that
times out keeps its worker: after ``workers`` hangs, healthy episodes queue for a thread until their
own step timeout fails them, and the process cannot exit until the hung calls return
(``concurrent.futures`` joins its workers at exit). :class:`SyncPool` instead

* writes a call off when its caller gives up on it (cancelled while running, as a timeout does) and
  starts a replacement thread, so ``workers`` threads keep serving healthy calls;
* replaces at most ``max_hung`` written-off threads at a time: past that, new calls fail at once
  with :class:`HungThreadsError` naming the count, instead of growing threads without bound;
* runs daemon threads, so the process exits as soon as the run is done, hung calls or not;
* counts ``hung`` (written off and still running) for the run's summary.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Executor, Future
from typing import Any


class HungThreadsError(RuntimeError):
    """Too many blocking calls are stuck in their threads to start another one."""


class SyncPool(Executor):
    """``workers`` daemon threads for blocking calls, plus a replacement for each abandoned one (up to ``max_hung``)."""

    def __init__(self, workers: int, *, max_hung: int = 64, name: str = "agentrl-sync"):
        if workers < 1 or max_hung < 0:
            raise ValueError(f"SyncPool needs workers >= 1 and max_hung >= 0, got {workers}, {max_hung}")
        self.workers, self.max_hung, self.name = workers, max_hung, name
        self.hung = 0  # written-off calls still running
        self.hung_total = 0  # calls written off over the pool's life
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._owner: dict[Future, threading.Thread] = {}
        self._written_off: dict[threading.Thread, bool] = {}  # hung thread -> whether a replacement was started
        self._shutdown = False
        self._count = 0
        for _ in range(workers):
            self._spawn()

    def _spawn(self) -> None:
        self._count += 1
        threading.Thread(target=self._work, name=f"{self.name}-{self._count}", daemon=True).start()

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future:
        with self._lock:
            if self._shutdown:
                raise RuntimeError("SyncPool is shut down")
            if self.hung > self.max_hung:
                raise HungThreadsError(
                    f"{self.hung} blocking env/tool calls are stuck in their threads (timed out "
                    "and never returned): fix the hanging step()/tool, make it async, or raise "
                    "its timeout"
                )
        fut: Future = Future()
        self._queue.put((fut, fn, args, kwargs))
        return fut

    def _work(self) -> None:
        me = threading.current_thread()
        while True:
            item = self._queue.get()
            if item is None:
                return
            fut, fn, args, kwargs = item
            with self._lock:  # atomic with abandon(): a call is either cancelled while queued or owned
                if not fut.set_running_or_notify_cancel():
                    continue
                self._owner[fut] = me
            try:
                result = fn(*args, **kwargs)
            except BaseException as exc:  # noqa: BLE001 - handed to the caller, whatever it is
                fut.set_exception(exc)
            else:
                fut.set_result(result)
            with self._lock:
                self._owner.pop(fut, None)
                if me in self._written_off:  # came back after all
                    self.hung -= 1
                    if self._written_off.pop(me):  # its replacement serves on: this one ends
                        return

    def abandon(self, fut: Future) -> None:
        """The caller gave up on ``fut``: drop it if queued, else write its thread off and replace it."""
        with self._lock:
            if fut.cancel():  # still queued: it will never run
                return
            thread = self._owner.get(fut)
            if thread is None or thread in self._written_off or self._shutdown:
                return
            self.hung += 1
            self.hung_total += 1
            self._written_off[thread] = self.hung <= self.max_hung
            if self._written_off[thread]:
                self._spawn()

    @classmethod
    def for_rollout(cls, concurrency: int) -> SyncPool:
        """The pool for a rollout's blocking env steps: every concurrent episode has a thread (plus 4),
        and up to ``max(64, concurrency)`` hung calls are replaced."""
        return cls(concurrency + 4, max_hung=max(64, concurrency), name="agentrl-env")

    async def run(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Any:
        """``await`` ``fn(*args, **kwargs)`` in a worker (the caller's contextvars included); cancelling abandons it."""
        call = functools.partial(contextvars.copy_context().run, fn, *args, **kwargs)
        fut = self.submit(call)
        try:
            return await asyncio.wrap_future(fut)
        except asyncio.CancelledError:
            self.abandon(fut)
            raise

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        """Stop the idle workers (hung ones are daemon threads: they never hold up the process's exit)."""
        with self._lock:
            if self._shutdown:
                return
            self._shutdown = True
        for _ in range(self._count):
            self._queue.put(None)
