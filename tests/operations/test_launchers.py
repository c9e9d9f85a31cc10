"""The launchers users' platforms take, read by those platforms' own code, with no account and no cloud:
launchers/skypilot.yaml by SkyPilot's parser (`sky.Task.from_yaml`, as `sky jobs launch` reads it; SkyPilot cannot
share the project's venv, so it runs in an isolated uv environment), and launchers/modal_app.py by the Modal client
(the app's function, its GPU, timeout, retries, secret and volume, and its image's build steps), without network."""
from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
UV = shutil.which("uv") or str(ROOT / ".tools" / "bin" / "uv")
SKYPILOT = "skypilot==0.14.1"

READ_TASK = """
import json, sys, yaml
import sky

path = sys.argv[1]
as_written = sky.Task.from_yaml(path)
# As `sky jobs launch ... --env PHASE1A_CONFIG=... --secret AWS_ACCESS_KEY_ID --secret AWS_SECRET_ACCESS_KEY` makes it.
launched = sky.Task.from_yaml_config(yaml.safe_load(open(path)), env_overrides=[("PHASE1A_CONFIG", sys.argv[2])],
                                     secrets_overrides=[("AWS_ACCESS_KEY_ID", "id"), ("AWS_SECRET_ACCESS_KEY", "key")])
[resources] = as_written.resources
print(json.dumps({"name": as_written.name, "accelerators": resources.accelerators, "use_spot": resources.use_spot,
                  "image": resources.extract_docker_image(), "disk_size": resources.disk_size,
                  "job_recovery": resources.job_recovery, "envs": as_written.envs, "run": as_written.run,
                  "launched_envs": launched.envs, "launched_secrets": sorted(launched.secrets)}))
"""


@pytest.mark.slow
@pytest.mark.skipif(not Path(UV).exists(), reason="uv is not installed (make setup installs it under .tools/)")
def test_the_skypilot_task_is_what_skypilot_reads(tmp_path):
    """On the 2-core VM with other suites running (load 8 to 9): 73 s with an empty uv cache (skypilot's 97 packages
    downloaded), 45 s from the cache, most of it `import sky`."""
    # --no-config: the project's uv settings (bytecode compilation) are not this throwaway environment's.
    done = subprocess.run([UV, "run", "--no-config", "--no-project", "--with", SKYPILOT, "python", "-c", READ_TASK,
                           str(ROOT / "launchers" / "skypilot.yaml"), "s3://my-bucket/jobs/my-job.yaml"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    task = json.loads(done.stdout.strip().splitlines()[-1])
    assert task["accelerators"] == {"H100": 1} and task["use_spot"] is True
    assert task["image"] == "phase1a:latest" and task["disk_size"] == 256
    assert task["job_recovery"] == {"strategy": "EAGER_NEXT_REGION", "max_restarts_on_errors": 2,
                                    "recover_on_exit_codes": [143]}
    assert task["envs"]["PHASE1A_CONFIG"].startswith("s3://")
    assert task["launched_envs"]["PHASE1A_CONFIG"] == "s3://my-bucket/jobs/my-job.yaml"
    assert task["launched_secrets"] == ["AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"]
    assert 'phase1a run --config "$PHASE1A_CONFIG"' in task["run"]


def _image_layers(image) -> list[tuple[str, object]]:
    """The image's layers, base first: ('dockerfile', its commands) for each build step, ('mount', what it adds)
    for local files. Modal keeps them in each layer's loader until an app is deployed; read them from there."""
    from modal._utils.async_utils import synchronizer

    layers, layer = [], synchronizer._translate_in(image)
    while layer is not None:
        cells = {name: cell.cell_contents for name, cell in
                 zip(layer._load.__code__.co_freevars, layer._load.__closure__ or ())}
        if cells.get("dockerfile_function"):
            layers.append(("dockerfile", cells["dockerfile_function"]("2025.06").commands))
        if "mount" in cells:
            layers.append(("mount", cells["mount"]._entries))
        bases = cells.get("base_images") or ({"base": cells["base_image"]} if "base_image" in cells else {})
        layer = next(iter(bases.values()), None)
    return layers[::-1]


def test_the_modal_app_runs_the_cli_on_an_h100_from_an_image_of_the_lock():
    spec = importlib.util.spec_from_file_location("phase1a_modal_app", ROOT / "launchers" / "modal_app.py")
    app_module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(app_module)

    info = app_module.run.info()  # set where the function is defined: no network
    assert info.gpus == [("H100", 1)] and info.timeout == 24 * 60 * 60 and info.max_retries == 2
    assert info.secrets == ["modal.Secret.from_name('phase1a-store')"]
    assert {path: volume.name for path, volume in info.volumes.items()} == {"/runs-volume": "phase1a-runs"}
    assert app_module.app.name == "phase1a" and app_module.start.info.raw_f.__name__ == "start"

    layers = _image_layers(app_module.image)
    kinds = [kind for kind, _ in layers]
    assert kinds == ["dockerfile", "dockerfile", "dockerfile", "mount", "mount", "mount"], layers
    base, dependencies, env = (commands for kind, commands in layers if kind == "dockerfile")
    assert base[0].startswith("FROM python:3.11")
    sync = [command for command in dependencies if "uv sync" in command]
    extras = "".join(f"--extra={name} " for name in app_module.EXTRAS)
    assert sync == [f"RUN /.uv/uv sync --project=/.uv --no-install-workspace --compile-bytecode {extras}--no-dev "
                    "--frozen"], dependencies
    assert app_module.EXTRAS[:2] == ["cuda", "tracking"]  # PyPI's CUDA torch, not the CPU wheel of /opt/wheels
    assert "COPY /.uv.lock /.uv/uv.lock" in dependencies  # the lock, frozen: the versions the tests ran
    assert env == ["FROM base", "ENV PYTHONUNBUFFERED=1"]
    assert {entry.module_name for entry in layers[3][1]} == {"phase1a", "flows", "tasks"}
    assert {str(entry.remote_path) for _, entries in layers[4:] for entry in entries} == \
        {"/root/configs", "/root/data/eval"}
