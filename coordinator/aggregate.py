"""The aggregation math as pure functions on plain numpy arrays.

Everything here works on a dense layout: ``protos`` of shape (U, C, d) holds update u's
prototype of class c (zeros where absent) and ``counts`` of shape (U, C) its sample count
(0 where absent). A class a client does not report simply has count 0, so every rule
below is a masked reduction over the client axis.
"""

from __future__ import annotations

from typing import Literal

import numpy as np

# Plain ndarray aliases: numpy's precise generics add noise here without catching bugs.
F64 = np.ndarray
Mask = np.ndarray
Weighting = Literal["count", "paper"]
Rule = Literal["mean", "median", "trimmed_mean"]


def present_mask(counts: F64) -> Mask:
    """(U, C) True where update u reports class c with a positive count."""
    return counts > 0


def weighted_sums(protos: F64, counts: F64) -> tuple[F64, F64]:
    """Per class, ``sum_i n_ic * C_ic`` (C, d) and ``sum_i n_ic`` (C,).

    These pairs are all a hierarchical aggregator needs to forward: they add up across
    gateways or shards, so pre-summing never changes the result.
    """
    return np.einsum("uc,ucd->cd", counts, protos), counts.sum(axis=0)


def client_sums(protos: F64, counts: F64) -> tuple[F64, np.ndarray]:
    """Per class, ``sum C_ic`` over the clients holding it (C, d) and their number (C,)."""
    mask = present_mask(counts)
    return np.einsum("uc,ucd->cd", mask.astype(np.float64), protos), mask.sum(axis=0)


def mean_of_sums(sums: F64, totals: F64, *, holders: np.ndarray | None = None) -> tuple[F64, Mask]:
    """``sums / totals`` for every class with ``totals > 0`` (zeros elsewhere), divided
    once more by ``holders`` if given (the paper's weighting), and the (C,) mask of those
    classes. The one division every averaging rule ends in, whether its sums were taken
    over all updates at once or added up from workers' partial sums (coordinator/tier/partial.py).
    """
    has = totals > 0
    out = np.zeros_like(sums)
    out[has] = sums[has] / totals[has, None]
    if holders is not None:
        out[has] /= holders[has, None]
    return out, has


def count_weighted_mean(
    protos: F64, counts: F64, *, weighting: Weighting = "count"
) -> tuple[F64, Mask]:
    """Global prototypes (FedPCL Eq. 6) and the (C,) mask of classes that have one.

    ``count``: ``sum_i n_ij C_ij / N_j`` — a convex combination, so a global prototype has
    the same scale as the unit-norm features it is compared with.
    ``paper``: the same times ``1 / |N_j|`` exactly as printed in the paper, which shrinks a
    class's prototype by the number of clients holding it.
    """
    if weighting not in ("count", "paper"):
        raise ValueError(f"unknown weighting {weighting!r}; use 'count' or 'paper'")
    sums, totals = weighted_sums(protos, counts)
    holders = present_mask(counts).sum(axis=0) if weighting == "paper" else None
    return mean_of_sums(sums, totals, holders=holders)


def combine(
    protos: F64, counts: F64, *, rule: Rule = "mean", trim: float = 0.1
) -> tuple[F64, Mask]:
    """Per-class combination across the clients holding each class, unweighted.

    ``mean`` is FedProto's and FedDBP's client-wise average; ``median`` is the
    coordinate-wise median; ``trimmed_mean`` drops ``floor(trim * n)`` values at each end of
    every coordinate before averaging. Median and trimmed mean bound the influence of a
    minority of arbitrary updates.
    """
    if rule == "mean":
        return mean_of_sums(*client_sums(protos, counts))
    mask = present_mask(counts)
    has = np.asarray(mask.any(axis=0))
    out = np.zeros((protos.shape[1], protos.shape[2]), dtype=np.float64)
    if rule not in ("median", "trimmed_mean"):
        raise ValueError(f"unknown rule {rule!r}; use mean, median or trimmed_mean")
    if not 0.0 <= trim < 0.5:
        raise ValueError(f"trim must be in [0, 0.5), got {trim}")
    for c in np.flatnonzero(has):
        rows = protos[mask[:, c], c]  # (n_c, d)
        if rule == "median":
            out[c] = np.median(rows, axis=0)
        else:
            k = trimmed_per_side(rows.shape[0], trim)
            ordered = np.sort(rows, axis=0)
            out[c] = ordered[k : rows.shape[0] - k].mean(axis=0)
    return out, has


def trimmed_per_side(n: int, trim: float) -> int:
    """How many of ``n`` values the trimmed mean drops at each end: ``floor(trim * n)``,
    but at least one whenever three or more remain to drop from (with 3 devices and
    ``trim = 0.1`` the floor is 0, and a trimmed mean that trims nothing is the mean one
    hostile device can steer)."""
    k = int(np.floor(trim * n))
    return max(k, 1) if n >= 3 and trim > 0 else k


