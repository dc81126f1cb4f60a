"""``edge-export``: build, verify and benchmark ONNX backbone bundles."""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from protocol.cliutil import make_parser, run


def build_parser() -> argparse.ArgumentParser:
    parser = make_parser(
        "edge-export",
        "Export frozen backbones to ONNX bundles for ProtoFleet agents.",
        epilog="A bundle is a directory of ONNX files plus a bundle.json manifest; its\n"
        "bundle id travels in every prototype message.",
    )
    parser.add_subparsers(dest="command", metavar="COMMAND")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    return run(build_parser(), argv, handlers={})
