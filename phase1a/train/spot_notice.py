"""Spot notices from the instance's metadata service. On a bare EC2 or GCE spot VM the reclaim is announced there,
not by a signal: a thread of the process that trains (or launches the ranks) watches it, and on a notice asks
training to stop exactly as SIGTERM does (phase1a/train/preemption.py): the step in progress ends, a checkpoint is
written and, with a store, uploaded within `checkpoint.grace_period`, counted from the notice.

- AWS, IMDSv2: `PUT /latest/api/token` with `X-aws-ec2-metadata-token-ttl-seconds` gives a session token (renewed
  at three quarters of its life, and again whenever the service refuses it: 401); `GET
  /latest/meta-data/spot/instance-action` with `X-aws-ec2-metadata-token` is 404 while no interruption is
  scheduled, then 200 with {"action": "terminate"|"stop"|"hibernate", "time": "<UTC>"}, two minutes ahead
  (hibernation: as it begins). Asked every second (AWS recommends every 5 s at least).
- GCE: `GET /computeMetadata/v1/instance/preempted` with `Metadata-Flavor: Google` answers FALSE, then TRUE once
  the VM is preempted (about 30 s before it stops). Watched by long polls: `wait_for_change=true` with the last
  ETag seen (a change between two polls still returns at once) and `timeout_sec`.

`checkpoint.spot_notice`: `auto` probes both services at the start of training, in the background (training
does not wait for it), with a short timeout, and watches the one that answers as itself; where neither does (a
laptop, a CI machine, a Kubernetes pod without access) the probe ends within a second and nothing else happens.
`aws` or `gce` watch that service whatever the probe says (its failures are logged); `off` watches nothing.
The addresses: PHASE1A_AWS_METADATA_URL and PHASE1A_GCE_METADATA_URL (plain http://host[:port]).
"""
from __future__ import annotations

import http.client
import json
import os
import threading
import time
import urllib.parse
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from phase1a.core.logs import run_logger
from phase1a.train.preemption import StopRequest
from phase1a.train.run_files import append_event

AWS_URL, AWS_DEFAULT = "PHASE1A_AWS_METADATA_URL", "http://169.254.169.254"
GCE_URL, GCE_DEFAULT = "PHASE1A_GCE_METADATA_URL", "http://metadata.google.internal"
PROBE_SECONDS = 0.5  # connect and answer: a link-local service answers in milliseconds where there is one
AWS_POLL_SECONDS = 1.0
GCE_WAIT_SECONDS = 60  # one long poll's timeout_sec; it returns at once when `preempted` changes
TOKEN_TTL_SECONDS = 21600  # an IMDSv2 token's life: the most AWS gives, as botocore asks
_FAILURES = (OSError, http.client.HTTPException)  # refused, unreachable, timed out, a broken answer


class MetadataUnavailable(RuntimeError):
    """The service answered, but not as the service it should be (a refusal, an unexpected status or body)."""


@dataclass(frozen=True)
class Notice:
    provider: str  # aws | gce
    action: str | None  # AWS: terminate, stop or hibernate; GCE: preempted
    action_time: str | None  # when the action is due (AWS's `time`, UTC); GCE says none

    def describe(self) -> str:
        due = f" at {self.action_time}" if self.action_time else ""
        return f"the {self.provider.upper()} spot notice ({self.action}{due})"


@dataclass(frozen=True)
class _Answer:
    status: int
    headers: http.client.HTTPMessage
    body: str


class _Service:
    """A metadata service's address. Plain HTTP and no proxy: a link-local address is never behind one, and an
    HTTP_PROXY in the environment would send the token request elsewhere."""

    def __init__(self, url: str) -> None:
        parts = urllib.parse.urlsplit(url)
        if parts.scheme != "http" or not parts.hostname:
            raise ValueError(f"{url!r} is not an address of the form http://host[:port]")
        self.url, self.host, self.port = url.rstrip("/"), parts.hostname, parts.port or 80
        self.root = parts.path.rstrip("/")

    def call(self, method: str, path: str, headers: dict[str, str], timeout: float) -> _Answer:
        connection = http.client.HTTPConnection(self.host, self.port, timeout=timeout)
        try:
            connection.request(method, self.root + path, headers=headers)
            response = connection.getresponse()
            return _Answer(response.status, response.headers, response.read().decode("utf-8", "replace"))
        finally:
            connection.close()


