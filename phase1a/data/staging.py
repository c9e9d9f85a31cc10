"""Staging: copy a dataset (and, on request, a model directory) to fast local disk, verified, skipped when
already identical. The stage task (tasks/stage.py) runs it for datasets; model resolution, the warm start and
the validate stage (a promoted version's adapter: `fetch_adapter`) for model directories.

Dataset sources: a local file, directory or glob, a file:// URL, s3://bucket/key (one object),
s3://bucket/prefix/ (every object under the prefix, as a directory of shards in key order), or a Hub dataset
id (its files for `data.config`, downloaded into HF_HOME's cache at one commit). Everything lands at
`staging_dir/<fingerprint[:16]>/<name>`, where the fingerprint is `data_source_fingerprint`: the sha256 of a local
file's bytes (of every file's, for a directory or glob), for S3 the hash of its keys, sizes and ETags, for the
Hub the resolved commit. So the stage cache can tell from its inputs alone whether the staged copy still
exists, and two sources never share a location. A Hub dataset's staged location is a link to its snapshot in
the Hugging Face cache, which other tools share.

With a store (phase1a/store/base.py), every S3 object staged and verified is also recorded there by its version
(`staged/s3/<bucket, key, size, ETag>`: its sha256), and a host that finds an object recorded does not download
it: the file is *deferred* (`StagedData.deferred`), its content key known. Tokenize downloads a deferred file
only when it has to encode it (`fetch_deferred`): a fresh host whose tokenized shards are in the store stages
the new objects alone. The record also says whether a JSON file holds one array (read from its first bytes when
it was downloaded), which tokenize needs before it reads any record.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any, Iterator
from urllib.parse import urlparse

from boto3.s3.transfer import TransferConfig
from pydantic import BaseModel, ValidationError

from phase1a.core.atomic import atomic_path, write_atomically
from phase1a.core.errors import DataError
from phase1a.core.fingerprint import READ_CHUNK, FileHashes, hash_json
from phase1a.core.locators import DATA_FILE_FORMATS, file_format, is_data_file, looks_like_hub_id
from phase1a.core.logs import run_logger
from phase1a.core.meter import Meter, stage_meter
from phase1a.data import hub
from phase1a.data.datasource import DataLocation, download_hub_dataset, is_json_array
from phase1a.store.base import Store
from phase1a.store.promoted import PromotedPointer, PromotionError
from phase1a.store.s3 import (
    DEFAULT_TRANSFER,
    S3Error,
    S3Object,
    S3Url,
    download_objects,
    is_s3_url,
    list_objects,
    make_client,
    parse_s3_url,
)


class StagedData(DataLocation):
    """A staged dataset: `path` a file or directory on local disk, `files` a directory's shards when the source
    named them (a glob, an S3 prefix)."""

    source: str
    fingerprint: str  # of the content (sha256 of a file, of every file's, or the Hub commit): tokenize keys on it
    size_bytes: int
    copied: bool
    objects: list[S3Object] = []  # S3 sources: the objects staged, with size and ETag
    file_sha256: dict[str, str] = {}  # a directory's files (relative path -> sha256): tokenize keys each shard on it
    files_copied: int = 0  # files downloaded or copied this time
    files_reused: int = 0  # files already staged (this listing, or an earlier one that shared them)
    files_ignored: int = 0  # a directory's or prefix's files that are not data files by suffix (README, NOTES.txt)
    ignored_files: list[str] = []  # the first SHOWN_IGNORED of those, named as the user names them


class StageManifest(BaseModel):
    """Written next to a staged S3 copy once it is verified; a re-stage compares it with a fresh listing."""

    source: str
    objects: list[S3Object]
    sha256: str = ""  # dataset: of the staged file
    size_bytes: int = 0
    file_sha256: dict[str, str] = {}  # model directory: relative path -> sha256
    deferred: dict[str, bool] = {}  # keys not downloaded (their sha256 came from the store) -> JSON array


SHOWN_IGNORED = 5  # ignored files named in the stage result and the report; every one is counted


def _ignoring(staged: StagedData, names: list[str]) -> StagedData:
    """`staged` with the files of `names` (relative to the source) that are not data files counted and the first
    few named, and logged: a file the reader passes over is said, not skipped without a word."""
    ignored = sorted(name for name in names if not is_data_file(name))
    if not ignored:
        return staged
    shown = [f"{staged.origin.rstrip('/')}/{name}" if staged.origin else name for name in ignored[:SHOWN_IGNORED]]
    more = f" and {len(ignored) - len(shown)} more" if len(ignored) > len(shown) else ""
    run_logger().warning("%s: %d file(s) ignored, not data files by their suffix (%s): %s%s", staged.source,
                         len(ignored), ", ".join(sorted(DATA_FILE_FORMATS)), ", ".join(shown), more)
    return staged.model_copy(update={"files_ignored": len(ignored), "ignored_files": shown})


@dataclass(frozen=True)
class StageOptions:
    """How a dataset is staged, beyond where from and where to: a Hub dataset's revision and config, S3's
    transfer settings, and the store that knows the hashes of objects staged before (None: download them all)."""

    revision: str | None = None
    config: str | None = None
    transfer: TransferConfig = DEFAULT_TRANSFER
    store: Store | None = None


@contextmanager
def _data_errors() -> Iterator[None]:
    try:
        yield
    except S3Error as error:
        raise DataError(str(error)) from None


def local_source_path(source: str, field: str = "data.source") -> Path:
    """A local path or file:// URL as a Path (a file or a directory); other schemes are refused."""
    parsed = urlparse(source)
    if parsed.scheme == "file":
        path = Path(parsed.path)
    elif parsed.scheme in ("", None) or len(parsed.scheme) == 1:  # len 1: a Windows drive letter
        path = Path(source)
    else:
        raise DataError(f"{field}: scheme {parsed.scheme!r} of {source!r} is not supported "
                        "(use a local path, file://, s3:// or a Hub dataset id org/name)")
    path = path.expanduser()
    if not path.exists():
        raise DataError(f"{field}: no such file: {path}")
    if not (path.is_file() or path.is_dir()):
        raise DataError(f"{field}: not a regular file or directory: {path}")
    return path


