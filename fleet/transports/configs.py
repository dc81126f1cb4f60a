"""The files a simulated fleet is set up from: each agent's and the coordinator's
configuration tables (written as TOML), the coordinator's worker tier when it is sharded,
and the fleet's signing keys."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from coordinator.config import CoordinatorConfig
from coordinator.downlink import AnnouncementRefused
from coordinator.rounds.announcements import largest_announcement
from coordinator.tier.owner import refusal
from edge_agent.config import ClosedFormSettings
from edge_agent.privacy.settings import PrivacySettings
from fleet.data.partition import ClientData
from fleet.transports import secure as secure_mod
from fleet.transports.fleet_ca import issue_certificates
from fleet.transports.spec import FLEET, RunSpec, train_table
from protocol.auth import Signer
from protocol.methods import wire_method
from runtime.keyfiles import generate_ed25519
from runtime.settings import ConfigError, build
from secagg.fleet import SecureAggregation


def toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    return json.dumps(str(value))  # a TOML basic string is a JSON string


def to_toml(tables: dict[str, Any]) -> str:
    """Top-level keys first, then one ``[table]`` per dict value (one level deep)."""
    lines = [f"{k} = {toml_value(v)}" for k, v in tables.items() if not isinstance(v, dict)]
    for name, table in tables.items():
        if isinstance(table, dict):
            lines.append(f"[{name}]")
            lines += [f"{k} = {toml_value(v)}" for k, v in table.items()]
    return "\n".join(lines) + "\n"


def agent_seed(spec: RunSpec, index: int) -> int:
    """The run's seed for its ``index``-th device (data order, and its head's start)."""
    return spec.seed * 100_003 + index


def initial_seed(spec: RunSpec, index: int) -> int:
    """The seed a device's head starts from: averaged models start from one head, as a
    server-initialised model would; every other method's devices start apart, as
    independent devices do."""
    return spec.seed if wire_method(spec.method).averaged else agent_seed(spec, index)


def agent_tables(
    spec: RunSpec,
    client: ClientData,
    *,
    classes: tuple[str, ...],
    index: int,
    security: dict[str, Any] | None = None,
    secure: SecureAggregation | None = None,
) -> dict[str, Any]:
    """The agent's tables for ``client``, the ``index``-th device, in the run's layout
    (its split saved there now); ``security`` is its [security] table, ``secure`` the
    fleet's [secure_aggregation] table under --secure-aggregation."""
    if secure is not None:
        privacy = secure_mod.agent_tables(secure)
    else:
        privacy = privacy_tables(spec, index) if spec.privacy else {}
    layout = spec.layout
    train, test = client.save(layout.agent_data(client.name))
    return {
        "agent_id": client.name,
        "fleet": FLEET,
        "state_dir": str(layout.agent_state(client.name)),
        "bundle": str(spec.bundle),
        "method": spec.method,
        "classes": list(classes),
        "seed": agent_seed(spec, index),
        **({"init_seed": spec.seed} if wire_method(spec.method).averaged else {}),
        # The report reads every round back from the agent's state: none may be dropped.
        "history": max(200, spec.rounds),
        "data": {
            "train": str(train),
            "test": str(test),
            **(
                {"feature_cache": str(spec.feature_cache), "shared_feature_cache": True}
                if spec.feature_cache
                else {}
            ),
        },
        "train": train_table(spec),
        # One intra-op thread per session: many agents share a few cores.
        "runtime": {"intra_op_threads": 1, "inter_op_threads": 1},
        **privacy,
        **(
            {"closed_form": {"dim": spec.stats_dim, **basis_table(spec)}}
            if wire_method(spec.method).closed_form
            else {}
        ),
        **({"security": security} if security is not None else {}),
    }


def basis_table(spec: RunSpec) -> dict[str, str]:
    """The run's public basis for a ``[closed_form]`` table, on the agents and the
    coordinator alike (nothing for the random projection)."""
    return {"basis": spec.stats_basis} if spec.stats_basis else {}


def privacy_tables(spec: RunSpec, index: int) -> dict[str, Any]:
    seed = {"reproducible_noise_seed": agent_seed(spec, index)} if spec.reproducible_noise else {}
    return {"privacy": {**spec.privacy, **seed}}


def prototype_dim(spec: RunSpec, feature_dim: int) -> int:
    """What the agents' updates carry: head embeddings, (dp-features) backbone features, or
    (closed-form methods) the features' statistics, projected to ``stats_dim`` if set."""
    if wire_method(spec.method).closed_form:
        return ClosedFormSettings(dim=spec.stats_dim).size(feature_dim)
    return feature_dim if spec.privacy.get("mechanism") == "dp-features" else spec.out_dim


