"""Each attack test tries one way out of the sandbox and checks it is contained, with a clear
result for the model, no effect on the host, and the sandbox still usable afterwards."""

from __future__ import annotations

import json
import os
import site
import socket
import sys
import time
import tracemalloc

import pytest

from flywheel.env.sandbox import (
    CommandResult,
    PathEscapeError,
    Sandbox,
    SandboxConfig,
    SandboxError,
    Snapshot,
)


@pytest.fixture
def box(config: SandboxConfig):
    with Sandbox.create({"main.py": "print('hello')\n", "pkg/util.py": "X = 1\n"}, config) as sb:
        yield sb


def assert_usable(sb: Sandbox) -> None:
    result = sb.run("echo still-alive")
    assert result.exit_code == 0 and result.output == "still-alive\n", result.render()


# ---- functional ----------------------------------------------------------------------------------


def test_run_returns_exit_code_and_output(box: Sandbox):
    result = box.run("python3 main.py; echo oops >&2; exit 3")
    assert result == CommandResult(3, "hello\noops\n", False, False, result.duration_s)
    assert result.render() == "hello\noops\n[exit code 3]"


def test_runs_as_nobody_in_workspace_with_clean_env(box: Sandbox):
    out = box.run("id -u; pwd; echo $HOME; env | sort | cut -d= -f1 | tr '\\n' ' '").output.splitlines()
    assert out[:3] == [str(65534 if os.geteuid() == 0 else os.geteuid()), "/workspace", "/workspace"]
    assert set(out[3].split()) <= {
        "HOME",
        "LANG",
        "OLDPWD",
        "PATH",
        "PWD",
        "PYTHONUNBUFFERED",
        "PYTHONDONTWRITEBYTECODE",
        "TMPDIR",
        "SHLVL",
    }


def test_an_edit_right_after_a_run_is_what_the_next_run_imports(box: Sandbox):
    """The same length, the same second: a cached .pyc would still hold the old code."""
    box.write_text("limits.py", "LIMIT = 0\n")
    assert box.run("python3 -c 'import limits; print(limits.LIMIT)'").output == "0\n"
    box.write_text("limits.py", "LIMIT = 1\n")
    assert box.run("python3 -c 'import limits; print(limits.LIMIT)'").output == "1\n"
    assert "__pycache__" not in box.run("ls -a").output


def test_stdout_and_stderr_interleave_in_order(box: Sandbox):
    result = box.run("python3 -c \"import sys; print('a'); print('b', file=sys.stderr); print('c')\"")
    assert result.output == "a\nb\nc\n"


def test_host_written_files_stay_editable_inside(box: Sandbox):
    box.write_text("new/dir/f.txt", "one\n")
    assert box.run("echo two >> new/dir/f.txt && touch new/dir/g && rm pkg/util.py").exit_code == 0
    assert box.read_text("new/dir/f.txt") == "one\ntwo\n"


def test_snapshot_restore_and_reset(box: Sandbox):
    box.run("mkdir -p empty sub && echo 1 > sub/a && chmod 755 sub/a && ln -s sub/a link")
    snap = box.snapshot()
    assert snap.files["sub/a"] == b"1\n" and snap.modes["sub/a"] == 0o755
    assert "empty" in snap.dirs and snap.symlinks == {"link": "sub/a"}
    box.run("rm -rf sub empty && echo junk > extra && echo changed > main.py")
    box.restore(snap)
    assert box.snapshot() == snap
    assert box.run("cat link && test -x sub/a && test -d empty").output == "1\n"
    box.reset()
    assert box.snapshot() == Snapshot.of_files({"main.py": "print('hello')\n", "pkg/util.py": "X = 1\n"})


def test_close_leaves_no_process_mount_or_directory(config: SandboxConfig, probes):
    sb = Sandbox.create({"a": "b"}, config)
    device = probes.device_of(sb.workspace)
    sb.run("sleep 876543 > /dev/null 2>&1 &")
    sb.close()
    sb.close()  # idempotent
    assert not sb.workspace.exists() and not probes.is_mounted(sb.workspace)
    assert probes.jail_pids(device) == [] and probes.pids_running("sleep 876543") == []
    with pytest.raises(SandboxError, match="closed"):
        sb.run("true")


