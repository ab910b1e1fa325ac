"""Real repositories as environments: what each piece costs, against its baseline in the same run.

    python bench/repos.py [--repeats 5] [--skip-semantic]

Prints one JSON object:
  env_build_s              `build` of the pytest environment into an empty cache (pip's download
                           cache warm), including bytecode compilation
  jail_start_ms            `true` in a jail, bare / with the environment bound (median)
  suite_s                  toolz 1.0.0's suite (180 tests): outside any jail (host, same interpreter
                           and pytest), in a jail with the precompiled environment, in a jail with
                           the same environment stripped of its .pyc files (what every run cost
                           before: PYTHONDONTWRITEBYTECODE recompiles pytest each time), and graded
                           (the supervisor, tokens, report fd; one test file). Medians of wall time
                           and, as `*_cpu`, of the CPU seconds of the processes started.
  semantic_s               toolz's text files indexed: cold (empty embedding cache), warm (another
                           sandbox, same files), one edited file re-indexed
"""

from __future__ import annotations

import argparse
import json
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from flywheel.env.environments import build
from flywheel.env.grading import grade
from flywheel.env.repos import PYTEST_ENV, base_python, fetch_sdist, sdist_files, write_tree
from flywheel.env.sandbox import Sandbox, SandboxConfig, Snapshot
from flywheel.env.semantic import EmbeddingCache, SemanticIndex, embed
from flywheel.env.task import Task, TaskMetadata

ROOT = Path(__file__).parents[1]
SUITE = "python -m pytest -q -p no:cacheprovider toolz/tests"


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)  # every waited-for descendant: bwrap, the jail, pytest
    return usage.ru_utime + usage.ru_stime


def median(fn, repeats: int) -> float:
    return statistics.median(timed(fn) for _ in range(repeats))


def median_cpu(fn, repeats: int) -> float:
    """CPU seconds of the processes `fn` starts: steadier than wall time on a shared, loaded host."""
    samples = []
    for _ in range(repeats):
        before = children_cpu()
        fn()
        samples.append(children_cpu() - before)
    return statistics.median(samples)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--skip-semantic", action="store_true")
    parser.add_argument("--only-semantic", action="store_true")
    args = parser.parse_args()
    out: dict[str, object] = {}
    files = sdist_files(fetch_sdist("toolz", "1.0.0", ROOT / ".cache" / "pypi"))
    config = SandboxConfig(wall_time_s=120, cpu_time_s=120, disk_mb=128)
    if not args.only_semantic:
        environment_figures(args, files, config, out)
    if not args.skip_semantic:
        semantic_figures(files, config, out)
    print(json.dumps(out, indent=1))


def environment_figures(args, files: dict[str, str], config: SandboxConfig, out: dict[str, object]) -> None:
    with tempfile.TemporaryDirectory(prefix="flywheel-bench-envs-", dir="/var/tmp") as tmp:
        Path(tmp).chmod(0o755)
        fresh = Path(tmp) / "fresh"
        out["env_build_s"] = round(timed(lambda: build(PYTEST_ENV, fresh, progress=lambda _l: None)), 2)
        env = build(PYTEST_ENV, progress=lambda _l: None)
        stripped = Path(tmp) / "stripped"
        shutil.copytree(env.path, stripped, symlinks=True)
        for d in stripped.rglob("__pycache__"):
            d.chmod(0o755)
            shutil.rmtree(d)
        print("built; timing jails", file=sys.stderr)
        with Sandbox.create({}, config) as bare, Sandbox.create({}, config, environment=env.path) as bound:
            out["jail_start_ms"] = {
                "bare": round(1000 * median(lambda: bare.run("true"), 3 * args.repeats), 1),
                "env_bound": round(1000 * median(lambda: bound.run("true"), 3 * args.repeats), 1),
            }
        with tempfile.TemporaryDirectory(prefix="flywheel-bench-toolz-") as host:
            write_tree(Path(host), files)
            site_dir = str(env.site)
            host_cmd = [base_python(), "-S", "-c",
                        f"import sys, site; sys.path[:0] = ['', {site_dir!r}]; site.addsitedir({site_dir!r}); "
                        "import pytest; sys.exit(pytest.main(['-q', '-p', 'no:cacheprovider', 'toolz/tests']))"]
            def run_outside():
                subprocess.run(host_cmd, cwd=host, capture_output=True, check=True,
                               env={"PYTHONDONTWRITEBYTECODE": "1", "PATH": "/usr/bin:/bin"})
            suite: dict[str, float] = {"outside": round(median(run_outside, args.repeats), 3),
                                       "outside_cpu": round(median_cpu(run_outside, args.repeats), 3)}
        print("timing the suite in jails", file=sys.stderr)
        for name, prefix in (("jail_precompiled", env.path), ("jail_no_pyc", stripped)):
            with Sandbox.create(files, config, environment=prefix) as box:
                check = box.run(SUITE)
                assert check.exit_code == 0 and "180 passed" in check.output, check.render()[-500:]
                suite[name] = round(median(lambda box=box: box.run(SUITE), args.repeats), 3)
                suite[name + "_cpu"] = round(median_cpu(lambda box=box: box.run(SUITE), args.repeats), 3)
        task = Task(id="bench/toolz", family="repo", split="train", instruction="-", files=files, hidden_tests={},
                    test_command=SUITE, metadata=TaskMetadata(difficulty=2), environment=PYTEST_ENV.requirements,
                    pass_to_pass=("toolz/tests/test_utils.py::test_raises",))
        suite["graded"] = round(median(lambda: grade(task, Snapshot.of_files(files)), args.repeats), 3)
        suite["graded_cpu"] = round(median_cpu(lambda: grade(task, Snapshot.of_files(files)), args.repeats), 3)
        suite["jail_over_outside_cpu"] = round(suite["jail_precompiled_cpu"] / suite["outside_cpu"], 2)
        suite["no_pyc_over_precompiled_cpu"] = round(suite["jail_no_pyc_cpu"] / suite["jail_precompiled_cpu"], 2)
        out["suite_s"] = suite



def semantic_figures(files: dict[str, str], config: SandboxConfig, out: dict[str, object]) -> None:
    print("semantic index cold / warm", file=sys.stderr)
    text = {p: t for p, t in files.items() if Path(p).suffix in (".py", ".rst", ".md", ".cfg", ".txt")}
    embed(["load the embedder first: a process's first query pays for it, not indexing"])
    with tempfile.TemporaryDirectory(prefix="flywheel-bench-embed-") as cache_dir, \
            Sandbox.create(text, config) as first, Sandbox.create(text, config) as second:
        cache = EmbeddingCache(Path(cache_dir))
        cold_index = SemanticIndex(first.workspace, cache)
        cold = timed(cold_index.refresh)
        warm_index = SemanticIndex(second.workspace, cache)  # another sandbox of the same repository
        warm = timed(warm_index.refresh)
        second.write_text("toolz/recipes.py", second.read_text("toolz/recipes.py") + "\n# edited\n")
        edit = timed(warm_index.refresh)
        unchanged = timed(warm_index.refresh)  # what every query pays before it searches
        chunks = sum(len(f.spans) for f in cold_index._files.values())
    out["semantic_s"] = {"files": len(text), "chunks": chunks, "cold": round(cold, 3), "warm": round(warm, 4),
                         "one_edit": round(edit, 3), "unchanged": round(unchanged, 4)}


if __name__ == "__main__":
    main()
