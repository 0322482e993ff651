"""HTTP engine clients: SGLang's native ``/generate`` (token-exact) and OpenAI chat completions.

:class:`SGLangEngine` talks to anything that speaks SGLang's native API: a real SGLang server on a
GPU node, or ``agentrl serve`` (the embedded engine) on a laptop. Requests carry ``input_ids``
and ask for ``return_logprob``; the reply's ``output_ids`` and ``output_token_logprobs`` are
appended to the episode verbatim.

Faults: connection errors, timeouts and 5xx answers are retried with exponential backoff
(``max_retries``); a 4xx answer (a request the engine refuses, e.g. a prompt longer than its
context) is not retried. Either way the caller gets :class:`EngineError`, which aborts that one
sample; :class:`~agentrl.engines.router.Router` first tries the other engines.

:class:`ChatCompletionsEngine` is text in, text out (an :class:`Engine` adapter over OpenAI chat
completions), for evaluating API models: samples made through it are marked ``token_exact=False``.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import aiohttp
import httpx

from agentrl.engines.base import Engine, EngineError, EngineRequestError, GenerateOutput, SamplingParams

if TYPE_CHECKING:
    from agentrl.chat import ChatTemplate

PAUSE_MODES = ("abort", "retract", "in_place")
"""SGLang's ``/pause_generation`` modes."""


def _limits() -> httpx.Limits:
    # Hundreds of episodes share one client; httpx's default pool (100) would queue them.
    return httpx.Limits(max_connections=2048, max_keepalive_connections=512)


API_KEY_ENV = "AGENTRL_ENGINE_API_KEY"
"""The API key of engines agentrl did not start (``--engine-url``), and of ``agentrl serve`` without ``--api-key``."""


def auth_headers(api_key: str | None) -> dict[str, str]:
    """The header an engine started with ``--api-key`` wants (none without a key)."""
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


