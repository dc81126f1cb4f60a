import os
import subprocess
import sys

import pytest

from runtime.runlock import AlreadyRunning, RunLock, holder


def test_a_held_lock_refuses_a_second_taker_naming_the_holder(tmp_path):
    path = tmp_path / "deep" / "run.lock"  # its folder is made
    lock = RunLock.take(path, what="agent state X")
    with pytest.raises(AlreadyRunning) as refused:
        RunLock.take(path, what="agent state X", remedy="try later")
    assert str(refused.value) == (
        f"agent state X is in use by another process (pid {os.getpid()}); try later"
    )
    lock.release()
    lock.release()  # twice is harmless
    # Held for a with block, then released.
    with RunLock.take(path, what="agent state X"), pytest.raises(AlreadyRunning):
        RunLock.take(path, what="agent state X")
    RunLock.take(path, what="agent state X").release()


def test_a_killed_holder_leaves_no_lock_and_a_foreign_file_gives_no_pid(tmp_path):
    path = tmp_path / "run.lock"
    # A holder that dies without releasing: the kernel drops its flock.
    code = (
        "import os, pathlib; from runtime.runlock import RunLock; "
        f"RunLock.take(pathlib.Path({str(path)!r}), what='x'); os._exit(9)"
    )
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 9
    lock = RunLock.take(path, what="x")
    path.write_text("not a pid\n")  # whatever the file says, the flock decides
    with pytest.raises(
        AlreadyRunning, match=r"^x is in use by another process; stop that one first$"
    ):
        RunLock.take(path, what="x")
    lock.release()


def test_the_holder_is_read_from_the_kernels_lock_table(tmp_path):
    path = tmp_path / "run.lock"
    assert holder(path) is None  # no file
    lock = RunLock.take(path, what="x")
    assert holder(path) == os.getpid()
    lock.release()
    assert holder(path) is None  # the file stays, the lock is gone
    # A holder in another pid namespace (a container) is listed without its pid: the
    # file's pid is the answer; a waiter's "->" line holds nothing.
    st = path.stat()
    device = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    table = tmp_path / "locks"
    table.write_text(f"1: -> FLOCK  ADVISORY  WRITE 77 {device} 0 EOF\n")
    assert holder(path, locks=table) is None
    table.write_text(
        f"1: FLOCK  ADVISORY  WRITE 77 00:00:1 0 EOF\n2: FLOCK  ADVISORY  WRITE -1 {device} 0 EOF\n"
    )
    path.write_text("4242\n")
    assert holder(path, locks=table) == 4242
