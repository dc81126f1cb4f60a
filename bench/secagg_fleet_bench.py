"""A private lda head at 10,000 devices, the projection chosen by the public rule (issue 52).

digits-5 feature shift through the zoo, ``n`` devices of 20 training samples, scored on
the pooled test set (every device's 20). Each device's statistics are built by the
agent's own ``ClosedFormDevice`` and summed by the vector transport's secure-sum
arithmetic (:class:`fleet.engine.secure_sum.SimulatedSecureSum`: clipped to the declared
bound, scaled, stochastically rounded, its share ``N_Z(0, sigma^2 / T)`` added, summed in
the 32-bit ring, decoded), every device surviving; the head is solved as the
coordinator's secure tally solves it (lda, the scatter floored at the plan's public noise
level), in a 32-bit ring at 1,000 devices and a 64-bit one at 10,000 (figures before
0c97cbc summed 10,000 in 32 bits, which the plan refuses for a deployment; their secure
figures match the trusted curator's within 0.11 points, which a wrapped sum would not).
The masks are left out: they cancel exactly in the ring (bench.secagg_bench's
protocol check and bench.secagg_scale_bench run the real protocol).

The plan is the calibrated SecAgg+ plan of bench.secagg_scale_bench: ``T`` nine tenths of
the fleet, ``c`` the most colluders a neighbourhood of ``k`` (100 at 1,000 devices, 200 at
10,000) admits, 80 and 160; epsilon 1 and 8 at delta 1e-5, one round.

**The public basis.** Every device takes its statistics in the zoo's public basis
(closed_form/basis.py, ``bench.export_bench.ensure_basis``: rendered images only), as a
fleet naming ``[closed_form] basis`` does; the same fleet in the random projection is set
beside it at that projection's rule ``k``: ``privacy.secagg_<n>_random_{exact,eps1,
central_eps1}_acc``.

**The public rule** (secagg/dimension.py) picks ``k`` from the fleet's size, the dataset
bound, epsilon and the classes (the basis's ratio); the exact head takes the rule's ``k``
at epsilon 0 (the largest). Keys: ``privacy.secagg_<n>_eps{1,8}_acc`` and ``privacy.secagg_<n>_exact_acc``
under the rule (at 1,000, ``privacy.secagg_1000_eps{1,8}_acc_public_rule``: the keys
without the suffix are bench.secagg_bench's best-k figures), ``privacy.secagg_<n>_rule_k_eps{1,8}``,
``privacy.secagg_10000_eps1_gap`` (exact less eps 1, points), each ``k``'s as
``privacy.secaggplus_<n>_k<k>_{exact,eps1,eps8,central_eps1,central_eps8}_acc`` (and the
plan's ``_eps<e>_sigma``), and
``privacy.central_10000_eps{1,8}_acc``: the exact sum plus a continuous Gaussian of the
plan's standard deviation, what a trusted curator's sum gives. ``_exact_floor_eps<e>``
(under the rule: ``privacy.secagg_<n>_exact_floor_eps<e>_acc``): the exact statistics
under the eigenvalue floor that epsilon's noise calls for, without the noise: what the
floor costs alone.

**Best k, labelled.** At 10,000 every ``k`` of :data:`BEST_KS` runs as well, and
``privacy.secagg_10000_best_k_{exact,eps1,eps8}_acc`` is the best of them on the test set:
the optimistic bound a deployed fleet cannot pick, beside what the rule gets.
"""

from __future__ import annotations

import secrets
import sys
from dataclasses import replace

import numpy as np

import closed_form as cf
from bench.closed_form_bench import DELTA
from bench.export_bench import ZOO, ensure_basis
from bench.one_backbone import pooled_features
from bench.secagg_bench import CLASSES, SCALE, TEST, TRAIN, _accuracy, _devices, _spec, _unflat
from closed_form.basis import load_basis
from edge_agent.closed_form import prepare, projection
from fleet.engine.secure_sum import SimulatedSecureSum
from fleet.transports.spec import FLEET
from secagg.dimension import public_dim
from secagg.fleet import flatten
from secagg.plan import (
    DistributedPlan,
    SecureSum,
    decoded_noise_std,
    plan_distributed,
    statistics_length,
)

EPSILONS = (1.0, 8.0)
#: devices -> (quorum T, colluding c): bench.secagg_scale_bench's plans.
PLANS = {1000: (900, 80), 10_000: (9000, 160)}
BEST_KS = (128, 256, 512)


def _plan(k: int, eps: float, devices: int) -> DistributedPlan:
    quorum, colluding = PLANS[devices]
    release = SecureSum.of_statistics(k=k, classes=CLASSES, scale=SCALE, threshold=quorum,
                                      colluding=colluding)  # fmt: skip
    return plan_distributed(release=release, epsilon_target=eps, delta=DELTA)


def rule_k(devices: int, eps: float, features: int, *, basis: bool = True) -> int:
    """The public rule's ``k`` for this fleet (epsilon 0: no noise), in the public basis
    or (``basis`` False) the random projection."""
    quorum, colluding = PLANS[devices]
    return public_dim(devices=devices, dataset_size=TRAIN, classes=CLASSES, epsilon=eps,
                      delta=DELTA, scale=SCALE, quorum=quorum, colluding=colluding,
                      below=features, basis=basis)  # fmt: skip


