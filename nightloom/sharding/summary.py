"""The short report of a sharded dataset: per-shard figures and the verdict (CLI --json, Prefect artifact)."""

from __future__ import annotations

from nightloom.records import Record
from nightloom.sharding.manifest import ShardManifest
from nightloom.sharding.quality_records import QualityCounts


class ShardFigures(Record):
    index: int
    rows: int
    tokens: int
    bytes: int


class ShardSummary(Record):
    output: str
    num_shards: int
    balance_by: str
    tolerance: float
    imbalance: float
    imbalance_before_rebalance: float
    rebalanced: bool
    balanced: bool
    rows: int
    tokens: int
    bytes: int
    dedup_dropped: int
    empty_skipped: int
    bad_records: int
    files_read: int | None
    files_empty: int
    files_bad: int
    files_duplicate: int
    files_ignored: int
    file_examples: dict[str, list[str]]
    settings_hash: str
    shards: list[ShardFigures]
    tokenizer: str = "bytes"  # the tokenizer's fingerprint
    token_files: int = 0  # .bin/.idx pairs written (training shards + held-out split)
    token_file_tokens: int = 0  # ids in those .bin files, one EOS per document included
    token_dtype: str | None = None  # uint8, uint16 or int32; None when the manifest lists no token files
    quality: QualityCounts | None = None  # sharding.filters / near_dup: documents and tokens removed per filter

    def quality_line(self) -> str:
        """e.g. "removed: gopher_quality 120 docs (45,000 tokens), near_dup 30 docs (9,000 tokens); samples in F"."""
        if self.quality is None:
            return ""
        parts = [f"{k} {v.documents:,} docs ({v.tokens:,} tokens)" for k, v in self.quality.removed.items()]
        where = f"; samples in {self.quality.samples}" if self.quality.samples else ""
        return "removed: " + ", ".join(parts) + f", {self.quality.files_filtered} files emptied{where}"

    def tokens_line(self) -> str:
        """e.g. "token files: 4 .bin/.idx pairs (uint16), 1,234,567 tokens incl. EOS; tokenizer bytes"."""
        if not self.token_files:
            return "token files: none (manifest written before token files; the trainer reads the text)"
        return (
            f"token files: {self.token_files} .bin/.idx pairs ({self.token_dtype}), {self.token_file_tokens:,} "
            f"tokens incl. EOS; tokenizer {self.tokenizer}"
        )

    def files_line(self) -> str:
        """Where every input file went, e.g. "files: 120 read, 3 empty, 1 bad, 0 duplicate, 2 ignored (.DS_Store, ...)"."""
        if self.files_read is None:
            return "files: not accounted (manifest written before per-file accounting)"
        parts = [
            f"{self.files_read} read",
            f"{self.files_empty} empty",
            f"{self.files_bad} bad",
            f"{self.files_duplicate} duplicate",
            f"{self.files_ignored} ignored",
        ]
        shown = [f"{k}: {', '.join(v[:3])}{', ...' if len(v) > 3 else ''}" for k, v in self.file_examples.items() if v]
        return "files: " + ", ".join(parts) + (f" ({'; '.join(shown)})" if shown else "")

    def table(self) -> list[dict]:
        """Rows for a table artifact: one per shard, then a verdict row."""
        rows = [s.model_dump() | {"share_of_mean": "", "verdict": ""} for s in self.shards]
        metric = [getattr(s, self.balance_by) for s in self.shards]
        mean = sum(metric) / len(metric) if metric else 0
        for r, x in zip(rows, metric):
            r["share_of_mean"] = f"{x / mean:.4f}" if mean else ""
        verdict = (
            f"{'balanced' if self.balanced else 'NOT balanced'}: imbalance {self.imbalance:.4f} on {self.balance_by} "
            f"(tolerance {self.tolerance:g}; before rebalancing {self.imbalance_before_rebalance:.4f}); "
            f"dedup dropped {self.dedup_dropped}, empty {self.empty_skipped}, bad {self.bad_records}; "
            f"{self.files_line()}; {self.tokens_line()}"
            + (f"; {self.quality_line()}" if self.quality is not None else "")
        )
        rows.append(
            {
                "index": "all",
                "rows": self.rows,
                "tokens": self.tokens,
                "bytes": self.bytes,
                "share_of_mean": "",
                "verdict": verdict,
            }
        )
        return rows


def summarize(manifest: ShardManifest, output: str) -> ShardSummary:
    files = [s.token_files for s in manifest.shards + ([manifest.heldout] if manifest.heldout else [])]
    files = [f for f in files if f is not None]
    return ShardSummary(
        output=output,
        token_files=len(files),
        token_file_tokens=sum(f.tokens for f in files),
        token_dtype=files[0].dtype if files else None,
        shards=[ShardFigures(index=s.index, rows=s.rows, tokens=s.tokens, bytes=s.bytes) for s in manifest.shards],
        **manifest.model_dump(
            include={
                "num_shards",
                "balance_by",
                "tolerance",
                "imbalance",
                "imbalance_before_rebalance",
                "rebalanced",
                "balanced",
                "rows",
                "tokens",
                "bytes",
                "dedup_dropped",
                "empty_skipped",
                "bad_records",
                "files_read",
                "files_empty",
                "files_bad",
                "files_duplicate",
                "files_ignored",
                "file_examples",
                "settings_hash",
                "tokenizer",
                "quality",
            }
        ),
    )
