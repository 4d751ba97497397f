"""Token files (.bin/.idx, Megatron's indexed dataset) next to every shard: megatron-core reads exactly the
tokenizer's ids + EOS per document, the bytes match megatron-core's own builder, the output is the same for any
worker count, and a bad tokenizer fails before any work."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import xxhash

from flows.cli import main
from nightloom.sharding import load_manifest, shard_dataset, summarize
from nightloom.sharding.tokens import TokenFileWriter, token_dtype, with_eos
from nightloom.spec import DatasetSpec, ShardingSpec, TokenizerSpec
from nightloom.tokenizer import TokenizerError, load_tokenizer
from tests.support.sharding import make_docs, takes_o_direct, write_jsonl, write_parquet

indexed = pytest.importorskip("megatron.core.datasets.indexed_dataset")
EXTRA = ["数据 模型", "🌙 naïve café", "Straße  \t tabs", "<|endoftext|> inside a document"]


def _docs() -> list[str]:
    return make_docs(400, seed=11, dup_every=9) + EXTRA


@pytest.fixture(scope="module")
def bpe(tmp_path_factory) -> TokenizerSpec:
    """A byte-level BPE trained with `tokenizers` (vocab 400 > 256, so byte ids cannot pass for it)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    folder = tmp_path_factory.mktemp("bpe") / "tok"
    folder.mkdir()
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_docs(), trainer=trainer)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))
    return TokenizerSpec(path=str(folder))


def _corpus(root: Path) -> Path:
    docs = _docs()
    write_jsonl(root / "in" / "a.jsonl", docs[:250])
    write_parquet(root / "in" / "b.parquet", docs[250:])
    return root / "in"


def _shard(src: Path, out: Path, tokenizer, workers: int = 2, keep_columns: tuple[str, ...] = ()):
    settings = {"num_shards": 3, "tolerance": 0.5, "heldout": 0.1}
    dataset = DatasetSpec(path=str(src), keep_columns=list(keep_columns))
    return shard_dataset(dataset, ShardingSpec(output=str(out), **settings), workers=workers, tokenizer=tokenizer)


@pytest.mark.parametrize("path", ["fast", "record"])
@pytest.mark.parametrize("which", ["bytes", "bpe"])
def test_megatron_reads_every_shard_as_the_tokenizers_ids_then_eos(tmp_path, request, which, path):
    spec = request.getfixturevalue("bpe") if which == "bpe" else TokenizerSpec.coerce("bytes")
    tok = load_tokenizer(spec)
    keep = ("id",) if path == "record" else ()  # a kept column takes the record-by-record path
    out = tmp_path / "out"
    m = _shard(_corpus(tmp_path), out, spec, keep_columns=keep)
    assert m.schema_version == 3 and m.tokenizer == tok.fingerprint()
    kept = 0
    for s in m.shards + [m.heldout]:
        tf = s.token_files
        # the smallest dtype that holds the ids: bytes' 256 ids are its .bin's own bytes (uint8, Megatron code 1)
        assert tf is not None and tf.dtype == ("uint8" if which == "bytes" else "uint16") and tf.eos_id == tok.eos_id
        ds = indexed.IndexedDataset(str(out / tf.prefix))
        texts = pq.read_table(out / s.path).column("text").to_pylist()
        assert len(ds) == len(texts) == s.rows == tf.documents
        for i, text in enumerate(texts):
            assert ds[i].tolist() == tok.encode(text) + [tok.eos_id], (s.path, i)
        assert ds.document_indices.tolist() == list(range(len(texts) + 1))  # one sequence per document
        assert tf.tokens == s.tokens + s.rows == int(ds.sequence_lengths.sum())
        assert tf.bin_hash == _xxh3(out / tf.bin) and tf.idx_hash == _xxh3(out / tf.idx)
        kept += len(texts)
    assert kept == m.rows + m.heldout.rows == len(set(_docs()))  # every kept document, once


def _xxh3(p: Path) -> str:
    import xxhash

    return "xxh3-128:" + xxhash.xxh3_128(p.read_bytes()).hexdigest()


