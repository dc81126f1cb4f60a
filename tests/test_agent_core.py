"""The agent's round logic: answering once and resuming, its state folder, ignoring what
no coordinator of its fleet sends, its configuration file, `edge-agent status` and
`edge-agent predict`, and how each method's device is scored."""

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from coordinator.strategies import make_strategy
from edge_agent import data as data_mod
from edge_agent.agent import Agent
from edge_agent.cli import EXAMPLE
from edge_agent.config import load
from edge_agent.extras import model_weights
from edge_agent.state import StateDir
from edge_agent.train import LocalModel, embed
from fleet.data.digits5 import domain_data
from fleet.engine.evaluation import FleetEvaluator
from protocol import PrototypeUpdate, RoundAnnouncement
from runtime.settings import ConfigError
from tests.agent_helpers import RUN, RUN_STARTED, agent_config, digits_npz


def announcement(bundle_id: str, round_: int, **kw) -> RoundAnnouncement:
    fields = dict(
        fleet="lab",
        round=round_,
        bundle=bundle_id,
        method="fedpcl",
        classes=tuple(str(i) for i in range(10)),
        deadline=0.0,
        params={"final": False},
        run=RUN,
        run_started=RUN_STARTED,
        dim=32,
    )
    fields.update(kw)
    return RoundAnnouncement(**fields)  # type: ignore[arg-type]


@pytest.mark.slow
def test_agent_answers_once_and_resumes_from_its_state(small_zoo, tmp_path):
    cfg = agent_config(tmp_path / "a", small_zoo, agent_id="dev-a", domain="clean")
    agent = Agent(cfg, evaluator=FleetEvaluator)
    assert agent.runtime.samples_processed == 180  # train + test features computed once
    first = agent.handle(announcement(agent.bundle_id, 0))
    assert first.reason == "answered" and first.payload is not None
    update = PrototypeUpdate.from_wire(first.payload)
    labels = agent.train_labels
    assert update.counts == tuple(int((labels == c).sum()) for c in update.classes)
    assert sum(update.counts) == 120 and update.prototypes.shape == (len(update.classes), 32)
    np.testing.assert_allclose(
        np.linalg.norm(update.prototypes.astype(np.float32), axis=1) <= 1.001, True
    )
    assert agent.handle(announcement(agent.bundle_id, 0)).reason == "republish"
    agent.state.mark_published(0)
    assert agent.handle(announcement(agent.bundle_id, 0)).reason == "already_answered"
    record = agent.state.snapshot.history[-1]
    assert record["test_accuracy"] == record["test_accuracy_prototype"] is not None
    assert record["test_accuracy_classifier"] is None  # FedPCL trains no classifier

    again = Agent(cfg)  # a restart: the cache is hit, the head and round are restored
    assert again.runtime.samples_processed == 0 and again.resumed
    assert again.last_round == 0
    assert again.handle(announcement(again.bundle_id, 0)).reason == "already_answered"
    assert again.handle(announcement(again.bundle_id, 1)).reason == "answered"
    # A device scores its test split by its own rule alone; the rest is the fleet's.
    device_record = again.state.snapshot.history[-1]
    assert device_record["round"] == 1 and device_record["test_accuracy"] is not None
    assert "test_accuracy_prototype" not in device_record


def test_state_keeps_the_configured_number_of_rounds_of_history(small_zoo, tmp_path):
    cfg = dataclasses.replace(
        agent_config(tmp_path / "h", small_zoo, agent_id="dev-h", domain="clean"), history=3
    )
    agent = Agent(cfg)
    for r in range(5):
        assert agent.handle(announcement(agent.bundle_id, r)).reason == "answered"
    assert [h["round"] for h in agent.state.snapshot.history] == [2, 3, 4]
    assert [h["round"] for h in Agent(cfg).state.snapshot.history] == [2, 3, 4]  # on disk
    with pytest.raises(ValueError, match="history must be at least 1"):
        dataclasses.replace(cfg, history=0)


