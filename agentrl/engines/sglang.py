"""SGLang servers for training: launched and watched by Ray actors, paused around weight updates.

An :class:`SGLangServer` actor per engine runs the server process (``python -m
sglang.launch_server`` on GPU nodes, or ``python -m agentrl serve``, the embedded engine with the
same HTTP API, so this code path is tested on a laptop) and restarts it on the same port when it
dies. :class:`agentrl.runtime.engine_group.SGLangEngineGroup` places the actors, hands the train loop
their ``urls`` and restarts dead engines from a monitor thread. :func:`paused_for_update` is slime's protocol around
a weight push: pause (running requests return finish reason ``abort``), flush, update, continue.

``--sglang-<name> VALUE`` flags arrive as ``{"name": value}`` (:func:`server_args_from_flags`) and
leave in SGLang's CLI spelling, ``--<name> VALUE`` (booleans are ``store_true`` flags, lists one
flag and several words, dicts JSON); SGLang's parser checks them, and a bad one stops the server
with its log tail in the error. ``agentrl serve`` maps what it understands, drops with a warning
what cannot change what is sampled, and refuses the rest before any process starts.

API keys never reach a command line (every local user reads ``/proc/PID/cmdline``): ``agentrl serve`` gets its
key in the environment; SGLang, which reads its key from ``--api-key`` or from a ``--config FILE.yaml`` (SGLang
0.5.3 and later), gets it in a file only the server's user can read, written for each start and deleted once
the server answers (an older SGLang gets ``--api-key``). Server logs are created readable by their owner only
(SGLang logs its server args, the key among them).

No orphans: a server leads its own process group, the kernel SIGKILLs it when its actor process
dies (``PR_SET_PDEATHSIG``), and the embedded engine also exits when its stdin pipe closes.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import importlib.util
import json
import logging
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from agentrl.engines.http import API_KEY_ENV, auth_headers
from agentrl.engines.router import fan_out
from agentrl.ports import free_port

log = logging.getLogger(__name__)

BINARIES = ("sglang", "agentrl")

OWNED_ARGS = ("model_path", "host", "port")
"""Set by :class:`SGLangLaunch` itself (as slime sets them); refused among the pass-through args."""

EMBEDDED_FLAGS = {
    "context_length": "--context-length",
    "max_running_requests": "--max-running-requests",
    "random_seed": "--seed",
    "tool_call_parser": "--tool-call-parser",
    "enable_torch_compile": "--enable-torch-compile",
    "torch_compile_max_bs": "--torch-compile-max-bs",
    "enable_lora": "--enable-lora",
    "lora_paths": "--lora-paths",
    "max_loras_per_batch": "--max-loras-per-batch",
    "max_loaded_loras": "--max-loaded-loras",
    "max_lora_rank": "--max-lora-rank",
    "lora_target_modules": "--lora-target-modules",
}
"""ServerArgs fields ``agentrl serve`` understands, and its flag for each."""

EMBEDDED_SWITCHES = frozenset({"enable_torch_compile", "enable_lora"})
"""Of those, the ones ``agentrl serve`` takes as a bare switch (given when true, left out when false)."""

EMBEDDED_IGNORED = frozenset(
    {
        "mem_fraction_static",
        "cuda_graph_bs",
        "cuda_graph_max_bs",
        "disable_cuda_graph",
        "disable_cuda_graph_padding",
        "enable_weights_cpu_backup",
        "enable_draft_weights_cpu_backup",
        "skip_server_warmup",
        "log_level",
        "log_level_http",
        "enable_metrics",
        "nccl_port",
        "base_gpu_id",
        "gpu_id_step",
        "attention_backend",
        "sampling_backend",
        "chunked_prefill_size",
        "max_prefill_tokens",
        "schedule_policy",
        "schedule_conservativeness",
        "disable_radix_cache",
        "trust_remote_code",
        "watchdog_timeout",
        "dist_timeout",
        "decode_log_interval",
    }
)
"""Performance, memory and logging knobs the embedded engine drops with a warning: none changes what is sampled."""

EMBEDDED_ONLY_ONE = ("tp_size", "dp_size", "pp_size", "ep_size")  # parallel sizes it accepts only as 1


def server_args_from_flags(values: Mapping[str, Any]) -> dict[str, Any]:
    """``--sglang-*`` values -> SGLang ``ServerArgs`` field names and values, in the given order.

    Keys may keep the ``sglang_``/``--sglang-`` prefix and use dashes (``"mem-fraction-static"``,
    ``"sglang_mem_fraction_static"`` and ``"--sglang-mem-fraction-static"`` all give
    ``mem_fraction_static``). ``None`` means "not given" (argparse's default) and is dropped.
    """
    out: dict[str, Any] = {}
    for key, value in values.items():
        name = key.lstrip("-").replace("-", "_").removeprefix("sglang_")
        if not name.isidentifier():
            raise ValueError(f"--sglang-{key}: not a SGLang server argument name")
        if name in out:
            raise ValueError(f"--sglang-{name.replace('_', '-')} is given twice")
        if value is not None:
            out[name] = value
    return out


def _cli_words(name: str, value: Any) -> list[str]:
    """One ServerArgs value in SGLang's CLI spelling (argparse as ``add_cli_args_from_dataclass`` builds it)."""
    flag = "--" + name.replace("_", "-")
    if isinstance(value, bool):
        return [flag] if value else []  # store_true: present means True
    if isinstance(value, (list, tuple)):
        return [flag, *map(str, value)] if value else []  # nargs="+"
    if isinstance(value, dict):
        return [flag, json.dumps(value)]
    return [flag, str(value)]


@dataclass
class SGLangLaunch:
    """How to start one engine's server: the model, where it listens, and its server args.

    ``binary`` is ``"sglang"`` (``python -m sglang.launch_server``; GPU nodes) or ``"agentrl"``
    (``python -m agentrl serve``, the embedded engine). ``port=None`` picks a free port on the
    engine's node. ``host`` stays on loopback unless asked (``"0.0.0.0"`` for engines on other
    nodes; URLs then carry the node's IP). ``colocate`` adds ``--enable-memory-saver``, which
    SGLang needs for ``/release_memory_occupation`` while the trainer shares the GPU. ``seed`` + the
    engine's index becomes its ``--random-seed``, so engines do not draw identical samples.
    ``tp_size`` may also come in ``server_args`` (it then moves here).
    """

    model_path: str
    binary: str = "sglang"
    host: str = "127.0.0.1"
    port: int | None = None
    tp_size: int = 1
    server_args: dict[str, Any] = field(default_factory=dict)
    colocate: bool = False
    seed: int | None = None
    env: dict[str, str] = field(default_factory=dict)
    startup_timeout: float = 600.0
    log_dir: str | None = None
    api_key: str | None = None
    weight_ipc_dir: str | None = None
    """``agentrl serve`` only: the run's private folder for tensor handles (``--weight-ipc-dir``), set by a
    run that may push weights by handle (``--weight-sync tensor``, or ``auto`` colocated)."""

    def __post_init__(self) -> None:
        if self.binary not in BINARIES:
            raise ValueError(f"binary must be one of {BINARIES}, got {self.binary!r}")
        self.model_path = str(self.model_path)
        self.server_args = server_args_from_flags(self.server_args)
        owned = [k for k in OWNED_ARGS if k in self.server_args]
        if owned:
            raise ValueError(
                f"--sglang-{owned[0].replace('_', '-')} is set by the launcher "
                "(use --hf-checkpoint; host and port are chosen per engine): drop it"
            )
        tp = self.server_args.pop("tp_size", None)
        if tp is not None and self.tp_size not in (1, int(tp)):
            raise ValueError(
                f"--sglang-tp-size {tp} disagrees with {self.tp_size} GPUs per engine "
                "(--rollout-num-gpus-per-engine): give one of them"
            )
        self.tp_size = int(tp if tp is not None else self.tp_size)
        key = self.server_args.pop("api_key", None)  # --sglang-api-key: the key, not a pass-through arg
        self.api_key = self.api_key or (str(key) if key else None)

    @property
    def health_path(self) -> str:
        """What :meth:`SGLangServer.alive` asks: SGLang's ``/health_generate`` runs a one-token generation
        (a hung scheduler fails it); the embedded ``/health`` reports its worker thread, since its
        ``/health_generate`` would queue behind every running request."""
        return "/health_generate" if self.binary == "sglang" else "/health"

    def process_env(self) -> dict[str, str]:
        """The server's environment: ours, plus what a trainer-driven server needs."""
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        if self.binary == "sglang":
            # As slime: /health answers without queueing a generation (the monitor asks /health_generate).
            env.setdefault("SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION", "false")
            if self.colocate:  # SGLang's memory saver does not work with expandable segments (slime drops them)
                env.pop("PYTORCH_CUDA_ALLOC_CONF", None)
                env.pop("PYTORCH_ALLOC_CONF", None)
        else:  # `-m agentrl` must resolve from a Ray worker's directory too
            root = str(Path(__file__).resolve().parents[2])
            env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
            env.pop(API_KEY_ENV, None)
            if self.api_key:  # by environment, not argv: other local users can read a process's argv
                env[API_KEY_ENV] = self.api_key
        env.update(self.env)
        return env

    @property
    def headers(self) -> dict[str, str]:
        """What the launcher's own health checks and weight loads send."""
        return auth_headers(self.api_key)


def build_launch_command(
    launch: SGLangLaunch, *, port: int | None = None, seed: int | None = None, key_file: str | None = None
) -> list[str]:
    """The server's argv. ``port`` / ``seed`` default to ``launch.port`` / ``launch.seed``.

    SGLang gets, besides the pass-through args: ``--model-path --host --port --tp-size``,
    ``--skip-server-warmup`` (slime always sets it: the launcher's own readiness check is a real
    generation through ``/health_generate``, and the warmup's fixed timeout fails slow first
    starts), ``--enable-memory-saver`` when colocated, ``--random-seed`` when seeded, and the API key:
    ``--config key_file`` where the caller wrote it there (:func:`write_key_config`), else ``--api-key``.
    """
    port = launch.port if port is None else port
    if port is None:
        raise ValueError("build_launch_command needs a port")
    seed = launch.seed if seed is None else seed
    extra = dict(launch.server_args)
    if launch.binary == "agentrl":
        return _embedded_command(launch, port, seed, extra)
    args: dict[str, Any] = {
        "model_path": launch.model_path,
        "host": launch.host,
        "port": int(port),
        "tp_size": launch.tp_size,
        "skip_server_warmup": True,
    }
    if launch.colocate:
        args["enable_memory_saver"] = True
    if launch.api_key and key_file:  # SGLang merges the YAML file's args into its own: the key stays off argv
        args["config"] = key_file
    elif launch.api_key:  # an SGLang without --config: argv is the only way in
        args["api_key"] = launch.api_key
    if seed is not None and "random_seed" not in extra:
        args["random_seed"] = int(seed)
    args.update(extra)
    if launch.colocate:
        args["enable_memory_saver"] = True  # release/resume memory needs it whatever the flags say
    argv = [sys.executable, "-m", "sglang.launch_server"]
    for name, value in args.items():
        argv += _cli_words(name, value)
    return argv


def sglang_reads_config_file() -> bool:
    """Whether the installed SGLang merges ``--config FILE.yaml`` into its server args (0.5.3 and later: its
    ``server_args_config_parser`` module), found without importing SGLang."""
    try:
        spec = importlib.util.find_spec("sglang")
    except (ImportError, ValueError):
        return False
    if spec is None or not spec.submodule_search_locations:
        return False
    srt = Path(next(iter(spec.submodule_search_locations))) / "srt"
    return any((srt / p).is_file() for p in ("server_args_config_parser.py", "utils/server_args_config_parser.py"))


def write_key_config(path: Path, api_key: str) -> None:
    """An SGLang ``--config`` YAML file holding only ``api-key``, readable by this user alone (JSON's string
    syntax is YAML's double-quoted scalar)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        os.fchmod(f.fileno(), 0o600)
        f.write(f"api-key: {json.dumps(api_key)}\n")


def _embedded_command(launch: SGLangLaunch, port: int, seed: int | None, extra: dict[str, Any]) -> list[str]:
    """``agentrl serve`` argv: the args it understands mapped, harmless ones dropped, the rest refused."""
    sizes = {"tp_size": launch.tp_size, **{k: extra.pop(k) for k in EMBEDDED_ONLY_ONE if k in extra}}
    big = {k: v for k, v in sizes.items() if int(v) != 1}
    if big:
        raise ValueError(
            f"the embedded engine (agentrl serve) has no model parallelism, got {big}: "
            "use one device per engine, or SGLang"
        )
    if seed is not None:
        extra.setdefault("random_seed", seed)
    memory_saver = bool(extra.pop("enable_memory_saver", False)) or launch.colocate
    ignored = [k for k in extra if k in EMBEDDED_IGNORED]
    unknown = [k for k in extra if k not in EMBEDDED_IGNORED and k not in EMBEDDED_FLAGS]
    if unknown:
        flags = ", ".join("--sglang-" + k.replace("_", "-") for k in unknown)
        raise ValueError(
            f"the embedded engine (agentrl serve) does not support {flags}: drop them, or run "
            f"SGLang (it understands {sorted(EMBEDDED_FLAGS)}; it ignores {sorted(EMBEDDED_IGNORED)})"
        )
    if ignored:
        log.warning(
            "the embedded engine ignores %s (performance/memory options of SGLang)",
            ", ".join("--sglang-" + k.replace("_", "-") for k in ignored),
        )
    argv = [
        sys.executable,
        "-m",
        "agentrl",
        "serve",
        "--hf-checkpoint",
        launch.model_path,
        "--host",
        launch.host,
        "--port",
        str(int(port)),
        "--exit-with-stdin",
    ]
    if launch.weight_ipc_dir:
        argv += ["--weight-ipc-dir", launch.weight_ipc_dir]
    for name, value in extra.items():
        if name in EMBEDDED_SWITCHES:
            if not isinstance(value, bool):
                raise ValueError(f"--sglang-{name.replace('_', '-')} is a switch: true or false, got {value!r}")
            argv += [EMBEDDED_FLAGS[name]] if value else []
        elif name == "torch_compile_max_bs" and (
            isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 65536
        ):
            raise ValueError(f"--sglang-torch-compile-max-bs must be an integer in [1, 65536], got {value!r}")
        elif name in EMBEDDED_FLAGS and isinstance(value, (list, tuple)):  # nargs="+": --lora-paths, target modules
            argv += [EMBEDDED_FLAGS[name], *map(str, value)] if value else []
        elif name in EMBEDDED_FLAGS:
            argv += [EMBEDDED_FLAGS[name], str(value)]
    if memory_saver:  # colocated: the trainer's release must free the KV cache
        argv.append("--enable-memory-saver")
    return argv


def _pdeathsig_hook(parent: int) -> Callable[[], None] | None:
    """A ``preexec_fn`` that has the kernel SIGKILL the child when the spawning thread's process dies."""
    if not sys.platform.startswith("linux"):
        return None
    prctl = ctypes.CDLL(None, use_errno=True).prctl

    def hook() -> None:  # runs in the child between fork and exec: no locks, no logging
        prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        if os.getppid() != parent:  # the parent died before prctl: nobody would kill us later
            os._exit(1)

    return hook


class SGLangServer:
    """One engine's server process, supervised from inside a Ray actor (``ray.remote(SGLangServer)``).

    Also usable as a plain object in one process. The server logs (stdout and stderr) go to
    ``log_path`` on the actor's node, appended across restarts with a header line per start.
    """

    def __init__(self, launch: SGLangLaunch, index: int = 0, port: int | None = None):
        self.launch, self.index = launch, index
        bind = "127.0.0.1" if launch.host in ("0.0.0.0", "::", "") else launch.host
        self.port = port or launch.port or free_port(bind)
        self.seed = None if launch.seed is None else launch.seed + index
        # SGLang's key in a private file (written for each start, deleted once the server answers), not on argv
        self._key_dir: str | None = None
        key_file = None
        if launch.binary == "sglang" and launch.api_key and "config" not in launch.server_args:
            if sglang_reads_config_file():
                self._key_dir = tempfile.mkdtemp(prefix="agentrl-sglang-key-")  # mode 0700
                key_file = str(Path(self._key_dir) / "api-key.yaml")
            else:
                log.warning("this SGLang has no --config: its API key goes on the command line (upgrade to >= 0.5.3)")
        self.command = build_launch_command(launch, port=self.port, seed=self.seed, key_file=key_file)  # checks args
        log_dir = Path(launch.log_dir or Path(tempfile.gettempdir()) / "agentrl-engines")
        log_dir.mkdir(parents=True, exist_ok=True)
        self.log_path = log_dir / f"engine-{index}-port{self.port}.log"
        self.starts = 0
        self._proc: subprocess.Popen | None = None
        self._log: Any = None
        # Popen runs on this one long-lived thread: PR_SET_PDEATHSIG fires when the *thread* that
        # forked the child exits, so a short-lived Ray executor thread would kill the server early.
        self._spawner = ThreadPoolExecutor(1, thread_name_prefix="agentrl-sglang-spawn")
        # adapters the run serves by name ({name: (folder, version)}, :meth:`load_adapter`): a restart starts with
        # them (--lora-paths), so the server never answers a request naming one before it has it
        self._serving: dict[str, tuple[str, str]] = {}
        self._adapters: dict[str, str] = {}  # what the running process holds: {name: folder}

    def url(self) -> str:
        host = self.launch.host
        if host in ("0.0.0.0", "::", ""):
            import ray

            host = ray.util.get_node_ip_address()
        return f"http://{f'[{host}]' if ':' in host else host}:{self.port}"

    def pid(self) -> int | None:
        """The server's pid (= its process group id), None when not running."""
        return self._proc.pid if self._proc is not None and self._proc.poll() is None else None

    def start(self) -> str:
        """Start the server and wait until it generates; return its URL. Raises with the log tail on failure."""
        if self._proc is not None and self._proc.poll() is None:
            return self.url()
        self._kill(grace=0.0)  # reap a dead server, its stray children and its log handle
        self.starts += 1
        key_file = self._key_file()
        if key_file is not None:
            write_key_config(key_file, str(self.launch.api_key))
        try:
            self._proc = self._spawner.submit(self._spawn).result()
            try:
                self._wait_ready(self._proc)
                self._adapters = {name: folder for name, (folder, _) in self._serving.items()}
                for _, version in self._serving.values():  # the adapter's version, not the launch checkpoint's
                    self._post_ok("/update_weight_version", {"new_version": version, "abort_all_requests": False})
            except BaseException:
                self._kill(grace=2.0)
                raise
        finally:
            if key_file is not None:  # read at startup only
                key_file.unlink(missing_ok=True)
        return self.url()

    def _key_file(self) -> Path | None:
        return Path(self._key_dir) / "api-key.yaml" if self._key_dir else None

    def _spawn(self) -> subprocess.Popen:
        fd = os.open(self.log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)  # SGLang logs its key
        os.fchmod(fd, 0o600)
        self._log = os.fdopen(fd, "ab")
        argv = self.command + (
            ["--lora-paths", *(f"{name}={folder}" for name, (folder, _) in self._serving.items())]
            if self._serving
            else []
        )
        command = shlex.join(argv)
        if self.launch.api_key:
            command = command.replace(self.launch.api_key, "***")
        header = f"\n=== agentrl: start {self.starts} of engine {self.index}: {command}\n"
        self._log.write(header.encode())
        self._log.flush()
        stdin = subprocess.PIPE if self.launch.binary == "agentrl" else subprocess.DEVNULL  # --exit-with-stdin
        return subprocess.Popen(
            argv,
            stdin=stdin,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=self.launch.process_env(),
            start_new_session=True,
            preexec_fn=_pdeathsig_hook(os.getpid()),
        )

    def _wait_ready(self, proc: subprocess.Popen) -> None:
        url, timeout = self.url(), self.launch.startup_timeout
        deadline = time.monotonic() + timeout
        while True:
            if proc.poll() is not None:
                raise RuntimeError(
                    f"engine {self.index} ({self.launch.binary}) exited with code {proc.returncode} "
                    f"during startup. Last lines of {self.log_path}:\n{self.log_tail()}"
                )
            try:
                if httpx.get(url + "/health_generate", timeout=5.0, headers=self.launch.headers).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"engine {self.index} ({self.launch.binary}) did not answer /health_generate on "
                    f"{url} within {timeout:.0f}s (raise the startup timeout for big models). "
                    f"Last lines of {self.log_path}:\n{self.log_tail()}"
                )
            time.sleep(0.25)

    def alive(self, timeout: float = 10.0) -> bool:
        """The process runs and answers ``launch.health_path`` within ``timeout`` seconds."""
        if self._proc is None or self._proc.poll() is not None:
            return False
        try:
            return (
                httpx.get(
                    self.url() + self.launch.health_path, timeout=timeout, headers=self.launch.headers
                ).status_code
                == 200
            )
        except httpx.HTTPError:
            return False

    def restart(self) -> str:
        """Kill the server's process group and start it again on the same port; return its URL."""
        log.warning("restarting engine %d on port %d", self.index, self.port)
        self._kill(grace=5.0)
        return self.start()

    def load_weights(self, model_path: str, weight_version: str) -> None:
        """``/update_weights_from_disk`` on this server (a restarted engine catching up with the run)."""
        r = httpx.post(
            self.url() + "/update_weights_from_disk",
            timeout=600.0,
            headers=self.launch.headers,
            json={"model_path": model_path, "weight_version": weight_version},
        )
        if r.status_code >= 400 or not r.json().get("success", False):
            raise RuntimeError(f"engine {self.index}: loading {model_path} failed: {r.text[:300]}")

    def load_adapter(self, lora_name: str, lora_path: str, weight_version: str) -> None:
        """A LoRA run's adapter, the PEFT folder ``lora_path``, served as ``lora_name`` by SGLang's own endpoints:
        another folder of that name this server process holds is unloaded first (``/load_lora_adapter`` refuses a
        name in use), then ``/update_weight_version`` makes responses report ``weight_version``. Remembered: a
        restart starts with it."""
        self._serving[lora_name] = (str(lora_path), str(weight_version))
        if self._adapters.get(lora_name) != lora_path:
            if lora_name in self._adapters:
                self._post_ok("/unload_lora_adapter", {"lora_name": lora_name})
                del self._adapters[lora_name]
            self._post_ok("/load_lora_adapter", {"lora_name": lora_name, "lora_path": lora_path, "pinned": False})
            self._adapters[lora_name] = lora_path
        self._post_ok("/update_weight_version", {"new_version": str(weight_version), "abort_all_requests": False})

    def _post_ok(self, path: str, body: dict[str, Any]) -> None:
        r = httpx.post(self.url() + path, timeout=600.0, headers=self.launch.headers, json=body)
        try:
            reply = r.json()
        except ValueError:
            reply = None
        ok = r.status_code < 400 and not (isinstance(reply, dict) and reply.get("success") is False)
        if not ok:
            raise RuntimeError(f"engine {self.index}: {path} failed (HTTP {r.status_code}): {r.text[:300]}")

    def log_tail(self, lines: int = 40) -> str:
        try:
            with open(self.log_path, "rb") as f:
                f.seek(max(0, os.path.getsize(self.log_path) - 64 * 1024))
                return "\n".join(f.read().decode(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def _kill(self, grace: float) -> None:
        """SIGTERM the process group, SIGKILL after ``grace`` seconds, reap; also stray members of a dead leader."""
        proc, self._proc = self._proc, None
        if proc is not None:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGTERM)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(timeout=grace)
            # A pgid is not reused while a member lives, so this reaches only our server's children.
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            if proc.stdin:
                proc.stdin.close()
        if self._log is not None:
            self._log.close()
            self._log = None

    def shutdown(self, grace: float = 15.0) -> None:
        """Stop the server (SIGTERM, then SIGKILL after ``grace`` seconds) and reap it."""
        self._kill(grace)
        self._spawner.shutdown(wait=False)
        if self._key_dir is not None:
            shutil.rmtree(self._key_dir, ignore_errors=True)


@contextlib.asynccontextmanager
async def paused_for_update(
    engines: Any, *, mode: str | None = "abort", group: Any = None, flush: bool = True
) -> AsyncIterator[list[int]]:
    """Hold generation on ``engines`` (a Router, an SGLangEngine, or a list of them) while the body updates weights.

    Order as in slime's weight updaters: (``group``: restart dead engines, then suspend the monitor)
    pause (mode ``abort``: running requests return finish reason ``abort`` with their partial output;
    new ones wait on the server), flush the prefix cache (not with ``in_place``, which keeps the KV
    of held requests), body, continue. The continue is sent even when the body fails, so engines are
    never left paused. ``mode=None`` skips pause, flush and continue (engines that swap weights between
    two decode steps, like the embedded one) but still restarts dead engines and holds the monitor.
    Yields the indices of the engines restarted first: they serve the launch (or recorded) weights
    until the body's push reaches them too, and must rejoin an NCCL group.
    """
    targets = list(engines) if isinstance(engines, (list, tuple)) else [engines]
    restarted = await asyncio.to_thread(group.check_and_restart) if group is not None else []
    suspended = group.monitor_suspended() if group is not None else contextlib.nullcontext()
    await asyncio.to_thread(suspended.__enter__)  # may wait for a health check in progress
    try:
        if mode is None:
            yield restarted
            return
        try:
            await fan_out(e.pause_generation(mode) for e in targets)
            if flush and mode != "in_place":
                await fan_out(e.flush_cache() for e in targets)
            yield restarted
        except BaseException:
            try:
                await fan_out(e.continue_generation() for e in targets)
            except Exception as exc:  # noqa: BLE001 - the body's error is the one to report
                log.error("continue_generation after a failed update failed too: %s", exc)
            raise
        await fan_out(e.continue_generation() for e in targets)
    finally:
        await asyncio.to_thread(suspended.__exit__, None, None, None)
