"""A fake cloud metadata service on 127.0.0.1, both flavours on one port: EC2's IMDSv2 and Compute Engine's metadata
server, as strict as the real ones about what a client sends, so that a client that passes here speaks the protocol.

AWS (IMDSv2 only, as an instance with `HttpTokens: required`):
- `PUT /latest/api/token` needs `X-aws-ec2-metadata-token-ttl-seconds`, a whole number of 1 to 21600, else 400; a
  request with `X-Forwarded-For` is 403; any other method is 405. The token is good for that many seconds.
- `GET /latest/meta-data/...` without `X-aws-ec2-metadata-token`, or with one that is unknown or expired, is 401.
- `/latest/meta-data/spot/instance-action` is 404 until armed, then 200 with {"action", "time"}.

GCE:
- `/computeMetadata/v1/...` without `Metadata-Flavor: Google`, or with `X-Forwarded-For`, is 403; answers carry
  `Metadata-Flavor: Google` and an ETag.
- `instance/preempted` is FALSE until armed, then TRUE. `?wait_for_change=true` holds the request until the value's
  ETag differs from `last_etag` (at once when it already does) or `timeout_sec` passes.

Every request is kept (`requests`), every refusal with its reason (`refused`).
"""
from __future__ import annotations

import hashlib
import json
import secrets
import threading
import time
import urllib.parse
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


@dataclass(frozen=True)
class Seen:
    method: str
    path: str
    headers: dict[str, str]
    status: int
    reason: str = ""


class FakeMetadata:
    MAX_TTL = 21600

    def __init__(self) -> None:
        self.requests: list[Seen] = []
        self.tokens: dict[str, float] = {}  # token: monotonic expiry
        self.instance_action: dict | None = None
        self.preempted = False
        self.closing = False
        self.held = 0  # GCE long polls waiting for a change now
        self.changed = threading.Condition()  # the GCE value changed, or the server is closing
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self.server.daemon_threads = True
        # A short poll: shutdown() waits for it, once a test.
        self.thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    @property
    def refused(self) -> list[Seen]:
        return [seen for seen in self.requests if seen.status in (400, 401, 403, 405)]

    def __enter__(self) -> "FakeMetadata":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        with self.changed:  # long polls in flight return now
            self.closing = True
            self.changed.notify_all()
        self.server.shutdown()
        self.server.server_close()

    def arm_aws(self, action: str = "terminate", seconds_ahead: int = 120) -> None:
        due = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(time.time() + seconds_ahead))
        self.instance_action = {"action": action, "time": due}

    def arm_gce(self) -> None:
        with self.changed:
            self.preempted = True
            self.changed.notify_all()

    def disarm(self) -> None:
        with self.changed:
            self.instance_action, self.preempted = None, False
            self.changed.notify_all()

    def gce_etag(self, preempted: bool | None = None) -> str:
        """The ETag of `instance/preempted`'s value (by default, the current one)."""
        value = self.preempted if preempted is None else preempted
        return hashlib.sha256(str(value).encode()).hexdigest()[:16]


def _handler(fake: FakeMetadata) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args) -> None:  # the tests read `requests` instead
            pass

        def do_PUT(self) -> None:
            self._route("PUT")

        def do_GET(self) -> None:
            self._route("GET")

        def do_POST(self) -> None:
            self._route("POST")

        def _route(self, method: str) -> None:
            path = urllib.parse.urlsplit(self.path).path
            if path.startswith("/latest/"):
                self._aws(method, path)
            elif path.startswith("/computeMetadata/v1/"):
                self._gce(method, path)
            else:
                self._answer(method, 404, "Not Found")

        # ---- AWS -------------------------------------------------------------------------------------------

        def _aws(self, method: str, path: str) -> None:
            if self.headers.get("X-Forwarded-For"):
                return self._answer(method, 403, "Forbidden", "X-Forwarded-For is refused")
            if path == "/latest/api/token":
                return self._token(method)
            token = self.headers.get("X-aws-ec2-metadata-token")
            if method != "GET":
                return self._answer(method, 405, "Method Not Allowed")
            if token is None:
                return self._answer(method, 401, "Unauthorized", "no token (IMDSv1 is off)")
            if fake.tokens.get(token, 0.0) <= time.monotonic():
                return self._answer(method, 401, "Unauthorized", "token unknown or expired")
            if path == "/latest/meta-data/spot/instance-action" and fake.instance_action is not None:
                return self._answer(method, 200, json.dumps(fake.instance_action), content_type="application/json")
            self._answer(method, 404, "Not Found")

        def _token(self, method: str) -> None:
            if method != "PUT":
                return self._answer(method, 405, "Method Not Allowed")
            ttl = self.headers.get("X-aws-ec2-metadata-token-ttl-seconds")
            if ttl is None or not ttl.isdigit() or not 1 <= int(ttl) <= FakeMetadata.MAX_TTL:
                return self._answer(method, 400, "Bad Request", f"token TTL header {ttl!r}")
            token = secrets.token_urlsafe(32)
            fake.tokens[token] = time.monotonic() + int(ttl)
            self._answer(method, 200, token, extra={"X-aws-ec2-metadata-token-ttl-seconds": ttl})

        # ---- GCE -------------------------------------------------------------------------------------------

        def _gce(self, method: str, path: str) -> None:
            if self.headers.get("Metadata-Flavor") != "Google" or self.headers.get("X-Forwarded-For"):
                return self._answer(method, 403, "Missing Metadata-Flavor:Google header.", "no Metadata-Flavor")
            if method != "GET":
                return self._answer(method, 405, "Method Not Allowed")
            if path != "/computeMetadata/v1/instance/preempted":
                return self._answer(method, 404, "Not Found")
            query = urllib.parse.parse_qs(urllib.parse.urlsplit(self.path).query)
            if query.get("wait_for_change", ["false"])[0] == "true":
                last = query.get("last_etag", [None])[0]
                timeout = float(query.get("timeout_sec", ["360"])[0])
                with fake.changed:
                    fake.held += 1
                    fake.changed.wait_for(lambda: fake.closing or fake.gce_etag() != last, timeout)
                    fake.held -= 1
            with fake.changed:
                value, etag = ("TRUE" if fake.preempted else "FALSE"), fake.gce_etag()
            self._answer(method, 200, value, extra={"ETag": etag})

        def _answer(self, method: str, status: int, body: str, reason: str = "", content_type: str = "text/plain",
                    extra: dict[str, str] | None = None) -> None:
            fake.requests.append(Seen(method, self.path, dict(self.headers), status, reason))
            data = body.encode()
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(data)))
            if self.path.startswith("/computeMetadata/"):
                self.send_header("Metadata-Flavor", "Google")
            for name, value in (extra or {}).items():
                self.send_header(name, value)
            self.end_headers()
            self.wfile.write(data)

    return Handler
