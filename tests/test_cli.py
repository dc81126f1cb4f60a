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


def test_demo_round_trips_every_update():
    result = run("edge-fleet", "demo", "--clients", "3")
    assert result.returncode == 0, result.stderr
    rows = [line for line in result.stdout.splitlines() if line.startswith("device-")]
    assert len(rows) == 3
    assert all("protofleet/v1/demo/update/" in row and "MISMATCH" not in row for row in rows)
