"""The in-memory filesystem a power cut can hit: what reads see, and what a cut leaves.

Every inode has two states. The *volatile* one is what reads, stats and listings see; every
write, truncate, create, unlink and rename changes only it. The *durable* one is what is left
after the power goes:

- `fsync`/`fdatasync` of a file makes its bytes and size durable (both calls do the same);
- `fsync` of a directory makes that directory's entries durable: the names created, unlinked
  or renamed into or out of it since its last fsync;
- nothing else is ever durable: not a close, not a rename, not an fsync of the file a new
  name points at.

So a file created and fsynced whose directory was never fsynced is gone after a cut, and a
rename of a temporary file over a final name is undone unless the directory is fsynced
afterwards. This is the strict POSIX model crash-consistency tools (ALICE, CrashMonkey) test
against. Real filesystems are more lenient: ext4 (data=ordered) commits a whole journal
transaction on any fsync, so an fsync of a file usually carries its new directory entry and
every earlier rename with it, and `auto_da_alloc` flushes a file's data when it replaces
another by rename; XFS and btrfs log a new file's name with its fsync. A program that is safe
here is safe there; the converse does not hold. A rename across two directories is made
durable per directory: the name leaves the source when the source is fsynced and appears in
the target when the target is.

Times are not kept across a cut (they restart at the cut). `cut()` replaces every volatile
state by its durable one and forgets every inode no durable entry reaches. Knows nothing of
FUSE or of the kernel: the daemon (astra.testing.powercut.daemon) maps requests onto this.
"""

from __future__ import annotations

import errno
import os
import stat
import time
from dataclasses import dataclass, field
from typing import TextIO

ROOT = 1


def _err(code: int) -> OSError:
    return OSError(code, os.strerror(code))


@dataclass
class Inode:
    ino: int
    mode: int
    uid: int = 0
    gid: int = 0
    data: bytearray = field(default_factory=bytearray)
    entries: dict[bytes, int] = field(default_factory=dict)
    durable_data: bytes = b""
    durable_entries: dict[bytes, int] = field(default_factory=dict)
    nlink: int = 0
    lookups: int = 0
    opens: int = 0
    mtime_ns: int = field(default_factory=time.time_ns)

    @property
    def is_dir(self) -> bool:
        return stat.S_ISDIR(self.mode)


