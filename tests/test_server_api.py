"""The embedded engine's HTTP app speaks SGLang's API: native endpoints via httpx, OpenAI ones via ``openai``.

A real uvicorn server on a free loopback port, in a thread of this process, serving a tiny model.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time

import httpx
import openai
import pytest

from agentrl.engines.local import LocalEngine, build_app


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    from agentrl.tiny import build_model

    return build_model(tmp_path_factory.mktemp("server_api") / "tiny", mean_turn_tokens=10.0)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(app) -> tuple[str, object, threading.Thread]:
    import uvicorn

    port = _free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.time() + 20
    while not server.started:
        assert time.time() < deadline and thread.is_alive(), "server did not start"
        time.sleep(0.05)
    return f"http://127.0.0.1:{port}", server, thread


@pytest.fixture(scope="module")
def server(ckpt):
    engine = LocalEngine(ckpt, max_running_requests=4, seed=0)

    def always_call(text: str):  # the tool-call hook, here turning any answer into one call of f
        return "", [{"id": "call_0", "type": "function", "function": {"name": "f", "arguments": "{}"}}]

    url, srv, thread = _start(build_app(engine, model_name="tiny"))
    url2, srv2, thread2 = _start(build_app(engine, model_name="tiny", tool_parser=always_call))
    yield {"url": url, "tool_url": url2, "engine": engine, "ckpt": ckpt}
    for s, t in ((srv, thread), (srv2, thread2)):
        s.should_exit = True
        t.join(10)
    asyncio.run(engine.close())


@pytest.fixture
def http(server):
    with httpx.Client(base_url=server["url"], timeout=30) as c:
        yield c


def test_health_and_info(http, server):
    assert http.get("/health").status_code == 200
    assert http.get("/health_generate").status_code == 200
    info = http.get("/get_model_info").json()
    assert info["is_generation"] is True and info["model_path"] == str(server["ckpt"])
    assert set(info) >= {"model_path", "tokenizer_path", "preferred_sampling_params", "weight_version"}
    assert http.get("/get_weight_version").json() == {"weight_version": server["engine"].weight_version}
    si = http.get("/get_server_info").json()
    assert si["context_length"] == 4096 and si["max_running_requests"] == 4 and "version" in si
    # SGLang's formats, as slime's external-engine check and topology discovery read them
    assert si["dtype"] == "float32" and (si["tp_size"], si["dp_size"], si["pp_size"], si["ep_size"]) == (1, 1, 1, 1)
    newer = http.get("/server_info").json()
    assert {k: v for k, v in newer.items() if k != "restarts"} == {k: v for k, v in si.items() if k != "restarts"}
    models = http.get("/v1/models").json()
    assert models["object"] == "list" and models["data"][0]["id"] == "tiny"
    assert models["data"][0]["max_model_len"] == 4096 and models["data"][0]["owned_by"] == "agentrl"


def test_generate_native(http, server):
    tok = server["engine"].tokenizer
    body = {
        "input_ids": [5, 6, 7],
        "sampling_params": {"max_new_tokens": 6, "temperature": 0.8, "ignore_eos": True},
        "return_logprob": True,
        "return_text_in_logprobs": True,
        "rid": "r-1",
    }
    out = http.post("/generate", json=body).json()
    meta = out["meta_info"]
    assert meta["id"] == "r-1" and meta["finish_reason"] == {"type": "length", "length": 6}
    assert meta["prompt_tokens"] == 3 and meta["completion_tokens"] == len(out["output_ids"]) == 6
    assert [t for _, t, _ in meta["output_token_logprobs"]] == out["output_ids"]
    assert [x for _, _, x in meta["output_token_logprobs"]] == [tok.decode([t]) for t in out["output_ids"]]
    assert all(lp <= 0 for lp, _, _ in meta["output_token_logprobs"])
    assert {"cached_tokens", "weight_version", "e2e_latency"} <= set(meta)

    batch = http.put("/generate", json={"input_ids": [[5, 6], [7, 8, 9]], "sampling_params": {"max_new_tokens": 3}})
    assert batch.status_code == 200 and len(batch.json()) == 2
    assert batch.json()[1]["meta_info"]["prompt_tokens"] == 3
    assert "output_token_logprobs" not in batch.json()[0]["meta_info"]

    text = http.post("/generate", json={"text": "What is 12 plus 30?", "sampling_params": {"max_new_tokens": 2}}).json()
    assert text["meta_info"]["prompt_tokens"] == len(tok.encode("What is 12 plus 30?"))

    stream = http.post("/generate", json={"input_ids": [5], "sampling_params": {"max_new_tokens": 2}, "stream": True})
    events = [line[6:] for line in stream.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]" and "output_ids" in json.loads(events[0])


@pytest.mark.parametrize(
    "body",
    [
        {"input_ids": [], "sampling_params": {}},
        {"input_ids": [1, 2], "sampling_params": {"top_p": 0}},
        {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": -3}},
        {"input_ids": [1] * 5000},
        {"sampling_params": {}},
    ],
)
def test_generate_rejects_bad_requests(http, body):
    r = http.post("/generate", json=body)
    assert r.status_code == 400 and r.json()["error"]["message"]


@pytest.mark.parametrize(
    "path, body, field",
    [
        # each answered 500 before (issue 18 item 3); now a 400 that names the field
        ("/generate", {"input_ids": [1, 2], "sampling_params": {"stop": 5}}, "sampling_params.stop"),
        (
            "/generate",
            {"input_ids": [1, 2], "sampling_params": {"stop_token_ids": 5}},
            "sampling_params.stop_token_ids",
        ),
        (
            "/generate",
            {"input_ids": [1, 2], "sampling_params": {"sampling_seed": 2**64}},
            "sampling_params.sampling_seed",
        ),
        (
            "/generate",
            {"input_ids": [1, 2], "sampling_params": {"skip_special_tokens": "no"}},
            "sampling_params.skip_special_tokens",
        ),
        ("/generate", {"input_ids": [1, 2], "sampling_params": {"top_k": 2**63}}, "sampling_params.top_k"),
        ("/generate", {"input_ids": [1, "2"]}, "input_ids"),
        ("/generate", {"input_ids": [1, 2], "return_logprob": "yes"}, "return_logprob"),
        ("/generate", {"input_ids": [1, 2], "return_logprob": True, "logprob_start_len": 2}, "logprob_start_len"),
        ("/generate", {"input_ids": [1, 2], "logprob_start_len": "0"}, "logprob_start_len"),
        ("/generate", {"input_ids": [1, 2], "sampling_params": {"custom_params": {"x": 1}}}, "custom_params"),
        ("/generate", {"input_ids": [1, 2], "sampling_params": {"logit_bias": {"a": 1.0}}}, "logit_bias"),
        ("/generate", {"input_ids": [1, 2], "sampling_params": {"logit_bias": {"99999": 1.0}}}, "logit_bias"),
        ("/generate", {"input_ids": [1, 2], "sampling_parms": {}}, "sampling_parms"),
        ("/v1/chat/completions", {"messages": ["hi"]}, "messages.0"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]},
            "messages.0.content",
        ),
        ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "hi"}]}, "messages.0.role"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": "5"}, "max_tokens"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "hi"}], "temperature": 10**400},
            "sampling_params.temperature",
        ),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "n": 0}, "n"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "hi"}], "logit_bias": {"5": 200}},
            "logit_bias",
        ),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "hi"}], "tool_choice": "any"},
            "tool_choice",
        ),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "hi"}], "tool_choice": "required"},
            "tool_choice",
        ),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "hi"}], "response_format": {"type": "json_object"}},
            "response_format",
        ),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "hi"}], "stream": True, "stream_options": {"x": 1}},
            "stream_options",
        ),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "hi"}], "stream_options": {"include_usage": True}},
            "stream_options is only allowed with stream: true",
        ),
        ("/v1/completions", {"prompt": "a", "seed": 2**64 - 1, "n": 2}, "seed"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
            "messages.0.content",
        ),
        ("/v1/completions", {"prompt": "a", "stop_token_ids": 5}, "sampling_params.stop_token_ids"),
        ("/v1/completions", {"prompt": {"a": 1}}, "prompt"),
        ("/v1/completions", {"prompt": "a", "echo": True}, "echo"),
        ("/update_weights_from_disk", {"model_path": 5}, "model_path"),
        ("/update_weights_from_disk", {"model_path": "/x", "abort_all_requests": "yes"}, "abort_all_requests"),
        (
            "/init_weights_update_group",
            {"master_address": "127.0.0.1", "master_port": "x", "rank_offset": 1, "world_size": 2},
            "master_port",
        ),
        (
            "/update_weights_from_distributed",
            {"names": [], "dtypes": [], "shapes": [], "load_format": "x"},
            "load_format",
        ),
        ("/update_weights_from_tensor", {"serialized_named_tensors": ["a", "b"]}, "serialized_named_tensors"),
        ("/abort_request", {"rid": 5}, "rid"),
        ("/release_memory_occupation", {"tags": ["gpu"]}, "tags"),
    ],
)
def test_bad_fields_are_400s_naming_the_field(http, path, body, field):
    r = http.post(path, json=body)
    assert r.status_code == 400, r.text
    assert field in r.json()["error"]["message"], r.json()
    assert http.get("/health").status_code == 200


def test_fuzzed_bodies_never_kill_or_500_the_server(http, server):
    """Random JSON at the generation endpoints, whole bodies and one field of a valid body at a time:
    never a 5xx, ``/health`` stays 200, and the same greedy request gives the same tokens after."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    probe = {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 5, "temperature": 0, "ignore_eos": True}}
    before = http.post("/generate", json=probe).json()["output_ids"]
    scalar = (
        st.none() | st.booleans() | st.integers(min_value=-(2**70), max_value=2**70) | st.floats() | st.text(max_size=8)
    )
    value = st.recursive(
        scalar, lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=8), c, max_size=4), max_leaves=8
    )
    fields = [
        "max_new_tokens",
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "stop",
        "stop_token_ids",
        "ignore_eos",
        "skip_special_tokens",
        "no_stop_trim",
        "sampling_seed",
        "frequency_penalty",
    ]
    valid = {
        "/generate": {"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 3}, "return_logprob": True},
        "/v1/completions": {"prompt": [5, 6], "max_tokens": 3},
        "/v1/chat/completions": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3},
    }

    def mutate(path: str, key: str, v) -> dict:
        body = json.loads(json.dumps(valid[path]))
        if path == "/generate" and key in fields:
            body["sampling_params"][key] = v
        else:
            body[key] = v
        if key in ("max_new_tokens", "max_tokens") and isinstance(v, int) and not isinstance(v, bool):
            body[key if path != "/generate" else "sampling_params"] = (
                min(v, 8) if path != "/generate" else {**body["sampling_params"], key: min(v, 8)}
            )
        return body

    bodies = st.tuples(st.sampled_from(list(valid)), value) | st.builds(
        lambda p, k, v: (p, mutate(p, k, v)),
        st.sampled_from(list(valid)),
        st.sampled_from(
            fields
            + [
                "input_ids",
                "prompt",
                "messages",
                "text",
                "rid",
                "stream",
                "return_logprob",
                "tools",
                "logprobs",
                "n",
                "seed",
            ]
        ),
        value,
    )

    @settings(max_examples=250, deadline=None, suppress_health_check=list(HealthCheck), database=None)
    @given(bodies)
    def one(case):
        path, body = case
        r = http.post(path, content=json.dumps(body, allow_nan=True))
        assert r.status_code < 500, (path, body, r.text)

    one()
    assert http.get("/health").status_code == 200
    assert http.post("/generate", json=probe).json()["output_ids"] == before


