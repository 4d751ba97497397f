"""DirectWriter: write-once files past the page cache, byte for byte what was given, whatever the file system."""

from __future__ import annotations

import errno
import hashlib
import os

import numpy as np
import pytest

from nightloom.sharding import directio
from nightloom.sharding.directio import ALIGN, DirectWriter
from tests.support.sharding import takes_o_direct


def _pieces(seed: int, total: int) -> list[bytes]:
    rng = np.random.default_rng(seed)
    out, n = [], 0
    while n < total:
        k = int(rng.choice([1, 7, ALIGN - 1, ALIGN, 3 * ALIGN + 5, 20_000]))
        out.append(rng.integers(0, 256, size=k, dtype=np.uint8).tobytes())
        n += k
    return out


@pytest.mark.parametrize("tail", [0, 1, ALIGN - 1])
def test_written_bytes_and_hash_equal_what_was_given_across_buffer_ends(tmp_path, tail):
    pieces = _pieces(1, 5 * 2 * ALIGN) + [b"x" * tail]
    path = tmp_path / "f.bin"
    with DirectWriter(path, buffer_bytes=2 * ALIGN, digest=hashlib.sha256()) as w:
        for p in pieces:
            assert w.write(p) == len(p)
        mid = w.reserve(3)  # filled in place: the path the token writer casts into
        mid[:] = b"abc"
        w.commit(3)
    data = b"".join(pieces) + b"abc"
    assert path.read_bytes() == data  # the padding of the last block is cut off
    assert w.size == len(data) and w.digest.hexdigest() == hashlib.sha256(data).hexdigest()
    assert w.direct or not takes_o_direct(tmp_path)


def test_a_file_system_that_refuses_o_direct_on_write_gets_buffered_writes(tmp_path, monkeypatch):
    real = os.write
    refused = []

    def refuse_direct(fd, data):
        if os.O_DIRECT & __import__("fcntl").fcntl(fd, __import__("fcntl").F_GETFL):
            refused.append(fd)
            raise OSError(errno.EINVAL, "Invalid argument")
        return real(fd, data)

    monkeypatch.setattr(directio.os, "write", refuse_direct)
    pieces = _pieces(2, 6 * ALIGN)
    with DirectWriter(tmp_path / "f.bin", buffer_bytes=ALIGN) as w:
        for p in pieces:
            w.write(p)
    assert (tmp_path / "f.bin").read_bytes() == b"".join(pieces)
    assert not w.direct and (refused or not takes_o_direct(tmp_path))


def test_an_error_removes_the_file_and_buffers_are_reused(tmp_path, monkeypatch):
    monkeypatch.setattr(directio, "_POOL", directio._BufferPool())
    with pytest.raises(RuntimeError), DirectWriter(tmp_path / "f.bin", buffer_bytes=ALIGN) as w:
        w.write(b"y" * (3 * ALIGN))
        raise RuntimeError("stop")
    assert not (tmp_path / "f.bin").exists() and w.closed
    kept = {id(b) for b in w._bufs}
    with DirectWriter(tmp_path / "g.bin", buffer_bytes=ALIGN) as again:
        again.write(b"z")
    assert kept & {id(b) for b in again._bufs}  # from the pool, not new maps
    assert (tmp_path / "g.bin").read_bytes() == b"z"


def test_a_write_error_surfaces_and_nothing_is_left(tmp_path, monkeypatch):
    def full(fd, data):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(directio.os, "write", full)
    w = DirectWriter(tmp_path / "f.bin", buffer_bytes=ALIGN)
    with pytest.raises(OSError, match="No space"):
        w.write(b"a" * (4 * ALIGN))
        w.close()
    w.abort()
    assert not (tmp_path / "f.bin").exists()


def test_a_write_after_close_is_an_error_and_after_abort_is_dropped(tmp_path):
    w = DirectWriter(tmp_path / "f.bin", buffer_bytes=ALIGN)
    w.write(b"abc")
    w.close()
    with pytest.raises(ValueError, match="write after close"):
        w.write(b"d")
    assert (tmp_path / "f.bin").read_bytes() == b"abc"
    gone = DirectWriter(tmp_path / "g.bin", buffer_bytes=ALIGN)
    gone.write(b"x" * (2 * ALIGN))
    gone.abort()
    assert gone.write(b"late") == 4 and not (tmp_path / "g.bin").exists()  # a buffered stream's last flush


def test_a_short_write_then_einval_resumes_where_it_stopped(tmp_path, monkeypatch):
    """O_DIRECT may write part of a buffer; the rest, unaligned, is refused (EINVAL) and goes buffered, once."""
    import fcntl

    real = os.write
    calls = {"n": 0}

    def short_then_refuse(fd, data):
        direct = os.O_DIRECT & fcntl.fcntl(fd, fcntl.F_GETFL)
        calls["n"] += 1
        if direct and calls["n"] == 1:
            return real(fd, memoryview(data)[:1000])  # a short write of an unaligned count
        if direct:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real(fd, data)

    monkeypatch.setattr(directio.os, "write", short_then_refuse)
    pieces = _pieces(3, 5 * ALIGN)
    with DirectWriter(tmp_path / "f.bin", buffer_bytes=2 * ALIGN, digest=hashlib.sha256()) as w:
        for p in pieces:
            w.write(p)
    data = b"".join(pieces)
    assert (tmp_path / "f.bin").read_bytes() == data
    assert w.digest.hexdigest() == hashlib.sha256(data).hexdigest()


def test_a_failed_background_write_fails_every_later_call(tmp_path, monkeypatch):
    real = os.write
    failed = []

    def full_once(fd, data):
        if not failed:
            failed.append(len(data))
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(fd, data)

    monkeypatch.setattr(directio.os, "write", full_once)
    w = DirectWriter(tmp_path / "f.bin", buffer_bytes=ALIGN)
    with pytest.raises(OSError, match="No space"):
        for _ in range(4):  # the failure shows at a later buffer switch
            w.write(b"a" * ALIGN)
    with pytest.raises(OSError, match="No space"):  # the disk has room again, but a buffer was lost: still an error
        w.write(b"b")
    with pytest.raises(OSError, match="No space"):
        w.close()
    w.abort()
    assert failed and not (tmp_path / "f.bin").exists()
