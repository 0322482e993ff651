"""Warm sandboxes shared by the episodes of a run: a concurrency cap, a creation rate limit, reuse.

Creating a container costs ~0.3 s and an engine falls over under a storm of creations, while a
``reset`` of a warm one (kill its processes, wipe scratch) costs a few ms. So a run keeps a pool:
an episode :meth:`SandboxPool.acquire` s a sandbox for all its tool calls and releases it at the
end; the pool resets it and hands it to the next episode. At most ``max_concurrency`` sandboxes
exist at once (callers wait in FIFO order), and new ones are created at most ``create_rate`` per
second. A sandbox whose reset fails is destroyed, never handed out again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable

from agentrl.sandbox.base import Sandbox, SandboxConfig

__all__ = ["SandboxPool"]

log = logging.getLogger(__name__)


def _close_orphan(task: asyncio.Future[Sandbox]) -> None:
    """Close a sandbox whose creation finished after its caller was cancelled."""
    if not task.cancelled() and task.exception() is None:
        asyncio.ensure_future(task.result().close())


class SandboxPool:
    """Hands out reset sandboxes made by ``factory``; see the module docstring.

    ``factory`` is an async callable returning a new :class:`Sandbox` (the backend's ``create``
    bound to a config). The pool is bound to the event loop that first uses it.
    """

    def __init__(self, factory: Callable[[], Awaitable[Sandbox]], config: SandboxConfig) -> None:
        config.validate()
        self.factory = factory
        self.config = config
        self._idle: list[Sandbox] = []
        self._live = 0
        self._slots: asyncio.Semaphore | None = None
        self._create_lock: asyncio.Lock | None = None
        self._next_create = 0.0
        self._closed = False
        self.stats = {"created": 0, "reused": 0, "reset_failed": 0, "closed": 0}

    def _init(self) -> None:
        if self._slots is None:
            self._slots = asyncio.Semaphore(self.config.max_concurrency)
            self._create_lock = asyncio.Lock()

    async def acquire(self) -> Sandbox:
        """A ready sandbox (waits while ``max_concurrency`` are in use). Release it with :meth:`release`."""
        if self._closed:
            raise RuntimeError("sandbox pool is closed")
        self._init()
        assert self._slots is not None and self._create_lock is not None
        await self._slots.acquire()
        try:
            if self._idle:
                self.stats["reused"] += 1
                return self._idle.pop()
            async with self._create_lock:  # rate limit: creations spaced by 1/create_rate
                wait = self._next_create - time.monotonic()
                if wait > 0:
                    await asyncio.sleep(wait)
                self._next_create = time.monotonic() + 1.0 / self.config.create_rate
            # shielded: a cancel while the backend creates it must not orphan the new sandbox
            creating = asyncio.ensure_future(self.factory())
            try:
                sandbox = await asyncio.shield(creating)
            except asyncio.CancelledError:
                creating.add_done_callback(_close_orphan)
                raise
            self._live += 1
            self.stats["created"] += 1
            return sandbox
        except BaseException:
            self._slots.release()
            raise

    async def release(self, sandbox: Sandbox) -> None:
        """Reset ``sandbox`` and keep it warm for the next episode (destroyed if the reset fails)."""
        assert self._slots is not None
        try:
            if self._closed:
                await self._destroy(sandbox)
                return
            try:
                await sandbox.reset()
            except Exception as e:  # a broken sandbox is never handed out again
                self.stats["reset_failed"] += 1
                log.warning("sandbox reset failed (%s: %s); destroying it", type(e).__name__, e)
                await self._destroy(sandbox)
                return
            except BaseException:  # cancelled mid-reset (e.g. the env's close timed out): half reset, destroy it
                await asyncio.shield(self._destroy(sandbox))
                raise
            if self._closed:  # the pool closed while it was being reset
                await self._destroy(sandbox)
                return
            self._idle.append(sandbox)
        finally:
            self._slots.release()

    @contextlib.asynccontextmanager
    async def sandbox(self) -> AsyncIterator[Sandbox]:
        """``async with pool.sandbox() as sb:`` acquire, use, release."""
        sb = await self.acquire()
        try:
            yield sb
        finally:
            await self.release(sb)

    async def _destroy(self, sandbox: Sandbox) -> None:
        self._live -= 1
        self.stats["closed"] += 1
        with contextlib.suppress(Exception):
            await sandbox.close()

    @property
    def live(self) -> int:
        """Sandboxes that exist now (in use or idle)."""
        return self._live

    async def close(self) -> None:
        """Destroy the idle sandboxes; ones still in use are destroyed when released."""
        self._closed = True
        idle, self._idle = self._idle, []
        for sb in idle:
            await self._destroy(sb)
