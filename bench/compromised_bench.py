"""One compromised device against the coordinator's defaults (docs/coordinator.md, Robust
options): how far it moves the global prototypes towards its own vector, how long it makes
them, and what it costs the honest devices' accuracy.

An enrolled device whose key was stolen answers every round with one fixed vector a_c per
class, signed with its own key, in the two strongest forms admission lets through:

- ``loud``: unit rows (the longest an exact release may be) claiming ``admission.max_count``
  samples of every class, so a count-weighted mean would be all its own;
- ``long``: rows 1,000 long (``admission.max_value``) that claim a noise mechanism, which
  exempts them from the unit bound an exact release is held to.

FedPCL on digits-5's feature shift over the full zoo, in memory (the real agents and
round manager), with 3, 10 and 100 devices, under the defaults, under each ``rule``, with
the defaults but the direction screen off (``no_screen``: count cap and norm clip only)
and with every median defence off (``undefended``). Figures: the cosine of each class's
final global prototype to a_c (the largest over classes), the largest global norm, and,
at 10 devices, the honest devices' mean final accuracy against the same run with no
attack, itself run with and without the direction screen (what the screen costs a fleet
that is not attacked).
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from bench.export_bench import ZOO, ensure_zoo
from coordinator.config import AdmissionSettings
from edge_agent.agent import Agent, Decision
from edge_agent.delivery import SignedUpdates
from export import bundle as bundle_mod
from fleet.data.partition import digits5
from fleet.transports.collect import collect
from fleet.transports.memory import run_memory
from fleet.transports.runner import fleet_tables
from fleet.transports.spec import RunSpec
from protocol import PrivacyMeta, PrototypeUpdate, RoundAnnouncement

ROUNDS = 10
DEVICES = (3, 10, 100)
#: The coordinator's ``[robust]`` table of each setting compared.
SETTINGS: dict[str, dict[str, Any]] = {
    "defaults": {},
    "median": {"rule": "median"},
    "trimmed_mean": {"rule": "trimmed_mean"},
    "no_screen": {"median_direction_screen": False},
    "undefended": {
        "median_count_cap": False,
        "median_norm_clip": False,
        "median_direction_screen": False,
    },
}
ATTACKS = ("loud", "long")
LIMITS = AdmissionSettings()


def attack_vectors(classes: int, dim: int) -> np.ndarray:
    """The attacker's unit vector of each class: fixed, and unrelated to the data."""
    rows = np.random.default_rng(20261126).normal(size=(classes, dim))
    return rows / np.linalg.norm(rows, axis=1, keepdims=True)


class Compromised(Agent):
    """A real enrolled device, data and key included, whose answers the attacker writes."""

    attack = "loud"
    last: RoundAnnouncement | None = None

    def handle(
        self, announcement: RoundAnnouncement, *, received_bytes: int | None = None
    ) -> Decision:
        type(self).last = announcement
        if announcement.params.get("final") is True:
            return Decision("final")
        rows = attack_vectors(self.num_classes, self.prototype_dim)
        privacy = PrivacyMeta()
        if self.attack == "long":
            rows = rows * LIMITS.max_value
            privacy = PrivacyMeta(mechanism="dp", epsilon=1.0, delta=1e-5,
                                  guarantee="(epsilon, delta)-DP, add/remove one example")  # fmt: skip
        sent = SignedUpdates.signed(self, announcement, PrototypeUpdate(
            fleet=self.cfg.fleet, round=announcement.round, client=self.cfg.agent_id,
            bundle=self.bundle_id, method=self.cfg.method,
            classes=tuple(range(self.num_classes)),
            counts=(float(LIMITS.max_count),) * self.num_classes,
            prototypes=rows.astype(np.float16), privacy=privacy,
        ))  # fmt: skip
        return Decision("answered", update=sent.update, payload=sent.payload)


def attacked(
    root: Path, *, devices: int, robust: dict[str, Any], attack: str | None, seed: int = 0
) -> dict[str, float]:
    """One run: the attacker's cosine and the global norm (0 without an attack), and the
    honest devices' mean final accuracy."""
    partition = digits5(clients=devices, split="feature", seed=seed, train=100, test=100)
    spec = RunSpec(method="fedpcl", rounds=ROUNDS, bundle=ZOO, out=root, seed=seed,
                   transport="memory", progress=False, feature_cache=root.parent / "cache")  # fmt: skip
    agents, coord = fleet_tables(spec, partition, bundle_mod.load(ZOO))
    coord["robust"] = robust
    attacker = partition.clients[0].name
    Compromised.attack, Compromised.last = attack or "loud", None
    impostors = {attacker: Compromised} if attack else {}
    peak, _ = run_memory(spec, list(agents.values()), coord, impostors=impostors)
    result = collect(spec, partition, peak_mb=peak, wall=0.0)
    # The same devices with and without an attack: the attacker's seat is left out of both.
    honest = [c.accuracy[-1] for c in result.clients if c.name != attacker]
    out = {"accuracy": float(np.mean([a for a in honest if a is not None]))}
    if attack:
        final = Compromised.last
        assert final is not None and len(final.global_classes)
        rows = np.asarray(final.global_prototypes, dtype=np.float64)
        mine = attack_vectors(len(final.classes), rows.shape[1])[list(final.global_classes)]
        norms = np.linalg.norm(rows, axis=1)
        cosines = (rows * mine).sum(axis=1) / np.maximum(norms, 1e-12)
        out |= {"cosine": float(cosines.max()), "norm": float(norms.max())}
    return out


def run() -> dict[str, float]:
    ensure_zoo()
    results: dict[str, float] = {}
    with tempfile.TemporaryDirectory(prefix="protofleet-compromised-") as tmp:
        root = Path(tmp)
        for devices in DEVICES:
            for name, robust in SETTINGS.items():
                worst: dict[str, float] = {"cosine": -1.0, "norm": 0.0}
                for attack in ATTACKS:
                    got = attacked(root / f"{devices}-{name}-{attack}", devices=devices,
                                   robust=robust, attack=attack)  # fmt: skip
                    worst = {k: max(worst[k], got[k]) for k in worst}
                    if devices == 10 and name == "defaults":
                        results[f"reliability.compromised_1_of_10_{attack}_accuracy"] = got[
                            "accuracy"
                        ]
                key = f"reliability.compromised_1_of_{devices}_{name}"
                results[f"{key}_cosine"] = worst["cosine"]
                results[f"{key}_norm"] = worst["norm"]
        clean = attacked(root / "10-clean", devices=10, robust={}, attack=None)["accuracy"]
        unscreened = attacked(root / "10-clean-no-screen", devices=10,
                              robust=SETTINGS["no_screen"], attack=None)["accuracy"]  # fmt: skip
    results["reliability.compromised_1_of_10_clean_accuracy"] = clean
    results["reliability.compromised_1_of_10_clean_no_screen_accuracy"] = unscreened
    results["reliability.compromised_1_of_10_cosine"] = results[
        "reliability.compromised_1_of_10_defaults_cosine"
    ]
    attacked_accuracy = min(
        results[f"reliability.compromised_1_of_10_{a}_accuracy"] for a in ATTACKS
    )
    results["reliability.compromised_1_of_10_accuracy_drop"] = 100.0 * (clean - attacked_accuracy)
    return results