def is_glob(source: str) -> bool:
    return "://" not in source and any(char in source for char in "*?[")


def glob_files(source: str, field: str = "data.source") -> tuple[Path, list[str]]:
    """A glob's base directory (its part before the first wildcard) and its matching data files, relative to
    that base, sorted: the shards, in order."""
    pattern = Path(source).expanduser()
    base = Path(*pattern.parts[: next(i for i, part in enumerate(pattern.parts) if is_glob(part))])
    relative = str(pattern.relative_to(base))
    files = sorted(p.relative_to(base).as_posix() for p in base.glob(relative) if p.is_file() and is_data_file(p))
    if not files:
        raise DataError(f"{field}: the glob {source} matches no data file")
    return base, files


def _local_files(path: Path) -> list[str]:
    """Every file of a local dataset directory, relative (README and metadata too: they say what it holds)."""
    return sorted(p.relative_to(path).as_posix() for p in path.rglob("*") if p.is_file())


def _content_fingerprint(hashes: list[tuple[str, str]]) -> str:
    """A directory's content key: each (relative name, sha256) in reading order. Local trees and S3 prefixes
    share it, so the same files key the same wherever they were staged from."""
    return hash_json([[name, sha] for name, sha in hashes])


def _files_fingerprint(base: Path, files: list[str], hashes: FileHashes) -> str:
    return _content_fingerprint([(name, hashes.sha256(base / name)) for name in files])


def file_hashes(staging_dir: Path) -> FileHashes:
    """The hashes of local files that staging has read, remembered under the staging directory."""
    return FileHashes(Path(staging_dir) / "file-hashes.json")


def _s3_fingerprint(url: S3Url, objects: list[S3Object]) -> str:
    return hash_json(["s3", url.bucket, [[item.key, item.size, item.etag] for item in objects]])


def _list(url: S3Url, endpoint_url: str | None, client: Any = None) -> tuple[Any, list[S3Object]]:
    with _data_errors():
        client = client or make_client(endpoint_url)
        return client, list_objects(client, url)


def _parse(source: str) -> S3Url:
    with _data_errors():
        return parse_s3_url(source)


