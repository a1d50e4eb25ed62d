"""Generate the Python stubs of proto/ into astra/ (committed), or check them.

    python tools/codegen.py          # regenerate astra/<pkg>/v1/*_pb2*.py(i) and the descriptors
    python tools/codegen.py --check  # exit 1 if the committed stubs drifted
    python tools/codegen.py --deps   # lay out google/rpc protos for `buf lint`

Stubs mirror the proto packages: astra.dataflow.v1 -> astra/dataflow/v1/. Beside them,
servers/contracts.binpb: every contract as a FileDescriptorSet with its imports and its
source comments, which server reflection serves (servers/reflection.py), so `grpcurl
describe` shows the operating rules written in the protos.
The google/rpc dependency comes from the googleapis-common-protos package,
which ships its .proto sources.
"""

from __future__ import annotations

import argparse
import filecmp
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO = ROOT / "proto"
DEPS = ROOT / "build" / "protodeps"
# status.proto for the contracts; error_details.proto for engines that load the protos at run
# time and encode the ErrorInfo / BadRequest / RetryInfo details (tools/raas-node).
GOOGLE_DEPS = ("google/rpc/status.proto", "google/rpc/error_details.proto")


def _googleapis_root() -> Path:
    import google.rpc.status_pb2 as status_pb2

    return Path(status_pb2.__file__).resolve().parent.parent.parent


def _protoc_include() -> Path:
    import grpc_tools

    return Path(grpc_tools.__file__).resolve().parent / "_proto"


def proto_files() -> list[Path]:
    return sorted(PROTO.rglob("*.proto"))


def lay_out_deps() -> None:
    src = _googleapis_root()
    for rel in GOOGLE_DEPS:
        dst = DEPS / rel
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(src / rel, dst)


DESCRIPTORS = Path("servers") / "contracts.binpb"


def generate(out: Path) -> list[Path]:
    from grpc_tools import protoc

    files = [str(p.relative_to(PROTO)) for p in proto_files()]
    (out / DESCRIPTORS).parent.mkdir(parents=True, exist_ok=True)
    args = [
        "protoc",
        f"-I{PROTO}",
        f"-I{_googleapis_root()}",
        f"-I{_protoc_include()}",
        f"--python_out={out}",
        f"--pyi_out={out}",
        f"--grpc_python_out={out}",
        f"--descriptor_set_out={out / DESCRIPTORS}",
        "--include_imports",
        "--include_source_info",
        *files,
    ]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")
    outputs = []
    for rel in files:
        stem = Path(rel).with_suffix("")
        for suffix in ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py"):
            outputs.append(stem.parent / (stem.name + suffix))
    for d in {(out / p).parent for p in outputs}:
        while d != out and d.is_relative_to(out):
            (d / "__init__.py").touch()
            d = d.parent
    return sorted([*outputs, DESCRIPTORS])


def committed_stubs() -> list[Path]:
    stubs = [
        p.relative_to(ROOT)
        for p in (ROOT / "astra").rglob("*_pb2*")
        if p.is_file() and p.suffix in (".py", ".pyi")  # not the interpreter's __pycache__
    ]
    return sorted([*stubs, *([DESCRIPTORS] if (ROOT / DESCRIPTORS).is_file() else [])])


def check() -> int:
    with tempfile.TemporaryDirectory() as tmp:
        fresh = generate(Path(tmp))
        have = committed_stubs()
        problems = [f"missing or extra stub: {p}" for p in sorted(set(fresh) ^ set(have))]
        for rel in set(fresh) & set(have):
            if not filecmp.cmp(Path(tmp) / rel, ROOT / rel, shallow=False):
                problems.append(f"stale stub: {rel}")
    for line in problems:
        print(line, file=sys.stderr)
    if problems:
        print("run: python tools/codegen.py", file=sys.stderr)
    return 1 if problems else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail if committed stubs drifted")
    parser.add_argument("--deps", action="store_true", help="lay out google protos for buf")
    args = parser.parse_args()
    if args.deps:
        lay_out_deps()
        return 0
    if args.check:
        return check()
    for stale in committed_stubs():
        (ROOT / stale).unlink()
    generate(ROOT)
    return 0


if __name__ == "__main__":
    sys.exit(main())
