"""The Learner: turns a batch of graded trajectories into one new policy version.

    train_step(trajectories, advantages)
      loss masks        each trajectory's loss_mask (zeroed for truncated episodes if truncated="mask")
      minibatches       `minibatches` contiguous chunks of the batch, one optimizer step each
      micro-batches     each chunk packed into forwards of <= micro_batch_tokens padded tokens; episodes
                        that begin alike (a group's episodes of one task) in forwards of their own that
                        run the common prefix once (`share_prefix`)
      proximal pass     no-grad forward of every micro-batch under the current weights: logp_prox,
                        entropy (and logp_ref under the reference model when kl_coef > 0); skipped
                        when there is one optimizer step per batch (see below)
      for epoch in ppo_epochs, for minibatch:
          forward + backward per micro-batch, loss divided by the whole minibatch's denominator
          loss or grad norm not finite?  skip the step and count it: no NaN reaches the weights
          clip the grad norm, AdamW step
      version += 1 if any step was taken; weights() is what the engine loads next
      policy_digest     a hash of the new weights' bytes (`weights_digest`), in the step's metrics

The loss is decoupled PPO (`flywheel.rl.loss`). The proximal policy is the weights at the start of
`train_step`. With ppo_epochs = minibatches = 1 (the default) there is one optimizer step and the
proximal policy equals the current one when the loss is taken: the ratio is exactly 1, clipping
never engages, and only the behaviour weight pi_prox / pi_behaviour corrects for the staleness of
tokens the engine sampled under older versions. Raise ppo_epochs or minibatches to take several
steps per batch; then later steps move away from the proximal policy and clipping bounds them.
The proximal pass costs one extra no-grad forward per micro-batch; it is what makes a stale
token's weight pi_prox / pi_behaviour rather than pi_theta / pi_behaviour, which would change as
the update proceeds. With a single step the two are the same weights, so the training forward's
own logprobs, detached, serve as logp_prox and the proximal pass is skipped: a third less work
per batch, the same loss and gradient (tested).

Logprobs are of the temperature-scaled distribution log_softmax(logits / T), computed in float32,
the convention of the engine's behaviour logprobs (`flywheel.model.engine`); set `temperature` to
the sampling temperature (1.0 for greedy).

Departures from AReaL and PPO: no value model or GAE (the advantage of an episode is given to all
its generated tokens, or, where the caller gives one per token, to each token its own: the penalty
of a broken tool call on the turn that made it, `flywheel.rl.advantages`); minibatches are
contiguous chunks of the batch in the order given, the same in every epoch (episodes of one GRPO
group stay together), not reshuffled; the learning rate is constant after an optional linear
warmup, a function of the optimizer steps taken (`lr_at`), so there is no scheduler state to resume.

Routing replay (`loss.routing_replay`, `flywheel.model.routing`): every forward of the step (the
proximal pass and the training forwards) routes the positions that predicted sampled tokens to the
experts the engine recorded there; the router is still trained through its probabilities at them.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import random
import time
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field
from transformers import PreTrainedModel

from flywheel.agent.trajectory import Status, Trajectory
from flywheel.model.routing import replay_routing, routing_width
from flywheel.rl.loss import LossConfig, loss_denominator, policy_loss
from flywheel.rl.training import pack_batches, prefix_forward, scored_logits, shared_prefix_groups, warmup_factor
from flywheel.timing import timed


class LearnerConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lr: float = Field(default=1e-4, gt=0)  # for the tiny model; real checkpoints want ~1e-6
    # Optimizer steps over which the learning rate ramps linearly from lr / warmup_steps up to lr
    # (0: none). Adam's first steps move every weight by about lr whatever its gradient's noise;
    # the ramp keeps them small until the moment estimates have seen a few batches.
    warmup_steps: int = Field(default=0, ge=0)
    betas: tuple[float, float] = (0.9, 0.95)
    weight_decay: float = Field(default=0.0, ge=0)
    grad_clip: float = Field(default=1.0, gt=0)
    # Padded tokens per forward and backward: bounds activation memory, does not change the gradient.
    # On a CPU small ones stay in cache: one batch of 32 agent episodes (20k tokens) of the embedded
    # default trained 1.34x faster at 1024 than at 8192 on one core, 1.22x on two (bench/learner.py).
    # An accelerator wants them as large as its memory allows.
    micro_batch_tokens: int = Field(default=1024, gt=0)
    # passes over each batch; more = more learning per sampled token, more drift from the proximal policy
    ppo_epochs: int = Field(default=1, ge=1)
    minibatches: int = Field(default=1, ge=1)  # optimizer steps per epoch; capped at the number of trajectories
    # the episodes' sampling temperature (1.0 for greedy), so logprobs match the engine's
    temperature: float = Field(default=1.0, gt=0)
    # Intra-op threads while training (None: the calling thread's setting). Where the learner shares
    # a CPU with a busy engine (async mode on a laptop), give it the cores the engine does not use:
    # oversubscribed OpenMP threads wait for each other and both sides slow down.
    threads: int | None = Field(default=None, ge=1)
    # Episodes of a batch that begin with the same tokens (a GRPO group's episodes of one task, whose
    # first turns a confident policy samples alike: a third of the demo's batch tokens, half of the
    # second episodes of a task whole) run their common prefix once (`shared_prefix_groups`): the
    # same loss and gradient to float rounding, less work. False: every row computes all of its
    # tokens (the path before it).
    share_prefix: bool = True
    # keep: learn from truncated episodes with their reward; mask: give them no loss
    truncated: Literal["keep", "mask"] = "keep"
    seed: int = 0  # order of micro-batches
    loss: LossConfig = Field(default_factory=LossConfig)


@dataclass
class MicroBatch:
    """One forward's worth of right-padded trajectories; all tensors [batch, seq] unless noted."""
    ids: torch.Tensor  # long, padding 0 (never attended to, never in the loss)
    attention: torch.Tensor  # long, 1 on real tokens
    mask: torch.Tensor  # float, 1 on tokens that carry loss
    logp_behaviour: torch.Tensor  # float32, as the engine recorded them
    advantages: torch.Tensor  # [batch, seq] float32
    logp_prox: torch.Tensor | None = None  # float32, filled by `proximal_pass`
    logp_ref: torch.Tensor | None = None  # float32, filled by `proximal_pass` when there is a reference model
    # float, 1 on loss tokens sampled by the weights this step starts from: there the engine's
    # logprob and the Learner's proximal one score the same weights and tokens, so their difference
    # is the engine/Learner mismatch (`engine_logprob_mismatch_*`), not policy drift
    on_policy: torch.Tensor | None = None
    prefix: int = 0  # leading tokens every row shares, run once (`token_logprobs`); 0: none shared
    # [batch, seq, layers * k] long: the engine's experts to replay at each position (-1: the router's own
    # choice), `loss.routing_replay`; None: no replay
    experts: torch.Tensor | None = None
    # float32, the hinted teachers' logprobs, and 1 on the loss tokens that have one (`Trajectory.teacher_logprobs`
    # not null, `DistillConfig`); None: no trajectory of the micro-batch has a teacher
    logp_teacher: torch.Tensor | None = None
    distilled: torch.Tensor | None = None