def data_source_fingerprint(source: str, endpoint_url: str | None = None, revision: str | None = None,
                            field: str = "data.source", hashes: FileHashes | None = None,
                            config: str | None = None) -> str:
    """What the stage cache keys on, without downloading anything: the sha256 of a local file's bytes (of
    every file's, for a directory or glob), for S3 the hash of (bucket, keys, sizes, ETags) from one HEAD or
    listing, for a Hub dataset its id, the commit `revision` resolves to and the `config` whose files are staged.
    `hashes` remembers local files' hashes by their identity (inode, size, mtime), so unchanged shards are not
    read again."""
    hashes = hashes or FileHashes()
    if is_s3_url(source):
        url = _parse(source)
        return _s3_fingerprint(url, _list(url, endpoint_url)[1])
    if looks_like_hub_id(source):
        commit = hub.resolve_commit(source, repo_type="dataset", revision=revision, field=field)
        return _hub_fingerprint(source, commit, config)
    if is_glob(source):
        fingerprint = _files_fingerprint(*glob_files(source, field), hashes)
    else:
        path = local_source_path(source, field)
        fingerprint = _files_fingerprint(path, _local_files(path), hashes) if path.is_dir() else hashes.sha256(path)
    hashes.save()
    return fingerprint


def _hub_fingerprint(source: str, commit: str, config: str | None) -> str:
    # The stage downloads one config's files: another config of the same commit is other data. Without a config,
    # the key it always had.
    return hash_json(["hub-dataset", source, commit] + ([config] if config is not None else []))


def staged_name(source: str) -> str:
    """The staged file's or directory's name, from the source string alone (the cache's presence check must
    not list S3 or ask the Hub)."""
    if is_s3_url(source):
        url = _parse(source)
        return (url.key.rstrip("/").rsplit("/", 1)[-1] or url.bucket) if url.is_prefix else url.key.rsplit("/", 1)[-1]
    if looks_like_hub_id(source):
        return source.replace("/", "--")
    parsed = urlparse(source)
    path = Path(parsed.path if parsed.scheme == "file" else source)
    name = glob_files(source)[0].name if is_glob(source) else path.name
    if name in ("", ".", ".."):
        raise DataError(f"data.source: {source!r} does not name a file")
    return name


def staged_location(staging_dir: Path, fingerprint: str, name: str) -> Path:
    # Content-addressed, so two different sources with the same name never collide.
    return Path(staging_dir) / fingerprint[:16] / name


def _manifest_path(target: Path) -> Path:
    return target.with_name(f"{target.name}.manifest.json")


def _read_manifest(path: Path) -> StageManifest | None:
    try:
        return StageManifest.model_validate_json(path.read_bytes())
    except (OSError, ValidationError, ValueError):  # missing or half-written: stage again
        return None


def _write_manifest(path: Path, manifest: StageManifest) -> None:
    write_atomically(path, json.dumps(manifest.model_dump(mode="json"), indent=2) + "\n")


def _intact(path: Path, size: int, sha256: str, hashes: FileHashes | None = None) -> bool:
    # The size is the cheap check; the full hash catches a same-size corruption, at local-disk read speed
    # (or from `hashes`, for a file whose identity was hashed before).
    return path.is_file() and path.stat().st_size == size and (hashes or FileHashes()).sha256(path) == sha256


# ---- the blob store: each staged file once, by content ----------------------------------------------------
# A new listing (one more shard under the prefix) stages into a new directory; its unchanged files are hard
# links to the copies an earlier listing staged, so only the new files are downloaded or copied.

def _blob(staging_dir: Path, sha256: str) -> Path:
    return Path(staging_dir) / "blobs" / sha256


def _s3_index(staging_dir: Path, bucket: str, item: S3Object) -> Path:
    """Where the sha256 of an S3 object (bucket, key, size, ETag) staged before is recorded."""
    return Path(staging_dir) / "blobs" / "s3" / hash_json([bucket, item.key, item.size, item.etag])[:40]


def _link(source: Path, destination: Path) -> None:
    """`destination` becomes a hard link to `source` (a copy where the file system has no hard links)."""
    destination.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(destination) as scratch:
        try:
            os.link(source, scratch)
        except OSError:
            shutil.copyfile(source, scratch)


