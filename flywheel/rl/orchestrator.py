"""The asynchronous GRPO Orchestrator: schedules rollouts so that learning overlaps them and
staleness stays bounded. It only schedules; the learning step is `flywheel.rl.train.learning_step`.

    rollout workers (threads, `concurrency` episodes at once)         training loop (`flywheel.rl.train`)
    ┌───────────────────────────────────────────────────────┐         ┌───────────────────────────────────┐
    │ wait: admission (unconsumed groups < admit_limit)     │         │ next_batch() waits: ≥ B complete  │
    │ run_episode × G on one task (or k siblings) ── Engine │ ──────> │  groups with signal, and no       │
    │ each turn: EpisodeState -> run/inflight/ (resumable)  │ buffer  │  unfinished group that would      │
    │ done: Trajectory appended to run/trajectories.jsonl   │         │  exceed max_staleness             │
    └───────────────────────────────────────────────────────┘         │ advantages -> Learner.train_step  │
              ^                                                       │ Engine.update_weights(w, v+1)     │──┐
              │  consumed(): admission reopens, new groups    <────── │ consumed(groups, v+1), checkpoint │  │
              │                                                       └───────────────────────────────────┘  │
              └── in-flight episodes pause, their KV cache is rebuilt under the new weights (or kept),       │
                  and they resume (partial rollouts): every token keeps the version that made it <───────────┘

What unblocks what:
- A rollout worker starts a new group when one is consumed (or filtered): the admission limit
  `groups_per_step * (1 + max_staleness)` caps the groups that are started but not yet trained on.
- `next_batch` returns when B complete groups are buffered, except that a group started at version
  s may only be trained on at version v ≤ s + max_staleness. Before the learner moves from v to
  v + 1 it therefore takes every buffered group started at v − max_staleness into this batch,
  and waits for any such group still in flight. Staleness (current version minus the oldest
  token's version) is so never above `max_staleness`, by construction; the Learner reports its
  histogram.
- Sync mode is the same machine with `max_staleness = 0`: B groups start, all finish, the learner
  steps, the next B start. Same code path, so the comparison in `bench/async_rl.py` is fair.
- Every turn asks the engine with its group's start order as priority: when more episodes are in
  flight than the engine has rows, the oldest groups, the ones the learner waits on, go first.

What goes in and out is plain: tasks, an Engine and a SandboxPool to run episodes on, a getter of
the current policy version (the Orchestrator never holds a Learner, so it can run as a Ray actor),
and optionally a `runner` that plays an episode elsewhere (`flywheel.rl.ray_backend`: on a rollout
worker actor of a Ray cluster; `flywheel.rl.harness.program.HarnessRunner`: an external agent program
against a per-episode OpenAI endpoint) with `run_episode`'s contract: same task, resume state, `on_turn`
at every turn boundary on this side, one Trajectory back;
out come `Batch` records (groups of `Trajectory`), in come `consumed(group ids, version)` calls, and
`progress()` is the dict the loop checkpoints with the learner state and `resume` takes back.

Nothing hangs silently: an episode that makes no progress for `episode_timeout_s`, a batch that
cannot be formed for `stall_timeout_s`, and (in the loop) a weight update that is not applied within
`weight_update_timeout_s` each raise `OrchestratorStalled` naming what was waited for.

Durable runs (`run_dir`, `flywheel.rl.run_folder`): the Orchestrator writes `groups.jsonl` (every
group when it starts, with its policy version), `trajectories.jsonl` (every finished episode the
moment it arrives, failed ones too) and `inflight/` (each unfinished episode's latest state); the
loop writes `state/` (learner state + `progress()`, every `checkpoint_every` steps) and
`metrics.jsonl`. A run killed at any moment restarts from `state/`: groups consumed after that
checkpoint are buffered again, finished episodes are read back, and unfinished ones resume from
their saved state (an episode that had not finished its first turn restarts). The one exception is
what a lost policy sampled: the engines take policy N before N's checkpoint is written (it is
written while the next step runs), so a kill in between resumes at N-1 with tokens of N on disk.
Those episodes play again from their start, and the groups started at N start again at N-1
(`_rewind`): every trained token's version names the weights that sampled it. That costs the
running run nothing; a resume redoes at most the rollouts since its checkpoint
(`rewound_episodes`, `restarted_groups`). flywheel/rl/audit.py checks these invariants on a run folder.

Departures from AReaL: rollout workers are threads of one process, not RPC servers (the Engine may
run in a process of its own, `EngineConfig.separate_process`, so that its decode loop does not wait
on their GIL); staleness is bounded by blocking the learner on the oldest group rather than by
discarding rollouts, so no work is thrown away.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal, Protocol

from pydantic import BaseModel, ConfigDict, model_validator
from transformers import PreTrainedTokenizerBase

from flywheel.agent.episode import EpisodeConfig, EpisodeState, run_episode
from flywheel.agent.evaluate import passed
from flywheel.agent.trajectory import Status, Trajectory
from flywheel.env.pool import SandboxPool
from flywheel.env.task import Task
from flywheel.model.engine import Engine
from flywheel.rl.advantages import AdvantageConfig
from flywheel.rl.run_folder import RunFolder
from flywheel.rl.task_sampler import TaskSampler, TaskSampling, sibling_key
from flywheel.timing import delta, timed

# An episode's timed stages (`run_episode`'s timings): turns (waiting for the engine included), tool
# calls, grading, sandbox creation
EPISODE_STAGES = ("generate_s", "tools_s", "grade_s", "sandbox_s")


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
    max_steps: int = 10  # learner steps of the run (read by the training loop, like checkpoint_every)
    # Tasks are drawn in a fresh seeded order each pass over the task set. In the order given
    # (family by family) the learner would spend a quarter of a run on each family in turn and
    # unlearn the last one while on the next.
    shuffle_tasks: bool = True
    # Which tasks new groups play (flywheel/rl/task_sampler.py): "shuffle", every task once a pass;
    # "frontier", drawn by their measured pass rate so that a group's outcomes are likely to differ.
    # Frontier spends the rollouts where the signal is, at the cost of tasks the policy already
    # always or never solves, which it draws only at the floor's weight.
    task_sampling: TaskSampling = "shuffle"
    seed: int = 0
    checkpoint_every: int = 1  # learner state + progress() to run_dir/state every N steps (resume point)
    episode_timeout_s: float = 600.0
    stall_timeout_s: float = 1800.0
    weight_update_timeout_s: float = 120.0  # the loop's Engine.update_weights
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


class EpisodeRunner(Protocol):
    """Plays one episode as `run_episode` does (with the Orchestrator's engine, tokenizer and pool
    when it runs here); `on_turn` is called in the caller's process at every turn boundary, and an
    exception it raises stops the episode. Its state is what a resumed run continues from; None
    where the episode cannot be resumed mid-way (an external harness program,
    `flywheel.rl.harness.program.HarnessRunner`, which also calls it while its program runs, so that a
    shutdown stops it promptly): a killed run plays it again from its start. May have
    `counts() -> dict[str, int]` (added to `Orchestrator.counts`) and `replacements()`
    (`Orchestrator.replacements`)."""

    def __call__(self, task: Task, config: EpisodeConfig, group_id: str, resume: EpisodeState | None,
                 on_turn: Callable[[EpisodeState | None], None], priority: int) -> Trajectory: ...


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
    estimate: float = float("nan")  # its tasks' estimated pass rate when it was drawn (`TaskSampler.estimate`)

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


@dataclass(frozen=True)
class ReadyGroup:
    """A complete group handed to the training loop: its episodes in member order."""
    id: str
    start_version: int  # the policy version when the group started (its oldest tokens' at most)
    trajectories: tuple[Trajectory, ...]


@dataclass(frozen=True)
class GroupOutcome:
    """A group as it completed: what the step's draw record (metrics.jsonl `draw`) says of it."""
    id: str
    family: str
    tasks: tuple[str, ...]
    difficulty: int
    start_version: int
    episodes: int
    passed: int
    reward_mean: float
    reward_spread: float  # max - min of its rewards: 0 is no signal
    estimate: float  # its tasks' estimated pass rate when it was drawn, from the episodes finished before
    signal: bool  # training on it would move the policy (`AdvantageConfig.has_signal`)
    filtered: str | None  # why dynamic sampling dropped it ("all passed", "all failed", "equal rewards"); None: kept

    @property
    def mixed(self) -> bool:
        """On the frontier: some of its episodes passed and some failed."""
        return 0 < self.passed < self.episodes


