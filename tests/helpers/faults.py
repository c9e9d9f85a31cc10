"""A fault injector between an S3 client and the moto server: a real TCP proxy on 127.0.0.1.

Each client connection carries one request (the proxy asks both sides for `Connection: close`), forwarded to
the server as it came. A request that matches a fault is answered `HTTP/1.1 503 Slow Down` instead, has its
response cut off after some bytes by closing the connection, (an upload) has its connection closed after some
bytes of its body, before anything reaches the server, is held for some seconds before it is forwarded (a slow
link; dropped unforwarded if the proxy stops meanwhile), or is forwarded without some of its headers (`strip`: an
S3-compatible service that ignores If-None-Match and If-Match on PUT, as the server then sees them); the first
`times` times it matches, after letting the first `skip` through. Every request
is recorded (method, target, Range header, the fault it met, the response bytes forwarded), so a test can say
what the client asked for after a failure.
"""
from __future__ import annotations

import re
import socket
import threading
from dataclasses import dataclass
from typing import Literal
from urllib.parse import urlsplit

_SLOW_DOWN = (b"<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n<Error><Code>SlowDown</Code>"
              b"<Message>Please reduce your request rate.</Message></Error>")


@dataclass
class Fault:
    kind: Literal["drop", "slow_down", "cut_upload", "delay", "strip"]
    method: str  # "GET", "PUT", ...
    target: str  # a regex searched in the request target (path and query), e.g. r"^/bucket/data\.jsonl$"
    times: int  # the first `times` matching requests meet it
    after_bytes: int = 0  # drop: bytes of the response (head included) forwarded before the connection is cut;
    # 0: the request reaches the server, its answer is lost; cut_upload: bytes of the request body read first
    skip: int = 0  # matching requests let through before the fault applies
    seconds: float = 0.0  # delay: how long the request is held before it is forwarded
    headers: tuple[str, ...] = ("if-none-match", "if-match")  # strip: the request headers removed (any case)
    met: int = 0
    passed: int = 0


@dataclass
class Seen:
    method: str
    target: str
    range: str | None
    fault: str | None
    response_bytes: int = 0


