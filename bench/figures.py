"""The figures of README.md and docs/, generated from the committed results files.

A generated block in a Markdown file sits between ``<!-- figures:NAME -->`` and
``<!-- /figures:NAME -->``; :data:`BLOCKS` holds one generator per NAME, reading
bench/results.json (``make bench``) and bench/accuracy.json (``make bench-accuracy``).
``make figures`` rewrites every block; ``--check`` only says which differ (a test runs
it). A figure whose section was not measured in the file's run says so: nothing is
carried over from older runs or typed by hand.

The blocks are written by :mod:`bench.accuracy_figures` and
:mod:`bench.performance_figures`; this module is the one place a block is named, and the
machinery that finds and rewrites the blocks.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Callable

from bench import accuracy_figures as accuracy
from bench import performance_figures as performance
from bench import secure_figures as secure
from bench.figure_results import HERE, SOURCES, Results

__all__ = ["BLOCK", "BLOCKS", "FILES", "SOURCES", "Results", "main", "render"]

ROOT = HERE.parent
FILES = tuple(
    ROOT / name
    for name in (
        "README.md",
        "docs/fleet.md",
        "docs/privacy.md",
        "docs/coordinator.md",
        "docs/deploy.md",
        "docs/export.md",
        "docs/scale.md",
    )
)
BLOCK = re.compile(
    r"(<!-- figures:(?P<name>[\w-]+) -->\n)(?P<body>.*?)(<!-- /figures:(?P=name) -->)", re.S
)

BLOCKS: dict[str, Callable[[Results], str]] = {
    "effnet-fleet": performance.effnet_fleet,
    "effnet-export": performance.effnet_export,
    "reliability": performance.reliability,
    "restart": performance.restart,
    "database": performance.database,
    "compromised": performance.compromised,
    "lda-attacks": performance.lda_attacks,
    "privacy": performance.privacy,
    "secure-aggregation": secure.secure_aggregation,
    "secure-cost": secure.secure_cost,
    "secure-scale": secure.secure_scale,
    "secure-memory": secure.secure_memory,
    "secure-broker": secure.secure_broker,
    "secure-rule": secure.secure_rule,
    "fair-table": accuracy.protocol_table("fair"),
    "paper-table": accuracy.protocol_table("paper"),
    "glyphs-table": accuracy.glyphs_table,
    "targets": accuracy.targets,
    "closed-form-targets": accuracy.closed_form_targets,
    "closed-form": accuracy.closed_form,
    "closed-form-privacy": accuracy.closed_form_privacy,
    "demo": accuracy.demo,
    "comparison": accuracy.comparison,
    "bench-table": performance.bench_table,
    "traffic": performance.traffic,
    "scale": performance.scale,
}


def render(text: str, results: Results) -> str:
    """``text`` with every marked block regenerated; an unknown block name is an error."""

    def fill(match: re.Match[str]) -> str:
        name = match["name"]
        if name not in BLOCKS:
            raise KeyError(f"no generator for the block figures:{name}")
        return f"{match[1]}{BLOCKS[name](results)}\n{match[4]}"

    return BLOCK.sub(fill, text)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true",
                        help="rewrite nothing; exit 1 naming the files whose blocks differ")  # fmt: skip
    args = parser.parse_args(argv)
    results = Results.load()
    stale = []
    for path in FILES:
        text = path.read_text()
        new = render(text, results)
        if new != text:
            stale.append(path)
            if not args.check:
                path.write_text(new)
    for path in stale:
        print(f"{'stale' if args.check else 'rewritten'}: {path.relative_to(ROOT)}")
    return 1 if args.check and stale else 0


if __name__ == "__main__":  # python -m bench.figures (make figures), from the repository
    sys.exit(main())
