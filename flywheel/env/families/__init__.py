"""Task families: procedural coding tasks generated deterministically from a seed, plus HumanEval.

    from flywheel.env.families import generate, get_task
    tasks = generate("bugfix", "train", n=100, seed=0)          # difficulties cycle 1, 2, 3, ...
    same = get_task(tasks[0].id)                                # regenerated from the id alone

Each procedural family draws an endless stream of candidate tasks from (family, seed, difficulty,
index). A candidate's split is `split_of(content_key)`, so train and eval partition one stream and
the same problem can never be in both; `generate` keeps the candidates of the requested split.
Ids look like `bugfix/train/s0/d1/17` (17 = index in the candidate stream); HumanEval ids look
like `humaneval/HumanEval_0`.

The held-out set is defined once, by `held_out_tasks`: eval-split tasks drawn from one fixed seed
(`HELD_OUT_SEED`), whatever the seed of the run that evaluates on them. The bootstrap's eval, the
RL run's evals, the gate's battery and the benchmarks all call it, so their pass rates are on the
same tasks and compare.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator, Sequence

from flywheel.env.families import ambiguous, bugfix, crossfile, humaneval, implement, mined
from flywheel.env.families.humaneval import all_humaneval_tasks
from flywheel.env.families.workspace import Draft, TaskRef, to_task
from flywheel.env.task import SPLITS, Split, Task, split_of

FAMILIES: tuple[str, ...] = ("bugfix", "implement", "crossfile", "ambiguous")
KNOWN_FAMILIES: tuple[str, ...] = FAMILIES + ("humaneval", "mined")  # mined: real packages (families/mined.py)
DIFFICULTIES: tuple[int, ...] = (1, 2, 3)
HELD_OUT_SEED = 1  # the candidate stream of the held-out set; a run's own seed never moves it

__all__ = ["FAMILIES", "HELD_OUT_SEED", "KNOWN_FAMILIES", "all_humaneval_tasks", "candidate", "generate", "get_task",
           "held_out_tasks", "task_set"]


def builder(family: str) -> Callable[[random.Random, int], Draft]:
    builders = {"bugfix": bugfix.build, "implement": implement.build, "crossfile": crossfile.build,
                "ambiguous": ambiguous.build}
    if family not in builders:
        raise ValueError(f"unknown task family {family!r}; known families: {', '.join(KNOWN_FAMILIES)}")
    return builders[family]


def candidate(ref: TaskRef) -> Task:
    """Build candidate `ref.index` of its stream; its split comes from its content, not from `ref`."""
    draft = builder(ref.family)(ref.rng(), ref.difficulty)
    task = to_task(ref.family, draft, "pending", "train")
    split = split_of(task.content_key())
    real = TaskRef(ref.family, split, ref.seed, ref.difficulty, ref.index)
    return task.model_copy(update={"id": real.task_id(), "split": split})


def _check(split: str, difficulty: int | None) -> None:
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    if difficulty is not None and difficulty not in DIFFICULTIES:
        raise ValueError(f"difficulty must be one of {DIFFICULTIES} or None (cycle), got {difficulty!r}")


def _stream(family: str, split: Split, seed: int, difficulty: int, limit: int) -> Iterator[Task]:
    for index in range(limit):
        task = candidate(TaskRef(family, split, seed, difficulty, index))
        if task.split == split:
            yield task
    raise RuntimeError(
        f"family {family!r} produced too few {split} tasks at difficulty {difficulty} in {limit} candidates; "
        "ask for fewer tasks or use another seed"
    )


def generate(family: str, split: Split, n: int, seed: int = 0, difficulty: int | None = None) -> list[Task]:
    """`n` distinct tasks of one family and split; the same arguments give the same tasks.

    `difficulty=None` cycles through 1, 2, 3. For "humaneval", `n` is capped at the problems in
    the split, difficulty is always 2 and `seed` shuffles the order.
    """
    _check(split, difficulty)
    if family == "humaneval":
        return humaneval.generate(split, n, seed)
    if family == mined.FAMILY:
        return mined.generate(split, n, seed)
    builder(family)  # fail fast on an unknown family
    levels = DIFFICULTIES if difficulty is None else (difficulty,)
    limit = 50 * n + 200
    streams = {d: _stream(family, split, seed, d, limit) for d in levels}
    tasks: list[Task] = []
    seen: set[str] = set()
    while len(tasks) < n:
        task = next(streams[levels[len(tasks) % len(levels)]])
        key = task.content_key()
        if key not in seen:
            seen.add(key)
            tasks.append(task)
    return tasks


def task_set(
    families: Sequence[str], split: Split, n_per_family: int, seed: int = 0, difficulty: int | None = None
) -> list[Task]:
    """`n_per_family` tasks of each family, family by family in the order given."""
    return [t for family in families for t in generate(family, split, n_per_family, seed, difficulty)]


def held_out_tasks(families: Sequence[str], n_per_family: int, difficulty: int | None = None,
                   humaneval: int = 0) -> list[Task]:
    """The held-out task set: `n_per_family` eval-split tasks of each family (family by family, in
    the order given), then `humaneval` HumanEval problems of its eval split. A smaller set is a
    prefix of a larger one of the same families and difficulty."""
    tasks = task_set(families, "eval", n_per_family, seed=HELD_OUT_SEED, difficulty=difficulty)
    if humaneval:
        tasks += generate("humaneval", "eval", humaneval, seed=HELD_OUT_SEED)
    return tasks


def get_task(task_id: str) -> Task:
    """Regenerate a task from its id."""
    if task_id.startswith("humaneval/"):
        return humaneval.get(task_id)
    if task_id.startswith(mined.FAMILY + "/"):
        return mined.get(task_id)
    ref = TaskRef.parse(task_id)
    builder(ref.family)
    if ref.difficulty not in DIFFICULTIES:
        raise ValueError(f"task id {task_id!r} has difficulty {ref.difficulty}; it must be one of {DIFFICULTIES}")
    task = candidate(ref)
    if task.split != ref.split:
        raise ValueError(f"task id {task_id!r} names split {ref.split!r}, but that candidate is in {task.split!r}")
    return task