# ---- attacks: resource exhaustion ----------------------------------------------------------------


def test_fork_bomb_is_capped_by_process_limit(sandbox_root, probes):
    cfg = SandboxConfig(root_dir=sandbox_root, max_processes=16, wall_time_s=5)
    with Sandbox.create({}, cfg) as sb:
        result = sb.run(
            'python3 -c "import os, time\nn = 0\ntry:\n  while True:\n    if os.fork() == 0:\n'
            "      time.sleep(30); os._exit(0)\n    n += 1\nexcept OSError as e:\n  print('blocked after', n, e)\"",
        )
        assert "blocked after" in result.output and "Resource temporarily unavailable" in result.output
        assert int(result.output.split()[2]) < 16
        assert not result.timed_out  # the stuck children died with the command
        assert probes.pids_running("time.sleep(30)") == []
        assert_usable(sb)


def test_shell_fork_bomb_times_out_and_everything_dies(sandbox_root, probes):
    cfg = SandboxConfig(root_dir=sandbox_root, max_processes=32)
    with Sandbox.create({}, cfg) as sb:
        device = probes.device_of(sb.workspace)
        result = sb.run("bomb() { bomb | bomb & }; bomb; sleep 30", timeout_s=1.5)
        assert result.timed_out and result.exit_code is None
        assert "all processes killed" in result.render()
        assert probes.jail_pids(device) == []
        assert_usable(sb)


def test_memory_bomb_gets_memory_error(sandbox_root):
    cfg = SandboxConfig(root_dir=sandbox_root, memory_mb=256)
    with Sandbox.create({}, cfg) as sb:
        result = sb.run("python3 -c 'x = bytearray(1024 ** 3)'")
        assert result.exit_code == 1 and "MemoryError" in result.output
        assert_usable(sb)


def test_infinite_loop_times_out_and_kills_process_group(box: Sandbox, probes):
    device = probes.device_of(box.workspace)
    start = time.perf_counter()
    result = box.run("sleep 765432 & python3 -c 'while True: pass'", timeout_s=1.0)
    assert result.timed_out and result.exit_code is None
    assert 1.0 <= result.duration_s < 3.0 and time.perf_counter() - start < 3.0
    assert result.render().endswith("s; all processes killed]")
    assert probes.jail_pids(device) == [] and probes.pids_running("sleep 765432") == []
    assert_usable(box)


def test_cpu_time_limit_kills_busy_loop(sandbox_root):
    cfg = SandboxConfig(root_dir=sandbox_root, cpu_time_s=1, wall_time_s=10)
    with Sandbox.create({}, cfg) as sb:
        result = sb.run("python3 -c 'while True: pass'")
        assert not result.timed_out and result.duration_s < 5
        assert result.exit_code in (128 + 9, 128 + 24)  # SIGKILL or SIGXCPU
        assert "killed by SIG" in result.render()


def test_huge_output_is_cut_with_marker_and_bounded_memory(box: Sandbox):
    tracemalloc.start()
    result = box.run("head -c 20000000 /dev/zero | tr '\\0' 'y'")
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert result.truncated and result.exit_code == 0
    limit = box.config.max_output_bytes
    assert f"[output cut: {20_000_000 - limit} more bytes]" in result.output
    assert len(result.output) < limit + 100
    assert peak < 2_000_000  # reading 20 MB kept only the budget (plus read buffers)


def test_binary_output_is_replaced_by_a_marker(box: Sandbox):
    result = box.run("head -c 5000 /dev/urandom")
    assert result.output == "[binary output: 5000 bytes not shown]\n" and result.exit_code == 0


