"""The embedded engine answers the requests slime and SGLang's own clients send, as SGLang does.

Payloads are written here as slime builds them (``slime/rollout/on_policy_distillation.py``'s teacher
scoring, ``sglang_rollout.py``'s top-p replay, ``server_control.py``'s idle wait); every number is
checked against a plain full-sequence forward of the same checkpoint. A real uvicorn server on a
loopback port serves a tiny model.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import time

import httpx
import pytest
import torch

from agentrl.engines.local import LocalEngine, build_app

from .test_server_api import _start

PROMPT = [5, 17, 42, 99, 7, 120, 33, 64, 11, 250]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    from agentrl.tiny import build_model

    return build_model(tmp_path_factory.mktemp("parity") / "tiny", mean_turn_tokens=10.0)


@pytest.fixture(scope="module")
def ref(ckpt):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def server(ckpt):
    engine = LocalEngine(ckpt, max_running_requests=4, seed=0)
    url, srv, thread = _start(build_app(engine, model_name="tiny"))
    yield {"url": url, "engine": engine}
    srv.should_exit = True
    thread.join(10)
    asyncio.run(engine.close())


@pytest.fixture
def http(server):
    with httpx.Client(base_url=server["url"], timeout=60) as c:
        yield c


def full_logp(model, ids: list[int], temperature: float = 1.0) -> torch.Tensor:
    """``log_softmax(logits / T)`` at every position of one plain forward: row p predicts token p + 1."""
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].float()
    return torch.log_softmax(logits / temperature, dim=-1)


def test_teacher_scoring_payload_returns_prompt_logprobs(http, ref):
    """slime's on-policy distillation: ``max_new_tokens: 0``, ``logprob_start_len: 0``; it reads
    ``input_token_logprobs[1:]`` as the teacher's log-probs of every token after the first."""
    body = {
        "input_ids": PROMPT,
        "sampling_params": {"temperature": 0.8, "max_new_tokens": 0, "skip_special_tokens": False},
        "return_logprob": True,
        "logprob_start_len": 0,
    }
    out = http.post("/generate", json=body).json()
    meta = out["meta_info"]
    assert out["output_ids"] == [] and meta["finish_reason"] == {"type": "length", "length": 0}
    assert meta["output_token_logprobs"] == []
    entries = meta["input_token_logprobs"]
    assert [t for _, t, _ in entries] == PROMPT and entries[0][0] is None
    want = full_logp(ref, PROMPT, 0.8)[:-1].gather(1, torch.tensor(PROMPT[1:])[:, None])[:, 0]
    got = torch.tensor([lp for lp, _, _ in entries[1:]])
    assert torch.allclose(got, want, atol=1e-4), (got, want)

    # from a later position, with top log-probs and text; the first entry is None whatever the start
    body.update(logprob_start_len=4, top_logprobs_num=3, return_text_in_logprobs=True)
    body["sampling_params"] = {"temperature": 0, "max_new_tokens": 2, "ignore_eos": True}
    meta = http.post("/generate", json=body).json()["meta_info"]
    entries, tops = meta["input_token_logprobs"], meta["input_top_logprobs"]
    assert [t for _, t, _ in entries] == PROMPT[4:] and entries[0][0] is None and tops[0] is None
    logp = full_logp(ref, PROMPT)
    assert abs(entries[1][0] - float(logp[4, PROMPT[5]])) < 1e-4
    assert isinstance(entries[1][2], str)
    best = logp[4].topk(3)
    assert [i for _, i, _ in tops[1]] == best.indices.tolist()
    assert max(abs(v - w) for (v, _, _), w in zip(tops[1], best.values.tolist())) < 1e-4

    # default (-1): only the last prompt token, no log-prob, as SGLang
    body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 1}, "return_logprob": True}
    meta = http.post("/generate", json=body).json()["meta_info"]
    assert meta["input_token_logprobs"] == [[None, PROMPT[-1], None]] and "output_top_logprobs" not in meta


