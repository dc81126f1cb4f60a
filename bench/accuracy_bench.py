"""Accuracy benchmarks: the comparison tables of docs/fleet.md and README's demo table.

Every sweep is the real ``edge-fleet`` command with the full zoo (bench/zoo), 5 clients,
30 rounds, seeds 0-2, in memory (the MQTT transport gives the same figures; the demo runs
over MQTT as ``make demo`` does):

- both protocols (fair, paper) x the three digits-5 settings x the nine methods, with the
  ceiling (central) of each (the closed-form methods train no classifier, so the two
  protocols run them alike);
- both protocols on glyphs-5 (``edge-fleet glyphs``, data made differently from
  digits-5) through ``--data``;
- ``edge-fleet demo`` (seed 0, feature shift, over MQTT): the table it prints.

Keys: ``accuracy.<protocol>.<setting>.<method>.{final_mean, final_std, best_mean,
best_std, best_round_min, best_round_max}`` (accuracies as fractions), and
``...first_final_round`` (the round from which a method's mean stays at its final value),
``accuracy.demo.<method>.<domain | mean>`` with ``accuracy.demo_best.<method>.{mean,
round}``. Hours on a 2-core machine: the sweeps keep
their runs under runs/bench-accuracy/<commit>/, so a bench stopped part-way (Ctrl-C, a
reboot) continues where it stopped when run again at the same commit (``--resume``:
finished runs are read back); a work tree with uncommitted changes starts afresh.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

from bench.export_bench import ZOO, ensure_zoo
from bench.run import ROOT, commit
from fleet.data import glyphs

BIN = Path(sys.executable).parent
METHODS = "solo,fedavg,fedproto,fedpcl,fpl,feddbp,lda,ridge,fedcof"
SEEDS = "0,1,2"
ROUNDS = 30
SETTINGS = ("feature", "label", "feature-label", "glyphs")
PROTOCOLS = ("fair", "paper")


def _sweep(command: str, argv: list[str], out: Path) -> dict[str, Any]:
    argv = [*argv, "--bundle", str(ZOO), "--out", str(out), "--rounds", str(ROUNDS)]
    if (out / "runs").is_dir():
        argv.append("--resume")  # the same commit's sweep, stopped part-way
    done = subprocess.run(
        [str(BIN / "edge-fleet"), command, *argv, "--no-progress"], stdout=subprocess.DEVNULL
    )
    if done.returncode != 0:
        raise RuntimeError(f"edge-fleet {command} {' '.join(argv)} failed ({done.returncode})")
    report: dict[str, Any] = json.loads((out / "report.json").read_text())
    return report


def summary_keys(prefix: str, report: dict[str, Any]) -> dict[str, float]:
    """The figures of a compare report.json under ``prefix``."""
    out: dict[str, float] = {}
    for method, m in report["methods"].items():
        rounds = [r for r in m["best_round"].values() if r is not None]
        figures = {"final_mean": m["final_mean"], "final_std": m["final_std"],
                   "best_mean": m["best_mean"], "best_std": m["best_std"],
                   "best_round_min": min(rounds, default=None),
                   "best_round_max": max(rounds, default=None)}  # fmt: skip
        out |= {f"{prefix}.{method}.{k}": float(v) for k, v in figures.items() if v is not None}
        first = first_final_round(m["mean_by_round"])
        if first is not None:
            out[f"{prefix}.{method}.first_final_round"] = float(first)
    return out


def first_final_round(curve: list[float | None]) -> int | None:
    """The first round (1-based) from which the mean over seeds stays at its final value."""
    final = curve[-1] if curve else None
    if final is None:
        return None
    first = len(curve)
    while first > 1:
        before = curve[first - 2]
        if before is None or abs(before - final) >= 1e-9:
            break
        first -= 1
    return first


def run() -> dict[str, float]:
    ensure_zoo()
    results: dict[str, float] = {"accuracy.rounds": ROUNDS, "accuracy.clients": 5,
                                 "accuracy.seeds": len(SEEDS.split(","))}  # fmt: skip
    at = commit()
    root = ROOT / "runs" / "bench-accuracy" / at
    if at.endswith("+changes") or at == "unknown":
        shutil.rmtree(root, ignore_errors=True)  # code no commit holds: nothing to resume
    root.mkdir(parents=True, exist_ok=True)
    data = root / "glyphs5.npz"
    glyphs.main(argparse.Namespace(out=data, seed=0, train=100, test=100))
    for protocol in PROTOCOLS:
        for setting in SETTINGS:
            where = ["--data", str(data)] if setting == "glyphs" else ["--split", setting]
            report = _sweep(
                "compare",
                ["--methods", METHODS, "--seeds", SEEDS, "--transport", "memory",
                 "--protocol", protocol, *where],
                root / f"{protocol}-{setting}",
            )  # fmt: skip
            results |= summary_keys(f"accuracy.{protocol}.{setting}", report)
            print(f"  accuracy: {protocol} {setting} done", file=sys.stderr, flush=True)
    demo = _sweep("demo", [], root / "demo")
    for method, m in demo["methods"].items():
        results |= {f"accuracy.demo.{method}.{d}": v for d, v in m["per_domain"].items()}
        results[f"accuracy.demo.{method}.mean"] = m["final_mean"]
        results[f"accuracy.demo_best.{method}.mean"] = m["best_mean"]
        results[f"accuracy.demo_best.{method}.round"] = m["best_round"]["0"]
    results["accuracy.demo.wall_seconds"] = sum(
        r["wall_seconds"] for m in demo["methods"].values() for r in m["runs"].values()
    )
    return results


if __name__ == "__main__":
    print(json.dumps(run(), indent=1))
