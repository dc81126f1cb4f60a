"""runtime.lifecycle: stop signals reach a service however the kernel delivers them."""

from __future__ import annotations

import linecache
import signal
import sys
import threading
import time

from runtime.lifecycle import SignalDispatch, serve
from runtime.sdnotify import Notifier


class _Waiting:
    """A service whose main-thread ``run`` blocks until stopped, as the agent's does
    between round announcements; it has a second thread, as paho's network thread is."""

    def __init__(self) -> None:
        self.stopped = threading.Event()
        self.rescued = False

    def run(self) -> None:
        # Started from run(): serve's handlers are installed by now.
        threading.Thread(target=self._take_sigterm_here).start()
        self.stopped.wait()  # the agent's main thread waits on a lock, no timeout

    def _take_sigterm_here(self) -> None:
        _until_main_blocks_in_a_lock()
        # A thread-directed SIGTERM: this thread takes it, not the main thread, which is
        # what the kernel may do with `kill` when another thread is running.
        signal.pthread_kill(threading.get_ident(), signal.SIGTERM)
        if not self.stopped.wait(10):  # the main thread never ran the handler
            self.rescued = True
            self.stop()

    def stop(self) -> None:
        self.stopped.set()

    def healthy(self) -> bool:
        return True


def _until_main_blocks_in_a_lock(timeout: float = 10.0) -> None:
    """Until the main thread sits in ``Condition.wait``'s ``waiter.acquire(...)``: while
    this thread holds the GIL, that means blocked on the lock, where no signal handler
    runs until the lock or the wait's timeout wakes it."""
    main = threading.main_thread().ident or 0
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        frame = sys._current_frames().get(main)
        if frame is not None and frame.f_code.co_name == "wait":
            line = linecache.getline(frame.f_code.co_filename, frame.f_lineno)
            if "waiter.acquire(" in line:
                return
        time.sleep(0.001)  # hand the GIL to the main thread so it gets there
    raise TimeoutError("the main thread never blocked")


def test_a_sigterm_taken_by_another_thread_still_stops_the_service() -> None:
    service = _Waiting()
    before = signal.getsignal(signal.SIGTERM)
    serve(
        name="test-service",
        load=lambda: None,
        make=lambda cfg: service,
        notifier=Notifier(env={}),
    )
    # With a Python signal handler doing the stop, the main thread would sit in its wait
    # until the helper thread's 10 s rescue: the flagged handler never gets to run.
    assert service.stopped.is_set() and not service.rescued
    assert signal.getsignal(signal.SIGTERM) is before  # serve restored the handler


def test_signals_run_their_action_in_the_dispatch_thread_and_handlers_come_back() -> None:
    taken: list[tuple[int, str]] = []
    done = threading.Event()

    def action(signum: int) -> None:
        taken.append((signum, threading.current_thread().name))
        done.set()

    handler_before = signal.getsignal(signal.SIGUSR1)
    fd_before = signal.set_wakeup_fd(-1)  # reading it means replacing it: put it back
    signal.set_wakeup_fd(fd_before)
    with SignalDispatch({signal.SIGUSR1: action}):
        signal.raise_signal(signal.SIGUSR1)
        assert done.wait(10)
    assert taken == [(signal.SIGUSR1, "signals")]
    assert signal.getsignal(signal.SIGUSR1) == handler_before
    assert signal.set_wakeup_fd(fd_before) == fd_before  # the previous wakeup fd is back
