"""What a simulated fleet is set up from and read back through: the agents' and the
coordinator's tables, the run folder's layout, and each agent's own state reader."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from edge_agent.config import AgentConfig
from edge_agent.state import StateDir
from fleet.data import partition as part
from fleet.transports.collect import client_records
from fleet.transports.configs import (
    agent_tables,
    coordinator_tables,
    fleet_keys,
    prototype_dim,
    to_toml,
    write_config,
)
from fleet.transports.spec import RunSpec
from runtime.cliutil import CommandFailed
from runtime.settings import build, load_config


def test_tables_are_written_as_toml() -> None:
    text = to_toml({"a": 1, "b": 'x"y', "t": {"c": [1.5, 2], "d": True}})
    assert text == 'a = 1\nb = "x\\"y"\n[t]\nc = [1.5, 2]\nd = true\n'


def test_an_agents_tables_name_its_places_in_the_run_folder(tmp_path: Path) -> None:
    client = part.digits5(clients=1, split="feature", seed=0, train=4, test=2).clients[0]
    spec = RunSpec(method="fedpcl", rounds=2, bundle=tmp_path / "zoo", out=tmp_path / "run")
    layout = spec.layout
    keys = fleet_keys(layout.keys, [client.name])
    tables = agent_tables(spec, client, classes=("0", "1"), index=0,
                          security=keys.agent_table(client.name))  # fmt: skip
    path = write_config(layout.agent_config(client.name), tables)
    assert path == tmp_path / "run" / "clients" / client.name / "agent.toml"
    cfg = load_config(AgentConfig, path)
    assert cfg == build(AgentConfig, tables)  # the file says what the tables say
    assert cfg.state_dir == layout.agent_state(client.name)
    assert cfg.data.train is not None and cfg.data.train.parent == layout.agent_data(client.name)
    assert cfg.security.key == keys.agent_key(client.name) and cfg.security.key.is_file()
    assert keys.device_pub(client.name).is_file() and keys.coordinator_pub.is_file()
    coord = coordinator_tables(spec, "b" * 64, ("0", "1"), 1, dim=8, feature_dim=8,
                               security=keys.coordinator_table())  # fmt: skip
    assert coord["state_dir"] == str(layout.coordinator)
    assert list(coord)[-1] == "security"


def test_a_run_is_read_back_through_each_agents_own_state(tmp_path: Path) -> None:
    partition = part.digits5(clients=2, split="feature", seed=0, train=4, test=2)
    spec = RunSpec(method="fedpcl", rounds=2, bundle=tmp_path, out=tmp_path)
    first, second = (c.name for c in partition.clients)
    state = StateDir(spec.layout.agent_state(first), agent_id=first)
    state.reset_for_bundle("b" * 64)
    state.save_round(1, model=None, prototypes=np.zeros((1, 2), np.float32),
                     counts=np.ones(1, np.int64), update=b"u",
                     metrics={"test_accuracy": 0.5, "bytes_up": 7})  # fmt: skip
    with pytest.raises(CommandFailed, match=f"no record of {second}: no agent state in "):
        client_records(spec, partition)
    StateDir(spec.layout.agent_state(second), agent_id=first).reset_for_bundle("b" * 64)
    with pytest.raises(CommandFailed, match=f"no record of {second}: .* belongs to agent"):
        client_records(spec, partition)  # another agent's state is no record of this one
    (spec.layout.agent_state(second) / "state.json").unlink()
    StateDir(spec.layout.agent_state(second), agent_id=second).reset_for_bundle("b" * 64)
    one, two = client_records(spec, partition)
    assert one.accuracy == (None, 0.5) and one.bytes_up == (0, 7) and one.bytes_down == (0, 0)
    assert two.accuracy == (None, None) and two.bytes_up == (0, 0)
    # A damaged record fails the run with the agent's own words for it.
    (spec.layout.agent_state(first) / "state.json").write_text("{")
    with pytest.raises(CommandFailed, match=f"no record of {first}: .* is damaged"):
        client_records(spec, partition)


def test_fleet_agents_keep_every_round_for_the_report(tmp_path: Path) -> None:
    client = part.digits5(clients=1, split="feature", seed=0, train=4, test=2).clients[0]
    for rounds, kept in ((30, 200), (450, 450)):  # a device's default, or every round
        spec = RunSpec(method="fedpcl", rounds=rounds, bundle=tmp_path, out=tmp_path)
        tables = agent_tables(spec, client, classes=("0", "1"), index=0)
        assert tables["history"] == kept


def test_simulated_agents_draw_secret_noise_unless_the_run_asks_for_replayable_noise(
    tmp_path: Path,
) -> None:
    client = part.digits5(clients=1, split="feature", seed=0, train=4, test=2).clients[0]
    privacy = {"mechanism": "dp-features", "epsilon": 8.0}
    secret = RunSpec(method="fedpcl", rounds=2, bundle=tmp_path, out=tmp_path, privacy=privacy)
    tables = agent_tables(secret, client, classes=("0", "1"), index=3)
    assert tables["privacy"] == privacy  # no seed: the agents draw from the OS
    replayable = replace(secret, reproducible_noise=True, seed=2)
    tables = agent_tables(replayable, client, classes=("0", "1"), index=3)
    assert tables["privacy"]["reproducible_noise_seed"] == 2 * 100_003 + 3
    # A feature-space release sets the coordinator's prototype dimension.
    assert prototype_dim(secret, 896) == 896
    assert prototype_dim(replace(secret, privacy={}), 896) == secret.out_dim
