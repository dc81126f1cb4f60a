"""The coordinator's configuration: a TOML file mapped onto frozen dataclasses.

coordinator/coordinator.toml (``edge-coordinator example-config``) is a commented example
of every key.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from coordinator.admission import Admission
from coordinator.closed_form_settings import ClosedFormSettings
from coordinator.downlink import DEFAULT_BUDGET
from coordinator.strategies import RobustOptions, available, make_strategy
from protocol import DEFAULT_MAX_PAYLOAD_BYTES, validate_id
from protocol.announcement import PARAM_OLDEST_UNTIL, PARAM_OLDEST_VERSION
from protocol.limits import PREVIOUS_VERSION, PROTOCOL_VERSION, SUPPORTED_VERSIONS
from protocol.methods import wire_method
from runtime.security import CoordinatorSecurity
from runtime.settings import load_config
from runtime.transport import MqttSettings
from secagg.fleet import AGGREGATIONS, SecureAggregation, method_problem

Scalar = bool | int | float | str


def database_in(state_dir: Path) -> Path:
    """The coordinator's SQLite database in its state directory."""
    return state_dir / "coordinator.sqlite3"


@dataclass(frozen=True)
class ModelSettings:
    """What the fleet trains: announced to every device in each round."""

    method: str = "fedpcl"
    bundle: str = "unset"
    classes: tuple[str, ...] = tuple(str(i) for i in range(10))
    dim: int = 256
    #: Client-side hyperparameters (tau, epochs, ...) passed through in the announcement.
    params: Mapping[str, Scalar] = field(default_factory=dict)
    #: Server-side strategy parameters, e.g. ``weighting = "paper"`` for FedPCL.
    strategy: Mapping[str, Scalar] = field(default_factory=dict)
    announce_dtype: Literal["f2", "f4"] = "f4"
    #: FedAvg and FPL: the bundle's feature size (``feature_dim`` in its bundle.json) and
    #: the devices' ``[train] norm``. With ``dim`` and the class list they fix the shapes
    #: of the weights devices send (protocol.weights), so no update can choose them.
    feature_dim: int = 0
    norm: Literal["batch", "group"] = "batch"
    #: The most bytes a round announcement may take by carrying FedPCL's local sets: past
    #: it a uniform sample of them is sent (coordinator.downlink). 0 sends every set.
    downlink_budget: int = DEFAULT_BUDGET

    def __post_init__(self) -> None:
        if self.method not in available():
            raise ValueError(f"unknown method {self.method!r}; available: {', '.join(available())}")
        if not self.classes:
            raise ValueError("classes must not be empty")
        if len(set(self.classes)) != len(self.classes):
            raise ValueError("classes must be unique")
        if self.dim < 1:
            raise ValueError("dim must be positive")
        if wire_method(self.method).averaged and self.feature_dim < 1:
            raise ValueError(
                f"feature_dim is required for {self.method}: the bundle's feature size "
                "(feature_dim in its bundle.json), which fixes the shapes of the weights "
                "devices send"
            )
        if self.downlink_budget < 0:
            raise ValueError(
                f"downlink_budget must be >= 0 (0: no bound), got {self.downlink_budget}"
            )
        # Built once here so that a bad [model.strategy] is reported with the file's name
        # when the configuration is read, not by the first round.
        make_strategy(self.method, robust=None, **self.strategy)


