"""The ``read_file`` and ``write_file`` tools: text files in the episode's scratch directory.

Models write code and data far more reliably as a file's whole content than as shell heredocs
(quoting breaks), and read files more cheaply than through ``cat`` (no shell, a size cap they
choose). Both tools work on ``/scratch`` only: paths are relative to it (a leading ``/scratch/`` is
accepted), and absolute paths or ``..`` escapes are refused with a message saying so. Files are
shared with the ``python`` and ``bash`` tools of the same episode.

Reading is capped (``max_bytes``, default the sandbox config's ``max_output_bytes``); a longer file
is cut with a note saying how to read the rest. A file that is not UTF-8 text is shown with a note
and its bytes escaped, never as raw binary in the model's context.
"""

from __future__ import annotations

from typing import Any

from agentrl.sandbox import Sandbox, check_relative_path
from agentrl.tool import Tool, ToolError, ToolResult

__all__ = ["ReadFileTool", "WriteFileTool", "read_file", "write_file"]

BINARY_PREVIEW = 1024
"""Bytes of a binary file shown (escaped) after the note."""


def _relative(tool: str, path: Any) -> str:
    try:
        rel = check_relative_path(path)
    except ValueError as e:
        raise ToolError(f"{tool}: {e}") from None
    if rel == ".":
        raise ToolError(f"{tool}: {path!r} is the scratch directory itself; give a file path such as 'notes.txt'")
    return rel


def _os_error(tool: str, path: str, e: OSError) -> ToolError:
    """A sentence for what went wrong with ``path`` (missing, a directory, no space, ...)."""
    if isinstance(e, FileNotFoundError):
        return ToolError(f"{tool}: no file {path!r} in /scratch; list the files with bash, e.g. `ls -la`")
    if isinstance(e, IsADirectoryError):
        return ToolError(f"{tool}: {path!r} is a directory; list it with bash, e.g. `ls -la {path}`")
    if isinstance(e, NotADirectoryError):
        return ToolError(f"{tool}: a parent of {path!r} is a file, not a directory")
    if isinstance(e, PermissionError):
        return ToolError(f"{tool}: permission denied for {path!r}")
    return ToolError(f"{tool}: cannot access {path!r}: {e.strerror or e}")


def _decode(data: bytes) -> tuple[str, bool]:
    """(text, is_text): strict UTF-8, except that a character cut at the very end is dropped."""
    if b"\x00" in data:
        return "", False
    try:
        return data.decode("utf-8"), True
    except UnicodeDecodeError as e:
        if e.start >= len(data) - 3 and e.reason == "unexpected end of data":
            return data[: e.start].decode("utf-8", errors="strict"), True
        return "", False


