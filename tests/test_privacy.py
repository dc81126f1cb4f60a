"""Privacy: the accountant against known values and hand composition, the release
mechanisms by hand, the durable ledger, the budget stop, and a SIGKILL between the ledger
write and the update."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from edge_agent.agent import Agent
from edge_agent.config import AgentConfig, PrivacySettings
from edge_agent.privacy import accounting as acc
from edge_agent.privacy.ledger import Ledger, LedgerError
from edge_agent.privacy.mechanisms import MechanismParams, release_dp, release_none, release_paper
from edge_agent.train_config import TrainConfig
from export import bundle as bundle_mod
from protocol import PrototypeUpdate, RoundAnnouncement
from tests.agent_helpers import agent_config

CLASSES = tuple(str(i) for i in range(10))


# -- accountant --------------------------------------------------------------------------------


def test_rdp_reproduces_the_known_value() -> None:
    history = [acc.Event(1.5, 0.04, 2250)]
    assert acc.epsilon(history, delta=1e-5) == pytest.approx(7.3291, abs=5e-5)


def test_prv_is_selectable_and_no_looser_than_rdp() -> None:
    history = [acc.Event(1.5, 0.04, 2250)]
    prv = acc.epsilon(history, delta=1e-5, accountant="prv")
    assert 5.0 < prv <= acc.epsilon(history, delta=1e-5)


def test_a_mixed_history_composes_to_the_sum_of_its_parts_at_every_order() -> None:
    orders = acc.orders()
    sgd_a = acc.Event(1.1, 0.05, 40)
    release = acc.release_event(3.0, 4.0)
    sgd_b = acc.Event(0.9, 0.1, 25)
    whole = acc.rdp([sgd_a, release, sgd_b, release], orders)
    parts = acc.rdp([sgd_a], orders) + 2 * acc.rdp([release], orders) + acc.rdp([sgd_b], orders)
    np.testing.assert_allclose(whole, parts, rtol=1e-12)
    # A release of sums and counts is the Gaussian mechanism: alpha/2 (1/s^2 + 1/c^2).
    by_hand = np.array(orders) / 2 * (1 / 3.0**2 + 1 / 4.0**2)
    np.testing.assert_allclose(acc.rdp([release], orders), by_hand, rtol=1e-9)
    assert acc.effective_sigma(2.0, 2.0) == pytest.approx(math.sqrt(2))


def test_plan_spends_the_budget_with_the_release_share() -> None:
    plan = acc.plan(epsilon_target=8.0, delta=1e-5, rounds=20, epochs=1, samples=300, batch=32)
    assert plan.sample_rate == pytest.approx(32 / 300)
    assert plan.sgd_steps == 20 * 10 and plan.releases == 20
    assert 7.9 <= plan.epsilon <= 8.0
    assert acc.epsilon(plan.history(), delta=1e-5) == pytest.approx(plan.epsilon, rel=1e-6)
    releases_only = acc.epsilon([acc.Event(plan.release_noise_multiplier, 1.0, 20)], delta=1e-5)
    assert releases_only == pytest.approx(0.2 * 8.0, rel=0.01)
    with pytest.raises(ValueError, match="release share"):
        acc.plan(epsilon_target=8, delta=1e-5, rounds=1, epochs=1, samples=10, batch=5,
                 release_share=1.5)  # fmt: skip


# -- mechanisms by hand -----------------------------------------------------------------------


def unit(rows: list[list[float]]) -> np.ndarray:
    z = np.array(rows, dtype=np.float32)
    return z / np.linalg.norm(z, axis=1, keepdims=True)


def test_release_none_and_paper_by_hand() -> None:
    z = unit([[1, 0], [0, 1], [1, 1]])
    y = np.array([0, 0, 2])
    exact = release_none(z, y, 3, MechanismParams(), np.random.default_rng(0))
    assert exact.classes.tolist() == [0, 2] and exact.counts.tolist() == [2, 1]
    np.testing.assert_allclose(exact.prototypes, [[0.5, 0.5], z[2]], atol=1e-6)

    params = MechanismParams(paper_noise="laplace", paper_scale=0.05, paper_p=0.2)
    noisy = release_paper(z, y, 3, params, np.random.default_rng(7))
    e = np.random.default_rng(7).laplace(0.0, 0.05, size=(2, 2))
    np.testing.assert_allclose(noisy.prototypes, 0.8 * exact.prototypes + e, atol=1e-6)


def test_release_dp_sends_every_class_and_divides_noisy_sums_by_noisy_counts() -> None:
    z = unit([[1, 0], [0, 1], [1, 1]])
    y = np.array([0, 0, 2])
    params = MechanismParams(sum_sigma=2.0, count_sigma=3.0)
    out = release_dp(z, y, 4, params, np.random.default_rng(5))
    rng = np.random.default_rng(5)
    sums = np.array([[1, 1], [0, 0], z[2], [0, 0]], dtype=np.float64)
    noisy_sums = sums + rng.normal(0, 2.0, size=(4, 2))
    noisy_counts = np.array([2.0, 0, 1, 0]) + rng.normal(0, 3.0, size=4)
    assert out.classes.tolist() == [0, 1, 2, 3]  # absent classes too
    np.testing.assert_allclose(
        out.prototypes, noisy_sums / np.maximum(1, noisy_counts)[:, None], rtol=1e-5
    )
    assert out.counts.tolist() == np.maximum(0, np.rint(noisy_counts)).astype(int).tolist()
    with pytest.raises(ValueError, match="unit-norm"):
        release_dp(z * 2, y, 4, params, np.random.default_rng(0))


# -- ledger -----------------------------------------------------------------------------------


def test_ledger_is_durable_and_refuses_a_changed_delta(tmp_path: Path) -> None:
    ledger = Ledger(tmp_path, epsilon_budget=5.0, delta=1e-5, accountant="rdp")
    first = ledger.record(0, [acc.Event(1.0, 0.1, 10), acc.release_event(5.0, 5.0)])
    second = ledger.record(1, [acc.Event(1.0, 0.1, 10), acc.release_event(5.0, 5.0)])
    assert 0 < first < second
    again = Ledger(tmp_path, epsilon_budget=5.0, delta=1e-5, accountant="rdp")
    assert again.spent() == pytest.approx(second)
    assert json.loads((tmp_path / "privacy.json").read_text())["epsilon_spent"] == pytest.approx(
        second
    )
    with pytest.raises(LedgerError, match="delta"):
        Ledger(tmp_path, epsilon_budget=5.0, delta=1e-6, accountant="rdp")


# -- the agent ---------------------------------------------------------------------------------


def dp_config(root: Path, bundle: Path, *, epsilon: float) -> AgentConfig:
    base = agent_config(root, bundle, agent_id="dev-dp", domain="clean")
    return replace(
        base,
        train=TrainConfig(out_dim=32, norm="group"),
        privacy=PrivacySettings(
            mechanism="dp",
            epsilon=epsilon,
            sgd_noise_multiplier=1.0,
            release_noise_multiplier=2.0,
            noise_seed=3,
        ),
    )


def announcement(bundle_id: str, round_: int) -> RoundAnnouncement:
    """Round 0 bare; later rounds carry global prototypes, so DP-SGD trains FedPCL's own
    objective (round 0 falls back to cross-entropy)."""
    globals_: dict[str, object] = {}
    if round_ > 0:
        protos = np.random.default_rng(round_).normal(size=(10, 32)).astype(np.float32)
        protos /= np.linalg.norm(protos, axis=1, keepdims=True)
        globals_ = {"global_classes": tuple(range(10)), "global_prototypes": protos}
    return RoundAnnouncement(
        fleet="lab", round=round_, bundle=bundle_id, method="fedpcl", classes=CLASSES,
        deadline=time.time() + 600, params={"final": False}, **globals_,  # type: ignore[arg-type]
    )  # fmt: skip


def test_dp_agent_reports_its_spend_and_stops_publishing_at_the_budget(
    small_zoo: Path, tmp_path: Path
) -> None:
    probe = Agent(dp_config(tmp_path / "probe", small_zoo, epsilon=1e6))
    two_rounds = probe.ledger.spent(probe._dp_events(None, None) * 2)
    three_rounds = probe.ledger.spent(probe._dp_events(None, None) * 3)
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


SCRIPT = """
import sys, time
from pathlib import Path
from edge_agent.agent import Agent
from edge_agent.config import load
from tests.test_privacy import announcement
agent = Agent(load(Path(sys.argv[1])))
decision = agent.handle(announcement(agent.bundle_id, 0))
print(decision.reason, agent.epsilon_spent)
"""


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


# -- audit ------------------------------------------------------------------------------------


def test_clopper_pearson_by_hand() -> None:
    from edge_agent.privacy.audit import clopper_pearson

    low, high = clopper_pearson(0, 100)
    assert low == 0.0 and high == pytest.approx(1 - 0.025 ** (1 / 100), rel=1e-9)
    low, high = clopper_pearson(100, 100)
    assert high == 1.0 and low == pytest.approx(0.025 ** (1 / 100), rel=1e-9)


def test_the_canary_audit_holds_for_the_release_and_fails_for_a_broken_one() -> None:
    from edge_agent.privacy.audit import canary_audit, release_broken

    real = canary_audit(runs=6000, seed=1)
    broken = canary_audit(runs=6000, seed=1, mechanism=release_broken)
    assert real.epsilon_claimed == broken.epsilon_claimed
    assert real.epsilon_lower_bound <= real.epsilon_claimed
    assert broken.epsilon_lower_bound > broken.epsilon_claimed  # the audit can fail


def test_label_inference_from_counts_with_and_without_noise() -> None:
    from edge_agent.privacy.audit import label_inference_error

    rng = np.random.default_rng(0)
    z = rng.normal(size=(60, 8))
    z /= np.linalg.norm(z, axis=1, keepdims=True)
    y = np.repeat([0, 1, 2], [40, 15, 5])
    true = np.bincount(y, minlength=4)
    exact = release_none(z, y, 4, MechanismParams(), rng)
    sent = np.zeros(4, np.int64)
    sent[exact.classes] = exact.counts
    assert label_inference_error(true, sent) == 0.0
    noisy = [
        label_inference_error(
            true, release_dp(z, y, 4, MechanismParams(sum_sigma=20.0, count_sigma=20.0), rng).counts
        )
        for _ in range(50)
    ]
    assert np.mean(noisy) > 0.15
