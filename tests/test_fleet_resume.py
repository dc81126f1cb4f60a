"""A sweep cut short resumes: finished runs are read back, not rerun; the cut run starts
again from round 0; the report equals an uninterrupted sweep's."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from fleet.cli.resume import fingerprint, load, run_or_resume, save, sweep_dir
from fleet.data import partition as part
from fleet.transports.spec import ClientRecord, RunResult, RunSpec
from runtime.cliutil import UsageError
from runtime.faults import ENV as CRASH_AT

BIN = Path(sys.executable).parent


def compare(bundle: Path, out: Path, *extra: str, env: dict[str, str] | None = None):
    argv = [str(BIN / "edge-fleet"), "compare", "--methods", "solo,fedpcl", "--seeds", "0",
            "--transport", "memory", "--clients", "2", "--rounds", "3", "--train", "20",
            "--test", "10", "--out-dim", "16", "--bundle", str(bundle), "--out", str(out),
            "--no-progress", *extra]  # fmt: skip
    return subprocess.run(
        argv, capture_output=True, text=True, timeout=300, env={**os.environ, **(env or {})}
    )


@pytest.mark.slow
def test_a_crashed_sweep_resumes_and_reports_what_an_uninterrupted_one_does(
    small_zoo: Path, tmp_path: Path
) -> None:
    reference = compare(small_zoo, tmp_path / "reference")
    assert reference.returncode == 0, reference.stderr

    out = tmp_path / "sweep"
    crashed = compare(small_zoo, out, env={CRASH_AT: "fleet:fedpcl:round_closed"})
    assert crashed.returncode == -9  # SIGKILL after fedpcl's first round: no clean-up ran
    (sweep,) = (out / "runs").iterdir()
    solo_record = sweep / "solo-seed0" / "result.json"
    before = (solo_record.read_bytes(), solo_record.stat().st_mtime_ns)
    assert (sweep / "fedpcl-seed0").is_dir()  # cut short: state without a result
    assert not (sweep / "fedpcl-seed0" / "result.json").exists()
    assert not (out / "report.json").exists()

    resumed = compare(small_zoo, out, "--resume")
    assert resumed.returncode == 0, resumed.stderr
    assert "solo seed 0: final mean accuracy" in resumed.stderr
    assert "(read back)" in resumed.stderr.split("solo seed 0")[1].splitlines()[0]
    assert "(read back)" not in resumed.stderr.split("fedpcl seed 0")[1].splitlines()[0]
    assert (solo_record.read_bytes(), solo_record.stat().st_mtime_ns) == before
    assert [p.name for p in (out / "runs").iterdir()] == [sweep.name]  # the same sweep

    got = json.loads((out / "report.json").read_text())["methods"]
    want = json.loads((tmp_path / "reference" / "report.json").read_text())["methods"]
    for method in ("solo", "fedpcl"):
        ours, theirs = got[method]["runs"]["0"], want[method]["runs"]["0"]
        # Round 0 of the cut run was not counted twice: three rounds, as uninterrupted.
        assert ours["accuracy"] == theirs["accuracy"]
        assert all(len(acc) == 3 for acc in ours["accuracy"].values())
        assert ours["bytes_up"] == theirs["bytes_up"]
        assert got[method]["final_mean"] == want[method]["final_mean"]


@pytest.mark.slow
def test_resume_needs_an_earlier_sweep(small_zoo: Path, tmp_path: Path) -> None:
    done = compare(small_zoo, tmp_path / "empty", "--resume")
    assert done.returncode == 2
    assert "--resume: no earlier sweep under" in done.stderr
    assert "Traceback" not in done.stderr


def test_a_record_is_read_back_only_for_the_same_settings_data_and_bundle(
    small_zoo: Path, tmp_path: Path
) -> None:
    data = part.digits5(clients=2, split="feature", seed=0, train=10, test=10)
    spec = RunSpec(method="fedpcl", rounds=2, bundle=small_zoo, out=tmp_path / "run",
                   transport="memory", out_dim=16, progress=False)  # fmt: skip
    key = fingerprint(spec, data)
    # Where a run is written and how it is watched are not what it computes.
    assert (
        fingerprint(replace(spec, out=tmp_path / "elsewhere", progress=True, workers=7), data)
        == key
    )
    assert fingerprint(replace(spec, rounds=3), data) != key
    assert fingerprint(replace(spec, extra_train={"tau": 0.2}), data) != key
    other = part.digits5(clients=2, split="feature", seed=1, train=10, test=10)
    assert fingerprint(spec, other) != key
    flipped = replace(data.clients[0], train_y=data.clients[0].train_y[::-1].copy())
    assert fingerprint(spec, replace(data, clients=(flipped, data.clients[1]))) != key

    record = ClientRecord(name="c0", domain="clean", accuracy=(0.5, None),
                          accuracy_prototype=(0.5, 0.6), accuracy_classifier=(None, None),
                          bytes_up=(10, 11), bytes_down=(20, 21))  # fmt: skip
    result = RunResult(spec=spec, clients=(record,), round_seconds=(0.1, 0.2), peak_mb=12.5,
                       wall_seconds=3.0, backbone_samples=40)  # fmt: skip
    spec.out.mkdir(parents=True)
    save(result, key)
    assert load(spec, key) == result
    assert load(spec, "another key") is None
    (spec.out / "result.json").write_text("{not json")
    assert load(spec, key) is None

    # A folder without a record (a run cut short) is cleared before the run starts again.
    (spec.out / "result.json").unlink()
    (spec.out / "leftover").write_text("state of a crashed run")
    seen: list[bool] = []

    def fake_run(s: RunSpec, p: part.Partition) -> RunResult:
        seen.append((s.out / "leftover").exists())
        s.out.mkdir(parents=True, exist_ok=True)
        return result

    assert run_or_resume(spec, data, run=fake_run) == (result, False)
    assert seen == [False]
    assert run_or_resume(spec, data, run=fake_run) == (result, True)
    assert seen == [False]  # read back, not run


def test_sweep_folders(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="no earlier sweep"):
        sweep_dir(tmp_path, resume=True)
    for stamp in ("20261101-120000", "20261123-090000", "20261105-000000"):
        (tmp_path / "runs" / stamp).mkdir(parents=True)
    assert sweep_dir(tmp_path, resume=True).name == "20261123-090000"
    assert sweep_dir(tmp_path, resume=False).parent == tmp_path / "runs"
