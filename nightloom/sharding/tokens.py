"""Megatron indexed datasets (.bin + .idx) per shard: every document's token ids then EOS, in the shard's row order.

One sequence per document (the tokenizer's ids exactly as its own rules produce them, then the EOS id), so a
shard's .bin is the trainer's packed stream as is, and Megatron-LM (`GPTDataset`), NeMo and nightloom read the
same files. Layout, from megatron-core 0.16.1 `megatron/core/datasets/indexed_dataset.py` (`_IndexWriter`):

    .bin  the ids back to back, little-endian: uint8 (at most 256 ids: the `bytes` tokenizer), uint16 (vocab
          < 65,500) or int32 (`DType.optimal_dtype`, which has no uint8 rule: its readers take any `DType` code)
    .idx  b"MMIDIDX\\x00\\x00", <Q version (1), <B dtype code (uint8 1, uint16 8, int32 4), <Q sequence count n,
          <Q document count (n + 1), int32 sequence lengths [n], int64 byte pointers [n],
          int64 document indices [n + 1] (0, 1, …, n: each document is one sequence)

Written with numpy a chunk at a time (lengths spill to a work file), so memory does not grow with the shard;
both files are hashed (xxh3-128, ~5× faster than sha256 on these twice-the-text files) while they are written.

Chats (train.task sft) differ in two ways: a document is the conversation's ids exactly as its chat template ends
them (no EOS appended here: nightloom/chat.py appends one only to a template whose assistant turn has no end
token), and beside the .bin a `<prefix>.labels.bin` holds one uint8 per id (1 = an assistant token, a label;
0 = context), aligned with the .bin, so a reader takes a document's labels at the same offsets as its ids.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import xxhash

from nightloom.sharding.arrays import CHUNK_RECORDS, ArrayReader, ArrayWriter
from nightloom.sharding.directio import DirectWriter

INDEX_HEADER = b"MMIDIDX\x00\x00"
INDEX_VERSION = 1
DTYPE_CODES = {"uint8": 1, "uint16": 8, "int32": 4}  # megatron.core.datasets.indexed_dataset.DType
LENGTH_DTYPE = np.dtype("<i4")
LABEL_DTYPE = np.dtype("u1")
LABELS_SUFFIX = ".labels.bin"
HASH_PREFIX = "xxh3-128:"


def token_dtype(vocab_size: int) -> str:
    """The smallest dtype that holds every id: uint8 for at most 256 ids (the `bytes` tokenizer: its .bin is then the
    text's own bytes, half the disk and write time of uint16), else Megatron's rule (`DType.optimal_dtype`): uint16
    when the vocabulary has fewer than 65,500 ids, else int32."""
    if vocab_size <= 256:
        return "uint8"
    return "uint16" if vocab_size < 65_500 else "int32"


def labels_file_name(prefix: str) -> str:
    """The label-mask file of the indexed dataset `prefix` (chats)."""
    return prefix + LABELS_SUFFIX


def read_lengths(idx: bytes) -> np.ndarray:
    """The sequence lengths of a .idx file's bytes (int64; one sequence per document here)."""
    if idx[: len(INDEX_HEADER)] != INDEX_HEADER:
        raise ValueError("not a Megatron .idx file (bad header)")
    n = struct.unpack_from("<Q", idx, len(INDEX_HEADER) + 9)[0]
    return np.frombuffer(idx, dtype=LENGTH_DTYPE, count=n, offset=len(INDEX_HEADER) + 25).astype(np.int64)


def np_dtype(name: str) -> np.dtype:
    if name not in DTYPE_CODES:
        raise ValueError(f"token dtype {name!r}: expected one of {sorted(DTYPE_CODES)}")
    return np.dtype(name).newbyteorder("<")


def with_eos(lengths: np.ndarray, ids: np.ndarray, eos_id: int, dtype: np.dtype) -> np.ndarray:
    """`ids` (documents back to back, `lengths` ids each) with `eos_id` after every document, as `dtype`.
    (A mask assignment: ~15× faster than np.insert, which dominated the write step for the bytes tokenizer.)"""
    ends = np.cumsum(np.asarray(lengths, dtype=np.int64) + 1) - 1  # where each document's EOS goes
    out = np.empty(len(ids) + len(ends), dtype=dtype)
    body = np.ones(len(out), dtype=bool)
    body[ends] = False
    out[body] = ids
    out[ends] = eos_id
    return out


def utf8_ids(texts: pa.Array | pa.ChunkedArray) -> tuple[np.ndarray, np.ndarray]:
    """(bytes per document, every document's UTF-8 bytes back to back): the `bytes` tokenizer's ids, read straight
    from the Arrow string buffers (no Python strings)."""
    if isinstance(texts, pa.ChunkedArray):
        texts = texts.combine_chunks()
    if pa.types.is_large_string(texts.type):
        off_type = np.int64
    elif pa.types.is_string(texts.type):
        off_type = np.int32
    else:
        raise TypeError(f"utf8_ids: a string array expected, got {texts.type}")
    n = len(texts)
    if n == 0:
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.uint8)
    offsets = np.frombuffer(texts.buffers()[1], dtype=off_type)[texts.offset : texts.offset + n + 1].astype(np.int64)
    buf = texts.buffers()[2]
    data = np.frombuffer(buf, dtype=np.uint8) if buf is not None else np.zeros(0, dtype=np.uint8)
    return np.diff(offsets), data[offsets[0] : offsets[-1]]


