"""Advantages: how much better an episode did than the policy usually does on the same thing.

One reward per episode in, one advantage per episode out; the Learner gives that advantage to
every generated token of the episode. The baseline an episode is compared with depends on how
the data was collected:

    method       advantage of episode i                    data
    grpo         (r_i - mean_g) / (std_g + eps)            groups: one task sampled G times (simulated RL)
    dr_grpo      r_i - mean_g                              groups
    rloo         r_i - mean of the other members of g      groups
    family_loo   r_i - mean of the other episodes of the   ungrouped: one episode per prompt (real-time
                 same task family in the batch             RL, where users ask each thing once)

    from flywheel.rl.advantages import AdvantageConfig
    advantages = AdvantageConfig(method="rloo").compute(rewards, groups)

A group whose rewards are all equal carries no signal (every advantage is 0, so it adds nothing
to the gradient but still costs a forward and backward pass); `group_has_signal` and
`zero_signal_groups` let the orchestrator count them and, if it wants, drop or resample them.
A group whose episodes all failed (or all passed) but whose rewards differ is `outcome_tied`: it
is trained on (a broken tool call must cost something), and the orchestrator counts it.

Where a broken tool call's penalty lands (`broken_calls`, for trajectories):

    episode   the penalty is part of the episode's reward, so it moves the advantage of every token
              of the episode (and of its group mates, through the baseline)
    turn      the group baseline compares outcomes only (the reward without the penalty), and each
              turn that made invalid calls gets the penalty it earned, as a negative advantage on
              that turn's own tokens (`Trajectory.broken_turns`), on top of the episode's advantage

With `episode`, a group whose episodes all failed and differ only by their broken calls rewards
the episodes that did less: shorter, fewer calls. With `turn` the same group teaches "do not emit
that call" and nothing about the rest; the penalty is still paid, never dropped.

A call can also be well formed and fail: the tool answers with an error (`edit_file` on a path that
does not exist, an `old` snippet that is not in the file). Such calls are not in the reward; an
episode that recovers from one loses nothing. `failed_call_cost` > 0 charges each of them to the
turn that made it, as a negative advantage on that turn's tokens (`Trajectory.failed_turns`). It is
credit inside the episode, where the group baseline gives one number to all of it: the tiny
bootstrap's failing episodes repeat a failed edit turn after turn (33 of 96 held-out episodes ran
out of turns that way, 5 failed calls each on average; the 49 that passed made none), and with
`failed_call_cost` every such turn is pushed down on its own, also in groups whose outcomes tie.
A group with a failed call then has signal (`has_signal`).

Departures from the papers:
- GRPO (Shao et al. 2024) divides by the group's standard deviation; we use the sample standard
  deviation (Bessel's correction), as TRL and verl do.
- Dr.GRPO (Liu et al. 2025) also removes the per-sequence length normalisation of the loss. Here
  that is a separate choice, `LossConfig.aggregation` in `flywheel.rl.loss`; `dr_grpo` is only the
  advantage without the std division (the same as `grpo` with `scale_by_std=False`).
- RLOO (Ahmadian et al. 2024) is undefined for a group of one; a lone episode (and a family seen
  once, for `family_loo`) gets advantage 0: with nothing to compare it with, it teaches nothing,
  rather than pushing the policy in the direction of its raw reward.
- Groups (families) whose rewards are all equal get exactly 0, not the float residue of
  `r - mean(r)`, which `/ (std + eps)` would turn into noise.
- `family_loo` is our stand-in for a learned value baseline in real-time RL: families differ in
  how hard they are, so comparing with the same family removes most of the reward's variance that
  the policy cannot change. It is not scaled by a standard deviation.
"""

from __future__ import annotations

import math
import statistics
from collections import defaultdict
from collections.abc import Sequence
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from flywheel.agent.trajectory import INVALID_CALL_PENALTY, Trajectory

AdvantageMethod = Literal["grpo", "dr_grpo", "rloo", "family_loo"]
BrokenCallCredit = Literal["episode", "turn"]
GROUPED_METHODS = ("grpo", "dr_grpo", "rloo")
SIGNAL_TOLERANCE = 1e-9  # rewards closer than this count as equal: sums of the same parts may differ in the last bit


class AdvantageConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    method: AdvantageMethod = "grpo"
    # grpo only: unit-scale advantages per group; off = Dr.GRPO, which does not upweight near-unanimous groups
    scale_by_std: bool = True
    eps: float = Field(default=1e-6, gt=0)  # grpo only: keeps a group of near-equal rewards from exploding
    broken_calls: BrokenCallCredit = "episode"  # where an invalid tool call's penalty lands (module docstring)
    # advantage taken from a turn per valid call the tool refused (module docstring)
    failed_call_cost: float = Field(default=0.0, ge=0)

    def compute(self, rewards: Sequence[float], groups: Sequence[str],
                families: Sequence[str] | None = None) -> list[float]:
        return compute_advantages(rewards, groups, families, self.method, scale_by_std=self.scale_by_std, eps=self.eps)

    def for_trajectories(self, trajectories: Sequence[Trajectory]) -> list[float | list[float]]:
        """One advantage per trajectory, for `Learner.train_step`: a number for all its generated
        tokens, or (broken_calls = "turn", for a trajectory with broken calls) one per token."""
        groups, families = [t.group_id for t in trajectories], [t.family for t in trajectories]
        if self.broken_calls == "episode":
            advantages: list[float | list[float]] = list(self.compute([t.reward for t in trajectories], groups,
                                                                      families))
        else:
            episode = self.compute([outcome_reward(t) for t in trajectories], groups, families)
            advantages = [charge_broken_turns(t, a) for t, a in zip(trajectories, episode, strict=True)]
        if self.failed_call_cost > 0:
            advantages = [charge_failed_turns(t, a, self.failed_call_cost)
                          for t, a in zip(trajectories, advantages, strict=True)]
        return advantages

    def has_signal(self, trajectories: Sequence[Trajectory]) -> bool:
        """Whether training on this group would move the policy: its rewards differ, or (broken_calls
        = "turn") one of its episodes made a broken call, or (failed_call_cost > 0) a failed one, whose
        tokens are charged either way."""
        if self.failed_call_cost > 0 and any(t.failed_turns for t in trajectories):
            return True
        if self.broken_calls == "turn":
            return (any(broken_call_penalty(t) > 0 for t in trajectories)
                    or group_has_signal([outcome_reward(t) for t in trajectories]))
        return group_has_signal([t.reward for t in trajectories])


def broken_call_penalty(t: Trajectory) -> float:
    """What the episode's invalid tool calls cost it (>= 0): `EpisodeConfig.invalid_call_penalty` per call in
    simulated RL, `RewardConfig.invalid_tool_call` per call in real-time RL, under one part name."""
    return -t.reward_parts.get(INVALID_CALL_PENALTY, 0.0)


def outcome_reward(t: Trajectory) -> float:
    """The episode's reward without its broken-call penalty: what the workspace it left earned."""
    return t.reward + broken_call_penalty(t)


def charge_broken_turns(t: Trajectory, advantage: float) -> float | list[float]:
    """`advantage` on every token, minus the episode's broken-call penalty on the turns that made
    the broken calls, shared by its invalid calls (so the cap on the penalty holds). Calls no span
    records (an episode resumed from a state saved before spans were kept) are charged to every
    generated token: the penalty is never dropped. A trajectory without broken calls keeps its
    single number."""
    penalty = broken_call_penalty(t)
    if penalty <= 0 or not t.invalid_tool_calls:
        return advantage
    per_call = penalty / t.invalid_tool_calls
    unrecorded = t.invalid_tool_calls - sum(n for _, _, n in t.broken_turns)
    return charge_spans([advantage - per_call * unrecorded * m for m in t.loss_mask], t.broken_turns, per_call)


def charge_spans(per_token: list[float], spans: Sequence[tuple[int, int, int]], per_call: float) -> list[float]:
    """Take `per_call x calls` from the tokens of each `[start, end, calls]` span, in place; returns `per_token`."""
    for start, end, n in spans:
        per_token[start:end] = [a - per_call * n for a in per_token[start:end]]
    return per_token


