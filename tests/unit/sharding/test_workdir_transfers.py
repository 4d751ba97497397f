"""An S3 work folder moves many files at once: placement fetches one meta file per scan unit, and one at a time a
corpus of thousands of units waited a round trip each. No S3 here: the transfers are replaced, the logic is real."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from nightloom import storage
from nightloom.sharding.workdir import WorkDir


def test_fetch_downloads_the_missing_files_side_by_side_and_keeps_cached_ones(tmp_path, monkeypatch):
    monkeypatch.setenv("NIGHTLOOM_SHARD_CACHE", str(tmp_path / "cache"))
    wd = WorkDir("s3://bucket/work/abc")
    wd.local.mkdir(parents=True)
    (wd.local / "meta-00001.bin").write_bytes(b"cached")
    barrier = threading.Barrier(3, timeout=20)  # only passed if three downloads run at once
    got: list[str] = []

    def fake_get(uri: str, local: Path, s3=None) -> Path:
        got.append(uri)
        barrier.wait()
        local.write_bytes(uri.encode())
        return local

    monkeypatch.setattr(storage, "get_file", fake_get)
    wd.fetch("meta-00000.bin", "meta-00001.bin", "meta-00002.bin", "meta-00003.bin")
    assert sorted(got) == [f"s3://bucket/work/abc/meta-0000{i}.bin" for i in (0, 2, 3)]
    assert (wd.local / "meta-00001.bin").read_bytes() == b"cached"
    assert (wd.local / "meta-00003.bin").read_bytes() == b"s3://bucket/work/abc/meta-00003.bin"


def test_a_failed_transfer_is_raised(tmp_path, monkeypatch):
    monkeypatch.setenv("NIGHTLOOM_SHARD_CACHE", str(tmp_path / "cache"))
    wd = WorkDir("s3://bucket/work/abc")

    def fake_upload(local, uri, s3=None) -> None:
        if uri.endswith("b.bin"):
            raise storage.StorageError(f"{uri}: access denied")

    monkeypatch.setattr(storage, "upload_file", fake_upload)
    with pytest.raises(storage.StorageError, match="b.bin: access denied"):
        wd.publish("a.bin", "b.bin", "c.bin")
