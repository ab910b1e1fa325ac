"""Semantic code search over a workspace: chunks aligned to functions and classes, embedded once.

A `SemanticIndex` is built lazily on the first query and kept current: each query first re-checks
file sizes and mtimes and re-chunks only the files that changed, so edits made by tools or by
commands are always searchable. Only chunks whose text is new are embedded: an edit to one function
re-embeds that function's chunk, not its file.

Chunks: a Python file is cut at its top-level functions and classes (decorators and the comments
just above a definition go with it; the statements between definitions form chunks of their own);
a class longer than `MAX_CHUNK_LINES` is cut into its methods, and anything still longer into
windows of lines, as are files that are not Python or do not parse. A hit names its path and line
range. Each chunk is embedded with its path (and its class, for a method) as its first line.

Embeddings are cached by chunk content: a chunk's vector is stored under the hash of (embedder,
text) in one SQLite file (`EmbeddingCache`, default `embeddings/` beside the environment cache, or
$FLYWHEEL_EMBED_CACHE), so an identical chunk is embedded once for every sandbox, episode and
process that indexes it: 1,000 sandboxes of one repository embed it once. Where each file version
was cut is stored beside the vectors, so a warm index neither parses nor embeds. The file grows
with every distinct chunk indexed (~1 KB a chunk with the static embedder) and may be deleted at
any time;
`flywheel index build` fills it for a repository before any episode needs it.

The embedder (`flywheel.env.embedders`) is the static one distilled from MiniLM unless the config
asks for MiniLM itself (`ToolConfig.search_embedder`). `bench/repos.py` measures toolz cold, warm,
after an edit, a 2,000-file repository, and each embedder's recall.
"""

from __future__ import annotations

import ast
import hashlib
import json
import os
import sqlite3
import stat
import threading
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from flywheel.env.embedders import Embedder, get_embedder
from flywheel.env.environments import cache_dir
from flywheel.env.sandbox import walk_workspace

DEFAULT_EMBEDDER = "static"
CHUNK_LINES = 24  # windows for text that is not Python: long enough to hold a paragraph or a small function
CHUNK_OVERLAP = 8
MAX_CHUNK_LINES = 80  # a definition longer than this is cut (methods, then windows): a mean over more says little
MAX_FILE_BYTES = 256 * 1024  # larger files are data, not code worth embedding
TEXT_SUFFIXES = {".py", ".md", ".txt", ".toml", ".cfg", ".json", ".yaml", ".yml", ".sh", ".ini", ".rst"}
EMBED_CACHE_ENV = "FLYWHEEL_EMBED_CACHE"
# In each file's chunking key: bump the version when the rules of chunk_file change.
CHUNKER = f"defs-v1-{CHUNK_LINES}-{CHUNK_OVERLAP}-{MAX_CHUNK_LINES}"


def load_embedder(name: str = DEFAULT_EMBEDDER) -> Embedder:
    """The process-wide embedder semantic search uses: callers load it up front so that the first
    search of an episode does not pay for reading (or, once per machine, distilling) it."""
    return get_embedder(name)


class EmbeddingCache:
    """Chunk vectors by content hash, in one SQLite file shared by every process that indexes.

    SQLite in WAL mode lets many readers and one writer at a time share the file; a row of the
    wrong size counts as a miss. `folder=None`: no caching."""

    def __init__(self, folder: Path | None):
        self.folder = folder
        self.hits = 0
        self.misses = 0
        self._db: sqlite3.Connection | None = None
        self._lock = threading.Lock()

    @classmethod
    def default(cls) -> EmbeddingCache:
        return cls(Path(os.environ[EMBED_CACHE_ENV]) if os.environ.get(EMBED_CACHE_ENV)
                   else cache_dir().parent / "embeddings")

    @staticmethod
    def key(embedder: str, text: str) -> str:
        return hashlib.sha256(f"{embedder}\0{text}".encode("utf-8", "replace")).hexdigest()

    def _connection(self) -> sqlite3.Connection:
        if self._db is None:
            self.folder.mkdir(parents=True, exist_ok=True)
            self._db = sqlite3.connect(self.folder / "vectors.sqlite", timeout=60, check_same_thread=False)
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("CREATE TABLE IF NOT EXISTS vectors (key TEXT PRIMARY KEY, vector BLOB NOT NULL)")
            self._db.execute("CREATE TABLE IF NOT EXISTS chunkings (key TEXT PRIMARY KEY, spans TEXT NOT NULL)")
        return self._db

    def _select(self, table: str, keys: list[str]) -> list[tuple[str, object]]:
        if self.folder is None or not keys:
            return []
        rows = []
        with self._lock:
            db = self._connection()
            for start in range(0, len(keys), 500):  # SQLite's limit on bound parameters
                part = keys[start : start + 500]
                rows += db.execute(f"SELECT * FROM {table} WHERE key IN ({','.join('?' * len(part))})", part)
        return rows

    def _insert(self, table: str, rows: list[tuple[str, object]]) -> None:
        if self.folder is None or not rows:
            return
        with self._lock:
            db = self._connection()
            with db:  # one transaction: one fsync for the whole batch
                db.executemany(f"INSERT OR REPLACE INTO {table} VALUES (?, ?)", rows)

    def get_many(self, keys: list[str], dim: int) -> dict[str, np.ndarray]:
        found = {key: np.frombuffer(blob, dtype=np.float32) for key, blob in self._select("vectors", keys)
                 if len(blob) == 4 * dim}
        self.hits += len(found)
        self.misses += len(set(keys)) - len(found)
        return found

    def put_many(self, items: Iterable[tuple[str, np.ndarray]]) -> None:
        self._insert("vectors", [(key, np.asarray(vector, dtype=np.float32).tobytes()) for key, vector in items])

    def get_chunkings(self, keys: list[str]) -> dict[str, list[tuple[int, int, str]]]:
        """Where each file version was cut, by file key: (start_line, end_line, context) a chunk. A
        warm index reads these instead of parsing the file again (parsing is most of its time)."""
        return {key: [tuple(span) for span in json.loads(spans)] for key, spans in self._select("chunkings", keys)}

    def put_chunkings(self, items: dict[str, list[Chunk]]) -> None:
        self._insert("chunkings", [(key, json.dumps([(c.start_line, c.end_line, c.context) for c in chunks]))
                                   for key, chunks in items.items()])


