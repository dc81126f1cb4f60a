"""Simulated fleets: partitions, the report's arithmetic, and whole fleets over a real
Mosquitto, the embedded amqtt broker and the in-memory transport."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import select
import signal
import sqlite3
import subprocess
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from edge_agent.config import load as load_agent_config
from edge_agent.state import StateDir
from edge_agent.train import LocalModel, embed
from export.runtime import BackboneRuntime
from fleet.data import partition as part
from fleet.report.ledger import update_ledger
from fleet.report.plots import plot_domains
from fleet.report.summary import build_report, markdown, to_json, train_note
from fleet.transports.amqtt_broker import AmqttBroker
from fleet.transports.broker import MosquittoBroker, free_port
from fleet.transports.configs import to_toml
from fleet.transports.mqtt import parse_broker_url
from fleet.transports.runner import run
from fleet.transports.spec import ClientRecord, RunResult, RunSpec
from runtime.cliutil import CommandFailed, Terminated, UsageError
from tests.process_helpers import LoggedProcess

BIN = Path(sys.executable).parent
PNG = b"\x89PNG\r\n\x1a\n"


# -- partitions ----------------------------------------------------------------------------


def test_dirichlet_counts_sum_and_concentrate() -> None:
    rng = np.random.default_rng(0)
    counts = part.dirichlet_label_counts(100, 10, 0.1, rng)
    assert counts.sum() == 100 and counts.shape == (10,)
    top_share = lambda alpha: np.mean(  # noqa: E731
        [part.dirichlet_label_counts(100, 10, alpha, rng).max() / 100 for _ in range(200)]
    )
    # Small alpha: most of a client's data in one class; large alpha: close to 1/10 each.
    assert top_share(0.1) > 0.5 > 0.2 > top_share(100.0)


def test_digits5_splits_are_deterministic_and_shaped_as_asked() -> None:
    a = part.digits5(clients=6, split="feature", seed=3, train=30, test=10)
    b = part.digits5(clients=6, split="feature", seed=3, train=30, test=10)
    c = part.digits5(clients=6, split="feature", seed=4, train=30, test=10)
    assert [x.domain for x in a.clients] == [*part.DOMAINS, part.DOMAINS[0]]
    for x, y in zip(a.clients, b.clients, strict=True):
        np.testing.assert_array_equal(x.train_x, y.train_x)
        np.testing.assert_array_equal(x.test_y, y.test_y)
    assert not np.array_equal(a.clients[0].train_x, c.clients[0].train_x)
    first = a.clients[0]
    assert first.train_x.shape == (30, 3, 32, 32) and first.train_x.dtype == np.uint8
    assert len(first.test_y) == 10

    label = part.digits5(clients=4, split="label", seed=0, train=60, test=20, alpha=0.1)
    assert {x.domain for x in label.clients} == {"clean"}
    # Dirichlet(0.1): each client's labels concentrate on few classes.
    assert all(np.bincount(x.train_y, minlength=10).max() >= 20 for x in label.clients)
    both = part.digits5(clients=5, split="feature-label", seed=0, train=60, test=20, alpha=0.1)
    assert [x.domain for x in both.clients] == list(part.DOMAINS)


def test_digits5_clients_never_share_a_source_digit() -> None:
    # The real Digit-5's domains are separate datasets: no client may test on a digit
    # that another client (in another style) or itself trained on.
    def sources(clients: int, split: str) -> list[tuple[set[int], set[int]]]:
        plan = part.source_plan(
            clients=clients, split=split, seed=0, train=100, test=100, alpha=0.5, domain="clean"
        )
        return [(set(a.tolist()), set(b.tolist())) for _, a, b in plan]

    seen: set[int] = set()
    for train, test in sources(5, "feature"):
        assert len(train) == 100 and len(test) == 100 and not (train | test) & seen
        seen |= train | test
    # Skewed labels or 40 clients can ask for more digits of a class than there are:
    # those are reused across clients, but a client's test digits are never its own
    # training digits.
    for clients, split in [(40, "feature"), (5, "label"), (5, "feature-label")]:
        assert all(not train & test for train, test in sources(clients, split)), split


def test_digits5_rejects_bad_arguments() -> None:
    with pytest.raises(UsageError, match="--split"):
        part.digits5(clients=2, split="iid", seed=0, train=10, test=5)
    with pytest.raises(UsageError, match="--alpha"):
        part.digits5(clients=2, split="label", seed=0, train=10, test=5, alpha=0)


def test_clients_from_an_npz(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    arrays: dict[str, np.ndarray] = {}
    for i in range(2):
        arrays[f"train_x_{i}"] = rng.integers(0, 255, (8, 3, 16, 16), dtype=np.uint8)
        arrays[f"train_y_{i}"] = np.arange(8) % 3
        arrays[f"test_x_{i}"] = rng.random((4, 3, 16, 16), dtype=np.float32)
        arrays[f"test_y_{i}"] = np.arange(4) % 3
    arrays["domain_1"] = np.array("sketch")
    np.savez(tmp_path / "fleet.npz", **arrays)  # type: ignore[arg-type]
    got = part.from_npz(tmp_path / "fleet.npz")
    assert [c.domain for c in got.clients] == ["client-0", "sketch"]
    assert got.classes == ("0", "1", "2")
    assert got.clients[1].test_x.dtype == np.uint8

    del arrays["test_y_1"]
    np.savez(tmp_path / "broken.npz", **arrays)  # type: ignore[arg-type]
    with pytest.raises(UsageError, match="client 1 lacks test_y_1"):
        part.from_npz(tmp_path / "broken.npz")

    # Client 2 past a missing client 1 would be silently left out.
    gap = {k: v for k, v in arrays.items() if not k.endswith("_1")}
    gap |= {k[:-1] + "2": v for k, v in arrays.items() if k.endswith("_0")}
    np.savez(tmp_path / "gap.npz", **gap)  # type: ignore[arg-type]
    with pytest.raises(UsageError, match="no train_x_1 but holds arrays of client 2"):
        part.from_npz(tmp_path / "gap.npz")

    # A client with nothing to train on (or to be scored on) is refused before any run.
    arrays["test_y_1"] = arrays["test_y_0"]
    arrays["train_x_1"], arrays["train_y_1"] = arrays["train_x_1"][:0], arrays["train_y_1"][:0]
    np.savez(tmp_path / "empty.npz", **arrays)  # type: ignore[arg-type]
    with pytest.raises(UsageError, match=r"client-0001 \(sketch\) has no training images"):
        part.from_npz(tmp_path / "empty.npz")


def test_clients_from_folders(tmp_path: Path) -> None:
    from PIL import Image

    def image(path: Path, value: int) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        Image.fromarray(np.full((20, 20, 3), value, np.uint8)).save(path)

    per_client = tmp_path / "clients"
    for client in ("a", "b"):
        for split in ("train", "test"):
            for cls in ("cat", "dog"):
                image(per_client / client / split / cls / "1.png", 10)
    (per_client / "a" / "train" / "cat" / "broken.png").write_bytes(b"not a png")
    got = part.from_directory(per_client, image_size=8)
    assert got.classes == ("cat", "dog") and len(got.clients) == 2
    assert got.clients[0].train_x.shape == (2, 3, 8, 8)
    assert "1 unreadable images skipped" in got.description

    domains = tmp_path / "office"
    for dom in ("amazon", "webcam"):
        for cls in ("mug", "pen"):
            for k in range(5):
                image(domains / dom / cls / f"{k}.png", 20 * k)
    got = part.from_directory(domains, image_size=8, test_share=0.3)
    assert [c.domain for c in got.clients] == ["amazon", "webcam"]
    assert len(got.clients[0].train_y) == 7 and len(got.clients[0].test_y) == 3

    # One image in a domain: after the split it has nothing left to test on.
    image(domains / "tiny" / "mug" / "0.png", 0)
    with pytest.raises(UsageError, match=r"\(tiny\) has no test images"):
        part.from_directory(domains, image_size=8, test_share=0.3)


# -- report arithmetic ---------------------------------------------------------------------


def fake_result(
    tmp_path: Path,
    method: str,
    seed: int,
    accs: list[list[float]],
    train: dict[str, Any] | None = None,
) -> RunResult:
    spec = RunSpec(method=method, rounds=len(accs[0]), bundle=tmp_path, out=tmp_path, seed=seed,
                   extra_train=train or {})  # fmt: skip
    clients = tuple(
        ClientRecord(
            name=f"c{i}",
            domain=["clean", "photo"][i % 2],
            accuracy=tuple(a),
            accuracy_prototype=tuple(a),
            accuracy_classifier=tuple(a),
            bytes_up=(100,) * len(a),
            bytes_down=(1000,) * len(a),
        )
        for i, a in enumerate(accs)
    )
    return RunResult(spec, clients, (1.0,) * len(accs[0]), 50.0, 2.0)


def test_report_means_stds_and_table(tmp_path: Path) -> None:
    results = {
        "fedpcl": {
            0: fake_result(tmp_path, "fedpcl", 0, [[0.5, 0.8], [0.4, 0.6]]),
            1: fake_result(tmp_path, "fedpcl", 1, [[0.5, 0.6], [0.4, 0.4]]),
        }
    }
    doc = build_report(results, config={}, partition="toy")
    m = doc["methods"]["fedpcl"]
    # Final means per seed: (0.8 + 0.6) / 2 = 0.7 and (0.6 + 0.4) / 2 = 0.5.
    assert m["final_mean"] == pytest.approx(0.6)
    assert m["final_std"] == pytest.approx(0.1)
    assert m["per_domain"] == pytest.approx({"clean": 0.7, "photo": 0.5})
    assert m["mean_by_round"] == pytest.approx([0.45, 0.6])
    assert m["bytes_up_per_client_round"] == 100
    # Best rounds: seed 0's mean by round is (0.45, 0.7), seed 1's (0.45, 0.5): both at 2.
    assert m["best_mean"] == pytest.approx(0.6) and m["best_std"] == pytest.approx(0.1)
    assert m["best_round"] == {"0": 2, "1": 2}
    assert doc["methods"]["fedpcl"]["runs"]["0"]["best_round"] == 2
    table = markdown(doc)
    assert "| method | clean | photo | final | best (round) |" in table
    assert "| fedpcl | 70.0 (10.0) | 50.0 (10.0) | 60.0 (10.0) | 60.0 (10.0) @ 2 |" in table
    assert "own rule: fedpcl by cosine similarity to its local prototypes." in table
    both = {m: results["fedpcl"] for m in ("solo", "fedproto", "fedavg", "fpl", "feddbp")}
    other = markdown(build_report(both, config={}, partition="toy"))
    assert (
        "own rule: solo by its classifier; fedproto by Euclidean distance to the global "
        "prototypes; fedavg and fpl by the round's global model; feddbp by its decision "
        "branch's distance to its personalised global prototypes." in other
    )
    assert "no classifier is trained" in table and "no classifier is trained" not in other
    assert "(mean over seeds, final round, %)" in table
    one = markdown(build_report({"fedpcl": {0: results["fedpcl"][0]}}, config={}, partition="t"))
    assert "seed 0: by domain" in one and "(seed 0, final round, %)" in one
    assert "mean over" not in one and "| 70.0 @ 2 |" in one
    assert "Settings:" not in table  # no configuration given, nothing to state
    assert table.startswith("# Fleet report: toy\n")  # no protocol given, none stated
    assert m["train"] == {}
    config = {"rounds": 2, "epochs": 3, "out_dim": 32, "transport": "memory", "protocol": "paper"}
    trained = {"tau": 0.2, "classifier": "bounded"}
    same = {"fedpcl": {s: fake_result(tmp_path, "fedpcl", s, [[0.5]], trained) for s in (0, 1)}}
    stated = markdown(build_report(same, config=config, partition="toy"))
    # The protocol in the first line, what it means in the next paragraph.
    assert stated.startswith("# Fleet report, paper protocol: toy\n\nPaper protocol: every ")
    assert (
        "Settings: 2 rounds, 3 local epochs per round, head output 32, memory transport, "
        "train: classifier=bounded, tau=0.2." in stated
    )
    settings = build_report(same, config=config, partition="toy")["methods"]["fedpcl"]["settings"]
    assert settings["protocol"] == "paper" and settings["inference"] == "local_prototype_cosine"
    assert settings["train"]["classifier"] == "bounded" and settings["train"]["lr"] == 1e-3
    # Settings some methods had and others not are named with their methods.
    mixed = {
        method: {0: fake_result(tmp_path, method, 0, [[0.5]], {"tau": 0.2, **extra})}
        for method, extra in (("solo", {"classifier": "bounded"}), ("fedpcl", {}),
                              ("fedavg", {"classifier": "bounded", "lr": 0.002}))
    }  # fmt: skip
    doc_mixed = build_report(mixed, config=config, partition="toy")
    assert doc_mixed["methods"]["fedavg"]["train"] == {"tau": 0.2, "classifier": "bounded",
                                                        "lr": 0.002}  # fmt: skip
    assert (
        "train: tau=0.2, classifier=bounded for solo and fedavg, lr=0.002 for fedavg."
        in markdown(doc_mixed)
    )
    # The ceiling: a row of its own, last, and no traffic or device-rule row.
    with_central = {**results, "central": {0: fake_result(tmp_path, "central", 0, [[0.9, 0.95]]),
                                           1: fake_result(tmp_path, "central", 1, [[0.9, 0.85]])}}  # fmt: skip
    ceiling = markdown(build_report(with_central, config={}, partition="toy"))
    rows = [line for line in ceiling.splitlines() if line.startswith("| ")]
    # Seed 0 peaks at round 2 (0.95), seed 1 at round 1 (0.9).
    assert rows[2] == "| central (ceiling) | 90.0 (5.0) | - | 90.0 (5.0) | 92.5 (2.5) @ 1-2 |"
    assert ceiling.count("| central") == 1 and "is the ceiling" in ceiling
    # A report with no per-method record (a privacy sweep) states its --train-param.
    assert train_note({"train_param": {"tau": 0.2}}, None) == "train: tau=0.2"
    assert train_note({"train_param": {"tau": 0.2}}, {}) == "train: tau=0.2"
    assert train_note({}, None) == ""
    # Two seeds: the per-domain plot draws their spread (the fleet test draws one seed),
    # and the ceiling as a line.
    png = plot_domains(build_report(with_central, config={}, partition="toy"),
                       tmp_path / "domains.png").read_bytes()  # fmt: skip
    assert png.startswith(PNG) and len(png) > 5_000

    # Figures that do not exist are null: NaN is not JSON, also inside a dataclass.
    @dataclass(frozen=True)
    class Setting:
        alpha: float

    doc["methods"]["fedpcl"]["final_mean_classifier"] = float("nan")
    doc["config"] = {"split": Setting(alpha=float("inf"))}
    strict = json.loads(to_json(doc), parse_constant=lambda c: pytest.fail(f"{c} in JSON"))
    assert strict["methods"]["fedpcl"]["final_mean_classifier"] is None
    assert strict["config"] == {"split": {"alpha": None}}


def test_small_helpers() -> None:
    assert parse_broker_url("mqtt://10.0.0.5:1884") == ("10.0.0.5", 1884)
    assert parse_broker_url("broker.lan") == ("broker.lan", 1883)
    with pytest.raises(UsageError):
        parse_broker_url("http://x")
    text = to_toml({"a": 1, "b": 'x"y', "t": {"c": [1.5, 2], "d": True}})
    assert text == 'a = 1\nb = "x\\"y"\n[t]\nc = [1.5, 2]\nd = true\n'


def test_the_protocol_sets_every_classifier_alike_and_train_param_wins(tmp_path: Path) -> None:
    from fleet.cli.commands import spec_for
    from fleet.cli.main import build_parser

    def train_of(
        argv: list[str], method: str, command: str = "compare", **kwargs: Any
    ) -> dict[str, Any]:
        args = build_parser().parse_args([command, *argv])
        args.workers = 2  # what check_options fills in before a sweep
        spec = spec_for(args, method=method, bundle=tmp_path, seed=0, out=tmp_path, **kwargs)
        return spec.extra_train

    with_classifier = ("solo", "fedavg", "fedproto", "fpl", "feddbp")
    for command in ("compare", "run", "demo", "privacy"):
        # The fair default: the agents' own (linear) classifier for every method.
        for method in (*with_classifier, "fedpcl"):
            assert train_of([], method, command) == {}
        # The paper's protocol: its released code's classifier for every method that has
        # one, never for some baselines alone; FedPCL has none.
        paper = ["--protocol", "paper"]
        for method in with_classifier:
            assert train_of(paper, method, command) == {"classifier": "bounded"}
        assert train_of(paper, "fedpcl", command) == {}
    # --train-param is every method's and wins over the protocol's settings.
    given = ["--protocol", "paper", "--train-param", "classifier=linear", "--train-param",
             "tau=0.2"]  # fmt: skip
    assert train_of(given, "solo") == {"classifier": "linear", "tau": 0.2}
    assert train_of(given, "fedpcl") == {"classifier": "linear", "tau": 0.2}
    assert train_of(["--train-param", "tau=0.2"], "fedavg") == {"tau": 0.2}
    # A sweep's own settings win over --train-param.
    assert train_of(["--train-param", "norm=batch"], "fedpcl", "privacy",
                    extra_train={"norm": "group"}) == {"norm": "group"}  # fmt: skip
    with pytest.raises(SystemExit):  # argparse's usage error: not a protocol
        build_parser().parse_args(["compare", "--protocol", "reference"])


# -- whole fleets ----------------------------------------------------------------------------


def independent_accuracy(client_dir: Path) -> float:
    """Re-evaluate an agent from its state directory alone: head, prototypes, test data."""
    cfg = load_agent_config(client_dir / "agent.toml")
    runtime = BackboneRuntime(cfg.bundle)
    state = StateDir(cfg.state_dir, agent_id=cfg.agent_id)
    model = LocalModel(in_dim=runtime.feature_dim, num_classes=len(cfg.classes), cfg=cfg.train)
    assert state.load_model(model)
    loaded = state.load_prototypes()
    assert loaded is not None
    protos, counts = loaded
    assert cfg.data.test is not None
    with np.load(cfg.data.test) as data:
        x = data["x"].astype(np.float32) / 255
        y = data["y"]
    z, _ = embed(model, runtime.extract(x))
    # FedPCL's rule, computed here by hand: cosine similarity to the local prototypes.
    unit = protos / np.maximum(np.linalg.norm(protos, axis=1, keepdims=True), 1e-12)
    scores = np.where(counts[None] > 0, z @ unit.T, -np.inf)
    return float((scores.argmax(1) == y).mean())


@pytest.mark.slow
@pytest.mark.broker
def test_three_clients_two_rounds_over_mosquitto_match_the_agents_records(
    small_zoo: Path, tmp_path: Path
) -> None:
    out = tmp_path / "report"
    argv = [str(BIN / "edge-fleet"), "run", "--transport", "mqtt", "--clients", "3",
            "--rounds", "2", "--train", "40", "--test", "30", "--out-dim", "32",
            "--bundle", str(small_zoo), "--out", str(out), "--no-progress"]  # fmt: skip
    done = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr

    def strict(constant: str) -> None:
        raise AssertionError(f"report.json holds {constant}, which is not JSON")

    report = json.loads((out / "report.json").read_text(), parse_constant=strict)
    assert report["methods"]["fedpcl"]["final_mean_classifier"] is None  # it trains none
    run_ = report["methods"]["fedpcl"]["runs"]["0"]
    run_dir = Path(run_["run_dir"])
    assert len(run_["final"]) == 3

    db = sqlite3.connect(run_dir / "coordinator" / "coordinator.sqlite3")
    stored = {
        (c, r): n for r, c, n in db.execute("SELECT round, client, length(payload) FROM updates")
    }
    announced = dict(db.execute("SELECT round, length(announcement) FROM rounds"))
    db.close()
    ledger = update_ledger(run_dir / "coordinator" / "coordinator.sqlite3",
                           clients=list(run_["final"]), rounds=2)  # fmt: skip
    assert ledger.exact and ledger.stored == 6
    for client, accs in run_["accuracy"].items():
        assert len(accs) == 2 and all(0.0 <= a <= 1.0 for a in accs)
        # The final figure is what the agent's saved head and prototypes really score.
        assert run_["final"][client] == pytest.approx(
            independent_accuracy(run_dir / "clients" / client), abs=1e-9
        )
        # Traffic: what the coordinator stored and announced, byte for byte.
        assert run_["bytes_up"][client] == [stored[(client, 0)], stored[(client, 1)]]
        assert run_["bytes_down"][client] == [announced[0], announced[1]]
    assert report["methods"]["fedpcl"]["final_mean"] == pytest.approx(
        np.mean(list(run_["final"].values()))
    )
    md = (out / "report.md").read_text()
    prototype = report["methods"]["fedpcl"]["final_mean_prototype"]
    assert f"| fedpcl | {100 * prototype:.1f} | - |" in md  # no classifier to score
    for png in ("accuracy_vs_round.png", "accuracy_per_domain.png", "backbone_contribution.png"):
        data = (out / png).read_bytes()
        assert data.startswith(PNG) and len(data) > 5_000

    # The in-memory transport runs the same code: the same partition gives the same numbers.
    partition = part.digits5(clients=3, split="feature", seed=0, train=40, test=30)
    spec = RunSpec(method="fedpcl", rounds=2, bundle=small_zoo, out=tmp_path / "memory",
                   transport="memory", out_dim=32, progress=False)  # fmt: skip
    memory = run(spec, partition)
    for record in memory.clients:
        assert list(record.accuracy) == pytest.approx(run_["accuracy"][record.name], abs=1e-9)


def _long_fleet(bundle: Path, tmp_path: Path) -> LoggedProcess:
    """A 2-agent MQTT fleet of 500 rounds, leading a process group of its own."""
    argv = ["--log-level", "INFO", "run", "--transport", "mqtt", "--clients", "2",
            "--rounds", "500", "--train", "20", "--test", "10", "--out-dim", "16",
            "--bundle", str(bundle), "--out", str(tmp_path / "out"), "--no-progress"]  # fmt: skip
    return LoggedProcess("edge-fleet", argv, new_session=True)


def _group_members(group: int) -> dict[int, str]:
    """pid -> command line of the live (not zombie) processes of a process group."""
    members = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue  # exited while we looked
        state, _ppid, pgrp = stat.rsplit(")", 1)[1].split()[:3]
        if int(pgrp) == group and state != "Z":
            members[int(entry.name)] = cmdline
    return members


@pytest.mark.slow
@pytest.mark.broker
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_a_killed_fleet_process_takes_its_children_with_it(small_zoo: Path, tmp_path: Path) -> None:
    """SIGKILL (the OOM killer, kill -9) runs no clean-up: the broker, the coordinator and
    the workers notice their parent's death themselves and exit."""
    fleet = _long_fleet(small_zoo, tmp_path)
    group = fleet.proc.pid
    try:
        fleet.wait_for("round 2 of 500 closed", timeout=120)
        children = {p: c for p, c in _group_members(group).items() if p != fleet.proc.pid}
        kinds = " ".join(children.values())
        assert (
            "mosquitto" in kinds
            and "edge-coordinator" in kinds
            and "fleet.transports.worker" in kinds
        )
        # A pidfd becomes readable when its process ends: an event to wait on, not a poll.
        fds = {pid: os.pidfd_open(pid) for pid in children}
        fleet.kill()
        deadline = time.monotonic() + 60
        for pid, fd in fds.items():
            ready, _, _ = select.select([fd], [], [], max(0.0, deadline - time.monotonic()))
            os.close(fd)
            assert ready, f"{children[pid]} outlived the fleet process"
    finally:
        fleet.close()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(group, signal.SIGKILL)  # whatever a failure left running


