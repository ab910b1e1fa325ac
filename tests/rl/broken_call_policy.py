"""The tiny start policy of the end-to-end training tests: it opens broken tool calls.

A short SFT teaches a tiny MoE to open its one turn with `<tool_call>` two times in three and then say a
few words. The unclosed call is answered as invalid and costs `invalid_call_penalty` (never dropped),
while a plain-text turn costs nothing, so groups have reward signal and a step that moves the weights
can only raise the reward by emitting fewer broken calls. tests/rl/test_train.py builds it per run;
tests/rl/test_distributed.py commits one (its fixture) because its SFT takes a minute on 2 shared cores.
"""

from __future__ import annotations

from pathlib import Path

import torch

from flywheel.agent.episode import initial_prompt
from flywheel.env.families import task_set
from flywheel.model.chat import IM_END, TOOL_CALL_OPEN
from flywheel.model.factory import ModelConfig, build_model
from flywheel.model.tokenizer import train_tokenizer
from flywheel.rl.sft import SFTConfig, train_sft

RAMBLE = "Let me think."
FIXTURE = Path(__file__).with_name("fixtures") / "broken_call_policy"  # `save_fixture`'s output, 216 KB


def broken_call_policy(vocab_size: int):
    """(model, tokenizer) after the SFT, for the one bugfix task `train` draws (train_tasks_per_family = 1,
    difficulty 1). A larger vocabulary makes the prompt longer in tokens (2000: 741 tokens)."""
    torch.manual_seed(0)
    tasks = task_set(["bugfix"], "train", 1, seed=100, difficulty=1)
    tokenizer = train_tokenizer([initial_prompt(t) + TOOL_CALL_OPEN + RAMBLE for t in tasks] * 4, vocab_size=vocab_size)
    model = build_model(ModelConfig(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=16,
                                    num_experts=4, experts_per_token=2, moe_intermediate_size=32), tokenizer)
    ramble = tokenizer(RAMBLE + IM_END, add_special_tokens=False)["input_ids"]
    examples = []
    for task in tasks:
        prompt = tokenizer(initial_prompt(task), add_special_tokens=False)["input_ids"]
        broken = tokenizer.convert_tokens_to_ids([TOOL_CALL_OPEN]) + ramble
        for body in (broken, broken, ramble):  # 2:1, so that step 1's 16 episodes surely hold broken calls
            examples.append((prompt + body, [0] * len(prompt) + [1] * len(body)))
    train_sft(model, examples, SFTConfig(epochs=60, lr=1e-2, warmup_steps=1, batch_tokens=100_000),
              tokenizer.pad_token_id)
    return model, tokenizer


def save_fixture(folder: Path = FIXTURE) -> None:
    """Regenerate the committed fixture: `python -c "from tests.rl.broken_call_policy import save_fixture;
    save_fixture()"`."""
    model, tokenizer = broken_call_policy(vocab_size=2000)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
