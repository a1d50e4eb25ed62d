"""The committed stubs match proto/, and the contracts keep their documented rules."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_committed_stubs_match_protos():
    out = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "codegen.py"), "--check"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr


def test_every_rpc_is_documented():
    for proto in (ROOT / "proto").rglob("*.proto"):
        lines = proto.read_text().splitlines()
        for i, line in enumerate(lines):
            if re.match(r"\s*rpc \w+", line):
                assert lines[i - 1].strip().startswith("//"), f"{proto.name}: {line.strip()}"


def test_every_service_has_status_and_capabilities():
    for proto in (ROOT / "proto").rglob("*_service.proto"):
        text = proto.read_text()
        assert "rpc GetStatus(" in text, proto.name
        assert "rpc GetCapabilities(" in text, proto.name


# A bound stated in words: a size, a count, a range, or a reference to the message limit.
_BOUND = re.compile(
    r"at most|\d+\s*-\s*\d+|\d+\.\.\d+|<=|characters|MiB|message size limit|"
    r"as many as|exactly (?:one|\d+)|one path segment",
    re.I,
)


def _messages() -> dict[str, list[tuple[bool, str, str, str, str]]]:
    """message name -> [(repeated, type, field, comment above it, file)] for every proto."""
    msgs: dict[str, list] = {}
    for proto in (ROOT / "proto").rglob("*.proto"):
        current, depth, comment = None, 0, []
        for line in proto.read_text().splitlines():
            s = line.strip()
            m = re.match(r"message (\w+) \{", s)
            if m and depth == 0:
                current, depth, comment = m.group(1), s.count("{") - s.count("}"), []
                msgs[current] = []
                if depth == 0:  # message Empty {}
                    current = None
                continue
            if current is None:
                continue
            if s.startswith("//"):
                comment.append(s)
                continue
            depth += s.count("{") - s.count("}")
            if depth <= 0:
                current = None
                continue
            f = re.match(r"(?:optional\s+)?(repeated\s+)?(map<[^>]+>|[\w.]+)\s+(\w+)\s*=\s*\d+;", s)
            if f:  # oneof members too
                msgs[current].append(
                    (bool(f.group(1)), f.group(2), f.group(3), " ".join(comment), proto.name)
                )
            comment = []
    return msgs


def test_every_unbounded_request_field_states_its_bound():
    """INVARIANTS: payload sizes are bounded and the bounds are stated in the proto comments.
    Every string, bytes, repeated or map field a server receives (in a request message or any
    message inside one) says its bound."""
    msgs = _messages()
    todo = set()
    for proto in (ROOT / "proto").rglob("*.proto"):
        for m in re.finditer(r"rpc \w+\((?:stream )?([\w.]+)\)", proto.read_text()):
            todo.add(m.group(1).split(".")[-1])
    seen: set[str] = set()
    while todo:
        name = todo.pop()
        if name in seen or name not in msgs:
            continue
        seen.add(name)
        todo.update(t.split(".")[-1] for _, t, _, _, _ in msgs[name])
    assert {"PromptGroup", "SamplingParams", "NDArray", "PublishHeader"} <= seen
    missing = [
        f"{file}: {msg}.{field}"
        for msg in sorted(seen)
        for repeated, typ, field, comment, file in msgs[msg]
        if (repeated or typ in ("string", "bytes") or typ.startswith("map<"))
        and not _BOUND.search(comment)
    ]
    assert not missing, "no bound stated for: " + ", ".join(missing)