def _string_scalar(value: bytes, type_: pa.DataType) -> pa.Scalar:
    """A string scalar built from buffers (pa.scalar first imports pandas, to ask whether it is given a Series)."""
    offsets = np.array([0, len(value)], dtype=np.int64 if pa.types.is_large_string(type_) else np.int32)
    return pa.Array.from_buffers(type_, 1, [None, pa.py_buffer(offsets), pa.py_buffer(value)])[0]


def utf8_ids_with_eos(texts: pa.Array) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(bytes per document, the `bytes` tokenizer's stream as uint8: each document's UTF-8 bytes then a placeholder,
    the placeholders' positions, where EOS goes). Arrow appends the placeholder to every document (one copy, GIL
    released); the writer widens the stream and puts EOS in: ~1.6× faster than `with_eos` on `utf8_ids`' output,
    whose mask assignment holds the GIL."""
    joined = pc.binary_join_element_wise(texts, _string_scalar(b"", texts.type), _string_scalar(b"\x00", texts.type))
    lengths, body = utf8_ids(joined)
    return lengths - 1, body, np.cumsum(lengths) - 1


@dataclass(frozen=True)
class TokenCounts:
    """What one finished .bin/.idx pair holds, and the files' content hashes ("xxh3-128:<hex>"); named as the
    manifest's TokenFiles fields, which take them as they are."""

    documents: int
    tokens: int  # ids in the .bin, one EOS per document included (chats: as the template ends them)
    bin_hash: str
    idx_hash: str
    label_tokens: int = 0  # chats: label ids (1s) in the labels file
    labels_hash: str | None = None  # chats: of the labels file


