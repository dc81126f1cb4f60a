"""The agent's round logic, free of any transport: given an announcement, decide whether
to answer, train, compute prototypes and produce the update. The MQTT service and the
simulated fleet drive the same class."""

from __future__ import annotations

import logging
import math
import time
from collections import Counter
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import torch

from edge_agent import data as data_mod
from edge_agent import screening
from edge_agent.anchored import AnchoredLearner, FitSplit
from edge_agent.closed_form import (
    ClosedFormDevice,
    StatisticsRelease,
    largest_dim,
    statistics_bytes,
)
from edge_agent.config import AgentConfig
from edge_agent.evaluation import Evaluator
from edge_agent.extras import load_weights, update_extras
from edge_agent.features import FeatureCache, cache_features, fingerprint, with_cache_dir
from edge_agent.head import local_prototypes
from edge_agent.inference import dense_globals, rule_of
from edge_agent.keys import AgentKeys
from edge_agent.methods import device_method
from edge_agent.privacy.dpsgd import train_round_dp
from edge_agent.privacy.ledger import Ledger
from edge_agent.privacy.mechanisms import MECHANISMS, Release
from edge_agent.privacy.randomness import NONE, NoiseSource
from edge_agent.privacy.spending import Spending
from edge_agent.state import StateDir
from edge_agent.train import Guidance, LocalModel, embed, make_optimiser, train_round
from export import bundle as bundle_mod
from export.runtime import BackboneRuntime
from protocol import PrivacyMeta, PrototypeUpdate, RoundAnnouncement
from runtime.faults import crash_point

log = logging.getLogger(__name__)

#: Seconds between two saves (and log lines) of the ignored-announcement counts.
IGNORED_SAVE_S = 10.0


