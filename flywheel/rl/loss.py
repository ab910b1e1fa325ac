"""The policy loss: token-level decoupled PPO with clip-higher, a capped behaviour weight and optional KL.

Asynchronous RL trains on tokens that older policies generated (the engine keeps sampling while
the Learner updates). Decoupled PPO (AReaL, Fu et al. 2025) separates the two policies that
standard PPO conflates: the *behaviour* policy that sampled the token (its logprob comes with the
trajectory) and the *proximal* policy that the update is kept close to (the Learner's weights at
the start of the batch). Per generated token t with advantage A:

    r_t = exp(logp_t - logp_prox_t)                       trust region, has the gradient
    w_t = exp(logp_prox_t - logp_behaviour_t)             off-policy correction, a constant
    w_t = min(w_t, cap)              behaviour_mode="truncate" (TIS, Yao et al. 2025)
    drop t if w_t > cap              behaviour_mode="mask"
    drop t unless floor <= w_t <= cap     behaviour_mode="band" (IcePop, Ling team 2025: masked IS)
    pg_t = -w_t * min(r_t A, clip(r_t, 1 - clip_low, 1 + clip_high) A)     clip-higher (DAPO, Yu et al. 2025)
    kl_t = exp(logp_ref_t - logp_t) - (logp_ref_t - logp_t) - 1          k3 estimator, if a reference is given
    d_t  = clip(logp_t - logp_teacher_t, -distill.clip, distill.clip)   on the tokens a teacher scored (below)
    loss_t = pg_t + kl_coef * kl_t + distill.weight * w_t * (sg(d_t) + sg(d_t) * (logp_t - sg(logp_t)))

Hinted self-distillation (`DistillConfig`, flywheel/live/hints.py): where a user's follow-up said
what was wrong with an answer, the teacher is the same weights reading that follow-up as a user
message placed before the answer; its logprobs of the answer's sampled tokens come with the
trajectory (`Trajectory.teacher_logprobs`). The term is the on-policy estimator of the per-token
reverse KL(student || teacher): the tokens were sampled from the student, so d_t is an unbiased
sample of the token's KL and sg(d_t) * grad logp_t is its gradient (the score-function form; the
gradient of the expectation's other term, E[grad logp], is 0). Its value is d_t itself, so the
loss stays readable; it pushes down tokens the hinted teacher finds less likely than the student
does, and up those it finds more likely. Clipping bounds one token's pull (a hint can make a token
thousands of times less likely); the behaviour weight w_t corrects staleness as for pg_t.

With `ratio_level="sequence"` (GSPO, Zheng et al. 2025) the trust region is the sequence's:
every token of sequence i takes its length-normalised ratio

    s_i  = exp(mean over i's loss tokens of (logp_t - logp_prox_t))
    r_t  = sg(s_i) * exp(logp_t - sg(logp_t))     (GSPO-token: value s_i, gradient s_i dlogp_t)

so one token's ratio cannot leave the band alone, and a sequence is clipped whole. On a
mixture of experts the token ratios are noisy (a token's routing can flip between two policies);
their geometric mean over the sequence is much less so, which is why GSPO was made for MoE RL.

then aggregated over tokens with loss mask 1:

    token-mean             sum_t loss_t / (tokens in the batch)
    seq-mean-token-mean    mean over sequences of (sum of the sequence's loss_t / its tokens)

With one optimizer step per batch the proximal policy *is* the current one when the loss is taken,
so r_t = 1, clipping never engages and only w_t corrects for staleness; clipping matters with
several optimizer steps per batch (`LearnerConfig.ppo_epochs`, `minibatches`).

Micro-batching: pass the whole optimizer step's `loss_denominator` (summed over its micro-batches)
as `denominator`, and the gradients accumulated over micro-batches equal one big batch's.

Departures from the papers:
- No dual-clip (Ye et al. 2020) for negative advantages with huge ratios: the proximal policy is
  at most one batch old, so r_t stays near 1, and the behaviour weight is capped separately.
- "mask" keeps dropped tokens in the denominator (as AReaL does): masking a stale token makes the
  step smaller instead of giving the remaining tokens more weight, and the denominator is known
  before any logprob is computed.
- The KL term is applied to every loss token without the behaviour weight (as in GRPO and verl),
  although the tokens come from the behaviour policy, not the current one.
- Log-ratios are clamped to [-20, 20] before exponentiating, so an extreme token gives a large
  finite number instead of inf (a clamped token has no gradient). NaN is not clamped: it
  propagates to the loss, and the Learner then skips the step.
- "band" is IcePop's masking applied to w_t, the proximal-over-behaviour ratio. IcePop's k_t
  is the training engine over the inference engine at the *same* weights; here the behaviour
  logprob may also be some versions older (async rollouts), so the band also masks stale tokens
  that drifted; with `max_staleness = 0` the two agree. Masked tokens stay in the denominator,
  as in "mask".
- GSPO's sampling policy is its old policy; here the two are apart (decoupled PPO), so the
  sequence ratio is taken against the proximal policy and the behaviour weight stays per token
  (truncated, masked or banded as configured), not a sequence-level weight. GSPO needs
  `aggregation="seq-mean-token-mean"` (its objective averages sequences) and its clip ranges are
  those of a geometric mean, far narrower than a token's: the paper uses 3e-4 and 4e-4.
- Truncated episodes are not this function's concern: the Learner zeroes their loss mask or keeps
  them (`LearnerConfig.truncated`), and a reward override for them is set where episodes are
  graded (`EpisodeConfig.truncated_reward`).
"""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator

