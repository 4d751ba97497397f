"""Two specs (or deployments) that share a sharding.output with other settings never overwrite each other's shards:
the second is refused, naming the differences; the same settings over changed inputs re-shard as before."""

from __future__ import annotations

import pytest

from nightloom.sharding import ShardingError, load_manifest
from nightloom.spec import RunSpec
from tests.support.sharding import make_docs, write_jsonl


def spec(tmp_path, docs: int = 300, **sharding) -> RunSpec:
    src = write_jsonl(tmp_path / "c.jsonl", make_docs(docs, seed=3))
    return RunSpec(
        name="shard-folder",
        dataset={"path": str(src)},
        sharding={"num_shards": 4, "output": str(tmp_path / "out"), "tolerance": 0.5, **sharding},
    )


def test_other_settings_are_refused_and_the_shards_kept(prefect_backend, tmp_path):
    from flows.shard import shard_dataset_flow

    first = shard_dataset_flow(spec(tmp_path))
    with pytest.raises(ShardingError) as err:
        shard_dataset_flow(spec(tmp_path, num_shards=2, heldout=0.05))
    msg = str(err.value)
    assert f"sharding.output {tmp_path / 'out'} holds shards made with other settings" in msg
    assert "num_shards 4 there, 2 here" in msg and "heldout split False there, True here" in msg
    assert load_manifest(str(tmp_path / "out")) == first  # untouched

    changed = shard_dataset_flow(spec(tmp_path, docs=320))  # same settings, inputs changed: re-sharded
    assert changed.settings_hash != first.settings_hash and changed.num_shards == 4
