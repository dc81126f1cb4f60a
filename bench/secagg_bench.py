"""Secure aggregation with distributed noise against each device noising its own
statistics (issue 43): a one-shot LDA on digits-5 feature shift, 1,000 devices of 20
training samples, accuracy on the pooled test set (every device's 20 test samples).

Every variant sends the same statistics, built by the agent's own ``ClosedFormDevice``
(unit-norm features, the first k columns of the zoo's public basis, closed_form/basis.py,
rows made unit length again; the protocol check below keeps the random projection), and the
fleet's head is solved as the coordinator solves it (``cf.denoise``, then ``cf.lda_head``
with OAS shrinkage, a secure sum's with the scatter floored at its public noise level,
the plan's and the rounding's (``secagg.plan.decoded_noise_std``), as the coordinator's
secure tally (``coordinator/rounds/secure.py``) passes it; the coordinator's rescaling of a huge head changes no prediction). A sum of the
devices' own releases is solved as the coordinator solves plain updates, without that floor.
Under the fair protocol each variant runs at every projection k of :data:`KS` (the
closed-form benchmark's private grid, ``closed_form_bench.DP_KS``, and the small k where
noise on each device's second moments hurts least) and reports its best, the same rule
for all:

- ``exact``: the plain sum, no noise;
- ``local``: each device's ``dp-features`` release (``ClosedFormDevice.noisy_release``
  with ``plan_features``'s multiplier at the same epsilon), summed by the coordinator's
  ``statistics_of``;
- ``secagg``: each device quantises its statistics (``secagg.quantise``: clip to
  the declared dataset bound, scale ``SCALE``, stochastic rounding) and adds its share
  ``N_Z(0, sigma^2 / t)``, with ``sigma^2`` from ``secagg.plan``
  (``THRESHOLD`` of the 1,000 devices must survive, ``COLLUDING`` may collude); the ring
  sum is decoded (``decode``) and solved;
- ``noise off``: the same without noise: equal to ``exact`` within ``sum_error_bound``;
- ``eps1000``: the secure sum at epsilon 1000 (noise of standard deviation about 0.05 a
  coordinate). Not free: the within-class scatter's narrowest directions are narrower
  than that noise at large k (docs/privacy.md, "The solve"), so it is set beside
- ``central``: the exact sum plus a continuous Gaussian of the secure plan's own standard
  deviation (``sum_std``) at each epsilon, what a trusted curator's sum of the same
  noise gives. Secure and central within a point of each other at every epsilon is the
  guard that the secure path (quantiser, ring, shares, decoding, solve) costs nothing
  beyond its noise; issue 56's 15-point loss at 100 devices was rows that used a
  fraction of the clip budget (closed_form/projection.py::prepare);
- ``eps1e7``: the secure sum at epsilon 10^7 (0.0005 a coordinate, the rounding's own
  size): noise that truly costs nothing, the guard beside ``exact``. (At 10^6, 0.0014,
  two draws scored 0.02 and 0.5 points under ``exact`` at k 512.)

What runs the full protocol: the real ``SecAggDevice`` / ``SecAggServer`` round (keys,
Shamir shares, masks, unmasking, every message through its wire form) on ``PROTOCOL_DEVICES``
devices at k 64, with noise off (its decoded sum against the exact one and the bound) and
on (the exact integer sampler of ``secagg.noise``). The 1,000-device sums are
formed directly from the same quantiser and ring arithmetic, without masks (they cancel
exactly in the ring, which that run and tests/test_secagg_protocol.py check), and with
the noise drawn by :func:`discrete_gaussian`, a vectorised numpy sampler of the same
``N_Z(0, sigma^2 / t)`` (CKS Algorithm 3 in floating point): the exact sampler draws
about 150,000 values a second here (``privacy.secagg_exact_sampler_per_s``), and one
k-512 sum needs 136 million (15 minutes), each variant another. The vectorised one is for simulation only: its floating-point
acceptance test is not the hardened sampler a device runs.

Noise is secret, as on a device (numpy generators seeded from ``secrets``, the rounding
coins from the OS), and each private figure is one draw: on the pooled 20,000 test
samples a draw moves it little, and three draws of each (as closed_form_bench takes)
would triple the k-512 pass past the ten minutes this section may take on 2 cores. ``THRESHOLD``
and ``COLLUDING`` are fixed beforehand, not tuned: a tenth of the fleet may drop, a tenth
of the threshold may collude.

Keys: ``privacy.{secagg,local}_1000_eps{1,8}_acc``, ``privacy.{secagg,central}_1000_eps{1,8,1000}_acc``,
``privacy.secagg_1000_eps1e7_acc``,
``privacy.secagg_1000_exact_acc``,
``privacy.secagg_1000_noise_off_acc``, ``privacy.secagg_1000_noise_off_max_error`` and
``_bound``, ``privacy.secagg_1000_k<k>_<variant>_acc`` per k, the plans' ``sigma`` (float
units of the sum) and the protocol run's ``privacy.secagg_protocol_*``.
"""

