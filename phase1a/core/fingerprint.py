"""Content fingerprints: what the caches key on, so a changed file, or changed code, never reuses a stale result."""
from __future__ import annotations

import ast
import hashlib
import json
import time
from dataclasses import dataclass
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

# The version of each stage's output format, by a module its output is keyed on: it enters the code fingerprint of
# that module and of every module that imports it, so a bump re-runs that stage and no other, but for tokenize's
# (its shards' keys and the tokenized directory's name move, and that name is in the plan's, train's and validate's
# keys). Bump one when what a stage writes changes and no code the fingerprint sees did: a dependency's
# upgrade that changes the bytes (pyarrow, tokenizers, a chat template's rendering), or a reader that needs outputs
# rewritten. This assignment itself is left out of the code hash (code_hash), so a bump moves only the keys it names.
FORMAT_VERSIONS: dict[str, int] = {
    "tasks.stage": 1,  # stage's record (StagedData); the staged copy is the source's bytes, named by their content
    # tokenize's encoded shards (Arrow and numpy files, kept locally and in the store) and the dataset made of
    # them: the tokenized directory's name covers this module's code, and so does the stage's key
    "phase1a.data.shards": 1,
    "tasks.plan": 1,  # the plan (Plan's JSON)
    "tasks.validate": 1,  # the verdict (ValidationResult's JSON)
}
# Keyword arguments of pydantic's Field that are prose: they reach the JSON schema and docs/configuration.md, never
# a value a stage reads, so rewording a setting's description does not re-run the stages that import the schema.
PROSE_KEYWORDS = frozenset({"description", "title", "examples"})


def _module_file(name: str, root: Path) -> Path | None:
    """The project file of a dotted module name (a module or a package's __init__), or None: not ours."""
    if name.split(".")[0] not in PROJECT_PACKAGES:
        return None
    base = root.joinpath(*name.split("."))
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def code_hash(tree: ast.Module) -> str:
    """sha256 of a module's code: its tree without prose, positions or layout.

    Left out: prose, which does nothing when the module runs (comments, never in the tree; docstrings and every
    other statement that is a bare string; the PROSE_KEYWORDS of a call to pydantic's Field), and the
    FORMAT_VERSIONS table (its entries enter each with its own module). Every other string stays: dict keys,
    format strings, and error messages, which are behaviour (a user reads them; tokenize counts skipped records
    by their reason in its output).

    Fields that are None or empty are left out, so that a field a newer Python adds to the grammar (3.12's
    type_params) leaves the hash of code that does not use it as it was: every file of the project hashes alike
    on 3.11 and 3.12, so the image and a checkout on the other supported Python share their caches."""
    out: list[str] = []
    _emit(tree, out)
    return hashlib.sha256("\x00".join(out).encode()).hexdigest()


def _emit(node: ast.AST, out: list[str]) -> None:
    """The node's type, then each field's name and value, in `out`, in one pass: about half ast.dump's time on
    tokenize's modules, and ast.dump would show 3.12's empty type_params."""
    kind = type(node)
    out.append(kind.__name__)
    for name in node._fields:
        value = getattr(node, name, None)
        if name == "body" and type(value) is list:
            value = [statement for statement in value if not _is_prose(statement)
                     and not (kind is ast.Module and _assigns_format_versions(statement))]
        elif name == "keywords" and kind is ast.Call and _called_name(node) == "Field":
            value = [keyword for keyword in value if keyword.arg not in PROSE_KEYWORDS]
        if value is None or (type(value) is list and not value):
            continue
        out.append(name)
        if type(value) is list:
            out.append("[")
            for item in value:
                if isinstance(item, ast.AST):
                    _emit(item, out)
                else:  # a name: of a global statement, of a class pattern's keyword
                    out.append(repr(item))
            out.append("]")
        elif isinstance(value, ast.AST):
            _emit(value, out)
        else:  # a constant (repr escapes NUL, so no value reads as a separator), an operator's flag, a name
            out.append(repr(value))
    out.append(")")


def _is_prose(statement: ast.stmt) -> bool:
    return (type(statement) is ast.Expr and type(statement.value) is ast.Constant
            and type(statement.value.value) is str)


def _called_name(call: ast.Call) -> str | None:
    return call.func.attr if isinstance(call.func, ast.Attribute) else getattr(call.func, "id", None)


def _assigns_format_versions(statement: ast.stmt) -> bool:
    targets = statement.targets if isinstance(statement, ast.Assign) else [getattr(statement, "target", None)]
    return isinstance(statement, (ast.Assign, ast.AnnAssign)) and any(
        isinstance(target, ast.Name) and target.id == "FORMAT_VERSIONS" for target in targets)


def source_fingerprint(source: str | bytes, filename: str = "<source>") -> str:
    """`code_hash` of a module's source: two sources that differ in prose, comments or layout only hash alike."""
    return code_hash(ast.parse(source, filename=filename))


@dataclass(frozen=True)
class _Source:
    imports: frozenset[str]
    code: str


_sources: dict[Path, tuple[tuple[int, int, int], _Source]] = {}


def _read_source(path: Path) -> _Source:
    """A file's imports and code hash, parsed once per process and version of the file (its inode, mtime and
    size, as `FileHashes` keys a file): the stages' fingerprints share most of their modules."""
    stat = path.stat()
    stamp = (stat.st_ino, stat.st_mtime_ns, stat.st_size)
    remembered = _sources.get(path)
    if remembered is not None and remembered[0] == stamp:
        return remembered[1]
    tree = ast.parse(path.read_bytes(), filename=str(path))
    source = _Source(_imported_names(tree), code_hash(tree))
    _sources[path] = (stamp, source)
    return source


def _imported_names(tree: ast.Module) -> frozenset[str]:
    """Every module an import statement anywhere in the file names, including imports inside functions (the
    code they run is as much this module's as what it imports at the top), and `from pkg import module`;
    not those under `if TYPE_CHECKING:`, which never run. Only statements are visited: an import is one."""
    names: set[str] = set()
    pending: list[ast.AST] = list(tree.body)
    while pending:
        statement = pending.pop()
        if isinstance(statement, ast.Import):
            names.update(alias.name for alias in statement.names)
        elif isinstance(statement, ast.ImportFrom):
            if statement.module and statement.level == 0:
                names.add(statement.module)
                names.update(f"{statement.module}.{alias.name}" for alias in statement.names)
        elif isinstance(statement, ast.If) and _is_type_checking(statement.test):
            pending += statement.orelse
        else:  # the statements inside: a def's, a class's, a with's, an except's or a case's body, else, finally
            for block in ("body", "orelse", "finalbody", "handlers", "cases"):
                value = getattr(statement, block, None)
                if type(value) is list:
                    pending += value
    return frozenset(names)


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
        pending += [imported for imported in _read_source(path).imports if imported not in found]
        # a package's __init__ runs before any of its modules
        pending += [parent for parent in _parents(name) if parent not in found]
    return found


def _parents(name: str) -> list[str]:
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


@lru_cache(maxsize=None)
def code_fingerprint(module: str, root: Path = PROJECT_ROOT) -> str:
    """Hash of the code of `module` and of every project module it imports (`code_hash`: prose left out), and
    of the FORMAT_VERSIONS of those among them that write a stage's output. Computed once per process: the code
    a process runs is the code it imported when it started."""
    digest = hashlib.sha256()
    for name, path in sorted(project_imports(module, root).items()):
        digest.update(name.encode())
        digest.update(_read_source(path).code.encode())
        if name in FORMAT_VERSIONS:
            digest.update(f"format {FORMAT_VERSIONS[name]}".encode())
    return digest.hexdigest()[:16]
