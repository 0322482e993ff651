"""Tool-call parsers: hand-written cases per wire format, and 'never raises' property tests."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agentrl.parsing import (
    PARSERS,
    HermesParser,
    Llama3JsonParser,
    OpenAIToolCallsParser,
    ToolCallParser,
    format_tool_error,
    get_parser,
)
from agentrl.types import ParseError, ToolCall

hermes = HermesParser()
llama = Llama3JsonParser()
openai = OpenAIToolCallsParser()


# --- registry -------------------------------------------------------------------------------


def test_registry():
    assert isinstance(get_parser("hermes"), HermesParser)
    assert isinstance(get_parser("qwen"), HermesParser)
    assert isinstance(get_parser("llama3_json"), Llama3JsonParser)
    assert isinstance(get_parser("Llama3-JSON"), Llama3JsonParser)
    assert isinstance(get_parser("openai"), OpenAIToolCallsParser)
    assert set(PARSERS) >= {"hermes", "qwen", "llama3_json", "openai"}
    with pytest.raises(ValueError, match="unknown tool-call parser 'mistral'; known parsers: .*hermes.*llama3_json"):
        get_parser("mistral")


def test_format_tool_error():
    err = ParseError("invalid JSON: boom", raw="<tool_call>{</tool_call>", id="call_0")
    assert format_tool_error(err) == "Error: could not parse tool call: invalid JSON: boom"


# --- hermes ---------------------------------------------------------------------------------


def test_hermes_single_call_and_content():
    text = 'Let me add.\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
    assert hermes.parse(text) == ("Let me add.", [ToolCall("add", {"a": 1, "b": 2}, "call_0")], [])


def test_hermes_no_calls():
    assert hermes.parse("  The answer is 4.  ") == ("The answer is 4.", [], [])
    assert hermes.parse("") == ("", [], [])


def test_hermes_multiple_calls_string_arguments_and_parameters_alias():
    text = (
        '<tool_call>{"name": "a", "arguments": "{\\"x\\": 1}"}</tool_call>\n'
        '<tool_call>  {"name": "b", "parameters": {"y": [1, 2]}}  </tool_call>'
        '<tool_call>{"name": "c"}</tool_call> done'
    )
    content, calls, errors = hermes.parse(text)
    assert content == "done"
    assert calls == [
        ToolCall("a", {"x": 1}, "call_0"),
        ToolCall("b", {"y": [1, 2]}, "call_1"),
        ToolCall("c", {}, "call_2"),
    ]
    assert errors == []


def test_hermes_close_tag_inside_a_json_string():
    text = '<tool_call>{"name": "echo", "arguments": {"s": "</tool_call>"}}</tool_call>'
    assert hermes.parse(text)[1] == [ToolCall("echo", {"s": "</tool_call>"}, "call_0")]


def test_hermes_ids_shared_between_calls_and_errors():
    text = (
        '<tool_call>{"name": "a", "arguments": {}}</tool_call>'
        "<tool_call>{oops}</tool_call>"
        '<tool_call>{"name": "b", "arguments": {}}</tool_call>'
    )
    content, calls, errors = hermes.parse(text)
    assert [c.id for c in calls] == ["call_0", "call_2"]
    assert len(errors) == 1 and errors[0].id == "call_1"
    assert errors[0].raw == "<tool_call>{oops}</tool_call>"
    assert content == ""


def test_hermes_model_written_ids_kept_unless_duplicate():
    text = (
        '<tool_call>{"id": "x", "name": "a", "arguments": {}}</tool_call>'
        '<tool_call>{"id": "x", "name": "b", "arguments": {}}</tool_call>'
        '<tool_call>{"id": "call_1", "name": "c", "arguments": {}}</tool_call>'
        '<tool_call>{"name": "d", "arguments": {}}</tool_call>'
    )
    ids = [c.id for c in hermes.parse(text)[1]]
    assert ids[:2] == ["x", "call_1"]
    assert len(set(ids)) == 4


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (
            '{"name": "a", "arguments": {"x": 1}',
            "invalid JSON in <tool_call>: Expecting ',' delimiter at line 1 column 36 (char 35)",
        ),
        ('{"name": "a", "arguments": {}}}', "invalid JSON in <tool_call>: Extra data at line 1 column 31 (char 30)"),
        ('{"arguments": {}}', 'tool call is missing "name"'),
        ('{"name": 3, "arguments": {}}', '"name" must be a non-empty string, got number'),
        ('{"name": "", "arguments": {}}', '"name" must be a non-empty string, got string'),
        ('{"name": "a", "arguments": [1]}', "\"arguments\" of 'a' must be a JSON object, got array"),
        ('{"name": "a", "arguments": "[1]"}', "\"arguments\" of 'a' must be a JSON object, got array"),
        (
            '{"name": "a", "arguments": "{x}"}',
            "\"arguments\" of 'a' is a string but not valid JSON (invalid JSON: Expecting",
        ),
        ('["a"]', 'a tool call must be a JSON object with "name" and "arguments", got array'),
        ("   ", "empty <tool_call>"),
    ],
)
def test_hermes_malformed(body, message):
    content, calls, errors = hermes.parse(f"before <tool_call>{body}</tool_call> after")
    assert content == "before  after"
    assert calls == []
    assert len(errors) == 1 and errors[0].id == "call_0"
    assert errors[0].message.startswith(message), errors[0].message
    assert errors[0].raw == f"<tool_call>{body}</tool_call>"


def test_hermes_unclosed_complete_call_is_parsed():
    content, calls, errors = hermes.parse('Sure.\n<tool_call>\n{"name": "a", "arguments": {"x": 1}}\n')
    assert (content, calls, errors) == ("Sure.", [ToolCall("a", {"x": 1}, "call_0")], [])


def test_hermes_unclosed_truncated_call_is_an_error():
    content, calls, errors = hermes.parse('Sure. <tool_call>{"name": "a", "argum')
    assert content == "Sure." and calls == []
    assert errors[0].message.startswith("invalid JSON after an unclosed <tool_call>: ")
    assert errors[0].raw == '<tool_call>{"name": "a", "argum'


def test_hermes_unclosed_followed_by_another_call():
    text = '<tool_call>{"name": "a", "arguments": {}}\n<tool_call>{"name": "b", "arguments": {}}</tool_call>'
    content, calls, errors = hermes.parse(text)
    assert [c.name for c in calls] == ["a", "b"] and errors == [] and content == ""


def test_hermes_stray_close_tag_is_text():
    assert hermes.parse("a </tool_call> b") == ("a </tool_call> b", [], [])


# --- llama3 json ----------------------------------------------------------------------------


def test_llama3_single_and_python_tag():
    call = ToolCall("get_weather", {"city": "Paris"}, "call_0")
    assert llama.parse('{"name": "get_weather", "parameters": {"city": "Paris"}}') == ("", [call], [])
    assert llama.parse('<|python_tag|>{"name": "get_weather", "arguments": {"city": "Paris"}}') == ("", [call], [])
    assert llama.parse('Checking.<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}') == (
        "Checking.",
        [call],
        [],
    )


def test_llama3_several_calls():
    text = '{"name": "a", "parameters": {}}; {"name": "b", "parameters": {"x": 1}};'
    content, calls, errors = llama.parse(text)
    assert calls == [ToolCall("a", {}, "call_0"), ToolCall("b", {"x": 1}, "call_1")] and errors == [] and content == ""


def test_llama3_plain_text_and_json_answers_are_content():
    assert llama.parse("The weather is nice.") == ("The weather is nice.", [], [])
    assert llama.parse('{"answer": 42}') == ('{"answer": 42}', [], [])
    assert llama.parse("{not json at all}") == ("{not json at all}", [], [])
    assert llama.parse("") == ("", [], [])


def test_llama3_broken_call_is_an_error():
    content, calls, errors = llama.parse('{"name": "a", "parameters": {"x": 1}')
    assert content == "" and calls == []
    assert errors[0].message.startswith("invalid JSON: Expecting ',' delimiter") and errors[0].id == "call_0"
    _, calls, errors = llama.parse('{"name": "a", "parameters": {}} and some text')
    assert calls == [] and "unexpected text after a JSON tool call" in errors[0].message


def test_llama3_bad_parts_of_a_multi_call():
    _, calls, errors = llama.parse('{"name": "a", "parameters": {}}; {"name": 1}; [1]')
    assert [c.id for c in calls] == ["call_0"]
    assert [e.id for e in errors] == ["call_1", "call_2"]


# --- openai ---------------------------------------------------------------------------------


def test_openai_message():
    message = {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": "call_abc", "type": "function", "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}},
            {"id": "call_def", "type": "function", "function": {"name": "add", "arguments": '{"a": 1,'}},
            {"type": "function", "function": {"name": "now", "arguments": ""}},
            {"id": "call_x", "type": "function", "function": {"name": "f", "arguments": {"k": "v"}}},
            "junk",
        ],
    }
    content, calls, errors = openai.parse_message(message)
    assert content == ""
    assert calls == [
        ToolCall("add", {"a": 1, "b": 2}, "call_abc"),
        ToolCall("now", {}, "call_2"),
        ToolCall("f", {"k": "v"}, "call_x"),
    ]
    assert [e.id for e in errors] == ["call_def", "call_4"]
    assert "not valid JSON" in errors[0].message
    assert "must be an object, got string" in errors[1].message


def test_openai_text_only_and_legacy_function_call():
    assert openai.parse_message({"role": "assistant", "content": " hi "}) == ("hi", [], [])
    assert openai.parse_message({"content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]})[0] == "ab"
    legacy = {"content": "", "function_call": {"name": "add", "arguments": '{"a": 1}'}}
    assert openai.parse_message(legacy)[1] == [ToolCall("add", {"a": 1}, "call_0")]
    assert openai.parse("text <tool_call>{}</tool_call>") == ("text <tool_call>{}</tool_call>", [], [])


def test_openai_call_round_trips_through_types():
    call = ToolCall("add", {"a": 1}, "call_9")
    assert openai.parse_message({"content": "", "tool_calls": [call.to_openai()]})[1] == [call]


# --- properties: never raise on arbitrary input ---------------------------------------------

FRAGMENTS = [
    "<tool_call>",
    "</tool_call>",
    "<|python_tag|>",
    "{",
    "}",
    "[",
    "]",
    '"name"',
    '"arguments"',
    '"parameters"',
    '"id"',
    ":",
    ",",
    ";",
    '"',
    "\\",
    "\\u00e9",
    '"add"',
    "1",
    "-1e999",
    "null",
    "true",
    " ",
    "\n",
    "é",
    "🙂",
    "\x00",
    '{"name": "a", "arguments": {}}',
    '{"name": "a", "arguments": "{}"}',
    '"call_0"',
    "[" * 50,
]
tool_text = st.lists(st.sampled_from(FRAGMENTS) | st.text(max_size=5), max_size=30).map("".join)


def _check_result(result: object) -> None:
    content, calls, errors = result
    assert isinstance(content, str)
    assert all(isinstance(c, ToolCall) and isinstance(c.name, str) and isinstance(c.arguments, dict) for c in calls)
    assert all(isinstance(e, ParseError) and isinstance(e.message, str) and e.message for e in errors)
    ids = [c.id for c in calls] + [e.id for e in errors]
    assert all(isinstance(i, str) and i for i in ids)
    assert len(set(ids)) == len(ids)


@pytest.mark.parametrize("name", sorted(PARSERS))
@settings(max_examples=300, deadline=None)
@given(text=st.text() | tool_text)
def test_parsers_never_raise(name, text):
    parser = get_parser(name)
    assert isinstance(parser, ToolCallParser)
    _check_result(parser.parse(text))


@settings(max_examples=200, deadline=None)
@given(text=tool_text)
def test_hermes_one_item_per_opening_tag_at_most(text):
    content, calls, errors = hermes.parse(text)
    assert len(calls) + len(errors) <= text.count("<tool_call>")
    if "<tool_call>" not in text:
        assert (content, calls, errors) == (text.strip(), [], [])


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=5),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=10,
)


@settings(max_examples=200, deadline=None)
@given(
    message=st.dictionaries(
        st.sampled_from(["role", "content", "tool_calls", "function_call"]),
        json_values
        | st.lists(
            st.fixed_dictionaries(
                {
                    "id": json_values | st.just("call_0"),
                    "function": st.fixed_dictionaries(
                        {"name": json_values | st.just("f"), "arguments": json_values | tool_text | st.just("{}")}
                    )
                    | json_values,
                },
            ),
            max_size=4,
        ),
    )
    | json_values
)
def test_openai_parse_message_never_raises(message):
    _check_result(openai.parse_message(message))


@settings(max_examples=100, deadline=None)
@given(
    calls=st.lists(
        st.tuples(
            st.text(min_size=1, max_size=8).filter(str.strip),
            st.dictionaries(st.text(max_size=4), json_values, max_size=3),
        ),
        max_size=4,
    ),
    filler=st.text(alphabet="abc .\n", max_size=10),
)
def test_hermes_round_trip(calls, filler):
    text = filler + "".join(
        f"<tool_call>\n{json.dumps({'name': n, 'arguments': a})}\n</tool_call>{filler}" for n, a in calls
    )
    content, parsed, errors = hermes.parse(text)
    assert errors == []
    assert [(c.name, json.dumps(c.arguments)) for c in parsed] == [(n.strip(), json.dumps(a)) for n, a in calls]
    assert [c.id for c in parsed] == [f"call_{i}" for i in range(len(calls))]


@settings(max_examples=300, deadline=None)
@given(
    st.lists(
        st.one_of(st.none(), st.sampled_from(["call_0", "call_1", "call_0_1", "call_1_1", "call_2", "x"])),
        min_size=1,
        max_size=6,
    ),
    st.sampled_from(["hermes", "openai"]),
)
def test_call_ids_are_unique_in_a_turn_whatever_ids_the_model_writes(ids, parser_name):
    """Model-written ids that look like the parser's own (``call_0_1``) never collide with them (issue 18 item 8)."""
    parser = get_parser(parser_name)
    objs = [{"name": "f", "arguments": {}, **({"id": i} if i else {})} for i in ids]
    if parser_name == "hermes":
        _, calls, errors = parser.parse("".join(f"<tool_call>{json.dumps(o)}</tool_call>" for o in objs))
    else:
        entries = [
            {"type": "function", "function": {"name": "f", "arguments": "{}"}, **({"id": i} if i else {})} for i in ids
        ]
        _, calls, errors = parser.parse_message({"role": "assistant", "content": None, "tool_calls": entries})
    got = [c.id for c in calls] + [e.id for e in errors]
    assert len(got) == len(ids) and len(set(got)) == len(got), (ids, got)
    if ids[0] is not None:  # the first model-written id is free: kept as written
        assert got[0] == ids[0]


def test_episode_call_ids_never_repeat_across_turns_or_collide_with_model_ids():
    """The episode renames parser ids ``call_n`` to ``call_{turn}_n``: a model-written ``call_0_1`` in the same
    turn used to collide with the parser's second call (issue 18 item 8)."""
    from agentrl.parsing import unique_call_ids

    seen: set[str] = set()
    turn0 = [
        ToolCall(name="f", arguments={}, id="call_0_1"),
        ToolCall(name="f", arguments={}, id="call_1"),
        ParseError("bad", "raw", "call_2"),
    ]
    unique_call_ids(turn0, 0, seen)
    assert [c.id for c in turn0] == ["call_0_1", "call_0_1_1", "call_0_2"]
    turn1 = [ToolCall(name="f", arguments={}, id="call_0_1"), ToolCall(name="f", arguments={}, id="call_0")]
    unique_call_ids(turn1, 1, seen)
    assert [c.id for c in turn1] == ["call_0_1_2", "call_1_0"]  # a model repeating an old id gets a new one
    assert len(seen) == 5
