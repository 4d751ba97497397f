"""The short report of a sharded dataset: per-shard figures and the verdict (CLI --json, Prefect artifact)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

from nightloom.sharding.manifest import ShardManifest


class ShardFigures(BaseModel):
    model_config = ConfigDict(extra="forbid")
    index: int
    rows: int
    tokens: int
    bytes: int


class ShardSummary(BaseModel):
    model_config = ConfigDict(extra="forbid")
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
    settings_hash: str
    shards: list[ShardFigures]

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
            f"dedup dropped {self.dedup_dropped}, empty {self.empty_skipped}, bad {self.bad_records}"
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
    return ShardSummary(
        output=output,
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
                "settings_hash",
            }
        ),
    )