from __future__ import annotations

import secrets
import sys
import time
from collections.abc import Iterator
from random import Random

import numpy as np

import closed_form as cf
from bench.closed_form_bench import DELTA, DP_KS
from bench.export_bench import ZOO, ensure_basis
from bench.one_backbone import pooled_features
from closed_form.basis import load_basis
from coordinator.strategies.closed_form import statistics_of
from edge_agent.closed_form import ClosedFormDevice, prepare, projection
from edge_agent.config import ClosedFormSettings
from edge_agent.methods import device_method
from edge_agent.privacy.accounting import plan_features
from fleet.engine.batch import FleetFeatures
from fleet.engine.secure_sum import discrete_gaussian
from fleet.transports.spec import FLEET
from secagg.device import SecAggDevice
from secagg.masks import Bits, ring_add
from secagg.noise import device_noise
from secagg.plan import (
    DistributedPlan,
    SecureSum,
    check_ring,
    decoded_noise_std,
    plan_distributed,
    statistics_clip,
)
from secagg.quantise import QuantiseSpec, decode, round_scaled, sum_error_bound, to_ring
from secagg.server import SecAggServer
from secagg.settings import SecAggSettings

#: Projections tried for every variant: the small k give each device's own noise its best
#: chance (its second moment has k(k+1)/2 entries to noise), the large the exact sum.
KS = (8, 16, 32, *DP_KS)
DEVICES, TRAIN, TEST = 1000, 20, 20
CLASSES = 10
EPSILONS = (1.0, 8.0)
#: The secure sum alone at a large budget, beside the central Gaussian of its noise.
LARGE_EPSILON = 1000.0
#: The secure sum alone at a budget whose noise is the quantiser's order: the guard.
GUARD_EPSILON = 1e7
SECURE_EPSILONS = (*EPSILONS, LARGE_EPSILON, GUARD_EPSILON)


def eps_name(eps: float) -> str:
    """``eps1``, ``eps1000``, ``eps1e7``: a key's name for a budget."""
    return "eps" + f"{eps:g}".replace("e+0", "e").replace("e+", "e")


#: A power of two (exact scaling): gamma * sqrt(3) is 57,000 units, so the rounding's
#: sqrt(support) adds under 0.7% to the sensitivity even at k 512.
SCALE = 2.0**15
BITS: Bits = 32
THRESHOLD = 900  # a tenth of the fleet may drop
COLLUDING = 90  # a tenth of the threshold may collude with the coordinator
PROTOCOL_DEVICES = 10
PROTOCOL_K = 64
METHOD = device_method("lda")


def _secret_generator() -> np.random.Generator:
    return np.random.default_rng(secrets.randbits(128))


