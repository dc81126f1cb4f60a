"""``edge-agent``: the on-device ProtoFleet agent."""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from protocol.cliutil import make_parser, run


def build_parser() -> argparse.ArgumentParser:
    parser = make_parser(
        "edge-agent",
        "Train a projection head on private data on this device and publish class\n"
        "prototypes to a ProtoFleet coordinator over MQTT. Raw data and weights never\n"
        "leave the device.",
    )
    parser.add_subparsers(dest="command", metavar="COMMAND")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    return run(build_parser(), argv, handlers={})