@dataclass(frozen=True)
class Decision:
    """What the agent does with an announcement: ``update`` to publish, or why not."""

    reason: str
    update: PrototypeUpdate | None = None
    payload: bytes | None = None
    #: For a round this device cannot take part in: what an operator should fix.
    mismatch: str = ""


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
        self.ignored: Counter[str] = Counter(
            self.state.snapshot.extra.get("ignored_announcements", {})
        )
        self._ignored_saved = -math.inf
        self.keys = AgentKeys.load(cfg.security)
        if runtime is None:
            bundle = bundle_mod.load(cfg.bundle)  # refuses files that do not match their hashes
            runtime = BackboneRuntime(
                bundle, settings=with_cache_dir(cfg.runtime, self.state.providers_dir)
            )
        # A simulated fleet hands every agent of a worker the same runtime: one set of
        # ONNX Runtime sessions per process instead of one per agent.
        self.runtime = runtime
        self.state.reset_for_bundle(runtime.bundle.id)
        self.bundle_id = self.runtime.bundle.id
        cache = FeatureCache(
            cfg.data.feature_cache or self.state.cache_dir, shared=cfg.data.shared_feature_cache
        )
        dim = self.runtime.feature_dim
        # Only the labels outlive this: the backbones are done with the images once their
        # features are cached, and a large data set's pixels (12 kB a sample at 32 x 32)
        # would otherwise sit in a small device's memory for the agent's whole life.
        train = data_mod.load(cfg.data.train, cfg.classes, size=cfg.data.image_size)
        privacy = cfg.privacy
        if privacy.dataset_size is not None and len(train) > privacy.dataset_size:
            raise data_mod.DataError(
                f"{cfg.data.train}: {len(train)} training samples, above privacy.dataset_size "
                f"= {privacy.dataset_size}, the public bound the privacy plan is computed "
                "from: raise dataset_size (and re-plan with `edge-agent privacy-plan`) or "
                "hold fewer samples"
            )
        # The data version a feature-space release belongs to (dp-features).
        self.data_version = fingerprint(train.images, train.labels)
        self.features = cache_features(
            cache, self.bundle_id, train, self.runtime, what="training data"
        )
        self.train_labels = train.labels
        del train
        # Scored after every round on a labelled test split, if the configuration names one.
        self.evaluator = evaluator.for_test_split(
            cfg, load=lambda d: cache_features(cache, self.bundle_id, d, self.runtime,
                                               what="test data")
        )  # fmt: skip
        cache.prune(keep_bundle=self.bundle_id)
        if not cache.shared:
            # What the data was before it changed: its rows are copied by now.
            for name in cache.drop_unserved():
                log.info("feature cache: dropped %s (superseded data)", name)
        self.num_classes = len(cfg.classes)
        with torch.random.fork_rng():
            torch.manual_seed(cfg.seed if cfg.init_seed is None else cfg.init_seed)
            self.model = LocalModel(
                in_dim=dim,
                num_classes=self.num_classes,
                cfg=cfg.train,
                dual=device_method(cfg.method).dual,
            )
        self.resumed = self.state.load_model(self.model)
        self.ledger = Ledger(
            cfg.state_dir,
            epsilon_budget=privacy.epsilon,
            delta=privacy.delta,
            accountant=privacy.accountant,
        )
        # Secret unless the configuration asks for replayable noise (experiments only).
        self.noise = NoiseSource.create(privacy.reproducible_noise_seed)
        self.spending = Spending(
            settings=privacy, train=cfg.train, ledger=self.ledger, noise=self.noise
        )
        self.optimiser = make_optimiser(self.model, cfg.train)
        # Public randomness (data order): the run's seed.
        self.generator = torch.Generator().manual_seed(
            cfg.seed + (self.state.snapshot.last_round or 0)
        )
        self.learner: AnchoredLearner | None = None
        self.record = device_method(cfg.method)
        # A closed-form method trains nothing: its statistics leave, a linear head returns.
        self.closed: ClosedFormDevice | None = None
        if not self.record.trains_head:
            self.closed = ClosedFormDevice(
                method=self.record, fleet=cfg.fleet, features=self.features,
                labels=self.train_labels, num_classes=self.num_classes,
                settings=cfg.closed_form, seed=cfg.seed, state_dir=cfg.state_dir,
            )  # fmt: skip
            gram, cap = self.record.wire.gram, cfg.mqtt.max_payload_bytes
            size = statistics_bytes(self.closed.dim, classes=self.num_classes, gram=gram)
            if size > cap:
                # Refused here, not by the coordinator round after round: an update above
                # the cap would be sent again every resend_s and never stored.
                raise ValueError(
                    f"{cfg.method}'s statistics at {self.closed.dim} dimensions take up to "
                    f"{size:,} bytes, above mqtt.max_payload_bytes = {cap:,}: set "
                    f"[closed_form] dim to at most "
                    f"{largest_dim(cap, classes=self.num_classes, gram=gram)}"
                )
        elif MECHANISMS[privacy.mechanism].space == "features":
            split = FitSplit.stratified(self.train_labels, share=privacy.validation_share,
                                        seed=cfg.seed)  # fmt: skip
            self.learner = AnchoredLearner(
                model=self.model, method=cfg.method, weights=privacy.anchor_weights,
                cfg=cfg.train, features=self.features, labels=self.train_labels,
                split=split, seed=cfg.seed, state_dir=cfg.state_dir,
            )  # fmt: skip
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
            return self._ignore(
                f"announcement_{forged}",
                f"round {announcement.round}: {forged.replace('_', ' ')} (not signed by the "
                "pinned coordinator key, security.coordinator)",
            )
        mismatch = screening.mismatch(announcement, cfg, self.bundle_id)
        if mismatch is not None:
            reason, why = mismatch
            log.warning("round %d ignored: %s", announcement.round, why)
            return Decision(reason, mismatch=f"ignoring rounds: {why}")
        implausible = screening.implausible(
            announcement, cfg, self.last_round, dim=self.prototype_dim
        )
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

    def _ignore(self, reason: str, why: str) -> Decision:
        """Count an announcement no coordinator of this fleet sends (persisted at most every
        ``IGNORED_SAVE_S``: a flood of them must not become a flood of disk writes)."""
        self.ignored[reason] += 1
        now = time.monotonic()
        if now - self._ignored_saved >= IGNORED_SAVE_S:
            self._ignored_saved = now
            self.state.record(ignored_announcements=dict(self.ignored))
            log.warning("announcement ignored: %s (%d so far)", why, sum(self.ignored.values()))
        return Decision(reason)

    @property
    def prototype_dim(self) -> int:
        """What the fleet's prototypes are: head embeddings, or under dp-features the
        backbone features the releases are made of."""
        if self.closed is not None:
            return self.closed.dim
        return self.runtime.feature_dim if self.learner is not None else self.cfg.train.out_dim

    @property
    def predictor(self) -> LocalModel:
        """The model the device predicts with: its own, or (dp-features) the one its
        validation split chose."""
        return self.learner.model if self.learner is not None else self.model

    def _answer(self, announcement: RoundAnnouncement, received_bytes: int | None) -> Decision:
        cfg = self.cfg
        if self.ignored != Counter(self.state.snapshot.extra.get("ignored_announcements", {})):
            self.state.record(ignored_announcements=dict(self.ignored))  # unsaved counts
        self._adopt_global(announcement)
        if self.closed is not None:
            return self._answer_with_statistics(announcement, received_bytes)
        privacy = cfg.privacy
        dp = privacy.mechanism == "dp"
        if dp and not self.ledger.allows(self.spending.dp_events()):
            # Checked before training: the round's DP-SGD steps are paid for by its release.
            return self._exhausted(announcement.round)
        feature_release: tuple[Release, float] | None = None
        if self.learner is not None:
            feature_release = self.spending.feature_release(
                announcement.round, state=self.state, data_version=self.data_version,
                features=self.features, labels=self.train_labels, num_classes=self.num_classes,
            )  # fmt: skip
            if feature_release is None:
                return self._exhausted(announcement.round)
        log.info("round %d: training on %d samples", announcement.round, len(self.train_labels))
        guidance = Guidance.from_announcement(
            announcement, client=cfg.agent_id, dim=cfg.train.out_dim
        )
        args = (self.model, self.optimiser, self.features, self.train_labels)
        common: dict[str, Any] = {"method": cfg.method, "guidance": guidance, "cfg": cfg.train}
        record: dict[str, Any] = {}
        if dp:
            metrics = train_round_dp(
                *args,
                **common,
                schedule=self.spending.schedule(),
                noise=self.noise.torch,
                noise_multiplier=privacy.sgd_noise_multiplier,
                max_grad_norm=privacy.max_grad_norm,
            )
        elif self.learner is not None:
            metrics, choice = self.learner.train_round(
                self.features, self.train_labels, announcement, client=cfg.agent_id,
                generator=self.generator, optimiser=self.optimiser,
            )  # fmt: skip
            record |= {
                "anchor_weight": choice.weight,
                "predict_rule": choice.rule,
                "val_accuracies": [list(v) for v in choice.val_accuracies],
            }
        else:
            metrics = train_round(*args, **common, generator=self.generator)
        # Trained, nothing of the round written or sent yet: where a kill during training
        # lands, reached on purpose instead of by timing.
        crash_point(f"after_training:{announcement.round}")
        # One pass over the cached features gives the prototypes (Eq. 5) and, for
        # FedDBP, the embeddings its Fisher scores need.
        z, _ = embed(self.predictor, self.features)
        labels = torch.from_numpy(self.train_labels)
        protos_t, counts_t = local_prototypes(torch.from_numpy(z), labels, self.num_classes)
        # The exact local prototypes stay on the device for inference; what leaves it is
        # the mechanism's release.
        protos, counts = protos_t.numpy(), counts_t.numpy()
        held = np.flatnonzero(counts > 0)
        spent = None
        if feature_release is not None:
            release, spent = feature_release  # the data version's release, sent again
        else:
            release = MECHANISMS[privacy.mechanism].release(
                z,
                self.train_labels,
                self.num_classes,
                self.spending.mechanism_params(),
                self.noise.numpy,
            )
        if dp:
            # Durable before the update exists anywhere: a crash from here on can only
            # over-count this release, never forget it.
            spent = self.ledger.record(
                announcement.round, self.spending.dp_events(), reproducible=self.noise.reproducible
            )
            crash_point("after_ledger_write")
        formal = MECHANISMS[privacy.mechanism].formal
        extras = update_extras(
            method=cfg.method, model=self.model, held=held, z=z, labels=self.train_labels,
            num_classes=self.num_classes,
        )  # fmt: skip
        update = PrototypeUpdate(
            fleet=cfg.fleet,
            round=announcement.round,
            client=cfg.agent_id,
            bundle=self.bundle_id,
            method=cfg.method,
            classes=tuple(int(c) for c in release.classes),
            # Noisy counts as 64-bit floats: an update's size must not depend on them.
            counts=tuple((float if formal else int)(c) for c in release.counts),
            prototypes=release.prototypes.astype(np.float16),
            extras=extras,
            privacy=PrivacyMeta(
                mechanism=privacy.mechanism,
                epsilon=spent,
                delta=privacy.delta if formal else None,
                guarantee=self.ledger.guarantee if formal else NONE,
            ),
        )
        run = announcement.auth.run if announcement.auth is not None else None
        update = self.keys.sign(update, run=run)
        payload = update.to_wire()
        record |= {
            "loss": metrics.loss,
            "train_seconds": metrics.seconds,
            "time": time.time(),
            "bytes_up": len(payload),
            "bytes_down": received_bytes,
        }
        if self.evaluator is not None:
            # The figures of the head just trained; a method that predicts with what the
            # coordinator returns is scored when that arrives (_adopt_global). A
            # dp-features device predicts by the rule its validation split chose
            # (edge_agent.anchored), with the model it chose.
            rule = self.learner.predict_rule if self.learner is not None else None
            record.update(self.evaluator.after_training(self.predictor, protos, counts, rule=rule))
        if self.learner is not None:
            self.learner.save()
        self.state.save_round(
            announcement.round,
            model=self.predictor,
            prototypes=protos,
            counts=counts,
            update=payload,
            metrics=record,
        )
        log.info(
            "round %d answered: loss %.4f, %d classes", announcement.round, metrics.loss, len(held)
        )
        return Decision("answered", update=update, payload=payload)

    def _answer_with_statistics(
        self, announcement: RoundAnnouncement, received_bytes: int | None
    ) -> Decision:
        """A closed-form device's answer: its statistics until the coordinator has stored
        them for this data version (a receipt says so, :meth:`confirmed`), an update with
        no rows after that, so a run costs the statistics once and a few hundred bytes a
        round."""
        closed, cfg, privacy = self.closed, self.cfg, self.cfg.privacy
        assert closed is not None
        round_ = announcement.round
        # What the statistics are of: the data, and the method and size they are taken in
        # (another [closed_form] dim or method over the same data is another release).
        version = f"{self.data_version}:{cfg.method}:{closed.dim}"
        sent = self.state.snapshot.extra.get("statistics_stored") == version
        formal = MECHANISMS[privacy.mechanism].formal
        spent = self.ledger.spent() if formal else None
        if sent:
            release = StatisticsRelease.nothing(closed.dim)
        elif not formal:
            release = closed.release()
        else:
            made = self.spending.statistics_release(
                round_, state=self.state, data_version=version,
                make=lambda z, rng: closed.noisy_release(z, rng).arrays(),
            )  # fmt: skip
            if made is None:
                return self._exhausted(round_)
            release, spent = StatisticsRelease.from_arrays(made[0]), made[1]
        update = release.update(
            fleet=cfg.fleet, round_=round_, client=cfg.agent_id, bundle=self.bundle_id,
            method=cfg.method,
            privacy=PrivacyMeta(
                mechanism=privacy.mechanism, epsilon=spent,
                delta=privacy.delta if formal else None,
                guarantee=self.ledger.guarantee if formal else NONE,
            ),
        )  # fmt: skip
        run = announcement.auth.run if announcement.auth is not None else None
        update = self.keys.sign(update, run=run)
        payload = update.to_wire()
        if not sent:
            self.state.record(statistics_sent={"round": round_, "version": version})
        record: dict[str, Any] = {
            "loss": 0.0,
            "train_seconds": 0.0,
            "time": time.time(),
            "bytes_up": len(payload),
            "bytes_down": received_bytes,
            "statistics_sent": not sent,
        }
        exact = closed.statistics()
        means = exact.sums / np.maximum(exact.counts, 1.0)[:, None]
        self.state.save_round(round_, model=None, prototypes=means.astype(np.float32),
                              counts=exact.counts, update=payload, metrics=record)  # fmt: skip
        log.info("round %d answered: %s", round_, "statistics" if not sent else "no new data")
        return Decision("answered", update=update, payload=payload)

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
        return self.ledger.spent()

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
            and self.learner is None  # dp-features: scored by its own rule, after training
            and rule_of(method).from_server
            and announcement.round >= 1
        ):
            self.state.amend_round(
                announcement.round - 1, **self.evaluator.from_server(self.model, self.state)
            )