@dataclass(frozen=True)
class RoundSettings:
    """When a round closes: ``min_clients`` updates and ``wait_after_quorum`` seconds more
    (or every allow-listed client), or the deadline with at least ``min_clients``;
    otherwise the deadline is extended by ``timeout_s``, up to ``max_extensions`` times,
    after which the round closes with at least ``floor`` updates."""

    min_clients: int = 1
    wait_after_quorum_s: float = 5.0
    timeout_s: float = 300.0
    #: Deadline extensions without the quorum; after them a round closes with what it
    #: has if that is at least ``floor`` updates. Below the floor it keeps waiting and
    #: says why (status, the protofleet_round_stalled metric): never stuck silently.
    max_extensions: int = 3
    floor: int = 1
    #: A device's online status older than this counts as stale (devices restate it with
    #: every round they handle), so a client that vanished does not stay "online".
    online_ttl_s: float = 3600.0
    #: 0 runs forever; otherwise the coordinator publishes a final announcement and stops.
    max_rounds: int = 0
    allow_list: tuple[str, ...] = ()
    #: Closed rounds whose updates and announcements stay in the database; older rounds
    #: keep only their times, so the file stops growing. 0 keeps everything.
    keep_rounds: int = 10

    def __post_init__(self) -> None:
        if self.min_clients < 1:
            raise ValueError("min_clients must be at least 1")
        if self.wait_after_quorum_s < 0 or self.timeout_s <= 0:
            raise ValueError("wait_after_quorum_s must be >= 0 and timeout_s > 0")
        if self.online_ttl_s <= 0:
            raise ValueError("online_ttl_s must be positive")
        if self.max_extensions < 0:
            raise ValueError("max_extensions must be >= 0")
        if not 1 <= self.floor <= self.min_clients:
            raise ValueError(f"floor must be in [1, min_clients = {self.min_clients}]")
        if self.max_rounds < 0:
            raise ValueError("max_rounds must be >= 0")
        if self.keep_rounds < 0:
            raise ValueError("keep_rounds must be >= 0 (0 keeps every round)")
        for client in self.allow_list:
            validate_id(client, field="rounds.allow_list")
        if self.allow_list and self.min_clients > len(self.allow_list):
            raise ValueError("min_clients exceeds the number of allow-listed clients")


@dataclass(frozen=True)
class AdmissionSettings:
    """Public bounds every update must meet before it is stored (coordinator.admission).

    ``max_count``: the most samples one device may claim for one class; an update claiming
    more is rejected, so a device cannot outweigh the fleet by its counts. ``max_value``:
    the largest magnitude of any prototype or weight value (prototypes are unit-norm means:
    well inside 1 without noise). Together they keep every aggregate finite.
    """

    max_count: float = 100_000.0
    max_value: float = 1_000.0

    def __post_init__(self) -> None:
        if not 0 < self.max_count <= 1e9:
            raise ValueError(f"max_count must be in (0, 1e9], got {self.max_count}")
        # An announcement may carry float16 (announce_dtype = "f2"): its largest value.
        if not 0 < self.max_value <= 65504:
            raise ValueError(f"max_value must be in (0, 65504], got {self.max_value}")


@dataclass(frozen=True)
class AgentsSettings:
    """What the coordinator must know of its devices' configuration. ``max_payload_bytes``
    is their ``[mqtt] max_payload_bytes``: a device drops a larger payload unread, so the
    coordinator refuses to publish an announcement above it (coordinator.downlink)."""

    max_payload_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES

    def __post_init__(self) -> None:
        if self.max_payload_bytes < 1024:
            raise ValueError("agents.max_payload_bytes must be at least 1024")


@dataclass(frozen=True)
class MetricsSettings:
    port: int = 0  # 0 disables the Prometheus endpoint
    host: str = "127.0.0.1"

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"metrics.port must be 0-65535 (0: no endpoint), got {self.port}")


#: The most workers one owner collects from: each answers every collect request.
MAX_WORKERS = 256


@dataclass(frozen=True)
class WorkersSettings:
    """The sharded intake (docs/scale.md, docs/deploy.md): with workers named here,
    ``edge-coordinator run`` is the round owner (coordinator/tier/owner.py) and the updates go
    to ``edge-coordinator worker --name NAME`` processes on the shared subscription
    ``$share/<group>/...``. ``names`` or ``count`` (``w1`` ... ``wN``), not both; neither
    runs the single coordinator. ``collect_retry_s``: how often a collect request is sent
    again to a worker that has not answered it (a restarted worker answers from its
    database). ``local_sets``: FedPCL's per-client sets (Eq. 7) do not sum, so a FedPCL
    fleet with workers is refused unless this is ``"omit"`` (global prototypes only)."""

    names: tuple[str, ...] = ()
    count: int = 0
    group: str = "aggregators"
    collect_retry_s: float = 5.0
    local_sets: Literal["refuse", "omit"] = "refuse"

    def __post_init__(self) -> None:
        if self.names and self.count:
            raise ValueError("give names or count, not both")
        if not 0 <= self.count <= MAX_WORKERS:
            raise ValueError(f"count must be in 0..{MAX_WORKERS} (0: no workers), got {self.count}")
        if len(self.names) > MAX_WORKERS:
            raise ValueError(f"at most {MAX_WORKERS} names, got {len(self.names)}")
        for name in self.names:
            validate_id(name, field="workers.names")
        if len(set(self.names)) != len(self.names):
            raise ValueError("names must be unique")
        validate_id(self.group, field="workers.group")
        if not self.collect_retry_s > 0:
            raise ValueError(f"collect_retry_s must be positive, got {self.collect_retry_s}")

    @property
    def members(self) -> tuple[str, ...]:
        """The workers the owner collects from: ``names``, or ``w1`` ... ``w<count>``."""
        return self.names or tuple(f"w{i}" for i in range(1, self.count + 1))

    @property
    def enabled(self) -> bool:
        return bool(self.members)


