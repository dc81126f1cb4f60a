"""The names and shapes of the model weights an averaged method's device sends as extras
(``protocol/methods.py``: FedAvg, FPL).

They follow from public settings alone (the bundle's feature size, the head's output size,
the class list, the head's norm layer), so the coordinator can fix them in its
configuration instead of taking them from whichever update arrives first. The agent's
``LocalModel`` state dict must match this table; tests/test_admission.py checks it.
"""

from __future__ import annotations

from typing import Literal

Norm = Literal["batch", "group"]


def averaged_weight_shapes(
    *, feature_dim: int, out_dim: int, num_classes: int, norm: Norm = "batch"
) -> dict[str, tuple[int, ...]]:
    """``{name: shape}`` of the floating-point head and classifier weights."""
    if min(feature_dim, out_dim, num_classes) < 1:
        raise ValueError("feature_dim, out_dim and num_classes must be positive")
    shapes: dict[str, tuple[int, ...]] = {
        "head.fc.weight": (out_dim, feature_dim),
        "head.fc.bias": (out_dim,),
        "head.norm.weight": (out_dim,),
        "head.norm.bias": (out_dim,),
        "classifier.weight": (num_classes, out_dim),
        "classifier.bias": (num_classes,),
    }
    if norm == "batch":
        # BatchNorm's running statistics are floating-point buffers and travel too.
        shapes["head.norm.running_mean"] = (out_dim,)
        shapes["head.norm.running_var"] = (out_dim,)
    elif norm != "group":
        raise ValueError(f"norm must be 'batch' or 'group', got {norm!r}")
    return shapes
