"""The mined family: bugs injected into real packages from the index, graded by their own tests.

    flywheel tasks build --family mined --per-package 150     # validate mutants once, with progress
    flywheel tasks list  --family mined --split eval --n 10    # then: list, show, export like any family

SWE-smith's idea without Docker: take pure-Python sdists whose test suites run under pytest in
about a second (`PACKAGES`), enumerate every AST mutation of their source modules
(`flywheel/env/mutations.py`), and keep a mutant only if the package's own tests catch it: some
test that passes on the release fails on the mutant, and not every test does (an import-breaking
mutant says nothing about behaviour). One edit undoes each mutant by construction (it replaces one
span). The tests that fail become FAIL_TO_PASS, the rest of the passing ones PASS_TO_PASS, and the
instruction names the failing tests, as a bug report from CI would.

Validation runs each mutant's suite with pytest outside any jail (`repos.pytest_outside`, the same
counts as the sandboxed grader: tests/env/test_repos.py), so it is a build step: `build_catalogue`
tries mutants in an order fixed by (package, seed 0), appends each verdict to a catalogue file in
the cache as it is made (an interrupted build resumes where it stopped) and stops at
`per_package` validated mutants per package. `generate` then draws from the catalogue:
deterministic from its seed, and split by module (`split_of("package/module")`), so the eval
split's bugs lie in modules no training task touches.
"""

from __future__ import annotations

import functools
import hashlib
import json
import random
import subprocess
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

from flywheel.env.environments import build, cache_dir
from flywheel.env.families.workspace import file_edits
from flywheel.env.mutations import Mutation, mutations
from flywheel.env.repos import PYTEST_ENV, fetch_sdist, pytest_outside, sdist_files
from flywheel.env.task import Edit, Split, Task, TaskMetadata, is_test_path, split_of

FAMILY = "mined"
# A release's suite takes 1-2 CPU seconds here; a mutant past 20 is hung in a loop, not slow. CPU time,
# not wall time: on a loaded host (load average 26 on 2 cores) the wall clock rejected sound mutants.
VALIDATION_CPU_S = 20
VALIDATION_WALL_S = 900.0
EVAL_FRACTION = 0.25  # of modules; a package has few, so a little above the generated families' 0.2


@dataclass(frozen=True)
class Package:
    name: str
    version: str
    sources: tuple[str, ...]  # folders (or files) of the code that gets mutated
    tests: tuple[str, ...]  # pytest arguments that run its suite
    exclude: tuple[str, ...] = ()  # source paths never mutated (version stamps, compatibility shims)


PACKAGES: dict[str, Package] = {
    p.name: p for p in (
        Package("toolz", "1.0.0", ("toolz",), ("toolz/tests",),
                ("toolz/_version.py", "toolz/compatibility.py", "toolz/_signatures.py")),
        Package("inflection", "0.5.1", ("inflection",), ("test_inflection.py",)),
        Package("more-itertools", "10.5.0", ("more_itertools",), ("tests",)),
    )
}


@dataclass(frozen=True)
class MinedBug:
    """One validated mutant: what the catalogue stores, enough to rebuild its task exactly."""

    package: str
    version: str
    mutation: Mutation
    fail_to_pass: tuple[str, ...]
    pass_to_pass: tuple[str, ...]

    @property
    def module(self) -> str:
        return self.mutation.path

    def split(self) -> Split:
        return split_of(f"{self.package}/{self.module}", EVAL_FRACTION)

    def task_id(self) -> str:
        return f"{FAMILY}/{self.split()}/{self.package}/{self.mutation.key}"

    def to_json(self) -> str:
        return json.dumps({"package": self.package, "version": self.version, "mutation": asdict(self.mutation),
                           "fail_to_pass": self.fail_to_pass, "pass_to_pass": self.pass_to_pass})

    @classmethod
    def from_json(cls, line: str) -> MinedBug:
        d = json.loads(line)
        m = d["mutation"]
        mutation = Mutation(m["path"], m["kind"], m["function"], tuple(m["start"]), tuple(m["end"]), m["old"],
                            m["new"])
        return cls(d["package"], d["version"], mutation, tuple(d["fail_to_pass"]), tuple(d["pass_to_pass"]))