def _reuse_s3_blob(staging_dir: Path, bucket: str, item: S3Object, destination: Path, hashes: FileHashes) -> bool:
    """Link the verified copy of an object an earlier listing staged into place; False when there is none."""
    try:
        sha = _s3_index(staging_dir, bucket, item).read_text().strip()
    except OSError:
        return False
    if not _intact(_blob(staging_dir, sha), item.size, sha, hashes):
        return False
    _link(_blob(staging_dir, sha), destination)
    return True


def _keep_s3_blob(staging_dir: Path, bucket: str, item: S3Object, path: Path, sha: str) -> None:
    _link(path, _blob(staging_dir, sha))
    write_atomically(_s3_index(staging_dir, bucket, item), sha + "\n")


def _store_index(bucket: str, item: S3Object) -> str:
    return f"staged/s3/{hash_json([bucket, item.key, item.size, item.etag])[:40]}"


class _StoredObject(BaseModel):
    """The store's record of an S3 object staged and verified on some host."""

    sha256: str
    json_array: bool  # a JSON file that holds one array (datasource.is_json_array); False for other formats


def _known_to_store(store: Store, bucket: str, items: list[S3Object]) -> dict[str, _StoredObject]:
    """The record of each object (by key) that the store has; a store that cannot be read defers nothing."""

    def known(item: S3Object) -> tuple[str, _StoredObject | None]:
        fetched = store.get(_store_index(bucket, item))
        try:
            return item.key, _StoredObject.model_validate_json(fetched.data) if fetched else None
        except ValidationError:  # unreadable: download it
            return item.key, None

    try:
        with ThreadPoolExecutor(16) as pool:
            return {key: record for key, record in pool.map(known, items) if record is not None}
    except Exception as error:  # noqa: BLE001 - the store is a cache here: download instead
        run_logger().warning(f"{store.url}: staged objects not looked up ({type(error).__name__}); downloading")
        return {}


def _record_in_store(store: Store, bucket: str, shas: dict[str, str], pending: list[tuple[S3Object, Path]]) -> None:
    """What this host staged and verified, for the next host; a failure costs that host a download."""

    def record(item: S3Object, path: Path) -> None:
        shape = file_format(path) == "json" and is_json_array(path)
        store.put(_store_index(bucket, item), _StoredObject(sha256=shas[item.key], json_array=shape)
                  .model_dump_json().encode())

    try:
        with ThreadPoolExecutor(16) as pool:
            list(pool.map(lambda pair: record(*pair), pending))
    except Exception as error:  # noqa: BLE001
        run_logger().warning(f"{store.url}: staged objects not recorded ({type(error).__name__})")


def _require_free_space(directory: Path, needed: int, source: str) -> None:
    free = shutil.disk_usage(directory).free
    if free < needed:
        raise DataError(f"staging dir {directory}: {free} bytes free, {source} needs {needed}")


def verify_download(path: Path, expected_size: int, expected_md5: str | None, what: str | None = None) -> str:
    """Check a downloaded file's size and (where the ETag is one) MD5; return its sha256.

    A file that fails is deleted at once, so it can never be mistaken for a staged copy."""
    what = what or str(path)
    size = path.stat().st_size if path.is_file() else -1
    if size != expected_size:
        path.unlink(missing_ok=True)
        raise DataError(f"{what}: download failed verification ({size} bytes, expected {expected_size})")
    sha, md5 = hashlib.sha256(), hashlib.md5(usedforsecurity=False)
    with open(path, "rb") as handle:
        while chunk := handle.read(READ_CHUNK):
            sha.update(chunk)
            md5.update(chunk)
    if expected_md5 is not None and md5.hexdigest() != expected_md5:
        path.unlink(missing_ok=True)
        raise DataError(f"{what}: download failed verification (md5 {md5.hexdigest()}, ETag {expected_md5})")
    return sha.hexdigest()


