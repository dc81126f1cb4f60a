"""Conventions shared by the four console scripts.

It lives here because ``protocol`` is the one package every entry point already imports.
A user mistake is reported as one ``error:`` line and exit status 2, never a traceback;
Ctrl-C exits with 130. Only entry points configure logging.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable, Sequence

from protocol.version import package_version


class UsageError(Exception):
    """A mistake in what the user asked for: bad path, bad option value, missing file."""


def make_parser(prog: str, description: str, epilog: str | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog,
        description=description,
        epilog=epilog,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {package_version()}")
    parser.add_argument(
        "--log-level",
        default="INFO",
        choices=["DEBUG", "INFO", "WARNING", "ERROR"],
        help="verbosity of log lines on stderr (default: INFO)",
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
    logging.basicConfig(
        level=getattr(logging, args.log_level),
        format="%(asctime)s %(levelname)s %(name)s %(message)s",
        stream=sys.stderr,
    )
    command = getattr(args, "command", None)
    if command is None:
        parser.print_help()
        return 2
    try:
        return handlers[command](args)
    except UsageError as exc:
        print(f"{parser.prog}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{parser.prog}: interrupted", file=sys.stderr)
        return 130
