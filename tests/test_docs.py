"""The README and the pages under docs/ link inside the repository only, and every link lands; the
README is a first page: where to start reading and the folder map near the top, a short table of
the pages that hold the features and their figures, and only commands that exist."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from flywheel.cli import build_parser

ROOT = Path(__file__).resolve().parents[1]
LINK = re.compile(r"\]\(([^)\s]+)\)")
PAGES = sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "docs").glob("*.md"))
README = (ROOT / "README.md").read_text()


def anchors(markdown: str) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces as hyphens."""
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-")
            for h in re.findall(r"^#+ (.+)$", markdown, flags=re.M)}


@pytest.mark.parametrize("name", ["README.md", *PAGES])
def test_links_stay_inside_the_repository_and_resolve(name):
    doc = ROOT / name
    text = doc.read_text()
    links = LINK.findall(text)
    assert name != "README.md" or "docs/ARCHITECTURE.md" in links
    for link in links:
        assert "://" not in link, f"{name} links outside the repository: {link}"
        path, _, anchor = link.partition("#")
        target = (doc.parent / path).resolve() if path else doc
        assert target.is_relative_to(ROOT) and target.exists(), f"{name}: {link} is no file of the repository"
        if anchor:
            assert anchor in anchors(target.read_text()), f"{name}: {link} names no heading of {target.name}"


def test_the_readme_links_every_page_of_docs():
    linked = {link.partition("#")[0] for link in LINK.findall(README)}
    assert len(PAGES) > 5 and set(PAGES) <= linked, f"pages the README does not link: {set(PAGES) - linked}"


def test_the_readme_starts_a_newcomer_and_keeps_its_figures_on_the_pages():
    top = README[: README.index("## The `flywheel` command")]
    assert "flywheel/rl/train.py" in top and "flywheel/live/cycle.py" in top
    assert "## The two commands" in top and "## A 2-minute quick look" in top and "## Folders" in top
    assert "flywheel demo --config configs/quick.toml" in top
    # The folder map names every package of flywheel.
    packages = sorted(p.parent.name for p in (ROOT / "flywheel").glob("*/__init__.py"))
    assert all(f"\n  {name}/" in top for name in packages), packages
    assert len(README.splitlines()) < 200, "the README is a first page: features and their figures go to docs/"


@pytest.mark.parametrize("name", ["README.md", *PAGES])
def test_the_commands_the_docs_name_exist(name):
    text = (ROOT / name).read_text()
    # A command: a line of a code block, or an inline code span, that starts with it.
    blocks = "\n".join(re.findall(r"```.*?```", text, flags=re.S))
    spans = "\n".join(re.findall(r"`([^`\n]+)`", text))
    code = blocks + "\n" + spans
    makefile = (ROOT / "Makefile").read_text()
    for target in set(re.findall(r"^\s*(?:time )?make ([a-z][\w-]*)", code, flags=re.M)):
        assert re.search(rf"^{re.escape(target)}:", makefile, flags=re.M), f"{name}: `make {target}` is no target"
    commands = build_parser().format_help()
    for command in set(re.findall(r"^\s*(?:\.venv/bin/)?flywheel ([a-z]+)\b", code, flags=re.M)):
        assert re.search(rf"\b{command}\b", commands), f"{name}: `flywheel {command}` is no command"
    for config in set(re.findall(r"\bconfigs/[\w-]+\.toml\b", text)):
        assert (ROOT / config).is_file(), f"{name}: {config} does not exist"