class ReadFileTool(Tool):
    """Reads a text file from ``/scratch``; ``max_read_bytes`` caps what the model may ask for."""

    name = "read_file"
    sandboxed = True

    def __init__(self, *, max_read_bytes: int = 262_144) -> None:
        if max_read_bytes <= 0:
            raise ValueError("ReadFileTool: max_read_bytes must be > 0")
        self.max_read_bytes = int(max_read_bytes)
        self.description = (
            "Read a text file from /scratch (the working directory shared with the python and bash tools). "
            "`path` is relative to /scratch. Returns the file's content, cut after `max_bytes` bytes "
            f"(default about 16 KB, at most {self.max_read_bytes}) with a note when the file is longer."
        )
        self.parameters = {
            "type": "object",
            "properties": {
                "path": {"type": "string", "description": 'file path relative to /scratch, e.g. "src/main.py"'},
                "max_bytes": {
                    "type": "integer",
                    "description": f"read at most this many bytes (at most {self.max_read_bytes})",
                },
            },
            "required": ["path"],
        }

    async def __call__(self, *, sandbox: Sandbox, path: str, max_bytes: int | None = None) -> ToolResult:  # type: ignore[override]
        rel = _relative(self.name, path)
        if max_bytes is None:
            limit = min(int(sandbox.config.max_output_bytes), self.max_read_bytes)
        elif isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes <= 0:
            raise ToolError(f"read_file: 'max_bytes' must be a positive integer, got {max_bytes!r}")
        else:
            limit = min(max_bytes, self.max_read_bytes)
        try:
            data = await sandbox.read_file(rel, max_bytes=limit + 1)
        except ValueError as e:  # an escape, a planted symlink, a directory or a device
            hint = f"; to list a directory use bash, e.g. `ls -la {rel}`" if "link" not in str(e) else ""
            raise ToolError(f"read_file: {e}{hint}") from None
        except OSError as e:
            raise _os_error(self.name, rel, e) from None
        cut = len(data) > limit
        data = data[:limit]
        metadata = {"bytes": len(data), "truncated": cut, "path": rel}
        text, is_text = _decode(data)
        if not is_text:
            note = (
                f"[{rel!r} is not UTF-8 text (a binary file); the first {min(len(data), BINARY_PREVIEW)} bytes "
                "are shown escaped. Use python to inspect binary files.]"
            )
            preview = "".join(chr(b) if 32 <= b < 127 or b in (9, 10) else f"\\x{b:02x}" for b in data[:BINARY_PREVIEW])
            return ToolResult(f"{note}\n{preview}", metadata={**metadata, "binary": True})
        if not data:
            return ToolResult(f"[{rel!r} is empty]", metadata=metadata)
        if cut:
            text += (
                f"\n[... file cut: only the first {limit} bytes are shown. Read more with a larger max_bytes "
                f"(at most {self.max_read_bytes}) or with bash, e.g. `tail -c +{limit + 1} {rel} | head -c {limit}`]"
            )
        return ToolResult(text, metadata=metadata)


class WriteFileTool(Tool):
    """Writes (creates or replaces) a text file in ``/scratch``; ``max_write_bytes`` caps its size."""

    name = "write_file"
    sandboxed = True

    def __init__(self, *, max_write_bytes: int = 4 * 1024 * 1024) -> None:
        if max_write_bytes <= 0:
            raise ValueError("WriteFileTool: max_write_bytes must be > 0")
        self.max_write_bytes = int(max_write_bytes)
        self.description = (
            "Write a text file in /scratch (the working directory shared with the python and bash tools), "
            "creating parent directories as needed and replacing the file if it exists. `path` is relative "
            "to /scratch; `content` is the whole new content of the file."
        )
        self.parameters = {
            "type": "object",
            "properties": {
                "path": {"type": "string", "description": 'file path relative to /scratch, e.g. "src/main.py"'},
                "content": {"type": "string", "description": "the complete content of the file"},
            },
            "required": ["path", "content"],
        }

    async def __call__(self, *, sandbox: Sandbox, path: str, content: str) -> ToolResult:  # type: ignore[override]
        rel = _relative(self.name, path)
        if not isinstance(content, str):
            raise ToolError(f"write_file: 'content' must be a string, got {type(content).__name__}")
        data = content.encode("utf-8", errors="replace")  # lone surrogates from JSON -> '?'
        limit = min(self.max_write_bytes, int(sandbox.config.file_size_mb) * 1024 * 1024)
        if len(data) > limit:
            raise ToolError(f"write_file: content is too large ({len(data)} bytes, at most {limit})")
        try:
            await sandbox.write_files({rel: data})
        except ValueError as e:
            raise ToolError(f"write_file: {e}") from None
        except OSError as e:
            raise _os_error(self.name, rel, e) from None
        lines = content.count("\n") + (1 if content and not content.endswith("\n") else 0)
        size = f"{len(data)} byte{'' if len(data) == 1 else 's'}, {lines} line{'' if lines == 1 else 's'}"
        return ToolResult(f"Wrote {size} to /scratch/{rel}.", metadata={"bytes": len(data), "path": rel})


read_file = ReadFileTool()
"""The ready-made instance: ``tools = [read_file]``."""

write_file = WriteFileTool()
"""The ready-made instance: ``tools = [write_file]``."""
