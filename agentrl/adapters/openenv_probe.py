"""Reaching an OpenEnv server before any episode: its address checked, its ``/schema`` and ``/metadata`` read.

Part of :mod:`agentrl.adapters.openenv` (kept apart to keep that file readable): ``load_env("openenv:URL")``
calls :func:`probe_server` so a bad address or a server that is down is refused in one line, and
the answers are kept (:data:`SERVER_INFO`) for the episodes built next in this process. Inside a
running event loop (an env built by the rollout loop in a process that has not probed yet) the
probe is a task of that loop instead (:func:`start_probe`, aiohttp), so a slow server stalls none
of the other episodes on it, and the probe ends with the loop. Both probes share their checks and wording.

A server's API key (``agentrl env-serve --api-key-file``) is sent as ``Authorization: Bearer KEY``, the
key given to the adapter or else ``$AGENTRL_ENV_SERVE_API_KEY`` (:func:`auth_headers`); never in the
address, which logs and process lists show.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import os
import urllib.error
import urllib.request
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import aiohttp

from agentrl.adapters.openenv_actions import served_env

SERVER_INFO: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {}
"""Per server base URL: its action schema and ``/metadata`` (read once per process)."""

DIRECT_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))
"""The probe's opener: never through ``HTTP_PROXY``, as the episodes' aiohttp sessions never are."""

API_KEY_ENV = "AGENTRL_ENV_SERVE_API_KEY"
"""The key ``agentrl env-serve`` wants when started without ``--api-key``/``--api-key-file``, and the one
the ``openenv:`` adapter sends when given none (one name on both sides, as ``AGENTRL_ENGINE_API_KEY``)."""


def auth_headers(api_key: str | None = None) -> dict[str, str]:
    """The header carrying ``api_key`` (None: ``$AGENTRL_ENV_SERVE_API_KEY``); none without a key."""
    key = api_key if api_key is not None else (os.environ.get(API_KEY_ENV) or "").strip()
    return {"Authorization": f"Bearer {key}"} if key else {}


def session_urls(base_url: str) -> tuple[str, str]:
    """``(http_base, ws_url)`` for a server address; ``http(s)://`` and ``ws(s)://`` are both accepted."""
    parts = urlsplit(base_url if "://" in base_url else f"http://{base_url}")
    if "@" in parts.netloc:  # not echoed: it holds a password
        raise ValueError(
            f"an OpenEnv server address with user:password@ is not used: put the key in ${API_KEY_ENV} "
            "instead (an address shows in logs and process lists); the address is http://HOST:PORT"
        )
    schemes = {"http": ("http", "ws"), "https": ("https", "wss"), "ws": ("http", "ws"), "wss": ("https", "wss")}
    if parts.scheme not in schemes or not parts.hostname:
        raise ValueError(f"OpenEnv server address {base_url!r}: expected http://HOST:PORT (or https://, ws://, wss://)")
    try:
        parts.port  # noqa: B018 (read for its check: a port that is not a number 0-65535 raises here)
    except ValueError as exc:
        raise ValueError(
            f"OpenEnv server address {base_url!r}: bad port ({exc}): expected http://HOST:PORT, PORT a number"
        ) from None
    http_scheme, ws_scheme = schemes[parts.scheme]
    path = parts.path.rstrip("/")
    return (
        urlunsplit((http_scheme, parts.netloc, path, "", "")),
        urlunsplit((ws_scheme, parts.netloc, path + "/ws", "", "")),
    )


def probe_server(base_url: str, timeout: float = 5.0, api_key: str | None = None) -> dict[str, Any]:
    """``GET /schema`` of the server, synchronously; a ValueError (one line, saying what to fix) when
    it is unreachable or not an OpenEnv server (or a served agentrl env whose ``/metadata`` is broken).
    ``load_env("openenv:URL")`` calls it, so a bad address is refused before any episode starts;
    it also keeps the schema and ``/metadata`` for the envs built next in this process. It goes to the
    server directly, never through ``HTTP_PROXY`` (as the episodes do), so what it finds is what they find.
    ``api_key``: the server's key (None: ``$AGENTRL_ENV_SERVE_API_KEY``, :func:`auth_headers`)."""
    http_url, _ = session_urls(base_url)
    headers = auth_headers(api_key)
    schema = _read_schema(http_url, _get(f"{http_url}/schema", timeout, headers))
    metadata = _read_metadata(http_url, _get(f"{http_url}/metadata", timeout, headers))
    SERVER_INFO[http_url] = (schema["action"], metadata)
    return schema


_IN_FLIGHT: dict[str, asyncio.Task[dict[str, Any]]] = {}
"""Per server base URL: the probe running now on a loop (episodes starting together share it)."""


