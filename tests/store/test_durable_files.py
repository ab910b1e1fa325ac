"""flywheel.store.files: atomic replace, durable append, folder publish and replace, on a real filesystem.

The crash tests kill a real process (SIGKILL) in the middle of a stream of writes and check that
what is on disk is the old state or the new one, never a mix."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from flywheel.store.files import append_line, displaced, publish_folder, replace_folder, write_atomic


def test_write_atomic_replaces_the_file_and_leaves_no_temp(tmp_path):
    path = tmp_path / "state.json"
    write_atomic(path, "old")
    write_atomic(path, '{"ü": 1}')
    assert path.read_text(encoding="utf-8") == '{"ü": 1}'
    write_atomic(path, b"\x00bytes")
    assert path.read_bytes() == b"\x00bytes"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["state.json"]


def test_a_failed_write_atomic_keeps_the_old_target_and_removes_its_temp(tmp_path):
    target = tmp_path / "report"
    target.mkdir()
    (target / "inside").write_text("kept")  # a non-empty folder cannot be replaced by a file
    with pytest.raises(OSError):
        write_atomic(target, "new")
    assert (target / "inside").read_text() == "kept"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["report"]
    with pytest.raises(FileNotFoundError):
        write_atomic(tmp_path / "no-such-folder" / "x.json", "new")  # the folder must exist: said, not created


def test_append_line_adds_whole_lines_from_many_threads(tmp_path):
    path = tmp_path / "log.jsonl"
    lock = threading.Lock()

    def writer(n: int) -> None:
        for i in range(50):
            with lock:
                append_line(path, json.dumps({"writer": n, "i": i, "pad": "x" * 20_000}))

    threads = [threading.Thread(target=writer, args=(n,)) for n in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(records) == 200
    for n in range(4):  # each writer's lines whole and in its order
        assert [r["i"] for r in records if r["writer"] == n] == list(range(50))
    append_line(path, "no newline")
    assert path.read_text().endswith("\nno newline\n")


def test_the_first_append_after_a_cut_line_starts_a_line_of_its_own(tmp_path):
    """A crash that cut the last line (its newline never written) must not take the next record
    with it: glued to the cut one, it would be one more line a reader skips."""
    path = tmp_path / "log.jsonl"
    append_line(path, json.dumps({"i": 0}))
    with open(path, "ab") as f:
        f.write(b'{"i": 1, "cut by a cra')  # what a kill mid-write leaves
    append_line(path, json.dumps({"i": 2}))
    append_line(path, json.dumps({"i": 3}))
    lines = path.read_text().splitlines()
    assert lines[0] == '{"i": 0}' and lines[1] == '{"i": 1, "cut by a cra' and lines[2:] == ['{"i": 2}', '{"i": 3}']


def test_publish_folder_refuses_to_overwrite_and_replace_folder_swaps(tmp_path):
    tmp, final = tmp_path / "tmp", tmp_path / "v0"
    tmp.mkdir()
    (tmp / "weights").write_text("one")
    publish_folder(tmp, final)
    assert (final / "weights").read_text() == "one" and not tmp.exists()
    tmp.mkdir()
    (tmp / "weights").write_text("two")
    with pytest.raises(OSError):
        publish_folder(tmp, final)  # a published version is never replaced
    assert (final / "weights").read_text() == "one" and (tmp / "weights").read_text() == "two"
    replace_folder(tmp, final)
    assert (final / "weights").read_text() == "two"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["v0"]  # the displaced one is gone


WRITER = textwrap.dedent("""
    import sys
    from pathlib import Path
    from flywheel.store.files import append_line, replace_folder, write_atomic
    root = Path(sys.argv[1])
    n = 0
    while True:
        n += 1
        body = chr(97 + n % 26) * 100_000  # one letter per version: a mix of two versions shows
        write_atomic(root / "state.json", body)
        append_line(root / "log.jsonl", body)
        tmp = root / "state.tmp"
        tmp.mkdir()
        (tmp / "a").write_text(body)
        (tmp / "b").write_text(body)
        replace_folder(tmp, root / "state")
""")


def test_a_process_killed_mid_write_leaves_whole_files(tmp_path):
    proc = subprocess.Popen([sys.executable, "-c", WRITER, str(tmp_path)], env={**os.environ})
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and len((tmp_path / "log.jsonl").read_text()
                                                  if (tmp_path / "log.jsonl").exists() else "") < 1_000_000:
            time.sleep(0.02)
        time.sleep(0.013)  # somewhere inside a write
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    state = (tmp_path / "state.json").read_text()
    assert len(state) == 100_000 and len(set(state)) == 1  # one whole version
    lines = (tmp_path / "log.jsonl").read_text().split("\n")
    assert len(lines) >= 10 and all(len(line) == 100_000 and len(set(line)) == 1 for line in lines[:-1])
    folder = tmp_path / "state" if (tmp_path / "state").exists() else displaced(tmp_path / "state")
    a, b = (folder / "a").read_text(), (folder / "b").read_text()
    assert a == b and len(a) == 100_000  # both files of one version, whichever folder survived
