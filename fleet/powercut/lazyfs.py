"""A FUSE file system that keeps every write in memory until it is fsync'd, as LazyFS does:
kill its process and whatever was not fsync'd is gone, as after a power cut.

It passes through to a backing folder. Data written to a file waits in this process's
memory (a page cache of 4 KiB pages per file) and reaches the backing file only on an
``fsync``/``fdatasync`` of that file; reads see the cached pages over the backing bytes.
Metadata is written through at once (create, rename, unlink, truncate, mkdir), as a
journalling file system (ext4's default ``data=ordered``) commits it within seconds
regardless of data: the failure this models is the one that matters for SQLite and
for temp-file-then-rename writers, data that the kernel acknowledged and never flushed.
A directory fsync is therefore a no-op here; it costs nothing and loses nothing.

``python -m fleet.powercut.lazyfs BACKING MOUNTPOINT`` serves in the foreground until
killed; :mod:`fleet.powercut.mount` starts, cuts and remounts it.
"""

from __future__ import annotations

import errno
import os
import sys
import threading
from dataclasses import dataclass, field
from typing import Any

import mfusepy

PAGE = 4096


@dataclass
class Dirty:
    """The unsynced state of one file: its logical size and the pages written since the
    last fsync (index -> PAGE bytes)."""

    size: int
    pages: dict[int, bytearray] = field(default_factory=dict)