def test_file_size_limit(sandbox_root):
    cfg = SandboxConfig(root_dir=sandbox_root, max_file_mb=1)
    with Sandbox.create({}, cfg) as sb:
        result = sb.run("python3 -c \"open('big', 'wb').write(b'x' * 2_000_000)\"")
        assert result.exit_code == 1 and "File too large" in result.output
        assert os.path.getsize(sb.workspace / "big") <= 1024 * 1024


@pytest.mark.skipif(os.geteuid() != 0, reason="workspace quotas need a tmpfs mount (root)")
def test_filling_the_disk_hits_the_quota_and_recovers(sandbox_root):
    cfg = SandboxConfig(root_dir=sandbox_root, disk_mb=8, max_file_mb=4)
    with Sandbox.create({}, cfg) as sb:
        result = sb.run("for i in 1 2 3 4; do head -c 4000000 /dev/zero > f$i || exit 7; done")
        assert result.exit_code == 7 and "No space left on device" in result.output
        assert sum(os.path.getsize(p) for p in sb.workspace.iterdir()) <= 8 * 1024 * 1024
        with pytest.raises(OSError, match="No space left"):
            sb.write_text("host.txt", "x" * 5_000_000)
        assert sb.run("rm f* && echo fits > ok && cat ok").output == "fits\n"


def test_tmp_inside_is_private_and_capped(sandbox_root):
    cfg = SandboxConfig(root_dir=sandbox_root, disk_mb=2)
    with Sandbox.create({}, cfg) as sb:
        result = sb.run("head -c 3000000 /dev/zero > /tmp/big")
        assert result.exit_code == 1 and "No space left on device" in result.output
        assert sb.run("echo x > /tmp/mark-4711").exit_code == 0
        assert not os.path.exists("/tmp/mark-4711")
        assert sb.run("ls /tmp").output == ""  # a fresh /tmp per command