def _copy_verified(source: Path, destination: Path, hashes: FileHashes | None = None,
                   meter: Meter | None = None) -> str:
    """Copy one file, hashing it while it is read and again once written; renamed into place only when both
    agree. Returns its sha256. The copy keeps the source's mtime (as `cp -p`): the hash of what was written
    is then remembered in `hashes` (FileHashes trusts a hash taken well after the file's mtime). `meter`
    counts the bytes copied, a chunk at a time."""
    digest = hashlib.sha256()
    with atomic_path(destination) as partial:
        with open(source, "rb") as reader, open(partial, "wb") as writer:
            while chunk := reader.read(READ_CHUNK):
                digest.update(chunk)
                writer.write(chunk)
                if meter is not None:
                    meter.advance(len(chunk))
        stat = source.stat()
        os.utime(partial, ns=(stat.st_atime_ns, stat.st_mtime_ns))
        copied = (hashes or FileHashes()).sha256(partial)
        if copied != digest.hexdigest():
            raise DataError(f"{source}: staged copy failed verification (sha256 {copied} != {digest.hexdigest()})")
    return digest.hexdigest()


def _stage_local_file(source: str, path: Path, staging_dir: Path) -> StagedData:
    size = path.stat().st_size
    if size == 0:
        raise DataError(f"{path}: the file is empty")
    hashes = file_hashes(staging_dir)
    sha = hashes.sha256(path)
    target = staged_location(staging_dir, sha, path.name)
    copied = not _intact(target, size, sha, hashes)
    if copied:
        target.parent.mkdir(parents=True, exist_ok=True)
        _require_free_space(target.parent, size, str(path))
        with stage_meter("stage", size, "bytes", what=f"copying {path}") as meter:
            copied_sha = _copy_verified(path, target, hashes, meter)
        if copied_sha != sha:  # the source changed while it was copied
            raise DataError(f"{path}: the file changed while it was staged; stage again")
    hashes.save()
    return StagedData(source=source, path=str(target), origin=str(path), fingerprint=sha, size_bytes=size,
                      copied=copied)


def _stage_local_tree(source: str, base: Path, files: list[str], staging_dir: Path, explicit: bool) -> StagedData:
    """A directory (or a glob's matches) staged file by file under a directory keyed on its content. Each file
    is copied once into the blob store, verified, and linked into place: an interrupted stage resumes, and a
    tree that shares files with an earlier one copies only the files that are new."""
    hashes = file_hashes(staging_dir)
    shas = {name: hashes.sha256(base / name) for name in files}
    sizes = {name: (base / name).stat().st_size for name in files}
    if sum(sizes.values()) == 0:
        raise DataError(f"data.source: {source}: the data is empty")
    fingerprint = _content_fingerprint(list(shas.items()))
    target = staged_location(staging_dir, fingerprint, base.name)
    missing = [name for name in files if not _intact(target / name, sizes[name], shas[name], hashes)]
    blobs = {name: _blob(staging_dir, shas[name]) for name in missing}
    pending = [name for name in missing if not _intact(blobs[name], sizes[name], shas[name], hashes)]
    target.mkdir(parents=True, exist_ok=True)
    _require_free_space(target, sum(sizes[name] for name in pending), source)
    with stage_meter("stage", sum(sizes[name] for name in pending), "bytes",
                     what=f"copying {len(pending)} of {len(files)} files of {base}") as meter:
        for name in pending:
            if _copy_verified(base / name, blobs[name], hashes, meter) != shas[name]:
                raise DataError(f"{base / name}: the file changed while it was staged; stage again")
    for name in missing:
        _link(blobs[name], target / name)
    hashes.save()
    return StagedData(source=source, path=str(target), origin=str(base), files=files if explicit else [],
                      fingerprint=fingerprint, size_bytes=sum(sizes.values()), copied=bool(pending),
                      file_sha256=shas, files_copied=len(pending), files_reused=len(files) - len(pending))


def _stage_local(source: str, staging_dir: Path) -> StagedData:
    if is_glob(source):
        base, files = glob_files(source)
        return _stage_local_tree(source, base, files, staging_dir, explicit=True)
    path = local_source_path(source)
    if path.is_dir():
        files = _local_files(path)
        return _ignoring(_stage_local_tree(source, path, files, staging_dir, explicit=False), files)
    return _stage_local_file(source, path, staging_dir)


