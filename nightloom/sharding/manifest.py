"""The shard manifest: the only way trainers find shards. Written last, so its presence means a complete dataset.
Every record of it is a `Record`: an unknown field is an error when a manifest is read, never silently dropped."""

from __future__ import annotations

from pathlib import Path

import orjson
from pydantic import Field, model_serializer

from nightloom.records import Record

SCHEMA_VERSION = 3  # 2: per-file status and the file counts (every input file accounted for); 3: token files
READABLE_SCHEMAS = (1, 2, 3)  # older manifests load with defaults (no token files: the trainer reads the text)
MANIFEST_NAME = "manifest.json"


class TokenFiles(Record):
    """A shard's Megatron indexed dataset (nightloom/sharding/tokens.py): `prefix.bin` + `prefix.idx`, one sequence
    per document (the tokenizer's ids, then EOS) in the Parquet shard's row order."""

    bin: str  # relative to the manifest's folder/prefix
    idx: str
    dtype: str  # uint8 (at most 256 ids: bytes), uint16 (vocab < 65,500) or int32
    eos_id: int
    documents: int  # = the shard's rows
    tokens: int  # ids in the .bin, EOS included (= the shard's tokens + rows)
    bin_hash: str  # "xxh3-128:<hex>" of the .bin (as the sources' fingerprints)
    idx_hash: str
    labels: str | None = None  # chats: `<prefix>.labels.bin`, a uint8 0/1 per id of the .bin (1 = a label)
    labels_hash: str | None = None
    label_tokens: int = 0  # chats: the 1s in the labels file (the assistant tokens the loss counts)

    @model_serializer(mode="wrap")
    def _without_chat_fields(self, handler):
        """The chat fields only when set: a pretraining manifest keeps its bytes."""
        out = handler(self)
        if self.labels is None:
            for key in ("labels", "labels_hash", "label_tokens"):
                out.pop(key, None)
        return out

    @property
    def prefix(self) -> str:
        """What Megatron's `IndexedDataset(path_prefix)` takes."""
        return self.bin.removesuffix(".bin")

    def files(self) -> list[str]:
        return [self.bin, self.idx] + ([self.labels] if self.labels else [])


class ShardInfo(Record):
    index: int
    path: str  # relative to the manifest's folder/prefix
    rows: int
    tokens: int
    bytes: int
    sha256: str
    token_files: TokenFiles | None = None  # None: a manifest before schema 3 (text only)

    def files(self) -> list[str]:
        """Every file of this shard, relative to the manifest: the Parquet text, then the token files if any."""
        return [self.path] + (self.token_files.files() if self.token_files else [])


class BadRecord(Record):
    file: str
    line: int
    reason: str


class SourceFile(Record):
    path: str
    size: int
    fingerprint: str  # "xxh3-128:<hex>" of a local file's bytes, or "etag:<ETag>" of an S3 object
    status: str = "read"  # read | empty | bad | duplicate (nightloom.sharding.accounting)
    documents: int | None = None  # documents of this file in the shards (None: manifest before schema 2)


class ChatStats(Record):
    """train.task sft: how chat records became sequences (nightloom/chat.py)."""

    style: str  # dataset.style (auto: detected per record)
    template: str  # "sha256:<hex>" of the chat template
    seq_len: int  # conversations longer than seq_len + 1 ids were cut or dropped
    cut: int = 0  # conversations cut at a turn boundary (the longest run of whole turns ending with an assistant's)
    dropped: int = 0  # conversations with no such run that fits (in no shard)
    label_tokens: int = 0  # assistant tokens in the training shards (what the loss counts)
    task: str = "sft"  # dpo: each document a preference pair, chosen then rejected (nightloom/chat_pairs.py)

    @model_serializer(mode="wrap")
    def _sft_without_task(self, handler):
        """`task` only when dpo: an sft manifest keeps its bytes."""
        out = handler(self)
        if self.task == "sft":
            out.pop("task", None)
        return out


class RemovedSample(Record):
    """A removed document for a person to read: which filter, why (datatrove's reason name), its first characters."""

    filter: str
    reason: str
    text: str


class Removed(Record):
    documents: int = 0
    tokens: int = 0


