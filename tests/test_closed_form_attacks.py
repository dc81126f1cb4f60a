"""One compromised enrolled device against a closed-form (LDA) fleet, over a real
Mosquitto and the real ``edge-coordinator``: each attack of issue 50 is a statistics update
signed with the device's own key. The fleet's head must stay the honest devices' (or the
update be refused, said in ``edge-coordinator status``)."""

from __future__ import annotations

import dataclasses
import signal
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

import closed_form as cf
from coordinator.strategies.closed_form import LDA
from edge_agent.closed_form import StatisticsRelease, global_head
from protocol import PrivacyMeta, PrototypeUpdate
from protocol.auth import sign
from protocol.methods import COUNTS, GRAM
from tests.coordinator_helpers import BUNDLE, coordinator_toml, finish, stand_ins, start
from tests.process_helpers import coordinator_process, status
from tests.test_worker_intake import make_keys

pytestmark = pytest.mark.broker

K, C, HONEST = 6, 3, 5
ATTACKER = f"dev-{HONEST}"
DP = PrivacyMeta(mechanism="dp-features", epsilon=1.0, delta=1e-5, guarantee="dp")


def rows(rng: np.random.Generator, labels: np.ndarray) -> np.ndarray:
    """Unit rows around three well-apart class centres (no projection: ``tr(G) = N``)."""
    x = np.eye(K)[labels] + rng.normal(scale=0.35, size=(len(labels), K))
    return x / np.linalg.norm(x, axis=1, keepdims=True)


def device(seed: int, n: int = 30) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    y = np.arange(n) % C
    return rows(rng, y), y


def release(stats: cf.Statistics, client: str, privacy: PrivacyMeta | None = None):
    """``stats`` as an agent sends them (``privacy``: what the update says of itself)."""
    return StatisticsRelease.of(stats).update(
        fleet="lab", round_=0, client=client, bundle=BUNDLE, method="lda", privacy=privacy
    )


def flipped(times: float) -> cf.Statistics:
    """A real device's statistics with every label moved one class on, counts ``times``."""
    x, y = device(99)
    stats = cf.device_statistics(x, (y + 1) % C, C)
    return cf.Statistics(counts=stats.counts * times, sums=stats.sums * times,
                         gram=None if stats.gram is None else stats.gram * times,
                         holders=stats.holders, scatter=None, devices=1)  # fmt: skip


def with_extras(u: PrototypeUpdate, **extras: np.ndarray) -> PrototypeUpdate:
    return dataclasses.replace(u, extras={**u.extras, **extras})


def label_flip_inflated() -> PrototypeUpdate:
    # Whole counts, sums within them, tr(G) = N: plausible, 100 times an honest device.
    return release(flipped(100), ATTACKER)


def label_flip_claiming_dp() -> PrototypeUpdate:
    u = release(flipped(100), ATTACKER)
    shaken = np.asarray(u.extras[COUNTS]) + 0.5  # a fraction, as noise would make
    return dataclasses.replace(with_extras(u, counts=shaken),
                               counts=tuple(float(c) for c in shaken), privacy=DP)  # fmt: skip


def drawn_counts_negative() -> PrototypeUpdate:
    # The counts field says 0, the counts the coordinator sums say -300,000 (within the
    # bound main held the summed counts to with three classes: 1,000 + 3 * 100,000).
    u = release(flipped(1), ATTACKER)
    return dataclasses.replace(with_extras(u, counts=np.full(C, -300_000.0)),
                               counts=(0.0,) * C, privacy=DP)  # fmt: skip


def drawn_counts_tenfold() -> PrototypeUpdate:
    # The counts field within admission.max_count; the summed counts ten times more.
    u = dataclasses.replace(release(flipped(100), ATTACKER), privacy=DP)
    return with_extras(u, counts=np.asarray(u.extras[COUNTS]) * 10)


