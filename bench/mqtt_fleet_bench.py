"""1,000 real agents over Mosquitto (full zoo, digits-5 feature split, FedPCL), hosted by
four worker processes beside the coordinator and the broker.

- ``fleet.mqtt_1000_round_s``: the median round, announcement to announcement.
- ``fleet.mqtt_1000_peak_mb``: the peak of the summed resident memory of every process
  (broker, coordinator, workers, this one).
- ``fleet.mqtt_1000_lost``: updates the coordinator's database lacks of clients x rounds
  (must be 0); a duplicate, which its primary key rules out, fails the section instead.
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

from bench.export_bench import ZOO, ensure_zoo
from bench.fleet_bench import median_round_s
from fleet.data.partition import digits5
from fleet.report.ledger import run_ledger
from fleet.report.summary import run_summary
from fleet.transports import runner
from fleet.transports.spec import RunSpec

CLIENTS = 1000
ROUNDS = 3
WORKERS = 4


def run() -> dict[str, float]:
    ensure_zoo()
    with tempfile.TemporaryDirectory(prefix="protofleet-mqtt-1000-") as tmp:
        partition = digits5(clients=CLIENTS, split="feature", seed=0, train=20, test=20)
        spec = RunSpec(method="fedpcl", rounds=ROUNDS, bundle=ZOO, out=Path(tmp) / "run",
                       transport="mqtt", workers=WORKERS, progress=True)  # fmt: skip
        started = time.perf_counter()
        result = runner.run(spec, partition)
        ledger = run_ledger(result.spec, [c.name for c in partition.clients])
        summary = run_summary(result)
    if ledger.duplicates or ledger.unexpected or ledger.tally_gap or ledger.pruned:
        raise RuntimeError(f"the coordinator's store is not one row per update: {ledger}")
    rounds = summary["round_seconds"]
    print(
        f"  mqtt 1000: {time.perf_counter() - started:.0f} s, of it rounds {rounds}",
        file=sys.stderr,
    )
    return {
        "fleet.mqtt_1000_round_s": median_round_s(summary["round_seconds"]),
        "fleet.mqtt_1000_peak_mb": summary["peak_mb"],
        "fleet.mqtt_1000_lost": float(ledger.lost),
    }
