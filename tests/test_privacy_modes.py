"""The privacy modes (edge_agent/privacy/modes.py), one per mechanism, built directly on
small arrays: what each admits, trains and releases, the registry that chooses them, and
the configuration checks that ask the mechanisms' records what they need."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from edge_agent import inference, predictor
from edge_agent.anchored import RULES as ANCHORED_RULES
from edge_agent.closed_form import ClosedFormDevice
from edge_agent.config import ClosedFormSettings
from edge_agent.methods import device_method
from edge_agent.privacy.ledger import Ledger
from edge_agent.privacy.mechanisms import MECHANISMS, release_dp, release_none, release_paper
from edge_agent.privacy.modes import (
    MODES,
    DpMode,
    FeatureMode,
    LocalTraining,
    PlainMode,
    PrivacyMode,
    make_mode,
    mode_class,
)
from edge_agent.privacy.randomness import DP_GUARANTEE, REPRODUCIBLE
from edge_agent.privacy.settings import PrivacySettings
from edge_agent.state import StateDir
from edge_agent.train import LocalModel, make_optimiser
from edge_agent.train_config import TrainConfig
from tests.agent_helpers import agent_config, announcement

N, DIM, CLASSES, BOUND, SEED = 60, 12, 4, 120, 5


def labels() -> np.ndarray:
    return np.arange(N) % 3  # classes 0-2 held, class 3 not


def local(method: str = "fedpcl", *, norm: str = "batch") -> LocalTraining:
    cfg = TrainConfig(out_dim=32, norm=norm, batch_size=16)  # type: ignore[arg-type]
    torch.manual_seed(0)
    model = LocalModel(in_dim=DIM, num_classes=CLASSES, cfg=cfg)
    features = np.random.default_rng(0).normal(size=(N, DIM)).astype(np.float32)
    return LocalTraining(model=model, optimiser=make_optimiser(model, cfg), features=features,
                         labels=labels(), num_classes=CLASSES,
                         generator=torch.Generator().manual_seed(0), method=method,
                         client="dev", cfg=cfg, seed=0)  # fmt: skip


def build(root: Path, mechanism: str, *, epsilon: float = 100.0, method: str = "fedpcl",
          seed: int | None = SEED) -> PrivacyMode:  # fmt: skip
    settings = PrivacySettings(mechanism=mechanism, epsilon=epsilon, dataset_size=BOUND,
                               release_noise_multiplier=2.0, reproducible_noise_seed=seed)  # fmt: skip
    training = local(method, norm="group" if mechanism == "dp" else "batch")
    state = StateDir(root, agent_id="dev")
    return make_mode(settings, local=training, state=state, data_version="v1")


def unit_rows(n: int, d: int) -> np.ndarray:
    z = np.random.default_rng(1).normal(size=(n, d))
    return z / np.linalg.norm(z, axis=1, keepdims=True)


def cost(root: Path, mechanism: str, *, rounds: int = 1) -> float:
    """The epsilon of ``rounds`` answered rounds (dp) or releases (dp-features)."""
    probe = build(root, mechanism)
    spending = probe.spending
    events = spending.dp_events() if mechanism == "dp" else [spending.release_event()]
    return probe.ledger.spent(events * rounds)


# -- the registry ------------------------------------------------------------------------------


def test_every_configured_mechanism_has_a_mode_that_matches_its_record(tmp_path: Path) -> None:
    assert set(MODES) == set(MECHANISMS)
    for name, spec in MECHANISMS.items():
        cls = mode_class(name)
        assert (cls is FeatureMode) == (spec.space == "features"), name
        assert (cls is DpMode) == spec.dp_sgd, name
        mode = build(tmp_path / name, name)
        assert type(mode) is cls and mode.settings.mechanism == name
        # A formal mechanism's metadata carries its claim; the others' claim nothing.
        meta = mode.meta(mode.spent())
        assert (meta.delta is not None) == spec.formal, name
        assert meta.guarantee == (DP_GUARANTEE if spec.formal else "none"), name
    with pytest.raises(ValueError, match="none, paper, dp, dp-features"):
        mode_class("gaussian")


def test_the_configuration_asks_the_mechanisms_record_what_it_needs(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"'dp' needs privacy\.dataset_size"):
        PrivacySettings(mechanism="dp")
    PrivacySettings(mechanism="dp-features")  # no DP-SGD: no bound needed
    cfg = agent_config(tmp_path, Path("bundle"), agent_id="dev", domain="clean")
    with pytest.raises(ValueError, match=r"'dp' needs train\.norm = 'group'"):
        replace(cfg, privacy=PrivacySettings(mechanism="dp", dataset_size=BOUND))
    replace(cfg, privacy=PrivacySettings(mechanism="dp-features"))  # BatchNorm is fine there


# -- admit -------------------------------------------------------------------------------------


def test_dp_admits_a_round_only_while_the_ledger_holds_its_spend(tmp_path: Path) -> None:
    # A budget that holds one round, not two.
    budget = (cost(tmp_path / "a", "dp") + cost(tmp_path / "b", "dp", rounds=2)) / 2
    mode = build(tmp_path / "dev", "dp", epsilon=budget)
    assert mode.admit(0)
    _, spent = mode.release(0, unit_rows(N, 32), labels())
    assert spent == pytest.approx(mode.ledger.spent()) and len(mode.ledger.spends) == 1
    assert not mode.admit(1)
    assert len(mode.ledger.spends) == 1  # a refusal spends nothing
    restarted = build(tmp_path / "dev", "dp", epsilon=budget)  # the ledger survives it
    assert not restarted.admit(1)


def test_dp_features_pays_for_its_release_once_and_refuses_one_it_cannot_afford(
    tmp_path: Path,
) -> None:
    one = cost(tmp_path / "probe", "dp-features")
    poor = build(tmp_path / "poor", "dp-features", epsilon=one / 2)
    assert not poor.admit(0)
    assert poor.ledger.spends == [] and poor.state.load_feature_release("v1") is None
    mode = build(tmp_path / "dev", "dp-features")
    with pytest.raises(RuntimeError, match="not admitted"):
        mode.release(0, unit_rows(N, 32), labels())
    assert mode.admit(0) and len(mode.ledger.spends) == 1
    first, spent = mode.release(0, unit_rows(N, 32), labels())
    restarted = build(tmp_path / "dev", "dp-features")
    assert restarted.admit(1) and len(restarted.ledger.spends) == 1  # stored: no new spend
    again, spent_again = restarted.release(1, unit_rows(N, 32) * -1, labels())
    np.testing.assert_array_equal(again.prototypes, first.prototypes)
    assert spent_again == pytest.approx(spent)


# -- release -----------------------------------------------------------------------------------


def test_none_and_paper_release_the_embeddings_through_the_mechanism(tmp_path: Path) -> None:
    z = unit_rows(N, 32)
    plain = build(tmp_path / "none", "none")
    release, spent = plain.release(0, z, labels())
    expected = release_none(z, labels(), CLASSES, plain.spending.mechanism_params(),
                            np.random.default_rng(0))  # fmt: skip
    assert spent is None and release.classes.tolist() == [0, 1, 2]  # the classes held
    np.testing.assert_array_equal(release.prototypes, expected.prototypes)
    assert plain.wire_counts(release.counts) == (20, 20, 20)
    assert {type(c) for c in plain.wire_counts(release.counts)} == {int}
    paper = build(tmp_path / "paper", "paper")
    noisy, _ = paper.release(0, z, labels())
    by_hand = release_paper(z, labels(), CLASSES, paper.spending.mechanism_params(),
                            np.random.default_rng(SEED))  # fmt: skip
    np.testing.assert_array_equal(noisy.prototypes, by_hand.prototypes)
    assert not np.array_equal(noisy.prototypes, release.prototypes)


def test_dp_releases_every_class_noised_and_records_it_before_returning(tmp_path: Path) -> None:
    mode = build(tmp_path, "dp")
    z = unit_rows(N, 32)
    release, spent = mode.release(0, z, labels())
    by_hand = release_dp(z, labels(), CLASSES, mode.spending.mechanism_params(),
                         np.random.default_rng(SEED))  # fmt: skip
    assert release.classes.tolist() == [0, 1, 2, 3]  # absent classes too
    np.testing.assert_array_equal(release.prototypes, by_hand.prototypes)
    assert {type(c) for c in mode.wire_counts(release.counts)} == {float}
    durable = Ledger(tmp_path, epsilon_budget=100.0, delta=1e-5, accountant="rdp")
    assert spent is not None and spent > 0 and durable.spent() == pytest.approx(spent)
    # Replayable noise: the update says the claim is void.
    assert mode.meta(spent).guarantee == REPRODUCIBLE


def test_dp_features_releases_the_frozen_features_not_the_embeddings(tmp_path: Path) -> None:
    mode = build(tmp_path, "dp-features")
    assert mode.admit(0)
    release, _ = mode.release(0, unit_rows(N, 32), labels())
    by_hand = release_dp(mode.local.features, labels(), CLASSES,
                         mode.spending.mechanism_params(), np.random.default_rng(SEED))  # fmt: skip
    assert release.prototypes.shape == (CLASSES, DIM)
    np.testing.assert_array_equal(release.prototypes, by_hand.prototypes)
    assert mode.prototype_dim(feature_dim=DIM) == DIM
    assert build(tmp_path / "none", "none").prototype_dim(feature_dim=DIM) == 32


def test_a_closed_form_device_releases_its_statistics_once_under_a_formal_mode(
    tmp_path: Path,
) -> None:
    def closed() -> ClosedFormDevice:
        return ClosedFormDevice(method=device_method("lda"), fleet="lab",
                                features=local().features, labels=labels(),
                                num_classes=CLASSES, settings=ClosedFormSettings(), seed=0,
                                state_dir=None)  # fmt: skip

    plain = build(tmp_path / "none", "none", method="lda")
    made = plain.release_statistics(0, version="v1", closed=closed())
    assert made is not None and made[1] is None
    np.testing.assert_array_equal(made[0].rows, closed().release().rows)  # exact
    mode = build(tmp_path / "dp", "dp-features", method="lda")
    assert isinstance(mode, FeatureMode) and mode.learner is None  # it trains no head
    first = mode.release_statistics(0, version="v1", closed=closed())
    again = mode.release_statistics(1, version="v1", closed=closed())
    assert first is not None and again is not None and len(mode.ledger.spends) == 1
    np.testing.assert_array_equal(first[0].rows, again[0].rows)
    assert not np.allclose(first[0].rows[:3], closed().release().rows)  # noised


# -- train and predict -------------------------------------------------------------------------


def test_each_mode_trains_as_its_mechanism_says(tmp_path: Path) -> None:
    bare = announcement("b" * 64, 0, dim=0)
    plain = build(tmp_path / "none", "none").train(bare)
    assert plain.metrics.steps == 4 and plain.record == {}  # 60 samples in batches of 16
    dp = build(tmp_path / "dp", "dp")
    # DP-SGD: Poisson steps planned from the public bound (120), not the 60 held.
    assert dp.train(bare).metrics.steps == dp.spending.schedule().steps == 8
    features = build(tmp_path / "features", "dp-features")
    trained = features.train(bare)
    assert set(trained.record) == {"anchor_weight", "predict_rule", "val_accuracies"}
    assert trained.record["anchor_weight"] == 0.0  # no anchors announced: as Solo
    assert features.predict_rule in ANCHORED_RULES and features.predictor is features.local.model


def test_predict_asks_the_mode_for_the_rule_its_rounds_were_scored_by(tmp_path: Path) -> None:
    history: list[dict[str, Any]] = [{"round": 0, "predict_rule": "local_prototype_cosine"},
                                      {"round": 1}]  # fmt: skip
    assert FeatureMode.stored_rule(history) == "local_prototype_cosine"
    assert FeatureMode.stored_rule([]) == "classifier"
    assert PlainMode.stored_rule(history) is None and DpMode.stored_rule(history) is None
    # edge-agent predict: FedProto predicts by the global prototypes, which this device
    # has not been sent; under dp-features it predicts by the rule its rounds chose.
    cfg = agent_config(tmp_path, Path("bundle"), agent_id="dev", domain="clean",
                       method="fedproto")  # fmt: skip
    state = StateDir(cfg.state_dir, agent_id="dev")
    state.save_round(0, model=None, prototypes=np.ones((10, 32), np.float32),
                     counts=np.ones(10), update=b"", metrics={"predict_rule": "classifier"})  # fmt: skip
    refs = inference.stored_references(state)
    with pytest.raises(predictor.PredictorError, match="no global prototypes yet"):
        predictor.rule_for(cfg, state, refs)
    features = replace(cfg, privacy=PrivacySettings(mechanism="dp-features"))
    assert predictor.rule_for(features, state, refs) == "classifier"
