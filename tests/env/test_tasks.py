"""Task families: every task is solvable by its reference edits and unsolved without them.

Hidden tests run the way the grader runs them: the workspace in a temp dir, hidden tests copied
in, `python3 -I -S run_tests.py --report-fd N <hidden test files>` with N an unlinked file, and the
`{"tests": ...}` report read back from it. Runs go through a thread pool of subprocesses so the file
stays well under a minute.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from flywheel.env import families
from flywheel.env.families import FAMILIES, ambiguous, generate, get_task, task_set
from flywheel.env.families.functions import TEMPLATES
from flywheel.env.task import Edit, Task, is_test_path, split_of

PYTHON = shutil.which("python3") or sys.executable
RUNNER_TEXT = (Path(families.__file__).parent.parent / "testrun.py").read_text()
PER_DIFFICULTY = 10  # tasks per family, difficulty and split in the solve/fail check


def apply(files: dict[str, str], edits: Iterable[Edit]) -> dict[str, str]:
    """Apply edits as the edit tool will: `old` must occur exactly once at application time."""
    out = dict(files)
    for edit in edits:
        if edit.old == "":
            assert edit.path not in out, f"{edit.path}: empty `old` must create a new file"
            out[edit.path] = edit.new
            continue
        assert out[edit.path].count(edit.old) == 1, f"{edit.path}: `old` is not unique: {edit.old!r}"
        out[edit.path] = out[edit.path].replace(edit.old, edit.new, 1)
    return out


def run_tests(files: dict[str, str], targets: tuple[str, ...] = ("tests_hidden",)) -> dict[str, bool]:
    """Per-test results of the workspace `files` (hidden tests included in `files` by the caller)."""
    with tempfile.TemporaryDirectory() as root:
        for path, text in files.items():
            dest = Path(root, path)
            dest.parent.mkdir(parents=True, exist_ok=True)
            dest.write_text(text)
        paths = sorted(p for p in files if p.startswith(tuple(t + "/" for t in targets)) and is_test_path(p))
        with tempfile.TemporaryFile() as report:
            fd = report.fileno()
            proc = subprocess.run([PYTHON, "-I", "-S", "run_tests.py", "--report-fd", str(fd), *paths], cwd=root,
                                  env={"PATH": os.environ.get("PATH", "")}, capture_output=True, text=True,
                                  timeout=60, pass_fds=(fd,))
            report.seek(0)
            data = report.read()
    assert data, f"no report; stdout={proc.stdout[-2000:]!r} stderr={proc.stderr[-2000:]!r}"
    return json.loads(data)["tests"]


def run_many(jobs: list[tuple[dict[str, str], tuple[str, ...]]]) -> list[dict[str, bool]]:
    with ThreadPoolExecutor(max_workers=max(4, 2 * (os.cpu_count() or 2))) as pool:
        return list(pool.map(lambda job: run_tests(*job), jobs))


def with_hidden(task: Task, files: dict[str, str]) -> dict[str, str]:
    return {**files, **task.hidden_tests}


def sample(family: str) -> list[Task]:
    return [t for split in ("train", "eval") for d in (1, 2, 3)
            for t in generate(family, split, PER_DIFFICULTY, seed=0, difficulty=d)]


# ---- structure ---------------------------------------------------------------------------------

@pytest.mark.parametrize("family", FAMILIES)
def test_task_shape(family):
    for task in generate(family, "train", 30, seed=3):
        assert task.family == family and task.id.startswith(f"{family}/train/s3/d")
        assert task.files["run_tests.py"] == RUNNER_TEXT
        assert task.test_command == "python3 run_tests.py tests"
        assert task.visible_test_paths() and all(p.startswith("tests/") for p in task.visible_test_paths())
        assert task.hidden_tests and all(p.startswith("tests_hidden/") and is_test_path(p) for p in task.hidden_tests)
        assert task.instruction.strip() and task.reference_edits
        assert task.metadata.ambiguous == (family == "ambiguous")
        assert (task.metadata.clarification is not None) == (family == "ambiguous")
        assert "template" in task.metadata.extra
        assert task.split == split_of(task.content_key())
        top = {p.split("/")[0] for p in task.files if "/" in p} - {"tests"}
        assert not top & set(sys.stdlib_module_names), f"{task.id}: a package shadowed by the stdlib"
    assert [t.metadata.difficulty for t in generate(family, "eval", 6)] == [1, 2, 3, 1, 2, 3]


def test_template_library():
    assert len(TEMPLATES) >= 15 and len({t.name for t in TEMPLATES}) == len(TEMPLATES)
    for t in TEMPLATES:
        assert t.bugs and t.renames
        for bug in t.bugs:
            assert t.body.count(bug.old) == 1, (t.name, bug.old)
    assert len(ambiguous.AMBIGUOUS) >= 5 and all(len(t.variants) >= 3 for t in ambiguous.AMBIGUOUS)


# ---- solvable by the reference, unsolved without it ----------------------------------------

@pytest.mark.slow  # 14 s on the shared 2-core machine (load ~10)
@pytest.mark.parametrize("family", FAMILIES)
def test_reference_solves_and_untouched_fails(family):
    tasks = sample(family)
    solved = [apply(t.files, t.reference_edits) for t in tasks]
    jobs = [(with_hidden(t, t.files), ("tests_hidden",)) for t in tasks]
    jobs += [(with_hidden(t, s), ("tests", "tests_hidden")) for t, s in zip(tasks, solved, strict=True)]
    results = run_many(jobs)
    before, after = results[:len(tasks)], results[len(tasks):]
    for task, untouched, fixed in zip(tasks, before, after, strict=True):
        assert not all(untouched.values()), f"{task.id}: the untouched workspace passes the hidden tests"
        hidden = {k: v for k, v in fixed.items() if k.startswith("tests_hidden/")}
        visible = {k: v for k, v in fixed.items() if k.startswith("tests/")}
        assert hidden and all(hidden.values()), f"{task.id}: reference fails {[k for k, v in hidden.items() if not v]}"
        assert visible and all(visible.values()), \
            f"{task.id}: reference fails {[k for k, v in visible.items() if not v]}"
        assert len(hidden) > len(visible), f"{task.id}: hidden tests add no cases"


@pytest.mark.parametrize("family", FAMILIES)
def test_hidden_tests_repeat_every_visible_check(family):
    """Deleting or editing visible tests gains nothing: the hidden tests hold the same asserts."""
    for task in generate(family, "eval", 30, seed=1):
        solved = apply(task.files, task.reference_edits)
        hidden_text = "\n".join(task.hidden_tests.values())
        for path in task.visible_test_paths():
            for line in solved[path].splitlines():
                if line.strip().startswith("assert "):
                    assert line in hidden_text, f"{task.id}: {line.strip()!r} is not in the hidden tests"


@pytest.mark.slow  # 6 s on the shared 2-core machine (load ~10)
def test_visible_test_shows_the_bug():
    tasks = [t for d in (1, 2, 3) for t in generate("bugfix", "train", 5, seed=1, difficulty=d)]
    for task, result in zip(tasks, run_many([(t.files, ("tests",)) for t in tasks]), strict=True):
        assert not all(result.values()), f"{task.id}: no visible test fails before the fix"


@pytest.mark.slow  # 10 s on the shared 2-core machine (load ~10)
def test_guessing_another_variant_fails():
    tasks = generate("ambiguous", "train", 12, seed=0) + generate("ambiguous", "eval", 6, seed=0)
    jobs, names = [], []
    for task in tasks:
        own = int(task.metadata.extra["variant"])
        assert ambiguous.variant_edits(task, own) == task.reference_edits
        for v in range(int(task.metadata.extra["variants"])):
            if v != own:
                jobs.append((with_hidden(task, apply(task.files, ambiguous.variant_edits(task, v))), ("tests_hidden",)))
                names.append((task.id, v))
    for name, result in zip(names, run_many(jobs), strict=True):
        assert not all(result.values()), f"{name}: another variant's solution passes the hidden tests"


def test_ambiguous_visible_tests_do_not_give_the_answer():
    tasks = generate("ambiguous", "train", 9, seed=5)
    jobs = []
    for task in tasks:
        for v in range(int(task.metadata.extra["variants"])):
            jobs.append((apply(task.files, ambiguous.variant_edits(task, v)), ("tests",)))
    assert all(all(r.values()) for r in run_many(jobs)), "some variant fails the visible tests"


# ---- determinism, ids and splits ---------------------------------------------------------------

@pytest.mark.parametrize("family", FAMILIES)
def test_deterministic_and_regenerable(family):
    first = generate(family, "train", 12, seed=7)
    assert first == generate(family, "train", 12, seed=7)
    assert len({t.content_key() for t in first}) == 12
    for task in first[:6]:
        assert get_task(task.id) == task
    assert {t.content_key() for t in first}.isdisjoint(t.content_key() for t in generate(family, "train", 12, seed=8))


def test_same_tasks_in_another_process():
    """Ids are regenerated in other processes (rollout workers): no dependence on hash seeds."""
    code = ("from flywheel.env.families import FAMILIES, generate\n"
            "print(' '.join(t.content_key() for f in FAMILIES for t in generate(f, 'eval', 8, seed=2)))")
    here = " ".join(t.content_key() for f in FAMILIES for t in generate(f, "eval", 8, seed=2))
    for hash_seed in ("1", "2"):
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                             env={**os.environ, "PYTHONHASHSEED": hash_seed}, cwd=Path(__file__).parents[2])
        assert out.stdout.split() == here.split()


@pytest.mark.parametrize("family", FAMILIES)
def test_splits_never_share_a_task(family):
    train = generate(family, "train", 200, seed=0)
    evals = generate(family, "eval", 200, seed=0)
    train_keys, eval_keys = {t.content_key() for t in train}, {t.content_key() for t in evals}
    assert len(train_keys) == len(evals) == len(eval_keys) == 200
    assert train_keys.isdisjoint(eval_keys)
    assert all(t.split == "train" for t in train) and all(t.split == "eval" for t in evals)


def test_crossfile_has_both_modes_and_rename_spans_three_files():
    tasks = generate("crossfile", "train", 30, seed=0)
    modes = {t.metadata.extra["mode"] for t in tasks}
    assert modes == {"cause", "rename"}
    for task in tasks:
        edited = {e.path for e in task.reference_edits}
        if task.metadata.extra["mode"] == "rename":
            assert len([p for p in edited if not p.startswith("tests/")]) >= 3
        else:
            assert edited == {task.metadata.extra["bug_path"]} != {task.metadata.extra["named_path"]}


def test_task_set_and_errors():
    mixed = task_set(["bugfix", "ambiguous"], "eval", 4, seed=2)
    assert [t.family for t in mixed] == ["bugfix"] * 4 + ["ambiguous"] * 4
    with pytest.raises(ValueError, match="known families: bugfix, implement, crossfile, ambiguous"):
        generate("nope", "train", 1)
    with pytest.raises(ValueError, match="split"):
        generate("bugfix", "test", 1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="form"):
        get_task("bugfix/train/17")
    wrong_split = get_task("bugfix/train/s0/d1/0").id.replace("/train/", "/eval/")
    with pytest.raises(ValueError, match="split"):
        get_task(wrong_split)


# ---- HumanEval ----------------------------------------------------------------------------------

@pytest.mark.slow  # 34 s on the shared 2-core machine (load ~10)
def test_humaneval_canonical_passes_and_prompt_fails():
    tasks = families.all_humaneval_tasks()
    assert len(tasks) == 164 and tasks[0].id == "humaneval/HumanEval_0"
    assert all(t.split == split_of(t.id) and t.metadata.difficulty == 2 for t in tasks)
    jobs = [(with_hidden(t, t.files), ("tests_hidden",)) for t in tasks]
    jobs += [(with_hidden(t, apply(t.files, t.reference_edits)), ("tests_hidden",)) for t in tasks]
    results = run_many(jobs)
    prompt_passes = [t.id for t, r in zip(tasks, results[:164], strict=True) if all(r.values())]
    canonical_fails = [t.id for t, r in zip(tasks, results[164:], strict=True) if not all(r.values())]
    assert prompt_passes == [] and canonical_fails == []


def test_humaneval_generate_and_get():
    evals = generate("humaneval", "eval", 1000)
    trains = generate("humaneval", "train", 1000)
    assert len(evals) + len(trains) == 164 and {t.id for t in evals}.isdisjoint(t.id for t in trains)
    assert generate("humaneval", "eval", 5, seed=1) == generate("humaneval", "eval", 5, seed=1)
    assert get_task("humaneval/HumanEval_0").files["solution.py"].startswith("from typing import List")
    with pytest.raises(ValueError, match="HumanEval"):
        get_task("humaneval/HumanEval_999")


# Draws measured before the runner left the content key (ids and keys of seed 3, 12 tasks per family and
# split): editing flywheel/env/testrun.py must never move them.
PINNED_DRAWS = {
    ("bugfix", "train"): "310ab3ea0274bbcf", ("bugfix", "eval"): "086d004de6b0ec67",
    ("implement", "train"): "9a31b0c5d281c213", ("implement", "eval"): "9345bdbc531b3e3a",
    ("crossfile", "train"): "5f5e8184fab37255", ("crossfile", "eval"): "82b52f954ac274c2",
    ("ambiguous", "train"): "414813380fa87a5d", ("ambiguous", "eval"): "2990871119d8e060",
}


@pytest.mark.parametrize(("family", "split"), sorted(PINNED_DRAWS))
def test_draw_of_a_seed_is_pinned(family, split):
    tasks = generate(family, split, 12, seed=3)
    digest = hashlib.sha256(" ".join(f"{t.id}:{t.content_key()}" for t in tasks).encode()).hexdigest()[:16]
    assert digest == PINNED_DRAWS[(family, split)]


def test_runner_text_is_no_part_of_the_content_key():
    task = generate("bugfix", "train", 1, seed=3)[0]
    edited = task.model_copy(update={"files": {**task.files, "run_tests.py": "# another runner\n"}})
    other = task.model_copy(update={"files": {**task.files, "solution.py": "x = 1\n"}})
    assert edited.content_key() == task.content_key()
    assert other.content_key() != task.content_key()