def package_files(package: Package, folder: Path | None = None) -> dict[str, str]:
    return sdist_files(fetch_sdist(package.name, package.version, folder))


def source_paths(package: Package, files: dict[str, str]) -> list[str]:
    def mutable(path: str) -> bool:
        in_sources = any(path == s or path.startswith(s.rstrip("/") + "/") for s in package.sources)
        in_tests = any(path == t or path.startswith(t.rstrip("/") + "/") for t in package.tests)
        return (path.endswith(".py") and in_sources and not in_tests and not is_test_path(path)
                and "/tests/" not in path and path not in package.exclude)
    return sorted(p for p in files if mutable(p))


def candidates(package: Package, files: dict[str, str], seed: int = 0) -> list[Mutation]:
    """Every mutant of the package in the order validation tries them (fixed by the seed)."""
    found = [m for path in source_paths(package, files) for m in mutations(files[path], path)]
    random.Random(f"{FAMILY}/{package.name}/{package.version}/{seed}").shuffle(found)
    return found


def catalogue_path(cache: Path | None = None) -> Path:
    body = json.dumps([[p.name, p.version, p.sources, p.tests, p.exclude] for p in PACKAGES.values()])
    key = hashlib.sha256(body.encode()).hexdigest()[:12]
    return (cache or cache_dir().parent / "mined") / f"catalogue-{key}.jsonl"


def _read_catalogue(path: Path) -> tuple[list[MinedBug], set[str]]:
    """(validated bugs, keys of every mutant tried, kept or not)."""
    bugs, tried = [], set()
    for line in path.read_text().splitlines() if path.is_file() else []:
        record = json.loads(line)
        if record.get("rejected"):
            tried.add(f"{record['package']}|{record['key']}")
        else:
            bug = MinedBug.from_json(line)
            bugs.append(bug)
            tried.add(f"{bug.package}|{bug.mutation.key}")
    return bugs, tried


def validate(package: Package, files: dict[str, str], baseline: dict[str, str], mutation: Mutation,
             env) -> MinedBug | None:
    """The bug a mutant makes, or None when the package's tests do not tell it from the release."""
    mutated = {**files, mutation.path: mutation.apply(files[mutation.path])}
    try:
        outcomes = pytest_outside(mutated, env, list(package.tests), timeout_s=VALIDATION_WALL_S,
                                  cpu_limit_s=VALIDATION_CPU_S)
    except (subprocess.TimeoutExpired, RuntimeError):
        return None  # a mutant that hangs the suite (a loop that never ends) makes a task graded by timeouts
    passing = sorted(t for t, o in baseline.items() if o == "passed")
    broken = [t for t in passing if outcomes.get(t) != "passed"]
    if not broken or len(broken) == len(passing):
        return None
    kept = set(broken)
    return MinedBug(package.name, package.version, mutation, tuple(broken),
                    tuple(t for t in passing if t not in kept))


def build_catalogue(per_package: int, packages: Iterable[str] | None = None, workers: int = 2,
                    cache: Path | None = None, progress: Callable[[str], None] = print,
                    limit_tried: int | None = None) -> Path:
    """Validate mutants until `per_package` per package are kept; resumable, appends as it goes."""
    env = build(PYTEST_ENV, progress=progress)
    path = catalogue_path(cache)
    path.parent.mkdir(parents=True, exist_ok=True)
    for name in packages or PACKAGES:
        package = PACKAGES[name]
        files = package_files(package)
        bugs, tried = _read_catalogue(path)
        kept = sum(b.package == name for b in bugs)
        todo = [m for m in candidates(package, files) if f"{name}|{m.key}" not in tried]
        if limit_tried is not None:
            todo = todo[:limit_tried]
        baseline = pytest_outside(files, env, list(package.tests), timeout_s=300)
        started, done = time.perf_counter(), 0
        progress(f"{name} {package.version}: {kept} kept so far, {len(todo)} mutants left to try, "
                 f"{list(baseline.values()).count('passed')} passing tests")
        check = functools.partial(validate, package, files, baseline, env=env)
        with ThreadPoolExecutor(workers) as pool, path.open("a") as out:
            pending = iter(todo)
            while kept < per_package:
                batch = [m for _, m in zip(range(workers), pending, strict=False)]
                if not batch:
                    break
                for mutation, bug in zip(batch, pool.map(check, batch), strict=True):
                    done += 1
                    if bug is not None and kept < per_package:
                        kept += 1
                        out.write(bug.to_json() + "\n")
                    else:
                        out.write(json.dumps({"package": name, "key": mutation.key, "rejected": True}) + "\n")
                    out.flush()
                elapsed = time.perf_counter() - started
                if done % 10 < workers:
                    progress(f"  {name}: tried {done}, kept {kept}/{per_package} ({elapsed:.0f} s, "
                             f"{elapsed / done:.2f} s a mutant)")
    return path


