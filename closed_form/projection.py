"""The fleet's public projection of backbone features, specified to the bit, and the basis
check a statistics release carries so that statistics made in another basis are refused.

Every device of a closed-form fleet sums its features in the same ``k``-dimensional basis,
and nothing but that agreement makes the coordinator's sum meaningful: statistics in
another basis add up without error and give a head near chance. So the projection is a
function of public facts alone (the fleet id, the bundle's feature size ``D`` and ``k``)
made only of operations IEEE 754 rounds exactly (integer arithmetic, ``+ - * /`` and
``sqrt`` on float64, summed in a stated order), so that any language reproduces it bit
for bit (docs/protocol.md, "The closed-form projection"; docs/vectors/closed_form.json):

1. seed: the first 8 bytes of SHA-256 of ``"protofleet-projection:" + fleet`` (UTF-8),
   big-endian;
2. generator: SplitMix64 from that seed; value i is ``2 * (word_i >> 11) * 2^-53 - 1``,
   uniform in [-1, 1) and exact in float64; the (D, k) matrix takes them column by
   column (column c holds values ``c*D .. c*D + D - 1``), so the first columns of a
   wider projection are those of a narrower one;
3. orthonormalisation: modified Gram-Schmidt, columns in order, every dot product summed
   from index 0 up, each product rounded before it is added (no fused multiply-add).

Why not Gaussian draws and a library QR (what devices used before): neither numpy's
normal generator nor LAPACK's QR can be written down for another implementation to
reproduce, and their results differ in the last bits between builds. Uniform entries
orthonormalised serve a random projection as well (any i.i.d. symmetric entries do).

A fleet that names a public basis (closed_form/basis.py) projects by its first ``k``
columns instead: a stored file every party loads, not a function of the fleet id.

The basis check (``extras["basis"]`` of a closed-form update) is ``[D, s_0, ..., s_k-1]``
with ``s_c`` the sum of column c of the projection (summed in order), or ``[k, 1, ..., 1]``
when the fleet projects nothing (``k == D``). Every entry of the projection moves a column
sum, so a release made in any other basis misses it by far more than rounding
(:data:`BASIS_TOLERANCE`).
"""

from __future__ import annotations

import functools
import hashlib

import numpy as np
import numpy.typing as npt

from closed_form.arrays import F64

#: The name of this way of making the projection: a device keeps it beside what it knows
#: the coordinator stores, so that statistics in an earlier basis are sent again.
PROJECTION = "splitmix64-mgs/unit-rows"

#: SplitMix64's constants (Steele, Lea and Flood, 2014; the generator of Java's
#: ``SplittableRandom``).
GAMMA = 0x9E3779B97F4A7C15
MIX1 = 0xBF58476D1CE4E5B9
MIX2 = 0x94D049BB133111EB
_U64 = np.uint64

#: The largest ``D * k`` the coordinator builds a projection for when it checks a basis:
#: 16 M entries, 128 MB of float64 (D 1,536 at k 1,024 is 1.5 M).
MAX_ENTRIES = 1 << 24

#: How far a release's basis check may be from the coordinator's. Both are sums of the same
#: float64 values in the same order, so an implementation that follows the spec agrees
#: exactly; one that sums in another order is within about ``D * 1e-16``. Another basis is
#: off by about 1 (a column sum is a sum of ``D`` entries of size ``1/sqrt(D)``).
BASIS_TOLERANCE = 1e-9


def projection_seed(fleet: str) -> int:
    """The generator's seed: a hash of the fleet id, the same in every process."""
    digest = hashlib.sha256(f"protofleet-projection:{fleet}".encode()).digest()
    return int.from_bytes(digest[:8], "big")


def splitmix64(seed: int, count: int) -> npt.NDArray[np.uint64]:
    """The first ``count`` outputs of SplitMix64 started from ``seed`` (state ``seed``;
    each output adds :data:`GAMMA` to the state, then mixes it)."""
    if not 0 <= seed < 1 << 64:
        raise ValueError(f"seed must be an unsigned 64-bit integer, got {seed}")
    with np.errstate(over="ignore"):  # arithmetic modulo 2^64 is the point
        steps = np.arange(1, count + 1, dtype=_U64)
        z = _U64(seed) + steps * _U64(GAMMA)
        z = (z ^ (z >> _U64(30))) * _U64(MIX1)
        z = (z ^ (z >> _U64(27))) * _U64(MIX2)
        out: npt.NDArray[np.uint64] = z ^ (z >> _U64(31))
    return out


def uniform_values(seed: int, count: int) -> F64:
    """``count`` values uniform in [-1, 1): the top 53 bits of each SplitMix64 output as a
    fraction of 2^53, doubled, less one (every step exact in float64)."""
    words = splitmix64(seed, count) >> _U64(11)
    out: F64 = 2.0 * (words.astype(np.float64) * 2.0**-53) - 1.0
    return out


def ordered_sum(values: F64, axis: int = 0) -> F64:
    """Sums along ``axis`` added strictly from index 0 up (a running sum: no pairwise or
    vectorised reordering, which ``np.sum`` does)."""
    out: F64 = np.add.accumulate(values, axis=axis).take(-1, axis=axis)
    return out


