"""A paho client that reads its socket in bulk.

paho reads one packet per ``select()``, in three or more ``recv()`` calls (the first
byte, the length a byte at a time, the rest), and sends every PUBACK on its own, waking
its loop through a socket pair each time: about 100 microseconds a message here, which
caps a paho consumer at about 10,000 messages a second. A coordinator under a junk flood
must reject faster than that, or the broker's queue for it overflows and drops honest
updates with the junk.

:class:`BulkReadClient` replaces only the reading: one ``recv()`` of up to
``READ_BYTES`` per call, every complete packet in it handled, QoS 0/1 PUBLISH packets
of MQTT 3.1.1 decoded here (paho's own handler takes every other packet, unchanged), and
the PUBACKs of a batch sent as one write. Callbacks, acknowledgement rules (automatic or
``manual_ack``), reconnects, TLS and keep-alive stay paho's. It reaches into a few of
paho's private members: :func:`supported` checks them, and
:func:`runtime.mqtt_link.make_client` falls back to the plain client (saying so once)
should a paho release rename them.
"""

from __future__ import annotations

import functools
import logging
import ssl
import struct
import threading
import time
from typing import Any

import paho.mqtt
import paho.mqtt.client as mqtt
from paho.mqtt.exception import MalformedPacket

log = logging.getLogger(__name__)

READ_BYTES = 1 << 16
_PUBLISH = 0x30
_PUBACK = 0x40
#: paho's members this module relies on; checked before the class is used.
_PAHO_MEMBERS = (
    "_sock", "_in_packet", "_packet_handle", "_loop_rc_handle", "_handle_on_message",
    "_packet_queue", "_send_puback", "_manual_ack", "_protocol", "_msgtime_mutex",
    "_last_bytes_received",
)  # fmt: skip
_ACK = struct.Struct("!BBH")


@functools.cache
def supported() -> bool:
    """Whether the installed paho has every member :class:`BulkReadClient` uses."""
    probe = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, protocol=mqtt.MQTTv311)
    missing = [name for name in _PAHO_MEMBERS if not hasattr(probe, name)]
    if missing:
        log.warning(
            "paho-mqtt %s lacks %s: reading one packet at a time (slower under floods)",
            getattr(paho.mqtt, "__version__", "?"), ", ".join(missing),
        )  # fmt: skip
    return not missing


def client_class() -> type[mqtt.Client]:
    """:class:`BulkReadClient` where the installed paho supports it, else paho's own."""
    return BulkReadClient if supported() else mqtt.Client


def split_packet(buf: bytes | bytearray, pos: int) -> tuple[int, int, int] | None:
    """(first byte, body start, body end) of the packet at ``pos``, or None while it is
    incomplete. Raises ValueError for a remaining length of more than 4 bytes."""
    end = len(buf)
    if pos + 2 > end:
        return None
    length, mult, i = 0, 1, pos + 1
    while True:
        if i >= end:
            return None
        byte = buf[i]
        length += (byte & 0x7F) * mult
        i += 1
        if not byte & 0x80:
            break
        mult *= 128
        if i - pos > 4:
            raise ValueError("malformed remaining length")
    if i + length > end:
        return None
    return buf[pos], i, i + length


