"""ShardJob: the record of a planned sharding run (sources, scan units, settings hash, tokenizer), which every step
after the plan (scan, place, write, publish) receives; prepare.py makes it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pydantic import Field

from nightloom.chat import ChatSettings
from nightloom.records import Record
from nightloom.sharding.sources import SourceRef
from nightloom.sharding.workdir import WorkDir
from nightloom.spec import DatasetSpec, ShardingSpec, TokenizerSpec
from nightloom.storage import S3Config

if TYPE_CHECKING:
    from nightloom.sharding.manifest import ShardManifest


class ShardJob(Record):
    """A planned sharding run; serialisable, so Prefect tasks (and Dask/Ray workers) can receive it."""

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
    eos_id: int = 0  # appended after every document in the token files (not for chats: see nightloom/chat.py)
    chat: ChatSettings | None = None  # train.task sft: records are chats, each with a label-mask file per shard

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


def settings_differences(job: ShardJob, manifest: ShardManifest) -> list[str]:
    """How the settings of a manifest already in the job's output differ from the job's ('num_shards 8 there, 4
    here'): those of another spec or deployment, whose shards a run must not overwrite. Inputs that changed are
    not a difference (a re-shard of the same settings replaces them)."""
    here = {
        "num_shards": job.num_shards,
        "key": job.key_name,
        "salt": job.sharding.salt,
        "text_field": job.dataset.text_field,
        "keep_columns": list(job.dataset.keep_columns),
        "tokenizer": job.tokenizer_id,
        "compression": job.sharding.compression,
        "balance_by": job.sharding.balance_by,
        "tolerance": job.sharding.tolerance,
        "heldout split": job.has_heldout,
    }
    there = {
        "num_shards": manifest.num_shards,
        "key": manifest.key,
        "salt": manifest.salt,
        "text_field": manifest.text_field,
        "keep_columns": list(manifest.keep_columns),
        "tokenizer": manifest.tokenizer,
        "compression": manifest.compression,
        "balance_by": manifest.balance_by,
        "tolerance": manifest.tolerance,
        "heldout split": manifest.heldout is not None,
    }
    return [f"{k} {there[k]!r} there, {here[k]!r} here" for k in here if here[k] != there[k]]


def extra_columns(dataset: DatasetSpec, sharding: ShardingSpec) -> tuple[str, ...]:
    """The kept columns a shard stores besides its text and key column, in order, once each."""
    stored = (dataset.text_field, sharding.key_field)
    return tuple(c for c in dict.fromkeys(dataset.keep_columns) if c not in stored)
