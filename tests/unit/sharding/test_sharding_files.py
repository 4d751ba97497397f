"""Every input file accounted for (read, empty, bad, duplicate, ignored by name), and small files scanned in units."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from nightloom.sharding import fingerprint, load_manifest, plan_job, shard_dataset
from nightloom.sharding import prepare as plan_module
from nightloom.sharding import scan as scan_module
from nightloom.sharding.sources import ignored_by_name
from nightloom.spec import DatasetSpec, ShardingSpec
from tests.support.harness import ROOT
from tests.support.sharding import make_docs, shard_texts, tree_bytes


def _folder(tmp_path):
    """A text folder as users have them: code with __init__ files, junk beside the data, one broken file."""
    src = tmp_path / "src"
    docs = make_docs(40, seed=7)
    for i, d in enumerate(docs):
        (src / f"pkg{i % 4}").mkdir(parents=True, exist_ok=True)
        (src / f"pkg{i % 4}" / f"mod{i}.txt").write_text(d)
    (src / "pkg0" / "__init__.txt").write_text("from . import mod0  # a real document, underscore or not\n")
    (src / "pkg1" / "_private.txt").write_text("def _helper(): return 42\n")
    (src / "pkg2" / "zz_copy_of_mod2.txt").write_text(docs[2])  # sorts after mod2.txt: a duplicate of it
    (src / "pkg3" / "empty.txt").write_bytes(b"")
    (src / "pkg3" / "blank.txt").write_text("  \n\t\n")
    (src / "pkg3" / "latin1.txt").write_bytes("caf\xe9".encode("latin-1"))  # not UTF-8
    (src / ".hidden.txt").write_text("not data")
    (src / ".git").mkdir()
    (src / ".git" / "config").write_text("[core]")
    (src / "_SUCCESS").write_bytes(b"")
    (src / "_committed_1234").write_text("{}")
    (src / "_started_1234").write_text("{}")
    return src, docs


def test_every_file_is_accounted_for_and_the_counts_add_up(tmp_path):
    src, docs = _folder(tmp_path)
    on_disk = [p for p in src.rglob("*") if p.is_file()]
    m = shard_dataset(
        DatasetSpec(path=str(src), format="text"),
        ShardingSpec(output=str(tmp_path / "out"), num_shards=2, tolerance=0.5, on_error="skip", max_bad_fraction=0.1),
        workers=1,
    )
    counts = (m.files_read, m.files_empty, m.files_bad, m.files_duplicate, m.files_ignored)
    assert counts == (42, 2, 1, 1, 5), counts
    assert sum(counts) == len(on_disk)
    status = {s.path: s.status for s in m.sources}
    assert len(status) + m.files_ignored == len(on_disk)  # each input file listed once, with its status
    assert status["pkg0/__init__.txt"] == status["pkg1/_private.txt"] == "read"
    assert status["pkg2/zz_copy_of_mod2.txt"] == "duplicate"
    assert status["pkg3/empty.txt"] == status["pkg3/blank.txt"] == "empty"
    assert status["pkg3/latin1.txt"] == "bad"
    assert m.file_examples["bad"] == ["pkg3/latin1.txt:1: non-UTF-8 byte 0xe9 at byte offset 3"]
    assert sorted(m.file_examples["ignored"]) == [
        ".git/config",
        ".hidden.txt",
        "_SUCCESS",
        "_committed_1234",
        "_started_1234",
    ]
    # the documents of the read files are exactly what the shards hold
    texts = sorted(t for shard in shard_texts(tmp_path / "out") for t in shard)
    assert len(texts) == sum(s.documents for s in m.sources) == m.rows
    assert "def _helper(): return 42\n" in texts


@pytest.mark.slow
def test_cli_json_and_text_name_the_files(tmp_path):
    src, _ = _folder(tmp_path)
    cmd = [sys.executable, "-m", "flows.cli", "shard", "--input", str(src), "--output", str(tmp_path / "o")]
    cmd += [
        "--shards",
        "2",
        "--tolerance",
        "0.5",
        "--format",
        "text",
        "--on-error",
        "skip",
        "--max-bad-fraction",
        "0.1",
    ]
    out = subprocess.run([*cmd, "--json"], capture_output=True, text=True, cwd=ROOT, check=False)
    summary = json.loads(out.stdout)
    assert (summary["files_read"], summary["files_ignored"]) == (42, 5), out.stderr[-2000:]
    assert {"rows", "dedup_dropped", "empty_skipped", "bad_records"} <= summary.keys()
    text = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, check=False).stdout
    assert "files: 42 read, 2 empty, 1 bad, 1 duplicate, 5 ignored" in text, text
    assert "pkg3/latin1.txt:1" in text


@pytest.mark.parametrize(
    "rel, ignored",
    [
        (".DS_Store", True),
        ("a/.cache/x.jsonl", True),
        ("_SUCCESS", True),
        ("part/_committed_99", True),
        ("_started_1", True),
        ("_metadata", True),
        ("_common_metadata", True),
        ("__init__.py", False),
        ("pkg/_private.jsonl", False),
        ("_data/train.jsonl", False),
    ],
)
def test_only_hidden_files_and_known_markers_are_ignored(rel, ignored):
    assert ignored_by_name(rel) is ignored


@pytest.mark.slow
def test_small_files_are_scanned_in_units_one_at_a_time_with_identical_output(tmp_path, monkeypatch):
    src = tmp_path / "src"
    src.mkdir()
    for i, d in enumerate(make_docs(300, seed=5, dup_every=7)):
        (src / f"f{i:04d}.txt").write_text(d)
    ds, sharding = DatasetSpec(path=str(src), format="text"), ShardingSpec(output=str(tmp_path / "a"), num_shards=3)
    job = plan_job(ds, sharding)
    assert len(job.units) == 1 and job.units[0] == list(range(300))  # 300 small files: one scan
    grouped = shard_dataset(ds, sharding, workers=2)

    monkeypatch.setattr(plan_module, "UNIT_FILES", 1)  # one file per unit, as before units existed
    alone = ShardingSpec(output=str(tmp_path / "b"), num_shards=3)
    assert len(plan_job(ds, alone).units) == 300
    running, most = [0], [0]  # text units are Python-bound: one at a time per process, whatever the threads
    real = scan_module.scan_texts

    def counted(*args):
        running[0] += 1
        most[0] = max(most[0], running[0])
        try:
            return real(*args)
        finally:
            running[0] -= 1

    monkeypatch.setattr(scan_module, "scan_texts", counted)
    single = shard_dataset(ds, alone, workers=2)
    assert most[0] == 1
    assert tree_bytes(tmp_path / "a") == tree_bytes(tmp_path / "b")
    assert grouped.model_dump() == single.model_dump() == load_manifest(tmp_path / "a").model_dump()


def test_unit_bounds(tmp_path):
    from nightloom.sharding.sources import SourceRef

    def ref(i, size):
        return SourceRef(rel=f"{i}", uri=f"/x/{i}", size=size, format="jsonl")

    mib = 1 << 20
    sizes = [1 * mib, 2 * mib, 20 * mib, 3 * mib, 15 * mib, 1 * mib]
    units = plan_module.plan_units([ref(i, s) for i, s in enumerate(sizes)])
    assert units == [[0, 1], [2], [3], [4, 5]]  # a big file alone; never past UNIT_BYTES; order kept
    assert [i for u in units for i in u] == list(range(len(sizes)))


def test_fingerprints_are_cached_per_folder_and_a_rewritten_file_is_seen(tmp_path, monkeypatch):
    """Re-planning an unchanged folder reads no file to fingerprint it; a file rewritten in place with its old
    size and mtime (its ctime moves) and a file changed just before the cache was written are hashed again."""
    monkeypatch.setenv("NIGHTLOOM_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(fingerprint, "RACY_S", 0.0)
    src, _ = _folder(tmp_path)
    hashed: list[str] = []
    real = fingerprint.hash_file
    monkeypatch.setattr(fingerprint, "hash_file", lambda s, *a: hashed.append(s.uri) or real(s, *a))

    def plan():
        hashed.clear()
        return plan_job(DatasetSpec(path=str(src), format="text"), ShardingSpec(output=str(tmp_path / "out")))

    first = plan()
    assert len(hashed) == len(first.sources) > 40
    # the listing's one stat a file is the one the cache checks: no os.stat of any input file on a re-plan
    stats: list[str] = []
    real_stat = os.stat
    inside = str(src) + os.sep
    monkeypatch.setattr(os, "stat", lambda p, *a, **k: stats.append(str(p)) or real_stat(p, *a, **k))
    again = plan()
    assert hashed == [] and again.settings_hash == first.settings_hash
    assert [p for p in stats if p.startswith(inside)] == []
    target = src / "pkg1" / "mod1.txt"
    st = target.stat()
    body = target.read_bytes()
    target.write_bytes(bytes([body[0] ^ 1]) + body[1:])  # same size, then the old mtime back
    os.utime(target, ns=(st.st_atime_ns, st.st_mtime_ns))
    stats.clear()
    changed = plan()
    assert hashed == [str(target)] and changed.settings_hash != first.settings_hash
    assert [p for p in stats if p.startswith(inside)] == []  # the changed file too: hashed with the listing's stat
    # a corrupt cache file is ignored (everything hashed again), never an error
    cache_files = list((tmp_path / "cache" / "fingerprints").iterdir())
    assert len(cache_files) == 1
    for junk in ("{not json", "[1, 2]", '{"version": 1, "root": "%s", "files": [1]}' % src.resolve()):
        cache_files[0].write_text(junk)
        assert plan().settings_hash == changed.settings_hash and len(hashed) == len(first.sources)
    # a file changed within RACY_S of the cache write is not cached: hashed again next time
    monkeypatch.setattr(fingerprint, "RACY_S", 3600.0)
    cache_files[0].unlink()
    plan()
    plan()
    assert len(hashed) == len(first.sources)


def test_a_file_hashed_with_its_listed_size_is_hashed_whole_even_if_it_grew(tmp_path):
    """The fingerprint read is sized by the listing (no fstat); a file that grew since is still hashed to its end,
    and a small one read in several chunks gives the same hash."""
    import xxhash

    p = tmp_path / "a.txt"
    p.write_bytes(b"x" * 1000 + b"tail that came later")
    whole = xxhash.xxh3_128(p.read_bytes()).hexdigest()
    assert fingerprint.xxh3_file(p, size=1000) == fingerprint.xxh3_file(p) == whole
    assert fingerprint.xxh3_file(p, chunk=7, size=3) == whole


def test_a_first_run_reads_each_small_text_file_once_with_the_same_shards(tmp_path, monkeypatch):
    """The plan reads every new small text file to fingerprint it and keeps the bytes for the scan in this
    process (readahead.py): one read a file, the same shards as reading twice, nothing kept after the run."""
    from nightloom import storage
    from nightloom.sharding import readahead

    monkeypatch.setenv("NIGHTLOOM_CACHE", str(tmp_path / "cache"))  # no fingerprint known yet: a first run
    src, _ = _folder(tmp_path)
    inputs = [p for p in src.rglob("*.txt") if not any(part.startswith(".") for part in p.relative_to(src).parts)]
    reads: dict[str, int] = {}

    def counted(fn):
        return lambda p, *a, **k: reads.update({str(p): reads.get(str(p), 0) + 1}) or fn(p, *a, **k)

    monkeypatch.setattr(storage, "read_whole", counted(storage.read_whole))  # the scan's read (and the plan's)
    monkeypatch.setattr(fingerprint, "xxh3_file", counted(fingerprint.xxh3_file))  # the plan's read, when not kept
    settings = {"num_shards": 2, "tolerance": 0.5, "on_error": "skip", "max_bad_fraction": 0.1}
    once = shard_dataset(
        DatasetSpec(path=str(src), format="text"), ShardingSpec(output=str(tmp_path / "a"), **settings)
    )
    assert len(inputs) > 40 and sorted(reads) == sorted(map(str, inputs)) and set(reads.values()) == {1}
    assert readahead.kept_bytes() == 0
    monkeypatch.setattr(readahead, "MAX_FILE", -1)  # nothing kept: the scan reads every file again
    monkeypatch.setenv("NIGHTLOOM_CACHE", str(tmp_path / "cache2"))
    reads.clear()
    twice = shard_dataset(
        DatasetSpec(path=str(src), format="text"), ShardingSpec(output=str(tmp_path / "b"), **settings)
    )
    assert set(reads.values()) == {2}
    assert tree_bytes(tmp_path / "a") == tree_bytes(tmp_path / "b") and once.model_dump() == twice.model_dump()


def test_the_scan_sees_the_bytes_the_plan_fingerprinted(tmp_path, monkeypatch):
    """A file rewritten between plan and scan: the shards hold what its fingerprint (in the settings hash and the
    manifest) was taken of; kept bytes are handed out once, and never for another fingerprint."""
    from nightloom.sharding import readahead
    from nightloom.sharding.pipeline import run_job

    monkeypatch.setenv("NIGHTLOOM_CACHE", str(tmp_path / "cache"))
    src = tmp_path / "src"
    src.mkdir()
    for i, d in enumerate(make_docs(30, seed=3)):
        (src / f"f{i:02d}.txt").write_text(d)
    (src / "f00.txt").write_text("what the plan read")
    job = plan_job(DatasetSpec(path=str(src), format="text"), ShardingSpec(output=str(tmp_path / "out"), num_shards=2))
    (src / "f00.txt").write_text("rewritten after the plan")
    run_job(job)
    texts = [t for shard in shard_texts(tmp_path / "out") for t in shard]
    assert "what the plan read" in texts and "rewritten after the plan" not in texts
    readahead.keep("/x", "xxh3-128:aa", b"data")
    assert readahead.take("/x", "xxh3-128:bb") is None and readahead.take("/x", "xxh3-128:aa") is None
    readahead.keep("/x", "xxh3-128:aa", b"data")
    assert readahead.take("/x", "xxh3-128:aa") == b"data" and readahead.kept_bytes() == 0