def coordinator_tables(
    spec: RunSpec,
    bundle_id: str,
    classes: tuple[str, ...],
    clients: int,
    *,
    dim: int,
    feature_dim: int,
    security: dict[str, Any] | None = None,
    secure: SecureAggregation | None = None,
) -> dict[str, Any]:
    """The coordinator's tables of a run; ``security`` is its [security] table, ``secure``
    the fleet's [secure_aggregation] table under --secure-aggregation."""
    return {
        "fleet": FLEET,
        "state_dir": str(spec.layout.coordinator),
        "sqlite_synchronous": "NORMAL",
        "model": {
            "method": spec.method,
            "bundle": bundle_id,
            "classes": list(classes),
            "dim": dim,
            # With the classes they fix the weights FedAvg and FPL devices send.
            "feature_dim": feature_dim,
            "norm": train_table(spec).get("norm", "batch"),
            "downlink_budget": spec.downlink_budget,
        },
        "rounds": {
            "min_clients": clients,
            "wait_after_quorum_s": 0.0,
            "timeout_s": 3600.0,
            "max_rounds": spec.rounds,
        },
        **({"security": security} if security is not None else {}),
        **(secure_mod.coordinator_tables(secure, method=spec.method) if secure else {}),
        **merged_tables(workers_tables(spec), closed_form_table(spec, secure=secure is not None)),
    }


def merged_tables(*parts: dict[str, Any]) -> dict[str, Any]:
    """Tables of several sources, a table named twice merged key by key."""
    out: dict[str, Any] = {}
    for part in parts:
        for name, table in part.items():
            out[name] = {**out.get(name, {}), **table} if isinstance(table, dict) else table
    return out


def closed_form_table(spec: RunSpec, *, secure: bool) -> dict[str, Any]:
    """A closed-form fleet's ``[closed_form]``: devices that release noisy statistics say
    so, with their noise (the coordinator's checks follow the fleet's settings, never an
    update's word). No per-device cap (``count_cap = 0``): a simulated fleet's devices are
    honest, the vector transport keeps no payloads to read a capped device's statistics
    back from, and every transport must announce the same heads
    (tests/test_vector_engine.py); what the cap costs a clean fleet is measured by
    bench/closed_form_attack_bench.py. Nothing for other methods."""
    if not wire_method(spec.method).closed_form:
        return {}
    table: dict[str, Any] = {"count_cap": 0.0, **basis_table(spec)}
    if not secure and spec.privacy.get("mechanism", "none") != "none":
        default = PrivacySettings.release_noise_multiplier
        multiplier = spec.privacy.get("release_noise_multiplier", default)
        table |= {"release": "noisy", "noise_multiplier": float(multiplier)}
    return {"closed_form": table}


def workers_tables(spec: RunSpec) -> dict[str, Any]:
    """With ``spec.coordinator_workers``, the coordinator's [workers] table (``w1`` ...
    ``wN``) and what the round owner needs besides (coordinator/tier/owner.py::refusal);
    nothing for the single coordinator."""
    if spec.coordinator_workers is None:
        return {}
    record = wire_method(spec.method)
    # FedPCL's per-client local sets (Eq. 7) do not sum, so no partial carries them: the
    # announcement has the global prototypes only (docs/fleet.md says what that means).
    sets = {"local_sets": "omit"} if record.local_sets else {}
    tables: dict[str, Any] = {"workers": {"count": spec.coordinator_workers, **sets}}
    if record.closed_form:
        # The per-client cap needs every client's statistics, which no worker sends.
        tables["closed_form"] = {"count_cap": 0.0}
    else:  # a closed-form coordinator takes no [robust] table at all
        # The default defences take medians over every update of a round, which no
        # worker holds: the owner runs only with them off.
        tables["robust"] = {
            "median_count_cap": False,
            "median_norm_clip": False,
            "median_direction_screen": False,
        }
    return tables


def workers_refusal(tables: dict[str, Any]) -> str | None:
    """Why ``edge-coordinator run`` would refuse the coordinator of ``tables`` over its
    workers, as one line of edge-fleet's; None if it would not (or has no workers)."""
    if "workers" not in tables:
        return None
    try:
        config = build(CoordinatorConfig, tables)
    except ConfigError as exc:
        return f"--coordinator-workers: the coordinator's configuration: {exc}"
    problem = refusal(config)
    return None if problem is None else f"--coordinator-workers: {problem}"


