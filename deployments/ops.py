"""Idempotent set-up of a Prefect server for phase1a: work pools, and automations that keep runs honest.

    python deployments/ops.py pools [--templates]   # phase1a-cpu, -h100, -h200 (process), -k8s, -docker
    python deployments/ops.py automations [--zombie-after 600] [--crash-retries 3]
                                          [--notify-block custom-webhook/phase1a-alerts]

Run through `make pools` / `make automations` (docs/operations.md); PREFECT_API_URL names the server.
Both commands converge on the state described here whatever exists already, so re-running them is harmless.
"""
from __future__ import annotations

import argparse
import sys
from datetime import timedelta

# GPU pools run one flow run at a time: two trainings on one GPU would both be slow and could run out of
# memory. The CPU pool (the demo) takes as many as its workers start.
POOLS: dict[str, int | None] = {"phase1a-cpu": None, "phase1a-h100": 1, "phase1a-h200": 1}
# Pools whose runs start this project's image (deployments/job_templates.py: type, concurrency limit). Each
# Kubernetes run is a pod of its own, on a GPU the cluster finds, so the pool runs many at once; a Docker worker
# starts containers on its own host, whose GPUs take one run at a time.
IMAGE_POOLS: dict[str, tuple[str, int | None]] = {"phase1a-k8s": ("kubernetes", None), "phase1a-docker": ("docker", 1)}

ZOMBIE_AUTOMATION = "phase1a: crash flow runs that stopped sending heartbeats"
NOTIFY_AUTOMATION = "phase1a: notify when a flow run fails or crashes"
RETRY_AUTOMATION = "phase1a: run crashed flow runs again"
RETRY_AFTER = timedelta(seconds=30)  # how long a run stays Crashed before it is retried (retry_automation)


