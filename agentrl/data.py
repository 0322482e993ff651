"""Rows from files: task rows and demonstration rows, read the same way whatever the format.

Users already hold their data as JSON Lines, a JSON list, Parquet, CSV, or a Hugging Face ``datasets``
folder written by ``save_to_disk``. :func:`read_rows` yields each row as a dict together with where
it came from (``file:line`` for JSON Lines and CSV, ``file[row]`` otherwise), so every refusal further
down can name the exact row to fix. Parquet files and ``datasets`` folders are read through the
``datasets`` library (``pip install datasets``), imported only for them; JSON and CSV are read here, so
that a broken line is named by its line number and CSV cells stay the text they hold.

Keys may be nested, as verl's parquet files hold them: ``--input-key extra_info.question`` or
``--label-key reward_model.ground_truth`` walk into dicts (and lists, by index) with dots; a key that
exists as written (dots included) wins. See :func:`lookup`.

Rows are data: reading them runs no code. A task row naming code (slime's ``generate_function_path``)
is refused, naming the row, unless the user trusts the rows (``trust_row_code``, ``--trust-row-code``).
"""

from __future__ import annotations

import csv
import inspect
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from agentrl.user_code import load_function

__all__ = ["load_tasks", "lookup", "read_rows", "task_from_row", "task_rows", "untrusted_row_code"]

_MISSING = object()


def read_rows(path: str | Path) -> Iterator[tuple[str, dict[str, Any]]]:
    """Yield ``(where, row)`` for every row of ``path``; a row that is not a JSON object is refused.

    ``.jsonl`` (and any other suffix): one object per line (blank lines skipped). ``.json``: a list of
    objects, or JSON Lines (what ``datasets``' ``to_json`` writes under that name). ``.parquet`` and
    ``.csv``: one row per record (every CSV cell is the text it holds: ``007`` stays ``"007"``, an empty cell ``""``). A folder: a
    ``datasets`` dataset saved with ``save_to_disk`` (a ``DatasetDict`` is refused unless it has
    exactly one split: name the split's folder). A file the library cannot read is refused with its path.
    """
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"{path}: No such file or folder")
    if p.is_dir():
        yield from _datasets_rows(p)
    elif p.suffix == ".json":
        yield from _json_rows(p)
    elif p.suffix == ".parquet":
        try:
            ds = _datasets().Dataset.from_parquet(str(p))
        except Exception as exc:  # pyarrow's errors name neither the file nor what to do
            raise ValueError(f"{path}: not a readable parquet file ({type(exc).__name__}: {exc})") from None
        for i, row in enumerate(ds):
            yield _checked(f"{path}[{i}]", row)
    elif p.suffix == ".csv":
        yield from _csv_rows(p)
    else:  # .jsonl, and any other name: JSON Lines, as task files always were read
        yield from _jsonl_rows(p)


def _csv_rows(p: Path) -> Iterator[tuple[str, dict[str, Any]]]:
    """Every cell as the text it holds, each row named by its line. Read here rather than through pandas
    (which ``datasets`` uses): its type inference turns ``007`` into 7 and a column with a gap into floats,
    and a label must stay what the file says."""
    with open(p, encoding="utf-8-sig", newline="") as f:  # utf-8-sig: Excel writes a BOM before the header
        reader = csv.reader(f)
        header = next(reader, None)
        if not header:
            raise ValueError(f"{p}: an empty CSV file (the first line must name the columns)")
        if len(set(header)) != len(header):
            raise ValueError(f"{p}:1: repeated column names in {header}")
        for cells in reader:
            where = f"{p}:{reader.line_num}"
            if not cells:
                continue
            if len(cells) != len(header):
                raise ValueError(f"{where}: {len(cells)} cells for {len(header)} columns {header}")
            yield where, dict(zip(header, cells))


def _json_rows(p: Path) -> Iterator[tuple[str, dict[str, Any]]]:
    text = p.read_text(encoding="utf-8")
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        first = text.lstrip()[:1]
        if first == "{":  # JSON Lines under a .json name (datasets' to_json default)
            yield from _jsonl_rows(p)
            return
        raise ValueError(f"{p}: not valid JSON ({exc})") from None
    if isinstance(data, dict) and len(text.strip().splitlines()) == 1:  # JSON Lines of one row
        data = [data]
    if not isinstance(data, list):
        raise ValueError(f"{p}: a .json file must hold a list of objects, or one object per line")
    for i, row in enumerate(data):
        yield _checked(f"{p}[{i}]", row)


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
    try:
        ds = _datasets().load_from_disk(str(p))
    except FileNotFoundError as exc:  # a folder that is not a saved dataset
        raise ValueError(f"{p}: not a datasets folder written by save_to_disk ({exc})") from None
    if hasattr(ds, "keys") and not hasattr(ds, "features"):  # a DatasetDict
        splits = list(ds.keys())
        if len(splits) != 1:
            raise ValueError(f"{p}: a DatasetDict with splits {splits}; pass one split's folder ({p}/{splits[0]})")
        ds = ds[splits[0]]
    for i, row in enumerate(ds):
        yield _checked(f"{p}[{i}]", row)


# -- task rows: what an env's reset() receives as options --------------------------------------------


def load_tasks(
    path: str | Path, *, input_key: str = "prompt", label_key: str = "label", trust_row_code: bool = False
) -> list[dict[str, Any]]:
    """Read task rows (JSONL, JSON list, Parquet or a ``datasets`` folder: :func:`agentrl.data.read_rows`);
    each row keeps all its keys plus ``prompt`` and ``label``.

    A row that is not a JSON object, or lacks ``input_key``, is refused with its line (or row) number; so
    is a row naming code (``generate_function_path``) unless ``trust_row_code`` (:func:`task_from_row`).
    """
    rows = [
        task_from_row(row, input_key=input_key, label_key=label_key, where=where, trust_row_code=trust_row_code)
        for where, row in read_rows(path)
    ]
    if not rows:
        raise ValueError(f"{path}: no tasks")
    return rows


