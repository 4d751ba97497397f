"""Shared helpers for the sharding tests: small corpora written in the formats the sharder reads."""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import mmap
import os
import random
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import zstandard


def make_docs(n: int, seed: int = 0, dup_every: int = 0, skew: bool = False) -> list[str]:
    """n documents of varied length; every `dup_every`-th repeats an earlier one; `skew` = heavy-tailed sizes."""
    rng = random.Random(seed)
    words = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta", "iota", "kappa", "λόγος", "数据"]
    docs = []
    for i in range(n):
        if dup_every and i and i % dup_every == 0:
            docs.append(docs[rng.randrange(len(docs))])
            continue
        k = int(rng.paretovariate(1.2) * 5) if skew else rng.randint(3, 60)
        docs.append(f"doc {i}: " + " ".join(rng.choice(words) for _ in range(min(k, 4000))))
    return docs


def write_jsonl(path: Path, docs: list[str], extra: dict | None = None, compress: str = "") -> Path:
    lines = b"".join(json.dumps({"text": d, **(extra or {}), "id": i}).encode() + b"\n" for i, d in enumerate(docs))
    path.parent.mkdir(parents=True, exist_ok=True)
    if compress == "gz":
        path.write_bytes(gzip.compress(lines, mtime=0))
    elif compress == "zst":
        path.write_bytes(zstandard.ZstdCompressor().compress(lines))
    else:
        path.write_bytes(lines)
    return path


def write_parquet(path: Path, docs: list[str]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table({"text": docs, "id": list(range(len(docs)))}), path, row_group_size=50)
    return path


def read_shard(output: str | Path, index: int, s3=None) -> pa.Table:
    """Shard `index` of the dataset at `output` (local or s3://, `s3` a storage.S3Config) as an Arrow table, its
    sha256 checked against the manifest."""
    from nightloom import storage
    from nightloom.sharding import load_manifest

    output = str(output)
    info = load_manifest(output, s3).shards[index]
    data = storage.read_bytes(storage.join(output, info.path), s3)
    assert hashlib.sha256(data).hexdigest() == info.sha256, f"{info.path}: sha256 does not match the manifest"
    return pq.read_table(io.BytesIO(data))


def shard_texts(out: Path) -> list[list[str]]:
    """Texts of every shard, through the manifest."""
    from nightloom.sharding import load_manifest

    m = load_manifest(out)
    return [read_shard(out, s.index).column(m.text_field).to_pylist() for s in m.shards]


def tree_bytes(out: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(out.iterdir()) if p.is_file()}


def small_bpe(folder: Path, vocab: int = 350):
    """A byte-level BPE of `vocab` ids trained on make_docs text, saved as a Hugging Face tokenizer folder (EOS
    <|endoftext|>): a real tokenizer whose ids need the scan's id spill."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    from nightloom.spec import TokenizerSpec

    folder.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(make_docs(300, seed=2), trainer=trainer)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))
    return TokenizerSpec(path=str(folder))


def takes_o_direct(folder: Path) -> bool:
    """Whether files in `folder` can be written with O_DIRECT (ext4, xfs: yes; some FUSE mounts: no)."""
    if not hasattr(os, "O_DIRECT"):
        return False
    probe = folder / ".o_direct_probe"
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_DIRECT, 0o644)
    except OSError:
        return False
    try:
        os.write(fd, mmap.mmap(-1, 4096))
        return True
    except OSError:
        return False
    finally:
        os.close(fd)
        probe.unlink()
