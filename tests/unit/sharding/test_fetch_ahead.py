"""The writers' read-ahead: results in order, several items in flight, big items streamed alone, errors in turn."""

from __future__ import annotations

import threading

import pytest

from nightloom.sharding.fetch_ahead import ordered_ahead


def test_results_come_in_order_with_items_running_side_by_side():
    """Three fetches wait for each other at a barrier: they only get past it if they run at once."""
    barrier = threading.Barrier(3, timeout=20)

    def fetch(i: int) -> int:
        if i < 3:
            barrier.wait()  # BrokenBarrierError (after the timeout) if the items ran one by one
        return i * i

    assert list(ordered_ahead(range(6), fetch, lambda i: -i, ahead=3)) == [0, 1, 4, 9, 16, 25]


def test_a_refused_item_is_streamed_in_turn_and_nothing_after_it_starts_first():
    started: list[int] = []
    lock = threading.Lock()

    def fetch(i: int) -> str:
        with lock:
            started.append(i)
        return f"fetched {i}"

    def stream(i: int) -> str:
        with lock:  # every item before it is done, none after it has started
            assert started == [j for j in range(i) if j != 2], started
        return f"streamed {i}"

    out = list(ordered_ahead(range(5), fetch, stream, ahead=4, eager=lambda i: i != 2))
    assert out == ["fetched 0", "fetched 1", "streamed 2", "fetched 3", "fetched 4"]
    assert sorted(started) == [0, 1, 3, 4]


def test_ahead_of_one_streams_everything_in_the_callers_thread():
    caller = threading.get_ident()
    assert list(ordered_ahead("ab", lambda x: None, lambda x: (x, threading.get_ident() == caller), 1)) == [
        ("a", True),
        ("b", True),
    ]


def test_an_error_is_raised_in_its_turn_and_later_work_is_not_started():
    ran: list[int] = []

    def fetch(i: int) -> int:
        ran.append(i)
        if i == 1:
            raise ValueError("item 1 is bad")
        return i

    gen = ordered_ahead(range(50), fetch, lambda i: i, ahead=2)
    assert next(gen) == 0
    with pytest.raises(ValueError, match="item 1 is bad"):
        next(gen)
    assert max(ran) <= 2, ran  # at most the two in flight and the one started when item 0 was taken
