"""The four console scripts as a user runs them from the virtual environment."""

import subprocess
import sys
from pathlib import Path

import pytest

BIN = Path(sys.executable).parent
SCRIPTS = ["edge-export", "edge-agent", "edge-coordinator", "edge-fleet"]


def run(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(BIN / argv[0]), *argv[1:]], capture_output=True, text=True, timeout=120
    )


@pytest.mark.parametrize("script", SCRIPTS)
def test_help_works(script):
    result = run(script, "--help")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith(f"usage: {script}")


@pytest.mark.parametrize("script", SCRIPTS)
def test_version_is_reported(script):
    result = run(script, "--version")
    assert result.returncode == 0
    assert result.stdout.split() == [script, "0.1.0"]


def test_no_command_prints_help_and_fails():
    result = run("edge-fleet")
    assert result.returncode == 2
    assert "demo" in result.stdout


def test_unknown_option_is_a_usage_error_not_a_traceback():
    result = run("edge-fleet", "demo", "--clients", "many")
    assert result.returncode == 2
    assert "invalid int value" in result.stderr
    assert "Traceback" not in result.stderr
    result = run("edge-fleet", "demo", "--clients", "9")
    assert result.returncode == 2 and "--clients must be 1-5" in result.stderr


@pytest.mark.broker
def test_demo_runs_a_fleet_over_mqtt(small_zoo, tmp_path):
    result = run(
        "edge-fleet",
        "demo",
        "--zoo",
        str(small_zoo),
        "--out",
        str(tmp_path),
        "--clients",
        "2",
        "--rounds",
        "2",
        "--train",
        "60",
    )
    assert result.returncode == 0, result.stdout + result.stderr
    rows = [
        r
        for r in (line.split() for line in result.stdout.splitlines())
        if len(r) == 4 and r[0].isdigit()
    ]
    assert [r[0] for r in rows] == ["0", "1"]
    accuracies = [float(v) for r in rows for v in r[1:]]
    assert all(0.0 <= a <= 1.0 for a in accuracies)
    assert "2 FedPCL rounds over MQTT" in result.stdout
