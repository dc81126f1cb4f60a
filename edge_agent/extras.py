"""The method-specific arrays an update carries beside its prototypes, and the averaged
weights an announcement brings back: FedAvg's and FPL's head and classifier, FedDBP's
Fisher scores."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from edge_agent import losses
from edge_agent.train import LocalModel
from protocol import PrivacyMeta, PrototypeUpdate
from protocol.auth import MAX_SIGNATURE_BYTES, Auth
from protocol.limits import MAX_GUARANTEE_LENGTH, MAX_ID_LENGTH
from protocol.methods import wire_method

#: Their weights travel as extras named after the model's parameters.
WEIGHT_PREFIXES = ("head.", "classifier.")


def update_extras(
    *,
    method: str,
    model: LocalModel,
    held: np.ndarray,
    z: np.ndarray,
    labels: np.ndarray,
    num_classes: int,
) -> dict[str, np.ndarray]:
    """What ``method``'s update carries beside the prototypes of the ``held`` classes."""
    kind = wire_method(method).extras
    if kind == "weights":
        return model_weights(model)
    if kind == "fisher":
        scores = losses.fisher_scores(
            model.logits, torch.from_numpy(z), torch.from_numpy(labels), num_classes
        )
        return {"fisher": scores.numpy()[held].astype(np.float32)}
    return {}


def model_weights(model: LocalModel) -> dict[str, np.ndarray]:
    """The floating-point head and classifier weights (protocol/weights.py names them)."""
    return {
        k: v.detach().numpy().astype(np.float32)
        for k, v in model.state_dict().items()
        if k.startswith(WEIGHT_PREFIXES) and v.dtype.is_floating_point
    }


def load_weights(model: LocalModel, extras: Any) -> bool:
    """Load the announced arrays that fit ``model``; whether there were any (FPL's
    announcement always has extras, its cluster prototypes, the weights not always)."""
    fitting = fitting_weights(model.state_dict(), extras)
    if fitting:
        model.load_state_dict(fitting, strict=False)
    return bool(fitting)


def fitting_weights(state: Mapping[str, torch.Tensor], extras: Any) -> dict[str, torch.Tensor]:
    """The announced arrays named and shaped as entries of ``state``, as float32 tensors."""
    return {
        k: torch.from_numpy(np.array(a, dtype=np.float32))
        for k, a in extras.items()
        if k in state and tuple(state[k].shape) == a.shape
    }


def largest_update_bytes(
    *, method: str, model: LocalModel, fleet: str, client: str, bundle: str, num_classes: int,
    dim: int,
) -> int:  # fmt: skip
    """The most bytes an update of this device can take on the wire: every class held,
    the method's extras at their full shapes, counts as 64-bit floats (as under noise), the
    longest privacy note and the longest signature. Shapes fix it; values cannot grow it."""
    kind = wire_method(method).extras
    extras: dict[str, np.ndarray] = {}
    if kind == "weights":
        extras = model_weights(model)
    elif kind == "fisher":
        extras = {"fisher": np.zeros((num_classes, dim), np.float32)}
    update = PrototypeUpdate(
        fleet=fleet, round=2**31 - 1, client=client, bundle=bundle, method=method,
        classes=tuple(range(num_classes)), counts=(0.5,) * num_classes,
        prototypes=np.zeros((num_classes, dim), np.float16), extras=extras,
        privacy=PrivacyMeta(mechanism="dp", epsilon=0.5, delta=0.5,
                            guarantee="g" * MAX_GUARANTEE_LENGTH),
        auth=Auth(run="r" * MAX_ID_LENGTH, signature=b"s" * MAX_SIGNATURE_BYTES),
    )  # fmt: skip
    return len(update.to_wire())


def check_update_fits(size: int, *, method: str, limit: int) -> None:
    """Refuse, at start, a device whose updates could exceed ``limit`` (its and the
    coordinator's ``mqtt.max_payload_bytes``): sent, such an update would be refused, sent
    again every resend_s and never stored."""
    if size > limit:
        raise ValueError(
            f"{method} updates of this device take up to {size:,} bytes, above "
            f"mqtt.max_payload_bytes = {limit:,}: raise the limit on every device and the "
            "coordinator (and the broker's max_packet_size, docs/deploy.md), or use a "
            "smaller head ([train] out_dim) or fewer classes"
        )
