"""Task and demonstration rows from the formats datasets come in (issue 14 §5).

Every format is written by the library users write it with (``datasets`` for Parquet, CSV and
``save_to_disk`` folders, verl's nested parquet layout), then read back through :mod:`agentrl.data`
and, for the CLI, through ``agentrl check-env --prompt-data``.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import datasets
import pytest

from agentrl.data import load_tasks, lookup, read_rows

REPO = Path(__file__).resolve().parent.parent

ROWS = [
    {"question": "What is 2 + 3?", "answer": "5", "source": "a"},
    {"question": "What is 7 * 6?", "answer": "42", "source": "b"},
]


def _verl_rows() -> list[dict]:
    """verl's GSM8K parquet layout: a chat prompt, the answer under reward_model, the question in extra_info."""
    return [
        {
            "data_source": "openai/gsm8k",
            "prompt": [{"role": "user", "content": r["question"]}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": r["answer"]},
            "extra_info": {"split": "train", "index": i, "question": r["question"]},
        }
        for i, r in enumerate(ROWS)
    ]


def _write_all_formats(tmp: Path, rows: list[dict]) -> dict[str, Path]:
    ds = datasets.Dataset.from_list(rows)
    paths = {
        "jsonl": tmp / "t.jsonl",
        "json": tmp / "t.json",
        "json-lines": tmp / "lines.json",
        "parquet": tmp / "t.parquet",
        "folder": tmp / "folder",
        "dict-folder": tmp / "dict",
    }
    paths["jsonl"].write_text("".join(json.dumps(r) + "\n" for r in rows))
    paths["json"].write_text(json.dumps(rows))
    ds.to_json(str(paths["json-lines"]))  # datasets writes JSON Lines under a .json name by default
    ds.to_parquet(str(paths["parquet"]))
    ds.save_to_disk(str(paths["folder"]))
    datasets.DatasetDict({"train": ds}).save_to_disk(str(paths["dict-folder"]))
    return paths


def test_every_format_reads_the_same_rows(tmp_path):
    paths = _write_all_formats(tmp_path, ROWS)
    csv = tmp_path / "t.csv"
    datasets.Dataset.from_list(ROWS).to_csv(str(csv), index=False)
    paths["csv"] = csv
    for name, path in paths.items():
        tasks = load_tasks(path, input_key="question", label_key="answer")
        assert [t["prompt"] for t in tasks] == [r["question"] for r in ROWS], name
        assert [t["label"] for t in tasks] == ["5", "42"], name
        assert [t["source"] for t in tasks] == ["a", "b"], name  # every other key is kept
    wheres = [w for w, _ in read_rows(paths["jsonl"])] + [w for w, _ in read_rows(paths["parquet"])]
    assert wheres == [f"{paths['jsonl']}:1", f"{paths['jsonl']}:2", f"{paths['parquet']}[0]", f"{paths['parquet']}[1]"]


def test_nested_keys_read_verl_parquet_files(tmp_path):
    paths = _write_all_formats(tmp_path, _verl_rows())
    for name, path in paths.items():
        tasks = load_tasks(path, input_key="extra_info.question", label_key="reward_model.ground_truth")
        assert [t["prompt"] for t in tasks] == [r["question"] for r in ROWS], name
        assert [t["label"] for t in tasks] == ["5", "42"], name
        # the chat prompt as verl keeps it is a list of messages, which envs take as the first observation
        chat = load_tasks(path, input_key="prompt", label_key="reward_model.ground_truth")
        assert chat[1]["prompt"] == [{"role": "user", "content": "What is 7 * 6?"}], name
        assert load_tasks(path, input_key="prompt.0.content")[0]["prompt"] == "What is 2 + 3?"


def test_lookup_prefers_a_literal_key_and_keeps_none():
    row = {"a.b": 1, "a": {"b": 2, "n": None}, "l": [{"x": 3}]}
    assert lookup(row, "a.b") == 1
    assert lookup(row, "a.n", "missing") is None
    assert lookup(row, "l.0.x") == 3
    assert lookup(row, "l.5.x", "missing") == "missing"
    assert lookup(row, "a.b.c", "missing") == "missing"


def test_bad_files_are_refused_with_the_path_and_row(tmp_path):
    verl = _write_all_formats(tmp_path, _verl_rows())["parquet"]
    with pytest.raises(ValueError, match=r"t\.parquet\[0\]: no 'extra_info\.answer' key.*keys of extra_info are"):
        load_tasks(verl, input_key="extra_info.answer")
    with pytest.raises(ValueError, match=r"t\.parquet\[0\]: no 'prompt\.x' key.*prompt is a list"):
        load_tasks(verl, input_key="prompt.x")
    broken = tmp_path / "broken.parquet"
    broken.write_bytes(b"PAR1 not really parquet")
    with pytest.raises(ValueError, match=r"broken\.parquet: not a readable parquet file"):
        list(read_rows(broken))
    ragged = tmp_path / "ragged.csv"
    ragged.write_text('question,answer\n"What is 1?",1\n"x",2,3,4\n')
    with pytest.raises(ValueError, match=r"ragged\.csv:3: 4 cells for 2 columns"):
        list(read_rows(ragged))
    (tmp_path / "empty_folder").mkdir()
    with pytest.raises(ValueError, match="empty_folder: not a datasets folder written by save_to_disk"):
        list(read_rows(tmp_path / "empty_folder"))
    obj = tmp_path / "obj.json"
    obj.write_text(json.dumps({"data": ROWS}, indent=2))
    with pytest.raises(ValueError, match="obj.json: a .json file must hold a list of objects"):
        list(read_rows(obj))
    lines = tmp_path / "lines.json"
    lines.write_text(json.dumps(ROWS[0]) + "\n[1]\n")
    with pytest.raises(ValueError, match=r"lines\.json:2: expected a JSON object"):
        list(read_rows(lines))
    two = tmp_path / "two.json"
    datasets.DatasetDict(
        {"train": datasets.Dataset.from_list(ROWS), "test": datasets.Dataset.from_list(ROWS)}
    ).save_to_disk(str(two))
    with pytest.raises(ValueError, match=r"splits \['train', 'test'\]; pass one split's folder"):
        list(read_rows(two))


def test_check_env_reads_a_verl_parquet_file_with_nested_keys(tmp_path):
    """The flags end to end: the GSM8K env's episodes start from the nested question, its check passes."""
    path = _write_all_formats(tmp_path, _verl_rows())["parquet"]

    def check_env(*flags: str) -> subprocess.CompletedProcess:
        cmd = [sys.executable, "-m", "agentrl", "check-env", "--env", "agentrl/GSM8K-v0", "--prompt-data", str(path)]
        return subprocess.run([*cmd, *flags], capture_output=True, text=True, cwd=REPO, timeout=300)

    r = check_env("--input-key", "extra_info.question", "--label-key", "reward_model.ground_truth", "--json")
    assert r.returncode == 0, r.stdout + r.stderr
    assert json.loads(r.stdout)["ok"] is True
    r = check_env("--input-key", "extra_info.query")
    assert r.returncode == 2, r.stdout + r.stderr
    assert "t.parquet[0]: no 'extra_info.query' key" in r.stderr and "--prompt-data" in r.stderr, r.stderr


def test_csv_cells_stay_as_written(tmp_path):
    """pandas would read "007" as 7 and a column with a gap as floats; a label must stay what the file says."""
    path = tmp_path / "labels.csv"
    path.write_text("question,answer\nq1,007\nq2,0.50\nq3,\nq4,42\nq5,N/A\n")
    tasks = load_tasks(path, input_key="question", label_key="answer")
    assert [t["label"] for t in tasks] == ["007", "0.50", "", "42", "N/A"]
    excel = tmp_path / "excel.csv"  # Excel's "CSV UTF-8" starts with a byte-order mark
    excel.write_bytes("\ufeffquestion,answer\nq1,7\n".encode())
    assert load_tasks(excel, input_key="question", label_key="answer")[0]["label"] == "7"


def test_null_prompts_and_mistyped_label_keys_are_refused(tmp_path):
    """Parquet fills a nested key a row lacks with null; a typo in --label-key would make every label None."""
    rows = _verl_rows()
    rows[1]["extra_info"] = {"split": "train", "index": 1, "question": None}
    path = tmp_path / "gap.parquet"
    datasets.Dataset.from_list(rows).to_parquet(str(path))
    with pytest.raises(ValueError, match=r"gap\.parquet\[1\]: 'extra_info\.question' is null"):
        load_tasks(path, input_key="extra_info.question")
    good = _write_all_formats(tmp_path, _verl_rows())["parquet"]
    with pytest.raises(
        ValueError,
        match=r"t\.parquet\[0\]: no value at --label-key 'reward_model\.groundtruth'; keys of reward_model are",
    ):
        load_tasks(good, input_key="extra_info.question", label_key="reward_model.groundtruth")
    # the default label key may be absent: envs that need a label say so
    assert load_tasks(good, input_key="extra_info.question")[0]["label"] is None


# -- rows that name code (issue 38 §6) -----------------------------------------------------------------

HOSTILE_HELPER = """
from pathlib import Path

Path(__file__).with_name("MARKER").write_text("imported")  # proof that reading the rows ran this file


async def gen(args, sample, sampling_params):
    sample.tokens, sample.response_length, sample.loss_mask, sample.rollout_log_probs = [1, 2], 1, [1], [-1.0]
    sample.reward = 2.0
    return sample
"""


def hostile_helper(folder: Path) -> tuple[str, Path]:
    """A ``file.py:fn`` spec whose import writes ``folder/MARKER``, and that marker's path (not yet there)."""
    (folder / "helper.py").write_text(HOSTILE_HELPER)
    return f"{folder / 'helper.py'}:gen", folder / "MARKER"


def test_a_row_naming_code_is_refused_before_anything_is_imported(tmp_path):
    """Task files are data: a row's generate_function_path runs only with trust_row_code (--trust-row-code)."""
    from agentrl.data import task_rows

    spec, marker = hostile_helper(tmp_path)
    rows = [{"prompt": "fine"}, {"prompt": "hostile", "generate_function_path": spec}]
    jsonl, csv_file, json_file = tmp_path / "t.jsonl", tmp_path / "t.csv", tmp_path / "t.json"
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in rows))
    csv_file.write_text(f"prompt,generate_function_path\nfine,\nhostile,{spec}\n")
    json_file.write_text(json.dumps(rows))
    for path, where in ((jsonl, f"{jsonl}:2"), (csv_file, f"{csv_file}:3"), (json_file, f"{json_file}[1]")):
        with pytest.raises(ValueError) as err:
            load_tasks(path)
        message = str(err.value)
        assert message.startswith(f"{where}: 'generate_function_path' {spec!r}") and "--trust-row-code" in message
        assert not marker.exists(), f"reading {path.name} imported the row's module"

    class Env:
        @staticmethod
        def tasks():
            return rows

    with pytest.raises(ValueError, match=r"^E\.tasks\(\)\[1\]: 'generate_function_path'.*--trust-row-code"):
        task_rows(Env, None, env_name="E")
    assert not marker.exists()
    with pytest.raises(ValueError, match="must be a module:fn string"):  # a wrong type is named either way
        load_tasks(_jsonl(tmp_path / "int.jsonl", {"prompt": "x", "generate_function_path": 5}))

    tasks = load_tasks(jsonl, trust_row_code=True)  # trusted: imported and checked while read, as before
    assert marker.exists() and tasks[1]["generate_function_path"] == spec
    assert [t["generate_function_path"] for t in load_tasks(csv_file, trust_row_code=True)] == ["", spec]
    assert task_rows(Env, None, env_name="E", trust_row_code=True)[1]["generate_function_path"] == spec


def _jsonl(path: Path, *rows: dict) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path
