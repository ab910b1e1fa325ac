"""Supervised fine-tuning on demonstrations: how the policy learns the tool format before RL.

A demonstration is a list of chat messages. It is tokenized by the encoder the episode runner
uses (`ConversationEncoder.conversation`), turn by turn, so what SFT trains on is token for
token what the agent later sees at inference. Only assistant tokens carry loss.
Micro-batches are packed by a token budget (long demonstrations do not blow up memory, short
ones are not padded to the longest of a fixed-size batch); the packing, the output head on scored
positions and the warmup are the RL Learner's too (`flywheel.rl.training`).

Every demonstration starts with the same system prompt and tool schemas (about 700 tokens on the
embedded default, more than half of a median demonstration). `train_sft` runs that shared prefix
through the model once per step and lets every row of the batch attend to its keys and values
(`masked_ce_loss(prefix=...)`), instead of recomputing it per row. The loss and the gradients are
those of the full sequences (the prefix carries no loss, and its activations still receive the
gradient of every row through the expanded cache); only the repeated work is gone.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Sequence

import torch
from pydantic import BaseModel, ConfigDict, Field
from tqdm import tqdm
from transformers import PreTrainedModel

from flywheel.rl.training import pack_batches, prefix_forward, scored_logits, warmup_factor


class SFTConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    epochs: float = 3.0
    # Optimizer steps, in place of epochs (the cosine ends with them). A number of steps, not a
    # time budget, fixes what a run learns: the same config and seed give the same weights on a
    # fast machine and a slow one, only later.
    steps: int | None = Field(default=None, gt=0)
    lr: float = 5e-3  # high for a tiny model trained for minutes; lower it for real checkpoints
    warmup_steps: int = 20
    weight_decay: float = 0.0
    batch_tokens: int = 512  # tokens per optimizer step (padding included); fewer = more steps per minute
    # Longer demonstrations are cut to this many tokens (counted), shared prompt included: more
    # steps per minute, but their later turns (the edit, the test run, finish) are never trained.
    max_seq_len: int = 4096
    share_prefix: bool = True  # compute the common system prompt once per step (same loss, less work)
    # Weight of the next-token loss on tokens the model does not write (tool results, the user's
    # turns, not the shared system prompt): they hold many more copies from the context (a path
    # from a listing, a name from the instruction) than the assistant's own turns.
    context_loss_weight: float = 0.0
    # Weight multiplied onto tokens that repeat a rare token seen earlier in the same sequence (a
    # package, module or function name, a path): the choices a policy must copy from its context,
    # a handful per demonstration among hundreds of easy format tokens. "Rare": in fewer than
    # `copy_rare_share` of the demonstrations. See `bench/sft.py` for what each setting buys.
    copy_weight: float = 1.0
    copy_rare_share: float = 0.1
    grad_clip: float = 1.0
    seed: int = 0




def shared_prefix_length(examples: Sequence[tuple[list[int], list[int]]]) -> int:
    """Tokens that every example starts with and that carry no loss in any, nor does the token after.

    The token right after the prefix must be loss-free too: with the prefix computed separately,
    nothing predicts it (its logit lives in the prefix pass, whose logits are not scored)."""
    if not examples:
        return 0
    first = examples[0][0]
    n = min(len(t) for t, _ in examples) - 1
    for tokens, _ in examples[1:]:
        n = next((i for i in range(n) if tokens[i] != first[i]), n)
    for _, mask in examples:
        if 1 in mask[: n + 1]:
            n = mask.index(1) - 1
    return max(n, 0)


def rare_tokens(examples: Sequence[tuple[list[int], list[int]]], share: float) -> set[int]:
    """Token ids found in fewer than `share` of the examples: names and paths, not syntax."""
    counts: dict[int, int] = {}
    for tokens, _ in examples:
        for t in set(tokens):
            counts[t] = counts.get(t, 0) + 1
    return {t for t, n in counts.items() if n < share * len(examples)}


def repeats_rare(tokens: Sequence[int], rare: set[int]) -> list[bool]:
    """For each position: the token is rare and already appeared earlier in the sequence, i.e. a
    copy from the context (a path from a listing, a name from the instruction)."""
    seen: set[int] = set()
    out = []
    for token in tokens:
        out.append(token in rare and token in seen)
        seen.add(token)
    return out


def loss_weights(tokens: Sequence[int], mask: Sequence[int], config: SFTConfig, rare: set[int],
                 free: int = 0) -> list[float]:
    """Per-token loss weights: 1 on the assistant's tokens, `context_loss_weight` on the others
    except the first `free` (the shared prompt), each times `copy_weight` where the token repeats
    a rare one (`repeats_rare`)."""
    weights = []
    for i, (m, copied) in enumerate(zip(mask, repeats_rare(tokens, rare), strict=True)):
        w = 1.0 if m else (config.context_loss_weight if i >= free else 0.0)
        weights.append(w * config.copy_weight if copied else w)
    return weights


def masked_ce_loss(model: PreTrainedModel, ids: torch.Tensor, mask: torch.Tensor, attn: torch.Tensor,
                   prefix: torch.Tensor | None = None,
                   weights: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Sum of next-token cross-entropy over loss-mask positions, and their count. With `weights`,
    each position's cross-entropy counts that many times in the sum instead (context tokens too,
    see `loss_weights`); the count stays the number of loss-mask positions.

    ids, mask, attn, weights: [batch, seq]. Right padding, so positions are the natural ones.
    prefix: [prefix_len] tokens that precede every row (loss-free, see `shared_prefix_length`); run
    once, its keys and values are broadcast to all rows."""
    if prefix is None:
        hidden = model.base_model(input_ids=ids, attention_mask=attn).last_hidden_state  # [batch, seq, hidden]
    else:
        _, hidden = prefix_forward(model, prefix, ids, attn)  # the prefix carries no loss: only the rows' own
    weights = mask.float() if weights is None else weights * attn
    logits, targets, where = scored_logits(model, hidden, ids, weights)
    nll = torch.nn.functional.cross_entropy(logits, targets, reduction="none")
    return (nll * weights[:, 1:][where]).sum(), (mask[:, 1:] > 0).sum()


