"""The stage messages on the wire: encoded and signed on the way out, decoded and checked on
the way in, with the fleet's keys.

A device signs its messages with its own key, and the coordinator takes one only under
that device's enrolled key; the coordinator signs each message with its key, and a device
takes one only under the coordinator key it pinned. Both sign for the coordinator run the
caller names (:func:`protocol.auth.sign`), so a message of another run, round or recipient
does not verify. A fleet that runs insecure (no signer) neither signs nor checks.

What fails its check is dropped and counted by reason, never raised: decoding happens on
the links' worker threads, and a hostile payload must cost a counter, not a thread. The
reasons are those the coordinator already counts updates by: the decoder's
(:attr:`protocol.errors.ProtocolError.reason`: ``too_large``, ``malformed``,
``version``, ``field``...), ``kind`` (not a stage message this side takes),
``client_mismatch`` (a device's message on another device's topic, or a coordinator's
message for another device), ``wrong_fleet``, and those of
:func:`protocol.auth.signature_problem` (``unsigned``, ``unenrolled``, ``wrong_run``,
``bad_signature``).
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
from collections.abc import Mapping
from types import MappingProxyType
from typing import TypeVar

from protocol.auth import Signer, Verifier, sign, signature_problem
from protocol.codec import unpack
from protocol.errors import ProtocolError
from protocol.ids import validate_id
from protocol.limits import DEFAULT_MAX_PAYLOAD_BYTES
from secagg.consistency import Consistency, Signatures, Survivors
from secagg.messages import (
    Abort,
    Advertise,
    Close,
    MaskedInput,
    RelayedShares,
    Roster,
    SecAggMessage,
    ShareKeys,
    Unmask,
)

log = logging.getLogger(__name__)

M = TypeVar("M", bound=SecAggMessage)

#: What a device sends and the coordinator takes, by wire ``type``.
DEVICE_KINDS: Mapping[str, type[SecAggMessage]] = MappingProxyType(
    {m.KIND: m for m in (Advertise, ShareKeys, MaskedInput, Consistency, Unmask)}
)
#: What the coordinator sends and a device takes, by wire ``type``.
COORDINATOR_KINDS: Mapping[str, type[SecAggMessage]] = MappingProxyType(
    {m.KIND: m for m in (Roster, RelayedShares, Survivors, Signatures, Close, Abort)}
)


class Drops:
    """Messages dropped, counted by reason (thread-safe). Each reason is logged at its 1st,
    2nd, 4th, 8th... drop: a flood of forgeries stays readable in the log."""

    def __init__(self, *, logger: logging.Logger = log) -> None:
        self._log = logger
        self._lock = threading.Lock()
        self._counts: Counter[str] = Counter()

    def add(self, reason: str, what: str) -> None:
        with self._lock:
            self._counts[reason] += 1
            count = self._counts[reason]
        if count & (count - 1) == 0:
            self._log.warning("dropped %s: %s (%d so far)", what, reason, count)

    def counts(self) -> dict[str, int]:
        with self._lock:
            return dict(self._counts)


class _Wire:
    """What both sides share: sign what goes out, decode and check what comes in."""

    def __init__(
        self,
        *,
        fleet: str,
        run: str,
        signer: Signer | None,
        takes: Mapping[str, type[SecAggMessage]],
        max_bytes: int,
        logger: logging.Logger,
    ) -> None:
        self.fleet = validate_id(fleet, field="fleet")
        self.run = validate_id(run, field="run")
        self.signer = signer
        self.max_bytes = max_bytes
        self.drops = Drops(logger=logger)
        self._takes = takes

    @property
    def insecure(self) -> bool:
        return self.signer is None

    def encode(self, message: SecAggMessage) -> bytes:
        """``message``'s payload, signed for the run unless the fleet runs insecure."""
        if self.signer is not None:
            message = sign(message, self.signer, run=self.run)
        return message.to_wire()

    def _decode(self, payload: bytes, *, where: str) -> SecAggMessage | None:
        try:
            kind = unpack(payload, max_bytes=self.max_bytes).get("type")
            cls = self._takes.get(kind) if isinstance(kind, str) else None
            if cls is None:
                self.drops.add("kind", f"a message of type {kind!r} {where}")
                return None
            return cls.from_wire(payload, max_bytes=self.max_bytes)
        except ProtocolError as exc:
            self.drops.add(exc.reason, f"a message {where} ({exc})")
            return None

    def _problem(self, message: SecAggMessage, verifier: Verifier | None) -> str | None:
        if message.fleet != self.fleet:
            return "wrong_fleet"
        if self.insecure:
            return None
        return signature_problem(message, verifier, run=self.run)


