"""assign_shards: every DP rank gets the same number of micro-batches; padding/dropping is accounted exactly."""

from __future__ import annotations

import pytest

from nightloom.sharding import assign_shards
from nightloom.sharding.manifest import ShardInfo, ShardManifest


def _manifest(shards: list[tuple[int, int]]) -> ShardManifest:
    infos = [ShardInfo(index=i, path=f"s{i}", rows=r, tokens=t, bytes=t, sha256="0") for i, (r, t) in enumerate(shards)]
    return ShardManifest(
        num_shards=len(infos),
        key="<text>",
        salt="s",
        imbalance=0.0,
        imbalance_before_rebalance=0.0,
        balanced=True,
        rows=sum(r for r, _ in shards),
        tokens=sum(t for _, t in shards),
        bytes=sum(t for _, t in shards),
        shards=infos,
    )


SHAPES = [(1, 1), (2, 1), (4, 2), (3, 4), (8, 1), (5, 3)]


@pytest.mark.parametrize("dp,mb", SHAPES)
@pytest.mark.parametrize("policy", ["drop", "pad"])
def test_equal_micro_batches_and_exact_accounting(dp, mb, policy):
    shards = [(10 + 3 * i, 5000 + 977 * i) for i in range(8)]
    m = _manifest(shards)
    seq = 64
    a = assign_shards(m, dp, seq, mb, policy=policy)
    assert sorted(i for r in a.ranks for i in r.shards) == list(range(8))  # every shard exactly once
    assert all(r.shards for r in a.ranks)
    assert {r.micro_batches for r in a.ranks} == {a.micro_batches_per_rank}
    per_rank = a.micro_batches_per_rank * mb * (seq + 1)
    for r in a.ranks:
        rows = sum(shards[i][0] for i in r.shards)
        toks = sum(shards[i][1] for i in r.shards)
        assert r.stream_tokens == toks + rows - 1  # one separator between documents
        assert r.stream_tokens - r.dropped_tokens + r.padded_tokens == per_rank
        assert r.windows == r.stream_tokens // (seq + 1)
    if policy == "drop":
        assert a.padded_tokens == 0 and min(r.dropped_tokens for r in a.ranks) < mb * (seq + 1)
    else:
        assert a.dropped_tokens == 0 and min(r.padded_tokens for r in a.ranks) < mb * (seq + 1)
    assert a.total_tokens == sum(r.stream_tokens for r in a.ranks)


def test_lpt_spreads_tokens_and_is_deterministic():
    m = _manifest([(1, 100), (1, 90), (1, 50), (1, 40), (1, 30), (1, 20)])
    a = assign_shards(m, 2, 8, 1)
    # LPT: 100→r0, 90→r1, 50→r1, 40→r0, 30→r0... the two ranks end within one shard of each other
    loads = [r.stream_tokens for r in a.ranks]
    assert abs(loads[0] - loads[1]) <= 20
    assert a == assign_shards(m, 2, 8, 1)


def test_errors_are_clear():
    m = _manifest([(1, 100), (1, 100)])
    with pytest.raises(ValueError, match="2 shards cannot feed 4 data-parallel ranks"):
        assign_shards(m, 4, 8, 1)
    with pytest.raises(ValueError, match="shorter than one micro-batch"):
        assign_shards(m, 2, 128, 1)
    with pytest.raises(ValueError, match="must be > 0"):
        assign_shards(m, 0, 8, 1)


def test_on_a_real_manifest(tmp_path):
    from nightloom.sharding import shard_dataset
    from nightloom.spec import DatasetSpec, ShardingSpec
    from tests.support.sharding import make_docs, write_jsonl

    src = write_jsonl(tmp_path / "c.jsonl", make_docs(800, seed=4))
    man = shard_dataset(
        DatasetSpec(path=str(src)), ShardingSpec(output=str(tmp_path / "o"), num_shards=4, tolerance=0.05)
    )
    a = assign_shards(man, 2, 32, 2)
    assert a.micro_batches_per_rank >= 1
    assert sum(r.stream_tokens for r in a.ranks) == man.tokens + man.rows - 2  # separators within each rank
