"""Harbor task directories out and in: the format SkyRL, TRL, verifiers and NeMo Gym read.

    flywheel tasks export --family bugfix --n 20 --format harbor --out tasks/   # one folder per task
    flywheel tasks import tasks/some-task [--out tasks.jsonl]                     # Harbor -> Task records

A Harbor task is a folder (Harbor's `harbor.models.task.Task` reads it):

    instruction.md        what the agent is asked
    task.toml             limits and metadata (schema 1.4)
    environment/          Dockerfile (+ the files it copies): the container the agent works in
    tests/test.sh         run after the agent, from the working folder; writes /logs/verifier/reward.txt
    solution/solve.sh     optional: the reference solution

Out (`export_task`): any Task, the mined real-repository ones and SWE-bench instances included.
The environment is `python:3.X-slim` (this interpreter's version) with the workspace at /app and,
for a task with a dependency environment, its requirements pip-installed into /env/site (where
flywheel's jails bind it). The tests folder holds the hidden tests, the pristine runner and
`verify.py` (flywheel/env/harbor_verifier.py): flywheel's grading, done in the container after the
agent finished, writing flywheel's reward to reward.txt. The solution applies the reference edits.

In (`import_task`): a Harbor task whose environment flywheel can build without Docker: a
`python:*` base image and nothing but WORKDIR, COPY of files in environment/, ENV, and `pip install`
(packages or `-r FILE`) as build steps; the copied files become the workspace, the pip requirements
its dependency environment (`flywheel env build`). Anything else is refused with the line that
needs Docker. The task's tests/ are its hidden tests: copied into the grading jail only after the
agent finished, at /workspace/.harbor/tests, and `grade_harbor` runs its test.sh there and reads
the reward file it wrote.

Departures from Harbor, for the jail: the paths test.sh names are rewritten to where the jail has
them (`/tests` -> /workspace/.harbor/tests, `/logs/verifier` -> /workspace/.harbor/logs/verifier,
the Dockerfile's WORKDIR -> /workspace), in every text file of tests/; the jail has no network, so
a test.sh that installs its tools at verification time fails (give them as the environment's pip
requirements instead). What it does not protect against: an imported task's test.sh runs the
agent's code with the verifier's own rights, as in Harbor's container, so its reward is only as
unforgeable as the task's tests make it (flywheel's own families, exported, keep their supervisor).
"""

from __future__ import annotations

import hashlib
import json
import re
import shlex
import sys
import tomllib
from pathlib import Path

from flywheel.env.grading import (
    PYTEST_CONTROL_FILES,
    PYTEST_RUNNER_PATH,
    RUNNER_PATH,
    RUNNER_SOURCE,
    Grade,
    GradeConfig,
    hidden_test_ids,
    pytest_files,
)
from flywheel.env.outcome import TestOutcome
from flywheel.env.sandbox import ENV_MOUNT, Sandbox, SandboxConfig, Snapshot
from flywheel.env.task import Task, TaskMetadata, split_of

HARBOR_FAMILY = "harbor"
HARBOR_DIR = ".harbor"  # in the grading workspace: the task's tests and the verifier's logs
JAIL_TESTS = f"/workspace/{HARBOR_DIR}/tests"
JAIL_LOGS = f"/workspace/{HARBOR_DIR}/logs/verifier"
WORKDIR = "/app"  # the exported container's working folder
VERIFIER_SOURCE = (Path(__file__).parent / "harbor_verifier.py").read_text()

TEST_SH = """#!/bin/bash
# flywheel's grading (tests/verify.py), run from the working folder after the agent finished.
mkdir -p /logs/verifier
python3 /tests/verify.py --tests /tests --logs /logs/verifier
"""


# ---- out


