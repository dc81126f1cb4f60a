"""Closed-form linear heads from class statistics that a fleet adds up exactly.

On clipped frozen features (rows of norm <= 1) a device holds, per class ``c``, the count
``N_c`` and the feature sum ``s_c``, and over all its rows the Gram matrix ``G = sum x x^T``.
Every one of these is a plain sum, so the coordinator's sum over devices is exactly what one
device holding all the rows would have computed: the heads solved from it (LDA, Fed3R
ridge) are then the pooled heads, up to float64 rounding, whatever the split of the data.
FedCOF sends less (class means and counts only) and estimates the class covariances from
the spread of the devices' means, which is only as good as the number of devices holding
each class.

The coordinator (sum, then solve) and the device (its own head, a personalised one) both
import this package, so it is numpy only and pure: no state, no seeds, no I/O. Its modules,
in the order a release travels:

- ``projection``: the fleet's public projection of the features, specified to the bit,
  and the basis check a release carries (imported from there, not re-exported here);
- ``triangles``: the released (upper-triangle) form of a Gram matrix;
- ``statistics``: clipping, one device's :class:`Statistics`, and
  :class:`StatisticsSum`, the running sum every sum of statistics is taken with;
- ``encoding``: summed statistics as one map of raw arrays, wherever they are stored or
  sent between the coordinator's processes;
- ``privacy``: the Gaussian mechanism on a release and the clean-up after the sum;
- ``heads``: :class:`LinearHead` and the fleet's heads solved from the sum (LDA, ridge,
  FedCOF);
- ``personal``: a device's own ridge pulled toward the fleet's head;
- ``robust``: one device's weight in a sum capped at a multiple of the median holder's;
- ``arrays``: the checked read-only arrays and the two linear-algebra steps they share.

Notation: ``k`` the feature dimension, ``C`` the number of classes.
"""

from closed_form.encoding import MAX_DEVICES, statistics_fields, statistics_from
from closed_form.heads import (
    LinearHead,
    fedcof_covariances,
    fedcof_gram,
    fedcof_head,
    lda_head,
    oas_shrinkage,
    ridge_head,
)
from closed_form.personal import personalised_head
from closed_form.privacy import (
    SENSITIVITY,
    denoise,
    noised,
    release_delta,
    sensitivity_bound,
)
from closed_form.robust import capped, count_caps
from closed_form.statistics import (
    Statistics,
    StatisticsSum,
    clip_rows,
    device_statistics,
    means_statistics,
    merge,
)
from closed_form.triangles import (
    dim_of_triangle,
    from_upper_triangle,
    triangle_size,
    upper_triangle,
)

__all__ = [
    "MAX_DEVICES",
    "SENSITIVITY",
    "LinearHead",
    "Statistics",
    "StatisticsSum",
    "clip_rows",
    "denoise",
    "device_statistics",
    "dim_of_triangle",
    "fedcof_covariances",
    "fedcof_gram",
    "fedcof_head",
    "from_upper_triangle",
    "lda_head",
    "means_statistics",
    "merge",
    "noised",
    "oas_shrinkage",
    "personalised_head",
    "release_delta",
    "ridge_head",
    "capped",
    "count_caps",
    "sensitivity_bound",
    "statistics_fields",
    "statistics_from",
    "triangle_size",
    "upper_triangle",
]
