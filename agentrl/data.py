"""Rows from files: task rows and demonstration rows, read the same way whatever the format.

Users already hold their data as JSON Lines, a JSON list, Parquet, or a Hugging Face ``datasets``
folder written by ``save_to_disk``. :func:`read_rows` yields each row as a dict together with where
it came from (``file:line`` for JSON Lines, ``file[row]`` otherwise), so every refusal further down
can name the exact row to fix. Parquet and ``datasets`` folders need the ``datasets`` package
(``pip install datasets``); it is imported only for them.
"""

from __future__ import annotations

import inspect
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

__all__ = ["load_tasks", "read_rows", "task_from_row", "task_rows"]


def read_rows(path: str | Path) -> Iterator[tuple[str, dict[str, Any]]]:
    """Yield ``(where, row)`` for every row of ``path``; a row that is not a JSON object is refused.

    ``.jsonl`` (and any other suffix): one object per line (blank lines skipped). ``.json``: a list of objects.
    ``.parquet``: one row per record. A folder: a ``datasets`` dataset saved with ``save_to_disk``
    (a ``DatasetDict`` is refused unless it has exactly one split: name the split's folder).
    """
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"{path}: No such file or folder")
    if p.is_dir():
        yield from _datasets_rows(p)
    elif p.suffix == ".json":
        try:
            data = json.loads(p.read_text(encoding="utf-8"))
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}: not valid JSON ({exc})") from None
        if not isinstance(data, list):
            raise ValueError(f"{path}: a .json file must hold a list of objects (use .jsonl for one per line)")
        for i, row in enumerate(data):
            yield _checked(f"{path}[{i}]", row)
    elif p.suffix == ".parquet":
        ds = _datasets().Dataset.from_parquet(str(p))
        for i, row in enumerate(ds):
            yield _checked(f"{path}[{i}]", row)
    else:  # .jsonl, and any other name: JSON Lines, as task files always were read
        yield from _jsonl_rows(p)


def _jsonl_rows(p: Path) -> Iterator[tuple[str, dict[str, Any]]]:
    with open(p, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{p}:{n}: not valid JSON ({exc})") from None
            yield _checked(f"{p}:{n}", row)


def _checked(where: str, row: Any) -> tuple[str, dict[str, Any]]:
    if not isinstance(row, dict):
        raise ValueError(f"{where}: expected a JSON object per row, got {type(row).__name__}")
    return where, row


def _datasets() -> Any:
    try:
        import datasets
    except ImportError:
        raise ImportError(
            "reading Parquet files and datasets folders needs the `datasets` package: pip install datasets"
        ) from None
    return datasets


def _datasets_rows(p: Path) -> Iterator[tuple[str, dict[str, Any]]]:
    ds = _datasets().load_from_disk(str(p))
    if hasattr(ds, "keys") and not hasattr(ds, "features"):  # a DatasetDict
        splits = list(ds.keys())
        if len(splits) != 1:
            raise ValueError(f"{p}: a DatasetDict with splits {splits}; pass one split's folder ({p}/{splits[0]})")
        ds = ds[splits[0]]
    for i, row in enumerate(ds):
        yield _checked(f"{p}[{i}]", row)


# -- task rows: what an env's reset() receives as options --------------------------------------------


def load_tasks(path: str | Path, *, input_key: str = "prompt", label_key: str = "label") -> list[dict[str, Any]]:
    """Read task rows (JSONL, JSON list, Parquet or a ``datasets`` folder: :func:`agentrl.data.read_rows`);
    each row keeps all its keys plus ``prompt`` and ``label``.

    A row that is not a JSON object, or lacks ``input_key``, is refused with its line (or row) number.
    """
    rows = [task_from_row(row, input_key=input_key, label_key=label_key, where=where) for where, row in read_rows(path)]
    if not rows:
        raise ValueError(f"{path}: no tasks")
    return rows


def task_from_row(
    row: dict[str, Any], *, input_key: str = "prompt", label_key: str = "label", where: str = "task"
) -> dict[str, Any]:
    """A task row as env options: every key, with ``prompt``/``label`` taken from the given keys."""
    if input_key not in row:
        raise ValueError(f"{where}: no {input_key!r} key (set --input-key); keys are {sorted(row)}")
    gen = row.get("generate_function_path")
    if gen is not None:  # this row's own generate function (slime's Sample.generate_function_path)
        from agentrl.registry import load_function

        if not isinstance(gen, str):
            raise ValueError(f"{where}: 'generate_function_path' must be a module:fn string, not {gen!r}")
        try:
            fn = load_function(gen)
        except Exception as exc:  # a missing module, a syntax error in it, a missing name
            raise ValueError(f"{where}: 'generate_function_path' {gen!r}: {type(exc).__name__}: {exc}") from exc
        if not inspect.iscoroutinefunction(fn):
            raise ValueError(
                f"{where}: 'generate_function_path' {gen!r} must be an async def generate(args, sample, sampling_params)"
            )
    task = dict(row)
    task["prompt"] = row[input_key]
    task["label"] = row.get(label_key)
    return task


def task_rows(
    factory: Any,
    prompt_data: str | Path | None,
    *,
    input_key: str = "prompt",
    label_key: str = "label",
    env_name: str | None = None,
) -> list[dict[str, Any]]:
    """The tasks of a run: ``prompt_data`` (JSONL) if given, else the env class's own ``tasks()``."""
    if prompt_data:
        return load_tasks(prompt_data, input_key=input_key, label_key=label_key)
    source = getattr(factory, "tasks", None)
    if source is None:
        raise ValueError("no tasks: pass --prompt-data FILE.jsonl (the env has no tasks() of its own)")
    return [task_from_row(r, input_key=input_key, label_key=label_key, where=f"{env_name}.tasks()") for r in source()]
