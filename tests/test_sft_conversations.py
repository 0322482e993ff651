"""Demonstration rows laid down token-exactly, and every way a row is refused (with its file and line).

Real parts: the tiny model's own tokenizer and the chat template the rollout uses, the calculator
env's tool schemas, rows read from JSON, Parquet and ``datasets`` folders through the ``datasets``
library. The row helpers here (``_row``, ``TOOLS``, ``_spans``) serve the other ``test_sft*`` files.
"""

from __future__ import annotations

import json

import pytest

from agentrl.chat import ChatTemplate
from agentrl.envs.calculator import Calculator
from agentrl.rollout.demos import DemoError, conversation_samples

TOOLS = Calculator().tool_schemas()
SYSTEM = {"role": "system", "content": Calculator.system_prompt}


def _call(expr: str, cid: str = "c1") -> dict:
    return {
        "id": cid,
        "type": "function",
        "function": {"name": "calculator", "arguments": json.dumps({"expression": expr})},
    }


def _row(**over) -> dict:
    row = {
        "messages": [
            SYSTEM,
            {"role": "user", "content": "What is 3 + 4 * 5?"},
            {"role": "assistant", "content": None, "tool_calls": [_call("3 + 4 * 5")]},
            {"role": "tool", "tool_call_id": "c1", "content": "23"},
            {"role": "assistant", "content": "The answer is 23."},
        ],
        "tools": TOOLS,
    }
    row.update(over)
    return row


@pytest.fixture(scope="module")
def template(tiny_tokenizer):
    return ChatTemplate(tiny_tokenizer)


def _spans(template, s) -> list[str]:
    resp = s.tokens[s.prompt_length :]
    return [template.decode(resp[a:b]) for a, b in s.turn_spans]


def test_json_string_arguments_are_taught_as_objects():
    from agentrl.rollout.demos import check_conversation

    row = _row()
    msgs = check_conversation(row, "f.jsonl:1", {"calculator"})
    assert msgs[2]["tool_calls"][0]["function"]["arguments"] == {"expression": "3 + 4 * 5"}  # templates tojson it once
    assert isinstance(row["messages"][2]["tool_calls"][0]["function"]["arguments"], str)  # the row itself is untouched


def test_conversation_becomes_a_token_exact_sample(template):
    (s,), stats = conversation_samples([("f.jsonl:1", _row())], template, env_tools=TOOLS)
    assert s.token_exact and stats.kept == 1 and stats.assistant_turns == 2
    s.validate()
    # mask-1 spans are exactly the assistant turns in the wire format the hermes parser reads, stop token included
    first, second = _spans(template, s)
    assert (
        first
        == '\n<tool_call>\n{"name": "calculator", "arguments": {"expression": "3 + 4 * 5"}}\n</tool_call><|im_end|>'
    )
    assert second == "The answer is 23.<|im_end|>"
    assert [m for m in s.loss_mask if m] == [1] * sum(b - a for a, b in s.turn_spans)
    from agentrl.parsing import get_parser

    _, calls, errors = get_parser("hermes").parse(first.removesuffix("<|im_end|>"))
    assert not errors and calls[0].name == "calculator" and calls[0].arguments == {"expression": "3 + 4 * 5"}
    # the whole sample is the template's own rendering of the conversation (up to the final "\n")
    full = template.render(_row()["messages"], TOOLS, add_generation_prompt=False)
    assert template.decode(s.tokens) + "\n" == full
    assert template.decode(s.tokens[: s.prompt_length]) == template.render(
        _row()["messages"][:2], TOOLS, add_generation_prompt=True
    )