@pytest.mark.parametrize("vocab", [256, 300, 70_000])
def test_files_are_byte_identical_to_megatrons_builder(tmp_path, vocab):
    """Our numpy writer against megatron-core's IndexedDatasetBuilder, uint8, uint16 and int32."""
    import torch

    rng = np.random.default_rng(0)
    lengths = rng.integers(0, 50, size=300)
    ids = rng.integers(0, vocab - 1, size=int(lengths.sum()))
    eos = vocab - 1
    dtype = token_dtype(vocab)
    assert dtype == ("uint8" if vocab <= 256 else "uint16" if vocab < 65_500 else "int32")
    w = TokenFileWriter(tmp_path / "ours.bin", tmp_path / "lengths.bin", dtype, eos)
    for a in range(0, len(lengths), 64):  # in batches, as the shard writer adds them
        part = lengths[a : a + 64]
        start = int(lengths[:a].sum())
        w.add(part, ids[start : start + int(part.sum())])
    counts = w.finish(tmp_path / "ours.idx")
    b = indexed.IndexedDatasetBuilder(str(tmp_path / "ref.bin"), dtype=np.dtype(dtype).type)
    start = 0
    for n in lengths.tolist():
        doc = np.append(ids[start : start + n], eos)
        b.add_document(torch.from_numpy(doc), [len(doc)])
        start += n
    b.finalize(str(tmp_path / "ref.idx"))
    assert (tmp_path / "ours.bin").read_bytes() == (tmp_path / "ref.bin").read_bytes()
    assert (tmp_path / "ours.idx").read_bytes() == (tmp_path / "ref.idx").read_bytes()
    assert counts.documents == len(lengths) and counts.tokens == int(lengths.sum()) + len(lengths)
    assert not (tmp_path / "lengths.bin").exists()


def test_token_files_are_byte_identical_for_any_worker_count(tmp_path, bpe):
    src = _corpus(tmp_path)
    m1 = _shard(src, tmp_path / "o1", bpe, workers=1)
    m2 = _shard(src, tmp_path / "o2", bpe, workers=2)
    assert m1 == m2
    for s in m1.shards + [m1.heldout]:
        for f in s.files():
            assert (tmp_path / "o1" / f).read_bytes() == (tmp_path / "o2" / f).read_bytes(), f


def test_bad_tokenizer_is_a_clear_error_before_any_work(tmp_path, capsys):
    src = write_jsonl(tmp_path / "a.jsonl", make_docs(50))
    out = tmp_path / "out"
    with pytest.raises(TokenizerError, match=r"nope: model.tokenizer.path: not found"):
        _shard(src, out, str(tmp_path / "nope"))
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "tokenizer.json").write_text("{ not json")
    with pytest.raises(TokenizerError, match=r"broken/tokenizer.json: cannot be read"):
        _shard(src, out, str(broken))
    assert not out.exists()  # nothing written, not even the work folder
    cli = ["shard", "--input", str(src), "--output", str(out), "--shards", "2"]
    assert main([*cli, "--tokenizer", str(tmp_path / "nope")]) == 2
    assert "nope: model.tokenizer.path: not found" in capsys.readouterr().err
    assert not out.exists()


