"""flywheel's grader as a Harbor verifier: exported as a task's `tests/verify.py`, run by its test.sh.

    python3 /tests/verify.py --tests /tests --logs /logs/verifier     (from the task's working folder)

Standard library only (it runs in the task's container, where flywheel is not installed). It does
in the container what flywheel/env/grading.py does in a jail, after the agent has finished: the
hidden tests and the pristine runner (`run_tests.py`, flywheel/env/testrun.py) are copied in only
now, anything the agent put under `tests_hidden/` is removed (and, for a real-repository task, its
pytest control files replaced by the task's), the runner's supervisor reports each test through a
descriptor of an unlinked file, the outcomes are counted against the test ids computed at export,
and the reward is flywheel's (`grading.json`'s weights): the pass fraction, the all-passed bonus,
the visible-tests penalty. It writes `reward.txt` (the reward, as Harbor reads it) and
`grade.json` (its parts and each test's outcome) to the logs folder.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tests", type=Path, default=Path("/tests"))
    parser.add_argument("--logs", type=Path, default=Path("/logs/verifier"))
    ns = parser.parse_args(argv)
    spec = json.loads((ns.tests / "grading.json").read_text())
    work = Path.cwd()
    # The visible tests as the agent left them, before the hidden tests (which may be new versions of
    # the same files, as a SWE-bench test patch is) are copied over them.
    modified = float(any(_sha256(work / p) != digest for p, digest in spec["protected"].items()))
    shutil.rmtree(work / "tests_hidden", ignore_errors=True)
    if spec["pytest"]:  # what decides how pytest runs and reports is the task's, not the agent's
        control = set(spec["control_files"])
        for path in list(work.rglob("*")):
            if path.name in control and path.is_file():
                path.unlink()
        _copy_tree(ns.tests / "control", work)
    _copy_tree(ns.tests / "hidden", work)
    shutil.copyfile(ns.tests / "run_tests.py", work / spec["runner"])
    with tempfile.TemporaryFile() as report:
        fd = report.fileno()
        command = [sys.executable, "-I", "-S", spec["runner"], "--report-fd", str(fd)]
        command += ["--pytest", spec["site"], "--", *spec["files"]] if spec["pytest"] else spec["files"]
        try:
            run = subprocess.run(command, pass_fds=(fd,), capture_output=True, text=True, timeout=spec["timeout_s"])
            timed_out, log = False, run.stdout + run.stderr
        except subprocess.TimeoutExpired:
            timed_out, log = True, "timed out"
        report.seek(0)
        try:
            reported = json.loads(report.read())["tests"]
        except (ValueError, KeyError, TypeError):
            reported = {}
    ids = spec["ids"]
    tests = {test: reported.get(test) is True and not timed_out for test in ids}
    frac = sum(tests.values()) / len(ids) if ids else 0.0
    all_passed = float(bool(ids) and all(tests.values()))
    weights = spec["weights"]
    parts = {"pass_frac": weights["pass_frac_weight"] * frac,
             "all_passed_bonus": weights["all_passed_weight"] * all_passed,
             "visible_tests_penalty": -weights["visible_tests_penalty"] * modified}
    reward = sum(parts.values())
    ns.logs.mkdir(parents=True, exist_ok=True)
    (ns.logs / "reward.txt").write_text(f"{reward}\n")
    (ns.logs / "grade.json").write_text(json.dumps({"reward": reward, "parts": parts, "tests": tests,
                                                    "timed_out": timed_out, "log": log[-4000:]}, indent=1))
    return 0


def _copy_tree(source: Path, target: Path) -> None:
    if source.is_dir():
        for path in source.rglob("*"):
            if path.is_file():
                (target / path.relative_to(source)).parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(path, target / path.relative_to(source))


def _sha256(path: Path) -> str | None:
    try:
        return hashlib.sha256(path.read_bytes()).hexdigest()
    except OSError:
        return None  # deleted: modified


if __name__ == "__main__":
    os.umask(0o022)
    sys.exit(main())
