"""Promotion: copy a model that passed the gate to a versioned location, then move the `promoted` pointer.

Layout, the same in a local directory and under an s3://bucket/prefix/:

    promoted.json                      the pointer: version, where it lives, its metrics, when
    versions/<version>/adapter/...     the adapter (or full weights) as training saved it
    versions/<version>/merged/...      optional: the model with the adapter merged in (promotion.export)
    versions/<version>/gguf/...        optional: GGUF files of the merged model (promotion.export)
    versions/<version>/version.json    the pointer as it was written for this version, with its `parent`: the
                                       version it was trained from (`method.init_from`), so the chain
                                       base -> v1 -> v2 reads back (phase1a/store/promoted.py: `version_chain`)

Every file of a version is written and verified before the pointer moves, and the pointer is replaced in one
atomic step (locally a temporary file and os.replace, on S3 a single PUT), so a reader sees the old pointer or
the new one, never a pointer to a half-copied version. A failure before the pointer leaves the old one in
place. Concurrent promotions: the pointer is replaced only if it is still the one this promotion started
from (locally under a file lock, on S3 a conditional PUT with If-Match / If-None-Match), so a run validated
against version A can never overwrite a version B promoted meanwhile.
"""
from __future__ import annotations

import shutil
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from types import EllipsisType
from typing import Any, Callable

from botocore.exceptions import ClientError

from phase1a.core.atomic import atomic_path, write_atomically
from phase1a.core.fingerprint import sha256_file
from phase1a.core.locks import exclusive
from phase1a.core.meter import stage_meter
from phase1a.promote.result import PromotionOutcome
from phase1a.store.promoted import (
    POINTER,
    PromotedPointer,
    PromotionError,
    PromotionRecord,
    read_local_pointer,
    read_s3_pointer,
    read_s3_record,
)
from phase1a.store.s3 import S3Url, is_s3_url, make_client, parse_s3_url, s3_errors


class PromotionConflict(PromotionError):
    """The pointer moved while this promotion ran; this version was stored but not pointed at."""


@dataclass
class Promotion:
    """What to promote: `artifacts` (name -> directory) stored as `version`, described by `record`.

    `expected_version`: the pointer version the gate compared against (None: no pointer existed); `...` takes
    whatever the pointer is when promotion starts."""

    artifacts: dict[str, Path]
    version: str
    record: PromotionRecord
    expected_version: str | None | EllipsisType = ...


def _files(artifacts: dict[str, Path]) -> list[tuple[str, Path]]:
    listing = []
    for name, root in sorted(artifacts.items()):
        root = Path(root)
        if not root.is_dir():
            raise PromotionError(f"cannot promote {name}: {root} is not a directory")
        listing += [(f"{name}/{path.relative_to(root).as_posix()}", path)
                    for path in sorted(root.rglob("*")) if path.is_file()]
    return listing


def _promote_meter(listing: list[tuple[str, Path]], version: str, destination: str):
    """Progress of a version's copy or upload, a file at a time."""
    return stage_meter("promote", sum(path.stat().st_size for _, path in listing), "bytes",
                       what=f"{len(listing)} files as {version} under {destination}")


def _check_expected(current: PromotedPointer | None, expected_version: str | None | EllipsisType, where: str) -> None:
    if expected_version is ...:
        return
    seen = current.version if current else None
    if seen != expected_version:
        raise PromotionConflict(f"{where}: the promoted pointer is {seen or 'absent'}, but this run was validated "
                                f"against {expected_version or 'no promoted model'}; re-run to validate against it")


def _new_pointer(record: PromotionRecord, version: str, path: str, artifacts: dict[str, Path],
                 files: dict[str, str], join: Callable[[str], str]) -> PromotedPointer:
    return PromotedPointer(**record.model_dump(), version=version, path=path, files=files,
                           artifacts={name: join(name) for name in sorted(artifacts)},
                           promoted_at=datetime.now(timezone.utc).isoformat(timespec="seconds"))


