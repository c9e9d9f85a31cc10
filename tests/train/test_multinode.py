"""Two "nodes" on this machine: two torchrun agents (`--nnodes 2`, one rank each, gloo) joined by a c10d
rendezvous on a local port train the same steps as one process: under Slurm's srun, and on a host list where one
agent is killed mid-run and the launcher starts it again, so the group resumes from the last checkpoint."""
import json
import os
import socket
import stat
import threading
from pathlib import Path

import pytest
import torch

from helpers import date_records, make_tokenizer, write_jsonl
from helpers.prefect_stack import descendants, kill9, wait_for
from helpers.servers import free_port
from phase1a.config.schema import HardwareConfig, MethodConfig
from phase1a.core.layout import list_checkpoints
from phase1a.data.tokenizing import TokenizeOptions, tokenize_dataset
from phase1a.train.launch import Launch, LaunchError, launch_for, slurm_command, torchrun_command
from phase1a.train.rank import ENTRY, rank_settings
from phase1a.train.runner import run
from phase1a.train.settings import TrainSettings

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="gloo ranks on one CPU host")

# srun as it behaves on an allocation of SLURM_JOB_NUM_NODES nodes, each node here: one copy of the command a
# node, each with its node's variables; the exit code is the first failure's.
FAKE_SRUN = """#!/usr/bin/env bash
nodes=1
while [[ $1 == --* ]]; do case $1 in --nodes=*) nodes=${1#--nodes=};; esac; echo "$1" >> "$SRUN_LOG"; shift; done
pids=()
for ((node = 0; node < nodes; node++)); do SLURM_NODEID=$node SLURM_PROCID=$node "$@" & pids+=($!); done
code=0
for pid in "${pids[@]}"; do wait "$pid" || { [[ $code == 0 ]] && code=$?; }; done
exit $code
"""


