"""A device under dp and dp-features: the spend it reports and the budget stop, metadata
that neighbouring data sets cannot tell apart, a data set above the public bound refused,
secret noise and masks, the once-per-data-version feature release, and a SIGKILL between
the ledger write and the update."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from edge_agent.agent import Agent, Decision
from edge_agent.commands.status import _privacy_status
from edge_agent.data import DataError
from edge_agent.privacy import accounting as acc
from edge_agent.privacy.dpsgd import train_round_dp
from edge_agent.privacy.randomness import NoiseSource
from edge_agent.train import Guidance, LocalModel, make_optimiser
from edge_agent.train_config import TrainConfig
from export import bundle as bundle_mod
from fleet.engine.evaluation import FleetEvaluator
from protocol import PrototypeUpdate, topics
from tests.agent_helpers import agent_config, announcement, dp_config


def test_dp_agent_reports_its_spend_and_stops_publishing_at_the_budget(
    small_zoo: Path, tmp_path: Path
) -> None:
    probe = Agent(dp_config(tmp_path / "probe", small_zoo, epsilon=1e6))
    two_rounds = probe.mode.ledger.spent(probe.mode.spending.dp_events() * 2)
    three_rounds = probe.mode.ledger.spent(probe.mode.spending.dp_events() * 3)
    # A budget that holds two rounds and not three.
    cfg = dp_config(tmp_path / "agent", small_zoo, epsilon=(two_rounds + three_rounds) / 2)
    agent = Agent(cfg)
    bundle_id = bundle_mod.load(small_zoo).id
    spent: list[float] = []
    for r in range(2):
        decision = agent.handle(announcement(bundle_id, r))
        assert decision.reason == "answered" and decision.payload is not None
        update = PrototypeUpdate.from_wire(decision.payload)
        assert update.privacy.mechanism == "dp" and update.privacy.delta == 1e-5
        assert update.classes == tuple(range(10))  # every class, held or not
        assert update.privacy.epsilon is not None
        spent.append(update.privacy.epsilon)
    assert 0 < spent[0] < spent[1] <= cfg.privacy.epsilon
    assert spent[1] == pytest.approx(agent.epsilon_spent)
    third = agent.handle(announcement(bundle_id, 2))
    assert third.reason == "budget_exhausted" and third.payload is None
    assert agent.state.snapshot.extra["privacy_exhausted"] is True
    assert agent.epsilon_spent == pytest.approx(spent[1])  # nothing spent on a refusal
    # It keeps serving predictions: its local prototypes are still on disk.
    assert agent.state.load_prototypes() is not None


def neighbour(train: Path, folder: Path) -> Path:
    """The same data set with one example (the 8th) removed: add/remove neighbours."""
    with np.load(train) as data:
        x, y = data["x"], data["y"]
    path = folder / "neighbour.npz"
    folder.mkdir(parents=True, exist_ok=True)
    np.savez(path, x=np.delete(x, 7, axis=0), y=np.delete(y, 7))
    return path


def public_view(decision: Decision, fleet: str) -> dict[str, Any]:
    """Everything of an update an observer sees except the noised numbers themselves."""
    reason, payload = decision.reason, decision.payload
    if payload is None:
        return {"reason": reason}
    update = PrototypeUpdate.from_wire(payload)
    return {
        "reason": reason,
        "topic": topics.update_topic(fleet, update.client),
        "size": len(payload),
        "round": update.round,
        "classes": update.classes,
        "counts_len": len(update.counts),
        "counts_types": {type(c).__name__ for c in update.counts},
        "shape": update.prototypes.shape,
        "dtype": str(update.prototypes.dtype),
        "extras": sorted(update.extras),
        "privacy": update.privacy.to_obj(),
    }


@pytest.mark.slow
@pytest.mark.parametrize("mechanism", ["dp", "dp-features"])
def test_neighbouring_data_sets_publish_byte_identical_metadata(
    small_zoo: Path, tmp_path: Path, mechanism: str
) -> None:
    """One example removed: every update's epsilon, steps, round count, stop round, topic
    and size are the same; only the noised numbers differ. The budget holds two dp rounds
    (not three), and one dp-features release (sent again every round)."""
    probe = Agent(dp_config(tmp_path / "probe", small_zoo, epsilon=1e6, mechanism=mechanism))
    if mechanism == "dp":
        events = probe.mode.spending.dp_events()
        budget = (probe.mode.ledger.spent(events * 2) + probe.mode.ledger.spent(events * 3)) / 2
    else:
        budget = probe.mode.ledger.spent([probe.mode.spending.release_event()]) * 1.5
    views, ledgers = [], []
    for name in ("full", "neighbour"):
        root = tmp_path / name
        cfg = dp_config(root, small_zoo, epsilon=budget, mechanism=mechanism, seed=None)
        if name == "neighbour":
            cfg = replace(cfg, data=replace(cfg.data, train=neighbour(cfg.data.train, root)))
        agent = Agent(cfg)
        views.append([public_view(agent.handle(announcement(agent.bundle_id, r,
                                                            dim=agent.prototype_dim)), "lab")
                      for r in range(4)])  # fmt: skip
        ledgers.append(json.loads((cfg.state_dir / "privacy.json").read_text()))
    with np.load(neighbour(probe.cfg.data.train, tmp_path / "n")) as data:
        assert len(data["y"]) == len(probe.train_labels) - 1 == 119
    assert views[0] == views[1]
    reasons = [v["reason"] for v in views[0]]
    if mechanism == "dp":
        assert reasons == ["answered", "answered", "budget_exhausted", "budget_exhausted"]
    else:
        assert reasons == ["answered"] * 4
        assert len({v["privacy"]["epsilon"] for v in views[0]}) == 1  # paid once
    assert views[0][0]["counts_types"] == {"float"}
    assert views[0][0]["privacy"]["guarantee"] == "(epsilon, delta)-DP, add/remove one example"
    for ledger in ledgers:
        ledger.pop("spends")  # identical events; their rounds and counts checked below
    assert ledgers[0] == ledgers[1]


def test_a_data_set_above_the_declared_bound_is_refused_before_anything_is_released(
    small_zoo: Path, tmp_path: Path
) -> None:
    cfg = dp_config(tmp_path, small_zoo, epsilon=8.0)
    cfg = replace(cfg, privacy=replace(cfg.privacy, dataset_size=100))
    with pytest.raises(DataError, match=r"120 training samples, above privacy.dataset_size = 100"):
        Agent(cfg)
    assert not (cfg.state_dir / "privacy.json").exists()


def test_the_same_seed_draws_different_noise_and_masks_unless_reproducible(
    small_zoo: Path, tmp_path: Path
) -> None:
    updates, heads = {}, {}
    for name, seed in (("a", None), ("b", None), ("c", 11), ("d", 11)):
        agent = Agent(dp_config(tmp_path / name, small_zoo, epsilon=100.0, seed=seed))
        decision = agent.handle(announcement(agent.bundle_id, 0))
        assert decision.payload is not None
        updates[name] = PrototypeUpdate.from_wire(decision.payload)
        heads[name] = torch.cat([p.detach().flatten() for p in agent.model.parameters()])
    assert not np.array_equal(updates["a"].prototypes, updates["b"].prototypes)
    assert not torch.equal(heads["a"], heads["b"])  # DP-SGD's masks and noise differ
    assert updates["a"].privacy.guarantee == "(epsilon, delta)-DP, add/remove one example"
    # Replayable noise: the same draws, and everything says the guarantee is void.
    np.testing.assert_array_equal(updates["c"].prototypes, updates["d"].prototypes)
    assert torch.equal(heads["c"], heads["d"])
    assert updates["c"].privacy.guarantee == "none (reproducible noise)"
    ledger = json.loads((tmp_path / "c" / "state" / "privacy.json").read_text())
    assert ledger["guarantee"] == "none (reproducible noise)"
    assert ledger["spends"][0]["guarantee"] == "none (reproducible noise)"
    status = _privacy_status(dp_config(tmp_path / "c", small_zoo, epsilon=100.0, seed=11), {})
    assert status["guarantee"] == "none (reproducible noise)"
    # A later secret configuration cannot restore what the ledger's past spends lost.
    status = _privacy_status(dp_config(tmp_path / "c", small_zoo, epsilon=100.0, seed=None), {})
    assert status["guarantee"] == "none (reproducible noise)"


def test_dp_sgd_draws_its_poisson_masks_from_the_noise_source(
    small_zoo: Path, tmp_path: Path
) -> None:
    """With a negligible gradient noise, two secret sources still train apart (their
    masks differ); two equal sources train to the same weights."""
    # 32 channels in 16 groups: a Poisson batch of one sample still has two values per
    # group to normalise (with 16 channels, one each, such a batch failed now and then).
    cfg = TrainConfig(out_dim=32, norm="group")
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 12)).astype(np.float32)
    y = rng.integers(0, 3, size=64)
    schedule = acc.sgd_schedule(dataset_size=64, batch=8, epochs=1)

    def weights(source: NoiseSource) -> torch.Tensor:
        torch.manual_seed(0)
        model = LocalModel(in_dim=12, num_classes=3, cfg=cfg)
        metrics = train_round_dp(model, make_optimiser(model, cfg), x, y, method="solo",
                                 guidance=Guidance.empty(3, 32), cfg=cfg, schedule=schedule,
                                 noise=source.torch, noise_multiplier=1e-6, max_grad_norm=1.0)  # fmt: skip
        assert metrics.steps == schedule.steps == 8
        return torch.cat([p.detach().flatten() for p in model.parameters()])

    assert not torch.allclose(weights(NoiseSource.create()), weights(NoiseSource.create()))
    assert torch.equal(weights(NoiseSource.create(4)), weights(NoiseSource.create(4)))


def test_dp_features_releases_once_per_data_version(small_zoo: Path, tmp_path: Path) -> None:
    """The first round pays for the release; later rounds send the same bytes again at no
    cost, across a restart; new data is a new release and a new spend."""
    cfg = dp_config(tmp_path, small_zoo, epsilon=100.0, mechanism="dp-features", seed=None)
    agent = Agent(cfg)
    bare = announcement(agent.bundle_id, 0, announced_dim=agent.prototype_dim)
    first = PrototypeUpdate.from_wire(agent.handle(bare).payload)
    assert first.prototypes.shape == (10, agent.runtime.feature_dim)  # the feature space
    spent = first.privacy.epsilon
    restarted = Agent(cfg)
    again = PrototypeUpdate.from_wire(
        restarted.handle(announcement(agent.bundle_id, 1, dim=agent.prototype_dim)).payload
    )
    np.testing.assert_array_equal(again.prototypes, first.prototypes)
    assert again.counts == first.counts and again.privacy.epsilon == spent
    assert len(restarted.mode.ledger.spends) == 1
    changed = replace(cfg, data=replace(cfg.data, train=neighbour(cfg.data.train, tmp_path / "v2")))
    newer = Agent(changed)
    third = PrototypeUpdate.from_wire(
        newer.handle(announcement(agent.bundle_id, 2, dim=agent.prototype_dim)).payload
    )
    assert not np.array_equal(third.prototypes, first.prototypes)
    assert third.privacy.epsilon is not None and spent is not None and third.privacy.epsilon > spent
    assert len(newer.mode.ledger.spends) == 2


def test_dp_features_trains_alone_when_no_anchor_helps(small_zoo: Path, tmp_path: Path) -> None:
    """Without global means (none announced in the feature space) every candidate trains
    the same objective on the same data order: the device keeps weight 0, its classifier,
    and the model that a Solo agent with the same seed trains."""
    cfg = dp_config(tmp_path / "features", small_zoo, epsilon=100.0, mechanism="dp-features")
    agent = Agent(cfg)
    solo_cfg = replace(agent_config(tmp_path / "solo", small_zoo, agent_id="dev-dp", domain="clean",
                                    method="solo"), train=cfg.train)  # fmt: skip
    solo = Agent(solo_cfg, evaluator=FleetEvaluator)
    for r in range(3):
        bare = announcement(agent.bundle_id, r, dim=0, announced_dim=agent.prototype_dim)
        assert agent.handle(bare).reason == "answered"
        bare = announcement(solo.bundle_id, r, "solo", dim=0, announced_dim=solo.prototype_dim)
        assert solo.handle(bare).reason == "answered"
    record, alone = agent.state.snapshot.history[-1], solo.state.snapshot.history[-1]
    assert record["anchor_weight"] == 0.0
    # The rule (classifier or own prototypes) is the device's choice on its validation split.
    figure = {"classifier": "test_accuracy_classifier",
              "local_prototype_cosine": "test_accuracy_prototype"}[record["predict_rule"]]  # fmt: skip
    assert record["test_accuracy"] == alone[figure]
    assert agent.predictor is agent.model
    for a, b in zip(agent.model.parameters(), solo.model.parameters(), strict=True):
        assert torch.equal(a, b)


SCRIPT = """
import sys, time
from pathlib import Path
from edge_agent.agent import Agent, Decision
from edge_agent.config import load
from tests.agent_helpers import announcement
agent = Agent(load(Path(sys.argv[1])))
decision = agent.handle(announcement(agent.bundle_id, 0))
print(decision.reason, agent.epsilon_spent)
"""


@pytest.mark.slow
def test_sigkill_after_the_ledger_write_never_lowers_the_spent_epsilon(
    small_zoo: Path, tmp_path: Path
) -> None:
    root = tmp_path / "agent"
    cfg = dp_config(root, small_zoo, epsilon=100.0)
    config = root / "agent.toml"
    config.write_text(
        f'agent_id = "dev-dp"\nfleet = "lab"\nstate_dir = "{cfg.state_dir}"\n'
        f'bundle = "{small_zoo}"\n[data]\ntrain = "{cfg.data.train}"\n'
        f'[train]\nout_dim = 32\nnorm = "group"\n'
        f'[privacy]\nmechanism = "dp"\nepsilon = 100.0\nrelease_noise_multiplier = 2.0\n'
        f"dataset_size = 120\n"
        "[security]\ninsecure = true\n"
    )
    cwd = Path(__file__).resolve().parent.parent
    env = {**os.environ, "PROTOFLEET_CRASH_AT": "after_ledger_write"}
    killed = subprocess.run([sys.executable, "-c", SCRIPT, str(config)], cwd=cwd, env=env,
                            capture_output=True, text=True, timeout=300)  # fmt: skip
    assert killed.returncode == -9, killed.stderr
    ledger = json.loads((cfg.state_dir / "privacy.json").read_text())
    before = ledger["epsilon_spent"]
    assert before > 0 and len(ledger["spends"]) == 1
    state = json.loads((cfg.state_dir / "state.json").read_text())
    assert state.get("last_round") is None  # the update was never stored

    env.pop("PROTOFLEET_CRASH_AT")
    done = subprocess.run([sys.executable, "-c", SCRIPT, str(config)], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr
    reason, after = done.stdout.split()
    assert reason == "answered"
    # The lost release stays counted: the restart re-answers and pays again.
    assert float(after) > before
    assert len(json.loads((cfg.state_dir / "privacy.json").read_text())["spends"]) == 2
