"""Run the project's benchmarks and write what this run measured (``make bench``).

A *section* is a module with ``run() -> dict[str, float]``, whose keys are the flat names
the docs and issues refer to (e.g. ``protocol.update_f16_bytes``). A *suite* is a list of
sections with its own results file:

- ``perf`` (default, ``make bench``): bench/results.json;
- ``accuracy`` (``make bench-accuracy``, hours): bench/accuracy.json, the comparison
  tables of docs/fleet.md;
- ``closed-form`` (``make bench-closed-form``, about an hour): bench/closed_form.json, the
  closed-form methods against k, epsilon and fleet size (docs/fleet.md, docs/privacy.md).

The results file holds only the sections measured in this run, each with its date,
commit and machine (cores, CPU model): a section that failed is absent, never carried
over from an earlier file. A section that cannot measure on this machine (an optional
extra missing) raises :class:`Skipped`, and is recorded with its reason and no figures.
Generated blocks in README.md and docs/ are rewritten from the committed results files
by ``make figures`` (bench/figures.py).
A new section slots in by adding its module to a suite.
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import json
import os
import platform
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from export.bench import cpu_model

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent

SUITES: dict[str, list[str]] = {
    "perf": [
        "bench.protocol_bench",
        "bench.coordinator_bench",
        "bench.export_bench",
        "bench.agent_bench",
        "bench.fleet_bench",
        "bench.vector_bench",
        "bench.peer_bench",
        "bench.mqtt_fleet_bench",
        "bench.privacy_bench",
        "bench.secagg_bench",
        "bench.secagg_cost_bench",
        "bench.secagg_scale_bench",
        "bench.projection_rule_bench",
        "bench.secagg_fleet_bench",
        "bench.effnet_bench",
        "bench.effnet_fleet_bench",
        "bench.reliability_bench",
        "bench.intake_bench",
        "bench.compromised_bench",
        "bench.closed_form_attack_bench",
        "bench.restart_bench",
        "bench.durability_bench",
        "bench.power_cut_bench",
        "bench.fault_matrix_bench",
    ],
    "accuracy": ["bench.accuracy_bench"],
    "closed-form": ["bench.closed_form_bench"],
}
RESULTS = {
    "perf": HERE / "results.json",
    "accuracy": HERE / "accuracy.json",
    "closed-form": HERE / "closed_form.json",
}
FORMAT = 2


class Skipped(Exception):
    """A section's ``run()`` could not measure here (the reason is the message): the
    results file says so, with no figures, rather than leave the section out unexplained
    or fill it from an earlier run."""


def machine() -> dict[str, Any]:
    return {
        "cores": os.cpu_count(),
        "cpu": cpu_model(),
        "system": f"{platform.system()} {platform.release()}",
        "python": platform.python_version(),
    }


def commit() -> str:
    """The checked-out commit, with ``+changes`` when the work tree differs from it: the
    figures then come from code no commit holds. The results files themselves do not
    count: a run rewrites them, and the one before left them changed."""

    def git(*argv: str) -> str:
        return subprocess.run(
            ["git", *argv], cwd=ROOT, capture_output=True, text=True, check=True
        ).stdout.strip()

    try:
        head = git("rev-parse", "--short=12", "HEAD")
        outputs = [f":(exclude){p.relative_to(ROOT)}" for p in RESULTS.values()]
        dirty = git("status", "--porcelain", "--untracked-files=no", "--", ".", *outputs)
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head + ("+changes" if dirty else "")


def measure(
    names: list[str], *, load: Callable[[str], Any] = importlib.import_module
) -> tuple[dict[str, Any], list[str]]:
    """Run each section; (sections measured, names that failed). A section's record is
    stamped when it starts."""
    sections: dict[str, Any] = {}
    failed = []
    stamp = {"commit": commit(), "machine": machine()}
    for name in names:
        print(f"running {name} ...", file=sys.stderr, flush=True)
        date = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
        start = time.perf_counter()
        try:
            results = load(name).run()
        except Skipped as why:
            sections[name] = {"date": date, **stamp, "skipped": str(why), "results": {}}
            print(f"  {name}: skipped: {why}", file=sys.stderr)
            continue
        except Exception:
            traceback.print_exc()
            failed.append(name)
            print(f"  {name}: failed, left out", file=sys.stderr)
            continue
        seconds = time.perf_counter() - start
        sections[name] = {"date": date, **stamp, "seconds": round(seconds, 1),
                          "results": dict(sorted(results.items()))}  # fmt: skip
        print(f"  {name}: {seconds:.1f} s", file=sys.stderr)
    return sections, failed


def write(path: Path, sections: dict[str, Any]) -> None:
    """Replace ``path`` with this run's sections alone."""
    document = {"format": FORMAT, "sections": sections}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".partial")
    tmp.write_text(json.dumps(document, indent=1) + "\n")
    tmp.replace(path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Run ProtoFleet benchmarks.")
    parser.add_argument("--suite", choices=list(SUITES), default="perf",
                        help="perf (default; bench/results.json) or accuracy "
                             "(bench/accuracy.json)")  # fmt: skip
    parser.add_argument("--only", help="comma-separated section modules of the suite to run")
    parser.add_argument("--out", type=Path, help="results file (default: the suite's)")
    args = parser.parse_args(argv)
    names = SUITES[args.suite]
    if args.only:
        chosen = [n.strip() for n in args.only.split(",") if n.strip()]
        unknown = [n for n in chosen if n not in names]
        if unknown:
            parser.error(f"not in suite {args.suite}: {', '.join(unknown)}")
        names = chosen
    out = args.out or RESULTS[args.suite]
    sections, failed = measure(names)
    write(out, sections)
    rows = [(k, v) for s in sections.values() for k, v in s["results"].items()]
    width = max((len(k) for k, _ in rows), default=10)
    print(f"{'metric':<{width}}  value")
    for key, value in rows:
        shown = f"{value:,.0f}" if abs(value) >= 1000 else f"{value:.4g}"
        print(f"{key:<{width}}  {shown}")
    print(f"\nwritten: {out} ({len(sections)} section{'s' if len(sections) != 1 else ''})")
    for name, section in sections.items():
        if "skipped" in section:
            print(f"skipped, no figures: {name}: {section['skipped']}", file=sys.stderr)
    if failed:
        print(f"failed, not in {out.name}: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    # Through bench.run, not this __main__ module: a section raises bench.run.Skipped,
    # which only the one module object's ``except`` catches.
    from bench.run import main as main_of_bench_run

    sys.exit(main_of_bench_run())
