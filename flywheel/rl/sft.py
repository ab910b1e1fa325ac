"""Supervised fine-tuning on demonstrations: how the policy learns the tool format before RL.

A demonstration is a list of chat messages. It is tokenized the way the episode runner builds
sequences — turn by turn, with the same rendering helpers — so what SFT trains on is token for
token what the agent later sees at inference. Only assistant tokens carry loss.
Micro-batches are packed by a token budget (long demonstrations do not blow up memory, short
ones are not padded to the longest of a fixed-size batch).
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Sequence
from typing import Any

import torch
from pydantic import BaseModel, ConfigDict
from tqdm import tqdm
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from flywheel.agent.chat import render_assistant_body, render_messages, tool_schemas
from flywheel.agent.episode import tool_turn, user_turn


class SFTConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    epochs: float = 3.0
    lr: float = 5e-3  # high for a tiny model trained for minutes; lower it for real checkpoints
    warmup_steps: int = 20
    weight_decay: float = 0.0
    batch_tokens: int = 8192  # tokens per optimizer step (padding included); fewer = more steps per minute
    max_seq_len: int = 1100  # longer demonstrations are cut to this prefix (counted): more steps, but later turns are seen less
    grad_clip: float = 1.0
    seed: int = 0


def encode_conversation(messages: Sequence[dict[str, Any]], tokenizer: PreTrainedTokenizerBase) -> tuple[list[int], list[int]]:
    """(tokens, loss mask) of a conversation, segment by segment as the episode runner appends them.

    messages: system, user, then alternating assistant turns and their answers (tool results or
    a user reply)."""
    def encode(text: str) -> list[int]:
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    tokens = encode(render_messages(messages[:2], tool_schemas(), add_generation_prompt=True))
    mask = [0] * len(tokens)
    i = 2
    while i < len(messages):
        message = messages[i]
        if message["role"] != "assistant":
            raise ValueError(f"message {i} should be an assistant turn, got {message['role']!r}")
        body = encode(render_assistant_body(message))
        tokens += body
        mask += [1] * len(body)
        j = i + 1
        while j < len(messages) and messages[j]["role"] == "tool":
            j += 1
        if j > i + 1:
            answer = tool_turn([m["content"] for m in messages[i + 1 : j]])
        elif j < len(messages) and messages[j]["role"] == "user":
            answer = user_turn(messages[j]["content"])
            j += 1
        else:
            answer = None
        if answer is not None and j < len(messages):
            ids = encode(answer)
            tokens += ids
            mask += [0] * len(ids)
        i = j
    return tokens, mask


def pack_batches(lengths: Sequence[int], batch_tokens: int, rng: random.Random) -> list[list[int]]:
    """Group example indices so each batch's padded size (rows x longest) stays within the budget."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])  # similar lengths together: little padding
    batches, current, longest = [], [], 0
    for i in order:
        longest_if_added = max(longest, lengths[i])
        if current and longest_if_added * (len(current) + 1) > batch_tokens:
            batches.append(current)
            current, longest_if_added = [], lengths[i]
        current.append(i)
        longest = longest_if_added
    if current:
        batches.append(current)
    rng.shuffle(batches)
    return batches


def masked_ce_loss(model: PreTrainedModel, ids: torch.Tensor, mask: torch.Tensor, attn: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Sum of next-token cross-entropy over loss-mask positions, and their count.

    ids, mask, attn: [batch, seq]. Right padding, so positions are the natural ones."""
    logits = model(input_ids=ids, attention_mask=attn).logits[:, :-1]  # [batch, seq-1, vocab]
    targets = ids[:, 1:]
    weight = mask[:, 1:].float()
    nll = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1), reduction="none")
    return (nll * weight.reshape(-1)).sum(), weight.sum()


def train_sft(model: PreTrainedModel, examples: Sequence[tuple[list[int], list[int]]], config: SFTConfig,
              pad_id: int, time_budget_s: float | None = None) -> dict[str, float]:
    """Train in place. Returns metrics; shows a progress bar with loss and tokens/s."""
    rng = random.Random(config.seed)
    # Longer demonstrations are cut to their first max_seq_len tokens: a prefix is still a valid
    # example (its assistant tokens keep their loss), and short sequences buy many more steps.
    kept = [(t[: config.max_seq_len], m[: config.max_seq_len]) for t, m in examples]
    kept = [e for e in kept if sum(e[1]) > 0]
    truncated = sum(len(t) > config.max_seq_len for t, _ in examples)
    batches = pack_batches([len(t) for t, _ in kept], config.batch_tokens, rng)
    total_steps = max(1, math.ceil(len(batches) * config.epochs))
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.lr, weight_decay=config.weight_decay, betas=(0.9, 0.95))
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / config.warmup_steps) * 0.5 * (1 + math.cos(math.pi * min(1.0, s / total_steps)))
    )
    model.train()
    start = time.perf_counter()
    tokens_seen = 0
    losses: list[float] = []
    bar = tqdm(range(total_steps), desc="sft", unit="step", dynamic_ncols=True)
    for step in bar:
        batch = [kept[i] for i in batches[step % len(batches)]]
        width = max(len(t) for t, _ in batch)
        ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        attn = torch.zeros((len(batch), width), dtype=torch.long)
        for r, (t, m) in enumerate(batch):
            ids[r, : len(t)] = torch.tensor(t)
            mask[r, : len(m)] = torch.tensor(m)
            attn[r, : len(t)] = 1
        loss_sum, count = masked_ce_loss(model, ids, mask, attn)
        loss = loss_sum / count.clamp(min=1)
        if not torch.isfinite(loss):  # a NaN never reaches the weights
            optimizer.zero_grad(set_to_none=True)
            continue
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), config.grad_clip)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
        tokens_seen += int(attn.sum())
        losses.append(loss.item())
        elapsed = time.perf_counter() - start
        bar.set_postfix(loss=f"{losses[-1]:.3f}", tok_s=f"{tokens_seen / elapsed:,.0f}")
        if time_budget_s is not None and elapsed > time_budget_s:
            break
    bar.close()
    model.eval()
    elapsed = time.perf_counter() - start
    tail = losses[-max(1, len(losses) // 10):]
    return {
        "sft_steps": float(len(losses)),
        "sft_loss_final": sum(tail) / len(tail) if tail else float("nan"),
        "sft_loss_first": losses[0] if losses else float("nan"),
        "sft_tokens_per_s": tokens_seen / max(elapsed, 1e-9),
        "sft_seconds": elapsed,
        "sft_examples": float(len(kept)),
        "sft_truncated": float(truncated),
    }
