"""SGLang's HTTP API in front of :class:`LocalEngine`, so clients cannot tell it from SGLang.

Native endpoints (same paths and JSON shapes as SGLang): ``/generate``, ``/health``,
``/health_generate``, ``/get_model_info``, ``/get_server_info`` (and ``/server_info``), ``/get_weight_version``,
``/update_weights_from_disk``, ``/update_weight_version``, ``/load_lora_adapter``, ``/unload_lora_adapter``
(adapters chosen by ``lora_path``, see ``lora.py``), ``/flush_cache``, ``/abort_request``, ``/v1/loads`` (``include``
sections, as slime polls it for an idle server), ``/metrics`` (Prometheus text with SGLang's
``sglang:*`` names; always on, SGLang needs ``--enable-metrics``); the trainer's broadcast path
``/init_weights_update_group``, ``/update_weights_from_distributed``,
``/destroy_weights_update_group`` (see ``distributed.py``; gloo on CPU), colocation's
``/release_memory_occupation``, ``/resume_memory_occupation``, and the pause around a weight
update ``/pause_generation``, ``/continue_generation``. OpenAI-compatible: ``/v1/models``,
``/v1/completions``, ``/v1/chat/completions``.

Choices worth knowing:

- Requests are bounded before a handler trusts them (:mod:`agentrl.http_guard`): a body over ``max_body_mb``
  (``--max-body-mb``) is a 413 naming the flag; every JSON body is read by one function, so invalid UTF-8,
  invalid JSON and nesting deeper than ``http_guard.MAX_DEPTH`` are 400s on every route; a large body is
  parsed, checked and tokenized in a worker thread (``/health`` keeps answering), and a prompt that cannot fit
  the context is refused before its tokens are checked one by one or its text is tokenized. With an API key
  every route but :data:`OPEN_ROUTES` (SGLang's: ``/health*``, ``/metrics*``) needs it.
- ``text`` inputs are tokenized like SGLang does, with the tokenizer's default
  (``add_special_tokens=True``: a BOS is prepended where the tokenizer adds one). Chat requests are
  rendered with the chat template (``add_generation_prompt=True``) and tokenized without adding
  special tokens again.
- ``/generate`` with ``stream=true`` sends a server-sent event as tokens are sampled (every
  ``stream_interval`` tokens: at 1, 1 + k, ...), each SGLang's cumulative response (text and
  ``output_ids`` so far, ``meta_info`` with ``finish_reason`` null until the last), then
  ``data: [DONE]``; a batch tags each event with its ``index``.
- ``return_logprob`` extras as SGLang: ``logprob_start_len`` -> ``input_token_logprobs`` (first
  entry None; ``max_new_tokens: 0`` scores a prompt, slime's teacher call), ``top_logprobs_num`` ->
  ``output_top_logprobs`` / ``input_top_logprobs``. ``sampling_params.logit_bias`` is added to the
  logits before sampling; ``custom_params`` accepts slime's ``return_top_p_token_ids`` (each output
  token's top-p nucleus as ``top_p_token_ids`` / ``top_p_token_offsets``) and refuses other keys
  (there is no custom logit processor).
- The OpenAI endpoints live in ``openai_routes.py`` (``n``, ``seed``, ``logit_bias``,
  ``tool_choice``, token-by-token streaming; ``echo`` and top alternatives are refused).
- ``/pause_generation`` follows SGLang's ``mode="abort"`` (its default): running requests end at
  once with finish reason ``abort`` (partial output returned), the call returns when none is left,
  and new generate requests (native and OpenAI) wait until ``/continue_generation``. SGLang's
  ``retract`` and ``in_place`` modes hold running requests inside the scheduler; the embedded
  engine has no such state and answers them with HTTP 400. ``/health_generate`` is not held by a
  pause (on SGLang it would wait and time out): a paused engine is idle, not broken.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import json
import logging
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

from agentrl.engines.http import API_KEY_ENV
from agentrl.engines.ipc_folder import IpcFolder
from agentrl.engines.local import protocol as P
from agentrl.engines.local.distributed import (
    DEFAULT_RENDEZVOUS_TIMEOUT,
    WeightUpdateGroups,
    check_metadata,
    check_rendezvous_timeout,
)
from agentrl.engines.local.engine import EngineFault, InvalidRequestError, LocalEngine
from agentrl.engines.local.generate_jobs import generate_jobs
from agentrl.engines.local.openai_routes import ToolParser, add_openai_routes, check_jobs, merge_streams, run_jobs
from agentrl.engines.local.text_prompts import TextPrompts
from agentrl.engines.local.weights import WeightUpdateError, check_declared_bytes
from agentrl.engines.tensor_ipc import Receiver, deserialize_flattened_bucket, deserialize_named_tensors
from agentrl.engines.weight_group import run_in_thread
from agentrl.http_guard import (
    DEFAULT_MAX_BODY_MB,
    INLINE_PARSE_BYTES,
    ApiKeyGuard,
    BadRequest,
    BodyLimit,
    json_reply,
    max_body_bytes,
    read_json,
    warn_if_open,
)

log = logging.getLogger(__name__)

OPEN_ROUTES = ("/health*", "/metrics*")
"""Routes answered without the API key: SGLang's set (``/health``, ``/health_generate``, ``/metrics``), so a
load balancer or Prometheus can watch a server whose key it does not hold."""


def _error(message: str, status: int = 400) -> JSONResponse:
    return JSONResponse({"error": {"message": message}}, status_code=status)


async def _json_body(request: Request) -> dict:
    """The request's JSON object, read as :func:`agentrl.http_guard.read_json` reads it (a large body parsed in
    a worker thread); invalid UTF-8, invalid JSON, nesting deeper than ``http_guard.MAX_DEPTH`` or a value that
    is not an object: :class:`InvalidRequestError` (a 400 in the engine's error shape)."""
    try:
        body = await read_json(request)
    except BadRequest as exc:
        raise InvalidRequestError(str(exc)) from None
    if not isinstance(body, dict):
        raise InvalidRequestError("request body must be a JSON object")
    return body


async def _optional_json_body(request: Request) -> dict:
    """:func:`_json_body`, or ``{}`` for a request without a body (SGLang's control routes take either)."""
    return await _json_body(request) if await request.body() else {}


async def _is_large(request: Request) -> bool:
    """Whether the (already read) body is large enough that its checks and tokenizing go to a worker thread."""
    return len(await request.body()) > INLINE_PARSE_BYTES


LOAD_SECTIONS = {"core", "memory", "spec", "lora", "disagg", "queues", "all"}
"""SGLang's ``/v1/loads?include=`` sections (``spec``, ``lora``, ``disagg`` have nothing to report here)."""

PROMETHEUS = "text/plain; version=0.0.4; charset=utf-8"
LATENCY_BUCKETS = (0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 60, 120, 300, 600, float("inf"))


def _core_load(engine: LocalEngine) -> dict[str, Any]:
    """SGLang's ``LoadSnapshot`` core keys for the engine's one rank."""
    running, waiting = engine.num_running, engine.num_waiting
    used, total = engine.num_used_tokens, engine.max_running_requests * engine.context_length
    return {
        "dp_rank": 0,
        "num_running_reqs": running,
        "num_waiting_reqs": waiting,
        "num_used_tokens": used,
        "max_total_num_tokens": total,
        "max_running_requests": engine.max_running_requests,
        "token_usage": used / total if total else 0.0,
        "utilization": running / engine.max_running_requests,
    }


class RequestStats:
    """Counters over the requests this server answered, for ``/metrics`` (SGLang's metric names)."""

    def __init__(self) -> None:
        self.requests = self.aborted = self.prompt_tokens = self.generation_tokens = self.cached_tokens = 0
        self.latency_sum = 0.0
        self.latency_buckets = [0] * len(LATENCY_BUCKETS)

    def record(self, outs: list[dict]) -> None:
        for out in outs:
            meta = out["meta_info"]
            self.requests += 1
            self.aborted += (meta.get("finish_reason") or {}).get("type") == "abort"
            self.prompt_tokens += meta["prompt_tokens"]
            self.generation_tokens += meta["completion_tokens"]
            self.cached_tokens += meta.get("cached_tokens", 0)
            latency = float(meta.get("e2e_latency", 0.0))
            self.latency_sum += latency
            for i, edge in enumerate(LATENCY_BUCKETS):
                self.latency_buckets[i] += latency <= edge

    def prometheus(self, engine: LocalEngine, model_name: str) -> str:
        labels = f'{{model_name="{_label(model_name)}",engine_type="unified"}}'
        load = _core_load(engine)
        lines = []

        def metric(name: str, kind: str, doc: str, value: float) -> None:
            lines.extend(
                [f"# HELP sglang:{name} {doc}", f"# TYPE sglang:{name} {kind}", f"sglang:{name}{labels} {value}"]
            )

        metric("num_running_reqs", "gauge", "The number of running requests.", load["num_running_reqs"])
        metric("num_queue_reqs", "gauge", "The number of requests in the waiting queue.", load["num_waiting_reqs"])
        metric("num_used_tokens", "gauge", "The number of used tokens.", load["num_used_tokens"])
        metric("max_total_num_tokens", "gauge", "Maximum total tokens in the KV cache.", load["max_total_num_tokens"])
        metric("token_usage", "gauge", "The token usage.", load["token_usage"])
        hit = self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0
        metric("cache_hit_rate", "gauge", "The prefix cache hit rate.", hit)
        metric("prompt_tokens_total", "counter", "Number of prefill tokens processed.", self.prompt_tokens)
        metric("generation_tokens_total", "counter", "Number of generation tokens processed.", self.generation_tokens)
        metric("cached_tokens_total", "counter", "Number of cached prompt tokens.", self.cached_tokens)
        metric("num_requests_total", "counter", "Number of requests processed.", self.requests)
        metric("num_aborted_requests_total", "counter", "Number of requests aborted.", self.aborted)
        name = "sglang:e2e_request_latency_seconds"
        lines += [f"# HELP {name} Histogram of End-to-end request latency in seconds", f"# TYPE {name} histogram"]
        for edge, count in zip(LATENCY_BUCKETS, self.latency_buckets):
            le = "+Inf" if edge == float("inf") else repr(float(edge))
            lines.append(f'{name}_bucket{labels[:-1]},le="{le}"}} {count}')
        lines += [f"{name}_sum{labels} {self.latency_sum}", f"{name}_count{labels} {self.requests}"]
        return "\n".join(lines) + "\n"


def _label(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


PAUSE_MODES = ("abort", "retract", "in_place")
"""SGLang's ``/pause_generation`` modes (``PauseGenerationReqInput.mode``); the embedded engine does ``abort``."""


class PauseGate:
    """SGLang's pause for weight updates, in front of the engine.

    Generate requests pass :meth:`admit` (they wait there while paused) and are counted until they
    return. :meth:`pause` with ``abort`` aborts every request in the engine until none of the admitted
    ones is left, as SGLang's tokenizer manager does, so the update that follows finds the engine idle.
    """

    def __init__(self, engine: LocalEngine):
        self.engine = engine
        self.paused = False
        self.inflight = 0
        self._cond = asyncio.Condition()

    @contextlib.asynccontextmanager
    async def admit(self) -> AsyncIterator[None]:
        async with self._cond:
            await self._cond.wait_for(lambda: not self.paused)
            self.inflight += 1
        try:
            yield
        finally:
            self.inflight -= 1

    async def pause(self, mode: str) -> None:
        if mode not in PAUSE_MODES:
            raise InvalidRequestError(f"Invalid mode: {mode!r}. Expected one of {list(PAUSE_MODES)}.")
        if mode != "abort":
            raise InvalidRequestError(
                f"the embedded engine pauses only with mode 'abort' (got {mode!r}): "
                "it cannot hold running requests; use mode 'abort' or SGLang"
            )
        async with self._cond:
            self.paused = True
        while self.inflight:  # an admitted request may reach the engine after an abort: repeat
            self.engine.abort(abort_all=True)
            await asyncio.sleep(0.02)

    async def resume(self) -> None:
        async with self._cond:
            self.paused = False
            self._cond.notify_all()


def build_app(
    engine: LocalEngine,
    *,
    model_name: str | None = None,
    tool_parser: ToolParser | None = None,
    api_key: str | None = None,
    max_body_mb: float = DEFAULT_MAX_BODY_MB,
    weight_ipc_dir: str | None = None,
    dist_timeout: float = DEFAULT_RENDEZVOUS_TIMEOUT,
) -> FastAPI:
    """The FastAPI app serving ``engine`` (``model_name`` defaults to the checkpoint path).

    With ``api_key`` every endpoint but :data:`OPEN_ROUTES` (``/health*``, ``/metrics*``) needs
    ``Authorization: Bearer <api_key>`` and answers 401 ``{"error": "Unauthorized"}`` without it, as SGLang's
    ``--api-key``: weight updates, pauses and disk loads are then closed to whatever else can reach the port.
    A request body over ``max_body_mb`` MiB is answered 413 naming ``--max-body-mb`` before it is held in memory.
    ``weight_ipc_dir``: the private folder (:class:`~agentrl.engines.ipc_folder.IpcFolder`) whose files CPU
    tensor handles of ``/update_weights_from_tensor`` may name; without it every handle, CPU or CUDA, is refused.
    ``dist_timeout``: seconds ``/init_weights_update_group`` waits for the other ranks (``--dist-timeout``).
    """
    weight_ipc = IpcFolder(weight_ipc_dir) if weight_ipc_dir else None  # a bad folder: refused before serving
    cap = max_body_bytes(max_body_mb)
    app = FastAPI(title="agentrl embedded engine")
    app.state.weight_ipc = weight_ipc
    app.add_middleware(BodyLimit, max_bytes=cap, flag="--max-body-mb")
    if api_key:  # outermost: a client without the key is refused before its body is read
        app.add_middleware(ApiKeyGuard, api_key=api_key, open_paths=OPEN_ROUTES, refusal={"error": "Unauthorized"})
    name = model_name or engine.model_path
    prompts = TextPrompts(engine.tokenizer, engine.check_prompt_length)
    gate = app.state.pause_gate = PauseGate(engine)
    stats = app.state.stats = RequestStats()

    async def _stream_generate(engine: LocalEngine, gate: PauseGate, jobs: list[dict], batch: bool):
        """SSE chunks as SGLang writes them: cumulative text/ids, ``meta_info`` each time, ``index`` in a batch;
        a failed job sends an error event (see :func:`~.openai_routes.merge_streams`)."""
        async with contextlib.aclosing(merge_streams(engine, gate, stats, jobs)) as items:  # closed: jobs end
            async for i, out in items:
                tag = {"index": i} if batch else {}
                if isinstance(out, InvalidRequestError):
                    out = {"error": {"message": str(out)}}
                elif isinstance(out, Exception):  # the stream reports it, as SGLang does
                    out = {"error": {"message": f"the engine failed: {out!r}"}}
                yield f"data: {json.dumps({**out, **tag})}\n\n"
        yield "data: [DONE]\n\n"

    @app.exception_handler(InvalidRequestError)
    async def _invalid(_: Request, exc: InvalidRequestError):
        return _error(str(exc))

    @app.exception_handler(RequestValidationError)
    async def _bad_query(_: Request, exc: RequestValidationError):  # e.g. /v1/loads?dp_rank=x: a 400, as the rest
        parts = [f"{'.'.join(str(x) for x in e['loc'][1:])}: {e['msg']}" for e in exc.errors()[:3]]
        return _error("; ".join(parts))

    @app.exception_handler(EngineFault)
    async def _fault(_: Request, exc: EngineFault):  # this request only; the engine goes on serving
        return _error(str(exc), status=500)

    @app.get("/health")
    async def health():
        return Response(status_code=200 if engine.alive else 503)

    @app.get("/health_generate")
    async def health_generate():
        if not engine.alive:
            return Response(status_code=503)
        await engine.generate([0], {"max_new_tokens": 1, "temperature": 0})
        return Response(status_code=200)

    @app.get("/get_model_info")
    async def model_info():
        return {
            "model_path": engine.model_path,
            "tokenizer_path": engine.model_path,
            "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": engine.weight_version,
        }

    @app.get("/get_weight_version")
    async def weight_version():
        return {"weight_version": engine.weight_version}

    @app.get("/get_server_info")
    @app.get("/server_info")  # the newer name, which slime's external-engine check asks first
    async def server_info():
        return {
            "model_path": engine.model_path,
            "tokenizer_path": engine.model_path,
            "served_model_name": name,
            "context_length": engine.context_length,
            "max_running_requests": engine.max_running_requests,
            "max_cached_sequences": engine.store.max_sequences,
            "chunked_prefill_size": engine.chunked_prefill_size,
            "device": str(engine.runner.device),
            "enable_memory_saver": engine.enable_memory_saver,
            "enable_torch_compile": engine.enable_torch_compile,
            "torch_compile_max_bs": engine.torch_compile_max_bs,
            "torch_compile_steps": engine.runner.compiled_steps,  # agentrl's: decode steps the compiled graph served
            "enable_return_routed_experts": False,  # a dense model: no experts to report (return_routed_experts: 400)
            "dtype": str(next(engine.model.parameters()).dtype).removeprefix("torch."),  # SGLang's format
            # one process serves the whole model: SGLang's parallel sizes, as its server args report them
            "tp_size": 1,
            "dp_size": 1,
            "pp_size": 1,
            "ep_size": 1,
            "weight_version": engine.weight_version,
            "engine": "agentrl-local",
            "version": _version(),
            "restarts": engine.restarts,
            "last_error": repr(engine.last_error) if engine.last_error else None,
            **(engine.lora.server_args() if engine.lora is not None else {"enable_lora": False}),
        }

    @app.api_route("/generate", methods=["POST", "PUT"])
    async def generate(request: Request):
        body = await _json_body(request)
        # a large body (checked and tokenized) or pictures (expanded by the processor): off the event loop
        if body.get("image_data") is not None or await _is_large(request):
            batch, jobs = await asyncio.to_thread(generate_jobs, engine, prompts, body)
        else:
            batch, jobs = generate_jobs(engine, prompts, body)
        if body.get("stream") or len(jobs) > 1:  # every job checked before any runs (or streams its 200)
            await check_jobs(engine, jobs)
        if body.get("stream"):
            return StreamingResponse(_stream_generate(engine, gate, jobs, batch), media_type="text/event-stream")
        async with gate.admit():
            outs = await run_jobs(engine, jobs)
        stats.record(outs)
        large = len(outs) > 16 or any(j["return_logprob"] for j in jobs)  # log-probs: a prompt's worth of entries
        return await json_reply(outs if batch else outs[0], large=large)

    @app.get("/v1/loads")
    async def loads(include: str = "all", dp_rank: int | None = None, format: str = "json"):
        """SGLang's load report: one entry per data-parallel rank (one here); slime polls it for idle."""
        sections = {x.strip() for x in include.split(",") if x.strip()}
        if not sections or sections - LOAD_SECTIONS:
            raise InvalidRequestError(f"include: unknown section(s) {sorted(sections - LOAD_SECTIONS) or [include]}")
        if dp_rank not in (None, 0):
            raise InvalidRequestError(f"dp_rank: the embedded engine has one rank (0), got {dp_rank}")
        if format not in ("json", "prometheus"):
            raise InvalidRequestError(f"format must be 'json' or 'prometheus', got {format!r}")
        load = _core_load(engine)
        if sections & {"memory", "all"}:
            load["memory"] = engine.memory_report()
        if sections & {"queues", "all"}:
            load["queues"] = {"waiting": load["num_waiting_reqs"], "grammar": 0, "paused": 0, "retracted": 0}
        if format == "prometheus":
            return PlainTextResponse(stats.prometheus(engine, name), media_type=PROMETHEUS)
        return {
            "timestamp": datetime.datetime.now(datetime.UTC).isoformat(),
            "version": _version(),
            "accelerator": str(engine.runner.device),
            "num_accelerators": 1,
            "loads": [load],
        }

    @app.get("/metrics")
    async def metrics():
        """SGLang's Prometheus metrics (the names ``--enable-metrics`` exposes), always on here."""
        return PlainTextResponse(stats.prometheus(engine, name), media_type=PROMETHEUS)

    @app.post("/update_weights_from_disk")
    async def update_weights(request: Request):
        req = P.UpdateWeightsFromDiskRequest.parse(await _json_body(request))
        version = req.weight_version
        out = await engine.update_weights_from_disk(
            req.model_path, None if version is None else str(version), abort_all_requests=req.abort_all_requests
        )
        return JSONResponse(out, status_code=200 if out["success"] else 400)

    _weight_sync_routes(app, engine, dist_timeout)

    @app.post("/load_lora_adapter")
    async def load_lora_adapter(request: Request):
        """SGLang's: a PEFT adapter folder on this machine served as ``lora_name`` (200, or 400 with the reason)."""
        req = P.LoadLoraAdapterRequest.parse(await _json_body(request))
        out = await engine.load_lora_adapter(req.lora_name, req.lora_path, pinned=req.pinned)
        return JSONResponse(out, status_code=200 if out["success"] else 400)

    @app.post("/update_weight_version")
    async def update_weight_version(request: Request):
        """SGLang's: the version responses report from now on (after an adapter loaded by name, say)."""
        req = P.UpdateWeightVersionRequest.parse(await _json_body(request))
        return JSONResponse(engine.update_weight_version(req.new_version, abort_all_requests=req.abort_all_requests))

    @app.post("/unload_lora_adapter")
    async def unload_lora_adapter(request: Request):
        req = P.UnloadLoraAdapterRequest.parse(await _json_body(request))
        out = await engine.unload_lora_adapter(req.lora_name)
        return JSONResponse(out, status_code=200 if out["success"] else 400)

    @app.post("/pause_generation")
    async def pause_generation(request: Request):
        req = P.PauseRequest.parse(await _optional_json_body(request))
        await gate.pause(req.mode)
        return {"message": "Generation paused successfully.", "status": "ok"}

    @app.post("/continue_generation")
    async def continue_generation(request: Request):
        await _optional_json_body(request)  # nothing to read, but a body sent must be JSON, as everywhere
        await gate.resume()
        return {"message": "Generation continued successfully.", "status": "ok"}

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache(request: Request):
        if request.method == "POST":
            await _optional_json_body(request)
        engine.flush_cache()
        return PlainTextResponse("Cache flushed.\n")

    @app.post("/abort_request")
    async def abort_request(request: Request):
        req = P.AbortRequest.parse(await _json_body(request))
        engine.abort(req.rid, abort_all=req.abort_all)
        return Response(status_code=200)

    add_openai_routes(
        app,
        engine,
        name=name,
        gate=gate,
        stats=stats,
        tool_parser=tool_parser,
        json_body=_json_body,
        prompts=prompts,
        is_large=_is_large,
    )
    return app


def _weight_sync_routes(app: FastAPI, engine: LocalEngine, dist_timeout: float) -> None:
    """SGLang's broadcast weight update and memory release endpoints (same bodies and answers)."""
    groups = WeightUpdateGroups(rendezvous_timeout=dist_timeout)
    app.state.weight_update_groups = groups

    def answer(success: bool, message: str) -> JSONResponse:
        return JSONResponse({"success": success, "message": message}, status_code=200 if success else 400)

    @app.post("/init_weights_update_group")
    async def init_weights_update_group(request: Request):
        req = P.InitWeightsUpdateGroupRequest.parse(await _json_body(request))
        args = (req.master_address, req.master_port, req.rank_offset, req.world_size, req.group_name, req.backend)
        # blocks until every rank joined, --dist-timeout at most; refused at once while another group joins
        return answer(*await groups.init_async(*args))

    @app.post("/update_weights_from_distributed")
    async def update_weights_from_distributed(request: Request):
        req = P.UpdateWeightsFromDistributedRequest.parse(await _json_body(request))
        group = req.group_name

        def checked_metadata() -> list:
            meta = check_metadata(req.names, req.dtypes, req.shapes)
            # what the bucket declares is allocated to receive it: never more than the model's own bytes (names and
            # shapes are checked once received, as before: a bucket refused unreceived leaves the trainer's
            # broadcast unmatched, which only a bucket no model could hold deserves)
            check_declared_bytes(engine.model, [(shape, dtype) for _, dtype, shape in meta], "the bucket")
            return meta

        try:
            meta = await asyncio.to_thread(checked_metadata) if await _is_large(request) else checked_metadata()
        except (ValueError, WeightUpdateError) as exc:
            return answer(False, f"Failed to update parameter online: {exc}")
        if group not in groups:
            return answer(
                False, f"Group {group} not in the engine's groups. Please call `init_weights_update_group` first."
            )
        try:  # receive the whole bucket while the trainer broadcasts it, off the event loop
            received = await run_in_thread(groups.receive, group, meta)
        except Exception as exc:  # noqa: BLE001 - a broken group is a failed update
            return answer(False, f"Failed to update parameter online: {exc}")
        version = req.weight_version
        out = await engine.update_weights_from_tensors(
            dict(received),
            None if version is None else str(version),
            partial=True,
            abort_all_requests=req.abort_all_requests,
        )
        if not out["success"]:
            return answer(False, f"Failed to update parameter online: {out['message']} The model is unchanged.")
        message = "Succeeded to update parameter online."
        if version is not None:
            message += f" Weight version updated to {version}."
        return answer(True, message)

    @app.post("/update_weights_from_tensor")
    async def update_weights_from_tensor(request: Request):
        """SGLang's colocated update: tensors by handle (``agentrl.engines.tensor_ipc``), one payload per TP rank.

        Only handles of memory the run's trainer wrote are read (CUDA IPC, or files of the private
        ``weight_ipc_dir``), each checked against its storage and the parameter it replaces before a
        byte is read; the engine never unlinks, maps or connects to what a payload names.
        """
        req = P.UpdateWeightsFromTensorRequest.parse(await _json_body(request))
        read = deserialize_flattened_bucket if req.load_format == "flattened_bucket" else deserialize_named_tensors
        try:
            receiver = Receiver.for_model(engine.model, request.app.state.weight_ipc)
            named = await asyncio.to_thread(read, req.serialized_named_tensors[0], receiver)
        except Exception as exc:  # noqa: BLE001 - a bad payload is the client's error (RecursionError included)
            why = str(exc) if not isinstance(exc, RecursionError) else "the payload is nested too deeply"
            why = why if len(why) <= 500 else why[:497] + "..."  # a refusal never echoes megabytes back
            return answer(False, f"could not read serialized_named_tensors ({req.load_format or 'direct'}): {why}")
        version = req.weight_version
        result = await engine.update_weights_from_tensors(
            dict(named), None if version is None else str(version), partial=True
        )
        return answer(bool(result.get("success")), str(result.get("message", "")))

    @app.post("/destroy_weights_update_group")
    async def destroy_weights_update_group(request: Request):
        req = P.GroupRequest.parse(await _json_body(request))
        return answer(*await run_in_thread(groups.destroy, req.group_name))

    async def memory(request: Request, release: bool):
        req = P.MemoryRequest.parse(await _optional_json_body(request))
        tags = req.tags
        out = await (engine.release_memory_occupation(tags) if release else engine.resume_memory_occupation(tags))
        if not out["success"]:
            return _error(out["message"])
        return None  # SGLang answers 200 with a null body

    @app.api_route("/release_memory_occupation", methods=["GET", "POST"])
    async def release_memory_occupation(request: Request):
        return await memory(request, release=True)

    @app.api_route("/resume_memory_occupation", methods=["GET", "POST"])
    async def resume_memory_occupation(request: Request):
        return await memory(request, release=False)


def _version() -> str:
    try:
        import importlib.metadata

        return importlib.metadata.version("agentrl")
    except Exception:  # noqa: BLE001 - an uninstalled source tree has no version
        return "0.0.0"


def serve(
    checkpoint: str,
    host: str = "127.0.0.1",
    port: int = 30000,
    *,
    model_name: str | None = None,
    log_level: str = "info",
    tool_parser: ToolParser | None = None,
    api_key: str | None = None,
    max_body_mb: float = DEFAULT_MAX_BODY_MB,
    weight_ipc_dir: str | None = None,
    dist_timeout: float = DEFAULT_RENDEZVOUS_TIMEOUT,
    **engine_kwargs: Any,
) -> None:
    """Load ``checkpoint`` into a :class:`LocalEngine` and serve it with uvicorn until SIGTERM or Ctrl-C
    (:func:`_run_until_stopped`: the server stops within about :data:`SHUTDOWN_GRACE_S` seconds)."""
    max_body_bytes(max_body_mb)  # a bad cap is refused before the model loads
    check_rendezvous_timeout(dist_timeout)  # so is a bad --dist-timeout
    if weight_ipc_dir:  # so is a weight folder other users could write into
        IpcFolder(weight_ipc_dir)
    warn_if_open(
        host, api_key, exposes="can load weights, pause generation and read files as checkpoints", env=API_KEY_ENV
    )
    engine = LocalEngine(checkpoint, **engine_kwargs)
    app = build_app(
        engine,
        model_name=model_name,
        tool_parser=tool_parser,
        api_key=api_key,
        max_body_mb=max_body_mb,
        weight_ipc_dir=weight_ipc_dir,
        dist_timeout=dist_timeout,
    )
    try:
        _run_until_stopped(app, engine, host=host, port=port, log_level=log_level)
    finally:
        asyncio.run(engine.close(timeout=SHUTDOWN_GRACE_S))


SHUTDOWN_GRACE_S = 5.0
"""Seconds a stopping server gives the requests still open to finish; then they are cancelled."""


def _run_until_stopped(app: FastAPI, engine: LocalEngine, *, host: str, port: int, log_level: str) -> None:
    """Serve ``app`` with uvicorn until SIGTERM or Ctrl-C, then stop promptly whatever is in flight.

    uvicorn's graceful shutdown waits for every open request, with no limit by default, and a request
    can stay open for long: a rendezvous waiting for rank 0, a ``/generate`` stream, a weight load
    queued behind it. So on the signal every engine request is aborted (finish reason ``abort``, as
    SGLang's ``/abort_request``), a rendezvous in progress is cut short, and what is still open
    :data:`SHUTDOWN_GRACE_S` seconds later is cancelled. Threads still blocked in c10d or on a disk
    are daemon threads: they do not keep the process alive.
    """
    import uvicorn

    groups: WeightUpdateGroups = app.state.weight_update_groups

    class Server(uvicorn.Server):
        async def shutdown(self, sockets: Any = None) -> None:
            engine.abort(abort_all=True)
            groups.abort()
            await super().shutdown(sockets)

    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=SHUTDOWN_GRACE_S)
    Server(config).run()
