"""One compromised device against a closed-form (LDA) fleet under the coordinator's
defaults (issue 50; docs/deploy.md's threat model): how far each attack moves the fleet
head's accuracy, and whether any round is left without a head.

digits-5 feature shift through the zoo's fontdigits CNN (bench/one_backbone.py, 192
features, the statistics at the simulator's default projection k), 120 training and 100
test samples per device. Each device's statistics are what its agent sends
(edge_agent/closed_form.py); the coordinator is the real round manager and store
(coordinator/rounds/manager.py), fed the updates as the broker would hand them, for two
rounds (the statistics, then a round with nothing new). The attacker is device 0, an
enrolled device sending from its own data:

- ``label_flip``: its exact statistics with every label moved one class on, its counts
  raised to ``[closed_form] max_samples`` (whole counts, sums within them, tr(G) <= N);
- ``label_flip_dp``: the same, claiming a noisy release (fractional counts);
- ``deleted_classes``: counts as drawn of -100,000 on nine classes, claiming noise;
- ``huge_gram``: its real counts and sums, a second moment 10,000 off the diagonal;
- ``indefinite_gram``: its real counts and sums, a second moment of -1,000 I, claiming noise;
- ``inflated_counts``: its true class means at 10,000 samples each, no spread around them.

Keys: ``reliability.lda_attack_worst_drop`` (points: the clean fleet's head accuracy on
the honest devices' test rows less the attacked fleet's, the worst attack, 1 of 10),
``reliability.lda_attack_headless_rounds`` (rounds announced without a head over every
attack and fleet size), per attack ``reliability.lda_attack_1_of_<n>_<attack>_drop``, the
clean accuracy ``reliability.lda_attack_1_of_<n>_clean`` and the clean-fleet cost of the
defences, ``reliability.lda_attack_1_of_<n>_defence_cost`` (points: the pooled head,
count_cap = 0, less the default one), for n = 3, 10 and 100; beside each drop, the
``_undefended_drop`` of the same updates summed without admission or cap (as main summed
those it admitted).
"""

from __future__ import annotations

import dataclasses
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import numpy as np

import closed_form as cf
from bench.one_backbone import ensure_one_backbone, pooled_features
from coordinator.closed_form_settings import ClosedFormSettings
from coordinator.config import CoordinatorConfig, ModelSettings, RoundSettings
from coordinator.metrics import Metrics
from coordinator.rounds import RoundManager
from coordinator.storage.store import Store
from coordinator.strategies import Aggregate
from coordinator.strategies.closed_form import LDA
from edge_agent.closed_form import StatisticsRelease, global_head, prepare, projection
from export import bundle as bundle_mod
from fleet.data.partition import digits5
from fleet.engine.batch import FleetFeatures
from fleet.transports.spec import DEFAULT_STATS_DIM, RunSpec
from fleet.transports.vector import features_of
from protocol import PrivacyMeta, PrototypeUpdate
from protocol.methods import BIAS, COUNTS, GRAM
from runtime.security import CoordinatorSecurity

FLEET, BUNDLE, C = "bench", "b" * 64, 10
DEVICES = (3, 10, 100)
TRAIN, TEST = 120, 100
DP = PrivacyMeta(mechanism="dp-features", epsilon=1.0, delta=1e-5, guarantee="dp")
LIMITS = ClosedFormSettings()

Rows = tuple[np.ndarray, np.ndarray]  # (N, k) prepared rows, (N,) labels


def _update(stats: cf.Statistics, client: str, privacy: PrivacyMeta | None = None,
            round_: int = 0) -> PrototypeUpdate:  # fmt: skip
    return StatisticsRelease.of(stats).update(fleet=FLEET, round_=round_, client=client,
                                              bundle=BUNDLE, method="lda", privacy=privacy)  # fmt: skip


def _scaled(stats: cf.Statistics, times: float) -> cf.Statistics:
    gram = None if stats.gram is None else stats.gram * times
    return dataclasses.replace(stats, counts=stats.counts * times, sums=stats.sums * times,
                               gram=gram)  # fmt: skip


