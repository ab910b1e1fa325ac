"""The policy loss against hand-computed values, branch by branch, and its gradient at ratio 1."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from flywheel.rl.loss import DistillConfig, LossConfig, loss_denominator, policy_loss

NAN = float("nan")
LN = math.log


def branches():
    """Two sequences of 4 tokens; token 0 of each is prompt (mask 0) and holds garbage.

    row 0, A = +1:  t1 ratio 1.5 (clipped high: -1.3)   t2 ratio 0.5 (not clipped for A > 0: -0.5)
                    t3 ratio 1, w = 3 (truncated to 2: -2)
    row 1, A = -1:  t1 ratio 0.5 (clipped low: +0.8)    t2 ratio 1.5 (not clipped for A < 0: +1.5)
                    t3 masked, garbage
    """
    prox = torch.tensor([[-1.0, -1.0, -1.0, -2.0], [-1.0, -1.0, -1.0, -1.0]])
    logp = prox + torch.tensor([[0.0, LN(1.5), LN(0.5), 0.0], [0.0, LN(0.5), LN(1.5), 0.0]])
    logp[1, 3] = NAN
    behaviour = prox - torch.tensor([[0.0, 0.0, 0.0, LN(3.0)], [0.0, 0.0, 0.0, 0.0]])
    behaviour[0, 0] = NAN
    mask = torch.tensor([[0, 1, 1, 1], [0, 1, 1, 0]], dtype=torch.float32)
    advantages = torch.tensor([1.0, -1.0])
    return logp.requires_grad_(), prox, behaviour, advantages, mask


CONFIG = LossConfig(clip_low=0.2, clip_high=0.3, behaviour_cap=2.0)


def test_token_mean_with_clip_low_clip_high_and_truncated_weight():
    logp, prox, behaviour, adv, mask = branches()
    loss, stats = policy_loss(logp, prox, behaviour, adv, mask, CONFIG)
    assert loss.item() == pytest.approx((-1.3 - 0.5 - 2.0 + 0.8 + 1.5) / 5)
    loss.backward()
    # d/dlogp of -w min(rA, clip(r)A): 0 where clipped, -w r A otherwise; masked positions 0, not NaN
    expected = torch.tensor([[0.0, 0.0, -0.5, -2.0], [0.0, 0.0, 1.5, 0.0]]) / 5
    torch.testing.assert_close(logp.grad, expected)
    assert {k: v.item() for k, v in stats.items()} == pytest.approx(
        {"tokens": 5, "clipped_low": 1, "clipped_high": 1, "is_weight_sum": 7, "is_weight_max": 3, "is_capped": 1,
         "kl_sum": 0})


def test_seq_mean_token_mean_weighs_sequences_equally():
    logp, prox, behaviour, adv, mask = branches()
    config = CONFIG.model_copy(update={"aggregation": "seq-mean-token-mean"})
    loss, _ = policy_loss(logp, prox, behaviour, adv, mask, config)
    assert loss.item() == pytest.approx(((-1.3 - 0.5 - 2.0) / 3 + (0.8 + 1.5) / 2) / 2)
    loss.backward()
    expected = torch.tensor([[0.0, 0.0, -0.5 / 3, -2.0 / 3], [0.0, 0.0, 1.5 / 2, 0.0]]) / 2
    torch.testing.assert_close(logp.grad, expected)


def test_mask_mode_drops_tokens_above_the_cap_but_keeps_them_in_the_denominator():
    logp, prox, behaviour, adv, mask = branches()
    config = CONFIG.model_copy(update={"behaviour_mode": "mask"})
    loss, stats = policy_loss(logp, prox, behaviour, adv, mask, config)
    assert loss.item() == pytest.approx((-1.3 - 0.5 + 0.8 + 1.5) / 5)
    loss.backward()
    torch.testing.assert_close(logp.grad, torch.tensor([[0.0, 0.0, -0.5, 0.0], [0.0, 0.0, 1.5, 0.0]]) / 5)
    assert stats["is_capped"].item() == 1


def test_k3_kl_to_the_reference():
    # zero advantages: the loss is kl_coef * token-mean of k3 = exp(d) - d - 1, d = logp_ref - logp
    logp = torch.zeros(1, 3, requires_grad=True)
    ref = torch.tensor([[0.0, LN(2.0), 0.0]])
    mask = torch.tensor([[0.0, 1.0, 1.0]])
    config = LossConfig(kl_coef=0.5)
    loss, stats = policy_loss(logp, logp.detach(), logp.detach(), torch.zeros(1), mask, config, logp_ref=ref)
    k3 = 2.0 - LN(2.0) - 1.0
    assert loss.item() == pytest.approx(0.5 * k3 / 2)
    assert stats["kl_sum"].item() == pytest.approx(k3)
    loss.backward()
    # d k3 / d logp = 1 - exp(d)
    torch.testing.assert_close(logp.grad, torch.tensor([[0.0, 0.5 * (1 - 2.0) / 2, 0.0]]))
    with pytest.raises(ValueError, match="logp_ref"):
        policy_loss(logp, logp.detach(), logp.detach(), torch.zeros(1), mask, config)


def test_distillation_toward_a_hinted_teacher_is_the_clipped_reverse_kl_score_function():
    # zero advantages: the loss is weight * token-mean over hinted tokens of d = clip(logp - logp_teacher);
    # its gradient d * dlogp/dtheta (score function), not dd/dlogp = 1. Token 3 is far off: clipped at 1.
    logp = torch.tensor([[-1.0, -1.0, -2.0, -1.0]], requires_grad=True)
    teacher = torch.tensor([[0.0, -1.5, -1.0, -9.0]])
    mask = torch.tensor([[0.0, 1.0, 1.0, 1.0]])
    distilled = torch.tensor([[0.0, 1.0, 1.0, 1.0]])
    config = LossConfig(distill=DistillConfig(weight=0.5, clip=1.0))
    loss, stats = policy_loss(logp, logp.detach(), logp.detach(), torch.zeros(1), mask, config,
                              logp_teacher=teacher, distilled=distilled)
    d = torch.tensor([[0.0, 0.5, -1.0, 1.0]])
    assert loss.item() == pytest.approx(0.5 * d.sum().item() / 3)
    assert stats["distill_tokens"].item() == 3 and stats["distill_sum"].item() == pytest.approx(0.5)
    loss.backward()
    torch.testing.assert_close(logp.grad, 0.5 * d / 3)
    with pytest.raises(ValueError, match="together"):
        policy_loss(logp, logp.detach(), logp.detach(), torch.zeros(1), mask, config, logp_teacher=teacher)


def test_a_nan_in_a_loss_token_reaches_the_loss():
    logp, prox, behaviour, adv, mask = branches()
    bad_logp, bad_behaviour = logp.detach().clone(), behaviour.clone()
    bad_logp[0, 2] = NAN
    bad_behaviour[0, 2] = NAN
    assert torch.isnan(policy_loss(bad_logp, prox, behaviour, adv, mask, CONFIG)[0])
    assert torch.isnan(policy_loss(logp, prox, bad_behaviour, adv, mask, CONFIG)[0])
    assert torch.isnan(policy_loss(logp, prox, behaviour, torch.tensor([NAN, -1.0]), mask, CONFIG)[0])


def test_an_all_masked_batch_has_zero_loss_and_gradient():
    logp = torch.randn(2, 5, requires_grad=True)
    loss, _ = policy_loss(logp, logp.detach(), logp.detach(), torch.tensor([NAN, 1.0]), torch.zeros(2, 5), CONFIG)
    loss.backward()
    assert loss.item() == 0 and torch.equal(logp.grad, torch.zeros(2, 5))


def test_config_errors_say_the_fix():
    with pytest.raises(ValidationError, match="behaviour_cap >= 1"):
        LossConfig(behaviour_cap=0.5)
    with pytest.raises(ValidationError):
        LossConfig(aggregation="seq-sum")


batch_st = st.tuples(st.integers(1, 4), st.integers(2, 6), st.integers(0, 2**31 - 1))


def random_batch(rows: int, seq: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    logp = -torch.rand(rows, seq, generator=g, dtype=torch.float64) * 5
    advantages = torch.randn(rows, generator=g, dtype=torch.float64)
    mask = (torch.rand(rows, seq, generator=g) < 0.7).float()
    mask[:, 0] = 0
    return logp, advantages, mask


@settings(max_examples=40, deadline=None)
@given(batch_st, st.sampled_from(["token-mean", "seq-mean-token-mean"]))
def test_on_policy_gradient_is_the_vanilla_policy_gradient(shape, aggregation):
    logp, adv, mask = random_batch(*shape)
    logp = logp.float().requires_grad_()
    adv = adv.float()
    config = LossConfig(aggregation=aggregation)
    loss, stats = policy_loss(logp, logp.detach(), logp.detach(), adv, mask, config)
    loss.backward()
    # vanilla REINFORCE: minimise -A logp, with the same aggregation
    vanilla_logp = logp.detach().clone().requires_grad_()
    per_token = -adv[:, None] * vanilla_logp * mask
    if aggregation == "token-mean":
        vanilla = per_token.sum() / mask.sum().clamp(min=1)
    else:
        vanilla = (per_token.sum(1) / mask.sum(1).clamp(min=1)).sum() / (mask.sum(1) > 0).sum().clamp(min=1)
    vanilla.backward()
    torch.testing.assert_close(logp.grad, vanilla_logp.grad)
    assert stats["clipped_low"].item() == stats["clipped_high"].item() == stats["is_capped"].item() == 0


@settings(max_examples=40, deadline=None)
@given(batch_st, st.sampled_from(["token-mean", "seq-mean-token-mean"]), st.sampled_from(["truncate", "mask", "band"]),
       st.integers(1, 3))
def test_micro_batches_with_the_shared_denominator_add_up_to_the_whole(shape, aggregation, mode, parts):
    logp, adv, mask = random_batch(*shape)
    prox = logp + 0.3 * torch.randn(logp.shape, generator=torch.Generator().manual_seed(1), dtype=logp.dtype)
    behaviour = prox - 1.0 * torch.rand(logp.shape, generator=torch.Generator().manual_seed(2), dtype=logp.dtype)
    config = LossConfig(aggregation=aggregation, behaviour_mode=mode, behaviour_cap=1.5)
    whole, _ = policy_loss(logp, prox, behaviour, adv, mask, config)
    denominator = loss_denominator(mask, config)
    pieces = [policy_loss(logp[i::parts], prox[i::parts], behaviour[i::parts], adv[i::parts], mask[i::parts], config,
                          denominator=denominator)[0] for i in range(parts)]
    assert sum(pieces).item() == pytest.approx(whole.item(), rel=1e-5, abs=1e-6)  # float32 inside


def off_policy_batch(seed: int = 0) -> tuple[torch.Tensor, ...]:
    """Three sequences of 6 positions, position 0 prompt; ratios spread wide enough to clip and leave a band."""
    g = torch.Generator().manual_seed(seed)
    behaviour = -torch.rand(3, 6, generator=g, dtype=torch.float64) * 3
    prox = behaviour + torch.randn(3, 6, generator=g, dtype=torch.float64) * 0.8
    logp = prox + torch.randn(3, 6, generator=g, dtype=torch.float64) * 0.3
    mask = torch.tensor([[0, 1, 1, 1, 1, 1], [0, 1, 1, 0, 0, 0], [0, 0, 1, 1, 1, 0]], dtype=torch.float64)
    return logp, prox, behaviour, torch.tensor([1.0, -0.5, 2.0], dtype=torch.float64), mask


def test_gspo_matches_the_papers_objective_and_gradient():
    """GSPO (Zheng et al. 2025, eq. 5-7) on the same tensors: J = 1/G sum_i min(s_i A_i, clip(s_i) A_i),
    s_i = (pi(y_i) / pi_old(y_i))^(1/|y_i|); on-policy behaviour (w = 1), so pi_old is the proximal policy."""
    logp, prox, _, adv, mask = off_policy_batch()
    config = LossConfig(ratio_level="sequence", aggregation="seq-mean-token-mean", clip_low=0.1, clip_high=0.1)
    ours_logp = logp.clone().requires_grad_()
    loss, stats = policy_loss(ours_logp, prox, prox, adv, mask, config)
    loss.backward()

    ref_logp = logp.clone().requires_grad_()
    terms = []
    for i in range(3):
        on = mask[i] > 0
        s = torch.exp((ref_logp[i][on] - prox[i][on]).sum() / on.sum())
        terms.append(torch.minimum(s * adv[i], s.clamp(1 - 0.1, 1 + 0.1) * adv[i]))
    reference = -torch.stack(terms).mean()
    reference.backward()
    assert loss.item() == pytest.approx(reference.item(), rel=1e-6)
    torch.testing.assert_close(ours_logp.grad, ref_logp.grad.double())
    # the batch clips at least one whole sequence, and unclipped ones give a nonzero gradient
    assert stats["clipped_low"].item() + stats["clipped_high"].item() > 0
    assert ours_logp.grad.abs().sum() > 0
    # the token-level ratio gives another objective on the same tensors
    token = policy_loss(logp, prox, prox, adv, mask, config.model_copy(update={"ratio_level": "token"}))[0]
    assert token.item() != pytest.approx(loss.item())
    with pytest.raises(ValidationError, match="seq-mean-token-mean"):
        LossConfig(ratio_level="sequence")


def test_band_mode_matches_icepop():
    """IcePop (Ling team 2025): J = 1/G sum_i 1/|y_i| sum_t M(k_t) min(r_t A, clip(r_t) A), with
    k_t = pi_train / pi_infer and M(k) = k inside [alpha, beta], 0 outside."""
    logp, prox, behaviour, adv, mask = off_policy_batch(1)
    alpha, beta = 0.5, 1.8
    config = LossConfig(behaviour_mode="band", behaviour_floor=alpha, behaviour_cap=beta,
                        aggregation="seq-mean-token-mean", clip_low=0.2, clip_high=0.28)
    ours_logp = logp.clone().requires_grad_()
    loss, stats = policy_loss(ours_logp, prox, behaviour, adv, mask, config)
    loss.backward()

    ref_logp = logp.clone().requires_grad_()
    k = torch.exp(prox - behaviour)
    m = torch.where((k >= alpha) & (k <= beta), k, 0.0)
    r = torch.exp(ref_logp - prox)
    per_token = m * torch.minimum(r * adv[:, None], r.clamp(0.8, 1.28) * adv[:, None]) * mask
    reference = -(per_token.sum(1) / mask.sum(1)).mean()
    reference.backward()
    assert loss.item() == pytest.approx(reference.item(), rel=1e-6)
    torch.testing.assert_close(ours_logp.grad, ref_logp.grad.double())
    outside = ((k < alpha) | (k > beta)).double() * mask
    below = ((k < alpha).double() * mask).sum().item()
    assert below > 0 and ((k > beta).double() * mask).sum().item() > 0  # both edges of the band bind here
    assert stats["is_capped"].item() == outside.sum().item()
    # "mask" keeps the tokens under the floor: a different loss on the same tensors
    one_sided = policy_loss(logp, prox, behaviour, adv, mask, config.model_copy(update={"behaviour_mode": "mask"}))[0]
    assert one_sided.item() != pytest.approx(loss.item())
