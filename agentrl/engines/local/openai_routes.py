"""The embedded engine's OpenAI-compatible endpoints: ``/v1/models``, ``/v1/completions``, ``/v1/chat/completions``.

Everything OpenAI's request defines is either done or refused with a 400 naming the field (see
``protocol.py``). Tool calls: ``build_app(engine, tool_parser=f)`` where ``f(text) -> (content,
[OpenAI tool_call dicts])`` (``--tool-call-parser NAME`` builds one from :mod:`agentrl.parsing`);
when it returns calls the choice gets ``tool_calls`` and ``finish_reason="tool_calls"``. What is done
here, beyond plain sampling:

- ``n``: n samples of the same prompt (choice ``i`` of prompt ``p`` is index ``p * n + i``, as
  OpenAI lays them out); with ``seed``, sample ``i`` draws with ``seed + i`` (n copies of one seed
  would be n identical answers).
- ``logit_bias``: token id -> bias in [-100, 100], added to the logits before sampling.
- ``tool_choice``: ``"none"`` renders without tools and parses no calls; ``"auto"`` (the default)
  parses calls; ``"required"`` and a named function start the answer with the parser's call prefix
  (``<tool_call>\\n{"name": "f", "arguments": `` for hermes), so the model must write a call (to that
  function). SGLang constrains decoding with a JSON schema instead; a forced prefix makes the call
  happen but does not make its arguments valid JSON, which the parser then reports as content.
- ``stream``: chunks as tokens are sampled (OpenAI's ``chat.completion.chunk`` / ``text_completion``
  deltas). Text that may still change is held back: a trailing partial UTF-8 character, the start of
  a stop string, and, when tools are parsed, everything from the parser's call marker on (the calls
  come as one ``tool_calls`` delta at the end). ``stream_options.include_usage`` adds the usage chunk.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse

from agentrl.chat import ChatTemplate
from agentrl.engines.local import protocol as P
from agentrl.engines.local.engine import InvalidRequestError, LocalEngine
from agentrl.engines.local.generate_jobs import check_job_count
from agentrl.engines.local.text_prompts import TextPrompts
from agentrl.http_guard import json_reply
from agentrl.images import ImageError, count_images, normalize
from agentrl.parsing import get_parser

ToolParser = Callable[[str], tuple[str, list[dict]]]
"""The server's tool-call hook: text -> (content, OpenAI ``tool_calls``). One from
:func:`openai_tool_parser` also has ``call_prefix(name)`` and ``call_marker()``."""


def openai_tool_parser(name: str | None) -> ToolParser | None:
    """``--tool-call-parser NAME`` as the server's hook; None for none."""
    if not name or name == "none":
        return None
    return _ParserHook(get_parser(name))


class _ParserHook:
    def __init__(self, parser: Any):
        self.parser = parser

    def __call__(self, text: str) -> tuple[str, list[dict]]:
        """Calls that parse become ``tool_calls``; the raw text of a malformed one stays in the content
        (the client sees what the model wrote instead of an empty message)."""
        content, calls, errors = self.parser.parse(text)
        content = "\n".join(x for x in (content, *(e.raw for e in errors)) if x)
        return content, [c.to_openai() for c in calls]

    def call_prefix(self, name: str | None) -> str | None:
        return self.parser.call_prefix(name)

    def call_marker(self) -> str | None:
        return self.parser.call_marker()


