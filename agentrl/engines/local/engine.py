"""The embedded engine: continuous batching over a preallocated KV cache, on CPU or one GPU.

``LocalEngine`` is what ``agentrl serve`` runs when there is no SGLang: the HTTP app in
``server.py`` wraps it in SGLang's API, so client code cannot tell the two apart. It exists because
HF ``generate`` batches statically (a batch runs until its longest member ends, finished rows keep
burning compute) and HF's own continuous batching was slower than that on CPU, with one global
sampling mode and renormalized log-probs.

One worker thread owns the model. Each iteration it (1) applies aborts, cache flushes and weight
updates, (2) admits waiting requests into free rows (up to ``max_running_requests``): reuses the
longest cached token prefix, then prefills the rest in right-padded batches of similar length,
(3) runs one decode step for every running request, samples each row with its own parameters and
retires the finished ones at once. ``generate`` only enqueues and awaits a future that the worker
resolves with ``loop.call_soon_threadsafe``, so the event loop never blocks on the model.

Log-probs are SGLang's: ``log_softmax(logits / temperature)`` of the sampled token, taken before
top-k/top-p/min-p filtering, in fp32 (greedy: ``log_softmax(logits)``); they equal a full-sequence
re-score of prompt + output.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import threading
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from agentrl.cpu_share import CoreShare
from agentrl.engines.local.image_data import EngineVision, RequestImages
from agentrl.engines.local.kv_cache import CachedForward, CachedSequence, PrefixStore, SlotKVCache, common_prefix_len
from agentrl.engines.local.lora import (
    DEFAULT_MAX_LORAS_PER_BATCH,
    SUPPORTED_TARGETS,
    Adapter,
    LoraAdapters,
    LoraError,
    check_adapter_config,
    check_limits,
    parse_lora_paths,
    parse_target_modules,
    read_adapter_config,
)
from agentrl.engines.local.sampling import InvalidRequestError, SamplingConfig, biased, kept_tokens, sample_batch
from agentrl.engines.local.weights import WeightUpdateError, apply_weights, model_shapes, read_source
from agentrl.vlm import load_vision_model, vision_for

log = logging.getLogger(__name__)

MAX_CONSECUTIVE_FAULTS = 3
"""Iterations failing in a row (outside any one request) after which the engine reports itself unhealthy."""

MAX_TOP_LOGPROBS = 128
"""Largest ``top_logprobs_num``: each entry is a list per token (per prompt token too, from ``logprob_start_len``)."""

MEMORY_TAGS = ("weights", "kv_cache", "cuda_graph")
"""SGLang's ``tags`` for ``/release_memory_occupation`` and ``/resume_memory_occupation``."""


class EngineFault(RuntimeError):
    """The engine failed while serving this request (a fault, not a bad request): HTTP 500, engine up."""


class _Request:
    """One generation request as the worker tracks it."""

    def __init__(
        self,
        rid: str,
        input_ids: list[int],
        sp: SamplingConfig,
        logprob: tuple[bool, bool],
        future: asyncio.Future,
        loop: asyncio.AbstractEventLoop,
    ):
        self.rid, self.input_ids, self.sp = rid, input_ids, sp
        self.return_logprob, self.return_text_in_logprobs = logprob
        self.future, self.loop = future, loop
        # the prefix-cache key: the ids, with image placeholders as content-derived negative ids (image_data.py)
        self.prompt = np.asarray(input_ids, dtype=np.int64)
        self.images: RequestImages | None = None
        self.output_ids: list[int] = []
        self.logprobs: list[float] = []
        self.row = -1
        self.kv_len = 0  # positions whose keys/values are written in the row
        self.cached_tokens = 0
        self.finish: dict[str, Any] | None = None
        self.created = time.perf_counter()
        self.generator: torch.Generator | None = None  # own RNG when the request carries sampling_seed
        self.logprob_start_len = -1  # with return_logprob: input_token_logprobs from this prompt position
        self.top_logprobs_num = 0
        self.output_top: list[list[list]] = []  # per output token: top_logprobs_num [logprob, id, text]
        self.top_p_ids: list[list[int]] = []  # per output token: the kept set (custom_params.return_top_p_token_ids)
        self.input_meta: dict[str, list] = {}  # input_token_logprobs / input_top_logprobs, once scored
        self.stream: asyncio.Queue | None = None  # partial responses for a streaming request
        self.lora: Adapter | None = None  # the LoRA adapter the request runs under (lora_path)
        self.takes_policy = False  # named none on an engine serving a run's policy adapter: it is taken at admission

    @property
    def slot(self) -> int:
        """The adapter's slot in the stacked LoRA weights (0: none)."""
        return self.lora.slot if self.lora is not None else 0

    @property
    def tag(self) -> int:
        """The prefix-cache tag: the adapter load's uid (0: none), so KV is never shared across adapters."""
        return self.lora.uid if self.lora is not None else 0

    def tokens(self) -> np.ndarray:
        """Prompt + output ids whose KV is in the row (the last sampled token's is not yet)."""
        if not self.output_ids:
            return self.prompt[: self.kv_len]
        return np.concatenate([self.prompt, np.asarray(self.output_ids, dtype=np.int64)])[: self.kv_len]


