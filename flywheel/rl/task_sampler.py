"""Which tasks a new group plays, and what the run has measured of each task's pass rate.

    shuffle   every task once per pass over the task set, in a seeded order of its own each pass
              (the default; a function of the group's number alone), or in the order given
              (`shuffle=False`)
    frontier  tasks drawn at random, each with weight 4 p (1 - p) + floor, p the task's estimated
              pass rate: the variance of a pass/fail outcome (scaled to 1 at p = 0.5), which is the
              expected square of a Dr.GRPO advantage r - mean. A group whose outcomes are all alike
              has (nearly) equal rewards and teaches nothing; dynamic sampling filters it only after
              it has cost its rollouts. The floor keeps every task in the draw: a task the policy
              never solved may come within reach as it learns. (The chance that a group of G has
              mixed outcomes, 1 - p^G - (1 - p)^G, is flatter: 0.57 at p = 0.9 for G = 8, where the
              variance is 0.36 of its peak; a group there carries little signal even when mixed.)

The estimates (`estimate`) come from every finished episode of the run, whatever the mode, so a
shuffled run records them too: the draw's estimated pass rate beside the pass rate the episodes then
had tells a harder draw from a worse policy (flywheel/rl/train.py `batch_metrics`). A task's
estimate is its passes and episodes shrunk toward its template's (its siblings': same family and
function, `sibling_key`), the template's toward its family's and the family's toward all tasks':

    p_task = (passes + K p_template) / (episodes + K),  K = `PRIOR_EPISODES`

so a task never played takes its template's estimate, and before anything is played every task's
is 0.5. The counts are not discounted: a short run's policy moves little, and a long one's older
outcomes weigh as many episodes as they were.

Departure from the task order of `shuffle`: a frontier draw depends on the outcomes seen when the
group starts, so a resumed run (whose sampler is rebuilt from trajectories.jsonl) draws as the
killed one would have only up to the episodes that were in flight; what groups started is in
groups.jsonl either way.
"""

from __future__ import annotations

import random
from collections import defaultdict
from collections.abc import Sequence
from typing import Literal

from flywheel.env.task import Task

TaskSampling = Literal["shuffle", "frontier"]
PRIOR_EPISODES = 4.0  # K: how many episodes' worth of weight the parent's estimate carries
FRONTIER_FLOOR = 0.05  # every task's least weight in a frontier draw


def sibling_key(task: Task) -> tuple[str, object]:
    """Tasks with the same key are siblings: one family, one template (the function they are about).
    Tasks whose family records no template (`metadata.extra["template"]`) are siblings of their whole family."""
    return task.family, task.metadata.extra.get("template")


class TaskSampler:
    """Draws the first task of the n-th group, and keeps the pass counts its estimates come from."""

    def __init__(self, tasks: Sequence[Task], mode: TaskSampling, seed: int, shuffle: bool = True):
        self.tasks, self.mode, self.seed, self.shuffle = list(tasks), mode, seed, shuffle
        self._order: tuple[int, list[int]] = (-1, [])  # (pass over the task set, its task order)
        # [passes, episodes] per task id, template and family, and over all
        self._task: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
        self._by_template: dict[tuple[str, object], list[float]] = defaultdict(lambda: [0.0, 0.0])
        self._by_family: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
        self._all = [0.0, 0.0]

    def observe(self, task: Task, passed: bool) -> None:
        """One finished episode of `task`."""
        for counts in (self._task[task.id], self._by_template[sibling_key(task)], self._by_family[task.family],
                       self._all):
            counts[0] += passed
            counts[1] += 1

    def estimate(self, task: Task) -> float:
        """The task's estimated pass rate under the policy so far (module docstring)."""
        p = _shrunk(self._all, 0.5)
        p = _shrunk(self._by_family[task.family], p) if task.family in self._by_family else p
        key = sibling_key(task)
        p = _shrunk(self._by_template[key], p) if key in self._by_template else p
        return _shrunk(self._task[task.id], p) if task.id in self._task else p

    def played(self, task: Task) -> int:
        """Finished episodes of `task` so far."""
        return int(self._task[task.id][1]) if task.id in self._task else 0

    def weight(self, task: Task) -> float:
        """A frontier draw's weight: 4 p (1 - p) + floor, p the task's estimate (module docstring)."""
        p = self.estimate(task)
        return 4.0 * p * (1.0 - p) + FRONTIER_FLOOR

    def draw(self, n: int) -> Task:
        """The first task of the n-th group (its siblings are picked by the Orchestrator)."""
        if self.mode == "frontier":
            rng = random.Random(f"frontier/{self.seed}/{n}")
            return rng.choices(self.tasks, weights=[self.weight(t) for t in self.tasks])[0]
        return self._shuffled(n)

    def _shuffled(self, n: int) -> Task:
        """Pass n // len(tasks) over the task set, in that pass's order (a function of n alone, so a
        resumed run draws the same tasks the killed one would have)."""
        rounds, i = divmod(n, len(self.tasks))
        if not self.shuffle:
            return self.tasks[i]
        if self._order[0] != rounds:
            order = list(range(len(self.tasks)))
            random.Random(self.seed * 1_000_003 + rounds).shuffle(order)
            self._order = (rounds, order)
        return self.tasks[self._order[1][i]]


def _shrunk(counts: Sequence[float], parent: float) -> float:
    passes, episodes = counts
    return (passes + PRIOR_EPISODES * parent) / (episodes + PRIOR_EPISODES)