def client_tok(server):
    return server["engine"].tokenizer


def test_openai_completions(server):
    client = openai.OpenAI(base_url=server["url"] + "/v1", api_key="none")
    c = client.completions.create(
        model="tiny",
        prompt="The quick brown fox",
        max_tokens=5,
        temperature=0.7,
        logprobs=1,
        extra_body={"ignore_eos": True, "seed": 1},
    )  # a fixed draw: a sampled
    # multi-byte character split over tokens decodes to "\ufffd" pieces, which would not start the text
    ch = c.choices[0]
    assert c.object == "text_completion" and ch.finish_reason == "length" and c.usage.completion_tokens == 5
    assert len(ch.logprobs.tokens) == len(ch.logprobs.token_logprobs) == len(ch.logprobs.text_offset) == 5
    special = set(server["engine"].tokenizer.all_special_tokens)
    assert "".join(t for t in ch.logprobs.tokens if t not in special).startswith(ch.text)  # text skips special tokens
    ids = client.completions.create(model="tiny", prompt=[5, 6, 7, 8], max_tokens=3, stop=["zzz"])
    assert ids.usage.prompt_tokens == 4 and ids.choices[0].finish_reason in ("stop", "length")
    two = client.completions.create(model="tiny", prompt=[[5, 6], [7, 8, 9]], max_tokens=2)
    assert [ch.index for ch in two.choices] == [0, 1] and two.usage.prompt_tokens == 5
    default = client.completions.create(model="tiny", prompt="a", extra_body={"ignore_eos": True})
    assert default.usage.completion_tokens == 16
    many = client.completions.create(model="tiny", prompt=["a", "b c"], n=3, max_tokens=2, seed=5, temperature=1.0)
    assert [ch.index for ch in many.choices] == list(range(6))  # prompt p, sample i -> p * n + i
    assert many.usage.prompt_tokens == len(client_tok(server).encode("a")) + len(client_tok(server).encode("b c"))
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="tiny", prompt="a", echo=True)


