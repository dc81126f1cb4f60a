"""A device of a closed-form method (lda, ridge, fedcof): its statistics release, and the
linear head it predicts with.

The device trains nothing by gradient. Its frozen backbone features are made unit-norm,
passed through a public random projection to ``k`` dimensions when the fleet sets one
(seeded from the fleet id: every device and the coordinator agree on it without a
message) and clipped to norm <= 1. Their class statistics (``closed_form``)
leave the device once per data version; the coordinator sums every device's and
announces the solved linear head.

The device then chooses what it predicts with, on a validation split of its own data
(neither leaves it): the fleet's head as announced, a personalised head (a closed-form
ridge toward the fleet's on its own data) or its own head (an LDA on its own statistics,
what it would have without the fleet). The chosen head is refitted on all its data and
kept in its state folder, so ``edge-agent predict`` predicts with what was scored. The
device keeps its own head unless the fleet's or the personalised one gets at least one
more held-out sample right (:func:`choose`): a fleet head no better on its data (a small
fleet under heavy noise) is not used.
"""

from __future__ import annotations

import io
import logging
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

import closed_form as cf
from closed_form.basis import load_basis_id
from closed_form.projection import PROJECTION, basis_check, basis_problem, prepare, projection
from edge_agent.config import ClosedFormSettings
from edge_agent.fit_split import FitSplit
from edge_agent.methods import DeviceMethod
from protocol import PrivacyMeta, PrototypeUpdate, RoundAnnouncement
from protocol.methods import BASIS, BIAS, COUNTS, GRAM
from runtime.files import atomic_write

log = logging.getLogger(__name__)

#: What the device can predict with: the fleet's head, one personalised toward its data,
#: its own (the head it has without the fleet, chosen unless another earns its place).
CHOICES = ("global", "personalised", "own")


def choose(scores: dict[str, float], *, validation: int) -> str:
    """The head to predict with, from each head's accuracy on ``validation`` held-out
    samples: the device's own unless the fleet's or the personalised one gets at least one
    more of them right (a validation split of a few samples is noisy, and a noisy fleet
    head that ties its own by luck costs more than it gains); between those two, the
    better, the fleet's on a tie."""
    margin = 1.0 / max(validation, 1)
    best = max(CHOICES[:2], key=lambda name: (scores[name], -CHOICES.index(name)))
    return best if scores[best] >= scores["own"] + margin - 1e-12 else "own"


def own_head(x: np.ndarray, labels: np.ndarray, num_classes: int) -> cf.LinearHead:
    """The head a device has without the fleet: an LDA on its own statistics."""
    return cf.lda_head(cf.device_statistics(x, labels, num_classes))


def global_head(
    announcement: RoundAnnouncement, *, num_classes: int, dim: int
) -> cf.LinearHead | None:
    """The fleet's head as ``announcement`` carries it; None when it carries none of this
    size (round 0, or a coordinator of another ``dim``)."""
    rows = announcement.global_prototypes
    bias = announcement.extras.get(BIAS)
    classes = np.asarray(announcement.global_classes, dtype=np.int64)
    if len(classes) == 0 or rows.shape[1] != dim or bias is None or bias.shape != (len(classes),):
        return None
    weight = np.zeros((num_classes, dim))
    offsets = np.zeros(num_classes)
    present = np.zeros(num_classes, dtype=bool)
    weight[classes] = rows
    offsets[classes] = bias
    present[classes] = True
    return cf.LinearHead(weight=weight, bias=offsets, present=present)


#: Bytes of a statistics update beside its arrays: field names, the header, a signature.
ENVELOPE_BYTES = 4096


def statistics_bytes(k: int, *, classes: int, gram: bool) -> int:
    """An upper bound on a statistics update's size: float64 sums (C x k), counts twice
    (the field and the counts as drawn), and the second moment's upper triangle."""
    values = classes * k + 2 * classes + (cf.triangle_size(k) if gram else 0)
    return 8 * values + ENVELOPE_BYTES


def largest_dim(limit: int, *, classes: int, gram: bool) -> int:
    """The largest k whose statistics update fits ``limit`` bytes (0 if none does)."""
    k = 0
    while statistics_bytes(k + 1, classes=classes, gram=gram) <= limit:
        k += 1
    return k


def check_payload(dim: int, *, method: DeviceMethod, classes: int, limit: int) -> None:
    """Refuse statistics of ``dim`` dimensions that may not fit ``limit`` bytes (the
    broker's ``mqtt.max_payload_bytes``): here, at start, and not by the coordinator round
    after round (an update above the cap would be sent again every resend_s and never
    stored)."""
    gram = method.wire.gram
    size = statistics_bytes(dim, classes=classes, gram=gram)
    if size > limit:
        raise ValueError(
            f"{method.name}'s statistics at {dim} dimensions take up to {size:,} bytes, "
            f"above mqtt.max_payload_bytes = {limit:,}: set [closed_form] dim to at most "
            f"{largest_dim(limit, classes=classes, gram=gram)}"
        )


