"""The shipped Prometheus alert rules, checked and unit-tested by promtool itself."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

RULES = Path(__file__).resolve().parent.parent / "systemd" / "prometheus"


def test_alert_rules_fire_as_their_promtool_tests_say():
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool is not installed (CI installs Debian's prometheus)")
    for args in (
        ["check", "rules", "protofleet-alerts.yml"],
        ["test", "rules", "protofleet-alerts.test.yml"],
    ):
        result = subprocess.run(
            [promtool, *args], cwd=RULES, capture_output=True, text=True, timeout=120
        )
        assert result.returncode == 0, result.stdout + result.stderr