@pytest.mark.parametrize(
    "content, why",
    [
        (b'{"agent_id": "dev-s", "last_ro', "Unterminated string"),  # cut short
        (b"", "Expecting value"),  # emptied
        (b"[0]", "not a JSON object"),
        (b"\xff\xfe\x00garbage", "Expecting value"),
    ],
)
def test_a_damaged_state_file_is_named_and_never_overwritten(tmp_path, content, why):
    (tmp_path / "state.json").write_bytes(content)
    with pytest.raises(ValueError, match=why) as caught:
        StateDir(tmp_path, agent_id="dev-s")
    assert str(tmp_path / "state.json") in str(caught.value) and "move it aside" in str(
        caught.value
    )
    assert (tmp_path / "state.json").read_bytes() == content  # the user's to inspect


def test_reading_a_state_folder_creates_nothing(tmp_path):
    state = StateDir(tmp_path / "typo", agent_id="dev-s", create=False)
    assert state.snapshot.last_round is None and state.load_prototypes() is None
    assert not (tmp_path / "typo").exists()


def test_a_saved_head_that_no_longer_fits_is_replaced_with_a_warning(small_zoo, tmp_path, caplog):
    cfg = agent_config(tmp_path / "w", small_zoo, agent_id="dev-w", domain="clean")
    first = Agent(cfg)
    assert first.handle(announcement(first.bundle_id, 0)).reason == "answered"
    wider = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, out_dim=64))
    with caplog.at_level("WARNING", logger="edge_agent.state"):
        agent = Agent(wider)
    assert not agent.resumed and agent.last_round == 0
    assert "does not fit the configured head" in caplog.text and "size mismatch" in caplog.text


def test_a_restart_on_grown_data_runs_the_backbones_on_the_new_samples_only(small_zoo, tmp_path):
    cfg = agent_config(tmp_path / "g", small_zoo, agent_id="dev-g", domain="clean")
    Agent(cfg)
    old = np.load(cfg.data.train)
    extra = np.load(digits_npz(tmp_path, "clean", start=500, count=30))
    grown = tmp_path / "grown.npz"
    np.savez(
        grown, x=np.concatenate([old["x"], extra["x"]]), y=np.concatenate([old["y"], extra["y"]])
    )
    cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, train=grown))
    again = Agent(cfg)
    assert again.runtime.samples_processed == 30
    fresh = again.runtime.extract(data_mod.load(grown, cfg.classes).images[-40:])
    np.testing.assert_allclose(again.features[-40:], fresh, rtol=1e-5, atol=1e-5)
    # The cache holds the current training and test sets, nothing superseded.
    cached = sorted(p.name for p in (cfg.state_dir / "cache").glob("*.npy"))
    assert len(cached) == 2 and len(again.features) == 150


def test_mismatched_announcements_are_ignored(small_zoo, tmp_path):
    agent = Agent(agent_config(tmp_path / "b", small_zoo, agent_id="dev-b", domain="inverted"))
    ann = announcement(agent.bundle_id, 0)
    assert agent.handle(dataclasses.replace(ann, fleet="other")).reason == "wrong_fleet"
    wrong = agent.handle(dataclasses.replace(ann, bundle="0" * 64))
    assert wrong.reason == "wrong_bundle"
    assert wrong.mismatch == (
        f"ignoring rounds: the fleet uses bundle 000000000000, this device has "
        f"{agent.bundle_id[:12]}"
    )
    wrong = agent.handle(dataclasses.replace(ann, method="fedproto"))
    assert wrong.reason == "wrong_method"
    assert wrong.mismatch == "ignoring rounds: the fleet runs fedproto, this device fedpcl"
    wrong = agent.handle(dataclasses.replace(ann, classes=("0", "1", "x", "3")))
    assert wrong.reason == "wrong_classes"
    assert wrong.mismatch == (
        "ignoring rounds: the fleet announces 4 classes, this device has 10; "
        "they differ from position 2"
    )
    longer = dataclasses.replace(ann, classes=(*ann.classes, "extra"))
    assert agent.handle(longer).mismatch.endswith("they differ from position 10")
    assert agent.handle(dataclasses.replace(ann, params={"final": True})).reason == "final"
    assert agent.last_round is None


