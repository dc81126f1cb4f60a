"""fleet.engine.side_by_side: work items on threads, results in item order, torch on one core
per thread and restored after."""

import threading

import pytest
import torch

from fleet.engine.side_by_side import in_order

WAIT = 10.0  # seconds: a bound on an event that comes at once unless something is wrong


def test_items_run_at_once_and_come_back_in_their_order() -> None:
    """Item 0 finishes only after item 1 has: one thread at a time would wait forever
    (bounded here), and the results still come back 0, 1, 2, 3."""
    one_done = threading.Event()
    seen_threads: list[int] = []

    def work(item: int) -> tuple[int, int]:
        seen_threads.append(torch.get_num_threads())
        if item == 0:
            assert one_done.wait(WAIT), "item 1 never ran beside item 0"
        if item == 1:
            one_done.set()
        return item, threading.get_ident()

    before = torch.get_num_threads()
    out = list(in_order(work, range(4), threads=2))
    assert [item for item, _ in out] == [0, 1, 2, 3]
    assert len({ident for _, ident in out}) == 2
    assert threading.get_ident() not in {ident for _, ident in out}
    assert seen_threads == [1, 1, 1, 1]
    assert torch.get_num_threads() == before


def test_one_thread_runs_here_with_torch_on_one_core_too() -> None:
    """An item's arithmetic must not depend on the thread count: one core either way."""
    before = torch.get_num_threads()
    out = list(in_order(lambda i: (i, threading.get_ident(), torch.get_num_threads()),
                        range(3), threads=1))  # fmt: skip
    assert out == [(i, threading.get_ident(), 1) for i in range(3)]
    assert torch.get_num_threads() == before


def test_a_failing_item_reaches_the_caller_and_torch_is_restored() -> None:
    before = torch.get_num_threads()

    def work(item: int) -> int:
        if item == 2:
            raise ValueError("item 2 failed")
        return item

    got: list[int] = []
    with pytest.raises(ValueError, match="item 2 failed"):
        for result in in_order(work, range(6), threads=2):
            got.append(result)
    assert got == [0, 1]
    assert torch.get_num_threads() == before


def test_a_caller_that_stops_early_starts_no_more_than_its_window() -> None:
    started: list[int] = []
    lock = threading.Lock()

    def work(item: int) -> int:
        with lock:
            started.append(item)
        return item

    before = torch.get_num_threads()
    results = in_order(work, range(100), threads=2)
    assert next(results) == 0
    results.close()
    assert 1 <= len(started) <= 4  # the window: 2 x 2 items submitted, none after
    assert torch.get_num_threads() == before