@pytest.mark.parametrize(
    "row, message",
    [
        ({"prompt": "x"}, "f.jsonl:1: no 'messages' list"),
        (_row(messages=[{"role": "robot", "content": "hi"}]), "messages[0] has role 'robot'"),
        (_row(messages=[{"role": "user", "content": "hi"}]), "no assistant message"),
        (_row(messages=[{"role": "assistant", "content": "hi"}]), "starts with a system or user message"),
        (
            _row(messages=[{"role": "user", "content": 3}, {"role": "assistant", "content": "a"}]),
            "content must be a string",
        ),
        (
            _row(
                messages=[
                    {"role": "user", "content": "q"},
                    {"role": "tool", "content": "1"},
                    {"role": "assistant", "content": "a"},
                ]
            ),
            "messages[1]: a tool message with no unanswered tool call",
        ),
        (
            _row(
                messages=[
                    {"role": "user", "content": "q"},
                    {"role": "assistant", "content": None, "tool_calls": [_call("1")]},
                    {"role": "tool", "tool_call_id": "zz", "content": "1"},
                    {"role": "assistant", "content": "a"},
                ]
            ),
            "tool_call_id 'zz' matches no call",
        ),
        (
            _row(
                messages=[
                    {"role": "user", "content": "q"},
                    {
                        "role": "assistant",
                        "content": None,
                        "tool_calls": [{"id": "c", "function": {"name": "shell", "arguments": "{}"}}],
                    },
                ]
            ),
            "calls tool 'shell', which is not offered",
        ),
        (
            _row(
                messages=[
                    {"role": "user", "content": "q"},
                    {
                        "role": "assistant",
                        "content": None,
                        "tool_calls": [{"id": "c", "function": {"name": "calculator", "arguments": "{oops"}}],
                    },
                ]
            ),
            "are not valid JSON",
        ),
        (_row(tools=[{"type": "function", "function": {"name": "search"}}]), "differ from the env's ['calculator']"),
    ],
)
def test_bad_demonstrations_are_refused_with_file_and_line(template, row, message):
    with pytest.raises(DemoError, match="1 demonstration\\(s\\) refused") as err:
        conversation_samples([("f.jsonl:1", row)], template, env_tools=TOOLS)
    assert message in str(err.value)


def test_every_bad_row_is_listed_and_nothing_is_kept(template):
    rows = [("f.jsonl:1", _row()), ("f.jsonl:2", {"messages": []}), ("f.jsonl:3", _row()), ("f.jsonl:4", {"x": 1})]
    with pytest.raises(DemoError) as err:
        conversation_samples(rows, template, env_tools=TOOLS)
    text = str(err.value)
    assert text.startswith("2 demonstration(s) refused") and "f.jsonl:2:" in text and "f.jsonl:4:" in text


LOOKAHEAD = (  # writes an assistant turn's calls only once their results follow: the turn changes after the fact
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] or '' }}"
    "{% if m['tool_calls'] and not loop.last %}[calls]{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_a_template_that_rewrites_a_turn_after_the_fact_is_refused_at_the_first_differing_token(tiny_tokenizer):
    tpl = ChatTemplate(tiny_tokenizer, template=LOOKAHEAD, tool_template="native")
    row = {
        "messages": [
            {"role": "user", "content": "q"},
            {"role": "assistant", "content": "one", "tool_calls": [_call("1")]},
            {"role": "tool", "tool_call_id": "c1", "content": "1"},
            {"role": "assistant", "content": "two"},
        ],
        "tools": TOOLS,
    }
    with pytest.raises(
        DemoError,
        match=r"f.jsonl:7: the chat template does not reproduce this conversation turn by "
        r"turn: first difference at token \d+ of \d+: laid down '<\|im_end\|>.*whole "
        r"rendering '\[calls\]",
    ):
        conversation_samples([("f.jsonl:7", row)], tpl)
    (s,), stats = conversation_samples([("f.jsonl:7", row)], tpl, allow_non_token_exact=True)
    assert not s.token_exact and stats.not_token_exact == 1


