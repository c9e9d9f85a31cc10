"""Starting the ranks: one torchrun agent a node, `processes` ranks each (docs/operations.md#several-nodes).

One node: `torchrun --standalone`. Several: every agent joins a c10d rendezvous on the first node's
`rendezvous_port` (torchrun's elastic launch, as Axolotl and LLaMA-Factory use it); the agents then number the
ranks node by node. A rank that fails makes its agent restart the whole group from a new rendezvous round, up to
`max_restarts` times; the ranks resume from the run's latest checkpoint (phase1a/train/loop.py). An agent that dies (its
host lost, kill -9) stops the others, and the train stage starts the whole group again from a new rendezvous (as a
JobSet restarts its jobs), up to `max_restarts` times as well.

Where the agents run:
- `hosts`: `hardware.nodes`, one agent each: this machine's name (or localhost) runs here, another host over
  ssh, in the same directory.
- `slurm`: inside an allocation (`sbatch`), `srun` runs one agent on each of its first `num_nodes` nodes; the
  batch step's host is the rendezvous.
- `kubernetes`: `hardware.kubernetes`, an Indexed Job of one pod a node (phase1a/train/k8s_nodes.py); pod 0 is the
  rendezvous, and the shared filesystem is a ReadWriteMany volume every pod mounts.
Both need the run's directories (work_dir, cache_dir) on a filesystem every node mounts at the same path, as a
Slurm cluster's shared home or Lustre is: a rank that cannot see them fails, naming the directory.
"""
from __future__ import annotations

import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, Field

from phase1a.config.schema import HardwareConfig, KubernetesNodes
from phase1a.core.hardware import usable_cores
from phase1a.train.k8s_nodes import (
    KubernetesFailed,
    PodGroup,
    check_shared,
    kubernetes_api,
    manifests,
    object_name,
    rendezvous_host,
    run_job,
)

_LOCAL_NAMES = {"localhost", "127.0.0.1", "::1"}
_STOP_SECONDS = 90  # a stopped launch's agents: time for their ranks' last checkpoint


class LaunchError(RuntimeError):
    """The ranks did not all end well; the message says which agent and how."""


class LaunchStopped(RuntimeError):
    """The launch was asked to stop (a spot notice, the store's lease lost): its agents had SIGTERM, as a signal to
    this process gives them, and have ended; their ranks wrote a checkpoint at the step they were in."""


class Launch(BaseModel):
    """How a run's ranks start: `nodes` agents of `processes` ranks each."""

    processes: int = Field(1, ge=1)  # ranks a node: its GPUs
    nodes: int = Field(1, ge=1)
    launcher: Literal["hosts", "slurm", "kubernetes"] = "hosts"
    hosts: list[str] = Field(default_factory=list)  # `hosts`: one a node, the first is the rendezvous
    kubernetes: KubernetesNodes | None = None  # `kubernetes`: the pods' image, namespace and shared volume
    rendezvous_port: int = 29400
    max_restarts: int = Field(3, ge=0)
    run_id: str = "phase1a"  # the rendezvous' name: the training key, so two runs never meet
    # A rank's program before its settings file, e.g. ["-m", "phase1a.train.rank"]: the runner that launches sets it.
    entry: list[str] = Field(default_factory=list)

    @property
    def world_size(self) -> int:
        return self.nodes * self.processes

    @property
    def several(self) -> bool:
        return self.world_size > 1


def launch_for(hardware: HardwareConfig, run_id: str) -> Launch:
    """The config's nodes and GPUs as a launch; several nodes need `hardware.nodes` or a Slurm allocation."""
    launch = Launch(processes=hardware.num_gpus, nodes=hardware.num_nodes, hosts=hardware.nodes,
                    rendezvous_port=hardware.rendezvous_port, max_restarts=hardware.max_restarts, run_id=run_id)
    if launch.nodes == 1 or hardware.nodes:
        return launch
    if hardware.kubernetes is not None:
        return launch.model_copy(update={"launcher": "kubernetes", "kubernetes": hardware.kubernetes})
    if in_slurm_allocation():
        return launch.model_copy(update={"launcher": "slurm"})
    raise LaunchError(f"hardware.num_nodes is {launch.nodes}: name the hosts in hardware.nodes, set "
                      "hardware.kubernetes, or run the flow inside a Slurm allocation (sbatch) "
                      "(docs/operations.md#several-nodes)")


def torchrun_command(launch: Launch, settings_path: Path, rendezvous_host: str | None = None) -> list[str]:
    """One agent's command: standalone on one node, else joining the c10d rendezvous at `rendezvous_host`."""
    if not launch.entry:
        raise LaunchError("the launch names no program for its ranks (Launch.entry)")
    launcher = shutil.which("torchrun", path=str(Path(sys.executable).parent)) or shutil.which("torchrun")
    base = [launcher] if launcher else [sys.executable, "-m", "torch.distributed.run"]
    program = [*launch.entry, str(settings_path)]
    if launch.nodes == 1:
        return [*base, "--standalone", f"--nproc_per_node={launch.processes}", *program]
    return [*base, f"--nnodes={launch.nodes}", f"--nproc_per_node={launch.processes}", "--rdzv_backend=c10d",
            f"--rdzv_endpoint={rendezvous_host}:{launch.rendezvous_port}", f"--rdzv_id={launch.run_id}",
            f"--max_restarts={launch.max_restarts}", *program]


