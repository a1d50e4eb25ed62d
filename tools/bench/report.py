"""BENCHMARKS.md: each benchmark owns one `## ` section and replaces it in place.

`layout` gives every section the same shape, whatever its writer: the section opens with its
tables, and the prose after them is short bullets (one sentence each, source lines wrapped at
100 characters). It only moves and breaks text: every word a writer wrote stays. It never runs
a benchmark; `layout` reads nothing but the text it is given.

    python tools/bench/report.py BENCHMARKS.md   # lay out every section of a file in place
"""

from __future__ import annotations

import re
import sys
import textwrap
from pathlib import Path

WIDTH = 100
LABEL = re.compile(r"^(Method|Reading|Why|Parameters)( \([^()]*\))?[.:] +")
ABBREV = ("e.g.", "i.e.", "vs.", "cf.", "etc.", "approx.")


def replace_section(path: Path, heading: str, section: str) -> None:
    """Replaces the section starting at the line `heading` (up to the next `## ` heading) in
    `path` with `section` laid out by `layout`, or appends it when there is no such heading
    yet."""
    section = layout(section)
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


def _blocks(body: str) -> list[tuple[str, list[str]]]:
    """Blank-line separated blocks as (kind, items): 'table' keeps its rows, 'list' one joined
    string per item, 'para' one joined string."""
    out: list[tuple[str, list[str]]] = []
    for raw in re.split(r"\n\s*\n", body.strip("\n")):
        lines = [ln for ln in raw.split("\n") if ln.strip()]
        if not lines:
            continue
        if all(ln.lstrip().startswith("|") for ln in lines):
            out.append(("table", lines))
        elif re.match(r"(- |\d+\. )", lines[0]):
            items: list[str] = []
            for ln in lines:
                if re.match(r"(- |\d+\. )", ln):
                    items.append(ln.strip())
                else:  # a wrapped line, or a sub-bullet `_item` made of a sentence
                    items[-1] += " " + re.sub(r"^\s+- ", "", ln).strip()
            out.append(("list", items))
        else:
            out.append(("para", [" ".join(ln.strip() for ln in lines)]))
    return out


def sentences(text: str) -> list[str]:
    """Splits at '. ' (or '! ', '? ') outside parentheses and backticks, before an upper-case
    letter, a digit or markup; never after a known abbreviation or an ellipsis."""
    parts, depth, tick, start = [], 0, False, 0
    for i, ch in enumerate(text):
        if ch == "`":
            tick = not tick
        elif not tick and ch == "(":
            depth += 1
        elif not tick and ch == ")":
            depth = max(0, depth - 1)
        elif (
            ch in ".!?"
            and not tick
            and depth == 0
            and text[i + 1 : i + 2] == " "
            and re.match(r" +[A-Z0-9*`'\"(~]", text[i + 1 :])
            and not text[start : i + 1].endswith(ABBREV)
            and not text[: i + 1].endswith("..")
        ):
            parts.append(text[start : i + 1].strip())
            start = i + 1
    parts.append(text[start:].strip())
    return [p for p in parts if p]


def _semicolons(text: str) -> list[str]:
    """A sentence made of '; '-separated parts (outside parentheses): its parts."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        depth += ch == "("
        depth -= ch == ")" and depth > 0
        if ch == ";" and depth == 0 and text[i + 1 : i + 2] == " ":
            parts.append(text[start:i].strip())
            start = i + 1
    parts.append(text[start:].strip())
    return parts


def _wrap(text: str, first: str = "", rest: str = "") -> list[str]:
    return textwrap.wrap(
        text,
        WIDTH,
        initial_indent=first,
        subsequent_indent=rest,
        break_long_words=False,
        break_on_hyphens=False,
    )


def _bullets(text: str, indent: str = "", semicolons: bool = False) -> list[str]:
    """One bullet per sentence; with `semicolons` (a list of parameters), one per '; ' part."""
    out: list[str] = []
    for s in sentences(text):
        parts = _semicolons(s) if semicolons else [s]
        for part in parts:
            out += _wrap(part, indent + "- ", indent + "  ")
    return out


def _item(text: str) -> list[str]:
    """One list item: kept whole when short, else its first sentence with the rest as
    sub-bullets."""
    marker, body = re.match(r"(- |\d+\. )(.*)", text).groups()
    pad = " " * len(marker)
    ss = sentences(body)
    if len(body) <= 300 or len(ss) == 1:
        return _wrap(body, marker, pad)
    return _wrap(ss[0], marker, pad) + _bullets(" ".join(ss[1:]), "    ")


def _caption(kind: str, items: list[str], nxt: str | None) -> bool:
    if kind != "para":
        return False
    text = items[0]
    full_bold = text.startswith("**") and text.endswith("**")
    return (
        text.endswith(":")
        or (text.startswith("**") and not full_bold)
        or (nxt == "table" and len(text) <= 120)
    )


def _para(text: str) -> list[str]:
    if len(text) <= 200 or (text.startswith("**") and text.endswith("**")):
        return _wrap(text)
    if text.startswith("Measured ") and len(text.split()) <= 120:
        return _wrap(text)  # when and where: one short paragraph under the tables
    label = LABEL.match(text)
    if label:
        head = text[: label.end()].rstrip()
        rest = text[label.end() :]
        rest = rest[:1].upper() + rest[1:]  # "Why: what ..." → "Why:" and "- What ..."
        return [head[:-1] + ":", "", *_bullets(rest, semicolons=label.group(1) == "Parameters")]
    return _bullets(text)


def layout(section: str) -> str:
    """The section's heading, then its first run of tables (with the captions between and just
    before them), then everything else in its order; prose longer than 200 characters as one
    bullet per sentence."""
    heading, _, body = section.strip("\n").partition("\n")
    blocks = _blocks(body)
    kinds = [k for k, _ in blocks]
    first = kinds.index("table") if "table" in kinds else None
    if first is not None:
        lo = first
        while lo > 0 and _caption(*blocks[lo - 1], kinds[lo]):
            lo -= 1
        hi = first + 1
        while hi < len(blocks):
            if kinds[hi] == "table":
                hi += 1
            elif _caption(*blocks[hi], kinds[hi + 1] if hi + 1 < len(blocks) else None) and (
                hi + 1 < len(blocks) and kinds[hi + 1] == "table"
            ):
                hi += 2
            else:
                break
        blocks = blocks[lo:hi] + blocks[:lo] + blocks[hi:]
    out = [heading]
    for kind, items in blocks:
        out.append("")
        if kind == "table":
            out += items
        elif kind == "list":
            for item in items:
                out += _item(item)
        elif _caption(kind, items, None):
            out += _wrap(items[0])
        else:
            out += _para(items[0])
    return "\n".join(out) + "\n"


def layout_file(path: Path) -> None:
    """Lays out every `## ` section of `path` in place (the text before the first is kept)."""
    text = path.read_text()
    parts = re.split(r"(?m)^(?=## )", text)
    head, sections = parts[0], parts[1:]
    path.write_text(head + "\n\n".join(layout(s).rstrip("\n") + "\n" for s in sections))


if __name__ == "__main__":
    for name in sys.argv[1:]:
        layout_file(Path(name))
