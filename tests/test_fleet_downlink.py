"""The simulated fleet and the bounded downlink: ``--downlink-budget`` reaches the
coordinator, and agents and coordinator otherwise run the deployed payload limits."""

from __future__ import annotations

from pathlib import Path

import pytest

from coordinator.config import CoordinatorConfig
from coordinator.downlink import DEFAULT_BUDGET
from fleet.cli.main import build_parser, main
from fleet.cli.options import DataOptions, sweep_options
from fleet.report.notes import settings
from fleet.transports.configs import announcement_refusal, coordinator_tables
from fleet.transports.spec import RunSpec
from protocol import DEFAULT_MAX_PAYLOAD_BYTES
from runtime.settings import build
from runtime.transport import MqttSettings


def test_run_help_documents_the_downlink_budget(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["run", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--downlink-budget BYTES" in text
    assert "0 or 'exact': every set" in text and f"(default {DEFAULT_BUDGET})" in text


@pytest.mark.parametrize(("given", "budget"), [(None, DEFAULT_BUDGET), ("exact", 0), ("0", 0),
                                               ("EXACT", 0), ("131072", 131072)])  # fmt: skip
def test_the_budget_reaches_the_coordinators_model_table(
    tmp_path: Path, given: str | None, budget: int
) -> None:
    argv = ["run", "--bundle", str(tmp_path), "--out", str(tmp_path / "out")]
    argv += [] if given is None else ["--downlink-budget", given]
    options = sweep_options(build_parser().parse_args(argv), method="fedpcl")
    spec = options.spec(method="fedpcl", seed=0, out=tmp_path)
    assert spec.downlink_budget == budget
    tables = coordinator_tables(spec, "b" * 64, tuple("abc"), 5, dim=256, feature_dim=8)
    tables["security"] = {"insecure": True}
    cfg = build(CoordinatorConfig, tables)
    assert cfg.model.downlink_budget == budget
    # No payload limit of the simulator's own: the deployed defaults, agents' included.
    assert "mqtt" not in tables and "agents" not in tables
    assert cfg.mqtt.max_payload_bytes == DEFAULT_MAX_PAYLOAD_BYTES
    assert cfg.agents.max_payload_bytes == MqttSettings().max_payload_bytes


@pytest.mark.parametrize("bad", ["-1", "64k", ""])
def test_a_bad_budget_is_a_usage_error(bad: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        build_parser().parse_args(["run", "--downlink-budget", bad])
    assert exit_.value.code == 2
    assert "--downlink-budget" in capsys.readouterr().err


def test_a_report_names_a_budget_other_than_the_default() -> None:
    assert settings({"transport": "memory", "downlink_budget": DEFAULT_BUDGET}) == (
        "memory transport"
    )
    assert settings({"transport": "memory", "downlink_budget": 0}) == (
        "memory transport, every local set announced"
    )
    assert settings({"downlink_budget": 131072}) == "downlink 131,072 bytes"


def test_an_announcement_too_large_is_refused_before_the_clients_data_is_made(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # 450 exact FedPCL local sets of 10 x 256 float32: 4.6 MB against the devices' 4 MiB.
    # It used to end the run after the data, the feature extraction and round 0.
    class Made(Exception):
        """The clients' data would be made now."""

    def made(self: DataOptions, seed: int) -> None:
        raise Made

    monkeypatch.setattr(DataOptions, "partition", made)
    out = tmp_path / "out"
    argv = ["compare", "--methods", "solo,fedpcl", "--seeds", "0", "--clients", "450",
            "--transport", "memory", "--out", str(out)]  # fmt: skip
    assert main([*argv, "--downlink-budget", "exact"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err
    assert err.startswith(
        "edge-fleet: error: fedpcl with 450 clients: round 1: refusing to publish an "
        "announcement of 4,640,220 bytes, above agents.max_payload_bytes = 4,194,304"
    )
    assert not out.exists()
    # Within the default budget the same fleet passes the check and goes on to its data.
    with pytest.raises(Made):
        main(argv)


def test_a_size_that_needs_the_bundle_is_asked_again_once_it_is_known(tmp_path: Path) -> None:
    # dp-features sends backbone features: the bundle's feature size decides the rows.
    spec = RunSpec(method="fedpcl", rounds=1, bundle=tmp_path, out=tmp_path, downlink_budget=0,
                   privacy={"mechanism": "dp-features"})  # fmt: skip
    names = [f"client-{i:04d}" for i in range(120)]
    classes = tuple(str(c) for c in range(10))
    assert announcement_refusal(spec, classes, names, feature_dim=None) is None
    refused = announcement_refusal(spec, classes, names, feature_dim=896)
    assert refused is not None and refused.startswith("fedpcl with 120 clients: round 1: ")
    assert announcement_refusal(spec, classes, names[:5], feature_dim=896) is None
    # The same fleet sending 256-d head prototypes fits.
    plain = RunSpec(method="fedpcl", rounds=1, bundle=tmp_path, out=tmp_path, downlink_budget=0)
    assert announcement_refusal(plain, classes, names, feature_dim=None) is None
