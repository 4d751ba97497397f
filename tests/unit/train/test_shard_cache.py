"""What the two training streams (PackedWindows, ConversationRows) share in nightloom/train/data.py: the shard
cache, each shard's seeded order and its files' URIs."""

from __future__ import annotations

import numpy as np

from nightloom.train.data import ShardCache, shard_order, shard_uri


def test_the_cache_keeps_the_last_shards_used_and_loads_each_once():
    loads = []

    def load(k):
        loads.append(k)
        return f"shard {k}"

    cache = ShardCache(2)
    assert [cache.get(k, load) for k in (0, 1, 0, 2, 0, 1)] == [f"shard {k}" for k in (0, 1, 0, 2, 0, 1)]
    assert loads == [0, 1, 2, 1]  # 1 went out when 2 came (0 had been used since), then came back
    assert list(cache) == [0, 1]


def test_a_shard_s_order_is_its_seeded_permutation_and_none_unseeded():
    a, b = shard_order(7, 3, 50), shard_order(7, 3, 50)
    assert np.array_equal(a, b) and sorted(a) == list(range(50)) and not np.array_equal(a, np.arange(50))
    assert not np.array_equal(a, shard_order(7, 4, 50))  # another shard, another order
    assert shard_order(None, 3, 50) is None


def test_a_shard_file_sits_under_the_manifest_s_folder_or_prefix():
    assert shard_uri("s3://bucket/data", "shard-00001.bin") == "s3://bucket/data/shard-00001.bin"
    assert shard_uri("/data/out", "shard-00001.bin") == "/data/out/shard-00001.bin"
