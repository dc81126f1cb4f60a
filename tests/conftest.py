from collections.abc import Iterator

import pytest

from fleet.broker import MosquittoBroker


@pytest.fixture
def mosquitto() -> Iterator[MosquittoBroker]:
    """A real Mosquitto on a free loopback port, private to one test."""
    with MosquittoBroker() as broker:
        yield broker