def run_agents(launch: Launch, settings_path: Path, cwd: Path, stop: Callable[[], bool] | None = None) -> None:
    """Every agent of the run, to its end; raises LaunchError when they did not all end with 0 (the first that
    fails stops the others: the caller starts the whole group again: runner.py), LaunchStopped when `stop()`
    became true first."""
    if launch.launcher == "kubernetes" and launch.nodes > 1:
        return on_kubernetes(launch, settings_path, cwd, kubernetes_api())
    if launch.nodes == 1:
        agents = [_Agent(torchrun_command(launch, settings_path), cwd)]
    elif launch.launcher == "slurm":
        agents = [_Agent(slurm_command(launch, settings_path), cwd)]
    else:
        command = torchrun_command(launch, settings_path, launch.hosts[0])
        env = _local_threads(launch)
        agents = [_Agent(_on_host(host, command, cwd), cwd, host, env) for host in launch.hosts]
    _wait_all(agents, stop)


def _local_threads(launch: Launch) -> dict[str, str] | None:
    """Several agents on this machine share its cores: each rank gets its share of threads, as torchrun gives
    its own ranks (else every rank starts a thread a core, and they thrash: 5.3x slower measured on 2 cores)."""
    here = sum(is_this_host(host) for host in launch.hosts)
    if here < 2 or "OMP_NUM_THREADS" in os.environ:
        return None
    return {**os.environ, "OMP_NUM_THREADS": str(max(1, usable_cores() // (here * launch.processes)))}


# ---- kubernetes ----------------------------------------------------------------------------------------------

def on_kubernetes(launch: Launch, settings_path: Path, cwd: Path, api) -> None:
    """One pod a node in an Indexed Job (phase1a/train/k8s_nodes.py), agents joining on pod 0; `api`: the client."""
    settings = launch.kubernetes
    check_shared(settings, settings_path)
    name = object_name(launch.run_id)
    agent = torchrun_command(launch, settings_path, rendezvous_host(settings, name))
    service, job = manifests(settings, PodGroup(name=name, nodes=launch.nodes, gpus=launch.processes,
                                                port=launch.rendezvous_port, agent=agent, cwd=cwd))
    try:
        run_job(api, settings, service, job)
    except KubernetesFailed as failed:
        raise LaunchError(str(failed)) from None


# ---- slurm ---------------------------------------------------------------------------------------------------

def in_slurm_allocation() -> bool:
    return "SLURM_JOB_ID" in os.environ and "SLURM_JOB_NUM_NODES" in os.environ


def slurm_command(launch: Launch, settings_path: Path) -> list[str]:
    """`srun` of one agent on each of `launch.nodes` nodes of the allocation; this host (the batch step's, the
    allocation's first) is the rendezvous. srun ends every agent when one of them fails for good."""
    have = int(os.environ.get("SLURM_JOB_NUM_NODES", "0"))
    if have < launch.nodes:
        job = os.environ.get("SLURM_JOB_ID")
        raise LaunchError(f"hardware.num_nodes is {launch.nodes}, the Slurm allocation {job} has {have} nodes "
                          f"(SLURM_JOB_NUM_NODES): sbatch --nodes={launch.nodes}")
    agent = torchrun_command(launch.model_copy(update={"run_id": f"{launch.run_id}-{os.environ['SLURM_JOB_ID']}"}),
                             settings_path, socket.gethostname())
    return [shutil.which("srun") or "srun", f"--nodes={launch.nodes}", f"--ntasks={launch.nodes}",
            "--ntasks-per-node=1", "--kill-on-bad-exit=1", *agent]


# ---- hosts ---------------------------------------------------------------------------------------------------

def is_this_host(host: str) -> bool:
    return host in _LOCAL_NAMES or host in {socket.gethostname(), socket.getfqdn()}


def _on_host(host: str, command: list[str], cwd: Path) -> list[str]:
    """`command` here, or over ssh on `host` in the same directory (the same checkout and venv there)."""
    if is_this_host(host):
        return command
    remote = f"cd {shlex.quote(str(cwd))} && exec {shlex.join(command)}"
    return ["ssh", "-o", "BatchMode=yes", host, remote]


class _Agent:
    """One torchrun agent (or srun) as a child process."""

    def __init__(self, command: list[str], cwd: Path, host: str = "", env: dict[str, str] | None = None) -> None:
        self.host = host
        self.process = subprocess.Popen(command, cwd=cwd, env=env)

    def poll(self) -> int | None:
        return self.process.poll()

    def stop(self) -> None:
        """SIGTERM, which torchrun passes to its ranks (they checkpoint and stop), then SIGKILL past the wait."""
        if self.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=_STOP_SECONDS)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def _wait_all(agents: list[_Agent], stop: Callable[[], bool] | None = None) -> None:
    """Until every agent ended with 0; the first that fails fails the launch and stops the rest; `stop()` true
    stops them all (each agent's stop waits for its ranks' checkpoint)."""
    try:
        while True:
            codes = [agent.poll() for agent in agents]
            if all(code == 0 for code in codes):
                return
            if stop is not None and stop():
                raise LaunchStopped("asked to stop: the agents had SIGTERM")
            for number, (agent, code) in enumerate(zip(agents, codes)):
                if code not in (None, 0):
                    where = f" on {agent.host}" if agent.host else ""
                    raise LaunchError(f"torchrun agent {number}{where} exited with {code}")
            time.sleep(0.2)
    finally:
        for agent in agents:
            agent.stop()
