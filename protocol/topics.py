"""Topic builders and the single parser for every protocol topic.

Layout (``<fleet>`` and ``<client>`` are safe ids, see :mod:`protocol.ids`)::

    protofleet/v1/<fleet>/round              retained announcement of the open round
    protofleet/v1/<fleet>/update/<client>    one client's prototype update
    protofleet/v1/<fleet>/status/<client>    retained online/offline status
    protofleet/v1/<fleet>/receipt/<client>   the coordinator's receipt for a stored update

and, apart from them, the secure-aggregation stage topics (:class:`SecAggTopic`, parsed by
:func:`parse_secagg_topic`)::

    protofleet/v1/<fleet>/secagg/up/<client>    device <client>'s stage messages
    protofleet/v1/<fleet>/secagg/down/<client>  the coordinator's stage messages to <client>

Every coordinator stage message names its recipient, and its signature covers that name,
so there is no broadcast topic: a device reads its own ``down`` topic only, which a broker
ACL can hold it to (``secagg/down/%u``), as it holds it to writing ``secagg/up/%u``. The
secure-aggregation topics are a layout of their own, not a :class:`TopicKind`:
:func:`parse_topic` refuses them, so a service that does not run the protocol counts one
as a stray topic rather than misreading it.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from enum import Enum

from protocol.errors import InvalidId, TopicError
from protocol.ids import validate_id
from protocol.limits import TOPIC_ROOT, TOPIC_VERSION

_PREFIX = f"{TOPIC_ROOT}/{TOPIC_VERSION}"


class TopicKind(str, Enum):
    ROUND = "round"
    UPDATE = "update"
    STATUS = "status"
    RECEIPT = "receipt"


@dataclass(frozen=True)
class Topic:
    """A parsed protocol topic; ``client`` is ``None`` only for the round topic."""

    kind: TopicKind
    fleet: str
    client: str | None = None

    def __post_init__(self) -> None:
        validate_id(self.fleet, field="fleet")
        if self.kind is TopicKind.ROUND:
            if self.client is not None:
                raise TopicError("the round topic has no client level", field="topic")
        else:
            validate_id(self.client, field="client")

    def __str__(self) -> str:
        if self.kind is TopicKind.ROUND:
            return f"{_PREFIX}/{self.fleet}/round"
        return f"{_PREFIX}/{self.fleet}/{self.kind.value}/{self.client}"


def round_topic(fleet: str) -> str:
    return str(Topic(TopicKind.ROUND, fleet))


def update_topic(fleet: str, client: str) -> str:
    return str(Topic(TopicKind.UPDATE, fleet, client))


def status_topic(fleet: str, client: str) -> str:
    return str(Topic(TopicKind.STATUS, fleet, client))


def receipt_topic(fleet: str, client: str) -> str:
    return str(Topic(TopicKind.RECEIPT, fleet, client))


def update_filter(fleet: str) -> str:
    """Subscription filter matching every client's update topic in ``fleet``."""
    return f"{_PREFIX}/{validate_id(fleet, field='fleet')}/update/+"


def status_filter(fleet: str) -> str:
    """Subscription filter matching every client's status topic in ``fleet``."""
    return f"{_PREFIX}/{validate_id(fleet, field='fleet')}/status/+"


@functools.lru_cache(maxsize=4096)
def parse_topic(topic: str) -> Topic:
    """Parse a concrete topic (no wildcards) into a :class:`Topic`.

    Raises :class:`TopicError` for anything that is not exactly one of the three layouts.
    Cached: a coordinator parses the same few hundred device topics over and over, and a
    flood on one topic must cost little per message (errors are not cached).
    """
    if not isinstance(topic, str):
        raise TopicError("topic must be a string", field="topic")
    parts = topic.split("/")
    if len(parts) < 4 or parts[0] != TOPIC_ROOT:
        raise TopicError(f"not a {TOPIC_ROOT} topic: {topic!r}", field="topic")
    if parts[1] != TOPIC_VERSION:
        raise TopicError(f"unsupported topic version {parts[1]!r}", field="topic")
    fleet, kind = parts[2], parts[3]
    try:
        if kind == TopicKind.ROUND.value and len(parts) == 4:
            return Topic(TopicKind.ROUND, fleet)
        per_client = (TopicKind.UPDATE.value, TopicKind.STATUS.value, TopicKind.RECEIPT.value)
        if kind in per_client and len(parts) == 5:
            return Topic(TopicKind(kind), fleet, parts[4])
    except InvalidId as exc:
        raise TopicError(f"bad id in topic {topic!r}: {exc}", field="topic") from exc
    raise TopicError(f"unknown topic layout: {topic!r}", field="topic")


SECAGG_LEVEL = "secagg"


class SecAggDirection(str, Enum):
    """Which way a secure-aggregation stage message goes."""

    UP = "up"  # device -> coordinator
    DOWN = "down"  # coordinator -> device


@dataclass(frozen=True)
class SecAggTopic:
    """A parsed secure-aggregation topic: the device ``client`` sends on ``up`` and is
    sent to on ``down``."""

    direction: SecAggDirection
    fleet: str
    client: str

    def __post_init__(self) -> None:
        if not isinstance(self.direction, SecAggDirection):
            raise TopicError(f"{self.direction!r} is not a direction", field="topic")
        validate_id(self.fleet, field="fleet")
        validate_id(self.client, field="client")

    def __str__(self) -> str:
        return f"{_PREFIX}/{self.fleet}/{SECAGG_LEVEL}/{self.direction.value}/{self.client}"


def secagg_up_topic(fleet: str, client: str) -> str:
    return str(SecAggTopic(SecAggDirection.UP, fleet, client))


def secagg_down_topic(fleet: str, client: str) -> str:
    return str(SecAggTopic(SecAggDirection.DOWN, fleet, client))


def secagg_up_filter(fleet: str) -> str:
    """Subscription filter matching every device's secure-aggregation topic in ``fleet``."""
    return f"{_PREFIX}/{validate_id(fleet, field='fleet')}/{SECAGG_LEVEL}/up/+"


@functools.lru_cache(maxsize=4096)
def parse_secagg_topic(topic: str) -> SecAggTopic:
    """Parse a concrete secure-aggregation topic (no wildcards) into a :class:`SecAggTopic`.

    Raises :class:`TopicError` for anything that is not exactly one of its two layouts,
    with the checks of :func:`parse_topic`; cached like it (errors are not cached).
    """
    if not isinstance(topic, str):
        raise TopicError("topic must be a string", field="topic")
    parts = topic.split("/")
    if len(parts) != 6 or parts[0] != TOPIC_ROOT or parts[3] != SECAGG_LEVEL:
        raise TopicError(f"not a secure-aggregation topic: {topic!r}", field="topic")
    if parts[1] != TOPIC_VERSION:
        raise TopicError(f"unsupported topic version {parts[1]!r}", field="topic")
    try:
        direction = SecAggDirection(parts[4])
    except ValueError as exc:
        raise TopicError(f"unknown direction in topic {topic!r}", field="topic") from exc
    try:
        return SecAggTopic(direction, parts[2], parts[5])
    except InvalidId as exc:
        raise TopicError(f"bad id in topic {topic!r}: {exc}", field="topic") from exc