def token_logprobs(model: PreTrainedModel, ids: torch.Tensor, attention: torch.Tensor, temperature: float = 1.0,
                   entropy: bool = False, scored: torch.Tensor | None = None,
                   prefix: int = 0) -> tuple[torch.Tensor, torch.Tensor | None]:
    """float32 logprob [batch, seq] of each token given those before it, and if asked the entropy
    [batch, seq] of the distribution that predicted it. Nothing predicts token 0: its entries are 0.

    ids, attention: [batch, seq], right-padded, so positions are the natural ones.
    scored: [batch, seq] loss mask; when given, the output head runs only where it is 1 (the other
    entries are 0; `flywheel.rl.training.scored_logits`).
    prefix: the number of leading tokens every row shares (with `scored`): they are run once
    (`flywheel.rl.training.prefix_forward`), and the head once at the prefix's scored positions."""
    if prefix:
        if scored is None:
            raise ValueError("a shared prefix needs `scored`: its head runs only at the positions it names")
        return _shared_prefix_logprobs(model, ids, attention, temperature, entropy, scored, prefix)
    if scored is None:
        # [batch, seq-1, vocab]: position t predicts token t+1
        logits = model(input_ids=ids, attention_mask=attention).logits[:, :-1].float()
        targets = ids[:, 1:]
    else:
        hidden = model.base_model(input_ids=ids, attention_mask=attention).last_hidden_state  # [batch, seq, hidden]
        logits, targets, where = scored_logits(model, hidden, ids, scored)  # [scored, vocab], [scored]
    logp, ent = _picked(logits, targets, temperature, entropy)

    def full(values: torch.Tensor) -> torch.Tensor:  # back to [batch, seq], 0 where nothing was computed
        if scored is None:
            return torch.nn.functional.pad(values, (1, 0))
        out = torch.zeros(ids.shape, dtype=values.dtype, device=values.device)
        out[:, 1:][where] = values
        return out

    return full(logp), None if ent is None else full(ent)