@dataclass(frozen=True)
class Hit:
    path: str
    start_line: int
    end_line: int
    score: float
    text: str


@dataclass(frozen=True)
class Chunk:
    start_line: int
    end_line: int
    text: str  # the lines shown in a hit
    context: str = ""  # embedded before the text, not shown: the enclosing class of a method

    def embedded(self, rel: str) -> str:
        return f"{rel}{' ' + self.context if self.context else ''}\n{self.text}"


@dataclass
class _FileChunks:
    stamp: tuple[int, int]  # (size, mtime_ns) when indexed
    chunks: list[Chunk]
    keys: list[str]  # each chunk's cache key
    vectors: np.ndarray  # [n_chunks, dim]


def chunk_lines(lines: list[str], first: int = 1, last: int | None = None, context: str = "") -> list[Chunk]:
    """Overlapping windows of lines[first-1:last] (1-based, inclusive), blank windows dropped."""
    last = len(lines) if last is None else last
    step = CHUNK_LINES - CHUNK_OVERLAP
    chunks = []
    for start in range(first, max(last, first) + 1, step):
        end = min(start + CHUNK_LINES - 1, last)
        window = lines[start - 1 : end]
        if any(line.strip() for line in window):
            chunks.append(Chunk(start, end, "\n".join(window), context))
        if end >= last:
            break
    return chunks


def _span(lines: list[str], node: ast.stmt, floor: int) -> tuple[int, int]:
    """A definition's lines: from its first decorator, or the comments right above it, to its end."""
    start = min([node.lineno, *(d.lineno for d in getattr(node, "decorator_list", []))])
    while start - 1 > floor and lines[start - 2].lstrip().startswith("#"):
        start -= 1
    return start, node.end_lineno or node.lineno


def _chunk_body(lines: list[str], body: list[ast.stmt], first: int, last: int, context: str) -> list[Chunk]:
    """Chunks of the statements `body` spanning lines first..last: one per definition, one per run
    of other statements, cut further where longer than MAX_CHUNK_LINES."""
    chunks: list[Chunk] = []
    cursor = first  # the first line not yet in a chunk
    for node in body:
        if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            continue
        start, end = _span(lines, node, cursor - 1)
        if start > cursor:
            chunks += _sized(lines, cursor, start - 1, context)
        if end - start + 1 > MAX_CHUNK_LINES and isinstance(node, ast.ClassDef) and len(node.body) > 1:
            inner = f"{context}.{node.name}" if context else f"class {node.name}"
            chunks += _chunk_body(lines, node.body, start, end, inner)
        else:
            chunks += _sized(lines, start, end, context)
        cursor = end + 1
    if cursor <= last:
        chunks += _sized(lines, cursor, last, context)
    return chunks


def _sized(lines: list[str], first: int, last: int, context: str) -> list[Chunk]:
    while first <= last and not lines[first - 1].strip():  # blank lines around a chunk say nothing
        first += 1
    while last >= first and not lines[last - 1].strip():
        last -= 1
    if first > last:
        return []
    if last - first + 1 > MAX_CHUNK_LINES:
        return chunk_lines(lines, first, last, context)
    return [Chunk(first, last, "\n".join(lines[first - 1 : last]), context)]


