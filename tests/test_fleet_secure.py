"""``edge-fleet run --secure-aggregation`` and the privacy sweep's closed-form arms: the
public settings a run derives, the simulated secure sum of the vector transport (exact
within the quantiser's bound without noise, the plan's spread with it), the one-line
refusals, and a real secure fleet over Mosquitto."""

from __future__ import annotations

import json
import re
import sqlite3
from dataclasses import replace
from pathlib import Path
from random import Random

import numpy as np
import pytest

import closed_form as cf
from coordinator.config import CoordinatorConfig, database_in
from coordinator.config import load as load_coordinator_config
from coordinator.rounds import RoundManager
from coordinator.rounds.secure import SUM_KEY, FleetSum, SecureOutcome
from coordinator.storage.store import Store
from coordinator.strategies.closed_form import LDA
from edge_agent.closed_form import ClosedFormDevice, global_head
from edge_agent.config import ClosedFormSettings
from edge_agent.config import load as load_agent_config
from edge_agent.methods import device_method
from export.bundle import load as load_bundle
from fleet.cli import privacy
from fleet.cli.commands import cmd_run
from fleet.cli.main import build_parser
from fleet.data import partition as part
from fleet.engine.secure_sum import SimulatedSecureSum, discrete_gaussian
from fleet.transports.layout import RunLayout
from fleet.transports.runner import run
from fleet.transports.secure import (
    MIN_STAGE_S,
    coordinator_tables,
    public_settings,
    threshold_for,
)
from fleet.transports.spec import FLEET, RunSpec
from fleet.transports.vector import features_of
from fleet.transports.vector_closed_form import noise_sources
from protocol import RoundAnnouncement
from runtime.cliutil import UsageError
from runtime.settings import build
from secagg.fleet import SecureAggregation, flatten, secure_release, unflatten
from secagg.plan import decoded_noise_std, statistics_clip
from secagg.quantise import QuantiseSpec, sum_error_bound

PNG = b"\x89PNG\r\n\x1a\n"
K = 16  # a small public projection: the runs here test the plumbing, not the accuracy


def _spec(tmp_path: Path, **changes: object) -> RunSpec:
    base: dict[str, object] = dict(
        method="lda", rounds=2, bundle=tmp_path / "bundle", out=tmp_path / "run",
        transport="vector", progress=False, stats_dim=K, secure_aggregation=True,
    )  # fmt: skip
    return RunSpec(**{**base, **changes})  # type: ignore[arg-type]


def test_a_runs_public_settings_follow_the_fleets_size_and_partition(tmp_path: Path) -> None:
    # A tenth of the fleet may drop, a tenth of the threshold collude.
    assert [threshold_for(n) for n in (2, 3, 9, 10, 11, 1000)] == [2, 3, 9, 9, 10, 900]
    spec = _spec(tmp_path, privacy={"mechanism": "dp-features", "epsilon": 2.0, "delta": 1e-6})
    table = public_settings(spec, clients=1000, largest=20, k=K, classes=10)
    assert (table.threshold, table.colluding, table.neighbours) == (900, 90, 0)
    assert (table.dataset_size, table.epsilon, table.delta, table.bits) == (20, 2.0, 1e-6, 32)
    assert table.stage_timeout_s >= MIN_STAGE_S
    # No formal release asked: the exact sum.
    assert public_settings(_spec(tmp_path), clients=5, largest=100, k=K, classes=10).epsilon == 0
    # A 32-bit ring holds about 65,536 samples' counts at scale 2^15: past that, 64 bits.
    wide = public_settings(_spec(tmp_path), clients=1000, largest=100, k=K, classes=10)
    assert wide.bits == 64
    # A larger declared bound is the clip; a single device has nobody to hide among.
    declared = replace(spec, privacy={**spec.privacy, "dataset_size": 50})
    assert public_settings(declared, clients=5, largest=20, k=K, classes=10).dataset_size == 50
    with pytest.raises(UsageError, match="at least 2 clients"):
        public_settings(spec, clients=1, largest=20, k=K, classes=10)


