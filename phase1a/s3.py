"""boto3 plumbing for staging from S3: list/HEAD objects, pinned parallel downloads, errors that say what failed.

Credentials come only from boto3's standard chain (environment, profile, instance role). Nothing here reads,
logs or formats them, and botocore's exceptions are reworded into `S3Error` messages built from the URL, the
operation and the error code only, so no request detail can leak into a report or a log.
"""
from __future__ import annotations

import re
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator
from urllib.parse import urlsplit, urlunsplit

import boto3
from boto3.s3.transfer import TransferConfig, create_transfer_manager
from botocore.config import Config
from botocore.exceptions import (
    BotoCoreError,
    ClientError,
    ConnectionClosedError,
    ConnectTimeoutError,
    EndpointConnectionError,
    FlexibleChecksumError,
    NoCredentialsError,
    PartialCredentialsError,
    ProfileNotFound,
    ReadTimeoutError,
)
from pydantic import BaseModel
from s3transfer.exceptions import RetriesExceededError, S3DownloadFailedError, S3ValidationError
from s3transfer.subscribers import BaseSubscriber

from phase1a.units import MIB

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


class _Pinned(BaseSubscriber):
    """Hand s3transfer the listed size and ETag: it then sends If-Match on every (ranged) GET, so an object
    replaced mid-transfer fails with 412 instead of yielding a file stitched from two versions."""

    def __init__(self, item: S3Object) -> None:
        self._item = item

    def on_queued(self, future: Any, **kwargs: Any) -> None:
        future.meta.provide_transfer_size(self._item.size)
        future.meta.provide_object_etag(f'"{self._item.etag}"')


def download_objects(client: Any, bucket: str, items: list[tuple[S3Object, Path]],
                     transfer: TransferConfig = DEFAULT_TRANSFER) -> dict[str, str | None]:
    """Download each object to its path, all through one transfer manager (so `max_concurrency` bounds the
    requests across objects, and large objects are split into parallel ranged GETs).

    Returns each key's expected MD5 (or None when the ETag is not one) for the caller's verification; an
    object whose size or ETag changed since it was listed is refused before any byte is fetched."""
    md5s: dict[str, str | None] = {}

    def check(item: S3Object) -> tuple[str, str | None]:
        current, head = _head(client, bucket, item.key)
        if (current.size, current.etag) != (item.size, item.etag):
            raise S3Error(f"s3://{bucket}/{item.key}: the object changed since it was listed "
                          f"({item.size} -> {current.size} bytes); re-run to stage the new version")
        return item.key, expected_md5(item.etag, head)

    with ThreadPoolExecutor(max_workers=max(1, min(transfer.max_concurrency, len(items)))) as pool:
        md5s.update(pool.map(check, [item for item, _ in items]))
    with create_transfer_manager(client, transfer) as manager:  # leaving on an error cancels the rest
        futures = [(item, manager.download(bucket, item.key, str(dest), subscribers=[_Pinned(item)]))
                   for item, dest in items]
        for item, future in futures:
            with s3_errors(client, f"s3://{bucket}/{item.key}", bucket, "download"):
                future.result()
    return md5s
