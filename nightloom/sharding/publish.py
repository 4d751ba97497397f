"""Publish step: manifest.json, written last (counts, checksums, per-file accounting), so a reader never sees half a
dataset; then the shards of earlier runs with other settings and the work files are removed.
"""

from __future__ import annotations

from nightloom import storage
from nightloom.sharding.accounting import account_files
from nightloom.sharding.errors import BadInputError
from nightloom.sharding.job import ShardJob
from nightloom.sharding.manifest import MANIFEST_NAME, ChatStats, ShardInfo, ShardManifest
from nightloom.sharding.place import Placement
from nightloom.sharding.prepare import WORK_DIR_NAME
from nightloom.sharding.scan_result import MAX_BAD_EXAMPLES, ScanResult


def build_manifest(
    job: ShardJob, scans: list[ScanResult], placement: Placement, infos: list[ShardInfo]
) -> ShardManifest:
    scans = sorted(scans, key=lambda s: s.index)
    infos = sorted(infos, key=lambda i: i.index)
    heldout = next((i for i in infos if i.index == job.heldout_index), None)
    infos = [i for i in infos if i.index != job.heldout_index]
    examples = [e for s in scans for e in s.bad_examples][:MAX_BAD_EXAMPLES]
    sources, files = account_files(job, scans, placement)
    return ShardManifest(
        num_shards=job.num_shards,
        key=job.key_name,
        salt=job.sharding.salt,
        text_field=job.dataset.text_field,
        keep_columns=list(job.dataset.keep_columns),
        tokenizer=job.tokenizer_id,
        compression=job.sharding.compression,
        balance_by=job.sharding.balance_by,
        tolerance=job.sharding.tolerance,
        imbalance=round(placement.imbalance, 6),
        imbalance_before_rebalance=round(placement.imbalance_before, 6),
        rebalanced=placement.rebalanced,
        balanced=placement.imbalance <= job.sharding.tolerance,
        rows=sum(i.rows for i in infos),
        tokens=sum(i.tokens for i in infos),
        bytes=sum(i.bytes for i in infos),
        dedup_dropped=placement.dedup_dropped,
        empty_skipped=sum(s.empty for s in scans),
        bad_records=sum(s.bad for s in scans),
        bad_examples=examples,
        **files.manifest_fields(),
        sources=sources,
        shards=infos,
        heldout=heldout,
        settings_hash=job.settings_hash,
        chat=_chat_stats(job, scans, infos),
        quality=_quality(job, scans, placement, files.filtered),
    )


def samples_name(job: ShardJob) -> str:
    """The side file of removed documents (sharding.filters), beside the shards."""
    return f"removed-samples.{job.settings_hash[:8]}.jsonl"


def _quality(job: ShardJob, scans: list[ScanResult], placement: Placement, files_filtered: int):
    """The placement's quality counts with the files they emptied and the side file's name, if it has samples."""
    if placement.quality is None:
        return None
    has = any(s.removed_samples for s in scans)
    return placement.quality.model_copy(
        update={"files_filtered": files_filtered, "samples": samples_name(job) if has else None}
    )


def write_samples(job: ShardJob, scans: list[ScanResult]) -> None:
    """The removed documents the scans kept (the first `sharding.filters.samples` per filter of each unit, capped
    again over the corpus in unit order), one JSON object a line, written whole before the manifest."""
    limit, shown, lines, seen = job.sharding.filters.samples, {}, [], set()
    for s in sorted(scans, key=lambda s: s.index):
        for r in s.removed_samples:
            if shown.get(r.filter, 0) < limit and r.text not in seen:  # exact copies shown once
                seen.add(r.text)
                shown[r.filter] = shown.get(r.filter, 0) + 1
                lines.append(r.model_dump_json())
    storage.write_bytes(storage.join(job.output, samples_name(job)), "".join(x + "\n" for x in lines).encode(), job.s3)


def _chat_stats(job: ShardJob, scans: list[ScanResult], infos: list[ShardInfo]) -> ChatStats | None:
    if job.chat is None:
        return None
    return ChatStats(
        style=job.chat.style,
        template=job.chat.template_id,
        seq_len=job.chat.seq_len,
        cut=sum(s.chats_cut for s in scans),
        dropped=sum(s.chats_dropped for s in scans),
        label_tokens=sum(i.token_files.label_tokens for i in infos if i.token_files is not None),
        task=job.chat.task,
    )


def publish_manifest(
    job: ShardJob, scans: list[ScanResult], placement: Placement, infos: list[ShardInfo]
) -> ShardManifest:
    """Write manifest.json (the last write: its presence means a complete dataset), then clean up."""
    manifest = build_manifest(job, scans, placement, infos)
    if manifest.chat is not None and manifest.chat.label_tokens == 0:
        c = manifest.chat
        raise BadInputError(
            f"no assistant tokens to learn from in the training shards ({manifest.rows} conversations kept, "
            f"{c.dropped} dropped as longer than seq_len + 1 = {c.seq_len + 1} ids, {manifest.bad_records} bad): "
            "train.task sft would train on nothing"
        )
    if manifest.quality is not None and manifest.quality.samples:
        write_samples(job, scans)
    storage.write_bytes(storage.join(job.output, MANIFEST_NAME), manifest.to_json().encode(), job.s3)
    shards = manifest.shards + ([manifest.heldout] if manifest.heldout else [])
    keep = {f for s in shards for f in s.files()}
    for rel, _ in storage.list_files(job.output, job.s3):
        old = rel.startswith(("shard-", "heldout.")) and rel.endswith((".parquet", ".bin", ".idx"))
        old = old or (rel.startswith("removed-samples.") and rel != (manifest.quality and manifest.quality.samples))
        if "/" not in rel and old and rel not in keep:
            storage.delete(storage.join(job.output, rel), job.s3)  # shards of an earlier, different run
    job.work.remove()
    # also work left in the output by interrupted runs with other settings
    storage.delete_tree(storage.join(job.output, WORK_DIR_NAME), job.s3)
    return manifest
