"""``edge-fleet``: run and compare simulated ProtoFleet fleets on one machine."""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from fleet import demo
from protocol.cliutil import make_parser, run


def build_parser() -> argparse.ArgumentParser:
    parser = make_parser(
        "edge-fleet",
        "Simulate a whole ProtoFleet fleet (broker, coordinator, agents) on one machine.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    demo.add_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    return run(build_parser(), argv, handlers={"demo": demo.main})