@dataclass(frozen=True)
class StatisticsRelease:
    """What a closed-form update carries: per-class feature sums with their counts (signed
    under noise), and the second moment for the methods that use one. Float64: the
    coordinator's sum must be the pooled one, not a rounded one."""

    classes: np.ndarray  # (m,) class indices
    counts: np.ndarray  # (m,)
    rows: np.ndarray  # (m, k)
    gram: np.ndarray | None  # (k, k)
    #: (k + 1,) the basis the rows are in (closed_form/projection.py::basis_check); None:
    #: features taken as they are, no projection (``[k, 1, ..., 1]``).
    basis: np.ndarray | None = None

    @classmethod
    def of(
        cls, stats: cf.Statistics, *, every_class: bool = False, basis: np.ndarray | None = None
    ) -> StatisticsRelease:
        """``stats`` as sent: the classes held (``every_class``: all of them, as a noisy
        release sends them, so the set sent reveals nothing)."""
        classes = np.arange(stats.num_classes) if every_class else np.flatnonzero(stats.counts > 0)
        return cls(classes, stats.counts[classes], stats.sums[classes], stats.gram, basis)

    def arrays(self) -> dict[str, np.ndarray]:
        """The release as named arrays (a device keeps a noisy one, to send it again)."""
        out = {"classes": self.classes, "counts": self.counts, "rows": self.rows}
        if self.basis is not None:
            out["basis"] = self.basis
        return out if self.gram is None else out | {"gram": self.gram}

    @classmethod
    def from_arrays(cls, arrays: dict[str, np.ndarray]) -> StatisticsRelease:
        return cls(arrays["classes"], arrays["counts"], arrays["rows"], arrays.get("gram"),
                   arrays.get("basis"))  # fmt: skip

    @classmethod
    def nothing(cls, dim: int) -> StatisticsRelease:
        """The update of a device whose statistics the coordinator holds already."""
        return cls(np.zeros(0, np.int64), np.zeros(0), np.zeros((0, dim)), None)

    def update(self, *, fleet: str, round_: int, client: str, bundle: str, method: str,
               privacy: PrivacyMeta | None = None) -> PrototypeUpdate:  # fmt: skip
        """The update carrying it. Its ``counts`` field is the counts clamped at 0 (no
        update's may be negative); the counts as drawn travel in ``extras["counts"]``,
        which the coordinator sums, so that the noise of the devices' counts cancels in
        the fleet's instead of each clamped count adding a bias."""
        extras: dict[str, np.ndarray] = {}
        if len(self.classes):
            extras[COUNTS] = np.asarray(self.counts, dtype=np.float64)
            if self.gram is not None:
                extras[GRAM] = cf.upper_triangle(self.gram)
            k = self.rows.shape[1]
            basis = basis_check("", k, k) if self.basis is None else self.basis
            extras[BASIS] = np.asarray(basis, dtype=np.float64)
        return PrototypeUpdate(
            fleet=fleet, round=round_, client=client, bundle=bundle, method=method,
            classes=tuple(int(c) for c in self.classes),
            counts=tuple(max(0.0, float(c)) for c in self.counts),
            prototypes=np.asarray(self.rows, dtype=np.float64),
            extras=extras, privacy=privacy or PrivacyMeta(),
        )  # fmt: skip


@dataclass(frozen=True)
class StoredHead:
    """The head a device chose, as its state folder keeps it, with the projection its
    features pass through first: what ``edge-agent predict`` predicts with."""

    head: cf.LinearHead
    q: np.ndarray | None
    choice: str

    @classmethod
    def load(
        cls, path: Path, *, fleet: str, feature_dim: int, settings: ClosedFormSettings,
        num_classes: int,
    ) -> StoredHead | None:  # fmt: skip
        """None when there is none yet, one of another size, or one chosen in another basis
        (the fleet's ``[closed_form] basis`` set or changed since: its weights would score
        features projected otherwise)."""
        if not path.exists():
            return None
        k = settings.size(feature_dim)
        public = settings.public_basis(feature_dim)
        with np.load(path, allow_pickle=False) as data:
            if data["weight"].shape != (num_classes, k):
                log.warning("%s does not fit this fleet's head size; choosing anew", path)
                return None
            head = cf.LinearHead(weight=data["weight"], bias=data["bias"], present=data["present"])
            choice = str(data["choice"])
            # Heads kept before the basis check was stored were all in the random projection.
            made_in = np.asarray(data["basis"]) if "basis" in data.files else None
        if (public is not None if made_in is None
                else basis_problem(fleet, made_in, k, public=public) is not None):  # fmt: skip
            log.warning("%s was chosen in another basis; choosing anew", path)
            return None
        return cls(head, projection(fleet, feature_dim, k, basis=public), choice)

    def scores(self, features: np.ndarray) -> np.ndarray:
        """(N, C) scores on backbone features (absent classes -inf)."""
        return self.head.scores(prepare(features, self.q))


