"""A TCP proxy for the tests: forwards 127.0.0.1:port to a learner, and breaks connections on
demand (drop every open connection, refuse new ones for a while, cut the first connection after
N bytes upstream) so that the client's resume and retry paths meet real broken streams."""

from __future__ import annotations

import socket
import struct
import threading


def _reset(sock: socket.socket) -> None:
    """Closes `sock` with an RST (SO_LINGER 0), as a dropped connection looks."""
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    except OSError:
        pass
    try:
        sock.close()
    except OSError:
        pass


class TcpProxy:
    """127.0.0.1:<port> -> `upstream` ("HOST:PORT"). Thread-safe; close() stops it."""

    def __init__(self, upstream: str, cut_first_after_bytes: int | None = None) -> None:
        host, port = upstream.rsplit(":", 1)
        self._upstream = (host, int(port))
        self._cut_after = cut_first_after_bytes
        self._lock = threading.Lock()
        self._conns: list[tuple[socket.socket, socket.socket]] = []
        self._refusing = False
        self._closed = False
        self.accepted = 0  # connections accepted (refused ones included)
        self.cuts = 0  # connections cut by cut_first_after_bytes
        self._listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind(("127.0.0.1", 0))
        self._listener.listen(64)
        self.port = self._listener.getsockname()[1]
        self.address = f"127.0.0.1:{self.port}"
        threading.Thread(target=self._accept, daemon=True).start()

    def drop_all(self) -> int:
        """Resets every open connection; how many there were."""
        with self._lock:
            conns, self._conns = self._conns, []
        for a, b in conns:
            _reset(a)
            _reset(b)
        return len(conns)

    def refuse(self, on: bool) -> None:
        """While on, new connections are reset at once (the learner looks unreachable)."""
        with self._lock:
            self._refusing = on

    def close(self) -> None:
        with self._lock:
            self._closed = True
        try:
            self._listener.close()
        except OSError:
            pass
        self.drop_all()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            with self._lock:
                self.accepted += 1
                first = self.accepted == 1
                if self._closed or self._refusing:
                    _reset(client)
                    continue
            try:
                server = socket.create_connection(self._upstream, timeout=10)
                server.settimeout(None)
            except OSError:
                _reset(client)
                continue
            with self._lock:
                self._conns.append((client, server))
            limit = self._cut_after if first else None
            threading.Thread(target=self._pump, args=(client, server, limit), daemon=True).start()
            threading.Thread(target=self._pump, args=(server, client, None), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, limit: int | None) -> None:
        sent = 0
        try:
            while True:
                data = src.recv(65536)
                if not data:
                    break
                if limit is not None and sent + len(data) > limit:
                    dst.sendall(data[: max(0, limit - sent)])
                    with self._lock:
                        self.cuts += 1
                    break
                dst.sendall(data)
                sent += len(data)
        except OSError:
            pass
        _reset(src)
        _reset(dst)
        with self._lock:
            self._conns = [c for c in self._conns if src not in c and dst not in c]
