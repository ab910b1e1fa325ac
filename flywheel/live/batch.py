"""The on-policy batch: served completions and their distilled rewards, as Trajectories for the Learner.

    batch = on_policy_batch(completions, rewards, version=production.version, family_key="family")
    advantages = batch.advantages()                    # family_loo: the ungrouped baseline
    learner.train_step(batch.trajectories, advantages)

A completion becomes a one-turn Trajectory with exactly the tokens the server saw and produced:

    tokens    = prompt_ids + completion_ids
    loss_mask = [0] * len(prompt_ids) + [1] * len(completion_ids)
    logprobs  = [0.0] * len(prompt_ids) + completion.logprobs     (the engine's behaviour logprobs)
    versions  = [-1] * len(prompt_ids) + [0] * len(completion_ids)

`versions` are policy versions, as in simulated RL: learner steps since the weights the cycle
trains from, which are the served production checkpoint, so every token is policy 0 (on-policy,
staleness 0). The Registry version that served them is `OnPolicyBatch.version` (and each
`Completion.version`); the trained weights are registered under the Registry's next version.

Which completions are in: those served by `version` (the production version: on-policy), from the
user-routed arms (a request that pinned its version is an eval, not user traffic), whose reward is
trainable: `final` or `defaulted`. `pending` ones are not in yet (their feedback window is open;
the caller gathers them in a later batch), and `dropped` ones never are. Nor are completions sampled
at another temperature than the learner scores at (`temperature`, the learner's; a greedy one
counts as 1.0): their logprobs are of another distribution, so every token would carry a spurious
importance weight (simulated RL refuses the same mismatch in its config, flywheel/rl/train.py). Only the naive
`drop_invalid` reward config drops anything, which is exactly the reward hack it reproduces: what is
excluded from training is free for the policy. Every exclusion is counted in `OnPolicyBatch.excluded`.

Advantages: one episode per request, no groups (users ask each thing once), so the baseline of a
completion is the mean reward of the other completions of its task family in the batch
(`family_loo`, flywheel/rl/advantages.py). The family is the client's `request_meta[family_key]`
(a product can derive it from the request, e.g. the kind of file or command), or with a list of
keys the combination of their values; requests without one share the family `DEFAULT_FAMILY`. The
reward itself never reads `request_meta`.

Why the grouping matters: a baseline mixing requests the policy mostly solves with requests it
mostly fails gives every attempt at a hard request a negative advantage, the best ones included,
and every token of such an answer is pushed down, the tool call's well-formed JSON with the rest.
With hard and easy requests in groups of their own, an attempt is compared with attempts at its
own kind of request.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

from flywheel.agent.trajectory import Status, Trajectory
from flywheel.live.deploy import PINNED
from flywheel.live.records import Completion
from flywheel.live.rewards import Reward
from flywheel.rl.advantages import compute_advantages

DEFAULT_FAMILY = "all"


def family_of(completion: Completion, family_key: str | Sequence[str]) -> str:
    """The completion's baseline group: `request_meta[family_key]`, or with several keys their values
    joined by "/" (e.g. family and difficulty: "bugfix/3"); keys a request lacks are left out."""
    keys = [family_key] if isinstance(family_key, str) else list(family_key)
    values = [completion.request_meta.get(k) for k in keys]
    parts = [str(v) for v in values if isinstance(v, str | int) and not isinstance(v, bool) and str(v)]
    return "/".join(parts) or DEFAULT_FAMILY


def completion_trajectory(completion: Completion, reward: Reward, family: str) -> Trajectory:
    """One served completion with its reward as a Trajectory (module docstring)."""
    if reward.completion_id != completion.id:
        raise ValueError(f"reward of {reward.completion_id} given for completion {completion.id}; pair them by id")
    if not completion.prompt_ids:
        raise ValueError(f"completion {completion.id} has no prompt ids; the server stores the prompt it served")
    p, c = len(completion.prompt_ids), len(completion.completion_ids)
    return Trajectory(
        task_id=completion.id,
        family=family,
        tokens=[*completion.prompt_ids, *completion.completion_ids],
        loss_mask=[0] * p + [1] * c,
        logprobs=[0.0] * p + list(completion.logprobs),
        versions=[-1] * p + [0] * c,  # policy 0: the served checkpoint itself (module docstring)
        prompt_len=p,
        status=Status.TRUNCATED if completion.finish_reason == "length" else Status.FINISHED,
        reward=reward.reward,
        reward_parts=dict(reward.parts),
        turns=1,
        tool_calls=len(completion.tool_calls),
        invalid_tool_calls=completion.invalid_tool_calls,
        asked_question=completion.asked_question,
        group_id="",
        timings={"latency_s": completion.latency_ms / 1000},
    )


@dataclass
class OnPolicyBatch:
    version: int
    trajectories: list[Trajectory]
    completions: list[Completion]  # in the order of `trajectories`
    excluded: dict[str, int] = field(default_factory=dict)  # reason -> completions left out

    @property
    def families(self) -> list[str]:
        return [t.family for t in self.trajectories]

    def advantages(self) -> list[float]:
        """family_loo advantages, one per trajectory (module docstring)."""
        return compute_advantages([t.reward for t in self.trajectories], [""] * len(self.trajectories),
                                  self.families, method="family_loo")

    def summary(self) -> dict[str, float | int | dict[str, int]]:
        n = len(self.trajectories)
        rewards = [t.reward for t in self.trajectories]
        return {
            "completions": n,
            "sessions": len({c.session_id for c in self.completions}),
            "reward_mean": sum(rewards) / n if n else float("nan"),
            "tokens": sum(len(t.tokens) for t in self.trajectories),
            "generated_tokens": sum(t.generated_tokens for t in self.trajectories),
            "families": dict(Counter(self.families)),
            "excluded": dict(self.excluded),
        }


def on_policy_batch(completions: Sequence[Completion], rewards: Sequence[Reward], version: int,
                    family_key: str | Sequence[str] = "family", temperature: float = 1.0) -> OnPolicyBatch:
    """The trainable completions served by `version` at the learner's `temperature`, in the order given
    (module docstring).

    `rewards` must hold the reward of every completion of `version` given (RewardDistiller.distill
    of the same completions); completions of other versions are skipped and counted."""
    by_id = {r.completion_id: r for r in rewards}
    trajectories: list[Trajectory] = []
    kept: list[Completion] = []
    excluded: Counter[str] = Counter()
    for c in completions:
        if c.version != version:
            excluded["other_version"] += 1
            continue
        if c.arm == PINNED:
            excluded["pinned"] += 1
            continue
        if c.scoring_temperature != temperature:
            excluded["other_temperature"] += 1
            continue
        reward = by_id.get(c.id)
        if reward is None:
            raise ValueError(f"completion {c.id} has no reward; pass RewardDistiller.distill() of the same completions")
        if not reward.trainable:
            excluded[reward.status.value] += 1
            continue
        trajectories.append(completion_trajectory(c, reward, family_of(c, family_key)))
        kept.append(c)
    return OnPolicyBatch(version=version, trajectories=trajectories, completions=kept, excluded=dict(excluded))
