"""Every document the package cites exists in the repository, and every section it points to (`file.md#section`)
is a heading of that file: docstrings, comments and the bundled presets (whose comments `podsrl presets` prints)
send a reader to files they can open."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).parents[1]
# A cited document: a path with a folder (docs/trl.md) or an upper-case name (README.md); lower-case bare names are
# files podsrl writes (results.md of a comparison), not citations.
CITATION = re.compile(r"(?<![\w./-])((?:[\w-]+/)+[\w-]+\.md|[A-Z][A-Z0-9_]*\.md)(?:#([\w-]+))?")


def heading_anchors(path: Path) -> set[str]:
    """The anchors a Markdown renderer gives the file's headings: lower case, punctuation dropped, spaces to '-'."""
    headings = re.findall(r"^#+ (.+)$", path.read_text(encoding="utf-8"), flags=re.MULTILINE)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in headings}


def citations() -> list[tuple[Path, str, str]]:
    sources = sorted((ROOT / "podsrl").rglob("*.py")) + sorted((ROOT / "podsrl" / "configs").glob("*.yaml"))
    return [(source, doc, anchor) for source in sources
            for doc, anchor in CITATION.findall(source.read_text(encoding="utf-8"))]


def test_the_citation_pattern_finds_documents_and_sections():
    text = "see docs/methods.md#knapsack-rl, README.md and METHODS.md §2; writes results.md"
    assert CITATION.findall(text) == [("docs/methods.md", "knapsack-rl"), ("README.md", ""), ("METHODS.md", "")]


def test_every_cited_document_and_section_exists():
    found = citations()
    for source, doc, anchor in found:
        path = ROOT / doc
        assert path.is_file(), f"{source.relative_to(ROOT)} cites {doc}, which is not in the repository"
        if anchor:
            assert anchor in heading_anchors(path), f"{source.relative_to(ROOT)} cites {doc}#{anchor}: no such heading"
    assert any(doc == "docs/methods.md" for _, doc, _ in found)  # the methods' docstrings cite their section