def test_output_top_logprobs_match_the_model(http, ref):
    body = {
        "input_ids": PROMPT,
        "sampling_params": {"temperature": 0.7, "max_new_tokens": 6, "ignore_eos": True, "sampling_seed": 3},
        "return_logprob": True,
        "top_logprobs_num": 4,
    }
    out = http.post("/generate", json=body).json()
    tops = out["meta_info"]["output_top_logprobs"]
    assert len(tops) == len(out["output_ids"]) == 6 and all(len(t) == 4 for t in tops)
    logp = full_logp(ref, PROMPT + out["output_ids"], 0.7)[len(PROMPT) - 1 : -1]
    for k, row in enumerate(tops):
        best = logp[k].topk(4)
        assert [i for _, i, _ in row] == best.indices.tolist()
        assert max(abs(v - w) for (v, _, _), w in zip(row, best.values.tolist())) < 1e-4


def test_logit_bias_moves_sampling_and_is_refused_out_of_vocab(http, server):
    plain = {"input_ids": PROMPT, "sampling_params": {"temperature": 0, "max_new_tokens": 5, "ignore_eos": True}}
    before = http.post("/generate", json=plain).json()["output_ids"]
    target = next(t for t in (77, 78, 79) if t not in before)
    biased = json.loads(json.dumps(plain))
    biased["sampling_params"]["logit_bias"] = {str(target): 100.0}
    biased["return_logprob"] = True
    out = http.post("/generate", json=biased).json()
    assert out["output_ids"] == [target] * 5
    assert all(lp > -1e-3 for lp, _, _ in out["meta_info"]["output_token_logprobs"])  # of the biased distribution
    vocab = server["engine"].vocab_size
    r = http.post("/generate", json={**plain, "sampling_params": {"logit_bias": {str(vocab): 1.0}}})
    assert r.status_code == 400 and "logit_bias" in r.json()["error"]["message"]


