"""Dependency environments: a task's requirements, built once into a read-only prefix that every
jail of that task sees at `/env`.

    spec = EnvSpec(requirements=("pytest==9.2.0",))
    env = build(spec)                  # `flywheel env build pytest==9.2.0`: once, with progress
    env = locate(spec)                 # later, on the hot path: a lookup, never a build
    Sandbox.create(files, environment=env.path)   # /env/site on PYTHONPATH, /env/site/bin on PATH

A spec is a sorted set of pip requirement lines (wheels or sdists from the package index, or the
lines of a lock file) plus the interpreter's cache tag; its content hash names the prefix, so equal
specs share one copy (1,000 sandboxes of a repository bind the same folder) and a changed lock file
is a new environment. `build` runs `pip install --target <tmp>/site` with the host's interpreter
(the same one the jail runs), compiles every module to bytecode, rewrites console-script shebangs
to `/usr/bin/env python3` (the host venv's path does not exist in the jail), makes the tree
read-only and renames it into place in one step, so a prefix in the cache is always complete.

Bytecode: the jail sets PYTHONDONTWRITEBYTECODE (a same-size edit within a second must not be
tested as old code), so without precompiled files every run recompiles pytest and its plugins.
`build` writes unchecked-hash .pyc files (PEP 552): the prefix never changes after the build, so
they need no stat of their source, and they record /env paths for tracebacks. Measured with
`bench/repos.py` (toolz's suite in a jail): see docs/real-repos.md.

The cache: $FLYWHEEL_ENV_CACHE, else /var/cache/flywheel/envs as root (bwrap resolves bind sources
as the sandbox user after setpriv, who cannot pass through /root), else ~/.cache/flywheel/envs.

What it does not protect against: the environment's own code runs in the jail with the tested
code (pytest plugins included); it is read-only and shared, so a run cannot change it for the next
one, but nothing checks what a requirement does at import. Building runs pip on the host, outside
any jail: build only requirements you would install in your own shell.
"""

from __future__ import annotations

import compileall
import hashlib
import json
import os
import py_compile
import shutil
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from pydantic import BaseModel, ConfigDict, field_validator

from flywheel.env.task import Task

CACHE_ENV = "FLYWHEEL_ENV_CACHE"
JAIL_PREFIX = "/env"  # where an environment appears inside the jail
SITE = "site"  # the folder of the prefix that holds the packages (`pip install --target`)
SPEC_FILE = "spec.json"
LAYOUT = 1  # bump when the prefix's layout changes: it is part of every key


class EnvironmentMissing(LookupError):
    """A task's environment has not been built; the message gives the command that builds it."""