def chunk_file(rel: str, text: str) -> list[Chunk]:
    lines = text.splitlines()
    if rel.endswith(".py"):
        try:
            tree = ast.parse(text)
        except (SyntaxError, ValueError):  # a file mid-edit, or NUL bytes: windows still find it
            pass
        else:
            return _chunk_body(lines, tree.body, 1, len(lines), "")
    return chunk_lines(lines)


def _is_text(name: str) -> bool:
    try:
        name.encode("utf-8")  # a file name that is not UTF-8 comes back with lone surrogates
    except UnicodeEncodeError:
        return False
    return True


class SemanticIndex:
    """Embeddings of one workspace's text files, refreshed incrementally before each query."""

    def __init__(self, root: Path, cache: EmbeddingCache | None = None, embedder: str = DEFAULT_EMBEDDER):
        self.root = root
        self.cache = cache if cache is not None else EmbeddingCache.default()
        self.embedder_name = embedder
        self._files: dict[str, _FileChunks] = {}
        self._lock = threading.Lock()
        self.embedded_files = 0  # files (re-)indexed, for tests and stats
        self.embedded_chunks = 0  # chunks the embedder ran on (neither in this index nor in the cache)

    @property
    def embedder(self) -> Embedder:
        return get_embedder(self.embedder_name)

    def _scan(self) -> dict[str, tuple[int, int]]:
        found = {}
        # Regular files only: a FIFO named x.py would block the read, a socket cannot be opened. And
        # names that are UTF-8: the path is embedded with the text, and the tokenizer takes only text.
        for rel, st in walk_workspace(self.root, skip_dir=lambda d: d.startswith(".") or d == "__pycache__"):
            if stat.S_ISREG(st.st_mode) and Path(rel).suffix in TEXT_SUFFIXES and st.st_size <= MAX_FILE_BYTES:
                if _is_text(rel):
                    found[rel] = (st.st_size, st.st_mtime_ns)
        return found

    def chunk_count(self) -> int:
        return sum(len(f.chunks) for f in self._files.values())

    def refresh(self) -> None:
        current = self._scan()
        for rel in set(self._files) - set(current):
            del self._files[rel]
        stale = [rel for rel, stamp in current.items() if rel not in self._files or self._files[rel].stamp != stamp]
        if not stale:
            return
        embedder = self.embedder
        known = {k: v for rel in stale if rel in self._files for k, v in zip(self._files[rel].keys,
                                                                               self._files[rel].vectors, strict=True)}
        sources = {rel: (self.root / rel).read_text(errors="replace") for rel in stale}
        file_keys = {rel: hashlib.sha256(f"{CHUNKER}\0{rel}\0{text}".encode("utf-8", "replace")).hexdigest()
                     for rel, text in sources.items()}
        cut = self.cache.get_chunkings(list(file_keys.values()))
        chunks_by_file, keys_by_file, texts, new_cuts = {}, {}, {}, {}
        for rel in stale:
            if file_keys[rel] in cut:
                lines = sources[rel].splitlines()
                chunks = [Chunk(a, b, "\n".join(lines[a - 1 : b]), context) for a, b, context in cut[file_keys[rel]]]
            else:
                chunks = new_cuts[file_keys[rel]] = chunk_file(rel, sources[rel])
            chunks_by_file[rel] = chunks
            keys_by_file[rel] = []
            for chunk in chunks:
                text = chunk.embedded(rel)
                key = EmbeddingCache.key(embedder.name, text)
                keys_by_file[rel].append(key)
                if key not in known:
                    texts[key] = text
        known.update(self.cache.get_many(list(texts), embedder.dim))
        # One batched embedding over every new chunk the cache lacks: far cheaper than one call per file.
        missing = [key for key in texts if key not in known]
        vectors = embedder.embed([texts[key] for key in missing])  # [n_missing, dim]
        known.update(zip(missing, vectors, strict=True))
        self.cache.put_many(zip(missing, vectors, strict=True))
        self.cache.put_chunkings(new_cuts)
        self.embedded_chunks += len(missing)
        for rel in stale:
            self.embedded_files += 1
            keys = keys_by_file[rel]
            matrix = np.stack([known[k] for k in keys]) if keys else np.zeros((0, embedder.dim), np.float32)
            self._files[rel] = _FileChunks(current[rel], chunks_by_file[rel], keys, matrix)

    def search(self, query: str, top_k: int = 5) -> list[Hit]:
        with self._lock:
            self.refresh()
            entries = [(rel, chunk) for rel, fc in self._files.items() for chunk in fc.chunks]
            if not entries:
                return []
            matrix = np.concatenate([fc.vectors for fc in self._files.values()])  # [n_chunks, dim]
        scores = matrix @ self.embedder.embed([query])[0]  # cosine similarity: rows are unit-norm
        best = np.argsort(-scores)[:top_k]
        return [Hit(entries[i][0], entries[i][1].start_line, entries[i][1].end_line, float(scores[i]),
                    entries[i][1].text) for i in best]
