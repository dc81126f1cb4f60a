"""The agent's configuration: a TOML file mapped onto frozen dataclasses.
edge_agent/agent.toml (``edge-agent example-config``) is a commented example of every key."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from edge_agent.methods import CORE, DEVICE_METHODS, device_method
from edge_agent.train_config import TrainConfig
from export.runtime import RuntimeSettings
from protocol import validate_id
from runtime.security import AgentSecurity
from runtime.settings import load_config
from runtime.transport import MqttSettings


@dataclass(frozen=True)
class DataSettings:
    """``train``/``test``: an .npz (x, y) or a folder of class subfolders."""

    train: Path
    test: Path | None = None
    image_size: int = 32  # folder images are resized to this square side
    # Where backbone features are cached; default <state_dir>/cache. Entries are keyed by
    # bundle and data fingerprint, so agents (or runs) on the same data may share one.
    feature_cache: Path | None = None
    # True when other agents use the same feature_cache (a simulated fleet): the agent then
    # leaves their entries alone. A private cache reuses the rows of samples it has seen
    # when the data set changes, and drops the superseded entries.
    shared_feature_cache: bool = False

    def __post_init__(self) -> None:
        if self.image_size < 1:
            raise ValueError(f"data.image_size must be at least 1 pixel, got {self.image_size}")


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

    def __post_init__(self) -> None:
        from edge_agent.privacy.accounting import ACCOUNTANTS
        from edge_agent.privacy.mechanisms import MECHANISMS

        if self.mechanism not in MECHANISMS:
            raise ValueError(f"privacy.mechanism must be one of {', '.join(MECHANISMS)}")
        if self.accountant not in ACCOUNTANTS:
            raise ValueError(f"privacy.accountant must be one of {', '.join(ACCOUNTANTS)}")
        if self.epsilon <= 0 or not 0 < self.delta < 1:
            raise ValueError("privacy.epsilon must be positive and privacy.delta in (0, 1)")
        if min(self.sgd_noise_multiplier, self.max_grad_norm, self.release_noise_multiplier) <= 0:
            raise ValueError("privacy noise multipliers and max_grad_norm must be positive")
        if self.paper_noise not in ("gaussian", "laplace") or not 0 <= self.paper_p < 1:
            raise ValueError("privacy.paper_noise: gaussian or laplace; paper_p in [0, 1)")
        if self.paper_scale < 0:  # found by the first round's noise draw otherwise
            raise ValueError(f"privacy.paper_scale must not be negative, got {self.paper_scale}")
        if self.mechanism == "dp" and self.dataset_size is None:
            raise ValueError(
                "privacy.mechanism = 'dp' needs privacy.dataset_size: a public upper bound on "
                "the training set's size, from which the sampling rate and steps are planned "
                "(the private count must not shape what leaves the device)"
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
    def formal(self) -> bool:
        """Whether the mechanism makes an (epsilon, delta) claim the ledger accounts."""
        from edge_agent.privacy.mechanisms import MECHANISMS

        return MECHANISMS[self.mechanism].formal

    @property
    def guarantee(self) -> str:
        from edge_agent.privacy.randomness import guarantee

        return guarantee(formal=self.formal, reproducible=self.reproducible_noise_seed is not None)


@dataclass(frozen=True)
class ClosedFormSettings:
    """``dim``: the public projection size k (0: the bundle's feature size, no
    projection); a fleet setting, the coordinator's ``model.dim``. ``personal_lambda``:
    how strongly the personalised head stays near the fleet's. ``validation_share``: the
    part of the device's data that chooses between the heads."""

    dim: int = 0
    personal_lambda: float = 1.0
    validation_share: float = 0.2

    def __post_init__(self) -> None:
        if self.dim < 0:
            raise ValueError(f"closed_form.dim must be >= 0 (0: no projection), got {self.dim}")
        if self.personal_lambda <= 0:
            raise ValueError(
                f"closed_form.personal_lambda must be positive, got {self.personal_lambda}"
            )
        if not 0 < self.validation_share < 1:
            raise ValueError(
                f"closed_form.validation_share must be in (0, 1), got {self.validation_share}"
            )

    def size(self, feature_dim: int) -> int:
        """k for a bundle of ``feature_dim`` features: ``dim``, or the features themselves
        when they are no more (a projection could only lose information)."""
        return feature_dim if self.dim == 0 else min(self.dim, feature_dim)


@dataclass(frozen=True)
class AgentConfig:
    agent_id: str
    fleet: str
    state_dir: Path
    bundle: Path
    data: DataSettings
    method: str = CORE
    classes: tuple[str, ...] = tuple(str(i) for i in range(10))
    seed: int = 0
    # The head's starting weights when they should not follow ``seed``: FedAvg and FPL
    # average the devices' models, which only works if they all started from one.
    init_seed: int | None = None
    # Rounds of metrics kept in state.json (`edge-agent status` shows the last): the file
    # is rewritten every round, so on a device it stays small. A simulated fleet, whose
    # report reads every round back, keeps them all.
    history: int = 200
    train: TrainConfig = field(default_factory=TrainConfig)
    runtime: RuntimeSettings = field(default_factory=RuntimeSettings)
    mqtt: MqttSettings = field(default_factory=MqttSettings)
    privacy: PrivacySettings = field(default_factory=PrivacySettings)
    # lda, ridge, fedcof (edge_agent/closed_form.py).
    closed_form: ClosedFormSettings = field(default_factory=ClosedFormSettings)
    security: AgentSecurity = field(default_factory=AgentSecurity)

    @property
    def run_lock(self) -> Path:
        """Held by the running agent (``runtime.runlock``)."""
        return self.state_dir / "run.lock"

    def __post_init__(self) -> None:
        validate_id(self.agent_id, field="agent_id")
        validate_id(self.fleet, field="fleet")
        method = device_method(self.method)  # a ValueError names the known methods
        if self.privacy.mechanism == "dp" and self.train.norm != "group":
            raise ValueError(
                "privacy.mechanism = 'dp' needs train.norm = 'group': BatchNorm mixes the "
                "samples of a batch, which per-sample clipping cannot allow"
            )
        mechanism = self.privacy.mechanism
        if mechanism not in method.modes:
            takers = [m.name for m in DEVICE_METHODS.values() if mechanism in m.modes]
            raise ValueError(
                f"privacy.mechanism = {mechanism!r} is not available for {self.method} (it "
                f"takes {', '.join(sorted(method.modes))}); {mechanism} is for "
                f"{', '.join(takers)}"
            )
        if len(set(self.classes)) != len(self.classes) or not self.classes:
            raise ValueError("classes must be a non-empty list of unique names")
        if self.history < 1:
            raise ValueError(f"history must be at least 1 round, got {self.history}")


def load(path: Path) -> AgentConfig:
    return load_config(AgentConfig, path)