def export_task(task: Task, out: Path, config: GradeConfig | None = None) -> Path:
    """Write `task` as a Harbor task folder `out/<folder_name(task)>`; returns the folder."""
    config = config or GradeConfig()
    root = out / folder_name(task)
    if root.exists():
        raise ValueError(f"{root} exists: export into an empty folder, or remove it first")
    _write(root / "instruction.md", task.instruction + ("\n" if not task.instruction.endswith("\n") else ""))
    _write(root / "task.toml", _task_toml(task, config))
    env = root / "environment"
    for path, text in task.files.items():
        _write(env / "workspace" / path, text)
    lines = [f"FROM python:{sys.version_info.major}.{sys.version_info.minor}-slim", f"WORKDIR {WORKDIR}"]
    if task.environment:
        _write(env / "requirements.txt", "\n".join(task.environment) + "\n")
        lines += ["COPY requirements.txt /tmp/requirements.txt",
                  f"RUN pip install --no-cache-dir --target {ENV_MOUNT}/site -r /tmp/requirements.txt",
                  f"ENV PYTHONPATH={ENV_MOUNT}/site PATH={ENV_MOUNT}/site/bin:$PATH"]
    lines.append(f"COPY workspace/ {WORKDIR}/")
    _write(env / "Dockerfile", "\n".join(lines) + "\n")
    tests = root / "tests"
    _write(tests / "test.sh", TEST_SH, executable=True)
    _write(tests / "verify.py", VERIFIER_SOURCE)
    _write(tests / "run_tests.py", RUNNER_SOURCE)
    for path, text in task.hidden_tests.items():
        _write(tests / "hidden" / path, text)
    if task.graded_by_pytest:
        for path, text in task.files.items():
            if path.rsplit("/", 1)[-1] in PYTEST_CONTROL_FILES:
                _write(tests / "control" / path, text)
    expected = {e.path for e in task.reference_edits}
    protected = {p: hashlib.sha256(task.files[p].encode()).hexdigest()
                 for p in task.visible_test_paths() if p not in expected}
    _write(tests / "grading.json", json.dumps({
        "pytest": task.graded_by_pytest, "runner": PYTEST_RUNNER_PATH if task.graded_by_pytest else RUNNER_PATH,
        "files": pytest_files(task) if task.graded_by_pytest else sorted(task.hidden_tests),
        "ids": hidden_test_ids(task), "site": f"{ENV_MOUNT}/site", "control_files": sorted(PYTEST_CONTROL_FILES),
        "protected": protected, "timeout_s": config.timeout_s,
        "weights": {"pass_frac_weight": config.pass_frac_weight, "all_passed_weight": config.all_passed_weight,
                    "visible_tests_penalty": config.visible_tests_penalty}}, indent=1))
    if task.reference_edits:
        edits = json.dumps([e.model_dump() for e in task.reference_edits])
        _write(root / "solution" / "solve.sh", (
            "#!/bin/bash\n# The reference solution: its edits, applied in the working folder.\n"
            "python3 - <<'FLYWHEEL_EDITS'\nimport json, pathlib\n"
            f"for edit in json.loads({edits!r}):\n"
            "    path = pathlib.Path(edit['path'])\n"
            "    path.parent.mkdir(parents=True, exist_ok=True)\n"
            "    text = path.read_text() if edit['old'] else ''\n"
            "    path.write_text(text.replace(edit['old'], edit['new'], 1) if edit['old'] else edit['new'])\n"
            "FLYWHEEL_EDITS\n"), executable=True)
    return root


def folder_name(task: Task) -> str:
    """A task's folder name: its id with the characters a path or Harbor's names refuse as `-`
    ("bugfix/train/s3/d1/0" -> "bugfix-train-s3-d1-0"); task.toml keeps the id itself."""
    return re.sub(r"[^A-Za-z0-9._-]+", "-", task.id).strip("-.")


def _task_toml(task: Task, config: GradeConfig) -> str:
    metadata = {"flywheel_id": task.id, "family": task.family, "split": task.split,
                "difficulty": task.metadata.difficulty, "content_key": task.content_key()}
    rows = "\n".join(f"{k} = {json.dumps(v)}" for k, v in metadata.items())
    return (f'schema_version = "1.4"\n\n[metadata]\n{rows}\n\n[verifier]\ntimeout_sec = {config.timeout_s + 60:.1f}\n\n'
            "[agent]\ntimeout_sec = 900.0\n\n[environment]\nbuild_timeout_sec = 600.0\n")


def _write(path: Path, text: str, executable: bool = False) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    if executable:
        path.chmod(0o755)


# ---- in


class NotBuildable(ValueError):
    """A Harbor task whose environment needs Docker (the reason names the line)."""


