"""SWE-bench instances in and out: one JSONL record per task, in SWE-bench's field names.

    instances = read_instances(Path("instances.jsonl"))
    task = instance_task(instances[0], source=Path("~/src/repo"))   # a git checkout, or an sdist
    write_instances(Path("out.jsonl"), [task_instance(t) for t in tasks])

An instance names a repository, the commit the agent starts from (`base_commit`) or a `snapshot`
(an sdist path), the `problem_statement`, the fix (`patch`) and the tests that check it
(`test_patch`), both unified diffs, and the pytest node ids `FAIL_TO_PASS` / `PASS_TO_PASS`
(lists, or the JSON strings SWE-bench's own files hold). `environment` is flywheel's addition: the
pip requirement lines of the dependency environment (default: pytest only).

Into a task: the workspace is the tree at the base commit and nothing else (no `.git`), so the
agent cannot `git log` its way to the commits that hold the fix, a known SWE-bench hack. The test
patch's files become the hidden tests (copied over the workspace at grading), and the patch
becomes the reference edits. Out of a task: `patch` is the reference edits as a diff,
`test_patch` the hidden tests against the workspace, `base_commit` the task's content key when
the task came from no repository.
"""

from __future__ import annotations

import difflib
import json
import subprocess
import tempfile
from collections.abc import Iterable
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, field_validator

from flywheel.env.families.workspace import workspace_edits
from flywheel.env.jsonl import read_records
from flywheel.env.repos import PYTEST_ENV, git_snapshot, sdist_files, write_tree
from flywheel.env.task import Split, Task, TaskMetadata, split_of

FAMILY = "swebench"


class Instance(BaseModel):
    model_config = ConfigDict(extra="ignore")  # SWE-bench files carry more fields (hints_text, version, ...)
    instance_id: str
    repo: str
    base_commit: str = ""
    snapshot: str | None = None  # an sdist path, in place of a commit
    problem_statement: str
    patch: str
    test_patch: str = ""
    FAIL_TO_PASS: list[str] = Field(min_length=1)
    PASS_TO_PASS: list[str] = Field(default_factory=list)
    environment: list[str] = Field(default_factory=lambda: list(PYTEST_ENV.requirements))

    @field_validator("FAIL_TO_PASS", "PASS_TO_PASS", mode="before")
    @classmethod
    def _json_list(cls, value: object) -> object:
        return json.loads(value) if isinstance(value, str) else value  # SWE-bench stores them as JSON text


def read_instances(path: Path) -> list[Instance]:
    """The instances of a JSON-lines file; a missing file, a bad line or an empty file is refused
    as `read_tasks` refuses one, naming the file, the line and the field."""
    return read_records(path, Instance, what="SWE-bench instance", plural="instances",
                        command="flywheel tasks export --format swebench")


def write_instances(path: Path, instances: Iterable[Instance]) -> int:
    lines = [i.model_dump_json() + "\n" for i in instances]
    path.write_text("".join(lines))
    return len(lines)


def apply_patch(files: dict[str, str], patch: str) -> dict[str, str]:
    """`files` with a unified diff applied (git apply, outside any repository); refuses a patch that
    does not apply, naming it."""
    if not patch.strip():
        return dict(files)
    with tempfile.TemporaryDirectory(prefix="flywheel-patch-") as tmp:
        root = Path(tmp)
        write_tree(root, files)
        run = subprocess.run(["git", "apply", "--whitespace=nowarn", "-"], cwd=root, input=patch.encode(),
                             capture_output=True, check=False)
        if run.returncode != 0:
            raise ValueError(f"the patch does not apply to the snapshot: {run.stderr.decode().strip()}")
        out = {}
        for path in sorted(p for p in root.rglob("*") if p.is_file()):
            out[str(path.relative_to(root))] = path.read_text()
        return out


def snapshot_files(instance: Instance, source: Path) -> dict[str, str]:
    """The tree the agent starts from: the sdist `snapshot`, or `source` (a git repository) at the
    base commit."""
    if instance.snapshot:
        return sdist_files(Path(instance.snapshot))
    if not instance.base_commit:
        raise ValueError(f"instance {instance.instance_id} names neither a base_commit nor a snapshot")
    return git_snapshot(source, instance.base_commit)


def instance_task(instance: Instance, source: Path | None = None, split: Split | None = None) -> Task:
    files = snapshot_files(instance, source or Path("."))
    with_tests = apply_patch(files, instance.test_patch)
    hidden = {p: t for p, t in with_tests.items() if files.get(p) != t}
    fixed = apply_patch(files, instance.patch)
    key = f"{instance.repo}/{instance.instance_id}"
    return Task(
        id=f"{FAMILY}/{instance.instance_id}", family=FAMILY, split=split or split_of(key),
        instruction=instance.problem_statement, files=files, hidden_tests=hidden,
        test_command="python -m pytest -q " + " ".join(sorted({t.split("::", 1)[0] for t in instance.FAIL_TO_PASS})),
        metadata=TaskMetadata(difficulty=2, extra={"repo": instance.repo, "base_commit": instance.base_commit}),
        reference_edits=workspace_edits(files, fixed),
        environment=tuple(instance.environment),
        fail_to_pass=tuple(instance.FAIL_TO_PASS),
        pass_to_pass=tuple(instance.PASS_TO_PASS),
    )


def unified_diff(before: dict[str, str], after: dict[str, str]) -> str:
    """A git-style unified diff from `before` to `after` (a path missing from `before` is created)."""
    chunks = []
    for path in sorted(set(before) | set(after)):
        old, new = before.get(path), after.get(path)
        if old == new:
            continue
        chunks.extend(difflib.unified_diff(
            (old or "").splitlines(keepends=True), (new or "").splitlines(keepends=True),
            fromfile=f"a/{path}" if old is not None else "/dev/null", tofile=f"b/{path}"))
    return "".join(chunks)


def task_instance(task: Task) -> Instance:
    """A pytest-graded task as a SWE-bench instance (generated families have no node ids: refused)."""
    if not task.graded_by_pytest:
        raise ValueError(f"task {task.id} is graded by flywheel's runner, not pytest node ids; only "
                         "real-repository tasks (mined, swebench) export as SWE-bench instances")
    fixed = dict(task.files)
    for edit in task.reference_edits:
        fixed[edit.path] = fixed[edit.path].replace(edit.old, edit.new, 1) if edit.old else edit.new
    extra = task.metadata.extra
    return Instance(
        instance_id=task.id.replace("/", "__"), repo=str(extra.get("repo") or extra.get("package") or task.family),
        base_commit=str(extra.get("base_commit") or task.content_key()), problem_statement=task.instruction,
        patch=unified_diff(task.files, fixed),
        test_patch=unified_diff({p: task.files[p] for p in task.hidden_tests if p in task.files}, task.hidden_tests),
        FAIL_TO_PASS=list(task.fail_to_pass), PASS_TO_PASS=list(task.pass_to_pass),
        environment=list(task.environment),
    )
