"""``agentrl.http_guard``: body caps, JSON of any shape, API keys, against a real uvicorn server on loopback."""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import Iterator

import aiohttp
import httpx
import pytest
from fastapi import FastAPI, Request, WebSocket

from agentrl.http_guard import (
    MAX_DEPTH,
    ApiKeyGuard,
    BadRequest,
    BodyLimit,
    json_depth,
    json_reply,
    parse_json,
    read_json,
    resolve_api_key,
)
from tests.serving import serve_app

# -- parsing (unit) -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text, depth",
    [
        ("1", 0),
        ("[]", 1),
        ('{"a": [1, {"b": []}]}', 4),
        ('["[[[[", "{{{"]', 1),  # brackets in strings do not count
        ('["a\\\\", [["\\"[["]]]', 3),  # escaped backslash then a closing quote; an escaped quote
        ("[" * 300 + "]" * 300, 300),
    ],
)
def test_json_depth_counts_structure_only(text: str, depth: int) -> None:
    assert json_depth(text.encode()) == depth
    if depth <= 100:
        json.loads(text)  # the cases are valid JSON


@pytest.mark.parametrize(
    "raw, words",
    [
        (b"[" * 5000 + b"]" * 5000, f"at most {MAX_DEPTH}"),
        (b'{"a": ' * 2000 + b"1" + b"}" * 2000, "nested 2000 levels"),
        (b"[" * 5000, "at most"),  # unterminated and deep
        (b'["\xff"]', "not UTF-8"),
        (b"{'a': 1}", "not JSON"),
        (b'{"text": "hi \\ud800"}', "lone UTF-16 surrogate"),
        (b'["\\udc00 x"]', "lone UTF-16 surrogate"),
        (b'{"text": "\xed\xa0\x80"}', "not UTF-8"),  # a surrogate encoded raw (json.loads took it)
        ('{"t": "\ud800"}'.encode("utf-16-le", "surrogatepass"), "not UTF-8"),  # UTF-16 (json.loads took it)
        ('{"t": "x"}'.encode("utf-32"), "not UTF-8"),
        (b"", "not JSON"),
    ],
)
def test_parse_json_refuses_with_a_reason(raw: bytes, words: str) -> None:
    with pytest.raises(BadRequest, match=words) as info:
        parse_json(raw)
    assert info.value.status == 400


def test_parse_json_accepts_what_json_accepts() -> None:
    body = {"text": "[{", "input_ids": list(range(1000)), "sampling_params": {"stop": ["]", "}"]}}
    assert parse_json(json.dumps(body)) == body
    assert parse_json(b"[" * MAX_DEPTH + b"]" * MAX_DEPTH) is not None
    assert parse_json(b'["\\ud83d\\ude00", "\\\\ud800"]') == ["\U0001f600", "\\ud800"]  # a pair; an escaped backslash