class LazyFS(mfusepy.Operations):
    """Pass-through to ``backing`` with a write-back cache that only fsync drains."""

    use_ns = True

    def __init__(self, backing: str) -> None:
        self.backing = os.path.realpath(backing)
        # One lock: FUSE calls come on several threads, and a page is read, changed and
        # put back under it.
        self._lock = threading.RLock()
        self._dirty: dict[str, Dirty] = {}  # by path within the mount
        self.synced = 0  # fsyncs served, for a caller's check that writers fsync at all

    def _real(self, path: str) -> str:
        return os.path.join(self.backing, path.lstrip("/"))

    # -- metadata: through at once ----------------------------------------------------

    def getattr(self, path: str, fh: int | None = None) -> dict[str, Any]:
        try:
            st = os.lstat(self._real(path))
        except OSError as exc:
            raise mfusepy.FuseOSError(exc.errno) from exc
        attrs = {
            key: getattr(st, key)
            for key in ("st_mode", "st_nlink", "st_uid", "st_gid", "st_size",
                        "st_atime_ns", "st_mtime_ns", "st_ctime_ns")
        }  # fmt: skip
        for key in ("st_atime", "st_mtime", "st_ctime"):
            attrs[key] = attrs.pop(key + "_ns")
        with self._lock:
            dirty = self._dirty.get(path)
            if dirty is not None:
                attrs["st_size"] = dirty.size
        return attrs

    def readdir(self, path: str, fh: int) -> list[str]:
        return [".", "..", *os.listdir(self._real(path))]

    def access(self, path: str, amode: int) -> int:
        if not os.access(self._real(path), amode):
            raise mfusepy.FuseOSError(errno.EACCES)
        return 0

    def chmod(self, path: str, mode: int) -> int:
        os.chmod(self._real(path), mode)
        return 0

    def chown(self, path: str, uid: int, gid: int) -> int:
        os.chown(self._real(path), uid, gid)
        return 0

    def utimens(self, path: str, times: tuple[int, int] | None = None) -> int:
        if times is None:
            os.utime(self._real(path))
        else:
            os.utime(self._real(path), ns=times)
        return 0

    def mkdir(self, path: str, mode: int) -> int:
        os.mkdir(self._real(path), mode)
        return 0

    def rmdir(self, path: str) -> int:
        os.rmdir(self._real(path))
        return 0

    def unlink(self, path: str) -> int:
        with self._lock:
            os.unlink(self._real(path))
            self._dirty.pop(path, None)
        return 0

    def rename(self, old: str, new: str) -> int:
        # The name moves now; the data the old name had not fsync'd moves with it, still
        # unsynced (a rename is no flush: the zero-length file after a crash).
        with self._lock:
            os.rename(self._real(old), self._real(new))
            self._dirty.pop(new, None)
            moved = self._dirty.pop(old, None)
            if moved is not None:
                self._dirty[new] = moved
        return 0

    def statfs(self, path: str) -> dict[str, int]:
        st = os.statvfs(self._real(path))
        return {
            key: getattr(st, key)
            for key in ("f_bavail", "f_bfree", "f_blocks", "f_bsize", "f_favail", "f_ffree",
                        "f_files", "f_flag", "f_frsize", "f_namemax")
        }  # fmt: skip

    def create(self, path: str, mode: int, fi: Any = None) -> int:
        fd = os.open(self._real(path), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
        os.close(fd)
        with self._lock:
            self._dirty.pop(path, None)
        return 0

    def open(self, path: str, flags: int) -> int:
        if not os.path.exists(self._real(path)):
            raise mfusepy.FuseOSError(errno.ENOENT)
        return 0

    def truncate(self, path: str, length: int, fh: int | None = None) -> int:
        with self._lock:
            os.truncate(self._real(path), length)
            dirty = self._dirty.get(path)
            if dirty is not None:
                dirty.size = length
                for index in [i for i in dirty.pages if i * PAGE >= length]:
                    del dirty.pages[index]
                last = dirty.pages.get(length // PAGE)
                if last is not None:
                    last[length % PAGE :] = bytes(PAGE - length % PAGE)
        return 0

    # -- data: cached until fsync ------------------------------------------------------

    def _backing_page(self, path: str, index: int) -> bytearray:
        with open(self._real(path), "rb") as handle:
            handle.seek(index * PAGE)
            data = handle.read(PAGE)
        return bytearray(data.ljust(PAGE, b"\0"))

    def read(self, path: str, size: int, offset: int, fh: int) -> bytes:
        with self._lock:
            dirty = self._dirty.get(path)
            if dirty is None:
                with open(self._real(path), "rb") as handle:
                    handle.seek(offset)
                    return handle.read(size)
            end = min(offset + size, dirty.size)
            out = bytearray()
            position = offset
            while position < end:
                index, start = divmod(position, PAGE)
                page = dirty.pages.get(index)
                if page is None:
                    page = self._backing_page(path, index)
                take = min(PAGE - start, end - position)
                out += page[start : start + take]
                position += take
            return bytes(out)

    def write(self, path: str, data: bytes, offset: int, fh: int) -> int:
        with self._lock:
            dirty = self._dirty.get(path)
            if dirty is None:
                dirty = self._dirty[path] = Dirty(size=os.path.getsize(self._real(path)))
            position, view = offset, memoryview(data)
            while view:
                index, start = divmod(position, PAGE)
                page = dirty.pages.get(index)
                if page is None:
                    page = dirty.pages[index] = (
                        self._backing_page(path, index)
                        if index * PAGE < dirty.size
                        else bytearray(PAGE)
                    )
                take = min(PAGE - start, len(view))
                page[start : start + take] = view[:take]
                view, position = view[take:], position + take
            dirty.size = max(dirty.size, offset + len(data))
        return len(data)

    def fsync(self, path: str, datasync: int, fh: int) -> int:
        with self._lock:
            self.synced += 1
            dirty = self._dirty.pop(path, None)
            if dirty is None:
                return 0
            with open(self._real(path), "r+b") as handle:
                for index in sorted(dirty.pages):
                    start = index * PAGE
                    if start < dirty.size:
                        handle.seek(start)
                        handle.write(dirty.pages[index][: dirty.size - start])
                handle.truncate(dirty.size)
            # The backing folder is not ours to crash: nothing to gain from its fsync.
        return 0

    def flush(self, path: str, fh: int) -> int:
        return 0  # close(2) is no flush to disk

    def release(self, path: str, fh: int) -> int:
        return 0  # the cache outlives the handle, as the kernel's page cache does

    def fsyncdir(self, path: str, datasync: int, fh: int) -> int:
        return 0  # metadata is through already (module text)


def main(argv: list[str] | None = None) -> int:
    backing, mountpoint = argv if argv is not None else sys.argv[1:]
    # default_permissions: the kernel checks modes (we run as root and pass as root).
    mfusepy.FUSE(LazyFS(backing), mountpoint, foreground=True, default_permissions=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
