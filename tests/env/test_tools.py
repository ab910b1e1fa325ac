"""The agent's tools against a real bwrap sandbox, real ripgrep and the real embedding model."""

from __future__ import annotations

import pytest

from flywheel.env.sandbox import Sandbox
from flywheel.env.tools import Toolbox, ToolConfig, _conflicts, _launch_order, similar_paths
from flywheel.env.toolspec import TOOL_SCHEMAS, ToolCall, validate_arguments

FILES = {
    "pkg/__init__.py": "",
    "pkg/words.py": "def reverse_words(text):\n    return ' '.join(reversed(text.split()))\n",
    "pkg/money.py": "def add_tax(price, rate):\n    return price * (1 + rate)\n",
    "notes.txt": "line one\nline two\nline three\n",
}


@pytest.fixture
def tools():
    with Sandbox.create(FILES) as box, Toolbox(box) as toolbox:
        yield toolbox


def one(tools: Toolbox, name: str, **arguments):
    (result,) = tools.execute([ToolCall("c1", name, arguments)])
    return result


def test_every_schema_is_openai_function_form():
    for name, schema in TOOL_SCHEMAS.items():
        assert schema["type"] == "function"
        assert schema["function"]["name"] == name
        params = schema["function"]["parameters"]
        assert params["type"] == "object" and set(params["required"]) <= set(params["properties"])


def test_read_file_whole_and_range(tools):
    assert one(tools, "read_file", path="notes.txt").content == FILES["notes.txt"]
    part = one(tools, "read_file", path="notes.txt", start_line=2, end_line=3)
    assert part.ok and part.content == "line two\nline three\n"
    bad = one(tools, "read_file", path="notes.txt", start_line=0)
    assert not bad.ok and "line range" in bad.content


def test_read_missing_file_is_a_result_not_an_exception(tools):
    result = one(tools, "read_file", path="nope.py")
    assert not result.ok and "no such file" in result.content and "nope.py" in result.content


def test_a_missing_path_error_names_the_files_it_may_have_meant(tools, tmp_path):
    wrong_package = one(tools, "read_file", path="shop/money.py")
    assert not wrong_package.ok
    assert wrong_package.content == "error: no such file or folder: shop/money.py; did you mean pkg/money.py?"
    typo = one(tools, "edit_file", path="pkg/word.py", old="x", new="y")
    assert "; did you mean pkg/words.py" in typo.content  # the closest path first
    assert one(tools, "read_file", path="zzz/qqq.md").content == "error: no such file or folder: zzz/qqq.md"
    with Sandbox.create(FILES) as box, Toolbox(box, ToolConfig(missing_path_hints=0)) as bare:
        assert one(bare, "read_file", path="shop/money.py").content == "error: no such file or folder: shop/money.py"
    # A workspace of many files is walked only so far.
    for i in range(30):
        (tmp_path / f"d{i:02d}").mkdir()
        (tmp_path / f"d{i:02d}" / "money.py").write_text("")
    assert similar_paths("shop/money.py", tmp_path, 3) == ["d00/money.py", "d01/money.py", "d02/money.py"]
    assert len(similar_paths("shop/money.py", tmp_path, 50, max_files=10)) == 10


def test_list_dir_two_levels(tools):
    listing = one(tools, "list_dir").content.splitlines()
    assert "pkg/" in listing and "pkg/words.py" in listing and "notes.txt" in listing


def test_grep_regex_glob_and_cap(tools):
    hits = one(tools, "grep", pattern=r"def \w+_words", glob="*.py").content
    assert hits.startswith("pkg/words.py:1:def reverse_words")
    assert "no matches" in one(tools, "grep", pattern="zzz_absent").content
    assert "notes.txt" not in one(tools, "grep", pattern="line", glob="*.py").content
    tools.execute([ToolCall("w", "edit_file", {"path": "many.txt", "old": "", "new": "hit\n" * 500})])
    capped = one(tools, "grep", pattern="hit", path="many.txt").content
    assert capped.count("\n") == tools.config.grep_max_matches and "[cut: 450 more matches" in capped
    bad = one(tools, "grep", pattern="(unclosed")
    assert not bad.ok and "grep failed" in bad.content


