"""ShardJob: everything a sharding run needs, fixed before any work (sources, fingerprints, settings hash).

`settings_hash` covers the inputs' content fingerprints and every setting that changes the output, and
nothing machine-specific (no absolute paths, no mtimes), so the same data gives the same manifest anywhere.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
import time
from pathlib import Path

import orjson
import pyarrow
import xxhash
from pydantic import BaseModel, ConfigDict, Field

from nightloom.sharding import readahead, storage
from nightloom.sharding.balance import VIRTUAL_BUCKETS
from nightloom.sharding.corpus import ensure_sample_corpus
from nightloom.sharding.manifest import MANIFEST_NAME, SCHEMA_VERSION, ShardManifest, load_manifest
from nightloom.sharding.sources import SourceRef, check_keep_columns, list_inputs
from nightloom.sharding.storage import S3Config
from nightloom.sharding.workdir import WorkDir
from nightloom.spec import DatasetSpec, ShardingSpec, StorageSpec, TokenizerSpec

ALGORITHM_VERSION = "nightloom-shard-2"  # bump when output bytes change for the same settings
WORK_DIR_NAME = ".nightloom-work"
#: small input files are scanned together, in order, in units of up to this many bytes or files: a scan unit
#: is one task (and one spill), so 13k small files cost tens of tasks, not 13k. Output bytes do not depend on it.
UNIT_BYTES = 16 * 1024 * 1024
UNIT_FILES = 4096
#: a local, uncompressed JSONL file bigger than this is scanned in line-aligned byte ranges of about this size, each
#: its own unit, so one big file keeps every worker busy. Output bytes do not depend on it either.
RANGE_BYTES = 64 * 1024 * 1024


class ShardJob(BaseModel):
    """A planned sharding run; serialisable, so Prefect tasks (and Dask/Ray workers) can receive it."""

    model_config = ConfigDict(extra="forbid")
    dataset: DatasetSpec
    sharding: ShardingSpec
    s3: S3Config = Field(default_factory=S3Config)  # where s3:// inputs, output and work live (no secrets)
    sources: list[SourceRef]
    ignored: list[str] = []  # files under the dataset path ignored by name (hidden, writers' markers)
    units: list[list[int]] = []  # scan units: consecutive source indices scanned together
    # per unit: None (whole files) or the nominal byte range [start, stop) of its one source (line-aligned when
    # scanned: a unit reads the lines that start in it); empty = no ranges (a job planned before they existed)
    ranges: list[tuple[int, int] | None] = []
    settings_hash: str
    workdir: str
    tokenizer: TokenizerSpec = Field(default_factory=TokenizerSpec)  # counts tokens (model.tokenizer)
    tokenizer_id: str = "bytes"  # the tokenizer's fingerprint, recorded in the manifest
    token_dtype: str = "uint16"  # of the token files: uint8 (<= 256 ids), uint16 (< 65,500), else int32
    eos_id: int = 0  # appended after every document in the token files

    @property
    def output(self) -> str:
        return self.sharding.output

    @property
    def num_shards(self) -> int:
        return self.sharding.num_shards

    @property
    def key_name(self) -> str:
        return self.sharding.key_field or "<text>"

    @property
    def extra_columns(self) -> tuple[str, ...]:
        """`dataset.keep_columns` not already stored as the text or key column, in order, once each."""
        return extra_columns(self.dataset, self.sharding)

    @property
    def heldout_index(self) -> int:
        """The held-out split is written like one more shard, after the training shards."""
        return self.num_shards

    @property
    def has_heldout(self) -> bool:
        return self.sharding.heldout > 0

    def shard_stem(self, index: int) -> str:
        """A shard's files share this name: `.parquet` (text), `.bin` + `.idx` (token ids; Megatron's prefix)."""
        if index == self.heldout_index:
            return f"heldout.{self.settings_hash[:8]}"
        return f"shard-{index:05d}-of-{self.num_shards:05d}.{self.settings_hash[:8]}"

    def shard_name(self, index: int) -> str:
        return self.shard_stem(index) + ".parquet"

    def unit_range(self, index: int) -> tuple[int, int] | None:
        return self.ranges[index] if index < len(self.ranges) else None

    def unit_bytes(self, index: int) -> int:
        """Input bytes of unit `index`: its byte range, or its files' sizes (compressed ones as stored)."""
        r = self.unit_range(index)
        return r[1] - r[0] if r is not None else sum(self.sources[i].size for i in self.units[index])

    def files_finished(self, index: int) -> int:
        """Input files whose scan ends with unit `index` (a file scanned in ranges counts at its last one)."""
        r = self.unit_range(index)
        if r is None:
            return len(self.units[index])
        return int(r[1] >= self.sources[self.units[index][0]].size)

    @property
    def work(self) -> WorkDir:
        """The work folder (local, or an s3:// prefix cached locally), with this job's S3 settings."""
        return WorkDir(self.workdir, self.s3)


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