def _devices(data: FleetFeatures, k: int, *, basis: str = "") -> Iterator[ClosedFormDevice]:
    """Each client as the agent builds it, one at a time (a fleet's memory is one
    device's features and the running sum); ``basis``: the fleet's public basis file
    ("" for the random projection)."""
    settings = ClosedFormSettings(dim=k, basis=basis)
    for i in range(data.clients):
        yield ClosedFormDevice(
            method=METHOD, fleet=FLEET, features=data.features[data.train_index[i]],
            labels=data.train_labels[i], num_classes=CLASSES,
            settings=settings, seed=i, state_dir=None,
        )  # fmt: skip


def _flat(stats: cf.Statistics) -> np.ndarray:
    """A device's statistics as secure aggregation sums them: ``[triu(G), sums, counts]``."""
    assert stats.gram is not None
    return np.concatenate([cf.upper_triangle(stats.gram), stats.sums.ravel(), stats.counts])


def _unflat(total: np.ndarray, k: int, devices: int) -> cf.Statistics:
    tri = cf.triangle_size(k)
    return cf.Statistics(
        counts=total[tri + CLASSES * k :], sums=total[tri : tri + CLASSES * k].reshape(CLASSES, k),
        gram=cf.from_upper_triangle(total[:tri]), holders=np.zeros(CLASSES, dtype=np.int64),
        scatter=None, devices=devices,
    )  # fmt: skip


def _accuracy(
    stats: cf.Statistics, x_test: np.ndarray, y_test: np.ndarray, *, noise_std: float = 0.0
) -> float:
    head = cf.lda_head(cf.denoise(stats), noise_std=noise_std)
    return float((head.predict(x_test) == y_test).mean())


def _spec() -> QuantiseSpec:
    return QuantiseSpec(clip=statistics_clip(TRAIN), scale=SCALE, bits=BITS)


def _plan(
    k: int, epsilon: float, *, threshold: int = THRESHOLD, colluding: int = COLLUDING
) -> DistributedPlan:
    release = SecureSum.of_statistics(
        k=k, classes=CLASSES, scale=SCALE, threshold=threshold, colluding=colluding
    )
    return plan_distributed(release=release, epsilon_target=epsilon, delta=DELTA)


class _Sums:
    """Every variant's running sum over one pass of the fleet: each device is built and
    its statistics computed once, then released every way (the devices are the costly
    part at k 512, not the sums)."""

    def __init__(self, k: int) -> None:
        self.k = k
        self.spec = _spec()
        self.exact: list[cf.Statistics] = []
        self.local: dict[float, list[cf.Statistics]] = {eps: [] for eps in EPSILONS}
        self.ring: dict[float | None, np.ndarray | None] = dict.fromkeys((None, *SECURE_EPSILONS))
        self.plans = {eps: _plan(k, eps) for eps in SECURE_EPSILONS}
        self.multipliers = {
            eps: plan_features(epsilon_target=eps, delta=DELTA).release_noise_multiplier
            for eps in EPSILONS
        }
        self.noise = _secret_generator()

    def add(self, i: int, device: ClosedFormDevice) -> None:
        stats = device.statistics()
        _push(self.exact, stats)
        flat = _flat(stats)
        variants: list[tuple[float | None, DistributedPlan | None]] = [(None, None)]
        for eps, plan in [*variants, *self.plans.items()]:
            # Quantised and (with a plan) noised as a device does, into the ring.
            q = round_scaled(flat, spec=self.spec)
            if plan is not None:
                q = q + discrete_gaussian(q.size, plan.share_sigma2, self.noise)
            ring = to_ring(q, bits=BITS)
            before = self.ring[eps]
            self.ring[eps] = ring if before is None else ring_add(before, ring)
        for eps, z in self.multipliers.items():
            # The agent's own dp-features release, as the coordinator reads its update.
            release = device.noisy_release(z, self.noise)
            update = release.update(fleet=FLEET, round_=0, client=f"client-{i:05d}",
                                    bundle="zoo", method="lda")  # fmt: skip
            _push(self.local[eps], statistics_of(update, num_classes=CLASSES, dim=self.k))

    def secure(self, eps: float | None) -> np.ndarray:
        """The decoded ring sum: what the coordinator unmasks."""
        total = self.ring[eps]
        assert total is not None
        return decode(total, spec=self.spec)