@pytest.mark.broker
@pytest.mark.parametrize(
    ("how", "status"),
    [("ctrl-c", 128 + signal.SIGINT), ("sigterm", 128 + signal.SIGTERM)],
)
@pytest.mark.slow
def test_a_stopped_fleet_leaves_no_process_behind(
    small_zoo: Path, tmp_path: Path, how: str, status: int
) -> None:
    """Ctrl-C reaches the terminal's whole foreground group (edge-fleet, Mosquitto, the
    coordinator, the workers); `kill` or `timeout` sends SIGTERM to edge-fleet alone.
    Either way the run stops everything it started before it exits."""
    fleet = _long_fleet(small_zoo, tmp_path)
    try:
        fleet.wait_for("round 2 of 500 closed", timeout=120)
        group = os.getpgid(fleet.proc.pid)
        if how == "ctrl-c":
            os.killpg(group, signal.SIGINT)
        else:
            fleet.signal(signal.SIGTERM)
        assert fleet.proc.wait(timeout=90) == status
        fleet.wait_for("interrupted" if how == "ctrl-c" else "terminated", timeout=10)
        # edge-fleet waits for each process it started, so none may be left in its group.
        with pytest.raises(ProcessLookupError):
            os.killpg(group, 0)
    finally:
        fleet.close()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(fleet.proc.pid, signal.SIGKILL)  # whatever a failure left running


