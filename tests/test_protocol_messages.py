import math
from typing import Literal

import msgpack
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from protocol import (
    DEFAULT_MAX_PAYLOAD_BYTES,
    PROTOCOL_VERSION,
    ArrayError,
    FieldError,
    InvalidId,
    MalformedPayload,
    PayloadTooLarge,
    PrivacyMeta,
    ProtocolError,
    PrototypeUpdate,
    RoundAnnouncement,
    Status,
    UnsupportedVersion,
)
from tests import factories

ids = st.text(alphabet="abcXYZ019-_.", min_size=1, max_size=20).filter(
    lambda s: s not in {".", ".."}
)


@st.composite
def float_arrays(draw, rows: int | None = None, cols: int | None = None):
    dtype = draw(st.sampled_from([np.float16, np.float32]))
    width: Literal[16, 32] = 16 if dtype is np.float16 else 32
    shape = (
        rows if rows is not None else draw(st.integers(0, 6)),
        cols if cols is not None else draw(st.integers(0, 8)),
    )
    return draw(
        hnp.arrays(
            dtype,
            shape,
            elements=st.floats(allow_nan=False, allow_infinity=False, width=width),
        )
    )


@st.composite
def updates(draw):
    classes = tuple(draw(st.lists(st.integers(0, 4095), unique=True, max_size=6)))
    counts = tuple(
        draw(
            st.lists(
                st.one_of(st.integers(0, 10**6), st.floats(0, 1e6, allow_nan=False)),
                min_size=len(classes),
                max_size=len(classes),
            )
        )
    )
    extras = draw(st.dictionaries(ids, float_arrays(), max_size=3))
    epsilon = draw(st.one_of(st.none(), st.floats(0, 100)))
    delta = draw(st.one_of(st.none(), st.floats(0, 0.5)))
    return PrototypeUpdate(
        fleet=draw(ids),
        round=draw(st.integers(0, 2**31 - 1)),
        client=draw(ids),
        bundle=draw(st.text(min_size=1, max_size=64).filter(lambda s: "\x00" not in s)),
        method=draw(ids),
        classes=classes,
        counts=counts,
        prototypes=draw(float_arrays(rows=len(classes))),
        extras=extras,
        privacy=PrivacyMeta(mechanism=draw(ids), epsilon=epsilon, delta=delta, guarantee=draw(ids)),
    )


@st.composite
def announcements(draw):
    names = tuple(
        draw(
            st.lists(
                st.text(min_size=1, max_size=8).filter(lambda s: "\x00" not in s),
                unique=True,
                max_size=6,
            )
        )
    )
    present = (
        tuple(
            draw(st.lists(st.integers(0, max(len(names) - 1, 0)), unique=True, max_size=len(names)))
        )
        if names
        else ()
    )
    dim = draw(st.integers(0, 8))
    globals_ = draw(float_arrays(rows=len(present), cols=dim))
    clients = draw(st.lists(ids, unique=True, max_size=4))
    scalars = st.one_of(
        st.booleans(),
        st.integers(-10, 10),
        st.floats(-1e3, 1e3),
        st.text(max_size=8).filter(lambda s: "\x00" not in s),
    )
    return RoundAnnouncement(
        fleet=draw(ids),
        round=draw(st.integers(0, 2**31 - 1)),
        run=draw(ids),
        run_started=draw(st.floats(0, 4e9)),
        bundle=draw(st.text(alphabet="0123456789abcdef", min_size=1, max_size=64)),
        method=draw(ids),
        classes=names,
        dim=dim,
        deadline=draw(st.floats(0, 4e9)),
        params=draw(st.dictionaries(ids, scalars, max_size=4)),
        global_classes=present,
        global_prototypes=globals_,
        local_sets={c: draw(float_arrays(rows=len(present), cols=dim)) for c in clients},
        client_globals={c: draw(float_arrays(rows=len(present), cols=dim)) for c in clients[:1]},
        extras=draw(st.dictionaries(ids, float_arrays(), max_size=2)),
    )