def test_top_p_replay_returns_each_tokens_nucleus(http, ref):
    """slime's ``custom_params: {"return_top_p_token_ids": true}``: flat ids + offsets, decoded as slime does."""
    sp = {"temperature": 0.9, "top_p": 0.5, "max_new_tokens": 6, "ignore_eos": True, "sampling_seed": 7}
    sp |= {"no_stop_trim": True, "spaces_between_special_tokens": False}
    sp["custom_params"] = {"return_top_p_token_ids": True}
    out = http.post("/generate", json={"input_ids": PROMPT, "sampling_params": sp, "return_logprob": True}).json()
    meta = out["meta_info"]
    ids = torch.as_tensor(meta["top_p_token_ids"], dtype=torch.int32)
    offsets = torch.as_tensor(meta["top_p_token_offsets"], dtype=torch.int32)
    n = len(out["output_ids"])
    assert offsets.numel() == n + 1 and int(offsets[0]) == 0 and int(offsets[-1]) == ids.numel()
    probs = full_logp(ref, PROMPT + out["output_ids"], 0.9)[len(PROMPT) - 1 : -1].exp()
    for k, tok in enumerate(out["output_ids"]):
        kept = ids[offsets[k] : offsets[k + 1]].tolist()
        assert tok in kept
        p, order = probs[k].sort(descending=True)
        nucleus = order[(p.cumsum(0) - p) <= 0.5].tolist()  # the smallest prefix reaching top_p
        assert set(kept) == set(nucleus), k
    plain = http.post("/generate", json={"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 2}}).json()
    assert "top_p_token_ids" not in plain["meta_info"]


def _events(response: httpx.Response) -> list:
    lines = [line[6:] for line in response.text.splitlines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(x) for x in lines[:-1]]


def test_generate_streams_tokens_as_they_are_sampled(http, server):
    sp = {"temperature": 0, "max_new_tokens": 7, "ignore_eos": True}
    full = http.post("/generate", json={"input_ids": PROMPT, "sampling_params": sp}).json()
    events = _events(http.post("/generate", json={"input_ids": PROMPT, "sampling_params": sp, "stream": True}))
    # SGLang's default: cumulative text and ids, meta_info in every chunk, finish_reason only at the end
    assert [len(e["output_ids"]) for e in events] == [1, 2, 3, 4, 5, 6, 7]
    assert all(e["meta_info"]["finish_reason"] is None for e in events[:-1])
    assert events[-1] == {**full, "meta_info": {**full["meta_info"], **pick(events[-1], "id", "e2e_latency")}}
    assert all(full["output_ids"][: len(e["output_ids"])] == e["output_ids"] for e in events)

    # stream_interval 3: chunks at 1, 4, 7 tokens as SGLang's scheduler sends them, then the final one
    sp["stream_interval"] = 3
    events = _events(http.post("/generate", json={"input_ids": PROMPT, "sampling_params": sp, "stream": True}))
    assert [len(e["output_ids"]) for e in events] == [1, 4, 7]

    # a batch streams every member, each chunk tagged with its index
    body = {"input_ids": [PROMPT, PROMPT[:4]], "sampling_params": {**sp, "stream_interval": 1}, "stream": True}
    events = _events(http.post("/generate", json=body))
    assert {e["index"] for e in events} == {0, 1}
    assert sum(e["meta_info"]["finish_reason"] is not None for e in events) == 2

    # a bad request is refused before the stream starts
    r = http.post("/generate", json={"input_ids": PROMPT, "sampling_params": {"top_p": 2}, "stream": True})
    assert r.status_code == 400 and "top_p" in r.json()["error"]["message"]


def pick(d: dict, *keys: str) -> dict:
    return {k: d["meta_info"][k] for k in keys}


def test_a_stream_arrives_while_generation_runs(server):
    """The first chunk comes long before the last token (a ratio within one request, not a wall-clock bound)."""
    sp = {"temperature": 0, "max_new_tokens": 300, "ignore_eos": True}
    stamps = []
    with httpx.Client(base_url=server["url"], timeout=60) as c:
        t0 = time.perf_counter()
        with c.stream("POST", "/generate", json={"input_ids": PROMPT, "sampling_params": sp, "stream": True}) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    stamps.append((time.perf_counter() - t0, len(json.loads(line[6:])["output_ids"])))
    assert [n for _, n in stamps] == [*range(1, 301)]
    assert stamps[0][0] < 0.5 * stamps[-1][0], stamps[::50]


def _num_requests(load) -> int:
    """slime's ``num_requests_from_load`` (server_control.py), written out."""
    if isinstance(load, list):
        return sum(_num_requests(x) for x in load)
    if not isinstance(load, dict):
        return 0
    if "loads" in load:
        return _num_requests(load["loads"])
    return int(load.get("num_running_reqs", 0)) + int(load.get("num_waiting_reqs", 0))


async def test_loads_report_running_requests_until_an_abort_empties_the_engine(server):
    url = server["url"]
    async with httpx.AsyncClient(base_url=url, timeout=60) as c:
        idle = (await c.get("/v1/loads?include=core")).json()
        assert _num_requests(idle) == 0 and idle["loads"][0]["dp_rank"] == 0
        assert set(idle["loads"][0]) >= {"num_running_reqs", "num_waiting_reqs", "max_running_requests"}
        assert {"timestamp", "version", "loads"} <= set(idle)
        sp = {"temperature": 0, "max_new_tokens": 100000, "ignore_eos": True}
        jobs = [
            asyncio.create_task(c.post("/generate", json={"input_ids": PROMPT, "sampling_params": sp}))
            for _ in range(6)
        ]
        for _ in range(200):
            busy = (await c.get("/v1/loads", params={"include": "core"})).json()
            if _num_requests(busy) == 6:
                break
            await asyncio.sleep(0.05)
        assert busy["loads"][0]["num_running_reqs"] == 4 and busy["loads"][0]["num_waiting_reqs"] == 2
        everything = (await c.get("/v1/loads")).json()["loads"][0]
        assert everything["memory"]["weight_gb"] > 0 and everything["queues"]["waiting"] >= 0
        await c.post("/abort_request", json={"abort_all": True})  # what slime does before it polls
        outs = [(await j).json() for j in jobs]
        assert all(o["meta_info"]["finish_reason"]["type"] == "abort" for o in outs)
        assert _num_requests((await c.get("/v1/loads?include=core")).json()) == 0
        r = await c.get("/v1/loads?include=bogus")
        assert r.status_code == 400 and "include" in r.json()["error"]["message"]
        r = await c.get("/v1/loads?dp_rank=x")
        assert r.status_code == 400 and "dp_rank" in r.json()["error"]["message"]


def _metric(text: str, name: str) -> float:
    m = re.search(rf"^sglang:{name}\{{[^}}]*model_name=\"tiny\"[^}}]*\}} (\S+)$", text, re.M)
    assert m, f"no sglang:{name} in /metrics"
    return float(m.group(1))


def test_metrics_are_prometheus_text_with_sglang_names(http):
    before = http.get("/metrics")
    assert before.status_code == 200 and before.headers["content-type"].startswith("text/plain")
    n0, gen0 = _metric(before.text, "num_requests_total"), _metric(before.text, "generation_tokens_total")
    sp = {"max_new_tokens": 5, "ignore_eos": True}
    http.post("/generate", json={"input_ids": [[5, 6], [7, 8]], "sampling_params": sp})
    after = http.get("/metrics").text
    assert _metric(after, "num_requests_total") == n0 + 2
    assert _metric(after, "generation_tokens_total") == gen0 + 10
    assert _metric(after, "num_running_reqs") == 0
    assert re.search(r'^sglang:e2e_request_latency_seconds_bucket\{.*le="\+Inf"\} \d+$', after, re.M)
    for line in after.splitlines():  # every sample line is NAME{labels} VALUE
        assert line.startswith("#") or re.fullmatch(
            r"sglang:[a-z0-9_]+\{[^}]*\} [0-9.e+-]+|sglang:\w+_bucket\{[^}]*\} \d+", line
        ), line


async def test_server_info_reports_the_memory_saver_and_release_follows_it(server, ckpt):
    info = httpx.get(server["url"] + "/server_info").json()
    assert info["enable_memory_saver"] is False and info["dtype"] == "float32"
    out = await server["engine"].release_memory_occupation()  # SGLang's no-op saver: success, nothing freed
    assert out["success"] and out["freed_bytes"] == 0
    assert server["engine"].runner.cache.capacity > 1
    await server["engine"].resume_memory_occupation()


# ---------------------------------------------------------------- OpenAI-compatible endpoints


class MarkerCalls:
    """A tool-call format of this test: ``CALL name`` anywhere starts a call of ``name`` (rest ignored)."""

    def __call__(self, text: str):
        head, _, rest = text.partition("CALL ")
        if not _:
            return text, []
        name = rest.split(" ")[0]
        return head, [{"id": "call_0", "type": "function", "function": {"name": name, "arguments": "{}"}}]

    def call_prefix(self, name):
        return "CALL " + (f"{name} " if name else "")

    def call_marker(self):
        return "CALL"


TOOLS = [
    {"type": "function", "function": {"name": n, "description": d, "parameters": {"type": "object", "properties": {}}}}
    for n, d in (("get_weather", "Weather of a city."), ("add", "Add two numbers."))
]
HI = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def tool_urls(server):
    from agentrl.engines.local.openai_routes import openai_tool_parser

    started = [
        _start(build_app(server["engine"], model_name="tiny", tool_parser=openai_tool_parser("hermes"))),
        _start(build_app(server["engine"], model_name="tiny", tool_parser=MarkerCalls())),
    ]
    yield {"hermes": started[0][0], "marker": started[1][0]}
    for _, srv, thread in started:
        srv.should_exit = True
        thread.join(10)


def test_openai_n_seed_and_logit_bias(server):
    import openai

    client = openai.OpenAI(base_url=server["url"] + "/v1", api_key="none")
    kw = {"model": "tiny", "messages": HI, "max_tokens": 6, "temperature": 1.0, "seed": 11, "n": 3}
    kw["extra_body"] = {"ignore_eos": True}
    a = client.chat.completions.create(**kw)
    b = client.chat.completions.create(**kw)
    assert [c.index for c in a.choices] == [0, 1, 2]
    assert [c.message.content for c in a.choices] == [c.message.content for c in b.choices]  # seeded: replayed
    assert len({c.message.content for c in a.choices}) > 1  # seed + i: the samples differ
    one = client.chat.completions.create(**{**kw, "n": 1})
    assert a.usage.prompt_tokens == one.usage.prompt_tokens  # the prompt counts once
    assert a.usage.completion_tokens == 3 * 6 and one.usage.completion_tokens == 6  # every sample counted

    target = 77
    biased = client.completions.create(
        model="tiny",
        prompt=[5, 6, 7],
        max_tokens=4,
        temperature=0.8,
        logit_bias={str(target): 100},
        logprobs=1,
        extra_body={"ignore_eos": True},
    )
    tok = server["engine"].tokenizer
    assert biased.choices[0].logprobs.tokens == [tok.decode([target])] * 4


def _prompt_tokens(url: str, **kw) -> int:
    body = {"model": "tiny", "messages": HI, "max_tokens": 1, "temperature": 0, **kw}
    r = httpx.post(url + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["usage"]["prompt_tokens"]


def test_tool_choice_none_named_and_required(server, tool_urls):
    tok = server["engine"].tokenizer
    hermes = tool_urls["hermes"]
    with_tools = _prompt_tokens(hermes, tools=TOOLS)
    assert _prompt_tokens(hermes, tools=TOOLS, tool_choice="none") == _prompt_tokens(hermes) < with_tools
    # named: only that tool in the prompt, and the answer starts with the call (hermes layout)
    from agentrl.chat import ChatTemplate
    from agentrl.engines.local.openai_routes import _render_chat

    only = _render_chat(tok, ChatTemplate(tok), HI, TOOLS[:1], {})
    prefix = '<tool_call>\n{"name": "get_weather", "arguments": '
    named = {"type": "function", "function": {"name": "get_weather"}}
    assert _prompt_tokens(hermes, tools=TOOLS, tool_choice=named) == len(only) + len(
        tok.encode(prefix, add_special_tokens=False)
    )
    required = _prompt_tokens(hermes, tools=TOOLS, tool_choice="required")
    assert required == with_tools + len(tok.encode('<tool_call>\n{"name": "', add_special_tokens=False))

    # the whole path with a format whose calls always parse: the forced call comes back as tool_calls
    import openai

    client = openai.OpenAI(base_url=tool_urls["marker"] + "/v1", api_key="none")
    out = client.chat.completions.create(model="tiny", messages=HI, tools=TOOLS, tool_choice=named, max_tokens=3)
    ch = out.choices[0]
    assert ch.finish_reason == "tool_calls" and ch.message.tool_calls[0].function.name == "get_weather"
    out = client.chat.completions.create(
        model="tiny",
        messages=HI,
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "add"}},
        max_tokens=3,
    )
    assert out.choices[0].message.tool_calls[0].function.name == "add"
    out = client.chat.completions.create(model="tiny", messages=HI, tools=TOOLS, tool_choice="none", max_tokens=3)
    assert out.choices[0].message.tool_calls is None
    with pytest.raises(openai.BadRequestError, match="not among the tools"):
        client.chat.completions.create(
            model="tiny", messages=HI, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}}
        )
    plain = openai.OpenAI(base_url=server["url"] + "/v1", api_key="none")  # no parser: cannot force a call
    with pytest.raises(openai.BadRequestError, match="tool_choice.*tool-call parser"):
        plain.chat.completions.create(model="tiny", messages=HI, tools=TOOLS, tool_choice="required")