class ClosedFormDevice:
    """One device's prepared features, its statistics and the head it predicts with."""

    FILE = "closed_form.npz"

    def __init__(
        self,
        *,
        method: DeviceMethod,
        fleet: str,
        features: np.ndarray,
        labels: np.ndarray,
        num_classes: int,
        settings: ClosedFormSettings,
        seed: int,
        state_dir: Path | None,
    ) -> None:
        """``state_dir``: where the chosen head is kept (None: nowhere, for a simulated
        fleet of thousands that scores it and moves on)."""
        self.method = method
        self.settings = settings
        self.num_classes = num_classes
        self.dim = settings.size(features.shape[1])
        public = settings.public_basis(features.shape[1])
        self.q = projection(fleet, features.shape[1], self.dim, basis=public)
        self.basis = basis_check(fleet, features.shape[1], self.dim, basis=public)  # (k + 1,)
        #: How the release's basis is made, kept beside what the coordinator stores so that
        #: statistics in another basis are sent again (edge_agent/delivery.py).
        #: ``basis_id``: the public basis's content, "" for the random projection.
        self.basis_id = "" if public is None else load_basis_id(settings.basis)
        self.projection_name = PROJECTION + (f"+basis-{self.basis_id}" if self.basis_id else "")
        self.x = prepare(features, self.q)  # (N, k)
        self.labels = np.asarray(labels)
        self.split = FitSplit.stratified(self.labels, share=settings.validation_share, seed=seed)
        self.path = None if state_dir is None else state_dir / self.FILE
        self.val_accuracies: dict[str, float] = {}
        self._statistics: cf.Statistics | None = None
        stored = None
        if self.path is not None:
            stored = StoredHead.load(self.path, fleet=fleet, feature_dim=features.shape[1],
                                     settings=settings, num_classes=num_classes)  # fmt: skip
        self.head: cf.LinearHead | None = None if stored is None else stored.head
        self.choice = "" if stored is None else stored.choice

    def statistics(self) -> cf.Statistics:
        """This device's exact statistics over all its data (the second moment where its
        method uses one), computed once."""
        if self._statistics is None:
            self._statistics = cf.device_statistics(
                self.x, self.labels, self.num_classes, gram=self.method.wire.gram
            )
        return self._statistics

    def release(self) -> StatisticsRelease:
        """The exact statistics as sent."""
        return StatisticsRelease.of(self.statistics(), basis=self.basis)

    def noisy_release(self, noise_multiplier: float, rng: np.random.Generator) -> StatisticsRelease:
        """The statistics through one Gaussian mechanism of multiplier ``noise_multiplier``
        (noise std over the release's joint L2 sensitivity under adding or removing one
        example of norm <= 1). With a second moment: (G, s, n), sensitivity sqrt(3)
        (``closed_form``). Without (fedcof): the sums and counts, sqrt(2). Every
        class is sent, present or not, so the set sent reveals nothing."""
        exact = self.statistics()
        if self.method.wire.gram:
            noisy = cf.noised(exact, sigma=noise_multiplier * cf.SENSITIVITY, rng=rng)
            return StatisticsRelease.of(noisy, every_class=True, basis=self.basis)
        sigma = noise_multiplier * math.sqrt(2.0)
        sums = exact.sums + rng.normal(0.0, sigma, size=exact.sums.shape)
        counts = exact.counts + rng.normal(0.0, sigma, size=exact.counts.shape)
        return StatisticsRelease(np.arange(self.num_classes), counts, sums, None, self.basis)

    def adopt(self, announcement: RoundAnnouncement) -> bool:
        """Choose and keep the head to predict with, given the announcement's fleet head;
        False when it carries none (the device keeps what it had)."""
        fleet = global_head(announcement, num_classes=self.num_classes, dim=self.dim)
        if fleet is None:
            return False
        fit, val = self.split.fit, self.split.val
        x, y = self.x, self.labels
        lam = self.settings.personal_lambda
        probes = {
            "global": fleet,
            "personalised": cf.personalised_head(x[fit], y[fit], fleet, lam=lam),
            "own": own_head(x[fit], y[fit], self.num_classes),
        }
        scores = {
            name: float((head.predict(x[val]) == y[val]).mean()) if len(val) else 0.0
            for name, head in probes.items()
        }
        best = choose(scores, validation=len(val))
        if best == "global":
            chosen = fleet
        elif best == "personalised":
            chosen = cf.personalised_head(x, y, fleet, lam=lam)
        else:
            chosen = own_head(x, y, self.num_classes)
        self.head, self.choice, self.val_accuracies = chosen, best, scores
        self._save()
        return True

    def scores(self, features: np.ndarray) -> np.ndarray:
        """(N, C) scores of the chosen head on backbone features (absent classes -inf)."""
        if self.head is None:
            raise LookupError("no closed-form head yet: the coordinator has announced none")
        return self.head.scores(prepare(features, self.q))

    def _save(self) -> None:
        assert self.head is not None
        if self.path is None:
            return
        buf = io.BytesIO()
        np.savez(buf, weight=self.head.weight, bias=self.head.bias, present=self.head.present,
                 choice=np.array(self.choice), basis=self.basis)  # fmt: skip
        atomic_write(self.path, buf.getvalue())
