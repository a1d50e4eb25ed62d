"""The FUSE daemon: mounts the power-cut filesystem over /dev/fuse and answers the kernel.

Runs as its own process (`python -m astra.testing.powercut.daemon MOUNTPOINT`), one thread,
one select loop over two inputs: /dev/fuse (kernel requests, answered from the in-memory
model, astra.testing.powercut.model) and stdin (control lines from the test). Control:
`cut` unmounts (lazily), replaces the volatile state by the durable one, mounts a fresh
connection at the same place (so the kernel's page cache of the old one is gone) and answers
`cut`; `stop` or end of input unmounts and exits. Stdout says `ready` once mounted. With
ASTRA_POWERCUT_TRACE=FILE every fsync is written to FILE (path and size): what a program
makes durable, to compare with what it needs after a cut.

Mounting uses mount(2) through ctypes (fstype "fuse"), no libfuse. Files are never opened
with direct_io, so read-only (and shared) mmap works through the page cache. Locks (flock,
fcntl) are not negotiated, so the kernel keeps them locally. Never touches the mount itself
(that would wait on its own answer).
"""

from __future__ import annotations

import ctypes
import errno
import os
import selectors
import stat
import sys
import traceback

from astra.testing.powercut import protocol as p
from astra.testing.powercut.model import Inode, Model

MS_NOSUID, MS_NODEV, MNT_DETACH = 2, 4, 2
_libc = ctypes.CDLL(None, use_errno=True)


def mount_fuse(mountpoint: str) -> int:
    """Open /dev/fuse and mount it at `mountpoint`; returns the connection's fd."""
    fd = os.open("/dev/fuse", os.O_RDWR | os.O_CLOEXEC | os.O_NONBLOCK)
    data = (
        f"fd={fd},rootmode=40000,user_id={os.getuid()},group_id={os.getgid()},"
        "default_permissions,allow_other"
    )
    rc = _libc.mount(
        b"powercut",
        mountpoint.encode(),
        b"fuse",
        ctypes.c_ulong(MS_NOSUID | MS_NODEV),
        data.encode(),
    )
    if rc != 0:
        code = ctypes.get_errno()
        os.close(fd)
        raise OSError(code, f"mount of fuse at {mountpoint}: {os.strerror(code)}")
    return fd


def unmount(mountpoint: str) -> None:
    _libc.umount2(mountpoint.encode(), MNT_DETACH)


def _attr(m: Model, node: Inode) -> p.Attr:
    return p.Attr(node.ino, m.size(node), node.mode, node.nlink, node.uid, node.gid, node.mtime_ns)