class BulkReadClient(mqtt.Client):
    """paho's client, reading every packet a ``recv()`` brings (see the module text)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._rx = bytearray()
        self._acks: list[bytes] = []
        self._batching = False
        self._reader: int | None = None  # the thread whose acks are batched

    def reconnect(self) -> mqtt.MQTTErrorCode:
        self._rx = bytearray()  # a packet cut off by the old connection is not resumed
        return super().reconnect()

    def loop_read(self, max_packets: int = 1) -> mqtt.MQTTErrorCode:
        sock = self._sock
        if sock is None:
            return mqtt.MQTTErrorCode.MQTT_ERR_NO_CONN
        try:
            data = sock.recv(READ_BYTES)
        except (BlockingIOError, ssl.SSLWantReadError):
            return mqtt.MQTTErrorCode.MQTT_ERR_SUCCESS
        except ssl.SSLWantWriteError:
            self._call_socket_register_write()
            return mqtt.MQTTErrorCode.MQTT_ERR_SUCCESS
        except OSError:
            return self._loop_rc_handle(mqtt.MQTTErrorCode.MQTT_ERR_CONN_LOST)
        if not data:
            return self._loop_rc_handle(mqtt.MQTTErrorCode.MQTT_ERR_CONN_LOST)
        with self._msgtime_mutex:
            self._last_bytes_received = time.monotonic()
        rx = self._rx
        rx += data
        pos = 0
        rc = mqtt.MQTTErrorCode.MQTT_ERR_SUCCESS
        self._batching, self._reader = True, threading.get_ident()
        try:
            while rc == mqtt.MQTTErrorCode.MQTT_ERR_SUCCESS and self._sock is not None:
                try:
                    found = split_packet(rx, pos)
                except ValueError:
                    rc = mqtt.MQTTErrorCode.MQTT_ERR_PROTOCOL
                    break
                if found is None:
                    break
                command, start, end = found
                pos = end
                rc = self._handle_packet(command, rx, start, end)
        finally:
            self._batching = False
            del rx[:pos]
            self._flush_acks()
        if rc != mqtt.MQTTErrorCode.MQTT_ERR_SUCCESS or self._sock is None:
            self._rx = bytearray()
            return self._loop_rc_handle(rc) if rc else mqtt.MQTTErrorCode.MQTT_ERR_NO_CONN
        return rc

    def _handle_packet(
        self, command: int, rx: bytearray, start: int, end: int
    ) -> mqtt.MQTTErrorCode:
        qos = (command & 0x06) >> 1
        if command & 0xF0 != _PUBLISH or qos > 1 or self._protocol != mqtt.MQTTv311:
            return self._paho_handle(command, bytes(rx[start:end]))
        if end - start < 2:
            return mqtt.MQTTErrorCode.MQTT_ERR_PROTOCOL
        topic_len = (rx[start] << 8) | rx[start + 1]
        at = start + 2 + topic_len
        mid = 0
        if qos:
            if at + 2 > end:
                return mqtt.MQTTErrorCode.MQTT_ERR_PROTOCOL
            mid = (rx[at] << 8) | rx[at + 1]
            at += 2
        if at > end:
            return mqtt.MQTTErrorCode.MQTT_ERR_PROTOCOL
        message = mqtt.MQTTMessage(mid=mid, topic=bytes(rx[start + 2 : start + 2 + topic_len]))
        message.dup = bool(command & 0x08)
        message.qos = qos
        message.retain = bool(command & 0x01)
        message.payload = bytes(rx[at:end])
        message.timestamp = time.monotonic()
        self._handle_on_message(message)
        if qos and not self._manual_ack:
            self._send_puback(mid)
        return mqtt.MQTTErrorCode.MQTT_ERR_SUCCESS

    def _paho_handle(self, command: int, body: bytes) -> mqtt.MQTTErrorCode:
        # paho's handlers read the packet from _in_packet, as its own reader leaves it.
        self._in_packet = {
            "command": command, "have_remaining": 1, "remaining_count": [],
            "remaining_mult": 1, "remaining_length": len(body), "packet": bytearray(body),
            "to_process": 0, "pos": 0,
        }  # fmt: skip
        try:
            return self._packet_handle()
        except MalformedPacket:
            return mqtt.MQTTErrorCode.MQTT_ERR_PROTOCOL
        finally:
            self._in_packet = {
                "command": 0, "have_remaining": 0, "remaining_count": [],
                "remaining_mult": 1, "remaining_length": 0, "packet": bytearray(b""),
                "to_process": 0, "pos": 0,
            }  # fmt: skip

    def _send_puback(self, mid: int) -> mqtt.MQTTErrorCode:
        if not self._batching or threading.get_ident() != self._reader:
            return super()._send_puback(mid)
        self._acks.append(_ACK.pack(_PUBACK, 2, mid))
        return mqtt.MQTTErrorCode.MQTT_ERR_SUCCESS

    def _flush_acks(self) -> None:
        if self._acks:
            acks, self._acks = self._acks, []
            self._packet_queue(_PUBACK, b"".join(acks), 0, 0)
