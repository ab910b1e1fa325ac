"""A thread-safe pool of sandboxes for rollout workers: bounded, fair, and self-cleaning.

    worker threads ──acquire(files)──> [FIFO queue] ──slot free──> warm workspace (or a new one)
                                            ^                          │ files written
                                            │                          v
                      release / lifetime reap ◄────────────── Sandbox in use

- At most `max_active` sandboxes are out at once; more callers wait in arrival order, and a
  waiter that runs out of time gets a TimeoutError that says how to fix it.
- `warm` empty workspaces are kept mounted so a burst of acquires only writes files.
  Released sandboxes are destroyed, never reused, so no state leaks from one episode to the next;
  the releasing thread tops the warm set back up.
- An acquired sandbox held longer than `max_lifetime_s` is reaped (its command killed, workspace
  removed) the next time the pool is used, so a crashed worker cannot starve the others.
- On start the pool reaps what dead processes left under the root directory (`reap_orphans`).
"""

from __future__ import annotations

import fcntl
import os
import re
import shutil
import signal
import threading
import time
from collections import deque
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from flywheel.env.sandbox import SCRATCH_SUFFIX, WORKSPACE, Sandbox, SandboxConfig, unmount

_OWNED_NAME = re.compile(rf"^(\d+)-\d+-[0-9a-f]+({re.escape(SCRATCH_SUFFIX)})?$")