def promote(promotion: Promotion, destination: str, *, endpoint_url: str | None = None,
            copy_file: Callable[[Path, Path], Any] = shutil.copyfile,
            upload_file: Callable[[Any, Path, str, str], Any] | None = None) -> PromotionOutcome:
    """Store the promotion's artifacts as its version under `destination` and point `promoted.json` at it.

    `copy_file` / `upload_file` move one file (the defaults are shutil.copyfile and boto3's managed upload);
    every copy is verified after it is written."""
    if is_s3_url(destination):
        client = make_client(endpoint_url)
        return _promote_s3(promotion, parse_s3_url(destination.rstrip("/") + "/"), client, upload_file or _upload)
    return _promote_local(promotion, Path(destination), copy_file)


# --- a local directory -------------------------------------------------------------------------------------

def _promote_local(promotion: Promotion, root: Path, copy_file: Callable[[Path, Path], Any]) -> PromotionOutcome:
    artifacts, version, record = promotion.artifacts, promotion.version, promotion.record
    root.mkdir(parents=True, exist_ok=True)
    current = read_local_pointer(root)
    # Before the expected-version check: another run that trained the same adapter may have promoted it.
    if current and current.adapter_sha256 == record.adapter_sha256:
        return PromotionOutcome(pointer=current, promoted=False)
    _check_expected(current, promotion.expected_version, str(root))
    final = root / "versions" / version
    if final.exists():
        raise PromotionError(f"{final}: version {version} already exists; versions are never overwritten")
    files: dict[str, str] = {}
    listing = _files(artifacts)
    with atomic_path(final, existing="fail") as partial, _promote_meter(listing, version, str(root)) as meter:
        for relative, source in listing:  # the whole version appears at once, or not at all
            target = partial / relative
            target.parent.mkdir(parents=True, exist_ok=True)
            expected = sha256_file(source)
            copy_file(source, target)
            if sha256_file(target) != expected:
                raise PromotionError(f"{source}: the promoted copy failed verification")
            files[relative] = expected
            meter.advance(source.stat().st_size)
        pointer = _new_pointer(record, version, str(final), artifacts, files, lambda name: str(final / name))
        (partial / "version.json").write_text(pointer.model_dump_json(indent=2) + "\n")
    with exclusive(root / ".promoted.lock", f"the promoted pointer under {root}"):
        now = read_local_pointer(root)
        if now and now.adapter_sha256 == record.adapter_sha256:  # promoted meanwhile by a run of the same adapter
            shutil.rmtree(final)  # one version of an adapter is enough
            return PromotionOutcome(pointer=now, promoted=False)
        if (now.version if now else None) != (current.version if current else None):
            raise PromotionConflict(f"{root}: the promoted pointer moved to {now.version if now else 'nothing'} "
                                    f"while {version} was copied; {final} is stored but not promoted")
        write_atomically(root / POINTER, pointer.model_dump_json(indent=2) + "\n")
    return PromotionOutcome(pointer=pointer, promoted=True)


# --- S3 ----------------------------------------------------------------------------------------------------

def _upload(client: Any, path: Path, bucket: str, key: str) -> None:
    # botocore sends a CRC32 of every part and S3 refuses a part that does not match it.
    client.upload_file(str(path), bucket, key)


def _delete_quietly(client: Any, bucket: str, keys: list[str]) -> None:
    """Best effort: objects of a version that never got pointed at are unreferenced garbage, not harm."""
    for start in range(0, len(keys), 1000):
        try:
            client.delete_objects(Bucket=bucket, Delete={"Objects": [{"Key": k} for k in keys[start:start + 1000]]})
        except Exception:  # noqa: BLE001 - cleanup must never mask the error that led here
            return


def _promote_s3(promotion: Promotion, url: S3Url, client: Any, upload_file) -> PromotionOutcome:
    version, record = promotion.version, promotion.record
    current, etag = read_s3_pointer(client, url)
    # Before the expected-version check: an earlier attempt of this promotion (a retry) may have moved it here.
    if current and current.adapter_sha256 == record.adapter_sha256:
        return PromotionOutcome(pointer=current, promoted=False)
    _check_expected(current, promotion.expected_version, str(url))
    prefix = f"{url.key}versions/{version}/"
    _check_version_free(client, url, prefix, record, current)
    pointer, body = _upload_version(promotion, url, client, upload_file, prefix)
    return _put_pointer(client, url, body, etag, pointer)


