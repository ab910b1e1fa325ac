"""Real repositories as environments: what each piece costs, against its baseline in the same run.

    python bench/repos.py [--repeats 5] [--skip-semantic | --only-semantic] [--distill]

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
  semantic_s               toolz's text files indexed with the static embedder: cold (empty
                           embedding cache), warm (another sandbox, same files), one function edited
                           (and how many chunks that re-embedded), a query's re-check of an
                           unchanged workspace
  recall_at_5              per embedder (static, minilm): the share of toolz's documented functions
                           found in the top 5 hits by their docstring's first line, and by their name
  distill                  (--distill) the static embedder's one-off distillation: wall and CPU s
  large_repository         a generated repository of 2,000 files: the semantic index cold, and the
                           grep, read_file and list_dir tools' latencies (median of 5)
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import random
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from flywheel.env.embedders import EMBEDDER_CACHE_ENV, distill
from flywheel.env.environments import build
from flywheel.env.grading import grade
from flywheel.env.repos import PYTEST_ENV, base_python, fetch_sdist, sdist_files, write_tree
from flywheel.env.sandbox import Sandbox, SandboxConfig, Snapshot
from flywheel.env.semantic import EmbeddingCache, SemanticIndex, load_embedder
from flywheel.env.task import Task, TaskMetadata
from flywheel.env.tools import Toolbox
from flywheel.env.toolspec import ToolCall

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
    parser.add_argument("--recall", nargs="*", default=["static", "minilm"], choices=["static", "minilm"],
                        help="embedders whose recall to measure (MiniLM indexes toolz in minutes on 2 busy cores)")
    parser.add_argument("--distill", action="store_true", help="also time distilling the static embedder afresh")
    args = parser.parse_args()
    out: dict[str, object] = {}
    files = sdist_files(fetch_sdist("toolz", "1.0.0", ROOT / ".cache" / "pypi"))
    config = SandboxConfig(wall_time_s=120, cpu_time_s=120, disk_mb=128)
    if not args.only_semantic:
        environment_figures(args, files, config, out)
    if not args.skip_semantic:
        semantic_figures(files, config, out, args.recall)
    if args.distill:
        out["distill"] = distill_figures()
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



def semantic_figures(files: dict[str, str], config: SandboxConfig, out: dict[str, object],
                     recall_embedders: list[str]) -> None:
    print("semantic index cold / warm / one edit", file=sys.stderr)
    text = {p: t for p, t in files.items() if Path(p).suffix in (".py", ".rst", ".md", ".cfg", ".txt")}
    load_embedder("static")  # a process's first search pays for reading the table, not indexing
    with tempfile.TemporaryDirectory(prefix="flywheel-bench-embed-") as cache_dir, \
            Sandbox.create(text, config) as first, Sandbox.create(text, config) as second:
        cache = EmbeddingCache(Path(cache_dir))
        cold_index = SemanticIndex(first.workspace, cache)
        cold = timed(cold_index.refresh)
        warm_index = SemanticIndex(second.workspace, cache)  # another sandbox of the same repository
        warm = timed(warm_index.refresh)
        recipes = second.read_text("toolz/recipes.py")
        second.write_text("toolz/recipes.py", recipes.replace("def countby(", "def countby(  ", 1))
        before = warm_index.embedded_chunks
        edit = timed(warm_index.refresh)
        unchanged = timed(warm_index.refresh)  # what every query pays before it searches
        out["semantic_s"] = {"files": len(text), "chunks": cold_index.chunk_count(), "cold": round(cold, 3),
                             "warm": round(warm, 4), "one_edit": round(edit, 4),
                             "one_edit_chunks_embedded": warm_index.embedded_chunks - before,
                             "unchanged": round(unchanged, 4)}
    out["recall_at_5"] = {name: recall_at_5(text, name) for name in recall_embedders}
    large_repository_figures(config, out)


def distill_figures() -> dict[str, float]:
    """The one-off distillation of the static embedder into an empty folder: wall and CPU seconds of
    this process (MiniLM's forward passes run on torch's threads here)."""
    print("distilling the static embedder afresh", file=sys.stderr)
    with tempfile.TemporaryDirectory(prefix="flywheel-bench-distill-") as folder:
        os.environ[EMBEDDER_CACHE_ENV] = folder  # no other thread runs yet: see embedders.py on environ writes
        load_embedder("minilm")  # loading MiniLM is timed apart: every process that uses it pays that
        before = resource.getrusage(resource.RUSAGE_SELF)
        wall = timed(lambda: distill(progress=lambda _line: None))
        after = resource.getrusage(resource.RUSAGE_SELF)
        del os.environ[EMBEDDER_CACHE_ENV]
    cpu = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
    return {"wall_s": round(wall, 1), "cpu_s": round(cpu, 1), "threads": torch.get_num_threads()}


def docstring_queries(files: dict[str, str]) -> list[tuple[str, str, int]]:
    """(query, path, line of the def) for each documented top-level function of the package (tests
    excluded): the query is the docstring's first line, which the function's chunk holds among its
    code, so a hit must come from the chunk's whole mean, not from an exact match."""
    found = []
    for path, source in sorted(files.items()):
        if not path.endswith(".py") or "/tests/" in path:
            continue
        for node in ast.parse(source).body:
            doc = ast.get_docstring(node) if isinstance(node, ast.FunctionDef) else None
            if doc and len(doc.split("\n", 1)[0].split()) >= 3:
                found.append((doc.split("\n", 1)[0].strip(), path, node.lineno))
    return found