@pytest.mark.broker
@pytest.mark.parametrize(
    ("victim", "name", "log_file"),
    [
        ("edge-coordinator", "the coordinator", "coordinator.log"),
        ("worker-1.json", "worker 1", "worker-1.log"),
    ],
)
@pytest.mark.slow
def test_a_fleet_whose_process_dies_names_it_and_stops_the_rest(
    small_zoo: Path, tmp_path: Path, victim: str, name: str, log_file: str
) -> None:
    """The OOM killer takes the coordinator or a worker mid-run: edge-fleet says which and
    where its log is, exits 1 (a failure, not a usage error: 2), and stops the rest.
    Before, a dead coordinator left the fleet waiting out its 30-minute no-progress limit."""
    fleet = _long_fleet(small_zoo, tmp_path)
    group = fleet.proc.pid
    try:
        fleet.wait_for("round 2 of 500 closed", timeout=120)
        (pid,) = [p for p, command in _group_members(group).items() if victim in command]
        os.kill(pid, signal.SIGKILL)
        assert fleet.proc.wait(timeout=90) == 1
        fleet.wait_for(f"{name} exited early", timeout=10)
        (line,) = [x for x in fleet.lines if "exited early" in x]
        assert line.startswith(f"edge-fleet: error: {name} exited early (status -9); see ")
        assert line.rstrip().endswith(f"/logs/{log_file}")
        assert not any("Traceback" in x for x in fleet.lines)
        with pytest.raises(ProcessLookupError):
            os.killpg(group, 0)
    finally:
        fleet.close()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(group, signal.SIGKILL)  # whatever a failure left running


