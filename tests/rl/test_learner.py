"""The Learner on a real tiny Qwen3-MoE (CPU, float32): it learns, micro-batching does not change the
gradient, non-finite steps never reach the weights, staleness is counted, state resumes."""

from __future__ import annotations

import copy
import io
import random

import pytest
import torch

from flywheel.agent.trajectory import Status, Trajectory
from flywheel.model.factory import ModelConfig, build_model
from flywheel.model.tokenizer import train_tokenizer
from flywheel.rl.learner import (
    Learner,
    LearnerConfig,
    accumulate_gradients,
    make_micro_batches,
    proximal_pass,
    staleness_histogram,
    token_logprobs,
    weights_digest,
)
from flywheel.rl.loss import LossConfig, loss_denominator
from flywheel.rl.sft import masked_ce_loss
from flywheel.rl.training import shared_prefix_groups

TINY = ModelConfig(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=16, num_experts=4,
                   experts_per_token=2, moe_intermediate_size=32)


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def tokenizer():
    return train_tokenizer(["def add(a, b):\n    return a + b\n", "for x in items:\n    print(x)\n"] * 10,
                           vocab_size=300)


@pytest.fixture
def model(tokenizer):
    return build_model(TINY, tokenizer)


def trajectory(model, length: int, seed: int, version: int = 0, status: Status = Status.FINISHED) -> Trajectory:
    """prompt (5 tokens), generated, tool output (3), generated; behaviour logprobs from `model` itself."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, model.config.vocab_size, (length,), generator=g).tolist()
    gen = length - 8
    mask = [0] * 5 + [1] * (gen // 2) + [0] * 3 + [1] * (gen - gen // 2)
    ids = torch.tensor([tokens])
    with torch.no_grad():
        logp, _ = token_logprobs(model, ids, torch.ones_like(ids))
    return Trajectory(task_id=f"t{seed}", family="f", tokens=tokens, loss_mask=mask,
                      logprobs=[lp if m else 0.0 for lp, m in zip(logp[0].tolist(), mask, strict=True)],
                      versions=[version if m else -1 for m in mask], prompt_len=5, status=status, reward=0.0,
                      reward_parts={}, turns=2, tool_calls=1, invalid_tool_calls=0, asked_question=False, group_id="g")


def generated_logprob(model, t: Trajectory) -> float:
    ids = torch.tensor([t.tokens])
    with torch.no_grad():
        logp, _ = token_logprobs(model, ids, torch.ones_like(ids))
    return sum(lp for lp, m in zip(logp[0].tolist(), t.loss_mask, strict=True) if m)


def params(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def test_token_logprobs_are_next_token_logprobs_in_float32_unaffected_by_padding(model):
    short, long = trajectory(model, 14, seed=1), trajectory(model, 25, seed=2)
    mbs = make_micro_batches([short, long], [0.0, 0.0], [short.loss_mask, long.loss_mask], 10_000, random.Random(0))
    (b,) = mbs
    logp, entropy = token_logprobs(model, b.ids, b.attention, entropy=True)
    assert logp.dtype == torch.float32 and logp.shape == b.ids.shape and torch.equal(logp[:, 0], torch.zeros(2))
    with torch.no_grad():
        nll, count = masked_ce_loss(model, b.ids, b.mask.long(), b.attention)  # an independent next-token loss
    assert -(logp * b.mask).sum().item() == pytest.approx(nll.item(), rel=1e-5) and count == b.mask.sum()
    for row, t in enumerate(sorted([short, long], key=lambda t: len(t.tokens))):  # padding changes nothing
        generated = [lp for lp, m in zip(t.logprobs, t.loss_mask, strict=True) if m]
        torch.testing.assert_close(logp[row][b.mask[row] > 0], torch.tensor(generated), rtol=1e-5, atol=1e-5)
    ceiling = torch.log(torch.tensor(float(model.config.vocab_size))) + 1e-4
    assert ((entropy[:, 1:] > 0) & (entropy[:, 1:] <= ceiling)).all()
    hot, _ = token_logprobs(model, b.ids, b.attention, temperature=2.0)
    with torch.no_grad():
        logits = model(input_ids=b.ids, attention_mask=b.attention).logits[:, :-1]
    expected = torch.log_softmax(logits / 2.0, -1).gather(-1, b.ids[:, 1:, None]).squeeze(-1)
    torch.testing.assert_close(hot[:, 1:], expected)
    # The head only on scored tokens: the same logprobs and entropies there, zeros elsewhere.
    only, only_entropy = token_logprobs(model, b.ids, b.attention, entropy=True, scored=b.mask)
    scored = b.mask > 0
    torch.testing.assert_close(only[scored], logp[scored], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(only_entropy[scored], entropy[scored], rtol=1e-5, atol=1e-5)
    assert torch.equal(only[~scored], torch.zeros_like(only[~scored]))


def test_positive_advantage_raises_the_sequence_logprob(model):
    good, bad = trajectory(model, 24, seed=1), trajectory(model, 30, seed=2)
    before = generated_logprob(model, good), generated_logprob(model, bad)
    learner = Learner(model, LearnerConfig(lr=3e-3))
    for _ in range(4):
        metrics = learner.train_step([good, bad], [1.0, -1.0])
    assert generated_logprob(model, good) > before[0] + 1.0
    assert generated_logprob(model, bad) < before[1] - 1.0
    assert learner.version == 4 and metrics["policy_version"] == 4 and metrics["optimizer_steps"] == 1


def test_one_step_per_batch_has_ratio_one_and_on_policy_weight_one(model):
    batch = [trajectory(model, n, seed=n) for n in (14, 21, 27)]
    metrics = Learner(model, LearnerConfig(micro_batch_tokens=48)).train_step(batch, [1.0, -0.5, 0.25])
    # proximal == current weights: no clipping; behaviour == proximal up to padding noise: w = 1
    assert metrics["clip_low_frac"] == metrics["clip_high_frac"] == 0.0
    assert metrics["is_weight_mean"] == pytest.approx(1.0, abs=1e-5)
    n = sum(t.generated_tokens for t in batch)
    assert metrics["loss"] == pytest.approx(-(1.0 * 6 + -0.5 * 13 + 0.25 * 19) / n, abs=1e-5)
    assert metrics["loss_tokens"] == n


def test_engine_logprob_mismatch_is_measured_on_the_tokens_the_current_weights_sampled(model):
    exact = [trajectory(model, n, seed=n) for n in (14, 21)]
    metrics = Learner(copy.deepcopy(model), LearnerConfig()).train_step(exact, [1.0, -1.0])
    assert metrics["engine_logprob_mismatch_max"] < 1e-5
    # An engine whose logprobs are off by 0.1 on the learner's version; stale tokens (of the version
    # before, whatever their logprobs) are not counted.
    off = [trajectory(model, n, seed=n, version=1) for n in (14, 21)]
    for t in off:
        t.logprobs = [lp - 0.1 if m else lp for lp, m in zip(t.logprobs, t.loss_mask, strict=True)]
    stale = trajectory(model, 27, seed=27, version=0)
    stale.logprobs = [lp - 3.0 if m else lp for lp, m in zip(stale.logprobs, stale.loss_mask, strict=True)]
    learner = Learner(copy.deepcopy(model), LearnerConfig())
    learner.version = 1
    metrics = learner.train_step(off + [stale], [1.0, -1.0, 0.5])
    assert metrics["engine_logprob_mismatch_mean"] == pytest.approx(0.1, abs=1e-4)
    assert metrics["engine_logprob_mismatch_max"] == pytest.approx(0.1, abs=1e-4)


def test_per_token_advantages_weigh_each_token_and_a_constant_list_is_a_number(tokenizer):
    model = build_model(TINY, tokenizer)
    t = trajectory(model, 20, seed=3)  # generated tokens 5..10 and 14..19
    split = [0.0] * 5 + [1.0] * 6 + [0.0] * 3 + [-0.5] * 6
    metrics = Learner(copy.deepcopy(model), LearnerConfig()).train_step([t], [split])
    assert metrics["loss"] == pytest.approx(-(1.0 * 6 - 0.5 * 6) / 12, abs=1e-5)  # ratio 1: minus the mean advantage
    as_number, as_list = Learner(copy.deepcopy(model), LearnerConfig()), Learner(copy.deepcopy(model), LearnerConfig())
    assert as_number.train_step([t], [0.7])["loss"] == pytest.approx(as_list.train_step([t], [[0.7] * 20])["loss"])
    for name, weight in params(as_number.model).items():
        torch.testing.assert_close(params(as_list.model)[name], weight)
    with pytest.raises(ValueError, match="20 tokens but 19 per-token advantages"):
        as_list.train_step([t], [[0.7] * 19])


def test_several_steps_per_batch_engage_the_clip(model):
    batch = [trajectory(model, 24, seed=s) for s in range(4)]
    config = LearnerConfig(lr=2e-2, ppo_epochs=3, minibatches=2, loss=LossConfig(clip_low=0.05, clip_high=0.05))
    metrics = Learner(model, config).train_step(batch, [1.0, -1.0, 1.0, -1.0])
    assert metrics["optimizer_steps"] == 6 and metrics["policy_version"] == 1
    assert metrics["clip_low_frac"] > 0 and metrics["clip_high_frac"] > 0


@pytest.mark.parametrize("aggregation", ["token-mean", "seq-mean-token-mean"])
def test_micro_batching_by_token_budget_gives_the_gradient_of_one_batch(tokenizer, aggregation):
    model = build_model(TINY, tokenizer)
    batch = [trajectory(model, n, seed=n) for n in (12, 20, 25, 31, 16)]
    # off-policy behaviour logprobs, so that the behaviour weight is not 1 everywhere
    batch = [t.model_copy(update={"logprobs": [lp - 0.3 * (i % 3) if m else 0.0 for i, (lp, m) in
                                               enumerate(zip(t.logprobs, t.loss_mask, strict=True))]}) for t in batch]
    advantages = [1.0, -0.5, 0.3, -1.2, 0.7]
    config = LossConfig(aggregation=aggregation, behaviour_cap=1.2)

    def gradient(budget: int, shared_denominator: bool = True) -> tuple[dict[str, torch.Tensor], int]:
        model.zero_grad(set_to_none=True)
        mbs = make_micro_batches(batch, advantages, [t.loss_mask for t in batch], budget, random.Random(0))
        proximal_pass(model, mbs, temperature=1.0)
        if shared_denominator:
            denominator = sum(loss_denominator(b.mask, config) for b in mbs)
            accumulate_gradients(model, mbs, config, 1.0, denominator)
        else:  # each micro-batch normalised on its own: not the big batch's gradient
            for b in mbs:
                accumulate_gradients(model, [b], config, 1.0, loss_denominator(b.mask, config))
        assert all(b.ids.numel() <= budget or b.ids.shape[0] == 1 for b in mbs)
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}, len(mbs)

    whole, n_whole = gradient(10_000)
    split, n_split = gradient(40)
    assert n_whole == 1 and n_split >= 4
    assert whole.keys() == split.keys()
    for name in whole:
        torch.testing.assert_close(split[name], whole[name], rtol=1e-4, atol=1e-6)
    naive, _ = gradient(40, shared_denominator=False)
    assert any(not torch.allclose(naive[n], whole[n], rtol=1e-3, atol=1e-5) for n in whole)


def sibling(model, t: Trajectory, keep: int, length: int, seed: int, version: int = 0) -> Trajectory:
    """An episode of the same task that began as `t` did: its first `keep` tokens, then its own
    (generated from there on), with behaviour logprobs from `model` itself."""
    g = torch.Generator().manual_seed(seed)
    tokens = t.tokens[:keep] + torch.randint(0, model.config.vocab_size, (length - keep,), generator=g).tolist()
    mask = t.loss_mask[:keep] + [1] * (length - keep)
    ids = torch.tensor([tokens])
    with torch.no_grad():
        logp, _ = token_logprobs(model, ids, torch.ones_like(ids))
    return t.model_copy(update={"tokens": tokens, "loss_mask": mask, "versions": [version if m else -1 for m in mask],
                                "logprobs": [lp if m else 0.0 for lp, m in zip(logp[0].tolist(), mask, strict=True)]})


def shared_batch(model) -> list[Trajectory]:
    """Two tasks' episodes as a GRPO group holds them: one task's first two episodes identical (a
    confident policy), a third alike for their first 41 tokens, the other task's two alike for
    their first 36; and an episode that shares nothing."""
    first, other = trajectory(model, 60, seed=3), trajectory(model, 50, seed=4)
    return [first, first.model_copy(update={"group_id": "g2"}), sibling(model, first, 41, 57, seed=5),
            other, sibling(model, other, 36, 44, seed=6), trajectory(model, 30, seed=7)]


def test_episodes_that_begin_alike_run_their_common_prefix_once_with_the_same_logprobs(model):
    batch = shared_batch(model)
    def groups(budget: int, **kwargs) -> list[tuple[list[int], int]]:
        return sorted((sorted(rows), p) for rows, p in shared_prefix_groups([t.tokens for t in batch], budget,
                                                                             **kwargs))

    assert groups(1024) == [([0, 1, 2], 41), ([3, 4], 36)]
    assert groups(90) == [([0, 1], 59), ([3, 4], 36)]  # 41 + 3 x 19 > 90: the identical two alone, to token 59
    assert groups(1024, min_shared=37) == [([0, 1, 2], 41)]
    mbs = make_micro_batches(batch, [0.0] * 6, [t.loss_mask for t in batch], 1024, random.Random(0),
                             share_prefix=True)
    assert sorted(b.prefix for b in mbs) == [0, 36, 41] and sum(b.ids.shape[0] for b in mbs) == 6
    for b in mbs:
        if b.prefix:
            shared, shared_entropy = token_logprobs(model, b.ids, b.attention, entropy=True, scored=b.mask,
                                                    prefix=b.prefix)
            alone, alone_entropy = token_logprobs(model, b.ids, b.attention, entropy=True, scored=b.mask)
            torch.testing.assert_close(shared, alone, rtol=0, atol=1e-5)
            torch.testing.assert_close(shared_entropy, alone_entropy, rtol=0, atol=1e-5)
            assert torch.equal(shared[b.mask == 0], torch.zeros_like(shared[b.mask == 0]))


def test_a_shared_prefix_gives_the_step_of_every_row_computed_alone(tokenizer):
    """share_prefix changes the work, not the step: the same loss, gradient norm, statistics and
    weights after it, with stale tokens and per-token advantages in the shared part."""
    model = build_model(TINY, tokenizer)
    batch = shared_batch(model)
    batch[1] = batch[1].model_copy(update={"versions": [1 if m else -1 for m in batch[1].loss_mask],
                                           "logprobs": [lp - 0.2 if m else 0.0 for lp, m in
                                                        zip(batch[1].logprobs, batch[1].loss_mask, strict=True)]})
    advantages = [1.0, -0.5, [0.3] * 20 + [-0.8] * 37, -1.2, 0.7, 0.4]
    results = {}
    for share in (True, False):
        learner = Learner(copy.deepcopy(model), LearnerConfig(lr=1e-2, share_prefix=share, micro_batch_tokens=256))
        learner.version = 1
        metrics = learner.train_step(batch, advantages)
        results[share] = metrics, params(learner.model)
    (shared, shared_weights), (alone, alone_weights) = results[True], results[False]
    for key in ("loss", "grad_norm", "entropy", "is_weight_mean", "loss_tokens", "engine_logprob_mismatch_max"):
        assert shared[key] == pytest.approx(alone[key], rel=1e-5, abs=1e-6), key
    # Adam's step is lr-sized (1e-2) even where a gradient is ~0, where the two summation orders'
    # rounding shows (up to 1.3e-5 seen); a prefix computed wrong shows in the loss and the gradient
    # norm above, compared to 1e-5
    for name, weight in alone_weights.items():
        torch.testing.assert_close(shared_weights[name], weight, rtol=1e-5, atol=5e-5)
    # the on-policy episode's behaviour logprobs are the model's own less 0.2: recomputed through the
    # shared prefix to within 1e-5 of that
    assert shared["engine_logprob_mismatch_max"] == pytest.approx(0.2, abs=1e-5)


def test_one_step_per_batch_takes_the_proximal_logprobs_from_its_own_forward(tokenizer):
    """Skipping the proximal pass changes nothing: same loss, gradient, statistics and entropy."""
    model = build_model(TINY, tokenizer)
    batch = [trajectory(model, n, seed=n) for n in (14, 22, 27)]
    batch = [t.model_copy(update={"logprobs": [lp - 0.4 * (i % 2) if m else 0.0 for i, (lp, m) in
                                               enumerate(zip(t.logprobs, t.loss_mask, strict=True))]}) for t in batch]
    config = LossConfig(behaviour_cap=1.3)

    def run(fused: bool):
        model.zero_grad(set_to_none=True)
        mbs = make_micro_batches(batch, [1.0, -0.5, 0.8], [t.loss_mask for t in batch], 30, random.Random(0))
        entropy = proximal_pass(model, mbs, temperature=1.0, policy=not fused)
        denominator = sum(loss_denominator(b.mask, config) for b in mbs)
        loss, stats = accumulate_gradients(model, mbs, config, 1.0, denominator, proximal_here=fused)
        entropy = entropy + stats.pop("entropy_sum", 0.0)
        return loss, stats, entropy, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    loss, stats, entropy, grads = run(fused=False)
    fused_loss, fused_stats, fused_entropy, fused_grads = run(fused=True)
    torch.testing.assert_close(fused_loss, loss)
    torch.testing.assert_close(fused_entropy, entropy)
    assert float(entropy) > 0 and stats["is_capped"] > 0  # the behaviour weights were not all 1
    for key in stats:
        torch.testing.assert_close(fused_stats[key], stats[key])
    for name in grads:
        torch.testing.assert_close(fused_grads[name], grads[name])
    with pytest.raises(ValueError, match="no proximal logprobs"):
        mbs = make_micro_batches(batch, [1.0, -0.5, 0.8], [t.loss_mask for t in batch], 30, random.Random(0))
        accumulate_gradients(model, mbs, config, 1.0, torch.tensor(1.0))


def test_staleness_histogram_counts_generated_tokens_by_age(model):
    batch = [trajectory(model, 20, seed=1, version=3), trajectory(model, 18, seed=2, version=1)]
    mixed = batch[1].model_copy(update={"versions": [-1] * 5 + [1] * 5 + [-1] * 3 + [2] * 5})
    assert staleness_histogram([batch[0], mixed], version=3) == {0: 12, 1: 5, 2: 5}
    learner = Learner(model, LearnerConfig(), version=3)
    metrics = learner.train_step([batch[0], mixed], [1.0, -1.0])
    assert (metrics["staleness/0"], metrics["staleness/1"], metrics["staleness/2"]) == (12, 5, 5)
    assert metrics["staleness_max"] == 2 and metrics["staleness_mean"] == pytest.approx((5 + 10) / 22)
    with pytest.raises(ValueError, match="version 5"):
        staleness_histogram([trajectory(model, 20, seed=1, version=5)], version=4)


@pytest.mark.parametrize("poison", ["advantage", "behaviour_logprob"])
def test_a_non_finite_step_is_skipped_counted_and_leaves_the_weights(model, poison):
    batch = [trajectory(model, 20, seed=1), trajectory(model, 24, seed=2)]
    advantages = [1.0, -1.0]
    if poison == "advantage":
        advantages = [float("nan"), -1.0]
    else:
        logprobs = list(batch[1].logprobs)
        logprobs[6] = float("nan")  # a generated token
        batch[1] = batch[1].model_copy(update={"logprobs": logprobs})
    learner = Learner(model, LearnerConfig(lr=1e-2, ppo_epochs=2))
    before = params(model)
    metrics = learner.train_step(batch, advantages)
    assert metrics["skipped_steps"] == 2 and metrics["optimizer_steps"] == 0 and learner.skipped_steps == 2
    assert all(torch.equal(before[n], p) for n, p in model.named_parameters())
    assert learner.version == 0 and not learner.optimizer.state  # Adam moments untouched too
    clean = [trajectory(model, 20, seed=1), trajectory(model, 24, seed=2)]
    metrics = learner.train_step(clean, [1.0, -1.0])
    assert metrics["optimizer_steps"] == 2 and metrics["skipped_steps_total"] == 2 and learner.version == 1
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_truncated_episodes_are_kept_or_masked(model):
    batch = [trajectory(model, 20, seed=1), trajectory(model, 24, seed=2, status=Status.TRUNCATED)]
    kept = Learner(model, LearnerConfig(truncated="keep")).train_step(batch, [1.0, -1.0])
    masked = Learner(model, LearnerConfig(truncated="mask")).train_step(batch, [1.0, -1.0])
    assert kept["loss_tokens"] == 12 + 16 and masked["loss_tokens"] == 12


def test_state_resumes_weights_and_optimizer(tokenizer):
    model = build_model(TINY, tokenizer)
    batch = [trajectory(model, 20, seed=1), trajectory(model, 24, seed=2)]
    config = LearnerConfig(lr=1e-2)
    learner = Learner(model, config)
    learner.train_step(batch, [1.0, -1.0])
    state = torch.load(_saved(learner.state()), weights_only=False)  # through the disk, as a run folder holds it

    def resumed(load: bool) -> dict[str, torch.Tensor]:
        twin = Learner(build_model(TINY.model_copy(update={"seed": 7}), tokenizer), config)
        if load:
            twin.load_state(state)
            assert twin.version == 1 and twin.optimizer_steps == 1
        else:  # the same weights with a fresh optimizer
            twin.model.load_state_dict(state["weights"], strict=True)
        twin.train_step(batch, [1.0, -1.0])
        return params(twin.model)

    learner.train_step(batch, [1.0, -1.0])
    assert learner.version == 2
    same, fresh = resumed(load=True), resumed(load=False)
    assert all(torch.allclose(same[n], p, atol=1e-6) for n, p in model.named_parameters())
    assert not all(torch.allclose(fresh[n], p, atol=1e-6) for n, p in model.named_parameters())
    with pytest.raises(ValueError, match="Learner.state"):
        learner.load_state({"version": 3})


def test_warmup_ramps_the_step_size_and_resumes_where_it_was(tokenizer):
    model = build_model(TINY, tokenizer)
    batch = [trajectory(model, 20, seed=1), trajectory(model, 24, seed=2)]
    config = LearnerConfig(lr=1e-2, warmup_steps=4)
    learner = Learner(model, config)
    before = params(model)
    metrics = learner.train_step(batch, [1.0, -1.0])
    # Adam's first step moves each weight with a gradient by the learning rate itself (m / sqrt(v) = +-1)
    moved = max(float((p - before[n]).abs().max()) for n, p in params(model).items())
    assert moved == pytest.approx(1e-2 / 4, rel=1e-3)
    assert metrics["lr"] == pytest.approx(1e-2 / 4)
    learner.train_step(batch, [1.0, -1.0])
    twin = Learner(build_model(TINY, tokenizer), config)
    twin.load_state(torch.load(_saved(learner.state()), weights_only=False))
    rates = [twin.train_step(batch, [1.0, -1.0])["lr"] for _ in range(3)]
    assert rates == pytest.approx([1e-2 * 3 / 4, 1e-2, 1e-2])  # steps 3, 4, 5: the ramp goes on from the resumed step
    assert Learner(model, LearnerConfig(lr=1e-2)).lr_at(0) == 1e-2  # no warmup: the full rate from the first step


def _saved(obj) -> io.BytesIO:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    buffer.seek(0)
    return buffer


def test_weights_are_a_detached_copy_with_ties_kept(model):
    learner = Learner(model, LearnerConfig())
    weights = learner.weights()
    assert weights.keys() == model.state_dict().keys()
    assert weights["lm_head.weight"] is weights["model.embed_tokens.weight"]
    before = weights["lm_head.weight"].clone()
    learner.train_step([trajectory(model, 20, seed=1)], [1.0])
    assert torch.equal(weights["lm_head.weight"], before)
    assert not torch.equal(model.lm_head.weight.detach(), before)


def test_kl_needs_a_reference_model_and_measures_drift(model):
    config = LearnerConfig(lr=1e-2, loss=LossConfig(kl_coef=0.1))
    with pytest.raises(ValueError, match="ref_model"):
        Learner(model, config)
    learner = Learner(model, config, ref_model=copy.deepcopy(model))
    batch = [trajectory(model, 20, seed=1), trajectory(model, 24, seed=2)]
    first = learner.train_step(batch, [1.0, -1.0])
    for _ in range(3):
        last = learner.train_step(batch, [1.0, -1.0])
    assert first["kl"] == pytest.approx(0.0, abs=1e-6) and last["kl"] > 1e-4


def test_the_learner_trains_with_its_own_thread_count_and_restores_the_callers(tokenizer):
    model = build_model(TINY, tokenizer)
    seen = []
    model.base_model.register_forward_pre_hook(lambda *_: seen.append(torch.get_num_threads()))
    batch = [trajectory(model, 16, seed=s) for s in range(2)]
    before = torch.get_num_threads()
    seen.clear()
    Learner(model, LearnerConfig(threads=1)).train_step(batch, [1.0, -1.0])
    assert seen and set(seen) == {1}
    assert torch.get_num_threads() == before
    seen.clear()
    Learner(model, LearnerConfig()).train_step(batch, [1.0, -1.0])
    assert set(seen) == {before}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_step_on_a_gpu_moves_the_weights_as_on_the_cpu(tokenizer):
    cpu = build_model(TINY, tokenizer)
    gpu = copy.deepcopy(cpu).to("cuda")
    batch = [trajectory(cpu, 20, seed=1), trajectory(cpu, 24, seed=2), trajectory(cpu, 17, seed=3)]
    config = LearnerConfig(lr=1e-2)
    on_cpu = Learner(cpu, config).train_step(batch, [1.0, -1.0, 0.5])
    learner = Learner(gpu, config)
    on_gpu = learner.train_step(batch, [1.0, -1.0, 0.5])
    assert on_gpu["loss"] == pytest.approx(on_cpu["loss"], abs=1e-4)
    assert on_gpu["grad_norm"] == pytest.approx(on_cpu["grad_norm"], rel=1e-3)
    assert all(w.device.type == "cuda" for w in learner.weights().values())
    for name, p in cpu.named_parameters():
        torch.testing.assert_close(gpu.get_parameter(name).detach().cpu(), p.detach(), atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", id="gpu", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU"))])
def test_the_weights_digest_tells_equal_weights_from_moved_ones(tokenizer, device):
    """What flywheel/rl/audit.py relies on (policies.jsonl): a copy of the weights has the digest,
    a step, or one weight nudged by a rounding step, gives another; frozen weights are left out (a
    moved frozen weight keeps it, a moved trainable one changes it); a step's metrics carry it (an
    integer a float holds exactly). On a GPU (`gpu` in its id for bench/gpu_check.sh) by sums."""
    cpu = build_model(TINY, tokenizer)
    batch = [trajectory(cpu, 20, seed=1)]
    model = copy.deepcopy(cpu).to(device)
    start = weights_digest(model)
    assert weights_digest(copy.deepcopy(model)) == start and 0 <= start < 2**53
    nudged = copy.deepcopy(model)
    with torch.no_grad():
        weight = next(nudged.parameters())
        weight[0, 0] = torch.nextafter(weight[0, 0], torch.tensor(1.0, device=device))
    assert weights_digest(nudged) != start
    frozen = copy.deepcopy(model)  # a LoRA run's base: no step moves it, so it is not hashed
    for p in frozen.parameters():
        p.requires_grad_(False)
    weight = next(frozen.parameters())
    weight.requires_grad_(True)
    trainable_only = weights_digest(frozen)
    with torch.no_grad():
        for p in list(frozen.parameters())[1:]:
            p.add_(1.0)
    assert weights_digest(frozen) == trainable_only != start
    with torch.no_grad():
        weight.add_(1.0)
    assert weights_digest(frozen) != trainable_only
    metrics = Learner(model, LearnerConfig(lr=1e-2)).train_step(batch, [1.0])
    assert metrics["policy_digest"] == weights_digest(model) != start
