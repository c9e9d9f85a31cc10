"""boto3 plumbing for staging from S3: list/HEAD objects, pinned parallel downloads that resume, errors that say
what failed.

Credentials come only from boto3's standard chain (environment, profile, instance role). Nothing here reads,
logs or formats them, and botocore's exceptions are reworded into `S3Error` messages built from the URL, the
operation and the error code only, so no request detail can leak into a report or a log.
"""
from __future__ import annotations

import fcntl
import hashlib
import json
import os
import re
import threading
import uuid
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from contextlib import closing, contextmanager
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING, Any, Iterator
from urllib.parse import urlsplit, urlunsplit

import boto3
from boto3.s3.transfer import TransferConfig
from botocore.config import Config
from botocore.exceptions import (
    BotoCoreError,
    ClientError,
    ConnectionClosedError,
    ConnectTimeoutError,
    EndpointConnectionError,
    FlexibleChecksumError,
    IncompleteReadError,
    NoCredentialsError,
    PartialCredentialsError,
    ProfileNotFound,
    ReadTimeoutError,
    ResponseStreamingError,
)
from pydantic import BaseModel
from s3transfer.exceptions import RetriesExceededError, S3DownloadFailedError, S3ValidationError

from phase1a.core.atomic import write_atomically
from phase1a.core.retries import is_transient
from phase1a.core.units import MIB

if TYPE_CHECKING:
    from phase1a.core.meter import Meter

# Objects above the threshold are fetched as parallel ranged GETs; 64 MiB parts keep the request count low on
# multi-GB shards while still spreading one object over all connections.
DEFAULT_TRANSFER = TransferConfig(multipart_threshold=64 * MIB, multipart_chunksize=64 * MIB, max_concurrency=16)

_MD5_ETAG = re.compile(r"^[0-9a-f]{32}$")


class S3Error(ValueError):
    """An S3 access that failed; the message names the s3:// URL and what went wrong, never credentials."""


class S3Object(BaseModel):
    key: str
    size: int
    etag: str  # without the quotes S3 puts around it


@dataclass(frozen=True)
class S3Url:
    bucket: str
    key: str  # empty or ending in "/": a prefix, i.e. every object under it

    @property
    def is_prefix(self) -> bool:
        return self.key == "" or self.key.endswith("/")

    def __str__(self) -> str:
        return f"s3://{self.bucket}/{self.key}"


def is_s3_url(source: str) -> bool:
    return source[:5].lower() == "s3://"


def parse_s3_url(url: str) -> S3Url:
    # Split by hand: S3 keys may contain '?' and '#', which urlparse would cut off as query and fragment.
    if not is_s3_url(url):
        raise S3Error(f"{url!r}: not an s3:// URL")
    bucket, _, key = url[5:].partition("/")
    if not bucket:
        raise S3Error(f"{url!r}: no bucket name (expected s3://bucket/key or s3://bucket/prefix/)")
    return S3Url(bucket, key)


def make_client(endpoint_url: str | None = None, max_pool_connections: int | None = None) -> Any:
    """An S3 client with short connect timeouts and bounded retries, so an unreachable endpoint fails in
    seconds. A fresh session each time: credentials are re-read from the chain, never cached here.
    AWS_MAX_ATTEMPTS / AWS_RETRY_MODE still apply, since only the retry mode default is set."""
    options: dict[str, Any] = {
        "connect_timeout": 5,
        "read_timeout": 60,
        "retries": {"mode": "standard"},
        # One pooled connection per transfer thread, or urllib3 drops and re-opens connections under load.
        "max_pool_connections": max_pool_connections or DEFAULT_TRANSFER.max_concurrency + 4,
    }
    if endpoint_url:
        # S3-compatible stores (MinIO, Ceph, moto) rarely have wildcard DNS for virtual-hosted buckets.
        options["s3"] = {"addressing_style": "path"}
    try:
        return boto3.session.Session().client("s3", endpoint_url=endpoint_url or None, config=Config(**options))
    except ProfileNotFound as error:
        raise S3Error(f"AWS profile {error.kwargs.get('profile')!r} (AWS_PROFILE) not found") from None
    except ValueError as error:  # botocore rejects a malformed endpoint URL with a ValueError
        raise S3Error(f"data.s3_endpoint_url: {error}") from None


def endpoint_of(client: Any) -> str:
    """The endpoint a client talks to, with any user:password@ part removed before it goes into a message."""
    parts = urlsplit(client.meta.endpoint_url)
    host = parts.hostname or ""
    if parts.port:
        host = f"{host}:{parts.port}"
    return urlunsplit((parts.scheme, host, parts.path, "", ""))


def _status(error: ClientError) -> int | None:
    return error.response.get("ResponseMetadata", {}).get("HTTPStatusCode")