def extra_columns(dataset: DatasetSpec, sharding: ShardingSpec) -> tuple[str, ...]:
    stored = (dataset.text_field, sharding.key_field)
    return tuple(c for c in dict.fromkeys(dataset.keep_columns) if c not in stored)


def hash_file(src: SourceRef, read_ahead: bool = False) -> str:
    """A local file's fingerprint: xxh3-128 of its bytes. With `read_ahead`, a small text file is read whole and
    its bytes kept for this process's scan (readahead.py), so a first run reads it once."""
    if read_ahead and src.format == "text" and src.size <= readahead.MAX_FILE:
        data = storage.read_whole(src.uri, src.size)
        fp = "xxh3-128:" + xxhash.xxh3_128(data).hexdigest()
        readahead.keep(src.uri, fp, data)
        return fp
    return "xxh3-128:" + storage.xxh3_file(src.uri, size=src.size)


RACY_S = 2.0  # a file changed this recently may change again within its timestamp's resolution: never cached


class FingerprintCache:
    """Content fingerprints (xxh3-128) of one local dataset path's files, kept from run to run in one JSON file
    under `$NIGHTLOOM_CACHE/fingerprints/` and trusted while a file's (size, mtime_ns, ctime_ns, inode) are
    unchanged, so re-sharding an unchanged folder reads no file to fingerprint it (21k small files: one read
    each, ~0.5 s; a 1 TB folder: 1 TB). ctime cannot be set by a user, so rewriting a file with its old mtime
    is still seen. As in git's index, a file changed within RACY_S of the cache write is not cached."""

    VERSION = 1

    def __init__(self, root: str, read_ahead: bool = False):
        base = Path(os.environ.get("NIGHTLOOM_CACHE", Path.home() / ".cache" / "nightloom")) / "fingerprints"
        resolved = str(Path(root).resolve())
        self.path = base / (hashlib.sha256(resolved.encode()).hexdigest()[:32] + ".json")
        self.root, self.entries, self.changed = resolved, {}, False
        self.listed: dict[str, list[int]] = {}  # stat keys of files the listing saw but the cache did not know
        self.read_ahead = read_ahead  # keep small text files' bytes for this process's scan (readahead.py)
        try:
            doc = orjson.loads(self.path.read_bytes())
            if doc.get("version") == self.VERSION and doc.get("root") == resolved and isinstance(doc["files"], dict):
                self.entries = doc["files"]
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            pass  # no cache, or one this version cannot read: hash again

    @staticmethod
    def _key(st: os.stat_result) -> list[int]:
        return [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino]

    def _kept(self, rel: str, key: list[int]) -> str:
        """`rel`'s kept fingerprint if it was kept with this stat key, else ""."""
        hit = self.entries.get(rel)
        return hit[4] if isinstance(hit, list) and len(hit) == 5 and hit[:4] == key else ""

    def cached(self, rel: str, st: os.stat_result) -> str:
        """`rel`'s kept fingerprint if `st` (the listing's stat) matches the one it was kept with, else "" (and
        `st` is remembered, so `fingerprint` does not stat the file again)."""
        key = self._key(st)
        fp = self._kept(rel, key)
        if not fp:
            self.listed[rel] = key
        return fp

    def fingerprint(self, src: SourceRef) -> str:
        """The file's fingerprint: the kept one while its stat is unchanged, else its bytes hashed (and kept). The
        stat is the listing's if it made one (taken before the read, so a file changed in between is a miss next
        time, never a wrong hit)."""
        listed = self.listed.pop(src.rel, None)  # the listing's stat, which `cached` already found no hit for
        key = listed or self._key(os.stat(src.uri))
        if listed is None and (fp := self._kept(src.rel, key)):
            return fp
        fp = hash_file(src, self.read_ahead)
        self.entries[src.rel] = [*key, fp]
        self.changed = True
        return fp

    def save(self, keep: set[str]) -> None:
        """Write the cache (only `keep`'s entries: the files listed this time), write then rename; a read-only
        home is fine (the next run hashes again)."""
        if not self.changed and keep == set(self.entries):
            return
        newest = (time.time() - RACY_S) * 1e9
        files = {r: e for r, e in self.entries.items() if r in keep and max(e[1], e[2]) < newest}
        if not files and not self.path.exists():
            return  # nothing to keep (all new files): no cache file for every freshly written folder
        try:
            storage.write_bytes(
                str(self.path), orjson.dumps({"version": self.VERSION, "root": self.root, "files": files})
            )
        except OSError:
            pass


