"""Episodes in each model family's own chat format (Qwen2.5, Qwen3, Llama 3.x, a ChatML template
without tools): the tokens an episode records are, turn for turn, what the model's real template
renders for the same conversation, and the tokens trained are the tokens sampled.

The scripted engine plays the turns a model of the family would write (a call, a question, finish)
so that every kind of appended turn is checked (and the same conversation as an SFT demonstration
is the same tokens and loss mask); a real tiny model of the family's architecture then
plays an episode of its own, and the Learner's logprobs of its tokens are the engine's."""

from __future__ import annotations

import pytest
import torch

from flywheel.agent.episode import EpisodeConfig, opening, run_episode
from flywheel.agent.trajectory import Status
from flywheel.env.families import generate
from flywheel.env.pool import PoolConfig, SandboxPool
from flywheel.env.task import JUST_DO_IT
from flywheel.env.toolspec import validate_arguments
from flywheel.model.chat import CHAT_TEMPLATE, tool_schemas
from flywheel.model.conversation import ConversationEncoder
from flywheel.model.engine import EngineConfig, LocalEngine
from flywheel.model.formats import format_of
from flywheel.rl.learner import token_logprobs
from tests.agent.test_episode import ScriptedEngine
from tests.model.families import family_tokenizer, tiny_model

FAMILIES = {"qwen2.5": "qwen2", "qwen3": "qwen3", "llama3": "llama", "smollm2": "llama"}


@pytest.fixture(scope="module")
def task():
    return generate("bugfix", "train", 1, seed=5, difficulty=1)[0]


@pytest.fixture(scope="module")
def pool():
    with SandboxPool(PoolConfig(max_active=2)) as p:
        yield p


def assistant(name: str | None = None, content: str = "") -> dict:
    calls = [] if name is None else [{"id": "c", "type": "function", "function": {"name": name, "arguments": {}}}]
    return {"role": "assistant", "content": content, **({"tool_calls": calls} if calls else {})}


def template_ids(tokenizer, chat_format, messages) -> list[int]:
    """The model's own template's prompt for `messages`, tokenized as a whole. A template without
    tools cannot render calls: there flywheel's own template is the reference (the format adds it)."""
    template = CHAT_TEMPLATE if chat_format.tools_source == "flywheel" else None
    text = tokenizer.apply_chat_template(messages, tools=tool_schemas(), chat_template=template, tokenize=False,
                                         add_generation_prompt=True, **chat_format.template_kwargs())
    return tokenizer(text, add_special_tokens=False)["input_ids"]


@pytest.mark.parametrize("family", FAMILIES)
def test_an_episode_s_tokens_are_the_template_s_turn_for_turn(family, task, pool):
    tokenizer = family_tokenizer(family)
    chat_format = format_of(tokenizer)
    turns = [assistant("format_disk"), assistant(content="Which file is it in?"), assistant("finish")]
    engine = ScriptedEngine(tokenizer, [chat_format.assistant_body(m) for m in turns])
    trajectory = run_episode(task, engine, tokenizer, pool, EpisodeConfig(max_turns=4))
    assert trajectory.status == Status.FINISHED and trajectory.invalid_tool_calls == 1 and trajectory.asked_question
    error = f"error: invalid tool call: {validate_arguments('format_disk', {})}"
    conversation = [*opening(task), turns[0], {"role": "tool", "content": error}, turns[1],
                    {"role": "user", "content": JUST_DO_IT}]
    # Each prompt the engine was given is the template's prompt for the conversation so far.
    for prompt, k in zip(engine.prompts, (2, 4, 6), strict=True):
        assert prompt == template_ids(tokenizer, chat_format, conversation[:k])
    # The record: those prompts, and between them exactly the tokens the engine gave (mask 1).
    generated = [tokenizer(chat_format.assistant_body(m), add_special_tokens=False)["input_ids"] for m in turns]
    assert trajectory.tokens == engine.prompts[2] + generated[2]
    masked = [t for t, m in zip(trajectory.tokens, trajectory.loss_mask, strict=True) if m]
    assert masked == [t for ids in generated for t in ids]
    # A demonstration of the same conversation is, for SFT, the same tokens with the same loss mask.
    demo = ConversationEncoder(tokenizer).conversation([*conversation, turns[2]])
    assert demo == (trajectory.tokens, trajectory.loss_mask)


@pytest.mark.parametrize("family", FAMILIES)
def test_a_real_model_s_sampled_tokens_are_the_ones_trained_with_the_engine_s_logprobs(family, task, pool):
    tokenizer = family_tokenizer(family)
    model = tiny_model(tokenizer, FAMILIES[family])
    config = EpisodeConfig(max_turns=2, max_tokens_per_turn=12, temperature=1.0)
    with LocalEngine(model, EngineConfig(max_batch=2)) as engine:
        trajectory = run_episode(task, engine, tokenizer, pool, config)
    assert trajectory.generated_tokens > 0
    prompt = template_ids(tokenizer, format_of(tokenizer), opening(task))
    assert trajectory.tokens[:len(prompt)] == prompt and trajectory.prompt_len == len(prompt)
    ids = torch.tensor([trajectory.tokens])
    logp, _ = token_logprobs(model, ids, torch.ones_like(ids))
    mask = torch.tensor(trajectory.loss_mask, dtype=torch.bool)
    assert torch.allclose(logp[0][mask], torch.tensor(trajectory.logprobs)[mask], atol=1e-4)
