"""The one conversation encoder: what episodes, SFT and the server tokenize is the same ids."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from flywheel.agent.episode import initial_prompt, opening
from flywheel.env.families import generate
from flywheel.model.chat import IM_END, SYSTEM_PROMPT, render_assistant_body, render_messages, tool_schemas
from flywheel.model.conversation import ConversationEncoder
from flywheel.model.tokenizer import train_tokenizer

CALL = {"id": "c0", "type": "function", "function": {"name": "read_file", "arguments": {"path": "a.py"}}}
DEMO = [
    {"role": "system", "content": SYSTEM_PROMPT},
    {"role": "user", "content": "Fix the failing test."},
    {"role": "assistant", "content": "Looking.", "tool_calls": [CALL]},
    {"role": "tool", "content": "def f():\n    return 1\n"},
    {"role": "assistant", "content": "Which behaviour do you want?"},
    {"role": "user", "content": "Return 2."},
    {"role": "assistant", "content": "Done."},
]


@pytest.fixture(scope="module", params=[True, False], ids=["tools_in_prompt", "no_tools"])
def tokenizer(request):
    tools = tool_schemas() if request.param else None
    return train_tokenizer([render_messages(DEMO, tools)] * 20, vocab_size=500, tools_in_prompt=request.param)


def test_a_demonstration_is_the_episode_s_segments_in_order(tokenizer):
    encoder = ConversationEncoder(tokenizer)
    tokens, mask = encoder.conversation(DEMO)
    opening_ids = encoder.encode(DEMO[:2], encoder.tools)
    segments = [(opening_ids, 0),
                (encoder.text(render_assistant_body(DEMO[2])), 1), (encoder.tool_reply([DEMO[3]["content"]]), 0),
                (encoder.text(render_assistant_body(DEMO[4])), 1), (encoder.user_reply(DEMO[5]["content"]), 0),
                (encoder.text(render_assistant_body(DEMO[6])), 1)]
    assert tokens == [t for ids, _ in segments for t in ids]
    assert mask == [m for ids, m in segments for _ in ids]
    assert tokens[-1] == tokenizer.convert_tokens_to_ids(IM_END)  # the last answer's reply is never appended
    # The whole conversation rendered at once is the same text, less the newline after the last turn.
    assert tokenizer.decode(tokens) + "\n" == render_messages(DEMO, encoder.tools)


def test_an_episode_opens_with_the_server_s_prompt_of_the_same_messages(tokenizer):
    encoder = ConversationEncoder(tokenizer)
    task = generate("bugfix", "train", 1, seed=0, difficulty=1)[0]
    with_tools = encoder.tools is not None
    whole = tokenizer(initial_prompt(task, with_tools), add_special_tokens=False)["input_ids"]
    assert encoder.encode(opening(task), encoder.tools) == whole
    assert ConversationEncoder(tokenizer).encode(opening(task), encoder.tools) == whole  # a fresh cache agrees


def test_cached_turns_are_not_changed_by_what_callers_append(tokenizer):
    encoder = ConversationEncoder(tokenizer)
    first = encoder.encode(DEMO[:2], encoder.tools)
    expected = list(first)
    first += [0, 0, 0]  # an episode appends its generated tokens to the prompt it got
    assert encoder.encode(DEMO[:2], encoder.tools) == expected
    tokens, _ = encoder.conversation(DEMO)
    assert tokens[: len(expected)] == expected and encoder.encode(DEMO[:2], encoder.tools) == expected


def test_threads_sharing_one_encoder_get_the_ids_of_a_fresh_one(tokenizer):
    encoder = ConversationEncoder(tokenizer, cache_size=2)  # evictions while other threads read
    conversations = [[*DEMO[:1], {"role": "user", "content": f"task {i}"}] for i in range(40)]
    with ThreadPoolExecutor(8) as pool:
        got = list(pool.map(lambda m: encoder.encode(m, encoder.tools), conversations * 3))
    assert got == [ConversationEncoder(tokenizer).encode(m, encoder.tools) for m in conversations * 3]


def test_a_conversation_that_does_not_alternate_is_refused_with_its_place():
    tokenizer = train_tokenizer([render_messages(DEMO)] * 20, vocab_size=500, tools_in_prompt=False)
    with pytest.raises(ValueError, match="message 2 should be an assistant turn, got 'user'"):
        ConversationEncoder(tokenizer).conversation([*DEMO[:2], {"role": "user", "content": "again"}])
