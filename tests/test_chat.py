"""Chat template rendering, observation deltas and the token ledger."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agentrl.chat import BUILTIN_TOOL_TEMPLATE, ChatTemplate, TemplateError, TokenLedger

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "add",
            "description": "Add two numbers.",
            "parameters": {"type": "object", "properties": {"a": {"type": "number"}}},
        },
    }
]

NATIVE_WITH_TOOLS = (
    "{% if tools %}<|im_start|>system\nTOOLS:{{ tools | tojson }}<|im_end|>\n{% endif %}"
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.fixture()
def template(tiny_tokenizer):
    return ChatTemplate(tiny_tokenizer)


def test_plain_chatml_without_tools_uses_native(template):
    assert not template.native_supports_tools
    assert template.template_for(None) == template.native
    text, ids = template.prompt([{"role": "user", "content": "hi"}])
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert template.decode(ids) == text


def test_tools_fall_back_to_builtin_when_native_ignores_them(template):
    assert template.template_for(TOOLS) == BUILTIN_TOOL_TEMPLATE
    text, _ = template.prompt([{"role": "user", "content": "hi"}], TOOLS)
    assert "<tools>" in text and '"name": "add"' in text and "<tool_call>" in text
    assert text.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")


def test_native_template_with_tool_support_is_kept(tiny_tokenizer):
    t = ChatTemplate(tiny_tokenizer, template=NATIVE_WITH_TOOLS)
    assert t.native_supports_tools and t.template_for(TOOLS) == NATIVE_WITH_TOOLS
    assert (
        ChatTemplate(tiny_tokenizer, template=NATIVE_WITH_TOOLS, tool_template="builtin").template_for(TOOLS)
        == BUILTIN_TOOL_TEMPLATE
    )


def test_delta_after_eos_turn_writes_only_the_bridge(template):
    delta = template.observation_delta([{"role": "user", "content": "next"}], last_token_text="<|im_end|>")
    assert delta == "\n<|im_start|>user\nnext<|im_end|>\n<|im_start|>assistant\n"


def test_delta_after_stop_string_closes_the_turn(template):
    delta = template.observation_delta([{"role": "user", "content": "next"}], last_token_text=None)
    assert delta == "<|im_end|>\n<|im_start|>user\nnext<|im_end|>\n<|im_start|>assistant\n"


def test_delta_groups_consecutive_tool_results(template):
    msgs = [
        {"role": "tool", "content": "3", "tool_call_id": "a"},
        {"role": "tool", "content": "4", "tool_call_id": "b"},
    ]
    delta = template.observation_delta(msgs, TOOLS, last_token_text="<|im_end|>")
    assert delta == (
        "\n<|im_start|>user\n<tool_response>\n3\n</tool_response>\n<tool_response>\n4\n</tool_response>"
        "<|im_end|>\n<|im_start|>assistant\n"
    )


def test_prompt_plus_deltas_equal_full_render(template):
    """Prompt + sampled turns + deltas reproduce what the template renders for the whole conversation."""
    first = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}]
    turns = [
        (
            '<tool_call>\n{"name": "add", "arguments": {"a": 2}}\n</tool_call>',
            [{"role": "tool", "content": "4", "tool_call_id": "c0"}],
        ),
        ("Checking.", [{"role": "user", "content": "Sure?"}]),
    ]
    text, _ = template.prompt(first, TOOLS)
    convo = list(first)
    for assistant, obs in turns:
        text += assistant + "<|im_end|>"
        text += template.observation_delta(obs, TOOLS, last_token_text="<|im_end|>", first_messages=first)
        convo += [{"role": "assistant", "content": assistant}] + obs
    assert text == template.render(convo, TOOLS, add_generation_prompt=True)


def test_non_append_only_template_is_refused(tiny_tokenizer):
    # renders only the last message: earlier turns change when messages are appended
    t = ChatTemplate(tiny_tokenizer, template="{{ messages[-1]['content'] }}")
    with pytest.raises(TemplateError):
        t.observation_delta([{"role": "user", "content": "x"}], last_token_text=None)


def test_ledger_invariants():
    led = TokenLedger([1, 2, 3])
    led.append_model([10, 11], [-0.1, -0.2])
    led.append_env([20, 21, 22])
    led.append_model([12], [-0.3])
    assert led.tokens == [1, 2, 3, 10, 11, 20, 21, 22, 12]
    assert led.loss_mask == [1, 1, 0, 0, 0, 1]
    assert led.log_probs == [-0.1, -0.2, 0.0, 0.0, 0.0, -0.3]
    assert led.model_spans == [(0, 2), (5, 6)] and led.env_spans == [(2, 5)]
    with pytest.raises(ValueError):
        led.append_model([1, 2], [0.0])


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.text(max_size=40)), max_size=8))
def test_ledger_fuzz_env_text_roundtrips(tiny_tokenizer, parts):
    """Arbitrary observation text appended as deltas decodes back exactly; masks stay aligned."""
    t = ChatTemplate(tiny_tokenizer)
    led = TokenLedger(t.encode("<|im_start|>user\nx<|im_end|>\n"))
    expected = []
    for is_model, text in parts:
        ids = t.encode(text)
        if is_model:
            led.append_model(ids, [-1.0] * len(ids))
        else:
            led.append_env(ids)
            expected.append(text)
    assert len(led.loss_mask) == len(led.log_probs) == len(led.response_ids)
    assert [t.decode(led.response_ids[a:b]) for a, b in led.env_spans] == expected


@settings(max_examples=80, deadline=None)
@given(
    st.lists(st.tuples(st.sampled_from(["user", "tool", "system"]), st.text(max_size=60)), min_size=0, max_size=4),
    st.sampled_from([None, "<|im_end|>", "<|endoftext|>"]),
    st.booleans(),
)
def test_observation_delta_fuzz(tiny_tokenizer, msgs, last_token_text, with_tools):
    """Arbitrary observation text never crashes the delta renderer, and the delta round-trips through ids."""
    t = ChatTemplate(tiny_tokenizer)
    messages = [{"role": r, "content": c, "tool_call_id": "x"} for r, c in msgs]
    delta = t.observation_delta(messages, TOOLS if with_tools else None, last_token_text=last_token_text)
    assert delta.endswith("<|im_start|>assistant\n")
    assert t.decode(t.encode(delta)) == delta


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(st.sampled_from(["user", "assistant", "tool", "system"]), st.text(max_size=30)),
        min_size=1,
        max_size=5,
    ),
    st.booleans(),
    st.booleans(),
)
def test_fast_render_equals_apply_chat_template(tiny_tokenizer, msgs, with_tools, gen_prompt):
    """The direct render path gives exactly what transformers' apply_chat_template gives."""
    t = ChatTemplate(tiny_tokenizer)
    messages = [{"role": r, "content": c, "tool_call_id": "x" if r == "tool" else None} for r, c in msgs]
    if msgs[0][0] == "assistant":
        messages[0]["tool_calls"] = [
            {"id": "c", "type": "function", "function": {"name": "add", "arguments": '{"a": 1}'}}
        ]
    tools = TOOLS if with_tools else None
    slow = tiny_tokenizer.apply_chat_template(
        messages, chat_template=t.template_for(tools), tools=tools, add_generation_prompt=gen_prompt, tokenize=False
    )
    assert t.render(messages, tools, add_generation_prompt=gen_prompt) == slow


def test_delta_context_cache_is_bounded_in_characters(template):
    """Each distinct system message is a cache entry (a served conversation's can be megabytes): the cache
    keeps at most its character budget, and a reused context is still served from it."""
    from agentrl import chat

    big = "s" * (chat._TAIL_CACHE_CHARS // 40)  # ~1/10 of the budget per entry once counted
    for i in range(30):
        ctx = template.delta_context(None, [{"role": "system", "content": f"{i}{big}"}])
        assert ctx[0][0]["content"].startswith(str(i))
    assert template._tail_cache_chars <= chat._TAIL_CACHE_CHARS
    assert template._tail_cache_chars == sum(2 * len(k) + 2 * len(v[1]) for k, v in template._tail_cache.items())
    assert 0 < len(template._tail_cache) < 30
    same = [{"role": "system", "content": "short"}]
    assert template.delta_context(None, same) is template.delta_context(None, same)
    huge = [{"role": "system", "content": "h" * (chat._TAIL_CACHE_CHARS // 8)}]  # too big to cache at all
    template.delta_context(None, huge)
    assert template._tail_cache_chars <= chat._TAIL_CACHE_CHARS
