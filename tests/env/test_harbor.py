"""Harbor task folders out and in: an exported family task is read by Harbor's own package
(`harbor.models.task.Task`, in .venv-ecosystem: Harbor needs Python 3.12, `make ecosystem-env`),
imported back, and graded in the jail by its own tests/test.sh and reward file, with the reward
flywheel's grader gives the same workspace; its solution/solve.sh solves it; a reward file the
agent planted counts for nothing. A Harbor-native task (test.sh reading /app, writing
/logs/verifier/reward.txt) is graded in the jail; Harbor's own template task, which needs Docker
(FROM ubuntu), is refused with the line that needs it. A real-repository task (pip requirements,
pytest node ids) exports with its requirements in /env/site and its pytest control files kept."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from flywheel.cli import main
from flywheel.env.families import generate
from flywheel.env.grading import grade
from flywheel.env.harbor import NotBuildable, export_task, folder_name, import_task
from flywheel.env.sandbox import Sandbox, Snapshot
from flywheel.env.task import Task, TaskMetadata

REPO = Path(__file__).resolve().parents[2]
ECOSYSTEM_PYTHON = REPO / ".venv-ecosystem" / "bin" / "python"
needs_harbor = pytest.mark.skipif(not ECOSYSTEM_PYTHON.exists() and os.environ.get("FLYWHEEL_CI") != "1",
                                  reason="Harbor needs Python 3.12: make ecosystem-env builds .venv-ecosystem")

# Harbor's own reader, run in its environment: what it makes of each exported folder.
HARBOR_READS = """
import json, sys
from pathlib import Path
from harbor.models.task.task import Task
import harbor
out = {}
for folder in sys.argv[1:]:
    task = Task(folder)
    out[Path(folder).name] = {"valid": Task.is_valid_dir(folder), "name": task.name, "instruction": task.instruction,
        "test": str(task.paths.discovered_test_path), "solve": str(task.paths.discovered_solve_path),
        "metadata": task.config.metadata, "verifier_timeout": task.config.verifier.timeout_sec}
