"""Rollout engines for training: embedded engines as Ray actors, or SGLang servers already running.

Either way the generate loop talks HTTP to them through :class:`~agentrl.engines.router.Router`,
so the code path on a laptop and on a cluster is the same. What differs is how new weights get in:

- embedded engines (:class:`EngineActor`) take the trainer's full weights straight from Ray's
  object store (:meth:`EngineGroup.push_tensors`): shared memory on one node, no disk;
- any engine can load a checkpoint folder (``/update_weights_from_disk``);
- SGLang engines on GPUs receive an NCCL broadcast (``agentrl.runtime.weight_sync``).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger(__name__)


def tensors_to_numpy(named: dict[str, torch.Tensor]) -> dict[str, Any]:
    """CPU tensors as numpy arrays, so ``ray.put`` stores them zero-copy in shared memory.

    bfloat16 has no numpy dtype: it travels as its raw int16 bits with a ``(array, "bfloat16")`` tag.
    """
    out: dict[str, Any] = {}
    for name, t in named.items():
        t = t.detach().to("cpu").contiguous()
        if t.dtype == torch.bfloat16:
            out[name] = (t.view(torch.int16).numpy(), "bfloat16")
        else:
            out[name] = t.numpy()
    return out


def numpy_to_tensors(named: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Inverse of :func:`tensors_to_numpy`, without copying.

    Arrays from the object store are read-only views of shared memory; torch warns when it wraps
    one, but the engine only reads them (it copies them into its own parameters), so the warning
    is silenced instead of paying for another copy.
    """
    out: dict[str, torch.Tensor] = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        for name, a in named.items():
            if isinstance(a, torch.Tensor):
                out[name] = a
            elif isinstance(a, tuple):
                arr, tag = a
                out[name] = torch.from_numpy(arr).view(getattr(torch, tag))
            else:
                out[name] = torch.from_numpy(a)
    return out


class EngineServer:
    """The embedded engine plus its HTTP server on a loopback port, in one process.

    Ray wraps this class as an actor (:data:`EngineActor`). The server runs uvicorn in a thread
    with its own event loop; actor methods hop onto that loop to reach the engine.
    """

    def __init__(
        self,
        checkpoint: str,
        *,
        host: str = "127.0.0.1",
        port: int | None = None,
        num_threads: int | None = None,
        tool_call_parser: str | None = "hermes",
        api_key: str | None = None,
        **engine_kwargs: Any,
    ):
        import uvicorn

        from agentrl.engines.local.engine import LocalEngine
        from agentrl.engines.local.process import free_port
        from agentrl.engines.local.server import build_app, openai_tool_parser

        if num_threads:
            torch.set_num_threads(num_threads)
        self.port = port or free_port(host)
        self.url = f"http://{host}:{self.port}"
        self._ready = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self.engine = LocalEngine(checkpoint, **engine_kwargs)
        app = build_app(self.engine, tool_parser=openai_tool_parser(tool_call_parser), api_key=api_key)
        config = uvicorn.Config(app, host=host, port=self.port, log_level="warning", lifespan="off")
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._serve, name="agentrl-engine-http", daemon=True)
        self._thread.start()
        if not self._ready.wait(120) or not self._server.started:
            raise RuntimeError(f"the embedded engine's HTTP server did not start on {self.url}")

    def _serve(self) -> None:
        loop = asyncio.new_event_loop()
        asyncio.set_event_loop(loop)
        self._loop = loop

        async def main() -> None:
            task = asyncio.create_task(self._server.serve())
            while not self._server.started and not task.done():
                await asyncio.sleep(0.02)
            self._ready.set()
            await task

        try:
            loop.run_until_complete(main())
        finally:
            self._ready.set()

    def _call(self, coro: Any, timeout: float | None = None) -> Any:
        assert self._loop is not None
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    def get_url(self) -> str:
        return self.url

    def update_weights_from_tensors(self, named: dict[str, Any], weight_version: str) -> dict:
        """Load weights handed over by the object store (numpy arrays from :func:`tensors_to_numpy`)."""
        tensors = numpy_to_tensors(named)
        return self._call(self.engine.update_weights_from_tensors(tensors, weight_version))

    def update_weights_from_shared(self, path: str, layout: Any, weight_version: str) -> dict:
        """Point the model's parameters at a shared-memory slot the trainer wrote (no copy)."""
        from agentrl.runtime.shm_weights import open_weights

        return self._call(
            self.engine.update_weights_from_tensors(open_weights(path, layout), weight_version, assign=True)
        )

    def node_id(self) -> str:
        import ray

        return ray.get_runtime_context().get_node_id()

    def weight_version(self) -> str:
        return self.engine.weight_version

    def shutdown(self) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=10)
        asyncio.run(self.engine.close())