def add_openai_routes(
    app: FastAPI,
    engine: LocalEngine,
    *,
    name: str,
    gate: Any,
    stats: Any,
    tool_parser: ToolParser | None,
    json_body: Callable[[Request], Any],
    prompts: TextPrompts | None = None,
    is_large: Callable[[Request], Awaitable[bool]] | None = None,
) -> None:
    """Mount the OpenAI endpoints on ``app``; generation passes ``gate`` (pauses) and is counted in ``stats``.

    ``json_body`` reads a request's JSON object; text prompts are encoded by ``prompts`` (refused early when they
    cannot fit the context), in a worker thread when ``is_large(request)`` says the body is large."""
    tok = engine.tokenizer
    chat_template = ChatTemplate(tok, vision=engine.vision.family if engine.vision is not None else None)
    text_prompts = prompts if prompts is not None else TextPrompts(tok, engine.check_prompt_length)

    async def large(request: Request) -> bool:
        return bool(is_large is not None and await is_large(request))

    @app.get("/v1/models")
    async def models():
        """The served model, then each loaded LoRA adapter as SGLang lists them (``parent``: the served model)."""
        now = int(time.time())
        card = {"object": "model", "created": now, "owned_by": "agentrl"}
        data = [{"id": name, **card, "root": name, "parent": None, "max_model_len": engine.context_length}]
        if engine.lora is not None:
            data += [
                {"id": lora, **card, "root": path, "parent": name, "max_model_len": None}
                for lora, path in engine.lora.listing().items()
            ]
        return {"object": "list", "data": data}

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await json_body(request)
        if await large(request):  # checked and tokenized off the event loop
            req, jobs = await asyncio.to_thread(_completion_jobs, engine, text_prompts, body)
        else:
            req, jobs = _completion_jobs(engine, text_prompts, body)
        head = {
            "id": f"cmpl-{uuid.uuid4().hex}",
            "object": "text_completion",
            "created": int(time.time()),
            "model": name,
        }
        if req.stream:
            await check_jobs(engine, jobs)
            return _sse(_stream_completions(engine, gate, stats, jobs, head, req, tok))
        async with gate.admit():
            outs = await run_jobs(engine, jobs)
        stats.record(outs)
        choices = []
        for i, out in enumerate(outs):
            choice = {"index": i, "text": out["text"], "logprobs": None, **_finish(out)}
            if req.logprobs is not None:
                choice["logprobs"] = _completion_logprobs(tok, out["meta_info"]["output_token_logprobs"], 0)
            choices.append(choice)
        heavy = len(outs) > 16 or req.logprobs is not None  # log-probs: entries per token, encoded off the loop
        return await json_reply({**head, "choices": choices, "usage": _usage(outs, req.n)}, large=heavy)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        body = await json_body(request)
        big = await large(request)
        req = (
            await asyncio.to_thread(P.ChatCompletionRequest.parse, body) if big else P.ChatCompletionRequest.parse(body)
        )
        tools, prefix, parse = _tool_plan(req, tool_parser)
        messages, kwargs = req.message_dicts(), req.chat_template_kwargs or {}
        render = (tok, chat_template, engine, text_prompts, messages, tools, kwargs)
        if big or count_images(messages):  # rendering, decoding, tokenizing off the event loop
            ids, images = await asyncio.to_thread(_render_prompt, *render)
        else:
            ids, images = _render_prompt(*render)
        if prefix:
            ids = ids + tok.encode(prefix, add_special_tokens=False)
        lora = adapter_name(engine, req)
        jobs = [
            {"input_ids": ids, "sampling_params": sp, "return_logprob": req.logprobs, "lora_path": lora}
            for sp in _samples(req)
        ]
        for job in jobs if images else ():
            job["image_data"] = [im.url for im in images]
        head = {
            "id": f"chatcmpl-{uuid.uuid4().hex}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": name,
        }
        if req.stream:
            await check_jobs(engine, jobs)
            hook = tool_parser if parse else None
            return _sse(_stream_chat(engine, gate, stats, jobs, head, req, tok, hook, prefix))
        async with gate.admit():
            outs = await run_jobs(engine, jobs)
        stats.record(outs)
        choices = []
        for i, out in enumerate(outs):
            content, calls = prefix + out["text"], []
            if parse and tool_parser is not None:
                content, calls = tool_parser(content)
            fin = _finish(out)
            if calls:
                fin["finish_reason"] = "tool_calls"
            logprobs = _chat_logprobs(tok, out) if req.logprobs else None
            message = {"role": "assistant", "content": content, "tool_calls": calls or None}
            choices.append({"index": i, "message": message, "logprobs": logprobs, **fin})
        heavy = len(outs) > 16 or bool(req.logprobs)
        return await json_reply({**head, "choices": choices, "usage": _usage(outs, req.n)}, large=heavy)