def test_openai_streams_deltas_that_add_up_to_the_answer(server, tool_urls):
    import openai

    client = openai.OpenAI(base_url=server["url"] + "/v1", api_key="none")
    kw = {"model": "tiny", "messages": HI, "max_tokens": 24, "temperature": 0.9, "seed": 3}
    kw["extra_body"] = {"ignore_eos": True}
    whole = client.chat.completions.create(**kw).choices[0].message.content
    chunks = list(client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    deltas = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
    assert "".join(deltas) == whole and len(deltas) > 5  # token by token, not one chunk at the end
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] in ("stop", "length")
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens > 0

    ckw = {"model": "tiny", "prompt": "The quick brown fox", "max_tokens": 20, "temperature": 0.9, "seed": 3, "n": 2}
    full = client.completions.create(**ckw)
    parts = {0: "", 1: ""}
    for c in client.completions.create(**ckw, stream=True):
        for ch in c.choices:
            parts[ch.index] += ch.text
    assert parts == {ch.index: ch.text for ch in full.choices}

    # with a tool format, the call arrives as one tool_calls delta; text before the marker streams
    marker = openai.OpenAI(base_url=tool_urls["marker"] + "/v1", api_key="none")
    named = {"type": "function", "function": {"name": "add"}}
    chunks = list(
        marker.chat.completions.create(
            model="tiny", messages=HI, tools=TOOLS, tool_choice=named, max_tokens=4, stream=True
        )
    )
    calls = [tc for c in chunks for tc in (c.choices[0].delta.tool_calls or [])]
    assert [tc.function.name for tc in calls] == ["add"] and chunks[-1].choices[0].finish_reason == "tool_calls"