class FaultProxy:
    def __init__(self, upstream: str) -> None:
        parts = urlsplit(upstream)
        self.upstream = (parts.hostname, parts.port)
        self.faults: list[Fault] = []
        self.seen: list[Seen] = []
        self._lock = threading.Lock()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._listener.settimeout(0.2)
        self.url = f"http://127.0.0.1:{self._listener.getsockname()[1]}"
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)

    def __enter__(self) -> "FaultProxy":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stopping.set()
        self._thread.join(5)
        self._listener.close()

    def requests(self, method: str, target: str) -> list[Seen]:
        """The recorded requests of `method` whose target matches the regex, in order."""
        with self._lock:
            return [seen for seen in self.seen if seen.method == method and re.search(target, seen.target)]

    def _serve(self) -> None:
        while not self._stopping.is_set():
            try:
                client, _ = self._listener.accept()
            except (TimeoutError, OSError):
                continue
            threading.Thread(target=self._handle, args=(client,), daemon=True).start()

    def _match(self, method: str, target: str) -> Fault | None:
        with self._lock:
            for fault in self.faults:
                if fault.method == method and re.search(fault.target, target) and fault.met < fault.times:
                    if fault.passed < fault.skip:
                        fault.passed += 1
                        return None
                    fault.met += 1
                    return fault
        return None

    def _handle(self, client: socket.socket) -> None:
        with client:
            head, rest = _read_head(client)
            if head is None:
                return
            method, target, headers = _parse(head)
            fault = self._match(method, target)
            seen = Seen(method, target, headers.get("range"), fault.kind if fault else None)
            with self._lock:
                self.seen.append(seen)
            if fault is not None and fault.kind == "slow_down":
                _drain_body(client, headers, rest)
                client.sendall(b"HTTP/1.1 503 Slow Down\r\nContent-Type: application/xml\r\nConnection: close\r\n"
                               b"Content-Length: %d\r\n\r\n%s" % (len(_SLOW_DOWN), _SLOW_DOWN))
                return
            if fault is not None and fault.kind == "cut_upload":
                if headers.get("expect", "").lower() == "100-continue":
                    client.sendall(b"HTTP/1.1 100 Continue\r\n\r\n")
                part = min(fault.after_bytes, int(headers.get("content-length", "1")) - 1)
                _drain_body(client, {"content-length": str(part)}, rest)
                client.shutdown(socket.SHUT_RDWR)  # the connection dies mid-body: the server never sees it
                return
            if fault is not None and fault.kind == "delay":
                if self._stopping.wait(fault.seconds):
                    return  # the proxy stopped first: the request never reaches the server
                fault = None
            if headers.get("expect", "").lower() == "100-continue":
                # Answered here, so that the server's stream holds the final response alone: `after_bytes`
                # counts its bytes, and 0 cuts it off whole after the request has reached the server.
                client.sendall(b"HTTP/1.1 100 Continue\r\n\r\n")
            if fault is not None and fault.kind == "strip":
                head, fault = _without(head, fault.headers), None
            limit = fault.after_bytes if fault is not None else None
            self._forward(client, _rewrite(head) + rest, seen, limit)

    def _forward(self, client: socket.socket, request: bytes, seen: Seen, limit: int | None) -> None:
        with socket.create_connection(self.upstream, timeout=30) as upstream:
            upstream.sendall(request)
            # The rest of the request body (after a 100 Continue, say) flows on while the response comes back.
            threading.Thread(target=_pump, args=(client, upstream), daemon=True).start()
            while chunk := upstream.recv(65536):
                if limit is not None and seen.response_bytes + len(chunk) >= limit:
                    client.sendall(chunk[: limit - seen.response_bytes])
                    seen.response_bytes = limit
                    client.shutdown(socket.SHUT_RDWR)  # cut off mid-response, as a dropped connection is
                    return
                client.sendall(chunk)
                seen.response_bytes += len(chunk)


def _read_head(sock: socket.socket) -> tuple[bytes | None, bytes]:
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            return None, b""
        data += chunk
    head, _, rest = data.partition(b"\r\n\r\n")
    return head + b"\r\n\r\n", rest


def _parse(head: bytes) -> tuple[str, str, dict[str, str]]:
    request_line, *lines = head.decode("latin-1").split("\r\n")
    method, target, _ = request_line.split(" ", 2)
    headers = {}
    for line in lines:
        name, sep, value = line.partition(":")
        if sep:
            headers[name.strip().lower()] = value.strip()
    return method, target, headers


def _rewrite(head: bytes) -> bytes:
    """The request head with `Connection: close` (one request a connection, so each meets its own fate), and
    without `Expect` (the proxy has answered it)."""
    lines = [line for line in head.split(b"\r\n")
             if line and not line.lower().startswith((b"connection:", b"expect:"))]
    return b"\r\n".join(lines + [b"Connection: close"]) + b"\r\n\r\n"


def _without(head: bytes, names: tuple[str, ...]) -> bytes:
    """The request head without the named headers (moto checks no signature, so the rest of the request stands)."""
    prefixes = tuple(name.lower().encode() + b":" for name in names)
    return b"\r\n".join(line for line in head.split(b"\r\n") if not line.lower().startswith(prefixes))


def _drain_body(sock: socket.socket, headers: dict[str, str], rest: bytes) -> None:
    """Read the request body before answering, unless the client waits for a 100 Continue that never comes."""
    if headers.get("expect", "").lower() == "100-continue":
        return
    remaining = int(headers.get("content-length", "0")) - len(rest)
    while remaining > 0 and (chunk := sock.recv(min(remaining, 65536))):
        remaining -= len(chunk)


def _pump(source: socket.socket, sink: socket.socket) -> None:
    try:
        while chunk := source.recv(65536):
            sink.sendall(chunk)
    except OSError:
        pass  # either side closed: the exchange is over
