"""A receiver's directory: verified versions, the `current` link, and one fetch in progress.

Layout: versions/<identity>/ (full checkpoints, each written whole and
renamed into place), current (a symlink to one of them, replaced by rename,
so a reader that resolves it sees the old version or the new, never a mix),
staging/<identity>/ (the tensors of the version being fetched, each verified
against its Adler-32 before it is recorded; they survive a disconnect or a
kill, so a fetch resumes after the last acknowledged tensor) and receiver_id.
A new version is assembled from staged tensors plus the unchanged tensors of
its base, checked again, and only then made current. Never touches gRPC.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import uuid
from pathlib import Path

from astra.errors import DataLoss
from astra.weights.checkpoint import write_full
from astra.weights.checksum import adler32_hex
from astra.weights.layout import ChecksumMismatch, Tensor, Version, open_full, read_index
from astra.weights.receive_stage import FetchStage
from astra.weights.records import dirname_for, fsync_path
from astra.weights.store_cache import put_files


def identity_of(directory: Path) -> str:
    """A full version directory's identity: index metadata `version`, else its name."""
    metadata, _ = read_index(directory)
    return str(metadata.get("version") or directory.name)


class LocalVersions:
    """One receiver's directory."""

    def __init__(self, root: str | Path, *, durable: bool = True) -> None:
        self.root, self.durable = Path(root), durable
        for sub in ("versions", "staging"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        for junk in self.root.glob("versions/.*"):
            shutil.rmtree(junk, ignore_errors=True)

    @property
    def receiver_id(self) -> str:
        """A stable id for this directory, so the service keeps what it holds."""
        path = self.root / "receiver_id"
        if not path.is_file():
            path.write_text(f"receiver-{uuid.uuid4().hex[:16]}\n")
        return path.read_text().strip()

    def held(self) -> dict[str, Path]:
        out = {}
        for d in sorted((self.root / "versions").iterdir()):
            if d.is_dir() and not d.name.startswith("."):
                with contextlib.suppress(DataLoss, OSError, ValueError):
                    out[identity_of(d)] = d
        return out

    @property
    def current_path(self) -> Path | None:
        link = self.root / "current"
        return link.resolve() if link.exists() else None

    def current(self) -> str | None:
        path = self.current_path
        return identity_of(path) if path is not None else None

    def stage(self, target: str) -> FetchStage:
        """The stage for `target`, resumed when one exists; any other stage is dropped."""
        path = self.root / "staging" / dirname_for(target)
        for other in (self.root / "staging").iterdir():
            if other != path:
                shutil.rmtree(other, ignore_errors=True)
        return FetchStage(path, target, durable=self.durable)

    def make_current(self, directory: Path) -> None:
        """Points `current` at a version by an atomic rename of a new symlink."""
        tmp = self.root / f".current-{uuid.uuid4().hex[:8]}"
        os.symlink(directory.relative_to(self.root), tmp)
        os.replace(tmp, self.root / "current")
        if self.durable:
            fsync_path(self.root)

    def adopt(self, directory: Path, identity: str) -> Path:
        """Makes a held version current, copying it in first when it lives elsewhere."""
        final = self.root / "versions" / dirname_for(identity)
        if not final.is_dir():
            tmp = self.root / "versions" / f".adopt-{uuid.uuid4().hex[:8]}"
            shutil.copytree(directory, tmp)
            os.rename(tmp, final)
        self.make_current(final)
        return final

    def install(self, stage: FetchStage, base_dir: Path | None, num_tensors: int) -> Path:
        """Assembles the staged version (plus its base's unchanged tensors), checks it, swaps it in."""
        final = self.root / "versions" / dirname_for(stage.target)
        if final.is_dir():
            self.make_current(final)
            stage.remove()
            return final
        staged = stage.tensors()
        expected = {n: e["adler32"] for n, e in stage.entries.items()}
        tensors: dict[str, Tensor] = dict(staged)
        base = open_full(base_dir) if base_dir is not None else None
        try:
            if base is None and len(staged) != num_tensors:
                raise DataLoss(
                    f"{len(staged)} tensors staged, the plan has {num_tensors}",
                    reason="INCOMPLETE_FETCH",
                )
            for name, entry in base.entries.items() if base else ():
                if name in staged:
                    continue
                view = base.view(name)
                got = adler32_hex(view)
                if entry.checksum is not None and got != entry.checksum:
                    raise ChecksumMismatch(
                        f"base bytes hash to {got}, its shard says {entry.checksum}",
                        path=base.path,
                        tensor=name,
                    )
                tensors[name] = Tensor(entry.info.dtype, entry.info.shape, view)
                expected[name] = got
            out = stage.path / "out"
            shutil.rmtree(out, ignore_errors=True)
            write_full(out, tensors, version=stage.target, durable=self.durable)
        finally:
            tensors.clear()
            staged.clear()
            if base is not None:
                base.close()
        put_files(out, stage.files(), durable=self.durable)
        with Version(out) as written:
            for name, entry in written.entries.items():
                if entry.checksum != expected[name]:
                    raise ChecksumMismatch("changed while assembling", path=out, tensor=name)
        os.rename(out, final)
        self.make_current(final)
        stage.remove()
        return final

    def prune(self, keep: int = 2) -> list[str]:
        """Drops all but the current version and the newest others, `keep` in all."""
        current = self.current_path
        dirs = sorted(
            (d for d in (self.root / "versions").iterdir() if d.is_dir() and d != current),
            key=lambda d: d.stat().st_mtime,
            reverse=True,
        )
        dropped = []
        for d in dirs[max(0, keep - 1) :]:
            trash = self.root / "versions" / f".trash-{uuid.uuid4().hex[:8]}"
            os.rename(d, trash)
            shutil.rmtree(trash, ignore_errors=True)
            dropped.append(d.name)
        return dropped