def test_stable_text_holds_back_what_may_change():
    from agentrl.engines.local.openai_routes import _stable

    assert _stable("abc\ufffd", False, [], None) == "abc"  # a character still being sampled
    assert _stable("answer: 4</ans", False, ["</answer>"], None) == "answer: 4"  # a stop string may be starting
    assert _stable("hi <tool_call>{", False, [], "<tool_call>") == "hi "
    assert _stable("hi <tool", False, [], "<tool_call>") == "hi "
    assert _stable("hi <tool", True, [], "<tool_call>") == "hi <tool"


# ---------------------------------------------------------------- review findings, pinned


class _ScriptedStream:
    """An engine stand-in for the streaming code alone: yields the given cumulative texts (one token each)."""

    def __init__(self, texts: list[str]):
        self.texts = texts

    async def generate_stream(self, **job):
        for k, text in enumerate(self.texts):
            last = k == len(self.texts) - 1
            meta = {
                "finish_reason": {"type": "stop", "matched": 2} if last else None,
                "prompt_tokens": 3,
                "completion_tokens": k + 1,
                "output_token_logprobs": [[-0.5, 10 + j, None] for j in range(k + 1)],
            }
            yield {"text": text, "output_ids": list(range(k + 1)), "meta_info": meta}


class _Gate:
    @contextlib.asynccontextmanager
    async def admit(self):
        yield