def _describe(error: ClientError, what: str, bucket: str, action: str) -> str:
    code = str(error.response.get("Error", {}).get("Code", ""))
    status = _status(error)
    if code == "NoSuchBucket":
        return f"{what}: no such bucket {bucket!r}"
    if code in ("NoSuchKey", "NotFound") or status == 404:
        return f"{what}: no such key"
    if code in ("InvalidAccessKeyId", "SignatureDoesNotMatch", "InvalidToken", "ExpiredToken", "TokenRefreshRequired"):
        return f"{what}: the AWS credentials were rejected ({code}); check the access key, secret and session token"
    if code in ("AccessDenied", "AllAccessDisabled", "Forbidden") or status == 403:
        return f"{what}: access denied ({action}); the credentials lack permission for this bucket or key"
    if code == "PreconditionFailed" or status == 412:
        return f"{what}: the object changed while it was being downloaded; re-run to stage the new version"
    return f"{what}: {action} failed with S3 error {code or status}"


@contextmanager
def s3_errors(client: Any, what: str, bucket: str, action: str) -> Iterator[None]:
    """Reword botocore failures as S3Error naming `what` (an s3:// URL); `from None` keeps botocore's request
    details out of the chained traceback."""
    try:
        yield
    except NoCredentialsError:
        raise S3Error(f"{what}: no AWS credentials found (set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, "
                      "AWS_PROFILE, or run with an instance role)") from None
    except PartialCredentialsError as error:
        raise S3Error(f"{what}: incomplete AWS credentials ({error.kwargs.get('cred_var')} is missing)") from None
    except (EndpointConnectionError, ConnectTimeoutError, ConnectionClosedError):
        raise S3Error(f"{what}: cannot connect to the S3 endpoint {endpoint_of(client)} ({action})") from None
    except (ReadTimeoutError, RetriesExceededError):
        raise S3Error(f"{what}: the S3 endpoint {endpoint_of(client)} stopped answering during {action}") from None
    except (ResponseStreamingError, IncompleteReadError):
        raise S3Error(f"{what}: the connection to the S3 endpoint {endpoint_of(client)} broke off during "
                      f"{action}") from None
    except ClientError as error:
        raise S3Error(_describe(error, what, bucket, action)) from None
    except S3DownloadFailedError:  # s3transfer's wording of a 412 on its If-Match GETs
        raise S3Error(f"{what}: the object changed while it was being downloaded; "
                      "re-run to stage the new version") from None
    except (S3ValidationError, FlexibleChecksumError):
        raise S3Error(f"{what}: the S3 endpoint sent bytes that failed the transfer's own checks ({action})") from None
    except BotoCoreError as error:
        raise S3Error(f"{what}: {action} failed: {type(error).__name__}") from None


def list_objects(client: Any, url: S3Url) -> list[S3Object]:
    """The object a key names (one HEAD), or every object under a prefix in S3's key order (paged LIST)."""
    if not url.is_prefix:
        return [_head(client, url.bucket, url.key)[0]]
    objects: list[S3Object] = []
    with s3_errors(client, str(url), url.bucket, "list"):
        for page in client.get_paginator("list_objects_v2").paginate(Bucket=url.bucket, Prefix=url.key):
            for item in page.get("Contents", []):
                if item["Key"].endswith("/"):  # a console "folder" marker, not data
                    continue
                objects.append(S3Object(key=item["Key"], size=item["Size"], etag=item["ETag"].strip('"')))
    if not objects:
        raise S3Error(f"{url}: no objects under this prefix")
    # S3 lists in UTF-8 byte order; sort the same way explicitly so the order never depends on the store.
    return sorted(objects, key=lambda item: item.key.encode())


def _head(client: Any, bucket: str, key: str) -> tuple[S3Object, dict]:
    what = f"s3://{bucket}/{key}"
    with s3_errors(client, what, bucket, "HEAD"):
        try:
            response = client.head_object(Bucket=bucket, Key=key)
            return S3Object(key=key, size=response["ContentLength"], etag=response["ETag"].strip('"')), response
        except ClientError as error:
            if _status(error) != 404:
                raise
        # A HEAD's 404 has no body, so it cannot say whether the bucket or the key is missing: ask the bucket.
        try:
            client.head_bucket(Bucket=bucket)
        except ClientError as error:
            if _status(error) == 404:
                raise S3Error(f"{what}: no such bucket {bucket!r}") from None
            raise
    raise S3Error(f"{what}: no such key")


def expected_md5(etag: str, head: dict) -> str | None:
    """The object's MD5 when its ETag is one: single-part uploads without SSE-KMS or SSE-C. Multipart ETags
    carry a '-N' suffix, and KMS/customer-key ETags are opaque even though they look like MD5s."""
    encrypted = head.get("ServerSideEncryption", "").startswith("aws:kms") or "SSECustomerAlgorithm" in head
    return etag if _MD5_ETAG.match(etag) and not encrypted else None


