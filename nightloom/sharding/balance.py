"""Balance figures and deterministic rebalancing of hash buckets onto shards.

Documents hash into M = num_shards × VIRTUAL_BUCKETS buckets (bucket = H mod M). Plain hashing puts bucket b
on shard b mod N (identical to H mod N, since N divides M). When that misses the tolerance, a few buckets are
moved off their plain shard (`move_mapping`: from the heaviest shard to the lightest, the largest bucket that
does not overshoot, until the imbalance is within half the tolerance): the scan spills each document under its
plain shard, so a shard whose buckets mostly stay home reads little besides its own spill partition. Should that
not reach the tolerance, buckets are placed by LPT (largest bucket first onto the currently lightest shard; ties
by bucket id, then shard index): deterministic, keeps identical keys together, and bounded: every shard ends
within max_bucket of the mean.

Imbalance = max_i |x_i − mean| / mean (x_i = rows, tokens or bytes of shard i).
"""

from __future__ import annotations

import bisect
import heapq
import math

import numpy as np

from nightloom.sharding.errors import ShardingError, TooSmallError

VIRTUAL_BUCKETS = 1024


def imbalance(loads: np.ndarray) -> float:
    """max |x_i − mean| / mean; 0.0 for an all-zero vector."""
    mean = float(np.mean(loads)) if len(loads) else 0.0
    return float(np.max(np.abs(loads - mean)) / mean) if mean > 0 else 0.0


def plain_mapping(num_shards: int, num_buckets: int) -> np.ndarray:
    return (np.arange(num_buckets, dtype=np.int64) % num_shards).astype(np.int32)


def lpt_mapping(weights: np.ndarray, num_shards: int) -> np.ndarray:
    """Bucket → shard by longest-processing-time-first; empty buckets keep their plain shard."""
    mapping = plain_mapping(num_shards, len(weights))
    heap = [(0, s) for s in range(num_shards)]
    order = np.lexsort((np.arange(len(weights)), -weights))  # weight desc, bucket id asc
    for b in order:
        w = int(weights[b])
        if w == 0:
            break
        load, s = heapq.heappop(heap)
        mapping[b] = s
        heapq.heappush(heap, (load + w, s))
    return mapping


def move_mapping(weights: np.ndarray, num_shards: int, target: float) -> np.ndarray:
    """The plain mapping with as few buckets moved as it takes to reach imbalance ≤ `target` (or as close as
    this greedy gets: the caller checks). Each move takes, from the heaviest shard, the largest bucket no bigger
    than what both that shard is over and the lightest shard is under the mean, else the smallest one that
    still narrows both; ties by bucket id, then shard index, so the result depends on the weights alone."""
    mapping = plain_mapping(num_shards, len(weights))
    loads = shard_loads(mapping, weights, num_shards).astype(np.float64)
    mean = float(loads.mean()) if len(loads) else 0.0
    if mean <= 0:
        return mapping
    held: list[list[tuple[int, int]]] = [[] for _ in range(num_shards)]  # per shard: sorted (weight, bucket)
    for b in np.flatnonzero(weights > 0).tolist():
        held[b % num_shards].append((int(weights[b]), b))
    for h in held:
        h.sort()
    for _ in range(len(weights)):
        heavy, light = int(np.argmax(loads)), int(np.argmin(loads))
        if float(np.max(np.abs(loads - mean))) / mean <= target or heavy == light:
            break
        room = min(loads[heavy] - mean, mean - loads[light])
        h = held[heavy]
        k = bisect.bisect_right(h, (int(room), len(weights))) - 1  # the largest bucket that does not overshoot
        if k < 0:
            if not h or h[0][0] >= 2 * room:
                break  # no move narrows both: leave it to the caller (LPT)
            k = 0
        w, b = h.pop(k)
        bisect.insort(held[light], (w, b))
        mapping[b] = light
        loads[heavy] -= w
        loads[light] += w
    return mapping


def shard_loads(mapping: np.ndarray, weights: np.ndarray, num_shards: int) -> np.ndarray:
    return np.bincount(mapping, weights=weights, minlength=num_shards).astype(np.int64)


def too_small_message(
    *,
    num_shards: int,
    tolerance: float,
    metric: str,
    best: float,
    loads: np.ndarray,
    bucket_weights: np.ndarray,
    docs: int,
) -> str:
    """Explain the shortfall with the data a reachable balance needs (LPT bound: imbalance ≤ max_bucket/mean)."""
    total = int(loads.sum())
    biggest = int(bucket_weights.max()) if len(bucket_weights) else 0
    need = math.ceil(num_shards * biggest / tolerance)
    mean_doc = total / docs if docs else 1.0
    need_docs = math.ceil(need / mean_doc) if metric != "rows" else need
    unit = {"rows": "documents", "tokens": "tokens", "bytes": "bytes"}[metric]
    extra = "" if metric == "rows" else f" (about {need_docs:,} documents of the current mean {mean_doc:,.0f} {unit})"
    return (
        f"corpus too small to balance {num_shards} shards within tolerance {tolerance:g} on {metric}: "
        f"best achievable imbalance {best:.4f} (largest unsplittable unit {biggest:,} {unit}); "
        f"need at least {need:,} {unit}{extra}, have {total:,} {unit} in {docs:,} documents. "
        f"Use fewer shards, a larger tolerance, or more data."
    )


def balance(
    bucket_weights: np.ndarray, num_shards: int, tolerance: float, metric: str, docs: int
) -> tuple[np.ndarray, float, float, bool, np.ndarray]:
    """(bucket→shard mapping, imbalance before, after, rebalanced?, final loads) from per-bucket totals.

    Raises TooSmallError when even the rebalanced layout misses the tolerance.
    """
    bw = bucket_weights
    mapping = plain_mapping(num_shards, len(bw))
    loads = shard_loads(mapping, bw, num_shards)
    before = imbalance(loads)
    if before <= tolerance:
        return mapping, before, before, False, loads
    mapping = move_mapping(bw, num_shards, tolerance / 2)
    loads = shard_loads(mapping, bw, num_shards)
    after = imbalance(loads)
    if after > tolerance:
        mapping = lpt_mapping(bw, num_shards)
        loads = shard_loads(mapping, bw, num_shards)
        after = imbalance(loads)
    if after > tolerance:
        raise TooSmallError(
            too_small_message(
                num_shards=num_shards,
                tolerance=tolerance,
                metric=metric,
                best=after,
                loads=loads,
                bucket_weights=bw,
                docs=docs,
            )
        )
    return mapping, before, after, True, loads


def check_enough_docs(docs: int, num_shards: int, where: str) -> None:
    if docs < num_shards:
        raise ShardingError(
            f"{where}: more shards ({num_shards}) than documents ({docs}) after dedup and skipping; "
            f"use at most {docs} shards or add data"
        )
