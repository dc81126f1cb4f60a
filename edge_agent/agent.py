"""The agent's round logic, free of any transport: given an announcement, decide whether
to answer, train, compute prototypes and produce the update. The MQTT service and the
simulated fleet drive the same class."""

from __future__ import annotations

import logging
import time
from dataclasses import asdict, dataclass, replace
from typing import Any

import numpy as np
import torch

from edge_agent import screening
from edge_agent.closed_form import ClosedFormDevice, check_payload
from edge_agent.config import AgentConfig
from edge_agent.delivery import Delivery, Sent, SignedUpdates
from edge_agent.evaluation import Evaluator
from edge_agent.extras import (
    check_update_fits,
    largest_update_bytes,
    load_weights,
)
from edge_agent.head import local_prototypes
from edge_agent.ignored import IgnoredAnnouncements
from edge_agent.inference import dense_globals, rule_of
from edge_agent.keys import AgentKeys
from edge_agent.methods import device_method
from edge_agent.privacy.modes import LocalTraining, make_mode
from edge_agent.secure_delivery import SecureSumInputs
from edge_agent.secure_join import SecureInput, summed
from edge_agent.startup import load_training_data, new_head, open_runtime
from edge_agent.state import StateDir
from edge_agent.train import LocalModel, embed, make_optimiser
from export.runtime import BackboneRuntime
from protocol import PrototypeUpdate, RoundAnnouncement
from protocol.limits import SUPPORTED_VERSIONS
from protocol.status import UNSUPPORTED_VERSION
from runtime.faults import crash_point

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Decision:
    """What the agent does with an announcement: ``update`` to publish, or why not."""

    reason: str
    update: PrototypeUpdate | None = None
    payload: bytes | None = None
    #: For a round this device cannot take part in: what an operator should fix.
    mismatch: str = ""
    #: A secure fleet's round: what this device adds to the fleet's sum.
    secure: SecureInput | None = None


