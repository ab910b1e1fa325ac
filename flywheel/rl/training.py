"""What supervised fine-tuning (`flywheel.rl.sft`) and the RL Learner (`flywheel.rl.learner`) share.

Both train a causal LM on token sequences where only some positions carry loss, so both:
- pack sequences into micro-batches by a padded-token budget (`pack_batches`): long sequences
  do not blow up activation memory, short ones are not padded to the longest of a fixed-size batch;
- apply the output head only where a token is scored (`scored_logits`): generated tokens are a
  small share of a demonstration or trajectory, and the head is a large share of a small model's FLOPs;
- ramp the learning rate up linearly over the first optimizer steps (`warmup_factor`), as a pure
  function of the step, so a resumed run continues along the ramp with no scheduler state.

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