def test_a_stop_request_is_raised_at_the_runs_next_check_as_the_signal_it_was() -> None:
    from fleet.transports.mqtt import _StopRequest

    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)  # as under nohup
    try:
        assert set(_StopRequest().actions()) == {signal.SIGTERM}  # ignored stays ignored
        # As in a terminal, whatever this pytest inherited (a job started in the
        # background of a script inherits SIGINT ignored).
        signal.signal(signal.SIGINT, signal.default_int_handler)
        stop = _StopRequest()
        stop.check()  # nothing asked: no exception
        actions = stop.actions()
        assert set(actions) == {signal.SIGINT, signal.SIGTERM}
        actions[signal.SIGTERM](signal.SIGTERM)
        actions[signal.SIGINT](signal.SIGINT)  # the first request decides
        with pytest.raises(Terminated):
            stop.check()
        interrupted = _StopRequest()
        interrupted.actions()[signal.SIGINT](signal.SIGINT)
        with pytest.raises(KeyboardInterrupt) as caught:
            interrupted.check()
        assert caught.type is KeyboardInterrupt  # not its subclass Terminated
    finally:
        signal.signal(signal.SIGINT, previous)


@pytest.mark.broker
def test_a_broker_the_fleet_cannot_use_is_named_before_anything_starts(
    small_zoo: Path, tmp_path: Path
) -> None:
    # Before, agents and coordinator were started anyway and the fleet sat silent until
    # its 30-minute no-progress limit.
    partition = part.digits5(clients=2, split="label", seed=1, train=30, test=20)
    nobody, port = free_port("127.0.0.1"), free_port("127.0.0.1")
    # No anonymous access: this broker answers, and refuses.
    locked = f"listener {port} 127.0.0.1\nallow_anonymous false\n"
    with MosquittoBroker(port=port, listener_config=locked):
        cases = [
            (nobody, f"cannot reach the MQTT broker at 127.0.0.1:{nobody}: Connection refused"),
            (port, f"the MQTT broker at 127.0.0.1:{port} refused the connection: Not authorized"),
        ]
        for n, (at, message) in enumerate(cases):
            out = tmp_path / str(n)
            spec = RunSpec(method="fedpcl", rounds=1, bundle=small_zoo, out=out, workers=1,
                           broker=f"mqtt://127.0.0.1:{at}", out_dim=32, progress=False)  # fmt: skip
            with pytest.raises(CommandFailed) as failed:
                run(spec, partition)
            assert str(failed.value) == message
            assert not list((out / "logs").glob("*.log"))  # no coordinator, no worker


