"""What uv.lock installs on a platform, walked from the project's entry as `uv sync --frozen` walks it: each
dependency's marker evaluated for the platform (a chosen extra is uv's conflict marker
`extra-<len>-<project>-<extra>`), the versions and sources the lock pinned, the extras a dependency names."""
from __future__ import annotations

import tomllib
from pathlib import Path

from packaging.markers import Marker

ROOT = Path(__file__).resolve().parents[2]


def platform(python: str, system: str, machine: str) -> dict[str, str]:
    """The marker environment of CPython `python` on `system` (linux, darwin) and `machine`."""
    return {"python_full_version": python, "python_version": ".".join(python.split(".")[:2]),
            "sys_platform": system, "platform_system": {"linux": "Linux", "darwin": "Darwin"}[system],
            "platform_machine": machine, "platform_python_implementation": "CPython",
            "implementation_name": "cpython", "os_name": "posix"}


LINUX_311 = platform("3.11.7", "linux", "x86_64")
LINUX_312 = platform("3.12.8", "linux", "x86_64")
MACOS_312 = platform("3.12.8", "darwin", "arm64")


def read_lock(path: Path = ROOT / "uv.lock") -> dict:
    return tomllib.loads(path.read_text())


def installed(env: dict[str, str], extras: tuple[str, ...] = (), groups: tuple[str, ...] = ("dev",),
              lock: dict | None = None) -> dict[str, dict]:
    """Every package the lock installs for `env` with the project's `extras` and dependency `groups`: name -> its
    lock entry. At most one of the extras that conflict (cpu, cuda) at a time, as uv allows."""
    lock = lock or read_lock()
    entries: dict[str, list[dict]] = {}
    for package in lock["package"]:
        entries.setdefault(package["name"], []).append(package)
    project = next(p for p in lock["package"] if p.get("source") == {"editable": "."})
    name = project["name"]
    torch_extras = [extra for extra in extras if extra in ("cpu", "cuda")]
    assert len(torch_extras) <= 1, "the lock declares the torch extras as conflicting: one at a time"
    marker_env = env | {"extra": f"extra-{len(name)}-{name}-{torch_extras[0]}" if torch_extras else ""}

    def entry(dependency: dict) -> dict:
        candidates = [p for p in entries[dependency["name"]]
                      if dependency.get("version", p["version"]) == p["version"]
                      and dependency.get("source", p["source"]) == p["source"]]
        assert len(candidates) == 1, f"uv.lock: {dependency} names {len(candidates)} packages"
        return candidates[0]

    found: dict[str, dict] = {}
    todo = [(project, "dependencies", None)] + [(project, "optional-dependencies", extra) for extra in extras] + \
           [(project, "dev-dependencies", group) for group in groups]
    while todo:
        package, table, key = todo.pop()
        dependencies = package.get(table, [])
        for dependency in dependencies.get(key, []) if key else dependencies:
            if "marker" in dependency and not Marker(dependency["marker"]).evaluate(marker_env):
                continue
            target = entry(dependency)
            seen = found.setdefault(target["name"], target)
            assert seen is target, f"uv.lock gives {target['name']} twice for {env}: {seen['version']}, " \
                                   f"{target['version']}"
            if target is not project:  # the project itself (a group naming its extras): those extras, below
                todo.append((target, "dependencies", None))
            todo += [(target, "optional-dependencies", extra) for extra in dependency.get("extra", [])]
    found.pop(name, None)
    return found