class EngineGroup:
    """The rollout engines of a run: ``urls`` for the generate loop, and weight updates.

    ``EngineGroup.embedded(...)`` starts ``n`` embedded engines as Ray actors (each one CPU, or
    ``num_gpus`` GPUs, optionally placed in a placement group's bundles), each requiring a fresh
    per-run ``api_key`` (nothing else on the machine can load weights into them or pause them);
    ``EngineGroup.external(urls)`` wraps SGLang servers someone else runs (their key, if any, from
    ``$AGENTRL_ENGINE_API_KEY``). Clients send ``api_key`` (:func:`~agentrl.engines.http.auth_headers`).
    """

    def __init__(self, urls: Sequence[str], actors: Sequence[Any] = (), api_key: str | None = None):
        self.urls = list(urls)
        self.actors = list(actors)
        self.api_key = api_key

    @classmethod
    def embedded(
        cls,
        checkpoint: str | Path,
        n: int = 1,
        *,
        num_cpus: float = 1,
        num_gpus: float = 0,
        placement: Sequence[tuple[Any, int]] = (),
        num_threads: int | None = None,
        api_key: str | None = None,
        **engine_kwargs: Any,
    ) -> EngineGroup:
        import secrets

        import ray

        api_key = api_key or secrets.token_urlsafe(24)
        remote = ray.remote(EngineServer)
        actors = []
        from agentrl.runtime.cluster import actor_options

        for i in range(n):
            opts = actor_options(num_cpus, num_gpus, placement[i] if i < len(placement) else None)
            if num_gpus:
                engine_kwargs.setdefault("device", "cuda")
            actors.append(
                remote.options(**opts).remote(
                    str(checkpoint), num_threads=num_threads, api_key=api_key, **engine_kwargs
                )
            )
        urls = ray.get([a.get_url.remote() for a in actors])
        return cls(urls, actors, api_key)

    @classmethod
    def external(cls, urls: Sequence[str], api_key: str | None = None) -> EngineGroup:
        import os

        from agentrl.engines.http import API_KEY_ENV

        return cls(urls, api_key=api_key or os.environ.get(API_KEY_ENV) or None)

    @property
    def supports_tensors(self) -> bool:
        """Whether weights can go through the object store (embedded engines only)."""
        return bool(self.actors)

    def node_ids(self) -> list[str]:
        import ray

        return ray.get([a.node_id.remote() for a in self.actors])

    def push_shared(self, path: str, layout: Any, weight_version: str) -> None:
        """Have every engine switch to the weights in a shared-memory slot (same node only)."""
        import ray

        self._check(ray.get([a.update_weights_from_shared.remote(path, layout, weight_version) for a in self.actors]))

    def push_tensors(self, named_ref: Any, weight_version: str) -> None:
        """Load the weights behind ``named_ref`` (``ray.put(tensors_to_numpy(...))``) into every engine."""
        import ray

        self._check(ray.get([a.update_weights_from_tensors.remote(named_ref, weight_version) for a in self.actors]))

    @staticmethod
    def _check(results: list[dict]) -> None:
        bad = [r for r in results if not r.get("success")]
        if bad:
            raise RuntimeError(f"weight update failed on {len(bad)} engine(s): {bad[0].get('message')}")

    def shutdown(self) -> None:
        import ray

        for a in self.actors:
            try:
                ray.get(a.shutdown.remote(), timeout=30)
            except Exception:  # noqa: BLE001 - best effort; the actor is killed next
                pass
            ray.kill(a)
        self.actors = []
