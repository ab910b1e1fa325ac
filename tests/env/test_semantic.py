"""Semantic search at repository scale: chunks aligned to definitions, the static embedder distilled
from MiniLM, vectors cached per chunk, incremental re-indexing.

The static embedder's table is distilled once per machine into the embedder cache (the first test
that needs it pays ~1 min on two cores, every later run reads it), never per test.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from flywheel.cli import main
from flywheel.env import semantic
from flywheel.env.embedders import StaticEmbedder, distill, get_embedder, table_path
from flywheel.env.repos import write_tree
from flywheel.env.sandbox import Sandbox
from flywheel.env.semantic import EmbeddingCache, SemanticIndex, chunk_file
from flywheel.env.tools import Toolbox, ToolConfig
from flywheel.env.toolspec import ToolCall

ROOT = Path(__file__).parents[2]

MODULE = '''"""Shapes."""

import math

# The area of a circle.
@staticmethod
def circle_area(r):
    return math.pi * r * r


class Square:
    def __init__(self, side):
        self.side = side

    def area(self):
        return self.side ** 2


TAU = 2 * math.pi
'''

FILES = {
    "geo/shapes.py": MODULE,
    "geo/distance.py": "def haversine(lat1, lon1, lat2, lon2):\n    '''Great-circle distance between two points on"
                       " the Earth, in kilometres.'''\n    return 6371 * lat1 * lon2\n",
    "text/words.py": "def reverse_words(sentence):\n    '''Put the words of a sentence in the opposite order.'''\n"
                     "    return ' '.join(reversed(sentence.split()))\n",
    "money/tax.py": "def add_sales_tax(price, rate):\n    '''The price a customer pays once sales tax is added.'''\n"
                    "    return price * (1 + rate)\n",
    "README.md": "# geo\n\nShapes and distances.\n",
}


@pytest.fixture(scope="module")
def static():
    return get_embedder("static")  # distils the table if this machine has none (once, not per test)


def test_python_files_are_cut_at_definitions_with_their_decorators_and_comments():
    chunks = chunk_file("geo/shapes.py", MODULE)
    spans = [(c.start_line, c.end_line, c.text.splitlines()[0]) for c in chunks]
    assert spans == [(1, 3, '"""Shapes."""'), (5, 8, "# The area of a circle."), (11, 16, "class Square:"),
                     (19, 19, "TAU = 2 * math.pi")]
    lines = MODULE.splitlines()
    for c in chunks:
        assert c.text == "\n".join(lines[c.start_line - 1 : c.end_line])
    # A long class is cut into its methods, each embedded with its class as context.
    long_class = "class Big:\n" + "".join(f"    def m{i}(self):\n" + "        x = 1\n" * 30 for i in range(4))
    inner = chunk_file("big.py", long_class)
    assert [(c.start_line, c.end_line) for c in inner] == [(1, 1), (2, 32), (33, 63), (64, 94), (95, 125)]
    assert {c.context for c in inner} == {"class Big"}
    assert all(c.end_line - c.start_line + 1 <= 80 for c in inner)
    # Text that does not parse (mid-edit) and files that are not Python: windows of lines.
    broken = chunk_file("half.py", "def f(:\n" + "x = 1\n" * 40)
    assert [(c.start_line, c.end_line) for c in broken] == [(1, 24), (17, 40), (33, 41)]


def test_static_embedder_finds_by_meaning(static, tmp_path):
    with Sandbox.create(FILES) as box:
        index = SemanticIndex(box.workspace, EmbeddingCache(tmp_path / "cache"))
        for query, path in (("put the words of a sentence in the opposite order", "text/words.py"),
                            ("distance between two places on the globe", "geo/distance.py"),
                            ("how much a customer pays with tax", "money/tax.py")):
            assert index.search(query, top_k=1)[0].path == path, query
        vectors = static.embed(["merge", "", "the distance between two cities", "(self, the) -> 42"])
        assert vectors.shape == (4, static.dim) and np.allclose(np.linalg.norm(vectors[[0, 2]], axis=1), 1)
        # No weighted token (empty; only stopwords, punctuation and digits): a zero vector, matching nothing.
        assert not vectors[1].any() and not vectors[3].any()


def test_vectors_are_cached_per_chunk_and_an_edit_reembeds_only_its_chunk(static, tmp_path, monkeypatch):
    del static
    cache = EmbeddingCache(tmp_path / "cache")
    with Sandbox.create(FILES) as first, Sandbox.create(FILES) as second:
        cold = SemanticIndex(first.workspace, cache)
        cold.refresh()
        chunks = cold.chunk_count()
        assert cold.embedded_chunks == chunks > len(FILES)
        warm = SemanticIndex(second.workspace, cache)  # another sandbox, the same files: nothing embedded
        with monkeypatch.context() as patched:  # nor parsed: where each file was cut is cached too
            patched.setattr(semantic, "chunk_file", lambda *_: pytest.fail("parsed a cached file again"))
            warm.refresh()
        assert warm.embedded_chunks == 0 and cache.hits == chunks
        assert warm._files["geo/shapes.py"].chunks == cold._files["geo/shapes.py"].chunks
        # Edit one method of the class: its chunk alone is new, the module's other chunks are reused.
        second.write_text("geo/shapes.py", MODULE.replace("self.side ** 2", "self.side * self.side"))
        warm.refresh()
        assert warm.embedded_chunks == 1 and warm.embedded_files == len(FILES) + 1
        warm.refresh()  # nothing changed: nothing re-read
        assert warm.embedded_files == len(FILES) + 1
    # Another process reads the same SQLite file: nothing to embed.
    script = ("import sys; from pathlib import Path; from flywheel.env.semantic import EmbeddingCache, SemanticIndex\n"
              "from flywheel.env.repos import write_tree\n"
              f"files = {FILES!r}\nroot = Path(sys.argv[1]); write_tree(root, files)\n"
              "index = SemanticIndex(root, EmbeddingCache(Path(sys.argv[2]))); index.refresh()\n"
              "print(index.embedded_chunks, index.chunk_count())")
    run = subprocess.run([sys.executable, "-c", script, str(tmp_path / "ws"), str(tmp_path / "cache")],
                         capture_output=True, text=True, check=True, cwd=ROOT)
    assert run.stdout.split() == ["0", str(chunks)], run.stderr[-2000:]


def test_the_table_is_distilled_once_and_reused(static):
    path = table_path()
    stamp = path.stat().st_mtime_ns
    assert distill(progress=lambda line: pytest.fail(f"distilled again: {line}")) == path
    assert path.stat().st_mtime_ns == stamp
    again = StaticEmbedder(path)
    assert np.array_equal(again.embed(["merge two dicts"]), static.embed(["merge two dicts"]))


@pytest.mark.slow  # loading MiniLM: ~10 s idle, ~35 s at load ~20
def test_minilm_stays_selectable_in_the_tool_config(tmp_path, monkeypatch):
    monkeypatch.setenv("FLYWHEEL_EMBED_CACHE", str(tmp_path / "cache"))
    with Sandbox.create(FILES) as box, Toolbox(box, ToolConfig(search_embedder="minilm")) as tools:
        [result] = tools.execute([ToolCall("s", "semantic_search",
                                           {"query": "put the words of a sentence in the opposite order"})])
        assert result.ok and result.content.startswith("text/words.py:1-"), result.content
        assert tools._index.embedder.name == "all-MiniLM-L6-v2" and tools._index.embedder.dim == 384
    with pytest.raises(ValueError, match="search_embedder"):
        ToolConfig(search_embedder="word2vec")


def test_index_build_fills_the_cache_an_episode_then_reads(static, tmp_path, monkeypatch, capsys):
    del static
    monkeypatch.setenv("FLYWHEEL_EMBED_CACHE", str(tmp_path / "cache"))
    write_tree(tmp_path / "repo", FILES)
    assert main(["index", "build", str(tmp_path / "repo")]) == 0
    assert f"{len(FILES)} files" in capsys.readouterr().out
    with Sandbox.create(FILES) as box:  # an episode's sandbox of the same repository: nothing to embed
        index = SemanticIndex(box.workspace)
        index.refresh()
        assert index.embedded_chunks == 0 and index.chunk_count() > len(FILES)
    assert main(["index", "build", str(tmp_path / "missing")]) == 2  # a clear error, not a traceback
    assert "neither a folder nor an sdist" in capsys.readouterr().err
