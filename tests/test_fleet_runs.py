"""Whole simulated fleets: over a real Mosquitto, the embedded amqtt broker and in memory,
the same partition scoring the same; what the agents keep is what the report says."""

from __future__ import annotations

import json
import sqlite3
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from coordinator.config import database_in
from coordinator.config import load as load_coordinator_config
from edge_agent.agent import Agent
from edge_agent.cli import build_parser as agent_parser
from edge_agent.commands.predict import cmd_predict
from edge_agent.config import load as load_agent_config
from edge_agent.methods import METHODS
from edge_agent.state import StateDir
from edge_agent.train import LocalModel, embed
from export.runtime import BackboneRuntime
from fleet.data import partition as part
from fleet.report.ledger import update_ledger
from fleet.transports.amqtt_broker import AmqttBroker
from fleet.transports.configs import FleetKeys
from fleet.transports.layout import RunLayout
from fleet.transports.runner import run
from fleet.transports.spec import RunSpec

BIN = Path(sys.executable).parent
PNG = b"\x89PNG\r\n\x1a\n"


def independent_accuracy(config: Path) -> float:
    """Re-evaluate an agent from its configuration and state directory alone: head,
    prototypes, test data."""
    cfg = load_agent_config(config)
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
    layout = RunLayout(Path(run_["run_dir"]))
    keys = FleetKeys(layout.keys)
    assert len(run_["final"]) == 3

    db = sqlite3.connect(database_in(layout.coordinator))
    stored = {
        (c, r): n for r, c, n in db.execute("SELECT round, client, length(payload) FROM updates")
    }
    announced = dict(db.execute("SELECT round, length(announcement) FROM rounds"))
    db.close()
    ledger = update_ledger(database_in(layout.coordinator), clients=list(run_["final"]),
                           rounds=2)  # fmt: skip
    assert ledger.exact and ledger.stored == 6
    for client, accs in run_["accuracy"].items():
        assert len(accs) == 2 and all(0.0 <= a <= 1.0 for a in accs)
        # The final figure is what the agent's saved head and prototypes really score.
        assert run_["final"][client] == pytest.approx(
            independent_accuracy(layout.agent_config(client)), abs=1e-9
        )
        # Each configuration written once, whole: the broker it met and the fleet's keys.
        agent = load_agent_config(layout.agent_config(client))
        assert agent.mqtt.port > 0 and agent.security.key == keys.agent_key(client)
        # Traffic: what the coordinator stored and announced, byte for byte.
        assert run_["bytes_up"][client] == [stored[(client, 0)], stored[(client, 1)]]
        assert run_["bytes_down"][client] == [announced[0], announced[1]]
    assert report["methods"]["fedpcl"]["final_mean"] == pytest.approx(
        np.mean(list(run_["final"].values()))
    )
    md = (out / "report.md").read_text()
    prototype = report["methods"]["fedpcl"]["final_mean_prototype"]
    assert f"| fedpcl | {100 * prototype:.1f} | - |" in md  # no classifier to score
    coordinator = load_coordinator_config(layout.coordinator_config)
    assert coordinator.mqtt.port == agent.mqtt.port
    assert coordinator.security.devices == keys.devices
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
    partition = part.digits5(clients=2, split="feature", seed=3, train=24, test=16)
    heads = {}
    for method in ("fedavg", "fedpcl"):
        spec = RunSpec(method=method, rounds=1, bundle=small_zoo, out=tmp_path / method, seed=3,
                       transport="memory", out_dim=32, progress=False,
                       feature_cache=tmp_path / "feature-cache")  # fmt: skip
        run(spec, partition)
        configs = [load_agent_config(spec.layout.agent_config(c.name)) for c in partition.clients]
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
def test_a_device_predicts_exactly_as_the_fleet_scored_it_for_every_method(
    small_zoo: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`edge-agent predict` on a device's state after the last round gives, image by
    image, the predictions whose accuracy the simulation recorded as the device's final
    figure: the same rule through the same function, on what the device keeps."""
    partition = part.digits5(clients=2, split="feature", seed=1, train=40, test=30)
    for method in METHODS:
        spec = RunSpec(method=method, rounds=3, bundle=small_zoo, out=tmp_path / method,
                       transport="memory", out_dim=32, progress=False,
                       feature_cache=tmp_path / "cache")  # fmt: skip
        result = run(spec, partition)
        for record in result.clients:
            config = spec.layout.agent_config(record.name)
            test = load_agent_config(config).data.test
            assert test is not None
            args = agent_parser().parse_args(["predict", "--config", str(config), str(test)])
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
