"""Results of a function over items, in the items' order, with the next few computed ahead in threads.

A shard writer on an S3 work folder reads each scan unit's share by a handful of ranged GETs, and every GET
waits its round trip (tens of ms on S3) whatever its size: one unit after the other, a writer of a 100 GB
corpus (1,600 units) would spend minutes waiting. Reading the next units' shares while this one is written keeps
`ahead` requests in flight. (Not `scan_arrow._prefetched`, which runs one generator a step ahead in one thread, nor
`readahead.py`, the plan's small files kept for the scan.)
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TypeVar

T = TypeVar("T")
R = TypeVar("R")


def ordered_ahead(
    items: Iterable[T],
    fetch: Callable[[T], R],
    stream: Callable[[T], R],
    ahead: int,
    eager: Callable[[T], bool] = lambda _: True,
) -> Iterator[R]:
    """For every item in order: fetch(item), run up to `ahead` items before it is asked for, in threads. An item
    `eager` refuses (its result would be too big to hold) gets stream(item) instead, made in the caller's thread
    when its turn comes (meant to be consumed lazily), and nothing after it starts until the caller asks for the
    next result. With `ahead` ≤ 1 every item is streamed. An error is raised when its item's turn comes; work not
    started yet is cancelled when the caller stops early or fails."""
    if ahead <= 1:
        for item in items:
            yield stream(item)
        return
    pool = ThreadPoolExecutor(ahead, thread_name_prefix="nightloom-read-ahead")
    queue: deque[tuple[T, Future | None]] = deque()
    it = iter(items)
    blocked = False  # a streamed item is queued: nothing after it starts before it is consumed

    def fill() -> None:
        nonlocal blocked
        while not blocked and len(queue) < ahead:
            item = next(it, _END)
            if item is _END:
                return
            if eager(item):
                queue.append((item, pool.submit(fetch, item)))
            else:
                queue.append((item, None))
                blocked = True

    try:
        fill()
        while queue:
            item, future = queue.popleft()
            if future is None:
                blocked = False
                yield stream(item)  # consumed before the next items start
                fill()
            else:
                result = future.result()
                fill()  # the freed place is taken while the caller consumes this result
                yield result
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


_END = object()