@pytest.fixture(scope="module")
def job(tiny_model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("multinode")
    data = tokenize_dataset(write_jsonl(root / "d.jsonl", date_records(45)), make_tokenizer(), 256,
                            TokenizeOptions(), root / "cache" / "fp")

    def settings(name: str, launch: Launch = Launch(), epochs: int = 1) -> TrainSettings:
        return TrainSettings(model_dir=str(tiny_model_dir), train_path=data.train_path, output_dir=str(root / name),
                             launch=launch, method=MethodConfig(learning_rate=5e-3, batch_size=8, epochs=epochs,
                                                                lora={"r": 4, "alpha": 8}),
                             micro_batch_size=2, gradient_checkpointing=False, checkpoint_interval="2steps",
                             keep_last=3, show_progress=False)

    return settings


def losses(result) -> list[float]:
    return [json.loads(line)["loss"] for line in open(Path(result.output_dir) / "metrics.jsonl")]


def assert_same_run(one, other) -> None:
    """The same steps, the same per-step losses (the step's, summed over ranks) and the same final adapter."""
    assert other.steps == one.steps
    torch.testing.assert_close(losses(other), losses(one), rtol=1e-4, atol=1e-5)
    from safetensors.torch import load_file

    a, b = (load_file(Path(r.adapter_dir) / "adapter_model.safetensors") for r in (one, other))
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(b[name], a[name], rtol=1e-4, atol=1e-5, msg=name)


def test_the_config_makes_the_launch_and_refuses_nodes_without_a_launcher(monkeypatch):
    hardware = HardwareConfig(num_gpus=8, nodes=["gpu-a", "gpu-b"], rendezvous_port=29555)
    launch = launch_for(hardware, "train-abc").model_copy(update={"entry": ENTRY})
    assert (launch.nodes, launch.processes, launch.world_size, launch.launcher) == (2, 8, 16, "hosts")
    command = torchrun_command(launch, Path("s.json"), "gpu-a")
    assert command[1:7] == ["--nnodes=2", "--nproc_per_node=8", "--rdzv_backend=c10d", "--rdzv_endpoint=gpu-a:29555",
                            "--rdzv_id=train-abc", "--max_restarts=3"]
    assert command[-3:] == ["-m", "phase1a.train.rank", "s.json"]
    with pytest.raises(LaunchError, match="names no program"):
        torchrun_command(launch.model_copy(update={"entry": []}), Path("s.json"), "gpu-a")
    with pytest.raises(ValueError, match="num_nodes is 3 and nodes names 2 hosts"):
        HardwareConfig(num_nodes=3, nodes=["a", "b"])
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    with pytest.raises(LaunchError, match="hardware.nodes, set hardware.kubernetes, or run the flow inside a Slurm"):
        launch_for(HardwareConfig(num_nodes=2), "train-abc")
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    monkeypatch.setenv("SLURM_JOB_NUM_NODES", "1")
    slurm = launch_for(HardwareConfig(num_nodes=2), "train-abc")
    with pytest.raises(LaunchError, match="the Slurm allocation 77 has 1 nodes"):
        slurm_command(slurm, Path("s.json"))


def test_a_rank_on_a_node_without_the_shared_filesystem_names_it(tmp_path):
    with pytest.raises(FileNotFoundError, match="a filesystem every node mounts at the same path"):
        rank_settings(tmp_path / "train-x" / "settings.json")


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "hsdp"])
def test_two_nodes_under_srun_train_the_steps_of_one_process(job, tmp_path, monkeypatch, strategy):
    srun = tmp_path / "bin" / "srun"
    srun.parent.mkdir()
    srun.write_text(FAKE_SRUN)
    srun.chmod(srun.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{srun.parent}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("SRUN_LOG", str(tmp_path / "srun.log"))
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    monkeypatch.setenv("SLURM_JOB_NUM_NODES", "2")
    one = run(job("one"))
    launch = launch_for(HardwareConfig(num_nodes=2, rendezvous_port=free_port()), "train-srun")
    assert launch.launcher == "slurm" and launch.world_size == 2
    two = run(job(f"srun-{strategy}", launch).model_copy(update={"strategy": strategy}))
    assert two.train_tokens == one.train_tokens  # every rank's tokens
    assert (tmp_path / "srun.log").read_text().split() == ["--nodes=2", "--ntasks=2", "--ntasks-per-node=1",
                                                            "--kill-on-bad-exit=1"]
    agent = slurm_command(launch.model_copy(update={"entry": ENTRY}), Path("s.json"))
    assert {"--nnodes=2", "--nproc_per_node=1", "--rdzv_id=train-srun-4242"} <= set(agent)
    assert f"--rdzv_endpoint={socket.gethostname()}:{launch.rendezvous_port}" in agent
    assert_same_run(one, two)


@pytest.mark.slow
def test_a_node_killed_mid_run_rejoins_and_the_group_resumes_to_the_same_weights(job):
    one = run(job("one-4-epochs", epochs=4))
    launch = Launch(nodes=2, hosts=["127.0.0.1", "localhost"], rendezvous_port=free_port(), run_id="train-killed")
    settings = job("killed", launch, epochs=4)
    checkpoints = Path(settings.output_dir) / "checkpoints"
    killed: list[int] = []

    def kill_the_second_node_after_a_checkpoint() -> None:
        wait_for(lambda: list_checkpoints(checkpoints), 300, "a first checkpoint", interval=0.02)
        agents = [pid for pid in descendants(os.getpid()) if b"--nnodes=2" in Path(f"/proc/{pid}/cmdline").read_bytes()]
        second = max(agents)  # the agent started second: the rendezvous' client
        killed.append(len(list_checkpoints(checkpoints)))
        kill9([second, *descendants(second)])  # the node lost: its agent and its rank

    killer = threading.Thread(target=kill_the_second_node_after_a_checkpoint, daemon=True)
    killer.start()
    result = run(settings)
    killer.join(timeout=10)
    assert killed, "the second node was never killed"
    events = [json.loads(line) for line in open(Path(result.output_dir) / "events.jsonl")]
    [restarted] = [event for event in events if event["event"] == "group_restarted"]
    assert "torchrun agent 1 on localhost exited with -9" in restarted["failure"], restarted
    resumed = [event for event in events if event["event"] == "resumed"]
    assert resumed and resumed[-1]["from_step"] >= killed[0] * 2, events  # from a checkpoint, every 2 steps
    assert result.resumed_from_step == resumed[-1]["from_step"]
    assert_same_run(one, result)