def test_openai_chat_completions(server):
    client = openai.OpenAI(base_url=server["url"] + "/v1", api_key="none")
    messages = [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "What is 12 plus 30?"},
    ]
    r = client.chat.completions.create(model="tiny", messages=messages, max_tokens=50, logprobs=True)
    ch = r.choices[0]
    assert r.object == "chat.completion" and ch.message.role == "assistant" and ch.message.tool_calls is None
    assert ch.finish_reason in ("stop", "length")
    assert len(ch.logprobs.content) == r.usage.completion_tokens
    tok = server["engine"].tokenizer
    prompt = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert r.usage.prompt_tokens == len(tok.encode(prompt, add_special_tokens=False))
    if ch.finish_reason == "stop":
        assert "<|im_end|>" not in ch.message.content

    tools = [{"type": "function", "function": {"name": "f", "description": "d", "parameters": {"type": "object"}}}]
    client2 = openai.OpenAI(base_url=server["tool_url"] + "/v1", api_key="none")
    r2 = client2.chat.completions.create(model="tiny", messages=messages, max_tokens=3, tools=tools)
    assert r2.choices[0].finish_reason == "tool_calls" and r2.choices[0].message.tool_calls[0].function.name == "f"


def test_weight_update_flush_and_abort(http, server):
    r = http.post("/update_weights_from_disk", json={"model_path": str(server["ckpt"]), "weight_version": "v7"})
    assert r.status_code == 200 and r.json()["success"] is True and "num_paused_requests" in r.json()
    assert http.get("/get_weight_version").json() == {"weight_version": "v7"}
    assert http.get("/get_model_info").json()["weight_version"] == "v7"
    bad = http.post("/update_weights_from_disk", json={"model_path": "/nonexistent/ckpt"})
    assert bad.status_code == 400 and bad.json()["success"] is False
    for method in ("GET", "POST"):
        r = http.request(method, "/flush_cache")
        assert r.status_code == 200 and r.text == "Cache flushed.\n"

    async def abort_one():
        async with httpx.AsyncClient(base_url=server["url"], timeout=30) as c:
            long = asyncio.create_task(
                c.post(
                    "/generate",
                    json={
                        "input_ids": [5, 6],
                        "rid": "long",
                        "sampling_params": {"max_new_tokens": 3000, "ignore_eos": True},
                    },
                )
            )
            await asyncio.sleep(0.3)
            assert (await c.post("/abort_request", json={"rid": "long"})).status_code == 200
            return (await long).json()

    out = asyncio.run(abort_one())
    assert out["meta_info"]["finish_reason"]["type"] == "abort" and len(out["output_ids"]) < 3000
    assert http.post("/abort_request", json={"abort_all": True}).status_code == 200