MAX_LOG_RATIO = 20.0


class DistillConfig(BaseModel):
    """Hinted self-distillation (module docstring; the teachers are made in flywheel/live/hints.py).

    Off by default: weight 0 trains on the reward alone, and no teacher is computed."""

    model_config = ConfigDict(extra="forbid")
    # A hinted answer's token weighs `weight` times a policy-gradient token with advantage 1 (both share the
    # loss's denominator). Higher follows users' words faster, at the cost of following vague or wrong ones too.
    weight: float = Field(default=0.0, ge=0)
    # Per-token bound on |logp_student - logp_teacher| (nats): one token the hint makes very unlikely pulls
    # no harder than this. Lower is steadier and slower.
    clip: float = Field(default=2.0, gt=0)
    # The drop rule: a follow-up's hint is kept only if the hinted teacher's mean logprob of the answer's
    # sampled tokens is below the student's by at least `min_gain` nats per token, i.e. reading it makes the
    # model less likely to say what the user disliked. A hint that does not (vague, wrong, or hostile text
    # the model ignores) teaches nothing the reward does not, and is dropped and counted. Higher keeps fewer,
    # clearer hints.
    min_gain: float = Field(default=0.02, ge=0)
    # The tool-use guard: a hint after which the teacher is less likely to open the answer's tool calls (the
    # first token of each call's markup) by more than this many nats on average argues against calling a
    # tool ("stop using tools"), and is dropped. (Only the calls' contents are distilled in any case,
    # flywheel/live/hints.py.) Lower drops more hints; this one already drops honest "the tests still fail"
    # after a finish call (docs/feedback-distill.md: most dropped follow-ups are dropped here).
    max_call_drop: float = Field(default=0.1, ge=0)
    # The floor: a batch whose kept hints are fewer than this distils none of them (counted as
    # `distill_dropped/too_few`). A learner step moves every weight its gradient touches by about the
    # learning rate however few tokens that gradient came from (Adam's first steps), so with equal rewards
    # one kept hint steers a whole step: one hostile hint of 48 cut the start policy's tool use from 92 to
    # 63 answers of 144 in two steps (docs/feedback-distill.md). Below the floor the batch trains on the
    # reward alone; the replay's `min_requests` (8) is the same bound on the other side. Lower follows
    # fewer users' words, at the cost of letting a handful steer a step.
    min_kept: int = Field(default=8, ge=1)
    # Where the hint goes. "answer": the answer the follow-up is tied to (after a failing "done", the
    # `finish` call). "turn": every answer of the agent's turn it answered (flywheel/live/hints.py
    # `followup_hints`), so the edit that wrote the wrong line reads it too: what the hint is about, but
    # only worth it with a teacher that reads hints; with the scenario world's start policy it moved
    # the teacher away from the right edit and cut tool use on the distilled requests
    # (docs/feedback-distill.md, bench/hint_teacher.py).
    hint_at: Literal["answer", "turn"] = "answer"


class LossConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    clip_low: float = Field(default=0.2, gt=0, lt=1)  # ratio floor 1 - clip_low (binds for negative advantages)
    # ratio ceiling 1 + clip_high; above clip_low lets unlikely good tokens grow, which keeps entropy from
    # collapsing
    clip_high: float = Field(default=0.28, gt=0)
    behaviour_cap: float = 2.0  # cap on pi_prox / pi_behaviour; higher = less bias from stale tokens, more variance
    # truncate: weight min(w, cap); mask: drop tokens with w > cap; band: drop tokens outside [floor, cap]
    # (IcePop): also drops tokens the engine found far likelier than the Learner, which truncation keeps at full
    # weight; more dropped tokens (smaller steps) for less bias from engine/learner mismatch
    behaviour_mode: Literal["truncate", "mask", "band"] = "truncate"
    behaviour_floor: float = Field(default=0.5, gt=0, le=1)  # band's lower edge (IcePop's alpha; its beta is the cap)
    # token: PPO's per-token ratio; sequence: GSPO's length-normalised sequence ratio (needs seq-mean-token-mean and
    # clip ranges near 1e-3); steadier on MoE where single tokens' ratios jump when their routing flips
    ratio_level: Literal["token", "sequence"] = "token"
    # Routing replay (R3, `flywheel.model.routing`): the Learner's forwards route each position that predicted a
    # sampled token to the experts the engine chose there, so the engine/Learner ratio measures the policy, not
    # a routing flip. Needs episodes recorded with `episode.routed_experts` (the local engine) and turns off
    # `share_prefix` (its shared prefix is one row, the recorded routing is per episode).
    routing_replay: bool = False
    kl_coef: float = Field(default=0.0, ge=0)  # > 0 needs a reference model (the Learner's ref_model)
    distill: DistillConfig = Field(default_factory=DistillConfig)  # toward hinted teachers; off by default
    # token-mean: long answers weigh more per sequence
    aggregation: Literal["token-mean", "seq-mean-token-mean"] = "token-mean"

    @model_validator(mode="after")
    def _cap_at_least_one(self) -> LossConfig:
        if self.behaviour_cap < 1.0:
            raise ValueError(f"behaviour_cap={self.behaviour_cap} would shrink on-policy tokens (weight 1); "
                             "set loss.behaviour_cap >= 1 (2 is the TIS default)")
        if self.ratio_level == "sequence" and self.aggregation != "seq-mean-token-mean":
            raise ValueError("ratio_level='sequence' (GSPO) averages sequences: set loss.aggregation="
                             "'seq-mean-token-mean'")
        return self


def behaviour_weights(logp_prox: torch.Tensor, logp_behaviour: torch.Tensor, mask: torch.Tensor,
                      config: LossConfig) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(raw weight w, weight used in the loss, tokens kept), all [batch, seq] float, no gradient.

    Positions with mask 0 get weight 1 and are not kept, whatever their logprobs hold."""
    on = mask > 0
    log_w = torch.where(on, logp_prox.detach().float() - logp_behaviour.detach().float(), 0.0)
    raw = log_w.clamp(max=MAX_LOG_RATIO).exp()
    if config.behaviour_mode == "truncate":
        return raw, raw.clamp(max=config.behaviour_cap), on.float()
    # a NaN weight is kept, so that it reaches the loss and the step is skipped
    outside = raw > config.behaviour_cap
    if config.behaviour_mode == "band":
        outside = outside | (raw < config.behaviour_floor)
    kept = on & ~outside
    return raw, torch.where(kept, raw, 0.0), kept.float()


def loss_denominator(mask: torch.Tensor, config: LossConfig) -> torch.Tensor:
    """What `policy_loss` divides by: loss tokens (token-mean) or sequences with any (seq-mean-token-mean).

    A 0-dim tensor on mask's device: summing it over micro-batches needs no host sync."""
    on = (mask > 0).float()  # [batch, seq]
    if config.aggregation == "token-mean":
        return on.sum()
    return (on.sum(dim=1) > 0).float().sum()