def start_probe(base_url: str, timeout: float, api_key: str | None = None) -> asyncio.Task[dict[str, Any]]:
    """What :func:`probe_server` does, as a task of the running loop (aiohttp); await it shielded.

    A constructor inside the rollout loop cannot wait for the server (a blocking read there would
    stall every episode on the loop for up to ``timeout`` seconds), so it starts the probe here and
    ``reset`` awaits it. Envs built while it runs on this loop share that one probe instead of
    starting their own. It is a coroutine, not a worker thread, so it ends with its loop: cancelled
    when ``asyncio.run`` returns (or on Ctrl-C) instead of keeping the process up for ``timeout``.
    What it caches, and how it words a failure, is what :func:`probe_server` does (they share the
    checks): a probe that fails (its ValueError is the task's exception) leaves nothing behind, and
    the next env's probe asks the server again.
    """
    http_url, _ = session_urls(base_url)
    loop = asyncio.get_running_loop()
    task = _IN_FLIGHT.get(http_url)
    if task is None or task.done() or task.get_loop() is not loop:
        task = loop.create_task(_probe(http_url, timeout, auth_headers(api_key)), name=f"openenv probe {http_url}")
        task.add_done_callback(lambda t: _probe_done(http_url, t))
        _IN_FLIGHT[http_url] = task
    return task


def _probe_done(http_url: str, task: asyncio.Task[dict[str, Any]]) -> None:
    if _IN_FLIGHT.get(http_url) is task:
        del _IN_FLIGHT[http_url]
    if not task.cancelled():
        task.exception()  # read here: a probe nobody awaited (its env was never reset) is no "unretrieved" error


async def _probe(http_url: str, timeout: float, headers: dict[str, str]) -> dict[str, Any]:
    """:func:`probe_server` on the loop: each request limited to ``timeout`` seconds; aiohttp sessions
    ignore ``HTTP_PROXY`` unless told otherwise, as the episodes' do."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout), headers=headers) as session:
        schema = _read_schema(http_url, await _get_async(session, f"{http_url}/schema"))
        metadata = _read_metadata(http_url, await _get_async(session, f"{http_url}/metadata"))
    SERVER_INFO[http_url] = (schema["action"], metadata)
    return schema


# -- the two transports (each returns the answer, or what went wrong on the way) and the shared checks --

Answer = tuple[int, bytes] | Exception
"""A GET's ``(HTTP status, body)``, or the transport's exception (unreachable, timed out, cut off)."""


def _get(url: str, timeout: float, headers: dict[str, str]) -> Answer:
    try:
        with DIRECT_OPENER.open(urllib.request.Request(url, headers=headers), timeout=timeout) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:  # before OSError: it is one (a URLError)
        return exc.code, b""
    except (OSError, TimeoutError, http.client.HTTPException) as exc:
        return exc


async def _get_async(session: aiohttp.ClientSession, url: str) -> Answer:
    try:
        async with session.get(url) as resp:
            return resp.status, await resp.read()
    except (TimeoutError, aiohttp.ClientError, OSError) as exc:
        return exc


def _reason(exc: Exception) -> Any:
    """What went wrong on the way, as both transports word it (a timeout is "timed out" on either)."""
    if isinstance(exc, TimeoutError):
        return "timed out"
    return getattr(exc, "reason", None) or exc


def _read_schema(http_url: str, answer: Answer) -> dict[str, Any]:
    """The ``/schema`` answer checked: the schema, else a ValueError saying what to fix."""
    if isinstance(answer, Exception):
        raise ValueError(
            f"cannot reach the OpenEnv server at {http_url} ({_reason(answer)}): start it "
            "(uvicorn server.app:app --host 127.0.0.1 --port N) or fix the address"
        )
    status, body = answer
    if status in (401, 403):
        raise ValueError(
            f"{http_url} answered GET /schema with HTTP {status}: it wants an API key, or refused the one sent; "
            f"set ${API_KEY_ENV} to the server's key"
        )
    if status >= 400:
        raise ValueError(
            f"{http_url} answered GET /schema with HTTP {status}: it is not an OpenEnv server "
            "(openenv-core's create_app serves /schema and /ws); check the address and port"
        )
    try:
        schema = json.loads(body)
    except ValueError:
        raise ValueError(f"{http_url}/schema did not answer JSON: it is not an OpenEnv server") from None
    if not isinstance(schema, dict) or not isinstance(schema.get("action"), dict):
        raise ValueError(f"{http_url}/schema has no 'action' schema: it is not an OpenEnv server")
    return schema


def _read_metadata(http_url: str, answer: Answer) -> dict[str, Any]:
    """The ``/metadata`` answer checked. Optional in OpenEnv (an HTTP error: none), but a timeout or a
    broken answer is not "none": it raises, so nothing is cached (an agentrl-served env read as a plain
    OpenEnv server would lose its tools silently); a served env's broken marker is refused naming the field."""
    if isinstance(answer, Exception):
        raise ValueError(f"{http_url}/metadata did not answer ({_reason(answer)}); try again")
    status, body = answer
    if status >= 400:
        return {}
    try:
        metadata = json.loads(body)
    except ValueError as exc:
        raise ValueError(f"{http_url}/metadata did not answer ({exc}); try again") from None
    metadata = metadata if isinstance(metadata, dict) else {}
    served_env(metadata)
    return metadata
