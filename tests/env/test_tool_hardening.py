"""Every tool call becomes a result or a tool error: never an exception out of `Toolbox.execute`, nor a hang.

Each test builds what an agent can make with its own tools (FIFOs, sockets, a file used as a folder, a
tree deeper than PATH_MAX, a line of megabytes, files that are not UTF-8) in a real bwrap sandbox, or
passes arguments no path or command can hold (NUL bytes, lone surrogates, over-long names), and
checks the answer. The property test at the end drives all tools with generated arguments over one
workspace holding every special file type.
"""

from __future__ import annotations

import os
import stat
import threading
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from flywheel.env.sandbox import Sandbox, SandboxConfig, SandboxError, Snapshot
from flywheel.env.semantic import load_embedder
from flywheel.env.tools import Toolbox, ToolConfig
from flywheel.env.toolspec import TOOL_SCHEMAS, ToolCall, ToolResult

FILES = {
    "a.py": "def f():\n    return 1\n",
    "notes.txt": "line one\nline two\n",
    "latin1.txt": "caf\xe9 cr\xe8me\n".encode("latin-1"),
    "blob.bin": b"\x7fELF\x00\x01\x02binary\x00data\n",
}
# What the agent can build with run_command: a FIFO, a Unix socket, a tree deeper than PATH_MAX (4096
# bytes from the host's workspace path), a line of 5 MB, a folder nobody may read, and a file whose
# name is not UTF-8.
HOSTILE = r"""python3 - <<'EOF'
import os, socket
os.mkfifo('fifo.py')
socket.socket(socket.AF_UNIX).bind('sock.py')
os.mkdir('deep')
os.chdir('deep')
for _ in range(2100):  # 2 bytes a level: 4200 bytes below the workspace
    os.mkdir('d')
    os.chdir('d')
open('leaf.py', 'w').write('DEEP = 1\n')
os.chdir('/workspace')
open('long.txt', 'w').write('x' * 5_000_000 + '\n')
os.mkdir('locked')
open('locked/secret.txt', 'w').write('s\n')
os.chmod('locked', 0)
open(b'name\xff.txt', 'w').write('not utf-8 name\n')
EOF"""
CALL_LIMIT_S = 15.0  # a file tool answers in milliseconds; grep's own limit is 10 s


def _config(root: Path) -> SandboxConfig:
    return SandboxConfig(root_dir=root, wall_time_s=5.0, cpu_time_s=5, memory_mb=512)


@pytest.fixture(scope="module", autouse=True)
def embedder():
    # Loaded once, up front: its first load (seconds, more on a busy host) is not a tool's answer time.
    load_embedder()


@pytest.fixture
def box(sandbox_root):
    with Sandbox.create(FILES, _config(sandbox_root)) as sandbox:
        yield sandbox


@pytest.fixture
def tools(box):
    with Toolbox(box) as toolbox:
        yield toolbox


def run_hostile(box: Sandbox) -> None:
    result = box.run(HOSTILE)
    assert result.exit_code == 0, result.output


def answer(tools: Toolbox, name: str, arguments: dict) -> ToolResult:
    """One call through `execute`, in a thread, so a hang fails the test instead of blocking it."""
    out: dict[str, object] = {}

    def go() -> None:
        try:
            (out["result"],) = tools.execute([ToolCall("c1", name, arguments)])
        except BaseException as exc:  # noqa: BLE001 -- the test reports any escape, whatever it is
            out["raised"] = exc

    worker = threading.Thread(target=go, daemon=True)
    worker.start()
    worker.join(CALL_LIMIT_S)
    assert not worker.is_alive(), f"{name}({arguments!r:.200}) did not return within {CALL_LIMIT_S} s"
    assert "raised" not in out, f"{name}({arguments!r:.200}) raised {out.get('raised')!r}"
    result = out["result"]
    assert isinstance(result, ToolResult) and isinstance(result.content, str)
    result.content.encode("utf-8")  # what the tokenizer gets must be text: no lone surrogates
    assert len(result.content.encode()) <= tools.config.result_max_bytes + 200, len(result.content.encode())
    return result