def policy_loss(logp: torch.Tensor, logp_prox: torch.Tensor, logp_behaviour: torch.Tensor, advantages: torch.Tensor,
                mask: torch.Tensor, config: LossConfig, logp_ref: torch.Tensor | None = None,
                denominator: torch.Tensor | None = None, logp_teacher: torch.Tensor | None = None,
                distilled: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The loss to minimise and its statistics.

    logp (with gradient), logp_prox, logp_behaviour, logp_ref, mask: [batch, seq], position t holding
    the logprob of token t; advantages: [batch] or [batch, seq]. denominator: see `loss_denominator`;
    default this batch's own. logp_teacher, distilled: [batch, seq], the hinted teacher's logprobs and
    1 on the tokens that have one (`DistillConfig`; both or neither).

    The statistics are detached 0-dim tensors, sums over loss tokens so that micro-batches add up
    (divide by `tokens`): tokens, clipped_low, clipped_high, is_weight_sum, is_capped (truncated or
    masked or out of the band), kl_sum; and is_weight_max. With a teacher also distill_tokens and
    distill_sum (of the clipped d_t)."""
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(1)  # [batch, 1], broadcast over the sequence
    if logp.shape != mask.shape or logp_prox.shape != mask.shape or logp_behaviour.shape != mask.shape:
        raise ValueError(f"logp {tuple(logp.shape)}, logp_prox {tuple(logp_prox.shape)}, logp_behaviour "
                         f"{tuple(logp_behaviour.shape)} and mask {tuple(mask.shape)} must all be [batch, seq]")
    if advantages.shape[0] != mask.shape[0]:
        raise ValueError(f"advantages has {advantages.shape[0]} rows, mask {mask.shape[0]}; give one advantage per "
                         "sequence")
    on = mask > 0
    logp = logp.float()
    advantages = torch.where(on, advantages.float().detach().expand(mask.shape), 0.0)  # [batch, seq]
    raw_w, w, kept = behaviour_weights(logp_prox, logp_behaviour, mask, config)
    # where, not multiply: a masked position's inf or NaN must not leak into the loss or its gradient
    log_ratio = torch.where(on, logp - logp_prox.detach().float(), 0.0)
    if config.ratio_level == "sequence":
        seq_log = log_ratio.sum(dim=1, keepdim=True) / on.float().sum(dim=1, keepdim=True).clamp(min=1)  # [batch, 1]
        log_ratio = torch.where(on, seq_log.detach() + logp - logp.detach(), 0.0)
    ratio = log_ratio.clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO).exp()  # [batch, seq]
    clipped = ratio.clamp(1 - config.clip_low, 1 + config.clip_high)
    pg = -w * torch.minimum(ratio * advantages, clipped * advantages)
    per_token = torch.where(kept > 0, pg, 0.0)
    kl = torch.zeros_like(per_token)
    if logp_ref is not None:
        delta = torch.where(on, logp_ref.detach().float() - logp, 0.0).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
        kl = delta.exp() - delta - 1
        per_token = per_token + config.kl_coef * kl
    elif config.kl_coef > 0:
        raise ValueError(f"kl_coef={config.kl_coef} but no logp_ref: give reference logprobs or set loss.kl_coef=0")
    d = torch.zeros_like(per_token)
    teach = torch.zeros_like(per_token, dtype=torch.bool)
    if (logp_teacher is None) != (distilled is None):
        raise ValueError("give logp_teacher and distilled together (the teacher's logprobs and where they apply)")
    if logp_teacher is not None and distilled is not None:
        teach = on & (distilled > 0)
        clip = config.distill.clip
        d = torch.where(teach, logp.detach() - logp_teacher.detach().float(), 0.0).clamp(-clip, clip)
        # value d, gradient d * grad logp: the score-function gradient of the reverse KL (module docstring)
        surrogate = d + d * (logp - logp.detach())
        per_token = per_token + torch.where(teach, config.distill.weight * w * surrogate, 0.0)
    per_token = torch.where(on, per_token, 0.0)

    if denominator is None:
        denominator = loss_denominator(mask, config)
    denominator = denominator.clamp(min=1)  # an all-masked batch has loss 0, not 0/0
    if config.aggregation == "token-mean":
        loss = per_token.sum() / denominator
    else:
        per_seq = per_token.sum(dim=1) / on.float().sum(dim=1).clamp(min=1)  # [batch]
        loss = per_seq.sum() / denominator

    with torch.no_grad():
        onf = on.float()
        ratio_d = ratio.detach()
        stats = {
            "tokens": onf.sum(),
            "clipped_low": (onf * ((advantages < 0) & (ratio_d < 1 - config.clip_low)).float()).sum(),
            "clipped_high": (onf * ((advantages > 0) & (ratio_d > 1 + config.clip_high)).float()).sum(),
            "is_weight_sum": torch.where(on, raw_w, 0.0).sum(),
            "is_weight_max": torch.where(on, raw_w, 0.0).amax() if on.numel() else torch.zeros(()),
            "is_capped": (onf * (1 - kept) if config.behaviour_mode != "truncate"
                          else onf * (raw_w > config.behaviour_cap).float()).sum(),
            "kl_sum": torch.where(on, kl.detach(), 0.0).sum(),
        }
        if logp_teacher is not None:
            stats |= {"distill_tokens": teach.float().sum(), "distill_sum": d.sum()}
    return loss, stats
