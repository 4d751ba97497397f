"""A chat messages list in the text field (train.grpo's chat prompts, `{"prompt": [{"role", "content"}, ...]}`) is
sharded as that list's JSON text, the string nightloom.chat's `prompt_messages` reads back, from JSONL (record path
and the fast path's fallback) and Parquet alike; any other list is refused naming FILE:LINE and the field."""

from __future__ import annotations

import json

import orjson
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from nightloom.chat import prompt_messages
from nightloom.sharding import BadInputError, shard_dataset
from nightloom.spec import DatasetSpec, ShardingSpec
from tests.support.sharding import shard_texts

CHATS = [
    [{"role": "system", "content": "add the numbers"}, {"role": "user", "content": f"{i} plus {i + 1} = ? é"}]
    for i in range(5)
]
PLAIN = "one plus four ="


def _shard(path, out, keep: list[str]) -> list[str]:
    ds = DatasetSpec(path=str(path), text_field="prompt", keep_columns=keep)
    shard_dataset(ds, ShardingSpec(output=str(out), num_shards=1, tolerance=0.9))
    return [t for texts in shard_texts(out) for t in texts]


@pytest.mark.parametrize("keep", [["answer"], []], ids=["record-path", "fast-path-fallback"])
def test_a_messages_list_is_sharded_as_the_json_text_the_grpo_path_reads(tmp_path, keep):
    src = tmp_path / "p.jsonl"
    rows = [{"prompt": c, "answer": str(2 * i + 1)} for i, c in enumerate(CHATS)] + [{"prompt": PLAIN, "answer": "5"}]
    src.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    texts = _shard(src, tmp_path / "out", keep)
    assert sorted(texts) == sorted([orjson.dumps(c).decode() for c in CHATS] + [PLAIN])
    assert sorted((prompt_messages(t) for t in texts if t != PLAIN), key=str) == sorted(CHATS, key=str)
    assert prompt_messages(PLAIN) is None  # the plain prompt stays plain text


def test_a_parquet_list_of_role_content_structs_is_a_messages_list(tmp_path):
    src = tmp_path / "p.parquet"
    pq.write_table(pa.table({"prompt": CHATS, "answer": [str(i) for i in range(len(CHATS))]}), src)
    assert pq.read_schema(src).field("prompt").type == pa.list_(
        pa.struct([("role", pa.string()), ("content", pa.string())])
    )
    texts = _shard(src, tmp_path / "out", ["answer"])
    assert sorted(texts) == sorted(orjson.dumps(c).decode() for c in CHATS)


BAD_LISTS = {
    "numbers": ([1, 2, 3], "item 0 is int, not a {role, content} object"),
    "no-role": ([{"text": "hi"}], "item 0 has no string 'role'"),
    "no-content": ([{"role": "user", "content": "a"}, {"role": "user"}], "item 1 has no string 'content'"),
    "content-not-a-string": ([{"role": "user", "content": 5}], "item 0 has no string 'content'"),
    "unknown-role": ([{"role": "narrator", "content": "a"}], "item 0's role 'narrator' is not one of system, user"),
    "empty": ([], "(it is empty)"),
}


@pytest.mark.parametrize("case", sorted(BAD_LISTS))
def test_any_other_list_is_refused_naming_file_line_and_field(tmp_path, case):
    bad, reason = BAD_LISTS[case]
    src = tmp_path / "p.jsonl"
    rows = [{"prompt": CHATS[0], "answer": "1"}, {"prompt": PLAIN, "answer": "5"}, {"prompt": bad, "answer": "0"}]
    src.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    out = tmp_path / "out"
    with pytest.raises(BadInputError) as e:
        _shard(src, out, ["answer"])
    msg = str(e.value)
    assert f"{src}:3: list in field 'prompt' that is not a list of chat messages" in msg and reason in msg, msg
    assert not out.exists() or not [p for p in out.iterdir() if p.name != ".nightloom-work"]