class PoolConfig(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")
    # Sandboxes out at once. Each holds up to sandbox.disk_mb of memory (tmpfs), so this times
    # disk_mb must fit in RAM; higher serves more concurrent rollouts.
    max_active: int = Field(64, ge=1)
    # Empty workspaces kept ready for bursts: acquire gets faster, at the cost of idle mounts.
    warm: int = Field(4, ge=0)
    # An acquired sandbox older than this is reaped; longer than any sane episode, short enough
    # that a leaked sandbox does not hold its slot for long.
    max_lifetime_s: float = Field(900.0, gt=0)
    sandbox: SandboxConfig = SandboxConfig()


class SandboxPool:
    def __init__(self, config: PoolConfig | None = None) -> None:
        self.config = config or PoolConfig()
        self._cond = threading.Condition()
        self._queue: deque[object] = deque()  # one ticket per waiting acquire, in arrival order
        self._active: dict[int, tuple[Sandbox, float]] = {}  # id(sandbox) -> (sandbox, acquired at)
        self._starting = 0  # slots granted whose sandbox is still being made
        self._warm: list[Sandbox] = []
        self._closed = False
        self._created = 0
        self._reaped = reap_orphans(self.config.sandbox.resolved_root())
        self._latencies_ms: deque[float] = deque(maxlen=10_000)
        self._refill_warm()

    def acquire(
        self, files: Mapping[str, str | bytes] | None = None, timeout_s: float | None = None
    ) -> Sandbox:
        """A sandbox holding exactly `files`; waits in FIFO order while `max_active` are out."""
        asked = time.monotonic()
        deadline = None if timeout_s is None else asked + timeout_s
        ticket = object()
        with self._cond:
            self._queue.append(ticket)
            try:
                while True:
                    self._check_open()
                    self._reap_expired()
                    if (
                        self._queue[0] is ticket
                        and len(self._active) + self._starting < self.config.max_active
                    ):
                        break
                    wait = self._next_expiry() - time.monotonic()
                    if deadline is not None:
                        remaining = deadline - time.monotonic()
                        if remaining <= 0:
                            raise TimeoutError(
                                f"no sandbox free after {timeout_s:.1f} s: all {self.config.max_active} "
                                f"(PoolConfig.max_active) are in use and {self._queue.index(ticket)} callers "
                                "are queued ahead; release sandboxes sooner (use `with pool.sandbox(files)`) "
                                "or raise max_active"
                            )
                        wait = min(wait, remaining)
                    self._cond.wait(max(wait, 0.001))
            finally:
                self._queue.remove(ticket)
                self._cond.notify_all()  # the next in line may now be at the head
            self._starting += 1
            warm = self._warm.pop() if self._warm else None
        granted = time.monotonic()
        try:
            if warm is None:
                sandbox = Sandbox.create(files, self.config.sandbox)
                created = 1
            else:
                sandbox = warm
                created = 0
                if files:
                    sandbox.load(files)
        except BaseException:
            if warm is not None:
                warm.close()
            with self._cond:
                self._starting -= 1
                self._cond.notify_all()
            raise
        with self._cond:
            self._starting -= 1
            self._created += created
            self._active[id(sandbox)] = (sandbox, time.monotonic())
            self._latencies_ms.append((time.monotonic() - granted) * 1000)
        return sandbox

    def release(self, sandbox: Sandbox) -> None:
        """Destroy `sandbox` and free its slot. Releasing a reaped sandbox is a no-op."""
        with self._cond:
            entry = self._active.pop(id(sandbox), None)
            self._cond.notify_all()
        if entry is not None:
            sandbox.close()
            self._refill_warm()

    @contextmanager
    def sandbox(self, files: Mapping[str, str | bytes] | None = None) -> Iterator[Sandbox]:
        sb = self.acquire(files)
        try:
            yield sb
        finally:
            self.release(sb)

    def stats(self) -> dict[str, float | int]:
        with self._cond:
            self._reap_expired()
            lat = sorted(self._latencies_ms)
            return {
                "active": len(self._active) + self._starting,
                "queued": len(self._queue),
                "warm": len(self._warm),
                "created": self._created,
                "reaped": self._reaped,
                "start_latency_ms_p50": _percentile(lat, 0.50),
                "start_latency_ms_p99": _percentile(lat, 0.99),
            }

    def close(self) -> None:
        """Destroy every sandbox, idle or acquired; waiting and later acquires fail."""
        with self._cond:
            self._closed = True
            doomed = [sb for sb, _ in self._active.values()] + self._warm
            self._active.clear()
            self._warm = []
            self._cond.notify_all()
        for sb in doomed:
            sb.close()

    def __enter__(self) -> SandboxPool:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # ---- internals (callers hold self._cond unless said otherwise) -------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("the SandboxPool is closed; create a new pool")

    def _reap_expired(self) -> None:
        now = time.monotonic()
        limit = self.config.max_lifetime_s
        expired = [key for key, (_, t) in self._active.items() if now - t > limit]
        for key in expired:
            sandbox, _ = self._active.pop(key)
            sandbox.close()  # kills its running command, if any; the holder's next run raises
            self._reaped += 1
        if expired:
            self._cond.notify_all()

    def _next_expiry(self) -> float:
        if not self._active:
            return time.monotonic() + 3600
        return min(t for _, t in self._active.values()) + self.config.max_lifetime_s

    def _refill_warm(self) -> None:
        """Top the warm set up to `warm` (called without the lock: creating takes a while)."""
        while True:
            with self._cond:
                if self._closed or len(self._warm) >= self.config.warm:
                    return
            sandbox = Sandbox.create(None, self.config.sandbox)
            with self._cond:
                if self._closed or len(self._warm) >= self.config.warm:
                    extra = sandbox
                else:
                    self._warm.append(sandbox)
                    self._created += 1
                    extra = None
            if extra is not None:
                extra.close()
                return


def _percentile(sorted_values: list[float], q: float) -> float:
    if not sorted_values:
        return 0.0
    return sorted_values[min(len(sorted_values) - 1, int(q * len(sorted_values)))]


def reap_orphans(root: Path) -> int:
    """Remove the workspaces under `root` whose owner process is dead; returns how many.

    For each: kill any process still using it (found through its mount in /proc/*/mountinfo),
    unmount it and delete the directory. Workspaces of live owners are left alone. Pools starting
    at the same time (in one process or several) take turns through a lock file, so two never
    tear down the same workspace at once (the second's unmount failed with EINVAL).
    """
    root = Path(root)
    if not root.is_dir():
        return 0
    with open(root / ".reap.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        return _reap_unlocked(root)


def _reap_unlocked(root: Path) -> int:
    reaped = 0
    for entry in sorted(os.scandir(root), key=lambda e: e.name):
        match = _OWNED_NAME.match(entry.name)
        if match is None or _alive(int(match.group(1))):
            continue
        workspace = Path(entry.path)
        _kill_users_of(workspace)
        while os.path.ismount(workspace):
            unmount(workspace)
        shutil.rmtree(workspace, ignore_errors=True)
        if workspace.exists():
            raise OSError(f"could not remove orphaned workspace {workspace}; remove it by hand (as root)")
        reaped += match.group(2) is None  # a scratch dir (a command's /tmp) is not a workspace
    return reaped


def _is_jail_mount(mountinfo_line: str, device: str) -> bool:
    fields = mountinfo_line.split(" ", 5)  # id, parent, major:minor, root, mount point, ...
    return len(fields) > 4 and fields[2] == device and fields[4] == WORKSPACE


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


def _kill_users_of(workspace: Path) -> None:
    """SIGKILL every jailed process that has `workspace`'s tmpfs mounted at /workspace.

    Host processes see the same tmpfs too, but at its host path, so they are never matched.
    """
    if not os.path.ismount(workspace):
        return  # a plain directory: its jails died with their owner (bwrap --die-with-parent)
    st = os.stat(workspace)
    device = f"{os.major(st.st_dev)}:{os.minor(st.st_dev)}"
    # A jail still being set up when its owner died can mount the workspace after a scan; it dies
    # on its own (bwrap --die-with-parent), but scan again until nobody is left to be sure.
    for _ in range(10):
        victims = [pid for pid in _pids() if _has_jail_mount(pid, device)]
        if not victims:
            return
        for pid in victims:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + 5.0
        while victims and time.monotonic() < deadline:
            victims = [pid for pid in victims if _alive(pid)]
            time.sleep(0.005)
    raise OSError(f"processes keep appearing in orphaned workspace {workspace}; kill them by hand")


def _pids() -> list[int]:
    return [int(p) for p in os.listdir("/proc") if p.isdigit()]


def _has_jail_mount(pid: int, device: str) -> bool:
    try:
        with open(f"/proc/{pid}/mountinfo") as f:
            return any(_is_jail_mount(line, device) for line in f)
    except OSError:
        return False  # exited meanwhile, or not ours to read
