"""The promoted versions as the stages read them: the pointer (`promoted.json`) where versions are promoted to
(a directory or s3://bucket/prefix/), each version's `version.json`, and the chain of versions each was trained
from. The warm start (phase1a/start/warmstart.py) and the validate stage's promoted baseline read them; the
promote stage writes them (phase1a/promote/promotion.py, which describes the layout).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from botocore.exceptions import ClientError
from pydantic import BaseModel, ValidationError

from phase1a.store.s3 import S3Url, is_s3_url, make_client, parse_s3_url, s3_errors

POINTER = "promoted.json"


class PromotionError(RuntimeError):
    """A promoted version that cannot be read, or a promotion that did not happen (the previous pointer is intact)."""


class PromotionRecord(BaseModel):
    """What the caller knows about the model being promoted."""

    run: str
    adapter_sha256: str
    base_model_fingerprint: str
    sample_fingerprint: str
    metric_settings: str
    metrics: dict[str, Any]
    parent: str | None = None  # the promoted version this model was trained from; None: fresh from the base model
    started_from: str | None = None  # where its training started, in words: the base model, a version, an adapter


class PromotedPointer(PromotionRecord):
    version: str
    path: str  # the version's directory or s3:// prefix
    artifacts: dict[str, str]  # "adapter" / "merged" / "gguf" -> its location
    files: dict[str, str]  # path relative to the version -> sha256
    promoted_at: str


def read_pointer(destination: str, endpoint_url: str | None = None) -> PromotedPointer | None:
    """The pointer under `destination` (a directory or s3://bucket/prefix/); None when nothing is promoted there."""
    if is_s3_url(destination):
        url = parse_s3_url(destination.rstrip("/") + "/")
        return read_s3_pointer(make_client(endpoint_url), url)[0]
    return read_local_pointer(Path(destination))


def version_chain(destination: str, endpoint_url: str | None = None) -> list[PromotedPointer]:
    """The promoted version, then the version it was trained from, and so on back to one trained from the base
    model, each as its `version.json` recorded it. Empty when nothing is promoted."""
    pointer = read_pointer(destination, endpoint_url)
    chain = [pointer] if pointer is not None else []
    while chain and chain[-1].parent is not None:
        if any(seen.version == chain[-1].parent for seen in chain):
            raise PromotionError(f"{destination}: version {chain[-1].version} names {chain[-1].parent} as its "
                                 "parent, which is already in its chain")
        chain.append(_read_version(destination, chain[-1].parent, endpoint_url))
    return chain


def _read_version(destination: str, version: str, endpoint_url: str | None) -> PromotedPointer:
    if is_s3_url(destination):
        url = parse_s3_url(destination.rstrip("/") + "/")
        key, client = f"{url.key}versions/{version}/version.json", make_client(endpoint_url)
        with s3_errors(client, f"s3://{url.bucket}/{key}", url.bucket, "GET"):
            raw = client.get_object(Bucket=url.bucket, Key=key)["Body"].read()
        return _parse_pointer(raw, f"s3://{url.bucket}/{key}")
    path = Path(destination) / "versions" / version / "version.json"
    if not path.is_file():
        raise PromotionError(f"{path}: version {version}, a parent in the promoted chain, is missing")
    return _parse_pointer(path.read_bytes(), str(path))


def _parse_pointer(raw: bytes, where: str) -> PromotedPointer:
    try:
        return PromotedPointer.model_validate_json(raw)
    except (ValidationError, ValueError) as error:
        raise PromotionError(f"{where}: not a promoted pointer: {error}") from None


def read_local_pointer(root: Path) -> PromotedPointer | None:
    path = root / POINTER
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return None
    return _parse_pointer(raw, str(path))


def read_s3_pointer(client: Any, url: S3Url) -> tuple[PromotedPointer | None, str | None]:
    """The pointer under `url` and its ETag (what a conditional PUT replaces); (None, None) when there is none."""
    key = url.key + POINTER
    with s3_errors(client, f"s3://{url.bucket}/{key}", url.bucket, "GET"):
        try:
            response = client.get_object(Bucket=url.bucket, Key=key)
        except ClientError as error:
            if error.response.get("Error", {}).get("Code") in ("NoSuchKey", "404"):
                return None, None
            raise
        raw = response["Body"].read()
    return _parse_pointer(raw, f"s3://{url.bucket}/{key}"), response["ETag"]


def read_s3_record(client: Any, bucket: str, key: str) -> PromotedPointer | None:
    """A version's `version.json` at `key`; None when there is none."""
    with s3_errors(client, f"s3://{bucket}/{key}", bucket, "GET"):
        try:
            raw = client.get_object(Bucket=bucket, Key=key)["Body"].read()
        except ClientError as error:
            if error.response.get("Error", {}).get("Code") in ("NoSuchKey", "404"):
                return None
            raise
    return _parse_pointer(raw, f"s3://{bucket}/{key}")