def _push(parts: list[cf.Statistics], stats: cf.Statistics) -> None:
    parts.append(stats)
    if len(parts) == 50:
        parts[:] = [cf.merge(parts)]


def _sums(data: FleetFeatures, k: int, basis: str) -> _Sums:
    sums = _Sums(k)
    for plan in sums.plans.values():
        check_ring(plan, spec=sums.spec, devices=data.clients)
    for i, device in enumerate(_devices(data, k, basis=basis)):
        sums.add(i, device)
    return sums


def _protocol_round(settings: SecAggSettings, vectors: list[np.ndarray]) -> np.ndarray:
    """One full round of the real state machines in memory, every message through its
    wire form, nobody dropping: the decoded total."""
    names = [f"dev-{i:03d}" for i in range(len(vectors))]
    server = SecAggServer(fleet=FLEET, round=0, settings=settings)
    devices = [SecAggDevice(client=n, fleet=FLEET, round=0, settings=settings) for n in names]

    def wire(message: object) -> object:
        return type(message).from_wire(message.to_wire())  # type: ignore[attr-defined]

    for d in devices:
        server.take_advertise(wire(d.advertise()))  # type: ignore[arg-type]
    rosters = server.close_advertise()
    for d in devices:
        server.take_share(wire(d.share(wire(rosters[d.client]))))  # type: ignore[arg-type]
    relayed = server.close_share()
    for d, v in zip(devices, vectors, strict=True):
        server.take_masked_input(wire(d.masked_input(wire(relayed[d.client]), v)))  # type: ignore[arg-type]
    survivors = server.close_masked_input()
    for d in devices:
        server.take_consistency(wire(d.consistency(wire(survivors[d.client]))))  # type: ignore[arg-type]
    signatures = server.close_consistency()
    for d in devices:
        server.take_unmask(wire(d.unmask(wire(signatures[d.client]))))  # type: ignore[arg-type]
    return server.close_unmask().total


def protocol_check(data: FleetFeatures) -> dict[str, float]:
    """The real protocol on the first ``PROTOCOL_DEVICES`` devices at k ``PROTOCOL_K``."""
    n, t = PROTOCOL_DEVICES, PROTOCOL_DEVICES - 1
    vectors, exact = [], None
    for i, device in enumerate(_devices(data, PROTOCOL_K)):
        if i == n:
            break
        flat = _flat(device.statistics())
        vectors.append(flat)
        exact = flat if exact is None else exact + flat
    assert exact is not None
    length = len(exact)
    off = SecAggSettings(threshold=t, neighbours=n - 1, spec=_spec(), length=length)
    start = time.perf_counter()
    total = _protocol_round(off, vectors)
    off_s = time.perf_counter() - start
    plan = _plan(PROTOCOL_K, 1.0, threshold=t, colluding=0)
    on = SecAggSettings(threshold=t, neighbours=n - 1, spec=_spec(), length=length,
                        sigma2=plan.sigma2)  # fmt: skip
    start = time.perf_counter()
    noisy = _protocol_round(on, vectors)
    on_s = time.perf_counter() - start
    draws = n * length
    start = time.perf_counter()
    device_noise(2000, sigma2=plan.share_sigma2 * 1.0, threshold=1, rng=Random(0))
    per_s = 2000 / (time.perf_counter() - start)
    return {
        "privacy.secagg_protocol_devices": float(n),
        "privacy.secagg_protocol_length": float(length),
        "privacy.secagg_protocol_noise_off_max_error": float(np.abs(total - exact).max()),
        "privacy.secagg_protocol_noise_off_bound": sum_error_bound(n, spec=_spec()),
        "privacy.secagg_protocol_round_s": off_s,
        "privacy.secagg_protocol_noisy_round_s": on_s,
        # The noisy round's spread against the plan's: near 1 when the shares add up.
        "privacy.secagg_protocol_noise_std_ratio": float(np.std(noisy - exact)) / plan.sum_std(n),
        "privacy.secagg_exact_sampler_per_s": per_s,
        "privacy.secagg_protocol_draws": float(draws),
    }