def _scores(data: object, k: int, epsilons: tuple[float, ...], devices: int,
            x_test: np.ndarray, y_test: np.ndarray, basis: str) -> dict[str, float]:  # fmt: skip
    """One pass of the fleet at ``k`` in ``basis`` (a file, "" for the random
    projection): the exact head, and each epsilon's secure and central heads."""
    # A 32-bit ring holds 1,000 devices' sums at clip 20 and scale 2^15, not 10,000 (the
    # plan's check_ring): the larger fleet sums in 64 bits, as a deployment must.
    spec = replace(_spec(), bits=32 if devices <= 1000 else 64)
    plans = {eps: _plan(k, eps, devices) for eps in epsilons}
    sums = {eps: SimulatedSecureSum(spec=spec, share_sigma2=plan.share_sigma2)
            for eps, plan in plans.items()}  # fmt: skip
    noise = np.random.default_rng(secrets.randbits(128))
    exact: list[cf.Statistics] = []
    for device in _devices(data, k, basis=basis):  # type: ignore[arg-type]
        stats = device.statistics()
        exact.append(stats)
        if len(exact) == 100:
            exact[:] = [cf.merge(exact)]
        vector = flatten(stats, gram=True)
        for total in sums.values():
            total.add(vector, coins=None, noise=noise)
    merged = cf.merge(exact)
    out = {"exact": _accuracy(merged, x_test, y_test)}
    for eps, total in sums.items():
        floor = decoded_noise_std(spec=spec, plan=plans[eps], devices=devices)
        name = f"eps{eps:g}"
        out[name] = _accuracy(_unflat(total.decoded(), k, devices), x_test, y_test,
                              noise_std=floor)  # fmt: skip
        # The exact statistics under the floor this noise calls for: what the floor's
        # regularisation costs alone, before any noise (the gap's share that no better
        # estimate of the noised sum can win back while it keeps that floor).
        out[f"exact_floor_{name}"] = _accuracy(merged, x_test, y_test, noise_std=floor)
        sigma = plans[eps].sum_std(devices)
        central = flatten(merged, gram=True) + noise.normal(
            0.0, sigma, statistics_length(k, classes=CLASSES)
        )
        out[f"central_{name}"] = _accuracy(_unflat(central, k, devices), x_test, y_test,
                                           noise_std=sigma)  # fmt: skip
        out[f"{name}_sigma"] = sigma
    return out


def fleet(devices: int, ks: tuple[int, ...], basis: str) -> dict[str, float]:
    """Every figure of a fleet of ``devices`` in the public ``basis``: the rule's, and
    each of ``ks``; and the rule's in the random projection beside them."""
    data = pooled_features(ZOO, clients=devices, train=TRAIN, test=TEST)
    rows = data.features[np.concatenate(data.test_index)]
    y_test = np.concatenate(data.test_labels)
    features = rows.shape[1]
    rules = {eps: rule_k(devices, eps, features) for eps in (0.0, *EPSILONS)}
    out: dict[str, float] = {f"privacy.secagg_{devices}_rule_k_eps{e:g}": float(k)
                             for e, k in rules.items() if e}  # fmt: skip
    scores: dict[int, dict[str, float]] = {}
    public = load_basis(basis)
    for k in sorted({*ks, *rules.values()}):
        x_test = prepare(rows, projection(FLEET, features, k, basis=public))
        scores[k] = _scores(data, k, EPSILONS, devices, x_test, y_test, basis)
        for name, value in scores[k].items():
            tail = "" if name.endswith("sigma") else "_acc"
            out[f"privacy.secaggplus_{devices}_k{k}_{name}{tail}"] = value
        print(f"  secagg fleet: {devices} devices, k {k} done", file=sys.stderr, flush=True)
    suffix = "_public_rule" if devices == 1000 else ""
    out[f"privacy.secagg_{devices}_exact_acc{suffix}"] = scores[rules[0.0]]["exact"]
    for eps in EPSILONS:
        name = f"eps{eps:g}"
        out[f"privacy.secagg_{devices}_{name}_acc{suffix}"] = scores[rules[eps]][name]
        out[f"privacy.central_{devices}_{name}_acc{suffix}"] = scores[rules[eps]][f"central_{name}"]
        out[f"privacy.secagg_{devices}_exact_floor_{name}_acc{suffix}"] = scores[rules[eps]][
            f"exact_floor_{name}"
        ]
    # The same fleet in the random projection at its rule's k: what the basis is worth.
    k = rule_k(devices, 1.0, features, basis=False)
    x_test = prepare(rows, projection(FLEET, features, k))
    random = _scores(data, k, (1.0,), devices, x_test, y_test, "")
    for name in ("exact", "eps1", "central_eps1"):
        out[f"privacy.secagg_{devices}_random_{name}_acc"] = random[name]
    print(f"  secagg fleet: {devices} devices, random projection done", file=sys.stderr,
          flush=True)  # fmt: skip
    if ks:
        for name in ("exact", *(f"eps{e:g}" for e in EPSILONS)):
            out[f"privacy.secagg_{devices}_best_k_{name}_acc"] = max(scores[k][name] for k in ks)
    return out


def run() -> dict[str, float]:
    basis = str(ensure_basis())
    out = fleet(1000, (), basis)
    out |= fleet(10_000, BEST_KS, basis)
    gap = out["privacy.secagg_10000_exact_acc"] - out["privacy.secagg_10000_eps1_acc"]
    out["privacy.secagg_10000_eps1_gap"] = 100.0 * gap
    return out


if __name__ == "__main__":
    for key, value in run().items():
        print(f"{key} = {value:.4g}")
