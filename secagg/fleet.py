"""A fleet's secure aggregation of closed-form statistics: the public ``[secure_aggregation]``
table every party reads, the protocol settings and noise plan it gives for a method's
statistics, and the vector layout the devices' statistics are summed in.

The coordinator and every device hold the same table (public fleet settings, like the
class list). From it and the method's statistics shape, :func:`secure_release` builds the
:class:`~secagg.settings.SecAggSettings` both sides run a round with and the
distributed discrete Gaussian's plan (:mod:`secagg.plan`), so the coordinator can
check its ring and a device knows what one round of its release costs. A device's own
``[privacy] epsilon`` stays its lifetime cap: its ledger charges each round it takes part
in (edge_agent/privacy/modes.py).

The vector is ``[triu(G), sums (C*k), counts (C)]`` (``G`` only for lda and ridge):
what :mod:`secagg.plan` accounts for.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping
from dataclasses import dataclass, replace

import numpy as np

import closed_form as cf
from protocol.methods import WIRE_METHODS, wire_method
from secagg.plan import (
    DistributedPlan,
    SecureSum,
    check_ring,
    kls_tau,
    plan_distributed,
    statistics_clip,
    statistics_length,
)
from secagg.quantise import QuantiseSpec
from secagg.settings import SecAggSettings

#: ``[privacy] aggregation``: ``plain`` (each device's release reaches the coordinator) or
#: ``secure`` (only the fleet's sum does).
AGGREGATIONS = ("plain", "secure")

#: The ``[secure_aggregation]`` fields every party must hold alike, and their types: they
#: set the graph, the ring, the quantiser and the noise. ``stage_timeout_s`` is the
#: coordinator's deadline alone, so it stays out of the digest.
SHARED_FIELDS: dict[str, type] = {
    "threshold": int, "neighbours": int, "colluding": int, "scale": float, "bits": int,
    "epsilon": float, "delta": float, "dataset_size": int, "quorum": int,
}  # fmt: skip
#: Fields the digest leaves out while they hold their default, so that a table which does
#: not set them hashes as it did before they existed.
_OPTIONAL_FIELDS = {"quorum": 0}
_TABLE_LABEL = b"protofleet/secagg/table/v1\n"
_BASIS_LABEL = b"protofleet/secagg/basis/v1\n"
#: The announcement's extra naming the round a closed-form secure fleet's running sum began
#: (coordinator/rounds/secure_record.py): a device's input of an earlier round is not in it.
SINCE_EXTRA = "secure_sum_since"


def since_extra(since: int) -> dict[str, np.ndarray]:
    """The announcement extra that says the fleet's running sum began at round ``since``."""
    return {SINCE_EXTRA: np.array([float(since)])}


def since_of(extras: Mapping[str, np.ndarray]) -> int:
    """The round an announcement's extras say the running sum began (0 where they do not)."""
    since = extras.get(SINCE_EXTRA)
    return int(since[0]) if since is not None and since.size == 1 else 0