def test_api_key_closes_every_endpoint_but_health(server):
    """``build_app(api_key=...)``: SGLang's ``--api-key`` semantics, on the same engine as the other tests."""
    from agentrl.engines.http import auth_headers

    url, srv, thread = _start(build_app(server["engine"], model_name="tiny", api_key="s3cret"))
    gen = {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 2}}
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    try:
        with httpx.Client(base_url=url, timeout=30) as c:
            assert c.get("/health").status_code == 200 and c.get("/health_generate").status_code == 200
            for method, path, body in [
                ("POST", "/generate", gen),
                ("POST", "/v1/chat/completions", chat),
                ("POST", "/update_weights_from_disk", {"model_path": str(server["ckpt"])}),
                ("POST", "/pause_generation", {}),
                ("POST", "/init_weights_update_group", {}),
                ("GET", "/get_server_info", None),
                ("GET", "/server_info", None),
                ("GET", "/v1/models", None),
            ]:
                for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}):
                    r = c.request(method, path, json=body, headers=headers)
                    assert r.status_code == 401 and r.json() == {"error": "Unauthorized"}, (path, headers, r.text)
            assert c.post("/generate", json=gen, headers=auth_headers("s3cret")).status_code == 200
        client = openai.OpenAI(base_url=url + "/v1", api_key="s3cret")
        assert client.chat.completions.create(model="tiny", messages=chat["messages"], max_tokens=2).choices
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=url + "/v1", api_key="nope").chat.completions.create(
                model="tiny", messages=chat["messages"], max_tokens=2
            )
    finally:
        srv.should_exit = True
        thread.join(10)