def train_sft(model: PreTrainedModel, examples: Sequence[tuple[list[int], list[int]]], config: SFTConfig,
              pad_id: int, time_budget_s: float | None = None) -> dict[str, float]:
    """Train in place. Returns metrics; shows a progress bar with loss and tokens/s."""
    rng = random.Random(config.seed)
    # Longer demonstrations are cut to their first max_seq_len tokens: a prefix is still a valid
    # example (its assistant tokens keep their loss), and short sequences buy many more steps.
    kept = [(t[: config.max_seq_len], m[: config.max_seq_len]) for t, m in examples]
    kept = [e for e in kept if sum(e[1]) > 0]
    truncated = sum(len(t) > config.max_seq_len for t, _ in examples)
    shared = shared_prefix_length(kept)
    p = shared if config.share_prefix else 0
    prefix = torch.tensor(kept[0][0][:p]) if p else None
    rare = rare_tokens(kept, config.copy_rare_share)
    # No context loss on the shared prompt, whether or not it is computed once (the same loss
    # either way; and with it computed once there could be none, see shared_prefix_length).
    weighted = [loss_weights(t, m, config, rare, free=shared + 1)[p:] for t, m in kept]
    kept = [(t[p:], m[p:]) for t, m in kept]
    batches = pack_batches([len(t) for t, _ in kept], config.batch_tokens, rng)
    total_steps = config.steps or max(1, math.ceil(len(batches) * config.epochs))
    # fused: one kernel for every parameter's update, 8 ms a step against 18 ms for the per-tensor
    # loop on the bootstrap's model (2 cores), a tenth of its step; the same AdamW
    # only what trains: a LoRA adapter's weights when the base is frozen (flywheel/model/adapters.py)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=config.lr,
                                  weight_decay=config.weight_decay, betas=(0.9, 0.95), fused=True)
    start = time.perf_counter()

    def progress(step: int) -> float:
        """How far through training: by steps, or by the time budget if that runs out first, so
        a run cut by the budget still ends its cosine at a low learning rate (and learns less on
        a slower machine: `SFTConfig.steps` is the budget that does not depend on speed)."""
        by_time = (time.perf_counter() - start) / time_budget_s if time_budget_s else 0.0
        return min(1.0, max(step / total_steps, by_time))

    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: warmup_factor(s, config.warmup_steps) * 0.5 * (1 + math.cos(math.pi * progress(s)))
    )
    model.train()
    tokens_seen = 0
    losses: list[float] = []
    bar = tqdm(range(total_steps), desc="sft", unit="step", dynamic_ncols=True)
    for step in bar:
        rows = batches[step % len(batches)]
        width = max(len(kept[i][0]) for i in rows)
        ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        attn = torch.zeros((len(rows), width), dtype=torch.long)
        weights = torch.zeros((len(rows), width))
        for r, i in enumerate(rows):
            t, m = kept[i]
            ids[r, : len(t)] = torch.tensor(t)
            mask[r, : len(m)] = torch.tensor(m)
            attn[r, : len(t)] = 1
            weights[r, : len(t)] = torch.tensor(weighted[i])
        loss_sum, count = masked_ce_loss(model, ids, mask, attn, prefix, weights)
        loss = loss_sum / count.clamp(min=1)
        if not torch.isfinite(loss):  # a NaN never reaches the weights
            optimizer.zero_grad(set_to_none=True)
            continue
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), config.grad_clip)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
        tokens_seen += int(attn.sum()) + p * len(rows)  # tokens trained on, the shared prompt counted per row
        losses.append(loss.item())
        elapsed = time.perf_counter() - start
        bar.set_postfix(loss=f"{losses[-1]:.3f}", tok_s=f"{tokens_seen / elapsed:,.0f}",
                        **({"budget": f"{elapsed:.0f}/{time_budget_s:.0f}s"} if time_budget_s else {}))
        if time_budget_s is not None and elapsed > time_budget_s:
            break
    bar.close()
    model.eval()
    elapsed = time.perf_counter() - start
    tail = losses[-max(1, len(losses) // 10):]
    return {
        "sft_steps": float(len(losses)),
        "sft_steps_planned": float(total_steps),
        "sft_loss_final": sum(tail) / len(tail) if tail else float("nan"),
        "sft_loss_first": losses[0] if losses else float("nan"),
        "sft_tokens_per_s": tokens_seen / max(elapsed, 1e-9),
        "sft_seconds": elapsed,
        "sft_examples": float(len(kept)),
        "sft_truncated": float(truncated),
        "sft_shared_prefix_tokens": float(p),
    }
