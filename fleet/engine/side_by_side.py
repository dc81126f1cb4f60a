"""Work items run on a few threads at once, each thread's torch on one core, results in
item order: how the vector engine trains its chunks of clients.

Why threads and not torch's own parallelism: a chunk's step is many small operations
(a normalisation over 64 x 32 x 256 values, an Adam update of 64 small heads), which
torch splits over the cores with little gain (one chunk took 50 ms on two cores against
68 ms on one, development machine); two chunks side by side, one per core, keep both
busy. torch releases the GIL inside its operations, so the threads run in parallel.
Every item runs with torch on one core, even when ``threads`` is 1: some of torch's
kernels round differently when they split work over cores (BatchNorm's batch statistics
do), and an item's result must not depend on how many threads ran beside it, nor on how
many cores the machine has.
"""

from __future__ import annotations

import contextlib
from collections import deque
from collections.abc import Callable, Generator, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TypeVar

import torch

T = TypeVar("T")
R = TypeVar("R")


@contextlib.contextmanager
def torch_threads(count: int) -> Iterator[None]:
    """torch's intra-op threads set to ``count`` (process-wide) inside, restored after."""
    before = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def in_order(
    work: Callable[[T], R], items: Iterable[T], *, threads: int
) -> Generator[R, None, None]:
    """``work(item)`` for each item, on ``threads`` threads with torch on one core each,
    yielded in the items' order. At most ``2 * threads`` items are started ahead of the
    one the caller waits for, so a slow consumer holds a bounded number of results.
    ``threads`` <= 1 runs every item here, in order (torch on one core as well). torch's
    setting is process-wide: until the iteration ends, the caller's own torch work between
    results runs on one core too."""
    if threads <= 1:
        with torch_threads(1):
            yield from map(work, items)
        return
    pending: deque[Future[R]] = deque()
    with torch_threads(1), ThreadPoolExecutor(threads, thread_name_prefix="chunk") as pool:
        try:
            for item in items:
                pending.append(pool.submit(work, item))
                if len(pending) >= 2 * threads:
                    yield pending.popleft().result()
            while pending:
                yield pending.popleft().result()
        finally:
            # The caller stopped early or an item failed: start nothing more.
            for future in pending:
                future.cancel()
