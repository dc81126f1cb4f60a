"""The ``[privacy]`` table of an agent's configuration, checked against the registries it
names (``MECHANISMS``, ``ACCOUNTANTS``). Kept free of torch: reading a configuration must
not import it."""

from __future__ import annotations

from dataclasses import dataclass

from edge_agent.privacy.accounting import ACCOUNTANTS
from edge_agent.privacy.mechanisms import MECHANISMS, MechanismSpec
from edge_agent.privacy.randomness import guarantee
from secagg.fleet import AGGREGATIONS


@dataclass(frozen=True)
class PrivacySettings:
    """``mechanism``: none, paper (FedPCL A.2.4 noise, no guarantee), dp (DP-SGD and a
    Gaussian release of the head's prototypes every round) or dp-features (one Gaussian
    release of the frozen backbone features per data version; the head then trains
    without noise and never leaves the device). dp and dp-features give an (epsilon,
    delta) guarantee for the agent's whole life. ``edge-agent privacy-plan`` chooses the
    noise multipliers for a budget from public settings only; see docs/privacy.md."""

    mechanism: str = "none"
    epsilon: float = 8.0  # dp, dp-features: total budget; publishing stops before it is exceeded
    delta: float = 1e-5
    accountant: str = "rdp"  # rdp or prv
    # dp: the declared (public) upper bound on the training set's size. DP-SGD's sampling
    # rate and steps come from it, never from the private count; more data is refused.
    dataset_size: int | None = None
    sgd_noise_multiplier: float = 1.0
    max_grad_norm: float = 1.0
    release_noise_multiplier: float = 5.0  # effective; sums and counts each get sqrt(2) x this
    # dp-features: candidate weights of the global anchors' term in the head's local
    # objective; the device picks one by its own validation split (0 = train alone, as Solo).
    anchor_weights: tuple[float, ...] = (0.0, 0.3, 1.0)
    validation_share: float = 0.2
    paper_noise: str = "gaussian"  # or laplace
    paper_scale: float = 0.05
    paper_p: float = 0.1
    # Experiments only: mechanism randomness replayable from this seed. It voids the
    # guarantee, and every update, ledger entry, status and report says so.
    reproducible_noise_seed: int | None = None
    # plain: the device's release reaches the coordinator; secure: only the fleet's sum of
    # the devices' statistics does, noised by the [secure_aggregation] table (lda, ridge;
    # fedproto sums prototype rows without noise).
    aggregation: str = "plain"

    def __post_init__(self) -> None:
        if self.aggregation not in AGGREGATIONS:
            raise ValueError(f"privacy.aggregation must be one of {', '.join(AGGREGATIONS)}")
        if self.mechanism not in MECHANISMS:
            raise ValueError(f"privacy.mechanism must be one of {', '.join(MECHANISMS)}")
        if self.accountant not in ACCOUNTANTS:
            raise ValueError(f"privacy.accountant must be one of {', '.join(ACCOUNTANTS)}")
        if self.aggregation == "secure" and self.accountant == "prv":
            # The sum of discrete Gaussian shares is bounded in Renyi DP (secagg/plan.py);
            # PRV would price a continuous Gaussian the bound does not cover.
            raise ValueError(
                'privacy.accountant = "prv" cannot price a secure fleet\'s distributed '
                'noise, whose bound is proven for RDP only: set accountant = "rdp"'
            )
        if self.epsilon <= 0 or not 0 < self.delta < 1:
            raise ValueError("privacy.epsilon must be positive and privacy.delta in (0, 1)")
        if min(self.sgd_noise_multiplier, self.max_grad_norm, self.release_noise_multiplier) <= 0:
            raise ValueError("privacy noise multipliers and max_grad_norm must be positive")
        if self.paper_noise not in ("gaussian", "laplace") or not 0 <= self.paper_p < 1:
            raise ValueError("privacy.paper_noise: gaussian or laplace; paper_p in [0, 1)")
        if self.paper_scale < 0:  # found by the first round's noise draw otherwise
            raise ValueError(f"privacy.paper_scale must not be negative, got {self.paper_scale}")
        if self.spec.dp_sgd and self.dataset_size is None:
            raise ValueError(
                f"privacy.mechanism = {self.mechanism!r} needs privacy.dataset_size: a public "
                "upper bound on the training set's size, from which the sampling rate and "
                "steps are planned (the private count must not shape what leaves the device)"
            )
        if self.dataset_size is not None and self.dataset_size < 1:
            raise ValueError(f"privacy.dataset_size must be positive, got {self.dataset_size}")
        if not self.anchor_weights or min(self.anchor_weights) < 0:
            raise ValueError("privacy.anchor_weights must be a non-empty list of weights >= 0")
        if not 0 < self.validation_share < 1:
            raise ValueError(
                f"privacy.validation_share must be in (0, 1), got {self.validation_share}"
            )

    @property
    def spec(self) -> MechanismSpec:
        """The configured mechanism's record: what it releases, from what, with what claim."""
        return MECHANISMS[self.mechanism]

    @property
    def formal(self) -> bool:
        """Whether the mechanism makes an (epsilon, delta) claim the ledger accounts."""
        return self.spec.formal

    @property
    def guarantee(self) -> str:
        return guarantee(formal=self.formal, reproducible=self.reproducible_noise_seed is not None)