def run() -> dict[str, float]:
    basis = str(ensure_basis())
    data = pooled_features(ZOO, clients=DEVICES, train=TRAIN, test=TEST)
    out = protocol_check(data)
    print("  secagg: protocol check done", file=sys.stderr, flush=True)
    test_rows = data.features[np.concatenate(data.test_index)]
    y_test = np.concatenate(data.test_labels)
    spec = _spec()
    errors = []
    for k in KS:
        q = projection(FLEET, test_rows.shape[1], k, basis=load_basis(basis))
        x_test = prepare(test_rows, q)
        sums = _sums(data, k, basis)
        exact = cf.merge(sums.exact)
        out[f"privacy.secagg_1000_k{k}_exact_acc"] = _accuracy(exact, x_test, y_test)
        decoded = sums.secure(None)
        errors.append(float(np.abs(decoded - _flat(exact)).max()))
        off = _unflat(decoded, k, DEVICES)
        out[f"privacy.secagg_1000_k{k}_noise_off_acc"] = _accuracy(
            off, x_test, y_test, noise_std=decoded_noise_std(spec=spec, plan=None, devices=DEVICES)
        )
        central_noise = _secret_generator()
        for eps in SECURE_EPSILONS:
            secure = _unflat(sums.secure(eps), k, DEVICES)
            sigma = sums.plans[eps].sum_std(DEVICES)
            name = eps_name(eps)
            out[f"privacy.secagg_1000_k{k}_{name}_sigma"] = sigma
            floor = decoded_noise_std(spec=spec, plan=sums.plans[eps], devices=DEVICES)
            out[f"privacy.secagg_1000_k{k}_{name}_acc"] = _accuracy(
                secure, x_test, y_test, noise_std=floor
            )
            if eps != GUARD_EPSILON:  # the same noise on the exact sum, by a trusted curator
                central = _unflat(_flat(exact) + central_noise.normal(0.0, sigma, decoded.size),
                                  k, DEVICES)  # fmt: skip
                out[f"privacy.central_1000_k{k}_{name}_acc"] = _accuracy(
                    central, x_test, y_test, noise_std=sigma
                )
        for eps in EPSILONS:
            local = cf.merge(sums.local[eps])
            out[f"privacy.local_1000_k{k}_eps{eps:g}_acc"] = _accuracy(local, x_test, y_test)
        print(f"  secagg: k {k} done", file=sys.stderr, flush=True)
    names = [eps_name(e) for e in SECURE_EPSILONS]
    for variant in ("exact", "noise_off", *names):
        out[f"privacy.secagg_1000_{variant}_acc"] = max(
            out[f"privacy.secagg_1000_k{k}_{variant}_acc"] for k in KS
        )
    for name in names[:-1]:
        out[f"privacy.central_1000_{name}_acc"] = max(
            out[f"privacy.central_1000_k{k}_{name}_acc"] for k in KS
        )
    for name in ("eps1", "eps8"):
        out[f"privacy.local_1000_{name}_acc"] = max(
            out[f"privacy.local_1000_k{k}_{name}_acc"] for k in KS
        )
    out["privacy.secagg_1000_noise_off_max_error"] = max(errors)
    out["privacy.secagg_1000_noise_off_bound"] = sum_error_bound(DEVICES, spec=spec)
    return out
