"""The Hugging Face Hub: model and dataset repositories resolved to a commit and downloaded into HF_HOME's cache.

Everything goes through huggingface_hub: its cache (resumable downloads, `HF_HUB_OFFLINE=1` runs from the
cache alone), its token lookup (HF_TOKEN, the token file: we never pass, log or store a token) and its errors,
which we translate into messages that say what to do and name the config field.
"""
from __future__ import annotations

import fnmatch
import hashlib
import os
import re
from dataclasses import dataclass
from pathlib import Path

from phase1a.core.errors import DataError

_COMMIT = re.compile(r"^[0-9a-f]{40}$")


class HubError(DataError):
    """A Hub repository that cannot be resolved or downloaded; the message names the config field and the fix."""


@dataclass(frozen=True)
class Snapshot:
    repo_id: str
    repo_type: str
    revision: str | None  # as asked for (None: the default branch)
    commit: str  # what it resolved to: the snapshot directory's name
    path: Path


def cache_root() -> Path:
    from huggingface_hub import constants

    return Path(constants.HF_HUB_CACHE).expanduser()


def repo_cache_dir(repo_id: str, repo_type: str = "model") -> Path:
    """`<HF_HUB_CACHE>/models--org--name`, the folder huggingface_hub keeps blobs, refs and snapshots in."""
    return cache_root() / "--".join([f"{repo_type}s", *repo_id.split("/")])


def snapshot(repo_id: str, *, repo_type: str = "model", revision: str | None = None,
             allow_patterns: list[str] | None = None, ignore_patterns: list[str] | None = None,
             field: str = "model.name_or_path") -> Snapshot:
    """Download (or find in the cache) the files of `repo_id` at `revision` that match the patterns."""
    from huggingface_hub import snapshot_download

    try:
        path = Path(snapshot_download(repo_id, repo_type=repo_type, revision=revision,
                                      allow_patterns=allow_patterns, ignore_patterns=ignore_patterns))
    except Exception as error:  # noqa: BLE001 - translated where we know what to say, re-raised otherwise
        _raise_explained(error, repo_id, repo_type, revision, field)
    return Snapshot(repo_id=repo_id, repo_type=repo_type, revision=revision, commit=path.name, path=path)


def download_file(repo_id: str, filename: str, *, repo_type: str = "model", revision: str | None = None,
                  field: str = "model.name_or_path") -> Path:
    """One file of `repo_id` at `revision`, downloaded into (or found in) the HF cache: its local path."""
    from huggingface_hub import constants, hf_hub_download
    from huggingface_hub.errors import LocalEntryNotFoundError, RemoteEntryNotFoundError

    what = f"Hugging Face {repo_type} {repo_id!r}"
    try:
        return Path(hf_hub_download(repo_id, filename, repo_type=repo_type, revision=revision))
    except RemoteEntryNotFoundError:  # the Hub has the repository, not the file
        raise HubError(f"{field}: no file {filename!r} in {what} at revision {revision or 'main'!r}") from None
    except LocalEntryNotFoundError as error:
        # Offline with the repository cached but not this file: say which file, not that the revision is missing.
        if constants.is_offline_mode() and _cached_commit(repo_id, repo_type, revision) is not None:
            raise HubError(f"{field}: HF_HUB_OFFLINE=1 and {filename!r} of {what} at revision "
                           f"{revision or 'main'!r} is not in the cache: run once online, or unset HF_HUB_OFFLINE"
                           ) from None
        _raise_explained(error, repo_id, repo_type, revision, field)
    except Exception as error:  # noqa: BLE001 - translated where we know what to say, re-raised otherwise
        _raise_explained(error, repo_id, repo_type, revision, field)