class QualityCounts(Record):
    """Documents and tokens removed per filter (in the order they ran) and as near-duplicates (`near_dup`), after
    exact dedup; `files_filtered`: input files whose every document went that way (not all exact duplicates);
    `samples`: the side file in the output with removed documents per filter."""

    removed: dict[str, Removed] = Field(default_factory=dict)
    files_filtered: int = 0
    samples: str | None = None


class ShardManifest(Record):
    """Counts, checksums, hash settings and balance figures of one sharded dataset."""

    schema_version: int = SCHEMA_VERSION
    num_shards: int
    hash_algorithm: str = "xxhash64"
    key: str  # field name, or "<text>"
    salt: str
    text_field: str = "text"
    keep_columns: list[str] = Field(default_factory=list)  # extra columns copied verbatim into every shard row
    tokenizer: str = "bytes"  # "bytes" or the tokenizer's fingerprint (nightloom/tokenizer.py)
    compression: str = "zstd"  # Parquet codec of the shards
    balance_by: str = "tokens"
    tolerance: float = 0.02
    imbalance: float  # final, on balance_by
    imbalance_before_rebalance: float
    rebalanced: bool = False
    balanced: bool
    rows: int
    tokens: int
    bytes: int
    dedup_dropped: int = 0
    empty_skipped: int = 0
    bad_records: int = 0
    bad_examples: list[BadRecord] = Field(default_factory=list)
    files_read: int | None = None  # input files with documents in the shards (None: manifest before schema 2)
    files_empty: int = 0
    files_bad: int = 0  # no good document, at least one bad record
    files_duplicate: int = 0  # every document an exact duplicate of an earlier one
    files_ignored: int = 0  # hidden files and writers' markers, by name
    file_examples: dict[str, list[str]] = Field(default_factory=dict)  # status -> first few names
    sources: list[SourceFile] = Field(default_factory=list)
    shards: list[ShardInfo]
    heldout: ShardInfo | None = None  # held-out documents (sharding.heldout), never in a training shard
    settings_hash: str = ""  # hash of inputs + settings: a re-run with the same value does no work
    chat: ChatStats | None = None  # train.task sft only (absent from a pretraining manifest)
    quality: QualityCounts | None = None  # sharding.filters / near_dup only: removed per filter, samples file

    @model_serializer(mode="wrap")
    def _without_chat(self, handler):
        out = handler(self)
        for optional in ("chat", "quality"):  # absent unless used: other manifests keep their bytes
            if getattr(self, optional) is None:
                out.pop(optional, None)
        return out

    def to_json(self) -> str:
        """Indented, keys sorted (orjson: the stdlib's encoder took 0.4 s for a manifest of 21k sources)."""
        return (
            orjson.dumps(self.model_dump(mode="json"), option=orjson.OPT_INDENT_2 | orjson.OPT_SORT_KEYS).decode()
            + "\n"
        )


def manifest_uri(output: str) -> str:
    return output.rstrip("/") + "/" + MANIFEST_NAME


def load_manifest(output_or_manifest: str | Path, s3=None) -> ShardManifest:
    """Load a manifest from a local folder/file, or an s3:// one through nightloom.storage with
    `s3` (a storage.S3Config; None = the environment's endpoint)."""
    s = str(output_or_manifest)
    if s.startswith("s3://"):
        from nightloom.storage import read_bytes

        uri = s if s.endswith(".json") else manifest_uri(s)
        return _validate(read_bytes(uri, s3), uri)
    p = Path(s)
    if p.is_dir():
        p = p / MANIFEST_NAME
    if not p.is_file():
        raise FileNotFoundError(f"{p}: no shard manifest (was the dataset sharded to completion?)")
    return _validate(p.read_text(encoding="utf-8"), str(p))


def _validate(data: str | bytes, where: str) -> ShardManifest:
    m = ShardManifest.model_validate_json(data)
    if m.schema_version not in READABLE_SCHEMAS:
        raise ValueError(
            f"{where}: schema_version {m.schema_version} is not one this nightloom reads {READABLE_SCHEMAS} "
            "(written by a newer version?)"
        )
    return m
