"""Chat formats against real chat templates: each family's template (tests/model/fixtures) is
recognised as its format, and the format renders every conversation flywheel produces to the text
the template does, so prompts are the model's own."""

from __future__ import annotations

import pytest

from flywheel.model.chat import FLYWHEEL, SYSTEM_PROMPT, tool_schemas
from flywheel.model.formats import FORMAT_KEY, UnknownChatFormat, detect_format, format_of
from flywheel.model.tokenizer import load_tokenizer, train_tokenizer
from tests.model.families import family_tokenizer

SYSTEM = {"role": "system", "content": SYSTEM_PROMPT}
USER = {"role": "user", "content": "  The test test_clamp fails. Fix it, please.\n"}


def call(i: int, name: str, arguments: dict) -> dict:
    return {"id": f"call_{i}", "type": "function", "function": {"name": name, "arguments": arguments}}


CONVERSATIONS = [
    [SYSTEM, USER],
    [USER],
    [SYSTEM, USER, {"role": "assistant", "content": "Which test file?"}, {"role": "user", "content": "tests/t.py"}],
    [SYSTEM, USER, {"role": "assistant", "content": "", "tool_calls": [call(0, "grep", {"pattern": "def clamp"})]},
     {"role": "tool", "tool_call_id": "call_0", "content": "pkg/core.py:3:def clamp(x, lo, hi):\n  \"quoted\"\t"}],
    [SYSTEM, USER, {"role": "assistant", "content": "", "tool_calls": [call(0, "read_file", {"path": "pkg/core.py"})]},
     {"role": "tool", "tool_call_id": "call_0", "content": "def clamp(x, lo, hi):\n    return x\n"},
     {"role": "assistant", "content": "", "tool_calls": [
         call(1, "edit_file", {"path": "pkg/core.py", "old": "return x", "new": "return max(lo, min(x, hi))"})]},
     {"role": "tool", "tool_call_id": "call_1", "content": "edited pkg/core.py at line 2 — ünïcödé"},
     {"role": "user", "content": "Run the tests too."}],
]
# Several calls in one turn: Hermes templates render them; Llama 3's refuses more than one.
PARALLEL = [SYSTEM, USER, {"role": "assistant", "content": "Looking.", "tool_calls": [
    call(0, "grep", {"pattern": "clamp"}), call(1, "list_dir", {})]},
    {"role": "tool", "content": "a"}, {"role": "tool", "content": "b"}]


@pytest.mark.parametrize("family,expected", [("qwen2.5", "qwen2.5"), ("qwen3", "qwen3"), ("llama3", "llama3"),
                                             ("smollm2", "chatml")])
def test_a_real_template_is_recognised_as_its_format_and_renders_alike(family, expected):
    tokenizer = family_tokenizer(family)
    chat_format = detect_format(tokenizer)
    assert chat_format.name == expected
    conversations = CONVERSATIONS + ([PARALLEL] if family.startswith("qwen") else [])
    for messages in conversations:
        own_tools = chat_format.tools_source == "template"
        if not own_tools and any("tool_calls" in m or m["role"] == "tool" for m in messages):
            continue  # a template without tools cannot render calls: flywheel's header and markup are added
        for tools in ([None, tool_schemas()] if own_tools else [None]):
            theirs = tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True,
                                                   **chat_format.template_kwargs())
            assert chat_format.render(messages, tools, add_generation_prompt=True) == theirs


def test_a_template_without_tools_gets_flywheel_s_header_and_says_so():
    chat_format = detect_format(family_tokenizer("smollm2"))
    assert chat_format.tools_source == "flywheel" and "flywheel's tools header added" in chat_format.describe()
    assert chat_format.default_system.startswith("You are a helpful AI assistant named SmolLM")
    prompt = chat_format.render([SYSTEM, USER], tool_schemas(), add_generation_prompt=True)
    assert prompt == FLYWHEEL.render([SYSTEM, USER], tool_schemas(), add_generation_prompt=True)


def test_the_format_is_recorded_on_the_tokenizer_and_travels_with_it(tmp_path):
    tokenizer = family_tokenizer("llama3")
    assert FORMAT_KEY not in tokenizer.init_kwargs
    assert format_of(tokenizer).name == "llama3"  # detected, and recorded on it
    tokenizer.save_pretrained(tmp_path)
    loaded = load_tokenizer(tmp_path)
    assert loaded.init_kwargs[FORMAT_KEY]["name"] == "llama3"
    loaded.chat_template = "{{ 'not looked at again' }}"  # the record, not the template, decides now
    assert format_of(loaded).name == "llama3"


def test_flywheel_s_own_tokenizers_speak_flywheel_s_format():
    corpus = ["def f(x):\n    return x\n"] * 10
    for tools in (True, False):
        assert format_of(train_tokenizer(corpus, vocab_size=300, tools_in_prompt=tools)) is FLYWHEEL


MISTRAL_LIKE = ("{{ bos_token }}{% for m in messages %}{% if m.role == 'user' %}[INST] {{ m.content }} [/INST]"
                "{% else %}{{ m.content }}{{ eos_token }}{% endif %}{% endfor %}")
CHATML_OWN_TOOLS = (  # ChatML, but tools listed in a way no known format does
    "{% if tools %}<|im_start|>system\nTOOLS: {{ tools | length }}<|im_end|>\n{% endif %}"
    "{% for m in messages %}{{ '<|im_start|>' + m.role + '\n' + m.content + '<|im_end|>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.mark.parametrize("template,reason", [(MISTRAL_LIKE, "renders like none"),
                                             (CHATML_OWN_TOOLS, "lists tools, in a way no known format does")])
def test_a_template_no_format_renders_is_refused_with_each_family_s_difference(template, reason):
    tokenizer = family_tokenizer("qwen2.5")
    tokenizer.chat_template = template
    with pytest.raises(UnknownChatFormat) as exc:
        detect_format(tokenizer)
    message = str(exc.value)
    assert reason in message and "--chat-template" in message
    for name in ("flywheel:", "qwen2.5:", "qwen3:", "llama3:", "chatml:"):
        assert name in message


@pytest.mark.parametrize("family", ["qwen2.5", "llama3"])
def test_a_client_is_sent_only_calls_it_can_dispatch_in_every_format(family):
    """OpenAI's contract, whatever the model's format: an undeclared tool, or a call that does not
    parse, reaches the client as the text the model wrote, not as a tool_call; the valid call is
    still a tool_call, and `parse` keeps every call for the record."""
    chat_format = detect_format(family_tokenizer(family))
    good = chat_format.render_tool_call({"function": {"name": "grep", "arguments": {"pattern": "clamp"}}})
    undeclared = chat_format.render_tool_call({"function": {"name": "launch", "arguments": {"x": 1}}})
    cut = '{"name": "read_file", "arg'
    if chat_format.family == "hermes":
        answer = f"Looking.\n{good}\n{undeclared}\n<tool_call>\n{cut}" + chat_format.end_token
    else:
        answer = f"{good}\n{undeclared}\n{cut}" + chat_format.end_token
    content, calls = chat_format.parse(answer, schemas={"grep": tool_schemas(["grep"])[0]})
    assert [c.valid for c in calls] == [True, False, False], calls
    shown, sent = chat_format.client_view(answer, content, calls)
    assert [c.name for c in sent] == ["grep"]
    assert '"launch"' in shown and cut in shown and '"clamp"' not in shown