def task_from_row(
    row: dict[str, Any],
    *,
    input_key: str = "prompt",
    label_key: str = "label",
    where: str = "task",
    trust_row_code: bool = False,
) -> dict[str, Any]:
    """A task row as env options: every key, with ``prompt``/``label`` taken from the given keys.

    Both keys may be dotted paths into nested values (:func:`lookup`). A row without ``input_key``, or
    with a null there, is refused naming the row, the key and the keys it has. A missing label is
    ``None`` under the default ``label`` key (envs that need one say so); a ``label_key`` the user
    named must hold a value in every row (a typo would otherwise make every label ``None`` silently).

    A row's ``generate_function_path`` (slime's per-row generate function) names code that is imported
    and run. Task files travel like data (downloaded, shared, generated), so reading one must not run
    anything: such a row is refused before any import unless ``trust_row_code`` (``--trust-row-code``),
    the opt-in Hugging Face calls ``trust_remote_code``; with it the function is imported and checked here.
    """
    prompt = lookup(row, input_key, _MISSING)
    if prompt is _MISSING:
        raise ValueError(f"{where}: no {input_key!r} key (set --input-key); {_keys_hint(row, input_key)}")
    if prompt is None:  # Parquet fills a nested key a row lacks with null: a prompt "None" is no task
        raise ValueError(f"{where}: {input_key!r} is null (set --input-key, or drop the row)")
    label = lookup(row, label_key, _MISSING)
    if label_key != "label" and (label is _MISSING or label is None):  # a key the user named must be there
        hint = _keys_hint(row, label_key) if label is _MISSING else "it is null"
        raise ValueError(f"{where}: no value at --label-key {label_key!r}; {hint}")
    gen = row.get("generate_function_path")
    if gen is not None and gen != "":  # the row's own generate function (slime's); "": a CSV row without one
        if not isinstance(gen, str):
            raise ValueError(f"{where}: 'generate_function_path' must be a module:fn string, not {gen!r}")
        if not trust_row_code:
            raise ValueError(untrusted_row_code(where, gen))
        try:
            fn = load_function(gen)
        except Exception as exc:  # a missing module, a syntax error in it, a missing name
            raise ValueError(f"{where}: 'generate_function_path' {gen!r}: {type(exc).__name__}: {exc}") from exc
        if not inspect.iscoroutinefunction(fn):
            raise ValueError(
                f"{where}: 'generate_function_path' {gen!r} must be an async def generate(args, sample, sampling_params)"
            )
    task = dict(row)
    task["prompt"] = prompt
    task["label"] = None if label is _MISSING else label
    return task


def lookup(row: dict[str, Any], key: str, default: Any = None) -> Any:
    """``row[key]``, or the value at a dotted path (``extra_info.question``, ``prompt.0.content``).

    Why: verl's and many Hugging Face datasets keep the question and the answer inside nested columns
    (``extra_info``, ``reward_model``); a flag naming the path saves a conversion script. A key that
    exists as written wins over the path reading; digits index lists. ``default`` when nothing is there.
    """
    if key in row:
        return row[key]
    value: Any = row
    for part in key.split("."):
        if isinstance(value, dict) and part in value:
            value = value[part]
        elif isinstance(value, list) and part.isdigit() and int(part) < len(value):
            value = value[int(part)]
        else:
            return default
    return value


def _keys_hint(row: dict[str, Any], key: str) -> str:
    """Where the path stopped, and what keys were there (so the fix is one edit)."""
    value: Any = row
    walked: list[str] = []
    for part in key.split("."):
        if isinstance(value, dict) and part in value:
            value, walked = value[part], walked + [part]
            continue
        at = ".".join(walked) or "the row"
        if isinstance(value, dict):
            return f"keys of {at} are {sorted(value)}"
        return f"{at} is a {type(value).__name__}, not an object"
    return f"keys are {sorted(row)}"


def task_rows(
    factory: Any,
    prompt_data: str | Path | None,
    *,
    input_key: str = "prompt",
    label_key: str = "label",
    env_name: str | None = None,
    trust_row_code: bool = False,
) -> list[dict[str, Any]]:
    """The tasks of a run: ``prompt_data`` (JSONL) if given, else the env class's own ``tasks()``.

    ``trust_row_code``: accept rows naming code to run (:func:`task_from_row`); the env's own rows too,
    as an env's ``tasks()`` often hands over rows of a dataset it read."""
    if prompt_data:
        return load_tasks(prompt_data, input_key=input_key, label_key=label_key, trust_row_code=trust_row_code)
    source = getattr(factory, "tasks", None)
    if source is None:
        raise ValueError("no tasks: pass --prompt-data FILE.jsonl (the env has no tasks() of its own)")
    where = f"{env_name}.tasks()"
    return [
        task_from_row(r, input_key=input_key, label_key=label_key, where=f"{where}[{i}]", trust_row_code=trust_row_code)
        for i, r in enumerate(source())
    ]


def untrusted_row_code(where: str, spec: str) -> str:
    """The refusal of a row that names code while rows are not trusted: the row, the key, the flag."""
    return (
        f"{where}: 'generate_function_path' {spec!r} names code to import and run; task rows are data and run "
        "no code unless you trust them: pass --trust-row-code (trust_row_code=True) to run rows' own generate "
        "functions (slime's per-row generate_function_path) if you trust whoever wrote these rows, else drop the key"
    )