@st.composite
def statuses(draw):
    return Status(
        fleet=draw(ids),
        client=draw(ids),
        state=draw(st.sampled_from(["online", "offline"])),
        version=draw(st.text(max_size=16).filter(lambda s: "\x00" not in s)),
        last_round=draw(st.one_of(st.none(), st.integers(0, 2**31 - 1))),
        reason=draw(st.text(max_size=40).filter(lambda s: "\x00" not in s)),
    )


@settings(max_examples=200, deadline=None)
@given(updates())
def test_update_round_trips(message):
    assert PrototypeUpdate.from_wire(message.to_wire()) == message


@pytest.mark.slow
@settings(max_examples=200, deadline=None)
@given(announcements())
def test_announcement_round_trips(message):
    assert RoundAnnouncement.from_wire(message.to_wire()) == message


@settings(max_examples=200, deadline=None)
@given(statuses())
def test_status_round_trips(message):
    assert Status.from_wire(message.to_wire()) == message


def test_equality_sees_array_dtype_and_values():
    a = factories.update()
    assert a == factories.update()
    assert a != factories.update(prototypes=a.prototypes.astype(np.float32))
    changed = a.prototypes.copy()
    changed[0, 0] += 1
    assert a != factories.update(prototypes=changed)


def test_arrays_are_read_only_and_detached_from_the_caller():
    protos = np.ones((3, 4), dtype=np.float32)
    message = factories.update(prototypes=protos)
    protos[0, 0] = 5.0
    assert message.prototypes[0, 0] == 1.0
    with pytest.raises(ValueError):
        message.prototypes[0, 0] = 2.0


def test_big_endian_input_is_stored_little_endian():
    protos = np.arange(12, dtype=">f4").reshape(3, 4)
    message = factories.update(prototypes=protos)
    decoded = PrototypeUpdate.from_wire(message.to_wire())
    assert decoded.prototypes.dtype == np.dtype("<f4")
    np.testing.assert_array_equal(decoded.prototypes, protos)


def _raw(message) -> dict:
    return msgpack.unpackb(message.to_wire(), raw=False)


def _encode(obj: dict) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def _decode_error(cls, obj: dict) -> ProtocolError:
    with pytest.raises(ProtocolError) as info:
        cls.from_wire(_encode(obj))
    return info.value


def test_unknown_version_is_refused():
    obj = _raw(factories.update())
    obj["v"] = PROTOCOL_VERSION + 1
    err = _decode_error(PrototypeUpdate, obj)
    assert isinstance(err, UnsupportedVersion) and err.field == "v"


@pytest.mark.parametrize(
    "name", ["fleet", "round", "client", "classes", "counts", "prototypes", "privacy", "extras"]
)
def test_missing_field_is_named(name):
    obj = _raw(factories.update())
    del obj[name]
    err = _decode_error(PrototypeUpdate, obj)
    assert isinstance(err, FieldError) and err.field == name


def test_unknown_field_is_named():
    obj = _raw(factories.status())
    obj["colour"] = "red"
    err = _decode_error(Status, obj)
    assert isinstance(err, FieldError) and err.field == "colour"


@pytest.mark.parametrize(
    "name, value",
    [
        ("round", "3"),
        ("round", True),
        ("round", -1),
        ("round", 1.0),
        ("classes", "012"),
        ("counts", [1, 2, "3"]),
    ],
)
def test_wrong_types_are_refused(name, value):
    obj = _raw(factories.update())
    obj[name] = value
    err = _decode_error(PrototypeUpdate, obj)
    assert err.field == name


def test_negative_counts_are_refused():
    obj = _raw(factories.update())
    obj["counts"] = [4, -1, 1]
    assert _decode_error(PrototypeUpdate, obj).field == "counts"


def test_duplicate_classes_are_refused():
    obj = _raw(factories.update())
    obj["classes"] = [0, 0, 5]
    assert _decode_error(PrototypeUpdate, obj).field == "classes"


def test_counts_must_match_classes():
    obj = _raw(factories.update())
    obj["counts"] = [1, 2]
    assert _decode_error(PrototypeUpdate, obj).field == "counts"


def test_shape_mismatch_with_byte_length_is_refused():
    obj = _raw(factories.update())
    obj["prototypes"]["shape"] = [3, 5]
    err = _decode_error(PrototypeUpdate, obj)
    assert isinstance(err, ArrayError) and err.field == "prototypes"


