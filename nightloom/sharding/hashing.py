"""Shard assignment hash: xxhash64(key ‖ salt) over UTF-8 bytes (never Python's `hash()`, which is salted per process).

A second, independent 64-bit hash (xxh3_64 seeded with DEDUP_SEED, computed inline by the scan loops) joins it to
make a 128-bit dedup identity, so two different keys are treated as duplicates only with probability ~2^-128 per
pair.
"""

from __future__ import annotations

import numpy as np
import xxhash

HASH_ALGORITHM = "xxhash64"
DEDUP_SEED = 0x6E6C_6F6F6D  # fixed: dedup identity must not depend on the salt


def key_hash(key: bytes, salt: bytes) -> int:
    """H(key ‖ salt) = xxhash64 with seed 0; the shard under plain hashing is `key_hash % num_shards`."""
    return xxhash.xxh64_intdigest(key + salt)


def first_occurrences(h1: np.ndarray, h2: np.ndarray) -> np.ndarray:
    """Boolean mask: True for the first row (in array order) of every distinct (h1, h2) pair."""
    n = len(h1)
    keep = np.zeros(n, dtype=bool)
    if n == 0:
        return keep
    order = np.lexsort((h2, h1))  # stable: equal keys keep their input order
    s1, s2 = h1[order], h2[order]
    first = np.ones(n, dtype=bool)
    first[1:] = (s1[1:] != s1[:-1]) | (s2[1:] != s2[:-1])
    keep[order[first]] = True
    return keep