INODE_FLOOD = """
import os, sys
n = 0
try:
    for n in range(200_000):  # far past any cap; bounded so a missing cap fails instead of hanging
        open(f"{sys.argv[1]}/{n}", "w").close()
    print("no cap after", n + 1)
except OSError as exc:
    print("stopped after", n, exc.strerror)
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="inode caps need tmpfs mounts of our own (root)")
@pytest.mark.parametrize("where", ["/tmp", "/dev/shm"])
def test_a_flood_of_empty_files_stops_at_the_inode_cap(sandbox_root, where: str):
    """Empty files take no bytes, so `disk_mb` alone never stopped them; each inode is kernel memory."""
    cfg = SandboxConfig(root_dir=sandbox_root, disk_mb=1, wall_time_s=20)
    with Sandbox.create({"flood.py": INODE_FLOOD}, cfg) as sb:
        result = sb.run(f"python3 flood.py {where}; ls {where} | wc -l")
        first, count = result.output.splitlines()
        assert first.startswith("stopped after") and first.endswith("No space left on device"), result.render()
        assert 1000 <= int(first.split()[2]) <= 1024 and int(count) <= 1024
        assert sb.run(f"ls -A {where}").output == ""  # the next command starts empty
        assert_usable(sb)
    with open("/proc/self/mountinfo") as f:  # no /tmp of a command outlives its sandbox
        assert [p for line in f if (p := line.split(" ")[4]).startswith(f"{sandbox_root}/{os.getpid()}-")] == []


# ---- attacks: escaping the filesystem and network ------------------------------------------------


def test_network_is_unreachable(box: Sandbox):
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    listener.settimeout(0.5)
    port = listener.getsockname()[1]
    try:
        result = box.run(
            f"python3 -c \"import socket; socket.create_connection(('127.0.0.1', {port}), timeout=2); "
            "print('connected')\""
        )
        assert result.exit_code == 1 and "connected" not in result.output
        assert "Network is unreachable" in result.output or "refused" in result.output
        with pytest.raises(TimeoutError):
            listener.accept()
    finally:
        listener.close()
    assert box.run("python3 -c 'import socket; print(socket.gethostbyname(\"example.com\"))'").exit_code == 1


def test_host_files_outside_workspace_are_invisible(config: SandboxConfig, box: Sandbox):
    with Sandbox.create({"secret.txt": "other-sandbox-secret"}, config) as other:
        targets = ["/etc/shadow", "/etc/passwd", "/root/.bashrc", "/work/main/flywheel/env/sandbox.py",
                   str(other.workspace / "secret.txt"), str(config.resolved_root())]  # fmt: skip
        for target in targets:
            result = box.run(f"cat {target} || ls {target}")
            assert result.exit_code != 0, f"{target} is visible: {result.output[:200]}"
        assert box.run("ls -A /tmp /root /root/.pyenv /dev/shm").output.split() == [
            "/dev/shm:", "/root:", ".pyenv", "/root/.pyenv:", "versions", "/tmp:"
        ]  # fmt: skip
        assert box.run("ls /").output.split() == [
            "bin", "dev", "etc", "lib", "lib64", "proc", "root", "sbin", "tmp", "usr", "workspace"
        ]  # fmt: skip


def test_the_jails_python_is_the_standard_library_without_host_packages(box: Sandbox):
    """The host interpreter's site-packages (installed packages, `.pth` startup hooks) are hidden
    behind empty read-only mounts; the standard library stays."""
    host_site = [p for p in site.getsitepackages([os.path.realpath(sys.base_prefix)]) if os.path.isdir(p)]
    assert host_site and any(os.listdir(p) for p in host_site)  # there is something to hide
    script = ("import json, site, os; "
              "print(json.dumps({p: os.listdir(p) for p in site.getsitepackages() if os.path.isdir(p)}))")
    result = box.run(f"python3 -c '{script}'")
    assert result.exit_code == 0, result.render()
    seen = json.loads(result.output)
    assert set(seen) == {os.path.realpath(p) for p in host_site} and all(v == [] for v in seen.values())
    installed = next(n for p in host_site for n in sorted(os.listdir(p))  # a package the host can import
                     if n.isidentifier() and n not in sys.stdlib_module_names
                     and os.path.isfile(f"{p}/{n}/__init__.py"))
    assert box.run(f"python3 -c 'import {installed}'").exit_code != 0
    assert box.run(f"touch {host_site[0]}/planted.pth").exit_code != 0
    assert not os.path.exists(f"{host_site[0]}/planted.pth")
    assert box.run("python3 -c 'import json, sqlite3, unittest'").exit_code == 0


UNSHARE_USERNS = """
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
if libc.unshare(0x10000000) == 0:  # CLONE_NEWUSER
    print("nested user namespace")
else:
    print("refused:", os.strerror(ctypes.get_errno()))
"""


def test_no_user_namespaces_inside_the_jail(box: Sandbox):
    """A nested user namespace hands the command all capabilities over it (mounts, namespaces):
    the usual first step of a kernel exploit against a bwrap jail."""
    box.write_text("userns.py", UNSHARE_USERNS)
    result = box.run("python3 userns.py")
    assert result.exit_code == 0 and result.output.startswith("refused:"), result.render()
    result = box.run("unshare --user --map-root-user id -u")
    assert result.exit_code != 0 and "unshare failed" in result.output, result.render()
    assert_usable(box)


def test_proc_shows_no_host_paths(config: SandboxConfig, box: Sandbox):
    """Pid 1 of the jail once was a fork of bwrap, whose command line in /proc/1/cmdline held the
    venv, the sandbox root and the workspace name with the owner's pid. (A plain-dir workspace, when
    not root, shows its host path as its mount's root in mountinfo: see the sandbox docstring.)"""
    root = str(config.resolved_root())
    host_paths = [root, box.workspace.name, sys.prefix, os.path.dirname(sys.executable)]  # the name holds our pid
    if os.path.realpath(sys.base_prefix) != os.path.realpath(sys.prefix):
        host_paths.append(os.path.realpath(sys.prefix))  # the venv, where bwrap-bin lives
    for probe in ["/proc/1/cmdline", "/proc/1/environ", "/proc/1/maps", "/proc/self/cmdline",
                  "/proc/self/environ", "/proc/self/mountinfo" if box._mounted else "/proc/self/maps"]:  # fmt: skip
        result = box.run(f"tr '\\0' ' ' < {probe}")  # NULs would make the output "binary"
        seen = result.output
        assert result.exit_code == 0 and seen.strip(), result.render()
        leaked = [p for p in host_paths if p in seen]
        assert leaked == [], f"{probe} shows {leaked}: {seen[:300]}"
    assert box.run("readlink /proc/1/exe").output == os.path.realpath("/bin/sh") + "\n"
    assert box.run("tr '\\0' ' ' < /proc/1/cmdline").output.startswith("/bin/sh -c ulimit")