def import_task(folder: Path) -> Task:
    """The Task of the Harbor task folder `folder`; NotBuildable when its environment needs Docker."""
    folder = Path(folder)
    config_path = folder / "task.toml"
    if not config_path.is_file() or not (folder / "instruction.md").is_file():
        raise ValueError(f"{folder} is no Harbor task: it needs task.toml and instruction.md")
    config = tomllib.loads(config_path.read_text())
    if config.get("steps"):
        raise NotBuildable(f"{folder}: a multi-step task ([[steps]]); flywheel imports single-step tasks")
    if config.get("environment", {}).get("docker_image"):
        raise NotBuildable(f"{folder}: environment.docker_image = {config['environment']['docker_image']!r} is a "
                           "prebuilt image; flywheel builds only a python:* base plus pip requirements")
    workdir, files, requirements = _read_environment(folder / "environment")
    tests = folder / "tests"
    if not (tests / "test.sh").is_file():
        raise ValueError(f"{folder}: no tests/test.sh (flywheel grades with the task's own test.sh)")
    hidden = {f"{HARBOR_DIR}/tests/{rel}": text for rel, text in _text_files(tests, "tests").items()}
    metadata = config.get("metadata", {})
    difficulty = {"easy": 1, "medium": 2, "hard": 3}.get(str(metadata.get("difficulty", "")).lower(), 1)
    instruction = (folder / "instruction.md").read_text()
    body = json.dumps([instruction, files, hidden, requirements], sort_keys=True)
    key = hashlib.sha256(body.encode()).hexdigest()[:16]
    return Task(id=f"harbor-{folder.name}", family=HARBOR_FAMILY, split=split_of(key), instruction=instruction,
                files=files, hidden_tests=hidden, test_command="bash tests/test.sh  # run by the grader only",
                metadata=TaskMetadata(difficulty=difficulty, extra={"harbor_workdir": workdir}),
                environment=tuple(requirements), grader="harbor")


def _read_environment(env: Path) -> tuple[str, dict[str, str], list[str]]:
    """(working folder, workspace files, pip requirement lines) of a Dockerfile flywheel can build."""
    dockerfile = env / "Dockerfile"
    if not dockerfile.is_file():
        found = ", ".join(sorted(p.name for p in env.iterdir())) if env.is_dir() else "no environment/ folder"
        raise NotBuildable(f"{env}: no Dockerfile ({found}); flywheel builds a python:* Dockerfile only")
    text = re.sub(r"\\\n", " ", dockerfile.read_text())
    workdir, files, requirements, based = "/", {}, [], False
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        op, _, rest = line.partition(" ")
        op, rest = op.upper(), rest.strip()
        if op == "FROM":
            image = rest.split()[0]
            if not re.fullmatch(r"(docker\.io/)?(library/)?python:[0-9.]+(-slim|-bookworm|-slim-bookworm|-bullseye)?",
                                image):
                raise NotBuildable(f"{dockerfile}: FROM {image}: flywheel builds only a python:* base image "
                                   "(its own interpreter, the standard library) plus pip requirements")
            based = True
        elif op == "WORKDIR":
            workdir = rest if rest.startswith("/") else f"{workdir.rstrip('/')}/{rest}"
        elif op == "ENV":
            continue  # the jail sets its own environment; PYTHONPATH and PATH already reach /env/site
        elif op in ("COPY", "ADD"):
            args = shlex.split(rest)
            if any(a.startswith("--") for a in args) or len(args) < 2 or "://" in rest:
                raise NotBuildable(f"{dockerfile}: `{line}`: flywheel copies plain files of environment/ only")
            *sources, target = args
            for source in sources:
                files.update(_copied(env, source, target, workdir, dockerfile))
        elif op == "RUN":
            requirements += _pip_requirements(env, rest, dockerfile, line)
        else:
            raise NotBuildable(f"{dockerfile}: `{line}`: flywheel builds FROM python, WORKDIR, ENV, COPY and "
                               "RUN pip install only")
    if not based:
        raise NotBuildable(f"{dockerfile}: no FROM line")
    return workdir, files, requirements


def _copied(env: Path, source: str, target: str, workdir: str, dockerfile: Path) -> dict[str, str]:
    """The workspace files a COPY of `source` to `target` makes (paths relative to the workdir)."""
    if source.endswith("requirements.txt") and target.startswith("/tmp"):
        return {}  # copied for pip only
    path = (env / source).resolve()
    if not path.is_relative_to(env.resolve()) or not path.exists():
        raise NotBuildable(f"{dockerfile}: COPY {source}: not a file or folder of environment/")
    absolute = target if target.startswith("/") else f"{workdir.rstrip('/')}/{target}"
    if absolute.rstrip("/") != workdir.rstrip("/") and not absolute.startswith(workdir.rstrip("/") + "/"):
        raise NotBuildable(f"{dockerfile}: COPY to {target}, outside the working folder {workdir}: the jail has "
                           "only its workspace")
    base = absolute[len(workdir.rstrip("/")):].strip("/")
    if path.is_file():
        name = base if base and not target.endswith("/") else "/".join(p for p in (base, path.name) if p)
        return {name: _text(path, dockerfile)}
    return {"/".join(p for p in (base, rel) if p): text for rel, text in _text_files(path, str(dockerfile)).items()}


