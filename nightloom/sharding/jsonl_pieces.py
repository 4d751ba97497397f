"""JSONL in line-aligned byte pieces: the bytes a range unit reads (`line_span`), and the bounded pieces Arrow's
JSON reader parses (`line_chunks`, decompressing .gz/.zst as it goes).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa

JSON_CHUNK = 16 * 1024 * 1024  # JSONL is parsed in line-aligned pieces of this size (bounded memory)
NEWLINE_SEARCH = 1 << 16  # the last newline of a piece is looked for here first


def _after_newline(f, pos: int, size: int) -> int:
    """The offset just past the first newline at or after `pos` in the open file `f` (`size` if there is none)."""
    f.seek(pos)
    while pos < size:
        chunk = f.read(NEWLINE_SEARCH)
        if not chunk:
            break
        hit = chunk.find(b"\n")
        if hit >= 0:
            return pos + hit + 1
        pos += len(chunk)
    return size


def line_span(local: Path, start: int, stop: int) -> tuple[int, int]:
    """The bytes a range unit [start, stop) reads: every line that starts in it, so consecutive ranges of a file
    read each line exactly once whatever the range size (a line is in the range its first byte is in)."""
    size = local.stat().st_size
    with open(local, "rb", buffering=0) as f:
        a = 0 if start <= 0 else _after_newline(f, start - 1, size)
        b = size if stop >= size else _after_newline(f, stop - 1, size)
    return a, max(a, b)


def line_chunks(local: Path, size: int = JSON_CHUNK, span: tuple[int, int] | None = None):
    """Line-aligned Arrow buffers of about `size` bytes (a longer line makes a longer piece), decompressing as it
    goes; only the bytes of `span` (line-aligned, of an uncompressed file) when given. Pieces are slices of what
    was read; a blank partial last line is dropped."""
    name = local.name.lower()
    comp = "gzip" if name.endswith(".gz") else "zstd" if name.endswith((".zst", ".zstd")) else None
    if comp is None:
        yield from _file_pieces(local, size, span or (0, local.stat().st_size))
    else:
        yield from _stream_pieces(pa.input_stream(str(local), compression=comp), size)


def _last_newline(data: pa.Buffer) -> int:
    """The index of the last b"\n" in `data` (its tail is searched first), or -1."""
    view = np.frombuffer(data, dtype=np.uint8)
    tail = view[-NEWLINE_SEARCH:]
    hits = np.flatnonzero(tail == 10)
    if len(hits):
        return len(view) - len(tail) + int(hits[-1])
    hits = np.flatnonzero(view == 10)
    return int(hits[-1]) if len(hits) else -1


def _file_pieces(local: Path, size: int, span: tuple[int, int]):
    """An uncompressed file's bytes [start, end): each read starts right after the last piece's newline (the
    partial line is read again: nothing is copied; joining it to the next read cost two copies of the corpus,
    under the GIL); a line longer than a read is read again, twice as far."""
    pos, end = span
    with pa.OSFile(str(local)) as f:
        n = size
        while pos < end:
            f.seek(pos)
            data = f.read_buffer(min(n, end - pos))
            last = not data.size or pos + data.size >= end
            cut = _last_newline(data)
            if cut < 0 and not last:
                n *= 2
                continue
            n = size
            if cut >= 0:
                yield data.slice(0, cut + 1)
            if last:
                tail = data.slice(cut + 1)
                if tail.size and tail.to_pybytes().strip():
                    yield tail
                return
            pos += cut + 1


def _stream_pieces(stream, size: int):
    """A compressed stream, which cannot seek: a piece's partial last line is joined to the next read."""
    with stream as f:
        rest: pa.Buffer | None = None
        while (data := f.read_buffer(size)).size:
            if rest is not None:
                data = pa.py_buffer(rest.to_pybytes() + data.to_pybytes())
            cut = _last_newline(data)
            if cut < 0:
                rest = data
                continue
            yield data.slice(0, cut + 1)
            rest = data.slice(cut + 1) if cut + 1 < data.size else None
        if rest is not None and rest.to_pybytes().strip():
            yield rest
