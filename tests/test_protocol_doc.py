"""docs/protocol.md names every field the reference encoder writes and every topic layout.

The fields come from real encodings (each message built, encoded with ``to_wire()`` and
its msgpack map walked), so a field added to the code and not to the spec fails here.
A field counts as documented when it appears as `name` in its kind's section.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import pytest

from protocol import PrototypeUpdate, RoundAnnouncement, Status, TopicKind
from protocol.auth import Auth, statement
from protocol.receipts import Receipt
from protocol.topics import Topic, status_filter, update_filter
from tests import factories

DOC = Path(__file__).parent.parent / "docs" / "protocol.md"

# Headings (their start) of the sections that must document each group of fields.
HEADER = "### Common header"
ARRAYS = "### Arrays"
AUTH = "### Signatures"
TOPICS = "## Topics"
KIND_SECTIONS = {
    PrototypeUpdate.KIND: "### `PrototypeUpdate`",
    RoundAnnouncement.KIND: "### `RoundAnnouncement`",
    Status.KIND: "### `Status`",
    Receipt.KIND: "### `Receipt`",
}
# Maps keyed by data (array names, parameter names, client ids), not by field names:
# their keys are not fields, their values may be arrays.
ID_KEYED = frozenset({"extras", "params", "local_sets", "client_globals"})

_AUTH = Auth(run="0123456789abcdef", signature=bytes(64))
_ARRAY = np.ones((2, 4), dtype=np.float16)


def _messages() -> list[Any]:
    """One message of each kind, signed where the kind can be, every map non-empty."""
    update = factories.update()
    announcement = factories.announcement(
        client_globals={"jetson-01": _ARRAY},
        extras={"clusters": np.ones((3, 4), dtype=np.float32)},
    )
    receipt = Receipt(fleet="lab", round=3, run=factories.RUN, client="jetson-01", digest="0" * 64)
    signed = [dataclasses.replace(m, auth=_AUTH) for m in (update, announcement, receipt)]
    return [*signed, factories.status()]


def _is_array(value: object) -> bool:
    return isinstance(value, dict) and set(value) == {"dtype", "shape", "data"}


def _fields(
    obj: dict[str, Any], section: str, *, id_keyed: bool = False
) -> Iterator[tuple[str, str]]:
    """(section, field name) for every key of ``obj`` and of the maps nested in it."""
    for key, value in obj.items():
        if not id_keyed:
            yield section, key
        if _is_array(value):
            yield from ((ARRAYS, k) for k in value)
        elif isinstance(value, dict):
            nested = AUTH if key == "auth" and not id_keyed else section
            yield from _fields(value, nested, id_keyed=key in ID_KEYED and not id_keyed)


def wire_fields() -> set[tuple[str, str]]:
    """Every (section, field) the reference encoder writes, from the encoded bytes."""
    found: set[tuple[str, str]] = set()
    for message in _messages():
        wire = msgpack.unpackb(message.to_wire(), raw=False)
        section = KIND_SECTIONS[wire["type"]]
        header = {k: wire.pop(k) for k in ("v", "type")}
        found |= {(HEADER, k) for k in header}
        found.add((HEADER, f'"{header["type"]}"'))  # the kind's `type` value is listed
        found |= set(_fields(wire, section))
    signed = statement(kind="update", fleet="lab", round_=3, client="c", run="r", body=b"")
    found |= {(AUTH, k) for k in msgpack.unpackb(signed, raw=False)}
    return found


def topic_patterns() -> set[str]:
    """Every topic layout and subscription filter, with ``<fleet>`` and ``<client>``."""
    fleet, client = "FLEETX", "CLIENTX"
    topics = {
        str(Topic(kind, fleet, None if kind is TopicKind.ROUND else client)) for kind in TopicKind
    }
    topics |= {update_filter(fleet), status_filter(fleet)}
    return {t.replace(fleet, "<fleet>").replace(client, "<client>") for t in topics}


def sections(doc: str) -> dict[str, str]:
    """Each heading line mapped to its text, up to the next heading of the same or a
    higher level."""
    lines = doc.splitlines()
    heads = [(i, len(m.group(1))) for i, ln in enumerate(lines) if (m := re.match(r"(#+) ", ln))]
    out = {}
    for n, (start, level) in enumerate(heads):
        end = next((i for i, lv in heads[n + 1 :] if lv <= level), len(lines))
        out[lines[start]] = "\n".join(lines[start:end])
    return out


def section(doc: str, heading: str) -> str:
    found = [text for head, text in sections(doc).items() if head.startswith(heading)]
    assert len(found) == 1, f"docs/protocol.md needs exactly one section {heading!r}"
    return found[0]


def undocumented(doc: str) -> list[str]:
    missing = [
        f"{name} (in {heading!r})"
        for heading, name in sorted(wire_fields())
        if f"`{name}`" not in section(doc, heading)
    ]
    topics = section(doc, TOPICS)
    missing += [t for t in sorted(topic_patterns()) if f"`{t}`" not in topics]
    return missing


def test_every_wire_field_and_topic_is_in_the_spec():
    assert undocumented(DOC.read_text(encoding="utf-8")) == []


def test_the_walk_finds_nested_fields():
    found = wire_fields()
    for expected in [
        (KIND_SECTIONS["update"], "guarantee"),
        (AUTH, "sig"),
        (AUTH, "h"),
        (ARRAYS, "data"),
        (KIND_SECTIONS["round"], "client_globals"),
        (KIND_SECTIONS["receipt"], "auth"),
        (HEADER, '"receipt"'),
    ]:
        assert expected in found
    # Keys of data-keyed maps are names, not fields.
    assert (KIND_SECTIONS["update"], "fisher") not in found
    assert (KIND_SECTIONS["round"], "jetson-01") not in found


@pytest.mark.parametrize(
    "heading, name",
    [
        (KIND_SECTIONS["update"], "guarantee"),
        (KIND_SECTIONS["round"], "client_globals"),
        (KIND_SECTIONS["status"], "last_round"),
        (KIND_SECTIONS["receipt"], "digest"),
        (AUTH, "sig"),
        (ARRAYS, "shape"),
    ],
)
def test_a_field_dropped_from_its_section_is_reported(heading, name):
    doc = DOC.read_text(encoding="utf-8")
    text = section(doc, heading)
    assert f"`{name}`" in text
    doc = doc.replace(text, text.replace(f"`{name}`", name))
    assert undocumented(doc) == [f"{name} (in {heading!r})"]


def test_a_topic_dropped_from_the_spec_is_reported():
    doc = DOC.read_text(encoding="utf-8")
    receipt = "`protofleet/v1/<fleet>/receipt/<client>`"
    assert undocumented(doc.replace(receipt, "the receipt topic")) == [receipt.strip("`")]
