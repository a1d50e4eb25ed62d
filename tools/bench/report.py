"""BENCHMARKS.md: each benchmark owns one `## ` section and replaces it in place."""

from __future__ import annotations

from pathlib import Path


def replace_section(path: Path, heading: str, section: str) -> None:
    """Replaces the section starting at the line `heading` (up to the next `## ` heading) in
    `path` with `section`, or appends `section` when there is no such heading yet."""
    text = path.read_text() if path.exists() else "# Benchmarks\n\n"
    lines = text.splitlines(keepends=True)
    start = next((i for i, ln in enumerate(lines) if ln.rstrip() == heading), None)
    if start is None:
        path.write_text(text.rstrip("\n") + "\n\n\n" + section)
        return
    end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith("## ")), len(lines))
    tail = "".join(lines[end:])
    path.write_text(
        "".join(lines[:start]) + section.rstrip("\n") + "\n" + ("\n\n" + tail if tail else "")
    )
