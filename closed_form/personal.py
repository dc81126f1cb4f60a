"""A device's personalised head: a closed-form ridge on its own rows, pulled toward the
fleet's head."""

from __future__ import annotations

import math

import numpy as np
import numpy.typing as npt

from closed_form.arrays import F64, checked_labels, checked_rows, solve
from closed_form.heads import LinearHead


def personalised_head(
    x: npt.ArrayLike, labels: npt.ArrayLike, global_head: LinearHead, *, lam: float = 1.0
) -> LinearHead:
    """A device's closed-form ridge on its own rows, pulled toward the global head.

    Targets are one-hot. The global head's scores live on their own scale (LDA's are
    log-odds, ridge's are near [0, 1]), so it is first brought to the target scale by the
    scalars ``a, b`` minimising ``||a L + b - Y||^2`` over the device's rows (``L`` the
    global scores, absent classes at 0; ``a = 1, b = 0`` with fewer than 2 rows or constant
    ``L``), after the head is centred over its present classes (:func:`centred`: the same
    predictions; an LDA's scores share an offset hundreds of times their spread between
    classes, which a single ``a, b`` fitted over every entry cannot undo, so the pull went
    toward a head that scored 0.12-0.20 where the fleet's scored 0.92-1.0). Then with ``X~ = [x, 1]`` and ``Theta_0 = [a weight^T; a bias + b]``:
    ``Theta = (X~^T X~ + lam I)^-1 (X~^T Y + lam Theta_0)``. ``lam -> inf`` gives the
    rescaled global head (same predictions when ``a > 0``), ``lam -> 0`` the device's own
    least squares.
    """
    if not (math.isfinite(lam) and lam > 0):
        raise ValueError(f"lam must be a positive finite number, got {lam!r}")
    rows = checked_rows(x)
    if rows.shape[1] != global_head.dim:
        raise ValueError(f"x has {rows.shape[1]} features, the head expects {global_head.dim}")
    c, k = global_head.num_classes, global_head.dim
    lab = checked_labels(labels, rows.shape[0], c)
    targets = np.zeros((rows.shape[0], c))
    targets[np.arange(rows.shape[0]), lab] = 1.0
    weight, bias = centred(global_head)
    logits = rows @ weight.T + bias
    logits[:, ~global_head.present] = 0.0
    a, b = _affine_fit(logits, targets)
    theta0 = np.vstack([a * weight.T, a * bias + b])  # (k+1, C)
    design = np.hstack([rows, np.ones((rows.shape[0], 1))])  # (N, k+1)
    theta = solve(
        design.T @ design + lam * np.eye(k + 1),
        design.T @ targets + lam * theta0,
        "the personalised system",
    )
    return LinearHead(weight=theta[:k].T, bias=theta[k], present=global_head.present)


def centred(head: LinearHead) -> tuple[F64, F64]:
    """``head``'s weight and bias less their mean over its present classes (absent
    classes' rows left as they are): each row's scores shifted by the same amount, so its
    predictions are unchanged, and its scores centred on 0 across the classes."""
    present = head.present
    weight, bias = np.array(head.weight), np.array(head.bias)
    weight[present] -= weight[present].mean(axis=0)
    bias[present] -= bias[present].mean()
    return weight, bias


def _affine_fit(logits: F64, targets: F64) -> tuple[float, float]:
    """Scalars ``a, b`` minimising ``||a * logits + b - targets||^2`` over every entry."""
    if logits.shape[0] < 2:
        return 1.0, 0.0
    centred = logits - logits.mean()
    var = float(np.sum(centred**2))
    if var <= 1e-12 * max(1.0, float(np.sum(logits**2))):
        return 1.0, 0.0
    a = float(np.sum(centred * (targets - targets.mean()))) / var
    return a, float(targets.mean()) - a * float(logits.mean())
