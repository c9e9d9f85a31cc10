"""A throwaway PostgreSQL server for the tests, from the machine's own binaries (/usr/lib/postgresql/<N>/bin):
initdb into a temporary directory, pg_ctl start on a free 127.0.0.1 port with its unix socket inside that
directory, a password-protected superuser `prefect` and a database `prefect`; stopped and removed on exit.

The server is reached the way docs/operations.md tells a Prefect server to reach one: over TCP with a password
(scram-sha-256), `postgresql+asyncpg://prefect:PASSWORD@127.0.0.1:PORT/prefect`.
"""
from __future__ import annotations

import os
import pwd
import secrets
import shutil
import subprocess
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from helpers.servers import free_port

BIN_GLOB = "/usr/lib/postgresql/*/bin"
# PostgreSQL refuses to run as root; as root the server runs as this account, which Debian's packages create.
SERVICE_USER = "postgres"


@dataclass(frozen=True)
class Postgres:
    port: int
    password: str

    @property
    def url(self) -> str:
        return f"postgresql+asyncpg://prefect:{self.password}@127.0.0.1:{self.port}/prefect"

    def fetch(self, sql: str) -> list[tuple]:
        """Rows of a query, read straight from the database (asyncpg, as Prefect's server uses)."""
        import asyncio

        import asyncpg

        async def query() -> list[tuple]:
            connection = await asyncpg.connect(self.url.replace("+asyncpg", ""))
            try:
                return [tuple(row) for row in await connection.fetch(sql)]
            finally:
                await connection.close()

        return asyncio.run(query())


def find_binaries() -> Path | None:
    """The newest installed version's bin directory holding initdb and pg_ctl, or None."""
    found = [path for path in Path("/").glob(BIN_GLOB.lstrip("/"))
             if (path / "initdb").is_file() and (path / "pg_ctl").is_file()]
    return max(found, key=lambda path: int(path.parent.name) if path.parent.name.isdigit() else 0, default=None)


def unavailable_reason() -> str | None:
    """Why no server can be started here (a reason to skip), or None."""
    if find_binaries() is None:
        return f"no PostgreSQL binaries (initdb, pg_ctl) under {BIN_GLOB}"
    if os.geteuid() == 0:
        try:
            pwd.getpwnam(SERVICE_USER)
        except KeyError:
            return f"running as root, and PostgreSQL refuses root: no {SERVICE_USER!r} account to run it as"
    return None


def _owner() -> pwd.struct_passwd | None:
    return pwd.getpwnam(SERVICE_USER) if os.geteuid() == 0 else None


def _as(owner: pwd.struct_passwd | None) -> dict:
    """subprocess arguments that run a command as `owner` (None: as ourselves)."""
    return {"user": owner.pw_uid, "group": owner.pw_gid, "extra_groups": []} if owner else {}


def _run(args: list[str], owner: pwd.struct_passwd | None) -> str:
    result = subprocess.run(args, capture_output=True, text=True, timeout=120, **_as(owner))
    output = result.stdout + result.stderr
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(args)} exited {result.returncode}:\n{output}")
    return output


def _init(bin_dir: Path, root: Path, password: str, owner: pwd.struct_passwd | None) -> None:
    """A cluster whose superuser `prefect` logs in over TCP with a password (local socket: trust)."""
    pwfile = root / "pwfile"
    pwfile.write_text(password + "\n")
    if owner:
        os.chown(pwfile, owner.pw_uid, owner.pw_gid)
    _run([str(bin_dir / "initdb"), "-D", str(root / "data"), "-U", "prefect", f"--pwfile={pwfile}",
          "--auth-local=trust", "--auth-host=scram-sha-256", "-E", "UTF8", "--no-locale"], owner)
    pwfile.unlink()


def _start(bin_dir: Path, root: Path, port: int, owner: pwd.struct_passwd | None) -> None:
    # fsync off: the tests never crash the database machine, and a 2-core CI box's disk is slow.
    options = f"-c listen_addresses=127.0.0.1 -p {port} -k {root} -c fsync=off"
    log = root / "postgres.log"
    try:
        _run([str(bin_dir / "pg_ctl"), "-D", str(root / "data"), "-l", str(log), "-w", "-t", "60", "-o", options,
              "start"], owner)
    except RuntimeError as error:  # the log goes with the directory: say what it said
        raise RuntimeError(f"{error}\n{log.read_text(errors='replace')[-2000:] if log.exists() else ''}") from None
    _run([str(bin_dir / "createdb"), "-h", str(root), "-p", str(port), "-U", "prefect", "prefect"], owner)


@contextmanager
def postgres_server() -> Iterator[Postgres]:
    """Start a fresh server; stop it (fast shutdown) and delete its files on exit."""
    bin_dir = find_binaries()
    assert bin_dir is not None, unavailable_reason()
    owner = _owner()
    # Not under pytest's tmp_path: that lives in a root-only directory the postgres account cannot enter.
    root = Path(tempfile.mkdtemp(prefix="phase1a-postgres-"))
    if owner:
        os.chown(root, owner.pw_uid, owner.pw_gid)
    port, password = free_port(), secrets.token_urlsafe(16)
    try:
        _init(bin_dir, root, password, owner)
        _start(bin_dir, root, port, owner)
        yield Postgres(port, password)
    finally:
        if (root / "data" / "postmaster.pid").exists():
            subprocess.run([str(bin_dir / "pg_ctl"), "-D", str(root / "data"), "-m", "fast", "-w", "stop"],
                           capture_output=True, timeout=60, **_as(owner))
        shutil.rmtree(root, ignore_errors=True)
