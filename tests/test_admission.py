"""Admission checks: what the configuration fixes, the bounds that keep every aggregate
finite, and stored rows that today's checks refuse."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from closed_form import upper_triangle
from closed_form.projection import basis_check
from coordinator.admission import Admission
from coordinator.closed_form_settings import ClosedFormSettings
from coordinator.config import AdmissionSettings, ModelSettings
from coordinator.metrics import Metrics
from coordinator.rounds import RoundManager
from coordinator.storage.store import Store
from coordinator.strategies import available
from edge_agent.train import LocalModel
from edge_agent.train_config import TrainConfig
from protocol import PrivacyMeta
from protocol.methods import wire_method
from protocol.weights import averaged_weight_shapes
from tests.coordinator_helpers import BUNDLE, CLASSES, DIM, config, stand_in_update

#: The most samples one device of the closed-form methods may have in these tests.
SAMPLES = 1e9


class Clock:
    def __init__(self) -> None:
        self.now = 1_000.0

    def __call__(self) -> float:
        return self.now


@pytest.mark.parametrize("norm", ["batch", "group"])
def test_the_configured_weight_table_is_what_a_device_sends(norm):
    model = LocalModel(in_dim=24, num_classes=5, cfg=TrainConfig(out_dim=32, norm=norm))
    sent = {
        k: tuple(v.shape)
        for k, v in model.state_dict().items()
        if k.startswith(("head.", "classifier.")) and v.dtype.is_floating_point
    }
    assert sent == averaged_weight_shapes(feature_dim=24, out_dim=32, num_classes=5, norm=norm)


def checks(method: str = "fedpcl", **kw) -> Admission:
    fields = dict(
        fleet="lab",
        bundle=BUNDLE,
        method=method,
        classes=len(CLASSES),
        dim=DIM,
        max_count=100.0,
        max_value=2.0,
        feature_dim=6,
    )
    fields.update(kw)
    return Admission.for_fleet(**fields)  # type: ignore[arg-type]


def test_every_bound_is_checked_before_anything_is_stored():
    good = stand_in_update(0, 0)
    assert checks().check(good) is None
    replace = dataclasses.replace
    assert checks().check(replace(good, counts=(100, 101))) == "count_above_max"
    assert checks().check(replace(good, counts=(1e308, 1))) == "count_above_max"
    big = np.full((2, DIM), 2.5, np.float16)
    assert checks().check(replace(good, prototypes=big)) == "value_above_max"
    assert checks().check(replace(good, extras={"x": np.ones(2, np.float32)})) == "wrong_extras"
    assert checks().check(good, topic_client="dev-1") == "client_mismatch"
    assert checks(allow_list=("dev-1",)).check(good) == "not_allowed"
    # FedDBP: exactly the Fisher scores, shaped as the update's own prototypes.
    dbp = replace(good, method="feddbp")
    assert checks("feddbp").check(dbp) == "wrong_extras"
    fisher = np.ones(good.prototypes.shape, np.float32)
    assert checks("feddbp").check(replace(dbp, extras={"fisher": fisher})) is None
    assert checks("feddbp").check(replace(dbp, extras={"fisher": fisher[:1]})) == "wrong_extras"


def test_fedavg_weights_must_have_the_configured_names_and_shapes():
    shapes = averaged_weight_shapes(feature_dim=6, out_dim=DIM, num_classes=len(CLASSES))
    weights = {n: np.zeros(s, np.float32) for n, s in shapes.items()}
    good = dataclasses.replace(stand_in_update(0, 0, method="fedavg"), extras=weights)
    assert checks("fedavg").check(good) is None
    fewer = dict(weights)
    fewer.pop("classifier.bias")
    assert checks("fedavg").check(dataclasses.replace(good, extras=fewer)) == "wrong_extras"
    other = {**weights, "head.fc.weight": np.zeros((DIM, 7), np.float32)}
    assert checks("fedavg").check(dataclasses.replace(good, extras=other)) == "wrong_extras"
    assert checks("fedavg", norm="group").check(good) == "wrong_extras"  # no BN statistics


@pytest.mark.parametrize("method", sorted(set(available()) - {"solo"}))
def test_no_admitted_update_makes_an_aggregate_non_finite(tmp_path, method):
    # Every update at the admission bounds, with opposite signs so nothing cancels early:
    # the weighted sums must stay finite and every announced value within max_value.
    limits = AdmissionSettings(max_count=1e9, max_value=65504.0)
    cfg = dataclasses.replace(
        config(tmp_path, method=method, feature_dim=6, min_clients=40, wait_after_quorum_s=0.0),
        admission=limits,
        closed_form=ClosedFormSettings(release="noisy", max_samples=SAMPLES),
    )
    # Announced in float16, whose range a closed-form head is scaled into (a float32 head
    # is sent as solved).
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, announce_dtype="f2"))
    checks_ = cfg.admission_checks()
    m = RoundManager(config=cfg, store=Store(cfg.database), metrics=Metrics(), clock=Clock())
    shapes = averaged_weight_shapes(feature_dim=6, out_dim=DIM, num_classes=len(CLASSES))
    for i in range(40):
        sign = 1.0 if i % 2 else -1.0
        u = stand_in_update(i, 0, method=method)
        protos = np.full(u.prototypes.shape, sign * 65504.0, np.float16)
        extras: dict[str, np.ndarray] = {}
        if method in ("fedavg", "fpl"):
            extras = {n: np.full(s, sign * 65504.0, np.float32) for n, s in shapes.items()}
        elif method == "feddbp":
            extras = {"fisher": np.full(u.prototypes.shape, 65504.0, np.float32)}
        counts = (1e9,) * len(u.classes)
        if wire_method(method).closed_form:
            # At one device's bounds ([closed_form] max_samples): the counts as drawn,
            # class sums as long as their counts, a second moment of trace N.
            each = SAMPLES / len(u.classes)
            counts = (each,) * len(u.classes)
            protos = np.full(u.prototypes.shape, sign * each / np.sqrt(DIM))
            extras = {"counts": np.full(len(u.classes), each), "basis": basis_check("lab", 6, DIM)}
            if wire_method(method).gram:
                extras["gram"] = upper_triangle(np.eye(DIM) * SAMPLES / DIM)
        u = dataclasses.replace(u, counts=counts, prototypes=protos, extras=extras)
        # A release that says it is noisy: held to the bounds alone (an exact one this long
        # is refused as impossible_norm or implausible_statistics).
        mechanism = "dp-features" if wire_method(method).closed_form else "dp"
        noisy = PrivacyMeta(mechanism=mechanism, epsilon=1.0, delta=1e-5, guarantee="dp")
        u = dataclasses.replace(u, privacy=noisy)
        assert checks_.check(u) is None
        assert m.offer(u.to_wire(), topic_client=u.client).accepted
    nxt = m.poll()
    assert nxt is not None and nxt.round == 1  # RoundAnnouncement refuses non-finite arrays
    arrays = [nxt.global_prototypes, *nxt.local_sets.values(), *nxt.extras.values()]
    assert all(np.isfinite(a).all() and np.abs(a).max(initial=0) <= 65504 for a in arrays)


@pytest.mark.parametrize("method", ["fedpcl", "fedproto", "fedavg", "fpl", "feddbp"])
def test_an_exact_row_longer_than_one_is_impossible(method):
    # Prototypes are means of unit-norm embeddings: an exact row past 1 (+ rounding) is a
    # lie; a noised one is not held to it (its noise lengthens every row).
    u = stand_in_update(1, 0, method=method)
    admission = checks(method)
    extras = {n: np.zeros(s, np.float32) for n, s in (admission.extras or {}).items()}
    if admission.extras is None:
        extras = {"fisher": np.ones(u.prototypes.shape, np.float32)}
    rows = np.zeros(u.prototypes.shape, np.float32)
    rows[:, 0] = 1.0005  # float16 rounding of a unit row stays within this
    fine = dataclasses.replace(u, prototypes=rows, extras=extras)
    assert admission.check(fine) is None
    rows[0, 0] = 1.01
    long = dataclasses.replace(fine, prototypes=rows)
    assert admission.check(long) == "impossible_norm"
    noisy = PrivacyMeta(mechanism="dp", epsilon=1.0, delta=1e-5, guarantee="dp")
    assert admission.check(dataclasses.replace(long, privacy=noisy)) is None


def test_an_exact_count_must_be_whole():
    u = stand_in_update(1, 0)
    assert checks().check(dataclasses.replace(u, counts=(3.0, 4))) is None
    assert checks().check(dataclasses.replace(u, counts=(3.5, 4))) == "fractional_count"
    noisy = PrivacyMeta(mechanism="dp", epsilon=1.0, delta=1e-5, guarantee="dp")
    assert checks().check(dataclasses.replace(u, counts=(3.5, 4), privacy=noisy)) is None


def test_a_stored_update_todays_checks_refuse_is_quarantined_on_resume(tmp_path):
    clock = Clock()
    cfg = config(tmp_path, min_clients=2, wait_after_quorum_s=0.0)
    m = RoundManager(config=cfg, store=Store(cfg.database), metrics=Metrics(), clock=clock)
    honest = [stand_in_update(i, 0) for i in range(3)]
    for u in honest[:2]:
        assert m.offer(u.to_wire(), topic_client=u.client).accepted
    # What an older version admitted: it crashed every close, and every restart.
    huge = dataclasses.replace(honest[2], counts=(1e308, 1e308))
    m.store.add_update(0, huge.client, huge.to_wire(), received_at=clock.now)
    m.store.close()
    again = RoundManager(config=cfg, store=Store(cfg.database), metrics=Metrics(), clock=clock)
    assert again.metrics.value("protofleet_updates_quarantined_total") == 1
    nxt = again.poll()
    assert nxt is not None and set(nxt.local_sets) == {"dev-0", "dev-1"}
    summary = again.store.summary()
    assert summary["quarantined"] == 1
    assert summary["rejections"] == {"quarantined_count_above_max": 1}


def test_fedavg_and_fpl_need_the_feature_size_in_the_configuration():
    with pytest.raises(ValueError, match="feature_dim is required for fedavg"):
        ModelSettings(method="fedavg")
    ModelSettings(method="fedavg", feature_dim=1536)
    with pytest.raises(ValueError, match="max_value"):
        AdmissionSettings(max_value=1e5)