def recall_at_5(files: dict[str, str], embedder: str) -> dict[str, object]:
    """The share of docstring queries whose function is among the top 5 hits, and of queries made of
    the function's name alone (`partition_all` -> "partition all")."""
    print(f"recall@5 of {embedder}", file=sys.stderr)
    queries = docstring_queries(files)
    with tempfile.TemporaryDirectory(prefix="flywheel-bench-recall-") as root:
        write_tree(Path(root), files)
        index = SemanticIndex(Path(root), EmbeddingCache(None), embedder=embedder)
        index_s = timed(index.refresh)
        by_name = {(p, line): name for p, source in files.items() if p.endswith(".py")
                   for name, line in _defs(source)}

        def found(query: str, path: str, line: int) -> bool:
            return any(h.path == path and h.start_line <= line <= h.end_line for h in index.search(query, 5))

        doc = sum(found(q, p, line) for q, p, line in queries) / len(queries)
        name = sum(found(by_name[(p, line)].replace("_", " "), p, line) for _, p, line in queries) / len(queries)
    return {"queries": len(queries), "docstring": round(doc, 3), "name": round(name, 3), "index_s": round(index_s, 2)}


def _defs(source: str) -> list[tuple[str, int]]:
    return [(n.name, n.lineno) for n in ast.parse(source).body if isinstance(n, ast.FunctionDef)]


WORDS = ("parse", "render", "merge", "split", "count", "cache", "fetch", "store", "score", "rank", "filter",
         "encode", "decode", "group", "sort", "match", "index", "token", "frame", "batch", "queue", "order",
         "price", "user", "graph", "path", "node", "edge", "vector", "matrix", "record", "field", "table")


def generated_repository(n_files: int, seed: int = 0) -> dict[str, str]:
    """`n_files` Python modules in 40 packages, five documented functions each (~50 lines a file)."""
    rng = random.Random(seed)
    files = {}
    for i in range(n_files):
        functions = []
        for j in range(5):
            a, b, c = rng.sample(WORDS, 3)
            functions.append(f"def {a}_{b}_{j}(items, limit={rng.randint(1, 99)}):\n"
                             f'    """{a.capitalize()} the {b} of each item, then {c} them (at most limit)."""\n'
                             f"    out = []\n    for item in items[:limit]:\n"
                             f"        if item is not None and item != {rng.randint(0, 9)}:\n"
                             f"            out.append(({a!r}, item))\n    return out\n")
        files[f"pkg{i % 40}/module_{i}.py"] = f'"""Module {i}."""\n\n\n' + "\n\n".join(functions)
    return files


def large_repository_figures(config: SandboxConfig, out: dict[str, object], n_files: int = 2000) -> None:
    """A generated repository of `n_files` files: the semantic index cold (static embedder, empty
    cache), and grep, read and list through the agent's tools (medians of 5)."""
    print(f"{n_files}-file repository", file=sys.stderr)
    files = generated_repository(n_files)
    with tempfile.TemporaryDirectory(prefix="flywheel-bench-embed-") as cache_dir, \
            Sandbox.create(files, config) as box, Toolbox(box) as tools:
        index = SemanticIndex(box.workspace, EmbeddingCache(Path(cache_dir)))
        cold = timed(index.refresh)
        unchanged = timed(index.refresh)

        def call(name: str, **arguments) -> None:
            [result] = tools.execute([ToolCall("c", name, arguments)])
            assert result.ok, result.content

        ms = {"grep": lambda: call("grep", pattern="render_price"),
              "read_file": lambda: call("read_file", path="pkg7/module_1047.py"),
              "list_dir": lambda: call("list_dir", path="pkg7")}
        out["large_repository"] = {
            "files": n_files, "chunks": index.chunk_count(), "semantic_cold_s": round(cold, 2),
            "semantic_unchanged_s": round(unchanged, 3),
            **{f"{name}_ms": round(1000 * median(fn, 5), 1) for name, fn in ms.items()}}


if __name__ == "__main__":
    main()