def pad_local_sets(protos: F64, counts: F64, global_protos: F64, has_global: Mask) -> np.ndarray:
    """FedPCL Eq. 7: each client's local set over the global classes, a missing class
    filled with its global prototype. Returns (U, G, d) float32 for the G classes in
    ``has_global`` (float32 because it only ever goes on the wire)."""
    local = protos[:, has_global].astype(np.float32)  # (U, G, d)
    users, slots = np.nonzero(~present_mask(counts)[:, has_global])
    local[users, slots] = global_protos[has_global][slots]
    return local


def cap_counts(counts: F64, cap: float) -> F64:
    """Limit the count any client may claim per class (a lying client gains at most ``cap``)."""
    if cap <= 0:
        raise ValueError(f"count cap must be positive, got {cap}")
    return np.minimum(counts, cap)


#: How far above 1 the norm of a mean of unit vectors may be and still be one: float16 and
#: float32 rounding of the rows, never an honest device's arithmetic.
NORM_TOLERANCE = 1e-3


def class_medians(values: F64, counts: F64) -> F64:
    """(C,) per class, the lower median of ``values`` (U, C) over the clients holding the
    class (``counts > 0``), ``inf`` where nobody does. The lower median is a value some
    holder reported, and with two holders it is the smaller: one device of two cannot
    raise it."""
    held = np.where(present_mask(counts), values, np.nan)
    out = np.full(counts.shape[1], np.inf)
    has = present_mask(counts).any(axis=0)
    if has.any():
        out[has] = np.nanquantile(held[:, has], 0.5, axis=0, method="lower")
    return out


def cap_counts_at_median(counts: F64) -> F64:
    """Each client's count of a class capped at the class's lower median count in the
    round: one client weighs at most as much as the median holder, whatever it claims.
    Clients at or below the median keep their counts exactly."""
    return np.minimum(counts, class_medians(counts, counts)[None, :])


def clip_norms_at_median(protos: F64, counts: F64) -> F64:
    """Every prototype row clipped to the larger of 1 (+ :data:`NORM_TOLERANCE`) and its
    class's lower median row norm in the round. Means of unit vectors have norm <= 1, so an
    honest round without noise is left bit for bit as it was; under noise, where every
    honest row is longer than 1, no row can outweigh the median holder's by its length."""
    norms = np.linalg.norm(protos, axis=-1)  # (U, C)
    bound = np.maximum(1.0 + NORM_TOLERANCE, class_medians(norms, counts))  # (C,)
    scale = np.minimum(1.0, bound[None, :] / np.maximum(norms, 1e-12))
    return protos * scale[:, :, None]


#: A row whose cosine to its class's robust centre is below this fraction of the median
#: holder's cosine is screened out (:func:`screen_directions`).
DIRECTION_FRACTION = 0.5


def class_centres(protos: F64, counts: F64) -> F64:
    """(C, d) per class, the coordinate-wise median of the rows of the clients holding it
    (zeros where nobody does): a centre one client of three or more cannot drag far."""
    out = np.zeros((protos.shape[1], protos.shape[2]), dtype=np.float64)
    mask = present_mask(counts)
    for c in np.flatnonzero(mask.any(axis=0)):
        out[c] = np.median(protos[mask[:, c], c], axis=0)
    return out


def centre_cosines(protos: F64, centres: F64) -> F64:
    """(U, C) the cosine of each row (U, C, d) to its class's centre (C, d); 0 where
    either is the zero vector."""
    dots = np.einsum("ucd,cd->uc", protos, centres)
    norms = np.linalg.norm(protos, axis=-1) * np.linalg.norm(centres, axis=-1)[None, :]
    return np.where(norms > 0, dots / np.maximum(norms, 1e-300), 0.0)


def screen_directions(
    protos: F64, counts: F64, *, fraction: float = DIRECTION_FRACTION
) -> tuple[F64, Mask]:
    """Counts with the rows that point away from their class screened out, and the (U, C)
    mask of the rows screened.

    Per class, the centre is the coordinate-wise median of the holders' rows
    (:func:`class_centres`), ``s_uc`` each holder's cosine to it and ``m_c`` the lower
    median of those cosines (:func:`class_medians`). A row is screened, its count set to 0
    as if the client had not reported the class, when ``s_uc < fraction * m_c``: it agrees
    with the class's consensus direction less than ``fraction`` as well as the median
    holder does. A class with ``m_c <= 0`` has no consensus direction and is left alone.
    With one or two holders nothing is screened: ``m_c`` is then the smaller cosine, and
    no holder falls below a fraction of it. Every holder at or above the median is kept,
    so a class never loses its global prototype to the screen.

    Why: a device that sends the same vector every round is a stubborn agent. Any fixed
    share of the mean it keeps, the honest devices, trained towards the global prototypes,
    pick up round after round (one of 10 at a median device's weight moved FedPCL's global
    prototypes to cosine 0.63 towards its vector in 10 rounds, bench/compromised_bench.py);
    only a share of zero stops that. Lengths cannot tell it apart (the norm clip already
    made it as long as an honest row, and honest rows under domain shift lie almost as far
    from the mean as it does), directions can: a vector unrelated to the data is near
    orthogonal to the median of the honest rows.
    """
    if not 0.0 < fraction < 1.0:
        raise ValueError(f"fraction must be in (0, 1), got {fraction}")
    mask = present_mask(counts)
    cosines = centre_cosines(protos, class_centres(protos, counts))
    median = class_medians(cosines, counts)  # (C,), inf where nobody holds the class
    judged = np.isfinite(median) & (median > 0)
    screened = mask & judged[None, :] & (cosines < fraction * np.where(judged, median, 0.0))
    return np.where(screened, 0.0, counts), screened


