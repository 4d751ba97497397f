"""Shards carrying an OpenAI `messages` column (JSON-encoded by `dataset.keep_columns`) prepare with openai_map_fn."""

from __future__ import annotations

import json

from nightloom.finetune.run import prepare_data
from nightloom.finetune.xtuner_plan import plan_xtuner
from nightloom.sharding import shard_dataset
from nightloom.spec import DatasetSpec, ShardingSpec
from tests.support.xtuner_data import make_spec


def test_openai_messages_from_keep_columns_prepare(xtuner_env, base_model, tmp_path):
    rows = [
        {
            "id": f"conv-{i}",
            "messages": [
                {"role": "user", "content": f"What is {i} + {i}?"},
                {"role": "assistant", "content": f"It is {2 * i}."},
            ],
        }
        for i in range(12)
    ]
    src = tmp_path / "chat.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    shards = tmp_path / "shards"
    manifest = shard_dataset(
        DatasetSpec(path=str(src), text_field="id", keep_columns=["messages"]),
        ShardingSpec(num_shards=2, output=str(shards), balance_by="rows", tolerance=0.9),
    )
    assert manifest.keep_columns == ["messages"] and manifest.rows == 12

    spec = make_spec(tmp_path, base_model, shards, map_fn="openai")
    plan = plan_xtuner(spec, shards, tmp_path / "run", world_size=1, env=xtuner_env, peak_flops=1e9, log=lambda s: None)
    stats = prepare_data(plan, log=lambda s: None)
    assert stats["rows"] > 0 and stats["label_tokens"] > 0  # assistant turns became trainable labels
