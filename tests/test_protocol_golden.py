"""Golden bytes: the wire format of each message type may not change silently.

A deliberate format change bumps PROTOCOL_VERSION and rewrites these files with
``python -m tests.test_protocol_golden``.
"""

from collections.abc import Callable
from pathlib import Path

import pytest

from protocol import Message, PrototypeUpdate, RoundAnnouncement, Status
from tests import factories

GOLDEN = Path(__file__).parent / "golden"
CASES: dict[str, tuple[type[Message], Callable[[], Message]]] = {
    "update": (PrototypeUpdate, factories.update),
    "round": (RoundAnnouncement, factories.announcement),
    "status": (Status, factories.status),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_encoding_matches_golden_bytes(name):
    cls, make = CASES[name]
    golden = bytes.fromhex((GOLDEN / f"{name}.hex").read_text())
    assert make().to_wire() == golden
    assert cls.from_wire(golden) == make()


if __name__ == "__main__":
    for name, (_, make) in CASES.items():
        (GOLDEN / f"{name}.hex").write_text(make().to_wire().hex() + "\n")
