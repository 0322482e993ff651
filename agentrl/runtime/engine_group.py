"""Rollout engines for training: embedded engines as Ray actors, or SGLang servers already running.

Either way the generate loop talks HTTP to them through :class:`~agentrl.engines.router.Router`,
so the code path on a laptop and on a cluster is the same. What differs is how new weights get in:

- embedded engines (:class:`EngineServer` actors) take the trainer's full weights through Ray:
  a shared-memory slot on the trainer's node, else the object store (the ``shm`` and
  ``object_store`` routes of :mod:`agentrl.runtime.weight_sync`), no disk;
- any engine can load a checkpoint folder (``/update_weights_from_disk``);
- SGLang engines on GPUs receive an NCCL broadcast (``agentrl.runtime.weight_sync``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from agentrl.config import POLICY_ADAPTER
from agentrl.engines.http import API_KEY_ENV
from agentrl.engines.sglang import SGLangLaunch, SGLangServer, build_launch_command
from agentrl.ports import free_port
from agentrl.runtime.cluster import actor_options, peak_rss_mb
from agentrl.runtime.shm_weights import open_weights

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


def _reachable_host(host: str) -> str:
    """The address other nodes reach a server bound to ``host`` at: the node's IP for a wildcard address."""
    if host not in ("0.0.0.0", "::", ""):
        return host
    import ray

    return ray.util.get_node_ip_address() if ray.is_initialized() else "127.0.0.1"


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
        from agentrl.engines.local.openai_routes import openai_tool_parser
        from agentrl.engines.local.server import build_app

        if num_threads:
            torch.set_num_threads(num_threads)
        self.port = port or free_port(host)
        # a server on every interface (--engine-host 0.0.0.0: episodes on other nodes) is reached at its node's IP
        self.url = f"http://{_reachable_host(host)}:{self.port}"
        self._ready = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        # agentrl's own engines release their KV cache when the trainer asks (colocated offload)
        engine_kwargs.setdefault("enable_memory_saver", True)
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

    def load_policy_adapter(
        self, named: dict[str, Any], config: dict[str, Any], weight_version: str, policy: str | None = None
    ) -> dict:
        """A LoRA run's adapter-only weight sync (the trainer's adapter in PEFT's names, numpy arrays from the object
        store): replaces the policy adapter, which every request naming no adapter then runs under, its samples
        reporting ``weight_version``; or, with ``policy`` (a ``--policy``), that policy's adapter, which requests
        name (``lora_path``). The base weights never change in a LoRA run, so nothing else moves."""
        tensors = numpy_to_tensors(named)
        return self._call(
            self.engine.load_lora_adapter(
                POLICY_ADAPTER if policy is None else policy,
                tensors=tensors,
                config=config,
                replace=True,
                weight_version=weight_version,
                serve_by_default=policy is None,
            )
        )

    def update_weights_from_shared(self, path: str, layout: Any, weight_version: str) -> dict:
        """Point the model's parameters at a shared-memory slot the trainer wrote (no copy).

        Reached only through Ray (the run's own trainer). Every value was proven finite on the trainer
        side (the trainer after its step, or the writer as it wrote the slot:
        :func:`agentrl.runtime.shm_weights.write_checked`), so the engine does not read each page again
        to look for a NaN (that doubled the cost of a push: bench P5).
        """
        try:
            weights = open_weights(path, layout)
        except OSError as exc:
            return {"success": False, "message": f"cannot map weight slot: {exc}", "num_paused_requests": 0}
        return self._call(
            self.engine.update_weights_from_tensors(weights, weight_version, assign=True, finite_checked=True)
        )

    def node_id(self) -> str:
        import ray

        return ray.get_runtime_context().get_node_id()

    def weight_version(self) -> str:
        return self.engine.weight_version

    def peak_rss_mb(self) -> float:
        return peak_rss_mb()

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

        return cls(urls, api_key=api_key or os.environ.get(API_KEY_ENV) or None)

    @property
    def supports_tensors(self) -> bool:
        """Whether weights can go through the object store (embedded engines only)."""
        return bool(self.actors)

    def node_ids(self) -> list[str]:
        import ray

        return ray.get([a.node_id.remote() for a in self.actors])

    def peak_rss_mb(self) -> float | None:
        """The largest peak resident memory (MiB) of the embedded engine actors; None for external servers."""
        import ray

        return max(ray.get([a.peak_rss_mb.remote() for a in self.actors]), default=None)

    def shutdown(self) -> None:
        import ray

        for a in self.actors:
            try:
                ray.get(a.shutdown.remote(), timeout=30)
            except Exception:  # noqa: BLE001 - best effort; the actor is killed next
                pass
            ray.kill(a)
        self.actors = []


