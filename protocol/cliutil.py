"""Conventions shared by the four console scripts.

It lives here because ``protocol`` is the one package every entry point already imports.
A user mistake is reported as one ``error:`` line and exit status 2, never a traceback;
Ctrl-C exits with 130. Only entry points configure logging.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Callable, Sequence

from protocol.settings import ConfigError
from protocol.version import package_version


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
    A bad configuration file (:class:`~protocol.settings.ConfigError`) is reported the same way."""


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


def run(
    parser: argparse.ArgumentParser,
    argv: Sequence[str] | None,
    *,
    handlers: dict[str, Callable[[argparse.Namespace], int]],
) -> int:
    """Parse ``argv``, dispatch on the ``command`` attribute, and map errors to exit codes."""
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
        return handlers[command](args)
    except (UsageError, ConfigError) as exc:
        print(f"{parser.prog}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{parser.prog}: interrupted", file=sys.stderr)
        return 130
