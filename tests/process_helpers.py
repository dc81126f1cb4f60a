"""A console-script process whose log lines (stderr) can be waited on."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

BIN = Path(sys.executable).parent


class LoggedProcess:
    """``BIN/<script> *args``; stderr lines are collected for :meth:`wait_for`."""

    def __init__(
        self,
        script: str,
        args: Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        new_session: bool = False,
    ) -> None:
        # new_session: the process leads a process group of its own, as a terminal's
        # foreground job does, so a test can signal the group the way Ctrl-C does.
        # A foreground job also takes SIGINT by default even when the test runner was
        # started in the background (where the shell sets it to ignored, and children
        # inherit that).
        self.proc = subprocess.Popen(
            [str(BIN / script), *args],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, **(env or {})},
            start_new_session=new_session,
            preexec_fn=_take_sigint if new_session else None,
        )
        self.lines: list[str] = []
        self._eof = False
        self._cond = threading.Condition()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            with self._cond:
                self.lines.append(line)
                self._cond.notify_all()
        with self._cond:  # stderr closed: the process is gone, no line will come
            self._eof = True
            self._cond.notify_all()

    def wait_for(self, text: str, *, after: int = 0, timeout: float = 60.0) -> int:
        """Block until a line after index ``after`` contains ``text``; the new line count."""
        with self._cond:

            def seen() -> bool:
                return any(text in line for line in self.lines[after:])

            self._cond.wait_for(lambda: seen() or self._eof, timeout=timeout)
            if not seen():
                why = "the process closed stderr" if self._eof else f"none in {timeout} s"
                raise TimeoutError(
                    f"no log line {text!r} ({why}); got:\n{''.join(self.lines[-20:])}"
                )
            return len(self.lines)

    def signal(self, signum: int) -> None:
        self.proc.send_signal(signum)

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=10)

    def stop(self) -> int:
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout=60)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.kill()


def agent_process(config: Path, *, env: Mapping[str, str] | None = None) -> LoggedProcess:
    return LoggedProcess("edge-agent", ["run", "--config", str(config)], env=env)


def coordinator_process(config: Path, *, env: Mapping[str, str] | None = None) -> LoggedProcess:
    return LoggedProcess("edge-coordinator", ["run", "--config", str(config)], env=env)


def status(script: str, config: Path) -> dict[str, Any]:
    """The JSON of ``<script> status --config config``."""
    shown = subprocess.run(
        [str(BIN / script), "status", "--config", str(config)],
        capture_output=True, text=True, timeout=120, check=True,
    )  # fmt: skip
    return dict(json.loads(shown.stdout))


def _take_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def group_members(group: int) -> dict[int, str]:
    """pid -> command line of the live (not zombie) processes of a process group."""
    members = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue  # exited while we looked
        state, _ppid, pgrp = stat.rsplit(")", 1)[1].split()[:3]
        if int(pgrp) == group and state != "Z":
            members[int(entry.name)] = cmdline
    return members