@dataclass(frozen=True)
class Batch:
    """What `Orchestrator.next_batch` hands out: B complete groups (or more, when older groups are
    due), and how the policy did on every group completed since the previous batch."""
    groups: tuple[ReadyGroup, ...]
    # Episodes and passes of the groups completed since the previous batch, trained or filtered:
    # the policy's pass rate on training tasks. The trained batch's own pass rate is biased low by
    # dynamic sampling, which drops all-pass groups (0.25 there where held-out sampled was 0.47).
    rollout_episodes: int
    rollout_passed: int
    # Where the rollouts' time went since the previous batch: the caller's wait in `next_batch`, for
    # complete groups (`wait_rollouts_s`) or for a group the staleness bound makes it wait for
    # (`wait_staleness_s`); `episode_<stage>` summed over the episodes finished since then
    # (`EPISODE_STAGES`: episode-seconds, concurrent episodes add up past the wall time); the
    # engine's `engine_<counter>` (`LocalEngine.counters`) and `engine_idle_s`, the wall time it
    # was not prefilling, decoding or swapping (episodes in their tools, or none admitted).
    seconds: dict[str, float] = field(default_factory=dict)
    # Every group completed since the previous batch, trained later or filtered, in completion order.
    outcomes: tuple[GroupOutcome, ...] = ()

    @property
    def group_ids(self) -> list[str]:
        return [g.id for g in self.groups]

    def trajectories(self) -> list[Trajectory]:
        return [t for g in self.groups for t in g.trajectories]