def test_edit_file_unique_missing_ambiguous_and_create(tools):
    assert one(tools, "edit_file", path="pkg/money.py", old="(1 + rate)", new="(1.0 + rate)").ok
    assert "1.0 + rate" in tools.sandbox.read_text("pkg/money.py")
    missing = one(tools, "edit_file", path="pkg/money.py", old="no such text", new="x")
    assert not missing.ok and "not found" in missing.content
    ambiguous = one(tools, "edit_file", path="notes.txt", old="line", new="row")
    assert not ambiguous.ok and "occurs 3 times" in ambiguous.content
    assert tools.sandbox.read_text("notes.txt") == FILES["notes.txt"]  # a failed edit changes nothing
    created = one(tools, "edit_file", path="new/dir/mod.py", old="", new="X = 1\n")
    assert created.ok and tools.sandbox.read_text("new/dir/mod.py") == "X = 1\n"
    again = one(tools, "edit_file", path="new/dir/mod.py", old="", new="X = 2\n")
    assert not again.ok and "already exists" in again.content


def test_created_file_is_writable_from_inside_the_sandbox(tools):
    one(tools, "edit_file", path="made_by_host.txt", old="", new="a\n")
    result = one(tools, "run_command", command="echo b >> made_by_host.txt && cat made_by_host.txt")
    assert "a\nb" in result.content


@pytest.mark.parametrize(
    "name,arguments",
    [
        ("read_file", {"path": "../../etc/passwd"}),
        ("read_file", {"path": "/etc/passwd"}),
        ("edit_file", {"path": "../outside.py", "old": "", "new": "x"}),
        ("edit_file", {"path": "/tmp/outside.py", "old": "", "new": "x"}),
        ("list_dir", {"path": ".."}),
        ("grep", {"pattern": "root", "path": "/etc"}),
        ("grep", {"pattern": "root", "path": "../.."}),
    ],
)
def test_paths_outside_the_workspace_are_refused(tools, name, arguments):
    result = one(tools, name, **arguments)
    assert not result.ok and "refused path" in result.content


def test_symlink_escape_is_refused_by_every_file_tool(tools):
    one(tools, "run_command", command="ln -s /etc/passwd leak && ln -s / rootdir")
    for name, arguments in [
        ("read_file", {"path": "leak"}),
        ("read_file", {"path": "rootdir/etc/passwd"}),
        ("edit_file", {"path": "leak", "old": "root", "new": "x"}),
        ("edit_file", {"path": "rootdir/tmp/evil", "old": "", "new": "x"}),
        ("list_dir", {"path": "rootdir"}),
        ("grep", {"pattern": "root", "path": "leak"}),
    ]:
        result = one(tools, name, **arguments)
        assert not result.ok, (name, arguments, result.content)
    listing = one(tools, "grep", pattern="root:").content  # a directory-wide grep does not follow links
    assert "no matches" in listing
    hits = one(tools, "semantic_search", query="root user account password").content
    assert "leak" not in hits and "root:x:0" not in hits


@pytest.mark.parametrize(
    "call,reason",
    [
        (ToolCall("x", "delete_everything", {}), "unknown tool"),
        (ToolCall("x", "read_file", {}), "missing required argument"),
        (ToolCall("x", "read_file", {"path": 3}), "must be a string"),
        (ToolCall("x", "read_file", {"path": "a", "mode": "rb"}), "has no argument"),
        (ToolCall("x", "read_file", {"path": "a", "start_line": True}), "must be a integer"),
        (ToolCall("x", "edit_file", {}, error="bad JSON: Expecting ',' delimiter"), "bad JSON"),
    ],
)
def test_invalid_calls_are_answered_with_the_reason(tools, call, reason):
    (result,) = tools.execute([call])
    assert not result.ok and result.content.startswith("error: invalid tool call") and reason in result.content