def test_a_template_that_re_renders_history_is_refused_as_the_rollout_refuses_it(tiny_tokenizer):
    rewriting = LOOKAHEAD.replace(
        "{{ m['content'] or '' }}", "{{ (m['content'] if loop.last or m['role'] != 'assistant' else '...') or '' }}"
    )
    tpl = ChatTemplate(tiny_tokenizer, template=rewriting, tool_template="native")
    row = {
        "messages": [
            {"role": "user", "content": "q"},
            {"role": "assistant", "content": "one"},
            {"role": "user", "content": "more"},
            {"role": "assistant", "content": "two"},
        ]
    }
    with pytest.raises(DemoError, match="f.jsonl:2: the chat template re-renders earlier turns"):
        conversation_samples([("f.jsonl:2", row)], tpl)


def test_rows_are_read_from_json_parquet_csv_and_datasets_folders(tmp_path, template):
    from agentrl.data import read_rows

    rows = [_row(), _row()]
    (tmp_path / "d.json").write_text(json.dumps(rows))
    got = list(read_rows(tmp_path / "d.json"))
    assert [w for w, _ in got] == [f"{tmp_path}/d.json[0]", f"{tmp_path}/d.json[1]"]
    (tmp_path / "bad.jsonl").write_text(json.dumps(_row()) + "\n[1, 2]\n")
    with pytest.raises(ValueError, match="bad.jsonl:2: expected a JSON object"):
        list(read_rows(tmp_path / "bad.jsonl"))
    (tmp_path / "x.txt").write_text("a")
    with pytest.raises(ValueError, match="x.txt:1: not valid JSON"):  # other names are JSON Lines
        list(read_rows(tmp_path / "x.txt"))
    import datasets  # a test dependency: Parquet and datasets folders must be exercised, not skipped

    # as Hugging Face datasets hold them: tools as JSON text, every message with every key (None where absent)
    ds = datasets.Dataset.from_list([{"messages": r["messages"], "tools": json.dumps(r["tools"])} for r in rows])
    ds.to_parquet(str(tmp_path / "d.parquet"))
    ds.save_to_disk(str(tmp_path / "folder"))
    for path in (tmp_path / "d.parquet", tmp_path / "folder"):
        samples, stats = conversation_samples(read_rows(path), template, env_tools=TOOLS)
        assert stats.kept == 2 and _spans(template, samples[0])[1] == "The answer is 23.<|im_end|>"
        assert samples[0].tokens == conversation_samples([("x", _row())], template, env_tools=TOOLS)[0][0].tokens
    # CSV cells are text: messages and tools as JSON text; a cell that is not JSON is named with its line
    import csv

    for name, cells in (
        ("d.csv", [[json.dumps(r["messages"]), json.dumps(r["tools"])] for r in rows]),
        ("bad.csv", [["[{oops", ""]]),
    ):
        with open(tmp_path / name, "w", newline="") as f:
            csv.writer(f).writerows([["messages", "tools"], *cells])
    samples, stats = conversation_samples(read_rows(tmp_path / "d.csv"), template, env_tools=TOOLS)
    assert stats.kept == 2
    assert samples[0].tokens == conversation_samples([("x", _row())], template, env_tools=TOOLS)[0][0].tokens
    with pytest.raises(DemoError, match=r"bad.csv:2: 'messages' is a string but not valid JSON"):
        conversation_samples(read_rows(tmp_path / "bad.csv"), template, env_tools=TOOLS)


