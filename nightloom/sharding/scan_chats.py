"""The scan's chat path (train.task sft): each record a conversation, rendered with the chat template into ids and
assistant labels (nightloom/chat.py) as it is scanned.

Records are whole JSON objects (JSONL) or rows (Parquet, Arrow). A record that is not a usable chat (an unknown
role, no messages, no assistant turn, a content that is not a string, a template that refuses it or gives labels
the prefix rule cannot check) is a bad record reported as file:line, honouring `sharding.on_error` like any other.
A conversation is hashed, deduplicated and balanced by its rendered text and its templated ids; one longer than
seq_len + 1 ids is cut at a turn boundary or dropped, and counted either way (`ScanResult.chats_cut`/`_dropped`).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import xxhash

from nightloom.chat import ChatError, ChatSettings, Conversation, renderer, to_messages
from nightloom.chat_pairs import render_pair, to_pair
from nightloom.sharding.errors import BadInputError
from nightloom.sharding.hashing import DEDUP_SEED
from nightloom.sharding.job import ShardJob
from nightloom.sharding.scan_records import RecordBuffer, count_bad, key_bytes
from nightloom.sharding.scan_result import ScanResult
from nightloom.sharding.sources import (
    BATCH_ROWS,
    NO_EXTRAS,
    SourceRef,
    json_lines,
    read_extras,
)

Record = tuple[int, "dict | None", object, "str | None", "tuple[str | None, ...]"]  # where, record, key, error, extras


def _checked(n: int, obj, key_field: str | None, keep: tuple[str, ...]) -> Record:
    if type(obj) is not dict:
        return n, None, None, f"expected a JSON object, got {type(obj).__name__}", NO_EXTRAS
    key = None
    if key_field is not None:
        if obj.get(key_field) is None:
            return n, None, None, f"missing key field {key_field!r}", NO_EXTRAS
        key = obj[key_field]
    extras, err = read_extras(obj.get, obj.__contains__, keep) if keep else (NO_EXTRAS, None)
    if err is not None:
        return n, None, None, err, NO_EXTRAS
    return n, obj, key, None, extras


def _jsonl(path: Path, key_field: str | None, keep: tuple[str, ...], span) -> Iterator[Record]:
    for n, obj, err in json_lines(path, span):
        yield (n, None, None, err, NO_EXTRAS) if err is not None else _checked(n, obj, key_field, keep)


def _columnar(path: Path, fmt: str, key_field: str | None, keep: tuple[str, ...]) -> Iterator[Record]:
    """Parquet or Arrow rows as dicts (nested lists and structs as Python values); `where` is the row number."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        if fmt == "parquet":
            batches = pq.ParquetFile(path).iter_batches(batch_size=BATCH_ROWS)
        else:
            src = pa.memory_map(str(path))
            try:
                batches = iter(pa.ipc.open_stream(src))
            except pa.ArrowInvalid:
                src.seek(0)
                reader = pa.ipc.open_file(src)
                batches = (reader.get_batch(i) for i in range(reader.num_record_batches))
        row = 0
        for batch in batches:
            for obj in batch.to_pylist():
                row += 1
                yield _checked(row, obj, key_field, keep)
    except (pa.ArrowInvalid, pa.ArrowIOError, OSError) as e:
        raise BadInputError(f"{path}: corrupt {'Parquet' if fmt == 'parquet' else 'Arrow'} file: {e}") from None


def read_chat_records(
    path: Path, fmt: str, key_field: str | None = None, keep: tuple[str, ...] = (), span=None
) -> Iterator[Record]:
    """Every record of a JSONL, Parquet or Arrow file as a dict, with its line (row) number."""
    if fmt == "jsonl":
        return _jsonl(path, key_field, keep, span)
    if fmt in ("parquet", "arrow"):
        return _columnar(path, fmt, key_field, keep)
    raise BadInputError(f"{path}: a plain text file holds no chat records (train.task sft reads JSONL or Parquet)")


def first_record(path: Path, fmt: str) -> dict | None:
    """The first good record of a file (what `dataset.style: auto` sees first), or None."""
    for _, obj, _, err, _ in read_chat_records(path, fmt):
        if err is None:
            return obj
    return None


def _render(render, record: dict, chat: ChatSettings) -> Conversation | None:
    """A record as one document: a conversation (sft) or a preference pair (dpo: nightloom/chat_pairs.py)."""
    if chat.task == "dpo":
        return render_pair(render, to_pair(record))
    return render.render(to_messages(record, chat.style))


def scan_chats(
    local: Path, src: SourceRef, job: ShardJob, buf: RecordBuffer, res: ScanResult, span: tuple[int, int] | None
) -> None:
    """Chat path: file:line for every problem (honours on_error); each conversation rendered once, here."""
    chat = job.chat
    render = renderer(job.tokenizer.path, chat)
    salt = job.sharding.salt.encode("utf-8")
    fail = job.sharding.on_error == "fail"
    xx64, xx3 = xxhash.xxh64_intdigest, xxhash.xxh3_64_intdigest
    for where, record, key, err, extras in read_chat_records(
        local, src.format, job.sharding.key_field, job.extra_columns, span
    ):
        res.records += 1
        conv = None
        if err is None:
            try:
                conv = _render(render, record, chat)
            except ChatError as e:
                err = str(e)
        if err is not None:
            count_bad(res, src, where, err, fail)
            continue
        if conv is None:  # no run of whole turns ending with an assistant turn fits seq_len + 1 ids
            res.chats_dropped += 1
            continue
        res.chats_cut += conv.cut
        tb = conv.text.encode("utf-8")
        kb = tb if key is None else key_bytes(key)
        nb_all = len(tb) + len(kb) if buf.separate_key else len(tb)
        meta = (xx64(kb + salt), xx3(kb, seed=DEDUP_SEED), len(conv.ids), nb_all, 0)
        buf.add(tb, kb, meta, extras, conv.ids, conv.labels)


def render_chat_file(path: Path, tokenizer_dir: str | Path, chat: ChatSettings) -> tuple[list[Conversation], int]:
    """(conversations, dropped): every record of a JSONL file of chats rendered as the shard stage renders them
    (evaluation: `validate.eval_data`, `nightloom eval`), in file order; ChatError naming file:line for the first
    bad record."""
    render = renderer(tokenizer_dir, chat)
    out, dropped = [], 0
    for where, record, _, err, _ in read_chat_records(path, "jsonl"):
        try:
            if err is not None:
                raise ChatError(err)
            conv = _render(render, record, chat)
        except ChatError as e:
            raise ChatError(f"{path}:{where}: {e}") from None
        if conv is None:
            dropped += 1
        else:
            out.append(conv)
    return out, dropped
