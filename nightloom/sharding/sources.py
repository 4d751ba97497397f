"""Input discovery and streaming record readers: JSONL (plain/.gz/.zst), Parquet, text folders, HF save_to_disk.

Every reader yields `(where, text, key, error, extras)` tuples one record at a time from a bounded buffer
(never a whole file in memory); `where` is the 1-based line (JSONL) or row (Parquet/Arrow) number used in
messages; `extras` holds the `dataset.keep_columns` values as strings (`column_value`), in that order. A text
field holding a chat messages list (train.grpo's chat prompts) yields that list's JSON text (`messages_text`).
"""

from __future__ import annotations

import gzip
import io
import json
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Literal

import orjson

from nightloom import storage
from nightloom.chat import ROLES, prompt_messages
from nightloom.records import FrozenRecord
from nightloom.sharding.errors import BadInputError, ShardingError
from nightloom.storage import StorageError

Format = Literal["jsonl", "parquet", "text", "arrow"]
_JSONL = (".jsonl", ".ndjson", ".json")
COMPRESSED = (".gz", ".zst", ".zstd")
_TEXT = (".txt", ".text", ".md")
BATCH_ROWS = 4096


class SourceRef(FrozenRecord):
    """One input file: `rel` (its name relative to the dataset path) is what manifests record, never `uri`."""

    rel: str
    uri: str
    size: int
    format: Format
    fingerprint: str = ""


#: names Spark, Hadoop, Databricks and Parquet writers leave beside the data; ignored (and counted), like hidden files
MARKER_NAMES = frozenset({"_SUCCESS", "_metadata", "_common_metadata"})
MARKER_PREFIXES = ("_committed_", "_started_")
IGNORED_EXAMPLES = 10


def ignored_by_name(rel: str) -> bool:
    """A hidden file (any path part starting with "."; our work folder is one) or a known writer's marker file."""
    if rel.startswith(".") or "/." in rel:
        return True
    name = rel.rpartition("/")[2]
    return name in MARKER_NAMES or name.startswith(MARKER_PREFIXES)


class InputListing(FrozenRecord):
    """Every file under the dataset path: the inputs, in order, and the ones ignored by name (nothing else)."""

    sources: list[SourceRef]
    ignored: list[str] = []


def _strip_compression(name: str) -> str:
    for c in COMPRESSED:
        if name.endswith(c):
            return name[: -len(c)]
    return name


def detect_format(name: str, forced: str = "auto") -> Format | None:
    """Format of one file from its name (or the spec's `dataset.format`); None = not a data file."""
    if forced == "hf":
        return "arrow" if name.endswith(".arrow") else None
    if forced != "auto":
        return forced  # type: ignore[return-value]
    base = _strip_compression(name.lower())
    if base.endswith(_JSONL):
        return "jsonl"
    if base.endswith(".parquet"):
        return "parquet"
    if base.endswith(_TEXT):
        return "text"
    return None


def _hf_files(root: str, s3: storage.S3Config | None = None) -> list[str] | None:
    """Arrow files of a `save_to_disk` folder (Dataset or DatasetDict) in their recorded order, else None."""

    def load(name: str) -> dict | None:
        uri = storage.join(root, name)
        try:
            return json.loads(storage.read_bytes(uri, s3))
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
            return None
        except StorageError as err:
            if "no such object" in str(err):
                return None
            raise
        except json.JSONDecodeError as err:
            raise BadInputError(
                f"{uri}:{err.lineno}: invalid JSON in Hugging Face dataset metadata: {err.msg}"
            ) from None

    dd = load("dataset_dict.json")
    if dd is not None:
        out = []
        for split in dd.get("splits", []):
            sub = _hf_files(storage.join(root, split), s3) or []
            out += [f"{split}/{f}" for f in sub]
        return out
    st = load("state.json")
    if st is None:
        return None
    return [f["filename"] for f in st.get("_data_files", [])]


def list_sources(path: str, forced: str = "auto", s3: storage.S3Config | None = None) -> list[SourceRef]:
    """Every input file under `path` (a file, a folder or an s3:// prefix), sorted, with its format."""
    return list_inputs(path, forced, s3).sources


#: a local file's fingerprint from its stat alone (a cache lookup), or "" when it must be read to be known
CachedFingerprint = Callable[[str, os.stat_result], str]


