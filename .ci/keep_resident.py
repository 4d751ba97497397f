"""Keep the test machine's Python libraries in memory while CI runs: map every *.so* and *.pyc under the given
folders (read-only, pre-faulted) and wait until terminated.

Why: these VMs run DAMON proactive reclaim (kdamond, scheme `pageout` of *unmapped* page cache not accessed for
~60 s), and a cold read from their disk runs at ~25-200 MB/s. A library no process has mapped for a minute is
dropped, and the next process that imports it (every torchrun rank, XTuner rank, Prefect worker) reads it from
disk again: the tiny model script took 16 s of wall time for 4.8 CPU-s, `cat libtorch_cpu.so` 17 s cold and
0.07 s warm. Mapped pages are outside that scheme, so one process holding the mappings keeps them warm.
Python's own imports read .pyc files with read(), which the page cache then serves.

Usage: python .ci/keep_resident.py DIR... (prints what it holds, then sleeps; SIGTERM ends it).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import os
import signal
import sys
import time

MAX_MAPS = 60_000  # below vm.max_map_count (65,530): one mapping per file
# libc's mmap, not Python's: an mmap.mmap keeps a dup of its file descriptor, and ~50k files pass the box's
# 20,000-descriptor limit; a raw mapping outlives its closed descriptor
_libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
MAP_FAILED = ctypes.c_void_p(-1).value


def wanted(name: str) -> bool:
    """Byte-compiled modules and shared libraries (`x.so`, `libx.so.1.2`)."""
    return name.endswith((".pyc", ".so")) or ".so." in name


def hold(fd: int, size: int) -> bool:
    """Map the file read-only, every page faulted in now (MAP_POPULATE); the mapping is never undone."""
    addr = _libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED | mmap.MAP_POPULATE, fd, 0)
    return addr not in (None, MAP_FAILED)


def paths_under(dirs: list[str]) -> list[str]:
    """Every wanted file under `dirs`, at most MAX_MAPS."""
    found = [os.path.join(root, name) for top in dirs for root, _, files in os.walk(top) for name in files]
    return [p for p in found if wanted(os.path.basename(p))][:MAX_MAPS]


def each_fd(paths: list[str], fn) -> None:
    """fn(fd) for every file that opens read-only; a file that vanished or cannot be read is skipped."""
    for path in paths:
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            continue
        try:
            fn(fd)
        except OSError:
            pass
        finally:
            os.close(fd)


def main(dirs: list[str]) -> int:
    held = [0, 0]  # files, bytes
    t0 = time.monotonic()
    paths = paths_under(dirs)
    # ask for every file's pages at once (POSIX_FADV_WILLNEED starts readahead and returns), so the disk sees a
    # deep queue of reads instead of one small file's worth at a time while each mapping faults in
    each_fd(paths, lambda fd: os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_WILLNEED))

    def keep(fd: int) -> None:
        size = os.fstat(fd).st_size
        if size and hold(fd, size):
            held[0], held[1] = held[0] + 1, held[1] + size

    each_fd(paths, keep)
    print(
        f"[keep_resident] holding {held[0]} files, {held[1] / 2**20:.0f} MiB, mapped in {time.monotonic() - t0:.1f} s",
        flush=True,
    )
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    while True:
        signal.pause()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
