"""onnxruntime's own messages, routed into the project's log.

onnxruntime's Python layer prints a provider's failure and its fallback ("EP Error ...
Falling back to ['CPUExecutionProvider'] and retrying.") to stdout with ``print``, and
its C++ logger writes to stderr. A command whose stdout is JSON (``edge-export bench
--json``, ``edge-agent doctor``) then no longer parses. Every session this project opens
is opened (and first run) inside :func:`captured`, which holds file descriptors 1 and 2
and ``sys.stdout`` for that while and hands what arrived to a logger, line by line.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import sys
import tempfile
import threading
from collections.abc import Iterator

#: File descriptors are the process's: two threads taking them at once would each restore
#: the other's sink, and stdout would stay in a deleted file. Reentrant for nesting.
_HELD = threading.RLock()


@contextlib.contextmanager
def captured(logger: logging.Logger) -> Iterator[None]:
    """Whatever onnxruntime writes inside the block goes to ``logger`` at WARNING.

    Nothing of ours may log inside the block: a handler writing to stderr would have its
    line captured and logged a second time."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    python_out = io.StringIO()
    with _HELD, tempfile.TemporaryFile() as sink:
        saved: list[tuple[int, int]] = []
        try:
            for fd in (1, 2):
                with contextlib.suppress(OSError):  # no such descriptor (a daemon's closed stdout)
                    saved.append((fd, os.dup(fd)))
                    os.dup2(sink.fileno(), fd)
            with contextlib.redirect_stdout(python_out):
                yield
        finally:
            for fd, copy in saved:
                os.dup2(copy, fd)
                os.close(copy)
            sink.seek(0)
            text = python_out.getvalue() + sink.read().decode(errors="replace")
            for line in text.splitlines():
                line = line.strip(" *\t")
                if line:
                    logger.warning("onnxruntime: %s", line)