def _job_templates():
    """deployments/job_templates.py, loaded by its path: this file runs as a script and is loaded by path too."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location("phase1a_job_templates", Path(__file__).with_name("job_templates.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def ensure_pools(client, replace_templates: bool = False) -> list[str]:
    """The process pools with the worker's default template, the image pools with ours. An image pool that exists
    keeps its template (it may hold a Secret's reference added since) unless `replace_templates`."""
    from prefect.client.schemas.actions import WorkPoolCreate, WorkPoolUpdate
    from prefect.exceptions import ObjectNotFound
    from prefect.workers.process import ProcessWorker

    templates = _job_templates().TEMPLATES
    wanted = {**{name: ("process", limit) for name, limit in POOLS.items()}, **IMAGE_POOLS}
    done = []
    for name, (kind, limit) in wanted.items():
        try:
            template = ProcessWorker.get_default_base_job_template() if kind == "process" else templates[kind]()
        except ImportError as missing:  # a host without the image workers' packages still gets its process pools
            done.append(f"{name}: skipped ({missing.name} is not installed: pip install {kind}'s Prefect "
                        f"integration, prefect-{kind})")
            continue
        try:
            pool = client.read_work_pool(name)
        except ObjectNotFound:
            client.create_work_pool(WorkPoolCreate(name=name, type=kind, concurrency_limit=limit,
                                                   base_job_template=template))
            done.append(f"{name}: created ({kind}, concurrency limit {limit})")
            continue
        if pool.type != kind:
            raise SystemExit(f"work pool {name} exists with type {pool.type!r}, expected {kind!r}; delete it first")
        changes = {}
        if pool.concurrency_limit != limit:
            # Only fields set explicitly are sent, so an explicit None clears a limit.
            changes["concurrency_limit"] = limit
            done.append(f"{name}: concurrency limit {pool.concurrency_limit} -> {limit}")
        if kind != "process" and pool.base_job_template != template:
            if replace_templates:
                changes["base_job_template"] = template
                done.append(f"{name}: base job template replaced")
            else:
                done.append(f"{name}: its base job template differs from deployments/job_templates.py's; kept "
                            f"(`python deployments/ops.py pools --templates` replaces it)")
        if changes:
            client.update_work_pool(name, WorkPoolUpdate(**changes))
        elif kind == "process" or pool.base_job_template == template:
            done.append(f"{name}: exists ({kind}, concurrency limit {limit})")
    return done


def zombie_automation(after_seconds: int):
    """A run whose process died with its worker (machine lost, OOM-killed container, kill -9) stops sending
    `prefect.flow-run.heartbeat` events but stays Running forever, and with a pool limit of 1 it would hold
    the GPU pool's only slot: every later night would wait behind it. This marks such a run Crashed once no
    heartbeat (nor a final state) has arrived for `after_seconds`. Workers send heartbeats every
    PREFECT_FLOWS_HEARTBEAT_FREQUENCY seconds (`make worker` sets 60); `after_seconds` must leave room for
    several of them."""
    from prefect.client.schemas.objects import StateType
    from prefect.events.actions import ChangeFlowRunState
    from prefect.events.schemas.automations import AutomationCore, EventTrigger, Posture
    from prefect.events.schemas.events import ResourceSpecification

    return AutomationCore(
        name=ZOMBIE_AUTOMATION,
        description="Heartbeats are missing: the flow-run process is gone. Rerun the deployment to resume "
                    "training from its last checkpoint.",
        trigger=EventTrigger(
            after={"prefect.flow-run.heartbeat"},
            expect={"prefect.flow-run.heartbeat", "prefect.flow-run.Completed", "prefect.flow-run.Failed",
                    "prefect.flow-run.Cancelled", "prefect.flow-run.Crashed"},
            match=ResourceSpecification({"prefect.resource.id": ["prefect.flow-run.*"]}),
            match_related=ResourceSpecification({"prefect.resource.role": "flow", "prefect.resource.name": "phase1a"}),
            for_each={"prefect.resource.id"},
            posture=Posture.Proactive,
            threshold=1,
            within=timedelta(seconds=after_seconds),
        ),
        actions=[ChangeFlowRunState(
            state=StateType.CRASHED,
            message=f"No heartbeat for {after_seconds} s: the flow-run process or its worker died. "
                    "Run the deployment again to resume from the last checkpoint.")],
    )


def retry_automation(retries: int, after: timedelta = RETRY_AFTER):
    """A phase1a deployment run that ends Crashed (its process killed or OOM-killed: its worker says so; its machine
    lost: the zombie automation above says so) and is still Crashed `after` later is scheduled again, as `prefect
    flow-run retry` does: the same flow run, so the same deployment, parameters and job variables, taken by the
    pool's next free worker. Its stages come from the caches and training resumes from the last checkpoint (the
    store's, on another host).

    Attempts: Prefect counts a flow run's starts (`run_count`, the `prefect.run-count` label of its state events),
    and the trigger takes a crash at start 1 to `retries` only, so a run that keeps crashing is started `retries`
    more times at most, then stays Crashed. A run that crashed before it started (run count 0: its
    infrastructure could not be created) is left alone, as it would crash again without ever counting, and so
    is a Failed run (a bad config, a refused gate, an error in a stage): it would fail again.

    The wait: a process worker reports a crash twice, its runner at once and itself once the runner has loaded
    the flow for its crash hooks (seconds, a minute on a loaded host). A run scheduled again in between would be
    marked Crashed by the second report; after the wait it falls on the Crashed run and is refused. Any other
    news of the run meanwhile (a manual retry, a cancel) stands the automation down.

    Not RunDeployment, which would make a new flow run: Prefect 3.8's action can give that run neither tags nor a
    name, and a trigger matches the labels a run has, never those it lacks, so no trigger could tell a first
    run from one the automation started, and nothing would count the attempts."""
    from prefect.client.schemas.objects import StateType
    from prefect.events.actions import ChangeFlowRunState
    from prefect.events.schemas.automations import AutomationCore, EventTrigger, Posture
    from prefect.events.schemas.events import ResourceSpecification

    return AutomationCore(
        name=RETRY_AUTOMATION,
        description=f"A phase1a deployment run still Crashed {after.total_seconds():.0f} s after it crashed is "
                    f"started again, {retries} time(s) at most; training resumes from its last checkpoint. "
                    "Failed runs are not retried.",
        trigger=EventTrigger(
            after={"prefect.flow-run.Crashed"},
            expect={"prefect.flow-run.*"},
            match=ResourceSpecification({"prefect.resource.id": ["prefect.flow-run.*"],
                                         "prefect.run-count": [str(count) for count in range(1, retries + 1)]}),
            # Only a deployment's runs can be scheduled again; a run of `phase1a run` has no worker to take it.
            match_related=[
                ResourceSpecification({"prefect.resource.role": "flow", "prefect.resource.name": "phase1a"}),
                ResourceSpecification({"prefect.resource.role": "deployment"})],
            for_each={"prefect.resource.id"},
            posture=Posture.Proactive,
            threshold=1,
            within=after,
        ),
        # force: Crashed is a terminal state, which only a forced transition leaves (as `prefect flow-run retry`).
        actions=[ChangeFlowRunState(
            state=StateType.SCHEDULED, force=True,
            message=f"Crashed: scheduled again by the automation {RETRY_AUTOMATION!r} ({retries} time(s) at most), "
                    "to resume from the last checkpoint")],
    )


def notify_automation(block_document_id):
    """Any phase1a flow run that ends Failed, Crashed or TimedOut sends one notification through a
    notification block (Slack, Microsoft Teams, e-mail, PagerDuty, a custom webhook, ...)."""
    from prefect.events.actions import SendNotification
    from prefect.events.schemas.automations import AutomationCore, EventTrigger, Posture
    from prefect.events.schemas.events import ResourceSpecification

    return AutomationCore(
        name=NOTIFY_AUTOMATION,
        trigger=EventTrigger(
            expect={"prefect.flow-run.Failed", "prefect.flow-run.Crashed", "prefect.flow-run.TimedOut"},
            match=ResourceSpecification({"prefect.resource.id": ["prefect.flow-run.*"]}),
            match_related=ResourceSpecification({"prefect.resource.role": "flow", "prefect.resource.name": "phase1a"}),
            posture=Posture.Reactive,
            threshold=1,
            within=timedelta(0),
        ),
        actions=[SendNotification(
            block_document_id=block_document_id,
            subject="phase1a: flow run {{ flow_run.name }} {{ flow_run.state.name }}",
            body="phase1a flow run {{ flow_run.name }} ({{ flow_run.id }}) of deployment {{ deployment.name }} "
                 "ended {{ flow_run.state.name }}: {{ flow_run.state.message }}",
        )],
    )


def _replace(client, automation) -> str:
    """Create the automation, replacing any of the same name, so its definition here always wins."""
    old = client.read_automations_by_name(automation.name)
    for existing in old:
        client.delete_automation(existing.id)
    created = client.create_automation(automation)
    return f"{automation.name}: {'replaced' if old else 'created'} ({created})"


def _remove(client, name: str) -> str:
    old = client.read_automations_by_name(name)
    for existing in old:
        client.delete_automation(existing.id)
    return f"{name}: {'removed' if old else 'not installed'}"


def ensure_automations(client, zombie_after: int, notify_block: str | None, crash_retries: int = 3) -> list[str]:
    from prefect.blocks.core import Block

    done = [_replace(client, zombie_automation(zombie_after))]
    # After the zombie automation: a lost machine's run is marked Crashed by it, then retried by this one.
    done.append(_replace(client, retry_automation(crash_retries)) if crash_retries
                else _remove(client, RETRY_AUTOMATION))
    if notify_block:
        block = Block.load(notify_block)  # "<block type slug>/<name>", e.g. custom-webhook/phase1a-alerts
        done.append(_replace(client, notify_automation(block._block_document_id)))
    return done


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    pools = commands.add_parser("pools", help="create the work pools: process (GPU pools limited to one run), "
                                              "kubernetes and docker with phase1a's job templates")
    pools.add_argument("--templates", action="store_true",
                       help="replace the kubernetes and docker pools' base job templates with ours")
    automations = commands.add_parser("automations", help="zombie-run detection, crashed runs retried, and "
                                                          "failure notifications")
    automations.add_argument("--zombie-after", type=int, default=600, metavar="SECONDS",
                             help="mark a Running flow run Crashed after this long without a heartbeat")
    automations.add_argument("--crash-retries", type=int, default=3, metavar="N",
                             help="start a crashed deployment run again, N times at most (0: never, and remove "
                                  "the automation)")
    automations.add_argument("--notify-block", default=None, metavar="TYPE/NAME",
                             help="a notification block, e.g. slack-webhook/phase1a-alerts: notify on failure")
    args = parser.parse_args(argv)
    if args.command == "automations" and args.crash_retries < 0:
        parser.error(f"--crash-retries: {args.crash_retries} is below 0; give 0 to turn retries off")

    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        if args.command == "pools":
            lines = ensure_pools(client, replace_templates=args.templates)
        else:
            lines = ensure_automations(client, args.zombie_after, args.notify_block, args.crash_retries)
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