def test_the_simulated_sum_without_noise_is_the_plain_sum_within_the_quantisers_bound() -> None:
    rng = np.random.default_rng(0)
    spec = QuantiseSpec(clip=statistics_clip(30), scale=2.0**15, bits=32)
    vectors = [rng.uniform(-30, 30, size=500) for _ in range(7)]
    total = SimulatedSecureSum(spec=spec, share_sigma2=None)
    for v in vectors:
        total.add(v, coins=None, noise=rng)
    error = np.abs(total.decoded() - np.sum(vectors, axis=0))
    assert 0 < error.max() < sum_error_bound(7, spec=spec)


def test_the_secure_sums_noise_has_the_plans_spread_and_is_secret_unless_replayed(
    tmp_path: Path,
) -> None:
    """On a vector of 9,556 coordinates (k 128) the spread's estimate is within 0.7% (one
    standard error) of the truth: 4% is over five of them."""
    n = 10
    table = SecureAggregation(threshold=9, colluding=0, epsilon=1.0, dataset_size=50)
    release = secure_release(table, k=128, classes=10, gram=True, devices=n)
    assert release.plan is not None
    length, share = release.settings.length, release.plan.share_sigma2
    rng = np.random.default_rng(1)
    vectors = [rng.uniform(0, 50, size=length) for _ in range(n)]
    spec = _spec(tmp_path)
    total = SimulatedSecureSum(spec=release.settings.spec, share_sigma2=share)
    for k, v in enumerate(vectors):
        coins, noise = noise_sources(spec, k)
        total.add(v, coins=coins, noise=noise)
    noise = total.decoded() - np.sum(vectors, axis=0)
    expected = release.plan.sum_std(n)
    assert np.std(noise) == pytest.approx(expected, rel=0.04)
    assert abs(np.mean(noise)) < 5 * expected / np.sqrt(length)
    # Each device's draws: secret by default, replayed from its seed when asked.
    secret = [noise_sources(spec, 0)[1].integers(1 << 62) for _ in range(2)]
    assert secret[0] != secret[1]
    replayed = replace(spec, reproducible_noise=True)
    draws = []
    for _ in range(2):
        coins, source = noise_sources(replayed, 3)
        assert coins is not None
        draws.append((coins.random(), discrete_gaussian(4, share, source).tolist()))
    assert draws[0] == draws[1]
    assert isinstance(noise_sources(replayed, 3)[0], Random)


def _announced(spec: RunSpec, round_: int) -> RoundAnnouncement:
    """What a vector run's coordinator announced opening ``round_``, from its database."""
    with sqlite3.connect(database_in(spec.layout.coordinator)) as db:
        (wire,) = db.execute(
            "SELECT announcement FROM rounds WHERE round = ?", (round_,)
        ).fetchone()
    return RoundAnnouncement.from_wire(wire, max_bytes=1 << 30)


def test_a_vector_fleet_summing_securely_without_noise_hands_the_coordinator_the_plain_sum(
    small_zoo: Path, tmp_path: Path
) -> None:
    partition = part.digits5(clients=3, split="feature", seed=0, train=40, test=30)
    spec = _spec(tmp_path, bundle=small_zoo)
    result = run(spec, partition)
    table = result.secure
    assert table is not None and (table.threshold, table.epsilon, table.dataset_size) == (
        3,
        0.0,
        40,
    )
    # The devices' exact statistics, as each agent computes them.
    bundle = load_bundle(small_zoo)
    data = features_of(spec, partition, bundle)
    exact = np.sum([
        flatten(ClosedFormDevice(method=device_method("lda"), fleet=FLEET,
                                 features=data.features[data.train_index[k]],
                                 labels=data.train_labels[k], num_classes=10,
                                 settings=ClosedFormSettings(dim=K), seed=k,
                                 state_dir=None).statistics(), gram=True)
        for k in range(3)
    ], axis=0)  # fmt: skip
    # What the coordinator added to the fleet's sum (kept with round 0's close) is the
    # plain sum within the quantiser's bound, and the head it announced is solved from it.
    store = Store(database_in(spec.layout.coordinator))
    release = secure_release(table, k=K, classes=10, gram=True)
    kept = FleetSum.load(store.meta_value(SUM_KEY), release=release)
    store.close()
    assert kept.devices == 3
    error = np.abs(flatten(kept.stats, gram=True) - exact).max()
    assert 0 < error < sum_error_bound(3, spec=release.settings.spec)
    # Solved at the rounding's noise level: the sum carries it even without noise.
    rounding = decoded_noise_std(spec=release.settings.spec, plan=None, devices=3)
    solved = LDA().solve_statistics(kept.stats, noise_std=rounding)
    announced = _announced(spec, 1)
    np.testing.assert_array_equal(
        announced.global_prototypes,
        np.asarray(solved.global_prototypes).astype(announced.global_prototypes.dtype),
    )
    for client in result.clients:
        assert all(a is not None for a in client.accuracy)
        # Round 0's traffic up is the masked vector (k 16: 136 + 160 + 10 values of 4 bytes).
        assert client.bytes_up == (306 * 4, 0)


