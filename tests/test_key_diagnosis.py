"""A coordinator that signs with another key than the one its devices pinned learns it from
them: each says bad_coordinator_signature in its status, and the coordinator logs it, lists
it in `edge-coordinator status` and counts it for the alert (docs/deploy.md, section 4)."""

from __future__ import annotations

import shutil

import pytest

from runtime.keyfiles import generate_ed25519
from tests.coordinator_helpers import coordinator_toml
from tests.process_helpers import agent_process, coordinator_process, status
from tests.test_agent_service import write_config


@pytest.mark.slow
def test_devices_that_refuse_the_coordinators_key_are_named_by_the_coordinator(
    mosquitto, small_zoo, tmp_path
):
    fleet_keys, other = tmp_path / "fleet-keys", tmp_path / "other-keys"
    generate_ed25519(fleet_keys / "coordinator.key", fleet_keys / "coordinator.pub")
    generate_ed25519(fleet_keys / "dev-a.key", fleet_keys / "devices" / "dev-a.pub")
    # Restarted with a valid key that is not the fleet's: the enrolment is unchanged.
    generate_ed25519(other / "coordinator.key", other / "coordinator.pub")
    shutil.copytree(fleet_keys / "devices", other / "devices")
    coordinator = coordinator_toml(tmp_path, mosquitto.address.port, clients=1, keys=other)
    agent, _ = write_config(
        tmp_path / "a", small_zoo, "dev-a", "clean", mosquitto.address.port, epochs=1
    )
    agent.write_text(
        agent.read_text().replace(
            "[security]\ninsecure = true\n",
            f'[security]\nkey = "{fleet_keys / "dev-a.key"}"\n'
            f'coordinator = "{fleet_keys / "coordinator.pub"}"\n',
        )
    )
    served = coordinator_process(coordinator)
    device = agent_process(agent)
    try:
        device.wait_for("announcement ignored")
        served.wait_for("client dev-a refuses this coordinator's announcements")
        shown = status("edge-coordinator", coordinator)
        assert shown["rejecting_announcements"] == ["dev-a"]
        (client,) = shown["clients"]
        assert client["reason"].startswith("bad_coordinator_signature")
        assert device.stop() == 0
    finally:
        device.close()
        served.close()
    assert status("edge-agent", agent)["ignored_announcements"]["announcement_bad_signature"] >= 1
