"""The sweep commands' options, resolved once from the command line, and the sweeps they
run: the protocol's [train] settings, the output folder a sweep holds, a privacy sweep."""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from fleet.cli.commands import cmd_run
from fleet.cli.main import build_parser
from fleet.cli.main import main as fleet_main
from fleet.cli.options import Digits5Options, sweep_options
from fleet.cli.privacy import privacy_options
from runtime.runlock import RunLock, holder
from tests.process_helpers import LoggedProcess

BIN = Path(sys.executable).parent
PNG = b"\x89PNG\r\n\x1a\n"


def test_options_are_resolved_once_and_the_command_line_is_left_as_parsed(tmp_path: Path) -> None:
    argv = ["run", "--bundle", str(tmp_path), "--out", str(tmp_path / "out"), "--clients", "3"]
    args = build_parser().parse_args(argv)
    parsed = copy.deepcopy(vars(args))
    options = sweep_options(args, method="fedpcl")
    assert vars(args) == parsed
    assert options.workers == 2 and options.bundle == tmp_path and options.progress
    assert options.data.digits5 == Digits5Options(split="feature", clients=3, alpha=0.5,
                                                  domain="clean", train=100, test=100)  # fmt: skip
    assert options.data.image_size == 32
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.rounds = 3  # type: ignore[misc]
    # The report's record of the command line: every option in the parser's order, as
    # resolved, paths as text; nothing of the entry point's or the parser's own.
    assert list(options.config)[:4] == ["method", "seed", "data", "split"]
    assert options.config["workers"] == 2 and options.config["bundle"] == str(tmp_path)
    assert options.config["clients"] == 3 and options.config["alpha"] == 0.5
    assert {"command", "log_level", "digits5_defaults"}.isdisjoint(options.config)
    spec = options.spec(method="solo", seed=4, out=tmp_path / "run")
    assert (spec.seed, spec.workers, spec.feature_cache) == (
        4,
        2,
        tmp_path / "out" / "feature-cache",
    )


def test_a_privacy_sweep_records_every_setting_it_swept(tmp_path: Path) -> None:
    argv = ["privacy", "--bundle", str(tmp_path), "--out", str(tmp_path / "out"),
            "--splits", "feature,label", "--alpha", "0.3", "--epsilons", "8,2"]  # fmt: skip
    args = build_parser().parse_args(argv)
    parsed = copy.deepcopy(vars(args))
    options = privacy_options(args)
    assert vars(args) == parsed
    assert options.splits == ("feature", "label") and options.epsilons == (8.0, 2.0)
    assert options.sweep.transport == "memory"  # privacy's own default
    label = options.sweep.data.with_split("label").digits5
    assert label is not None and (label.split, label.alpha) == ("label", 0.3)
    config = options.config()
    assert config["split"] == "label" and config["swept_splits"] == ["feature", "label"]
    assert list(config)[-1] == "swept_splits" and config["alpha"] == 0.3


def test_a_privacy_sweep_refuses_the_vector_transport_before_any_arm_runs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Its FedPCL arms train with a privacy mechanism, which the vector transport does not
    # run: refused with one line before the zoo, the data or any arm (no report folder).
    out = tmp_path / "out"
    argv = ["privacy", "--closed-form", "--transport", "vector", "--bundle", str(tmp_path),
            "--out", str(out), "--paper", "none", "--mechanisms", "dp-features"]  # fmt: skip
    assert fleet_main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--transport vector" in err and "memory" in err
    assert not out.exists()
    # Its help says which transport each kind of arm runs over, and the real default.
    with pytest.raises(SystemExit):
        fleet_main(["privacy", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "(default memory)" in text and "(default mqtt)" not in text
    assert "closed-form arms always run on the vector transport" in text


def test_secure_aggregation_is_resolved_for_every_fleet_and_left_off_the_ceiling(
    tmp_path: Path,
) -> None:
    where = ["--bundle", str(tmp_path), "--out", str(tmp_path / "out")]
    argv = ["compare", "--methods", "lda,ridge", "--transport", "vector", "--secure-aggregation",
            *where]  # fmt: skip
    options = sweep_options(build_parser().parse_args([*argv, "--epsilon", "4"]), method="lda")
    spec = options.spec(method="ridge", seed=0, out=tmp_path / "run")
    # --epsilon is the sum's: a dp-features budget the sum's noise spends in its place.
    assert spec.secure_aggregation
    assert spec.privacy == {"mechanism": "dp-features", "epsilon": 4.0, "delta": 1e-5}
    ceiling = options.spec(method="central", seed=0, out=tmp_path / "central", plain=True)
    assert not ceiling.secure_aggregation and ceiling.privacy == {}
    assert options.config["secure_aggregation"] and options.config["epsilon"] == 4.0
    # Without --epsilon the sum is exact; without --secure-aggregation nothing changes.
    exact = sweep_options(build_parser().parse_args(argv), method="lda")
    assert exact.spec(method="lda", seed=0, out=tmp_path / "run").privacy == {}
    plain = sweep_options(build_parser().parse_args(["run", *where]), method="fedpcl")
    assert not plain.spec(method="fedpcl", seed=0, out=tmp_path / "run").secure_aggregation
    # A privacy sweep compares the aggregations itself (--closed-form), with no such option.
    with pytest.raises(SystemExit):
        build_parser().parse_args(["privacy", "--secure-aggregation", *where])


def test_the_protocol_sets_every_classifier_alike_and_train_param_wins(tmp_path: Path) -> None:
    def train_of(
        argv: list[str], method: str, command: str = "compare", **kwargs: Any
    ) -> dict[str, Any]:
        where = ["--bundle", str(tmp_path), "--out", str(tmp_path / "out")]
        options = sweep_options(build_parser().parse_args([command, *where, *argv]), method=method)
        return options.spec(method=method, seed=0, out=tmp_path, **kwargs).extra_train

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


@pytest.mark.slow
def test_a_sweep_waits_for_a_zoo_another_is_building_and_refuses_a_busy_out_folder(
    small_zoo: Path, tmp_path: Path
) -> None:
    """Two sweeps started at once on a fresh clone: the second used to delete the first's
    half-built zoo as an interrupted build's leftover."""
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
    out = tmp_path / "out"
    argv = ["run", "--transport", "memory", "--bundle", str(small_zoo), "--rounds", "1",
            "--clients", "2", "--train", "20", "--test", "20", "--no-progress",
            "--out", str(out)]  # fmt: skip
    assert cmd_run(build_parser().parse_args(argv)) == 0  # not main(): it sets up logging
    assert "report.json" in capsys.readouterr().out
    assert (out / ".lock").exists() and holder(out / ".lock") is None