def test_a_vector_fleets_noisy_sum_is_solved_at_its_plans_noise_level(
    small_zoo: Path, tmp_path: Path
) -> None:
    partition = part.digits5(clients=3, split="feature", seed=0, train=40, test=30)
    privacy = {"mechanism": "dp-features", "epsilon": 1000.0, "delta": 1e-5}
    spec = _spec(tmp_path, bundle=small_zoo, rounds=1, privacy=privacy)
    table = run(spec, partition).secure
    assert table is not None and table.epsilon == 1000.0
    release = secure_release(table, k=K, classes=10, gram=True)
    plan = release.plan
    assert plan is not None
    store = Store(database_in(spec.layout.coordinator))
    kept = FleetSum.load(store.meta_value(SUM_KEY), release=release)
    store.close()
    assert kept.devices == 3
    noise = decoded_noise_std(spec=release.settings.spec, plan=plan, devices=3)
    solved = LDA().solve_statistics(kept.stats, noise_std=noise)
    announced = _announced(spec, 1)
    np.testing.assert_array_equal(
        announced.global_prototypes,
        np.asarray(solved.global_prototypes).astype(announced.global_prototypes.dtype),
    )


def test_a_head_solved_from_the_secure_sum_without_noise_predicts_as_the_plain_one() -> None:
    """On features whose within-class covariance the quantiser's step (2^-15 a device)
    leaves well resolved. (The small test zoo's features are not: their covariance has
    eigenvalues near 1e-8, and a head solved from any sum within the bound differs.)"""
    rng = np.random.default_rng(2)
    means = rng.normal(size=(10, K))
    devices, test_x, test_y = [], [], []
    for _ in range(5):
        y = rng.integers(0, 10, size=60)
        x = means[y] + rng.normal(scale=1.0, size=(60, K))
        x /= np.maximum(np.linalg.norm(x, axis=1, keepdims=True), 1.0)  # norm <= 1
        devices.append(cf.device_statistics(x[:40], y[:40], 10))
        test_x.append(x[40:])
        test_y.append(y[40:])
    table = SecureAggregation(threshold=5, epsilon=0.0, dataset_size=40)
    release = secure_release(table, k=K, classes=10, gram=True, devices=5)
    total = SimulatedSecureSum(spec=release.settings.spec, share_sigma2=None)
    for stats in devices:
        total.add(flatten(stats, gram=True), coins=None, noise=rng)
    secure = unflatten(total.decoded(), k=K, classes=10, gram=True, devices=5)
    heads = [LDA().solve(cf.denoise(s)) for s in (cf.merge(devices), secure)]
    x = np.concatenate(test_x)
    np.testing.assert_array_equal(heads[0].predict(x), heads[1].predict(x))
    assert (heads[0].predict(x) == np.concatenate(test_y)).mean() > 0.5  # a real head


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--method", "fedpcl", "--secure-aggregation"], "fedpcl needs each device's own"),
        (["--method", "lda", "--secure-aggregation", "--transport", "memory"],
         "the memory transport has no MQTT"),
        (["--method", "lda", "--secure-aggregation", "--rounds", "3"], "give --rounds 1 or 2"),
        (["--method", "lda", "--epsilon", "1"], "--epsilon is the noise of --secure-aggregation"),
        (["--method", "lda", "--secure-aggregation", "--epsilon", "0"], "must be positive"),
        (["--method", "fedproto", "--secure-aggregation", "--transport", "vector"],
         "fedproto's runs over --transport mqtt"),
        (["--method", "fedproto", "--secure-aggregation", "--epsilon", "1"],
         "fedproto's secure sum carries no noise"),
    ],
)  # fmt: skip
def test_what_cannot_sum_securely_is_refused_in_one_line_before_anything_starts(
    tmp_path: Path, argv: list[str], says: str
) -> None:
    args = build_parser().parse_args(
        ["run", *argv, "--bundle", str(tmp_path / "bundle"), "--out", str(tmp_path / "out")]
    )
    with pytest.raises(UsageError, match=re.escape(says)) as refused:
        cmd_run(args)
    assert "\n" not in str(refused.value)
    assert not (tmp_path / "out").exists() and not (tmp_path / "bundle").exists()