def clip_norms(protos: F64, bound: float) -> F64:
    """Scale every prototype whose L2 norm exceeds ``bound`` back onto the ball."""
    if bound <= 0:
        raise ValueError(f"norm bound must be positive, got {bound}")
    norms = np.linalg.norm(protos, axis=-1, keepdims=True)
    scale = np.minimum(1.0, bound / np.maximum(norms, 1e-12))
    return protos * scale


def first_neighbours(points: F64, *, block: int = 2048) -> np.ndarray:
    """Index of each row's most cosine-similar other row.

    Computed in row blocks in float32 so 10,000 prototypes of one class need a 80 MB
    similarity block at a time instead of an 800 MB matrix."""
    unit = (points / np.maximum(np.linalg.norm(points, axis=1, keepdims=True), 1e-12)).astype(
        np.float32
    )
    out = np.empty(len(unit), dtype=np.int64)
    for start in range(0, len(unit), block):
        sim = unit[start : start + block] @ unit.T  # (b, n)
        rows = np.arange(sim.shape[0])
        sim[rows, rows + start] = -np.inf
        out[start : start + block] = sim.argmax(axis=1)
    return out


def finch_first_partition(points: F64) -> np.ndarray:
    """FINCH's first partition (FPL Eq. 4): link every point to its first neighbour by
    cosine similarity; clusters are the connected components. Labels are 0..K-1 in order
    of first appearance."""
    n = points.shape[0]
    if n == 0:
        return np.zeros(0, dtype=np.int64)
    if n == 1:
        return np.zeros(1, dtype=np.int64)
    neighbour = first_neighbours(points)
    # A(m, n) = 1 if n = v_m, m = v_n or v_m = v_n: the last case is implied by
    # connectivity through the shared neighbour, so linking each point to its
    # neighbour and taking components gives exactly the same partition.
    parent = np.arange(n)

    def find(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = int(parent[i])
        return i

    for i, j in enumerate(neighbour):
        ri, rj = find(i), find(int(j))
        if ri != rj:
            parent[max(ri, rj)] = min(ri, rj)
    roots = np.array([find(i) for i in range(n)])
    _, labels = np.unique(roots, return_inverse=True)
    # Renumber by first appearance so labels are stable and easy to test.
    order: dict[int, int] = {}
    for lab in labels:
        order.setdefault(int(lab), len(order))
    return np.array([order[int(lab)] for lab in labels], dtype=np.int64)


def cluster_means(points: F64, labels: np.ndarray) -> F64:
    """Mean of each cluster (FPL Eq. 5), rows in label order."""
    k = int(labels.max()) + 1 if labels.size else 0
    out = np.zeros((k, points.shape[1]), dtype=np.float64)
    np.add.at(out, labels, points)
    return out / np.bincount(labels, minlength=k)[:, None]


def topk_fusion(local: F64, global_: F64, scores: F64, *, k: int, eta: float) -> F64:
    """FedDBP Eq. 9-10 for one client: in each class's Top-K channels by Fisher score, mix
    ``eta * local + (1 - eta) * global``; elsewhere keep the global prototype.

    ``local``, ``global_`` and ``scores`` are (C, d); a class the client lacks should be
    passed with its global row as ``local``.
    """
    if k < 0:
        raise ValueError(f"k must be non-negative, got {k}")
    if not 0.0 <= eta <= 1.0:
        raise ValueError(f"eta must be in [0, 1], got {eta}")
    d = global_.shape[1]
    k = min(k, d)
    out = global_.copy()
    if k == 0:
        return out
    # argpartition picks the K largest scores per row without a full sort.
    top = np.argpartition(-scores, k - 1, axis=1)[:, :k]  # (C, k)
    rows = np.arange(global_.shape[0])[:, None]
    out[rows, top] = eta * local[rows, top] + (1.0 - eta) * global_[rows, top]
    return out