def fingerprint_all(
    dataset_path: str, sources: list[SourceRef], s3: S3Config | None = None, cache: FingerprintCache | None = None
) -> list[SourceRef]:
    """Every source with its fingerprint: an S3 object's ETag; a local file's content hash (FingerprintCache;
    `cache`: the one the listing already looked fingerprints up in). Sources that have one are kept as they are."""
    if storage.is_s3(dataset_path):  # a folder's listing already carried them; a single object is asked for
        return [
            src if src.fingerprint else src.model_copy(update={"fingerprint": "etag:" + storage.head(src.uri, s3)[1]})
            for src in sources
        ]
    cache = cache or FingerprintCache(dataset_path)
    # built anew, not model_copy(update=...): 3× cheaper, which shows on 20k files
    out = [
        s
        if s.fingerprint
        else SourceRef(rel=s.rel, uri=s.uri, size=s.size, format=s.format, fingerprint=cache.fingerprint(s))
        for s in sources
    ]
    cache.save({s.rel for s in sources})
    return out


def settings_hash(
    dataset: DatasetSpec,
    sharding: ShardingSpec,
    sources: list[SourceRef],
    ignored: list[str] | None = None,
    tokenizer_id: str = "bytes",
    token_dtype: str = "uint16",
) -> str:
    """`tokenizer_id` is the tokenizer's content fingerprint ("bytes" keeps the hashes of earlier shards);
    `token_dtype` the token files' dtype."""
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
        "sharding": sharding.model_dump(mode="json", exclude={"output", "dask", "heldout"}),
    }
    if sharding.heldout:  # only when set: earlier shards keep their hash
        doc["heldout"] = sharding.heldout
    if dataset.keep_columns:  # only when set: shards made before keep_columns existed keep their hash
        doc["keep_columns"] = list(dataset.keep_columns)
    if ignored:  # the manifest accounts for them: a new ignored file is a new manifest
        doc["ignored"] = sorted(ignored)
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
) -> ShardJob:
    """List and fingerprint the inputs and fix the settings hash (reads inputs once to hash them, cached by mtime).

    `tokenizer` (the run's model.tokenizer, default bytes) counts tokens; a `train_vocab` BPE is trained on the
    corpus here on first use, so its fingerprint enters the hash."""
    from nightloom.sharding.tokens import token_dtype
    from nightloom.tokenizer import ensure_trained, load_tokenizer

    tok_spec = TokenizerSpec.coerce(tokenizer)
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
    ensure_trained(tok_spec, dataset)
    tok = load_tokenizer(tok_spec)
    tok_id, dtype = tok.fingerprint(), token_dtype(tok.vocab_size)
    shash = settings_hash(dataset, sharding, sources, listing.ignored, tok_id, dtype)
    units, ranges = plan_scan(sources, split=sharding.key_field is None and not extra_columns(dataset, sharding))
    return ShardJob(
        tokenizer=tok_spec,
        tokenizer_id=tok_id,
        token_dtype=dtype,
        eos_id=tok.eos_id,
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
