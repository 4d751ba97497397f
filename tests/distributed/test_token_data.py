"""The trainer's windows from the shard stage's token files (.bin): the same windows it made from the Parquet
text (bytes: parity with the original stream; BPE: the tokenizer's stream), seeded or not, for any DP degree,
and a loader built fresh at step k (a resumed run) continues the same windows. No tokenization at load time."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from nightloom.sharding import shard_dataset
from nightloom.spec import DatasetSpec, ShardingSpec, TokenizerSpec
from nightloom.train.data import DataError, PackedWindows, StepLoader, _TokenShard
from tests.support.sharding import make_docs, write_jsonl

SEQ = 32


def _text_only_copy(out: Path, dest: Path) -> Path:
    """The same dataset as a schema-2 manifest (no token files): the trainer's text path."""
    shutil.copytree(out, dest)
    m = json.loads((dest / "manifest.json").read_text())
    m["schema_version"] = 2
    for s in m["shards"]:
        (dest / s.pop("token_files")["bin"]).unlink()
    (dest / "manifest.json").write_text(json.dumps(m))
    return dest


@pytest.fixture(scope="module")
def sharded(tmp_path_factory):
    root = tmp_path_factory.mktemp("tokdata")
    src = write_jsonl(root / "c.jsonl", make_docs(600, seed=5, dup_every=7, skew=True) + ["数据 🌙 naïve"])
    out = root / "out"
    shard_dataset(DatasetSpec(path=str(src)), ShardingSpec(output=str(out), num_shards=3, tolerance=0.2))
    return out, _text_only_copy(out, root / "text")


@pytest.mark.parametrize("seed", [None, 1234])
def test_windows_from_token_files_equal_the_windows_from_text(sharded, seed):
    tokens, text = (PackedWindows(str(p), SEQ, seed=seed) for p in sharded)
    assert all(isinstance(tokens._shard(k), _TokenShard) for k in range(len(tokens.spans)))
    assert tokens.total == text.total > 100
    assert torch.equal(tokens.windows(0, tokens.total + 7), text.windows(0, text.total + 7))  # wraps the epoch


def test_a_resumed_loader_continues_the_same_windows_for_any_dp(sharded):
    manifest = str(sharded[0])
    run = StepLoader(PackedWindows(manifest, SEQ, seed=7), micro_batch=4, grad_accum=2, dp=1, dp_rank=0)
    first = [run.batch(k).inputs for k in range(6)]
    for dp, mb, ga in ((1, 4, 2), (2, 2, 2), (4, 1, 2)):
        fresh = PackedWindows(manifest, SEQ, seed=7)  # a new process resuming at step 3
        loaders = [StepLoader(fresh, mb, ga, dp, r) for r in range(dp)]
        for k in range(3, 6):
            assert torch.equal(torch.cat([ld.batch(k).inputs for ld in loaders]), first[k]), (dp, k)


def test_bpe_windows_from_token_files_equal_the_tokenizers_stream(tmp_path):
    from nightloom.tokenizer import ensure_trained

    docs = make_docs(300, seed=3)
    src = write_jsonl(tmp_path / "c.jsonl", docs)
    ds = DatasetSpec(path=str(src))
    tok = TokenizerSpec(path=str(tmp_path / "tok"), train_vocab=320)
    assert ensure_trained(tok, ds)
    out = tmp_path / "out"
    shard_dataset(ds, ShardingSpec(output=str(out), num_shards=2, tolerance=0.3), tokenizer=tok)
    text = _text_only_copy(out, tmp_path / "text")
    a, b = PackedWindows(str(out), SEQ, seed=3, tokenizer=tok), PackedWindows(str(text), SEQ, seed=3, tokenizer=tok)
    assert a.total == b.total and torch.equal(a.windows(0, a.total), b.windows(0, b.total))
    assert int(a.windows(0, a.total).max()) >= 256  # BPE ids, not bytes


def test_truncated_or_missing_token_file_is_reported_with_the_shard(sharded, tmp_path):
    broken = tmp_path / "b"
    shutil.copytree(sharded[0], broken)
    m = json.loads((broken / "manifest.json").read_text())
    bin0 = broken / m["shards"][0]["token_files"]["bin"]
    bin0.write_bytes(bin0.read_bytes()[:-2])
    with pytest.raises(DataError, match=r"\.bin: manifest field shards\[0\] .* but the token file holds"):
        PackedWindows(str(broken), SEQ).windows(0, 1)
    bin0.unlink()
    with pytest.raises(DataError, match="token file listed in the manifest does not exist"):
        PackedWindows(str(broken), SEQ).windows(0, 1)