class Daemon:
    """One mounted connection at a time over one model; `cut()` swaps the connection."""

    def __init__(self, mountpoint: str) -> None:
        self.mountpoint = mountpoint
        self.model = Model()
        if trace := os.environ.get("ASTRA_POWERCUT_TRACE"):
            self.model.trace = open(trace, "a")  # noqa: SIM115 (open for the daemon's life)
        self.handles: dict[int, int] = {}
        self.next_fh = 1
        self.fd = mount_fuse(mountpoint)

    # ---- requests ------------------------------------------------------------------------
    def handle(self, buf: bytes) -> None:
        _, op, unique, nodeid, uid, gid, _, _, _ = p.IN_HEADER.unpack_from(buf)
        body = buf[p.IN_HEADER.size :]
        if op in p.NO_REPLY:
            if op == p.FORGET:
                self._forget(nodeid, p.FORGET_IN.unpack_from(body)[0])
            elif op == p.BATCH_FORGET:
                count = p.BATCH_FORGET_IN.unpack_from(body)[0]
                for i in range(count):
                    off = p.BATCH_FORGET_IN.size + i * p.FORGET_ONE.size
                    self._forget(*p.FORGET_ONE.unpack_from(body, off))
            return
        error, payload = 0, b""
        try:
            payload = self.dispatch(op, nodeid, uid, gid, body)
        except OSError as e:
            error = e.errno or errno.EIO
        except Exception:
            traceback.print_exc()
            error = errno.EIO
        reply = p.OUT_HEADER.pack(p.OUT_HEADER.size + len(payload), -error, unique) + payload
        try:
            os.write(self.fd, reply)
        except OSError as e:
            if e.errno not in (errno.ENOENT, errno.ENODEV):  # interrupted, or unmounted
                raise

    def _forget(self, ino: int, n: int) -> None:
        node = self.model.inodes.get(ino)
        if node is not None:
            node.lookups = max(0, node.lookups - n)
            self.model.release_if_unused(node)

    def _entry(self, node: Inode) -> bytes:
        node.lookups += 1
        return p.entry_out(_attr(self.model, node))

    def _open(self, node: Inode) -> bytes:
        fh, self.next_fh = self.next_fh, self.next_fh + 1
        self.handles[fh] = node.ino
        node.opens += 1
        return p.OPEN_OUT.pack(fh, 0, 0)

    def _release(self, body: bytes) -> bytes:
        ino = self.handles.pop(p.RELEASE_IN.unpack_from(body)[0], None)
        node = self.model.inodes.get(ino) if ino is not None else None
        if node is not None:
            node.opens -= 1
            self.model.release_if_unused(node)
        return b""

    def dispatch(self, op: int, nodeid: int, uid: int, gid: int, body: bytes) -> bytes:
        m = self.model
        if op == p.INIT:
            _major, minor, readahead, flags = p.INIT_IN.unpack_from(body)
            return p.INIT_OUT.pack(
                p.MAJOR, min(minor, p.MINOR), readahead, flags & p.WANTED_INIT_FLAGS,
                16, 12, p.MAX_WRITE, 1, p.MAX_PAGES, 0, 0, 0,
            )  # fmt: skip
        if op == p.LOOKUP:
            return self._entry(m.child(nodeid, p.names(body, 1)[0]))
        if op == p.GETATTR:
            return p.attr_out(_attr(m, m.get(nodeid)))
        if op == p.SETATTR:
            return self._setattr(nodeid, body)
        if op in (p.MKNOD, p.MKDIR, p.CREATE):
            return self._make(op, nodeid, uid, gid, body)
        if op == p.SYMLINK:
            name, target = p.names(body, 2)
            return self._entry(m.symlink(nodeid, name, target, uid, gid))
        if op == p.READLINK:
            node = m.get(nodeid)
            if not stat.S_ISLNK(node.mode):
                raise OSError(errno.EINVAL, "not a symlink")
            return bytes(node.data)
        if op in (p.UNLINK, p.RMDIR):
            m.unlink(nodeid, p.names(body, 1)[0], want_dir=op == p.RMDIR)
            return b""
        if op in (p.RENAME, p.RENAME2):
            head = p.RENAME_IN if op == p.RENAME else p.RENAME2_IN
            newdir, flags = head.unpack_from(body)[0], 0
            if op == p.RENAME2:
                flags = p.RENAME2_IN.unpack_from(body)[1]
            old, new = p.names(body[head.size :], 2)
            m.rename(nodeid, old, newdir, new, flags)
            return b""
        if op == p.LINK:
            (old,) = p.LINK_IN.unpack_from(body)
            return self._entry(m.link(old, nodeid, p.names(body[p.LINK_IN.size :], 1)[0]))
        if op in (p.OPEN, p.OPENDIR):
            return self._open(m.get(nodeid))
        if op == p.READ:
            _, offset, size, *_ = p.READ_IN.unpack_from(body)
            return m.read(nodeid, offset, size)
        if op == p.WRITE:
            _, offset, size, *_ = p.WRITE_IN.unpack_from(body)
            data = body[p.WRITE_IN.size : p.WRITE_IN.size + size]
            return p.WRITE_OUT.pack(m.write(nodeid, offset, data), 0)
        if op in (p.RELEASE, p.RELEASEDIR):
            return self._release(body)
        if op in (p.FSYNC, p.FSYNCDIR):
            m.fsync(nodeid)
            return b""
        if op in (p.FLUSH, p.ACCESS, p.DESTROY):
            return b""
        if op == p.READDIR:
            _, offset, size, *_ = p.READ_IN.unpack_from(body)
            return self._readdir(nodeid, offset, size)
        if op == p.STATFS:
            files = len(m.inodes)
            return p.STATFS_OUT.pack(1 << 24, 1 << 23, 1 << 23, 1 << 20, (1 << 20) - files,
                                     4096, 255, 4096, 0)  # fmt: skip
        if op == p.FALLOCATE:
            _, offset, length, mode, _ = p.FALLOCATE_IN.unpack_from(body)
            if mode & ~p.FALLOC_FL_KEEP_SIZE:
                raise OSError(errno.EOPNOTSUPP, "fallocate mode")
            if not mode and offset + length > m.size(m.get(nodeid)):
                m.truncate(nodeid, offset + length)
            return b""
        raise OSError(errno.ENOSYS, "not implemented")

    def _setattr(self, nodeid: int, body: bytes) -> bytes:
        m = self.model
        valid, _, _, size, _, _, mtime, _, _, mtime_ns, _, mode, _, uid, gid, _ = (
            p.SETATTR_IN.unpack_from(body)
        )
        node = m.get(nodeid)
        if valid & p.FATTR_SIZE:
            m.truncate(nodeid, size)
        if valid & p.FATTR_MODE:
            node.mode = stat.S_IFMT(node.mode) | (mode & 0o7777)
        if valid & p.FATTR_UID:
            node.uid = uid
        if valid & p.FATTR_GID:
            node.gid = gid
        if valid & p.FATTR_MTIME:
            node.mtime_ns = mtime * 1_000_000_000 + mtime_ns
        return p.attr_out(_attr(m, node))

    def _make(self, op: int, nodeid: int, uid: int, gid: int, body: bytes) -> bytes:
        m = self.model
        if op == p.MKDIR:
            mode, umask = p.MKDIR_IN.unpack_from(body)
            name = p.names(body[p.MKDIR_IN.size :], 1)[0]
            return self._entry(
                m.create(nodeid, name, stat.S_IFDIR | (mode & ~umask & 0o7777), uid, gid)
            )
        head = p.CREATE_IN if op == p.CREATE else p.MKNOD_IN
        if op == p.CREATE:
            _, mode, umask, _ = p.CREATE_IN.unpack_from(body)
        else:
            mode, _, umask, _ = p.MKNOD_IN.unpack_from(body)
            if not stat.S_ISREG(mode):
                raise OSError(errno.EPERM, "only regular files")
        name = p.names(body[head.size :], 1)[0]
        node = m.create(nodeid, name, stat.S_IFREG | (mode & ~umask & 0o7777), uid, gid)
        entry = self._entry(node)
        return entry + self._open(node) if op == p.CREATE else entry

    def _readdir(self, nodeid: int, offset: int, size: int) -> bytes:
        d = self.model.dir(nodeid)
        listing = [(b".", nodeid), (b"..", nodeid), *sorted(d.entries.items())]
        out = bytearray()
        for index in range(offset, len(listing)):
            name, ino = listing[index]
            node = self.model.inodes.get(ino)
            dtype = 4 if node is None or node.is_dir else 10 if stat.S_ISLNK(node.mode) else 8
            entry = p.dirent(ino, index + 1, name, dtype)
            if len(out) + len(entry) > size:
                break
            out += entry
        return bytes(out)

    # ---- the loop ------------------------------------------------------------------------
    def cut(self) -> None:
        unmount(self.mountpoint)
        os.close(self.fd)
        self.model.cut()
        self.handles.clear()
        self.fd = mount_fuse(self.mountpoint)

    def serve(self, control: int) -> None:
        sel = selectors.DefaultSelector()
        sel.register(control, selectors.EVENT_READ, "control")
        sel.register(self.fd, selectors.EVENT_READ, "fuse")
        pending = b""
        while True:
            for key, _ in sel.select():
                if key.data == "fuse":
                    try:
                        buf = os.read(self.fd, p.READ_BUFFER)
                    except OSError as e:
                        if e.errno in (errno.EAGAIN, errno.EINTR, errno.ENOENT):
                            continue
                        raise
                    self.handle(buf)
                    continue
                chunk = os.read(control, 4096)
                pending += chunk
                while b"\n" in pending or not chunk:
                    line, _, pending = pending.partition(b"\n")
                    if line.strip() == b"cut":
                        sel.unregister(self.fd)
                        self.cut()
                        sel.register(self.fd, selectors.EVENT_READ, "fuse")
                        _say(f"cut fsyncs={self.model.fsyncs} inodes={len(self.model.inodes)}")
                    elif line.strip() == b"stop" or not chunk:
                        unmount(self.mountpoint)
                        os.close(self.fd)
                        return
                    elif line.strip():
                        _say(f"error unknown command {line!r}")


def _say(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        sys.stderr.write("usage: python -m astra.testing.powercut.daemon MOUNTPOINT\n")
        return 2
    try:
        daemon = Daemon(argv[0])
    except OSError as e:
        _say(f"error {e}")
        return 1
    _say("ready")
    daemon.serve(sys.stdin.fileno())
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