def charge_failed_turns(t: Trajectory, advantage: float | Sequence[float], cost: float) -> float | list[float]:
    """`advantage` (a number, or one per token) minus `cost` per failed call on the tokens of the
    turn that made it. A trajectory without failed calls keeps its advantage as given."""
    if not t.failed_turns:
        return advantage if isinstance(advantage, int | float) else list(advantage)
    per_token = [float(advantage)] * len(t.tokens) if isinstance(advantage, int | float) else list(advantage)
    return charge_spans(per_token, t.failed_turns, cost)


def group_has_signal(rewards: Sequence[float]) -> bool:
    """Whether the rewards of one group differ, so that its advantages are not all zero."""
    return len(rewards) > 1 and max(rewards) - min(rewards) > SIGNAL_TOLERANCE


def outcome_tied(passed: Sequence[bool], rewards: Sequence[float]) -> bool:
    """Whether a group's episodes all passed or all failed, yet its rewards differ: then its whole
    signal comes from the reward's small parts (a penalty per invalid tool call, partial test
    credit). With the std scaling of `grpo` such a group weighs as much as one whose episodes
    differ in success, and when successes are rare these groups teach "do less": fewer calls,
    fewer penalties (watch `outcome_tied_groups` in the metrics)."""
    return len(set(passed)) == 1 and group_has_signal(rewards)


def zero_signal_groups(rewards: Sequence[float], groups: Sequence[str]) -> int:
    """How many groups have rewards that are all equal (a group of one counts: it has no signal either)."""
    if len(rewards) != len(groups):
        raise ValueError(f"{len(rewards)} rewards but {len(groups)} group ids; give one group id per episode")
    members: dict[str, list[float]] = defaultdict(list)
    for r, g in zip(rewards, groups, strict=True):
        members[g].append(r)
    return sum(not group_has_signal(rs) for rs in members.values())


def compute_advantages(rewards: Sequence[float], groups: Sequence[str], families: Sequence[str] | None = None,
                       method: AdvantageMethod = "grpo", *, scale_by_std: bool = True,
                       eps: float = 1e-6) -> list[float]:
    """One advantage per episode, in the order of `rewards`.

    groups: the group id of each episode (used by grpo, dr_grpo, rloo); families: the task family of
    each episode (used by family_loo, which ignores groups)."""
    n = len(rewards)
    for i, r in enumerate(rewards):
        if not math.isfinite(r):
            raise ValueError(f"reward of episode {i} is {r}; rewards must be finite: fix the grader or reward "
                             "distiller that produced it, a NaN here would poison the whole batch")
    if method == "family_loo":
        if families is None or len(families) != n:
            raise ValueError(f"family_loo needs one family per episode ({n}), got "
                             f"{'none' if families is None else len(families)}: "
                             "pass families=[t.family for t in batch]")
        keys = families
    elif method in GROUPED_METHODS:
        if len(groups) != n:
            raise ValueError(f"{n} rewards but {len(groups)} group ids; give one group id per episode")
        if "" in groups:
            raise ValueError(f"episode {list(groups).index('')} has no group id; {method} compares episodes sampled "
                             "together for one task: set Trajectory.group_id, or use method='family_loo' for ungrouped "
                             "data")
        keys = groups
    else:
        raise ValueError(f"unknown advantage method {method!r}; use one of {GROUPED_METHODS + ('family_loo',)}")

    members: dict[str, list[int]] = defaultdict(list)
    for i, key in enumerate(keys):
        members[key].append(i)
    advantages = [0.0] * n
    for idx in members.values():
        rs = [rewards[i] for i in idx]
        if not group_has_signal(rs):
            continue  # all equal or alone: exactly 0
        total, size = math.fsum(rs), len(rs)
        if method in ("rloo", "family_loo"):
            for i in idx:
                advantages[i] = rewards[i] - (total - rewards[i]) / (size - 1)
        else:
            scale = statistics.stdev(rs) + eps if method == "grpo" and scale_by_std else 1.0
            for i in idx:
                advantages[i] = (rewards[i] - total / size) / scale
    return advantages
