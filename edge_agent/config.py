"""The agent's configuration: a TOML file mapped onto frozen dataclasses.
edge_agent/agent.toml (``edge-agent example-config``) is a commented example of every key."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from closed_form.arrays import F64
from closed_form.basis import setting_basis
from edge_agent.methods import CORE, DEVICE_METHODS, device_method
from edge_agent.privacy.settings import PrivacySettings
from edge_agent.train_config import TrainConfig
from export.runtime import RuntimeSettings
from protocol import validate_id
from runtime.security import AgentSecurity
from runtime.settings import load_config
from runtime.transport import MqttSettings
from secagg.fleet import SecureAggregation, method_problem


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
class ClosedFormSettings:
    """``dim``: the public projection size k (0: the bundle's feature size, no
    projection); a fleet setting, the coordinator's ``model.dim``. ``personal_lambda``:
    how strongly the personalised head stays near the fleet's. ``validation_share``: the
    part of the device's data that chooses between the heads. ``basis``: the path of the
    fleet's public basis (closed_form/basis.py; the export tool writes it into the bundle
    as ``basis.npy``), "" for the random projection; a fleet setting, the coordinator's
    ``closed_form.basis``."""

    dim: int = 0
    personal_lambda: float = 1.0
    validation_share: float = 0.2
    basis: str = ""

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

    def public_basis(self, feature_dim: int) -> F64 | None:
        """The fleet's public basis for ``feature_dim`` features, None without one."""
        return setting_basis(self.basis, feature_dim=feature_dim)


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
    # The fleet's public secure-aggregation settings (privacy.aggregation = "secure").
    secure_aggregation: SecureAggregation = field(default_factory=SecureAggregation)

    @property
    def secure(self) -> bool:
        """Whether this device's statistics reach the coordinator only inside the fleet's sum."""
        return self.privacy.aggregation == "secure"

    @property
    def run_lock(self) -> Path:
        """Held by the running agent (``runtime.runlock``)."""
        return self.state_dir / "run.lock"

    def __post_init__(self) -> None:
        validate_id(self.agent_id, field="agent_id")
        validate_id(self.fleet, field="fleet")
        method = device_method(self.method)  # a ValueError names the known methods
        mechanism = self.privacy.mechanism
        if self.privacy.spec.dp_sgd and self.train.norm != "group":
            raise ValueError(
                f"privacy.mechanism = {mechanism!r} needs train.norm = 'group': BatchNorm "
                "mixes the samples of a batch, which per-sample clipping cannot allow"
            )
        if mechanism not in method.modes:
            takers = [m.name for m in DEVICE_METHODS.values() if mechanism in m.modes]
            raise ValueError(
                f"privacy.mechanism = {mechanism!r} is not available for {self.method} (it "
                f"takes {', '.join(sorted(method.modes))}); {mechanism} is for "
                f"{', '.join(takers)}"
            )
        if self.secure:
            self._check_secure()
        if len(set(self.classes)) != len(self.classes) or not self.classes:
            raise ValueError("classes must be a non-empty list of unique names")
        if self.history < 1:
            raise ValueError(f"history must be at least 1 round, got {self.history}")

    def _check_secure(self) -> None:
        problem = method_problem(self.secure_aggregation, self.method)
        if problem is not None:
            raise ValueError(problem)
        if self.privacy.mechanism != "none":
            raise ValueError(
                'privacy.aggregation = "secure" noises the fleet\'s sum '
                "([secure_aggregation] epsilon); privacy.mechanism = "
                f'{self.privacy.mechanism!r} would noise each device\'s part too: set it to "none"'
            )
        problem = self.secure_aggregation.problem()
        if problem is not None:
            raise ValueError(problem)
        if not self.security.insecure and self.security.ca is None:
            # Without the fleet CA a device could check its neighbours' keys against
            # nothing but the coordinator's word (secagg/enrolled.py).
            raise ValueError(
                'privacy.aggregation = "secure" in a signed fleet needs security.ca (the '
                "fleet CA's certificate) and security.certificate (the one it issued this "
                "device): they vouch for its neighbours' keys"
            )


def load(path: Path) -> AgentConfig:
    return load_config(AgentConfig, path)
