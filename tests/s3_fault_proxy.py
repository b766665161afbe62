"""A fault-injecting HTTP proxy in front of the test S3 server, for the throttling and
outage tests.

A real server under load answers ``503 SlowDown`` in bursts, fails with ``500``, drops
connections and stops answering; SeaweedFS on loopback does none of these by itself. The
proxy forwards every request to it unchanged (the ``Host`` header included, so the
request's signature still holds) and, for the requests a :class:`Fault` matches, answers
in its place *after reading the whole body*: the server never sees the request, the
client believes it was sent. It listens on loopback only, serves each connection on a
daemon thread, and stops by itself after ``lifetime`` seconds if no one stops it.
"""

from __future__ import annotations

import http.client
import random
import re
import socket
import struct
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from xml.sax.saxutils import escape

__all__ = ["Fault", "FaultProxy"]

_ERRORS = {
    503: ("SlowDown", "Please reduce your request rate."),
    500: ("InternalError", "We encountered an internal error. Please try again."),
}
_HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "expect", "proxy-connection"}


@dataclass
class Fault:
    """Answer the next ``times`` requests that match with ``kind`` instead of the server.

    Args:
        kind: ``"503"`` (SlowDown), ``"500"`` (InternalError), ``"reset"`` (the connection
            is reset, no answer), ``"cut"`` (the server's answer, its headers whole, the
            connection reset halfway through its body), ``"bare"`` (the server's answer
            as a plain ``200`` without its ``Content-Range``, as a store or proxy that
            ignores ``Range`` answers), ``"hang"`` (no answer until the
            proxy resumes or stops) or ``"late"`` (no answer ever; the request reaches the
            server after ``delay`` seconds, long after the client gave up: recorded
            ``"landed"`` then).
        delay: Seconds a ``"late"`` request is held before it is sent to the server.
        times: How many matching requests get the fault, in a row; then they pass.
        method: The HTTP method to match (``None``: any).
        path: A regular expression searched in the request's path and query.
        after: Let this many matching requests pass first.
    """

    kind: str
    times: int
    method: str | None = "PUT"
    path: str = ""
    after: int = 0
    delay: float = 0.0
    seen: int = field(default=0, init=False)

    def __post_init__(self) -> None:
        if self.kind not in ("503", "500", "reset", "cut", "bare", "hang", "late"):
            raise ValueError(
                f"Fault: kind must be 503, 500, reset, cut, bare, hang or late, got {self.kind!r}"
            )

    def take(self, method: str, path: str) -> bool:
        """Whether this request gets the fault (counts it)."""
        if self.method is not None and method != self.method:
            return False
        if not re.search(self.path, path):
            return False
        self.seen += 1
        return self.after < self.seen <= self.after + self.times


