"""Chat template round trip and tool-call parsing."""

from __future__ import annotations

import json

import pytest

from flywheel.model.chat import (
    CHAT_TEMPLATE,
    IM_END,
    SYSTEM_PROMPT,
    parse_assistant,
    render_assistant_body,
    render_messages,
    tool_schemas,
    tools_in_prompt,
)
from flywheel.model.conversation import ConversationEncoder
from flywheel.model.tokenizer import load_tokenizer, train_tokenizer

MESSAGES = [
    {"role": "system", "content": SYSTEM_PROMPT},
    {"role": "user", "content": "The test test_clamp fails. Fix it, please."},
    {"role": "assistant", "content": "Let me look.", "tool_calls": [
        {"id": "call_0", "type": "function", "function": {"name": "grep",
                                                          "arguments": {"pattern": "def clamp", "glob": "*.py"}}},
        {"id": "call_1", "type": "function", "function": {"name": "list_dir", "arguments": {}}},
    ]},
    {"role": "tool", "tool_call_id": "call_0", "content": "mathx/core.py:3:def clamp(x, lo, hi):"},
    {"role": "tool", "tool_call_id": "call_1", "content": "mathx/\nmathx/core.py\ntests/"},
    {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_2", "type": "function", "function": {"name": "edit_file", "arguments": {
            "path": "mathx/core.py", "old": "return max(lo, min(x, lo))", "new": "return max(lo, min(x, hi))"}}},
    ]},
    {"role": "tool", "tool_call_id": "call_2", "content": "edited mathx/core.py at line 4"},
    {"role": "user", "content": "Thanks — and ünïcödé “quotes” are fine?"},
    {"role": "assistant", "content": "Yes, all fixed."},
]


@pytest.fixture(scope="module")
def tokenizer():
    corpus = [render_messages(MESSAGES, tool_schemas())] * 20 + ["def f(x):\n    return x + 1\n"] * 20
    return train_tokenizer(corpus, vocab_size=600)


def test_python_renderer_matches_the_jinja_template(tokenizer):
    assert tokenizer.chat_template == CHAT_TEMPLATE
    for tools in (None, tool_schemas()):
        for gen in (False, True):
            jinja = tokenizer.apply_chat_template(MESSAGES, tools=tools, tokenize=False, add_generation_prompt=gen)
            assert jinja == render_messages(MESSAGES, tools, add_generation_prompt=gen)


def test_a_model_trained_without_tool_schemas_never_gets_them_in_its_prompt(tmp_path):
    corpus = [render_messages(MESSAGES)] * 20
    tokenizer = train_tokenizer(corpus, vocab_size=600, tools_in_prompt=False)
    tokenizer.save_pretrained(tmp_path)
    loaded = load_tokenizer(tmp_path)
    assert not tools_in_prompt(loaded) and tools_in_prompt(train_tokenizer(corpus, vocab_size=600))
    # The saved template agrees with the Python renderer: schemas given, none rendered.
    jinja = loaded.apply_chat_template(MESSAGES, tools=tool_schemas(), tokenize=False, add_generation_prompt=True)
    assert jinja == render_messages(MESSAGES, None, add_generation_prompt=True) and "<tools>" not in jinja
    # SFT encodes demonstrations the same way.
    ids, _ = ConversationEncoder(loaded).conversation(MESSAGES[:3])
    assert "<tools>" not in loaded.decode(ids) and loaded.decode(ids).startswith(render_messages(MESSAGES[:2]))


def test_render_tokenize_parse_round_trip(tokenizer):
    text = render_messages(MESSAGES, tool_schemas())
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert tokenizer.decode(ids, skip_special_tokens=False) == text
    for tag in ("<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>", "<tool_response>"):
        assert tokenizer.convert_tokens_to_ids(tag) in ids  # each is one token
    # Parse every assistant turn back out of the decoded text.
    turns = tokenizer.decode(ids, skip_special_tokens=False).split("<|im_start|>assistant\n")[1:]
    assistants = [m for m in MESSAGES if m["role"] == "assistant"]
    assert len(turns) == len(assistants)
    for turn, message in zip(turns, assistants, strict=True):
        body = turn[: turn.index(IM_END) + len(IM_END)]
        assert body == render_assistant_body(message)
        content, calls = parse_assistant(body)
        assert content == message["content"]
        expected = [(c["function"]["name"], c["function"]["arguments"]) for c in message.get("tool_calls", [])]
        assert [(c.name, c.arguments) for c in calls] == expected and all(c.valid for c in calls)


def test_message_by_message_tokens_equal_whole_conversation_tokens(tokenizer):
    """Token in, token out: appending turns never changes the tokens of earlier ones.

    A turn ends where the next message is not another tool result (results of one turn share
    one user message, and the runner appends them together)."""
    whole = tokenizer(render_messages(MESSAGES, tool_schemas()), add_special_tokens=False)["input_ids"]
    ends = [k for k in range(1, len(MESSAGES) + 1) if k == len(MESSAGES) or MESSAGES[k]["role"] != "tool"]
    pieces: list[int] = []
    done = ""
    for k in ends:
        prefix = render_messages(MESSAGES[:k], tool_schemas())
        assert prefix.startswith(done)
        pieces += tokenizer(prefix[len(done):], add_special_tokens=False)["input_ids"]
        done = prefix
    assert pieces == whole


@pytest.mark.parametrize(
    "text,reason",
    [
        ('<tool_call>\n{"name": "grep", "arguments": {"pattern": "x"\n</tool_call>', "bad JSON"),
        ('<tool_call>\n{"name": "format_disk", "arguments": {}}\n</tool_call>', "unknown tool"),
        ('<tool_call>\n{"name": "read_file", "arguments": {"path": 7}}\n</tool_call>', "must be a string"),
        ('<tool_call>\n{"name": "read_file", "arguments": {}}\n</tool_call>', "missing required"),
        ('<tool_call>\n["read_file"]\n</tool_call>', "must be {"),
        ('<tool_call>\n{"name": "read_file", "arguments": "{oops"}\n</tool_call>', "not JSON"),
        ('<tool_call>\n{"name": "read_file", "arguments": {"path": "a.py"}}', "unclosed"),
        # past Python's int-string conversion limit: a ValueError that is not a JSONDecodeError
        ('<tool_call>\n{"name": "read_file", "arguments": {"n": ' + "9" * 5000 + '}}\n</tool_call>', "bad JSON"),
        ('<tool_call>\n{"name": "read_file", "arguments": "{\\"n\\": ' + "9" * 5000 + '}"}\n</tool_call>', "not JSON"),
    ],
)
def test_malformed_calls_become_invalid_calls_with_the_reason(text, reason):
    content, calls = parse_assistant("Trying." + "\n" + text + IM_END)
    assert content == "Trying."
    assert len(calls) == 1 and not calls[0].valid and reason in calls[0].error


def test_several_calls_mixed_valid_and_invalid_keep_their_order():
    text = (
        '<tool_call>\n{"name": "read_file", "arguments": {"path": "a.py"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "nope", "arguments": {}}\n</tool_call>\n'
        '<tool_call>\n{"name": "run_command", "arguments": "{\\"command\\": \\"ls\\"}"}\n</tool_call>'
    )
    _, calls = parse_assistant(text)
    assert [c.valid for c in calls] == [True, False, True]
    assert calls[2].arguments == {"command": "ls"} and [c.id for c in calls] == ["call_0", "call_1", "call_2"]
    assert json.dumps(calls[0].arguments) == '{"path": "a.py"}'