def _stage_s3_object(source: str, url: S3Url, client: Any, item: S3Object, staging_dir: Path,
                     transfer: TransferConfig) -> StagedData:
    target = staged_location(staging_dir, _s3_fingerprint(url, [item]), staged_name(source))
    manifest_path = _manifest_path(target)
    recorded = _read_manifest(manifest_path)
    if recorded and recorded.objects == [item] and _intact(target, recorded.size_bytes, recorded.sha256):
        return StagedData(source=source, path=str(target), origin=source, fingerprint=recorded.sha256,
                          size_bytes=item.size, copied=False, objects=[item])
    target.parent.mkdir(parents=True, exist_ok=True)
    manifest_path.unlink(missing_ok=True)  # the old record must not vouch for a file about to be replaced
    _require_free_space(target.parent, item.size, source)
    with atomic_path(target) as partial:
        with _data_errors(), stage_meter("stage", item.size, "bytes", what=f"downloading {source}") as meter:
            md5s = download_objects(client, url.bucket, [(item, partial)], transfer, meter=meter)
        sha = verify_download(partial, item.size, md5s[item.key], what=f"s3://{url.bucket}/{item.key}")
    _write_manifest(manifest_path, StageManifest(source=source, objects=[item], sha256=sha, size_bytes=item.size))
    return StagedData(source=source, path=str(target), origin=source, fingerprint=sha, size_bytes=item.size,
                      copied=True, objects=[item])


@dataclass
class _StagedPrefix:
    target: Path
    shas: dict[str, str]  # key -> sha256
    downloaded: int
    reused: int  # linked from an earlier listing's copy
    deferred: dict[str, bool] = field(default_factory=dict)  # keys the store knows, not downloaded: JSON array


def _stage_s3_prefix(source: str, url: S3Url, client: Any, objects: list[S3Object], staging_dir: Path,
                     options: StageOptions) -> _StagedPrefix:
    """Every object under the prefix into `staging_dir/<fingerprint[:16]>/<name>/`, each verified and renamed
    into place; skipped when the manifest matches the listing and every file is intact. An object that an
    earlier listing staged (same key, size and ETag) is linked from the blob store, not downloaded again; one the
    store records is deferred."""
    name = url.key.rstrip("/").rsplit("/", 1)[-1] or url.bucket
    target = staged_location(staging_dir, _s3_fingerprint(url, objects), name)
    files = [(item, target / _relative_file(url, item.key)) for item in objects]
    manifest_path, hashes = _manifest_path(target), file_hashes(staging_dir)
    recorded = _read_manifest(manifest_path)
    if recorded and recorded.objects == objects:
        damaged = [path for item, path in files if not _intact(path, item.size, recorded.file_sha256.get(item.key, ""),
                                                                hashes) and not _still_deferred(item, path, recorded)]
        if not damaged:
            return _StagedPrefix(target, recorded.file_sha256, 0, len(files), recorded.deferred)
        for path in damaged:  # else the size check below would keep a same-size corruption
            path.unlink(missing_ok=True)
    manifest_path.unlink(missing_ok=True)

    # A file already at its final name was verified before it was renamed there, and the directory is keyed
    # on this exact listing: an interrupted stage resumes instead of starting over.
    missing = [(item, path) for item, path in files if not (path.is_file() and path.stat().st_size == item.size)]
    pending = [(item, path) for item, path in missing
               if not _reuse_s3_blob(staging_dir, url.bucket, item, path, hashes)]
    known = _known_to_store(options.store, url.bucket, [item for item, _ in pending]) if options.store else {}
    shas = {key: record.sha256 for key, record in known.items()}
    deferred = {key: record.json_array for key, record in sorted(known.items())}
    pending = [(item, path) for item, path in pending if item.key not in known]
    target.mkdir(parents=True, exist_ok=True)
    shas.update(_download_verified(source, (url, client), pending, len(files), target, options.transfer))
    for item, path in pending:  # into the blob store, for the next listing that shares it
        _keep_s3_blob(staging_dir, url.bucket, item, path, shas[item.key])
    if options.store is not None and pending:
        _record_in_store(options.store, url.bucket, shas, pending)
    shas.update({item.key: hashes.sha256(path) for item, path in files if item.key not in shas})
    hashes.save()
    _write_manifest(manifest_path, StageManifest(source=source, objects=objects, file_sha256=shas, deferred=deferred))
    return _StagedPrefix(target, shas, len(pending), len(files) - len(pending) - len(deferred), deferred)