class SGLangEngine(Engine):
    """Client for one SGLang-compatible server at ``url`` (e.g. ``http://127.0.0.1:30000``).

    Uses aiohttp: at 256 concurrent episodes it served ~25x more loopback requests per second
    than httpx, whose connection pool scans every connection on every request.
    """

    def __init__(
        self,
        url: str,
        *,
        timeout: float = 600.0,
        max_retries: int = 3,
        backoff: float = 0.5,
        api_key: str | None = None,
        return_routed_experts: bool = False,
        lora_path: str | None = None,
    ):
        self.url = url.rstrip("/")
        # every /generate names this loaded adapter (SGLang's lora_path): a LoRA run's policy on servers that serve
        # it by name (--weight-sync adapter on launched SGLang servers)
        self.lora_path = lora_path
        # MoE routing of every forwarded token (SGLang started with --enable-return-routed-experts)
        self.return_routed_experts = return_routed_experts
        self.api_key = api_key  # sent as SGLang's --api-key expects: Authorization: Bearer <key>
        self.timeout = timeout
        self.max_retries = max_retries
        self.backoff = backoff
        self._session: aiohttp.ClientSession | None = None
        self._pending_aborts: set[asyncio.Task] = set()

    def __repr__(self) -> str:
        return f"SGLangEngine({self.url!r})"

    @property
    def session(self) -> aiohttp.ClientSession:
        """The connection pool, created on first use inside the running event loop."""
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=0),
                timeout=aiohttp.ClientTimeout(total=self.timeout),
                headers=auth_headers(self.api_key),
            )
        return self._session

    async def _post(self, path: str, payload: dict[str, Any], *, parse: Any = None) -> tuple[int, Any]:
        """POST with retries on transport errors, 5xx and malformed replies; return (status, body).

        ``parse(body)`` (optional) turns a 2xx body into the result and raises ``EngineError`` on a
        malformed one, which is retried like a 5xx. A request that carries a ``rid`` gets a fresh
        one per attempt, and an attempt abandoned on a timeout or cancellation is aborted on the
        server, so retries do not pile up work there.
        """
        delay = self.backoff
        last: Exception | None = None
        for attempt in range(self.max_retries + 1):
            if "rid" in payload:
                payload = {**payload, "rid": uuid.uuid4().hex}
            try:
                async with self.session.post(self.url + path, json=payload) as resp:
                    text = await resp.text()
                    try:
                        body: Any = json.loads(text)
                    except ValueError:
                        body = text
                    if resp.status < 400 and parse is not None:
                        return resp.status, parse(body)
                    if resp.status < 500:
                        return resp.status, body
                    last = EngineError(f"{self.url}{path} answered HTTP {resp.status}: {text[:300]}")
            except EngineError as exc:  # a 2xx reply without the expected shape
                last = exc
            except (TimeoutError, aiohttp.ClientError) as exc:  # refused, reset, timed out
                last = exc
                if isinstance(exc, asyncio.TimeoutError) and "rid" in payload:
                    self._abort_later(payload["rid"])
            except asyncio.CancelledError:
                if "rid" in payload:
                    self._abort_later(payload["rid"])
                raise
            if attempt < self.max_retries:
                await asyncio.sleep(delay)
                delay *= 2
        raise EngineError(f"{self.url}{path} failed after {self.max_retries + 1} tries: {last!r}") from last

    def _abort_later(self, rid: str) -> None:
        """Best effort ``/abort_request`` for an abandoned request (fire and forget)."""

        async def abort() -> None:
            try:
                async with self.session.post(
                    self.url + "/abort_request", json={"rid": rid}, timeout=aiohttp.ClientTimeout(total=5)
                ):
                    pass
            except Exception:  # the engine may be gone: nothing left to abort then
                pass

        task = asyncio.get_running_loop().create_task(abort())
        self._pending_aborts.add(task)
        task.add_done_callback(self._pending_aborts.discard)

    accepts_images = True

    async def generate(
        self,
        input_ids: list[int],
        sampling_params: SamplingParams,
        *,
        key: str | None = None,
        image_data: Sequence[str] | None = None,
    ) -> GenerateOutput:
        """SGLang's ``/generate``; ``image_data``: one image per placeholder span of ``input_ids``, in order
        (data URLs; SGLang and the embedded engine run the model's processor on them)."""
        payload: dict[str, Any] = {
            "input_ids": input_ids,
            "sampling_params": sampling_params.to_json(),
            "return_logprob": True,
            "rid": "",
        }
        if image_data:
            payload["image_data"] = list(image_data)
        if self.return_routed_experts:
            payload["return_routed_experts"] = True
        if self.lora_path is not None:
            payload["lora_path"] = self.lora_path
        status, out = await self._post("/generate", payload, parse=self._parse_generate)
        if status >= 400:
            raise EngineRequestError(f"{self.url}/generate refused the request (HTTP {status}): {str(out)[:300]}")
        return out

    def _parse_generate(self, body: Any) -> GenerateOutput:
        out = GenerateOutput.from_sglang(body[0] if isinstance(body, list) else body, self.url)
        if self.return_routed_experts and out.routed_experts is None:  # asked for: a reply without them is malformed
            raise EngineError(f"{self.url}: asked for return_routed_experts, the reply has no meta_info.routed_experts")
        return out

    async def health(self) -> bool:
        try:
            async with self.session.get(self.url + "/health", timeout=aiohttp.ClientTimeout(total=10)) as resp:
                return resp.status == 200
        except (TimeoutError, aiohttp.ClientError):
            return False

    async def context_length(self) -> int | None:
        """``max_model_len`` from ``/v1/models`` (SGLang and the embedded engine), else ``/get_server_info``."""
        for path, read in (
            ("/v1/models", lambda b: b["data"][0]["max_model_len"]),
            ("/get_server_info", lambda b: b["context_length"]),
        ):
            try:
                async with self.session.get(self.url + path, timeout=aiohttp.ClientTimeout(total=10)) as resp:
                    if resp.status == 200:
                        return int(read(await resp.json(content_type=None)))
            except (TimeoutError, aiohttp.ClientError, ValueError, KeyError, IndexError, TypeError):
                continue
        return None

    async def model_info(self) -> dict[str, Any]:
        """``GET /get_model_info`` (model_path, weight_version, ...)."""
        async with self.session.get(self.url + "/get_model_info") as resp:
            resp.raise_for_status()
            return await resp.json()

    async def update_weights_from_disk(self, model_path: str, weight_version: str | None = None) -> None:
        payload: dict[str, Any] = {"model_path": model_path}
        if weight_version is not None:
            payload["weight_version"] = weight_version
        status, body = await self._post("/update_weights_from_disk", payload)
        if status >= 400 or not isinstance(body, dict) or not body.get("success", False):
            raise EngineRequestError(f"{self.url}: update_weights_from_disk failed: {str(body)[:300]}")

    # ---- weight sync by broadcast (SGLang's io_struct.py request bodies, same names and defaults)

    async def _post_checked(self, path: str, payload: dict[str, Any], *, once: bool = False) -> Any:
        """POST ``payload``; raise ``EngineRequestError`` on an HTTP error or ``"success": false``.

        ``once=True`` for requests that join a collective: a retry would join it a second time, so
        a transport error is raised (as ``EngineError``) instead of retried.
        """
        if not once:
            status, body = await self._post(path, payload)
        else:
            try:
                async with self.session.post(self.url + path, json=payload) as resp:
                    status, text = resp.status, await resp.text()
            except (TimeoutError, aiohttp.ClientError) as exc:
                raise EngineError(f"{self.url}{path} failed: {exc!r}") from exc
            try:
                body = json.loads(text)
            except ValueError:
                body = text
        if status >= 400 or (isinstance(body, dict) and body.get("success") is False):
            raise EngineRequestError(f"{self.url}{path} failed (HTTP {status}): {str(body)[:500]}", status)
        return body

    async def init_weights_update_group(
        self,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        group_name: str = "weight_update_group",
        backend: str = "nccl",
    ) -> None:
        """``POST /init_weights_update_group``: the engine's GPUs join the trainer's broadcast group.

        Engine GPU ``tp_rank`` becomes rank ``rank_offset + tp_rank`` of ``world_size``; the trainer
        is rank 0 and must join concurrently (the call returns once every rank has joined).
        """
        await self._post_checked(
            "/init_weights_update_group",
            {
                "master_address": master_address,
                "master_port": int(master_port),
                "rank_offset": int(rank_offset),
                "world_size": int(world_size),
                "group_name": group_name,
                "backend": backend,
            },
            once=True,
        )

    async def update_weights_from_distributed(
        self,
        names: list[str],
        dtypes: list[Any],
        shapes: list[Any],
        group_name: str = "weight_update_group",
        flush_cache: bool = True,
        weight_version: str | None = None,
        *,
        abort_all_requests: bool = False,
    ) -> None:
        """``POST /update_weights_from_distributed``: receive one bucket broadcast from rank 0 and load it.

        ``dtypes`` may be ``torch.dtype`` or strings; they are sent as ``"bfloat16"`` etc. (as slime
        does). The trainer must broadcast the tensors, in this order, while the request is open.
        """
        payload: dict[str, Any] = {
            "names": list(names),
            "dtypes": [str(d).removeprefix("torch.") for d in dtypes],
            "shapes": [[int(x) for x in s] for s in shapes],
            "group_name": group_name,
            "flush_cache": flush_cache,
            "abort_all_requests": abort_all_requests,
        }
        if weight_version is not None:
            payload["weight_version"] = str(weight_version)
        await self._post_checked("/update_weights_from_distributed", payload, once=True)

    async def update_weights_from_tensor(
        self,
        serialized_named_tensors: list[str],
        *,
        load_format: str | None = None,
        flush_cache: bool = True,
        weight_version: str | None = None,
    ) -> None:
        """``POST /update_weights_from_tensor``: load tensors handed over by handle (same machine; colocated).

        One entry per engine TP rank, each from :func:`agentrl.engines.tensor_ipc.serialize_named_tensors`
        (SGLang's ``MultiprocessingSerializer`` format). The sender keeps the tensors alive until this returns.
        """
        payload: dict[str, Any] = {
            "serialized_named_tensors": list(serialized_named_tensors),
            "load_format": load_format,
            "flush_cache": flush_cache,
        }
        if weight_version is not None:
            payload["weight_version"] = str(weight_version)
        await self._post_checked("/update_weights_from_tensor", payload, once=True)

    async def destroy_weights_update_group(self, group_name: str = "weight_update_group") -> None:
        """``POST /destroy_weights_update_group``."""
        await self._post_checked("/destroy_weights_update_group", {"group_name": group_name})

    async def release_memory_occupation(self, tags: list[str] | None = None) -> None:
        """``POST /release_memory_occupation`` (tags from ``weights``, ``kv_cache``, ``cuda_graph``; None = all).

        Colocated training frees the engine's memory for the trainer; SGLang requires that no
        request is running. The embedded engine frees its KV cache (see ``LocalEngine``).
        """
        await self._post_checked("/release_memory_occupation", {"tags": tags})

    async def resume_memory_occupation(self, tags: list[str] | None = None) -> None:
        """``POST /resume_memory_occupation`` (same tags; slime resumes ``weights``, updates them, then ``kv_cache``)."""
        await self._post_checked("/resume_memory_occupation", {"tags": tags})

    # ---- pause around a weight update (SGLang's http_server.py; slime: pause, flush, update, continue)

    async def pause_generation(self, mode: str = "abort") -> None:
        """``POST /pause_generation``: new generate requests wait on the server until :meth:`continue_generation`.

        ``mode`` is SGLang's ``PauseGenerationReqInput.mode``: ``abort`` (default) ends every running
        request now (each returns finish reason ``abort`` with its partial output) and answers once
        none is left; ``retract`` and ``in_place`` keep them in the scheduler and resume them after
        the continue (SGLang only; ``in_place`` keeps their KV, so ``flush_cache`` fails meanwhile).
        SGLang before 0.5.6 ignores the body and aborts.
        """
        if mode not in PAUSE_MODES:
            raise ValueError(f"pause mode must be one of {PAUSE_MODES}, got {mode!r}")
        await self._post_checked("/pause_generation", {"mode": mode})

    async def continue_generation(self) -> None:
        """``POST /continue_generation``: admit the requests held by :meth:`pause_generation`."""
        await self._post_checked("/continue_generation", {})

    async def flush_cache(self, *, timeout: float = 60.0, interval: float = 0.5) -> None:
        """``POST /flush_cache``: drop the prefix (radix) cache, whose KV was computed by older weights.

        SGLang refuses (HTTP 400) while requests run or wait; the call is repeated every ``interval``
        seconds until ``timeout``, as slime does, then raises :class:`EngineRequestError`.
        """
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            status, body = await self._post("/flush_cache", {})
            if status < 400:
                return
            if loop.time() >= deadline:
                raise EngineRequestError(
                    f"{self.url}/flush_cache still refused after {timeout:.0f}s "
                    f"(HTTP {status}: {str(body)[:200]}); are requests still running?"
                )
            await asyncio.sleep(interval)

    async def server_info(self) -> dict[str, Any]:
        """``GET /get_server_info`` (SGLang: the server args, e.g. ``tp_size``)."""
        async with self.session.get(self.url + "/get_server_info") as resp:
            resp.raise_for_status()
            return await resp.json(content_type=None)

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()