def _pip_requirements(env: Path, command: str, dockerfile: Path, line: str) -> list[str]:
    """The requirement lines of a `pip install` RUN step; NotBuildable for any other command."""
    words = shlex.split(command)
    while words[:1] and words[0] in ("python", "python3", "-m"):
        words = words[1:]
    if words[:2] not in (["pip", "install"], ["pip3", "install"]) or any(w in ("&&", ";", "|") for w in words):
        raise NotBuildable(f"{dockerfile}: `{line}`: the only build step flywheel runs is `pip install` "
                           "(no apt-get, no shell commands)")
    found, i = [], 2
    while i < len(words):
        word = words[i]
        if word in ("-r", "--requirement"):
            name = Path(words[i + 1]).name
            candidates = [p for p in env.rglob(name) if p.is_file()]
            if not candidates:
                raise NotBuildable(f"{dockerfile}: `{line}`: {words[i + 1]} is not in environment/")
            found += [ln.strip() for ln in candidates[0].read_text().splitlines()
                      if ln.strip() and not ln.strip().startswith("#")]
            i += 2
        elif word in ("--target", "-t", "--index-url", "-i", "--prefix"):
            i += 2
        elif word.startswith("-"):
            i += 1  # --no-cache-dir, -q, --upgrade, --system ...
        else:
            found.append(word)
            i += 1
    return found


def _text_files(root: Path, what: str) -> dict[str, str]:
    return {p.relative_to(root).as_posix(): _text(p, what) for p in sorted(root.rglob("*")) if p.is_file()
            and "__pycache__" not in p.parts}


def _text(path: Path, what: str) -> str:
    try:
        return path.read_text()
    except UnicodeDecodeError:
        raise NotBuildable(f"{what}: {path.name} is not text; flywheel's workspaces hold text files") from None


# ---- grading an imported task


def jail_paths(text: str, workdir: str) -> str:
    """`text` with the paths Harbor's container has rewritten to where the grading jail has them."""
    text = re.sub(r"(?<![\w./-])/logs/verifier(?![\w-])", JAIL_LOGS, text)
    text = re.sub(r"(?<![\w./-])/tests(?![\w-])", JAIL_TESTS, text)
    if workdir not in ("/", "/workspace"):
        text = re.sub(rf"(?<![\w./-]){re.escape(workdir.rstrip('/'))}(?![\w-])", "/workspace", text)
    return text


def grade_harbor(task: Task, final: Snapshot, config: GradeConfig,
                 sandbox_config: SandboxConfig | None = None, environment: Path | None = None) -> Grade:
    """Run the task's tests/test.sh in a fresh jail over the final workspace (its tests copied in
    now, anything the agent left under .harbor/ removed) and read the reward file it wrote:
    reward.txt (a number) or reward.json (its "reward", else the mean of its values)."""
    workdir = str(task.metadata.extra.get("harbor_workdir", "/"))
    files = {p: b for p, b in final.files.items() if not p.startswith(HARBOR_DIR + "/")}
    files.update({p: jail_paths(t, workdir).encode() for p, t in task.hidden_tests.items()})
    with Sandbox.create(files, sandbox_config, environment=environment) as box:
        run = box.run(f"mkdir -p {JAIL_LOGS} && cd /workspace && bash {JAIL_TESTS}/test.sh",
                      timeout_s=config.timeout_s)
        reward, found = _reward(box)
    ok = found and not run.timed_out
    value = reward if ok else 0.0
    return Grade(reward=value, parts={"harbor_reward": value},
                 outcome=TestOutcome(tests_passed_frac=min(max(value, 0.0), 1.0), all_passed=ok and value >= 1.0,
                                     timed_out=run.timed_out, visible_tests_modified=False),
                 passed=int(ok and value >= 1.0), failed=int(not (ok and value >= 1.0)), tests={},
                 log="" if ok else run.render()[-2000:])


def _reward(box: Sandbox) -> tuple[float, bool]:
    for name in ("reward.txt", "reward.json"):
        try:
            text = box.read_text(f"{HARBOR_DIR}/logs/verifier/{name}")
        except (OSError, ValueError):
            continue
        try:
            if name == "reward.txt":
                return float(text.strip()), True
            data = json.loads(text)
            values = data if isinstance(data, dict) else {"reward": data}
            if "reward" in values:
                return float(values["reward"]), True
            return sum(float(v) for v in values.values()) / len(values), True
        except (ValueError, TypeError, ZeroDivisionError):
            return 0.0, False
    return 0.0, False


__all__ = ["HARBOR_FAMILY", "NotBuildable", "export_task", "folder_name", "grade_harbor", "import_task", "jail_paths"]