def test_writes_outside_workspace_fail(box: Sandbox):
    for target in ["/usr/evil", "/usr/lib/evil", "/etc/evil", "/evil"]:
        result = box.run(f"echo x > {target}")
        assert result.exit_code != 0, target
        assert not os.path.exists(target)
    result = box.run("python3 -c \"import sys; open(sys.prefix + '/evil', 'w')\"")
    assert "Read-only file system" in result.output or "Permission denied" in result.output


@pytest.mark.parametrize("rel", ["../outside.txt", "/etc/passwd", "pkg/../../x", "a/../../../etc/passwd"])
def test_path_traversal_is_refused(box: Sandbox, rel: str):
    with pytest.raises(PathEscapeError, match="refused path"):
        box.resolve(rel)
    with pytest.raises(PathEscapeError):
        box.write_text(rel, "x")
    assert box.resolve("pkg/../main.py") == box.workspace / "main.py"


def test_symlink_escape_planted_by_sandbox_is_refused(box: Sandbox):
    box.run("ln -s /etc/passwd passwd && ln -s .. up && ln -s /etc etc && mkdir d && ln -s ../../ d/esc")
    for rel, why in [("passwd", "points outside"), ("up/x", "leaves the workspace"),
                     ("etc/hostname", "points outside"), ("d/esc/etc/passwd", "leaves the workspace")]:  # fmt: skip
        with pytest.raises(PathEscapeError, match=why):
            box.read_text(rel)
    before = os.stat("/etc/passwd")
    with pytest.raises(PathEscapeError, match="symlink 'passwd' -> '/etc/passwd'"):
        box.write_text("passwd", "pwned")
    assert os.stat("/etc/passwd").st_mtime == before.st_mtime


def test_symlinks_inside_the_workspace_are_followed(box: Sandbox):
    box.run("ln -s pkg/util.py inner && ln -s /workspace/pkg abs")
    assert box.read_text("inner") == "X = 1\n"
    assert box.read_text("abs/util.py") == "X = 1\n"


def test_fifo_planted_by_sandbox_does_not_hang_host_reads(box: Sandbox):
    box.run("mkfifo pipe")
    with pytest.raises(OSError, match="not a regular file"):
        box.read_text("pipe")


def test_background_process_dies_when_its_command_exits(box: Sandbox, probes):
    device = probes.device_of(box.workspace)
    result = box.run("sleep 654321 > /dev/null 2>&1 & echo started")
    assert result.output == "started\n" and result.exit_code == 0
    assert result.duration_s < 2
    assert probes.jail_pids(device) == [] and probes.pids_running("sleep 654321") == []


@pytest.mark.skipif(os.geteuid() != 0, reason="needs a root dir the sandbox user cannot enter")
def test_jail_setup_failure_is_a_sandbox_error(config: SandboxConfig):
    with Sandbox.create({}, config) as sb:
        root = config.resolved_root()
        os.chmod(root, 0o700)  # now bwrap, running as nobody, cannot reach the workspace
        try:
            with pytest.raises(SandboxError, match="failed to start"):
                sb.run("true")
        finally:
            os.chmod(root, 0o711)
        assert_usable(sb)