def _check_version_free(client: Any, url: S3Url, prefix: str, record: PromotionRecord,
                        current: PromotedPointer | None) -> None:
    """Versions are never overwritten. One that no pointer names, left by an earlier attempt of this same run
    (no version.json yet, or one naming this run), is this promotion's own to write again."""
    with s3_errors(client, f"s3://{url.bucket}/{prefix}", url.bucket, "list"):
        if not client.list_objects_v2(Bucket=url.bucket, Prefix=prefix, MaxKeys=1).get("KeyCount", 0):
            return
    earlier = read_s3_record(client, url.bucket, prefix + "version.json")
    pointed_at = current is not None and current.path == f"s3://{url.bucket}/{prefix}"
    if pointed_at or (earlier is not None and earlier.run != record.run):
        raise PromotionError(f"s3://{url.bucket}/{prefix}: version {prefix.rstrip('/').rsplit('/', 1)[-1]} "
                             "already exists; versions are never overwritten")


def _upload_version(promotion: Promotion, url: S3Url, client: Any, upload_file,
                    prefix: str) -> tuple[PromotedPointer, bytes]:
    """Every file of the version, each checked by its stored size, then its version.json; on an error what was
    uploaded is removed (best effort) and the error raised."""
    uploaded: list[str] = []
    files: dict[str, str] = {}
    listing = _files(promotion.artifacts)
    try:
        with _promote_meter(listing, promotion.version, str(url)) as meter:
            for relative, source in listing:
                key = prefix + relative
                what = f"s3://{url.bucket}/{key}"
                files[relative] = sha256_file(source)
                with s3_errors(client, what, url.bucket, "upload"):
                    uploaded.append(key)
                    upload_file(client, source, url.bucket, key)
                    size = client.head_object(Bucket=url.bucket, Key=key)["ContentLength"]
                if size != source.stat().st_size:
                    raise PromotionError(f"{what}: {size} bytes stored, {source} has {source.stat().st_size}")
                meter.advance(size)
        pointer = _new_pointer(promotion.record, promotion.version, f"s3://{url.bucket}/{prefix}",
                               promotion.artifacts, files, lambda name: f"s3://{url.bucket}/{prefix}{name}/")
        body = (pointer.model_dump_json(indent=2) + "\n").encode()
        with s3_errors(client, f"s3://{url.bucket}/{prefix}version.json", url.bucket, "PUT"):
            uploaded.append(prefix + "version.json")
            client.put_object(Bucket=url.bucket, Key=prefix + "version.json", Body=body)
    except BaseException:
        _delete_quietly(client, url.bucket, uploaded)
        raise
    return pointer, body


def _put_pointer(client: Any, url: S3Url, body: bytes, etag: str | None,
                 pointer: PromotedPointer) -> PromotionOutcome:
    """The pointer last, and only over the pointer this promotion started from. A pointer that moved to this
    same adapter (another run of the same training) is the outcome, and this upload is removed."""
    condition = {"IfMatch": etag} if etag else {"IfNoneMatch": "*"}
    with s3_errors(client, f"s3://{url.bucket}/{url.key}{POINTER}", url.bucket, "PUT"):
        try:
            client.put_object(Bucket=url.bucket, Key=url.key + POINTER, Body=body,
                              ContentType="application/json", **condition)
        except ClientError as error:
            status = error.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            if status not in (409, 412):
                raise
            now = read_s3_pointer(client, url)[0]
            if now is None or now.adapter_sha256 != pointer.adapter_sha256:
                raise PromotionConflict(f"{url}: the promoted pointer moved while {pointer.version} was uploaded; "
                                        f"{pointer.path} is stored but not promoted") from None
            if now.version != pointer.version:  # another run of the same training promoted it first
                prefix = pointer.path.removeprefix(f"s3://{url.bucket}/")
                _delete_quietly(client, url.bucket, [prefix + name for name in [*pointer.files, "version.json"]])
                return PromotionOutcome(pointer=now, promoted=False)
            # Else botocore re-sent a PUT whose answer was lost: the first landed, and the pointer is ours.
    return PromotionOutcome(pointer=pointer, promoted=True)