class Model:
    """The inode table, with the volatile/durable split and the cut."""

    def __init__(self) -> None:
        self.inodes: dict[int, Inode] = {ROOT: Inode(ROOT, stat.S_IFDIR | 0o755, nlink=2)}
        self.next_ino = ROOT + 1
        self.fsyncs = 0
        self.trace: TextIO | None = (
            None  # a text file each fsync is written to (ASTRA_POWERCUT_TRACE)
        )

    # ---- lookups -------------------------------------------------------------------------
    def get(self, ino: int) -> Inode:
        node = self.inodes.get(ino)
        if node is None:
            raise _err(errno.ENOENT)
        return node

    def dir(self, ino: int) -> Inode:
        node = self.get(ino)
        if not node.is_dir:
            raise _err(errno.ENOTDIR)
        return node

    def child(self, parent: int, name: bytes) -> Inode:
        ino = self.dir(parent).entries.get(name)
        if ino is None:
            raise _err(errno.ENOENT)
        return self.get(ino)

    def size(self, node: Inode) -> int:
        return 4096 if node.is_dir else len(node.data)

    # ---- names ---------------------------------------------------------------------------
    def create(self, parent: int, name: bytes, mode: int, uid: int, gid: int) -> Inode:
        d = self.dir(parent)
        if name in d.entries:
            raise _err(errno.EEXIST)
        node = Inode(self.next_ino, mode, uid, gid, nlink=2 if stat.S_ISDIR(mode) else 1)
        self.next_ino += 1
        self.inodes[node.ino] = node
        d.entries[name] = node.ino
        if node.is_dir:
            d.nlink += 1
        d.mtime_ns = time.time_ns()
        return node

    def symlink(self, parent: int, name: bytes, target: bytes, uid: int, gid: int) -> Inode:
        """A symbolic link: its target is written with it (durable with its name)."""
        node = self.create(parent, name, stat.S_IFLNK | 0o777, uid, gid)
        node.data = bytearray(target)
        node.durable_data = bytes(target)
        return node

    def link(self, ino: int, parent: int, name: bytes) -> Inode:
        node, d = self.get(ino), self.dir(parent)
        if node.is_dir:
            raise _err(errno.EPERM)
        if name in d.entries:
            raise _err(errno.EEXIST)
        d.entries[name] = ino
        node.nlink += 1
        return node

    def unlink(self, parent: int, name: bytes, want_dir: bool) -> None:
        d = self.dir(parent)
        node = self.child(parent, name)
        if want_dir and not node.is_dir:
            raise _err(errno.ENOTDIR)
        if not want_dir and node.is_dir:
            raise _err(errno.EISDIR)
        if node.is_dir and node.entries:
            raise _err(errno.ENOTEMPTY)
        del d.entries[name]
        self._drop_link(d, node)

    def _drop_link(self, d: Inode, node: Inode) -> None:
        node.nlink -= 2 if node.is_dir else 1
        if node.is_dir:
            d.nlink -= 1
        d.mtime_ns = time.time_ns()
        self.release_if_unused(node)

    def rename(self, old: int, name: bytes, new: int, newname: bytes, flags: int) -> None:
        src, dst = self.dir(old), self.dir(new)
        node = self.child(old, name)
        target_ino = dst.entries.get(newname)
        if flags & 1 and target_ino is not None:  # RENAME_NOREPLACE
            raise _err(errno.EEXIST)
        if flags & 2:  # RENAME_EXCHANGE
            if target_ino is None:
                raise _err(errno.ENOENT)
            src.entries[name], dst.entries[newname] = target_ino, node.ino
            return
        if target_ino == node.ino:
            return
        if target_ino is not None:
            target = self.get(target_ino)
            if target.is_dir != node.is_dir:
                raise _err(errno.EISDIR if target.is_dir else errno.ENOTDIR)
            if target.is_dir and target.entries:
                raise _err(errno.ENOTEMPTY)
            del dst.entries[newname]
            self._drop_link(dst, target)
        del src.entries[name]
        dst.entries[newname] = node.ino
        if node.is_dir and src is not dst:
            src.nlink -= 1
            dst.nlink += 1
        src.mtime_ns = dst.mtime_ns = time.time_ns()

    def release_if_unused(self, node: Inode) -> None:
        """Forget an inode no name, handle or kernel reference holds, unless a durable entry
        still names it (then only its volatile bytes go)."""
        if node.ino == ROOT or node.nlink > 0 or node.opens > 0:
            return
        node.data = bytearray()
        if node.lookups == 0 and not self._durably_named(node.ino):
            self.inodes.pop(node.ino, None)

    def _durably_named(self, ino: int) -> bool:
        return any(ino in n.durable_entries.values() for n in self.inodes.values() if n.is_dir)

    # ---- bytes ---------------------------------------------------------------------------
    def read(self, ino: int, offset: int, size: int) -> bytes:
        return bytes(self.get(ino).data[offset : offset + size])

    def write(self, ino: int, offset: int, data: bytes) -> int:
        node = self.get(ino)
        if offset > len(node.data):
            node.data.extend(b"\0" * (offset - len(node.data)))
        node.data[offset : offset + len(data)] = data
        node.mtime_ns = time.time_ns()
        return len(data)

    def truncate(self, ino: int, size: int) -> None:
        node = self.get(ino)
        if node.is_dir:
            raise _err(errno.EISDIR)
        if size < len(node.data):
            del node.data[size:]
        else:
            node.data.extend(b"\0" * (size - len(node.data)))
        node.mtime_ns = time.time_ns()

    # ---- durability ----------------------------------------------------------------------
    def path_of(self, ino: int) -> str:
        """A name of the inode (for the daemon's trace), or `?ino`."""
        for parent in self.inodes.values():
            for name, child in parent.entries.items():
                if child == ino:
                    up = "" if parent.ino == ROOT else self.path_of(parent.ino)
                    return f"{up}/{name.decode(errors='replace')}"
        return "/" if ino == ROOT else f"?{ino}"

    def fsync(self, ino: int) -> None:
        """A file's bytes and size, or a directory's entries, become durable."""
        node = self.get(ino)
        self.fsyncs += 1
        if self.trace is not None:
            self.trace.write(f"fsync {self.path_of(ino)} {len(node.data)}\n")
            self.trace.flush()
        if node.is_dir:
            node.durable_entries = dict(node.entries)
        else:
            node.durable_data = bytes(node.data)

    def cut(self) -> None:
        """The power goes: every inode takes its durable state; what no durable entry reaches
        from the root is gone. Open handles and kernel references are gone with the mount."""
        reached: set[int] = set()
        stack = [ROOT]
        while stack:
            ino = stack.pop()
            if ino in reached or ino not in self.inodes:
                continue
            reached.add(ino)
            stack.extend(self.inodes[ino].durable_entries.values())
        self.inodes = {ino: self.inodes[ino] for ino in reached}
        for node in self.inodes.values():
            node.entries = {n: i for n, i in node.durable_entries.items() if i in reached}
            node.durable_entries = dict(node.entries)
            node.data = bytearray(node.durable_data)
            node.lookups = node.opens = 0
            node.nlink = 2 if node.is_dir else 0
            node.mtime_ns = time.time_ns()
        for node in list(self.inodes.values()):
            for i in node.entries.values():
                child = self.inodes[i]
                if child.is_dir:
                    node.nlink += 1  # the child's ".."
                else:
                    child.nlink += 1
