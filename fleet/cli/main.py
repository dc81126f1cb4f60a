"""``edge-fleet``: run and compare simulated ProtoFleet fleets on one machine."""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from fleet.cli import commands, parsers, privacy
from fleet.data import glyphs
from runtime.cliutil import make_parser, run


def build_parser() -> argparse.ArgumentParser:
    parser = make_parser(
        "edge-fleet",
        "Simulate a whole ProtoFleet fleet (broker, coordinator, agents) on one machine:\n"
        "`run` one method, `compare` methods x seeds on the same partitions, `demo` the\n"
        "feature-shift comparison `make demo` shows. Reports: report.json, report.md, PNGs.\n"
        "`glyphs` writes a second benchmark data set (rendered Greek letters) for --data.",
    )
    # Hundreds of agents log a few lines per round each: warnings only unless asked.
    parser.set_defaults(log_level="WARNING")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    parsers.add_parsers(sub)
    privacy.add_parser(sub)
    glyphs.add_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    return run(
        build_parser(),
        argv,
        handlers={
            "run": commands.cmd_run,
            "compare": commands.cmd_compare,
            "demo": commands.cmd_demo,
            "privacy": privacy.main,
            "glyphs": glyphs.main,
        },
    )