def _picked(logits: torch.Tensor, targets: torch.Tensor, temperature: float,
            entropy: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log_softmax(logits / T) at `targets`, and if asked the distribution's entropy (no graph: a metric)."""
    if temperature != 1.0:
        logits = logits / temperature
    logz = torch.logsumexp(logits, dim=-1)
    logp = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - logz
    if not entropy:
        return logp, None
    with torch.no_grad():  # a metric: no graph for it when the logprobs have one
        detached = logits.detach()
        return logp, logz.detach() - (torch.softmax(detached, dim=-1) * detached).sum(-1)


def _shared_prefix_logprobs(model: PreTrainedModel, ids: torch.Tensor, attention: torch.Tensor, temperature: float,
                            entropy: bool, scored: torch.Tensor, p: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`token_logprobs` of rows whose first `p` tokens are the same. Tokens 1 .. p-1 are predicted
    from the prefix alone: computed once and given to every row that scores them; token p onwards
    from each row's own hidden states (the prefix's last one predicts each row's token p)."""
    rows = ids.shape[0]
    prefix_hidden, hidden = prefix_forward(model, ids[0, :p], ids[:, p:], attention[:, p:])  # [1, p, H], [rows, s, H]
    union = (scored[:, :p] > 0).any(0, keepdim=True).to(scored.dtype)  # [1, p]: scored by some row
    shared_logits, shared_targets, shared_where = scored_logits(model, prefix_hidden, ids[:1, :p], union)
    # Each row's own predictions: from the prefix's last position on ([rows, 1 + s, H] from position p - 1).
    own_hidden = torch.cat([prefix_hidden[:, -1:].expand(rows, -1, -1), hidden], dim=1)
    own_scored = torch.nn.functional.pad(scored[:, p:], (1, 0))  # position p - 1's own token is not scored
    own_logits, own_targets, own_where = scored_logits(model, own_hidden, ids[:, p - 1:], own_scored)
    shared = _picked(shared_logits, shared_targets, temperature, entropy)
    own = _picked(own_logits, own_targets, temperature, entropy)

    def full(shared_values: torch.Tensor, own_values: torch.Tensor) -> torch.Tensor:  # [rows, seq], 0 unscored
        head = torch.zeros((1, p - 1), dtype=own_values.dtype, device=own_values.device)
        head[shared_where] = shared_values
        tail = torch.zeros((rows, ids.shape[1] - p), dtype=own_values.dtype, device=own_values.device)
        tail[own_where] = own_values
        first = torch.zeros((rows, 1), dtype=own_values.dtype, device=own_values.device)
        return torch.cat([first, torch.where(scored[:, 1:p] > 0, head, 0.0), tail], dim=1)

    return full(shared[0], own[0]), None if shared[1] is None else full(shared[1], own[1])


class ScoredPolicy(torch.nn.Module):
    """A policy whose forward is `token_logprobs` with the loss mask as `scored`.

    The distributed Learner's FSDP root (`flywheel.rl.distributed`): FSDP unshards a module around
    its forward, and the scored forward calls `model.base_model` and the output head separately,
    so the root must be a module whose one forward spans both (the embeddings, the tied head and
    the final norm are the root's)."""

    def __init__(self, policy: PreTrainedModel):
        super().__init__()
        self.policy = policy

    def forward(self, ids: torch.Tensor, attention: torch.Tensor, scored: torch.Tensor, temperature: float,
                entropy: bool, prefix: int = 0) -> tuple[torch.Tensor, torch.Tensor | None]:
        return token_logprobs(self.policy, ids, attention, temperature, entropy=entropy, scored=scored, prefix=prefix)


def score(policy: PreTrainedModel | ScoredPolicy, b: MicroBatch, temperature: float,
          entropy: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`token_logprobs` of a micro-batch's loss tokens, through the ScoredPolicy root when there is one,
    with the engine's routing replayed where the micro-batch holds it."""
    if b.experts is not None:
        with replay_routing(policy, b.experts):
            return score(policy, dataclasses.replace(b, experts=None), temperature, entropy)
    if isinstance(policy, ScoredPolicy):
        return policy(b.ids, b.attention, b.mask, temperature, entropy, b.prefix)
    return token_logprobs(policy, b.ids, b.attention, temperature, entropy=entropy, scored=b.mask, prefix=b.prefix)


def staleness_histogram(trajectories: Sequence[Trajectory], version: int) -> dict[int, int]:
    """Generated tokens by staleness: `version` minus the version that generated each token."""
    counts: Counter[int] = Counter()
    for t in trajectories:
        for i, (v, m) in enumerate(zip(t.versions, t.loss_mask, strict=True)):
            if not m:
                continue
            if v < 0 or v > version:
                raise ValueError(f"trajectory {t.task_id}: generated token {i} has version {v}, learner is at "
                                 f"{version}; "
                                 "each generated token needs the version that sampled it, no newer than the learner's "
                                 "(resume the learner with load_state, or fix the episode recorder)")
            counts[version - v] += 1
    return dict(sorted(counts.items()))


Advantage = float | Sequence[float]  # one for every token of a trajectory, or one per token


def make_micro_batches(trajectories: Sequence[Trajectory], advantages: Sequence[Advantage],
                       masks: Sequence[Sequence[int]],
                       micro_batch_tokens: int, rng: random.Random,
                       device: torch.device | str = "cpu", version: int | None = None,
                       share_prefix: bool = False, routing: int = 0) -> list[MicroBatch]:
    """Pack trajectories so that each micro-batch's padded size (rows x longest) is within the budget.

    A trajectory longer than the budget gets a micro-batch of its own: a sequence is never split.
    share_prefix: trajectories that begin alike (`shared_prefix_groups`: a GRPO group's episodes of
    one task whose first turns the policy sampled alike) form micro-batches of their own, their
    common prefix run once; the others are packed as without it.
    routing: the model's layers x top-k (`routing_width`) to replay the trajectories' recorded
    experts (`MicroBatch.experts`); 0: none. Replay and share_prefix exclude each other."""
    if routing and share_prefix:
        raise ValueError("routing replay needs each episode's own forward: set learner.share_prefix = false")
    groups = shared_prefix_groups([t.tokens for t in trajectories], micro_batch_tokens) if share_prefix else []
    grouped = {i for rows, _ in groups for i in rows}
    rest = [i for i in range(len(trajectories)) if i not in grouped]
    packed = [[rest[j] for j in rows] for rows in pack_batches([len(trajectories[i].tokens) for i in rest],
                                                                micro_batch_tokens, rng)]
    layout = [(rows, 0) for rows in packed]
    if groups:
        layout += groups
        rng.shuffle(layout)
    batches = []
    for rows, prefix in layout:
        width = max(len(trajectories[i].tokens) for i in rows)
        ids = torch.zeros((len(rows), width), dtype=torch.long)
        attention = torch.zeros((len(rows), width), dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.float32)
        behaviour = torch.zeros((len(rows), width), dtype=torch.float32)
        adv = torch.zeros((len(rows), width), dtype=torch.float32)
        on_policy = torch.zeros((len(rows), width), dtype=torch.float32)
        experts = torch.full((len(rows), width, routing), -1, dtype=torch.long) if routing else None
        taught = any(trajectories[i].teacher_logprobs is not None for i in rows)
        teacher = torch.zeros((len(rows), width), dtype=torch.float32) if taught else None
        distilled = torch.zeros((len(rows), width), dtype=torch.float32) if taught else None
        for r, i in enumerate(rows):
            t, n = trajectories[i], len(trajectories[i].tokens)
            ids[r, :n] = torch.tensor(t.tokens)
            attention[r, :n] = 1
            mask[r, :n] = torch.tensor(masks[i], dtype=torch.float32)
            behaviour[r, :n] = torch.tensor(t.logprobs, dtype=torch.float32)
            adv[r, :n] = torch.tensor(advantages[i], dtype=torch.float32)  # a number broadcasts over the row
            if version is not None:
                on_policy[r, :n] = mask[r, :n] * (torch.tensor(t.versions) == version)
            if experts is not None:
                _place_routing(t, experts[r], routing)
            if teacher is not None and distilled is not None and t.teacher_logprobs is not None:
                given = torch.tensor([x is not None for x in t.teacher_logprobs], dtype=torch.float32)
                teacher[r, :n] = torch.tensor([0.0 if x is None else x for x in t.teacher_logprobs])
                distilled[r, :n] = mask[r, :n] * given
        batches.append(MicroBatch(ids.to(device), attention.to(device), mask.to(device), behaviour.to(device),
                                  adv.to(device), on_policy=on_policy.to(device) if version is not None else None,
                                  prefix=prefix, experts=None if experts is None else experts.to(device),
                                  logp_teacher=None if teacher is None else teacher.to(device),
                                  distilled=None if distilled is None else distilled.to(device)))
    return batches


def _place_routing(t: Trajectory, row: torch.Tensor, width: int) -> None:
    """Write `t`'s recorded experts into `row` [seq, width] (position i: token i's)."""
    if t.routed_experts is None:
        raise ValueError(f"trajectory {t.task_id} has no routed_experts but loss.routing_replay is on: record them "
                         "with episode.routed_experts = true (the local engine)")
    recorded = [(i, e) for i, e in enumerate(t.routed_experts) if e]
    if not recorded:
        return
    if len(recorded[0][1]) != width:
        raise ValueError(f"trajectory {t.task_id} records {len(recorded[0][1])} experts per token, the model routes "
                         f"{width} (layers x top-k): it was sampled from another architecture")
    positions = torch.tensor([i for i, _ in recorded])
    row[positions] = torch.tensor([e for _, e in recorded], dtype=torch.long)


@torch.no_grad()
def proximal_pass(model: PreTrainedModel | ScoredPolicy, batches: Sequence[MicroBatch], temperature: float,
                  ref_model: PreTrainedModel | None = None, policy: bool = True) -> torch.Tensor:
    """Fill each micro-batch's logp_prox (and logp_ref) under the current weights; returns the
    entropy summed over loss tokens (0-dim tensor). policy=False: logp_ref only (the proximal
    logprobs will come from the training forward itself, `accumulate_gradients`)."""
    entropy = torch.zeros((), device=batches[0].ids.device) if batches else torch.zeros(())
    for b in batches:
        if policy:
            b.logp_prox, ent = score(model, b, temperature, entropy=True)
            entropy += torch.where(b.mask > 0, ent, 0.0).sum()
        if ref_model is not None:
            b.logp_ref, _ = token_logprobs(ref_model, b.ids, b.attention, temperature, scored=b.mask, prefix=b.prefix)
    return entropy


def accumulate_gradients(model: PreTrainedModel | ScoredPolicy, batches: Sequence[MicroBatch], config: LossConfig,
                         temperature: float, denominator: torch.Tensor,
                         proximal_here: bool = False) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Forward and backward over the micro-batches of one optimizer step, adding into `.grad`.

    denominator: `loss_denominator` summed over the same micro-batches, so the accumulated gradient
    equals that of one forward over all of them. Returns the step's loss (detached) and the
    statistics of `policy_loss`, summed (is_weight_max: the max).

    proximal_here: the weights are the proximal policy (the first and only optimizer step of a
    batch), so logp_prox is this forward's own logprobs, detached, and the proximal pass is not
    needed; the stats then include `entropy_sum` over loss tokens."""
    total = torch.zeros((), device=denominator.device)
    stats: dict[str, torch.Tensor] = {}
    for b in batches:
        if b.logp_prox is None and not proximal_here:
            raise ValueError("micro-batch has no proximal logprobs; run proximal_pass on it before "
                             "accumulate_gradients")
        logp, ent = score(model, b, temperature, entropy=proximal_here)
        if proximal_here:
            b.logp_prox = logp.detach()
            merge_stats(stats, {"entropy_sum": torch.where(b.mask > 0, ent, 0.0).sum()})
        loss, s = policy_loss(logp, b.logp_prox, b.logp_behaviour, b.advantages, b.mask, config, b.logp_ref,
                              denominator, b.logp_teacher, b.distilled)
        loss.backward()
        total += loss.detach()
        merge_stats(stats, s)
    return total, stats


def engine_mismatch(batches: Sequence[MicroBatch]) -> torch.Tensor:
    """|engine logprob - Learner logprob| over the tokens the step's starting weights sampled, as
    [sum, tokens, max] (`mismatch_metrics` turns them into the metrics; kept as sums so that ranks
    can add theirs): 0 up to float noise when the engine computes the same distribution as the
    Learner (same temperature, same weights), whatever the engine is."""
    total, count, worst = torch.zeros(()), torch.zeros(()), torch.zeros(())
    for b in batches:
        if b.on_policy is None or b.logp_prox is None:
            continue
        diff = (b.logp_prox - b.logp_behaviour).abs() * b.on_policy  # [batch, seq]
        total += diff.sum().cpu()
        count += b.on_policy.sum().cpu()
        worst = torch.maximum(worst, diff.max().cpu())
    return torch.stack([total, count, worst])


def mismatch_metrics(sums: torch.Tensor) -> dict[str, float]:
    """engine_logprob_mismatch_mean / _max from `engine_mismatch`'s sums (NaN when no token counts)."""
    total, count, worst = (float(x) for x in sums)
    nan = float("nan")
    return {"engine_logprob_mismatch_mean": total / count if count else nan,
            "engine_logprob_mismatch_max": worst if count else nan}


def merge_stats(into: dict[str, torch.Tensor], stats: Mapping[str, torch.Tensor]) -> None:
    """Add `policy_loss` statistics into `into` (sums add, is_weight_max takes the max)."""
    for key, value in stats.items():
        if key not in into:
            into[key] = value
        else:
            into[key] = torch.maximum(into[key], value) if key == "is_weight_max" else into[key] + value


def weights_digest(model: torch.nn.Module) -> int:
    """53 bits of a hash of the trainable weights and their names (`named_parameters` order; a
    sharded tensor's local shard): equal weights give equal digests, different ones collide with
    chance about 2^-53. The training loop writes each policy's digest to the run's policies.jsonl
    before the engines get it, so flywheel/rl/audit.py can tell a resumed run's policy N from the lost
    one it replaced (a retrain on the same batch makes the same weights, and their samples are then
    rightly called N).

    Only what a step can move is hashed: a frozen parameter (a LoRA run's base model, about 540 MB
    for SmolLM2-135M) is the same in every version of a run. A tensor in host memory is hashed whole
    (about 10 ms for the embedded default's 8 MB); one on an accelerator by its float64 sum and sum of
    squares, reduced there and copied back together, so a step of a large model does not copy its
    weights to the host for this (any update that moves weights moves those sums)."""
    digest = hashlib.blake2b(digest_size=8)
    on_device: list[torch.Tensor] = []
    for name, tensor in model.named_parameters():
        if not tensor.requires_grad:
            continue
        local = tensor.to_local() if hasattr(tensor, "to_local") else tensor  # DTensor: this rank's shard
        local = local.detach().reshape(-1)
        digest.update(name.encode())
        if local.device.type == "cpu":
            digest.update(local.contiguous().view(torch.uint8).numpy())
        else:
            wide = local.double()
            on_device += [wide.sum(), wide.square().sum()]
    if on_device:
        digest.update(torch.stack(on_device).cpu().numpy().tobytes())
    return int.from_bytes(digest.digest(), "big") >> 11  # exact as a float (metrics.jsonl)


@contextmanager
def intra_op_threads(threads: int | None) -> Iterator[None]:
    """PyTorch's intra-op thread count for the calling thread, restored on exit (None: unchanged)."""
    if threads is None:
        yield
        return
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(saved)


class Learner:
    """Owns the policy's weights and optimizer, and the policy version of the weights.

    The policy version counts the steps taken since the weights the driver started from (0 by
    default); every generated token carries the one that sampled it, so staleness is a difference of
    policy versions. It is not a Registry version: the driver registers the result under the
    Registry's next version (flywheel/rl/train.py, flywheel/live/cycle.py)."""

    def __init__(self, model: PreTrainedModel, config: LearnerConfig, ref_model: PreTrainedModel | None = None,
                 version: int = 0):
        if config.loss.kl_coef > 0 and ref_model is None:
            raise ValueError(f"loss.kl_coef={config.loss.kl_coef} needs a reference model: pass ref_model "
                             "(e.g. the version-0 checkpoint) or set loss.kl_coef=0")
        if config.loss.routing_replay and not routing_width(model):
            raise ValueError(f"loss.routing_replay needs a mixture of experts; {type(model).__name__} has no MoE "
                             "router: set loss.routing_replay = false")
        self.model = model
        self.config = config
        self.ref_model = (ref_model.eval().requires_grad_(False) if ref_model is not None and config.loss.kl_coef > 0
                          else None)
        self.version = version
        self.optimizer = torch.optim.AdamW(self._parameter_groups(), lr=config.lr, betas=config.betas,
                                           weight_decay=config.weight_decay)
        self.optimizer_steps = 0
        self.skipped_steps = 0  # steps not taken because the loss or a gradient was not finite
        self._rng = random.Random(config.seed)

    def loss_mask(self, trajectory: Trajectory) -> list[int]:
        """The trajectory's loss mask after the `truncated` policy."""
        if trajectory.loss_mask and trajectory.loss_mask[0]:
            raise ValueError(f"trajectory {trajectory.task_id}: token 0 has loss mask 1, but nothing predicts the "
                             "first token; a trajectory starts with its prompt")
        if self.config.truncated == "mask" and trajectory.status == Status.TRUNCATED:
            return [0] * len(trajectory.tokens)
        return list(trajectory.loss_mask)

    def train_step(self, trajectories: Sequence[Trajectory], advantages: Sequence[Advantage]) -> dict[str, float]:
        """Learn from one batch; returns its metrics. Advantages: one per trajectory
        (`flywheel.rl.advantages`), each a number for all its tokens or a list with one per token.

        Metrics: loss (mean over steps taken), entropy (of the proximal policy, per loss token),
        kl, clip_low_frac / clip_high_frac, is_weight_mean / is_weight_max (pi_prox / pi_behaviour
        before the cap), is_truncated_frac / is_masked_frac, grad_norm (before clipping; token
        statistics over the steps taken), distill_loss (the mean clipped logp_student - logp_teacher over
        hinted tokens, the reverse-KL estimate the distillation term lowers) and distill_tokens
        (`flywheel.rl.loss`; both only where some trajectory has a teacher; tokens outside
        a hint's span carry d = 0, flywheel/live/hints.py), lr (of the last step taken), optimizer_steps, skipped_steps
        (non-finite, this call), skipped_steps_total, policy_version, staleness/<k> (generated
        tokens k policy versions old), staleness_mean / _max, sequences, batch_tokens, loss_tokens, tokens_per_s,
        seconds, and the seconds of its phases: learner_pack_s (micro-batches built), learner_proximal_s,
        learner_forward_backward_s, learner_optimizer_s (grad clip and AdamW)."""
        if not trajectories:
            raise ValueError("train_step got no trajectories; wait for a batch before stepping")
        if len(advantages) != len(trajectories):
            raise ValueError(f"{len(trajectories)} trajectories but {len(advantages)} advantages; give one per "
                             "trajectory")
        for t, a in zip(trajectories, advantages, strict=True):
            if not isinstance(a, int | float) and len(a) != len(t.tokens):
                raise ValueError(f"trajectory {t.task_id} has {len(t.tokens)} tokens but {len(a)} per-token "
                                 "advantages; "
                                 "give one per token, or one number for the whole trajectory")
        with intra_op_threads(self.config.threads):
            return self._train_step(trajectories, advantages)

    def _train_step(self, trajectories: Sequence[Trajectory], advantages: Sequence[Advantage]) -> dict[str, float]:
        start = time.perf_counter()
        seconds: dict[str, float] = {}  # the step's phases (`timed`), in the metrics as learner_<phase>
        config = self.config
        staleness = staleness_histogram(trajectories, self.version)
        masks = [self.loss_mask(t) for t in trajectories]
        device = next(self.model.parameters()).device
        n, k = len(trajectories), min(config.minibatches, len(trajectories))
        chunks = [range(j * n // k, (j + 1) * n // k) for j in range(k)]
        with timed(seconds, "pack_s"):
            minibatches = [self._micro_batches([trajectories[i] for i in c], [advantages[i] for i in c],
                                               [masks[i] for i in c], device) for c in chunks]

        was_training = self.model.training
        self.model.train()  # same mode in the proximal and the training pass, so their logprobs agree exactly
        # One optimizer step per batch: the proximal policy is the weights that step starts from, so
        # its logprobs are the training forward's own (detached), and the separate pass is skipped.
        fused = config.ppo_epochs == 1 and len(minibatches) == 1
        with timed(seconds, "proximal_s"):
            entropy = sum((proximal_pass(self.policy, mbs, config.temperature, self.ref_model, policy=not fused)
                           for mbs in minibatches), torch.zeros((), device=device))
        # Denominators stay on device: dividing by them forces no host sync.
        denominators = [self._reduce(sum((loss_denominator(b.mask, config.loss) for b in mbs),
                                         torch.zeros((), device=device))) for mbs in minibatches]
        totals: dict[str, torch.Tensor] = {}
        losses: list[torch.Tensor] = []
        grad_norms: list[torch.Tensor] = []
        skipped = 0
        for _ in range(config.ppo_epochs):
            for mbs, denominator in zip(minibatches, denominators, strict=True):
                with timed(seconds, "forward_backward_s"):
                    self.optimizer.zero_grad(set_to_none=True)
                    loss, stats = accumulate_gradients(self.policy, mbs, config.loss, config.temperature, denominator,
                                                       proximal_here=fused)
                    loss = self._reduce(loss)  # the whole batch's loss: the same on every rank
                entropy = entropy + stats.pop("entropy_sum", 0.0)
                # on an accelerator the forward and backward finish here, at the host sync
                with timed(seconds, "optimizer_s"):
                    grad_norm = self._clip_grad_norm()
                    finite = bool(torch.isfinite(loss) & torch.isfinite(grad_norm))  # the one host sync per step
                    if finite:
                        for group in self.optimizer.param_groups:
                            group["lr"] = self.lr_at(self.optimizer_steps + len(losses))
                        self.optimizer.step()
                    self.optimizer.zero_grad(set_to_none=True)
                if not finite:
                    skipped += 1  # before the optimizer touched anything: weights and Adam moments stay as they were
                    continue
                losses.append(loss)
                grad_norms.append(grad_norm)
                merge_stats(totals, stats)
        self.model.train(was_training)
        flat = [b for mbs in minibatches for b in mbs]
        sums = engine_mismatch(flat)
        mismatch = mismatch_metrics(torch.cat([self._reduce(sums[:2]), self._reduce(sums[2:], "max")]))
        taken = len(losses)
        self.optimizer_steps += taken
        self.skipped_steps += skipped
        if taken:
            self.version += 1
        elapsed = time.perf_counter() - start
        # every rank's share added up (the single-process Learner's reduce is the identity)
        entropy = self._reduce(torch.as_tensor(entropy, dtype=torch.float32).cpu())
        loss_tokens = float(self._reduce(sum((b.mask.sum().cpu() for b in flat), torch.zeros(()))))
        totals = {k: self._reduce(v.cpu(), "max" if k == "is_weight_max" else "sum") for k, v in totals.items()}
        return (self._metrics(trajectories, staleness, totals, losses, grad_norms, entropy, loss_tokens, taken,
                              skipped, elapsed) | mismatch | {f"learner_{k}": v for k, v in seconds.items()}
                | {"policy_digest": float(weights_digest(self.model))})

    def _metrics(self, trajectories: Sequence[Trajectory], staleness: dict[int, int], totals: dict[str, torch.Tensor],
                 losses: list[torch.Tensor], grad_norms: list[torch.Tensor], entropy: torch.Tensor,
                 loss_tokens: float, taken: int, skipped: int, elapsed: float) -> dict[str, float]:
        """The step's metrics (`train_step`'s docstring) from the whole batch's totals."""
        config = self.config
        batch_tokens = sum(len(t.tokens) for t in trajectories)
        stale_tokens = sum(staleness.values())
        nan = float("nan")

        def per_token(key: str) -> float:
            seen = float(totals["tokens"]) if totals else 0.0
            return float(totals[key]) / seen if seen else nan

        metrics = {
            "loss": float(torch.stack(losses).mean()) if losses else nan,
            "entropy": float(entropy) / loss_tokens if loss_tokens else nan,
            "kl": per_token("kl_sum"),
            "clip_low_frac": per_token("clipped_low"),
            "clip_high_frac": per_token("clipped_high"),
            "is_weight_mean": per_token("is_weight_sum"),
            "is_weight_max": float(totals["is_weight_max"]) if totals else nan,
            "is_truncated_frac": per_token("is_capped") if config.loss.behaviour_mode == "truncate" else 0.0,
            "is_masked_frac": per_token("is_capped") if config.loss.behaviour_mode in ("mask", "band") else 0.0,
            "grad_norm": float(torch.stack(grad_norms).mean()) if grad_norms else nan,  # before clipping
            "lr": self.optimizer.param_groups[0]["lr"],  # of the last step taken
            "optimizer_steps": float(taken),
            "skipped_steps": float(skipped),
            "skipped_steps_total": float(self.skipped_steps),
            "policy_version": float(self.version),
            "sequences": float(len(trajectories)),
            "batch_tokens": float(batch_tokens),  # prompt and tool output included
            "loss_tokens": loss_tokens,
            # batch tokens (prompt included) per second of train_step
            "tokens_per_s": batch_tokens / max(elapsed, 1e-9),
            "seconds": elapsed,
            "staleness_mean": sum(s * c for s, c in staleness.items()) / stale_tokens if stale_tokens else nan,
            "staleness_max": float(max(staleness)) if staleness else nan,
        }
        metrics.update({f"staleness/{s}": float(c) for s, c in staleness.items()})
        if float(totals.get("distill_tokens", 0.0)):  # only where hinted teachers were given
            metrics["distill_tokens"] = float(totals["distill_tokens"])
            metrics["distill_loss"] = float(totals["distill_sum"]) / metrics["distill_tokens"]
        return metrics

    # ---- what the distributed Learner (`flywheel.rl.distributed`) replaces: one process here

    @property
    def policy(self) -> PreTrainedModel | ScoredPolicy:
        """What the forwards run: the model here, the FSDP root there."""
        return self.model

    def _micro_batches(self, trajectories: Sequence[Trajectory], advantages: Sequence[Advantage],
                       masks: Sequence[Sequence[int]], device: torch.device) -> list[MicroBatch]:
        """One minibatch's micro-batches (there: of this rank's share of it)."""
        replay = self.config.loss.routing_replay
        return make_micro_batches(trajectories, advantages, masks, self.config.micro_batch_tokens, self._rng, device,
                                  self.version, self.config.share_prefix and not replay,
                                  routing_width(self.model) if replay else 0)

    def _parameter_groups(self) -> Any:
        """What AdamW optimizes (there: dense and expert parameters apart, on their own meshes)."""
        return self.model.parameters()

    def _reduce(self, value: torch.Tensor, op: Literal["sum", "max"] = "sum") -> torch.Tensor:
        """A quantity of this process's share of the batch as the whole batch's (there: over ranks)."""
        return value

    def _clip_grad_norm(self) -> torch.Tensor:
        """Clip the gradients to `grad_clip`; returns the norm before clipping."""
        return torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.config.grad_clip)

    def lr_at(self, step: int) -> float:
        """The learning rate of optimizer step `step` (0 for the first): linear warmup, then constant."""
        return self.config.lr * warmup_factor(step, self.config.warmup_steps)

    def weights(self) -> dict[str, torch.Tensor]:
        """A copy of the weights (the model's state_dict) for `Engine.update_weights`.

        A copy, so the engine may load it while training goes on; tied tensors stay one tensor."""
        copies: dict[tuple[int, tuple[int, ...], torch.dtype], torch.Tensor] = {}
        out = {}
        for name, tensor in self.model.state_dict().items():
            key = (tensor.data_ptr(), tuple(tensor.shape), tensor.dtype)
            if key not in copies:
                copies[key] = tensor.detach().clone()
            out[name] = copies[key]
        return out

    def state(self) -> dict[str, Any]:
        """Everything resuming needs: weights, optimizer moments, version and counters.

        A snapshot (later steps do not change it) that `torch.save` can write."""
        return {
            "version": self.version,
            "weights": self.weights(),
            "optimizer": copy.deepcopy(self.optimizer.state_dict()),
            "optimizer_steps": self.optimizer_steps,
            "skipped_steps": self.skipped_steps,
        }

    def snapshot(self) -> Callable[[], dict[str, Any]]:
        """`state()` as of now, to be read later (`RunFolder.save_state_later`). Taken here: the
        next step changes the weights and moments this copies."""
        state = self.state()
        return lambda: state

    def load_state(self, state: Mapping[str, Any]) -> None:
        """Resume from what `state()` returned: the model gets its weights, the optimizer its moments."""
        missing = {"version", "weights", "optimizer", "optimizer_steps", "skipped_steps"} - set(state)
        if missing:
            raise ValueError(f"learner state lacks {sorted(missing)}; give what Learner.state() returned")
        self.model.load_state_dict(state["weights"], strict=True)
        self.optimizer.load_state_dict(state["optimizer"])
        self.version = int(state["version"])
        self.optimizer_steps = int(state["optimizer_steps"])
        self.skipped_steps = int(state["skipped_steps"])