def catalogue(cache: Path | None = None) -> list[MinedBug]:
    path = catalogue_path(cache)
    bugs, _ = _read_catalogue(path)
    if not bugs:
        raise FileNotFoundError(f"no mined tasks in {path}; build them once with "
                                "`flywheel tasks build --family mined --per-package 150`")
    return bugs


def instruction(bug: MinedBug) -> str:
    shown = list(bug.fail_to_pass[:5])
    more = len(bug.fail_to_pass) - len(shown)
    listing = "\n".join(f"- {t}" for t in shown) + (f"\n- ... and {more} more" if more else "")
    first_file = bug.fail_to_pass[0].split("::", 1)[0]
    return (f"This is {bug.package} {bug.version}. After a recent change these tests fail:\n{listing}\n"
            f"Find the bug in the package's code and fix it; do not change the tests. "
            f"Run them with `python -m pytest -q {first_file}`.")


def to_task(bug: MinedBug, files: dict[str, str] | None = None) -> Task:
    package = PACKAGES[bug.package]
    files = files if files is not None else package_files(package)
    original = files[bug.module]
    broken = {**files, bug.module: bug.mutation.apply(original)}
    test_files = sorted({t.split("::", 1)[0] for t in bug.fail_to_pass + bug.pass_to_pass})
    return Task(
        id=bug.task_id(), family=FAMILY, split=bug.split(), instruction=instruction(bug), files=broken,
        # The suite's files, restored at grading: editing a test cannot make it pass.
        hidden_tests={p: files[p] for p in test_files},
        test_command=f"python -m pytest -q {' '.join(package.tests)}",
        metadata=TaskMetadata(difficulty=2, extra={"package": bug.package, "version": bug.version,
                                                   "mutation": bug.mutation.kind, "module": bug.module}),
        reference_edits=(reference_edit(bug, broken[bug.module], original),),
        environment=PYTEST_ENV.requirements,
        fail_to_pass=bug.fail_to_pass,
        pass_to_pass=bug.pass_to_pass,
    )


def reference_edit(bug: MinedBug, broken: str, original: str) -> Edit:
    """The one edit that undoes the mutant: its span with enough context to be unique."""
    edits = file_edits(bug.module, broken, original)
    if len(edits) != 1:
        raise AssertionError(f"mutant {bug.mutation.key} does not undo in one edit ({len(edits)} hunks)")
    return edits[0]


def generate(split: Split, n: int, seed: int = 0, cache: Path | None = None) -> list[Task]:
    """`n` mined tasks of `split`, drawn by `seed` from the catalogue."""
    bugs = [b for b in catalogue(cache) if b.split() == split]
    if n > len(bugs):
        raise ValueError(f"the mined catalogue holds {len(bugs)} {split} tasks, fewer than {n}; "
                         "build more with `flywheel tasks build --family mined --per-package N`")
    random.Random(f"{FAMILY}/{seed}").shuffle(bugs)
    sources: dict[str, dict[str, str]] = {}
    tasks = []
    for bug in bugs[:n]:
        if bug.package not in sources:
            sources[bug.package] = package_files(PACKAGES[bug.package])
        tasks.append(to_task(bug, sources[bug.package]))
    return tasks


def get(task_id: str, cache: Path | None = None) -> Task:
    for bug in catalogue(cache):
        if bug.task_id() == task_id:
            return to_task(bug)
    raise ValueError(f"no mined task {task_id!r} in {catalogue_path(cache)}; `flywheel tasks list --family mined`")
