"""What supervised fine-tuning (`flywheel.rl.sft`) and the RL Learner (`flywheel.rl.learner`) share.

Both train a causal LM on token sequences where only some positions carry loss, so both:
- pack sequences into micro-batches by a padded-token budget (`pack_batches`): long sequences
  do not blow up activation memory, short ones are not padded to the longest of a fixed-size batch;
- apply the output head only where a token is scored (`scored_logits`): generated tokens are a
  small share of a demonstration or trajectory, and the head is a large share of a small model's FLOPs;
- ramp the learning rate up linearly over the first optimizer steps (`warmup_factor`), as a pure
  function of the step, so a resumed run continues along the ramp with no scheduler state;
- run a prefix that several rows share once (`prefix_forward`): SFT's common system prompt, the
  Learner's episodes of one task that began alike (`shared_prefix_groups`).

One place for each, so the two trainers cannot drift apart.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

import torch
from transformers import PreTrainedModel


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


# Below this many shared tokens a group's prefix saves less than a forward of its own costs.
MIN_SHARED_TOKENS = 32


def shared_prefix_groups(sequences: Sequence[Sequence[int]], batch_tokens: int,
                         min_shared: int = MIN_SHARED_TOKENS) -> list[tuple[list[int], int]]:
    """Rows that begin with the same tokens, to run their common prefix once (`prefix_forward`):
    (row indices, prefix length) for each group of two or more; rows in no group are left out.

    In token order, neighbours share the longest prefixes, so groups are runs of that order: a run
    grows while the tokens it saves (prefix x rows beyond the first) do not shrink, its prefix keeps
    `min_shared` tokens, and its padded size (prefix + rows x longest rest) stays within
    `batch_tokens` (or its longest row, which is never split). A prefix stops one token short of its
    shortest row, so that every row predicts at least one token from its own hidden states."""
    def common(a: Sequence[int], b: Sequence[int]) -> int:
        n = min(len(a), len(b))
        return next((i for i in range(n) if a[i] != b[i]), n)

    groups: list[tuple[list[int], int]] = []
    run: list[int] = []
    shared = 0
    for i in sorted(range(len(sequences)), key=lambda i: list(sequences[i])):
        if run:
            rows = [*run, i]
            p = min(common(sequences[run[-1]], sequences[i]), *(len(sequences[j]) - 1 for j in rows))
            if len(run) > 1:
                p = min(p, shared)
            longest = max(len(sequences[j]) for j in rows)
            if (p >= min_shared and p + len(rows) * (longest - p) <= max(batch_tokens, longest)
                    and (len(rows) - 1) * p >= (len(run) - 1) * shared):
                run, shared = rows, p
                continue
            if len(run) > 1:
                groups.append((run, shared))
        run, shared = [i], 0
    if len(run) > 1:
        groups.append((run, shared))
    return groups


def scored_logits(model: PreTrainedModel, hidden: torch.Tensor, ids: torch.Tensor,
                  scored: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The output head only where a token is scored: (logits [n, vocab] float32, targets [n], where
    [batch, seq-1]) for the n positions whose next token has loss mask 1. Generated tokens are a
    small share of a demonstration or trajectory, and the head (vocab x hidden) is a large share of
    a small model's FLOPs.

    hidden: [batch, seq, hidden] from `model.base_model`; ids, scored: [batch, seq]."""
    where = scored[:, 1:] > 0  # [batch, seq-1]: position t predicts token t+1
    logits = model.get_output_embeddings()(hidden[:, :-1][where]).float()
    return logits, ids[:, 1:][where], where


def warmup_factor(step: int, warmup_steps: int) -> float:
    """The share of the full learning rate at optimizer step `step` (0 for the first) under a
    linear warmup of `warmup_steps` steps (0: none)."""
    return min(1.0, (step + 1) / warmup_steps) if warmup_steps else 1.0


def prefix_forward(model: PreTrainedModel, prefix: torch.Tensor, ids: torch.Tensor,
                   attention: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Hidden states of rows that all start with `prefix`, the prefix run once: (prefix hidden
    [1, p, hidden], the rows' own hidden [batch, seq, hidden]). Its keys and values are broadcast
    to every row as a view (no copy), so each row attends to them as to its own, and their
    gradients add up over the rows: the same function, and the same gradient, as the full rows'
    forward, with the prefix's work done once.

    prefix: [p] token ids; ids, attention: [batch, seq], the tokens after the prefix, right-padded."""
    decoder = model.base_model
    batch, width, p = ids.shape[0], ids.shape[1], prefix.shape[0]
    out = decoder(input_ids=prefix[None], use_cache=True)
    cache = out.cache
    for layer in cache.layers:  # [1, kv_heads, p, head_dim] -> [batch, ...] as a view: no copy, gradients sum
        layer.keys = layer.keys.expand(batch, -1, -1, -1)
        layer.values = layer.values.expand(batch, -1, -1, -1)
    full = torch.cat([attention.new_ones((batch, p)), attention], dim=1)  # [batch, p + seq]
    positions = torch.arange(p, p + width, device=ids.device).expand(batch, -1)  # [batch, seq]
    hidden = decoder(input_ids=ids, attention_mask=full, position_ids=positions, cache=cache).last_hidden_state
    return out.last_hidden_state, hidden