class CoordinatorWire(_Wire):
    """The coordinator's side: signs with ``signer`` (None: the fleet runs insecure) and
    takes a device's message only under its key in ``devices`` (the enrolled keys)."""

    def __init__(
        self,
        *,
        fleet: str,
        run: str,
        signer: Signer | None,
        devices: Mapping[str, Verifier],
        max_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES,
        logger: logging.Logger = log,
    ) -> None:
        super().__init__(
            fleet=fleet,
            run=run,
            signer=signer,
            takes=DEVICE_KINDS,
            max_bytes=max_bytes,
            logger=logger,
        )
        self.devices = MappingProxyType(dict(devices))

    def decode(self, payload: bytes, *, sender: str) -> SecAggMessage | None:
        """The device message in ``payload``, which arrived on ``sender``'s topic, or None
        (dropped and counted) unless it is well formed, names ``sender`` and is signed by
        its enrolled key."""
        where = f"on the secure-aggregation topic of {sender}"
        message = self._decode(payload, where=where)
        if message is None:
            return None
        problem = "client_mismatch" if message.client != sender else None
        problem = problem or self._problem(message, self.devices.get(sender))
        if problem is not None:
            self.drops.add(problem, f"a {message.KIND} {where}")
            return None
        return message

    def receipt_round(self, client: str, payload: bytes) -> int | None:
        """The round of ``client``'s input that ``payload`` shows the fleet's sum holding:
        this coordinator's own signed :class:`Close` (summed) or :class:`Abort` (``holds``)
        to ``client``, of this run; None for anything else (an insecure fleet's are not
        signed, so any well-formed one is taken)."""
        try:
            kind = unpack(payload, max_bytes=self.max_bytes).get("type")
            kinds: dict[object, type[Close] | type[Abort]] = {Close.KIND: Close, Abort.KIND: Abort}
            cls = kinds.get(kind)
            message = None if cls is None else cls.from_wire(payload, max_bytes=self.max_bytes)
        except ProtocolError:
            return None
        if message is None or message.client != client:
            return None
        if self._problem(message, None if self.signer is None else self.signer.public):
            return None
        if isinstance(message, Close):
            return message.round if message.summed else None
        assert isinstance(message, Abort)
        return message.holds if message.holds is not None and message.holds >= 0 else None


class DeviceWire(_Wire):
    """Device ``client``'s side: signs with ``signer`` (None: the fleet runs insecure) and
    takes the coordinator's message only under ``coordinator``, the key it pinned."""

    def __init__(
        self,
        *,
        fleet: str,
        client: str,
        run: str,
        signer: Signer | None,
        coordinator: Verifier | None,
        max_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES,
        logger: logging.Logger = log,
    ) -> None:
        if signer is not None and coordinator is None:
            raise ValueError("a device that signs needs the coordinator's key to check it")
        super().__init__(
            fleet=fleet,
            run=run,
            signer=signer,
            takes=COORDINATOR_KINDS,
            max_bytes=max_bytes,
            logger=logger,
        )
        self.client = validate_id(client, field="client")
        self.coordinator = coordinator

    def decode(self, payload: bytes) -> SecAggMessage | None:
        """The coordinator's message in ``payload``, or None (dropped and counted) unless it
        is well formed, addressed to this device and signed by the pinned key."""
        where = f"for {self.client}"
        message = self._decode(payload, where=where)
        if message is None:
            return None
        problem = "client_mismatch" if message.client != self.client else None
        problem = problem or self._problem(message, self.coordinator)
        if problem is not None:
            self.drops.add(problem, f"a {message.KIND} {where}")
            return None
        return message
