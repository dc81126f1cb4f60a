"""Closed-form test vectors (docs/vectors/closed_form.json): the fleet's projection, a small
fleet's statistics as its updates carry them, and the heads the coordinator announces from
them, so that a device written in another language can check itself against the reference
(docs/protocol.md, "Closed-form statistics").

The projection is made of operations IEEE 754 rounds exactly, summed in a stated order, so
it is rebuilt and compared byte for byte. The statistics and the float64 heads go through
BLAS and LAPACK, whose last bits depend on the build; they are compared to 1e-12, and the
head as announced (float32) byte for byte. ``python -m tests.test_closed_form_vectors``
rewrites the file after a deliberate change.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

import closed_form as cf
from closed_form.projection import (
    basis_check,
    ordered_sum,
    prepare,
    projection,
    projection_seed,
    splitmix64,
    uniform_values,
)
from coordinator.closed_form_settings import ClosedFormSettings
from coordinator.config import CoordinatorConfig, ModelSettings, RoundSettings
from coordinator.metrics import Metrics
from coordinator.rounds import RoundManager
from coordinator.rounds.announcements import within_dtype
from coordinator.storage.store import Store
from coordinator.strategies import Aggregate, make_strategy
from edge_agent.closed_form import StatisticsRelease
from protocol import PrototypeUpdate
from protocol.methods import BASIS, BIAS, COUNTS, GRAM
from runtime.security import CoordinatorSecurity

VECTORS = Path(__file__).resolve().parent.parent / "docs" / "vectors" / "closed_form.json"
BUNDLE = "b" * 64
#: The statistics vectors' fleet: 3 devices, 16 backbone features projected to 4.
FLEET, D, K, C = "vectors", 16, 4, 3
#: (fleet, D, k) of the projection vectors: the small one whole, a realistic one by its
#: first rows and a digest.
PROJECTIONS = ((FLEET, D, K), ("lab", 896, 64))
HEADS: dict[str, dict[str, Any]] = {"lda": {}, "ridge": {"lam": 0.1}, "fedcof": {"lam": 0.1}}


def f8(a: Any) -> str:
    return np.ascontiguousarray(a, dtype="<f8").tobytes().hex()


def f4(a: Any) -> str:
    return np.ascontiguousarray(a, dtype="<f4").tobytes().hex()


def from_hex(text: str, dtype: str = "<f8") -> np.ndarray:
    return np.frombuffer(bytes.fromhex(text), dtype=dtype)


def projection_vector(fleet: str, d: int, k: int) -> dict[str, Any]:
    q = projection(fleet, d, k)
    assert q is not None
    seed = projection_seed(fleet)
    out: dict[str, Any] = {
        "fleet": fleet,
        "feature_dim": d,
        "dim": k,
        "seed": f"{seed:016x}",
        "first_words": [f"{int(w):016x}" for w in splitmix64(seed, 4)],
        "first_values": f8(uniform_values(seed, 4)),
        "first_rows": f8(q[:3]),
        "matrix_sha256": hashlib.sha256(np.ascontiguousarray(q, "<f8").tobytes()).hexdigest(),
        "basis": f8(basis_check(fleet, d, k)),
    }
    if d * k <= 64:
        out["matrix"] = f8(q)
    return out


def device_data() -> list[tuple[np.ndarray, np.ndarray]]:
    """Three devices' backbone features (N, 16) and labels; the third lacks class 2."""
    rng = np.random.default_rng(54)
    centres = rng.normal(size=(C, D))
    out = []
    for n, classes in ((9, C), (7, C), (6, C - 1)):
        y = np.sort(rng.integers(0, classes, size=n))
        out.append((centres[y] + 0.8 * rng.normal(size=(n, D)), y))
    return out


def device_update(x: np.ndarray, y: np.ndarray, client: str, method: str) -> PrototypeUpdate:
    rows = prepare(x, projection(FLEET, D, K))
    stats = cf.device_statistics(rows, y, C, gram=method != "fedcof")
    release = StatisticsRelease.of(stats, basis=basis_check(FLEET, D, K))
    update = release.update(fleet=FLEET, round_=0, client=client, bundle=BUNDLE, method=method)
    return PrototypeUpdate.from_wire(update.to_wire())


def head_vector(method: str, updates: list[PrototypeUpdate]) -> dict[str, Any]:
    aggregate = make_strategy(method, **HEADS[method]).aggregate(updates, num_classes=C, dim=K)
    sent = within_dtype(aggregate, np.float32)
    return {
        **HEADS[method],
        "global_classes": list(aggregate.global_classes),
        "weight": f8(aggregate.global_prototypes),
        "bias": f8(aggregate.extras[BIAS]),
        "announced_weight_f4": f4(sent.global_prototypes),
        "announced_bias_f4": f4(sent.extras[BIAS]),
    }


