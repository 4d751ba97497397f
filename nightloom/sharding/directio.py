"""Write-once output files with O_DIRECT: the bytes go from two reused, page-aligned buffers straight to the disk,
past the page cache, while the next buffer fills.

The shard stage writes ~3× the corpus that it never reads again (the `.bin` token files are 2× the text with the
`bytes` tokenizer, then the Parquet shards). Through the page cache every written byte first needs a page of it,
and on VMs whose memory is backed on first touch and handed back when freed (virtio-balloon free page reporting,
as on the machines this project is measured on) a fresh page costs far more than the copy: `dd` of 2 GiB here,
buffered with fdatasync, took 2.4-6.0 s of kernel CPU against 0.17-0.30 s with O_DIRECT. The buffers come from
a small pool, so they stay hot from file to file. Where the file system refuses O_DIRECT (some FUSE and network
mounts, older tmpfs), the same class writes through the page cache.
"""

from __future__ import annotations

import errno
import mmap
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

ALIGN = 4096  # O_DIRECT wants buffer, offset and length aligned to the device's logical block (512 or 4096)
BUFFER_BYTES = 8 * 1024 * 1024
O_DIRECT = getattr(os, "O_DIRECT", 0)


class _BufferPool:
    """Staging buffers kept for the next file (a fresh one costs a page fault per page, a host fault on such VMs);
    at most `keep` are kept, so memory is bounded by the writers open at once."""

    def __init__(self, keep: int = 8):
        self.keep, self.free, self.lock = keep, {}, threading.Lock()

    def get(self, size: int) -> mmap.mmap:
        with self.lock:
            free = self.free.get(size)
            if free:
                return free.pop()
        buf = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE)  # page-aligned; private: a forked child gets its own
        if hasattr(buf, "madvise") and hasattr(mmap, "MADV_HUGEPAGE"):
            buf.madvise(mmap.MADV_HUGEPAGE)  # 2 MiB pages where the kernel allows: 512× fewer faults
        return buf

    def put(self, buf: mmap.mmap) -> None:
        """Keep `buf` for the next file, or let it go (unmapped once the last view of it is gone)."""
        with self.lock:
            if sum(map(len, self.free.values())) < self.keep:
                self.free.setdefault(len(buf), []).append(buf)


_POOL = _BufferPool()


class DirectWriter:
    """Append bytes to a new file at `path` (truncated); `close` pads the last block, then truncates the file to
    exactly the bytes written. One background thread writes a full buffer while the caller fills the other."""

    def __init__(self, path: Path | str, buffer_bytes: int = BUFFER_BYTES, digest=None):
        """`digest`: a hashlib-like object fed every byte written (the file's hash without reading it back)."""
        self.path, self.digest = Path(path), digest
        self.cap = max(ALIGN, buffer_bytes // ALIGN * ALIGN)
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_CLOEXEC", 0)
        self.direct = bool(O_DIRECT)
        try:
            self.fd = os.open(self.path, flags | O_DIRECT, 0o644)
        except OSError as err:
            if err.errno != errno.EINVAL:
                raise
            self.direct, self.fd = False, os.open(self.path, flags, 0o644)
        try:
            self._bufs = [_POOL.get(self.cap) for _ in range(2)]
        except BaseException:
            os.close(self.fd)
            self.path.unlink(missing_ok=True)
            raise
        self._views = [memoryview(b) for b in self._bufs]
        self._cur = self._fill = 0
        self.size = 0  # bytes accepted so far
        self._io = ThreadPoolExecutor(1, thread_name_prefix="nightloom-direct-write")
        self._pending: Future | None = None
        self._error: BaseException | None = None  # a failed background write: every later call raises it
        self.closed = self.aborted = False

    def _put(self, view: memoryview) -> None:
        """Write `view` at the file's end: O_DIRECT unless the file system refuses it (EINVAL: the rest, from where
        the writes stopped, goes buffered; a short unaligned O_DIRECT write ends that way too)."""
        while len(view):
            try:
                view = view[os.write(self.fd, view) :]
            except OSError as err:
                if not (self.direct and err.errno == errno.EINVAL):
                    raise
                import fcntl  # only where O_DIRECT exists (Linux); not on Windows

                self.direct = False
                fcntl.fcntl(self.fd, fcntl.F_SETFL, fcntl.fcntl(self.fd, fcntl.F_GETFL) & ~O_DIRECT)

    def _wait(self) -> None:
        if self._error is not None:
            raise self._error
        if self._pending is not None:
            pending, self._pending = self._pending, None
            try:
                pending.result()
            except BaseException as err:
                self._error = err
                raise

    def _submit(self, n: int) -> None:
        """Hand the current buffer's first `n` bytes to the writer thread and switch to the other buffer."""
        self._wait()  # the other buffer's write is done before it is filled again
        self._pending = self._io.submit(self._put, self._views[self._cur][:n])
        self._cur, self._fill = 1 - self._cur, 0

    def write(self, data) -> int:
        mv = memoryview(data).cast("B")
        if self.aborted:  # what a buffered stream in front of this one flushes as it is torn down: the file is gone
            return len(mv)
        if self.closed:
            raise ValueError(f"{self.path}: write after close")
        if self._error is not None:
            raise self._error
        if self.digest is not None:
            self.digest.update(mv)
        total = len(mv)
        self.size += total  # counted with the digest: a failure on the way is sticky, the file is not finished
        while len(mv):
            n = min(len(mv), self.cap - self._fill)
            self._views[self._cur][self._fill : self._fill + n] = mv[:n]
            self._fill += n
            mv = mv[n:]
            if self._fill == self.cap:
                self._submit(self.cap)
        return total

    def reserve(self, nbytes: int) -> memoryview:
        """The current buffer's free space, at most `nbytes`, to fill in place (no copy into it later); `commit`
        then says how much of it was filled."""
        if self._error is not None:
            raise self._error
        return self._views[self._cur][self._fill : self._fill + min(nbytes, self.cap - self._fill)]

    def commit(self, nbytes: int) -> None:
        if self.digest is not None:
            self.digest.update(self._views[self._cur][self._fill : self._fill + nbytes])
        self._fill += nbytes
        self.size += nbytes
        if self._fill == self.cap:
            self._submit(self.cap)

    def tell(self) -> int:
        return self.size

    def flush(self) -> None:
        """Nothing to do until close: only whole aligned buffers can be written before the end."""

    def close(self) -> None:
        """Write the rest (the last block zero-padded under O_DIRECT, the padding then cut off) and close."""
        if self.closed:
            return
        try:
            tail = self._fill
            if tail:
                padded = -(-tail // ALIGN) * ALIGN if self.direct else tail
                self._views[self._cur][tail:padded] = bytes(padded - tail)
                self._submit(padded)
            self._wait()
            if os.fstat(self.fd).st_size != self.size:
                os.ftruncate(self.fd, self.size)
        finally:
            self._release()

    def abort(self) -> None:
        """Stop, close and remove the file (nothing written is kept; later writes are dropped)."""
        self.aborted = True
        if not self.closed:
            try:
                self._wait()  # the buffer in flight is written before it goes back to the pool
            except Exception:  # noqa: BLE001 - the file is being thrown away; its write error is moot
                pass
            finally:
                self._release()
        self.path.unlink(missing_ok=True)

    def _release(self) -> None:
        self.closed = True
        self._io.shutdown(wait=True)
        os.close(self.fd)
        for v in self._views:
            v.release()
        for b in self._bufs:
            _POOL.put(b)

    def __enter__(self) -> DirectWriter:
        return self

    def __exit__(self, exc_type, *_) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()