def _still_deferred(item: S3Object, path: Path, recorded: StageManifest) -> bool:
    """A deferred file is not on disk until tokenize fetches it: its absence is no damage."""
    return item.key in recorded.deferred and not path.exists()


def _download_verified(source: str, bucket: tuple[S3Url, Any], pending: list[tuple[S3Object, Path]], of: int,
                       target: Path, transfer: TransferConfig) -> dict[str, str]:
    """The objects (`of` listed) to their paths under `target`, each verified (size, MD5 where the ETag is one)
    before it takes its name; on an error none does. Their sha256 by key."""
    (url, client), shas = bucket, {}
    _require_free_space(target, sum(item.size for item, _ in pending), source)
    with ExitStack() as renames:  # every verified download takes its name at the end; on an error none does
        partials = [(item, renames.enter_context(atomic_path(path))) for item, path in pending]
        what = f"downloading {len(pending)} of {of} objects of {source}"
        with _data_errors(), stage_meter("stage", sum(item.size for item, _ in pending), "bytes", what=what) as meter:
            md5s = download_objects(client, url.bucket, partials, transfer, meter=meter) if partials else {}
        for item, part in partials:
            shas[item.key] = verify_download(part, item.size, md5s[item.key], what=f"s3://{url.bucket}/{item.key}")
    return shas


def fetch_deferred(staged: StagedData, names: list[str], endpoint_url: str | None = None) -> None:
    """Download deferred files of a staged S3 prefix (relative names) into place, each verified against the
    sha256 the store recorded: a changed object fails, naming it."""
    url = _parse(staged.source)
    wanted = {str(_relative_file(url, item.key)): item for item in staged.objects}
    pending = [(wanted[name], Path(staged.path) / name) for name in names
               if name in staged.deferred and not (Path(staged.path) / name).is_file()]
    if not pending:
        return
    with _data_errors():
        client = make_client(endpoint_url)
    shas = _download_verified(staged.source, (url, client), pending, len(staged.objects), Path(staged.path),
                              DEFAULT_TRANSFER)
    for item, _ in pending:
        expected = staged.file_sha256[str(_relative_file(url, item.key))]
        if shas[item.key] != expected:
            (Path(staged.path) / _relative_file(url, item.key)).unlink(missing_ok=True)
            raise DataError(f"s3://{url.bucket}/{item.key}: sha256 {shas[item.key]}, not the {expected} recorded when "
                            "it was staged; the object changed: stage again")


def _stage_s3(source: str, staging_dir: Path, endpoint_url: str | None, options: StageOptions) -> StagedData:
    url = _parse(source)
    client, objects = _list(url, endpoint_url)
    if sum(item.size for item in objects) == 0:
        raise DataError(f"{source}: the data is empty")
    if not url.is_prefix:
        return _stage_s3_object(source, url, client, objects[0], staging_dir, options.transfer)
    data = [item for item in objects if is_data_file(item.key)]
    if not data:
        raise DataError(f"{source}: no data file under the prefix (keys: {', '.join(o.key for o in objects[:5])})")
    staged = _stage_s3_prefix(source, url, client, objects, staging_dir, options)
    files = [_relative_file(url, item.key).as_posix() for item in data]  # key order: the shards' order
    shas = {name: staged.shas[item.key] for name, item in zip(files, data)}
    listed = [_relative_file(url, item.key).as_posix() for item in objects]
    return _ignoring(StagedData(source=source, path=str(staged.target), origin=source, files=files,
                      fingerprint=_content_fingerprint(list(shas.items())), size_bytes=sum(item.size for item in data),
                      copied=bool(staged.downloaded), objects=objects, file_sha256=shas,
                      files_copied=staged.downloaded, files_reused=staged.reused,
                      deferred={_relative_file(url, key).as_posix(): shape for key, shape in staged.deferred.items()}),
                     listed)


