import os
import subprocess
import sys

import pytest

from protocol.runlock import AlreadyRunning, RunLock


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
    RunLock.take(path, what="agent state X").release()


def test_a_killed_holder_leaves_no_lock_and_a_foreign_file_gives_no_pid(tmp_path):
    path = tmp_path / "run.lock"
    # A holder that dies without releasing: the kernel drops its flock.
    code = (
        "import os, pathlib; from protocol.runlock import RunLock; "
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