def huge_indefinite_gram(privacy: PrivacyMeta | None = DP) -> PrototypeUpdate:
    # Its diagonal and trace a real device's; off the diagonal, 30,000.
    u = release(flipped(1), ATTACKER, privacy)
    full = cf.from_upper_triangle(np.asarray(u.extras[GRAM]))
    full += 30_000.0 * (np.ones((K, K)) - np.eye(K))
    return with_extras(u, gram=cf.upper_triangle(full))


def indefinite_gram_exact() -> PrototypeUpdate:
    return huge_indefinite_gram(privacy=None)


def negative_definite_gram() -> PrototypeUpdate:
    u = release(flipped(1), ATTACKER, DP)
    return with_extras(u, gram=cf.upper_triangle(-1000.0 * np.eye(K)))


def deleted_classes() -> PrototypeUpdate:
    u = release(flipped(1), ATTACKER)
    drawn = np.array([-300_000.0, -300_000.0, 10.0])
    return dataclasses.replace(with_extras(u, counts=drawn), counts=(0.0, 0.0, 10.0),
                               privacy=DP)  # fmt: skip


def stealthy_no_spread() -> PrototypeUpdate:
    # The true class means at 1,000 samples each, and no spread around them (W = 0).
    x, y = device(98)
    means = np.stack([x[y == c].mean(axis=0) for c in range(C)])
    counts = np.full(C, 1000.0)
    stats = cf.Statistics(counts=counts, sums=means * counts[:, None],
                          gram=np.einsum("c,ci,cj->ij", counts, means, means),
                          holders=np.ones(C, np.int64), scatter=None, devices=1)  # fmt: skip
    return release(stats, ATTACKER)


#: attack -> its update, and the rejection it meets in a fleet of exact releases and in
#: one of noisy releases ([closed_form] release); None: admitted, and capped.
ATTACKS: dict[str, tuple[Callable[[], PrototypeUpdate], str | None, str | None]] = {
    "label_flip_inflated": (label_flip_inflated, None, "wrong_release"),
    "label_flip_claiming_dp": (label_flip_claiming_dp, "wrong_release", None),
    "drawn_counts_negative": (drawn_counts_negative, "wrong_release", "value_above_max"),
    "drawn_counts_tenfold": (drawn_counts_tenfold, "wrong_release", "implausible_statistics"),
    "huge_indefinite_gram": (huge_indefinite_gram, "wrong_release", "implausible_statistics"),
    "indefinite_gram_exact": (indefinite_gram_exact, "implausible_statistics", "wrong_release"),
    "negative_definite_gram": (negative_definite_gram, "wrong_release", "implausible_statistics"),
    "deleted_classes": (deleted_classes, "wrong_release", "value_above_max"),
    "stealthy_no_spread": (stealthy_no_spread, "implausible_statistics", "wrong_release"),
}
#: The noisy fleet's [closed_form] table: sigma = sqrt(3), so 6 sigma is 10.4.
NOISY = '[closed_form]\nrelease = "noisy"\nnoise_multiplier = 1.0\n'


def fleet_head(
    mosquitto, tmp_path: Path, attack: PrototypeUpdate, *, admitted: bool, noisy: bool
) -> tuple[float, dict, dict]:
    """The honest devices and the attacker's signed update (sent first) over a real
    Mosquitto, the round closing once every update the coordinator should admit is in
    (``admitted``: the attacker's too): the announced head's accuracy on honest test rows,
    the rejections and the status. ``noisy``: a fleet of noisy releases, whose honest
    devices' statistics say so (their noise drawn as zero)."""
    keys = make_keys(tmp_path, HONEST + 1)
    config = coordinator_toml(tmp_path, mosquitto.address.port, method="lda",
                              clients=HONEST + admitted,
                              dim=K, feature_dim=K, keys=keys.folder)  # fmt: skip
    if noisy:
        config.write_text(config.read_text() + NOISY)
    honest = [release(cf.device_statistics(*device(i), C), f"dev-{i}", DP if noisy else None)
              for i in range(HONEST)]  # fmt: skip
    proc = start(config)
    try:
        with stand_ins(mosquitto) as fleet:
            run = fleet.run()
            fleet.send([sign(u, keys.devices[u.client], run=run)
                        for u in [attack, *honest]])  # fmt: skip
            final = fleet.announcement(1)
        finish(proc)
    finally:
        proc.kill()
    head = global_head(final, num_classes=C, dim=K)
    assert head is not None, "the fleet was left without a head"
    rng = np.random.default_rng(7)
    y = np.arange(600) % C
    accuracy = float((head.predict(rows(rng, y)) == y).mean())
    shown = status("edge-coordinator", config)
    return accuracy, shown["rejections"], shown


