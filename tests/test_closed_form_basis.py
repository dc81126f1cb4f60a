"""The public whitening basis (closed_form/basis.py): by hand, as a projection and a basis
check, on a device and at the coordinator's admission, and written by `edge-export basis`."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import closed_form as cf
from closed_form.basis import BASIS_FILE, load_basis, public_basis, setting_basis
from closed_form.projection import basis_check, basis_problem, ordered_sum, prepare, projection
from coordinator.admission import Admission
from coordinator.closed_form_settings import ClosedFormSettings as FleetClosedForm
from coordinator.config import CoordinatorConfig, ModelSettings, RoundSettings
from coordinator.config import load as load_coordinator_config
from coordinator.metrics import Metrics
from coordinator.rounds import RoundManager
from coordinator.storage.store import StateError, Store
from coordinator.strategies.closed_form import announced
from edge_agent.closed_form import ClosedFormDevice, StatisticsRelease, StoredHead
from edge_agent.config import ClosedFormSettings
from edge_agent.config import load as load_agent_config
from edge_agent.methods import device_method
from export import bundle as bundle_mod
from fleet.cli.commands import cmd_run
from fleet.cli.main import build_parser
from fleet.transports.layout import RunLayout
from protocol import RoundAnnouncement
from protocol.methods import BIAS
from runtime.security import CoordinatorSecurity
from secagg.fleet import SecureAggregation, secure_release
from tests.agent_helpers import RUN, RUN_STARTED

FLEET, D, K, C = "lab", 6, 4, 3
BUNDLE = "b" * 64
BIN = Path(sys.executable).parent


def test_the_basis_whitens_the_public_covariance_by_hand():
    # Unit rows +-e1 (four times) and +-e2 (twice), given at other lengths: mean 0, the
    # covariance (sum x x^T / (n - 1)) is diag(4, 2) / 5, so the eigenvalues are 0.8 and
    # 0.4. Columns: e1 * sqrt(0.8 / 0.8) and e2 * sqrt(0.8 / 0.4).
    rows = np.array([[3, 0], [-3, 0], [0.5, 0], [-0.5, 0], [0, 2], [0, -7]], dtype=float)
    want = np.array([[1.0, 0.0], [0.0, np.sqrt(2.0)]])
    np.testing.assert_allclose(public_basis(rows), want, atol=1e-12)


def test_a_dead_direction_is_floored_and_signs_follow_the_data():
    # A third coordinate that never varies: its eigenvalue 0 is raised to floor * 0.8.
    rows = [[1, 0, 0], [-1, 0, 0], [1, 0, 0], [-1, 0, 0], [0, 1, 0], [0, -1, 0]]
    basis = public_basis(rows)
    np.testing.assert_allclose(np.abs(basis), np.diag([1, np.sqrt(2), 1000.0]), atol=1e-6)
    # Each column's largest entry is positive, whichever sign the eigensolver returned.
    assert (basis[np.abs(basis).argmax(axis=0), range(3)] > 0).all()
    np.testing.assert_allclose(public_basis(rows, floor=0.25)[2, 2], 2.0)  # sqrt(0.8 / 0.2)


@pytest.mark.parametrize(
    ("rows", "match"),
    [
        ([[1.0, 2.0]], "at least two public rows"),
        ([[1.0, np.nan], [0.0, 1.0]], "non-finite"),
        ([[1.0, 0.0], [2.0, 0.0]], "do not vary"),
    ],
)
def test_rows_that_make_no_basis_are_refused(rows, match):
    with pytest.raises(ValueError, match=match):
        public_basis(rows)


def test_a_stored_basis_is_checked_as_it_is_loaded(tmp_path):
    with pytest.raises(ValueError, match="no file at"):
        load_basis(str(tmp_path / "none.npy"))
    junk = tmp_path / "junk.npy"
    junk.write_bytes(b"not a matrix")
    with pytest.raises(ValueError, match=r"is not a \.npy matrix"):
        load_basis(str(junk))
    for name, bad, match in (("wide.npy", np.ones((3, 4)), "square"),
                             ("nan.npy", np.full((2, 2), np.nan), "non-finite"),
                             ("zero.npy", np.diag([1.0, 0.0]), "zero column")):  # fmt: skip
        np.save(tmp_path / name, bad)
        with pytest.raises(ValueError, match=match):
            load_basis(str(tmp_path / name))
    np.save(tmp_path / "ok.npy", np.eye(3))
    loaded = load_basis(str(tmp_path / "ok.npy"))
    assert not loaded.flags.writeable
    with pytest.raises(ValueError, match="a basis for 3 features; the bundle has 4"):
        setting_basis(str(tmp_path / "ok.npy"), feature_dim=4)
    assert setting_basis("") is None and setting_basis(str(tmp_path / "ok.npy")) is loaded


def _basis(seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return public_basis(rng.normal(size=(200, D)) * np.arange(1, D + 1))


def test_the_projection_is_the_bases_first_columns_and_its_check_holds_to_them():
    basis = _basis()
    q = projection(FLEET, D, K, basis=basis)
    assert q is not None and np.array_equal(q, basis[:, :K])
    full = projection(FLEET, D, D, basis=basis)  # k = D: the basis itself, not nothing
    assert full is not None and np.array_equal(full, basis)
    with pytest.raises(ValueError, match="at most the bundle's 6 features"):
        projection(FLEET, D, D + 1, basis=basis)
    with pytest.raises(ValueError, match="a basis of shape"):
        projection(FLEET, D + 1, K, basis=basis)
    check = basis_check(FLEET, D, K, basis=basis)
    np.testing.assert_array_equal(check, [D, *ordered_sum(basis[:, :K])])
    assert basis_problem(FLEET, check, K, public=basis) is None
    # The random projection's check is not this basis's, either way round.
    random = basis_check(FLEET, D, K)
    assert "away from fleet lab's projection" in str(basis_problem(FLEET, random, K, public=basis))
    assert basis_problem(FLEET, check, K) is not None
    assert basis_problem(FLEET, check, K, public=_basis(1)) is not None
    # Column sums run large: summed in another order they differ in the last bits only.
    big = basis * 1e4
    check = basis_check(FLEET, D, K, basis=big)
    for off, fine in ((1e-13, True), (1e-6, False)):
        moved = check.copy()
        moved[1:] *= 1 + off
        assert (basis_problem(FLEET, moved, K, public=big) is None) is fine


def _device(x: np.ndarray, y: np.ndarray, basis: str) -> ClosedFormDevice:
    return ClosedFormDevice(
        method=device_method("lda"), fleet=FLEET, features=x, labels=y, num_classes=C,
        settings=ClosedFormSettings(dim=K, basis=basis), seed=0, state_dir=None,
    )  # fmt: skip


def test_a_device_and_the_coordinator_that_name_one_basis_agree(tmp_path):
    path = tmp_path / BASIS_FILE
    np.save(path, _basis())
    rng = np.random.default_rng(3)
    x, y = rng.normal(size=(30, D)), rng.integers(0, C, 30)
    device = _device(x, y, str(path))
    # The device's statistics are of its rows through the basis's first K columns.
    rows = prepare(x, load_basis(str(path))[:, :K])
    gram = device.statistics().gram
    assert gram is not None
    assert float(np.abs(gram - rows.T @ rows).max()) < 1e-12
    assert device.projection_name != _device(x, y, "").projection_name

    def update(dev: ClosedFormDevice, *, noisy: bool = False):
        release = (dev.noisy_release(5.0, np.random.default_rng(1)) if noisy
                   else StatisticsRelease.of(dev.statistics(), basis=dev.basis))  # fmt: skip
        return release.update(fleet=FLEET, round_=0, client="d0", bundle=BUNDLE, method="lda")

    def admission(basis: str) -> Admission:
        return Admission.for_fleet(fleet=FLEET, bundle=BUNDLE, method="lda", classes=C, dim=K,
                                   max_count=1e6, max_value=1e6, feature_dim=D,
                                   basis=load_basis(basis) if basis else None)  # fmt: skip

    assert not admission(str(path)).wrong_basis(update(device))
    assert not admission(str(path)).wrong_basis(update(device, noisy=True))  # dp-features
    assert admission("").wrong_basis(update(device))  # a coordinator without it refuses
    assert admission(str(path)).wrong_basis(update(_device(x, y, "")))  # and the reverse


def _coordinator(state_dir: Path, basis: str, feature_dim: int = 0) -> CoordinatorConfig:
    return CoordinatorConfig(
        fleet=FLEET, state_dir=state_dir,
        model=ModelSettings(method="lda", bundle=BUNDLE, classes=tuple("abc"), dim=K,
                            feature_dim=feature_dim),
        rounds=RoundSettings(min_clients=2), security=CoordinatorSecurity(insecure=True),
        closed_form=FleetClosedForm(basis=basis),
    )  # fmt: skip


def test_a_basis_setting_that_names_no_basis_is_said_at_start(tmp_path):
    def coordinator(basis: str, feature_dim: int = 0) -> CoordinatorConfig:
        return _coordinator(tmp_path, basis, feature_dim)

    with pytest.raises(ValueError, match=r"closed_form\.basis = '.*missing\.npy'.*no file at"):
        coordinator(str(tmp_path / "missing.npy"))
    np.save(tmp_path / "b.npy", _basis())
    held = coordinator(str(tmp_path / "b.npy"), D).admission_checks().basis
    assert held is not None and np.array_equal(held, load_basis(str(tmp_path / "b.npy")))
    with pytest.raises(ValueError, match="a basis for 6 features; the bundle has 7"):
        coordinator(str(tmp_path / "b.npy"), D + 1)
    with pytest.raises(ValueError, match=r"closed_form\.basis = .*square"):
        np.save(tmp_path / "wide.npy", np.ones((2, 3)))
        ClosedFormSettings(dim=K, basis=str(tmp_path / "wide.npy")).public_basis(2)


def test_edge_export_basis_writes_one_for_the_bundle(small_zoo, tmp_path):
    bundle = tmp_path / "bundle"
    subprocess.run(["cp", "-r", str(small_zoo), str(bundle)], check=True)
    d = bundle_mod.load(bundle).feature_dim
    few = subprocess.run([str(BIN / "edge-export"), "basis", str(bundle), "--per-task",
                          str(d // 3)], capture_output=True, text=True, timeout=300)  # fmt: skip
    assert few.returncode == 2 and f"--per-task must be above {d // 3}" in few.stderr
    assert not (bundle / BASIS_FILE).exists()
    run = subprocess.run([str(BIN / "edge-export"), "basis", str(bundle), "--per-task",
                          str(d // 3 + 1)], capture_output=True, text=True, timeout=300)  # fmt: skip
    assert run.returncode == 0, run.stderr
    basis = load_basis(str(bundle / BASIS_FILE))
    assert basis.shape == (d, d)
    assert np.linalg.norm(basis[:, 0]) == pytest.approx(1.0)
    # Whitening: the columns grow as the public eigenvalues fall.
    norms = np.linalg.norm(basis, axis=0)
    assert norms[-1] > norms[d // 2] > norms[0]
    missing = subprocess.run([str(BIN / "edge-export"), "basis", str(tmp_path / "none")],
                             capture_output=True, text=True, timeout=300)  # fmt: skip
    assert missing.returncode == 2 and "Traceback" not in missing.stderr
    assert "none" in missing.stderr
    for bad in ("1", "x"):
        bad_run = subprocess.run([str(BIN / "edge-export"), "basis", str(bundle), "--per-task", bad],
                                 capture_output=True, text=True, timeout=300)  # fmt: skip
        assert bad_run.returncode == 2 and "Traceback" not in bad_run.stderr


def test_a_private_release_in_the_basis_keeps_what_the_random_projection_loses():
    # Three classes apart only along the narrowest direction of a steep spectrum; the
    # public rows share the features' geometry, not their labels. Under the same noise on
    # the second moment the whitened basis keeps that direction above the noise; the
    # features as they are (k = D: no random projection to lose it in) do not.
    dim, n, sigma = 24, 20_000, 2.0
    scale = np.geomspace(1.0, 1e-3, dim)

    def draw(count: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
        r = np.random.default_rng(seed)
        y = r.integers(0, C, count)
        x = r.normal(size=(count, dim)) * scale
        x[:, -1] += (y - 1.0) * 3e-3
        return x, y

    public, _ = draw(5_000, 1)
    x, y = draw(n, 2)
    x_test, y_test = draw(5_000, 3)

    def accuracy(q: np.ndarray | None) -> float:
        rows, test = prepare(x, q), prepare(x_test, q)
        stats = cf.device_statistics(rows, y, C)
        assert stats.gram is not None
        noise = np.random.default_rng(4).normal(0.0, sigma, (dim, dim))
        gram = stats.gram + np.triu(noise) + np.triu(noise, 1).T
        head = cf.lda_head(dataclasses.replace(stats, gram=gram), noise_std=sigma)
        return float((head.predict(test) == y_test).mean())

    whitened = accuracy(projection(FLEET, dim, dim, basis=public_basis(public)))
    plain = accuracy(projection(FLEET, dim, dim))
    assert whitened > plain + 0.2


@pytest.mark.broker
@pytest.mark.slow
def test_a_secure_fleet_in_the_bundles_basis_runs_over_mosquitto(small_zoo, tmp_path, capsys):
    # --stats-basis writes the bundle's basis once and names it on every agent and the
    # coordinator; the basis is bound into the secure round's settings, so the round
    # finishes only if every party holds the same one.
    bundle = tmp_path / "bundle"
    subprocess.run(["cp", "-r", str(small_zoo), str(bundle)], check=True)
    (bundle / BASIS_FILE).unlink(missing_ok=True)
    out = tmp_path / "report"
    argv = ["run", "--transport", "mqtt", "--method", "lda", "--stats-basis",
            "--secure-aggregation", "--epsilon", "1", "--clients", "3", "--rounds", "1",
            "--train", "30", "--test", "20", "--stats-dim", "16", "--workers", "1",
            "--bundle", str(bundle), "--out", str(out), "--no-progress"]  # fmt: skip
    assert cmd_run(build_parser().parse_args(argv)) == 0
    capsys.readouterr()
    assert (bundle / BASIS_FILE).exists()
    report = json.loads((out / "report.json").read_text())
    lda = report["methods"]["lda"]
    assert lda["settings"]["stats_basis"] is True
    run_ = lda["runs"]["0"]
    assert len(run_["accuracy"]) == 3
    layout = RunLayout(Path(run_["run_dir"]))
    coordinator = load_coordinator_config(layout.coordinator_config)
    assert coordinator.closed_form.basis == str(bundle / BASIS_FILE)
    for client in run_["accuracy"]:
        agent = load_agent_config(layout.agent_config(client))
        assert agent.closed_form.basis == str(bundle / BASIS_FILE)
    assert "head solved from the secure sum of 3 device(s)" in layout.coordinator_log.read_text()


def test_a_head_chosen_in_another_basis_is_not_predicted_with(tmp_path):
    # The head a device keeps scores features projected as when it was chosen: once the
    # fleet's basis is set (or changed, or dropped), `edge-agent predict` must not use it.
    path = tmp_path / BASIS_FILE
    np.save(path, _basis())
    rng = np.random.default_rng(5)
    x, y = rng.normal(size=(60, D)), np.arange(60) % C
    own = cf.lda_head(cf.device_statistics(prepare(x, None)[:, :K], y, C))
    announcement = RoundAnnouncement(
        fleet=FLEET, round=1, run=RUN, run_started=RUN_STARTED, bundle=BUNDLE, method="lda",
        classes=tuple("abc"), dim=K, deadline=0.0, params={"final": False},
        global_classes=announced(own).global_classes,
        global_prototypes=np.asarray(announced(own).global_prototypes, np.float32),
        extras={BIAS: np.asarray(announced(own).extras[BIAS], np.float32)},
    )  # fmt: skip

    def stored(kept_in: str, read_in: str):
        state = tmp_path / f"state-{bool(kept_in)}-{bool(read_in)}"
        state.mkdir()
        device = ClosedFormDevice(
            method=device_method("lda"), fleet=FLEET, features=x, labels=y, num_classes=C,
            settings=ClosedFormSettings(dim=K, basis=kept_in), seed=0, state_dir=state,
        )  # fmt: skip
        assert device.adopt(announcement)
        return StoredHead.load(state / ClosedFormDevice.FILE, fleet=FLEET, feature_dim=D,
                               settings=ClosedFormSettings(dim=K, basis=read_in),
                               num_classes=C)  # fmt: skip

    assert stored(str(path), str(path)) is not None
    assert stored("", "") is not None
    assert stored("", str(path)) is None  # chosen in the random projection
    assert stored(str(path), "") is None  # chosen in the basis


def test_a_secure_round_binds_the_basis_into_its_settings(tmp_path):
    # A secure sum hides each device's basis check, so the basis is bound into the digest
    # every advertisement carries: a device in another basis is refused there.
    path, other = tmp_path / "a.npy", tmp_path / "b.npy"
    np.save(path, _basis())
    np.save(other, _basis(1))
    table = SecureAggregation(threshold=2, epsilon=0.0, dataset_size=20)

    def digest(basis: np.ndarray | None) -> bytes:
        return secure_release(table, k=K, classes=C, gram=True, basis=basis).settings.table

    rng = np.random.default_rng(6)
    x, y = rng.normal(size=(20, D)), np.arange(20) % C
    device = _device(x, y, str(path))
    coordinator = _coordinator(tmp_path, str(path))
    check = coordinator.closed_form.basis_check(fleet=FLEET, feature_dim=0, dim=K)
    assert check is not None and np.array_equal(check, device.basis)
    assert digest(device.basis) == digest(check)
    assert digest(None) == table.digest()  # the random projection's digest as before
    assert len({digest(None), digest(check), digest(_device(x, y, str(other)).basis)}) == 3
    plain = dataclasses.replace(coordinator, closed_form=FleetClosedForm())
    assert plain.closed_form.basis_check(fleet=FLEET, feature_dim=0, dim=K) is None


def test_a_basis_written_again_is_a_new_release_and_a_new_run(tmp_path):
    # edge-export basis is not the same to the bit twice: a file written again is read
    # again, names another release on the device, and another state at the coordinator.
    path = tmp_path / BASIS_FILE
    np.save(path, _basis())
    rng = np.random.default_rng(8)
    x, y = rng.normal(size=(20, D)), np.arange(20) % C
    first = _device(x, y, str(path))
    state = tmp_path / "coordinator"

    def manager() -> RoundManager:
        cfg = _coordinator(state, str(path))
        state.mkdir(exist_ok=True)
        return RoundManager(config=cfg, store=Store(cfg.database), metrics=Metrics(),
                            clock=lambda: 0.0)  # fmt: skip

    manager()
    manager()  # the same basis: the same state resumes
    np.save(path, _basis(2))
    os.utime(path, ns=(1, 1))  # another modification time, whatever the clock's grain
    again = _device(x, y, str(path))
    assert first.q is not None  # the file as first read
    assert not np.array_equal(load_basis(str(path))[:, :K], first.q)  # read again
    assert again.basis_id != first.basis_id and first.basis_id
    assert again.projection_name != first.projection_name
    assert not np.array_equal(again.basis, first.basis)
    with pytest.raises(StateError, match="changed: basis"):
        manager()
