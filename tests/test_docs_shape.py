"""The documentation stays readable for a newcomer: README.md under 200 lines, no paragraph or
list item in README.md or docs/*.md over 150 words, and every `## ` section of BENCHMARKS.md
opening with a table."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
MAX_WORDS = 150


def paragraphs(text: str) -> list[str]:
    """Prose units outside code fences: a paragraph, or one list item with its wrapped lines."""
    units: list[list[str]] = []
    current: list[str] = []
    fenced = False
    for line in [*text.splitlines(), ""]:
        if line.lstrip().startswith("```"):
            fenced = not fenced
            line = ""
        if fenced:
            continue
        item = re.match(r"\s*(- |\d+\. )", line)
        if not line.strip() or line.startswith(("#", "|")) or item:
            if current:
                units.append(current)
            current = [line] if item else []
        else:
            current.append(line)
    return [" ".join(u) for u in units]


def test_paragraphs_counts_items_and_skips_code() -> None:
    text = "a b\nc\n\n- d e\n  f\n- g\n\n```\n" + "x " * 500 + "\n```\n| t | u |\n"
    assert [len(p.split()) for p in paragraphs(text)] == [3, 4, 2]


def test_readme_stays_short() -> None:
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 200, len(lines)
    assert "make run" in "\n".join(lines) and "make test" in "\n".join(lines)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_no_paragraph_is_a_wall_of_text(page: Path) -> None:
    long = [p[:60] for p in paragraphs(page.read_text()) if len(p.split()) > MAX_WORDS]
    assert not long, f"{page.name}: paragraphs over {MAX_WORDS} words (make them bullets): {long}"


def test_every_benchmark_section_opens_with_its_table() -> None:
    text = (ROOT / "BENCHMARKS.md").read_text()
    sections = re.split(r"(?m)^(?=## )", text)[1:]
    assert sections
    for section in sections:
        body = [ln for ln in section.splitlines()[1:] if ln.strip()]
        first = next(i for i, ln in enumerate(body) if ln.startswith("|"))
        captions = body[:first]  # at most a caption or two: what the table counts
        assert len(" ".join(captions).split()) <= 80, (section.splitlines()[0], captions)
        assert not any(ln.startswith("- ") for ln in captions), section.splitlines()[0]