def orthonormalise(g: F64) -> F64:
    """Modified Gram-Schmidt on the columns of ``g`` (D, k), in order: column j has the
    projection on each earlier unit column i removed in turn (``r = q_i . v``, then
    ``v = v - r q_i``), then is divided by its norm ``sqrt(v . v)``. Done here column by
    column across all later columns at once, which performs exactly the same operations."""
    v = np.array(g, dtype=np.float64, copy=True)
    cols = v.shape[1]
    for i in range(cols):
        norm = float(np.sqrt(ordered_sum(v[:, i] * v[:, i])))
        if not norm > 0.0:
            raise ValueError(f"column {i} of the projection is dependent on the earlier ones")
        q = v[:, i] / norm
        v[:, i] = q
        if i + 1 < cols:
            rest = v[:, i + 1 :]
            r = ordered_sum(q[:, None] * rest)  # (cols - i - 1,)
            rest -= q[:, None] * r[None, :]
    return v


def projection(fleet: str, feature_dim: int, k: int, *, basis: F64 | None = None) -> F64 | None:
    """The public (feature_dim, k) projection: the first ``k`` columns of the fleet's
    public ``basis`` when it has one (closed_form/basis.py: the public covariance,
    whitened), else :func:`random_projection`."""
    if basis is None:
        return random_projection(fleet, feature_dim, k)
    if basis.shape != (feature_dim, feature_dim):
        raise ValueError(f"a basis of shape {basis.shape} for {feature_dim} features")
    if not 0 < k <= feature_dim:
        raise ValueError(
            f"closed_form.dim = {k} must be at most the bundle's {feature_dim} features"
        )
    return basis[:, :k]


@functools.lru_cache(maxsize=4)
def random_projection(fleet: str, feature_dim: int, k: int) -> F64 | None:
    """The public (feature_dim, k) projection with orthonormal columns; None when ``k`` is
    the feature size (no projection). Orthonormal columns never lengthen a vector, so a
    clipped row stays within norm 1, and keep the features' geometry."""
    if k == feature_dim:
        return None
    if not 0 < k < feature_dim:
        raise ValueError(f"closed_form.dim = {k} must be below the bundle's {feature_dim} features")
    values = uniform_values(projection_seed(fleet), feature_dim * k)
    q = orthonormalise(values.reshape(k, feature_dim).T)  # column c: values c*D .. c*D+D-1
    q.setflags(write=False)  # cached: one (D, k) matrix serves every device of a process
    return q


def prepare(features: npt.ArrayLike, q: F64 | None) -> F64:
    """Backbone features (N, D) -> rows of norm 1 in the statistics' space (N, k): each row
    divided by its Euclidean norm, multiplied by ``q``, and divided by its norm again (by
    2^-1022 when a norm is smaller, so a zero row stays zero).

    Why again after the projection: ``k`` orthonormal columns keep about ``sqrt(k / D)``
    of a unit row (0.27 at k 64 of the zoo's 896 features), while the release's
    sensitivity, and so a private release's noise, is priced for rows of norm 1. Rows left
    short put a fraction of the signal (its square, in the second moment) against the full
    noise: a secure sum at epsilon 1000 scored 2 points under the exact sum at 1,000 devices
    x 20, k 64, 15 at 100 x 50 (issue 56); at unit length it scores as the exact sum. The
    exact statistics' head hardly moves: a ratio of the features' own geometry, the same
    for every row of one class direction, is all that changes."""
    x = _unit_rows(np.asarray(features, dtype=np.float64))
    if q is None:
        return x
    return _unit_rows(x @ q)


def _unit_rows(x: F64) -> F64:
    norms = np.linalg.norm(x, axis=1, keepdims=True)
    out: F64 = x / np.maximum(norms, np.finfo(np.float64).tiny)
    return out


def basis_check(fleet: str, feature_dim: int, k: int, *, basis: F64 | None = None) -> F64:
    """What a release made in this fleet's basis carries as ``extras["basis"]``:
    ``[D, column sums of the projection]``, ``[k, 1, ..., 1]`` without a projection
    (``basis``: the fleet's public basis, if it has one)."""
    q = projection(fleet, feature_dim, k, basis=basis)
    sums = np.ones(k) if q is None else ordered_sum(q)
    return np.concatenate([[float(feature_dim)], sums])


def basis_problem(
    fleet: str, basis: npt.ArrayLike, k: int, *, public: F64 | None = None
) -> str | None:
    """Why ``basis`` (a release's ``extras["basis"]``) is not this fleet's basis for ``k``
    dimensions, or None when it is (``public``: the fleet's public basis, if it has one;
    its column sums run to thousands, so the tolerance is relative to their size)."""
    got = np.asarray(basis, dtype=np.float64)
    if got.shape != (k + 1,):
        return f"a basis check of shape {got.shape}, expected ({k + 1},)"
    d = got[0]
    if d != int(d) or not k <= d or d * k > MAX_ENTRIES:
        return f"a feature size of {d:g} for {k} dimensions"
    if public is not None and public.shape[0] != d:
        return f"a feature size of {d:g}; the fleet's public basis has {public.shape[0]}"
    want = basis_check(fleet, int(d), k, basis=public)
    off = float(np.abs(got - want).max())
    # A public basis's column sums run to thousands: its tolerance is relative to them.
    size = 1.0 if public is None else max(1.0, float(np.abs(want[1:]).max()))
    if off > BASIS_TOLERANCE * size:
        return f"column sums {off:.3g} away from fleet {fleet}'s projection of {int(d)} features"
    return None