@dataclass(frozen=True)
class SecureAggregation:
    """The ``[secure_aggregation]`` table: public, the same on the coordinator and every
    device (docs/privacy.md, "Secure aggregation").

    ``threshold`` (t): the fewest devices a round may finish with, and the fewest shares
    that rebuild a secret; 0 until set (a secure fleet must set it). ``neighbours``: how
    many peers each device pairs with (SecAgg+); 0 pairs every device with every other.
    ``colluding``: how many devices may hand their noise to the coordinator without
    weakening the guarantee (the plan counts only ``t - colluding`` shares). ``scale``
    and ``bits``: the quantiser's step (a power of two keeps it exact) and the ring's
    width. ``epsilon`` and ``delta``: what one round's sum spends (0: no noise, the exact
    sum). ``dataset_size``: the public bound on a device's training samples, which bounds
    each coordinate (the clip). ``stage_timeout_s``: how long the coordinator keeps each
    of the five stages open; who has not answered by then has dropped. ``quorum`` (T):
    the fewest survivors a round may finish with across the fleet, 0 for ``threshold``;
    set it with ``neighbours`` (SecAgg+), where ``t`` is a neighbourhood's, so that the
    noise is calibrated to the fleet: each device adds ``sigma^2 / T`` and the plan counts
    ``T - colluding`` honest shares (docs/privacy.md, "Noise calibrated to the fleet")."""

    threshold: int = 0
    neighbours: int = 0
    colluding: int = 0
    scale: float = 32768.0
    bits: int = 32
    epsilon: float = 1.0
    delta: float = 1e-5
    dataset_size: int = 0
    stage_timeout_s: float = 30.0
    quorum: int = 0

    def __post_init__(self) -> None:
        if min(self.threshold, self.neighbours, self.colluding, self.quorum) < 0:
            raise ValueError("threshold, neighbours, colluding and quorum must not be negative")
        if self.bits not in (32, 64):
            raise ValueError(f"bits must be 32 or 64, got {self.bits}")
        if not (math.isfinite(self.scale) and self.scale > 0):
            raise ValueError(f"scale must be positive, got {self.scale}")
        if not (math.isfinite(self.epsilon) and self.epsilon >= 0):
            raise ValueError(f"epsilon must be 0 (no noise) or positive, got {self.epsilon}")
        if not 0 < self.delta < 1:
            raise ValueError(f"delta must be in (0, 1), got {self.delta}")
        if self.dataset_size < 0:
            raise ValueError(f"dataset_size must not be negative, got {self.dataset_size}")
        if not (math.isfinite(self.stage_timeout_s) and self.stage_timeout_s > 0):
            raise ValueError(f"stage_timeout_s must be positive, got {self.stage_timeout_s}")

    def digest(self) -> bytes:
        """SHA-256 of :data:`SHARED_FIELDS` in one canonical form (``epsilon = 1`` and
        ``1.0`` read alike): every advertisement carries it, and the coordinator refuses
        a device whose digest is not its own (secagg/server.py)."""
        lines = []
        for name, kind in SHARED_FIELDS.items():
            value = getattr(self, name)
            if name in _OPTIONAL_FIELDS and value == _OPTIONAL_FIELDS[name]:
                continue
            lines.append(f"{name}={float(value).hex() if kind is float else int(value)}")
        return hashlib.sha256(_TABLE_LABEL + "\n".join(lines).encode()).digest()

    def problem(self) -> str | None:
        """What a secure fleet must still set, in one line; None when it is complete."""
        if self.threshold < 2:
            return (
                "[secure_aggregation] threshold must be set (at least 2): the fewest devices "
                "a round may finish with"
            )
        if self.dataset_size < 1:
            return (
                "[secure_aggregation] dataset_size must be set: the public bound on a "
                "device's training samples"
            )
        if self.colluding >= self.threshold:
            return (
                f"[secure_aggregation] colluding = {self.colluding} leaves no honest share of "
                f"threshold = {self.threshold}"
            )
        if 0 < self.quorum < self.threshold:
            return (
                f"[secure_aggregation] quorum = {self.quorum} is below threshold = "
                f"{self.threshold}: a round cannot finish with fewer devices than t"
            )
        return None

    @property
    def fewest(self) -> int:
        """T: the fewest survivors a round may finish with (``quorum``, else ``threshold``)."""
        return self.quorum or self.threshold


def method_problem(table: SecureAggregation, method: str) -> str | None:
    """Why ``method`` cannot aggregate securely under ``table``, in one line; None when it
    can (the table's own completeness aside, :meth:`SecureAggregation.problem`)."""
    record = wire_method(method)
    if not record.secure:
        secure = [m.name for m in WIRE_METHODS.values() if m.secure]
        return (
            f'privacy.aggregation = "secure" sums the devices\' releases, and {method} needs '
            f'each device\'s own: use {", ".join(secure)}, or aggregation = "plain"'
        )
    if not record.closed_form and table.epsilon > 0:
        return (
            f"{method}'s secure sum carries no noise (a prototype's sensitivity to one "
            "example has no public bound here): set [secure_aggregation] epsilon = 0"
        )
    return None