def _stage_hub(source: str, staging_dir: Path, revision: str | None, config: str | None) -> StagedData:
    """The Hub dataset's files for `config`, in HF_HOME's cache at one commit; the staged location links there."""
    snapshot = download_hub_dataset(source, revision, config)
    fingerprint = _hub_fingerprint(source, snapshot.commit, config)
    target = staged_location(staging_dir, fingerprint, staged_name(source))
    if not target.is_dir():
        with atomic_path(target) as link:
            link.symlink_to(snapshot.path, target_is_directory=True)
    files = sorted(p for p in Path(snapshot.path).rglob("*") if p.is_file())
    # The Hub cache names each file's blob by its content (sha256 for LFS files, git's sha1 for small ones).
    content = {p.relative_to(snapshot.path).as_posix(): p.resolve().name for p in files}
    return StagedData(source=source, path=str(target), origin=source, fingerprint=fingerprint,
                      size_bytes=sum(p.stat().st_size for p in files), copied=False, file_sha256=content)


def stage_dataset(source: str, staging_dir: Path, endpoint_url: str | None = None,
                  options: StageOptions = StageOptions()) -> StagedData:
    """Copy `source` under `staging_dir`; every copy is verified before it gets its final name."""
    staging_dir = Path(staging_dir)
    if is_s3_url(source):
        return _stage_s3(source, staging_dir, endpoint_url, options)
    if looks_like_hub_id(source):
        return _stage_hub(source, staging_dir, options.revision, options.config)
    return _stage_local(source, staging_dir)


def _relative_file(url: S3Url, key: str) -> PurePosixPath:
    # A key like "model/../../etc/x" must not write outside the staging directory.
    relative = PurePosixPath(key[len(url.key):])
    if relative.is_absolute() or ".." in relative.parts or not relative.parts:
        raise DataError(f"s3://{url.bucket}/{key}: key does not map to a file inside the staged directory")
    return relative


def _copy_local_model(directory: Path, staging_dir: Path) -> Path:
    """A model directory on slow storage (a network mount) copied to local disk, each file verified. The
    listing (names, sizes, mtimes) keys the copy, so an unchanged model is never read from slow storage twice."""
    files = sorted(p for p in directory.rglob("*") if p.is_file())
    listing = [(p.relative_to(directory).as_posix(), p.stat().st_size, p.stat().st_mtime_ns) for p in files]
    target = staged_location(staging_dir, hash_json(listing), directory.name)
    marker = target / ".phase1a-staged"
    if marker.is_file():
        return target
    target.mkdir(parents=True, exist_ok=True)
    _require_free_space(target, sum(size for _, size, _ in listing), str(directory))
    with stage_meter("stage model", sum(size for _, size, _ in listing), "bytes",
                     what=f"copying {directory} to local disk") as meter:
        for relative, _, _ in listing:
            _copy_verified(directory / relative, target / relative, meter=meter)
    write_atomically(marker, json.dumps(listing) + "\n")  # its presence says the copy is whole
    return target


def stage_model(source: str, staging_dir: Path, endpoint_url: str | None = None,
                transfer: TransferConfig = DEFAULT_TRANSFER, copy_local: bool = False) -> Path:
    """An s3://bucket/prefix/ model directory downloaded to `staging_dir/<fingerprint[:16]>/<name>/` (verified,
    renamed into place file by file, skipped when the manifest matches). A local directory is copied the same
    way when `copy_local` (it lives on slow storage), else returned unchanged; a built-in model name or a Hub
    id passes through to the model resolver."""
    if not is_s3_url(source):
        parsed = urlparse(source)
        path = Path(parsed.path) if parsed.scheme == "file" else Path(source)
        return _copy_local_model(path, Path(staging_dir)) if copy_local and path.is_dir() else path
    url = _parse(source if source.endswith("/") else source + "/")  # a model is always a directory
    client, objects = _list(url, endpoint_url)
    return _stage_s3_prefix(source, url, client, objects, Path(staging_dir), StageOptions(transfer=transfer)).target


def fetch_adapter(pointer: PromotedPointer, staging_dir: Path, endpoint_url: str | None = None) -> Path:
    """The promoted version's adapter on local disk: staged under `staging_dir/promoted/` from S3 (verified,
    reused while unchanged), or where it lies locally."""
    location = pointer.artifacts.get("adapter", "")
    if is_s3_url(location):
        return stage_model(location, Path(staging_dir) / "promoted", endpoint_url)
    if not Path(location).is_dir():
        raise PromotionError(f"promoted version {pointer.version}: its adapter {location!r} is missing")
    return Path(location)
