"""The local-training settings, without torch.

Kept apart from ``edge_agent.train`` so that reading a configuration (``edge-agent
--help``, ``status``, a usage error, ``edge-fleet``'s option checks) does not pay for
importing torch: seconds on a laptop, longer on a Jetson's eMMC.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Norm = Literal["batch", "group"]
Classifier = Literal["linear", "bounded"]


@dataclass(frozen=True)
class TrainConfig:
    """Paper defaults (FedPCL 5.1): Adam, lr 1e-3, weight decay 1e-4, batch 32, E = 1."""

    epochs: int = 1
    batch_size: int = 32
    lr: float = 1e-3
    weight_decay: float = 1e-4
    tau: float = 0.07
    fpl_tau: float = 0.02
    include_positive: bool = False
    lam: float = 1.0
    out_dim: int = 256
    norm: Norm = "batch"
    # The cross-entropy methods' classifier on z: "linear" is FedPCL Table 7's FC(256, C).
    # "bounded" passes its output through ReLU and L2 normalisation before the softmax, as
    # the code behind FedPCL's published Solo and FedAvg figures does: every logit lies in
    # [0, 1], so no prediction can be confident and cross-entropy keeps pulling. A device
    # gets the stronger linear one; `edge-fleet ... --protocol paper` gives every method
    # with a classifier the bounded one, to reproduce the paper's comparison (docs/fleet.md).
    classifier: Classifier = "linear"
    # FedDBP's loss weights (its paper: 1.0, 10.0, 1.0) for the decision-branch CE, the
    # shared-branch L2 alignment and the decision-branch contrast.
    dbp_lambda1: float = 1.0
    dbp_lambda2: float = 10.0
    dbp_lambda3: float = 1.0

    def __post_init__(self) -> None:
        if self.epochs < 1 or self.batch_size < 2:
            raise ValueError(
                "epochs must be >= 1 and batch_size >= 2 (BatchNorm needs two samples)"
            )
        if self.lr <= 0 or self.tau <= 0 or self.fpl_tau <= 0:
            raise ValueError("lr, tau and fpl_tau must be positive")
        if self.out_dim < 1:
            raise ValueError(f"out_dim must be positive, got {self.out_dim}")
        weights = {
            "weight_decay": self.weight_decay,
            "lam": self.lam,
            "dbp_lambda1": self.dbp_lambda1,
            "dbp_lambda2": self.dbp_lambda2,
            "dbp_lambda3": self.dbp_lambda3,
        }
        negative = [name for name, value in weights.items() if value < 0]
        if negative:
            raise ValueError(f"{', '.join(negative)} must not be negative")