@dataclass(frozen=True)
class ProtocolSettings:
    """The wire versions through an upgrade (docs/deploy.md, "Upgrading the protocol").
    The coordinator reads updates and statuses of its version and the previous one, and
    answers each update's receipt in the update's version. ``announce_version``: the
    version its announcements are written in; the previous one while devices that read
    only it remain (a device of this version reads both and answers in the announcement's).
    ``previous_until``: Unix seconds from which updates and statuses of the previous
    version are refused (0: no date set); said in every announcement's ``params``
    (``protocol_oldest``, ``protocol_oldest_until``) once set."""

    announce_version: int = PROTOCOL_VERSION
    previous_until: float = 0.0

    def __post_init__(self) -> None:
        if self.announce_version not in SUPPORTED_VERSIONS:
            raise ValueError(
                f"announce_version must be one of {', '.join(map(str, SUPPORTED_VERSIONS))}, "
                f"got {self.announce_version}"
            )
        if not (math.isfinite(self.previous_until) and self.previous_until >= 0):
            raise ValueError(f"previous_until must be Unix seconds >= 0, got {self.previous_until}")

    def previous_refused(self, now: float) -> bool:
        """Whether messages of the previous version are refused at ``now``."""
        return 0 < self.previous_until <= now

    def params(self) -> dict[str, float | int]:
        """What every announcement says of the end of the previous version's support."""
        if not self.previous_until:
            return {}
        return {PARAM_OLDEST_VERSION: PREVIOUS_VERSION, PARAM_OLDEST_UNTIL: self.previous_until}


@dataclass(frozen=True)
class PrivacySettings:
    """``aggregation``: ``plain``, each device's release reaches the coordinator, or
    ``secure``, only the fleet's sum does (secagg/, the ``[secure_aggregation]``
    table; lda, ridge and fedproto)."""

    aggregation: Literal["plain", "secure"] = "plain"

    def __post_init__(self) -> None:
        if self.aggregation not in AGGREGATIONS:
            raise ValueError(f"aggregation must be one of {', '.join(AGGREGATIONS)}")