def list_inputs(
    path: str, forced: str = "auto", s3: storage.S3Config | None = None, cached: CachedFingerprint | None = None
) -> InputListing:
    """The input files under `path` (a file, a folder or an s3:// prefix), sorted, with their formats, and the
    files ignored by name (hidden files and writers' markers). Any other file must be readable input.

    Fingerprints: an S3 folder's come with its listing (ETags); a local file's from `cached(rel, stat)` when it
    knows it from the stat the listing already made (no second stat, no second SourceRef per file), else ""."""
    is_remote = storage.is_s3(path)
    if not is_remote and not Path(path).exists():
        raise BadInputError(f"{path}: dataset path not found")
    if is_remote:
        objs = storage.list_files(path, s3)
        if not objs:  # maybe a single object
            if storage.exists(path, s3):
                size, _ = storage.head(path, s3)
                objs = None
                single = [(Path(storage.S3Location.parse(path).key).name, size)]
            else:
                raise BadInputError(f"{path}: no objects under this S3 prefix")
        else:
            single = None
    is_dir = (not is_remote and Path(path).is_dir()) or (is_remote and single is None)
    if not is_dir:
        name = Path(path).name if not is_remote else single[0][0]
        fmt = detect_format(name, forced)
        if fmt is None:
            raise BadInputError(f"{path}: cannot tell the format from the name; set dataset.format")
        if is_remote:
            size, fp = single[0][1], ""
        else:
            st = os.stat(path)
            size, fp = st.st_size, cached(name, st) if cached else ""
        return InputListing(sources=[SourceRef(rel=name, uri=str(path), size=size, format=fmt, fingerprint=fp)])
    hf = _hf_files(path, s3) if forced in ("auto", "hf") else None
    if hf is not None:
        sizes = dict(storage.list_files(path, s3))
        missing = [f for f in hf if f not in sizes]
        if missing:
            raise BadInputError(f"{storage.join(path, missing[0])}: listed in the Hugging Face dataset but missing")
        return InputListing(
            sources=[SourceRef(rel=f, uri=storage.join(path, f), size=sizes[f], format="arrow") for f in hf]
        )
    if forced == "hf":
        raise BadInputError(f"{path}: not a Hugging Face save_to_disk folder (no state.json or dataset_dict.json)")
    out, ignored = [], []
    # an S3 listing carries each object's ETag, its fingerprint: no HEAD request per object later
    listed = (
        [(o.name, o.size, "etag:" + o.etag if o.etag else "") for o in storage.list_objects(path, s3, markers=True)]
        if is_remote
        else [(rel, st.st_size, cached(rel, st) if cached else "") for rel, st in storage.walk_local(str(path))]
    )
    for rel, size, fp in listed:
        if ignored_by_name(rel):
            ignored.append(rel)
            continue
        fmt = detect_format(rel, forced)
        if fmt is None:
            raise BadInputError(f"{storage.join(path, rel)}: unknown input format; set dataset.format or remove it")
        out.append(SourceRef(rel=rel, uri=storage.join(path, rel), size=size, format=fmt, fingerprint=fp))
    if not out:
        shown = f" (ignored by name: {', '.join(ignored[:IGNORED_EXAMPLES])})" if ignored else ""
        raise BadInputError(f"{path}: folder holds no input files{shown}")
    return InputListing(sources=out, ignored=ignored)


def open_binary(path: Path) -> io.BufferedIOBase:
    name = path.name.lower()
    if name.endswith(".gz"):
        return gzip.open(path, "rb")  # type: ignore[return-value]
    if name.endswith((".zst", ".zstd")):
        import zstandard

        raw = open(path, "rb")  # noqa: SIM115 (closed by the stream reader)
        return io.BufferedReader(zstandard.ZstdDecompressor().stream_reader(raw, closefd=True), 1 << 20)
    return open(path, "rb", buffering=1 << 20)


def utf8_error(data: bytes) -> str | None:
    try:
        data.decode("utf-8")
        return None
    except UnicodeDecodeError as e:
        return f"non-UTF-8 byte 0x{data[e.start]:02x} at byte offset {e.start}"


Item = tuple[int, "str | None", "object", "str | None", "tuple[str | None, ...]"]
NO_EXTRAS: tuple[str | None, ...] = ()