# ---- arguments --------------------------------------------------------------------------------------


_OS_ARGUMENTS = [
    ("run_command", "command", {}),
    ("grep", "pattern", {}),
    ("grep", "glob", {"pattern": "x"}),
    ("grep", "path", {"pattern": "x"}),
    ("read_file", "path", {}),
    ("list_dir", "path", {}),
    ("edit_file", "path", {"old": "", "new": "x"}),
]
_TEXT_ARGUMENTS = [
    ("edit_file", "old", {"path": "a.py", "new": "x"}),
    ("edit_file", "new", {"path": "a.py", "old": "return 1"}),
    ("semantic_search", "query", {}),
    ("finish", "summary", {}),
]


@pytest.mark.parametrize(
    "name,key,base,bad",
    [(*a, "a\0b") for a in _OS_ARGUMENTS]
    + [(*a, "a\udc80b") for a in _OS_ARGUMENTS + _TEXT_ARGUMENTS]
    + [(*a, "x" * 200_000) for a in _OS_ARGUMENTS],
    ids=lambda v: v if isinstance(v, str) and len(v) < 20 else None,
)
def test_strings_no_path_or_command_can_hold_are_refused(tools, box, name, key, base, bad):
    before = box.snapshot()
    result = answer(tools, name, {**base, key: bad})
    assert not result.ok and result.content.startswith("error: invalid tool call"), result.content
    assert repr(key) in result.content
    assert box.snapshot() == before  # a refused call changes nothing


def test_nul_in_edit_text_is_written_byte_exactly(tools, box):
    assert answer(tools, "edit_file", {"path": "z.txt", "old": "", "new": "a\0b\n"}).ok
    assert (box.workspace / "z.txt").read_bytes() == b"a\0b\n"


@pytest.mark.parametrize(
    "path",
    ["n" * 300, "/".join(["d" * 250] * 20), "a/" * 2100 + "x"],
    ids=["name-over-255-bytes", "path-over-4096-bytes", "many-short-components"],
)
@pytest.mark.parametrize(
    "name,base",
    [("read_file", {}), ("list_dir", {}), ("grep", {"pattern": "x"}), ("edit_file", {"old": "", "new": "x"})],
)
def test_paths_over_the_filesystem_limits_are_tool_errors(tools, name, base, path):
    result = answer(tools, name, {**base, "path": path})
    assert not result.ok and "too long" in result.content, result.content


# ---- workspace contents the agent made -------------------------------------------------------------


def test_special_files_are_tool_errors_and_never_block(tools, box):
    run_hostile(box)
    for path in ["fifo.py", "sock.py"]:
        for name, arguments in [
            ("read_file", {"path": path}),
            ("edit_file", {"path": path, "old": "", "new": "x"}),  # a FIFO is empty: "creating" it blocked
            ("edit_file", {"path": path, "old": "a", "new": "b"}),
            ("grep", {"pattern": "x", "path": path}),  # rg reading a FIFO waits for a writer
        ]:
            result = answer(tools, name, arguments)
            assert not result.ok and "not a regular file" in result.content, (name, path, result.content)
    assert stat.S_ISFIFO(os.lstat(box.workspace / "fifo.py").st_mode)  # left as it was
    # Directory-wide tools step over them.
    assert answer(tools, "grep", {"pattern": "DEEP|line one"}).ok
    assert answer(tools, "list_dir", {}).ok
    assert answer(tools, "semantic_search", {"query": "line two"}).ok


def test_a_path_through_a_regular_file_is_a_tool_error(tools, box):
    for name, arguments in [
        ("read_file", {"path": "a.py/x"}),
        ("edit_file", {"path": "a.py/x/y.py", "old": "", "new": "x"}),
        ("list_dir", {"path": "a.py/x"}),
        ("grep", {"pattern": "x", "path": "a.py/x"}),
    ]:
        result = answer(tools, name, arguments)
        assert not result.ok and "a.py" in result.content and "not a folder" in result.content, result.content
    assert box.read_text("a.py") == FILES["a.py"]