class AwsNotices:
    """EC2's instance metadata service, version 2 (session tokens)."""

    provider, pause_seconds = "aws", AWS_POLL_SECONDS
    TOKEN_PATH, ACTION_PATH = "/latest/api/token", "/latest/meta-data/spot/instance-action"

    def __init__(self, url: str, token_ttl: int = TOKEN_TTL_SECONDS) -> None:
        self.service, self.token_ttl = _Service(url), token_ttl
        self._token: str | None = None
        self._token_at = 0.0
        self.tokens = 0  # session tokens taken

    def _fresh_token(self, timeout: float) -> str:
        if self._token is None or time.monotonic() - self._token_at >= 0.75 * self.token_ttl:
            asked_at = time.monotonic()  # the token's life counts from before the request, to be safe
            answer = self.service.call("PUT", self.TOKEN_PATH,
                                       {"X-aws-ec2-metadata-token-ttl-seconds": str(self.token_ttl)}, timeout)
            if answer.status != 200 or not answer.body.strip():
                raise MetadataUnavailable(f"{self.service.url}{self.TOKEN_PATH}: HTTP {answer.status} for a token")
            self._token, self._token_at, self.tokens = answer.body.strip(), asked_at, self.tokens + 1
        return self._token

    def probe(self, timeout: float) -> bool:
        """Only IMDSv2 hands out a token for a PUT with the TTL header: GCE's service and others answer no."""
        self._fresh_token(timeout)
        return True

    def check(self, timeout: float) -> Notice | None:
        for _ in range(2):
            answer = self.service.call("GET", self.ACTION_PATH,
                                       {"X-aws-ec2-metadata-token": self._fresh_token(timeout)}, timeout)
            if answer.status != 401:
                break
            self._token = None  # expired early, or the service forgot it: take a new one and ask again
        if answer.status == 404:
            return None
        where = f"{self.service.url}{self.ACTION_PATH}"
        if answer.status != 200:
            raise MetadataUnavailable(f"{where}: HTTP {answer.status}")
        try:
            action = json.loads(answer.body)
            return Notice("aws", str(action["action"]), action.get("time"))
        except (ValueError, KeyError, TypeError):
            raise MetadataUnavailable(f"{where}: not an instance action: {answer.body[:200]!r}") from None


class GceNotices:
    """Compute Engine's metadata server."""

    provider, pause_seconds = "gce", 0.0  # the long poll does the waiting
    PATH = "/computeMetadata/v1/instance/preempted"
    HEADERS = {"Metadata-Flavor": "Google"}

    def __init__(self, url: str, wait_seconds: int = GCE_WAIT_SECONDS) -> None:
        self.service, self.wait_seconds = _Service(url), wait_seconds
        self._etag = "0"  # as Google's own example starts: the first long poll returns at once, with the value

    def probe(self, timeout: float) -> bool:
        """The server says who it is: its answers carry `Metadata-Flavor: Google`."""
        answer = self.service.call("GET", self.PATH, self.HEADERS, timeout)
        return answer.status == 200 and answer.headers.get("Metadata-Flavor") == "Google"

    def check(self, timeout: float) -> Notice | None:
        query = urllib.parse.urlencode({"wait_for_change": "true", "last_etag": self._etag,
                                        "timeout_sec": self.wait_seconds})
        answer = self.service.call("GET", f"{self.PATH}?{query}", self.HEADERS, self.wait_seconds + timeout)
        if answer.status != 200:  # 503: the server is busy, Google's example asks again
            raise MetadataUnavailable(f"{self.service.url}{self.PATH}: HTTP {answer.status}")
        self._etag = answer.headers.get("ETag", "0")
        value = answer.body.strip().upper()
        if value not in ("TRUE", "FALSE"):
            raise MetadataUnavailable(f"{self.service.url}{self.PATH}: {answer.body[:200]!r}, not TRUE or FALSE")
        return Notice("gce", "preempted", None) if value == "TRUE" else None