def test_resolve_api_key_sources(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("X_TEST_KEY", "from-env")
    assert resolve_api_key(None, env="X_TEST_KEY") == "from-env"
    assert resolve_api_key("from-flag", env="X_TEST_KEY") == "from-flag"
    f = tmp_path / "key"
    f.write_text("from-file\n")
    os.chmod(f, 0o600)
    assert resolve_api_key(None, file=f, env="X_TEST_KEY") == "from-file"
    with pytest.raises(ValueError, match="both given"):
        resolve_api_key("a", file=f)
    monkeypatch.delenv("X_TEST_KEY")
    assert resolve_api_key(None, env="X_TEST_KEY") is None
    with pytest.raises(ValueError, match="not a regular file"):
        resolve_api_key(None, file=tmp_path)
    with pytest.raises(ValueError, match="cannot read"):
        resolve_api_key(None, file=tmp_path / "missing")
    (tmp_path / "two").write_text("a b\n")
    with pytest.raises(ValueError, match="one key"):
        resolve_api_key(None, file=tmp_path / "two")
    with pytest.raises(ValueError, match="non-empty"):
        resolve_api_key("  ")


# -- a real server ---------------------------------------------------------------------------------------


def _app(max_bytes: int = 4000, key: str | None = None) -> FastAPI:
    app = FastAPI()

    @app.post("/echo")
    async def echo(request: Request):
        body = await read_json(request)
        return {"n": len(json.dumps(body))}

    @app.post("/walk")
    async def walk(request: Request):  # a handler that recurses over what it was sent (as a template would)
        def depth(x):
            return 1 + max((depth(v) for v in x), default=0) if isinstance(x, list) else 0

        return {"depth": depth(json.loads(await request.body()))}

    @app.get("/health")
    async def health():
        return {"ok": True}

    @app.websocket("/ws")
    async def ws(websocket: WebSocket):
        await websocket.accept()
        await websocket.send_text("hello")
        await websocket.close()

    app.add_middleware(BodyLimit, max_bytes=max_bytes)
    if key:
        app.add_middleware(ApiKeyGuard, api_key=key, open_paths=("/health",))
    return app


@pytest.fixture(scope="module")
def url() -> Iterator[str]:
    with serve_app(_app()) as u:
        yield u


@pytest.mark.e2e
def test_body_over_the_cap_is_413_naming_the_flag(url: str) -> None:
    r = httpx.post(f"{url}/echo", content=b"[" + b"1," * 2100 + b"1]")
    assert r.status_code == 413
    assert "--max-body-mb" in r.json()["error"]["message"] and "MiB" in r.json()["error"]["message"]
    assert httpx.post(f"{url}/echo", json=[1] * 10).json() == {"n": 30}


@pytest.mark.e2e
def test_streamed_body_without_length_is_cut_at_the_cap(url: str) -> None:
    def chunks() -> Iterator[bytes]:
        yield b"["
        for _ in range(100):
            yield b"1," * 200
        yield b"1]"

    r = httpx.post(f"{url}/echo", content=chunks())  # chunked: no Content-Length to refuse it by
    assert r.status_code == 413


@pytest.mark.e2e
def test_deep_and_broken_json_is_400_never_500(url: str) -> None:
    for raw in (b"[" * 400 + b"]" * 400, b"\xff", b"nope"):
        r = httpx.post(f"{url}/echo", content=raw)
        assert r.status_code == 400, (raw[:10], r.text)
    # a handler's own recursion on a deep (but parseable) body: the guard answers 400 instead of a 500
    r = httpx.post(f"{url}/walk", content=b"[" * 990 + b"]" * 990)
    assert r.status_code == 400, r.text
    assert httpx.post(f"{url}/walk", content=b"[[[]]]").json() == {"depth": 3}


@pytest.mark.e2e
def test_api_key_guard_http_and_websocket() -> None:
    with serve_app(_app(key="s3cret")) as url:
        assert httpx.get(f"{url}/health").status_code == 200  # open
        r = httpx.post(f"{url}/echo", json=[1])
        assert r.status_code == 401 and "Bearer" in r.json()["error"]["message"]
        assert httpx.post(f"{url}/echo", json=[1], headers={"Authorization": "Bearer wrong"}).status_code == 401
        assert httpx.post(f"{url}/echo", json=[1], headers={"Authorization": "Bearer s3cret"}).status_code == 200
        assert httpx.get(f"{url}/health/../echo").status_code in (401, 404, 405)  # no path trick opens a route

        async def ws(headers: dict[str, str]) -> str:
            async with aiohttp.ClientSession() as s:
                async with s.ws_connect(f"{url}/ws", headers=headers) as w:
                    return (await w.receive()).data

        with pytest.raises(aiohttp.WSServerHandshakeError) as info:
            asyncio.run(ws({}))
        assert info.value.status == 403
        assert asyncio.run(ws({"Authorization": "Bearer s3cret"})) == "hello"


def test_body_limit_refuses_a_bad_cap() -> None:
    with pytest.raises(ValueError, match="--max-body-mb"):
        BodyLimit(FastAPI(), max_bytes=0)


@pytest.mark.parametrize("large", [False, True])
def test_json_reply_carries_a_lone_surrogate_as_its_escape(large):
    """A reply holding text no UTF-8 can carry (a lone surrogate a model wrote as ``\\ud800``) is sent as JSON
    escapes, not a 500; text that UTF-8 carries is sent as UTF-8 (not escaped)."""
    app = FastAPI()

    @app.get("/r")
    async def r() -> object:
        return await json_reply({"s": "a\ud800b", "t": "\u00e9"}, large=large)

    @app.get("/plain")
    async def plain() -> object:
        return await json_reply({"t": "\u00e9"}, large=large)

    with serve_app(app) as url:
        got = httpx.get(f"{url}/r")
        assert got.status_code == 200, got.text
        assert json.loads(got.content) == {"s": "a\ud800b", "t": "\u00e9"}
        assert httpx.get(f"{url}/plain").content == '{"t":"\u00e9"}'.encode()
