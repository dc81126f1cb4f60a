"""The secure-aggregation stage topics: their layout, their parser, and their place in the
spec (docs/protocol.md names every topic and every field of the stage messages)."""

from __future__ import annotations

from typing import Any

import msgpack
import pytest

from protocol.errors import InvalidId, TopicError
from protocol.limits import MAX_ID_LENGTH
from protocol.topics import (
    SecAggDirection,
    SecAggTopic,
    parse_secagg_topic,
    parse_topic,
    secagg_down_topic,
    secagg_up_filter,
    secagg_up_topic,
)
from secagg.consistency import Survivors
from secagg.messages import (
    CIPHERTEXT_BYTES,
    KEY_BYTES,
    SHARE_BYTES,
    Abort,
    Advertise,
    Close,
    MaskedInput,
    PublicKeys,
    RelayedShares,
    Roster,
    SecAggMessage,
    ShareKeys,
    Stage,
    Unmask,
)
from tests.test_protocol_doc import DOC, section

SECTION = "## Secure aggregation"


def test_secagg_topics_have_the_documented_layout() -> None:
    assert secagg_up_topic("lab", "dev-1") == "protofleet/v1/lab/secagg/up/dev-1"
    assert secagg_down_topic("lab", "dev.1_a") == "protofleet/v1/lab/secagg/down/dev.1_a"
    assert secagg_up_filter("lab") == "protofleet/v1/lab/secagg/up/+"


@pytest.mark.parametrize(
    ("topic", "expected"),
    [
        ("protofleet/v1/lab/secagg/up/d1", SecAggTopic(SecAggDirection.UP, "lab", "d1")),
        ("protofleet/v1/lab/secagg/down/d1", SecAggTopic(SecAggDirection.DOWN, "lab", "d1")),
    ],
)
def test_the_secagg_parser_inverts_the_builders(topic: str, expected: SecAggTopic) -> None:
    assert parse_secagg_topic(topic) == expected
    assert str(parse_secagg_topic(topic)) == topic


@pytest.mark.parametrize(
    "topic",
    [
        "protofleet/v2/lab/secagg/up/d1",
        "other/v1/lab/secagg/up/d1",
        "protofleet/v1/lab/secagg/up",
        "protofleet/v1/lab/secagg/up/+",
        "protofleet/v1/lab/secagg/down/#",
        "protofleet/v1/+/secagg/up/d1",
        "protofleet/v1/lab/secagg/sideways/d1",
        "protofleet/v1/lab/secagg/up/d1/x",
        "protofleet/v1/lab/update/d1",
        "protofleet/v1/lab/round",
        "protofleet/v1//secagg/up/d1",
        "",
    ],
)
def test_the_secagg_parser_rejects_anything_else(topic: str) -> None:
    with pytest.raises(TopicError):
        parse_secagg_topic(topic)


def test_the_round_parser_refuses_secagg_topics() -> None:
    # A service that does not run the protocol counts one as a stray topic.
    with pytest.raises(TopicError):
        parse_topic(secagg_up_topic("lab", "d1"))


@pytest.mark.parametrize("bad", ["", "a+b", "a#", "a/b", "..", "x" * (MAX_ID_LENGTH + 1), None])
def test_secagg_topics_refuse_unsafe_ids(bad: object) -> None:
    with pytest.raises(InvalidId):
        secagg_up_topic("lab", bad)  # type: ignore[arg-type]
    with pytest.raises(InvalidId):
        secagg_down_topic(bad, "d1")  # type: ignore[arg-type]
    with pytest.raises(InvalidId):
        secagg_up_filter(bad)  # type: ignore[arg-type]


def test_a_direction_must_be_one_of_the_two() -> None:
    with pytest.raises(TopicError):
        SecAggTopic("up", "lab", "d1")  # type: ignore[arg-type]


# The spec's section.


def _stage_messages() -> list[SecAggMessage]:
    """One message of each stage kind, every list and map non-empty."""
    keys = PublicKeys(c=bytes(KEY_BYTES), s=bytes(range(KEY_BYTES)))
    head: dict[str, Any] = {"fleet": "lab", "round": 3, "client": "d1"}
    ct = {"d2": bytes(CIPHERTEXT_BYTES)}
    return [
        Advertise(**head, keys=keys),
        Roster(**head, clients=("d1", "d2"), keys={"d1": keys}),
        ShareKeys(**head, ciphertexts=ct),
        RelayedShares(**head, ciphertexts=ct),
        MaskedInput(**head, bits=32, masked=bytes(8)),
        Survivors(**head, survivors=("d1", "d2")),
        Unmask(
            **head, seed_shares={"d1": bytes(SHARE_BYTES)}, key_shares={"d2": bytes(SHARE_BYTES)}
        ),
        Close(**head, summed=True),
        Abort(**head, stage=Stage.SHARE, reason="too few"),
    ]


def test_the_spec_names_every_secagg_topic_kind_and_field() -> None:
    text = section(DOC.read_text(encoding="utf-8"), SECTION)
    wanted = {
        "`protofleet/v1/<fleet>/secagg/up/<client>`",
        "`protofleet/v1/<fleet>/secagg/down/<client>`",
        "`protofleet/v1/<fleet>/secagg/up/+`",
    }
    for message in _stage_messages():
        wire = msgpack.unpackb(message.to_wire(), raw=False)
        del wire["v"]  # the common header's, documented there
        wanted.add(f'`type = "{wire.pop("type")}"`')
        wanted |= {f"`{key}`" for key in wire}
    wanted |= {f"`{stage.value}`" for stage in Stage}
    assert sorted(name for name in wanted if name not in text) == []
