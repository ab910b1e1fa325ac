"""The tiny start policy of the Ray and fault tests: it asks the user a question every turn.

A short SFT teaches a tiny MoE to answer each turn with "Which file?" (no tool call), so an episode
is `max_turns` turns with a saved state after each, then graded: every episode has turn boundaries
to resume from and to kill between. Built in a few seconds, once per test module.

One demonstration in three opens each question with an unclosed `<tool_call>` (the policy then
does so at about one turn in seven, at temperature 0.5), which costs `invalid_call_penalty`: a fifth
to a third of the episodes hold one, so most groups' rewards differ, the Learner's steps move the weights,
and each policy version is other weights. A policy that never moved (this one before: every reward
equal) makes the audit's lineage check (flywheel/rl/audit.py) vacuous: every version samples alike.
"""

from __future__ import annotations

import itertools
from pathlib import Path

import torch

from flywheel.agent.episode import initial_prompt, opening
from flywheel.env.families import task_set
from flywheel.model.chat import IM_END, TOOL_CALL_OPEN
from flywheel.model.conversation import ConversationEncoder
from flywheel.model.factory import ModelConfig, build_model
from flywheel.model.registry import Registry
from flywheel.model.tokenizer import train_tokenizer
from flywheel.rl.sft import SFTConfig, train_sft

SAY = "Which file?"


def register_question_policy(root: Path, head_dim: int = 16) -> Path:
    """A Registry at `root` whose `production` is the policy, for the 2 bugfix tasks (difficulty 1,
    seed 100) that `train_tasks_per_family = 2` draws. Returns `root`. `head_dim = 32`: one vLLM's
    CPU attention can serve (bench/faults.py's vllm part)."""
    torch.manual_seed(0)
    tasks = task_set(["bugfix"], "train", 2, seed=100, difficulty=1)
    tokenizer = train_tokenizer([initial_prompt(t) + SAY for t in tasks] * 4, vocab_size=300)
    model = build_model(ModelConfig(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=head_dim,
                                    num_experts=4, experts_per_token=2, moe_intermediate_size=32), tokenizer)
    encoder = ConversationEncoder(tokenizer)
    say = tokenizer(SAY + IM_END, add_special_tokens=False)["input_ids"]
    broken = tokenizer.convert_tokens_to_ids([TOOL_CALL_OPEN]) + say
    examples = []
    for task, said in itertools.product(tasks, (say, say, broken)):  # four turns, each answered by the user
        tokens = encoder.encode(opening(task), encoder.tools)
        mask = [0] * len(tokens)
        for _ in range(4):
            reply = encoder.user_reply(task.answer_question(SAY))
            tokens, mask = tokens + said + reply, mask + [1] * len(said) + [0] * len(reply)
        examples.append((tokens, mask))
    train_sft(model, examples, SFTConfig(epochs=25, lr=3e-2, warmup_steps=1, batch_tokens=100_000),
              tokenizer.pad_token_id)
    with Registry(root) as registry:
        registry.register(model, tokenizer, parent=None, aliases=["production"], note="asks questions")
    return root
