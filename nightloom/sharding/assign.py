"""Map shards to data-parallel ranks so every rank does the same number of micro-batches.

Tokenizer "bytes": a rank's stream is its documents' UTF-8 bytes in shard order, packed with one separator
token between documents (stream tokens = Σ tokens + Σ rows − 1). The stream is cut into non-overlapping
windows of seq_len + 1 tokens (inputs = window[:-1], targets = window[1:]); micro_batch windows make a
micro-batch. Shards go to ranks by LPT on stream tokens (largest first onto the lightest rank, ties by
index), then every rank runs the same count: the minimum ("drop": surplus tokens dropped) or the maximum
("pad": short ranks padded). Both amounts are reported.
"""

from __future__ import annotations

import heapq
import math
from typing import Literal

from pydantic import BaseModel, ConfigDict

from nightloom.sharding.manifest import ShardManifest


class RankShards(BaseModel):
    model_config = ConfigDict(extra="forbid")
    rank: int
    shards: list[int]  # shard indices, ascending: the rank reads them in this order
    documents: int
    stream_tokens: int  # packed: documents + separators
    windows: int  # full windows of seq_len + 1 in its stream
    micro_batches: int  # what it actually runs (equal on every rank)
    dropped_tokens: int
    padded_tokens: int


class DPAssignment(BaseModel):
    """Shards per DP rank and the equal micro-batch count; what the trainer needs to split data."""

    model_config = ConfigDict(extra="forbid")
    dp_size: int
    seq_len: int
    micro_batch: int
    policy: Literal["drop", "pad"]
    micro_batches_per_rank: int
    ranks: list[RankShards]
    padded_tokens: int
    dropped_tokens: int
    total_tokens: int  # packed stream tokens over all ranks

    def shards_for(self, rank: int) -> list[int]:
        return self.ranks[rank].shards


def assign_shards(
    manifest: ShardManifest, dp_size: int, seq_len: int, micro_batch: int, policy: Literal["drop", "pad"] = "drop"
) -> DPAssignment:
    """Shard indices per DP rank with an equal number of micro-batches (see the module docstring)."""
    if dp_size <= 0 or seq_len <= 0 or micro_batch <= 0:
        raise ValueError(f"dp_size, seq_len, micro_batch must be > 0, got {dp_size}, {seq_len}, {micro_batch}")
    if policy not in ("drop", "pad"):
        raise ValueError(f"policy must be 'drop' or 'pad', got {policy!r}")
    shards = manifest.shards
    if len(shards) < dp_size:
        raise ValueError(f"{len(shards)} shards cannot feed {dp_size} data-parallel ranks: reshard with ≥ {dp_size}")
    heap = [(0, 0, r) for r in range(dp_size)]  # (stream tokens, shard count, rank)
    owned: list[list[int]] = [[] for _ in range(dp_size)]
    for sh in sorted(shards, key=lambda s: (-(s.tokens + s.rows), s.index)):
        load, count, r = heapq.heappop(heap)
        owned[r].append(sh.index)
        heapq.heappush(heap, (load + sh.tokens + sh.rows, count + 1, r))
    by_index = {s.index: s for s in shards}
    window = seq_len + 1
    per_mb = window * micro_batch
    streams, docs = [], []
    for r in range(dp_size):
        rows = sum(by_index[i].rows for i in owned[r])
        toks = sum(by_index[i].tokens for i in owned[r])
        docs.append(rows)
        streams.append(toks + max(rows - 1, 0))
    if policy == "drop":
        m = min(s // per_mb for s in streams)
        if m == 0:
            raise ValueError(
                f"rank stream of {min(streams):,} tokens is shorter than one micro-batch "
                f"({micro_batch} × {window} tokens): use fewer ranks, shorter seq_len or more data"
            )
    else:
        m = max(math.ceil(s / per_mb) for s in streams)
    ranks = []
    for r in range(dp_size):
        used = m * per_mb
        ranks.append(
            RankShards(
                rank=r,
                shards=sorted(owned[r]),
                documents=docs[r],
                stream_tokens=streams[r],
                windows=streams[r] // window,
                micro_batches=m,
                dropped_tokens=max(streams[r] - used, 0),
                padded_tokens=max(used - streams[r], 0),
            )
        )
    return DPAssignment(
        dp_size=dp_size,
        seq_len=seq_len,
        micro_batch=micro_batch,
        policy=policy,
        micro_batches_per_rank=m,
        ranks=ranks,
        padded_tokens=sum(x.padded_tokens for x in ranks),
        dropped_tokens=sum(x.dropped_tokens for x in ranks),
        total_tokens=sum(streams),
    )