def column_value(value: object) -> str | None:
    """A kept column's value as stored in a shard: strings verbatim, null as null, anything else as JSON.

    Raises ValueError for bytes that are not UTF-8."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, bytes):
        return value.decode("utf-8")
    return orjson.dumps(value, default=str).decode("utf-8")


def read_extras(get, has, keep: tuple[str, ...]) -> tuple[tuple[str | None, ...], str | None]:
    """(values, None) or ((), error) for the kept columns of one record."""
    out = []
    for c in keep:
        if not has(c):
            return NO_EXTRAS, f"missing field {c!r} (dataset.keep_columns)"
        try:
            out.append(column_value(get(c)))
        except (ValueError, TypeError) as e:
            return NO_EXTRAS, f"field {c!r} (dataset.keep_columns) cannot be stored as a string: {e}"
    return tuple(out), None


def _not_messages(value: list) -> str:
    """What keeps `value` from being a chat messages list: its first bad item, named."""
    if not value:
        return "it is empty"
    for i, m in enumerate(value):
        if type(m) is not dict:
            return f"item {i} is {'null' if m is None else type(m).__name__}, not a {{role, content}} object"
        for k in ("role", "content"):
            if type(m.get(k)) is not str:
                return f"item {i} has no string {k!r}"
        if m["role"] not in ROLES:
            return f"item {i}'s role {m['role']!r} is not one of {', '.join(ROLES)}"
    return "not a messages list"


def messages_text(value: list, field: str) -> tuple[str | None, str | None]:
    """A list in the text field: (its JSON text, None) when it is a chat messages list ({role, content} objects with
    string values, train.grpo's chat prompts), stored as the GRPO prompt path reads it back (nightloom.chat's
    `prompt_messages`, the same {role, content} pairs), else (None, why) naming the field and the first bad item."""
    messages = prompt_messages(value)
    if messages is not None:
        return orjson.dumps(messages).decode("utf-8"), None
    return None, (
        f"list in field {field!r} that is not a list of chat messages ({_not_messages(value)}); a list is read only "
        f"as messages: {{role, content}} objects with string values, role one of {', '.join(ROLES)}"
    )


def text_or_why(obj: dict, text: object, field: str) -> tuple[str | None, str | None]:
    """A JSON record's text field that is not a string: (JSON text, None) for a chat messages list
    (`messages_text`), else (None, why) naming the field (missing, or its type)."""
    if type(text) is list:
        return messages_text(text, field)
    return None, f"{'missing field' if field not in obj else f'{type(text).__name__} in field'} {field!r}"


def lines_before(path: Path, offset: int) -> int:
    """Newlines in the first `offset` bytes of an uncompressed file (the line number a byte range starts after)."""
    n = 0
    with open(path, "rb", buffering=0) as f:
        while offset > 0:
            chunk = f.read(min(offset, 1 << 24))
            if not chunk:
                break
            n += chunk.count(b"\n")
            offset -= len(chunk)
    return n


def iter_lines(f, span: tuple[int, int] | None) -> Iterator[bytes]:
    """The lines of `f`, or those starting in the line-aligned byte `span` of an uncompressed file."""
    if span is None:
        yield from f
        return
    pos, stop = span
    f.seek(pos)
    for line in f:
        if pos >= stop:
            return
        pos += len(line)
        yield line


def nonfinite_json(line: bytes) -> object | None:
    """`line` as JSON whose numbers may be spelled NaN, Infinity or -Infinity (Python's json.dumps writes them for
    non-finite floats), or None. Arrow's JSON reader, the fast path, accepts them, so the record path does too: a
    file's records must not turn bad because an unrelated line sent the file down this path. Strings must still be
    valid UTF-8 without lone surrogates, as orjson wants (json.loads lets surrogates through; orjson.dumps refuses)."""
    if b"NaN" not in line and b"Infinity" not in line:
        return None
    try:
        obj = json.loads(line)
        orjson.dumps(obj)
    except (ValueError, TypeError, RecursionError):  # JSONDecodeError, UnicodeDecodeError, orjson.JSONEncodeError
        return None
    return obj


def refused_line(line: bytes, error: Exception) -> tuple[object | None, str | None]:
    """A line orjson refused with `error`: (value, None) when it is JSON with non-finite numbers
    (`nonfinite_json`), (None, why) when it is not JSON or not UTF-8, (None, None) when it is blank (no record)."""
    if not line.strip():
        return None, None
    obj = nonfinite_json(line)
    if obj is None:
        return None, utf8_error(line) or f"invalid JSON: {error}"
    return obj, None


@contextmanager
def numbered_lines(path: Path, span: tuple[int, int] | None) -> Iterator[Iterator[tuple[int, bytes]]]:
    """(line number, line) of a JSON-lines file, or of the line-aligned byte `span` of it (numbered as in the whole
    file); reading errors inside the block (an unreadable file, a truncated or corrupt gzip/zstd stream) are
    BadInputErrors naming the file."""
    first = 1 + (lines_before(path, span[0]) if span and span[0] else 0)
    try:
        with open_binary(path) as f:
            yield enumerate(iter_lines(f, span), first)
    except (OSError, EOFError) as e:  # truncated gzip/zstd stream, unreadable file
        raise BadInputError(f"{path}: cannot read compressed or raw stream: {e}") from None
    except Exception as e:
        if type(e).__name__ == "ZstdError":
            raise BadInputError(f"{path}: corrupt zstd stream: {e}") from None
        raise


def read_jsonl(
    path: Path,
    text_field: str,
    key_field: str | None,
    keep: tuple[str, ...] = (),
    span: tuple[int, int] | None = None,
) -> Iterator[Item]:
    """Line by line; blank lines are not records. Errors: corrupt JSON, non-UTF-8, missing/non-string field (numbers
    spelled NaN/Infinity/-Infinity are not errors: `nonfinite_json`; a chat messages list is its JSON text:
    `messages_text`).
    `span`: only the lines of that line-aligned byte range (numbered as in the whole file)."""
    # the JSON loop is written here, not read through json_lines: this is the record path's hot loop, and a
    # generator between them cost 6-10% more CPU (300k lines: 0.155-0.158 against 0.170-0.174 s; 0.194 against
    # 0.206 s on 2026-12-05)
    loads, decode_error = orjson.loads, orjson.JSONDecodeError
    with numbered_lines(path, span) as lines:
        for n, line in lines:
            try:
                obj = loads(line)
            except decode_error as e:
                obj, why = refused_line(line, e)
                if why is not None:
                    yield n, None, None, why, NO_EXTRAS
                if obj is None:
                    continue
            if type(obj) is not dict:
                yield n, None, None, f"expected a JSON object, got {type(obj).__name__}", NO_EXTRAS
                continue
            text = obj.get(text_field)
            if type(text) is not str:  # a chat messages list becomes its JSON text; the string path pays nothing
                text, why = text_or_why(obj, text, text_field)
                if why is not None:
                    yield n, None, None, why, NO_EXTRAS
                    continue
            key = None
            if key_field is not None:
                if key_field not in obj or obj[key_field] is None:
                    yield n, None, None, f"missing key field {key_field!r}", NO_EXTRAS
                    continue
                key = obj[key_field]
            extras, err = read_extras(obj.get, obj.__contains__, keep) if keep else (NO_EXTRAS, None)
            if err is not None:
                yield n, None, None, err, NO_EXTRAS
                continue
            yield n, text, key, None, extras


def json_lines(path: Path, span: tuple[int, int] | None = None) -> Iterator[tuple[int, object, str | None]]:
    """(line number, value, None) for each JSON line of a file (or of a line-aligned byte `span` of it, numbered as
    in the whole file), (line number, None, reason) for a line that is not JSON or not UTF-8; blank lines are
    skipped. An unreadable file or a truncated or corrupt compressed stream is a BadInputError."""
    loads, decode_error = orjson.loads, orjson.JSONDecodeError
    with numbered_lines(path, span) as lines:
        for n, line in lines:
            try:
                obj = loads(line)
            except decode_error as e:
                obj, why = refused_line(line, e)
                if obj is None:
                    if why is not None:
                        yield n, None, why
                    continue
            yield n, obj, None


def arrow_batches(path: Path, fmt: Format, columns: list[str]):
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        if fmt == "parquet":
            pf = pq.ParquetFile(path)
            names = pf.schema_arrow.names
            missing = [c for c in columns if c not in names]
            if missing:
                raise BadInputError(f"{path}: missing field {missing[0]!r} (columns: {', '.join(names)})")
            yield from pf.iter_batches(batch_size=BATCH_ROWS, columns=columns)
        else:
            with pa.memory_map(str(path)) as src:
                try:
                    reader = pa.ipc.open_stream(src)
                except pa.ArrowInvalid:
                    src.seek(0)
                    reader = pa.ipc.open_file(src)
                    reader = (reader.get_batch(i) for i in range(reader.num_record_batches))
                    batches = reader
                else:
                    batches = reader
                first = True
                for b in batches:
                    if first:
                        missing = [c for c in columns if c not in b.schema.names]
                        if missing:
                            raise BadInputError(
                                f"{path}: missing field {missing[0]!r} (columns: {', '.join(b.schema.names)})"
                            )
                        first = False
                    yield b.select(columns)
    except (pa.ArrowInvalid, pa.ArrowIOError, OSError) as e:
        kind = "Parquet" if fmt == "parquet" else "Arrow"
        raise BadInputError(f"{path}: corrupt {kind} file: {e}") from None


def read_columnar(
    path: Path, fmt: Format, text_field: str, key_field: str | None, keep: tuple[str, ...] = ()
) -> Iterator[Item]:
    """Parquet or Arrow (HF) rows in batches; `where` is the 1-based row number within the file."""
    cols = [text_field] + ([key_field] if key_field and key_field != text_field else [])
    cols += [c for c in dict.fromkeys(keep) if c not in cols]
    at = {c: i for i, c in enumerate(cols)}
    row = 0
    for batch in arrow_batches(path, fmt, cols):
        values = [batch.column(i).to_pylist() for i in range(len(cols))]
        texts = values[0]
        keys = values[at[key_field]] if key_field else None
        for i, text in enumerate(texts):
            row += 1
            if isinstance(text, bytes):
                err = utf8_error(text)
                if err:
                    yield row, None, None, err, NO_EXTRAS
                    continue
                text = text.decode("utf-8")
            elif isinstance(text, list):  # a Parquet/Arrow list<struct<role, content>>: a chat messages list
                text, why = messages_text(text, text_field)
                if why is not None:
                    yield row, None, None, why, NO_EXTRAS
                    continue
            if not isinstance(text, str):
                why = f"{'null' if text is None else type(text).__name__} in field {text_field!r}"
                yield row, None, None, why, NO_EXTRAS
                continue
            key = None
            if key_field is not None:
                key = keys[i]
                if key is None:
                    yield row, None, None, f"missing key field {key_field!r}", NO_EXTRAS
                    continue
            extras, err = NO_EXTRAS, None
            if keep:  # every kept column is present: arrow_batches refused the file otherwise
                fields = {c: values[at[c]][i] for c in keep}
                extras, err = read_extras(fields.get, fields.__contains__, keep)
            if err is not None:
                yield row, None, None, err, NO_EXTRAS
                continue
            yield row, text, key, None, extras


def read_text_file(path: Path, key_field: str | None) -> Iterator[Item]:
    """One document per file; `where` is 1."""
    data = storage.read_whole(path)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        yield 1, None, None, utf8_error(data), NO_EXTRAS
        return
    if key_field is not None:
        yield 1, None, None, f"key field {key_field!r} does not exist in a text file (use the text as key)", NO_EXTRAS
        return
    yield 1, text, None, None, NO_EXTRAS


def check_keep_columns(keep: list[str] | tuple[str, ...], sources: list[SourceRef]) -> None:
    """Text files have no fields to keep: refuse `dataset.keep_columns` for them before any work."""
    text = [s for s in sources if s.format == "text"]
    if keep and text:
        raise BadInputError(
            f"dataset.keep_columns: {text[0].uri} is a plain text file, which has no fields to keep "
            f"({list(keep)}); use JSONL or Parquet input, or leave keep_columns empty"
        )


def read_records(
    path: Path,
    fmt: Format,
    text_field: str,
    key_field: str | None,
    keep: tuple[str, ...] = (),
    span: tuple[int, int] | None = None,
) -> Iterator[Item]:
    """The record reader for `fmt`; `keep` = the `dataset.keep_columns` to return as `extras`; `span` = a
    line-aligned byte range of an uncompressed JSONL file (a range unit), else the whole file."""
    if fmt == "jsonl":
        return read_jsonl(path, text_field, key_field, keep, span)
    if span is not None:
        raise ShardingError(f"internal: {path}: byte ranges are for uncompressed JSONL only, not {fmt}")
    if fmt == "text":
        if keep:
            raise BadInputError(f"dataset.keep_columns: {path} is a plain text file, which has no fields to keep")
        return read_text_file(path, key_field)
    return read_columnar(path, fmt, text_field, key_field, keep)