class TokenFileWriter:
    """Append documents to a .bin (temp path) and build its .idx at `finish`; the caller renames both into place.

    `lengths_path` is a work file for the per-document lengths (the .idx needs them all before the pointers).
    `labels_tmp` (chats): the labels file's temp path; documents are then written without an EOS."""

    def __init__(self, bin_tmp: Path, lengths_path: Path, dtype: str, eos_id: int, labels_tmp: Path | None = None):
        self.dtype, self.eos_id = np_dtype(dtype), int(eos_id)
        self.bin_tmp = Path(bin_tmp)
        self.bin_tmp.parent.mkdir(parents=True, exist_ok=True)
        # written once, never read back here: past the page cache, hashed as it is written
        self._bin = DirectWriter(self.bin_tmp, digest=xxhash.xxh3_128())
        self._labels = None
        try:
            self._lengths = ArrayWriter(lengths_path, LENGTH_DTYPE)
            if labels_tmp is not None:
                self._labels = DirectWriter(Path(labels_tmp), digest=xxhash.xxh3_128())
        except BaseException:
            self._bin.abort()
            raise
        self.documents = self.tokens = self.label_ids = 0

    def add(self, lengths: np.ndarray, ids: np.ndarray, labels: np.ndarray | None = None) -> None:
        """Documents with `lengths` ids each (EOS not included), their ids back to back; chats also give their
        labels (aligned with `ids`) and get no EOS."""
        if not len(lengths):
            return
        if (labels is None) != (self._labels is None):
            raise ValueError("token ids: labels are given exactly when the writer has a labels file (chats)")
        lengths = np.asarray(lengths, dtype=np.int64)
        if int(lengths.sum()) != len(ids):
            raise ValueError(f"token ids: {len(ids)} ids for documents of {int(lengths.sum())} ids in all")
        if len(ids) and np.issubdtype(ids.dtype, np.signedinteger) and int(ids.min()) < 0:
            raise ValueError("token ids: negative id")
        if self.dtype == np.uint16 and len(ids) and int(ids.max()) > np.iinfo(np.uint16).max:
            raise ValueError(f"token ids: id {int(ids.max())} does not fit uint16 (vocab too small in the manifest?)")
        if labels is None:
            self._put(lengths, with_eos(lengths, ids, self.eos_id, self.dtype))
            return
        if len(labels) != len(ids):
            raise ValueError(f"token ids: {len(labels)} labels for {len(ids)} ids")
        mask = np.ascontiguousarray(labels, dtype=LABEL_DTYPE)
        self._labels.write(memoryview(mask).cast("B"))
        self.label_ids += int(mask.sum())
        self._bin.write(memoryview(np.ascontiguousarray(ids, dtype=self.dtype)).cast("B"))
        self._lengths.append(lengths)
        self.documents += len(lengths)
        self.tokens += len(ids)

    def add_texts(self, texts: pa.Array | pa.ChunkedArray) -> None:
        """Documents of the `bytes` tokenizer, whose ids are their UTF-8 bytes (a chunk at a time: no concatenation
        of the chunks first)."""
        for chunk in texts.chunks if isinstance(texts, pa.ChunkedArray) else [texts]:
            if len(chunk):
                lengths, body, eos_at = utf8_ids_with_eos(chunk)
                self._put_widened(body, eos_at)
                self._count(lengths, len(body))

    def _put_widened(self, body: np.ndarray, eos_at: np.ndarray) -> None:
        """Append `body` widened to the token dtype, with EOS at positions `eos_at`, cast straight into the file's
        write buffer a buffer at a time (no array of the widened stream is made)."""
        size, done = self.dtype.itemsize, 0
        while done < len(body):
            dst = np.frombuffer(self._bin.reserve((len(body) - done) * size), dtype=self.dtype)
            n = len(dst)
            np.copyto(dst, body[done : done + n], casting="unsafe")
            lo, hi = np.searchsorted(eos_at, [done, done + n])
            dst[eos_at[lo:hi] - done] = self.eos_id
            self._bin.commit(n * size)
            done += n

    def _put(self, lengths: np.ndarray, stream: np.ndarray) -> None:
        """Append documents of `lengths` ids (EOS not included) whose ids and EOS are `stream`."""
        data = memoryview(stream).cast("B")  # no copy into a bytes object
        self._bin.write(data)
        self._count(lengths, len(stream))

    def _count(self, lengths: np.ndarray, ids: int) -> None:
        self._lengths.append(lengths + 1)
        self.documents += len(lengths)
        self.tokens += ids

    def finish(self, idx_tmp: Path) -> TokenCounts:
        """Close the .bin (and labels) and write the .idx at `idx_tmp` (all still temp paths)."""
        self._bin.close()
        if self._labels is not None:
            self._labels.close()
        self._lengths.publish()
        n = self.documents
        h = xxhash.xxh3_128()
        with open(idx_tmp, "wb") as f:

            def put(b: bytes) -> None:
                f.write(b)
                h.update(b)

            put(INDEX_HEADER + struct.pack("<Q", INDEX_VERSION) + struct.pack("<B", DTYPE_CODES[self.dtype.name]))
            put(struct.pack("<Q", n) + struct.pack("<Q", n + 1))
            with ArrayReader(self._lengths.path, LENGTH_DTYPE) as r:
                for chunk in r.chunks():
                    put(chunk.tobytes())
            pos = 0
            with ArrayReader(self._lengths.path, LENGTH_DTYPE) as r:
                for chunk in r.chunks():
                    ends = np.cumsum(chunk.astype(np.int64) * self.dtype.itemsize) + pos
                    put((ends - chunk.astype(np.int64) * self.dtype.itemsize).astype("<i8").tobytes())
                    pos = int(ends[-1])
            for a in range(0, n + 1, CHUNK_RECORDS):
                put(np.arange(a, min(a + CHUNK_RECORDS, n + 1), dtype="<i8").tobytes())
        self._lengths.path.unlink(missing_ok=True)
        labels_hash = HASH_PREFIX + self._labels.digest.hexdigest() if self._labels is not None else None
        bin_hash, idx_hash = HASH_PREFIX + self._bin.digest.hexdigest(), HASH_PREFIX + h.hexdigest()
        return TokenCounts(n, self.tokens, bin_hash, idx_hash, self.label_ids, labels_hash)

    def abort(self) -> None:
        self._bin.abort()  # closes it if open, and removes the temp file
        if self._labels is not None:
            self._labels.abort()
        self._lengths.abort()  # closes and removes the temp file (a no-op after publish)
        self._lengths.path.unlink(missing_ok=True)
