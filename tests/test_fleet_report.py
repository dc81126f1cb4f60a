"""The reports' arithmetic and words: means and spreads over seeds, best rounds, the
Markdown tables of a comparison and of a privacy sweep, strict JSON."""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pytest

from fleet.report.markdown import markdown
from fleet.report.notes import train_note
from fleet.report.plots import plot_domains
from fleet.report.privacy_report import curves, plot_accuracy_vs_epsilon
from fleet.report.privacy_report import markdown as privacy_markdown
from fleet.report.summary import build_report, to_json
from fleet.transports.spec import ClientRecord, RunResult, RunSpec
from secagg.fleet import SecureAggregation

PNG = b"\x89PNG\r\n\x1a\n"


def fake_result(
    tmp_path: Path,
    method: str,
    seed: int,
    accs: list[list[float]],
    train: dict[str, Any] | None = None,
) -> RunResult:
    spec = RunSpec(method=method, rounds=len(accs[0]), bundle=tmp_path, out=tmp_path, seed=seed,
                   extra_train=train or {})  # fmt: skip
    clients = tuple(
        ClientRecord(
            name=f"c{i}",
            domain=["clean", "photo"][i % 2],
            accuracy=tuple(a),
            accuracy_prototype=tuple(a),
            accuracy_classifier=tuple(a),
            bytes_up=(100,) * len(a),
            bytes_down=(1000,) * len(a),
        )
        for i, a in enumerate(accs)
    )
    return RunResult(spec=spec, clients=clients, round_seconds=(1.0,) * len(accs[0]),
                     peak_mb=50.0, wall_seconds=2.0)  # fmt: skip