def test_prototype_rows_must_match_classes():
    obj = _raw(factories.update())
    obj["prototypes"]["shape"] = [6, 2]
    assert _decode_error(PrototypeUpdate, obj).field == "prototypes"


def test_float64_arrays_travel_bit_for_bit():
    # The closed-form methods' statistics add up exactly over a fleet: no rounding on the way.
    sums = np.random.default_rng(0).normal(size=(3, 4)) * 1e3
    back = PrototypeUpdate.from_wire(factories.update(prototypes=sums).to_wire())
    assert back.prototypes.dtype == np.float64
    assert np.array_equal(back.prototypes, sums)


@pytest.mark.parametrize("dtype", ["f16", "i4", "<f2", 2, None])
def test_unsupported_dtype_is_refused(dtype):
    obj = _raw(factories.update())
    obj["prototypes"]["dtype"] = dtype
    err = _decode_error(PrototypeUpdate, obj)
    assert isinstance(err, ArrayError) and err.field == "prototypes"


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_non_finite_values_are_refused(bad):
    protos = np.zeros((3, 4), dtype=np.float32)
    obj = _raw(factories.update(prototypes=protos))
    broken = protos.copy()
    broken[1, 2] = bad
    obj["prototypes"]["data"] = broken.tobytes()
    err = _decode_error(PrototypeUpdate, obj)
    assert isinstance(err, ArrayError) and err.field == "prototypes"
    with pytest.raises(ArrayError):
        factories.update(prototypes=broken)


def test_non_finite_extra_is_named():
    obj = _raw(factories.update())
    fisher = np.zeros((3, 4), dtype=np.float32)
    fisher[0, 0] = np.nan
    obj["extras"]["fisher"]["data"] = fisher.tobytes()
    assert _decode_error(PrototypeUpdate, obj).field == "extras.fisher"


def test_non_finite_epsilon_is_refused():
    obj = _raw(factories.update())
    obj["privacy"]["epsilon"] = math.nan
    assert _decode_error(PrototypeUpdate, obj).field == "privacy.epsilon"


def test_payload_over_the_cap_is_refused_before_decoding():
    payload = factories.update().to_wire()
    with pytest.raises(PayloadTooLarge):
        PrototypeUpdate.from_wire(payload, max_bytes=len(payload) - 1)
    assert PrototypeUpdate.from_wire(payload, max_bytes=len(payload)) == factories.update()
    with pytest.raises(PayloadTooLarge):
        PrototypeUpdate.from_wire(b"\x00" * (DEFAULT_MAX_PAYLOAD_BYTES + 1))


def test_wrong_message_type_is_refused():
    with pytest.raises(MalformedPayload):
        Status.from_wire(factories.update().to_wire())


def test_unsafe_ids_inside_messages_are_refused():
    obj = _raw(factories.update())
    obj["client"] = "dev/../../x"
    err = _decode_error(PrototypeUpdate, obj)
    assert isinstance(err, InvalidId) and err.field == "client"


def test_announcement_local_sets_must_align_with_globals():
    with pytest.raises(FieldError) as info:
        factories.announcement(local_sets={"a": np.zeros((3, 4), dtype=np.float16)})
    assert info.value.field == "local_sets.a"


def test_announcement_global_class_must_index_the_class_list():
    with pytest.raises(FieldError) as info:
        factories.announcement(global_classes=(0, 3))
    assert info.value.field == "global_classes"


def test_global_of_prefers_the_client_specific_set():
    own = np.full((2, 4), 0.5, dtype=np.float16)
    message = factories.announcement(client_globals={"jetson-01": own})
    np.testing.assert_array_equal(message.global_of("jetson-01"), own)
    np.testing.assert_array_equal(message.global_of("jetson-02"), message.global_prototypes)


def test_status_state_is_checked():
    obj = _raw(factories.status())
    obj["state"] = "sleeping"
    assert _decode_error(Status, obj).field == "state"


def test_float16_update_of_ten_classes_is_compact():
    z = np.zeros((10, 256), dtype=np.float16)
    message = factories.update(
        classes=tuple(range(10)), counts=(100,) * 10, prototypes=z, extras={}
    )
    assert len(message.to_wire()) <= 6000
