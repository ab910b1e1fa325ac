"""Shared parts of the procedural families: task ids, seeded randomness, test-file text, and
turning a (starting workspace, solved workspace) pair into a `Task` with reference edits.

A family builder only describes two workspaces: what the agent starts from and what a correct
solution looks like. The reference edits are derived from their difference here, so they can
never drift from the solution the hidden tests were checked against.
"""

from __future__ import annotations

import difflib
import functools
import random
from dataclasses import dataclass, field
from importlib import resources

from flywheel.env.task import SPLITS, Edit, Split, Task, TaskMetadata

TEST_COMMAND = "python3 run_tests.py tests"
RUNNER_PATH = "run_tests.py"


@functools.cache
def runner_text() -> str:
    """The exact text of `flywheel/env/testrun.py`, shipped as `run_tests.py` in every workspace."""
    return resources.files("flywheel.env").joinpath("testrun.py").read_text()


@dataclass(frozen=True)
class TaskRef:
    """What a procedural task id encodes: enough to regenerate the task exactly."""

    family: str
    split: Split
    seed: int
    difficulty: int
    index: int

    def task_id(self) -> str:
        return f"{self.family}/{self.split}/s{self.seed}/d{self.difficulty}/{self.index}"

    @classmethod
    def parse(cls, task_id: str) -> TaskRef:
        parts = task_id.split("/")
        ok = (
            len(parts) == 5
            and parts[1] in SPLITS
            and parts[2][:1] == "s"
            and parts[2][1:].lstrip("-").isdigit()
            and parts[3][:1] == "d"
            and parts[3][1:].isdigit()
            and parts[4].isdigit()
        )
        if not ok:
            raise ValueError(
                f"task id {task_id!r} is not of the form 'family/split/s<seed>/d<difficulty>/<index>', "
                "e.g. 'bugfix/train/s0/d1/17'"
            )
        return cls(parts[0], parts[1], int(parts[2][1:]), int(parts[3][1:]), int(parts[4]))  # type: ignore[arg-type]

    def rng(self) -> random.Random:
        """The candidate's randomness; independent of the split so both splits share one stream."""
        return random.Random(f"{self.family}/{self.seed}/{self.difficulty}/{self.index}")


@dataclass(frozen=True)
class Draft:
    """A task as a builder describes it: the starting workspace and the solved one."""

    instruction: str
    files: dict[str, str]
    solved: dict[str, str]
    hidden_tests: dict[str, str]
    difficulty: int
    ambiguous: bool = False
    clarification: str | None = None
    extra: dict[str, str | int | float | bool] = field(default_factory=dict)


def to_task(family: str, draft: Draft, task_id: str, split: Split) -> Task:
    files = {RUNNER_PATH: runner_text(), **draft.files}
    solved = {RUNNER_PATH: runner_text(), **draft.solved}
    return Task(
        id=task_id,
        family=family,
        split=split,
        instruction=draft.instruction,
        files=dict(sorted(files.items())),
        hidden_tests=dict(sorted(draft.hidden_tests.items())),
        test_command=TEST_COMMAND,
        metadata=TaskMetadata(
            difficulty=draft.difficulty,
            ambiguous=draft.ambiguous,
            clarification=draft.clarification,
            extra=dict(draft.extra),
        ),
        reference_edits=workspace_edits(files, solved),
    )


def workspace_edits(before: dict[str, str], after: dict[str, str]) -> tuple[Edit, ...]:
    edits: list[Edit] = []
    for path in sorted(after):
        if path not in before:
            edits.append(Edit(path=path, old="", new=after[path]))
        elif before[path] != after[path]:
            edits.extend(file_edits(path, before[path], after[path]))
    missing = sorted(set(before) - set(after))
    if missing:
        raise ValueError(f"a solved workspace may not delete files, but {missing} are gone")
    return tuple(edits)


def file_edits(path: str, before: str, after: str) -> list[Edit]:
    """Unique-snippet edits that turn `before` into `after` when applied in order.

    Hunks are applied bottom-up so each one's line numbers still hold in the current text; each
    snippet grows by context lines until it occurs exactly once in the text it will be applied to.
    """
    old_lines = before.splitlines(keepends=True)
    new_lines = after.splitlines(keepends=True)
    hunks = [op for op in difflib.SequenceMatcher(a=old_lines, b=new_lines, autojunk=False).get_opcodes()
             if op[0] != "equal"]
    current = list(old_lines)
    edits = []
    for _, i1, i2, j1, j2 in reversed(hunks):
        text = "".join(current)
        lo, hi = i1, i2
        while True:
            old = "".join(current[lo:hi])
            if old and text.count(old) == 1:
                break
            if lo == 0 and hi == len(current):
                raise ValueError(f"cannot find a unique snippet for an edit of {path}")
            lo, hi = max(lo - 1, 0), min(hi + 1, len(current))
        replacement = current[lo:i1] + new_lines[j1:j2] + current[i2:hi]
        edits.append(Edit(path=path, old=old, new="".join(replacement)))
        current[lo:hi] = replacement
    if "".join(current) != after:
        raise AssertionError(f"derived edits for {path} do not reproduce the solved file")
    return edits


# ---- test-file text ---------------------------------------------------------------------------

def call_text(name: str, args: tuple) -> str:
    return f"{name}({', '.join(repr(a) for a in args)})"


def test_function(test_name: str, body_lines: list[str]) -> str:
    return f"def {test_name}():\n" + "".join(f"    {line}\n" for line in body_lines)


def python_file(doc: str | None, imports: list[str], blocks: list[str]) -> str:
    """A module: optional docstring, imports, then top-level blocks separated by two blank lines."""
    head = f'"""{doc}"""\n' if doc else ""
    if imports:
        head += ("\n" if head else "") + "".join(line + "\n" for line in imports)
    parts = ([head] if head else []) + list(blocks)
    return "\n\n".join(p if p.endswith("\n") else p + "\n" for p in parts)


def pick(rng: random.Random, pool: tuple[str, ...] | list[str]) -> str:
    return pool[rng.randrange(len(pool))]
