"""Placement's per-document flags, one bit each: the same answers as a bool array, at an eighth of its size."""

from __future__ import annotations

import numpy as np
import pytest

from nightloom.sharding.docflags import DocFlags


def test_flags_agree_with_a_bool_array_across_byte_boundaries():
    rng = np.random.default_rng(3)
    n = 1237  # not a multiple of 8: the last byte is partly padding
    ref = np.zeros(n, dtype=bool)
    flags = DocFlags(n)
    for _ in range(20):
        idx = rng.integers(0, n, rng.integers(0, 40))
        ref[idx] = True
        flags.set(np.concatenate([idx, idx[:3]]))  # repeats, any order
    assert flags.count() == int(ref.sum()) and flags.any() == bool(ref.any())
    for start, count in [(0, n), (1, 7), (7, 9), (8, 8), (13, 300), (n - 5, 5), (n, 0), (600, 0)]:
        assert np.array_equal(flags.get(start, count), ref[start : start + count]), (start, count)
    assert flags.bits.nbytes == (n + 7) // 8


def test_from_bools_round_trips_and_counts_every_chunk(monkeypatch):
    monkeypatch.setattr("nightloom.sharding.docflags.CHUNK_BYTES", 5)  # count() over several chunks
    mask = np.random.default_rng(4).random(203) < 0.3
    flags = DocFlags.from_bools(mask)
    assert np.array_equal(flags.get(0, 203), mask) and flags.count() == int(mask.sum())
    assert not DocFlags(64).any() and DocFlags(0).count() == 0


def test_out_of_range_is_an_error_not_a_silent_write():
    flags = DocFlags(10)
    with pytest.raises(IndexError, match="0…9"):
        flags.set(np.array([3, 10]))
    with pytest.raises(IndexError):
        flags.set(np.array([-1]))
    with pytest.raises(IndexError):
        flags.get(5, 6)
    assert flags.count() == 0
