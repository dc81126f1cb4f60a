"""Prometheus metrics of one coordinator, on a private registry (so tests and several
coordinators in one process never collide)."""

from __future__ import annotations

from wsgiref.simple_server import WSGIServer

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    ProcessCollector,
    start_http_server,
)

#: The outcomes ``protofleet_secure_rounds`` counts.
SECURE_OUTCOMES = ("closed", "aborted")


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self._server: WSGIServer | None = None
        self.address: tuple[str, int] | None = None  # where /metrics is served, if anywhere
        self.rounds_completed = Counter(
            "protofleet_rounds_completed", "Rounds aggregated and closed", registry=self.registry
        )
        self.updates_accepted = Counter(
            "protofleet_updates_accepted", "Prototype updates accepted", registry=self.registry
        )
        self.updates_rejected = Counter(
            "protofleet_updates_rejected",
            "Prototype updates rejected",
            ["reason"],
            registry=self.registry,
        )
        self.updates_quarantined = Counter(
            "protofleet_updates_quarantined",
            "Stored updates set aside on resume because they fail today's admission checks",
            registry=self.registry,
        )
        self.clients_online = Gauge(
            "protofleet_clients_online",
            "Clients whose last status is online",
            registry=self.registry,
        )
        self.clients_rejecting_announcements = Gauge(
            "protofleet_clients_rejecting_announcements",
            "Online clients that refuse this coordinator's announcements as not signed by "
            "the key they pinned (status reason bad_coordinator_signature)",
            registry=self.registry,
        )
        self.clients_unsupported_version = Gauge(
            "protofleet_clients_unsupported_version",
            "Online clients that cannot read the protocol version of this coordinator's "
            "announcements (status reason unsupported_version); edge-coordinator status "
            "names them",
            registry=self.registry,
        )
        self.clients_previous_version = Gauge(
            "protofleet_clients_previous_version",
            "Clients whose last status came in the previous protocol version: the devices "
            "an upgrade still waits for",
            registry=self.registry,
        )
        self.round_duration = Histogram(
            "protofleet_round_duration_seconds",
            "Seconds from opening to closing a round",
            buckets=(0.1, 0.5, 1, 2, 5, 10, 30, 60, 120, 300, 900, 3600),
            registry=self.registry,
        )
        self.aggregation_seconds = Histogram(
            "protofleet_aggregation_seconds",
            "Seconds spent aggregating one round",
            buckets=(0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 5),
            registry=self.registry,
        )
        self.insecure = Gauge(
            "protofleet_insecure",
            "1 when security.insecure = true: messages are neither signed nor checked",
            registry=self.registry,
        )
        self.client_last_accepted = Gauge(
            "protofleet_client_last_accepted_round",
            "The last round in which a device's update was accepted (a receipt was sent)",
            ["client"],
            registry=self.registry,
        )
        self.storage_errors = Counter(
            "protofleet_storage_errors",
            "Storage errors (each stops the coordinator; systemd restarts it)",
            registry=self.registry,
        )
        # process_start_time_seconds: a restart loop (a full disk) shows in its changes.
        ProcessCollector(registry=self.registry)
        self.current_round = Gauge(
            "protofleet_current_round", "The open round", registry=self.registry
        )
        self.round_opened = Gauge(
            "protofleet_round_opened_timestamp_seconds",
            "When the open round was opened (Unix seconds)",
            registry=self.registry,
        )
        self.round_extensions = Gauge(
            "protofleet_round_extensions",
            "Deadline extensions of the open round so far",
            registry=self.registry,
        )
        self.round_stalled = Gauge(
            "protofleet_round_stalled",
            "1 while the open round has used its extensions and is below rounds.floor",
            registry=self.registry,
        )
        self.head_kept = Gauge(
            "protofleet_head_kept",
            "1 while the announced closed-form head is the last good one, kept because a "
            "round's statistics gave none or a worse one (edge-coordinator status says why)",
            registry=self.registry,
        )

        # A secure fleet's rounds (coordinator/rounds/secure_rounds.py). Both outcomes
        # exist from the start, at 0, so that a dashboard's panel has a series to draw.
        self.secure_rounds = Counter(
            "protofleet_secure_rounds",
            "Secure-aggregation rounds ended, by outcome (closed: a sum was unmasked; "
            "aborted: fewer than the threshold answered a stage, or the round failed)",
            ["outcome"],
            registry=self.registry,
        )
        for outcome in SECURE_OUTCOMES:
            self.secure_rounds.labels(outcome=outcome)
        self.secure_round_seconds = Histogram(
            "protofleet_secure_round_seconds",
            "Seconds of a secure-aggregation round, its four stages",
            buckets=(1, 2, 5, 10, 20, 30, 60, 120, 300, 600),
            registry=self.registry,
        )
        self.secure_stage = Gauge(
            "protofleet_secure_stage",
            "The stage the open secure-aggregation round waits in: 0 none, 1 advertise, "
            "2 share, 3 masked input, 4 consistency, 5 unmask",
            registry=self.registry,
        )
        self.secure_survivors = Gauge(
            "protofleet_secure_survivors",
            "Devices whose inputs are in the last unmasked secure sum",
            registry=self.registry,
        )
        self.secure_round_epsilon = Gauge(
            "protofleet_secure_round_epsilon",
            "The epsilon one secure round's noise spends ([secure_aggregation] epsilon as "
            "planned; 0 without noise or outside a secure fleet)",
            registry=self.registry,
        )
        self.client_epsilon_spent = Gauge(
            "protofleet_client_epsilon_spent",
            "The epsilon a device reports spent in total (privacy.epsilon of its last "
            "accepted update; devices without a formal mechanism report none)",
            ["client"],
            registry=self.registry,
        )

    def serve(self, *, host: str, port: int) -> None:
        """Serve the registry on ``host:port``; raises ``OSError`` if it cannot bind."""
        self.stop_serving()
        self._server, _thread = start_http_server(port, addr=host, registry=self.registry)
        self.address = (host, port)

    def stop_serving(self) -> None:
        """Close the endpoint (a reload may move it); the counters live on."""
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server, self.address = None, None

    def value(self, name: str, **labels: str) -> float:
        """Current value of a sample, for status output and tests."""
        found = self.registry.get_sample_value(name, labels or None)
        return 0.0 if found is None else float(found)