class LocalEngine:
    """An in-process SGLang look-alike: ``generate`` takes token ids and returns SGLang's JSON.

    ``max_running_requests`` rows decode together; more requests wait in FIFO order.
    ``max_cached_sequences`` finished sequences keep their KV for prefix reuse (LRU; 0 disables
    prefix reuse; default ``max_running_requests``). ``context_length`` defaults to the model's
    ``max_position_embeddings``. ``seed`` seeds the sampling generator. ``enable_memory_saver`` is
    SGLang's server arg: without it ``release_memory_occupation`` succeeds and frees nothing, as
    SGLang's no-op memory saver does (agentrl's own colocated engines turn it on).
    ``adaptive_threads`` (CPU): the worker thread's torch threads follow
    :class:`~agentrl.cpu_share.CoreShare` (cores left free by other processes, re-checked
    every ~0.2 s of decoding, never below ``min_threads``), so it yields cores to a trainer that
    trains at the same time.
    ``enable_torch_compile`` / ``torch_compile_max_bs`` (SGLang's server args): decode steps of 2 to
    ``torch_compile_max_bs`` rows run through ``torch.compile`` (see :meth:`CachedForward.compile_decode`),
    compiled before the engine takes requests (1-3 minutes for SmolLM2 on CPU, which needs a C++ compiler;
    not with ``adaptive_threads``, whose thread changes would each compile again); worth it for long runs
    only: up to ~10% of a CPU decode step, ~4% of a decode end to end as measured (bench/README.md, P3).
    ``enable_lora`` and the ``lora_*`` / ``max_lora*`` arguments are SGLang's LoRA server args (see
    :mod:`agentrl.engines.local.lora`): adapters loaded from ``lora_paths`` at start or later with
    :meth:`load_lora_adapter`, chosen per request by ``lora_path``, several in one batch.
    """

    def __init__(
        self,
        checkpoint: str | Path,
        *,
        device: str = "cpu",
        dtype: str = "float32",
        max_running_requests: int = 32,
        max_cached_sequences: int | None = None,
        context_length: int | None = None,
        seed: int | None = None,
        chunked_prefill_size: int = 1024,
        enable_memory_saver: bool = False,
        adaptive_threads: bool = False,
        min_threads: int = 1,
        enable_torch_compile: bool = False,
        torch_compile_max_bs: int = 32,
        enable_lora: bool = False,
        lora_paths: list[str] | None = None,
        max_loras_per_batch: int = DEFAULT_MAX_LORAS_PER_BATCH,
        max_loaded_loras: int | None = None,
        max_lora_rank: int | None = None,
        lora_target_modules: list[str] | None = None,
    ):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        # refused before anything loads: a bad switch, or a compile this machine cannot do
        self.enable_torch_compile = _strict_bool("enable_torch_compile", enable_torch_compile)
        # SGLang: --lora-paths turns LoRA on by itself; each setting is refused before the model loads
        sources = parse_lora_paths(lora_paths or [])
        self.enable_lora = _strict_bool("enable_lora", enable_lora) or bool(sources)
        targets = parse_target_modules(lora_target_modules)
        check_limits(max_lora_rank, max_loras_per_batch, max_loaded_loras)
        if self.enable_lora and self.enable_torch_compile:
            raise LoraError(
                "--enable-lora with --enable-torch-compile: the compiled decode step has no adapters; "
                "drop one of the two"
            )
        if max_loaded_loras is not None and len(sources) > max_loaded_loras:
            raise LoraError(
                f"--lora-paths names {len(sources)} adapters, more than --max-loaded-loras {max_loaded_loras}"
            )
        initial = [(src, read_adapter_config(src.path, what=f"--lora-paths {src.name}")) for src in sources]
        bs = torch_compile_max_bs
        if isinstance(bs, bool) or not isinstance(bs, int) or not 1 <= bs <= 65536:
            raise ValueError(f"torch_compile_max_bs must be an integer in [1, 65536], got {bs!r}")
        self.torch_compile_max_bs = bs
        if self.enable_torch_compile:
            if min(bs, max_running_requests) < 2:
                raise ValueError(
                    "enable_torch_compile compiles decode batches of 2 or more rows: torch_compile_max_bs and "
                    f"max_running_requests must both be >= 2 (got {bs} and {max_running_requests})"
                )
            if adaptive_threads and torch.device(device).type == "cpu":
                raise ValueError(
                    "enable_torch_compile with adaptive_threads: a compiled graph is only valid for the thread "
                    "count it was compiled at, so every change would compile it again; use fixed threads"
                )
            if torch.device(device).type == "cpu":
                _check_cpp_compiler()

        def load() -> None:
            self.model_path = str(checkpoint)
            self.tokenizer = AutoTokenizer.from_pretrained(self.model_path, local_files_only=True)
            family = vision_for(self.model_path)  # a vision-language checkpoint: its processor and features
            if family is not None:
                self.model = load_vision_model(self.model_path, getattr(torch, dtype), device).eval()
                self.body = self.model.get_decoder()  # the text model the cached forward runs
            else:
                self.model = (
                    AutoModelForCausalLM.from_pretrained(
                        self.model_path, dtype=getattr(torch, dtype), local_files_only=True
                    )
                    .to(device)
                    .eval()
                )
                self.body = self.model.model
            self.model.requires_grad_(False)
            self.vision = EngineVision(family, self.model) if family is not None else None
            if self.enable_lora and family is not None:
                raise LoraError(
                    f"--enable-lora: {self.model_path} is a vision-language checkpoint; the embedded engine serves "
                    "adapters on text models only"
                )
            self.lora = (
                self._lora_adapters(initial, targets, max_lora_rank, max_loras_per_batch, max_loaded_loras)
                if self.enable_lora
                else None
            )
            self._lora_pending: set[str] = set()  # names being loaded (event-loop side)
            cfg = getattr(self.body, "config", None) or self.model.config
            ctx = context_length or getattr(cfg, "max_position_embeddings", None) or 4096
            windows = [w for w in (getattr(layer.self_attn, "sliding_window", None) for layer in self.body.layers) if w]
            if windows and min(windows) < ctx:
                log.warning("sliding-window attention: context_length clamped to the window %d", min(windows))
                ctx = min(windows)
            self.context_length = int(ctx)
            self.max_running_requests = max_running_requests
            self.chunked_prefill_size = chunked_prefill_size
            self.enable_memory_saver = bool(enable_memory_saver)
            self.runner = CachedForward(
                self.model, rows=max_running_requests, max_capacity=self.context_length, body=self.body
            )
            if self.enable_torch_compile:
                self._compile()
            self.vocab_size = self.model.get_input_embeddings().weight.shape[0]
            self.store = PrefixStore(max_running_requests if max_cached_sequences is None else max_cached_sequences)
            self.eos_token_ids = self._eos_ids()
            self.weight_version = "default"
            self._version_counter = 0
            self._generator = torch.Generator(device=device)
            self._generator.manual_seed(seed if seed is not None else int.from_bytes(uuid.uuid4().bytes[:6], "little"))

        # Loaded in a thread of its own that then ends: a thread that has run a parallel torch op on CPU keeps
        # OpenMP's worker threads for good, and with those and the engine worker's own ones outnumbering the cores,
        # libgomp stops spinning and every parallel region of the decode waits on a futex wake-up (~25% of SmolLM2's
        # decode throughput on 2 cores, bench/README.md P12). The model is the worker thread's alone from here on.
        _in_own_thread(load)
        # Shared with the worker thread, guarded by _cv.
        self._cv = threading.Condition()
        self._inbox: deque[_Request] = deque()
        self._aborts: list[str | None] = []  # rids; None = all
        self._control: list[tuple[str, Any]] = []
        self._kv_released = False  # release_memory_occupation dropped the KV buffers; admission waits
        self._stop = False
        self.last_error: BaseException | None = None  # the last fault an iteration survived
        self.restarts = 0  # iterations that failed outside any one request (see _run)
        self.consecutive_faults = 0  # such failures in a row: at MAX_CONSECUTIVE_FAULTS the engine reports unhealthy
        # Owned by the worker thread.
        self._unloads: list[tuple[Adapter, asyncio.Future]] = []  # unloads waiting for their adapter's requests
        self._policy: Adapter | None = None  # a run's policy adapter (serve_by_default): taken at admission
        self._waiting: deque[_Request] = deque()
        self._rows: list[_Request | None] = [None] * max_running_requests
        # set from the worker thread itself: torch's OpenMP thread count is per thread
        self._cores = (
            CoreShare(torch.get_num_threads(), min_threads=min_threads)
            if adaptive_threads and device == "cpu"
            else None
        )
        self._thread = threading.Thread(target=self._run, name="agentrl-local-engine", daemon=True)
        self._thread.start()

    def _lora_adapters(
        self,
        initial: list[tuple[Any, Any]],
        targets: frozenset[str] | None,
        max_rank: int | None,
        per_batch: int,
        max_loaded: int | None,
    ) -> LoraAdapters:
        """Wrap the target layers and load ``--lora-paths`` (before the worker starts). As SGLang: without
        ``--lora-target-modules`` the start adapters' modules are the targets (all when none is given), without
        ``--max-lora-rank`` the largest start rank bounds later loads (any rank up to 1024 when none is given)."""
        # each start adapter's config checked once here (a rank out of bounds is refused naming r, not a flag)
        confs = [
            (src, check_adapter_config(cfg, what=f"--lora-paths {src.name}", max_rank=None)) for src, cfg in initial
        ]
        if targets is None and confs:
            for src, conf in confs:
                if not conf.targets:
                    raise LoraError(
                        f"--lora-paths {src.name}: adapter_config.json lists no target_modules; pass --lora-target-modules"
                    )
            targets = parse_target_modules(sorted(set().union(*(conf.targets for _, conf in confs))))
        if max_rank is None and confs:
            max_rank = max(conf.rank for _, conf in confs)
        lora = LoraAdapters(
            self.model,
            list(self.body.layers),
            targets=targets if targets is not None else frozenset(SUPPORTED_TARGETS),
            max_rank=max_rank,
            max_loras_per_batch=per_batch,
            max_loaded_loras=max_loaded,
            model_config=self.model.config,
        )
        for src, cfg in initial:
            adapter, modules = lora.prepare(src.name, cfg, src.path, what=f"--lora-paths {src.name}", pinned=src.pinned)
            adapter.uid = lora.new_uid()
            lora.install(adapter, modules)
            lora.by_name[adapter.name] = adapter
        return lora

    def _compile(self) -> None:
        """Compile the decode step now, before any request (see the class docstring)."""
        t0 = time.monotonic()
        log.info("compiling the decode step (torch.compile, batches of 2 to %d rows) ...", self.torch_compile_max_bs)
        self.runner.compile_decode(self.torch_compile_max_bs)
        log.info("decode step compiled in %.1f s", time.monotonic() - t0)

    def _eos_ids(self) -> set[int]:
        """EOS ids from the config, the generation config (an int or a list) and the tokenizer."""
        ids: set[int] = set()
        for src in (self.model.config, getattr(self.model, "generation_config", None), self.tokenizer):
            eos = getattr(src, "eos_token_id", None)
            ids.update([eos] if isinstance(eos, int) else (eos or []))
        return ids

    # ---------------------------------------------------------------- public API (event-loop side)

    @property
    def alive(self) -> bool:
        """Whether ``/health`` answers 200: the worker runs, and its iterations have not failed
        :data:`MAX_CONSECUTIVE_FAULTS` times in a row (a sticky fault, e.g. a broken device, fails every
        request: a supervisor should restart the server rather than see it healthy)."""
        return self._thread.is_alive() and not self._stop and self.consecutive_faults < MAX_CONSECUTIVE_FAULTS

    @property
    def num_running(self) -> int:
        return sum(r is not None for r in self._rows)

    @property
    def num_waiting(self) -> int:
        """Requests queued for a row (read from any thread: a snapshot)."""
        return len(self._inbox) + len(self._waiting)

    @property
    def num_used_tokens(self) -> int:
        """KV positions held by running requests."""
        return sum(r.kv_len for r in list(self._rows) if r is not None)

    def memory_report(self) -> dict[str, float | int]:
        """SGLang's ``/v1/loads`` memory section: weights and KV buffers in GB, token capacity."""
        weights = sum(p.numel() * p.element_size() for p in self.model.parameters())
        weights += self.lora.nbytes() if self.lora is not None else 0  # the adapters' stacks are weights too
        cache = self.runner.cache
        kv = sum(b.nbytes for b in cache.k + cache.v)
        return {
            "weight_gb": weights / 1e9,
            "kv_cache_gb": kv / 1e9,
            "graph_gb": 0.0,
            "token_capacity": self.max_running_requests * self.context_length,
        }

    async def check_request(self, input_ids: Any, sampling_params: dict | None = None, **options: Any) -> None:
        """Raise :class:`InvalidRequestError` where :meth:`generate` would, without running anything
        (a streaming response must refuse a bad request before its 200 goes out; its pictures are decoded
        in a worker thread)."""
        prepared = await self._prepare_images(input_ids, options.get("image_data"))
        self._new_request(
            input_ids,
            sampling_params,
            options.get("rid"),
            bool(options.get("return_logprob")),
            bool(options.get("return_text_in_logprobs")),
            options.get("logprob_start_len", -1),
            options.get("top_logprobs_num", 0),
            options.get("image_data"),
            prepared,
            lora_path=options.get("lora_path"),
        ).future.cancel()

    async def generate(
        self,
        input_ids: list[int],
        sampling_params: dict | None = None,
        *,
        rid: str | None = None,
        return_logprob: bool = False,
        return_text_in_logprobs: bool = False,
        logprob_start_len: int = -1,
        top_logprobs_num: int = 0,
        image_data: Any = None,
        lora_path: str | None = None,
    ) -> dict:
        """Continue ``input_ids``; return SGLang's ``/generate`` response dict.

        ``image_data`` (a vision-language model): one image per placeholder span of ``input_ids``, in
        order, as data:/file:// URLs or base64 (see :mod:`agentrl.engines.local.image_data`).

        With ``return_logprob``: ``output_token_logprobs``; ``top_logprobs_num > 0`` adds
        ``output_top_logprobs``; ``input_token_logprobs`` (and ``input_top_logprobs``) cover the prompt
        from ``logprob_start_len`` on (-1, the default: the last prompt token only, as SGLang); the first
        entry's log-prob is None, as SGLang's; from a position before the last one they cost one extra
        forward of the prompt; with
        ``max_new_tokens: 0`` that is all the request does (slime's teacher scoring).
        ``lora_path``: the name of a loaded LoRA adapter to run under (SGLang's field; None: the base model).
        Raises :class:`InvalidRequestError` for requests SGLang would answer with HTTP 400.
        Cancelling the awaiting task aborts the request.
        """
        req = self._new_request(
            input_ids,
            sampling_params,
            rid,
            return_logprob,
            return_text_in_logprobs,
            logprob_start_len,
            top_logprobs_num,
            image_data,
            await self._prepare_images(input_ids, image_data),
            lora_path=lora_path,
        )
        if req.finish is not None:
            return self._response(req)
        self._submit(req)
        try:
            return await asyncio.shield(req.future)
        except asyncio.CancelledError:
            self.abort(req.rid)
            raise

    async def generate_stream(
        self,
        input_ids: list[int],
        sampling_params: dict | None = None,
        *,
        rid: str | None = None,
        return_logprob: bool = False,
        return_text_in_logprobs: bool = False,
        logprob_start_len: int = -1,
        top_logprobs_num: int = 0,
        image_data: Any = None,
        lora_path: str | None = None,
    ) -> AsyncIterator[dict]:
        """:meth:`generate`, yielding SGLang's cumulative response (text and ids so far, ``finish_reason``
        None) every ``stream_interval`` tokens as they are sampled, then the final response.

        Closing the iterator early (the client went away) aborts the request.
        """
        req = self._new_request(
            input_ids,
            sampling_params,
            rid,
            return_logprob,
            return_text_in_logprobs,
            logprob_start_len,
            top_logprobs_num,
            image_data,
            await self._prepare_images(input_ids, image_data),
            lora_path=lora_path,
        )
        if req.finish is not None:
            yield self._response(req)
            return
        req.stream = asyncio.Queue()
        self._submit(req)
        getter: asyncio.Future | None = None
        try:
            while True:
                getter = asyncio.ensure_future(req.stream.get())
                done, _ = await asyncio.wait({getter, req.future}, return_when=asyncio.FIRST_COMPLETED)
                if getter in done:
                    yield getter.result()
                    continue
                getter.cancel()
                while not req.stream.empty():  # chunks sent before the end, in order
                    yield req.stream.get_nowait()
                yield req.future.result()
                return
        finally:
            if getter is not None and not getter.done():
                getter.cancel()
            if not req.future.done():
                self.abort(req.rid)

    def _new_request(
        self,
        input_ids: Any,
        sampling_params: dict | None,
        rid: str | None,
        return_logprob: bool,
        return_text_in_logprobs: bool,
        logprob_start_len: int,
        top_logprobs_num: int,
        image_data: Any = None,
        prepared: tuple[np.ndarray, RequestImages | None] | None = None,
        *,
        lora_path: Any = None,
    ) -> _Request:
        if self._stop or not self._thread.is_alive():
            raise RuntimeError("the embedded engine is closed")
        ids = self._check_input_ids(input_ids)
        adapter = self.lora_adapter(lora_path)
        key, images = prepared if prepared is not None else (None, None)
        if prepared is not None:
            pass  # decoded and checked by _prepare_images (in a worker thread)
        elif self.vision is not None:
            key, images = self.vision.prepare(ids, image_data)
        elif image_data not in (None, []):
            raise InvalidRequestError("image_data: the served model is text-only (not a vision-language checkpoint)")
        sp = SamplingConfig.from_dict(sampling_params or {})
        bad = [k for k in sp.logit_bias or {} if int(k) >= self.vocab_size]
        if bad:
            raise InvalidRequestError(
                f"sampling_params.logit_bias: token id {bad[0]} is outside the vocabulary (0..{self.vocab_size - 1})"
            )
        if not isinstance(logprob_start_len, int) or not -1 <= logprob_start_len < len(ids):
            raise InvalidRequestError(
                f"logprob_start_len must be -1 or a prompt position 0..{len(ids) - 1}, got {logprob_start_len!r}"
            )
        top_max = min(MAX_TOP_LOGPROBS, self.vocab_size)
        if (
            not isinstance(top_logprobs_num, int)
            or isinstance(top_logprobs_num, bool)
            or not 0 <= top_logprobs_num <= top_max
        ):
            raise InvalidRequestError(f"top_logprobs_num must lie in 0..{top_max}, got {top_logprobs_num!r}")
        if sp.return_top_p_token_ids and not sp.filtered and not sp.greedy:
            raise InvalidRequestError(
                "custom_params.return_top_p_token_ids needs top_p < 1 (or top_k / min_p): without a filter every "
                "token's set is the whole vocabulary"
            )
        sp.max_new_tokens = min(sp.max_new_tokens, self.context_length - len(ids))
        loop = asyncio.get_running_loop()
        req = _Request(
            rid or uuid.uuid4().hex, ids, sp, (return_logprob, return_text_in_logprobs), loop.create_future(), loop
        )
        if key is not None:
            req.prompt, req.images = key, images
        req.lora = adapter
        req.takes_policy = adapter is None and self.lora is not None
        if return_logprob:
            req.logprob_start_len = logprob_start_len if logprob_start_len >= 0 else len(ids) - 1
            req.top_logprobs_num = top_logprobs_num
            if req.logprob_start_len == len(ids) - 1:
                self._score_prompt(req)  # the last prompt token only: no forward needed
        if sp.sampling_seed is not None:
            req.generator = torch.Generator(device=self._generator.device)
            req.generator.manual_seed(sp.sampling_seed)
        if sp.max_new_tokens == 0 and (not return_logprob or req.input_meta):
            req.finish = {"type": "length", "length": 0}  # nothing to compute: answered without the worker
        return req

    async def _prepare_images(self, input_ids: Any, image_data: Any) -> tuple[np.ndarray, RequestImages | None] | None:
        """:meth:`EngineVision.prepare` in a worker thread (decoding pictures must not stall the event loop);
        None when there are none to decode (``_new_request`` then checks the request as usual)."""
        if self.vision is None or image_data in (None, []):
            return None
        ids = self._check_input_ids(input_ids)
        return await asyncio.to_thread(self.vision.prepare, ids, image_data)

    def _submit(self, req: _Request) -> None:
        with self._cv:
            self._inbox.append(req)
            self._cv.notify()

    def check_prompt_length(self, tokens: int, *, at_least: bool = False) -> None:
        """Raise :class:`InvalidRequestError` (SGLang's message) when a prompt of ``tokens`` tokens leaves no room
        in the context; ``at_least``: ``tokens`` is a lower bound (a text refused before it is tokenized)."""
        if tokens >= self.context_length:
            count = f"at least {tokens}" if at_least else str(tokens)
            raise InvalidRequestError(
                f"The input ({count} tokens) is longer than the model's context length ({self.context_length} tokens)."
            )

    def _check_input_ids(self, input_ids: Any) -> list[int]:
        if not isinstance(input_ids, (list, tuple)) or not input_ids:
            raise InvalidRequestError("input_ids must be a non-empty list of token ids")
        self.check_prompt_length(len(input_ids))  # first: a long list is refused before any per-token work
        # per-token checks at C speed (map, set, min, max): a batch's prompts are checked on the event loop
        if not all(issubclass(k, (int, np.integer)) and not issubclass(k, bool) for k in set(map(type, input_ids))):
            raise InvalidRequestError("input_ids must hold integers")
        if min(input_ids) < 0 or max(input_ids) >= self.vocab_size:
            raise InvalidRequestError(f"input_ids must lie in 0..{self.vocab_size - 1}")
        return list(map(int, input_ids))  # a copy: the caller may go on changing its list

    def abort(self, rid: str | None = None, abort_all: bool = False) -> None:
        """End request ``rid`` (or every request) with finish reason ``abort``; partial output is returned."""
        with self._cv:
            self._aborts.append(None if abort_all else rid)
            self._cv.notify()

    def flush_cache(self) -> bool:
        """Drop every cached prefix (takes effect before the next admission)."""
        return self._enqueue("flush", None)

    def _enqueue(self, kind: str, arg: Any) -> bool:
        """Queue a control item for the worker; False (nothing queued) when the engine is closed, whose worker would
        never answer it."""
        with self._cv:
            if self._stop or not self._thread.is_alive():
                return False
            self._control.append((kind, arg))
            self._cv.notify()
        return True

    async def load_lora_adapter(
        self,
        lora_name: str,
        lora_path: str | None = None,
        *,
        tensors: dict[str, torch.Tensor] | None = None,
        config: dict | None = None,
        pinned: bool = False,
        replace: bool = False,
        weight_version: str | None = None,
        serve_by_default: bool = False,
    ) -> dict:
        """SGLang's ``/load_lora_adapter``: a PEFT adapter folder (``lora_path``), or its ``tensors`` (PEFT's names)
        and ``config`` (its ``adapter_config.json`` as a dict), served as ``lora_name`` from the next batch on.

        The files are read and checked in a worker thread (every tensor against this model's layers before its
        memory is allocated); the slot is filled between two forwards, so running requests are not held. A name
        already loaded is refused (unload it first, as SGLang). ``pinned`` is SGLang's and is reported back; every
        loaded adapter stays resident here (nothing is evicted), so it changes nothing. Returns SGLang's ``{"success", "error_message",
        "loaded_adapters"}``; a refusal changes nothing.

        For a training run's own engines (not SGLang's API): ``replace`` swaps a loaded adapter of that name for this
        one (requests already running finish on the old one, whose slot is freed after them; new ones get this one);
        ``weight_version`` is what responses under it report as ``meta_info.weight_version`` (the policy's version,
        as a base-weight update reports its own); ``serve_by_default`` makes it the adapter of every request that
        names none (the run's rollouts sample the policy without naming it)."""
        if self.lora is None:
            return self._lora_result(False, "this engine was started without --enable-lora (or --lora-paths)")
        what = f"lora adapter {lora_name!r}"
        if not isinstance(pinned, bool):
            return self._lora_result(False, f"pinned must be true or false, got {pinned!r}")
        if lora_name in self._lora_pending or (lora_name in self.lora.by_name and not replace):
            return self._lora_result(False, f"an adapter named {lora_name!r} is already loaded: unload it first")
        if (lora_path is None) == (tensors is None):
            return self._lora_result(False, "give exactly one of lora_path and tensors")
        self._lora_pending.add(lora_name)
        fut: asyncio.Future | None = None
        try:
            lora = self.lora

            def prepare() -> tuple[Adapter, dict]:
                cfg = read_adapter_config(lora_path, what=what) if lora_path is not None else config
                return lora.prepare(
                    lora_name, cfg, lora_path if lora_path is not None else tensors, what=what, pinned=pinned
                )  # type: ignore[arg-type]

            try:
                adapter, modules = await asyncio.to_thread(prepare)
            except LoraError as exc:
                return self._lora_result(False, str(exc))
            adapter.uid = lora.new_uid()
            adapter.version = None if weight_version is None else str(weight_version)
            fut = asyncio.get_running_loop().create_future()

            def installed(f: asyncio.Future) -> None:  # also when the caller went away meanwhile: no slot is lost
                self._lora_pending.discard(lora_name)
                if f.cancelled() or not f.result().get("success"):
                    return
                old = lora.by_name.get(lora_name)
                lora.by_name[lora_name] = adapter
                if old is not None:  # replaced: freed once its running requests end
                    self._enqueue("lora_unload", (old, asyncio.get_running_loop().create_future()))

            fut.add_done_callback(installed)
            if not self._enqueue("lora_load", (adapter, modules, serve_by_default, fut)):
                fut.cancel()
                return self._lora_result(False, "engine closed")
            out = await asyncio.shield(fut)
            return self._lora_result(bool(out.get("success")), out.get("message", ""))
        finally:
            if fut is None:
                self._lora_pending.discard(lora_name)

    async def unload_lora_adapter(self, lora_name: str) -> dict:
        """SGLang's ``/unload_lora_adapter``: new requests naming ``lora_name`` are refused at once; its slot is
        freed (and its cached prefixes dropped) when the requests already using it have ended."""
        if self.lora is None:
            return self._lora_result(False, "this engine was started without --enable-lora (or --lora-paths)")
        adapter = self.lora.by_name.pop(lora_name, None) if isinstance(lora_name, str) else None
        if adapter is None:
            return self._lora_result(False, f"no adapter named {lora_name!r} is loaded")
        fut = asyncio.get_running_loop().create_future()
        if not self._enqueue("lora_unload", (adapter, fut)):
            return self._lora_result(False, "engine closed")
        out = await asyncio.shield(fut)
        return self._lora_result(bool(out.get("success")), out.get("message", ""))

    def _lora_result(self, success: bool, message: str) -> dict:
        loaded = self.lora.listing() if self.lora is not None else {}
        return {"success": success, "error_message": "" if success else message, "loaded_adapters": loaded}

    def lora_adapter(self, lora_path: Any, what: str = "lora_path") -> Adapter | None:
        """The loaded adapter a request names (``lora_path``: SGLang's field holds the adapter's name), or None;
        raises :class:`InvalidRequestError` naming ``what`` for an adapter this engine does not hold."""
        if lora_path is None:
            return None
        if self.lora is None:
            raise InvalidRequestError(f"{what}: this engine was started without --enable-lora")
        adapter = self.lora.by_name.get(lora_path) if isinstance(lora_path, str) else None
        if adapter is None:
            try:  # may run in a worker thread (a large OpenAI body) while the event loop loads or unloads one
                loaded = sorted(self.lora.by_name)
            except RuntimeError:
                loaded = ["..."]
            raise InvalidRequestError(
                f"{what}: no adapter named {str(lora_path)[:200]!r} is loaded (loaded: {loaded}); load it with "
                "/load_lora_adapter"
            )
        return adapter

    async def update_weights_from_disk(
        self, model_path: str, weight_version: str | None = None, *, abort_all_requests: bool = False
    ) -> dict:
        """Load a HF checkpoint folder's safetensors into the running model, in place.

        Running requests finish first (or are aborted with ``abort_all_requests``); new requests
        wait. On failure the model is unchanged and ``success`` is False.
        """
        fut = asyncio.get_running_loop().create_future()
        if abort_all_requests:
            self.abort(abort_all=True)
        if not self._enqueue("update", (model_path, weight_version, fut, {})):
            return {"success": False, "message": "engine closed", "num_paused_requests": 0}
        return await fut

    def update_weight_version(self, new_version: str, *, abort_all_requests: bool = False) -> dict:
        """SGLang's ``/update_weight_version``: responses report ``new_version`` from now on, the weights unchanged.

        What a trainer calls after loading its policy's adapter by name (``/load_lora_adapter``), which changes no
        version itself; responses of an adapter pushed with a version of its own report that one instead.
        """
        if abort_all_requests:
            self.abort(abort_all=True)
        self.weight_version = str(new_version)
        return {
            "success": True,
            "message": f"Weight version updated to {self.weight_version}",
            "new_version": self.weight_version,
        }

    async def update_weights_from_tensors(
        self,
        named_tensors: dict[str, Any],
        weight_version: str | None = None,
        *,
        abort_all_requests: bool = False,
        partial: bool = False,
        assign: bool = False,
        finite_checked: bool = False,
    ) -> dict:
        """Copy in-memory weights (HF names -> tensors or numpy arrays) into the running model.

        The same in-place, between-batches update as :meth:`update_weights_from_disk`, without the
        disk round trip: the train loop hands the trainer's full weights over Ray's object store.
        ``partial=True`` loads whatever names arrive (one bucket of a broadcast update, as SGLang's
        ``load_weights`` does) instead of requiring every parameter; a ``weight_version`` of None then
        keeps the current version. Unknown names or wrong shapes still fail the whole update.
        ``assign=True`` makes the model's parameters *be* the given tensors (no copy) where dtype and
        device match: the shared-memory weight sync hands over views of a buffer the trainer writes,
        and the caller promises not to write that buffer again while the engine uses it.
        ``finite_checked=True``: the caller already proved every value finite (the shared-memory
        writer checks each chunk as it writes it), so the engine does not read every page again.
        """
        fut = asyncio.get_running_loop().create_future()
        if abort_all_requests:
            self.abort(abort_all=True)
        opts = {"partial": partial, "assign": assign, "finite_checked": finite_checked}
        if not self._enqueue("update", (dict(named_tensors), weight_version, fut, opts)):
            return {"success": False, "message": "engine closed", "num_paused_requests": 0}
        return await fut

    async def release_memory_occupation(self, tags: list[str] | None = None) -> dict:
        """SGLang's colocation hook: free memory for the trainer until :meth:`resume_memory_occupation`.

        What the embedded engine frees for tag ``kv_cache`` (the default, with all tags): every
        cached prefix and the KV buffers of all rows (shrunk to one position). ``weights`` and
        ``cuda_graph`` free nothing here: the weights stay resident (there is no paging allocator
        to park them in) and there are no CUDA graphs. It waits for running requests to finish;
        requests that arrive while released wait for the resume. Returns ``freed_bytes``.
        """
        return await self._memory_control("release", tags)

    async def resume_memory_occupation(self, tags: list[str] | None = None) -> dict:
        """Reallocate what :meth:`release_memory_occupation` freed (empty) and admit requests again."""
        return await self._memory_control("resume", tags)

    async def _memory_control(self, kind: str, tags: list[str] | None) -> dict:
        if tags is not None and (not isinstance(tags, list) or not set(tags) <= set(MEMORY_TAGS)):
            raise InvalidRequestError(f"tags must be a list drawn from {list(MEMORY_TAGS)}, got {tags!r}")
        fut = asyncio.get_running_loop().create_future()
        if not self._enqueue(kind, (tags, fut)):
            return {"success": False, "message": "engine closed"}
        return await fut

    async def close(self, timeout: float | None = None) -> None:
        """Stop the worker thread; requests still pending are aborted.

        ``timeout``: wait at most this many seconds for the worker to finish what it is doing (a
        stopping server must not wait out a long weight load); it is a daemon thread, so one still
        busy does not keep the process alive.
        """
        with self._cv:
            self._stop = True
            self._cv.notify()
        await asyncio.get_running_loop().run_in_executor(None, self._thread.join, timeout)

    # ---------------------------------------------------------------- worker thread

    def _run(self) -> None:
        """The worker thread: iterations until :meth:`close`, surviving any fault (its own supervisor).

        A fault a stage can pin on requests fails only those (:meth:`_sample_and_step`,
        :meth:`_finish_checks`, :meth:`_apply_control`); anything else raised by an iteration, a
        ``BaseException`` included, fails the requests holding rows (their KV may be half
        written), is logged and counted in ``restarts``, and the loop goes on: waiting requests, the
        HTTP server and ``/health`` are unaffected.
        """
        while True:
            try:
                with torch.inference_mode():
                    while self._iteration():
                        self.consecutive_faults = 0
                break
            except BaseException as exc:  # noqa: BLE001 - nothing may end the loop but close()
                log.exception("embedded engine iteration failed; failing its running requests and going on")
                self.last_error = exc
                self.restarts += 1
                self.consecutive_faults += 1
                for req in [r for r in self._rows if r is not None]:
                    self._fail(req, exc)
        for req in itertools.chain(self._waiting, self._inbox, (r for r in self._rows if r)):
            req.finish = {"type": "abort", "message": "engine closed"}
            self._resolve(req)
        for _, fut in self._unloads:
            _call_soon(fut.get_loop(), _set_result, fut, {"success": False, "message": "engine closed"})
        for kind, arg in self._control:
            if kind != "flush":
                fut = arg[2] if kind == "update" else arg[-1]
                _call_soon(
                    fut.get_loop(),
                    _set_result,
                    fut,
                    {"success": False, "message": "engine closed", "num_paused_requests": 0},
                )

    def _fail(self, req: _Request, exc: BaseException) -> None:
        """Answer ``req`` with :class:`EngineFault` and free its row (its KV is not kept)."""
        if req.row >= 0 and self._rows[req.row] is req:
            self._rows[req.row] = None
        req.row = -1
        with contextlib.suppress(ValueError):
            self._waiting.remove(req)
        err = EngineFault(f"the engine failed while serving request {req.rid}: {exc!r}")
        _call_soon(req.loop, _set_exception, req.future, err)

    def _iteration(self) -> bool:
        with self._cv:
            while not (
                self._stop
                or self._inbox
                or self._aborts
                or self._control
                or self.num_running
                or (self._waiting and not self._admission_paused())
            ):
                idle_since = time.monotonic()
                self._cv.wait()
                if self._cores is not None and time.monotonic() - idle_since > 1.0:
                    # a long idle spell (a synchronous run's train step): what others did then says
                    # nothing of the decode to come; short gaps between turns stay in the window
                    self._cores.restart()
            if self._stop:
                return False
            self._waiting.extend(self._inbox)
            self._inbox.clear()
            aborts, self._aborts = self._aborts, []
        for rid in aborts:
            self._apply_abort(rid)
        self._apply_control()
        if not self._admission_paused():
            self._admit()
        if self.num_running:
            if self._cores is not None:
                self._cores.apply()
            self._decode_step()
        self._finish_unloads()
        return True

    def _admission_paused(self) -> bool:
        """New requests wait while a weight update or memory release is pending, or memory is released."""
        return self._kv_released or any(kind in ("update", "release") for kind, _ in self._control)

    def _apply_abort(self, rid: str | None) -> None:
        msg = {"type": "abort", "message": "Abort requested."}
        for req in [r for r in self._waiting if rid is None or r.rid == rid]:
            self._waiting.remove(req)
            req.finish = dict(msg)
            self._resolve(req)
        for req in [r for r in self._rows if r is not None and (rid is None or r.rid == rid)]:
            req.finish = dict(msg)
            self._retire(req)

    def _apply_control(self) -> None:
        with self._cv:
            todo = list(self._control)
        for item in todo:
            kind, arg = item
            try:
                done = self._control_item(kind, arg)
            except BaseException as exc:  # noqa: BLE001 - a failed control fails its caller, not the loop
                log.exception("embedded engine: %s failed", kind)
                self.last_error = exc
                if kind != "flush":
                    fut = arg[2] if kind == "update" else arg[-1]
                    _call_soon(
                        fut.get_loop(),
                        _set_result,
                        fut,
                        {"success": False, "message": f"{kind} failed: {exc!r}", "num_paused_requests": 0},
                    )
                done = True
            if done:
                with self._cv:
                    self._control.remove(item)

    def _control_item(self, kind: str, arg: Any) -> bool:
        """Apply one control item if it can run now; whether it is done."""
        if kind == "flush":
            self.store.clear()
        elif kind == "update" and self.num_running == 0:
            path, version, fut, opts = arg
            result = self._load_weights(path, version, **opts)
            _call_soon(fut.get_loop(), _set_result, fut, result)
        elif kind == "lora_load":
            adapter, modules, by_default, fut = arg
            assert self.lora is not None
            try:
                self.lora.install(adapter, modules)
                result = {"success": True, "message": ""}
                if by_default:  # the run's policy from now on: requests admitted from here take it
                    self._policy = adapter
                    if adapter.version is not None:
                        self.weight_version = adapter.version
            except LoraError as exc:
                result = {"success": False, "message": str(exc)}
            _call_soon(fut.get_loop(), _set_result, fut, result)
        elif kind == "lora_unload":  # done once no request holds it: checked after every iteration
            if self._policy is arg[0]:  # the policy unloaded by hand: requests naming none run on the base again
                self._policy = None
            self._unloads.append(arg)
            self._finish_unloads()
        elif kind in ("release", "resume") and self.num_running == 0:
            tags, fut = arg
            result = self._release_memory(tags) if kind == "release" else self._resume_memory(tags)
            _call_soon(fut.get_loop(), _set_result, fut, result)
        else:
            return False
        return True

    def _finish_unloads(self) -> None:
        """Free the slots of unloaded adapters that no request holds any more (the worker thread). Kept out of the
        control list, so a held unload never keeps the worker awake: a request ending is an iteration, which checks."""
        if not self._unloads:
            return
        assert self.lora is not None
        with self._cv:  # requests not yet taken from the inbox hold it too
            holders = {id(r.lora) for r in itertools.chain(self._inbox, self._waiting, self._rows) if r and r.lora}
        for item in [u for u in self._unloads if id(u[0]) not in holders]:
            adapter, fut = item
            self._unloads.remove(item)
            self.lora.remove(adapter)
            self.store.drop(adapter.uid)
            _call_soon(fut.get_loop(), _set_result, fut, {"success": True, "message": ""})

    def _load_weights(
        self,
        source: str | dict,
        version: str | None,
        *,
        partial: bool = False,
        assign: bool = False,
        finite_checked: bool = False,
    ) -> dict:
        try:
            loaded, what = read_source(source, shapes=model_shapes(self.model))
            apply_weights(self.model, loaded, what, partial=partial, assign=assign, finite_checked=finite_checked)
        except WeightUpdateError as exc:
            return {"success": False, "message": str(exc), "num_paused_requests": 0}
        self.store.clear()
        if self.vision is not None:
            self.vision.clear()
        self._version_counter += 1
        if version is not None or not partial:
            self.weight_version = version if version is not None else str(self._version_counter)
        return {"success": True, "message": "Succeeded to update model weights.", "num_paused_requests": 0}

    def _kv_cache_like(self, initial_capacity: int) -> SlotKVCache:
        old = self.runner.cache
        rows, kv_heads, _, head_dim = old.k[0].shape
        return SlotKVCache(
            len(old.k),
            rows,
            kv_heads,
            head_dim,
            max_capacity=old.max_capacity,
            dtype=old.k[0].dtype,
            device=old.k[0].device,
            initial_capacity=initial_capacity,
        )

    def _release_memory(self, tags: list[str] | None) -> dict:
        if not self.enable_memory_saver:
            return {"success": True, "freed_bytes": 0, "message": "memory saver disabled: nothing released"}
        if "kv_cache" not in (tags or MEMORY_TAGS) or self._kv_released:
            return {"success": True, "freed_bytes": 0, "message": "nothing to release"}
        cache = self.runner.cache
        freed = sum(b.nbytes for b in cache.k + cache.v)
        freed += sum(e.k.nbytes + e.v.nbytes for e in self.store._entries.values())
        n = len(self.store)
        self.store.clear()
        self.runner.cache = self._kv_cache_like(initial_capacity=1)
        self._kv_released = True
        log.info("released %d cached prefixes and the KV buffers (%.1f MiB)", n, freed / 2**20)
        return {
            "success": True,
            "freed_bytes": freed,
            "message": f"released {n} cached prefixes and the KV buffers; weights stay resident",
        }

    def _resume_memory(self, tags: list[str] | None) -> dict:
        if "kv_cache" in (tags or MEMORY_TAGS) and self._kv_released:
            self.runner.cache = self._kv_cache_like(initial_capacity=256)
            self._kv_released = False
        return {"success": True, "message": "resumed"}

    # ---------------------------------------------------------------- admission and prefill

    def _admit(self) -> None:
        free = [i for i, r in enumerate(self._rows) if r is None]
        new: list[_Request] = []
        # SGLang's --max-loras-per-batch: the running rows use at most that many adapters (no adapter counts as one);
        # a request whose adapter would be one more waits, in order, while later ones that fit go ahead
        slots = {r.slot for r in self._rows if r is not None}
        limit = self.lora.max_loras_per_batch if self.lora is not None else None
        held: list[_Request] = []
        while self._waiting and len(new) < len(free):
            req = self._waiting.popleft()
            if req.takes_policy:  # the policy of the moment it starts: queued requests never run on a replaced one
                req.lora = self._policy
            if limit is not None and req.slot not in slots and len(slots) >= limit:
                held.append(req)
                continue
            if req.images is not None and req.images.features is None:
                try:  # the vision tower, now (past the prefix it will reuse): a picture it cannot take fails it only
                    self.vision.compute(req.images, self._best_prefix(req)[1])  # type: ignore[union-attr]
                except BaseException as exc:  # noqa: BLE001
                    self._fail(req, exc)
                    continue
            if req.return_logprob and not req.input_meta:
                try:
                    self._score_prompt(req)
                except BaseException as exc:  # noqa: BLE001 - fails this request only
                    self._fail(req, exc)
                    continue
                if req.sp.max_new_tokens == 0:  # scoring only: no row, no decode
                    req.finish = {"type": "length", "length": 0}
                    self._resolve(req)
                    continue
            req.row = free[len(new)]
            self._rows[req.row] = req
            slots.add(req.slot)
            new.append(req)
        # held back for --max-loras-per-batch (as SGLang: under steady load of other adapters one may wait long)
        self._waiting.extendleft(reversed(held))
        if self.store.max_sequences <= 0:
            self._prefill([(r, 0, None) for r in new])
            return
        # Siblings sharing a long prefix (a GRPO group) wait one round to reuse the first one's KV.
        while new:
            batch, later = [], []
            for req in new:
                src, n = self._best_prefix(req)
                if any(b.tag == req.tag and common_prefix_len(req.prompt, b.prompt) > n + 8 for b, _, _ in batch):
                    later.append(req)
                else:
                    batch.append((req, n, src))
            self._prefill(batch)
            new = later

    def _best_prefix(self, req: _Request) -> tuple[CachedSequence | _Request | None, int]:
        """The cached sequence or running request sharing the longest prompt prefix with ``req``."""
        src, n = self.store.best_match(req.prompt, req.tag)
        for other in self._rows:
            if other is not None and other is not req and other.tag == req.tag and other.kv_len > n:
                m = common_prefix_len(other.tokens(), req.prompt)
                if m > n:
                    src, n = other, m
        return src, min(n, len(req.prompt) - 1)  # always recompute the last prompt token

    def _score_prompt(self, r: _Request) -> None:
        """``input_token_logprobs`` (and ``input_top_logprobs``) of the prompt from ``logprob_start_len``.

        One plain forward of the whole prompt through the checkpoint's own modules (the KV rows are not
        touched), then the LM head in chunks of 256 positions so a long prompt never materializes
        ``[L, vocab]`` logits at once. Same definition as the output log-probs: ``log_softmax(logits /
        T)`` (greedy: ``T = 1``), without ``logit_bias`` (which acts on sampling only).
        """
        start, L = r.logprob_start_len, len(r.input_ids)
        dev = self.runner.device
        text = r.return_text_in_logprobs
        # SGLang's layout: one entry per prompt position from ``start``; the first one's log-prob is None
        lps: list[list] = [[None, r.input_ids[start], self._token_text(r.input_ids[start], text)]]
        tops: list[Any] = [None]
        if start + 1 < L:
            ids = torch.tensor([r.input_ids], device=dev)
            if self.lora is not None:
                self.lora.select([r.slot])
            if r.images is None:
                hidden = self.body(input_ids=ids, use_cache=False).last_hidden_state[0]
            else:
                embeds = self.body.embed_tokens(ids)
                at, feats = self.vision.rows(r.images, 0, L)  # type: ignore[union-attr,misc]
                embeds[0, torch.from_numpy(at)] = feats.to(embeds.dtype)
                hidden = self.body(inputs_embeds=embeds, use_cache=False).last_hidden_state[0]
            temp = 1.0 if r.sp.greedy else float(r.sp.temperature)
            for c in range(start + 1, L, 256):
                end = min(c + 256, L)
                logp = torch.log_softmax(self.model.lm_head(hidden[c - 1 : end - 1]).float() / temp, dim=-1)
                targets = r.input_ids[c:end]
                chosen = logp.gather(1, torch.tensor(targets, device=dev)[:, None])[:, 0].tolist()
                lps += [[lp, t, self._token_text(t, text)] for lp, t in zip(chosen, targets)]
                if r.top_logprobs_num:
                    tops += [self._top_entries(row, r.top_logprobs_num, text) for row in logp]
        r.input_meta = {"input_token_logprobs": lps}
        if r.top_logprobs_num:
            r.input_meta["input_top_logprobs"] = tops

    def _token_text(self, tok: int, want: bool) -> str | None:
        return self.tokenizer.decode([tok]) if want else None

    def _top_entries(self, logp: torch.Tensor, k: int, text: bool) -> list[list]:
        vals, idx = logp.topk(k)
        return [[v, i, self._token_text(i, text)] for v, i in zip(vals.tolist(), idx.tolist())]

    def _prefill(self, batch: list[tuple[_Request, int, Any]]) -> None:
        for req, n, src in batch:
            if isinstance(src, _Request):
                self.runner.cache.ensure(n)
                self.runner.cache.copy_row(src.row, req.row, n)
            elif src is not None:
                self.runner.cache.load(req.row, src.k, src.v, n)
            req.kv_len = req.cached_tokens = n if src is not None else 0
        pending = sorted((r for r, _, _ in batch), key=lambda r: len(r.prompt) - r.kv_len)
        while pending:
            # Group similar remaining lengths so right-padding wastes little; cap tokens per forward.
            group: list[_Request] = []
            for req in pending:
                t = min(len(req.prompt) - req.kv_len, self.chunked_prefill_size)
                if group and (len(group) + 1) * t > self.chunked_prefill_size * 2:
                    break
                group.append(req)
            pending = pending[len(group) :]
            self._prefill_chunk(group)
            pending = sorted(
                pending + [r for r in group if r.kv_len < len(r.prompt)], key=lambda r: len(r.prompt) - r.kv_len
            )

    def _prefill_chunk(self, group: list[_Request]) -> None:
        lens = [min(len(r.prompt) - r.kv_len, self.chunked_prefill_size) for r in group]
        ids = torch.zeros(len(group), max(lens), dtype=torch.long)
        inject = []
        for i, (r, n) in enumerate(zip(group, lens)):
            ids[i, :n] = torch.from_numpy(r.prompt[r.kv_len : r.kv_len + n]).clamp(
                min=0
            )  # a copy: the key keeps its ids
            found = self.vision.rows(r.images, r.kv_len, r.kv_len + n) if r.images is not None else None  # type: ignore[union-attr]
            if found is not None:
                inject.append((i, torch.from_numpy(found[0]), found[1]))
        dev = self.runner.device
        if self.lora is not None:
            self.lora.select([r.slot for r in group])
        logits = self.runner.forward(
            ids.to(dev),
            torch.tensor([r.row for r in group], device=dev),
            torch.tensor([r.kv_len for r in group], device=dev),
            torch.tensor(lens, device=dev) - 1,
            inject or None,
        )
        done = []
        for i, (r, n) in enumerate(zip(group, lens)):
            r.kv_len += n
            if r.kv_len == len(r.prompt):
                done.append(i)
        if done:
            self._sample_and_step([group[i] for i in done], logits[done])

    # ---------------------------------------------------------------- decode

    def _decode_step(self) -> None:
        self._compact_rows()
        batch = [r for r in self._rows if r is not None]
        B = len(batch)
        dev = self.runner.device
        ids = torch.tensor([[r.output_ids[-1]] for r in batch], device=dev)
        start = torch.tensor([r.kv_len for r in batch], device=dev)
        if self.lora is not None:
            self.lora.select([r.slot for r in batch])
        logits = self.runner.forward(ids, slice(0, B), start, torch.zeros(B, dtype=torch.long, device=dev))
        for r in batch:
            r.kv_len += 1
        self._sample_and_step(batch, logits)

    def _compact_rows(self) -> None:
        """Move the highest running rows into holes so running requests occupy rows 0..B-1."""
        rows = self._rows
        while True:
            holes = [i for i, r in enumerate(rows) if r is None]
            last = max((i for i, r in enumerate(rows) if r is not None), default=-1)
            if not holes or holes[0] > last:
                return
            req, dst = rows[last], holes[0]
            self.runner.cache.copy_row(last, dst, req.kv_len)
            rows[dst], rows[last], req.row = req, None, dst

    def _sample_and_step(self, reqs: list[_Request], raw: torch.Tensor) -> None:
        gens = [r.generator or self._generator for r in reqs]
        drawn: list[tuple[_Request, torch.Tensor, int, float]] = []  # (request, its biased logits row, token, lp)
        try:
            logits = biased(raw, [r.sp for r in reqs])
            ids, lps = sample_batch(logits, [r.sp for r in reqs], gens)
            drawn = [(r, logits[i], t, lp) for i, (r, t, lp) in enumerate(zip(reqs, ids.tolist(), lps.tolist()))]
        except BaseException as exc:  # noqa: BLE001 - find the request(s) at fault, fail only them
            log.warning("sampling a batch of %d failed (%r); sampling its rows one by one", len(reqs), exc)
            self.last_error = exc
            for i, r in enumerate(reqs):
                try:
                    row = biased(raw[i : i + 1], [r.sp])  # from the raw logits: each row biased once
                    one_id, one_lp = sample_batch(row, [r.sp], [gens[i]])
                    drawn.append((r, row[0], int(one_id[0]), float(one_lp[0])))
                except BaseException as one_exc:  # noqa: BLE001
                    self._fail(r, one_exc)
        for r, row_logits, tok, lp in drawn:
            r.output_ids.append(tok)
            r.logprobs.append(lp)
            try:
                self._record_extras(r, row_logits, tok)
                r.finish = self._check_finished(r)
                if r.finish is None and r.stream is not None and self._stream_due(r):
                    # SGLang's scheduler: a chunk at tokens 1, 1 + k, 1 + 2k, ...; the finished response always
                    _call_soon(r.loop, r.stream.put_nowait, self._response(r, partial=True))
            except BaseException as exc:  # noqa: BLE001 - e.g. a stop string or a partial text that cannot be decoded
                self._fail(r, exc)
                continue
            if r.finish is not None:
                self._retire(r)

    @staticmethod
    def _stream_due(r: _Request) -> bool:
        k = r.sp.stream_interval
        return k == 1 or len(r.output_ids) % k == 1

    def _record_extras(self, r: _Request, logits: torch.Tensor, tok: int) -> None:
        """What a request asked for beyond the token and its log-prob: top log-probs, the top-p nucleus."""
        if r.top_logprobs_num:
            temp = 1.0 if r.sp.greedy else float(r.sp.temperature)
            logp = torch.log_softmax(logits.float() / temp, dim=-1)
            r.output_top.append(self._top_entries(logp, r.top_logprobs_num, r.return_text_in_logprobs))
        if r.sp.return_top_p_token_ids:
            r.top_p_ids.append(kept_tokens(logits, r.sp, tok))

    def _check_finished(self, r: _Request) -> dict | None:
        """SGLang's order: length first, then stop token, then stop string."""
        sp, tok = r.sp, r.output_ids[-1]
        if len(r.output_ids) >= sp.max_new_tokens:
            return {"type": "length", "length": sp.max_new_tokens}
        if not sp.ignore_eos and (tok in sp.stop_token_ids or tok in self.eos_token_ids):
            return {"type": "stop", "matched": tok}
        if sp.stop:
            tail = self.tokenizer.decode(r.output_ids[-sp.stop_window :])  # as SGLang: special tokens kept
            for s in sp.stop:
                if s in tail:
                    return {"type": "stop", "matched": s}
        return None

    def _retire(self, r: _Request) -> None:
        """Free the request's row (keeping its KV in the prefix store) and answer it."""
        if r.row >= 0:
            if self.store.max_sequences > 0 and r.kv_len > 0:
                k, v = self.runner.cache.extract(r.row, r.kv_len)
                self.store.insert(CachedSequence(r.tokens(), k, v, r.tag))
            self._rows[r.row] = None
            r.row = -1
        self._resolve(r)

    def _resolve(self, r: _Request) -> None:
        try:
            response = self._response(r)
        except BaseException as exc:  # noqa: BLE001 - a response that cannot be built fails its request only
            self._fail(r, exc)
            return
        _call_soon(r.loop, _set_result, r.future, response)

    def _response(self, r: _Request, *, partial: bool = False) -> dict:
        sp, fin = r.sp, r.finish or {}
        out = r.output_ids
        if not sp.no_stop_trim and fin.get("type") == "stop" and isinstance(fin.get("matched"), int):
            out = out[:-1]
        text = self.tokenizer.decode(
            out,
            skip_special_tokens=sp.skip_special_tokens,
            spaces_between_special_tokens=sp.spaces_between_special_tokens,
        )
        if not sp.no_stop_trim and isinstance(fin.get("matched"), str):
            pos = text.find(fin["matched"])
            text = text[:pos] if pos >= 0 else text
        meta: dict[str, Any] = {
            "id": r.rid,
            "finish_reason": None if partial else fin,
            "prompt_tokens": len(r.input_ids),
            "completion_tokens": len(r.output_ids),
            "cached_tokens": r.cached_tokens,
            "weight_version": r.lora.version
            if r.lora is not None and r.lora.version is not None
            else self.weight_version,
            "e2e_latency": time.perf_counter() - r.created,
        }
        if r.return_logprob:
            meta["output_token_logprobs"] = [
                [lp, tok, self.tokenizer.decode([tok]) if r.return_text_in_logprobs else None]
                for lp, tok in zip(r.logprobs, r.output_ids)
            ]
            if r.top_logprobs_num:
                meta["output_top_logprobs"] = [list(e) for e in r.output_top]
            meta.update(r.input_meta)
        if sp.return_top_p_token_ids:  # slime's replay format: flat ids + offsets (len = tokens + 1)
            meta["top_p_token_ids"] = [t for kept in r.top_p_ids for t in kept]
            meta["top_p_token_offsets"] = [0, *itertools.accumulate(len(k) for k in r.top_p_ids)]
        return {"text": text, "output_ids": list(r.output_ids), "meta_info": meta}


