"""One MCP session (:class:`Connection`): the SDK's ``Client`` owned by a task of its own, the transports
(a child process over stdio, streamable HTTP, or a session in the episode's sandbox) and the
conversion of the server's results into what the model reads.

The client lives in one task because anyio's scopes must close in the task that opened them, while
an episode's tool calls come from many; that task holds the transport open until :meth:`Connection.close`.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import os
from collections.abc import AsyncIterator, Callable
from typing import Any

from agentrl.mcp.server_spec import Listing, MCPServerError, MCPServerSpec
from agentrl.sandbox.base import Session
from agentrl.tool import ToolResult

__all__ = ["MAX_RESULT_CHARS", "Connection"]

MAX_RESULT_CHARS = 64 * 1024
"""The most characters of a call's result the model reads; the rest is cut with a note saying so
(a server that returns a whole file or page would otherwise fill the context window, or the memory)."""


class Connection:
    """One MCP session on the running loop: a child process, an HTTP session, or a sandbox session."""

    def __init__(self, spec: MCPServerSpec, stream: Session | None) -> None:
        self.spec, self.stream = spec, stream
        self.loop = asyncio.get_running_loop()
        self.client: Any = None
        self.broken: str | None = None
        self.stage = "start"  # "start" (the transport opening), then "handshake" (initialize sent): for messages
        self._stop = asyncio.Event()
        self._ready: asyncio.Future[None] = self.loop.create_future()
        self._ready.add_done_callback(lambda f: f.cancelled() or f.exception())  # read here: never "unretrieved"
        self._task = self.loop.create_task(self._run(), name=f"agentrl-mcp {spec.describe()}")

    def usable(self, loop: asyncio.AbstractEventLoop) -> bool:
        return self.loop is loop and self.broken is None and not self._task.done()

    async def ready(self) -> None:
        """Wait for the handshake (shielded: a caller's timeout does not abort a starting server).

        :meth:`_run` time-limits the handshake itself; the longer wait here only backs that up (a
        transport that ignores cancellation), and then the task is cancelled, not left running.
        """
        backup = self.spec.connect_timeout + 10.0
        try:
            await asyncio.wait_for(asyncio.shield(self._ready), backup)
        except TimeoutError:  # only this wait's own deadline: a caller's timeout arrives as a cancellation
            if not self._ready.done():
                self._fail(
                    f"did not start: the handshake went on {backup:g}s, past connect_timeout "
                    f"({self.spec.connect_timeout:g}s): its transport did not stop when that expired"
                )
                self._task.cancel()
        await self._ready  # the handshake's outcome: None, or the MCPServerError saying why it failed

    async def _run(self) -> None:
        deadline = asyncio.timeout(self.spec.connect_timeout)
        try:
            _import_sdk()  # before the deadline: the SDK's first import takes seconds on a busy machine
            async with contextlib.AsyncExitStack() as stack:
                try:
                    async with deadline:
                        self.client = await _open_client(stack, self.spec, self.stream, self._opened)
                except BaseException:
                    if deadline.expired() and not _cancelled_from_outside():
                        # the stack's exit ends the transport (the child process) before we return
                        self._fail(self._late())
                        return
                    raise  # not connect_timeout's doing (another deadline, a dead server): said as it is
                self.stage = "ready"
                self._ready.set_result(None)
                await self._stop.wait()
        except BaseException as e:  # the server failed (or the loop is shutting down: then re-raised)
            self._fail(f"{_STAGES.get(self.stage, self.stage)}: {_why(e)}" if self.stage != "ready" else _why(e))
            if isinstance(e, (asyncio.CancelledError, KeyboardInterrupt, SystemExit)):
                raise
        finally:
            self.client = None
            self._fail("closed")

    def _opened(self) -> None:
        """The transport is open (the child process runs, the HTTP client exists): the handshake begins."""
        self.stage = "handshake"

    def _late(self) -> str:
        """What connect_timeout cut short, said so that the fix is plain: the start, or the handshake's answer."""
        limit = f"{self.spec.connect_timeout:g}s (connect_timeout)"
        if self.stage == "start":
            what = "its session in the sandbox" if self.stream is not None else "its transport"
            return f"did not start: {what} did not open within {limit}"
        asked = "initialize" if self.spec.protocol == "legacy" else "the protocol negotiation (server/discover)"
        if self.spec.url is not None:
            return f"did not answer {asked} within {limit}: nothing came back from {self.spec.url}"
        return (
            f"did not answer {asked} within {limit}: its process started but never answered the handshake "
            "(stuck before it, or slower to start than connect_timeout allows)"
        )

    def _fail(self, reason: str) -> None:
        """Mark the session broken for ``reason`` ("did not ..." says it whole; else it did not start for it)."""
        self.broken = self.broken or reason
        if not self._ready.done():
            said = reason if reason.startswith("did not ") else f"did not start: {reason}"
            self._ready.set_exception(MCPServerError(f"MCP server {self.spec.describe()!r} {said}"))
        self.stop()

    def stop(self) -> None:
        """Ask the owning task to close the session (from any thread; idempotent)."""
        if not self.loop.is_closed():
            with contextlib.suppress(RuntimeError):
                self.loop.call_soon_threadsafe(self._stop.set)

    async def close(self, timeout: float = 10.0) -> None:
        """Close the session and wait for it (the child process is gone when this returns).

        A task that does not end within ``timeout`` seconds is cancelled. If the caller is cancelled
        meanwhile, the task is cancelled too and the caller's cancellation goes on (never swallowed).
        """
        self.stop()
        if asyncio.get_running_loop() is not self.loop:
            return  # another loop's: its task ends when that loop runs again or closes
        try:
            await asyncio.wait([self._task], timeout=timeout)  # never raises the task's own outcome
            if not self._task.done():
                self._task.cancel()
                await asyncio.wait([self._task], timeout=5.0)  # its cleanup ends the child process
        except asyncio.CancelledError:
            self._task.cancel()
            raise

    async def list_tools(self) -> Listing:
        """Every page of ``tools/list``, all within ``connect_timeout`` (a server that answers the
        handshake but never its listing would otherwise hang :func:`~agentrl.mcp.mcp_tools` for good)."""
        out: list[tuple[str, str, dict[str, Any]]] = []
        cursor = None
        deadline = asyncio.timeout(self.spec.connect_timeout)
        try:
            async with deadline:
                for _ in range(1000):  # a server whose pages never end must not hang the listing
                    page = await self._request("tools/list", "list_tools", cursor=cursor)
                    if isinstance(page, ToolResult):
                        raise MCPServerError(f"MCP server {self.spec.describe()!r}: {page.content}")
                    out += [_described(t) for t in page.tools]
                    cursor = page.next_cursor
                    if not cursor:
                        break
        except TimeoutError:
            if not deadline.expired():
                raise
            reason = f"did not answer tools/list within {self.spec.connect_timeout:g}s (connect_timeout)"
            self._fail(reason)
            raise MCPServerError(
                f"MCP server {self.spec.describe()!r} {reason}: it answered the handshake, then not its tool listing"
            ) from None
        return tuple(out)

    async def call(self, name: str, arguments: dict[str, Any]) -> ToolResult:
        result = await self._request(f"tools/call {name}", "call_tool", name, arguments)
        if not isinstance(result, ToolResult):
            result = _to_result(result, self.spec.describe())
        return _capped(result)

    async def _request(self, what: str, method: str, *args: Any, **kwargs: Any) -> Any:
        """Send one request; a JSON-RPC error becomes an error result, a dead server :class:`MCPServerError`."""
        from mcp.shared.exceptions import MCPError

        if self.client is None:
            raise MCPServerError(f"MCP server {self.spec.describe()!r} is not connected ({self.broken})")
        try:
            return await getattr(self.client, method)(*args, **kwargs)
        except MCPError as e:
            if e.error.message != "Connection closed" and self.broken is None:
                text = f"Error: {what.split(' ', 1)[-1]}: {e.error.message}"
                return ToolResult(text, is_error=True, metadata={"error": "tool_error", "mcp_code": e.error.code})
            reason = f"the connection closed during {what}"
        except Exception as e:
            if self.broken is None and not self._task.done() and not _transport_failed(e):
                # the server answered, but wrongly (e.g. structured content its own output schema refuses):
                # that tool is broken, not the session, and the model can try something else
                text = f"Error: {what.split(' ', 1)[-1]}: the server's reply was invalid: {_why(e)}"
                return ToolResult(text, is_error=True, metadata={"error": "tool_error"})
            reason = f"{what} failed: {_why(e)}"  # the process died, the URL stopped answering
        self._fail(reason)
        raise MCPServerError(f"MCP server {self.spec.describe()!r}: {reason}")


async def _open_client(
    stack: contextlib.AsyncExitStack, spec: MCPServerSpec, stream: Session | None, opened: Callable[[], None]
) -> Any:
    """Enter an SDK ``Client`` (and its transport) on ``stack``; the handshake is done when it returns.
    ``opened`` is called when the transport is open, before the handshake's first message."""
    from mcp import Client, StdioServerParameters
    from mcp.client.stdio import stdio_client
    from mcp.client.streamable_http import streamable_http_client
    from mcp.shared._httpx_utils import create_mcp_http_client

    transport: Any
    if stream is not None:
        transport = _sandbox_transport(stream)
    elif spec.url is not None:
        http = await stack.enter_async_context(create_mcp_http_client(headers=dict(spec.headers)))
        transport = streamable_http_client(spec.url, http_client=http)
    else:
        errlog = stack.enter_context(open(spec.stderr or os.devnull, "a"))  # noqa: SIM115 - closed by the stack
        params = StdioServerParameters(
            command=spec.command[0], args=list(spec.command[1:]), env=dict(spec.env) or None, cwd=spec.cwd
        )
        transport = stdio_client(params, errlog=errlog)
    return await stack.enter_async_context(Client(_marked(transport, opened), mode=spec.protocol, cache=None))


def _import_sdk() -> None:
    """Import what :func:`_open_client` uses (a no-op once done)."""
    import mcp.client.stdio
    import mcp.client.streamable_http
    import mcp.shared._httpx_utils  # noqa: F401


@contextlib.asynccontextmanager
async def _marked(transport: Any, opened: Callable[[], None]) -> AsyncIterator[Any]:
    """``transport`` (an async context manager of the two streams), calling ``opened`` once it is open."""
    async with transport as streams:
        opened()
        yield streams


def _cancelled_from_outside() -> bool:
    """Whether the running task is being cancelled by someone (loop shutdown, close), not by a deadline
    (``asyncio.timeout`` takes its own cancellation back when it raises TimeoutError)."""
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0


@contextlib.asynccontextmanager
async def _sandbox_transport(stream: Session) -> AsyncIterator[tuple[Any, Any]]:
    """MCP's stdio framing (one JSON-RPC message a line) over a sandbox :class:`Session`."""
    import anyio
    import mcp_types
    from mcp.shared.message import SessionMessage

    to_client, from_server = anyio.create_memory_object_stream[Any](0)
    to_server, from_client = anyio.create_memory_object_stream[Any](0)

    async def read() -> None:
        async with to_client:
            while True:
                try:
                    line = await stream.readline(3600.0, limit=64 << 20)
                except TimeoutError:
                    continue
                except (EOFError, ValueError, OSError):
                    return  # the process exited (or wrote a line past the limit): the session sees closure
                if line.strip():
                    try:
                        message: Any = SessionMessage(mcp_types.jsonrpc_message_adapter.validate_json(line))
                    except ValueError as e:
                        message = e
                    await to_client.send(message)

    async def write() -> None:
        try:
            async with from_client:
                async for message in from_client:
                    await stream.send(
                        message.message.model_dump_json(by_alias=True, exclude_unset=True).encode() + b"\n"
                    )
        except (EOFError, OSError, anyio.BrokenResourceError, anyio.ClosedResourceError):
            await to_client.aclose()

    async with anyio.create_task_group() as tg:
        tg.start_soon(read)
        tg.start_soon(write)
        try:
            yield from_server, to_server
        finally:
            tg.cancel_scope.cancel()
            with anyio.CancelScope(shield=True):
                await stream.kill()


_STAGES = {"start": "while starting", "handshake": "during the handshake"}


def _transport_failed(e: BaseException) -> bool:
    """Whether an exception from the SDK means the transport is gone (not just one bad reply)."""
    import anyio
    import httpx

    while isinstance(e, BaseExceptionGroup) and e.exceptions:
        e = e.exceptions[0]
    gone = (OSError, EOFError, anyio.ClosedResourceError, anyio.BrokenResourceError, anyio.EndOfStream)
    return isinstance(e, (*gone, httpx.TransportError))


def _why(e: BaseException) -> str:
    """``Type: message`` of the first real error inside (anyio wraps failures in exception groups)."""
    while isinstance(e, BaseExceptionGroup) and e.exceptions:
        e = e.exceptions[0]
    return f"{type(e).__name__}: {e}"


def _described(tool: Any) -> tuple[str, str, dict[str, Any]]:
    """A listed tool as (name, description, parameters); refuses what no model could call."""
    name = getattr(tool, "name", None)
    if not isinstance(name, str) or not name:
        raise MCPServerError(f"the server listed a tool without a name: {tool!r}")
    schema = dict(tool.input_schema or {})
    schema.setdefault("type", "object")
    if not isinstance(schema.get("properties", {}), dict):
        raise MCPServerError(f"tool {name!r}: inputSchema properties must be an object, got {schema['properties']!r}")
    schema.setdefault("properties", {})
    return name, tool.description or "", schema


def _to_result(result: Any, server: str) -> ToolResult:
    """A ``CallToolResult`` as the model reads it: text parts joined, other parts named in brackets."""
    parts = [_content_text(c) for c in result.content]
    text = "\n".join(parts)
    metadata: dict[str, Any] = {"mcp_server": server}
    if result.structured_content is not None:
        metadata["structured_content"] = result.structured_content
        if not parts:
            text = json.dumps(result.structured_content, ensure_ascii=False, default=str)
    if result.is_error:
        metadata["error"] = "tool_error"
        return ToolResult(f"Error: {text or 'the tool failed and said nothing'}", is_error=True, metadata=metadata)
    return ToolResult(text, metadata=metadata)


def _capped(result: ToolResult) -> ToolResult:
    """The result with text the model can read: at most :data:`MAX_RESULT_CHARS`, valid UTF-8."""
    text = result.content.encode("utf-8", "replace").decode("utf-8")  # a lone surrogate becomes "?"
    if len(text) > MAX_RESULT_CHARS:
        note = f"\n[... cut: the result had {len(text)} characters; only the first {MAX_RESULT_CHARS} are shown]"
        text = text[:MAX_RESULT_CHARS] + note
        result.metadata["truncated"] = True
        result.metadata.pop("structured_content", None)  # as large; the logs need not keep it either
    result.content = text
    return result


def _content_text(content: Any) -> str:
    kind = getattr(content, "type", "?")
    if kind == "text":
        return str(content.text)
    if kind in ("image", "audio"):
        size = len(base64.b64decode(content.data, validate=False)) if isinstance(content.data, str) else 0
        return f"[{kind}: {content.mime_type}, {size} bytes]"
    if kind == "resource_link":
        return f"[resource link: {content.uri}" + (f" ({content.name})" if content.name else "") + "]"
    if kind == "resource":
        res = content.resource
        if isinstance(getattr(res, "text", None), str):
            return str(res.text)
        return f"[resource: {res.uri}, {res.mime_type or 'binary'}]"
    return f"[{kind} content]"