def test_report_means_stds_and_table(tmp_path: Path) -> None:
    results = {
        "fedpcl": {
            0: fake_result(tmp_path, "fedpcl", 0, [[0.5, 0.8], [0.4, 0.6]]),
            1: fake_result(tmp_path, "fedpcl", 1, [[0.5, 0.6], [0.4, 0.4]]),
        }
    }
    doc = build_report(results, config={}, partition="toy")
    m = doc["methods"]["fedpcl"]
    # Final means per seed: (0.8 + 0.6) / 2 = 0.7 and (0.6 + 0.4) / 2 = 0.5.
    assert m["final_mean"] == pytest.approx(0.6)
    assert m["final_std"] == pytest.approx(0.1)
    assert m["per_domain"] == pytest.approx({"clean": 0.7, "photo": 0.5})
    assert m["mean_by_round"] == pytest.approx([0.45, 0.6])
    assert m["bytes_up_per_client_round"] == 100
    # Best rounds: seed 0's mean by round is (0.45, 0.7), seed 1's (0.45, 0.5): both at 2.
    assert m["best_mean"] == pytest.approx(0.6) and m["best_std"] == pytest.approx(0.1)
    assert m["best_round"] == {"0": 2, "1": 2}
    assert doc["methods"]["fedpcl"]["runs"]["0"]["best_round"] == 2
    table = markdown(doc)
    assert "| method | clean | photo | final | best (round) |" in table
    assert "| fedpcl | 70.0 (10.0) | 50.0 (10.0) | 60.0 (10.0) | 60.0 (10.0) @ 2 |" in table
    assert "own rule: fedpcl by cosine similarity to its local prototypes." in table
    both = {m: results["fedpcl"] for m in ("solo", "fedproto", "fedavg", "fpl", "feddbp")}
    other = markdown(build_report(both, config={}, partition="toy"))
    assert (
        "own rule: solo by its classifier; fedproto by Euclidean distance to the global "
        "prototypes; fedavg and fpl by the round's global model; feddbp by its decision "
        "branch's distance to its personalised global prototypes." in other
    )
    assert "no classifier is trained" in table and "no classifier is trained" not in other
    assert "(mean over seeds, final round, %)" in table
    one = markdown(build_report({"fedpcl": {0: results["fedpcl"][0]}}, config={}, partition="t"))
    assert "seed 0: by domain" in one and "(seed 0, final round, %)" in one
    assert "mean over" not in one and "| 70.0 @ 2 |" in one
    assert "Settings:" not in table  # no configuration given, nothing to state
    assert table.startswith("# Fleet report: toy\n")  # no protocol given, none stated
    assert m["train"] == {}
    config = {"rounds": 2, "epochs": 3, "out_dim": 32, "transport": "memory", "protocol": "paper"}
    trained = {"tau": 0.2, "classifier": "bounded"}
    same = {"fedpcl": {s: fake_result(tmp_path, "fedpcl", s, [[0.5]], trained) for s in (0, 1)}}
    stated = markdown(build_report(same, config=config, partition="toy"))
    # The protocol in the first line, what it means in the next paragraph.
    assert stated.startswith("# Fleet report, paper protocol: toy\n\nPaper protocol: every ")
    assert (
        "Settings: 2 rounds, 3 local epochs per round, head output 32, memory transport, "
        "train: classifier=bounded, tau=0.2." in stated
    )
    settings = build_report(same, config=config, partition="toy")["methods"]["fedpcl"]["settings"]
    assert settings["protocol"] == "paper" and settings["inference"] == "local_prototype_cosine"
    assert settings["train"]["classifier"] == "bounded" and settings["train"]["lr"] == 1e-3
    # Settings some methods had and others not are named with their methods.
    mixed = {
        method: {0: fake_result(tmp_path, method, 0, [[0.5]], {"tau": 0.2, **extra})}
        for method, extra in (("solo", {"classifier": "bounded"}), ("fedpcl", {}),
                              ("fedavg", {"classifier": "bounded", "lr": 0.002}))
    }  # fmt: skip
    doc_mixed = build_report(mixed, config=config, partition="toy")
    assert doc_mixed["methods"]["fedavg"]["train"] == {"tau": 0.2, "classifier": "bounded",
                                                        "lr": 0.002}  # fmt: skip
    assert (
        "train: tau=0.2, classifier=bounded for solo and fedavg, lr=0.002 for fedavg."
        in markdown(doc_mixed)
    )
    # The ceiling: a row of its own, last, and no traffic or device-rule row.
    with_central = {**results, "central": {0: fake_result(tmp_path, "central", 0, [[0.9, 0.95]]),
                                           1: fake_result(tmp_path, "central", 1, [[0.9, 0.85]])}}  # fmt: skip
    ceiling = markdown(build_report(with_central, config={}, partition="toy"))
    rows = [line for line in ceiling.splitlines() if line.startswith("| ")]
    # Seed 0 peaks at round 2 (0.95), seed 1 at round 1 (0.9).
    assert rows[2] == "| central (ceiling) | 90.0 (5.0) | - | 90.0 (5.0) | 92.5 (2.5) @ 1-2 |"
    assert ceiling.count("| central") == 1 and "is the ceiling" in ceiling
    # A report with no per-method record (a privacy sweep) states its --train-param.
    assert train_note({"train_param": {"tau": 0.2}}, None) == "train: tau=0.2"
    assert train_note({"train_param": {"tau": 0.2}}, {}) == "train: tau=0.2"
    assert train_note({}, None) == ""
    # Two seeds: the per-domain plot draws their spread (the fleet test draws one seed),
    # and the ceiling as a line.
    png = plot_domains(build_report(with_central, config={}, partition="toy"),
                       tmp_path / "domains.png").read_bytes()  # fmt: skip
    assert png.startswith(PNG) and len(png) > 5_000

    # Figures that do not exist are null: NaN is not JSON, also inside a dataclass.
    @dataclass(frozen=True)
    class Setting:
        alpha: float

    doc["methods"]["fedpcl"]["final_mean_classifier"] = float("nan")
    doc["config"] = {"split": Setting(alpha=float("inf"))}
    strict = json.loads(to_json(doc), parse_constant=lambda c: pytest.fail(f"{c} in JSON"))
    assert strict["methods"]["fedpcl"]["final_mean_classifier"] is None
    assert strict["config"] == {"split": {"alpha": None}}


def test_a_privacy_report_marks_reproducible_noise_as_no_guarantee() -> None:
    rows = {"solo (no privacy)": 0.5, "fedpcl dp eps=8": 0.25}
    document = {"config": {}, "delta": 1e-5, "results": {"label": rows},
                "privacy": {"fedpcl dp eps=8": {"mechanism": "dp",
                                                "guarantee": "none (reproducible noise)"}}}  # fmt: skip
    assert "Formal arms' guarantee: none (reproducible noise)." in privacy_markdown(document)


def test_a_privacy_report_on_own_data_names_the_file_not_a_digits5_setting() -> None:
    rows = {"solo (no privacy)": 0.5, "fedpcl dp eps=8": 0.25}
    own = {"config": {"data": "/data/clinic.npz"}, "delta": 1e-5, "results": {"clinic.npz": rows},
           "label_inference_tv": {"clinic.npz": {"no noise": 0.0}}}  # fmt: skip
    table = privacy_markdown(own)
    assert table.startswith("# Privacy on clinic.npz ")
    assert "| setting | clinic.npz |" in table and "| release | clinic.npz |" in table
    assert "| fedpcl dp eps=8 | 25.0 |" in table
    digits = {"config": {"data": None}, "delta": 1e-5, "results": {"label": rows}}
    assert "# Privacy on digits-5 " in privacy_markdown(digits)
    assert "| setting | label shift |" in privacy_markdown(digits)


