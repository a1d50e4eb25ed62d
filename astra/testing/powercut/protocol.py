"""The FUSE kernel protocol as this test filesystem speaks it: opcodes, struct layouts, errors.

Layouts follow the kernel's `include/uapi/linux/fuse.h` for protocol 7.31 (the version this
daemon answers FUSE_INIT with; a newer kernel then speaks 7.31 to it). Only the requests the
power-cut filesystem answers are described; every other opcode is answered ENOSYS by the
daemon. Pure data and packing: never opens /dev/fuse, never touches a file.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

MAJOR = 7
MINOR = 31
ROOT_ID = 1

# opcodes
LOOKUP = 1
FORGET = 2
GETATTR = 3
SETATTR = 4
READLINK = 5
SYMLINK = 6
MKNOD = 8
MKDIR = 9
UNLINK = 10
RMDIR = 11
RENAME = 12
LINK = 13
OPEN = 14
READ = 15
WRITE = 16
STATFS = 17
RELEASE = 18
FSYNC = 20
FLUSH = 25
INIT = 26
OPENDIR = 27
READDIR = 28
RELEASEDIR = 29
FSYNCDIR = 30
ACCESS = 34
CREATE = 35
INTERRUPT = 36
DESTROY = 38
BATCH_FORGET = 42
FALLOCATE = 43
RENAME2 = 45

NO_REPLY = frozenset({FORGET, BATCH_FORGET, INTERRUPT})

# FUSE_INIT flags this daemon accepts when the kernel offers them
INIT_ASYNC_READ = 1 << 0
INIT_BIG_WRITES = 1 << 5
INIT_MAX_PAGES = 1 << 22
WANTED_INIT_FLAGS = INIT_ASYNC_READ | INIT_BIG_WRITES | INIT_MAX_PAGES
MAX_PAGES = 256  # 1 MiB per WRITE/READ
MAX_WRITE = MAX_PAGES * 4096
READ_BUFFER = MAX_WRITE + 64 * 1024

# SETATTR `valid` bits
FATTR_MODE = 1 << 0
FATTR_UID = 1 << 1
FATTR_GID = 1 << 2
FATTR_SIZE = 1 << 3
FATTR_ATIME = 1 << 4
FATTR_MTIME = 1 << 5
FATTR_ATIME_NOW = 1 << 7
FATTR_MTIME_NOW = 1 << 8

FSYNC_FDATASYNC = 1 << 0
RENAME_NOREPLACE = 1 << 0
RENAME_EXCHANGE = 1 << 1
FALLOC_FL_KEEP_SIZE = 1

IN_HEADER = struct.Struct("<IIQQIIIHH")  # len opcode unique nodeid uid gid pid extlen pad
OUT_HEADER = struct.Struct("<IiQ")  # len error unique
INIT_IN = struct.Struct("<IIII")  # major minor max_readahead flags
# major minor max_readahead flags max_background congestion_threshold max_write time_gran
# max_pages map_alignment flags2 max_stack_depth unused[6]: 64 bytes
INIT_OUT = struct.Struct("<IIIIHHIIHHII24x")
ATTR = struct.Struct("<QQQQQQIIIIIIIIII")  # 88 bytes
ENTRY_HEAD = struct.Struct("<QQQQII")  # nodeid generation entry_valid attr_valid nsecs
ATTR_OUT_HEAD = struct.Struct("<QII")  # attr_valid attr_valid_nsec dummy
GETATTR_IN = struct.Struct("<IIQ")
# valid pad fh size lock_owner atime mtime ctime atimensec mtimensec ctimensec mode _ uid gid _
SETATTR_IN = struct.Struct("<IIQQQQQQIIIIIIII")
OPEN_IN = struct.Struct("<II")  # flags open_flags
OPEN_OUT = struct.Struct("<QII")  # fh open_flags padding
CREATE_IN = struct.Struct("<IIII")  # flags mode umask open_flags
MKNOD_IN = struct.Struct("<IIII")  # mode rdev umask padding
MKDIR_IN = struct.Struct("<II")  # mode umask
RENAME_IN = struct.Struct("<Q")  # newdir
RENAME2_IN = struct.Struct("<QII")  # newdir flags padding
LINK_IN = struct.Struct("<Q")  # oldnodeid
READ_IN = struct.Struct("<QQIIQII")  # fh offset size read_flags lock_owner flags padding
WRITE_IN = struct.Struct("<QQIIQII")  # fh offset size write_flags lock_owner flags padding
WRITE_OUT = struct.Struct("<II")
FSYNC_IN = struct.Struct("<QII")  # fh fsync_flags padding
RELEASE_IN = struct.Struct("<QIIQ")
FORGET_IN = struct.Struct("<Q")
BATCH_FORGET_IN = struct.Struct("<II")
FORGET_ONE = struct.Struct("<QQ")
FALLOCATE_IN = struct.Struct("<QQQII")  # fh offset length mode padding
# blocks bfree bavail files ffree bsize namelen frsize padding spare[6]
STATFS_OUT = struct.Struct("<QQQQQIIII24x")
DIRENT_HEAD = struct.Struct("<QQII")  # ino off namelen type


@dataclass(frozen=True)
class Attr:
    """What GETATTR and every entry reply tell the kernel about an inode."""

    ino: int
    size: int
    mode: int
    nlink: int
    uid: int
    gid: int
    mtime_ns: int

    def pack(self) -> bytes:
        sec, nsec = divmod(self.mtime_ns, 1_000_000_000)
        blocks = (self.size + 511) // 512
        return ATTR.pack(
            self.ino, self.size, blocks, sec, sec, sec, nsec, nsec, nsec,
            self.mode, self.nlink, self.uid, self.gid, 0, 4096, 0,
        )  # fmt: skip


def entry_out(attr: Attr, valid_s: int = 1) -> bytes:
    """fuse_entry_out: the inode, a generation of 0, and how long the kernel may cache it."""
    return ENTRY_HEAD.pack(attr.ino, 0, valid_s, valid_s, 0, 0) + attr.pack()


def attr_out(attr: Attr, valid_s: int = 1) -> bytes:
    return ATTR_OUT_HEAD.pack(valid_s, 0, 0) + attr.pack()


def dirent(ino: int, offset: int, name: bytes, dtype: int) -> bytes:
    """One fuse_dirent, its name padded to 8 bytes; `offset` is the cookie of the next one."""
    raw = DIRENT_HEAD.pack(ino, offset, len(name), dtype) + name
    return raw + b"\0" * (-len(raw) % 8)


def names(body: bytes, count: int) -> list[bytes]:
    """The `count` NUL-terminated names at the start of a request body."""
    return body.split(b"\0")[:count]