class EnvSpec(BaseModel):
    """What an environment holds: pip requirement lines, order and duplicates ignored."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    requirements: tuple[str, ...]

    @field_validator("requirements")
    @classmethod
    def _normalized(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        lines = sorted({line.strip() for line in value if line.strip() and not line.strip().startswith("#")})
        for line in lines:
            if line.startswith("-") and not line.startswith(("--hash", "-e")):
                raise ValueError(f"requirement {line!r} is a pip option; give requirement lines only")
        if not lines:
            raise ValueError("an environment needs at least one requirement, e.g. 'pytest==9.2.0'")
        return tuple(lines)

    @classmethod
    def from_lock_file(cls, path: Path) -> EnvSpec:
        """The requirement lines of a pip lock / requirements file (comments and blanks dropped)."""
        return cls(requirements=tuple(path.read_text().splitlines()))

    def key(self) -> str:
        body = json.dumps({"requirements": self.requirements, "python": sys.implementation.cache_tag,
                           "layout": LAYOUT})
        return hashlib.sha256(body.encode()).hexdigest()[:16]


@dataclass(frozen=True)
class BuiltEnv:
    spec: EnvSpec
    path: Path  # the read-only prefix on the host; the jail sees it at JAIL_PREFIX

    @property
    def site(self) -> Path:
        return self.path / SITE


def cache_dir() -> Path:
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV])
    if os.geteuid() == 0:
        return Path("/var/cache/flywheel/envs")
    return Path.home() / ".cache" / "flywheel" / "envs"


def locate(spec: EnvSpec, cache: Path | None = None) -> BuiltEnv:
    """The built environment of `spec`; never builds (building is explicit and slow)."""
    path = (cache or cache_dir()) / spec.key()
    if not (path / SPEC_FILE).is_file():
        reqs = " ".join(f"'{r}'" for r in spec.requirements)
        raise EnvironmentMissing(f"environment {spec.key()} is not built in {path.parent}; "
                                 f"build it once with: flywheel env build {reqs}")
    return BuiltEnv(spec, path)


def build(spec: EnvSpec, cache: Path | None = None, progress: Callable[[str], None] = print,
          pip_args: tuple[str, ...] = ()) -> BuiltEnv:
    """Build `spec` into the cache unless it is there; returns it either way. Safe to race: the
    prefix appears by one rename, and a loser of the race drops its copy."""
    cache = cache or cache_dir()
    try:
        return locate(spec, cache)
    except EnvironmentMissing:
        pass
    cache.mkdir(parents=True, exist_ok=True)
    os.chmod(cache, 0o755)  # the sandbox user must pass through to bind it
    started = time.perf_counter()
    staging = Path(tempfile.mkdtemp(prefix=f".building-{spec.key()}-", dir=cache))
    try:
        progress(f"[1/3] pip install {len(spec.requirements)} requirement(s) into {staging.name}")
        requirements = staging / "requirements.txt"
        requirements.write_text("".join(line + "\n" for line in spec.requirements))
        pip = [sys.executable, "-m", "pip", "install", "--no-compile", "--disable-pip-version-check",
               "--target", str(staging / SITE), "-r", str(requirements), *pip_args]
        with subprocess.Popen(pip, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as proc:
            assert proc.stdout is not None
            log = []
            for line in proc.stdout:
                log.append(line)
                if line.startswith(("Collecting", "Downloading", "Installing", "Successfully")):
                    progress("      " + line.rstrip())
        if proc.returncode != 0:
            raise RuntimeError(f"pip failed to build environment {spec.key()} (exit {proc.returncode}):\n"
                               + "".join(log[-30:]))
        progress("[2/3] compiling bytecode")
        compiled = compile_prefix(staging / SITE)
        fix_shebangs(staging / SITE / "bin")
        (staging / SPEC_FILE).write_text(json.dumps({"key": spec.key(), "requirements": spec.requirements,
                                                     "python": sys.implementation.cache_tag}, indent=1) + "\n")
        make_read_only(staging)
        target = cache / spec.key()
        progress(f"[3/3] publishing {target} ({compiled} modules compiled, {time.perf_counter() - started:.1f} s)")
        try:
            staging.rename(target)
        except OSError:  # another process published it first (ENOTEMPTY / EEXIST)
            if not (target / SPEC_FILE).is_file():
                raise
    finally:
        if staging.exists():
            remove_tree(staging)
    return locate(spec, cache)


def compile_prefix(site: Path) -> int:
    """Unchecked-hash .pyc for every module under `site`, recording /env paths; the count compiled."""
    # A False result means some file is not valid Python of this version (templates, py2 leftovers
    # some packages ship); those stay uncompiled, as they would in the developer's own install.
    compileall.compile_dir(str(site), quiet=2, ddir=f"{JAIL_PREFIX}/{SITE}", workers=0,
                           invalidation_mode=py_compile.PycInvalidationMode.UNCHECKED_HASH)
    return sum(1 for _ in site.rglob("*.pyc"))


def fix_shebangs(bin_dir: Path) -> None:
    """Console scripts name the host interpreter; in the jail they run under `python3` on PATH."""
    if not bin_dir.is_dir():
        return
    for script in bin_dir.iterdir():
        if not script.is_file():
            continue
        data = script.read_bytes()
        if data.startswith(b"#!") and b"python" in data.split(b"\n", 1)[0]:
            script.write_bytes(b"#!/usr/bin/env python3\n" + data.split(b"\n", 1)[1])


def make_read_only(root: Path) -> None:
    """Everyone may read (the sandbox user binds it), nobody may write, not even its owner by accident."""
    for dirpath, dirnames, filenames in os.walk(root):
        for name in filenames:
            path = Path(dirpath, name)
            if path.is_symlink():
                continue
            executable = path.stat().st_mode & stat.S_IXUSR
            path.chmod(0o555 if executable else 0o444)
        for name in dirnames:
            Path(dirpath, name).chmod(0o555)
    root.chmod(0o555)


def remove_tree(root: Path) -> None:
    """Delete a read-only prefix (or a failed build): folders are opened up first."""
    for dirpath, dirnames, _ in os.walk(root):
        for name in dirnames:
            Path(dirpath, name).chmod(0o755)
    root.chmod(0o755)
    shutil.rmtree(root)


def task_environment(task: Task, cache: Path | None = None) -> Path | None:
    """The built prefix a task's jails bind (None: it needs none); EnvironmentMissing says how to build it."""
    if not task.environment:
        return None
    return locate(EnvSpec(requirements=task.environment), cache).path


def built_environments(cache: Path | None = None) -> list[BuiltEnv]:
    """Every complete environment in the cache (staging folders of builds in progress are not)."""
    cache = cache or cache_dir()
    found = []
    for entry in sorted(cache.iterdir()) if cache.is_dir() else []:
        spec_file = entry / SPEC_FILE
        if not entry.name.startswith(".") and spec_file.is_file():
            found.append(BuiltEnv(EnvSpec(requirements=tuple(json.loads(spec_file.read_text())["requirements"])),
                                  entry))
    return found
