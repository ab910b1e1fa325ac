"""The README and the architecture document link inside the repository only, and every link lands."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LINK = re.compile(r"\]\(([^)\s]+)\)")


def anchors(markdown: str) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces as hyphens."""
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-")
            for h in re.findall(r"^#+ (.+)$", markdown, flags=re.M)}


@pytest.mark.parametrize("name", ["README.md", "docs/ARCHITECTURE.md"])
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
