"""Durable file writes: the one place where flywheel replaces a file, appends a record or
publishes a folder so that a crash at any moment leaves either the old state or the new one.

    write_atomic(path, text)        temp file beside it, fsync, rename over it, fsync the folder
    append_line(path, line)         one write of a whole line, on a line of its own, fsync (and the
                                    folder's, on creation)
    publish_folder(tmp, final)      fsync every file and folder under tmp, rename, fsync the parent
    replace_folder(tmp, final)      the same over an existing folder, which moves to `displaced(final)`
                                    for the instant between the two renames

One policy for all of them, durable: fsync the file, then the folder that names it. A rename alone
is atomic against a crash of the process (a reader sees the old file or the new one) but not against
a power loss or a kernel crash: the new name can reach the disk before the new contents, which then
read as empty or zeroed, and a file's creation can be lost with its folder's entry. The files that
go through here are the ones a resume or a reader relies on (a run's groups, trajectories and learner
state, checkpoints, cycle states and reports), each written after work that took far longer (an
episode's turn, a learner step, a cycle stage). Measured on the project's VM (ext4 on virtio, 10 kB
records): 18 ms per write_atomic and 7 ms per append_line, against 0.7 ms for an unsynced rename;
paid in the writing thread with the GIL released. Concurrent writers share the journal's commits:
32 threads (the rollout workers saving episode states) reached 940 synced writes/s together, 34 ms
per write each, where unsynced ones took 47 ms on the same loaded CPUs. A log that must be fast
writes elsewhere.

A temp file is named after its target (`.<name>.<random>.tmp`, hidden, beside it) so concurrent
writers of one path do not share one, and it is removed when the write fails. A crash can leave one
behind; nothing reads them.
Imports nothing of flywheel: any layer (env, model, rl, live, report) may use it.
"""

from __future__ import annotations

import os
import shutil
import uuid
from pathlib import Path


def write_atomic(path: str | Path, data: str | bytes) -> None:
    """Replace `path` with `data` (text is written as UTF-8): readers see the old file or the new
    one whole, and after a power loss the new one is there if this returned. The folder must exist."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.tmp")
    payload = data.encode("utf-8") if isinstance(data, str) else data
    try:
        with open(tmp, "wb") as f:
            f.write(payload)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def append_line(path: str | Path, line: str) -> None:
    """Append `line` (a newline is added if it has none) in one write and fsync it. A crash can cut
    only the last line of the file, so a reader skips a line that does not parse; the first append
    after such a cut starts on a line of its own (a newline first), so the record it writes is not
    glued to the cut one and lost with it. Callers that append to one file from several threads
    hold a lock around this: one write per line keeps lines whole on a local filesystem, but the
    order of interleaved lines is theirs to decide."""
    path = Path(path)
    if not line.endswith("\n"):
        line += "\n"
    created = not path.exists()
    with open(path, "ab+") as f:
        end = f.seek(0, os.SEEK_END)
        if end and os.pread(f.fileno(), 1, end - 1) != b"\n":  # the last line was cut by a crash
            line = "\n" + line
        f.write(line.encode("utf-8"))
        f.flush()
        os.fsync(f.fileno())
    if created:
        fsync_dir(path.parent)


def publish_folder(tmp: str | Path, final: str | Path) -> None:
    """Make the folder `tmp`, written whole, appear as `final`, which must not exist (a non-empty
    `final` makes the rename fail rather than be replaced)."""
    tmp, final = Path(tmp), Path(final)
    fsync_tree(tmp)
    os.rename(tmp, final)  # the folder appears whole or not at all
    fsync_dir(final.parent)


def replace_folder(tmp: str | Path, final: str | Path) -> None:
    """Make the folder `tmp`, written whole, replace `final`. Between the two renames the previous
    `final` is at `displaced(final)`: a reader that finds no `final` reads that one."""
    tmp, final = Path(tmp), Path(final)
    old = displaced(final)
    fsync_tree(tmp)
    if old.exists() and not final.exists():
        os.replace(old, final)  # a previous call died between its renames: put that folder back first
    shutil.rmtree(old, ignore_errors=True)  # else a leftover of a call that died after its second rename
    if final.exists():
        os.replace(final, old)
    os.replace(tmp, final)
    fsync_dir(final.parent)
    shutil.rmtree(old, ignore_errors=True)


def displaced(final: str | Path) -> Path:
    """Where `replace_folder` keeps the previous `final` while it swaps the new one in."""
    final = Path(final)
    return final.with_name(final.name + ".old")


def fsync_tree(folder: str | Path) -> None:
    """Flush every file under `folder` and every folder itself, so a rename that follows publishes whole files."""
    folder = Path(folder)
    for path in folder.rglob("*"):
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
    for sub in [folder, *(p for p in folder.rglob("*") if p.is_dir())]:
        fsync_dir(sub)


def fsync_dir(folder: str | Path) -> None:
    """Flush a folder's entries (a created, renamed or removed name) to disk."""
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
