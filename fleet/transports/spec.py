"""What a simulated fleet run is asked to do (:class:`RunSpec`) and what it gives back
(:class:`RunResult`, one :class:`ClientRecord` per agent)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from coordinator.config import MAX_WORKERS
from coordinator.downlink import DEFAULT_BUDGET
from edge_agent.train_config import TrainConfig
from fleet.transports.layout import RunLayout
from fleet.transports.secure import secure_refusal
from runtime.cliutil import UsageError
from runtime.settings import ConfigError, build
from secagg.fleet import SecureAggregation

FLEET = "sim"
TRANSPORTS = ("mqtt", "memory", "vector")
#: The simulator's projection of the closed-form methods' statistics (``--stats-dim``):
#: docs/fleet.md has the accuracy and bytes it was chosen from.
DEFAULT_STATS_DIM = 512


@dataclass(frozen=True, kw_only=True)
class RunSpec:
    method: str
    rounds: int
    bundle: Path
    out: Path  # this run's folder
    seed: int = 0
    transport: str = "mqtt"
    broker: str | None = None  # mqtt://host:port of an external broker
    workers: int = 2
    # The coordinator sharded over this many ``edge-coordinator worker`` processes and a
    # round owner (docs/scale.md); None runs the single coordinator. mqtt only.
    coordinator_workers: int | None = None
    out_dim: int = 256
    epochs: int = 1
    progress: bool = True
    extra_train: dict[str, Any] = field(default_factory=dict)
    privacy: dict[str, Any] = field(default_factory=dict)  # the agents' [privacy] table
    # Mechanism noise replayable from the seed: for experiments that must repeat to the
    # bit; it voids every guarantee (the agents and reports say so). Secret otherwise.
    reproducible_noise: bool = False
    # Shared by every run that sees the same images (the methods of a compare): the
    # backbones then run once per image, not once per method.
    feature_cache: Path | None = None
    # The coordinator's [model] downlink_budget (bytes; 0 sends every local set). Agents
    # and coordinator otherwise run the deployed defaults, payload limits included: a run
    # whose announcement the agents would drop fails, as a deployment's would.
    downlink_budget: int = DEFAULT_BUDGET
    # Closed-form methods: the public projection size k of their statistics (the agents'
    # [closed_form] dim and the coordinator's model dim; 0 keeps the bundle's features).
    stats_dim: int = DEFAULT_STATS_DIM
    # Closed-form methods: the public basis file their statistics are taken in (the
    # agents' and the coordinator's [closed_form] basis; "" for the random projection).
    stats_basis: str = ""
    # Closed-form methods: the devices' statistics reach the coordinator only inside the
    # fleet's secure sum (fleet/transports/secure.py has the public settings): over mqtt
    # the protocol itself, on the vector transport its sum simulated. A formal release in
    # ``privacy`` (dp-features at epsilon, delta) becomes the sum's distributed noise at the
    # same budget, and the devices add none of their own; without one the sum is exact.
    secure_aggregation: bool = False

    def __post_init__(self) -> None:
        if self.transport not in TRANSPORTS:
            raise UsageError(f"--transport must be one of {', '.join(TRANSPORTS)}")
        if self.rounds < 1 or self.workers < 1 or self.epochs < 1:
            raise UsageError("--rounds, --workers and --epochs must be at least 1")
        if self.coordinator_workers is not None:
            if not 1 <= self.coordinator_workers <= MAX_WORKERS:
                raise UsageError(
                    f"--coordinator-workers must be in 1..{MAX_WORKERS}, "
                    f"got {self.coordinator_workers}"
                )
            if self.transport != "mqtt":
                raise UsageError(
                    f"--coordinator-workers applies to --transport mqtt; the {self.transport} "
                    "transport runs its coordinator in this one process"
                )
        if self.out_dim < 1:
            raise UsageError(f"--out-dim must be at least 1, got {self.out_dim}")
        if self.stats_dim < 0:
            raise UsageError(f"--stats-dim must be >= 0 (0: no projection), got {self.stats_dim}")
        if self.downlink_budget < 0:
            raise UsageError(f"--downlink-budget must be >= 0, got {self.downlink_budget}")
        if self.secure_aggregation:
            problem = secure_refusal(self)
            if problem is not None:
                raise UsageError(problem)
        # The agents build the same table from their TOML file: a bad value fails here,
        # before a fleet starts, not in every worker process.
        try:
            build(TrainConfig, train_table(self), prefix="train.")
        except ConfigError as exc:
            raise UsageError(f"--train-param {exc}") from None

    @property
    def layout(self) -> RunLayout:
        """The paths of this run's folder."""
        return RunLayout(self.out)


def train_table(spec: RunSpec) -> dict[str, Any]:
    """The agents' [train] table of a run."""
    return {"out_dim": spec.out_dim, "epochs": spec.epochs, **spec.extra_train}


@dataclass(frozen=True, kw_only=True)
class ClientRecord:
    name: str
    domain: str
    accuracy: tuple[float | None, ...]  # per round, by the method's own inference rule
    accuracy_prototype: tuple[float | None, ...]  # per round, cosine to local prototypes
    accuracy_classifier: tuple[float | None, ...]  # per round, the linear classifier
    bytes_up: tuple[int, ...]
    bytes_down: tuple[int, ...]


@dataclass(frozen=True, kw_only=True)
class RunResult:
    spec: RunSpec
    clients: tuple[ClientRecord, ...]
    round_seconds: tuple[float, ...]
    peak_mb: float
    wall_seconds: float
    backbone_samples: int | None = None  # images the backbones ran on (memory transport)
    # The public [secure_aggregation] table of a --secure-aggregation run, as every party
    # held it (fleet/transports/secure.py); None for a plain run.
    secure: SecureAggregation | None = None
