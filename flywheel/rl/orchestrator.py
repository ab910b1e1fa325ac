"""The asynchronous GRPO Orchestrator: rollouts and learning overlap, staleness stays bounded.

    rollout workers (threads, `concurrency` episodes at once)          learner (the caller's thread)
    ┌──────────────────────────────────────────────────────┐         ┌────────────────────────────────┐
    │ wait: admission (unconsumed groups < admit_limit)     │         │ wait: ≥ B complete groups with  │
    │ run_episode × G on one task (or k siblings) ── Engine │ ──────> │  signal, and no unfinished group │
    │ each turn: EpisodeState -> run/inflight/ (resumable)  │ buffer  │  that would exceed max_staleness │
    │ done: Trajectory appended to run/trajectories.jsonl   │         │ advantages -> Learner.train_step │
    └──────────────────────────────────────────────────────┘         │ Engine.update_weights(w, v+1) ──┐│
              ^  in-flight episodes pause, their KV cache is rebuilt │ checkpoint, eval, metrics      ││
              └── under the new weights (or kept), and they resume ──┴────────────────────────────────┘│
                  (partial rollouts): every token keeps the version that made it  <───────────────────┘

What unblocks what:
- A rollout worker starts a new group when one is consumed (or filtered): the admission limit
  `groups_per_step * (1 + max_staleness)` caps the groups that are started but not yet trained on.
- The learner steps when B complete groups are buffered, except that a group started at version
  s may only be trained on at version v ≤ s + max_staleness. Before the learner moves from v to
  v + 1 it therefore takes every buffered group started at v − max_staleness into this batch,
  and waits for any such group still in flight. Staleness (current version minus the oldest
  token's version) is so never above `max_staleness`, by construction; the Learner reports its
  histogram.
- Sync mode is the same machine with `max_staleness = 0`: B groups start, all finish, the learner
  steps, the next B start. Same code path, so the comparison in `bench/async_rl.py` is fair.
- Every turn asks the engine with its group's start order as priority: when more episodes are in
  flight than the engine has rows, the oldest groups, the ones the learner waits on, go first.

Nothing hangs silently: an episode that makes no progress for `episode_timeout_s`, a learner that
cannot form a batch for `stall_timeout_s`, and a weight update that is not applied within
`weight_update_timeout_s` each raise `OrchestratorStalled` naming what was waited for.

Durable runs (`run_dir`):
- `groups.jsonl`       every group when it starts (id, its task or sibling tasks, policy version)
- `trajectories.jsonl` every finished episode the moment it arrives, failed ones too
- `inflight/*.json`    the latest `EpisodeState` of each unfinished episode (written atomically)
- `state/`             learner weights + optimizer + which groups were trained on, every
                       `checkpoint_every` steps (written to a temporary folder, then renamed)
- `metrics.jsonl`      one line per step
A run killed at any moment restarts from `state/`: groups trained on after that checkpoint are
buffered again, finished episodes are read back, and unfinished ones resume from their saved
state (an episode that had not finished its first turn restarts). No rollout is dropped.

Departures from AReaL: rollout workers are threads of one process, not RPC servers (the Engine may
run in a process of its own, `EngineConfig.separate_process`, so that its decode loop does not wait
on their GIL); staleness is bounded by blocking the learner on the oldest group rather than by
discarding rollouts, so no work is thrown away.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, model_validator
from transformers import PreTrainedTokenizerBase

from flywheel.agent.episode import EpisodeConfig, EpisodeState, run_episode
from flywheel.agent.evaluate import passed
from flywheel.agent.trajectory import Status, Trajectory
from flywheel.env.pool import SandboxPool
from flywheel.env.task import Task
from flywheel.model.engine import Engine
from flywheel.rl.advantages import AdvantageConfig, outcome_tied
from flywheel.rl.learner import Learner


class OrchestratorConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    mode: Literal["async", "sync"] = "async"
    group_size: int = 8  # G episodes per group; their rewards are compared to each other
    # Tasks per group: 1 is GRPO's group (G samples of one task). k > 1 spreads the G episodes over
    # k sibling tasks (same family and template: one request, different hidden details), so the
    # baseline is the template's. A policy that answers every sibling alike then still gets signal
    # wherever the siblings' tests disagree, e.g. an `ambiguous` policy that writes the variant
    # it prefers whatever the user's answer said: one-task groups reward that guess when it happens
    # to match and drop the group when all G guesses tie.
    tasks_per_group: int = 1
    groups_per_step: int = 4  # B complete groups make one learner step
    # How many versions a token may lag the learner when it is trained on. Higher values keep the
    # engine busy through long-tailed episodes (better throughput) at the cost of off-policy noise
    # (corrected by the behaviour importance weight, which grows with staleness). 0 = on-policy.
    max_staleness: int = 1
    concurrency: int = 32  # episodes in flight; the engine batches their generations
    filter_zero_signal: bool = True  # dynamic sampling: groups with equal rewards are counted, not trained on
    # Filtered groups in a row, in units of groups_per_step, before the run stops: every group
    # scoring the same means the tasks are all too hard or all too easy for this policy.
    zero_signal_patience: int = 10
    max_steps: int = 10
    # Tasks are drawn in a fresh seeded order each pass over the task set. In the order given
    # (family by family) the learner would spend a quarter of a run on each family in turn and
    # unlearn the last one while on the next.
    shuffle_tasks: bool = True
    seed: int = 0
    checkpoint_every: int = 1  # learner state to run_dir/state every N steps (resume point)
    episode_timeout_s: float = 600.0
    stall_timeout_s: float = 1800.0
    weight_update_timeout_s: float = 120.0
    episode: EpisodeConfig = EpisodeConfig()
    advantages: AdvantageConfig = AdvantageConfig()

    @model_validator(mode="after")
    def _check(self) -> OrchestratorConfig:
        if self.group_size < 1 or self.groups_per_step < 1:
            raise ValueError("group_size and groups_per_step must be ≥ 1")
        if self.filter_zero_signal and self.group_size < 2:
            raise ValueError("a group of one never has signal, so filter_zero_signal would discard everything: "
                             "set group_size ≥ 2 or filter_zero_signal=false")
        if self.max_staleness < 0:
            raise ValueError("max_staleness must be ≥ 0 (0 is on-policy)")
        if self.tasks_per_group < 1 or self.group_size % self.tasks_per_group:
            raise ValueError(f"group_size {self.group_size} must be a multiple of tasks_per_group "
                             f"{self.tasks_per_group} (each sibling task gets the same number of episodes)")
        if self.concurrency < self.group_size:
            raise ValueError(f"concurrency {self.concurrency} < group_size {self.group_size}: a group could never run "
                             "whole; raise --set concurrency")
        return self

    @property
    def staleness_bound(self) -> int:
        return 0 if self.mode == "sync" else self.max_staleness

    @property
    def admit_limit(self) -> int:
        """Groups started but not yet trained on (or filtered)."""
        return self.groups_per_step * (1 + self.staleness_bound)


class OrchestratorStalled(RuntimeError):
    pass


class _Stopped(Exception):
    """Raised at an episode's turn boundary after `close`: its state is saved, the sandbox released."""


