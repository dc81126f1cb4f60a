"""``edge-coordinator``: the ProtoFleet aggregation service."""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from protocol.cliutil import make_parser, run


def build_parser() -> argparse.ArgumentParser:
    parser = make_parser(
        "edge-coordinator",
        "Run federated rounds: announce global prototypes, collect device updates over\n"
        "MQTT, aggregate them with the fleet's strategy and keep durable state in SQLite.",
    )
    parser.add_subparsers(dest="command", metavar="COMMAND")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    return run(build_parser(), argv, handlers={})
