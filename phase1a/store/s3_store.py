"""The store on S3 (phase1a/store/base.py): uploads checked by the size S3 reports (botocore sends a CRC32 with every
part and S3 refuses one that does not match it), downloads through phase1a/store/s3.py (parallel, resumed, pinned to
the version listed), conditional writes with If-None-Match / If-Match (a service that ignores them is refused at the
start: phase1a/store/base.py, check_conditional_writes), ages by the HTTP Date of S3's answers."""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from contextlib import closing
from datetime import timezone
from pathlib import Path

from botocore.exceptions import ClientError

from phase1a.core.atomic import atomic_path
from phase1a.store.base import Fetched, Listed, Store, StoreConflict, http_date
from phase1a.store.s3 import (
    DEFAULT_TRANSFER,
    S3Error,
    S3Object,
    download_objects,
    endpoint_of,
    make_client,
    parse_s3_url,
    s3_errors,
)


def _status(error: ClientError) -> int | None:
    return error.response.get("ResponseMetadata", {}).get("HTTPStatusCode")


class S3Store(Store):
    def __init__(self, url: str, endpoint_url: str | None = None) -> None:
        root = parse_s3_url(url if url.endswith("/") else url + "/")
        self.bucket, self.prefix = root.bucket, root.key
        self.url = f"s3://{self.bucket}/{self.prefix}"
        self.client = make_client(endpoint_url)

    def _errors(self, key: str, action: str):
        return s3_errors(self.client, self.where(key), self.bucket, action)

    @property
    def service(self) -> str:
        return f"the S3 service at {endpoint_of(self.client)}"

    def _reachable(self) -> None:
        with self._errors("", "HEAD bucket"):
            try:
                self.client.head_bucket(Bucket=self.bucket)
            except ClientError as error:
                if _status(error) == 404:
                    raise S3Error(f"{self.url}: no such bucket {self.bucket!r}") from None
                raise

    def put_file(self, path: Path, key: str) -> None:
        with self._errors(key, "upload"):
            self.client.upload_file(str(path), self.bucket, self.prefix + key)
            stored = self.client.head_object(Bucket=self.bucket, Key=self.prefix + key)["ContentLength"]
        if stored != Path(path).stat().st_size:
            raise OSError(f"{self.where(key)}: {stored} bytes stored, {path} has {Path(path).stat().st_size}")

    def get_files(self, items: list[tuple[str, Path, int]]) -> None:
        """Objects below the multipart threshold in one GET each (what is read is checked by the caller against
        its manifest); larger ones through phase1a/store/s3.py: parallel ranged GETs pinned to the version a HEAD
        found, resumed where an attempt was cut off."""
        large = [item for item in items if item[2] > DEFAULT_TRANSFER.multipart_threshold]
        with ThreadPoolExecutor(DEFAULT_TRANSFER.max_concurrency) as pool:
            list(pool.map(self._get_small, [item for item in items if item not in large]))
            pinned = list(pool.map(self._pinned, large))
        if pinned:
            download_objects(self.client, self.bucket, pinned)

    def _get_small(self, item: tuple[str, Path, int]) -> None:
        key, destination, _ = item
        with self._errors(key, "GET"), atomic_path(Path(destination)) as scratch, open(scratch, "wb") as sink:
            body = self.client.get_object(Bucket=self.bucket, Key=self.prefix + key)["Body"]
            with closing(body):
                for chunk in body.iter_chunks(DEFAULT_TRANSFER.io_chunksize):
                    sink.write(chunk)

    def _pinned(self, item: tuple[str, Path, int]) -> tuple[S3Object, Path]:
        key, destination, _ = item
        with self._errors(key, "HEAD"):
            head = self.client.head_object(Bucket=self.bucket, Key=self.prefix + key)
        return S3Object(key=self.prefix + key, size=head["ContentLength"], etag=head["ETag"].strip('"')), \
            Path(destination)

    def get(self, key: str) -> Fetched | None:
        with self._errors(key, "GET"):
            try:
                response = self.client.get_object(Bucket=self.bucket, Key=self.prefix + key)
            except ClientError as error:
                if _status(error) == 404:
                    return None
                raise
            data = response["Body"].read()
        modified = response["LastModified"]
        headers = response.get("ResponseMetadata", {}).get("HTTPHeaders", {})
        return Fetched(data, response["ETag"].strip('"'), modified.astimezone(timezone.utc), http_date(headers))

    def put(self, key: str, data: bytes, *, if_absent: bool = False, if_match: str | None = None) -> str:
        condition = {"IfNoneMatch": "*"} if if_absent else {"IfMatch": f'"{if_match}"'} if if_match else {}
        with self._errors(key, "PUT"):
            try:
                response = self.client.put_object(Bucket=self.bucket, Key=self.prefix + key, Body=data, **condition)
            except ClientError as error:
                # NoSuchKey to If-Match: no object to match, a lost condition as on a mount (LocalStore).
                missing = if_match is not None and error.response.get("Error", {}).get("Code") == "NoSuchKey"
                if not condition or not (missing or _status(error) in (409, 412)):
                    raise
                # botocore re-sends a PUT whose answer was lost; the first may have landed: then it is ours.
                current = self.get(key)
                if current is not None and current.data == data:
                    return current.etag
                raise StoreConflict(f"{self.where(key)}: " + ("exists" if if_absent else "changed since it was read"
                                                              if current is not None else "no longer exists"))
        return response["ETag"].strip('"')

    def list(self, prefix: str) -> list[Listed]:
        found = []
        with self._errors(prefix, "list"):
            for page in self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket,
                                                                              Prefix=self.prefix + prefix):
                for item in page.get("Contents", []):
                    found.append(Listed(item["Key"][len(self.prefix):], item["Size"]))
        return sorted(found, key=lambda item: item.key.encode())

    def delete(self, keys: list[str]) -> None:
        for start in range(0, len(keys), 1000):
            batch = keys[start:start + 1000]
            with self._errors(batch[0], "delete"):
                self.client.delete_objects(Bucket=self.bucket, Delete={
                    "Objects": [{"Key": self.prefix + key} for key in batch], "Quiet": True})
