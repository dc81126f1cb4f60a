import dataclasses

import numpy as np

from edge_agent.agent import Agent
from protocol import PrototypeUpdate, RoundAnnouncement
from tests.agent_helpers import agent_config


def announcement(bundle_id: str, round_: int, **kw) -> RoundAnnouncement:
    fields = dict(
        fleet="lab",
        round=round_,
        bundle=bundle_id,
        method="fedpcl",
        classes=tuple(str(i) for i in range(10)),
        deadline=0.0,
        params={"final": False},
    )
    fields.update(kw)
    return RoundAnnouncement(**fields)  # type: ignore[arg-type]


def test_agent_answers_once_and_resumes_from_its_state(small_zoo, tmp_path):
    cfg = agent_config(tmp_path / "a", small_zoo, agent_id="dev-a", domain="clean")
    agent = Agent(cfg)
    assert agent.runtime.samples_processed == 180  # train + test features computed once
    first = agent.handle(announcement(agent.bundle_id, 0))
    assert first.reason == "answered" and first.payload is not None
    update = PrototypeUpdate.from_wire(first.payload)
    labels = agent.train_data.labels
    assert update.counts == tuple(int((labels == c).sum()) for c in update.classes)
    assert sum(update.counts) == 120 and update.prototypes.shape == (len(update.classes), 32)
    np.testing.assert_allclose(
        np.linalg.norm(update.prototypes.astype(np.float32), axis=1) <= 1.001, True
    )
    assert agent.handle(announcement(agent.bundle_id, 0)).reason == "republish"
    agent.state.mark_published(0)
    assert agent.handle(announcement(agent.bundle_id, 0)).reason == "already_answered"
    assert "test_accuracy" in agent.state.snapshot.history[-1]

    again = Agent(cfg)  # a restart: the cache is hit, the head and round are restored
    assert again.runtime.samples_processed == 0 and again.resumed
    assert again.last_round == 0
    assert again.handle(announcement(again.bundle_id, 0)).reason == "already_answered"
    assert again.handle(announcement(again.bundle_id, 1)).reason == "answered"


def test_mismatched_announcements_are_ignored(small_zoo, tmp_path):
    agent = Agent(agent_config(tmp_path / "b", small_zoo, agent_id="dev-b", domain="inverted"))
    ann = announcement(agent.bundle_id, 0)
    assert agent.handle(dataclasses.replace(ann, fleet="other")).reason == "wrong_fleet"
    assert agent.handle(dataclasses.replace(ann, bundle="0" * 64)).reason == "wrong_bundle"
    assert agent.handle(dataclasses.replace(ann, method="fedproto")).reason == "wrong_method"
    assert agent.handle(dataclasses.replace(ann, params={"final": True})).reason == "final"
    assert agent.last_round is None
