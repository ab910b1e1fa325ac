"""SFT: demonstrations tokenized exactly as episodes are, batches within budget, loss goes down."""

from __future__ import annotations

import random

import torch

from flywheel.agent.chat import render_assistant_body, render_messages, tool_schemas
from flywheel.env.families import generate
from flywheel.env.pool import PoolConfig, SandboxPool
from flywheel.model.factory import ModelConfig, build_model
from flywheel.model.tokenizer import train_tokenizer
from flywheel.rl.sft import SFTConfig, encode_conversation, pack_batches, train_sft
from flywheel.sim.expert import demonstrations


def test_demonstrations_encode_as_the_whole_conversation_with_assistant_only_loss():
    tasks = generate("bugfix", "train", 2, seed=3, difficulty=1) + generate("ambiguous", "train", 1, seed=3, difficulty=1)
    with SandboxPool(PoolConfig(max_active=4, warm=0)) as pool:
        demos = demonstrations(tasks, pool)
    tokenizer = train_tokenizer([render_messages(m, tool_schemas()) for m in demos], vocab_size=700)
    for messages in demos:
        tokens, mask = encode_conversation(messages, tokenizer)
        whole = tokenizer(render_messages(messages, tool_schemas()), add_special_tokens=False)["input_ids"]
        assert tokens == whole[: len(tokens)]  # same tokens as rendering the conversation at once
        trained = tokenizer.decode([t for t, m in zip(tokens, mask, strict=True) if m])
        bodies = "".join(render_assistant_body(m) for m in messages if m["role"] == "assistant")
        assert trained == bodies  # exactly the assistant turns carry loss, nothing else


def test_packed_batches_stay_within_the_token_budget():
    rng = random.Random(0)
    lengths = [rng.randint(10, 900) for _ in range(200)]
    batches = pack_batches(lengths, 2048, rng)
    assert sorted(i for b in batches for i in b) == list(range(200))
    assert all(max(lengths[i] for i in b) * len(b) <= 2048 or len(b) == 1 for b in batches)


def test_a_few_steps_lower_the_loss_on_a_real_model():
    tokenizer = train_tokenizer(["<tool_call>\n{\"name\": \"list_dir\", \"arguments\": {}}\n</tool_call>"] * 20, vocab_size=300)
    model = build_model(ModelConfig(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=16,
                                    num_experts=4, experts_per_token=2, moe_intermediate_size=32), tokenizer)
    ids = tokenizer("Look.<tool_call>\n{\"name\": \"list_dir\", \"arguments\": {}}\n</tool_call>")["input_ids"]
    example = (ids, [0] * 3 + [1] * (len(ids) - 3))
    torch.manual_seed(0)
    metrics = train_sft(model, [example] * 8, SFTConfig(epochs=30, lr=1e-2, warmup_steps=1, batch_tokens=len(ids) * 4),
                        tokenizer.pad_token_id)
    assert metrics["sft_loss_final"] < 0.5 * metrics["sft_loss_first"]
    assert model.lm_head.weight is model.get_input_embeddings().weight  # still tied after training