class _Stats:
    def record(self, outs):
        pass


@pytest.mark.parametrize(
    "texts",
    [
        ["\n", "\nHello", "\nHello world", "\nHello world, how are you"],  # the parser strips: leading newline
        ["Sure ", "Sure <tool", "Sure <tool_call>{bad", "Sure <tool_call>{bad json"],  # a malformed call stays content
        ["Hi ", "Hi <tool_call>\n", 'Hi <tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>'],
    ],
)
async def test_streamed_chat_adds_up_to_the_parsed_answer(server, texts):
    from agentrl.engines.local import protocol as P
    from agentrl.engines.local.openai_routes import _stream_chat, openai_tool_parser

    hook = openai_tool_parser("hermes")
    req = P.ChatCompletionRequest.parse({"messages": HI, "stream": True, "logprobs": True})
    chunks = [
        c
        async for c in _stream_chat(
            _ScriptedStream(texts),
            _Gate(),
            _Stats(),
            [{"sampling_params": {}}],
            {"id": "x"},
            req,
            server["engine"].tokenizer,
            hook,
            "",
        )
    ]
    content, calls = hook(texts[-1])
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert "".join(d.get("content") or "" for d in deltas) == content  # what the non-streamed answer says
    assert [tc["function"]["name"] for d in deltas for tc in d.get("tool_calls") or []] == [
        c["function"]["name"] for c in calls
    ]
    entries = [e for c in chunks[1:] for e in c["choices"][0]["logprobs"]["content"]]
    assert len(entries) == len(texts)  # a token whose text is held back still has its log-prob sent