def statistics_vectors() -> dict[str, Any]:
    devices = []
    heads: dict[str, Any] = {}
    data = device_data()
    for method in HEADS:
        updates = [device_update(x, y, f"d{i}", method) for i, (x, y) in enumerate(data)]
        heads[method] = head_vector(method, updates)
        if method != "lda":
            continue
        for (x, y), u in zip(data, updates, strict=True):
            devices.append({
                "client": u.client,
                "features_shape": list(x.shape),
                "features": f8(x),
                "labels": [int(v) for v in y],
                "classes": list(u.classes),
                "counts": list(u.counts),
                "prototypes": f8(u.prototypes),
                "extras": {name: f8(u.extras[name]) for name in (COUNTS, GRAM, BASIS)},
            })  # fmt: skip
    summed = cf.merge(
        cf.device_statistics(prepare(x, projection(FLEET, D, K)), y, C) for x, y in data
    )
    assert summed.gram is not None
    n = float(summed.counts.sum())
    mu = summed.sums / summed.counts[:, None]
    within = summed.gram - (mu.T * summed.counts) @ mu
    sigma = within / (n - C)
    heads["lda"]["oas_shrinkage"] = f8([cf.oas_shrinkage(sigma, n)])
    return {
        "fleet": FLEET,
        "feature_dim": D,
        "dim": K,
        "classes": C,
        "devices": devices,
        "heads": heads,
    }


def build() -> dict[str, Any]:
    return {
        "about": (
            "ProtoFleet closed-form test vectors: docs/protocol.md, Closed-form statistics. "
            "Hex strings are little-endian float64 ('f8') or float32 ('_f4') bytes in C "
            "order; 'seed' and 'first_words' are big-endian 64-bit integers. The "
            "projection is reproducible to the bit; statistics and float64 heads agree to "
            "about 1e-12 across linear-algebra libraries, the announced float32 head to "
            "the bit."
        ),
        "projections": [projection_vector(*p) for p in PROJECTIONS],
        "statistics": statistics_vectors(),
    }


PUBLISHED = json.loads(VECTORS.read_text()) if VECTORS.exists() else {}


def test_the_projection_vectors_are_reproduced_byte_for_byte():
    assert [projection_vector(p["fleet"], p["feature_dim"], p["dim"])
            for p in PUBLISHED["projections"]] == PUBLISHED["projections"]  # fmt: skip


def test_the_small_projection_is_published_whole_and_orthonormal():
    small = PUBLISHED["projections"][0]
    q = from_hex(small["matrix"]).reshape(small["feature_dim"], small["dim"])
    np.testing.assert_allclose(q.T @ q, np.eye(small["dim"]), atol=1e-15)
    assert f8(q[:3]) == small["first_rows"]


def test_the_devices_updates_are_the_published_statistics():
    published = PUBLISHED["statistics"]
    for i, (x, y) in enumerate(device_data()):
        want = published["devices"][i]
        assert f8(x) == want["features"] and [int(v) for v in y] == want["labels"]
        got = device_update(x, y, f"d{i}", "lda")
        assert list(got.classes) == want["classes"] and list(got.counts) == want["counts"]
        np.testing.assert_allclose(got.prototypes.ravel(), from_hex(want["prototypes"]),
                                   rtol=1e-12, atol=1e-14)  # fmt: skip
        for name, value in want["extras"].items():
            np.testing.assert_allclose(got.extras[name], from_hex(value), rtol=1e-12, atol=1e-14)
        assert f8(got.extras[BASIS]) == want["extras"][BASIS]  # the basis: to the bit


def test_the_heads_from_the_published_statistics_are_the_published_heads():
    published = PUBLISHED["statistics"]
    updates = []
    for want in published["devices"]:
        extras = {name: from_hex(value) for name, value in want["extras"].items()}
        updates.append(PrototypeUpdate(
            fleet=FLEET, round=0, client=want["client"], bundle=BUNDLE, method="lda",
            classes=tuple(want["classes"]), counts=tuple(want["counts"]),
            prototypes=from_hex(want["prototypes"]).reshape(len(want["classes"]), K),
            extras=extras,
        ))  # fmt: skip
    head = head_vector("lda", updates)
    want = published["heads"]["lda"]
    assert head["global_classes"] == want["global_classes"]
    np.testing.assert_allclose(from_hex(head["weight"]), from_hex(want["weight"]), rtol=1e-12)
    np.testing.assert_allclose(from_hex(head["bias"]), from_hex(want["bias"]), rtol=1e-12)
    assert head["announced_weight_f4"] == want["announced_weight_f4"]
    assert head["announced_bias_f4"] == want["announced_bias_f4"]


def test_every_published_head_is_rebuilt_from_the_features():
    rebuilt = statistics_vectors()["heads"]
    for method, want in PUBLISHED["statistics"]["heads"].items():
        got = rebuilt[method]
        for name in ("weight", "bias"):
            np.testing.assert_allclose(from_hex(got[name]), from_hex(want[name]), rtol=1e-12)
        assert got["announced_weight_f4"] == want["announced_weight_f4"], method
        assert got["announced_bias_f4"] == want["announced_bias_f4"], method