async def wait_healthy(engine: Engine, *, timeout: float = 300.0, interval: float = 0.5) -> None:
    """Poll ``engine.health()`` until it answers, or raise ``EngineError`` after ``timeout`` seconds."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not await engine.health():
        if loop.time() > deadline:
            raise EngineError(f"{engine!r} did not become healthy within {timeout:.0f}s")
        await asyncio.sleep(interval)


class ChatCompletionsEngine(Engine):
    """Text-in/text-out :class:`Engine` adapter for an OpenAI-compatible ``/v1/chat/completions`` endpoint.

    For evaluating API models only: the server renders and tokenizes the conversation itself, so
    the ids the SDK records are ``template``'s local re-tokenization of the reply (log-prob 0.0,
    weight version ``"api"``), not what the model saw. :attr:`token_exact` is False: samples made
    this way are marked ``token_exact=False`` and training refuses them unless told otherwise.

    The episode loop reaches it as it reaches any engine, through :meth:`generate_turn`, which
    sends the conversation's messages; :meth:`generate` (ids in) cannot exist for a text API
    and raises.
    """

    token_exact = False
    accepts_images = True  # as image_url parts of the messages

    def __init__(
        self,
        base_url: str,
        template: ChatTemplate,
        *,
        model: str | None = None,
        api_key: str | None = None,
        timeout: float = 600.0,
    ):
        self.base_url = base_url.rstrip("/")
        if not self.base_url.endswith("/v1"):
            self.base_url += "/v1"
        self.template = template
        self.model = model
        self.api_key = api_key
        self._client = httpx.AsyncClient(
            base_url=self.base_url, timeout=timeout, headers=auth_headers(api_key), limits=_limits()
        )

    def __repr__(self) -> str:
        return f"ChatCompletionsEngine({self.base_url!r})"

    async def generate(
        self, input_ids: list[int], sampling_params: SamplingParams, *, key: str | None = None
    ) -> GenerateOutput:
        raise EngineError(
            f"{self.base_url}: a chat-completions endpoint takes messages, not token ids; "
            "call generate_turn(..., messages=...) (the episode loop does)"
        )

    async def generate_turn(
        self,
        input_ids: list[int],
        sampling_params: SamplingParams,
        *,
        key: str | None = None,
        messages: Sequence[Mapping[str, Any]] = (),
        tools: Sequence[Mapping[str, Any]] = (),
        image_data: Sequence[str] = (),
    ) -> GenerateOutput:
        """Send ``messages``/``tools``; return the reply re-tokenized, with its assistant message.

        ``image_data`` is not sent: the messages carry the same images as ``image_url`` parts."""
        if not messages:
            raise EngineError(f"{self.base_url}: generate_turn needs the conversation's messages")
        msg, finish_reason = await self.chat(list(messages), list(tools), sampling_params)
        ids = self.template.encode(msg["content"])
        finish = "length" if finish_reason == "length" else "stop"
        if finish == "stop":
            ids.append(self.template.eos_token_ids[0])
        return GenerateOutput(
            output_ids=ids,
            output_logprobs=[0.0] * len(ids),
            finish_reason=finish,
            matched=ids[-1] if finish == "stop" else None,
            message=msg,
            weight_version="api",
            engine_url=self.base_url,
        )

    async def health(self) -> bool:
        try:
            return (await self._client.get("/models", timeout=10)).status_code == 200
        except httpx.HTTPError:
            return False

    async def _model(self) -> str:
        if self.model is None:
            try:
                resp = await self._client.get("/models")
                resp.raise_for_status()
                self.model = str(resp.json()["data"][0]["id"])
            except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError) as exc:
                raise EngineError(f"{self.base_url}/models: no model to name ({exc}); pass --model") from None
        return self.model

    async def chat(
        self, messages: list[dict], tools: list[dict] | None, sampling: SamplingParams
    ) -> tuple[dict[str, Any], str]:
        """One chat completion: the first choice's assistant message (role, content, tool_calls) and finish_reason."""
        payload: dict[str, Any] = {
            "model": await self._model(),
            "messages": messages,
            "max_tokens": sampling.max_new_tokens,
            "temperature": sampling.temperature,
            "top_p": sampling.top_p,
        }
        if sampling.stop:
            payload["stop"] = sampling.stop
        if tools:
            payload["tools"] = tools
        try:
            resp = await self._client.post("/chat/completions", json=payload)
        except httpx.TransportError as exc:
            raise EngineError(f"{self.base_url}/chat/completions: {exc}") from exc
        if resp.status_code >= 400:
            raise EngineRequestError(f"{self.base_url}/chat/completions HTTP {resp.status_code}: {resp.text[:300]}")
        try:
            choice = resp.json()["choices"][0]
            raw = choice.get("message") or {}
            message: dict[str, Any] = {"role": "assistant", "content": str(raw.get("content") or "")}
            if raw.get("tool_calls"):
                message["tool_calls"] = list(raw["tool_calls"])
            return message, str(choice.get("finish_reason") or "stop")
        except (ValueError, KeyError, IndexError, TypeError, AttributeError) as exc:
            raise EngineError(
                f"{self.base_url}/chat/completions: malformed reply ({type(exc).__name__}: {exc}): {resp.text[:200]}"
            ) from None

    async def close(self) -> None:
        await self._client.aclose()