@dataclass(frozen=True)
class CoordinatorConfig:
    fleet: str
    state_dir: Path
    coordinator_id: str = "coordinator"
    # What a receipt promises (issue 53; bench/durability_bench.py measures the cost):
    # FULL and GROUP, that the update survives a power cut (FULL: an fsync per commit;
    # GROUP: commits at NORMAL, receipts held for one fsync per batch,
    # coordinator/storage/group_sync.py); NORMAL, only a crash of the process. GROUP by
    # default: as fast as NORMAL, where FULL took 2-3x as long a receipt on a busy disk
    # (docs/deploy.md, "Durability").
    sqlite_synchronous: Literal["NORMAL", "FULL", "GROUP"] = "GROUP"
    model: ModelSettings = field(default_factory=ModelSettings)
    rounds: RoundSettings = field(default_factory=RoundSettings)
    robust: RobustOptions = field(default_factory=RobustOptions)
    admission: AdmissionSettings = field(default_factory=AdmissionSettings)
    security: CoordinatorSecurity = field(default_factory=CoordinatorSecurity)
    mqtt: MqttSettings = field(default_factory=MqttSettings)
    agents: AgentsSettings = field(default_factory=AgentsSettings)
    metrics: MetricsSettings = field(default_factory=MetricsSettings)
    workers: WorkersSettings = field(default_factory=WorkersSettings)
    privacy: PrivacySettings = field(default_factory=PrivacySettings)
    protocol: ProtocolSettings = field(default_factory=ProtocolSettings)
    secure_aggregation: SecureAggregation = field(default_factory=SecureAggregation)
    closed_form: ClosedFormSettings = field(default_factory=ClosedFormSettings)

    def __post_init__(self) -> None:
        validate_id(self.fleet, field="fleet")
        validate_id(self.coordinator_id, field="coordinator_id")
        if self.secure:
            problem = self.secure_problem()
            if problem is not None:
                raise ValueError(problem)
        if wire_method(self.model.method).closed_form:
            # Read now: a basis file that is missing or of another size is said at start,
            # not at the first release (every one of which it would refuse).
            self.closed_form.public_basis(self.model.feature_dim)
        if wire_method(self.model.method).closed_form and self.robust != RobustOptions():
            # Said, not ignored: the defences cap, clip or take medians of prototypes,
            # and a closed-form head is solved from sums (admission bounds them instead).
            raise ValueError(
                f"[robust] does not apply to {self.model.method}: its head is solved from the "
                "summed statistics; leave the [robust] table out"
            )

    @property
    def secure(self) -> bool:
        """Whether only the fleet's sum of the devices' statistics reaches this coordinator."""
        return self.privacy.aggregation == "secure"

    def secure_problem(self) -> str | None:
        """Why this fleet cannot aggregate securely, in one line; None when it can."""
        table = self.secure_aggregation
        problem = method_problem(table, self.model.method)
        if problem is not None:
            return problem
        if self.workers.enabled:
            return (
                'privacy.aggregation = "secure" runs on the single coordinator: leave the '
                "[workers] table out"
            )
        robust = self.robust
        if not wire_method(self.model.method).closed_form and (
            robust.median_count_cap or robust.median_norm_clip or robust.median_direction_screen
            or robust.rule != "mean"
        ):  # fmt: skip
            # Said, not switched off quietly: the defaults are the safe ones, and a secure
            # sum cannot apply them (the device's quantiser bounds each coordinate instead).
            return (
                f"[robust] medians need each device's rows, which a secure {self.model.method} "
                "fleet never sees: set median_count_cap, median_norm_clip and "
                'median_direction_screen to false (rule = "mean")'
            )
        return table.problem()

    def stalled(self, *, round_: int, updates: int, extensions: int) -> str | None:
        """Why the open round cannot close, when it cannot: said by status and metrics."""
        rounds = self.rounds
        if extensions < rounds.max_extensions or updates >= rounds.floor:
            return None
        return (
            f"round {round_} has {updates} update(s) after {extensions} deadline extensions, "
            f"below rounds.floor = {rounds.floor}: it closes once that many devices answer"
        )

    def identity(self) -> dict[str, str]:
        """What this fleet's state belongs to (``Store.bind_identity``): the fleet, method
        and bundle, and a closed-form fleet's public basis where it has one."""
        model = self.model
        return {"fleet": self.fleet, "method": model.method, "bundle": model.bundle} | (
            self.closed_form.identity(model.feature_dim)
        )

    def admission_checks(self) -> Admission:
        model = self.model
        wire = wire_method(model.method)
        # Rows of norm exactly 1 when the statistics are of the features themselves (no
        # projection): model.feature_dim, where the fleet gives it, equal to dim.
        release = self.closed_form.bounds(
            gram=wire.gram, unit_rows=wire.closed_form and model.feature_dim == model.dim
        )
        return Admission.for_fleet(
            fleet=self.fleet,
            bundle=model.bundle,
            method=model.method,
            classes=len(model.classes),
            dim=model.dim,
            max_count=self.admission.max_count,
            max_value=self.admission.max_value,
            feature_dim=model.feature_dim,
            norm=model.norm,
            allow_list=self.rounds.allow_list,
            release=release,
            basis=self.closed_form.public_basis(model.feature_dim),
        )

    @property
    def database(self) -> Path:
        return database_in(self.state_dir)

    @property
    def run_lock(self) -> Path:
        """Held by the running coordinator (``runtime.runlock``)."""
        return self.database.with_name(self.database.name + ".lock")


def load(path: Path) -> CoordinatorConfig:
    return load_config(CoordinatorConfig, path)