@pytest.mark.slow
def test_a_fleet_through_the_embedded_amqtt_broker(small_zoo: Path, tmp_path: Path) -> None:
    partition = part.digits5(clients=2, split="label", seed=1, train=30, test=20)
    with AmqttBroker() as broker:
        spec = RunSpec(method="fedproto", rounds=2, bundle=small_zoo, out=tmp_path / "amqtt",
                       broker=f"mqtt://127.0.0.1:{broker.address.port}", workers=1, out_dim=32,
                       progress=False)  # fmt: skip
        result = run(spec, partition)
    assert [len(c.accuracy) for c in result.clients] == [2, 2]
    assert all(a is not None for c in result.clients for a in c.accuracy)
    assert all(u > 0 for c in result.clients for u in c.bytes_up)


@pytest.mark.slow
def test_privacy_sweep_reports_accuracy_and_the_label_attack(
    small_zoo: Path, tmp_path: Path
) -> None:
    argv = [str(BIN / "edge-fleet"), "privacy", "--bundle", str(small_zoo), "--out", str(tmp_path),
            "--clients", "2", "--rounds", "2", "--train", "30", "--test", "20", "--out-dim", "32",
            "--splits", "label", "--epsilons", "8", "--paper", "laplace:0.05:0.2",
            "--no-progress"]  # fmt: skip
    done = subprocess.run(argv, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    report = json.loads((tmp_path / "report.json").read_text())
    rows = report["results"]["label"]
    assert set(rows) == {"solo (no privacy)", "fedpcl (no privacy)",
                         "fedpcl paper laplace s=0.05 p=0.2", "fedpcl dp eps=8",
                         "fedpcl dp-features eps=8"}  # fmt: skip
    assert all(0.0 <= v <= 1.0 for v in rows.values())
    attack = report["label_inference_tv"]["label"]
    assert attack["no noise"] == 0.0 and attack["dp eps=8"] > 0.05
    assert attack["dp-features eps=8"] > 0.0
    # Secret noise by default: the formal arms claim their guarantee, planned from the
    # declared bound (the largest client's 30 samples), never from a client's own count.
    dp = report["privacy"]["fedpcl dp eps=8"]
    assert dp["guarantee"] == "(epsilon, delta)-DP, add/remove one example"
    assert dp["dataset_size"] == 30
    assert report["privacy"]["fedpcl dp-features eps=8"]["mechanism"] == "dp-features"
    assert (
        "Formal arms' guarantee: (epsilon, delta)-DP, add/remove one example."
        in (tmp_path / "report.md").read_text()
    )
    assert (tmp_path / "accuracy_vs_epsilon.png").read_bytes().startswith(PNG)
    table = (tmp_path / "report.md").read_text()
    assert "| fedpcl dp eps=8 |" in table
    assert "Settings: 2 rounds, 1 local epoch per round, head output 32, memory transport." in table
    # The fair protocol's Solo: the agents' own classifier; each arm's settings in full.
    assert report["train"]["solo (no privacy)"] == {}
    assert report["train"]["fedpcl dp eps=8"] == {"norm": "group"}
    assert report["train"]["fedpcl dp-features eps=8"] == {}
    arm = report["settings"]["fedpcl dp eps=8"]
    assert arm["protocol"] == "fair" and arm["train"]["norm"] == "group"
    assert arm["privacy"]["mechanism"] == "dp" and arm["privacy"]["epsilon"] == 8.0
    assert table.startswith("# Privacy on digits-5 (delta 1e-05 for the whole run; fair protocol)")


def test_a_privacy_report_marks_reproducible_noise_as_no_guarantee() -> None:
    from fleet.cli.privacy import markdown

    rows = {"solo (no privacy)": 0.5, "fedpcl dp eps=8": 0.25}
    document = {"config": {}, "delta": 1e-5, "results": {"label": rows},
                "privacy": {"fedpcl dp eps=8": {"mechanism": "dp",
                                                "guarantee": "none (reproducible noise)"}}}  # fmt: skip
    assert "Formal arms' guarantee: none (reproducible noise)." in markdown(document)


def test_fleet_agents_keep_every_round_for_the_report(tmp_path: Path) -> None:
    from fleet.transports.configs import agent_tables

    client = part.digits5(clients=1, split="feature", seed=0, train=4, test=2).clients[0]
    for rounds, kept in ((30, 200), (450, 450)):  # a device's default, or every round
        spec = RunSpec(method="fedpcl", rounds=rounds, bundle=tmp_path, out=tmp_path)
        tables = agent_tables(spec, client, tmp_path / str(rounds), ("0", "1"), 0)
        assert tables["history"] == kept


def test_simulated_agents_draw_secret_noise_unless_the_run_asks_for_replayable_noise(
    tmp_path: Path,
) -> None:
    from fleet.transports.configs import agent_tables, prototype_dim

    client = part.digits5(clients=1, split="feature", seed=0, train=4, test=2).clients[0]
    privacy = {"mechanism": "dp-features", "epsilon": 8.0}
    secret = RunSpec(method="fedpcl", rounds=2, bundle=tmp_path, out=tmp_path, privacy=privacy)
    tables = agent_tables(secret, client, tmp_path / "a", ("0", "1"), 3)
    assert tables["privacy"] == privacy  # no seed: the agents draw from the OS
    replayable = replace(secret, reproducible_noise=True, seed=2)
    tables = agent_tables(replayable, client, tmp_path / "b", ("0", "1"), 3)
    assert tables["privacy"]["reproducible_noise_seed"] == 2 * 100_003 + 3
    # A feature-space release sets the coordinator's prototype dimension.
    assert prototype_dim(secret, 896) == 896
    assert prototype_dim(replace(secret, privacy={}), 896) == secret.out_dim


def test_a_privacy_report_on_own_data_names_the_file_not_a_digits5_setting() -> None:
    from fleet.cli.privacy import markdown

    rows = {"solo (no privacy)": 0.5, "fedpcl dp eps=8": 0.25}
    own = {"config": {"data": "/data/clinic.npz"}, "delta": 1e-5, "results": {"clinic.npz": rows},
           "label_inference_tv": {"clinic.npz": {"no noise": 0.0}}}  # fmt: skip
    table = markdown(own)
    assert table.startswith("# Privacy on clinic.npz ")
    assert "| setting | clinic.npz |" in table and "| release | clinic.npz |" in table
    assert "| fedpcl dp eps=8 | 25.0 |" in table
    digits = {"config": {"data": None}, "delta": 1e-5, "results": {"label": rows}}
    assert "# Privacy on digits-5 " in markdown(digits)
    assert "| setting | label shift |" in markdown(digits)


def test_runs_sharing_a_feature_cache_run_the_backbones_once(
    small_zoo: Path, tmp_path: Path
) -> None:
    partition = part.digits5(clients=2, split="feature", seed=2, train=24, test=16)
    results = []
    for method in ("solo", "fedpcl"):  # what `compare` does: one cache for every method
        spec = RunSpec(method=method, rounds=1, bundle=small_zoo, out=tmp_path / method,
                       transport="memory", out_dim=32, progress=False,
                       feature_cache=tmp_path / "feature-cache")  # fmt: skip
        results.append(run(spec, partition))
    assert results[0].backbone_samples == 2 * (24 + 16)
    assert results[1].backbone_samples == 0
    assert all(a is not None for c in results[1].clients for a in c.accuracy)


def test_averaged_models_start_from_one_head_and_the_others_apart(
    small_zoo: Path, tmp_path: Path
) -> None:
    from edge_agent.agent import Agent

    partition = part.digits5(clients=2, split="feature", seed=3, train=24, test=16)
    heads = {}
    for method in ("fedavg", "fedpcl"):
        spec = RunSpec(method=method, rounds=1, bundle=small_zoo, out=tmp_path / method, seed=3,
                       transport="memory", out_dim=32, progress=False,
                       feature_cache=tmp_path / "feature-cache")  # fmt: skip
        run(spec, partition)
        paths = sorted((tmp_path / method).glob("clients/*/agent.toml"))
        configs = [load_agent_config(path) for path in paths]
        assert len({c.seed for c in configs}) == 2  # batch order and noise stay per device
        # Each device's head as it is built, before any training: a fresh state dir.
        heads[method] = [
            Agent(replace(c, state_dir=tmp_path / "fresh" / method / c.agent_id)).model.state_dict()
            for c in configs
        ]
    first, second = heads["fedavg"]
    assert all(torch.equal(first[k], second[k]) for k in first)
    first, second = heads["fedpcl"]
    assert not torch.equal(first["head.fc.weight"], second["head.fc.weight"])


@pytest.mark.slow
def test_a_sweep_waits_for_a_zoo_another_is_building_and_refuses_a_busy_out_folder(
    small_zoo: Path, tmp_path: Path
) -> None:
    """Two sweeps started at once on a fresh clone: the second used to delete the first's
    half-built zoo as an interrupted build's leftover."""
    import shutil

    from runtime.runlock import RunLock

    zoo = tmp_path / "zoo"
    argv = ["run", "--transport", "memory", "--bundle", str(zoo), "--rounds", "1",
            "--clients", "2", "--train", "20", "--test", "20", "--no-progress"]  # fmt: skip
    building = RunLock.take(tmp_path / ".zoo.lock", what="stand-in build")  # "the first sweep"
    fleet = LoggedProcess("edge-fleet", [*argv, "--out", str(tmp_path / "a")])
    try:
        fleet.wait_for(f"the zoo in {zoo} is in use by another process (pid {os.getpid()})")
        # A second sweep into the same --out is refused while the first holds it.
        busy = subprocess.run(
            [str(BIN / "edge-fleet"), *argv, "--out", str(tmp_path / "a")],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert busy.returncode == 2
        assert busy.stderr.strip() == (
            f"edge-fleet: error: --out {tmp_path / 'a'} is in use by another process "
            f"(pid {fleet.proc.pid}); wait for that sweep to end or choose another --out"
        )
        shutil.copytree(small_zoo, zoo)  # the first sweep's build completes
        building.release()
        assert fleet.proc.wait(timeout=300) == 0
        assert not any("building the" in line for line in fleet.lines)  # used, not rebuilt
        assert json.loads((tmp_path / "a" / "report.json").read_text())["config"]["bundle"] == str(
            zoo
        )
    finally:
        building.release()
        fleet.close()


def test_a_sweep_in_this_process_lets_go_of_its_out_folder_when_it_ends(
    small_zoo: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # The lock is the sweep's, not the process's: a program that runs sweeps one after
    # another (or a notebook) must not keep other processes out of a folder it finished.
    from fleet.cli.commands import cmd_run
    from fleet.cli.main import build_parser
    from runtime.runlock import holder

    out = tmp_path / "out"
    argv = ["run", "--transport", "memory", "--bundle", str(small_zoo), "--rounds", "1",
            "--clients", "2", "--train", "20", "--test", "20", "--no-progress",
            "--out", str(out)]  # fmt: skip
    assert cmd_run(build_parser().parse_args(argv)) == 0  # not main(): it sets up logging
    assert "report.json" in capsys.readouterr().out
    assert (out / ".lock").exists() and holder(out / ".lock") is None


@pytest.mark.slow
def test_a_device_predicts_exactly_as_the_fleet_scored_it_for_every_method(
    small_zoo: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`edge-agent predict` on a device's state after the last round gives, image by
    image, the predictions whose accuracy the simulation recorded as the device's final
    figure: the same rule through the same function, on what the device keeps."""
    from edge_agent.cli import build_parser as agent_parser
    from edge_agent.commands.predict import cmd_predict
    from edge_agent.methods import METHODS

    partition = part.digits5(clients=2, split="feature", seed=1, train=40, test=30)
    for method in METHODS:
        spec = RunSpec(method=method, rounds=3, bundle=small_zoo, out=tmp_path / method,
                       transport="memory", out_dim=32, progress=False,
                       feature_cache=tmp_path / "cache")  # fmt: skip
        result = run(spec, partition)
        for record in result.clients:
            client = spec.out / "clients" / record.name
            test = client / "data" / "test.npz"
            args = agent_parser().parse_args(
                ["predict", "--config", str(client / "agent.toml"), str(test)]
            )
            capsys.readouterr()
            assert cmd_predict(args) == 0
            rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
            with np.load(test) as data:
                labels = data["y"]
            predicted = np.array([int(r["class"]) for r in rows])  # classes "0".."9"
            assert len(predicted) == len(labels) == 30
            final = record.accuracy[-1]
            assert final is not None, method
            assert float((predicted == labels).mean()) == final, (method, record.name)


def test_glyphs5_is_deterministic_balanced_and_reads_back_as_clients(tmp_path: Path) -> None:
    from fleet.cli.main import build_parser
    from fleet.data import glyphs

    a = glyphs.make(seed=3, train=20, test=10)
    b = glyphs.make(seed=3, train=20, test=10)
    assert all(np.array_equal(a[k], b[k]) for k in a)
    assert not np.array_equal(a["train_x_0"], glyphs.make(seed=4, train=20, test=10)["train_x_0"])
    for i, domain in enumerate(glyphs.DOMAINS):
        assert a[f"train_x_{i}"].shape == (20, 3, 32, 32) and a[f"train_x_{i}"].dtype == np.uint8
        assert np.bincount(a[f"train_y_{i}"], minlength=10).tolist() == [2] * 10
        assert str(a[f"domain_{i}"]) == domain
    # The domains look different: mean colours per domain are far apart.
    means = [a[f"train_x_{i}"].mean() for i in range(5)]
    assert max(means) - min(means) > 20
    out = tmp_path / "g.npz"
    args = build_parser().parse_args(["glyphs", "--out", str(out), "--train", "20", "--test", "10"])
    assert glyphs.main(args) == 0
    clients = part.from_npz(out).clients
    assert [c.domain for c in clients] == list(glyphs.DOMAINS)
    assert len(clients[0].train_y) == 20 and len(clients[4].test_y) == 10
    with pytest.raises(UsageError, match="train must be at least 10"):
        glyphs.main(argparse.Namespace(out=out, seed=0, train=5, test=1))


def test_a_coordinator_that_finished_is_not_taken_for_a_crash(tmp_path: Path) -> None:
    import subprocess
    import sys

    from fleet.transports.mqtt import _liveness
    from runtime.cliutil import CommandFailed

    done = subprocess.Popen([sys.executable, "-c", "pass"])
    crashed = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    done.wait()
    crashed.wait()
    log = tmp_path / "x.log"
    finished = _liveness({"the coordinator": (done, log)}, lambda: None, lambda: None, grace_s=0)
    finished()  # its final announcement may still be on its way: nothing to report
    failed = _liveness({"the coordinator": (crashed, log)}, lambda: None, lambda: None, grace_s=0)
    with pytest.raises(CommandFailed, match=r"the coordinator exited early \(status 3\)"):
        failed()
    worker = _liveness({"worker 0": (done, log)}, lambda: None, lambda: None, grace_s=0)
    with pytest.raises(CommandFailed, match="worker 0 exited early"):
        worker()  # a worker never finishes by itself


@pytest.mark.broker
def test_the_fleet_watcher_follows_announcements_over_the_default_size_cap(mosquitto) -> None:
    # FedPCL's announcement to 200 agents carries 200 padded local sets: 2 MB. Ignored as
    # too large, it left `edge-fleet run --clients 200` waiting until the coordinator's exit.
    from fleet.transports.spec import FLEET
    from fleet.transports.watcher import Watcher
    from protocol import RoundAnnouncement, round_topic
    from tests.mqtt_helpers import connected

    rows = np.zeros((10, 256), np.float32)
    big = RoundAnnouncement(
        fleet=FLEET, round=2, bundle="b" * 64, method="fedpcl",
        classes=tuple(str(c) for c in range(10)), deadline=0.0,
        global_classes=tuple(range(10)), global_prototypes=rows,
        local_sets={f"client-{i:04d}": rows for i in range(200)},
    )  # fmt: skip
    payload = big.to_wire()
    assert len(payload) > 1 << 20
    watcher = Watcher(mosquitto.address.host, mosquitto.address.port, expected=0)
    try:
        with connected(mosquitto.address, "coordinator") as (pub, _):
            pub.publish(round_topic(FLEET), payload, qos=1, retain=True).wait_for_publish(30)
        with watcher._cond:
            assert watcher._cond.wait_for(lambda: watcher.round == 2, timeout=30)
    finally:
        watcher.close()


def test_no_worker_hosts_more_agents_than_pahos_select_can_watch() -> None:
    from fleet.transports.mqtt import AGENTS_PER_WORKER, workers_for

    assert workers_for(1000, 4) == 4  # 250 each
    assert workers_for(3, 4) == 3  # never an idle worker
    assert workers_for(1000, 2) == -(-1000 // AGENTS_PER_WORKER)
    assert 3 * AGENTS_PER_WORKER < 1024  # three sockets an agent, under select()'s limit