def _manager(state_dir: Path) -> RoundManager:
    cfg = CoordinatorConfig(
        fleet=FLEET,
        state_dir=state_dir,
        model=ModelSettings(method="lda", bundle=BUNDLE, classes=tuple("abc"), dim=K),
        rounds=RoundSettings(min_clients=2, wait_after_quorum_s=0.0, timeout_s=100.0),
        security=CoordinatorSecurity(insecure=True),
        # The head is compared with the plain strategy's over the same statistics: no
        # per-class cap (the devices here hold different counts, which it would weigh).
        closed_form=ClosedFormSettings(count_cap=0),
    )
    return RoundManager(config=cfg, store=Store(cfg.database), metrics=Metrics(), clock=lambda: 0.0)


def gaussian_qr(fleet: str, d: int, k: int) -> npt.NDArray[np.float64]:
    """The projection devices used before it was specified: Gaussian draws of numpy's
    generator and LAPACK's QR, the same seed. What an outside device guessed from the old
    words ("orthonormal columns seeded from the fleet id") looks like this."""
    gauss = np.random.default_rng(projection_seed(fleet)).standard_normal((d, k))
    q, r = np.linalg.qr(gauss)
    return q * np.sign(np.diag(r))


def test_a_statistics_release_in_another_basis_is_refused(tmp_path):
    (x0, y0), (x1, y1), (x2, y2) = device_data()
    m = _manager(tmp_path)
    right = device_update(x0, y0, "d0", "lda")
    assert m.offer(right.to_wire(), topic_client="d0").accepted
    # Statistics in another basis, each with the basis check of the projection it used
    # (what a device following the spec computes): the old Gaussian projection, and another
    # fleet's. Summed with d0's, either would turn the head to noise.
    for client, q in (("d1", gaussian_qr(FLEET, D, K)), ("d2", projection("other", D, K))):
        assert q is not None
        stats = cf.device_statistics(prepare(x1, q), y1, C)
        basis = np.concatenate([[float(D)], ordered_sum(q)])
        wrong = StatisticsRelease.of(stats, basis=basis).update(
            fleet=FLEET, round_=0, client=client, bundle=BUNDLE, method="lda"
        )
        assert m.offer(wrong.to_wire(), topic_client=client).reason == "wrong_basis"
    # A release without a basis check (a device from before it existed) is refused too.
    stats = cf.device_statistics(prepare(x2, projection(FLEET, D, K)), y2, C)
    bare = StatisticsRelease.of(stats).update(fleet=FLEET, round_=0, client="d3",
                                              bundle=BUNDLE, method="lda")  # fmt: skip
    bare = dataclasses.replace(bare, extras={n: a for n, a in bare.extras.items() if n != BASIS})
    assert m.offer(bare.to_wire(), topic_client="d3").reason == "wrong_basis"
    # A coordinator told the bundle's feature size refuses a basis of another size.
    pinned = dataclasses.replace(
        m.config, model=dataclasses.replace(m.config.model, feature_dim=D + 1)
    )
    assert pinned.admission_checks().wrong_basis(right)
    assert not m.config.admission_checks().wrong_basis(right)
    assert m.flush_rejections() == {"wrong_basis": 3}
    assert m.offer(device_update(x2, y2, "d2", "lda").to_wire(), topic_client="d2").accepted
    nxt = m.poll()
    assert nxt is not None and nxt.round == 1
    want = make_strategy("lda").aggregate(
        [right, device_update(x2, y2, "d2", "lda")], num_classes=C, dim=K
    )
    np.testing.assert_allclose(nxt.global_prototypes,
                               np.asarray(want.global_prototypes, np.float32), rtol=1e-6)  # fmt: skip
    m.store.close()


if __name__ == "__main__":
    VECTORS.write_text(json.dumps(build(), indent=1) + "\n")


def test_a_head_is_scaled_only_past_the_announce_dtypes_range():
    # A head with a value past float16's largest: sent as solved in float32, scaled whole
    # (the same predictions) in float16; the scaling was once applied to float32 too.
    weight = np.array([[1.0e5, -2.0], [3.0, 4.0]])
    bias = np.array([0.5, -7.0e4])
    head = Aggregate(global_classes=(0, 1), global_prototypes=weight, extras={BIAS: bias})
    as_f4 = within_dtype(head, np.float32)
    assert as_f4 is head
    as_f2 = within_dtype(head, np.float16)
    scale = 65504.0 / 1.0e5
    np.testing.assert_allclose(as_f2.global_prototypes, weight * scale)
    np.testing.assert_allclose(as_f2.extras[BIAS], bias * scale)
    assert np.isfinite(np.asarray(as_f2.global_prototypes, np.float16)).all()
