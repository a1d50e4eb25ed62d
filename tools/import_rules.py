"""The import rules, checked: import-linter's contracts (pyproject.toml) and no import circle.

    python tools/import_rules.py          # `make lint` and CI run it
    python tools/import_rules.py --tree   # only the link tree (`make typecheck` runs mypy in it)

setuptools' editable install maps servers/ to astra.servers and clients/ to astra.clients,
which neither import-linter, grimp nor mypy can follow: they run over a tree of links in
build/imports that puts them where the installed package has them. A circle is a set of
modules that import each other, imports under TYPE_CHECKING included (a part that needs its
owner's type is given a protocol or a base class instead); the rule is that there is none. Exit status 1 on a broken contract or a circle.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TREE = ROOT / "build" / "imports"


def link_tree() -> Path:
    pkg = TREE / "astra"
    shutil.rmtree(pkg, ignore_errors=True)
    pkg.mkdir(parents=True)
    for entry in (ROOT / "astra").iterdir():
        if entry.name != "__pycache__":
            (pkg / entry.name).symlink_to(entry)
    (pkg / "servers").symlink_to(ROOT / "servers")
    (pkg / "clients").symlink_to(ROOT / "clients")
    return TREE


def circles(graph) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    for root in sorted(graph.modules):
        if root in index:
            continue
        work = [(root, iter(sorted(graph.find_modules_directly_imported_by(root))))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, edges = work[-1]
            for nxt in edges:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph.find_modules_directly_imported_by(nxt)))))
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    comp = []
                    while True:
                        m = stack.pop()
                        on_stack.discard(m)
                        comp.append(m)
                        if m == node:
                            break
                    if len(comp) > 1:
                        out.append(sorted(comp))
    return out


def main() -> int:
    tree = link_tree()
    if sys.argv[1:] == ["--tree"]:
        return 0
    env = {**os.environ, "PYTHONPATH": str(tree)}
    lint = Path(sys.executable).with_name("lint-imports")
    code = subprocess.call([str(lint), str(ROOT / "pyproject.toml")], cwd=tree, env=env)
    sys.path.insert(0, str(tree))
    import grimp

    graph = grimp.build_graph("astra", exclude_type_checking_imports=False)
    found = circles(graph)
    for comp in found:
        print("import circle: " + " <-> ".join(comp), file=sys.stderr)
    print(f"import circles: {len(found)}")
    return 1 if code or found else 0


if __name__ == "__main__":
    sys.exit(main())
