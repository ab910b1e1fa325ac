"""SFT: demonstrations tokenized exactly as episodes are, batches within budget, loss goes down."""

from __future__ import annotations

import random

import pytest
import torch

from flywheel.env.families import generate
from flywheel.env.pool import PoolConfig, SandboxPool
from flywheel.model.chat import render_assistant_body, render_messages, tool_schemas
from flywheel.model.conversation import ConversationEncoder
from flywheel.model.factory import ModelConfig, build_model
from flywheel.model.tokenizer import train_tokenizer
from flywheel.rl.sft import (
    SFTConfig,
    loss_weights,
    masked_ce_loss,
    rare_tokens,
    shared_prefix_length,
    train_sft,
)
from flywheel.rl.training import pack_batches
from flywheel.sim.expert import demonstrations


def test_demonstrations_encode_as_the_whole_conversation_with_assistant_only_loss():
    tasks = generate("bugfix", "train", 2, seed=3, difficulty=1) + generate("ambiguous", "train", 1, seed=3,
                                                                            difficulty=1)
    with SandboxPool(PoolConfig(max_active=4, warm=0)) as pool:
        demos = demonstrations(tasks, pool)
    tokenizer = train_tokenizer([render_messages(m, tool_schemas()) for m in demos], vocab_size=700)
    for messages in demos:
        tokens, mask = ConversationEncoder(tokenizer).conversation(messages)
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
    tokenizer = train_tokenizer(["<tool_call>\n{\"name\": \"list_dir\", \"arguments\": {}}\n</tool_call>"] * 20,
                                vocab_size=300)
    model = build_model(ModelConfig(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=16,
                                    num_experts=4, experts_per_token=2, moe_intermediate_size=32), tokenizer)
    ids = tokenizer("Look.<tool_call>\n{\"name\": \"list_dir\", \"arguments\": {}}\n</tool_call>")["input_ids"]
    example = (ids, [0] * 3 + [1] * (len(ids) - 3))
    torch.manual_seed(0)
    metrics = train_sft(model, [example] * 8, SFTConfig(epochs=30, lr=1e-2, warmup_steps=1, batch_tokens=len(ids) * 4),
                        tokenizer.pad_token_id)
    assert metrics["sft_loss_final"] < 0.5 * metrics["sft_loss_first"]
    assert model.lm_head.weight is model.get_input_embeddings().weight  # still tied after training


def test_shared_prefix_gives_the_loss_and_gradients_of_full_sequences():
    tokenizer = train_tokenizer(["system prompt and tools; then a user asks", "<tool_call>list_dir</tool_call>"] * 10,
                                vocab_size=300)
    model = build_model(ModelConfig(hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=16,
                                    num_experts=4, experts_per_token=2, moe_intermediate_size=32), tokenizer)
    shared = tokenizer("system prompt and tools; then a user asks")["input_ids"]
    rows = [shared + tokenizer(text)["input_ids"] for text in ("fix it<tool_call>list_dir",
                                                               "go<tool_call>list_dir</tool_call>")]
    examples = [(r, [0] * (len(shared) + 2) + [1] * (len(r) - len(shared) - 2)) for r in rows]
    p = shared_prefix_length(examples)
    assert p == len(shared)

    def batch(parts):
        width = max(len(t) for t, _ in parts)
        ids, mask, attn = (torch.zeros((len(parts), width), dtype=torch.long) for _ in range(3))
        for r, (t, m) in enumerate(parts):
            ids[r, : len(t)], mask[r, : len(m)], attn[r, : len(t)] = torch.tensor(t), torch.tensor(m), 1
        return ids, mask, attn

    model.train()
    ids, mask, attn = batch(examples)
    logp = torch.log_softmax(model(input_ids=ids, attention_mask=attn).logits[:, :-1].float(), -1)  # the plain way
    reference = -(logp.gather(-1, ids[:, 1:, None])[..., 0] * mask[:, 1:]).sum()
    model.zero_grad()
    full, n_full = masked_ce_loss(model, ids, mask, attn)
    assert torch.allclose(full, reference, atol=1e-4) and n_full == mask[:, 1:].sum()
    full.backward()
    grads_full = {k: v.grad.clone() for k, v in model.named_parameters() if v.grad is not None}
    model.zero_grad()
    shared_loss, n_shared = masked_ce_loss(model, *batch([(t[p:], m[p:]) for t, m in examples]),
                                           prefix=torch.tensor(shared))
    shared_loss.backward()
    assert n_full == n_shared
    assert torch.allclose(full, shared_loss, atol=1e-5)
    for name, grad in grads_full.items():
        assert torch.allclose(grad, dict(model.named_parameters())[name].grad, atol=1e-5), name


def test_shared_prefix_stops_before_the_first_trained_token():
    examples = [([1, 2, 3, 4, 5], [0, 0, 0, 1, 1]), ([1, 2, 3, 9, 9], [0, 0, 0, 0, 1])]
    assert shared_prefix_length(examples) == 2  # token 3 is shared, but 4 (after it) is trained in row 0
    assert shared_prefix_length([([1, 2, 3], [0, 0, 1]), ([7, 2, 3], [0, 0, 1])]) == 0