@pytest.mark.slow
def test_announced_settings_that_differ_from_the_device_are_warned_about_once(
    small_zoo, tmp_path, caplog
):
    agent = Agent(agent_config(tmp_path / "p", small_zoo, agent_id="dev-p", domain="clean"))
    params: dict[str, bool | int | float | str] = {
        "tau": 0.2,
        "epochs": 1,
        "colour": "red",
        "final": False,
    }
    with caplog.at_level("WARNING", logger="edge_agent.agent"):
        for r in range(2):
            agent.handle(dataclasses.replace(announcement(agent.bundle_id, r), params=params))
    warned = [rec.getMessage() for rec in caplog.records if "announces" in rec.getMessage()]
    # tau differs (0.07 here); epochs agrees; colour and final are no [train] settings.
    assert warned == [
        "the coordinator announces tau = 0.2; this device trains with tau = 0.07 "
        "(its config's [train] section)"
    ]
    assert agent.last_round == 1  # a warning, not a refusal


def test_feddbp_agent_uploads_fisher_scores_the_coordinator_fuses(small_zoo, tmp_path):
    agent = Agent(
        agent_config(tmp_path / "d", small_zoo, agent_id="dev-d", domain="photo", method="feddbp")
    )
    decision = agent.handle(announcement(agent.bundle_id, 0, method="feddbp"))
    assert decision.update is not None
    fisher = decision.update.extras["fisher"]
    assert fisher.shape == decision.update.prototypes.shape and (fisher >= 0).all() and fisher.any()
    result = make_strategy("feddbp", top_k=4).aggregate([decision.update], num_classes=10, dim=32)
    assert set(result.client_globals) == {"dev-d"}


def test_documented_agent_config_loads():
    cfg = load(EXAMPLE)
    assert cfg.agent_id == "jetson-01" and cfg.train.tau == 0.07 and cfg.train.batch_size == 32
    assert cfg.mqtt.reconnect_max_s == 60.0


@pytest.mark.parametrize(
    ("table", "line", "message"),
    [
        ("data", "image_size = 0", "data.image_size must be at least 1 pixel, got 0"),
        ("runtime", "intra_op_threads = -1", "intra_op_threads and inter_op_threads must be >= 0"),
        ("runtime", "batch_size = 0", "runtime.batch_size must be at least 1, got 0"),
        ("privacy", "paper_scale = -0.05", "privacy.paper_scale must not be negative"),
    ],
)
def test_values_found_only_at_run_time_before_are_refused_as_the_file_is_read(
    tmp_path, table, line, message
):
    path = tmp_path / "agent.toml"
    body = f"[{table}]\n{line}\n" if table != "data" else line + "\n"
    path.write_text(
        'agent_id = "a"\nfleet = "lab"\nstate_dir = "s"\nbundle = "b"\n'
        f'[data]\ntrain = "t.npz"\n{body}'
    )
    with pytest.raises(ConfigError, match=f"{table}: .*{message}"):
        load(path)


@pytest.mark.slow
def test_status_and_predict_commands(small_zoo, tmp_path):
    root = tmp_path / "e"
    cfg = agent_config(root, small_zoo, agent_id="dev-e", domain="clean")
    agent = Agent(cfg)
    agent.handle(announcement(agent.bundle_id, 0))
    config = root / "agent.toml"
    config.write_text(
        f'agent_id = "dev-e"\nfleet = "lab"\nstate_dir = "{cfg.state_dir}"\nbundle = "{small_zoo}"\n'
        f'[data]\ntrain = "{cfg.data.train}"\n[train]\nout_dim = 32\n'
        "[security]\ninsecure = true\n"
    )
    bin_dir = Path(sys.executable).parent

    def agent_cli(*argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [str(bin_dir / "edge-agent"), argv[0], "--config", str(config), *argv[1:]],
            capture_output=True,
            text=True,
            check=check,
        )

    report = json.loads(agent_cli("status").stdout)
    assert report["last_round"] == 0 and report["bundle_id"] == agent.bundle_id
    assert len(report["cache_entries"]) == 2  # train and test features
    x, _ = domain_data("clean", indices=np.arange(1500, 1520))
    np.savez(root / "query.npz", x=x)
    rows = [
        json.loads(line)
        for line in agent_cli("predict", str(root / "query.npz")).stdout.splitlines()
    ]
    assert len(rows) == 20 and all(
        r["class"] in [str(i) for i in range(10)] and r["latency_ms"] > 0 for r in rows
    )
    # A tree of class folders: every image below it, an unreadable one reported in place.
    for i, cls in enumerate(("3", "7", "7/more")):
        (root / "tree" / cls).mkdir(parents=True)
        Image.fromarray((x[i].transpose(1, 2, 0) * 255).astype(np.uint8)).save(
            root / "tree" / cls / f"{i}.png"
        )
    (root / "tree" / "3" / "broken.png").write_bytes(b"not a png")
    rows = [
        json.loads(line) for line in agent_cli("predict", str(root / "tree")).stdout.splitlines()
    ]
    assert sorted(Path(r["input"]).relative_to(root / "tree").as_posix() for r in rows) == [
        "3/0.png",
        "3/broken.png",
        "7/1.png",
        "7/more/2.png",
    ]
    assert "unreadable" in next(r["error"] for r in rows if "broken" in r["input"])
    bad = agent_cli("predict", str(root / "nope.npz"), check=False)
    assert bad.returncode == 2 and "no such input" in bad.stderr and "Traceback" not in bad.stderr
    (cfg.state_dir / "state.json").write_text('{"agent_id": "dev-e", "last_ro')
    for command in ("status", "predict"):
        argv = (command, str(root / "query.npz")) if command == "predict" else (command,)
        bad = agent_cli(*argv, check=False)
        assert bad.returncode == 2 and "state.json is damaged" in bad.stderr, bad.stderr