@dataclass(frozen=True)
class SecureRelease:
    """What one round of a secure fleet runs with: the protocol's settings and the noise
    plan (None without noise), for statistics of ``k`` features over ``classes``, or, with
    ``prototypes``, for prototype rows of ``k`` values (``[rows (C*k), holders (C)]``)."""

    settings: SecAggSettings
    plan: DistributedPlan | None
    k: int
    classes: int
    gram: bool
    prototypes: bool = False


def secure_release(
    table: SecureAggregation,
    *,
    k: int,
    classes: int,
    gram: bool,
    devices: int | None = None,
    basis: np.ndarray | None = None,
) -> SecureRelease:
    """The settings and plan of ``table`` for this statistics shape. ``devices``: the
    fleet's size, to check the ring holds its sum (None: not checked here). ``basis``: the
    basis check (``[D, column sums]``, closed_form/projection.py) of a fleet with a public
    basis, None for the random projection: bound into the settings' digest, so a device in
    another basis is refused at its advertisement, as the plain path's admission refuses
    its statistics (a secure sum hides them). Raises ValueError when the table is
    incomplete or the ring too narrow."""
    problem = table.problem()
    if problem is not None:
        raise ValueError(problem)
    spec = QuantiseSpec(clip=statistics_clip(table.dataset_size), scale=table.scale,
                        bits=table.bits)  # type: ignore[arg-type]  # fmt: skip
    plan = None
    if table.epsilon > 0:
        release = SecureSum.of_statistics(
            k=k, classes=classes, scale=table.scale, threshold=table.fewest,
            colluding=table.colluding, gram=gram,
        )  # fmt: skip
        plan = plan_distributed(release=release, epsilon_target=table.epsilon, delta=table.delta)
        if devices is not None:
            check_ring(plan, spec=spec, devices=max(devices, table.fewest))
    settings = _protocol(
        table, spec=spec, length=statistics_length(k, classes=classes, gram=gram),
        sigma2=None if plan is None else plan.sigma2,
    )  # fmt: skip
    if basis is not None:
        check = np.asarray(basis, dtype="<f8").tobytes()
        bound = hashlib.sha256(_BASIS_LABEL + settings.table + check).digest()
        settings = replace(settings, table=bound)
    return SecureRelease(settings=settings, plan=plan, k=k, classes=classes, gram=gram)


def _protocol(
    table: SecureAggregation, *, spec: QuantiseSpec, length: int, sigma2: int | None = None
) -> SecAggSettings:
    """The protocol's settings from ``table`` for vectors of ``length`` values."""
    return SecAggSettings(
        threshold=table.threshold,
        # 0 neighbours: the complete graph (each device pairs with all others).
        neighbours=table.neighbours or (1 << 30),
        spec=spec,
        length=length,
        sigma2=sigma2,
        table=table.digest(),
        colluding=table.colluding,
        quorum=table.quorum,
    )


def prototype_release(table: SecureAggregation, *, dim: int, classes: int) -> SecureRelease:
    """The settings of a prototype method's round: rows of ``dim`` values, norm at most 1
    (an exact prototype is a mean of unit embeddings), so every coordinate lies in
    [-1, 1], and one holder count per class; no noise."""
    problem = table.problem() or method_problem(table, "fedproto")
    if problem is not None:
        raise ValueError(problem)
    spec = QuantiseSpec(clip=1.0, scale=table.scale, bits=table.bits)  # type: ignore[arg-type]
    settings = _protocol(table, spec=spec, length=classes * dim + classes)
    return SecureRelease(
        settings=settings, plan=None, k=dim, classes=classes, gram=False, prototypes=True
    )