def test_a_fleet_report_states_the_public_settings_of_a_secure_sum(tmp_path: Path) -> None:
    table = SecureAggregation(threshold=9, colluding=0, epsilon=2.0, dataset_size=50)
    secure = replace(fake_result(tmp_path, "lda", 0, [[0.5]]), secure=table)
    doc = build_report({"lda": {0: secure}, "ridge": {0: secure},
                        "fedcof": {0: fake_result(tmp_path, "fedcof", 0, [[0.5]])}},
                       config={}, partition="toy")  # fmt: skip
    settings = doc["methods"]["lda"]["settings"]
    assert settings["secure_aggregation"]["threshold"] == 9
    # What the agents ran with: no mechanism of their own, the sum's budget as their cap.
    assert settings["privacy"] == {"aggregation": "secure", "mechanism": "none", "delta": 1e-5,
                                   "epsilon": 2.0}  # fmt: skip
    assert doc["methods"]["fedcof"]["settings"]["secure_aggregation"] is None
    line = (
        "Secure aggregation (lda and ridge): the devices' releases reached the coordinator "
        "only as the fleet's sum, distributed discrete Gaussian noise for epsilon 2 at delta 1e-05 "
        "over the whole run; threshold 9, 0 colluding, every device each other's neighbour, "
        "50 samples a device at most, a 32-bit ring at scale 32768."
    )
    assert markdown(doc).count("Secure aggregation (") == 1 and line in markdown(doc)


def test_a_privacy_report_claims_the_secure_sums_guarantee_and_says_what_it_compares() -> None:
    rows = {"lda exact sum (no privacy)": 0.8, "lda secure eps=1": 0.7}
    table = {"threshold": 5, "colluding": 0, "dataset_size": 100, "bits": 32}
    claim: dict[str, Any] = {"aggregation": "secure", "epsilon": 1.0, "mechanism": "none",
                             "guarantee": "(epsilon, delta)-DP, add/remove one example"}  # fmt: skip
    document = {"config": {}, "delta": 1e-5, "results": {"feature": rows}, "closed_form": "lda",
                "settings": {"lda exact sum (no privacy)": {"stats_dim": 64},
                             "lda secure eps=1": {"secure_aggregation": table}},
                "privacy": {"lda secure eps=1": claim}}  # fmt: skip
    text = privacy_markdown(document)
    assert "Formal arms' guarantee: (epsilon, delta)-DP, add/remove one example." in text
    assert "lda (vector transport, statistics in k = 64), the same budget per arm" in text
    assert "(threshold 5, 0 colluding, 100 samples a device at most, a 32-bit ring)" in text
    # A secure sum without noise claims nothing.
    claim |= {"epsilon": 0.0, "guarantee": "none"}
    assert "Formal arms' guarantee" not in privacy_markdown(document)


def privacy_document() -> dict[str, Any]:
    """An ``edge-fleet privacy --closed-form lda`` report of two settings."""
    epsilons = [1.0, 8.0]
    rows = {"fedpcl (no privacy)": 0.8, "solo (no privacy)": 0.6, "lda exact sum (no privacy)": 0.8}
    for e in epsilons:
        rows |= {f"fedpcl dp eps={e:g}": 0.5, f"fedpcl dp-features eps={e:g}": 0.7,
                 f"lda dp-features eps={e:g}": 0.6, f"lda secure eps={e:g}": 0.75}  # fmt: skip
    return {"epsilons": epsilons, "delta": 1e-5, "mechanisms": ["dp", "dp-features"],
            "closed_form": "lda", "results": {"feature": rows, "label": dict(rows)}}  # fmt: skip


def test_every_arm_of_the_privacy_plot_has_its_own_colour_and_style(tmp_path: Path) -> None:
    document = privacy_document()
    arms = curves(document)
    assert len(arms) == 7
    # "FedPCL without privacy" and "lda, exact sum" were one colour, both dotted.
    assert len({a.colour for a in arms}) == len({str(a.style) for a in arms}) == len(arms)
    # Every arm is a row the report holds.
    rows = document["results"]["feature"]
    for arm in arms:
        assert arm.row.format(e="8") in rows, arm.row
    plot = plot_accuracy_vs_epsilon(document, tmp_path / "accuracy_vs_epsilon.png")
    assert plot.read_bytes().startswith(b"\x89PNG")
    # Without --closed-form, and with one mechanism, only the arms that ran are drawn.
    plain = {**document, "closed_form": None, "mechanisms": ["dp"]}
    assert [a.label for a in curves(plain)] == [
        "DP FedPCL (DP-SGD)", "FedPCL without privacy", "Solo (shares nothing)",
    ]  # fmt: skip
