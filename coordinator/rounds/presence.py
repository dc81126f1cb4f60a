"""The devices' presence: their retained status messages, kept in the client table, and
the gauge of devices online."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable

from coordinator.config import CoordinatorConfig
from coordinator.metrics import Metrics
from coordinator.rounds.rejections import Rejections
from coordinator.storage.store import Store
from protocol import BAD_COORDINATOR_SIGNATURE, ProtocolError, Status, UnsupportedVersion
from protocol.limits import PROTOCOL_VERSION, SUPPORTED_VERSIONS
from protocol.status import UNSUPPORTED_VERSION

log = logging.getLogger(__name__)


class Presence:
    """Records the statuses of known clients; ``known`` starts as the enrolled, allow-listed
    and ever-accepted clients, and grows by :meth:`know` as updates are accepted."""

    def __init__(
        self,
        *,
        config: CoordinatorConfig,
        store: Store,
        metrics: Metrics,
        rejections: Rejections,
        known: Iterable[str],
        clock: Callable[[], float],
        on_status: Callable[[Status], None] | None = None,
    ) -> None:
        """``on_status`` hears every status stored (the run and round it reports)."""
        self.config = config
        self._on_status = on_status
        self._store = store
        self._metrics = metrics
        self._rejections = rejections
        self._clock = clock
        self._known = set(known)
        # What the log last said of each client: a persistent session replays queued
        # status messages after a restart, and repeating "offline" for each says nothing.
        self._logged: dict[str, tuple[str, str]] = {}

    def know(self, client: str) -> None:
        """``client`` had an update accepted: its statuses are stored from now on."""
        self._known.add(client)

    def record(
        self, payload: bytes | bytearray, *, topic_client: str | None = None
    ) -> Status | None:
        """Store one status payload; None (and counted) when it is refused."""
        try:
            status = Status.from_wire(payload, max_bytes=self.config.mqtt.max_payload_bytes)
        except UnsupportedVersion as exc:
            self._rejections.count("status_version")
            self._say_version(topic_client, exc.version)
            return None
        except ProtocolError as exc:
            self._rejections.count(f"status_{exc.reason}")
            return None
        if status.wire_version < PROTOCOL_VERSION and self.config.protocol.previous_refused(
            self._clock()
        ):
            self._rejections.count("status_version")
            self._say_version(status.client, status.wire_version)
            return None
        if status.fleet != self.config.fleet or (
            topic_client is not None and status.client != topic_client
        ):
            self._rejections.count("status_mismatch")
            return None
        if status.client not in self._known:
            # Counted, not stored: invented ids would otherwise fill the clients table
            # (and the online gauge) for good.
            self._rejections.count("status_unknown_client")
            return None
        self._store.record_status(
            status.client,
            state=status.state.value,
            version=status.version,
            last_round=status.last_round,
            reason=status.reason,
            at=self._clock(),
            protocol=status.wire_version,
        )
        self.update_online()
        if self._on_status is not None:
            self._on_status(status)
        said = (status.state.value, status.reason or "-")
        if self._logged.get(status.client) != said:
            self._logged[status.client] = said
            if status.reason.startswith(UNSUPPORTED_VERSION):
                log.warning(
                    "client %s cannot read this coordinator's announcements: upgrade it, or "
                    "announce a version it reads ([protocol] announce_version) (%s)",
                    status.client,
                    status.reason,
                )
            elif status.reason.startswith(BAD_COORDINATOR_SIGNATURE):
                log.warning(
                    "client %s refuses this coordinator's announcements as not signed by the "
                    "key it pinned: is security.key the fleet's coordinator key? (%s)",
                    status.client,
                    status.reason,
                )
            else:
                log.info("client %s is %s (%s)", status.client, *said)
        return status

    def _say_version(self, client: str | None, version: int | None) -> None:
        """Name a device whose status is of a version not read here, once per version."""
        said = ("version", str(version))
        if client is None or self._logged.get(client) == said:
            return
        self._logged[client] = said
        log.warning(
            "client %s sends protocol version %s, which this coordinator does not read "
            "(it reads %s): its statuses and updates are refused until it is upgraded",
            client,
            version,
            " and ".join(map(str, self._versions())),
        )

    def _versions(self) -> tuple[int, ...]:
        if self.config.protocol.previous_refused(self._clock()):
            return (PROTOCOL_VERSION,)
        return SUPPORTED_VERSIONS

    def update_online(self) -> None:
        """The online gauges: devices whose last status is online and fresher than
        ``rounds.online_ttl_s`` (devices restate it every round), and of those, the ones
        that refuse this coordinator's signature."""
        since = self._clock() - self.config.rounds.online_ttl_s
        self._metrics.clients_online.set(self._store.online_count(since=since))
        self._metrics.clients_rejecting_announcements.set(len(self.rejecting(since=since)))
        self._metrics.clients_unsupported_version.set(
            len(self._store.unsupported_version(since=since))
        )
        self._metrics.clients_previous_version.set(len(self._store.previous_version()))

    def rejecting(self, *, since: float) -> list[str]:
        """Online devices that refuse this coordinator's announcements' signature."""
        return self._store.refusing_signature(since=since)