def label_flip(x: np.ndarray, y: np.ndarray, client: str) -> PrototypeUpdate:
    stats = cf.device_statistics(x, (y + 1) % C, C)
    return _update(_scaled(stats, LIMITS.max_samples // len(y)), client)


def label_flip_dp(x: np.ndarray, y: np.ndarray, client: str) -> PrototypeUpdate:
    u = label_flip(x, y, client)
    shaken = np.asarray(u.extras[COUNTS]) + 0.5
    return dataclasses.replace(u, counts=tuple(float(c) for c in shaken),
                               extras={**u.extras, COUNTS: shaken}, privacy=DP)  # fmt: skip


def deleted_classes(x: np.ndarray, y: np.ndarray, client: str) -> PrototypeUpdate:
    u = _update(cf.device_statistics(x, y, C), client)
    drawn = np.asarray(u.extras[COUNTS]).copy()
    drawn[1:] = -100_000.0
    return dataclasses.replace(u, counts=tuple(max(0.0, float(c)) for c in drawn),
                               extras={**u.extras, COUNTS: drawn}, privacy=DP)  # fmt: skip


def huge_gram(x: np.ndarray, y: np.ndarray, client: str) -> PrototypeUpdate:
    u = _update(cf.device_statistics(x, y, C), client)
    k = x.shape[1]
    full = cf.from_upper_triangle(np.asarray(u.extras[GRAM])) + 1e4 * (1 - np.eye(k))
    return dataclasses.replace(u, extras={**u.extras, GRAM: cf.upper_triangle(full)})


def indefinite_gram(x: np.ndarray, y: np.ndarray, client: str) -> PrototypeUpdate:
    u = _update(cf.device_statistics(x, y, C), client, DP)
    gram = cf.upper_triangle(-1000.0 * np.eye(x.shape[1]))
    return dataclasses.replace(u, extras={**u.extras, GRAM: gram})


def inflated_counts(x: np.ndarray, y: np.ndarray, client: str) -> PrototypeUpdate:
    held = np.unique(y)
    means = np.zeros((C, x.shape[1]))
    means[held] = np.stack([x[y == c].mean(axis=0) for c in held])
    counts = np.where(np.isin(np.arange(C), held), 10_000.0, 0.0)
    stats = cf.Statistics(counts=counts, sums=means * counts[:, None],
                          gram=np.einsum("c,ci,cj->ij", counts, means, means),
                          holders=(counts > 0).astype(np.int64), scatter=None,
                          devices=1)  # fmt: skip
    return _update(stats, client)


ATTACKS: dict[str, Callable[[np.ndarray, np.ndarray, str], PrototypeUpdate]] = {
    "label_flip": label_flip,
    "label_flip_dp": label_flip_dp,
    "deleted_classes": deleted_classes,
    "huge_gram": huge_gram,
    "indefinite_gram": indefinite_gram,
    "inflated_counts": inflated_counts,
}


def _devices(data: FleetFeatures, k: int) -> tuple[list[Rows], list[Rows]]:
    """Each device's prepared training and test rows (the agent's: unit-norm features
    through the fleet's public projection, clipped)."""
    q = projection(FLEET, data.features.shape[1], k)
    train, test = [], []
    for i in range(data.clients):
        train.append((prepare(data.features[data.train_index[i]], q), data.train_labels[i]))
        test.append((prepare(data.features[data.test_index[i]], q), data.test_labels[i]))
    return train, test


def _fleet(root: Path, updates: list[PrototypeUpdate], k: int, closed_form: ClosedFormSettings,
           clients: list[str]) -> list[cf.LinearHead | None]:  # fmt: skip
    """The heads the coordinator announces after round 0 (these updates) and round 1
    (nothing new from anyone); None for a round announced without a head."""
    config = CoordinatorConfig(
        fleet=FLEET, state_dir=root,
        model=ModelSettings(method="lda", bundle=BUNDLE, classes=tuple(map(str, range(C))),
                            dim=k),
        rounds=RoundSettings(min_clients=1, wait_after_quorum_s=0.0),
        security=CoordinatorSecurity(insecure=True), closed_form=closed_form,
    )  # fmt: skip
    manager = RoundManager(config=config, store=Store(config.database), metrics=Metrics(),
                           clock=lambda: 0.0)  # fmt: skip
    heads = []
    try:
        for round_ in (0, 1):
            sent = updates if round_ == 0 else [
                StatisticsRelease.nothing(k).update(fleet=FLEET, round_=1, client=c,
                                                     bundle=BUNDLE, method="lda")
                for c in clients
            ]  # fmt: skip
            for u in sent:
                manager.offer(u.to_wire(), topic_client=u.client)
            announced = manager.poll()
            assert announced is not None, "the round did not close"
            heads.append(global_head(announced, num_classes=C, dim=k))
    finally:
        manager.store.close()
    return heads


def _head_of(aggregate: Aggregate, k: int) -> cf.LinearHead:
    weight, bias = np.zeros((C, k)), np.zeros(C)
    present = np.zeros(C, dtype=bool)
    idx = list(aggregate.global_classes)
    weight[idx], bias[idx], present[idx] = aggregate.global_prototypes, aggregate.extras[BIAS], True
    return cf.LinearHead(weight=weight, bias=bias, present=present)


def _accuracy(head: cf.LinearHead | None, test: list[Rows]) -> float:
    """The head's accuracy on the honest devices' pooled test rows (0 without a head)."""
    if head is None:
        return 0.0
    x = np.concatenate([t[0] for t in test])
    y = np.concatenate([t[1] for t in test])
    return float((head.predict(x) == y).mean())


def measure(root: Path, data: FleetFeatures, *, k: int) -> tuple[dict[str, float], int]:
    """One fleet size: each attack's drop (points), the clean accuracy and the defences'
    cost on the clean fleet; and the rounds left without a head."""
    n = data.clients
    train, test = _devices(data, k)
    names = [f"dev-{i:03d}" for i in range(n)]
    honest = [
        _update(cf.device_statistics(x, y, C), c) for (x, y), c in zip(train, names, strict=True)
    ]
    judged = test[1:]  # the honest devices' test rows: the attacker's seat is left out
    key = f"reliability.lda_attack_1_of_{n}"
    clean = _accuracy(_fleet(root / "clean", honest, k, LIMITS, names)[-1], judged)
    pooled = _accuracy(_fleet(root / "pooled", honest, k, ClosedFormSettings(count_cap=0),
                              names)[-1], judged)  # fmt: skip
    out = {f"{key}_clean": 100.0 * clean, f"{key}_defence_cost": 100.0 * (pooled - clean)}
    headless = 0
    for attack, make in ATTACKS.items():
        sent = [make(*train[0], names[0]), *honest[1:]]
        heads = _fleet(root / attack, sent, k, LIMITS, names)
        headless += sum(h is None for h in heads)
        out[f"{key}_{attack}_drop"] = 100.0 * (clean - min(_accuracy(h, judged) for h in heads))
        # Without admission or cap (what main did with the attacks it admitted): every
        # update summed as sent, the head solved once.
        bare = LDA().aggregate(sent, num_classes=C, dim=k)
        bare_head = None if not bare.global_classes else _head_of(bare, k)
        out[f"{key}_{attack}_undefended_drop"] = 100.0 * (clean - _accuracy(bare_head, judged))
        print(f"  1 of {n}: {attack} {out[f'{key}_{attack}_drop']:+.2f} points",
              file=sys.stderr, flush=True)  # fmt: skip
    return out, headless


def fleet_of(bundle: Path, devices: int) -> FleetFeatures:
    if devices > 10:  # drawn from 50 rendered clients, as the other 100-device figures are
        return pooled_features(bundle, clients=devices, train=TRAIN, test=TEST)
    partition = digits5(clients=devices, split="feature", seed=0, train=TRAIN, test=TEST)
    spec = RunSpec(method="lda", rounds=1, bundle=bundle, out=bundle, transport="vector")
    return features_of(spec, partition, bundle_mod.load(bundle))


def run(devices: tuple[int, ...] = DEVICES) -> dict[str, float]:
    bundle = ensure_one_backbone()
    k = min(DEFAULT_STATS_DIM, bundle_mod.load(bundle).feature_dim)
    results: dict[str, float] = {}
    headless = 0
    with tempfile.TemporaryDirectory(prefix="protofleet-lda-attack-") as tmp:
        for n in devices:
            got, none = measure(Path(tmp) / str(n), fleet_of(bundle, n), k=k)
            results |= got
            headless += none
    if 10 in devices:
        results["reliability.lda_attack_worst_drop"] = max(
            results[f"reliability.lda_attack_1_of_10_{a}_drop"] for a in ATTACKS
        )
    results["reliability.lda_attack_headless_rounds"] = float(headless)
    return results


if __name__ == "__main__":
    import json

    sizes = tuple(int(a) for a in sys.argv[1:]) or DEVICES
    print(json.dumps(run(sizes), indent=1, sort_keys=True))
