"""Random and mutated bytes may only ever raise ProtocolError from a decoder."""

import collections

import pytest

from protocol import ProtocolError, PrototypeUpdate, RoundAnnouncement, Status
from tests import factories
from tests.fuzz_corpus import payloads

CASES = [
    # decoder, valid payloads to mutate, seed, reasons the corpus must reach
    (
        PrototypeUpdate,
        [factories.update().to_wire()],
        11,
        ("malformed", "field", "array", "id", "version"),
    ),
    (
        RoundAnnouncement,
        [factories.announcement().to_wire()],
        12,
        ("malformed", "field", "array", "id", "version"),
    ),
    (Status, [factories.status().to_wire()], 13, ("malformed", "field", "id", "version")),
]


@pytest.mark.parametrize(
    "cls, valid, seed, expected", CASES, ids=lambda c: getattr(c, "__name__", "")
)
def test_decoders_raise_only_protocol_errors(cls, valid, seed, expected):
    reasons: collections.Counter[str] = collections.Counter()
    for payload in payloads(valid, count=10_000, seed=seed):
        try:
            cls.from_wire(payload)
        except ProtocolError as exc:
            reasons[exc.reason] += 1
        else:
            reasons["accepted"] += 1
    assert sum(reasons.values()) == 10_000
    # The corpus must exercise the validators, not just msgpack's parser.
    for reason in expected:
        assert reasons[reason] > 0, reasons