class _Stopped(Exception):
    """Another GET of the batch failed: this one was not started."""


@dataclass
class _Fetch:
    """One object's download. Its bytes gather in a resume file beside the destination, named by the object's
    version (bucket, key, ETag): an attempt cut off mid-object keeps what arrived, and the next attempt asks only
    for the rest (`Range: bytes=<have>-`). An object above the multipart threshold is fetched as parallel parts,
    each resumed on its own; how far each got is written beside the file (`.parts`) when an attempt fails."""

    item: S3Object
    dest: Path
    resume: Path
    parts: list[tuple[int, int]]  # [first, end) of each GET
    have: list[int] = field(default_factory=list)  # bytes of each part on disk
    fd: int = -1
    private: bool = False  # another process holds the shared resume file: ours is not kept
    meter: Meter | None = None  # counts the bytes as they arrive (phase1a/core/meter.py)

    @property
    def progress_path(self) -> Path:
        return self.resume.with_name(self.resume.name + ".parts")


def _plan(bucket: str, item: S3Object, dest: Path, transfer: TransferConfig) -> _Fetch:
    version = hashlib.sha256(f"{bucket}/{item.key}@{item.etag}:{item.size}".encode()).hexdigest()[:16]
    resume = dest.with_name(f".{PurePosixPath(item.key).name}.{version}.resume")
    chunk = transfer.multipart_chunksize
    parts = ([(0, item.size)] if item.size <= transfer.multipart_threshold
             else [(first, min(first + chunk, item.size)) for first in range(0, item.size, chunk)])
    return _Fetch(item, dest, resume, parts)


def _lock(path: Path) -> int | None:
    """An open descriptor of `path` under an exclusive flock, or None when another process holds it. The lock
    dies with its holder, so a killed run never blocks the next one."""
    for _ in range(3):
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            if os.fstat(fd).st_ino == os.stat(path).st_ino:  # else its holder renamed it away meanwhile
                return fd
        except (BlockingIOError, FileNotFoundError):
            pass
        os.close(fd)
    return None


