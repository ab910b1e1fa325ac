"""A reference loss curve: a refactor that changes the Learner's numerics fails here.

A short deterministic run on CPU (one intra-op thread, seeded model and data): a handful of
Learner steps on fixed synthetic trajectories with the tiny test model, in two configurations
that between them take every path of `Learner.train_step` (one fused optimizer step per batch
with a warmup; several PPO epochs and minibatches with a proximal pass, clipping, stale tokens
above the behaviour cap and a KL term against a reference model). Each step's loss, grad norm,
entropy, KL, behaviour weight, clip and cap fractions and learning rate are compared with
`reference_loss.json` to a relative tolerance of `RTOL`: tight enough that a 1% change of the
learning rate fails (checked below), loose enough for float32 rounding that differs between CPUs.

When a numerics change is intended (a new loss term, another normalisation), regenerate the
curve and commit the new file with the change, saying why the numbers moved:

    PYTHONPATH=. python tests/rl/test_reference_loss.py      # rewrites tests/rl/reference_loss.json
"""

from __future__ import annotations

import copy
import json
import math
import sys
from pathlib import Path

import pytest
import torch

from flywheel.agent.trajectory import Status, Trajectory
from flywheel.model.factory import ModelConfig, build_model
from flywheel.model.tokenizer import train_tokenizer
from flywheel.rl.learner import Learner, LearnerConfig, token_logprobs
from flywheel.rl.loss import LossConfig

REFERENCE = Path(__file__).with_name("reference_loss.json")
RTOL, ATOL = 1e-4, 1e-6  # measured: three runs agree bit for bit; 1% more lr moves a step's loss by 2.4e-3
TINY = ModelConfig(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=16, num_experts=4,
                   experts_per_token=2, moe_intermediate_size=32)
STEPS = 5
KEYS = ("loss", "grad_norm", "entropy", "kl", "is_weight_mean", "clip_low_frac", "clip_high_frac", "is_truncated_frac",
        "lr")
CONFIGS = {
    "one_step": LearnerConfig(lr=1e-3, warmup_steps=2, micro_batch_tokens=128),
    "ppo": LearnerConfig(lr=1e-3, ppo_epochs=2, minibatches=2, micro_batch_tokens=128,
                         loss=LossConfig(kl_coef=0.05, clip_low=0.1, clip_high=0.1)),
}


def trajectories(model) -> list[Trajectory]:
    """Eight fixed episodes: prompt, generated, tool output, generated. Behaviour logprobs are the
    start model's, nudged by seeded noise (so behaviour weights differ from 1 and some pass the
    cap); half the tokens come from the version before (stale by one)."""
    g = torch.Generator().manual_seed(1234)
    out = []
    for i in range(8):
        length = int(torch.randint(20, 60, (1,), generator=g))
        tokens = torch.randint(0, model.config.vocab_size, (length,), generator=g).tolist()
        gen = length - 9
        mask = [0] * 6 + [1] * (gen // 2) + [0] * 3 + [1] * (gen - gen // 2)
        ids = torch.tensor([tokens])
        with torch.no_grad():
            logp, _ = token_logprobs(model, ids, torch.ones_like(ids))
        noise = torch.randn(length, generator=g) * 0.5
        behaviour = [float(lp + n) if m else 0.0 for lp, n, m in zip(logp[0], noise, mask, strict=True)]
        version = i % 2  # the learner is at version 1: odd episodes on-policy, even ones a version old
        out.append(Trajectory(task_id=f"ref{i}", family="ref", tokens=tokens, loss_mask=mask, logprobs=behaviour,
                              versions=[version if m else -1 for m in mask], prompt_len=6, status=Status.FINISHED,
                              reward=0.0, reward_parts={}, turns=2, tool_calls=1, invalid_tool_calls=0,
                              asked_question=False, group_id=f"g{i // 4}"))
    return out


def advantages(step: int, batch: list[Trajectory]) -> list[float | list[float]]:
    """Seeded advantages per step; the last episode's are per token (a penalised turn)."""
    g = torch.Generator().manual_seed(step)
    out: list[float | list[float]] = [float(a) for a in torch.randn(len(batch), generator=g)]
    last = batch[-1]
    out[-1] = [0.0 if j < len(last.tokens) // 2 else -0.5 for j in range(len(last.tokens))]
    return out


def curve(name: str, lr_scale: float = 1.0) -> list[dict[str, float]]:
    """The per-step metrics of one configuration, run from scratch on one thread."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # reductions split over threads round differently
    try:
        tokenizer = train_tokenizer(["def add(a, b):\n    return a + b\n", "for x in items:\n    print(x)\n"] * 10,
                                    vocab_size=300)
        model = build_model(TINY, tokenizer)  # seeded by ModelConfig.seed
        batch = trajectories(model)
        config = CONFIGS[name].model_copy(update={"lr": CONFIGS[name].lr * lr_scale})
        ref = copy.deepcopy(model) if config.loss.kl_coef > 0 else None
        learner = Learner(model, config, ref_model=ref, version=1)
        rows = []
        for step in range(STEPS):
            metrics = learner.train_step(batch, advantages(step, batch))
            rows.append({key: metrics[key] for key in KEYS})
        return rows
    finally:
        torch.set_num_threads(threads)


def mismatches(got: list[dict[str, float]], want: list[dict[str, float]]) -> list[str]:
    bad = []
    for step, (g, w) in enumerate(zip(got, want, strict=True)):
        for key in KEYS:
            if not math.isclose(g[key], w[key], rel_tol=RTOL, abs_tol=ATOL):
                bad.append(f"step {step} {key}: {g[key]!r}, reference {w[key]!r}")
    return bad


@pytest.mark.parametrize("name", list(CONFIGS))
def test_the_learner_reproduces_its_reference_loss_curve(name):
    reference = json.loads(REFERENCE.read_text())[name]
    assert len(reference) == STEPS
    bad = mismatches(curve(name), reference)
    assert not bad, ("the Learner's numerics changed:\n  " + "\n  ".join(bad) +
                     "\nif intended, regenerate with `PYTHONPATH=. python tests/rl/test_reference_loss.py` "
                     "and say in the commit why the numbers moved")


def test_the_tolerance_catches_a_one_percent_change_of_the_learning_rate():
    reference = json.loads(REFERENCE.read_text())["one_step"]
    assert mismatches(curve("one_step", lr_scale=1.01), reference)


if __name__ == "__main__":
    curves = {name: curve(name) for name in CONFIGS}
    REFERENCE.write_text(json.dumps(curves, indent=1) + "\n")
    print(f"wrote {REFERENCE}", file=sys.stderr)
