"""What every agentrl HTTP server does to a request before a handler trusts it.

Three servers face clients: the embedded engine (``agentrl serve``, SGLang's API), the recording proxy
(``agentrl proxy``, OpenAI's API) and ``agentrl env-serve`` (OpenEnv's). They share these rules, kept here
so that each is written once:

- **Bounded bodies.** :class:`BodyLimit` (ASGI middleware) answers 413 to a body over the server's cap,
  naming the cap and the flag that raises it (``--max-body-mb``), before the body is held in memory: a
  declared ``Content-Length`` over the cap is refused unread, a body that streams past it is cut off there.
  WebSocket messages are capped by the ASGI server (uvicorn's ``ws_max_size``) with the same value.
- **JSON of any shape is data.** :func:`parse_json` refuses invalid UTF-8, invalid JSON and nesting deeper
  than :data:`MAX_DEPTH` with :class:`BadRequest` (a 400 with the reason), never a ``RecursionError``
  (an HTTP 500) from the parser or from the code that later walks the value. :func:`read_json` parses a
  large body in a worker thread so the event loop keeps answering ``/health`` while it runs.
- **API keys.** :func:`resolve_api_key` takes the key from ``--api-key``, a file (``--api-key-file``) or an
  environment variable: the flag puts the key in ``/proc/PID/cmdline`` where every local user reads it, the
  other two do not. :class:`ApiKeyGuard` compares ``Authorization: Bearer KEY`` in constant time on every
  HTTP route and WebSocket but the server's open ones (the engine's ``/health*`` and ``/metrics``, as
  SGLang's ``--api-key``).
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import math
import os
import re
import stat
from collections.abc import Awaitable, Callable, Collection, MutableMapping
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

__all__ = [
    "DEFAULT_MAX_BODY_MB",
    "MAX_DEPTH",
    "ApiKeyGuard",
    "BadRequest",
    "BodyLimit",
    "error_body",
    "json_depth",
    "json_reply",
    "max_body_bytes",
    "warn_if_open",
    "parse_json",
    "read_api_key_file",
    "read_json",
    "resolve_api_key",
]

DEFAULT_MAX_BODY_MB = 16
"""The default cap on one request body (and one WebSocket message), in MiB: a 32k-token batch of
``input_ids`` is under 1 MiB of JSON; pictures sent inline as data URLs are what needs more (raise the
flag). A 16 MiB ``/generate`` body of token ids becomes ~1.7 GB of Python objects once parsed, so the
cap is also what bounds a request's memory."""

MAX_DEPTH = 128
"""Deepest JSON nesting accepted. Chat requests nest ~6 levels, tool schemas a few more; Python's parser
and every recursive walk after it (pydantic, jinja2, ``json.dumps``) fail near 1,000."""

MAX_BODY_MB_LIMIT = 4096
"""The largest ``--max-body-mb`` a server accepts (4 GiB: beyond it one request is the machine's memory)."""

INLINE_PARSE_BYTES = 64 << 10
"""Bodies up to this size are parsed on the event loop (a thread hop costs more than the parse)."""

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


