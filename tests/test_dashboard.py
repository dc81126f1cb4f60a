"""The shipped Grafana dashboard (systemd/prometheus/protofleet-dashboard.json): every
panel's query, evaluated by a real Prometheus scraping live coordinators, neither errors
nor comes back empty. Two small fleets, each on its own Mosquitto: a single coordinator
(rounds, intake, a rejection) and a round owner with two workers (the worker tier's
panels); Prometheus scrapes both as the deployment guide's job."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

import pytest

from fleet.powercut.coordinator_cuts import FLEET, StandInDevices, write_config
from fleet.transports.broker import MosquittoBroker, free_port
from protocol import update_topic
from tests.process_helpers import LoggedProcess

DASHBOARD = (
    Path(__file__).resolve().parent.parent / "systemd" / "prometheus" / "protofleet-dashboard.json"
)
BIN = Path(sys.executable).parent
WORKERS = (
    "[robust]\nmedian_count_cap = false\nmedian_norm_clip = false\nmedian_direction_screen = false\n"
    '[workers]\nnames = ["w1", "w2"]\nlocal_sets = "omit"\ncollect_retry_s = 1.0\n'
)
#: The longest wait for Prometheus, or for a query to see data.
WAIT_S = 90.0


def panel_queries() -> list[tuple[str, str]]:
    """(panel title, expression) of every query of every panel."""
    panels = json.loads(DASHBOARD.read_text())["panels"]
    return [(p["title"], t["expr"]) for p in panels for t in p.get("targets", [])]


def test_the_dashboard_has_the_panels_the_guide_names():
    titles = {title for title, _ in panel_queries()}
    for wanted in ("Rounds closed", "Round time", "Rejections by reason", "Stalled round",
                   "Devices rejecting announcements", "Worker shares", "Secure rounds",
                   "Secure round time and survivors", "Privacy budget"):  # fmt: skip
        assert wanted in titles
    uids = [t["datasource"]["uid"] for p in json.loads(DASHBOARD.read_text())["panels"]
            for t in p.get("targets", [])]  # fmt: skip
    assert set(uids) == {"${datasource}"}  # the datasource chosen on import


@contextmanager
def process(argv: list[str], log: Path) -> Iterator[subprocess.Popen[bytes]]:
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=log.open("ab"))
    try:
        yield proc
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def query(port: int, expr: str) -> dict:
    url = f"http://127.0.0.1:{port}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
    try:
        with urllib.request.urlopen(url, timeout=10) as response:
            return json.loads(response.read())
    except urllib.error.HTTPError as exc:  # a bad query is a 400 with the error in its body
        return json.loads(exc.read())


def wait_ready(port: int, proc: subprocess.Popen[bytes]) -> None:
    """Until Prometheus answers /-/ready (it replays its log and binds first)."""
    deadline = time.monotonic() + WAIT_S
    while True:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/-/ready", timeout=5):
                return
        except OSError:
            assert proc.poll() is None, "prometheus exited"
            assert time.monotonic() < deadline, f"prometheus not ready in {WAIT_S:.0f} s"
            time.sleep(0.2)  # poll interval: it offers nothing to wait on


def evaluate_until_data(port: int, queries: list[tuple[str, str]]) -> dict[str, str]:
    """Each query's problem (an error, or nothing returned) once ``WAIT_S`` has passed
    without data; empty when every query returned some."""
    problems: dict[str, str] = {}
    deadline = time.monotonic() + WAIT_S
    pending = list(queries)
    while pending:
        title, expr = pending[0]
        answer = query(port, expr)
        if answer.get("status") != "success":
            problems[f"{title}: {expr}"] = f"error: {answer.get('error')}"
            pending.pop(0)
        elif answer["data"]["result"]:
            pending.pop(0)
        elif time.monotonic() > deadline:
            problems[f"{title}: {expr}"] = "returned nothing"
            pending.pop(0)
        else:
            time.sleep(0.5)  # poll interval: the next scrape brings the sample or nothing
    return problems


@pytest.mark.slow
@pytest.mark.broker
def test_every_panel_query_returns_data_from_a_live_fleet(tmp_path: Path) -> None:
    prometheus = shutil.which("prometheus")
    if prometheus is None:
        pytest.skip("prometheus is not installed (CI installs Debian's prometheus)")
    coordinator = [str(BIN / "edge-coordinator")]
    with ExitStack() as stack:
        single, tier = (stack.enter_context(MosquittoBroker()) for _ in range(2))
        ports = {"single": free_port(), "owner": free_port()}
        single_cfg, tier_cfg = tmp_path / "single.toml", tmp_path / "tier.toml"
        write_config(single_cfg, state=tmp_path / "single", port=single.address.port, quorum=4,
                     extra=f"[metrics]\nport = {ports['single']}\n")  # fmt: skip
        write_config(tier_cfg, state=tmp_path / "tier", port=tier.address.port, quorum=4,
                     extra=f"[metrics]\nport = {ports['owner']}\n" + WORKERS)  # fmt: skip
        workers = {name: LoggedProcess("edge-coordinator", ["worker", "--config", str(tier_cfg),
                                                            "--name", name])
                   for name in ("w1", "w2")}  # fmt: skip
        for worker in workers.values():
            stack.callback(worker.close)
            stack.callback(worker.stop)
        stack.enter_context(process([*coordinator, "run", "--config", str(single_cfg)],
                                    tmp_path / "single.log"))  # fmt: skip
        stack.enter_context(process([*coordinator, "run", "--config", str(tier_cfg)],
                                    tmp_path / "owner.log"))  # fmt: skip
        # A worker is ready once subscribed: updates sent before any worker is are dropped
        # by the broker (a shared subscription without members), and these stand-ins send
        # a round's updates once (CI lost the first round so, and then saw none).
        for name, worker in workers.items():
            worker.wait_for(f"worker {name} ready", timeout=60)
        # The single coordinator's devices claim a formal mechanism: the privacy panel.
        devices = [StandInDevices(b.address.port, devices=6, epsilon=e)
                   for b, e in ((single, 0.5), (tier, None))]  # fmt: skip
        for d in devices:
            stack.callback(d.close)
        # One message no device would send, so the rejections panel has a reason to show.
        devices[0].wait("a round answered", lambda: len(devices[0].receipts) >= 4)
        single_pub = devices[0]._client  # the stand-ins' own client: a device's topic
        single_pub.publish(update_topic(FLEET, "dev-000"), b"not an update", qos=1)
        devices[1].wait("rounds over the workers", lambda: devices[1].latest_round >= 2)

        web = free_port()
        config = tmp_path / "prometheus.yml"
        targets = ", ".join(f'"127.0.0.1:{p}"' for p in ports.values())
        config.write_text(
            "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n"
            "scrape_configs:\n  - job_name: protofleet-coordinator\n"
            f"    static_configs:\n      - targets: [{targets}]\n"
        )
        server = stack.enter_context(process(
            [prometheus, f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
             f"--web.listen-address=127.0.0.1:{web}"],
            tmp_path / "prometheus.log",
        ))  # fmt: skip
        wait_ready(web, server)
        problems = evaluate_until_data(web, panel_queries())
    assert problems == {}, (
        json.dumps(problems, indent=1) + (tmp_path / "owner.log").read_text()[-2000:]
    )
