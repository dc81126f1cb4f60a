import pytest

from protocol import (
    InvalidId,
    Topic,
    TopicError,
    TopicKind,
    ids,
    parse_topic,
    round_topic,
    status_filter,
    status_topic,
    update_filter,
    update_topic,
    validate_id,
)
from protocol.limits import MAX_ID_LENGTH


def test_topics_have_the_documented_layout():
    assert round_topic("lab") == "protofleet/v1/lab/round"
    assert update_topic("lab", "dev-1") == "protofleet/v1/lab/update/dev-1"
    assert status_topic("lab", "dev.1_a") == "protofleet/v1/lab/status/dev.1_a"
    assert update_filter("lab") == "protofleet/v1/lab/update/+"
    assert status_filter("lab") == "protofleet/v1/lab/status/+"


@pytest.mark.parametrize(
    "topic, expected",
    [
        ("protofleet/v1/lab/round", Topic(TopicKind.ROUND, "lab")),
        ("protofleet/v1/lab/update/d1", Topic(TopicKind.UPDATE, "lab", "d1")),
        ("protofleet/v1/lab/status/d1", Topic(TopicKind.STATUS, "lab", "d1")),
    ],
)
def test_parse_inverts_the_builders(topic, expected):
    assert parse_topic(topic) == expected
    assert str(parse_topic(topic)) == topic


@pytest.mark.parametrize(
    "topic",
    [
        "protofleet/v2/lab/round",
        "other/v1/lab/round",
        "protofleet/v1/lab/round/extra",
        "protofleet/v1/lab/update",
        "protofleet/v1/lab/update/+",
        "protofleet/v1/lab/status/#",
        "protofleet/v1/+/round",
        "protofleet/v1/lab/unknown/d1",
        "protofleet/v1/lab/update/d1/x",
        "protofleet/v1//round",
        "",
    ],
)
def test_parse_rejects_anything_else(topic):
    with pytest.raises(TopicError):
        parse_topic(topic)


@pytest.mark.parametrize(
    "bad", ["", "a+b", "a#", "a/b", "a\x00b", "ä", "a b", "..", "x" * (MAX_ID_LENGTH + 1), 5, None]
)
def test_ids_outside_the_safe_alphabet_are_refused(bad):
    with pytest.raises(InvalidId):
        validate_id(bad, field="client")
    with pytest.raises(InvalidId):
        update_topic("lab", bad)


def test_invalid_id_names_its_field():
    with pytest.raises(InvalidId) as info:
        status_topic("la/b", "ok")
    assert info.value.field == "fleet"


def test_round_topic_has_no_client():
    with pytest.raises(TopicError):
        Topic(TopicKind.ROUND, "lab", "d1")


def test_an_id_found_safe_once_is_still_held_to_a_shorter_limit_and_the_cache_is_bounded():
    assert validate_id("dev-00042", field="client") == "dev-00042"
    assert "dev-00042" in ids._SAFE_SEEN  # the fast path is what is under test
    with pytest.raises(InvalidId):
        validate_id("dev-00042", field="client", max_length=5)
    with pytest.raises(InvalidId):
        validate_id("dev/00042", field="client")
    for i in range(ids._SAFE_SEEN_MAX + 3):
        validate_id(f"d{i}", field="client")
    assert len(ids._SAFE_SEEN) <= ids._SAFE_SEEN_MAX
    ids._SAFE_SEEN.clear()  # later tests start from an empty memory
