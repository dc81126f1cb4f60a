"""A public whitening basis for the closed-form statistics, made from public feature rows.

The random projection (closed_form/projection.py) keeps the backbone features' geometry,
and with it their spectrum: on digits-5 through the zoo (10,000 devices x 20, k 512) the
within-class scatter's median eigenvalue is about 1.5e-5 of its trace, while a private
release's noise is the same size in every direction. The exact head draws on those narrow
directions, and the noise swamps them (docs/privacy.md, "The public basis").

A basis that whitens the features' public covariance spreads each row's unit norm over
the directions evenly, so the narrow directions carry signal the noise no longer swamps:
column ``j`` is the public covariance's ``j``-th eigenvector (largest eigenvalue first)
divided by the square root of its eigenvalue, eigenvalues raised to at least
:data:`RELATIVE_FLOOR` of the largest first (a backbone's dead units give exact zeros).
The first ``k`` columns are the projection to ``k`` dimensions: the public principal
directions, whitened. Scaled so the first column has norm 1 (rows are made unit-norm
after the projection anyway: only the columns' ratios matter).

**Public.** The rows must be public: the export tool renders its own source tasks' images
(export/zoo.py) and passes them through the bundle (export/basis.py). No private row ever
enters, so the basis costs no privacy budget, and every device and the coordinator load
the same stored matrix (an eigendecomposition is not reproducible to the bit across
builds, so it is made once and shipped, never recomputed).
"""

from __future__ import annotations

import functools
import hashlib
from pathlib import Path

import numpy as np
import numpy.typing as npt

from closed_form.arrays import F64

#: Eigenvalues are raised to at least this fraction of the largest before whitening.
#: On digits-5 through the zoo (10,000 devices x 20, epsilon 1, k 512) 1e-6 and 1e-5 score
#: alike and 1e-4 a point lower: the floor only keeps dead directions finite.
RELATIVE_FLOOR = 1e-6

#: The file name the export tool gives a bundle's basis.
BASIS_FILE = "basis.npy"


def public_basis(rows: npt.ArrayLike, *, floor: float = RELATIVE_FLOOR) -> F64:
    """The (D, D) whitening basis of public feature ``rows`` (N, D): each row made unit
    norm, their covariance's eigenvectors by decreasing eigenvalue, each divided by the
    square root of its eigenvalue (floored at ``floor`` times the largest), the first
    column of norm 1, and each column's largest entry positive (so the eigensolver's sign
    convention does not matter; ties and equal eigenvalues still leave a choice, which is
    why the matrix is made once and shipped)."""
    x = np.asarray(rows, dtype=np.float64)
    if x.ndim != 2 or x.shape[0] < 2 or x.shape[1] < 1:
        raise ValueError(f"need at least two public rows of features, got shape {x.shape}")
    if not np.isfinite(x).all():
        raise ValueError("the public rows have non-finite entries")
    if not 0 < floor < 1:
        raise ValueError(f"floor must lie in (0, 1), got {floor}")
    norms = np.linalg.norm(x, axis=1, keepdims=True)
    x = x / np.maximum(norms, np.finfo(np.float64).tiny)
    cov = np.atleast_2d(np.cov(x, rowvar=False))
    lam, vec = np.linalg.eigh(cov)
    lam, vec = lam[::-1], vec[:, ::-1]
    if not lam[0] > 0:
        raise ValueError("the public rows do not vary: there is nothing to whiten")
    lam = np.maximum(lam, floor * lam[0])
    out: F64 = vec * np.sqrt(lam[0] / lam)
    signs = np.sign(out[np.abs(out).argmax(axis=0), np.arange(out.shape[1])])
    out *= np.where(signs == 0, 1.0, signs)
    return out


def check_basis(basis: npt.ArrayLike) -> F64:
    """``basis`` as a read-only (D, D) float64 matrix, refused (ValueError) when it is not
    square, or has a non-finite entry or a zero column (its size against a bundle's:
    :func:`setting_basis`)."""
    b = np.array(basis, dtype=np.float64)
    if b.ndim != 2 or b.shape[0] != b.shape[1] or b.shape[0] < 1:
        raise ValueError(f"a basis must be a square (D, D) matrix, got shape {b.shape}")
    if not np.isfinite(b).all():
        raise ValueError("the basis has non-finite entries")
    if not (np.abs(b).max(axis=0) > 0).all():
        raise ValueError("the basis has a zero column")
    b.setflags(write=False)
    return b


def basis_id(basis: F64) -> str:
    """A short name of ``basis``'s exact content (SHA-256 of its little-endian float64
    bytes, row-major, first 16 hex digits): what a device's release and the coordinator's
    state are keyed by, so a basis written again (``edge-export basis`` is not the same to
    the bit twice) is a new release and a new run, never mixed with the old."""
    data = np.ascontiguousarray(basis, dtype="<f8").tobytes()
    return hashlib.sha256(data).hexdigest()[:16]


def load_basis(path: str) -> F64:
    """The basis stored at ``path`` (a ``.npy`` file), checked once and cached by the
    file's identity (path, size and modification time): every device of a simulated fleet,
    and every update the coordinator admits, reads the same read-only matrix, and a file
    written again is read again."""
    return _loaded(path)[0]


def load_basis_id(path: str) -> str:
    """:func:`basis_id` of the basis at ``path``, computed once per file as it is."""
    return _loaded(path)[1]


def _loaded(path: str) -> tuple[F64, str]:
    try:
        stat = Path(path).stat()
    except FileNotFoundError:
        raise ValueError(f"no file at {path}") from None
    except OSError as exc:
        raise ValueError(f"{path} cannot be read ({exc})") from None
    return _load(path, stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=4)
def _load(path: str, size: int, mtime_ns: int) -> tuple[F64, str]:
    del size, mtime_ns  # the cache's key: the file as it is now
    try:
        raw = np.load(Path(path), allow_pickle=False)
    except FileNotFoundError:
        raise ValueError(f"no file at {path}") from None
    except (OSError, ValueError) as exc:
        raise ValueError(f"{path} is not a .npy matrix ({exc})") from None
    basis = check_basis(raw)
    return basis, basis_id(basis)


def setting_basis(path: str, *, feature_dim: int = 0) -> F64 | None:
    """The basis a ``[closed_form] basis`` setting names (None for ""), for a bundle of
    ``feature_dim`` features (0: any); ValueError naming the setting for a file that is
    missing, no basis, or of another size. The device's and the coordinator's settings
    both read it here."""
    if not path:
        return None
    try:
        basis = load_basis(path)
        if feature_dim and basis.shape[0] != feature_dim:
            raise ValueError(f"a basis for {basis.shape[0]} features; the bundle has {feature_dim}")
    except ValueError as exc:
        raise ValueError(f"closed_form.basis = {path!r}: {exc}") from None
    return basis