class BadRequest(ValueError):
    """A request the server refuses as malformed or too large; ``status`` is its HTTP status."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status


def error_body(message: str, status: int) -> dict[str, Any]:
    """The error JSON of every guard refusal: OpenAI's shape, whose ``error.message`` is also what
    SGLang-style clients read."""
    kind = {401: "authentication_error", 413: "request_too_large"}.get(status, "invalid_request_error")
    return {"error": {"message": message, "type": kind, "param": None, "code": status}}


# -- JSON ---------------------------------------------------------------------------------------------


def json_depth(raw: bytes) -> int:
    """The deepest ``[``/``{`` nesting of a JSON text, without parsing it (brackets inside strings do not
    count). Exact for valid JSON; for invalid JSON it may be off, and the parser refuses that anyway.

    Escaped backslashes and quotes are removed first, then everything but brackets and quotes, so the
    loop below walks only the structure: a 16 MiB list of numbers costs a few milliseconds.
    """
    structure = raw.replace(b"\\\\", b"").replace(b'\\"', b"").translate(None, _NOT_STRUCTURE)
    depth = deepest = 0
    in_string = False
    for c in structure:
        if c == 0x22:  # "
            in_string = not in_string
        elif in_string:
            continue
        elif c in (0x5B, 0x7B):  # [ {
            depth += 1
            deepest = max(deepest, depth)
        else:  # ] }
            depth -= 1
    return deepest


_NOT_STRUCTURE = bytes(c for c in range(256) if c not in b'[]{}"')
_SURROGATE = re.compile(r"\\[uU][dD][89a-fA-F]")


def parse_json(raw: bytes | str, *, what: str = "request body", max_depth: int = MAX_DEPTH) -> Any:
    """``raw`` as a JSON value, or :class:`BadRequest` saying what is wrong with it (never another error)."""
    try:  # strictly UTF-8 (RFC 8259): json.loads alone would take UTF-16/32 and encoded surrogates
        text = raw.decode("utf-8") if isinstance(raw, (bytes, bytearray)) else raw
        raw = raw if isinstance(raw, (bytes, bytearray)) else raw.encode("utf-8")
    except (UnicodeDecodeError, UnicodeEncodeError) as exc:
        raise BadRequest(f"{what} is not UTF-8: {exc.reason} at {exc.start}") from None
    depth = json_depth(raw)
    if depth > max_depth:
        raise BadRequest(f"{what} is nested {depth} levels deep; at most {max_depth} are accepted")
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise BadRequest(f"{what} is not JSON: {exc}") from None
    except RecursionError:  # invalid JSON the depth scan misread: still the client's error
        raise BadRequest(f"{what} is nested too deeply (at most {max_depth} levels)") from None
    if _SURROGATE.search(text):  # "\ud800" is valid JSON but no text: tokenizers and encoders fail on it
        try:
            json.dumps(value, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError as exc:
            raise BadRequest(f"{what} holds a lone UTF-16 surrogate ({exc.object[exc.start]!r}): not text") from None
    return value


async def read_json(request: Any, *, what: str = "request body", max_depth: int = MAX_DEPTH) -> Any:
    """The body of a Starlette ``request`` as JSON (:func:`parse_json`); a large one is parsed in a worker
    thread. The body's size is bounded by :class:`BodyLimit` before this reads it."""
    raw = await request.body()
    if len(raw) <= INLINE_PARSE_BYTES:
        return parse_json(raw, what=what, max_depth=max_depth)
    return await asyncio.to_thread(parse_json, raw, what=what, max_depth=max_depth)


def json_bytes(content: Any) -> bytes:
    """``content`` as compact UTF-8 JSON. Text holding a lone UTF-16 surrogate (a model may write the escape
    ``"\\ud800"`` into tool-call arguments; it parses to a string no UTF-8 can carry) is sent as JSON escapes
    instead of failing the reply: the client reads back exactly what the model wrote."""
    try:
        return json.dumps(content, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode("utf-8")
    except UnicodeEncodeError:
        return json.dumps(content, allow_nan=False, separators=(",", ":")).encode("ascii")


async def json_reply(content: Any, *, status: int = 200, large: bool = False) -> Any:
    """``content`` as a JSON response, serialized in a worker thread when ``large`` (thousands of outputs
    with their log-probs take seconds to encode; FastAPI's own encoder would run them on the event loop)."""
    from starlette.responses import Response

    body = await asyncio.to_thread(json_bytes, content) if large else json_bytes(content)
    return Response(body, status_code=status, media_type="application/json")


# -- body size ----------------------------------------------------------------------------------------


class _TooLarge(Exception):
    pass


class BodyLimit:
    """ASGI middleware: a request body over ``max_bytes`` is answered 413 and never held whole.

    Also answers 400 where a handler let a ``RecursionError`` or :class:`BadRequest` escape before it
    started its response (a request too deep for some recursive walk is the client's error, not a 500).
    Add it with ``app.add_middleware(BodyLimit, max_bytes=..., flag="--max-body-mb")``.
    """

    def __init__(self, app: ASGIApp, max_bytes: int, flag: str = "--max-body-mb"):
        if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 1:
            raise ValueError(f"{flag}: the body cap must be a positive number of bytes, got {max_bytes!r}")
        self.app, self.max_bytes, self.flag = app, max_bytes, flag

    def refusal(self) -> str:
        mib = self.max_bytes / 2**20
        return f"request body is larger than this server's limit of {mib:g} MiB; the server's {self.flag} raises it"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = _header(scope, b"content-length")
        if declared is not None and not declared.isdigit():
            await _respond(send, 400, "Content-Length is not a number")
            return
        if declared is not None and int(declared) > self.max_bytes:
            await _respond(send, 413, self.refusal())
            return
        seen = 0
        started = False

        async def counted() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    raise _TooLarge
            return message

        async def tracked(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, counted, tracked)
        except (_TooLarge, RecursionError, BadRequest) as exc:
            if started:
                raise
            if isinstance(exc, _TooLarge):
                await _respond(send, 413, self.refusal())
            elif isinstance(exc, BadRequest):
                await _respond(send, exc.status, str(exc))
            else:
                await _respond(send, 400, "request is nested too deeply to process")


def _header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope.get("headers", ()):
        if key.lower() == name:
            return value.decode("latin-1").strip()
    return None


async def _respond(send: Send, status: int, message: str, content: dict[str, Any] | None = None) -> None:
    body = json.dumps(error_body(message, status) if content is None else content).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def max_body_bytes(max_body_mb: Any, flag: str = "--max-body-mb") -> int:
    """``--max-body-mb`` as bytes, or ValueError naming the flag (every server checks it before it starts)."""
    if isinstance(max_body_mb, bool) or not isinstance(max_body_mb, (int, float)) or not math.isfinite(max_body_mb):
        raise ValueError(f"{flag} must be a number of MiB, got {max_body_mb!r}")
    if not 0 < max_body_mb <= MAX_BODY_MB_LIMIT:
        raise ValueError(f"{flag} must lie in (0, {MAX_BODY_MB_LIMIT}] MiB, got {max_body_mb!r}")
    return max(1, int(max_body_mb * 2**20))


# -- API keys -----------------------------------------------------------------------------------------


LOOPBACK_HOSTS = ("127.0.0.1", "::1", "localhost")


def warn_if_open(host: str, api_key: str | None, *, exposes: str, env: str) -> None:
    """Log a warning when a server listens beyond loopback without a key: ``exposes`` says what anyone who
    reaches the port can then do, ``env`` the variable that sets a key without a command line."""
    if not api_key and host not in LOOPBACK_HOSTS:
        log.warning(
            "serving on %s without an API key: anyone who can reach the port %s; set --api-key-file (or %s)",
            host,
            exposes,
            env,
        )


def read_api_key_file(path: str | os.PathLike[str], *, flag: str = "--api-key-file") -> str:
    """The key held in a file (surrounding whitespace dropped): a regular, non-empty file. A file other
    users can read is used with a warning (``chmod 600`` it)."""
    p = Path(path)
    try:
        st = p.stat()
    except OSError as exc:
        raise ValueError(f"{flag}: cannot read {str(path)!r}: {exc.strerror}") from None
    if not stat.S_ISREG(st.st_mode):
        raise ValueError(f"{flag}: {str(path)!r} is not a regular file")
    if st.st_size > 4096:
        raise ValueError(f"{flag}: {str(path)!r} holds {st.st_size} bytes; an API key file holds one key")
    key = p.read_text(encoding="utf-8").strip()
    if not key or any(c.isspace() for c in key):
        raise ValueError(f"{flag}: {str(path)!r} must hold one key (no spaces or line breaks inside it)")
    if st.st_mode & 0o077:
        log.warning("%s: %s can be read by other users; chmod 600 it", flag, path)
    return key


def resolve_api_key(
    value: str | None, *, file: str | os.PathLike[str] | None = None, env: str | None = None, flag: str = "--api-key"
) -> str | None:
    """The server's key from exactly one of ``--api-key`` (``value``), ``--api-key-file`` (``file``) or the
    environment variable ``env`` (used only when neither flag is given); ``None`` when none is set."""
    if value is not None and file is not None:
        raise ValueError(f"{flag} and {flag}-file both given: pass the key one way")
    if file is not None:
        return read_api_key_file(file, flag=f"{flag}-file")
    if value is not None:
        if not value.strip() or any(c.isspace() for c in value):
            raise ValueError(f"{flag}: the key must be non-empty and hold no spaces")
        return value
    from_env = (os.environ.get(env) or "").strip() if env else ""
    return from_env or None


class ApiKeyGuard:
    """ASGI middleware: every HTTP request and WebSocket but ``open_paths`` (a path equal to one, or under
    one followed by ``/`` or, for names ending in ``*``, any path starting with it) carries
    ``Authorization: Bearer KEY``, compared in constant time; else 401 (a WebSocket is closed with 1008
    before it is accepted: the client sees HTTP 403)."""

    def __init__(
        self,
        app: ASGIApp,
        api_key: str,
        open_paths: Collection[str] = (),
        refusal: dict[str, Any] | None = None,
    ):
        if not api_key:
            raise ValueError("ApiKeyGuard needs a non-empty key")
        self.app, self.refusal = app, refusal
        self.expected = f"Bearer {api_key}".encode()
        self.open_paths = tuple(open_paths)

    def is_open(self, path: str) -> bool:
        for p in self.open_paths:
            if p.endswith("*") and path.startswith(p[:-1]) or path == p or path.startswith(p.rstrip("/") + "/"):
                return True
        return False

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind = scope["type"]
        if kind not in ("http", "websocket") or self.is_open(scope.get("path", "")):
            await self.app(scope, receive, send)
            return
        if kind == "http" and scope.get("method") == "OPTIONS":
            await self.app(scope, receive, send)
            return
        given = (_header(scope, b"authorization") or "").encode("latin-1")
        if hmac.compare_digest(given, self.expected):
            await self.app(scope, receive, send)
            return
        if kind == "websocket":
            await send({"type": "websocket.close", "code": 1008, "reason": "Unauthorized"})
            return
        await _respond(send, 401, "missing or wrong API key: send 'Authorization: Bearer KEY'", self.refusal)
