"""Content fingerprints: what the caches key on, so a changed file, or changed code, never reuses a stale result."""
from __future__ import annotations

import ast
import hashlib
import json
import time
from functools import lru_cache
from pathlib import Path
from typing import Any

from phase1a.core.atomic import write_atomically
from phase1a.core.meter import Meter, stage_meter
from phase1a.core.units import MIB

READ_CHUNK = 8 * MIB  # large enough that hashing runs at disk speed, small enough to stay out of RAM's way
SHOWN_HASH_BYTES = 256 * MIB  # a first hash of a file this large shows progress: seconds at disk speed, minutes
PROJECT_ROOT = Path(__file__).resolve().parents[2]
# The project's own top-level packages (pyproject's wheel packages). Installed as a wheel (the image), PROJECT_ROOT is
# site-packages: without this every third-party module a stage imports would count as the project's, and the first
# cache key of a stage parsed the source of torch, transformers and Prefect (minutes a stage on two cores).
PROJECT_PACKAGES = ("phase1a", "tasks", "flows")


def sha256_file(path: Path, meter: Meter | None = None) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(READ_CHUNK):
            digest.update(chunk)
            if meter is not None:
                meter.advance(len(chunk))
    return digest.hexdigest()


def _sha256_shown(path: Path, size: int) -> str:
    """A large file's first hash (the content key of a source staged for the first time) shows its progress."""
    if size < SHOWN_HASH_BYTES:
        return sha256_file(path)
    with stage_meter("hash", size, "bytes", what=f"{Path(path).name}, read once for its content key") as meter:
        return sha256_file(path, meter)


class FileHashes:
    """sha256 of local files, remembered by (device, inode, size, mtime) in a JSON file: a nightly re-stage of
    50 unchanged shards stats them instead of reading them (git's index and DVC's state do the same). A hard
    link shares its file's identity, so a staged link to a verified copy is not read again.

    A file rewritten in place gets a new mtime, unless it is rewritten within one tick of the file system's
    clock: as git does with "racy" entries, a hash taken less than RACY_NS after the file's mtime is not trusted
    and the file is read again next time. Concurrent writers may lose each other's entries; a lost entry costs
    one re-hash, never a wrong answer."""

    RACY_NS = 100_000_000  # far above a coarse file-system clock's tick (1-10 ms)
    MAX_ENTRIES = 200_000

    def __init__(self, store: Path | None = None) -> None:
        self.store = Path(store) if store else None
        self.entries: dict[str, list] = {}  # identity -> [the path it was read at, sha256, when it was hashed (ns)]
        self.changed = False
        if self.store and self.store.is_file():
            try:
                self.entries = json.loads(self.store.read_text())
            except (OSError, ValueError):  # unreadable: start afresh; hashing costs time, never correctness
                self.entries = {}

    def sha256(self, path: Path) -> str:
        stat = Path(path).stat()
        identity = f"{stat.st_dev}:{stat.st_ino}:{stat.st_size}:{stat.st_mtime_ns}"
        entry = self.entries.get(identity)
        if entry is None or entry[2] - stat.st_mtime_ns < self.RACY_NS:
            entry = self.entries[identity] = [str(path), _sha256_shown(path, stat.st_size), time.time_ns()]
            self.changed = True
        return entry[1]

    def save(self) -> None:
        """Write the entries back; past MAX_ENTRIES, the oldest go (a forgotten file is hashed again)."""
        if self.store is None or not self.changed:
            return
        newest = sorted(self.entries.items(), key=lambda item: item[1][2])[-self.MAX_ENTRIES:]
        write_atomically(self.store, json.dumps(dict(newest)))
        self.changed = False


def sha256_tree(root: Path, patterns: tuple[str, ...] = ("*",)) -> str:
    """Hash of every matching file's relative name and bytes, in a stable order."""
    digest = hashlib.sha256()
    files = sorted({p for pattern in patterns for p in root.glob(pattern) if p.is_file()})
    for path in files:
        digest.update(path.relative_to(root).as_posix().encode())
        digest.update(sha256_file(path).encode())
    return digest.hexdigest()


def hash_json(value: Any) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True, default=str).encode()).hexdigest()


# ---- code ----------------------------------------------------------------------------------------------------

def _module_file(name: str, root: Path) -> Path | None:
    """The project file of a dotted module name (a module or a package's __init__), or None: not ours."""
    if name.split(".")[0] not in PROJECT_PACKAGES:
        return None
    base = root.joinpath(*name.split("."))
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def _imported_names(path: Path) -> set[str]:
    """Every module an import statement anywhere in the file names, including imports inside functions (the
    code they run is as much this module's as what it imports at the top), and `from pkg import module`;
    not those under `if TYPE_CHECKING:`, which never run."""
    names: set[str] = set()
    tree = ast.parse(path.read_bytes(), filename=str(path))
    for block in [n for n in ast.walk(tree) if isinstance(n, ast.If) and _is_type_checking(n.test)]:
        block.body = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def project_imports(module: str, root: Path = PROJECT_ROOT) -> dict[str, Path]:
    """The module and every project module it imports, directly or through others: the import graph, walked
    from the source files (nothing is imported), limited to files under `root`."""
    found: dict[str, Path] = {}
    pending = [module]
    while pending:
        name = pending.pop()
        path = _module_file(name, root)
        if name in found or path is None:
            continue
        found[name] = path
        pending += [imported for imported in _imported_names(path) if imported not in found]
        # a package's __init__ runs before any of its modules
        pending += [parent for parent in _parents(name) if parent not in found]
    return found


def _parents(name: str) -> list[str]:
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


@lru_cache(maxsize=None)
def code_fingerprint(module: str, root: Path = PROJECT_ROOT) -> str:
    """Hash of the source of `module` and of every project module it imports. Computed once per process: the
    code a process runs is the code it imported when it started."""
    digest = hashlib.sha256()
    for name, path in sorted(project_imports(module, root).items()):
        digest.update(name.encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]
