"""External APIs played over HTTP on 127.0.0.1, for clients that must not reach a real one: a Kubernetes API server
and a Docker Engine, each answering the few calls a Prefect worker makes to start a flow run, and keeping every
request it was sent."""
from __future__ import annotations

import json
import re
import threading
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Callable, Iterator
from urllib.parse import urlsplit

# (method, path) -> (status, JSON body or None); the route's match groups are passed on.
Route = tuple[str, str, Callable[..., tuple[int, object]]]


@dataclass
class Request:
    method: str
    path: str
    query: str
    body: object


@dataclass
class FakeApi:
    url: str
    requests: list[Request] = field(default_factory=list)

    def sent(self, method: str, pattern: str) -> list[Request]:
        return [r for r in self.requests if r.method == method and re.fullmatch(pattern, r.path)]


@contextmanager
def serve(routes: list[Route]) -> Iterator[FakeApi]:
    """An HTTP server answering `routes` (the first whose method and path pattern match), 404 otherwise."""
    api = FakeApi(url="")

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # keep-alive, as the clients expect

        def _answer(self):
            parts = urlsplit(self.path)
            length = int(self.headers.get("Content-Length") or 0)
            raw = self.rfile.read(length) if length else b""
            body = json.loads(raw) if raw else None
            api.requests.append(Request(self.command, parts.path, parts.query, body))
            status, answer = 404, {"kind": "Status", "status": "Failure", "reason": "NotFound", "code": 404,
                                   "message": f"{self.command} {parts.path}: not served by the fake API"}
            for method, pattern, reply in routes:
                found = re.fullmatch(pattern, parts.path)
                if method == self.command and found:
                    status, answer = reply(body, *found.groups())
                    break
            data = b"" if answer is None else json.dumps(answer).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        do_GET = do_POST = do_PUT = do_PATCH = do_DELETE = _answer

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    api.url = f"http://127.0.0.1:{server.server_port}"
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield api
    finally:
        server.shutdown()
        server.server_close()


def kubernetes_routes() -> list[Route]:
    """Jobs and Secrets created as the API server creates them: the object sent back with a name (from
    generateName), a namespace and a uid; a Secret read before it exists is a 404."""

    def created(body, namespace):
        metadata = body.setdefault("metadata", {})
        metadata.setdefault("name", metadata.get("generateName", "object-") + "x7k2p")
        metadata.update(namespace=namespace, uid="0b8e6f8e-5d4c-4d57-9a43-4c0f2f1d2a11")
        return 201, body

    return [("POST", r"/apis/batch/v1/namespaces/([^/]+)/jobs", created),
            ("POST", r"/api/v1/namespaces/([^/]+)/secrets", created)]


CONTAINER_ID = "c0ffee" * 8


def docker_routes(api_version: str = "1.45") -> list[Route]:
    """The Engine calls of creating and starting a container from an image already on the host."""
    version = {"ApiVersion": api_version, "MinAPIVersion": "1.24", "Version": "27.3.1", "Os": "linux",
               "Arch": "amd64"}
    container = {"Id": CONTAINER_ID, "Name": "/phase1a-run", "State": {"Status": "created"}, "Config": {}}
    prefix = r"(?:/v[0-9.]+)?"
    return [("GET", prefix + "/version", lambda body: (200, version)),
            ("GET", prefix + r"/images/(.+)/json", lambda body, image: (200, {"Id": "sha256:" + "ab" * 32})),
            ("POST", prefix + "/containers/create", lambda body: (201, {"Id": CONTAINER_ID, "Warnings": []})),
            ("GET", prefix + f"/containers/{CONTAINER_ID}/json", lambda body: (200, container)),
            ("POST", prefix + f"/containers/{CONTAINER_ID}/start", lambda body: (204, None))]