@pytest.mark.slow  # 12 s on the shared 2-core machine (load ~10)
def test_a_tree_deeper_than_path_max_can_be_snapshot_reset_and_searched(tools, box):
    run_hostile(box)
    for name, arguments in [
        ("list_dir", {"path": "deep"}),
        ("grep", {"pattern": "DEEP"}),
        ("semantic_search", {"query": "deep constant"}),
        ("read_file", {"path": "deep/leaf.py"}),  # missing: its hints walk the deep tree
    ]:
        answer(tools, name, arguments)
    snap = box.snapshot()
    assert "a.py" in snap.files and "deep/d" in snap.dirs
    # Entries a host path cannot reach are left out, so the snapshot restores.
    assert all(len(os.fsencode(box.workspace / p)) < 4096 for p in [*snap.files, *snap.dirs])
    box.restore(snap)
    assert box.snapshot() == snap
    box.reset()
    assert box.snapshot() == Snapshot.of_files(FILES)


def test_reset_removes_special_files_and_locked_folders(box):
    run_hostile(box)
    box.reset()
    assert box.snapshot() == Snapshot.of_files(FILES)
    assert sorted(os.listdir(box.workspace)) == sorted(FILES)


def test_a_line_of_megabytes_is_cut_by_bytes(tools, box):
    run_hostile(box)
    cap = tools.config.read_max_bytes
    whole = answer(tools, "read_file", {"path": "long.txt"})
    assert whole.ok and len(whole.content.encode()) <= cap + 200
    assert "line 1 is 5000001 bytes" in whole.content
    many = "".join(f"{i:05d} " + "y" * 94 + "\n" for i in range(1000))  # 100 kB in 1000 lines of 101 bytes
    assert answer(tools, "edit_file", {"path": "many.txt", "old": "", "new": many}).ok
    part = answer(tools, "read_file", {"path": "many.txt", "start_line": 11})
    shown = part.content.split("\n[cut:")[0]
    last_shown = 10 + shown.count("\n")
    assert shown == "".join(many.splitlines(keepends=True)[10:last_shown])  # whole lines only
    assert f"read from start_line={last_shown + 1}" in part.content
    assert len(part.content.encode()) <= cap + 200
    assert answer(tools, "grep", {"pattern": "xxx", "path": "long.txt"}).ok


# ---- encodings -------------------------------------------------------------------------------------


def test_edit_file_refuses_a_file_that_is_not_utf8_and_leaves_its_bytes(tools, box):
    for old in ["caf", ""]:
        result = answer(tools, "edit_file", {"path": "latin1.txt", "old": old, "new": "CAF"})
        assert not result.ok and ("not UTF-8" in result.content or "already exists" in result.content)
    assert (box.workspace / "latin1.txt").read_bytes() == FILES["latin1.txt"]


def test_read_file_says_when_content_is_binary_or_not_utf8(tools):
    binary = answer(tools, "read_file", {"path": "blob.bin"})
    assert not binary.ok and "binary" in binary.content and "\0" not in binary.content
    latin = answer(tools, "read_file", {"path": "latin1.txt"})
    assert latin.ok and "not UTF-8" in latin.content and "caf\ufffd cr\ufffdme" in latin.content


def test_a_file_name_that_is_not_utf8_is_shown_as_text(tools, box):
    run_hostile(box)
    listing = answer(tools, "list_dir", {})
    assert listing.ok and "name\\udcff.txt" in listing.content
    assert answer(tools, "grep", {"pattern": "not utf-8 name"}).ok


# ---- output ----------------------------------------------------------------------------------------


def test_every_result_has_a_byte_cap(box):
    config = ToolConfig(result_max_bytes=4096)
    with Toolbox(box, config) as tools:
        answer(
            tools,
            "run_command",
            {"command": "for i in $(seq 60); do mkdir -p $(printf 'n%.0s' $(seq 200))$i; done"},
        )
        listing = answer(tools, "list_dir", {})  # 60 names of 200 bytes: 12 kB under the entry cap
        assert len(listing.content.encode()) <= 4096 + 200 and "[cut:" in listing.content
        echo = answer(tools, "finish", {"summary": "s" * 10_000})
        assert len(echo.content.encode()) <= 4096 + 200


