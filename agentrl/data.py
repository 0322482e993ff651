"""Rows from files: task rows and demonstration rows, read the same way whatever the format.

Users already hold their data as JSON Lines, a JSON list, Parquet, or a Hugging Face ``datasets``
folder written by ``save_to_disk``. :func:`read_rows` yields each row as a dict together with where
it came from (``file:line`` for JSON Lines, ``file[row]`` otherwise), so every refusal further down
can name the exact row to fix. Parquet and ``datasets`` folders need the ``datasets`` package
(``pip install datasets``); it is imported only for them.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

__all__ = ["read_rows"]


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