def flatten_prototypes(rows: np.ndarray, held: np.ndarray) -> np.ndarray:
    """A device's prototypes as FedProto's secure sum adds them: ``[rows, holders]``, the
    rows of the classes it holds (zeros elsewhere) and a 1 for each of them."""
    held = np.asarray(held, dtype=bool)
    dense = np.where(held[:, None], np.asarray(rows, dtype=np.float64), 0.0)
    return np.concatenate([dense.ravel(), held.astype(np.float64)])


def global_prototypes(
    total: np.ndarray, *, dim: int, classes: int, threshold: int
) -> tuple[np.ndarray, np.ndarray]:
    """FedProto's global prototypes from the decoded sum: each class's summed rows over
    its holder count (exact integers, rounded back from the quantised sum), and which
    classes to announce: those at least ``threshold`` (t) devices hold. The sum has no
    noise, so a class fewer hold would announce the mean of a few devices' rows (one
    device's own prototype when one holds it); t is the fewest inputs the protocol lets
    any sum have, and so the fewest a class's announced mean may have."""
    if total.shape != (classes * dim + classes,):
        raise ValueError(f"a sum of {total.shape} values, not ({classes * dim + classes},)")
    holders = np.rint(total[classes * dim :])
    has = holders >= max(1, threshold)
    rows = total[: classes * dim].reshape(classes, dim) / np.maximum(holders, 1.0)[:, None]
    return rows, has


def ledger_multiplier(plan: DistributedPlan) -> float:
    """The noise multiplier of the continuous Gaussian a device's ledger records for one
    round of ``plan``: ``sqrt(m sigma^2 / t) / Delta`` (honest shares only). The sum of
    ``m`` discrete Gaussian shares is bounded by that Gaussian's Renyi divergence plus
    Kairouz-Liu-Steinke's ``tau d`` term (secagg/plan.py); the ledger's accountant
    can price the Gaussian only, so a plan whose ``tau d`` is not negligible is refused."""
    release = plan.release
    slack = kls_tau(plan.share_sigma2, release.honest) * release.length
    if slack > 1e-12:
        raise ValueError(
            f"each device's noise share (sigma^2 {plan.share_sigma2:.3g} units^2) is too small "
            f"for the ledger's Gaussian accounting (tau d = {slack:.3g}): raise "
            "[secure_aggregation] scale"
        )
    return release.equivalent_multiplier(plan.sigma2)


def flatten(stats: cf.Statistics, *, gram: bool) -> np.ndarray:
    """A device's statistics as the secure sum adds them: ``[triu(G), sums, counts]``."""
    parts = [stats.sums.ravel(), stats.counts]
    if gram:
        if stats.gram is None:
            raise ValueError("these statistics carry no second moment")
        parts.insert(0, cf.upper_triangle(stats.gram))
    return np.concatenate([np.asarray(p, dtype=np.float64) for p in parts])


def unflatten(
    total: np.ndarray, *, k: int, classes: int, gram: bool, devices: int
) -> cf.Statistics:
    """The fleet's summed statistics from the decoded sum of ``devices`` devices. Which
    device holds which class is not in a sum: a class counts as held where its summed
    count is at least one example."""
    tri = cf.triangle_size(k) if gram else 0
    expected = statistics_length(k, classes=classes, gram=gram)
    if total.shape != (expected,):
        raise ValueError(f"a sum of {total.shape} values, not ({expected},)")
    counts = np.asarray(total[tri + classes * k :], dtype=np.float64)
    return cf.Statistics(
        counts=counts,
        sums=np.asarray(total[tri : tri + classes * k], dtype=np.float64).reshape(classes, k),
        gram=cf.from_upper_triangle(total[:tri]) if gram else None,
        holders=(counts >= 1.0).astype(np.int64),
        scatter=None,
        devices=devices,
    )
