"""Run every benchmark of the project and write bench/results.json (``make bench``).

Each entry of BENCHMARKS names a module with ``run() -> dict[str, float]``; keys are the
flat names the issues refer to (e.g. ``protocol.update_f16_bytes``).
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
import time
import traceback
from pathlib import Path

BENCHMARKS = [
    "bench.protocol_bench",
    "bench.coordinator_bench",
    "bench.export_bench",
    "bench.agent_bench",
    "bench.fleet_bench",
    "bench.privacy_bench",
    "bench.reliability_bench",
]

RESULTS = Path(__file__).resolve().parent / "results.json"


def main() -> int:
    parser = argparse.ArgumentParser(description="Run ProtoFleet benchmarks.")
    parser.add_argument("--only", help="comma-separated module names to run")
    parser.add_argument("--out", type=Path, default=RESULTS, help="results file")
    args = parser.parse_args()
    chosen = args.only.split(",") if args.only else BENCHMARKS
    # Keep earlier figures of modules not run this time, so --only refreshes a subset.
    results: dict[str, float] = json.loads(args.out.read_text()) if args.out.exists() else {}
    failed = []
    for name in chosen:
        print(f"running {name} ...", file=sys.stderr, flush=True)
        start = time.perf_counter()
        try:
            results.update(importlib.import_module(name).run())
        except Exception:
            traceback.print_exc()
            failed.append(name)
        print(f"  {name}: {time.perf_counter() - start:.1f} s", file=sys.stderr)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2, sort_keys=True) + "\n")
    width = max((len(k) for k in results), default=10)
    print(f"{'metric':<{width}}  value")
    for key in sorted(results):
        value = results[key]
        shown = f"{value:,.0f}" if abs(value) >= 1000 else f"{value:.4g}"
        print(f"{key:<{width}}  {shown}")
    print(f"\nwritten: {args.out}")
    if failed:
        print(f"failed: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    sys.exit(main())
