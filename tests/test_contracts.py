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
