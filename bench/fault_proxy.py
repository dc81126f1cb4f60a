"""A TCP proxy between some devices and the broker, for the fault matrix
(bench/fault_matrix_bench.py): it adds latency to every chunk each way, or partitions its
devices from the broker (drops their connections and refuses new ones) until healed."""

from __future__ import annotations

import contextlib
import socket
import threading
import time


class FaultProxy:
    """Listens on a free loopback port and forwards to ``target``."""

    def __init__(self, target: tuple[str, int], *, delay_s: float = 0.0) -> None:
        self.target = target
        self.delay_s = delay_s
        self._server = socket.create_server(("127.0.0.1", 0))
        self.port = self._server.getsockname()[1]
        self._lock = threading.Lock()
        self._open: list[socket.socket] = []
        self._partitioned = False
        self._closing = False
        threading.Thread(target=self._accept, daemon=True).start()

    def partition(self) -> None:
        """Cut every connection through here and refuse new ones until :meth:`heal`."""
        with self._lock:
            self._partitioned = True
            sockets, self._open = self._open, []
        for sock in sockets:
            _close(sock)

    def heal(self) -> None:
        with self._lock:
            self._partitioned = False

    def close(self) -> None:
        self._closing = True
        self.partition()
        _close(self._server)

    def _accept(self) -> None:
        while not self._closing:
            try:
                client, _ = self._server.accept()
            except OSError:
                return
            with self._lock:
                refused = self._partitioned
            if refused:
                _close(client)
                continue
            try:
                upstream = socket.create_connection(self.target, timeout=5)
            except OSError:
                _close(client)
                continue
            upstream.settimeout(None)
            with self._lock:
                self._open += [client, upstream]
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    def _pump(self, source: socket.socket, sink: socket.socket) -> None:
        try:
            while True:
                data = source.recv(65536)
                if not data:
                    break
                if self.delay_s:
                    time.sleep(self.delay_s)  # the added latency itself
                sink.sendall(data)
        except OSError:
            pass
        _close(source)
        _close(sink)


def _close(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)
    sock.close()
