"""What uv.lock installs on each platform: walked here from the project's entry as `uv sync --frozen` walks it (markers
evaluated for the platform, the extra's conflict markers included), so a re-lock that hands a GPU host the local CPU
wheel, or this machine CUDA torch, fails here. And the Makefile's choice of torch's build (TORCH)."""
from __future__ import annotations

import subprocess
import tomllib
from pathlib import Path

import pytest
from packaging.markers import Marker

ROOT = Path(__file__).resolve().parents[1]
LOCK = tomllib.loads((ROOT / "uv.lock").read_text())
CPU_WHEEL = "/opt/wheels/torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl"
CUDA_PACKAGES = {"triton", "cuda-toolkit", "cuda-bindings", "nvidia-cudnn-cu13", "nvidia-nccl-cu13", "nvidia-cublas"}


def platform(python: str, system: str, machine: str) -> dict[str, str]:
    return {"python_full_version": python, "python_version": ".".join(python.split(".")[:2]),
            "sys_platform": system, "platform_system": {"linux": "Linux", "darwin": "Darwin"}[system],
            "platform_machine": machine, "platform_python_implementation": "CPython",
            "implementation_name": "cpython", "os_name": "posix"}


LINUX_311 = platform("3.11.7", "linux", "x86_64")
LINUX_312 = platform("3.12.8", "linux", "x86_64")
MACOS_312 = platform("3.12.8", "darwin", "arm64")


def installed(env: dict[str, str], extras: tuple[str, ...] = (), groups: tuple[str, ...] = ("dev",)) -> dict:
    """Every package the lock installs for `env` with the project's `extras` and `groups`: name -> its lock entry.
    An activated extra is the marker value `extra-<len>-<project>-<extra>` (uv's encoding of conflicting extras)."""
    entries = {}
    for package in LOCK["package"]:
        entries.setdefault(package["name"], []).append(package)
    project = next(p for p in LOCK["package"] if p.get("source") == {"editable": "."})
    name = project["name"]
    active = [f"extra-{len(name)}-{name}-{extra}" for extra in extras] or [""]
    assert len(active) == 1, "the lock declares the torch extras as conflicting: one at a time"
    marker_env = env | {"extra": active[0]}

    def entry(dependency: dict) -> dict:
        candidates = [p for p in entries[dependency["name"]]
                      if dependency.get("version", p["version"]) == p["version"]
                      and dependency.get("source", p["source"]) == p["source"]]
        assert len(candidates) == 1, f"uv.lock: {dependency} names {len(candidates)} packages"
        return candidates[0]

    found, todo = {}, [(project, "dependencies", None)]
    for extra in extras:
        todo.append((project, "optional-dependencies", extra))
    for group in groups:
        todo.append((project, "dev-dependencies", group))
    while todo:
        package, table, key = todo.pop()
        dependencies = package.get(table, [])
        for dependency in dependencies[key] if key else dependencies:
            if "marker" in dependency and not Marker(dependency["marker"]).evaluate(marker_env):
                continue
            target = entry(dependency)
            seen = found.setdefault(target["name"], target)
            assert seen is target, f"uv.lock gives {target['name']} twice for {env}: {seen['version']}, " \
                                   f"{target['version']}"
            todo.append((target, "dependencies", None))
            for extra in dependency.get("extra", []):
                todo.append((target, "optional-dependencies", extra))
    return found


def wheel_for(package: dict, tag: str) -> str:
    wheels = [w.get("url") or w.get("path") for w in package.get("wheels", [])]
    matching = [w for w in wheels if tag in w]
    assert matching, f"uv.lock: {package['name']} {package['version']} has no wheel with {tag}: {wheels}"
    return matching[0]


@pytest.mark.parametrize("env, tag", [(LINUX_311, "cp311-cp311-manylinux_2_28_x86_64"),
                                      (LINUX_312, "cp312-cp312-manylinux_2_28_x86_64")])
def test_linux_x86_64_default_is_pypi_cuda_torch(env, tag):
    packages = installed(env)
    torch = packages["torch"]
    assert (torch["version"], torch["source"]) == ("2.13.0", {"registry": "https://pypi.org/simple"})
    assert wheel_for(torch, tag).startswith("https://files.pythonhosted.org/")
    assert CUDA_PACKAGES <= packages.keys(), CUDA_PACKAGES - packages.keys()
    assert packages["nvidia-cublas"]["source"] == {"registry": "https://pypi.org/simple"}
    # The same with the `cuda` extra named, as `make setup TORCH=cuda` installs it.
    assert installed(env, ("cuda",))["torch"] is torch


def test_cpu_extra_takes_the_local_wheel_and_no_cuda_package():
    packages = installed(LINUX_311, ("cpu",))
    torch = packages["torch"]
    assert (torch["version"], torch["source"]) == ("2.13.0+cpu", {"registry": "/opt/wheels"})
    assert wheel_for(torch, "cp311-cp311-manylinux_2_28_x86_64") == CPU_WHEEL
    assert not CUDA_PACKAGES & packages.keys()
    assert not [name for name in packages if name.startswith(("nvidia-", "cuda-"))]
    # Everything but torch (and what only CUDA torch needs) is the same as the default's: one set of versions.
    default = installed(LINUX_311)
    assert {n: p["version"] for n, p in packages.items() if n != "torch"} == \
           {n: p["version"] for n, p in default.items() if n in packages and n != "torch"}


def test_macos_takes_pypi_torch():
    torch = installed(MACOS_312)["torch"]
    assert (torch["version"], torch["source"]) == ("2.13.0", {"registry": "https://pypi.org/simple"})
    assert wheel_for(torch, "cp312-cp312-macosx").endswith("arm64.whl")
    assert not CUDA_PACKAGES & installed(MACOS_312).keys()


def test_the_local_index_serves_only_the_cpu_extra():
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    uv = pyproject["tool"]["uv"]
    assert "find-links" not in uv, "find-links would offer the local wheel to every resolution"
    index = {i["name"]: i for i in uv["index"]}["local-cpu"]
    assert (index["format"], index["explicit"]) == ("flat", True)
    assert uv["sources"]["torch"] == [{"index": "local-cpu", "extra": "cpu"}]


def make_setup(*args: str) -> subprocess.CompletedProcess:
    # -n: print what setup runs, run nothing. UV: any file that exists (the target's prerequisite), so that a missing
    # .tools/bin/uv adds no install lines.
    return subprocess.run(["make", "-n", "setup", "UV=/bin/true", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=60)


def test_makefile_picks_torch_and_takes_a_choice():
    has_gpu = subprocess.run("nvidia-smi -L 2>/dev/null | grep -q GPU", shell=True).returncode == 0
    default = "cpu" if Path(CPU_WHEEL).is_file() and not has_gpu else "cuda"
    assert make_setup().stdout.strip() == f"/bin/true sync --frozen --extra {default}"
    for torch in ("cpu", "cuda"):
        assert make_setup(f"TORCH={torch}").stdout.strip() == f"/bin/true sync --frozen --extra {torch}"
    wrong = make_setup("TORCH=rocm")
    assert wrong.returncode != 0 and "TORCH=rocm" in wrong.stderr and "cpu or cuda" in wrong.stderr
