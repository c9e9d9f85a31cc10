"""Tokenized shards in the store (`shards/<key>/`, each a bundle, phase1a/store/bundles.py), keyed as the local shard
cache is (phase1a/data/shards.py: content, format, tokenizer, settings, code): a host that lacks a shard downloads it
instead of encoding it again, and a shard a host encodes is uploaded while it encodes the next.

A download is verified file by file against the shard's manifest; one that is not what the manifest says
(bytes flipped, cut short, replaced) is counted, removed from the store and encoded again, never used. The
store is a cache here: when it cannot be reached the shards are encoded locally, with a warning.
"""
from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from phase1a.core.logs import run_logger
from phase1a.store.base import Store
from phase1a.store.bundles import (
    Bundle,
    BundleCorrupt,
    Wanted,
    delete_bundle,
    download_bundles,
    read_bundle,
    upload_bundle,
)

_THREADS = 8


def shard_prefix(directory: Path) -> str:
    """A shard's place in the store, from its local directory's name (its key)."""
    return f"shards/{Path(directory).name}/"


@dataclass
class SharedShards:
    store: Store
    downloaded: int = 0
    corrupt: list[str] = field(default_factory=list)  # what was wrong with each shard that was encoded again
    uploaded: int = 0
    upload_failures: list[str] = field(default_factory=list)
    _uploads: list[tuple[Path, Future]] = field(default_factory=list)
    _pool: ThreadPoolExecutor | None = None

    def fetch(self, directories: list[Path]) -> set[int]:
        """Download the shards the store has into their local directories; the positions of those it gave."""
        try:
            with ThreadPoolExecutor(_THREADS) as pool:
                manifests = list(pool.map(self._manifest, directories))
            wanted = [(number, Wanted(shard_prefix(d), d, bundle))
                      for number, (d, bundle) in enumerate(zip(directories, manifests)) if bundle is not None]
            outcomes = download_bundles(self.store, [item for _, item in wanted]) if wanted else []
        except Exception as error:  # noqa: BLE001 - the store is a cache: encode instead
            run_logger().warning(f"{self.store.where('shards/')}: tokenized shards not downloaded "
                                 f"({type(error).__name__}: {error}); encoding them here")
            return set()
        fetched = set()
        for (number, item), problem in zip(wanted, outcomes):
            if problem is None:
                fetched.add(number)
            else:
                self._corrupt(item.prefix, problem)
        self.downloaded += len(fetched)
        return fetched

    def _manifest(self, directory: Path) -> Bundle | None:
        prefix = shard_prefix(directory)
        try:
            return read_bundle(self.store, prefix)
        except BundleCorrupt as problem:
            self._corrupt(prefix, problem)
            return None

    def _corrupt(self, prefix: str, problem: BundleCorrupt) -> None:
        self.corrupt.append(str(problem))
        run_logger().warning(f"{problem}: the shard is encoded again and replaces it")
        delete_bundle(self.store, prefix)

    def share(self, directory: Path) -> None:
        """Upload a shard just encoded, in the background."""
        if self._pool is None:
            self._pool = ThreadPoolExecutor(_THREADS)
        self._uploads.append((directory, self._pool.submit(upload_bundle, self.store, directory,
                                                           shard_prefix(directory))))

    def finish(self) -> None:
        """Wait for the uploads; one that failed is a warning (the next host encodes that shard)."""
        for directory, upload in self._uploads:
            try:
                upload.result()
                self.uploaded += 1
            except Exception as error:  # noqa: BLE001 - the tokenized data is whole locally
                self.upload_failures.append(f"{directory.name}: {type(error).__name__}: {error}")
                run_logger().warning(f"{self.store.where(shard_prefix(directory))}: not uploaded "
                                     f"({type(error).__name__}: {error})")
        self._uploads.clear()
        if self._pool is not None:
            self._pool.shutdown()
            self._pool = None