def _samples(req: P.CompletionRequest | P.ChatCompletionRequest, sp: dict | None = None) -> list[dict]:
    """One sampling-params dict per requested sample (``n``); sample ``i`` seeded ``seed + i``."""
    sp = sp if sp is not None else req.sampling(default_max=None)
    seed = sp.get("sampling_seed")
    if isinstance(seed, int) and not isinstance(seed, bool) and seed + req.n - 1 > 2**64 - 1:
        raise InvalidRequestError(f"seed: with n={req.n} the samples draw with seed..seed+{req.n - 1}, past 2**64-1")
    out = []
    for i in range(req.n):
        one = dict(sp)
        if (
            "sampling_seed" in one
            and isinstance(one["sampling_seed"], int)
            and not isinstance(one["sampling_seed"], bool)
        ):
            one["sampling_seed"] = one["sampling_seed"] + i
        out.append(one)
    return out


def _tool_plan(req: P.ChatCompletionRequest, hook: ToolParser | None) -> tuple[list[dict] | None, str, bool]:
    """(tools for the template, forced answer prefix, whether to parse calls) for ``tool_choice``."""
    choice, tools = req.tool_choice, req.tools
    if choice == "none":
        return None, "", False
    if choice in (None, "auto"):
        return tools, "", True
    if not tools:
        raise InvalidRequestError(f"tool_choice: {_choice_text(choice)} needs tools")
    prefix_of = getattr(hook, "call_prefix", None)
    if choice == "required":
        prefix = prefix_of(None) if prefix_of else None
        chosen = tools
    else:
        wanted = choice.function.name
        chosen = [t for t in tools if _tool_name(t) == wanted]
        if not chosen:
            names = [_tool_name(t) for t in tools]
            raise InvalidRequestError(f"tool_choice: function {wanted!r} is not among the tools {names}")
        prefix = prefix_of(wanted) if prefix_of else None
    if not prefix:
        raise InvalidRequestError(
            f"tool_choice: {_choice_text(choice)} needs a tool-call parser with a text call format "
            "(serve with --tool-call-parser hermes, qwen or llama3_json)"
        )
    return chosen, prefix, True


def _tool_name(tool: Any) -> Any:
    fn = tool.get("function") if isinstance(tool, dict) else None
    return fn.get("name") if isinstance(fn, dict) else None


def _choice_text(choice: Any) -> str:
    return repr(choice) if isinstance(choice, str) else f"function {choice.function.name!r}"


# ---------------------------------------------------------------- streaming


async def merge_streams(
    engine: LocalEngine, gate: Any, stats: Any, jobs: list[dict]
) -> AsyncIterator[tuple[int, dict | Exception]]:
    """(index, partial or final response) of every job's stream, as they come; a job that fails yields
    (index, the exception) once and ends. Finished responses are counted in ``stats``.

    Each job holds the pause gate only while its engine request runs (the chunks wait in a queue), so
    a client that reads slowly never holds up ``/pause_generation`` and the weight update behind it.
    Closing the iterator (the client went away) cancels the jobs still running, which aborts them.
    Serves ``/generate`` (``server.py``) and the OpenAI endpoints alike.
    """
    queue: asyncio.Queue = asyncio.Queue()

    async def one(i: int, job: dict) -> None:
        try:
            async with gate.admit():
                async for out in engine.generate_stream(**job):
                    if out["meta_info"]["finish_reason"] is not None:
                        stats.record([out])
                    await queue.put((i, out))
        except Exception as exc:  # noqa: BLE001 - the caller reports it in the stream
            await queue.put((i, exc))
        finally:
            await queue.put(None)

    tasks = [asyncio.create_task(one(i, job)) for i, job in enumerate(jobs)]
    try:
        left = len(tasks)
        while left:
            item = await queue.get()
            if item is None:
                left -= 1
                continue
            yield item
    finally:
        for t in tasks:
            t.cancel()


async def _merged(engine: LocalEngine, gate: Any, stats: Any, jobs: list[dict]) -> AsyncIterator[tuple[int, dict]]:
    """:func:`merge_streams`, a failed job raising (the OpenAI stream then ends with an error event)."""
    async with contextlib.aclosing(merge_streams(engine, gate, stats, jobs)) as items:  # closed: jobs end
        async for i, out in items:
            if isinstance(out, Exception):
                raise out
            yield i, out


def _sse(events: AsyncIterator[dict]) -> StreamingResponse:
    async def body():
        try:
            async for e in events:
                yield f"data: {json.dumps(e)}\n\n"
        except Exception as exc:  # noqa: BLE001 - the status line is out: the error travels as an event
            yield f"data: {json.dumps({'error': {'message': str(exc)}})}\n\n"
        yield "data: [DONE]\n\n"

    return StreamingResponse(body(), media_type="text/event-stream")