class Orchestrator:
    """Schedules rollouts into batches; knows nothing of who consumes them (the training loop, a
    benchmark, a test) nor of the Learner: the current version comes from `version()`."""

    def __init__(self, config: OrchestratorConfig, tasks: Sequence[Task], engine: Engine,
                 tokenizer: PreTrainedTokenizerBase, pool: SandboxPool, run_dir: str | Path,
                 version: Callable[[], int], runner: EpisodeRunner | None = None):
        if not tasks:
            raise ValueError("no training tasks")
        self.config, self.tasks, self.engine, self.version = config, list(tasks), engine, version
        self.tokenizer, self.pool = tokenizer, pool
        self.runner = runner or self._run_here
        self.run = RunFolder(run_dir)
        self._tasks_by_id = {t.id: t for t in self.tasks}
        self._siblings: dict[tuple[str, object], list[Task]] = {}
        for t in self.tasks:
            self._siblings.setdefault(sibling_key(t), []).append(t)
        self.sampler = TaskSampler(self.tasks, config.task_sampling, config.seed, shuffle=config.shuffle_tasks)
        self._cond = threading.Condition()
        self._groups: dict[str, _Group] = {}  # started, not yet consumed
        self._handed_out: list[str] = []  # groups of the last batch, until `consumed` is called
        self._next_group = 0  # groups started so far, also the task cursor
        self._consumed: dict[str, int] = {}  # group -> the version it was consumed at (trained, or filtered)
        self._counts = {"zero_signal_groups": 0, "filtered_groups": 0, "episodes": 0, "failed_episodes": 0,
                        "resumed_episodes": 0, "rewound_episodes": 0, "restarted_groups": 0}
        self._resumed_runner_counts: dict[str, int] = {}  # the runner's counts as the resumed run saved them
        self._error: BaseException | None = None
        self._filtered_in_a_row = 0
        self._rollouts = {"episodes": 0, "passed": 0}  # since the previous batch, see `Batch`
        self._outcomes: list[GroupOutcome] = []  # groups completed since the previous batch, `Batch.outcomes`
        self._episode_s = dict.fromkeys(EPISODE_STAGES, 0.0)  # summed over the episodes since then, `Batch.seconds`
        self._engine_reading: dict[str, float] | None = None  # the engine's counters at the previous batch
        self._last_batch_at = time.perf_counter()
        self._workers = ThreadPoolExecutor(config.concurrency, thread_name_prefix="rollout")
        self._closed = False
        self.step = 0  # batches consumed: the learner steps taken, resumed ones included

    # ---- what the training loop calls -------------------------------------------------------------

    def next_batch(self) -> Batch:
        """Wait for the next batch (starting groups up to the admission limit first). Call
        `consumed` with its groups before asking for another."""
        if self._handed_out:
            raise RuntimeError(f"groups {self._handed_out} were handed out and not reported consumed; call "
                               "consumed(batch.group_ids, version) after training on a batch, before the next")
        deadline = time.monotonic() + self.config.stall_timeout_s
        waits: dict[str, float] = {"wait_rollouts_s": 0.0, "wait_staleness_s": 0.0}
        with self._cond:
            self._admit()
            while True:
                if self._error is not None:
                    raise OrchestratorStalled(f"a rollout worker failed: {self._error!r}") from self._error
                groups, blocked_by = self._ready_batch()
                if groups is not None:
                    self._filtered_in_a_row = 0
                    self._handed_out = [g.id for g in groups]
                    rollouts, self._rollouts = self._rollouts, {"episodes": 0, "passed": 0}
                    episode_s, self._episode_s = self._episode_s, dict.fromkeys(EPISODE_STAGES, 0.0)
                    outcomes, self._outcomes = self._outcomes, []
                    batch = Batch(tuple(ReadyGroup(g.id, g.start_version, tuple(g.trajectories())) for g in groups),
                                  rollouts["episodes"], rollouts["passed"], outcomes=tuple(outcomes))
                    break
                if self._filtered_in_a_row > self.config.zero_signal_patience * self.config.groups_per_step:
                    raise OrchestratorStalled(
                        f"{self._filtered_in_a_row} groups in a row had equal rewards (no signal): the tasks are all "
                        "too hard or all too easy for this policy; change the task difficulty or set "
                        "filter_zero_signal=false")
                self._check_episode_progress()
                if time.monotonic() > deadline:
                    raise OrchestratorStalled(f"no learner batch for {self.config.stall_timeout_s:.0f} s: "
                                              f"{self._describe()}; check the engine and the sandbox pool")
                with timed(waits, f"wait_{blocked_by}_s"):
                    self._cond.wait(timeout=1.0)
        # outside the lock: a ProcessEngine's counters are a round trip to its process
        return replace(batch, seconds={**waits, **{f"episode_{k}": v for k, v in episode_s.items()},
                                                   **self._engine_since_last_batch()})

    def _engine_since_last_batch(self) -> dict[str, float]:
        """The engine's prefills, decode steps, swaps and idle time since the previous batch (its
        `counters()`; nothing for an engine without them: vLLM, Ray's)."""
        counters = getattr(self.engine, "counters", None)
        now = time.perf_counter()
        interval, self._last_batch_at = now - self._last_batch_at, now
        if counters is None:
            return {}
        reading = counters()
        done, self._engine_reading = delta(reading, self._engine_reading), reading
        busy = done["prefill_s"] + done["decode_s"] + done["swap_s"]
        return {**{f"engine_{k}": v for k, v in done.items()}, "engine_idle_s": max(0.0, interval - busy)}

    def consumed(self, group_ids: Sequence[str], version: int) -> None:
        """The groups of the last batch were trained on, and the policy is now at `version`: they leave
        the buffer and as many new groups start, at that version."""
        if sorted(group_ids) != sorted(self._handed_out):
            raise ValueError(f"consumed({list(group_ids)}) but the last batch handed out {self._handed_out}; "
                             "report exactly the group ids of the batch that was trained on")
        with self._cond:
            for group_id in group_ids:
                del self._groups[group_id]
                self._consumed[group_id] = version
            self._handed_out = []
            self.step += 1
            self._admit(version)

    def counts(self) -> dict[str, int]:
        """Running totals: episodes, failed episodes, resumed episodes, zero-signal and filtered groups,
        and the runner's own (a Ray runner's `failover_episodes`), added to what a resumed run counted."""
        with self._cond:
            counts = dict(self._counts)
        for key, n in getattr(self.runner, "counts", dict)().items():
            counts[key] = self._resumed_runner_counts.get(key, 0) + n
        return counts

    def replacements(self) -> list[dict[str, Any]]:
        """What the runner replaced since the last call (a Ray runner's dead workers and engines,
        each with the seconds it took); [] for a runner that replaces nothing."""
        return getattr(self.runner, "replacements", list)()

    def progress(self, counts: dict[str, int] | None = None) -> dict[str, Any]:
        """What a resume needs besides the learner (a plain dict for `RunFolder.save_state`): batches
        consumed, the policy version (the learner's, saved beside it), groups started, which groups
        were consumed at which version, the counts (`counts()` unless the caller just took them: on
        Ray it asks every worker)."""
        counts = self.counts() if counts is None else counts
        with self._cond:
            return {"step": self.step, "policy_version": self.version(), "next_group": self._next_group,
                    "consumed": dict(self._consumed), "counts": counts}

    def resume(self, progress: dict[str, Any] | None) -> bool:
        """Restore from `run_dir` and the `progress()` saved with the learner (None: no checkpoint was
        taken); returns whether there was a run to resume. Call before `next_batch`, once the
        learner holds the checkpoint's weights: `version()` is then the policy the run resumes at,
        and every later policy was lost with the process (`_rewind`)."""
        started = {r["group"]: r for r in self.run.read("groups.jsonl")}  # a group restarted: its last record
        if progress is None and not started:
            return False
        if progress is not None:
            self.step = progress["step"]
            consumed = progress["consumed"]  # a list in runs saved before the versions were kept
            self._consumed = dict(consumed) if isinstance(consumed, dict) else dict.fromkeys(consumed, -1)
            runner_keys = set(getattr(self.runner, "counts", dict)())
            self._counts.update({k: v for k, v in progress["counts"].items() if k not in runner_keys})
            self._resumed_runner_counts = {k: v for k, v in progress["counts"].items() if k in runner_keys}
        finished = finished_episodes(self.run)
        states = self.run.episode_states()
        with self._cond:
            for record in started.values():
                if record["group"] in self._consumed:
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
                self._rewind(group, finished, states)
                self._groups[group.id] = group
                for i in range(group.size):
                    episode_id = f"{group.id}/{i}"
                    if episode_id in finished:
                        group.results[i] = finished[episode_id]
                        self.run.drop_episode_state(episode_id)
                    else:
                        self._counts["resumed_episodes"] += episode_id in states
                        self._launch(group, i, states.get(episode_id))
            self._next_group = max((int(g[1:]) + 1 for g in started), default=0)
            for traj in finished.values():  # the sampler's counts, as the killed run had them
                if traj.task_id in self._tasks_by_id:
                    self.sampler.observe(self._tasks_by_id[traj.task_id], passed(traj))
        return True

    def _rewind(self, group: _Group, finished: dict[str, Trajectory], states: dict[str, EpisodeState]) -> None:
        """Forget what policies later than the resumed one sampled for `group` (caller holds the lock).

        The engines may sample with policy N before N's checkpoint is on disk (it is written while
        the next step runs), so a run killed then resumes at an older policy while its records hold
        tokens of N. N's weights are gone, and the next weights the Learner makes will be called N
        too: such a token's version would name weights that never sampled it. So an episode holding
        one plays again from its start (its trajectory is struck out of trajectories.jsonl, its
        saved state dropped), and a group that started under a lost policy starts again at the
        resumed one (a new groups.jsonl record). Both records are written before anything runs
        again, so a kill during the resume finds the same work to redo. This costs nothing while
        the run lives; a resume loses at most the rollouts of the steps after its checkpoint."""
        version = self.version()
        restart = group.start_version > version
        for i in range(group.size):
            episode_id = f"{group.id}/{i}"
            lost = [record for record in (finished.get(episode_id), states.get(episode_id))
                    if record is not None and (restart or newest_version(record) > version)]
            if not lost:
                continue
            if episode_id in finished:
                self.run.append("trajectories.jsonl", {"episode": episode_id, "discarded": version})
                del finished[episode_id]
            if episode_id in states:
                self.run.drop_episode_state(episode_id)
                del states[episode_id]
            self._counts["rewound_episodes"] += 1
        if restart:  # after its episodes are struck out: a kill in between finds the group still to restart
            self.run.append("groups.jsonl", {"group": group.id, "task": group.tasks[0].id,
                                             "tasks": [t.id for t in group.tasks], "version": version,
                                             "restarted_from": group.start_version})
            group.start_version = version
            self._counts["restarted_groups"] += 1

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

    # ---- forming batches --------------------------------------------------------------------------

    def _ready_batch(self) -> tuple[list[_Group] | None, Literal["staleness", "rollouts"]]:
        """B complete groups, oldest first, including every group that must be trained on now; or
        None and what holds the batch back: a group the staleness bound makes the learner wait for,
        or too few complete groups."""
        self._filter_zero_signal()
        v, bound = self.version(), self.config.staleness_bound
        unfinished_due = [g for g in self._groups.values() if g.start_version + bound <= v and not g.complete]
        complete = sorted((g for g in self._groups.values() if g.complete), key=lambda g: (g.start_version, g.id))
        due = [g for g in complete if g.start_version + bound <= v]
        if unfinished_due:
            return None, "staleness"  # moving to v + 1 now would leave them staler than the bound
        if self.config.mode == "sync" and any(not g.complete for g in self._groups.values()):
            return None, "rollouts"
        if len(complete) < self.config.groups_per_step:
            return None, "rollouts"
        return due + [g for g in complete if g not in due][: max(0, self.config.groups_per_step - len(due))], "rollouts"

    def _filter_zero_signal(self) -> None:
        for g in list(self._groups.values()):
            if not g.complete or g.signal_checked:
                continue
            g.signal_checked = True
            trajectories = g.trajectories()
            self._rollouts["episodes"] += len(trajectories)
            self._rollouts["passed"] += sum(passed(t) for t in trajectories)
            signal = self.config.advantages.has_signal(trajectories)
            self._outcomes.append(group_outcome(g, signal, filtered=not signal and self.config.filter_zero_signal))
            if not signal:
                self._counts["zero_signal_groups"] += 1
                if self.config.filter_zero_signal:
                    self._counts["filtered_groups"] += 1
                    self._filtered_in_a_row += 1
                    del self._groups[g.id]
                    self._consumed[g.id] = self.version()
                    self._admit()

    # ---- rollouts -----------------------------------------------------------------------------------

    def _admit(self, version: int | None = None) -> None:
        """Start groups while fewer than the admission limit are unconsumed, at `version` (default:
        the current one). Caller holds the lock."""
        version = self.version() if version is None else version
        while not self._closed and len(self._groups) < self.config.admit_limit:
            tasks = self._group_tasks(self._next_group)
            group = _Group(f"g{self._next_group}", tasks, version, self.config.group_size,
                           estimate=sum(map(self.sampler.estimate, tasks)) / len(tasks))
            self._next_group += 1
            self._groups[group.id] = group
            self.run.append("groups.jsonl", {"group": group.id, "task": tasks[0].id, "tasks": [t.id for t in tasks],
                                             "version": group.start_version})
            for i in range(group.size):
                self._launch(group, i, None)

    def _task(self, n: int) -> Task:
        """The task of the n-th group (`TaskSampler.draw`, by `task_sampling`)."""
        return self.sampler.draw(n)

    def _group_tasks(self, n: int) -> tuple[Task, ...]:
        """The tasks of the n-th group: the n-th task (`_task`), then `tasks_per_group - 1` of its
        siblings, other tasks where the task set has enough (given the first, a function of n alone)."""
        first = self._task(n)
        k = self.config.tasks_per_group
        if k == 1:
            return (first,)
        rng = random.Random(f"siblings/{self.config.seed}/{n}")
        others = [t for t in self._siblings[sibling_key(first)] if t.id != first.id] or [first]
        picked = rng.sample(others, k - 1) if len(others) >= k - 1 else [rng.choice(others) for _ in range(k - 1)]
        return (first, *picked)

    def _launch(self, group: _Group, index: int, state: EpisodeState | None) -> None:
        group.running[index] = time.monotonic()
        self._workers.submit(self._episode, group, index, state)

    def _episode(self, group: _Group, index: int, state: EpisodeState | None) -> None:
        episode_id = f"{group.id}/{index}"

        def saved(s: EpisodeState | None) -> None:
            if s is not None:
                self.run.save_episode_state(episode_id, s)
            with self._cond:
                group.running[index] = time.monotonic()
                if self._closed:
                    raise _Stopped

        try:
            traj = self.runner(group.task(index), self.config.episode, group_id=group.id, resume=state,
                               on_turn=saved, priority=group.order)
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
            self.sampler.observe(group.task(index), passed(traj))
            for stage in EPISODE_STAGES:
                self._episode_s[stage] += traj.timings.get(stage, 0.0)
            self._counts["episodes"] += 1
            self._counts["failed_episodes"] += traj.status in (Status.SANDBOX_ERROR, Status.ABORTED, Status.TOOL_ERROR)
            self._cond.notify_all()

    def _run_here(self, task: Task, config: EpisodeConfig, group_id: str, resume: EpisodeState | None,
                  on_turn: Callable[[EpisodeState], None], priority: int) -> Trajectory:
        """The default runner: the episode in this process, on this Orchestrator's engine and pool."""
        return run_episode(task, self.engine, self.tokenizer, self.pool, config, group_id=group_id, resume=resume,
                           on_turn=on_turn, priority=priority)

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
        return (f"policy {self.version()}, {len(self._groups)} groups unconsumed ({complete} complete), "
                f"{running} episodes running")