out["template"] = str(Path(harbor.__file__).parent / "cli" / "template-task")
print(json.dumps(out))
"""


def _solved(folder: Path, files: dict[str, str]) -> Snapshot:
    """The workspace after the exported solution/solve.sh ran in it (in a jail)."""
    with Sandbox.create({**files, "solve.sh": (folder / "solution" / "solve.sh").read_text()}) as box:
        run = box.run("bash solve.sh && rm solve.sh", timeout_s=20)
        assert run.exit_code == 0, run.render()
        return box.snapshot()


@needs_harbor
def test_an_exported_task_is_read_by_harbor_and_graded_back_by_its_own_test_sh(tmp_path):
    out = tmp_path / "harbor"
    assert main(["tasks", "export", "--family", "bugfix", "--n", "1", "--seed", "3", "--format", "harbor",
                 "--out", str(out)]) == 0
    (task,) = generate("bugfix", "train", 1, seed=3)
    folder = out / folder_name(task)
    # A real-repository task's shape (SWE-bench, mined): pip requirements and pytest node ids.
    repo_task = Task(id="swebench/demo__pkg-1", family="swebench", split="eval", instruction="Fix pkg.",
                     files={"pkg/__init__.py": "X = 1\n", "conftest.py": "", "tests/test_a.py": "def test_x(): pass\n"},
                     hidden_tests={"tests/test_a.py": "def test_x(): assert 1\n"}, test_command="pytest",
                     metadata=TaskMetadata(difficulty=2), environment=("pytest==8.4.1",),
                     fail_to_pass=("tests/test_a.py::test_x",))
    repo_folder = export_task(repo_task, out)
    read = json.loads(subprocess.run([str(ECOSYSTEM_PYTHON), "-c", HARBOR_READS, str(folder), str(repo_folder)],
                                     check=True, capture_output=True, text=True, timeout=120).stdout)
    assert read[repo_folder.name]["valid"] and read[repo_folder.name]["metadata"]["family"] == "swebench"
    dockerfile = (repo_folder / "environment" / "Dockerfile").read_text()
    assert "pip install --no-cache-dir --target /env/site -r /tmp/requirements.txt" in dockerfile
    spec = json.loads((repo_folder / "tests" / "grading.json").read_text())
    assert spec["pytest"] and spec["ids"] == ["tests/test_a.py::test_x"] and spec["files"] == ["tests/test_a.py"]
    assert (repo_folder / "tests" / "control" / "conftest.py").exists()
    harbor_task = read[folder.name]
    assert harbor_task["valid"] and harbor_task["instruction"].strip() == task.instruction.strip()
    assert harbor_task["test"].endswith("tests/test.sh") and harbor_task["solve"].endswith("solution/solve.sh")
    assert harbor_task["metadata"] == {"flywheel_id": task.id, "family": "bugfix", "split": task.split,
                                       "difficulty": task.metadata.difficulty, "content_key": task.content_key()}

    imported = import_task(folder)
    assert imported.files == task.files and imported.grader == "harbor" and imported.environment == ()
    assert not any(p.startswith(".harbor") for p in imported.files)  # the tests are not in the workspace
    # Unsolved: the hidden tests fail; a reward file the agent planted is removed before test.sh runs.
    forged = Snapshot.of_files({**task.files, ".harbor/logs/verifier/reward.txt": "1\n"})
    unsolved = grade(imported, forged)
    assert not unsolved.all_passed
    assert unsolved.reward == pytest.approx(grade(task, Snapshot.of_files(task.files)).reward)
    # Solved by the exported solution: the same reward as flywheel's own grading of that workspace.
    solved = _solved(folder, task.files)
    assert grade(imported, solved).reward == pytest.approx(grade(task, solved).reward) == pytest.approx(1.0)
    # A deleted visible test costs what it costs in flywheel (the verifier's hashes of them).
    (visible, *_) = task.visible_test_paths()
    tampered = Snapshot.of_files({p: b for p, b in solved.files.items() if p != visible})
    penalized = grade(task, tampered).reward
    assert penalized < 1.0 and grade(imported, tampered).reward == pytest.approx(penalized)

    # Harbor's own task template needs Docker (FROM ubuntu): refused with the reason.
    template = Path(read["template"])
    with pytest.raises(NotBuildable, match="FROM ubuntu:24.04: flywheel builds only a python"):
        import_task(template)


def test_a_harbor_task_with_a_python_base_is_graded_by_its_test_sh_in_the_jail(tmp_path):
    folder = tmp_path / "answer-task"
    (folder / "environment" / "src").mkdir(parents=True)
    (folder / "tests").mkdir()
    (folder / "instruction.md").write_text("Write the answer to /app/answer.txt.\n")
    (folder / "task.toml").write_text('schema_version = "1.4"\n[metadata]\ndifficulty = "medium"\n')
    (folder / "environment" / "Dockerfile").write_text(
        "FROM python:3.12-slim\nWORKDIR /app\nCOPY requirements.txt /tmp/requirements.txt\n"
        "RUN pip install --no-cache-dir \\\n    -r /tmp/requirements.txt\nCOPY src/ /app/\n")
    (folder / "environment" / "requirements.txt").write_text("# pinned\nattrs==25.4.0\n")
    (folder / "environment" / "src" / "question.txt").write_text("six times seven\n")
    (folder / "tests" / "test.sh").write_text(
        "#!/bin/bash\nif grep -qx 42 /app/answer.txt; then echo 1 > /logs/verifier/reward.txt; "
        "else echo 0 > /logs/verifier/reward.txt; fi\n")
    task = import_task(folder)
    assert task.files == {"question.txt": "six times seven\n"} and task.environment == ("attrs==25.4.0",)
    assert task.metadata.difficulty == 2 and set(task.hidden_tests) == {".harbor/tests/test.sh"}
    bare = task.model_copy(update={"environment": ()})  # graded without building its environment
    assert grade(bare, Snapshot.of_files({**task.files, "answer.txt": "42\n"})).reward == 1.0
    wrong = grade(bare, Snapshot.of_files({**task.files, "answer.txt": "41\n"}))
    assert wrong.reward == 0.0 and not wrong.all_passed
    # Docker-only build steps are refused with the line that needs them.
    (folder / "environment" / "Dockerfile").write_text("FROM python:3.12-slim\nRUN apt-get install -y git\n")
    with pytest.raises(NotBuildable, match="apt-get install -y git.*only build step flywheel runs is `pip install`"):
        import_task(folder)
