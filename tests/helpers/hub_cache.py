"""A Hugging Face cache laid out by hand, as huggingface_hub 2.4 writes it, for offline tests of Hub code."""
from __future__ import annotations

import hashlib
import itertools
import json
import os

from phase1a.data.hub import repo_cache_dir

LFS_SUFFIXES = (".safetensors", ".bin", ".pt", ".model")  # what a Hub repository's .gitattributes keeps in LFS
_names = itertools.count()


def unique_repo(stem: str) -> str:
    """A fresh repository id per test: the HF cache (and huggingface_hub's in-memory tree cache) is per session."""
    return f"org/{stem}-{os.getpid()}-{next(_names)}"


def git_blob_id(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def cache_repo(repo_id: str, files: dict[str, bytes], ref: str = "main", listed_only: tuple[str, ...] = (),
               repo_type: str = "model") -> str:
    """Put `files` in the HF cache as commit `<40 hex>` of `repo_id` with `ref` pointing at it, as
    huggingface_hub's file_download/_snapshot_download do: `blobs/<sha256 for LFS files, git sha1 otherwise>`,
    `snapshots/<commit>/<file>` relative symlinks to them, `refs/<ref>` holding the commit (no newline), and
    `trees/<commit>.json`, the repository's whole listing (`listed_only`: files in the repo never downloaded)."""
    folder = repo_cache_dir(repo_id, repo_type)
    commit = hashlib.sha1(repr(sorted((name, git_blob_id(data)) for name, data in files.items())).encode()).hexdigest()
    snapshot_dir = folder / "snapshots" / commit
    snapshot_dir.mkdir(parents=True, exist_ok=True)
    (folder / "blobs").mkdir(exist_ok=True)
    tree = {}
    for name, data in files.items():
        lfs = name.endswith(LFS_SUFFIXES)
        blob_id = hashlib.sha256(data).hexdigest() if lfs else git_blob_id(data)
        blob = folder / "blobs" / blob_id
        blob.write_bytes(data)
        link = snapshot_dir / name
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
        tree[name] = {"size": len(data), "blob_id": git_blob_id(data)}
        if lfs:
            tree[name] |= {"lfs_sha256": blob_id, "lfs_size": len(data)}
    for name in listed_only:
        tree[name] = {"size": 10, "blob_id": git_blob_id(name.encode())}
    (folder / "trees").mkdir(exist_ok=True)
    (folder / "trees" / f"{commit}.json").write_text(json.dumps({"format_version": 1, "files": tree}))
    (folder / "refs").mkdir(exist_ok=True)
    (folder / "refs" / ref).write_text(commit)
    return commit