class FaultProxy:
    """The proxy in front of ``upstream_port`` on loopback; :attr:`endpoint` is its URL.

    Args:
        upstream_port: The S3 port of the real server on 127.0.0.1.
        faults: Fixed faults; each counts every request it matches, the first that takes
            one answers it.
        share: A share of all requests (0 to 1) answered by a random fault of ``kinds``.
        kinds: The kinds the random faults are drawn from.
        seed: Seed of the random faults.
        lifetime: Seconds after which the proxy stops by itself.
    """

    def __init__(
        self,
        upstream_port: int,
        faults: list[Fault] | None = None,
        *,
        share: float = 0.0,
        kinds: tuple[str, ...] = ("503",),
        seed: int = 0,
        lifetime: float = 600.0,
    ) -> None:
        self.upstream_port = upstream_port
        self.faults = list(faults or [])
        self.share = share
        self.kinds = kinds
        self.log: list[tuple[str, str, str]] = []
        """(method, path, what answered: a status or a fault kind) of every request."""
        self.ranges: list[tuple[int, str, str]] = []
        """(entries of :attr:`log` when it arrived, path, Range header) of every request
        that asked for a range."""
        self._random = random.Random(seed)
        self._lock = threading.Lock()
        self._running = threading.Event()
        self._running.set()
        self._stopped = threading.Event()
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: Any) -> None:
                """Quiet: the proxy's own :attr:`FaultProxy.log` records every request."""

            def do_GET(self) -> None:
                proxy._handle(self)

        for verb in ("PUT", "POST", "DELETE", "HEAD"):
            setattr(Handler, f"do_{verb}", Handler.do_GET)
        self._resets: set[int] = set()

        class Server(ThreadingHTTPServer):
            def shutdown_request(self, request: Any) -> None:
                """A reset connection is closed without the FIN of ``shutdown``."""
                if id(request) in proxy._resets:
                    proxy._resets.discard(id(request))
                    request.close()
                    return
                super().shutdown_request(request)

        self._server = Server(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()
        self._timer = threading.Timer(lifetime, self.stop)
        self._timer.daemon = True
        self._timer.start()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def env(self, server_env: dict[str, str]) -> dict[str, str]:
        """``server_env`` (the AWS variables of the real server) pointed at the proxy."""
        return {**server_env, "AWS_ENDPOINT_URL": self.endpoint}

    def pause(self) -> None:
        """Stop answering: every request from now on waits (until :meth:`resume`)."""
        self._running.clear()

    def resume(self) -> None:
        self._running.set()

    def stop(self) -> None:
        """Stop listening and release every waiting request (idempotent)."""
        if self._stopped.is_set():
            return
        self._stopped.set()
        self._running.set()
        self._timer.cancel()
        self._server.shutdown()
        self._server.server_close()

    def __enter__(self) -> FaultProxy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def answered(self, what: str) -> int:
        """How many requests were answered with ``what`` (a status or a fault kind)."""
        with self._lock:
            return sum(1 for _, _, answer in self.log if answer == what)

    # ------------------------------------------------------------------ internals

    def _fault_for(self, method: str, path: str) -> Fault | None:
        with self._lock:
            taken = [fault for fault in self.faults if fault.take(method, path)]  # counts all
            if taken:
                return taken[0]
            if self.share and self._random.random() < self.share:
                return Fault(self._random.choice(self.kinds), 1)
        return None

    def _record(self, method: str, path: str, answer: str) -> None:
        with self._lock:
            self.log.append((method, path, answer))

    def _handle(self, request: BaseHTTPRequestHandler) -> None:
        method, path = request.command, request.path
        body = _read_body(request)
        if (asked := request.headers.get("Range")) is not None:
            with self._lock:
                self.ranges.append((len(self.log), path, asked))
        if not self._running.is_set():
            self._record(method, path, "paused")
            self._running.wait(timeout=3600)
            request.close_connection = True
            if self._stopped.is_set():
                return
        fault = self._fault_for(method, path)
        if fault is not None and fault.kind == "late":
            self._record(method, path, "late")
            if not self._stopped.wait(timeout=fault.delay):
                status, _, _ = self._forward(request, body)
                self._record(method, path, "landed" if status == 200 else str(status))
            request.close_connection = True  # never answered: the client gave up long ago
            return
        if fault is not None and fault.kind not in ("cut", "bare"):
            self._record(method, path, fault.kind)
            _answer_fault(request, fault.kind, self)
            return
        status, headers, data = self._forward(request, body)
        self._record(method, path, str(status) if fault is None else fault.kind)
        bare = fault is not None and fault.kind == "bare"
        request.send_response(200 if bare and status == 206 else status)
        dropped = {"content-length", "content-range"} if bare else {"content-length"}
        for name, value in headers:
            if name.lower() not in _HOP_BY_HOP and name.lower() not in dropped:
                request.send_header(name, value)
        request.send_header("Content-Length", str(len(data)))
        request.end_headers()
        if method == "HEAD":
            return
        if fault is None or bare:
            request.wfile.write(data)
            return
        request.wfile.write(data[: len(data) // 2])
        request.wfile.flush()
        _answer_fault(request, "reset", self)

    def _forward(
        self, request: BaseHTTPRequestHandler, body: bytes
    ) -> tuple[int, list[tuple[str, str]], bytes]:
        connection = http.client.HTTPConnection("127.0.0.1", self.upstream_port, timeout=120)
        try:
            connection.putrequest(
                request.command, request.path, skip_host=True, skip_accept_encoding=True
            )
            for name, value in request.headers.items():
                if name.lower() not in _HOP_BY_HOP and name.lower() != "content-length":
                    connection.putheader(name, value)
            connection.putheader("Content-Length", str(len(body)))
            connection.endheaders(body)
            response = connection.getresponse()
            data = response.read()
            return response.status, response.getheaders(), data
        finally:
            connection.close()


def _read_body(request: BaseHTTPRequestHandler) -> bytes:
    """The request's whole body (``Content-Length`` or chunked)."""
    if request.headers.get("Transfer-Encoding", "").lower() == "chunked":
        chunks = []
        while True:
            size = int(request.rfile.readline().split(b";")[0].strip() or b"0", 16)
            if size == 0:
                while request.rfile.readline() not in (b"\r\n", b"\n", b""):
                    pass
                return b"".join(chunks)
            chunks.append(request.rfile.read(size))
            request.rfile.readline()
    length = int(request.headers.get("Content-Length") or 0)
    return request.rfile.read(length) if length else b""


def _answer_fault(request: BaseHTTPRequestHandler, kind: str, proxy: FaultProxy) -> None:
    if kind == "reset":
        # SO_LINGER 0: close sends RST, the client sees "connection reset by peer".
        request.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        proxy._resets.add(id(request.connection))
        request.close_connection = True
        return
    if kind == "hang":
        proxy._stopped.wait(timeout=3600)
        request.close_connection = True
        return
    code, message = _ERRORS[int(kind)]
    xml = (
        '<?xml version="1.0" encoding="UTF-8"?>\n'
        f"<Error><Code>{code}</Code><Message>{message}</Message>"
        f"<Resource>{escape(request.path)}</Resource><RequestId>{time.monotonic_ns()}</RequestId>"
        "</Error>"
    ).encode()
    request.send_response(int(kind))
    request.send_header("Content-Type", "application/xml")
    request.send_header("Content-Length", str(len(xml)))
    request.end_headers()
    request.wfile.write(xml)