def planned_workers_refusal(spec: RunSpec) -> str | None:
    """:func:`workers_refusal` asked before the bundle, the data and the keys exist: the
    model's sizes and classes, and the keys, stand in as placeholders (the owner's
    refusal reads the method, its strategy, [workers] and [robust], none of them)."""
    tables = coordinator_tables(spec, "unset", ("0",), 1, dim=1, feature_dim=1,
                                security={"insecure": True})  # fmt: skip
    return workers_refusal(tables)


def announcement_refusal(
    spec: RunSpec, classes: tuple[str, ...], clients: list[str], *, feature_dim: int | None
) -> str | None:
    """Why this run's coordinator would refuse its round announcements (larger than the
    agents' payload limit), asked before the agents start, which costs their feature
    extraction and a round; None when they fit. ``feature_dim`` None: the bundle is not
    known yet, and a run whose sizes depend on it is asked again once it is."""
    record = wire_method(spec.method)
    needs_bundle = (
        record.averaged or record.closed_form or spec.privacy.get("mechanism") == ("dp-features")
    )
    if feature_dim is None and needs_bundle:
        return None
    features = feature_dim or 1
    tables = coordinator_tables(spec, "unset", classes, len(clients),
                                dim=prototype_dim(spec, features), feature_dim=features,
                                security={"insecure": True})  # fmt: skip
    try:
        config = build(CoordinatorConfig, tables)
    except ConfigError:
        return None  # said, in its own words, where the run builds it
    # cryptography: imported here, with the key the run itself makes (Ed25519), so the
    # signature is counted at its size.
    from cryptography.hazmat.primitives.asymmetric import ed25519

    try:
        largest_announcement(config, clients, signer=Signer(ed25519.Ed25519PrivateKey.generate()))
    except AnnouncementRefused as exc:
        return f"{spec.method} with {len(clients)} clients: {exc}"
    return None


def write_config(path: Path, tables: dict[str, Any]) -> Path:
    """``tables`` as the TOML file ``path``: each configuration is written once, whole."""
    path.write_text(to_toml(tables))
    return path


@dataclass(frozen=True)
class FleetKeys:
    """Ed25519 keys of a simulated fleet, so it runs the signed path a deployment runs:
    ``coordinator.key`` and ``.pub``, ``agents/<name>.key``, ``devices/<name>.pub`` (the
    coordinator's enrolment folder), under ``root`` (the run's ``keys/``); and a fleet CA
    (``ca.key``, ``ca.crt``) with ``agents/<name>.crt`` for each agent, which secure
    aggregation's devices check each other's keys with (fleet/transports/fleet_ca.py)."""

    root: Path

    @property
    def coordinator_key(self) -> Path:
        return self.root / "coordinator.key"

    @property
    def coordinator_pub(self) -> Path:
        return self.root / "coordinator.pub"

    @property
    def devices(self) -> Path:
        return self.root / "devices"

    def agent_key(self, name: str) -> Path:
        return self.root / "agents" / f"{name}.key"

    def device_pub(self, name: str) -> Path:
        return self.devices / f"{name}.pub"

    @property
    def ca_key(self) -> Path:
        return self.root / "ca.key"

    @property
    def ca_cert(self) -> Path:
        return self.root / "ca.crt"

    def agent_certificate(self, name: str) -> Path:
        return self.root / "agents" / f"{name}.crt"

    def agent_table(self, name: str) -> dict[str, Any]:
        return {"key": str(self.agent_key(name)), "coordinator": str(self.coordinator_pub),
                "ca": str(self.ca_cert), "certificate": str(self.agent_certificate(name))}  # fmt: skip

    def coordinator_table(self) -> dict[str, Any]:
        return {"key": str(self.coordinator_key), "devices": str(self.devices)}


def fleet_keys(root: Path, names: list[str]) -> FleetKeys:
    """Make the keys a run lacks; a resumed run keeps its own (its stored updates are
    signed with them)."""
    keys = FleetKeys(root)
    if not keys.coordinator_key.exists():
        generate_ed25519(keys.coordinator_key, keys.coordinator_pub)
    for name in names:
        if not keys.agent_key(name).exists():
            generate_ed25519(keys.agent_key(name), keys.device_pub(name))
    devices = {n: (keys.device_pub(n), keys.agent_certificate(n)) for n in names}
    issue_certificates(ca_key=keys.ca_key, ca_cert=keys.ca_cert, devices=devices)
    return keys
