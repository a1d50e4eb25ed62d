"""The file system a sandboxed program sees: its working directory, the Python it runs on, and
the system's libraries, read-only; nothing else of the machine.

The sandbox (astra.rewards.sandbox) runs its launcher under `unshare --user --map-root-user
--mount` (and `--net`). In that mount namespace the launcher builds a new root on a tmpfs:
read-only binds of the system directories and the Python installation (`visible_paths`), a
writable bind of the working directory, a private /tmp, the four harmless /dev nodes; then it
moves that root over / and changes root into it, so the machine's other files (datasets with
their answers, the service's own code, other runs) have no path at all, root inside the
namespace included (without /proc there is no way back either). The user namespace is used
even when the service runs as root: its root has no capability over the machine's mounts.

Only the launcher's code (`VIEW`) runs in the namespace; this module builds its arguments and
probes once whether the machine allows it. Never imports gRPC.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

# Directories a Python program needs, where they exist (symlinks, as /lib -> usr/lib on a
# merged-/usr system, are recreated as symlinks).
SYSTEM_PATHS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
SYSTEM_FILES = ("/etc/ld.so.cache", "/etc/localtime")
DEVICES = ("/dev/null", "/dev/zero", "/dev/random", "/dev/urandom")

# Runs in the launcher, in the new mount namespace, before the limits are set: `_view(root,
# work, tmp_bytes, devices, paths)` makes `root` the file system (see the module docstring).
VIEW = r"""
import ctypes, os

def _view(root, work, tmp_bytes, devices, paths):
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mount.argtypes = [ctypes.c_char_p] * 3 + [ctypes.c_ulong, ctypes.c_char_p]

    def mount(src, dst, fstype, flags, data=None):
        enc = lambda s: None if s is None else os.fsencode(s)
        if libc.mount(enc(src), enc(dst), enc(fstype), flags, enc(data)) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"mount {src} on {dst}: {os.strerror(err)}")

    RDONLY, NOSUID, NODEV, REMOUNT, BIND, MOVE, REC, PRIVATE = (
        1, 2, 4, 32, 4096, 8192, 16384, 1 << 18)
    # Flags a remount in a user namespace must keep (statvfs bit -> mount bit).
    KEEP = ((2, 2), (4, 4), (8, 8), (1024, 1024), (2048, 2048), (4096, 1 << 21))
    mount(None, "/", None, REC | PRIVATE)
    mount("tmpfs", root, "tmpfs", NOSUID | NODEV, "size=1m,mode=0755")

    def place(path, is_dir):
        target = root + path
        os.makedirs(target if is_dir else os.path.dirname(target), exist_ok=True)
        if not is_dir:
            open(target, "a").close()
        return target

    # A private /tmp first: the Python installation or the working directory may be below it
    # (bound after it, into it).
    mount("tmpfs", place("/tmp", True), "tmpfs", NOSUID | NODEV, f"size={tmp_bytes},mode=1777")
    for path in paths:
        if os.path.islink(path):
            os.makedirs(os.path.dirname(root + path), exist_ok=True)
            if not os.path.lexists(root + path):
                os.symlink(os.readlink(path), root + path)
            continue
        if not os.path.exists(path) or os.path.lexists(root + path):
            continue  # missing here, or inside a path bound already
        target = place(path, os.path.isdir(path))
        mount(path, target, None, BIND | REC)
        flags = os.statvfs(target).f_flag
        kept = sum(bit for stat_bit, bit in KEEP if flags & stat_bit)
        mount(None, target, None, REMOUNT | BIND | RDONLY | kept)
    for dev in devices:
        if os.path.exists(dev):
            mount(dev, place(dev, False), None, BIND)
    mount(work, place(work, True), None, BIND)  # writable; not recursive: nothing below it
    os.chdir(root)
    mount(root, "/", None, MOVE)
    os.chroot(".")
    os.chdir(work)
"""


def visible_paths() -> list[str]:
    """What the sandboxed program may read besides its working directory: the system's
    directories and the Python installation it runs on (its prefix, the base installation
    of a virtual environment, where the executable really is)."""
    python = {
        sys.prefix,
        sys.base_prefix,
        sys.exec_prefix,
        sys.base_exec_prefix,
        str(Path(sys.executable).parent),
        str(Path(os.path.realpath(sys.executable)).parent),
    }
    # A prefix inside a system directory is covered by it; longer paths after shorter ones,
    # so a path inside one bound already is skipped by the launcher.
    return [*SYSTEM_PATHS, *SYSTEM_FILES, *sorted(python, key=len)]


def launcher_args(root: Path, work: Path, tmp_bytes: int) -> list[str]:
    """The arguments `_view` takes, after the limits, in the launcher's argv."""
    return [str(root), str(work), str(tmp_bytes), ",".join(DEVICES), *visible_paths()]