# Two attacks stay in the quick loop (a label flip and a huge second moment, on both kinds
# of fleet); every attack runs in the full suite (about 2 s each over a real Mosquitto).
QUICK = {"label_flip_inflated", "huge_indefinite_gram"}


@pytest.mark.parametrize("fleet", ["exact", "noisy"])
@pytest.mark.parametrize(
    "name",
    [
        pytest.param(
            name,
            marks=[] if name in QUICK else [pytest.mark.slow],
        )
        for name in sorted(ATTACKS)
    ],
)
def test_one_compromised_device_cannot_wreck_the_fleets_lda_head(mosquitto, tmp_path, name, fleet):
    make, *refusals = ATTACKS[name]
    refused = refusals[fleet == "noisy"]
    accuracy, rejections, _ = fleet_head(mosquitto, tmp_path, make(), admitted=refused is None,
                                         noisy=fleet == "noisy")  # fmt: skip
    assert rejections == ({} if refused is None else {refused: 1})
    # The honest devices' head scores 0.958 on these rows, and with a flipping device
    # weighing as much as one of them (the cap), 0.942; one that outweighs them (today's
    # main admits it uncapped) takes it to 0.03.
    assert accuracy >= 0.93, accuracy


def test_a_device_unenrolled_by_a_reload_leaves_the_fleets_head(mosquitto, tmp_path):
    # Its statistics, admitted while it was enrolled (flipped labels at an honest count:
    # within every bound), stay in the stored table; the reload that unenrols it rebuilds
    # the sum without them, and the next round's head is the honest devices' alone.
    keys = make_keys(tmp_path, HONEST + 1)
    config = coordinator_toml(tmp_path, mosquitto.address.port, method="lda",
                              clients=HONEST + 1, rounds=0, dim=K, feature_dim=K,
                              keys=keys.folder)  # fmt: skip
    honest_stats = [cf.device_statistics(*device(i), C) for i in range(HONEST)]
    honest = [release(s, f"dev-{i}") for i, s in enumerate(honest_stats)]
    coordinator = coordinator_process(config)
    try:
        with stand_ins(mosquitto) as fleet:
            run = fleet.run()
            fleet.send([sign(u, keys.devices[u.client], run=run)
                        for u in [release(flipped(1), ATTACKER), *honest]])  # fmt: skip
            with_attacker = fleet.announcement(1)
            (keys.folder / "devices" / f"{ATTACKER}.pub").unlink()
            config.write_text(config.read_text().replace(
                f"min_clients = {HONEST + 1}", f"min_clients = {HONEST}"))  # fmt: skip
            seen = len(coordinator.lines)
            coordinator.signal(signal.SIGHUP)
            coordinator.wait_for(f"the stored statistics of {ATTACKER} are left out", after=seen)
            coordinator.wait_for("configuration reloaded", after=seen)
            nothing = [StatisticsRelease.nothing(K).update(fleet="lab", round_=1, client=u.client,
                                                           bundle=BUNDLE, method="lda")
                       for u in honest]  # fmt: skip
            fleet.send([sign(u, keys.devices[u.client], run=run) for u in nothing])
            without = fleet.announcement(2)
        assert coordinator.stop() == 0
    finally:
        coordinator.close()
    want = LDA().solve_statistics(cf.merge(honest_stats))
    assert not np.allclose(with_attacker.global_prototypes, want.global_prototypes, rtol=1e-3)
    np.testing.assert_allclose(without.global_prototypes, want.global_prototypes, rtol=1e-5,
                               atol=1e-6 * float(np.abs(want.global_prototypes).max()))  # fmt: skip