@pytest.mark.slow
@pytest.mark.broker
def test_a_secure_lda_fleet_over_mosquitto_finishes_and_scores_its_clients(
    small_zoo: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "report"
    argv = ["run", "--transport", "mqtt", "--method", "lda", "--secure-aggregation",
            "--epsilon", "1", "--clients", "3", "--rounds", "1", "--train", "30",
            "--test", "20", "--stats-dim", str(K), "--workers", "1",
            "--bundle", str(small_zoo), "--out", str(out), "--no-progress"]  # fmt: skip
    assert cmd_run(build_parser().parse_args(argv)) == 0
    capsys.readouterr()
    report = json.loads((out / "report.json").read_text())
    lda = report["methods"]["lda"]
    run_ = lda["runs"]["0"]
    assert len(run_["accuracy"]) == 3
    for client, accuracy in run_["accuracy"].items():
        assert len(accuracy) == 1 and 0.0 <= accuracy[0] <= 1.0, client
        # Its statistics went up in the protocol's stages, not in an update.
        assert run_["bytes_up"][client][0] > 306 * 4
    table = lda["settings"]["secure_aggregation"]
    assert (table["threshold"], table["colluding"], table["epsilon"]) == (3, 0, 1.0)
    assert "Secure aggregation (lda)" in (out / "report.md").read_text()

    # Every party held the same table; the devices added no noise of their own.
    layout = RunLayout(Path(run_["run_dir"]))
    coordinator = load_coordinator_config(layout.coordinator_config)
    assert coordinator.secure and coordinator.secure_aggregation == SecureAggregation(**table)
    for client in run_["accuracy"]:
        agent = load_agent_config(layout.agent_config(client))
        assert agent.secure and agent.privacy.mechanism == "none"
        assert agent.secure_aggregation == coordinator.secure_aggregation
    log = layout.coordinator_log.read_text()
    assert "head solved from the secure sum of 3 device(s)" in log
    with sqlite3.connect(database_in(layout.coordinator)) as db:
        assert db.execute("SELECT COUNT(*) FROM updates").fetchone()[0] == 0


@pytest.mark.slow
@pytest.mark.broker
def test_a_secure_fedproto_fleet_over_mosquitto_sums_its_prototypes_every_round(
    small_zoo: Path, tmp_path: Path
) -> None:
    partition = part.digits5(clients=3, split="feature", seed=0, train=30, test=20)
    spec = _spec(tmp_path, method="fedproto", bundle=small_zoo, transport="mqtt", out_dim=16,
                 workers=1)  # fmt: skip
    result = run(spec, partition)
    table = result.secure
    assert table is not None and (table.threshold, table.epsilon) == (3, 0.0)
    for client in result.clients:  # scored on each round's global prototypes
        assert len(client.accuracy) == 2 and all(a is not None for a in client.accuracy)
        assert all(up > 0 for up in client.bytes_up)  # every round joins the sum
    coordinator = load_coordinator_config(spec.layout.coordinator_config)
    assert coordinator.secure and not coordinator.robust.median_count_cap
    log = spec.layout.coordinator_log.read_text()
    assert log.count("head solved from the secure sum of 3 device(s)") == 2


def test_the_privacy_sweep_sets_local_against_distributed_noise_for_a_closed_form_method(
    small_zoo: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "privacy"
    argv = ["privacy", "--closed-form", "--paper", "none", "--mechanisms", "dp-features",
            "--epsilons", "1", "--splits", "feature", "--clients", "3", "--train", "30",
            "--test", "20", "--rounds", "1", "--stats-dim", str(K),
            "--bundle", str(small_zoo), "--out", str(out), "--no-progress"]  # fmt: skip
    assert privacy.main(build_parser().parse_args(argv)) == 0
    capsys.readouterr()
    document = json.loads((out / "report.json").read_text())
    assert document["closed_form"] == "lda"
    arms = ("lda exact sum (no privacy)", "lda dp-features eps=1", "lda secure eps=1")
    assert set(arms) <= set(document["results"]["feature"])
    assert all(0.0 <= document["results"]["feature"][a] <= 1.0 for a in arms)
    secure = document["settings"]["lda secure eps=1"]
    assert secure["transport"] == "vector" and secure["secure_aggregation"]["epsilon"] == 1.0
    assert secure["secure_aggregation"]["dataset_size"] == 30
    local = document["settings"]["lda dp-features eps=1"]
    assert local["secure_aggregation"] is None and local["privacy"]["mechanism"] == "dp-features"
    claim = document["privacy"]["lda secure eps=1"]
    assert claim["aggregation"] == "secure" and claim["mechanism"] == "none"
    assert claim["guarantee"] == "(epsilon, delta)-DP, add/remove one example"
    md = (out / "report.md").read_text()
    assert "| lda secure eps=1 |" in md and "only the fleet's secure sum reaches" in md
    assert (out / "accuracy_vs_epsilon.png").read_bytes().startswith(PNG)


def _features(
    rng: np.random.Generator, rows: int, means: np.ndarray, scales: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Rows of norm < 1 around a common centre (as backbone features sit): classes apart
    along the widest directions, and a few directions of tiny spread."""
    y = rng.integers(0, 10, size=rows)
    return 0.2 + means[y] + rng.normal(size=(rows, K)) * scales, y


def test_a_secure_lda_at_a_negligible_epsilon_announces_the_exact_sums_head(
    tmp_path: Path,
) -> None:
    """Epsilon 1000 puts noise of standard deviation 0.047 on each summed coordinate:
    below the class structure here, above the within-class spread of the narrowest
    directions (eigenvalues down to 4e-4 of 1,000 rows). The coordinator's head from that
    sum must score as the exact sum's does; it lost 17-19 points when the noisy scatter's
    negative eigenvalues were set to 0 (closed_form/heads.py::lda_head)."""
    rng = np.random.default_rng(0)
    scales = np.geomspace(0.05, 0.0005, K)
    means = rng.normal(size=(10, K)) * 0.05 * (np.arange(K) < K // 4)
    devices = [cf.device_statistics(*_features(rng, 50, means, scales), 10) for _ in range(20)]
    test_x, test_y = _features(rng, 2000, means, scales)
    table = SecureAggregation(threshold=18, colluding=1, epsilon=1000.0, dataset_size=50)
    release = secure_release(table, k=K, classes=10, gram=True, devices=20)
    assert release.plan is not None and release.plan.sum_std(20) < 0.05
    total = SimulatedSecureSum(spec=release.settings.spec, share_sigma2=release.plan.share_sigma2)
    for stats in devices:
        total.add(flatten(stats, gram=True), coins=None, noise=rng)
    # The coordinator's own close of a secure round, as the vector transport and the
    # protocol over MQTT hand it the decoded sum.
    config = build(CoordinatorConfig, {
        "fleet": FLEET, "state_dir": str(tmp_path / "coordinator"),
        "model": {"method": "lda", "bundle": "b", "classes": [str(c) for c in range(10)],
                  "dim": K},
        "rounds": {"min_clients": 20, "max_rounds": 1},
        "security": {"insecure": True}, **coordinator_tables(table, method="lda"),
    })  # fmt: skip
    store = Store(config.database)
    manager = RoundManager(config=config, store=store)
    assert manager.take_secure(SecureOutcome(round=0, total=total.decoded(), survivors=20))
    announced = manager.poll()
    store.close()
    assert announced is not None
    head = global_head(announced, num_classes=10, dim=K)
    assert head is not None
    exact = cf.lda_head(cf.denoise(cf.merge(devices)))
    accuracy = [float((h.predict(test_x) == test_y).mean()) for h in (exact, head)]
    assert accuracy[0] > 0.6  # a real head
    assert accuracy[1] >= accuracy[0] - 0.01, accuracy