def test_cli_json_reports_token_files_and_a_v2_manifest_still_loads(tmp_path, bpe, capsys):
    src = write_jsonl(tmp_path / "a.jsonl", make_docs(120, seed=2))
    out = tmp_path / "out"
    cli = ["shard", "--input", str(src), "--output", str(out), "--shards", "2", "--tolerance", "0.5"]
    code = main([*cli, "--tokenizer", bpe.path, "--json"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    summary = json.loads(captured.out)
    m = load_manifest(out)
    assert summary["token_files"] == 2 and summary["token_dtype"] == "uint16"
    assert summary["token_file_tokens"] == m.tokens + m.rows == sum(s.token_files.tokens for s in m.shards)
    assert summary["tokenizer"] == load_tokenizer(bpe).fingerprint()
    # a manifest written before token files (schema 2) still loads, with none listed
    old = json.loads((out / "manifest.json").read_text())
    old["schema_version"] = 2
    for s in old["shards"]:
        del s["token_files"]
    (tmp_path / "v2").mkdir()
    (tmp_path / "v2" / "manifest.json").write_text(json.dumps(old))
    v2 = load_manifest(tmp_path / "v2")
    assert all(s.token_files is None for s in v2.shards) and v2.shards[0].files() == [v2.shards[0].path]
    assert summarize(v2, "x").token_files == 0


@pytest.mark.parametrize(("dtype", "eos"), [("uint8", 0), ("uint16", 256)])
def test_bytes_texts_give_the_files_megatron_builds_from_their_utf8_bytes(tmp_path, dtype, eos):
    """add_texts (the bytes tokenizer's path: Arrow appends the EOS placeholder) writes what megatron-core's
    builder writes from each document's UTF-8 bytes then EOS, for chunked, sliced and non-ASCII text, as uint8
    (the bytes tokenizer's own, EOS 0) or widened to uint16."""
    import pyarrow as pa
    import torch

    rng = np.random.default_rng(1)
    words = ["a", "λ", "東京", "🙂", " ", "\x00", "word"]
    docs = ["".join(rng.choice(words, size=int(n))) for n in rng.integers(1, 40, size=250)]
    chunked = pa.chunked_array([pa.array(docs[:100]), pa.array(docs[90:250]).slice(10)])  # an offset chunk
    w = TokenFileWriter(tmp_path / "ours.bin", tmp_path / "lengths.bin", dtype, eos)
    w.add_texts(chunked.slice(0, 120))
    w.add_texts(chunked.slice(120).combine_chunks())
    counts = w.finish(tmp_path / "ours.idx")
    b = indexed.IndexedDatasetBuilder(str(tmp_path / "ref.bin"), dtype=np.dtype(dtype).type)
    for d in docs:
        doc = np.append(np.frombuffer(d.encode(), dtype=np.uint8).astype(dtype), eos)
        b.add_document(torch.from_numpy(doc.astype(np.int64)), [len(doc)])
    b.finalize(str(tmp_path / "ref.idx"))
    assert (tmp_path / "ours.bin").read_bytes() == (tmp_path / "ref.bin").read_bytes()
    assert (tmp_path / "ours.idx").read_bytes() == (tmp_path / "ref.idx").read_bytes()
    assert counts.documents == len(docs) and counts.tokens == sum(len(d.encode()) + 1 for d in docs)


def test_a_long_token_file_goes_past_the_page_cache_with_the_same_bytes(tmp_path):
    """A .bin many write buffers long is written with O_DIRECT where the file system takes it (documents crossing
    buffer ends, a tail that is not a whole block), and holds exactly the ids and EOS a buffered write would."""
    rng = np.random.default_rng(5)
    lengths = rng.integers(1, 40_000, size=300)
    ids = rng.integers(0, 50_000, size=int(lengths.sum()))
    texts = pa.array(["".join(map(chr, rng.integers(32, 0x2FF, size=int(n) // 40 + 1))) for n in lengths])
    w = TokenFileWriter(tmp_path / "a.bin", tmp_path / "lengths.bin", "uint16", eos_id=7)
    direct = w._bin.direct
    for part in np.array_split(np.arange(len(lengths)), 30):
        start = int(lengths[: part[0]].sum()) if len(part) else 0
        w.add(lengths[part], ids[start : start + int(lengths[part].sum())])
    w.add_texts(texts)
    counts = w.finish(tmp_path / "a.idx")
    raw = [t.encode() for t in texts.to_pylist()]
    want = np.concatenate(
        [with_eos(lengths, ids, 7, np.dtype("<u2"))] + [np.append(np.frombuffer(r, dtype=np.uint8), 7) for r in raw]
    ).astype("<u2")
    got = np.fromfile(tmp_path / "a.bin", dtype="<u2")
    assert len(got) * 2 > 8 << 20  # more than one write buffer
    assert np.array_equal(got, want) and counts.tokens == len(want)
    assert counts.documents == len(lengths) + len(raw)
    assert counts.bin_hash == "xxh3-128:" + xxhash.xxh3_128(want.tobytes()).hexdigest()
    assert direct or not takes_o_direct(tmp_path)