def resolve_commit(repo_id: str, *, repo_type: str = "model", revision: str | None = None,
                   field: str = "model.name_or_path") -> str:
    """The commit `revision` points at, without downloading: asked of the Hub when online, read from the cache's
    refs offline or when the Hub cannot be reached (as snapshot_download itself falls back)."""
    from huggingface_hub import HfApi, constants

    if not constants.is_offline_mode():
        try:
            return HfApi().repo_info(repo_id, repo_type=repo_type, revision=revision).sha
        except Exception as error:  # noqa: BLE001
            cached = _cached_commit(repo_id, repo_type, revision) if _unreachable(error) else None
            if cached is None:
                _raise_explained(error, repo_id, repo_type, revision, field)
            return cached
    cached = _cached_commit(repo_id, repo_type, revision)
    if cached is None:
        raise _offline_error(repo_id, repo_type, revision, field)
    return cached


def _cached_commit(repo_id: str, repo_type: str, revision: str | None) -> str | None:
    folder = repo_cache_dir(repo_id, repo_type)
    revision = revision or "main"
    if _COMMIT.match(revision):
        return revision if (folder / "snapshots" / revision).is_dir() else None
    ref = folder / "refs" / revision
    return ref.read_text().strip() if ref.is_file() else None


def snapshot_at(path: Path) -> Snapshot | None:
    """The Snapshot a directory is, when it is `<cache>/models--org--name/snapshots/<commit>` (else None)."""
    path = Path(path)
    repo_folder = path.parent.parent
    if path.parent.name != "snapshots" or not _COMMIT.match(path.name) or not (repo_folder / "blobs").is_dir():
        return None
    kind, _, repo_id = repo_folder.name.partition("--")
    if not kind.endswith("s") or not repo_id:
        return None
    return Snapshot(repo_id=repo_id.replace("--", "/"), repo_type=kind[:-1], revision=None, commit=path.name,
                    path=path)


def snapshot_fingerprint(snap: Snapshot, patterns: tuple[str, ...] | None = None) -> str:
    """Commit + every file's relative path and blob id. The cache names each blob by its content (sha256 for LFS
    files, git sha1 otherwise), so nothing is re-hashed: gigabytes of weights fingerprint in milliseconds, a moved
    branch is a new fingerprint and an unchanged one is stable. `patterns` limits it to the files that matter."""
    digest = hashlib.sha256(f"{snap.repo_type}:{snap.repo_id}@{snap.commit}\n".encode())
    for path in sorted(p for p in snap.path.rglob("*") if p.is_file()):
        relative = path.relative_to(snap.path).as_posix()
        if patterns is not None and not any(fnmatch.fnmatch(relative, pattern) for pattern in patterns):
            continue
        digest.update(f"{relative}\0{_blob_id(path)}\n".encode())
    return digest.hexdigest()


def _blob_id(path: Path) -> str:
    if path.is_symlink():
        return Path(os.readlink(path)).name
    # Where symlinks are unavailable (Windows without developer mode) huggingface_hub copies the blob instead.
    from phase1a.core.fingerprint import sha256_file

    return sha256_file(path)


def repo_files(snap: Snapshot) -> list[str] | None:
    """Every file of the repository at the snapshot's commit, from the tree listing huggingface_hub caches with a
    download (no network); None when no listing is cached (a cache written by an older huggingface_hub)."""
    from huggingface_hub import get_cached_repo_tree
    from huggingface_hub.errors import CachedRepoTreeNotFoundError

    try:
        return [item.path for item in get_cached_repo_tree(snap.repo_id, repo_type=snap.repo_type,
                                                           revision=snap.commit)]
    except CachedRepoTreeNotFoundError:
        return None


def _revision_field(field: str) -> str:
    section, _, _ = field.rpartition(".")
    return f"{section}.revision" if section else "revision"


def _unreachable(error: BaseException) -> bool:
    import httpx2
    from huggingface_hub.errors import HfHubHTTPError

    if isinstance(error, (httpx2.TransportError, ConnectionError, TimeoutError)):
        return True
    return isinstance(error, HfHubHTTPError) and error.response is not None and error.response.status_code >= 500