def _stable(text: str, final: bool, stops: list[str], marker: str | None) -> str:
    """The part of ``text`` that later tokens cannot change or hide."""
    if final:
        return text
    end = len(text.rstrip("\ufffd"))  # a character whose bytes are not all sampled yet
    for s in stops:  # a stop string may be starting: it would be trimmed
        for k in range(min(len(s) - 1, end), 0, -1):
            if text[:end].endswith(s[:k]):
                end -= k
                break
    if marker is not None:
        at = text.find(marker)
        if at >= 0:
            end = min(end, at)
        else:
            for k in range(min(len(marker) - 1, end), 0, -1):
                if text[:end].endswith(marker[:k]):
                    end -= k
                    break
    return text[:end]


def _delta(basis: str, now: str) -> tuple[str, str]:
    """(text to send, the new basis): ``basis`` is the server text the client's text was last built
    from. ``now`` normally extends it; where a tokenizer's clean-up or a parser rewrote earlier text,
    that part cannot be unsent: only what lies past the old basis is sent, and the basis moves on."""
    if len(now) <= len(basis) and basis.startswith(now):
        return "", basis
    return now[len(basis) :], now


async def _stream_completions(engine, gate, stats, jobs, head, req, tok) -> AsyncIterator[dict]:
    sent = [""] * len(jobs)
    lp_sent = [0] * len(jobs)
    offset = [0] * len(jobs)  # characters of text already covered by logprobs (OpenAI's offsets are absolute)
    stops = _stops(jobs[0]["sampling_params"])
    outs: dict[int, dict] = {}
    async for i, out in _merged(engine, gate, stats, jobs):
        final = out["meta_info"]["finish_reason"] is not None
        text = _stable(out["text"], final, stops, None)
        delta, sent[i] = _delta(sent[i], text)
        choice: dict[str, Any] = {"index": i, "text": delta, "logprobs": None, "finish_reason": None}
        if req.logprobs is not None:
            lps = out["meta_info"]["output_token_logprobs"][lp_sent[i] :]
            if lps or final:
                choice["logprobs"] = _completion_logprobs(tok, lps, offset[i])
                offset[i] += sum(len(t) for t in choice["logprobs"]["tokens"])
                lp_sent[i] += len(lps)
        if final:
            choice.update(_finish(out))
            outs[i] = out
        if delta or final or choice["logprobs"]:
            yield {**head, "choices": [choice]}
    if req.stream_options and req.stream_options.include_usage:
        yield {**head, "choices": [], "usage": _usage([outs[i] for i in sorted(outs)], req.n)}


