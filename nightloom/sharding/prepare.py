"""The sharding's prepare step: list and fingerprint the inputs, group them into scan units, load the tokenizer and
fix the settings hash, all before any work (`plan_job` makes the ShardJob every later step receives).

`settings_hash` covers the inputs' content fingerprints and every setting that changes the output, and
nothing machine-specific (no absolute paths, no mtimes), so the same data gives the same manifest anywhere.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path

import pyarrow

from nightloom import storage
from nightloom.chat import CHAT_STYLES, ChatSettings
from nightloom.sharding import readahead
from nightloom.sharding.balance import VIRTUAL_BUCKETS
from nightloom.sharding.corpus import ensure_sample_corpus
from nightloom.sharding.errors import BadInputError
from nightloom.sharding.fingerprint import FingerprintCache, fingerprint_all
from nightloom.sharding.job import ShardJob, extra_columns
from nightloom.sharding.manifest import MANIFEST_NAME, SCHEMA_VERSION, ShardManifest, load_manifest
from nightloom.sharding.sources import SourceRef, check_keep_columns, list_inputs
from nightloom.spec import DatasetSpec, ShardingSpec, StorageSpec, TokenizerSpec
from nightloom.storage import S3Config

ALGORITHM_VERSION = "nightloom-shard-2"  # bump when output bytes change for the same settings
WORK_DIR_NAME = ".nightloom-work"
#: small input files are scanned together, in order, in units of up to this many bytes or files: a scan unit
#: is one task (and one spill), so 13k small files cost tens of tasks, not 13k. Output bytes do not depend on it.
UNIT_BYTES = 16 * 1024 * 1024
UNIT_FILES = 4096
#: a local, uncompressed JSONL file bigger than this is scanned in line-aligned byte ranges of about this size, each
#: its own unit, so one big file keeps every worker busy. Output bytes do not depend on it either.
RANGE_BYTES = 64 * 1024 * 1024


def plan_units(sources: list[SourceRef]) -> list[list[int]]:
    """Consecutive sources grouped into scan units of at most UNIT_BYTES / UNIT_FILES; a big file is alone."""
    return plan_scan(sources)[0]


def splittable(src: SourceRef) -> bool:
    """A file that can be read from any byte offset: local, uncompressed JSONL (S3 inputs are fetched whole)."""
    name = src.uri.lower()
    return src.format == "jsonl" and not storage.is_s3(src.uri) and not name.endswith((".gz", ".zst", ".zstd"))


def plan_scan(sources: list[SourceRef], split: bool = True) -> tuple[list[list[int]], list[tuple[int, int] | None]]:
    """(units, ranges): small files grouped as `plan_units` says; with `split`, a splittable file over RANGE_BYTES
    alone in byte ranges of RANGE_BYTES (the last one up to its end), one unit each.

    `split` only when the scan takes Arrow's fast path (no key field, no kept columns): the record path numbers
    lines from the file's start, so a range it reads first counts the newlines before it (fine after a bad
    line sends one range there; a whole file read that way would count O(size² / RANGE_BYTES) bytes)."""
    units: list[list[int]] = []
    ranges: list[tuple[int, int] | None] = []
    size = 0
    for i, src in enumerate(sources):
        if split and src.size > RANGE_BYTES and splittable(src):
            for start in range(0, src.size, RANGE_BYTES):
                units.append([i])
                ranges.append((start, min(start + RANGE_BYTES, src.size)))
            size = UNIT_BYTES + 1  # the next file starts a new unit
            continue
        if not units or size + src.size > UNIT_BYTES or len(units[-1]) >= UNIT_FILES:
            units.append([])
            ranges.append(None)
            size = 0
        units[-1].append(i)
        size += src.size
    return units, ranges


def settings_hash(
    dataset: DatasetSpec,
    sharding: ShardingSpec,
    sources: list[SourceRef],
    ignored: list[str] | None = None,
    tokenizer_id: str = "bytes",
    token_dtype: str = "uint16",
    chat: ChatSettings | None = None,
) -> str:
    """`tokenizer_id` is the tokenizer's content fingerprint ("bytes" keeps the hashes of earlier shards);
    `token_dtype` the token files' dtype; `chat` the task sft's style, template and seq_len (only when set)."""
    doc = {
        "algorithm": ALGORITHM_VERSION,
        "schema": SCHEMA_VERSION,
        "arrow": pyarrow.__version__.split(".")[0],
        "buckets": VIRTUAL_BUCKETS,
        "sources": [[s.rel, s.size, s.format, s.fingerprint] for s in sources],
        "format": dataset.format,
        "text_field": dataset.text_field,
        "tokenizer": tokenizer_id,
        # where it runs (dask) is not what it makes; heldout is added below only when set
        "sharding": sharding.model_dump(mode="json", exclude={"output", "dask", "heldout", "near_dup", "filters"}),
    }
    for part in ("near_dup", "filters"):  # only when set: shards made before these existed keep their hash
        if getattr(sharding, part) is not None:
            doc[part] = getattr(sharding, part).model_dump(mode="json")
    if sharding.heldout:  # only when set: earlier shards keep their hash
        doc["heldout"] = sharding.heldout
    if dataset.keep_columns:  # only when set: shards made before keep_columns existed keep their hash
        doc["keep_columns"] = list(dataset.keep_columns)
    if ignored:  # the manifest accounts for them: a new ignored file is a new manifest
        doc["ignored"] = sorted(ignored)
    if chat is not None:  # train.task sft: chats rendered by this template, cut at seq_len + 1 ids
        doc["chat"] = {"task": chat.task, "style": chat.style, "template": chat.template_id, "seq_len": chat.seq_len}
    if token_dtype == "uint8":  # only then: shards with uint16/int32 token files keep their hash (bytes' were uint16)
        doc["token_dtype"] = token_dtype
    return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()[:32]


#: layout of the work files (2: raw .bin arrays; 3: one scan per unit; 4: token id spills; 5: string spills;
#: 6: each spilled batch's byte range in the batch index; 7: spill parts written partition-major); work folders
#: of other formats are not resumed
WORK_FORMAT = 7


def default_workdir(output: str, shash: str, distributed: bool = False) -> str:
    """Where the work files go unless given: `$NIGHTLOOM_SHARD_WORKDIR` (a folder or an s3:// prefix) if set;
    else a hidden folder inside the output (a local output: same filesystem, so os.replace works; an S3 output
    on Dask: an S3 prefix, so workers share nothing but S3); else (S3 output, one machine) the temp dir."""
    name = f"{shash}-w{WORK_FORMAT}"
    if os.environ.get("NIGHTLOOM_SHARD_WORKDIR"):
        return storage.join(os.environ["NIGHTLOOM_SHARD_WORKDIR"], name)
    if not storage.is_s3(output) or distributed:
        return storage.join(storage.join(output, WORK_DIR_NAME), name)
    return str(Path(tempfile.gettempdir()) / "nightloom-shard-work" / name)


def existing_manifest(output: str, shash: str, s3: S3Config | None = None) -> ShardManifest | None:
    """The finished manifest at `output` if it was made with exactly these inputs and settings, else None."""
    uri = storage.join(output, MANIFEST_NAME)
    if not storage.exists(uri, s3):
        return None
    try:
        m = load_manifest(uri, s3)
    except (ValueError, OSError):
        return None
    if m.settings_hash != shash:
        return None
    shards = m.shards + ([m.heldout] if m.heldout else [])
    if not all(storage.exists(storage.join(output, f), s3) for s in shards for f in s.files()):
        return None
    return m


def plan_job(
    dataset: DatasetSpec,
    sharding: ShardingSpec,
    storage_spec: StorageSpec | None = None,
    workdir: str | None = None,
    tokenizer: TokenizerSpec | str | None = None,
    chat: ChatSettings | None = None,
) -> ShardJob:
    """List and fingerprint the inputs and fix the settings hash (reads inputs once to hash them, cached by mtime).

    `tokenizer` (the run's model.tokenizer, default bytes) counts tokens; a `train_vocab` BPE is trained on the
    corpus here on first use, so its fingerprint enters the hash. `chat` (train.task sft, nightloom.chat's
    `chat_settings`): records are chats, rendered with its template into ids and assistant labels."""
    from nightloom.sharding.tokens import token_dtype
    from nightloom.tokenizer import ensure_trained, load_tokenizer

    tok_spec = TokenizerSpec.coerce(tokenizer)
    if chat is None and dataset.style in CHAT_STYLES:
        raise BadInputError(f"dataset.style: {dataset.style} records are chats, which train.task: sft trains on")
    if chat is not None and (tok_spec.is_bytes or tok_spec.path is None):
        raise BadInputError("model.tokenizer: train.task sft needs a Hugging Face tokenizer folder (chat template)")
    if tok_spec.train_vocab is None:
        load_tokenizer(tok_spec)  # a bad tokenizer fails here, before any input is read
    s3 = S3Config.from_spec(storage_spec)
    for uri in (dataset.path, sharding.output):
        if storage.is_s3(uri):
            storage.check_bucket(uri, s3)
    if dataset.sample and not storage.is_s3(dataset.path):
        ensure_sample_corpus(dataset.path, kind=dataset.sample_kind)
    # cached fingerprints come with the listing's one stat a file; the others are hashed only after keep_columns
    # is checked (a wrong column name is reported before a 1 TB folder is read), small text files' bytes kept for
    # a scan in this process (not on Dask: the workers read for themselves)
    readahead.clear()
    local = not storage.is_s3(dataset.path)
    cache = FingerprintCache(dataset.path, read_ahead=sharding.dask is None) if local else None
    listing = list_inputs(dataset.path, dataset.format, s3, cached=cache.cached if cache else None)
    check_keep_columns(dataset.keep_columns, listing.sources)
    sources = fingerprint_all(dataset.path, listing.sources, s3, cache)
    ensure_trained(tok_spec, dataset, chat=chat is not None)
    tok = load_tokenizer(tok_spec)
    tok_id, dtype = tok.fingerprint(), token_dtype(tok.vocab_size)
    if chat is not None:
        from nightloom.chat import renderer

        renderer(tok_spec.path, chat)  # transformers loads the tokenizer folder here, before any input is read
    shash = settings_hash(dataset, sharding, sources, listing.ignored, tok_id, dtype, chat)
    fast = sharding.key_field is None and not extra_columns(dataset, sharding) and chat is None
    units, ranges = plan_scan(sources, split=fast)
    return ShardJob(
        tokenizer=tok_spec,
        tokenizer_id=tok_id,
        token_dtype=dtype,
        eos_id=tok.eos_id,
        chat=chat,
        dataset=dataset,
        sharding=sharding,
        s3=s3,
        sources=sources,
        ignored=listing.ignored,
        units=units,
        ranges=ranges,
        settings_hash=shash,
        workdir=workdir or default_workdir(sharding.output, shash, distributed=sharding.dask is not None),
    )