def _offline_error(repo_id: str, repo_type: str, revision: str | None, field: str) -> HubError:
    what = f"Hugging Face {repo_type} {repo_id!r}"
    if not repo_cache_dir(repo_id, repo_type).is_dir():
        return HubError(f"{field}: HF_HUB_OFFLINE=1 and no cached snapshot of {what}: run once online to fill the "
                        f"cache ({cache_root()}), or unset HF_HUB_OFFLINE")
    refs = repo_cache_dir(repo_id, repo_type) / "refs"
    cached = sorted(p.relative_to(refs).as_posix() for p in refs.rglob("*") if p.is_file()) if refs.is_dir() else []
    return HubError(f"{_revision_field(field)}: HF_HUB_OFFLINE=1 and revision {revision or 'main'!r} of {what} is "
                    f"not in the cache (cached: {', '.join(cached) or 'no branches or tags'}): run once online, "
                    f"or unset HF_HUB_OFFLINE")


def _raise_explained(error: Exception, repo_id: str, repo_type: str, revision: str | None, field: str):
    explained = _explain(error, repo_id, repo_type, revision, field)
    if explained is error:
        raise error
    raise explained from error


def _explain(error: Exception, repo_id: str, repo_type: str, revision: str | None, field: str) -> Exception:
    """Our message for huggingface_hub's error, or the error itself when we have nothing better to say. The
    original stays chained for the traceback; no message carries a token (huggingface_hub's never do either)."""
    from huggingface_hub import constants
    from huggingface_hub.errors import (
        DisabledRepoError,
        GatedRepoError,
        HfHubHTTPError,
        HFValidationError,
        IncompleteSnapshotError,
        LocalEntryNotFoundError,
        OfflineModeIsEnabled,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    what = f"Hugging Face {repo_type} {repo_id!r}"
    page = f"{constants.ENDPOINT}/{'' if repo_type == 'model' else repo_type + 's/'}{repo_id}"
    login = "run `huggingface-cli login` (or `hf auth login`) or set HF_TOKEN"
    if isinstance(error, GatedRepoError):
        return HubError(f"{field}: {what} is gated: accept its licence on {page} with your account, then {login}")
    if isinstance(error, RepositoryNotFoundError):
        return HubError(f"{field}: {what} not found: check the id; a private repository needs a token with access "
                        f"({login})")
    if isinstance(error, RevisionNotFoundError):
        return HubError(f"{_revision_field(field)}: revision {revision!r} not found in {what}: use a branch, tag "
                        f"or commit that exists there")
    if isinstance(error, DisabledRepoError):
        return HubError(f"{field}: {what} has been disabled by its owner or the Hub")
    if isinstance(error, HFValidationError):
        return HubError(f"{field}: {repo_id!r} is not a valid Hub repository id ({error})")
    if isinstance(error, IncompleteSnapshotError):
        reason = "HF_HUB_OFFLINE=1" if constants.is_offline_mode() else "the Hub cannot be reached"
        return HubError(f"{field}: the cached snapshot of {what} lacks files this run needs and {reason}: run "
                        f"once online to complete it")
    if isinstance(error, (LocalEntryNotFoundError, OfflineModeIsEnabled)):
        if constants.is_offline_mode() or isinstance(error.__cause__, OfflineModeIsEnabled):
            return _offline_error(repo_id, repo_type, revision, field)
        return HubError(f"{field}: cannot reach the Hugging Face Hub ({constants.ENDPOINT}) to download {what} "
                        f"and no cached snapshot of it: check the network or proxy (HTTPS_PROXY), or run where "
                        f"the Hub is reachable once to fill the cache")
    if _unreachable(error):
        return HubError(f"{field}: cannot reach the Hugging Face Hub ({constants.ENDPOINT}) for {what}: "
                        f"{type(error).__name__}; check the network or proxy, or set HF_HUB_OFFLINE=1 to use the cache")
    if isinstance(error, HfHubHTTPError) and error.response is not None and error.response.status_code in (401, 403):
        return HubError(f"{field}: the Hub refused access to {what} ({error.response.status_code}): {login} with "
                        f"a token that can read it")
    return error