def group_outcome(group: _Group, signal: bool, filtered: bool) -> GroupOutcome:
    """A complete group's record for the step's draw (`GroupOutcome`)."""
    trajectories = group.trajectories()
    rewards = [t.reward for t in trajectories]
    wins = sum(passed(t) for t in trajectories)
    reason = None
    if filtered:
        reason = "all passed" if wins == len(trajectories) else "all failed" if wins == 0 else "equal rewards"
    return GroupOutcome(group.id, group.tasks[0].family, tuple(t.id for t in group.tasks),
                        group.tasks[0].metadata.difficulty, group.start_version, len(trajectories), wins,
                        sum(rewards) / len(rewards), max(rewards) - min(rewards), group.estimate, signal, reason)


def newest_version(record: Trajectory | EpisodeState) -> int:
    """The newest policy version among a trajectory's or a saved state's generated tokens (-1: none)."""
    return max((v for v, m in zip(record.versions, record.loss_mask, strict=True) if m), default=-1)


def finished_episodes(run: RunFolder) -> dict[str, Trajectory]:
    """Each episode's trajectory in run/trajectories.jsonl: its last record, unless a resume struck
    it out after (a `discarded` record: it held tokens of a lost policy and plays again)."""
    finished: dict[str, Trajectory] = {}
    for record in run.read("trajectories.jsonl"):
        if "discarded" in record:
            finished.pop(record["episode"], None)
        else:
            finished[record["episode"]] = Trajectory.model_validate(record["trajectory"])
    return finished
