"""The real `flywheel` command, run as a user would."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest


def flywheel(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "flywheel.cli", *args], capture_output=True, text=True, timeout=120)


def test_tasks_list_show_export(tmp_path):
    listed = flywheel("tasks", "list", "--family", "crossfile", "--split", "eval", "--n", "3")
    assert listed.returncode == 0, listed.stderr
    ids = [line.split()[0] for line in listed.stdout.splitlines()[1:]]
    assert len(ids) == 3 and all(i.startswith("crossfile/eval/") for i in ids)
    shown = flywheel("tasks", "show", ids[0])
    assert shown.returncode == 0 and "## instruction" in shown.stdout and "## hidden tests" in shown.stdout
    out = tmp_path / "tasks.jsonl"
    exported = flywheel("tasks", "export", "--family", "ambiguous", "--split", "train", "--n", "4", "--out", str(out))
    assert exported.returncode == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 4 and all(r["metadata"]["ambiguous"] for r in rows)


@pytest.mark.slow  # 63 s on the shared 2-core machine (load ~10)
def test_bad_input_gets_a_clear_error():
    unknown = flywheel("tasks", "list", "--family", "nonsense")
    assert unknown.returncode == 2 and "bugfix" in unknown.stderr  # names the known families
    missing = flywheel("tasks", "show")
    assert missing.returncode == 2 and "needs a task id" in missing.stderr
    bad_set = flywheel("demo", "--set", "nonsense_key=1")
    assert bad_set.returncode == 2 and "nonsense_key" in bad_set.stderr


def test_help_lists_every_command():
    shown = flywheel("--help")
    assert shown.returncode == 0, shown.stderr
    for command in ("tasks", "demo", "registry", "bootstrap", "eval", "train", "serve", "live", "scenario",
                    "engine"):
        assert command in shown.stdout
