"""What the coordinator says about its enrolment before the first round: an empty devices
folder is refused, a quorum larger than the fleet is named."""

from __future__ import annotations

from pathlib import Path

import pytest

from coordinator.keys import CoordinatorKeys
from protocol.auth import KeyFileError
from runtime.keyfiles import generate_ed25519
from runtime.security import CoordinatorSecurity


def security(tmp_path: Path, devices: int) -> CoordinatorSecurity:
    folder = tmp_path / "devices"
    folder.mkdir()
    generate_ed25519(tmp_path / "coordinator.key", tmp_path / "coordinator.pub")
    for i in range(devices):
        generate_ed25519(tmp_path / f"dev-{i}.key", folder / f"dev-{i}.pub")
    (folder / "README").write_text("not a key")
    return CoordinatorSecurity(key=tmp_path / "coordinator.key", devices=folder)


def test_an_empty_devices_folder_is_refused_with_what_to_do(tmp_path):
    with pytest.raises(KeyFileError, match=r"no device is enrolled.*security\.insecure"):
        CoordinatorKeys.load(security(tmp_path, 0))


def test_a_quorum_above_the_enrolled_devices_is_named(tmp_path):
    keys = CoordinatorKeys.load(security(tmp_path, 2))
    assert sorted(keys.devices) == ["dev-0", "dev-1"]
    assert keys.quorum_problem(2) is None
    why = keys.quorum_problem(3)
    assert why is not None and "min_clients = 3 exceeds the 2 device(s)" in why
    assert CoordinatorKeys().quorum_problem(50) is None  # insecure: nobody is enrolled