def test_a_nul_byte_in_command_output_does_not_hide_it(tools):
    result = answer(tools, "run_command", {"command": r"printf 'before\0after\n'; echo more text"})
    assert (
        result.ok
        and "before" in result.content
        and "after" in result.content
        and "more text" in result.content
    )
    assert "\0" not in result.content


# ---- unexpected errors -----------------------------------------------------------------------------


class _BrokenListing(Toolbox):
    """A toolbox whose list_dir has a bug, as a tool of tomorrow may have."""

    def list_dir(self, path: str = ".") -> str:
        return {}[path]


def test_an_unexpected_error_is_that_calls_failure_and_the_turn_goes_on(box):
    with _BrokenListing(box) as tools:
        broken, fine = tools.execute(
            [ToolCall("1", "list_dir", {}), ToolCall("2", "read_file", {"path": "a.py"})]
        )
    assert not broken.ok and "internal error in list_dir" in broken.content and "KeyError" in broken.content
    assert fine.ok and fine.content == FILES["a.py"]


def test_a_failure_of_the_sandbox_itself_still_propagates(box):
    with Toolbox(box) as tools:
        box.close()
        with pytest.raises(SandboxError):
            tools.execute([ToolCall("1", "run_command", {"command": "true"})])


# ---- property: any arguments over a hostile workspace ------------------------------------------------

_NAMES = [
    ".",
    "a.py",
    "notes.txt",
    "latin1.txt",
    "blob.bin",
    "fifo.py",
    "sock.py",
    "long.txt",
    "locked",
    "locked/secret.txt",
    "deep",
    "deep/d/d",
    "a.py/x",
    "missing.py",
    "..",
    "../x",
    "/etc/passwd",
    "n" * 300,
    "a/" * 2100 + "x",
    "name\udcff.txt",
    "x\0y",
    "\udc80",
]
_text = st.one_of(
    st.text(max_size=40),
    st.sampled_from(
        ["", "\0", "\udc80", "a\0b", "(unclosed", "*", "**/*.py", "!*", "-x", "--files", "x" * 300]
    ),
)
_paths = st.one_of(st.sampled_from(_NAMES), st.text(max_size=30))
_ints = st.one_of(st.integers(-3, 3), st.integers(-(2**70), 2**70))
_VALUES = {
    "path": _paths,
    "pattern": _text,
    "glob": _text,
    "query": _text,
    "old": _text,
    "new": _text,
    "summary": _text,
    "start_line": _ints,
    "end_line": _ints,
    "top_k": _ints,
    "command": st.sampled_from(["cat fifo.py &", "true", "printf 'a\\0b'", "ls -R | head", "cat long.txt"]),
}


@st.composite
def _calls(draw):
    name = draw(st.sampled_from(sorted(TOOL_SCHEMAS)))
    properties = TOOL_SCHEMAS[name]["function"]["parameters"]["properties"]
    arguments = {key: draw(_VALUES[key]) for key in properties if draw(st.booleans()) or key == "path"}
    if draw(st.integers(0, 9)) == 0:
        arguments[draw(st.sampled_from(["path", "bogus"]))] = draw(st.one_of(_ints, _text, st.none()))
    return name, arguments


@pytest.fixture(scope="module")
def hostile_tools(sandbox_root):
    with Sandbox.create(FILES, _config(sandbox_root)) as sandbox, Toolbox(sandbox) as toolbox:
        run_hostile(sandbox)
        yield toolbox


@pytest.mark.slow  # 47 s on the shared 2-core machine (load ~10)
@settings(
    max_examples=100,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(call=_calls())
def test_any_call_returns_a_result_or_a_tool_error_in_time(hostile_tools, call):
    name, arguments = call
    result = answer(hostile_tools, name, arguments)
    assert result.call_id == "c1" and result.name == name
    assert result.ok or result.content.startswith("error: ")