@pytest.mark.slow
@pytest.mark.parametrize("method", ["fedavg", "fpl"])
def test_averaging_methods_are_scored_by_the_global_model_of_each_round(
    small_zoo, tmp_path, method
):
    """FedAvg's and FPL's accuracy is their global model's on the device's test split
    (not the device's locally trained copy), filed under the round that produced it."""

    def config(domain: str):  # enough local training that the heads learn something
        cfg = agent_config(tmp_path / domain, small_zoo, agent_id=f"dev-{domain}",
                           domain=domain, method=method)  # fmt: skip
        return dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, epochs=10, lr=1e-2))

    agents = [Agent(config(d), evaluator=FleetEvaluator) for d in ("clean", "inverted")]
    strategy = make_strategy(method)

    def play(round_: int, extras: dict, *, final: bool = False) -> dict:
        updates = []
        for agent in agents:
            ann = announcement(
                agent.bundle_id, round_, method=method, extras=extras, params={"final": final}
            )
            decision = agent.handle(ann)
            if decision.update is not None:
                # What the coordinator averages: the device's model after its training.
                assert set(decision.update.extras) == set(model_weights(agent.model))
                updates.append(decision.update)
        if not updates:
            return {}
        result = strategy.aggregate(updates, num_classes=10, dim=32)
        return {k: v.astype(np.float32) for k, v in result.extras.items()}  # as announced

    def global_accuracy(agent: Agent, weights: dict) -> float:
        model = LocalModel(in_dim=agent.runtime.feature_dim, num_classes=10, cfg=agent.cfg.train)
        model.load_state_dict({k: torch.from_numpy(v) for k, v in weights.items()}, strict=False)
        assert agent.evaluator is not None
        _, logits = embed(model, agent.evaluator.features)
        return float((logits.argmax(1) == agent.evaluator.labels).mean())

    first = play(0, {})
    for agent in agents:  # round 0's global model is not known yet
        record = agent.state.snapshot.history[-1]
        assert record["test_accuracy"] is None and record["test_accuracy_classifier"] is not None
    second = play(1, first)
    play(2, second, final=True)
    for agent in agents:
        by_round = {h["round"]: h for h in agent.state.snapshot.history}
        for round_, weights in ((0, first), (1, second)):
            assert by_round[round_]["test_accuracy"] == global_accuracy(agent, weights)
        # The device keeps the last global model: `edge-agent predict` uses what was scored.
        kept = LocalModel(in_dim=agent.runtime.feature_dim, num_classes=10, cfg=agent.cfg.train)
        assert agent.state.load_model(kept)
        for name, value in kept.state_dict().items():
            if name in second:
                np.testing.assert_array_equal(value.numpy(), second[name])
    # The test can tell the models apart: averaging two domains' heads gives other
    # scores than either device's locally trained copy.
    assert any(
        global_accuracy(a, first) != a.state.snapshot.history[0]["test_accuracy_classifier"]
        for a in agents
    )