async def test_a_failing_batch_samples_each_row_with_its_bias_once(ckpt, monkeypatch):
    """The one-by-one fallback after a failed batch must not bias the logits a second time."""
    import agentrl.engines.local.engine as engine_mod

    eng = LocalEngine(ckpt, max_running_requests=4, seed=0)
    try:
        sp = {"temperature": 0, "max_new_tokens": 1, "logit_bias": {"7": 4.0}}
        alone = await eng.generate(PROMPT, sp, return_logprob=True)
        real = engine_mod.sample_batch

        def fails_on_batches(logits, params, gens):
            if len(params) > 1:
                raise RuntimeError("a batch fault")
            return real(logits, params, gens)

        monkeypatch.setattr(engine_mod, "sample_batch", fails_on_batches)
        two = await asyncio.gather(*(eng.generate(PROMPT, sp, return_logprob=True) for _ in range(2)))
        want = alone["meta_info"]["output_token_logprobs"][0][0]
        assert all(abs(o["meta_info"]["output_token_logprobs"][0][0] - want) < 1e-5 for o in two)
    finally:
        await eng.close()


async def test_a_partial_response_that_fails_fails_its_request_only(ckpt, monkeypatch):
    eng = LocalEngine(ckpt, max_running_requests=4, seed=0)
    real = eng._response

    def response(r, *, partial=False):
        if partial and r.rid == "bad":
            raise RuntimeError("cannot decode")
        return real(r, partial=partial)

    monkeypatch.setattr(eng, "_response", response)
    try:
        sp = {"temperature": 0, "max_new_tokens": 20, "ignore_eos": True}
        ok = asyncio.ensure_future(eng.generate(PROMPT, sp))
        with pytest.raises(Exception, match="cannot decode"):
            async for _ in eng.generate_stream(PROMPT, sp, rid="bad"):
                pass
        assert len((await ok)["output_ids"]) == 20 and eng.alive and eng.restarts == 0
    finally:
        await eng.close()


@pytest.mark.parametrize(
    "body, field",
    [
        ({"sampling_params": {"temperature": 1.0, "custom_params": {"return_top_p_token_ids": True}}}, "top_p < 1"),
        ({"return_logprob": True, "top_logprobs_num": 100000}, "top_logprobs_num"),
    ],
)
def test_unbounded_answers_are_refused(http, body, field):
    r = http.post("/generate", json={"input_ids": PROMPT, **body})
    assert r.status_code == 400 and field in r.json()["error"]["message"], r.text


def test_a_rewritten_stream_text_is_never_sent_twice():
    """A tokenizer's clean-up can rewrite text already sent: only what lies past it is sent after."""
    from agentrl.engines.local.openai_routes import _delta

    client, basis = "", ""
    for now in ("Hello ", "Hello,", "Hello, world", "Hello, world!", "Hello, world! Bye"):
        text, basis = _delta(basis, now)
        client += text
    assert client == "Hello  world! Bye"  # the rewritten "," is the one character that could not be sent