def test_validate_arguments_accepts_good_calls():
    assert validate_arguments("read_file", {"path": "a.py", "start_line": 1}) is None
    assert validate_arguments("finish", {}) is None


def test_parallel_results_come_back_in_call_order_and_edits_stay_ordered(tools):
    calls = [
        ToolCall("1", "read_file", {"path": "notes.txt"}),
        ToolCall("2", "edit_file", {"path": "notes.txt", "old": "line one", "new": "first"}),
        ToolCall("3", "edit_file", {"path": "notes.txt", "old": "first", "new": "FIRST"}),
        ToolCall("4", "read_file", {"path": "notes.txt"}),
        ToolCall("5", "grep", {"pattern": "FIRST"}),
        ToolCall("6", "run_command", {"command": "head -1 notes.txt"}),
        ToolCall("7", "list_dir", {}),
    ]
    results = tools.execute(calls)
    assert [r.call_id for r in results] == ["1", "2", "3", "4", "5", "6", "7"]
    assert results[0].content.startswith("line one")  # ran before the edits
    assert results[2].ok and results[3].content.startswith("FIRST")  # saw both edits, in order
    assert "notes.txt:1:FIRST" in results[4].content
    assert "FIRST" in results[5].content


def test_conflict_rules():
    read_a = ToolCall("r", "read_file", {"path": "a.py"})
    read_b = ToolCall("r", "read_file", {"path": "b.py"})
    edit_a = ToolCall("e", "edit_file", {"path": "a.py", "old": "", "new": ""})
    grep = ToolCall("g", "grep", {"pattern": "x"})
    run = ToolCall("c", "run_command", {"command": "true"})
    assert not _conflicts(read_a, read_b) and not _conflicts(read_a, grep) and not _conflicts(grep, read_a)
    assert _conflicts(read_a, edit_a) and _conflicts(edit_a, read_a) and _conflicts(edit_a, grep)
    assert not _conflicts(read_b, edit_a)
    assert _conflicts(read_b, run) and _conflicts(run, read_b) and _conflicts(grep, run)


def test_semantic_search_finds_by_meaning_and_stays_current(tools):
    top = one(tools, "semantic_search", query="put the words of a sentence in the opposite order", top_k=1)
    assert top.ok and top.content.startswith("pkg/words.py:1-")
    index = tools._index
    embedded = index.embedded_files
    tools.execute([ToolCall("e", "edit_file", {"path": "pkg/geo.py", "old": "",
                                                "new": "def haversine_distance(lat1, lon1, lat2, lon2):\n"
                                                       "    '''Great-circle distance between two points on "
                                                       "Earth.'''\n"})])
    top = one(tools, "semantic_search", query="distance between two places on the globe", top_k=1)
    assert top.content.startswith("pkg/geo.py:1-")
    assert index.embedded_files == embedded + 1  # only the new file was embedded
    one(tools, "run_command", command="rm pkg/geo.py")
    assert "pkg/geo.py" not in one(tools, "semantic_search", query="distance on the globe").content


def test_run_command_reports_exit_code(tools):
    result = one(tools, "run_command", command="echo out; echo err >&2; exit 3")
    assert result.ok and "out" in result.content and "err" in result.content and "exit code 3" in result.content


def test_searches_launch_last_unless_something_waits_on_them():
    search = ToolCall("s", "semantic_search", {"query": "q"})
    grep = ToolCall("g", "grep", {"pattern": "x"})
    read = ToolCall("r", "read_file", {"path": "a.py"})
    edit = ToolCall("e", "edit_file", {"path": "a.py", "old": "", "new": ""})

    def order(calls):
        deps = [[j for j in range(i) if _conflicts(calls[j], c)] for i, c in enumerate(calls)]
        return _launch_order(calls, deps)

    assert order([search, grep, read]) == [1, 2, 0]
    assert order([search, grep, edit]) == [0, 1, 2]  # the edit must wait for the search: keep order