async def _stream_chat(engine, gate, stats, jobs, head, req, tok, hook, prefix) -> AsyncIterator[dict]:
    """Content deltas are what the parser makes of the stable text so far (a parser strips and cuts out
    calls: the deltas then add up to the non-streamed ``content``); calls come once, at the end."""
    head = {**head, "object": "chat.completion.chunk"}
    marker_of = getattr(hook, "call_marker", None)
    marker = marker_of() if marker_of is not None else None
    hold_all = hook is not None and marker is None  # a format without a marker: anything may be a call
    stops = _stops(jobs[0]["sampling_params"])
    sent = [""] * len(jobs)
    lp_sent = [0] * len(jobs)
    outs: dict[int, dict] = {}
    for i in range(len(jobs)):  # OpenAI's first chunk: the role
        yield {**head, "choices": [{"index": i, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]}
    async for i, out in _merged(engine, gate, stats, jobs):
        final = out["meta_info"]["finish_reason"] is not None
        full = prefix + out["text"]
        delta: dict[str, Any] = {}
        fin: dict[str, Any] = {"finish_reason": None}
        calls: list[dict] = []
        if final:
            outs[i] = out
            content, calls = hook(full) if hook is not None else (full, [])
        elif prefix or hold_all:
            content = ""  # a forced call, or no way to tell content from a call before the end
        else:
            stable = _stable(full, False, stops, marker)
            content = hook(stable)[0] if hook is not None else stable
        text, sent[i] = _delta(sent[i], content)
        if text:
            delta["content"] = text
        if final:
            if calls:
                delta["tool_calls"] = [{"index": k, **c} for k, c in enumerate(calls)]
            fin = _finish(out)
            if calls:
                fin["finish_reason"] = "tool_calls"
        choice: dict[str, Any] = {"index": i, "delta": delta, **fin}
        if req.logprobs:
            lps = out["meta_info"]["output_token_logprobs"][lp_sent[i] :]
            choice["logprobs"] = {"content": _chat_logprob_entries(tok, lps)}
            lp_sent[i] += len(lps)
        if delta or final or (req.logprobs and choice["logprobs"]["content"]):
            yield {**head, "choices": [choice]}
    if req.stream_options and req.stream_options.include_usage:
        yield {**head, "choices": [], "usage": _usage([outs[i] for i in sorted(outs)], req.n)}


def _stops(sp: dict) -> list[str]:
    if sp.get("no_stop_trim"):
        return []
    stop = sp.get("stop") or []
    return [stop] if isinstance(stop, str) else [s for s in stop if isinstance(s, str)]


# ---------------------------------------------------------------- shapes


def _completion_jobs(engine: LocalEngine, prompts: TextPrompts, body: dict) -> tuple[P.CompletionRequest, list[dict]]:
    """A ``/v1/completions`` body checked (a prompt longer than the context first, before the per-token checks)
    and unpacked into one ``engine.generate`` job per prompt and sample."""
    raw = body.get("prompt")
    n = body.get("n", 1)
    many = isinstance(raw, list) and raw and isinstance(raw[0], (str, list))
    check_job_count(len(raw) if many else 1, n if isinstance(n, int) and not isinstance(n, bool) and n > 0 else 1)
    for p in raw if many else [raw]:
        if isinstance(p, list):
            engine.check_prompt_length(len(p))
        elif isinstance(p, str):
            prompts.check_fits(p)
    req = P.CompletionRequest.parse(body)
    lora = adapter_name(engine, req)
    items = req.prompt if isinstance(req.prompt, list) and isinstance(req.prompt[0], (str, list)) else [req.prompt]
    jobs = []
    for ids in items:
        ids = ids if isinstance(ids, list) else prompts.encode(ids)
        for sp in _samples(req, req.sampling(default_max=16)):
            jobs.append(
                {"input_ids": ids, "sampling_params": sp, "return_logprob": req.logprobs is not None, "lora_path": lora}
            )
    return req, jobs


def adapter_name(engine: LocalEngine, req: P.CompletionRequest | P.ChatCompletionRequest) -> str | None:
    """The LoRA adapter an OpenAI request names, checked: SGLang's ``model: "base:adapter"`` (with LoRA on; without
    it ``model`` is not read, as before), else its ``lora_path`` field, else None (the base model)."""
    if engine.lora is not None and req.model is not None and ":" in req.model:
        name = req.model.split(":", 1)[1]
        engine.lora_adapter(name, what="model")
        return name
    engine.lora_adapter(req.lora_path, what="lora_path")
    return req.lora_path


async def check_jobs(engine: LocalEngine, jobs: list[dict]) -> None:
    """``engine.check_request`` for each job, before any runs (pictures decoded in a worker thread); the event
    loop serves other requests between two jobs (a batch of a thousand prompts is a second of checks)."""
    for i, job in enumerate(jobs):
        if i:
            await asyncio.sleep(0)
        await engine.check_request(**job)


async def run_jobs(engine: LocalEngine, jobs: list[dict]) -> list[dict]:
    """``engine.generate`` for every job, concurrently, as ``asyncio.gather`` would; each job is admitted (its
    checks run) one event-loop turn after the previous one, so a large batch never holds the loop."""
    if len(jobs) == 1:
        return [await engine.generate(**jobs[0])]
    tasks: list[asyncio.Future] = []
    try:
        for job in jobs:
            tasks.append(asyncio.ensure_future(engine.generate(**job)))
            await asyncio.sleep(0)
    except asyncio.CancelledError:  # the client went away while the jobs were being admitted
        for t in tasks:
            t.cancel()
        raise
    return list(await asyncio.gather(*tasks))


def _render_prompt(
    tok: Any,
    chat: ChatTemplate,
    engine: LocalEngine,
    prompts: TextPrompts,
    messages: list[dict],
    tools: Any,
    kwargs: dict,
) -> tuple[list[int], list[Any]]:
    """A conversation's prompt ids, and its images (none for a text-only conversation)."""
    if count_images(messages):
        return _render_images(tok, chat, engine, prompts, messages, tools, kwargs)
    return _render_chat(tok, chat, messages, tools, kwargs, prompts=prompts), []


def _render_images(
    tok: Any,
    chat: ChatTemplate,
    engine: LocalEngine,
    prompts: TextPrompts,
    messages: list[dict],
    tools: Any,
    kwargs: dict,
) -> tuple[list[int], list[Any]]:
    """A conversation with image parts: its images decoded and checked (400 naming the problem; a text-only
    model refuses them, and so does a ``file://`` URL: the server does not read its disk for a client), and
    its ids with every image's placeholders."""
    if engine.vision is None:
        i, j = next(
            (i, j)
            for i, m in enumerate(messages)
            if isinstance(m.get("content"), list)
            for j, p in enumerate(m["content"])
            if p.get("type") == "image_url"
        )
        raise InvalidRequestError(
            f"messages.{i}.content.{j}: image_url parts need a vision-language model; this one is text-only"
        )
    try:
        messages, images = normalize(messages, files=False)
    except ImageError as exc:
        raise InvalidRequestError(f"messages: {exc}") from None
    return _render_chat(tok, chat, messages, tools, kwargs, engine, images, prompts=prompts), images


def _render_chat(
    tok: Any,
    chat: ChatTemplate,
    messages: list[dict],
    tools: Any,
    kwargs: dict,
    engine: LocalEngine | None = None,
    images: Sequence[Any] = (),
    *,
    prompts: TextPrompts | None = None,
) -> list[int]:
    """Render with the model's template, or agentrl's built-in tool template when tools are offered
    and the model's template ignores them (as ``agentrl rollout`` does), so tools are never dropped.
    With ``images`` the model's processor expands their markers (``engine.vision``). With ``prompts`` the
    rendered text is refused before it is tokenized when it cannot fit the context."""
    try:
        source, messages = chat.prepared(messages, tools)
        text = tok.apply_chat_template(
            messages,
            tools=tools,
            chat_template=source,
            add_generation_prompt=True,
            tokenize=False,
            **kwargs,
        )
    except Exception as exc:  # noqa: BLE001 - a template error is the client's bad request
        raise InvalidRequestError(f"chat template failed: {exc}") from exc
    if prompts is not None:
        prompts.check_fits(text)
    if images:
        assert engine is not None and engine.vision is not None
        try:
            return engine.vision.family.expand(text, images).ids
        except ValueError as exc:
            raise InvalidRequestError(f"messages: {exc}") from None
    return tok.encode(text, add_special_tokens=False)  # checked above when prompts were given


def _completion_logprobs(tok: Any, lps: list, offset: int) -> dict:
    texts = [tok.decode([t]) for _, t, _ in lps]
    offsets = [offset + sum(len(t) for t in texts[:k]) for k in range(len(texts))]
    return {"tokens": texts, "token_logprobs": [lp for lp, _, _ in lps], "top_logprobs": None, "text_offset": offsets}


def _chat_logprob_entries(tok: Any, lps: list) -> list[dict]:
    out = []
    for lp, i, _ in lps:
        t = tok.decode([i])
        out.append({"token": t, "logprob": lp, "bytes": list(t.encode()), "top_logprobs": []})
    return out


def _chat_logprobs(tok: Any, out: dict) -> dict:
    return {"content": _chat_logprob_entries(tok, out["meta_info"]["output_token_logprobs"])}


def _finish(out: dict) -> dict:
    fr = out["meta_info"]["finish_reason"] or {}
    return {"finish_reason": fr.get("type"), "matched_stop": fr.get("matched") if fr.get("type") == "stop" else None}


def _usage(outs: list[dict], n: int) -> dict:
    """OpenAI's usage: each prompt counted once, whatever ``n``; every sample's completion tokens."""
    p = sum(o["meta_info"]["prompt_tokens"] for o in outs[::n])
    c = sum(o["meta_info"]["completion_tokens"] for o in outs)
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}
