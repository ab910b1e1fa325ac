"""Fixtures for sandbox and pool tests: a private root dir per test session, and leak probes."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from flywheel.env.sandbox import INTERPRETER_DIR, SandboxConfig, is_mount_point, unmount


@pytest.fixture(scope="session")
def sandbox_root() -> Path:
    # Not under pytest's tmp_path: bwrap runs as uid 65534 and must be able to reach the workspace,
    # and /tmp/pytest-of-root is 0700.
    root = Path(f"/tmp/flywheel-test-sandboxes-{os.getpid()}")
    yield root
    staged = root / INTERPRETER_DIR
    while is_mount_point(staged):
        unmount(staged)
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def config(sandbox_root: Path) -> SandboxConfig:
    return SandboxConfig(root_dir=sandbox_root, wall_time_s=5.0, cpu_time_s=5, memory_mb=512)


def device_of(path: Path) -> str:
    st = os.stat(path)
    return f"{os.major(st.st_dev)}:{os.minor(st.st_dev)}"


def jail_pids(device: str) -> list[int]:
    """Host pids of processes that have the workspace with this device mounted at /workspace."""
    pids = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X"):
                    continue  # already dead, waiting to be reaped: holds no resources
            with open(f"/proc/{name}/mountinfo") as f:
                if any(line.split(" ")[2] == device and line.split(" ")[4] == "/workspace" for line in f):
                    pids.append(int(name))
        except OSError:
            continue
    return pids


def pids_running(needle: str) -> list[int]:
    """Host pids whose command line contains `needle`."""
    pids = []
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == os.getpid():
            continue
        try:
            with open(f"/proc/{name}/cmdline", "rb") as f:
                if needle.encode() in f.read().replace(b"\0", b" "):
                    pids.append(int(name))
        except OSError:
            continue
    return pids


def is_mounted(path: Path) -> bool:
    with open("/proc/self/mounts") as f:
        return any(line.split(" ")[1] == str(path) for line in f)


class Probes:
    """Host-side leak checks, as a fixture so test files need not import conftest."""

    device_of = staticmethod(device_of)
    jail_pids = staticmethod(jail_pids)
    pids_running = staticmethod(pids_running)
    is_mounted = staticmethod(is_mounted)


@pytest.fixture
def probes() -> type[Probes]:
    return Probes