class SGLangEngineGroup:
    """The run's engines as :class:`SGLangServer` actors, with the surface the train loop uses.

    ``urls`` feed the :class:`~agentrl.engines.router.Router`; weights go over HTTP (disk or NCCL
    broadcast), never Ray's object store (``supports_tensors`` is False). A dead engine is restarted
    on its port by :meth:`check_and_restart`, from :meth:`start_monitor`'s thread and before each
    weight sync (:func:`paused_for_update`); it then loads the weights named by
    :meth:`record_weights`, if any, else it serves the launch checkpoint until the next sync.
    """

    def __init__(
        self,
        launch: SGLangLaunch,
        actors: list[Any],
        urls: list[str],
        options: list[dict[str, Any]],
        ports: list[int],
        health_timeout: float = 30.0,
    ):
        self.launch, self.actors, self.urls = launch, actors, urls
        self.health_timeout = health_timeout
        self.restarts = [0] * len(actors)
        self._options, self._ports = options, ports
        self._weights: tuple[str, str] | None = None
        self._adapters: dict[str, tuple[str, str, str]] = {}  # served by name: the policy's (each --policy's)
        self._stale: set[int] = set()  # restarted engines whose reload of the recorded weights failed
        self._lock = threading.Lock()  # one check_and_restart at a time; held while suspended
        self._suspended = 0
        self._stop = threading.Event()
        self._monitor: threading.Thread | None = None
        self.ipc_folder: Any = None
        """The run's private folder for tensor handles (``launch.weight_ipc_dir``), removed at shutdown."""

    @classmethod
    def start(
        cls,
        launch: SGLangLaunch,
        n: int = 1,
        *,
        num_cpus: float = 1.0,
        num_gpus: float | None = None,
        placement: Sequence[tuple[Any, int]] = (),
        health_timeout: float = 30.0,
    ) -> SGLangEngineGroup:
        """Start ``n`` engines concurrently, engine ``i`` in ``placement[i]`` (a placement group and bundle index).

        ``num_gpus`` per engine defaults to ``launch.tp_size`` for SGLang and 0 for the embedded engine
        (CPU); Ray sets each actor's ``CUDA_VISIBLE_DEVICES``, which the server inherits.
        """
        import ray

        build_launch_command(launch, port=launch.port or 1)  # refuse bad server args here, before any actor
        if num_gpus is None:
            num_gpus = float(launch.tp_size) if launch.binary == "sglang" else 0.0
        options = [actor_options(num_cpus, num_gpus, placement[i] if i < len(placement) else None) for i in range(n)]
        remote = ray.remote(SGLangServer)
        actors = [remote.options(**options[i]).remote(launch, i) for i in range(n)]
        try:
            urls = ray.get([a.start.remote() for a in actors])
        except BaseException:
            cls._kill_actors(actors)
            raise
        ports = [int(u.rsplit(":", 1)[1]) for u in urls]
        return cls(launch, actors, urls, options, ports, health_timeout)

    @property
    def supports_tensors(self) -> bool:
        return False

    @property
    def api_key(self) -> str | None:
        """The key every server requires (``launch.api_key``), for the run's clients."""
        return self.launch.api_key

    def pids(self) -> list[int | None]:
        """Each engine's server pid on its node (None while down)."""
        import ray

        return ray.get([a.pid.remote() for a in self.actors])

    def record_weights(self, model_path: str, weight_version: str) -> None:
        """Remember the run's latest checkpoint folder: an engine restarted later loads it before serving."""
        self._weights = (str(model_path), str(weight_version))

    def load_adapter(self, lora_name: str, lora_path: str, weight_version: str, *, last: bool = True) -> None:
        """Every server serves the PEFT adapter folder ``lora_path`` as ``lora_name`` (SGLang's ``/load_lora_adapter``,
        replacing the previous one) and reports ``weight_version``; an engine restarted later loads it too. ``last``:
        the last adapter of a push (several policies push one each)."""
        import ray

        with self._lock:  # not beside a monitor's restart, which reloads the recorded adapters
            self._adapters[str(lora_name)] = (str(lora_name), str(lora_path), str(weight_version))
            ray.get([a.load_adapter.remote(*self._adapters[str(lora_name)]) for a in self.actors])
            if last:  # this push's last adapter: every engine serves the latest of each now (it raised otherwise)
                self._stale.clear()

    def check_and_restart(self, *, from_monitor: bool = False) -> list[int]:
        """Restart every engine that is not alive (same port; a lost actor is replaced); return their indices.

        A restarted engine then loads the weights named by :meth:`record_weights`; if that fails it is
        retried on every later check. ``from_monitor``: skip while a weight update holds the engines
        paused (a paused SGLang fails its health check and must not be restarted for it); the check is
        made under the lock that :meth:`monitor_suspended` takes, so no check slips in after a pause.
        """
        import ray

        with self._lock:
            if from_monitor and self._suspended:
                return []
            states = self._states()
            dead = [i for i, state in enumerate(states) if state != "ok"]
            refs = [self.actors[i].restart.remote() if states[i] == "down" else self._replace(i) for i in dead]
            restarted = []
            for i, ref in zip(dead, refs):
                try:
                    url = ray.get(ref)
                except Exception as exc:  # noqa: BLE001 - tried again on the next check
                    log.error("engine %d could not be restarted: %s", i, exc)
                    continue
                if url != self.urls[i]:
                    log.warning("engine %d came back at %s instead of %s", i, url, self.urls[i])
                    self.urls[i] = url
                self.restarts[i] += 1
                self._stale.add(i)
                restarted.append(i)
            for i in sorted(self._stale):
                try:
                    if self._weights is not None:
                        ray.get(self.actors[i].load_weights.remote(*self._weights))
                    for adapter in self._adapters.values():  # a LoRA run's policies, served by name (a new
                        ray.get(self.actors[i].load_adapter.remote(*adapter))  # process has none)
                    self._stale.discard(i)
                except Exception as exc:  # noqa: BLE001 - it serves older weights (their version says so) until then
                    log.error("engine %d could not load the run's weights: %s; retried on the next check", i, exc)
            return restarted

    def _states(self) -> list[str]:
        """Per engine: ``ok``, ``down`` (the server is dead or does not answer) or ``lost`` (so is its actor)."""
        import ray

        refs = [a.alive.remote(self.health_timeout) for a in self.actors]
        out = []
        for ref in refs:
            try:
                out.append("ok" if ray.get(ref, timeout=self.health_timeout + 30) else "down")
            except Exception:  # noqa: BLE001 - a dead or stuck actor is replaced
                out.append("lost")
        return out

    def _replace(self, i: int) -> Any:
        import ray

        self._kill_actors([self.actors[i]])
        self.actors[i] = ray.remote(SGLangServer).options(**self._options[i]).remote(self.launch, i, self._ports[i])
        return self.actors[i].start.remote()

    def start_monitor(self, interval: float = 10.0) -> None:
        """Check every ``interval`` seconds from a daemon thread and restart dead engines (until :meth:`shutdown`)."""
        if self._monitor is not None:
            return

        def run() -> None:
            while not self._stop.wait(interval):
                try:
                    restarted = self.check_and_restart(from_monitor=True)
                except Exception:  # noqa: BLE001 - the monitor must outlive one failed round
                    log.exception("engine health check failed")
                    continue
                if restarted:
                    log.warning("restarted engine(s) %s", restarted)

        self._monitor = threading.Thread(target=run, name="agentrl-sglang-monitor", daemon=True)
        self._monitor.start()

    @contextlib.contextmanager
    def monitor_suspended(self):
        """No health checks inside (a paused SGLang engine fails ``/health_generate`` and would be restarted)."""
        with self._lock:  # waits for a check in progress
            self._suspended += 1
        try:
            yield
        finally:
            with self._lock:
                self._suspended -= 1

    def shutdown(self) -> None:
        """Stop the monitor, stop every server, kill the actors (safe to call twice)."""
        import ray

        self._stop.set()
        if self._monitor is not None:
            self._monitor.join(timeout=self.health_timeout + 60)
            self._monitor = None
        refs = [a.shutdown.remote() for a in self.actors]
        for ref in refs:
            with contextlib.suppress(Exception):  # a lost actor took its server with it
                ray.get(ref, timeout=60)
        self._kill_actors(self.actors)
        self.actors = []
        if self.ipc_folder is not None:
            self.ipc_folder.remove()
            self.ipc_folder = None

    @staticmethod
    def _kill_actors(actors: Sequence[Any]) -> None:
        import ray

        for a in actors:
            with contextlib.suppress(Exception):
                ray.kill(a)