class Agent:
    def __init__(
        self,
        cfg: AgentConfig,
        *,
        runtime: BackboneRuntime | None = None,
        evaluator: type[Evaluator] = Evaluator,
    ) -> None:
        """``evaluator`` scores the configured test split after every round (the
        simulated fleet passes one that scores more)."""
        self.cfg = cfg
        self._params_noted: set[str] = set()  # announced settings already warned about
        self.state = StateDir(cfg.state_dir, agent_id=cfg.agent_id, history=cfg.history)
        # Announcements ignored as implausible, by reason (edge-agent status shows them).
        self.ignored = IgnoredAnnouncements(self.state)
        self.keys = AgentKeys.load(cfg.security, client=cfg.agent_id)
        # A simulated fleet hands every agent of a worker the same runtime: one set of
        # ONNX Runtime sessions per process instead of one per agent.
        self.runtime = open_runtime(cfg, self.state) if runtime is None else runtime
        self.state.reset_for_bundle(self.runtime.bundle.id)
        self.bundle_id = self.runtime.bundle.id
        data = load_training_data(cfg, self.runtime, self.state, evaluator=evaluator)
        self.features, self.train_labels = data.features, data.labels
        self.data_version, self.evaluator = data.version, data.evaluator
        self.num_classes = len(cfg.classes)
        self.record = device_method(cfg.method)
        self.model = new_head(cfg, in_dim=self.runtime.feature_dim, dual=self.record.dual)
        self.resumed = self.state.load_model(self.model)
        self.optimiser = make_optimiser(self.model, cfg.train)
        # Public randomness (data order): the run's seed.
        self.generator = torch.Generator().manual_seed(
            cfg.seed + (self.state.snapshot.last_round or 0)
        )
        local = LocalTraining(
            model=self.model, optimiser=self.optimiser, features=self.features,
            labels=self.train_labels, num_classes=self.num_classes, generator=self.generator,
            method=cfg.method, client=cfg.agent_id, cfg=cfg.train, seed=cfg.seed,
        )  # fmt: skip
        # The privacy mechanism at work, chosen once: admit, train, release.
        self.mode = make_mode(cfg.privacy, local=local, state=self.state,
                              data_version=self.data_version)  # fmt: skip
        # How a round's release leaves the device, chosen once: a signed update, or an
        # input to the fleet's secure sum (edge_agent/delivery.py).
        self.delivery: Delivery = SecureSumInputs() if cfg.secure else SignedUpdates()
        # A closed-form method trains nothing: its statistics leave, a linear head returns.
        self.closed: ClosedFormDevice | None = None
        if not self.record.trains_head:
            self.closed = ClosedFormDevice(
                method=self.record, fleet=cfg.fleet, features=self.features,
                labels=self.train_labels, num_classes=self.num_classes,
                settings=cfg.closed_form, seed=cfg.seed, state_dir=cfg.state_dir,
            )  # fmt: skip
            check_payload(self.closed.dim, method=self.record, classes=self.num_classes,
                          limit=cfg.mqtt.max_payload_bytes)  # fmt: skip
        else:
            largest = largest_update_bytes(
                method=cfg.method, model=self.model, fleet=cfg.fleet, client=cfg.agent_id,
                bundle=self.bundle_id, num_classes=self.num_classes, dim=self.prototype_dim,
            )  # fmt: skip
            check_update_fits(largest, method=cfg.method, limit=cfg.mqtt.max_payload_bytes)
        log.info(
            "agent %s: %d training samples, bundle %s, %s",
            cfg.agent_id,
            len(self.train_labels),
            self.bundle_id[:12],
            "resumed head" if self.resumed else "new head",
        )

    @property
    def last_round(self) -> int | None:
        return self.state.snapshot.last_round

    def handle(
        self, announcement: RoundAnnouncement, *, received_bytes: int | None = None
    ) -> Decision:
        """Answer ``announcement`` at most once per round, across restarts.
        ``received_bytes`` (the announcement's size on the wire) goes into the round's
        record next to the update's size, for traffic accounting."""
        cfg = self.cfg
        if announcement.fleet != cfg.fleet:
            return Decision("wrong_fleet")
        forged = self.keys.announcement_problem(announcement)
        if forged is not None:
            decision = self._ignore(
                f"announcement_{forged}",
                f"round {announcement.round}: {forged.replace('_', ' ')} (not signed by the "
                "pinned coordinator key, security.coordinator)",
            )
            # Said in the status too, where the coordinator and its operator look: a
            # coordinator restarted with another key sees only devices that never answer.
            return replace(decision, mismatch=screening.BAD_COORDINATOR_SIGNATURE)
        mismatch = screening.mismatch(announcement, cfg, self.bundle_id)
        if mismatch is not None:
            reason, why = mismatch
            log.warning("round %d ignored: %s", announcement.round, why)
            return Decision(reason, mismatch=f"ignoring rounds: {why}")
        other_dim = screening.wrong_dim(announcement, dim=self.prototype_dim)
        if other_dim is not None:
            # Said in the status as well: a coordinator of another dimension would refuse
            # every update of this device, and say so only in its own counters.
            return replace(self._ignore(*other_dim), mismatch=f"ignoring rounds: {other_dim[1]}")
        older = self._follow(announcement)
        if older is not None:
            return older
        implausible = screening.implausible_round(announcement, cfg, self.last_round)
        if implausible is not None:
            return self._ignore(*implausible)
        screening.note_params(announcement.params, own=asdict(cfg.train), noted=self._params_noted)
        last = self.last_round
        if last is not None and announcement.round <= last:
            pending = self.state.pending_update()
            if pending is not None and pending[0] == announcement.round:
                return Decision("republish", payload=pending[1])  # stored, never acknowledged
            return Decision("already_answered")
        if announcement.params.get("final") is True:
            self._adopt_global(announcement)
            self.state.record(final_round=announcement.round)
            return Decision("final")
        return self._answer(announcement, received_bytes)

    @property
    def run(self) -> str | None:
        """The coordinator run this device follows (None before it heard one)."""
        return self.state.snapshot.run

    def _follow(self, announcement: RoundAnnouncement) -> Decision | None:
        """Follow the announcement's run, adopting it if it began after the one followed
        (the coordinator's database was lost or replaced: its rounds count from where it
        stands); refuse it (the returned decision) if it began before: a retained
        announcement of an earlier life of the fleet."""
        snap = self.state.snapshot
        run, started = announcement.run, announcement.run_started
        if announcement.wire_version < 3:
            # A version-2 coordinator (or one announcing version 2 while its fleet
            # upgrades) says no run: answered as a version-2 device did, whatever run.
            return None
        if snap.run == run:
            return None
        if snap.run is None:
            # The first run heard; a state folder from before runs keeps its rounds.
            log.info("following coordinator run %s", run)
            self.state.follow_run(run, started, keep_round=True)
            return None
        if started > (snap.run_started or 0.0):
            log.warning(
                "the coordinator began a new run %s; this device followed run %s (last "
                "answered round %s) and answers the new run's rounds from round %d (was its "
                "database lost?)",
                run, snap.run, snap.last_round, announcement.round,
            )  # fmt: skip
            self.state.follow_run(run, started, keep_round=False)
            return None
        why = (
            f"round {announcement.round} is of coordinator run {run}, which began before run "
            f"{snap.run} this device follows (a coordinator database restored from an "
            "older run?)"
        )
        return replace(self._ignore("old_run", why), mismatch=f"ignoring rounds: {why}")

    def unreadable(self, version: int | None) -> str:
        """Count an announcement of a protocol version this device does not read; the
        status reason that says so (docs/protocol.md, ``Status``)."""
        why = (
            f"the fleet announces protocol version {version}; this device reads "
            f"{' and '.join(map(str, SUPPORTED_VERSIONS))}"
        )
        self.ignored.add(UNSUPPORTED_VERSION, why)
        return f"{UNSUPPORTED_VERSION}: {why}"

    def _ignore(self, reason: str, why: str) -> Decision:
        """An announcement no coordinator of this fleet sends: counted, not answered."""
        self.ignored.add(reason, why)
        return Decision(reason)

    @property
    def prototype_dim(self) -> int:
        """What the fleet's prototypes are: head embeddings, a closed-form method's
        statistics, or under dp-features the backbone features the releases are made of."""
        if self.closed is not None:
            return self.closed.dim
        return self.mode.prototype_dim(feature_dim=self.runtime.feature_dim)

    @property
    def predictor(self) -> LocalModel:
        """The model the device predicts with: its own, or (dp-features) the one its
        validation split chose."""
        return self.mode.predictor

    def _answer(self, announcement: RoundAnnouncement, received_bytes: int | None) -> Decision:
        mode, round_ = self.mode, announcement.round
        self.ignored.flush()
        self._adopt_global(announcement)
        closed = self.closed
        if closed is not None:
            # What the statistics are of: the data, and the method, size and basis they are
            # taken in (another [closed_form] dim, method or basis over the same data is
            # another release: made, and under a privacy mechanism paid for, again).
            version = f"{self.data_version}:{self.cfg.method}:{closed.dim}"
            if closed.basis_id:
                version += f":basis-{closed.basis_id}"
            sent = self.delivery.statistics(self, announcement, closed=closed, version=version)
            if sent is None:
                return self._exhausted(round_)
            exact = closed.statistics()
            means = exact.sums / np.maximum(exact.counts, 1.0)[:, None]
            self._save_round(round_, sent, received_bytes, model=None,
                             prototypes=means.astype(np.float32), counts=exact.counts)  # fmt: skip
            if sent.reason == "answered":
                new = sent.record.get("statistics_sent")
                log.info("round %d answered: %s", round_, "statistics" if new else "no new data")
            return self._decision(sent)
        if not mode.admit(round_):
            return self._exhausted(round_)
        log.info("round %d: training on %d samples", round_, len(self.train_labels))
        trained = mode.train(announcement)
        # Trained, nothing of the round written or sent yet: where a kill during training
        # lands, reached on purpose instead of by timing.
        crash_point(f"after_training:{round_}")
        # One pass over the cached features gives the prototypes (Eq. 5) and, for
        # FedDBP, the embeddings its Fisher scores need.
        z, _ = embed(mode.predictor, self.features)
        labels = torch.from_numpy(self.train_labels)
        protos_t, counts_t = local_prototypes(torch.from_numpy(z), labels, self.num_classes)
        # The exact local prototypes stay on the device for inference; what leaves it is
        # the mode's release, as the delivery sends it.
        protos, counts = protos_t.numpy(), counts_t.numpy()
        sent = self.delivery.prototypes(self, announcement, z=z, protos=protos, counts=counts)
        record = trained.record | {
            "loss": trained.metrics.loss, "train_seconds": trained.metrics.seconds,
        }  # fmt: skip
        if self.evaluator is not None:
            # The figures of the head just trained; a method that predicts with what the
            # coordinator returns is scored when that arrives (_adopt_global). A
            # dp-features device predicts by the rule its validation split chose
            # (edge_agent.anchored), with the model it chose.
            record.update(self.evaluator.after_training(mode.predictor, protos, counts,
                                                        rule=mode.predict_rule))  # fmt: skip
        mode.save()
        self._save_round(round_, sent, received_bytes, model=mode.predictor, prototypes=protos,
                         counts=counts, record=record)  # fmt: skip
        if sent.reason == "answered":
            log.info("round %d answered: loss %.4f, %d classes", round_, trained.metrics.loss,
                     int((counts > 0).sum()))  # fmt: skip
        return self._decision(sent)

    def _save_round(
        self, round_: int, sent: Sent, received_bytes: int | None, *, model: LocalModel | None,
        prototypes: np.ndarray, counts: np.ndarray, record: dict[str, Any] | None = None,
    ) -> None:  # fmt: skip
        """The round's record, built here for every method and delivery: what training
        and scoring measured (``record``), the traffic, and what the delivery adds."""
        metrics = {"loss": 0.0, "train_seconds": 0.0, **(record or {})} | {
            "time": time.time(), "bytes_up": len(sent.payload), "bytes_down": received_bytes,
        } | sent.record  # fmt: skip
        self.state.save_round(round_, model=model, prototypes=prototypes, counts=counts,
                              update=sent.payload, metrics=metrics)  # fmt: skip
        if sent.published:
            self.state.mark_published(round_)

    @staticmethod
    def _decision(sent: Sent) -> Decision:
        payload = sent.payload if sent.update is not None else None
        return Decision(sent.reason, update=sent.update, payload=payload, secure=sent.secure)

    def summed(self, secure: SecureInput, *, receipt: bytes = b"") -> None:
        """The round's secure sum holds this device's statistics (it was a survivor; the
        coordinator's ``receipt`` says so): the same data need not be summed again."""
        summed(self.state, run=secure.run, round_=secure.round, receipt=receipt, secure=secure)

    def confirmed(self, round_: int) -> None:
        """The coordinator stored this device's update of ``round_`` (its receipt came):
        statistics it carried are in the fleet's sum and need not travel again."""
        sent = self.state.snapshot.extra.get("statistics_sent")
        if isinstance(sent, dict) and sent.get("round") == round_:
            self.state.record(statistics_stored=sent.get("version"))

    def _adopt_closed_form(self, announcement: RoundAnnouncement) -> None:
        """Choose the head to predict with from the fleet's (edge_agent/closed_form.py) and
        score it under the round whose statistics built it."""
        closed = self.closed
        assert closed is not None
        if not closed.adopt(announcement):
            return
        if self.evaluator is not None and announcement.round >= 1:
            test_x = self.evaluator.features
            predicted = closed.scores(test_x).argmax(axis=1)
            accuracy = float((predicted == self.evaluator.labels).mean())
            self.state.amend_round(
                announcement.round - 1,
                test_accuracy=accuracy,
                # The head is the device's classifier: the reports' classifier column.
                test_accuracy_classifier=accuracy,
                predict_rule=closed.choice,
                val_accuracies=closed.val_accuracies,
            )

    def _exhausted(self, round_: int) -> Decision:
        self.state.record(privacy_exhausted=True)
        log.warning(
            "round %d: privacy budget (epsilon %.3g) would be exceeded; not publishing",
            round_,
            self.cfg.privacy.epsilon,
        )
        return Decision("budget_exhausted")

    @property
    def epsilon_spent(self) -> float:
        return self.mode.ledger.spent()

    def _adopt_global(self, announcement: RoundAnnouncement) -> None:
        """Take what the coordinator returned for the previous round: FedAvg's and FPL's
        averaged model (the device continues from it), the global prototypes the
        method's inference rule compares against. A method that predicts with them is
        scored on them here, under the round whose updates built them; the last round's
        figure arrives with the final announcement. Both are kept in the state folder, so
        ``edge-agent predict`` predicts with what was scored."""
        method = self.cfg.method
        if self.closed is not None:
            self._adopt_closed_form(announcement)
            return
        if self.record.wire.averaged:
            if not load_weights(self.model, announcement.extras):
                return
            self.state.save_model(self.model)
        if rule_of(method).prototypes == "global":
            dense = dense_globals(
                announcement, client=self.cfg.agent_id, num_classes=self.num_classes,
                dim=self.cfg.train.out_dim,
            )  # fmt: skip
            if dense is None:
                return
            self.state.save_globals(*dense)
        if (
            self.evaluator is not None
            and self.mode.predict_rule is None  # dp-features: its own rule, after training
            and rule_of(method).from_server
            and announcement.round >= 1
        ):
            self.state.amend_round(
                announcement.round - 1, **self.evaluator.from_server(self.model, self.state)
            )