@dataclass
class _Group:
    id: str
    tasks: tuple[Task, ...]  # one, or sibling tasks (`tasks_per_group`), each run size / len(tasks) times
    start_version: int
    size: int
    results: dict[int, Trajectory] = field(default_factory=dict)  # member index -> trajectory
    running: dict[int, float] = field(default_factory=dict)  # member index -> last progress time
    signal_checked: bool = False

    @property
    def order(self) -> int:
        """The n of `g<n>`: groups are started in this order, and the engine serves older ones first."""
        return int(self.id[1:])

    def task(self, member: int) -> Task:
        return self.tasks[member * len(self.tasks) // self.size]

    @property
    def complete(self) -> bool:
        return len(self.results) == self.size

    def trajectories(self) -> list[Trajectory]:
        return [self.results[i] for i in sorted(self.results)]


class RunFolder:
    """The run's files; every write that a resume depends on is appended or atomically replaced."""

    def __init__(self, root: Path):
        self.root = root
        self.inflight = root / "inflight"
        self.state = root / "state"
        self.inflight.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()

    def append(self, name: str, record: dict[str, Any]) -> None:
        line = json.dumps(record, separators=(",", ":")) + "\n"
        with self._lock, open(self.root / name, "a") as f:
            f.write(line)
            f.flush()
            os.fsync(f.fileno())

    def read(self, name: str) -> list[dict[str, Any]]:
        path = self.root / name
        if not path.exists():
            return []
        records = []
        for line in path.read_text().splitlines():
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                continue  # a line cut by a crash mid-write: its episode is still in inflight/ or restarts
        return records

    def save_episode_state(self, episode_id: str, state: EpisodeState) -> None:
        path = self.inflight / f"{episode_id.replace('/', '_')}.json"
        tmp = path.with_suffix(".tmp")
        tmp.write_text(state.model_dump_json())
        os.replace(tmp, path)

    def drop_episode_state(self, episode_id: str) -> None:
        (self.inflight / f"{episode_id.replace('/', '_')}.json").unlink(missing_ok=True)

    def episode_states(self) -> dict[str, EpisodeState]:
        states = {}
        for path in self.inflight.glob("*.json"):
            states[path.stem.replace("_", "/", 1)] = EpisodeState.model_validate_json(path.read_text())
        return states

    def save_learner(self, learner: Learner, extra: dict[str, Any]) -> None:
        tmp = self.root / "state.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        torch.save(learner.state(), tmp / "learner.pt")
        (tmp / "progress.json").write_text(json.dumps(extra))
        old = self.root / "state.old"
        shutil.rmtree(old, ignore_errors=True)
        if self.state.exists():
            os.replace(self.state, old)
        os.replace(tmp, self.state)
        shutil.rmtree(old, ignore_errors=True)

    def load_learner(self) -> tuple[dict[str, Any], dict[str, Any]] | None:
        for folder in (self.state, self.root / "state.old"):  # a crash between the two renames leaves state.old
            if (folder / "progress.json").exists():
                return torch.load(folder / "learner.pt", weights_only=False), json.loads((folder / "progress.json").read_text())
        return None


class Orchestrator:
    """Drives rollouts and learning; knows nothing of who calls it (the CLI, a benchmark, a test)."""

    def __init__(self, config: OrchestratorConfig, tasks: Sequence[Task], engine: Engine, learner: Learner,
                 tokenizer: PreTrainedTokenizerBase, pool: SandboxPool, run_dir: Path,
                 on_step: Callable[[dict[str, Any]], None] | None = None):
        if not tasks:
            raise ValueError("no training tasks")
        self.config, self.tasks, self.engine, self.learner = config, list(tasks), engine, learner
        self.tokenizer, self.pool, self.on_step = tokenizer, pool, on_step
        self.run = RunFolder(Path(run_dir))
        self._tasks_by_id = {t.id: t for t in self.tasks}
        self._siblings: dict[tuple[str, object], list[Task]] = {}
        for t in self.tasks:
            self._siblings.setdefault(_sibling_key(t), []).append(t)
        self._cond = threading.Condition()
        self._groups: dict[str, _Group] = {}  # started, not yet consumed
        self._next_group = 0  # groups started so far, also the task cursor
        self._order: tuple[int, list[int]] = (-1, [])  # (pass over the task set, its task order)
        self._consumed: list[str] = []
        self._counts = {"zero_signal_groups": 0, "filtered_groups": 0, "episodes": 0, "failed_episodes": 0,
                        "resumed_episodes": 0}
        self._error: BaseException | None = None
        self._filtered_in_a_row = 0
        # Episodes and passes of the groups completed since the last learner step, trained or filtered:
        # the policy's pass rate on training tasks. The trained batch's `pass_rate` is biased low by
        # dynamic sampling, which drops all-pass groups (0.25 there where held-out sampled was 0.47).
        self._rollouts = {"episodes": 0, "passed": 0}
        self._workers = ThreadPoolExecutor(config.concurrency, thread_name_prefix="rollout")
        self._closed = False
        self.step = 0

    # ---- the learner loop ---------------------------------------------------------------------------

    def train(self, max_steps: int | None = None) -> list[dict[str, Any]]:
        """Run until `max_steps` learner steps in total (resuming counts earlier ones)."""
        goal = self.config.max_steps if max_steps is None else max_steps
        history = []
        with self._cond:
            self._admit()
        while self.step < goal:
            t0 = time.perf_counter()
            batch = self._wait_for_batch()
            waited = time.perf_counter() - t0
            metrics = self._learn(batch)
            metrics["wait_s"] = waited
            history.append(metrics)
            if self.on_step is not None:
                self.on_step(metrics)
        return history

    def _wait_for_batch(self) -> list[_Group]:
        deadline = time.monotonic() + self.config.stall_timeout_s
        with self._cond:
            while True:
                if self._error is not None:
                    raise OrchestratorStalled(f"a rollout worker failed: {self._error!r}") from self._error
                batch = self._ready_batch()
                if batch is not None:
                    self._filtered_in_a_row = 0
                    return batch
                if self._filtered_in_a_row > self.config.zero_signal_patience * self.config.groups_per_step:
                    raise OrchestratorStalled(
                        f"{self._filtered_in_a_row} groups in a row had equal rewards (no signal): the tasks are all "
                        "too hard or all too easy for this policy; change the task difficulty or set "
                        "filter_zero_signal=false")
                self._check_episode_progress()
                if time.monotonic() > deadline:
                    raise OrchestratorStalled(f"no learner batch for {self.config.stall_timeout_s:.0f} s: "
                                              f"{self._describe()}; check the engine and the sandbox pool")
                self._cond.wait(timeout=1.0)

    def _ready_batch(self) -> list[_Group] | None:
        """B complete groups, oldest first, including every group that must be trained on now."""
        self._filter_zero_signal()
        v, bound = self.learner.version, self.config.staleness_bound
        unfinished_due = [g for g in self._groups.values() if g.start_version + bound <= v and not g.complete]
        complete = sorted((g for g in self._groups.values() if g.complete), key=lambda g: (g.start_version, g.id))
        due = [g for g in complete if g.start_version + bound <= v]
        if unfinished_due:
            return None  # moving to v + 1 now would leave them staler than the bound
        if self.config.mode == "sync" and any(not g.complete for g in self._groups.values()):
            return None
        if len(complete) < self.config.groups_per_step:
            return None
        return due + [g for g in complete if g not in due][: max(0, self.config.groups_per_step - len(due))]

    def _filter_zero_signal(self) -> None:
        for g in list(self._groups.values()):
            if not g.complete or g.signal_checked:
                continue
            g.signal_checked = True
            trajectories = g.trajectories()
            self._rollouts["episodes"] += len(trajectories)
            self._rollouts["passed"] += sum(passed(t) for t in trajectories)
            if not self.config.advantages.has_signal(trajectories):
                self._counts["zero_signal_groups"] += 1
                if self.config.filter_zero_signal:
                    self._counts["filtered_groups"] += 1
                    self._filtered_in_a_row += 1
                    del self._groups[g.id]
                    self._consumed.append(g.id)
                    self._admit()

    def _learn(self, batch: list[_Group]) -> dict[str, Any]:
        trajectories = [t for g in batch for t in g.trajectories()]
        rewards = [t.reward for t in trajectories]
        advantages = self.config.advantages.for_trajectories(trajectories)
        # A sandbox failure or an abort is not the policy's doing: recorded, but no gradient.
        advantages = [a if t.status not in (Status.SANDBOX_ERROR, Status.ABORTED) else 0.0
                      for a, t in zip(advantages, trajectories, strict=True)]
        oldest = [t.version_span()[0] for t in trajectories if t.generated_tokens]
        staleness = self.learner.version - min(oldest) if oldest else 0
        t0 = time.perf_counter()
        metrics = dict(self.learner.train_step(trajectories, advantages))
        train_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        self.engine.update_weights(self.learner.weights(), self.learner.version,
                                   timeout_s=self.config.weight_update_timeout_s)
        update_s = time.perf_counter() - t0
        with self._cond:
            for g in batch:
                del self._groups[g.id]
                self._consumed.append(g.id)
            self.step += 1
            rollouts, self._rollouts = self._rollouts, {"episodes": 0, "passed": 0}
            self._admit()
            if self.step % self.config.checkpoint_every == 0:
                self._save_state()
        outcomes = [passed(t) for t in trajectories]
        tied = sum(outcome_tied([passed(t) for t in g.trajectories()], [t.reward for t in g.trajectories()])
                   for g in batch)
        metrics.update({
            "outcome_tied_groups": tied,
            "step": self.step, "policy_version": self.learner.version,
            "reward_mean": sum(rewards) / len(rewards),
            "pass_rate": sum(outcomes) / len(outcomes),
            "failed_tool_calls": sum(t.failed_tool_calls for t in trajectories) / len(trajectories),  # per episode
            "train_s": train_s, "weight_update_s": update_s,
            "rollout_episodes": rollouts["episodes"],
            "rollout_pass_rate": rollouts["passed"] / rollouts["episodes"] if rollouts["episodes"] else float("nan"),
            "episodes_trained": len(trajectories), "time": time.time(), "staleness_max": staleness,
            **self._counts,
        })
        self.run.append("metrics.jsonl", metrics)
        return metrics

    # ---- rollouts -----------------------------------------------------------------------------------

    def _admit(self) -> None:
        """Start groups while fewer than the admission limit are unconsumed. Caller holds the lock."""
        while not self._closed and len(self._groups) < self.config.admit_limit:
            tasks = self._group_tasks(self._next_group)
            group = _Group(f"g{self._next_group}", tasks, self.learner.version, self.config.group_size)
            self._next_group += 1
            self._groups[group.id] = group
            self.run.append("groups.jsonl", {"group": group.id, "task": tasks[0].id, "tasks": [t.id for t in tasks],
                                             "version": group.start_version})
            for i in range(group.size):
                self._launch(group, i, None)

    def _task(self, n: int) -> Task:
        """The task of the n-th group: pass n // len(tasks) over the task set, in that pass's order
        (a function of n alone, so a resumed run draws the same tasks the killed one would have)."""
        rounds, i = divmod(n, len(self.tasks))
        if not self.config.shuffle_tasks:
            return self.tasks[i]
        if self._order[0] != rounds:
            order = list(range(len(self.tasks)))
            random.Random(self.config.seed * 1_000_003 + rounds).shuffle(order)
            self._order = (rounds, order)
        return self.tasks[self._order[1][i]]

    def _group_tasks(self, n: int) -> tuple[Task, ...]:
        """The tasks of the n-th group: the n-th task (`_task`), then `tasks_per_group - 1` of its
        siblings, other tasks where the task set has enough (a function of n alone, as `_task` is)."""
        first = self._task(n)
        k = self.config.tasks_per_group
        if k == 1:
            return (first,)
        rng = random.Random(f"siblings/{self.config.seed}/{n}")
        others = [t for t in self._siblings[_sibling_key(first)] if t.id != first.id] or [first]
        picked = rng.sample(others, k - 1) if len(others) >= k - 1 else [rng.choice(others) for _ in range(k - 1)]
        return (first, *picked)

    def _launch(self, group: _Group, index: int, state: EpisodeState | None) -> None:
        group.running[index] = time.monotonic()
        self._workers.submit(self._episode, group, index, state)

    def _episode(self, group: _Group, index: int, state: EpisodeState | None) -> None:
        episode_id = f"{group.id}/{index}"

        def saved(s: EpisodeState) -> None:
            self.run.save_episode_state(episode_id, s)
            with self._cond:
                group.running[index] = time.monotonic()
                if self._closed:
                    raise _Stopped

        try:
            traj = run_episode(group.task(index), self.engine, self.tokenizer, self.pool, self.config.episode,
                               group_id=group.id, resume=state, on_turn=saved, priority=group.order)
        except _Stopped:
            return
        except BaseException as exc:  # noqa: BLE001 - recorded and raised in the learner's thread
            with self._cond:
                self._error = self._error or exc
                self._cond.notify_all()
            return
        if self._closed and traj.status == Status.ABORTED:
            return  # stopped by shutdown: its saved state resumes it next time
        self.run.append("trajectories.jsonl", {"episode": episode_id, "trajectory": traj.model_dump(mode="json")})
        self.run.drop_episode_state(episode_id)
        with self._cond:
            group.results[index] = traj
            group.running.pop(index, None)
            self._counts["episodes"] += 1
            self._counts["failed_episodes"] += traj.status in (Status.SANDBOX_ERROR, Status.ABORTED, Status.TOOL_ERROR)
            self._cond.notify_all()

    def _check_episode_progress(self) -> None:
        now = time.monotonic()
        for g in self._groups.values():
            for i, since in g.running.items():
                if now - since > self.config.episode_timeout_s:
                    raise OrchestratorStalled(
                        f"episode {g.id}/{i} ({g.task(i).id}) made no progress for {now - since:.0f} s "
                        f"(episode_timeout_s={self.config.episode_timeout_s:.0f}); {self._describe()}")

    def _describe(self) -> str:
        running = sum(len(g.running) for g in self._groups.values())
        complete = sum(g.complete for g in self._groups.values())
        return (f"policy {self.learner.version}, {len(self._groups)} groups unconsumed ({complete} complete), "
                f"{running} episodes running")

    # ---- durability ---------------------------------------------------------------------------------

    def _save_state(self) -> None:
        self.run.save_learner(self.learner, {"step": self.step, "next_group": self._next_group,
                                             "consumed": self._consumed, "counts": self._counts})

    def resume(self) -> bool:
        """Restore from `run_dir` if it holds a run; returns whether it did. Call before `train`."""
        saved = self.run.load_learner()
        started = self.run.read("groups.jsonl")
        if saved is None and not started:
            return False
        consumed: set[str] = set()
        if saved is not None:
            learner_state, progress = saved
            self.learner.load_state(learner_state)
            self.engine.update_weights(self.learner.weights(), self.learner.version,
                                       timeout_s=self.config.weight_update_timeout_s)
            self.step = progress["step"]
            self._consumed = list(progress["consumed"])
            self._counts.update(progress["counts"])
            consumed = set(self._consumed)
        finished: dict[str, Trajectory] = {}
        for record in self.run.read("trajectories.jsonl"):
            finished[record["episode"]] = Trajectory.model_validate(record["trajectory"])
        states = self.run.episode_states()
        with self._cond:
            for record in started:
                if record["group"] in consumed:
                    continue
                ids = record.get("tasks", [record["task"]])
                missing = [i for i in ids if i not in self._tasks_by_id]
                if missing:
                    raise ValueError(f"run {self.run.root} trained on task {missing[0]}, which is not in this task "
                                     "set; resume with the same task config")
                if self.config.group_size % len(ids):
                    raise ValueError(f"run {self.run.root} started groups of {len(ids)} tasks; resume with the same "
                                     "group_size and tasks_per_group")
                group = _Group(record["group"], tuple(self._tasks_by_id[i] for i in ids), record["version"],
                               self.config.group_size)
                self._groups[group.id] = group
                for i in range(group.size):
                    episode_id = f"{group.id}/{i}"
                    if episode_id in finished:
                        group.results[i] = finished[episode_id]
                        self.run.drop_episode_state(episode_id)
                    else:
                        self._counts["resumed_episodes"] += episode_id in states
                        self._launch(group, i, states.get(episode_id))
            self._next_group = max((int(r["group"][1:]) + 1 for r in started), default=0)
        return True

    def close(self, wait: bool = True) -> None:
        """Stop: no new episodes; running ones stop at their next turn boundary (after saving their
        state, so a later run with the same run_dir resumes them). wait: until they have stopped."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._workers.shutdown(wait=wait, cancel_futures=True)

    def __enter__(self) -> Orchestrator:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _sibling_key(task: Task) -> tuple[str, object]:
    """Tasks with the same key are siblings: one family, one template (the function they are about).
    Tasks whose family records no template (`metadata.extra["template"]`) are siblings of their whole family."""
    return task.family, task.metadata.extra.get("template")