def _two_tools_rows(arguments_as_text: bool, tools_as_text: bool = True) -> list[dict]:
    """Two rows calling different tools: what a column store merges into one argument struct."""
    add = {
        "type": "function",
        "function": {
            "name": "add",
            "description": "a + b",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "number"}, "b": {"type": "number"}},
                "required": ["a", "b"],
            },
        },
    }
    search = {
        "type": "function",
        "function": {
            "name": "search",
            "description": "find",
            "parameters": {"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]},
        },
    }

    def row(user, tool, args, result, answer):
        call = {
            "id": "c1",
            "type": "function",
            "function": {
                "name": tool["function"]["name"],
                "arguments": json.dumps(args) if arguments_as_text else args,
            },
        }
        return {
            "messages": [
                {"role": "user", "content": user},
                {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "c1", "content": result},
                {"role": "assistant", "content": answer},
            ],
            "tools": json.dumps([tool]) if tools_as_text else [tool],
        }

    return [row("add 1 and 2", add, {"a": 1, "b": 2}, "3", "3"), row("find x", search, {"query": "x"}, "ok", "done")]


def test_parquet_rows_with_json_string_arguments_train_exactly_what_was_written(tmp_path, template):
    import datasets

    from agentrl.data import read_rows

    rows = _two_tools_rows(arguments_as_text=True)
    datasets.Dataset.from_list(rows).to_parquet(str(tmp_path / "d.parquet"))
    samples, stats = conversation_samples(read_rows(tmp_path / "d.parquet"), template)
    assert stats.kept == 2
    assert '{"name": "add", "arguments": {"a": 1, "b": 2}}' in _spans(template, samples[0])[0]
    assert '{"name": "search", "arguments": {"query": "x"}}' in _spans(template, samples[1])[0]
    direct, _ = conversation_samples([(f"r{i}", r) for i, r in enumerate(rows)], template)  # the file changed nothing
    assert [s.tokens for s in samples] == [s.tokens for s in direct]


def test_parquet_object_arguments_get_other_rows_names_as_null_and_are_refused_with_the_fix(tmp_path, template):
    import datasets

    from agentrl.data import read_rows

    datasets.Dataset.from_list(_two_tools_rows(arguments_as_text=False)).to_parquet(str(tmp_path / "d.parquet"))
    with pytest.raises(DemoError) as err:
        conversation_samples(read_rows(tmp_path / "d.parquet"), template)
    text = str(err.value)
    assert text.startswith("2 demonstration(s) refused")
    assert "d.parquet[0]: messages[1].tool_calls[0]: arguments" in text and "unknown argument 'query'" in text
    assert "d.parquet[1]: messages[1].tool_calls[0]" in text and "unknown argument 'a'" in text
    assert "store function.arguments as a JSON string" in text
    # tool schemas stored as structs get the same union: each tool declares the other's parameters as null
    datasets.Dataset.from_list(_two_tools_rows(True, tools_as_text=False)).to_parquet(str(tmp_path / "t.parquet"))
    with pytest.raises(DemoError, match=r"t.parquet\[0\]: tools\[0\] \(add\) declares 'query' with no schema"):
        conversation_samples(read_rows(tmp_path / "t.parquet"), template)
    env = [json.loads(r["tools"])[0] for r in _two_tools_rows(True)]  # with the env's tools the row's are not rendered
    samples, _ = conversation_samples(list(read_rows(tmp_path / "t.parquet"))[:1], template, env_tools=env[:1])
    assert '{"name": "add", "arguments": {"a": 1, "b": 2}}' in _spans(template, samples[0])[0]


@pytest.mark.parametrize(
    "arguments, message",
    [
        ({"expression": 3}, "argument 'expression' must be a string, got integer 3"),
        ({"expression": "1", "precision": 2}, "unknown argument 'precision'"),
        ({}, "missing required argument 'expression'"),
    ],
)
def test_arguments_that_do_not_fit_the_env_schema_are_refused(template, arguments, message):
    row = _row()
    row["messages"][2]["tool_calls"][0]["function"]["arguments"] = arguments
    with pytest.raises(DemoError) as err:
        conversation_samples([("f.jsonl:7", row)], template, env_tools=TOOLS)
    assert "f.jsonl:7: messages[2].tool_calls[0]: arguments" in str(err.value) and message in str(err.value)
    assert "JSON string" not in str(err.value)  # no null: the columnar hint would mislead
