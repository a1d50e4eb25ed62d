"""A receiver's directory: verified versions, the `current` link, and one fetch in progress.

Layout: versions/<identity>/ (full checkpoints, each written whole and
renamed into place), current (a symlink to one of them, replaced by rename,
so a reader that resolves it sees the old version or the new, never a mix),
staging/<identity>/ (the tensors of the version being fetched: each large
one a single-tensor shard verified against its Adler-32 before it is
recorded, which survives a disconnect or a kill, so a fetch resumes after
it; small ones held in RAM, astra.weights.receive_stage) and receiver_id. A
new version is assembled by linking the staged shards plus the unchanged
tensors of its base (a base shard whose tensors are all unchanged is linked
whole; the other small ones join the new version's packed shard), its
headers checked against the verified checksums, and only then made current.
Never touches gRPC.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import uuid
from pathlib import Path

from astra.durable import fsync_path
from astra.errors import DataLoss
from astra.weights.layout import ChecksumMismatch, Version, open_full, read_index
from astra.weights.receive_stage import FetchStage, checked_base, checked_base_bytes
from astra.weights.records import dirname_for
from astra.weights.tensor_files import (
    INLINE_BYTES,
    assemble,
    copy_range,
    pwrite_all,
    tensor_header,
)


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

    @staticmethod
    def open(directory: Path) -> Version:
        """A held version opened as the base of a fetch (close it after)."""
        return open_full(directory)

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
        """Links the staged shards (plus its base's unchanged tensors) into a version, swaps it in.

        Staged tensors were verified as they landed: large ones are already complete
        single-tensor shards, small ones are written here as one shard (`FetchStage.pack`);
        nothing is hashed again. A base tensor the delta leaves unchanged is checked against
        its recorded Adler-32, then linked when its whole shard is unchanged and sits in a
        version this directory installed; else a small one joins the packed shard and a
        large one is copied in the kernel into a shard of its own.
        """
        final = self.root / "versions" / dirname_for(stage.target)
        if final.is_dir():
            self.make_current(final)
            stage.remove()
            return final
        received = {**stage.entries, **{n: e for n, (e, _) in stage.in_ram.items()}}
        # A full copy is exactly the plan; a delta at least the plan's changed tensors (what is
        # missing would otherwise be linked from the base: a mix of two versions).
        if len(received) < num_tensors or (base_dir is None and len(received) != num_tensors):
            raise DataLoss(
                f"{len(received)} tensors staged, the plan has {num_tensors}",
                reason="INCOMPLETE_FETCH",
            )
        expected = {n: e["adler32"] for n, e in received.items()}
        sizes = {n: e["size_bytes"] for n, e in received.items()}
        shards: dict[str, Path] = {}
        out = stage.path / "out"
        shutil.rmtree(out, ignore_errors=True)
        base = open_full(base_dir) if base_dir is not None else None
        try:
            if base is not None and base_dir is not None:  # one goes with the other
                trusted = self._installed(base_dir)
                for name, entry in base.entries.items():
                    if name in received:
                        continue
                    sizes[name] = entry.info.nbytes
                    whole = trusted and not any(t in received for t in entry.shard.tensors)
                    if whole or entry.info.nbytes >= INLINE_BYTES:
                        expected[name] = self._base_checksum(base, name)
                        shards[name] = (
                            entry.shard.path
                            if whole
                            else self._extract(base, name, expected[name], stage)
                        )
                    else:
                        expected[name] = self._hold_base(base, name, stage)
        finally:
            if base is not None:
                base.close()
        stage.pack()
        shards.update({n: stage.shard(n) for n in stage.entries})
        assemble(
            out,
            shards,
            sizes,
            version=stage.target,
            files=stage.files(),
            durable=self.durable,
        )
        with Version(out) as written:
            if written.entries.keys() != expected.keys():
                raise DataLoss("assembled tensors differ from the plan", reason="INCOMPLETE_FETCH")
            for name, entry in written.entries.items():
                if entry.checksum != expected[name]:
                    raise ChecksumMismatch("changed while assembling", path=out, tensor=name)
        os.rename(out, final)
        if self.durable:
            fsync_path(final.parent)
        self.make_current(final)
        stage.remove()
        return final

    def _installed(self, directory: Path) -> bool:
        """True for a version this directory installed (its tensors verified then)."""
        versions = (self.root / "versions").resolve()
        return directory.resolve().parent == versions

    def _base_checksum(self, base: Version, name: str) -> str:
        """The base tensor's Adler-32, computed and checked against the recorded one: a byte
        that rotted on disk since the base was installed is not carried into the new version
        (ChecksumMismatch naming the base and the tensor; the fetch then goes without it)."""
        return checked_base(base, name)

    @staticmethod
    def _hold_base(base: Version, name: str, stage: FetchStage) -> str:
        """A small base tensor, checked against its recorded Adler-32 (bit rot is
        ChecksumMismatch naming the base), held in the stage's RAM to be packed; its
        Adler-32."""
        data, got = checked_base_bytes(base, name)
        info = base.entries[name].info
        entry = {"dtype": info.dtype, "shape": list(info.shape), "adler32": got}
        stage.hold(name, {**entry, "size_bytes": info.nbytes}, data)
        return got

    def _extract(self, base: Version, name: str, checksum: str, stage: FetchStage) -> Path:
        """Copies one base tensor (in the kernel) into a single-tensor shard in the stage."""
        info, shard = base.entries[name].info, base.entries[name].shard
        head = tensor_header(name, info.dtype, info.shape, info.nbytes, checksum)
        path = stage.path / f"base-{stage.next_file()}"
        with open(shard.path, "rb") as src, open(path, "wb") as dst:
            pwrite_all(dst.fileno(), head, 0)
            copy_range(
                src.fileno(), shard.data_start + info.begin, dst.fileno(), len(head), info.nbytes
            )
            if self.durable:
                os.fsync(dst.fileno())
        return path

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