def clients_for(mode: str, environ: Mapping[str, str] = os.environ) -> list[AwsNotices | GceNotices]:
    """The services `checkpoint.spot_notice` names, at the addresses the environment gives."""
    wanted = {"auto": ("aws", "gce"), "aws": ("aws",), "gce": ("gce",), "off": ()}[mode]
    clients: list[AwsNotices | GceNotices] = []
    for provider, variable, default, kind in (("aws", AWS_URL, AWS_DEFAULT, AwsNotices),
                                              ("gce", GCE_URL, GCE_DEFAULT, GceNotices)):
        if provider in wanted:
            url = environ.get(variable) or default
            try:
                clients.append(kind(url))
            except ValueError as error:
                raise ValueError(f"{variable}: {error}") from None
    return clients


class SpotNotices:
    """Watches `clients` (auto: those that answer a probe), each in a daemon thread; on a notice, records it in
    `output_dir`'s events.jsonl (`spot_notice`: provider, action, action_time) and sets `request`. The threads
    stop with the block; a long poll in flight ends by itself."""

    def __init__(self, clients: list, request: StopRequest, output_dir: Path | None = None,
                 explicit: bool = False) -> None:
        self.clients, self.request, self.output_dir, self.explicit = clients, request, output_dir, explicit
        self.watching: list[str] = []  # the providers whose service answered the probe
        self.notice: Notice | None = None
        self._closed = threading.Event()
        self._threads: list[threading.Thread] = []
        self._log = run_logger()

    @classmethod
    def of(cls, mode: str, request: StopRequest, output_dir: Path | None = None) -> "SpotNotices":
        """`checkpoint.spot_notice`'s watcher."""
        return cls(clients_for(mode), request, output_dir, explicit=mode not in ("auto", "off"))

    def __enter__(self) -> "SpotNotices":
        self._log = run_logger()  # the run's, bound here: the threads have no Prefect context of their own
        for client in self.clients:
            thread = threading.Thread(target=self._watch, args=(client,), name=f"spot-notice-{client.provider}",
                                      daemon=True)
            thread.start()
            self._threads.append(thread)
        return self

    def __exit__(self, *exc) -> None:
        self._closed.set()

    def active(self) -> list[str]:
        """The providers still probed or watched."""
        return [thread.name.removeprefix("spot-notice-") for thread in self._threads if thread.is_alive()]

    def _watch(self, client) -> None:
        if not self._probe(client):
            return
        self.watching.append(client.provider)
        failing = False
        while not self._closed.is_set():
            try:
                notice = client.check(PROBE_SECONDS)
            except (*_FAILURES, MetadataUnavailable) as error:
                if not failing:  # said once, not every second of an outage
                    self._log.warning(f"spot notices: {client.service.url}: {_reason(error)}; asking again")
                failing = True
                self._closed.wait(max(client.pause_seconds, 1.0))
                continue
            if failing:
                self._log.info(f"spot notices: {client.service.url} answers again")
                failing = False
            if notice is not None and not self._closed.is_set():
                self._announce(notice)
                return
            self._closed.wait(client.pause_seconds)

    def _probe(self, client) -> bool:
        try:
            answered = client.probe(PROBE_SECONDS)
            why = "it answered as another service"
        except (*_FAILURES, MetadataUnavailable) as error:
            answered, why = False, _reason(error)
        if answered:
            self._log.info(f"spot notices: watching {client.service.url} ({client.provider.upper()})")
        elif self.explicit:
            self._log.warning(f"spot notices: checkpoint.spot_notice is {client.provider}, but "
                              f"{client.service.url} did not answer ({why}); watching it all the same")
        return answered or self.explicit

    def _announce(self, notice: Notice) -> None:
        self.notice = notice
        if self.output_dir is not None:  # first: the stop's checkpoint carries the curves, this event among them
            Path(self.output_dir).mkdir(parents=True, exist_ok=True)
            append_event(Path(self.output_dir), "spot_notice", provider=notice.provider, action=notice.action,
                         action_time=notice.action_time)
        self._log.warning(f"spot notices: {notice.describe()}: training stops after its step, with a checkpoint")
        self.request.set(notice.describe())


def _reason(error: BaseException) -> str:
    return str(error) or type(error).__name__
