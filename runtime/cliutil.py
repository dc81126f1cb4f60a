"""Conventions shared by the four console scripts.

It lives in ``runtime`` beside the other conventions every service and command shares.
A user mistake is reported as one ``error:`` line and exit status 2, never a traceback; a
failure at run time that the command could only report (a process it started died, a
broker would not start, a file could not be written) as one ``error:`` line and exit
status 1, so a script can tell "fix the command" from "look at the logs and retry". Ctrl-C exits with 130 and SIGTERM
with 143, both after the ``finally`` blocks have stopped whatever the command started.
Only entry points configure logging.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path

from runtime.example_config import render as render_example
from runtime.settings import ConfigError
from runtime.version import package_version


class JsonFormatter(logging.Formatter):
    """One JSON object per record: time, level, logger, message, and any ``extra`` fields."""

    _STANDARD = frozenset(vars(logging.makeLogRecord({})))

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, object] = {
            "time": self.formatTime(record, "%Y-%m-%dT%H:%M:%S"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        for key, value in vars(record).items():
            if key not in self._STANDARD and key not in entry:
                entry[key] = (
                    value if isinstance(value, (int, float, str, bool, type(None))) else str(value)
                )
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry)


class UsageError(Exception):
    """A mistake in what the user asked for: bad path, bad option value, missing file.
    A bad configuration file (:class:`~runtime.settings.ConfigError`) is reported the same way."""


class CommandFailed(Exception):
    """The command was well formed but something it ran failed: a child process exited,
    a broker did not start. The message says where to look (a log file)."""


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised in the main thread like Ctrl-C's KeyboardInterrupt.

    Why: Python's default SIGTERM action ends the process on the spot, skipping every
    ``finally``; a command that started processes (a fleet's broker, coordinator and
    workers) would leave them running when stopped by ``kill``, ``timeout`` or a CI job's
    cancellation. Services that handle SIGTERM themselves (runtime.lifecycle) install
    their own handler while they run.
    """


def _raise_terminated(signum: int, frame: object) -> None:
    # One is enough: a second SIGTERM must not cut the clean-up the first one started.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    raise Terminated


@contextmanager
def _terminate_like_ctrl_c() -> Iterator[None]:
    """Route SIGTERM to :class:`Terminated` while the command runs, unless the process was
    told to ignore it or this is not the main thread (where Python allows no handlers)."""
    if (
        threading.current_thread() is not threading.main_thread()
        or signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL
    ):
        yield
        return
    signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


def make_parser(prog: str, description: str, epilog: str | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog,
        description=description,
        epilog=epilog,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {package_version()}")
    parser.add_argument(
        "--log-format",
        default="text",
        choices=["text", "json"],
        help="log lines as text or one JSON object per line (for journald/Loki; default: text)",
    )
    parser.add_argument(
        "--log-level",
        default="INFO",
        choices=["DEBUG", "INFO", "WARNING", "ERROR"],
        help="verbosity of log lines on stderr (default: %(default)s)",
    )
    return parser


def add_example_config(
    sub: argparse._SubParsersAction,
    *,
    prog: str,
    example: Path,
    config: type,
) -> None:
    """The ``example-config`` command (handled by :func:`print_example_config`): every key
    of the ``config`` dataclass with its default, commented by the example shipped inside
    the package (so a device installed from a wheel has it too)."""
    p = sub.add_parser(
        "example-config",
        help="print a configuration file with every key, its default and what it does",
        description=f"Prints the commented example configuration; start from it with\n"
        f"  {prog} example-config > {example.name}",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.set_defaults(example=example, config=config)


def print_example_config(args: argparse.Namespace) -> int:
    notes = args.example.read_text(encoding="utf-8")
    sys.stdout.write(render_example(args.config, notes))
    return 0


def check_output_folder(path: Path, *, option: str) -> None:
    """Raise a usage error now if ``path`` cannot become a folder to write in, rather than
    fail minutes into the work that would fill it."""
    if path.exists() and not path.is_dir():
        raise UsageError(f"{option} {path} exists and is not a folder")
    nearest = next(p for p in (path, *path.absolute().parents) if p.exists())
    if not nearest.is_dir():
        raise UsageError(f"{option} {path}: {nearest} is not a folder")
    if not os.access(nearest, os.W_OK | os.X_OK):
        raise UsageError(f"{option} {path}: no permission to write in {nearest}")


def run(
    parser: argparse.ArgumentParser,
    argv: Sequence[str] | None,
    *,
    handlers: Mapping[str, Callable[[argparse.Namespace], int]],
) -> int:
    """Parse ``argv``, dispatch on the ``command`` attribute, and map errors to exit codes."""
    try:
        try:
            return _dispatch(parser, argv, handlers=handlers)
        finally:
            # Flushed here rather than at exit, where a closed pipe can only be reported
            # as "Exception ignored" and status 120.
            sys.stdout.flush()
    except BrokenPipeError:
        # The reader went away (`edge-coordinator status | head`): stop quietly, as a
        # shell tool killed by SIGPIPE would, and send what is still buffered nowhere.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 128 + signal.SIGPIPE


def _dispatch(
    parser: argparse.ArgumentParser,
    argv: Sequence[str] | None,
    *,
    handlers: Mapping[str, Callable[[argparse.Namespace], int]],
) -> int:
    args = parser.parse_args(argv)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(
        JsonFormatter()
        if args.log_format == "json"
        else logging.Formatter("%(asctime)s %(levelname)s %(name)s %(message)s")
    )
    logging.basicConfig(level=getattr(logging, args.log_level), handlers=[handler], force=True)
    command = getattr(args, "command", None)
    if command is None:
        parser.print_help()
        return 2
    try:
        with _terminate_like_ctrl_c():
            return handlers[command](args)
    except (UsageError, ConfigError) as exc:
        print(f"{parser.prog}: error: {exc}", file=sys.stderr)
        return 2
    except CommandFailed as exc:
        print(f"{parser.prog}: error: {exc}", file=sys.stderr)
        return 1
    except OSError as exc:
        if exc.filename is None:
            raise  # not about a file the user named or the command wrote: a bug to see whole
        # A disk that filled up, a folder without write permission: the user can act on
        # the path and the reason; the traceback is kept for --log-level DEBUG.
        logging.getLogger(__name__).debug("file error", exc_info=True)
        print(f"{parser.prog}: error: {exc.filename}: {exc.strerror or exc}", file=sys.stderr)
        return 1
    except Terminated:
        print(f"{parser.prog}: terminated", file=sys.stderr)
        return 128 + signal.SIGTERM
    except KeyboardInterrupt:
        print(f"{parser.prog}: interrupted", file=sys.stderr)
        return 130