def _open(fetch: _Fetch) -> None:
    fd = _lock(fetch.resume)
    if fd is None:
        fetch.private = True
        fetch.resume = fetch.resume.with_name(f"{fetch.resume.name}.{os.getpid()}-{uuid.uuid4().hex[:8]}")
        fd = os.open(fetch.resume, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
    fetch.fd = fd
    fetch.have = _progress(fetch, os.fstat(fd).st_size)
    if not any(fetch.have):
        os.ftruncate(fd, 0)  # nothing usable on disk: no stale byte may outlive the download
    elif fetch.meter is not None:
        fetch.meter.carry(sum(fetch.have))  # an earlier attempt's bytes: done, but not this attempt's speed


def _progress(fetch: _Fetch, on_disk: int) -> list[int]:
    """Each part's bytes already on disk: a whole object's is the file's size, parts' their record."""
    if len(fetch.parts) == 1:
        return [on_disk if on_disk <= fetch.item.size else 0]
    try:
        record = json.loads(fetch.progress_path.read_text())
        if [tuple(part) for part in record["parts"]] == fetch.parts:
            return [min(int(have), end - first) for have, (first, end) in zip(record["have"], fetch.parts)]
    except (OSError, ValueError, KeyError, TypeError):
        pass
    return [0] * len(fetch.parts)  # no record of these parts: start over


def _get_part(client: Any, bucket: str, fetch: _Fetch, index: int, stop: threading.Event, chunk: int) -> None:
    """One GET of what the part still lacks, written at its place; If-Match pins the listed version, so an object
    replaced meanwhile fails with 412 instead of yielding a file stitched from two versions."""
    first, end = fetch.parts[index]
    offset, whole = first + fetch.have[index], len(fetch.parts) == 1
    if offset >= end:
        return
    if stop.is_set():
        raise _Stopped()
    ranged = {"Range": f"bytes={offset}-" if whole else f"bytes={offset}-{end - 1}"} if offset or not whole else {}
    response = client.get_object(Bucket=bucket, Key=fetch.item.key, IfMatch=f'"{fetch.item.etag}"', **ranged)
    with closing(response["Body"]) as body:
        if ranged and not str(response.get("ContentRange", "")).startswith(f"bytes {offset}-"):
            if not whole:
                raise S3Error(f"s3://{bucket}/{fetch.item.key}: the S3 endpoint ignores byte ranges "
                              f"(asked for {ranged['Range']}); raise the multipart threshold above this object")
            offset = fetch.have[index] = 0  # it sent the whole object: write it from the start
        while offset < end:  # a GET under way runs to its end after another fails: its bytes are kept
            data = body.read(min(chunk, end - offset))
            if not data:  # botocore raises on a body shorter than its length; the caller's size check backs it
                break
            os.pwrite(fetch.fd, data, offset)
            offset += len(data)
            fetch.have[index] = offset - first
            if fetch.meter is not None:  # once per io_chunksize read (256 KiB), not per byte
                fetch.meter.advance(len(data))


def _fetch_object(client: Any, bucket: str, fetch: _Fetch, parts: ThreadPoolExecutor, stop: threading.Event,
                  chunk: int) -> None:
    with s3_errors(client, f"s3://{bucket}/{fetch.item.key}", bucket, "download"):
        if stop.is_set():
            raise _Stopped()
        _open(fetch)
        futures = [parts.submit(_get_part, client, bucket, fetch, index, stop, chunk)
                   for index in range(len(fetch.parts))]
        if wait(futures, return_when=FIRST_EXCEPTION).not_done:
            stop.set()  # a part failed: no GET starts any more; those under way run to their end
        wait(futures)
        try:
            for future in futures:
                future.result()
        except BaseException as error:
            stop.set()
            _set_aside(fetch, keep=not fetch.private and (isinstance(error, _Stopped) or is_transient(error)))
            raise
        fetch.resume.replace(fetch.dest)  # same directory: one rename, into the caller's scratch name
        fetch.progress_path.unlink(missing_ok=True)
        os.close(fetch.fd)


def _set_aside(fetch: _Fetch, keep: bool) -> None:
    """After a failed attempt: keep what arrived for the next one, or, when no retry can use it (the object
    changed, access was denied), remove it."""
    if keep and len(fetch.parts) > 1:
        write_atomically(fetch.progress_path, json.dumps({"parts": fetch.parts, "have": fetch.have}))
    if not keep:
        fetch.resume.unlink(missing_ok=True)
        fetch.progress_path.unlink(missing_ok=True)
    os.close(fetch.fd)


def _stash(fetch: _Fetch) -> None:
    """A finished object of a batch that failed goes back to its resume name: the caller removes its scratch
    names on the error, and the next attempt then finds the object whole instead of fetching it again."""
    if fetch.dest.is_file() and not fetch.resume.exists() and not fetch.private:
        fetch.dest.replace(fetch.resume)
        if len(fetch.parts) > 1:
            write_atomically(fetch.progress_path, json.dumps({"parts": fetch.parts,
                                                              "have": [end - first for first, end in fetch.parts]}))


def download_objects(client: Any, bucket: str, items: list[tuple[S3Object, Path]],
                     transfer: TransferConfig = DEFAULT_TRANSFER, *,
                     meter: Meter | None = None) -> dict[str, str | None]:
    """Download each object to its path: at most `max_concurrency` GETs at once across all objects, a large
    object split into parallel ranged GETs, and whatever an earlier attempt left (a resume file) not fetched
    again. On an error the objects already whole are kept for the next attempt, and so are the bytes of those
    cut off by a transient error (phase1a/core/retries.py); the error is raised, naming its object.

    Returns each key's expected MD5 (or None when the ETag is not one) for the caller's verification; an
    object whose size or ETag changed since it was listed is refused before any byte is fetched. `meter`, when
    given, counts the bytes as they arrive, from every transfer thread."""
    md5s = _check_unchanged(client, bucket, [item for item, _ in items], transfer)
    fetches = [_plan(bucket, item, Path(dest), transfer) for item, dest in items]
    for fetch in fetches:
        fetch.meter = meter
    stop = threading.Event()
    with ThreadPoolExecutor(transfer.max_concurrency) as parts, \
            ThreadPoolExecutor(max(1, min(transfer.max_concurrency, len(fetches)))) as objects:
        futures = [objects.submit(_fetch_object, client, bucket, fetch, parts, stop, transfer.io_chunksize)
                   for fetch in fetches]
        errors = [future.exception() for future in futures]
    failed = [error for error in errors if error is not None]
    if failed:
        for fetch, error in zip(fetches, errors):
            if error is None:
                _stash(fetch)
        raise next((error for error in failed if not isinstance(error, _Stopped)), failed[0])
    return md5s


def _check_unchanged(client: Any, bucket: str, items: list[S3Object],
                     transfer: TransferConfig) -> dict[str, str | None]:
    def check(item: S3Object) -> tuple[str, str | None]:
        current, head = _head(client, bucket, item.key)
        if (current.size, current.etag) != (item.size, item.etag):
            raise S3Error(f"s3://{bucket}/{item.key}: the object changed since it was listed "
                          f"({item.size} -> {current.size} bytes); re-run to stage the new version")
        return item.key, expected_md5(item.etag, head)

    with ThreadPoolExecutor(max_workers=max(1, min(transfer.max_concurrency, len(items)))) as pool:
        return dict(pool.map(check, items))
