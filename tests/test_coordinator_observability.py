import json
import logging
import subprocess
import sys
import urllib.request

from coordinator.metrics import Metrics
from fleet.transports.broker import free_port
from runtime.cliutil import JsonFormatter


def test_prometheus_endpoint_serves_the_counters():
    metrics = Metrics()
    metrics.updates_rejected.labels(reason="duplicate").inc(3)
    metrics.rounds_completed.inc()
    port = free_port()
    metrics.serve(host="127.0.0.1", port=port)
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    assert 'protofleet_updates_rejected_total{reason="duplicate"} 3.0' in body
    assert "protofleet_rounds_completed_total 1.0" in body
    assert "protofleet_round_duration_seconds_bucket" in body
    assert "protofleet_clients_online 0.0" in body


def test_json_log_lines_carry_the_structured_fields():
    record = logging.makeLogRecord(
        {"name": "coordinator.rounds", "levelname": "INFO", "msg": "round %d closed", "args": (3,)}
    )
    record.event, record.round = "round_closed", 3
    entry = json.loads(JsonFormatter().format(record))
    assert entry["message"] == "round 3 closed"
    assert entry["event"] == "round_closed" and entry["round"] == 3


def test_coordinator_never_imports_torch():
    code = (
        "import sys, coordinator.service.cli, coordinator.service.service, coordinator.rounds, coordinator.strategies;"
        "print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