def test_feddbp_is_scored_by_its_decision_branch_against_its_own_global_prototypes(
    small_zoo, tmp_path
):
    """FedDBP 3.1: prototype-based inference on the decision branch's features, against
    the personalised global prototypes the coordinator sent this client; scored when they
    arrive, under the round whose prototypes built them."""
    cfg = agent_config(tmp_path / "d", small_zoo, agent_id="dev-d", domain="clean",
                       method="feddbp")  # fmt: skip
    # On this tiny set the figures stay near chance; what is checked is the rule.
    agent = Agent(cfg)
    first = agent.handle(announcement(agent.bundle_id, 0, method="feddbp"))
    assert first.payload is not None
    assert agent.state.snapshot.history[-1]["test_accuracy"] is None  # not known yet
    update = PrototypeUpdate.from_wire(first.payload)
    assert agent.evaluator is not None
    assert agent.model.decision is not None
    labels = agent.evaluator.labels
    with torch.no_grad():  # the decision branch as round 0 left it
        agent.model.eval()
        z_d = agent.model.decision(torch.from_numpy(np.array(agent.evaluator.features))).numpy()
    # This client's personalised set is its own prototypes; the plain global set is
    # another set of the same vectors (the classes rolled by one).
    personal = update.prototypes.astype(np.float32)
    shared = np.roll(personal, 1, axis=0)
    agent.handle(
        announcement(agent.bundle_id, 1, method="feddbp", global_classes=update.classes,
                     global_prototypes=shared, client_globals={"dev-d": personal})
    )  # fmt: skip
    by_round = {h["round"]: h for h in agent.state.snapshot.history}

    def nearest(protos: np.ndarray) -> float:  # the paper's Euclidean distance, normalised
        unit = protos / np.linalg.norm(protos, axis=1, keepdims=True)
        dist = ((z_d[:, None, :] - unit[None]) ** 2).sum(axis=2)
        return float(np.mean(np.asarray(update.classes)[dist.argmin(1)] == labels))

    assert by_round[0]["test_accuracy"] == pytest.approx(nearest(personal))
    assert nearest(personal) != nearest(shared)  # the test tells the two sets apart
    assert by_round[1]["test_accuracy"] is None  # until round 2 brings its prototypes
    stored = agent.state.load_globals()
    assert stored is not None
    np.testing.assert_array_equal(stored[0][list(update.classes)], personal)


def test_implausible_announcements_are_ignored_counted_and_never_recorded(small_zoo, tmp_path):
    cfg = agent_config(tmp_path / "f", small_zoo, agent_id="dev-f", domain="clean")
    agent = Agent(cfg)
    real = announcement(agent.bundle_id, 0)
    assert agent.handle(real).reason == "answered"
    # The forged retained announcement of the report: round 2^31-1, dimension 17.
    forged = dataclasses.replace(
        real,
        round=2**31 - 1,
        dim=17,
        global_classes=(0,),
        global_prototypes=np.ones((1, 17), np.float32),
    )
    ignored = agent.handle(forged)
    assert ignored.reason == "wrong_dim"
    # Said in the status as well: the coordinator would refuse every update of the device.
    assert ignored.mismatch.startswith("ignoring rounds: round 2147483647 announces")
    # The right dimension, but a round no fleet reaches from round 0.
    far = dataclasses.replace(
        real, round=10_001, global_classes=(0,), global_prototypes=np.ones((1, 32), np.float32)
    )
    assert agent.handle(far).reason == "implausible_round"
    near = dataclasses.replace(far, round=10_000)  # max_round_jump past round 0: plausible
    assert agent.last_round == 0
    assert agent.handle(dataclasses.replace(real, round=1)).reason == "answered"
    assert agent.ignored.counts == {"wrong_dim": 1, "implausible_round": 1}
    # Across a restart the device still answers the real fleet's next round.
    again = Agent(cfg)
    assert again.last_round == 1
    assert again.state.snapshot.extra["ignored_announcements"] == {
        "wrong_dim": 1,
        "implausible_round": 1,
    }
    assert again.handle(dataclasses.replace(real, round=2)).reason == "answered"
    assert again.handle(near).reason == "answered"  # within 10,000 of round 2