def _in_own_thread(fn: Any) -> None:
    """Run ``fn`` in a new thread, wait for it to end, and raise what it raised (see ``LocalEngine.__init__``)."""
    failed: list[BaseException] = []

    def run() -> None:
        try:
            fn()
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller's thread
            failed.append(exc)

    t = threading.Thread(target=run, name="agentrl-local-engine-load", daemon=True)  # Ctrl-C is not held by it
    t.start()
    t.join()
    if failed:
        raise failed[0]


def _call_soon(loop: asyncio.AbstractEventLoop, fn: Any, *args: Any) -> None:
    """Hand a result to a waiter's event loop; one whose loop is gone is dropped (never raised in the worker)."""
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:  # the caller's event loop was closed: nobody is waiting any more
        pass


def _set_result(fut: asyncio.Future, value: Any) -> None:
    if not fut.done():
        fut.set_result(value)


def _set_exception(fut: asyncio.Future, exc: BaseException) -> None:
    if not fut.done():
        fut.set_exception(exc)


def _strict_bool(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be true or false, got {value!r}")
    return value


def _check_cpp_compiler() -> None:
    """Inductor builds its CPU kernels with the C++ compiler it finds (``$CXX``, else g++; clang++ on macOS).

    Only the compiler is looked for here; anything else a compile needs and lacks fails the warm-up
    compile, which also runs before the engine serves.
    """
    try:
        from torch._inductor.cpp_builder import get_cpp_compiler

        get_cpp_compiler()
    except Exception as exc:  # noqa: BLE001 - whatever the lookup raises, the answer is the same
        raise RuntimeError(
            f"--enable-torch-compile on CPU needs a C++ compiler for torch's inductor ({exc}): install g++ "
            "(or set CXX), or drop the flag"
        ) from exc