def test_context_tokens_add_their_weighted_loss_and_do_not_count_as_assistant_tokens():
    tokenizer = train_tokenizer(["<tool_call>list_dir</tool_call> files: a.py b.py"] * 10, vocab_size=300)
    model = build_model(ModelConfig(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=16,
                                    num_experts=4, experts_per_token=2, moe_intermediate_size=32), tokenizer)
    ids = torch.tensor([tokenizer("<tool_call>list_dir</tool_call> files: a.py b.py")["input_ids"]])
    n = ids.shape[1]
    assistant = torch.tensor([[0] + [1] * (n // 2) + [0] * (n - 1 - n // 2)])
    context = torch.tensor([[0] * (1 + n // 2) + [1] * (n - 1 - n // 2)])
    attn = torch.ones_like(ids)
    with torch.no_grad():
        own, count = masked_ce_loss(model, ids, assistant.float(), attn)
        other, _ = masked_ce_loss(model, ids, context.float(), attn)
        both, count_both = masked_ce_loss(model, ids, assistant, attn, weights=assistant + 0.3 * context)
    assert torch.allclose(both, own + 0.3 * other, atol=1e-4) and other > 0
    assert count_both == count == n // 2  # the per-token loss stays an average over the assistant's tokens


def test_loss_weights_raise_rare_tokens_repeated_from_the_context():
    config = SFTConfig(context_loss_weight=0.5, copy_weight=4.0)
    #        prompt  | context: names 7, 8 | assistant copies 7, then writes 5 (common) and 9 (new)
    tokens = [1, 2,    7, 8, 5,              7, 5, 9, 7]
    mask = [0, 0,      0, 0, 0,              1, 1, 1, 1]
    weights = loss_weights(tokens, mask, config, rare={7, 8, 9}, free=2)
    assert weights == [0.0, 0.0, 0.5, 0.5, 0.5, 4.0, 1.0, 1.0, 4.0]
    examples = [([7, 5], [0, 1]), ([8, 5], [0, 1]), ([9, 5, 7], [0, 1, 1])]
    assert rare_tokens(examples, share=0.5) == {8, 9}  # 5 is in all three, 7 in two


def test_sharing_the_prompt_leaves_the_context_loss_as_it_is():
    """Context loss never covers the shared prompt, so computing it once changes no loss."""
    tokenizer = train_tokenizer(["system prompt and tools; then a user asks",
                                 "<tool_call>list_dir</tool_call> a.py"] * 10,
                                vocab_size=300)
    shared = tokenizer("system prompt and tools; then a user asks")["input_ids"]
    examples = []
    for text in ("fix it<tool_call>list_dir", "go<tool_call>list_dir</tool_call> a.py"):
        row = shared + tokenizer(text)["input_ids"]
        examples.append((row, [0] * (len(shared) + 2) + [1] * (len(row) - len(shared) - 2)))
    first = {}
    for share in (True, False):
        model = build_model(ModelConfig(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=16,
                                        num_experts=4, experts_per_token=2, moe_intermediate_size=32), tokenizer)
        config = SFTConfig(epochs=1, warmup_steps=1, batch_tokens=10_000, share_prefix=share,
                           context_loss_weight=1.0, copy_weight=3.0)
        first[share] = train_sft(model, examples, config, tokenizer.pad_token_id)["sft_loss_first"]
    assert first[True] == pytest.approx(first[False], abs=1e-4)


def test_a_step_budget_learns_the_same_weights_on_a_slow_machine(monkeypatch):
    """`SFTConfig.steps` fixes the schedule and the number of updates: a machine whose clock runs 100
    s per step learns exactly what a fast one does. A time budget on that machine stops early."""
    tokenizer = train_tokenizer(["<tool_call>\n{\"name\": \"list_dir\", \"arguments\": {}}\n</tool_call>"] * 20,
                                vocab_size=300)
    ids = tokenizer("Look.<tool_call>\n{\"name\": \"list_dir\", \"arguments\": {}}\n</tool_call>")["input_ids"]
    examples = [(ids, [0] * 3 + [1] * (len(ids) - 3))] * 8
    config = SFTConfig(steps=12, lr=1e-2, warmup_steps=1, batch_tokens=len(ids) * 2)

    def trained(time_budget_s: float | None = None) -> tuple[dict[str, float], dict[str, torch.Tensor]]:
        model = build_model(ModelConfig(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=16,
                                        num_experts=4, experts_per_token=2, moe_intermediate_size=32, seed=3),
                                        tokenizer)
        metrics = train_sft(model, examples, config, tokenizer.pad_token_id, time_budget_s=time_budget_s)
        return metrics, {k: v.clone() for k, v in model.state_dict().items()}

    fast_metrics, fast = trained()
    clock = iter(range(0, 10**6, 100))  # every reading of the clock 100 s after the last
    monkeypatch.setattr("flywheel.rl.sft.time.perf_counter", lambda: float(next(clock)))
    slow_metrics, slow = trained()
    assert fast_metrics["sft_steps"] == slow_metrics["sft_steps"] == fast_metrics["sft_steps_planned"] == 12
    assert all(torch.equal(fast[k], slow[k]) for k in fast)
    budget_metrics, budgeted = trained(time_budget_s=450.0)  # the same machine under a time budget
    assert budget_metrics["sft_steps"] < 12
    assert not all(torch.equal(fast[k], budgeted[k]) for k in fast)
