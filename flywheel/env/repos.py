"""Real repositories as task workspaces: snapshots from sdists or local git repositories, and a
repository's own pytest suite run outside any jail (the reference the sandboxed grader must equal).

    files = sdist_files(Path(".cache/pypi/toolz-1.0.0.tar.gz"))     # {path: text}, top folder dropped
    files = git_snapshot(Path("~/src/project"), "abc123")            # the tree at one commit, no history
    outcomes = pytest_outside(files, env, ["toolz/tests"])           # {nodeid: "passed" | "failed" | ...}

A snapshot is the files of one tree and nothing else: no `.git`, so `git log` inside the jail
cannot show the commits after the base that hold the fix (a known SWE-bench hack). Binary files
and files over `MAX_FILE_BYTES` are left out (the workspace holds text the tools can read); the
suites this module is used on do not need them.

`pytest_outside` runs `python -m pytest` in a temporary copy with the environment's packages on
PYTHONPATH and the same flags the grader uses (`--rootdir` the copy, no cache provider), reading
per-test outcomes from a plugin object rather than from the output, so its node ids are the ones
the grader proves inside the jail.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from collections.abc import Mapping, Sequence
from pathlib import Path

from flywheel.env.environments import BuiltEnv, EnvSpec, cache_dir

# The environment real-repository tasks run under unless they name their own: pytest and its deps.
PYTEST_ENV = EnvSpec(requirements=("pytest==9.2.0",))

MAX_FILE_BYTES = 512 * 1024
SKIPPED_DIRS = {".git", ".hg", "__pycache__", ".pytest_cache", ".tox", ".eggs"}


def _keep(path: str, data: bytes) -> bool:
    parts = path.split("/")
    if any(p in SKIPPED_DIRS for p in parts) or path.endswith((".pyc", ".pyo", ".so")):
        return False
    if len(data) > MAX_FILE_BYTES or b"\0" in data:
        return False
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def sdist_files(path: Path) -> dict[str, str]:
    """The text files of an sdist (.tar.gz or .zip), paths relative to its top folder."""
    files: dict[str, str] = {}
    if path.suffix == ".zip":
        with zipfile.ZipFile(path) as archive:
            members = [(m.filename, archive.read(m)) for m in archive.infolist() if not m.is_dir()]
    else:
        with tarfile.open(path) as archive:
            members = []
            for m in archive.getmembers():
                handle = archive.extractfile(m) if m.isfile() else None
                if handle is not None:
                    members.append((m.name, handle.read()))
    for name, data in members:
        top, _, rel = name.partition("/")
        if rel and _keep(rel, data):
            files[rel] = data.decode("utf-8")
    if not files:
        raise ValueError(f"{path} holds no text files under a top folder; is it an sdist?")
    return dict(sorted(files.items()))


def fetch_sdist(name: str, version: str, folder: Path | None = None) -> Path:
    """The sdist of `name==version` from the package index, downloaded once into `folder`
    (default: `sdists/` beside the environment cache)."""
    folder = folder or cache_dir().parent / "sdists"
    folder.mkdir(parents=True, exist_ok=True)
    for suffix in (".tar.gz", ".zip"):
        for stem in (name, name.replace("-", "_"), name.lower()):
            found = folder / f"{stem}-{version}{suffix}"
            if found.is_file():
                return found
    run = subprocess.run([sys.executable, "-m", "pip", "download", "--no-binary", ":all:", "--no-deps",
                          "--disable-pip-version-check", "-q", "-d", str(folder), f"{name}=={version}"],
                         capture_output=True, text=True, check=False)
    if run.returncode != 0:
        raise RuntimeError(f"cannot download the sdist of {name}=={version}: {run.stderr.strip()[-500:]}")
    return fetch_sdist(name, version, folder)


def git_snapshot(repo: Path, commit: str) -> dict[str, str]:
    """The text files of `repo`'s tree at `commit`: no history, so no later commit is visible."""
    listing = subprocess.run(["git", "-C", str(repo), "ls-tree", "-r", "-z", "--name-only", commit],
                             capture_output=True, check=False)
    if listing.returncode != 0:
        raise ValueError(f"cannot list {commit!r} in {repo}: {listing.stderr.decode().strip()}; "
                         "give a commit of that repository")
    files: dict[str, str] = {}
    for name in filter(None, listing.stdout.decode().split("\0")):
        data = subprocess.run(["git", "-C", str(repo), "show", f"{commit}:{name}"], capture_output=True,
                              check=True).stdout
        if _keep(name, data):
            files[name] = data.decode("utf-8")
    return dict(sorted(files.items()))


def write_tree(root: Path, files: Mapping[str, str | bytes]) -> None:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(text.encode() if isinstance(text, str) else text)


# Runs in the host's base interpreter with -S (no site-packages but the environment's, as in the
# jail): pytest.main with a plugin object recording each test as the grader counts it: "passed" when
# its call passed and no phase failed, "failed" when a phase failed, else "skipped" (xfail included).
_OUTSIDE = r"""
import json, site, sys
root, env_site, out = sys.argv[1:4]
sys.path[:0] = [root, env_site]
site.addsitedir(env_site)
import pytest

class Outcomes:
    def __init__(self):
        self.failed, self.called, self.seen = set(), set(), {}
    def pytest_runtest_logreport(self, report):
        self.seen.setdefault(report.nodeid, None)
        if report.outcome != "passed":
            self.failed.add(report.nodeid) if report.outcome == "failed" else None
        elif report.when == "call":
            self.called.add(report.nodeid)

plugin = Outcomes()
code = pytest.main(sys.argv[4:], plugins=[plugin])
tests = {t: "failed" if t in plugin.failed else "passed" if t in plugin.called else "skipped" for t in plugin.seen}
with open(out, "w") as f:
    json.dump({"exit": int(code), "tests": tests}, f)
"""


def pytest_outside(files: Mapping[str, str | bytes], env: BuiltEnv, args: Sequence[str],
                   timeout_s: float = 300.0, cpu_limit_s: int | None = None) -> dict[str, str]:
    """Per-test outcomes of pytest over `files` on the host, with `env`'s packages only:
    {nodeid: "passed" | "failed" | "skipped"}. `cpu_limit_s` (RLIMIT_CPU) stops a run that hangs
    in a loop whatever the host's load, where a wall-clock limit would also stop slow ones."""
    with tempfile.TemporaryDirectory(prefix="flywheel-pytest-") as tmp:
        root = Path(tmp) / "workspace"
        write_tree(root, files)
        out = Path(tmp) / "outcomes.json"
        env_vars = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "PYTHONDONTWRITEBYTECODE": "1",
                    "LANG": "C.UTF-8", "HOME": tmp}
        argv = [base_python(), "-S", "-c", _OUTSIDE, str(root), str(env.site), str(out),
                "--rootdir", str(root), "-p", "no:cacheprovider", "-q", *args]
        if cpu_limit_s is not None:  # set by the shell, not preexec_fn: validation runs in threads
            argv = ["/bin/sh", "-c", f'ulimit -t {int(cpu_limit_s)} && exec "$0" "$@"', *argv]
        run = subprocess.run(
            argv,
            cwd=root, env=env_vars, capture_output=True, text=True, timeout=timeout_s, check=False)
        if not out.is_file():
            raise RuntimeError(f"pytest wrote no outcomes (exit {run.returncode}):\n{run.stdout[-2000:]}"
                               f"{run.stderr[-2000:]}")
        return json.loads(out.read_text())["tests"]


def base_python() -> str:
    """The interpreter the jail runs (the venv's base), not the venv with the host's packages."""
    return getattr(sys, "_base_executable", None) or sys.executable
