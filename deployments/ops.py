"""Idempotent set-up of a Prefect server for phase1a: work pools, and automations that keep runs honest.

    python deployments/ops.py pools                 # phase1a-cpu, phase1a-h100, phase1a-h200 (process)
    python deployments/ops.py automations [--zombie-after 600] [--notify-block custom-webhook/phase1a-alerts]

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

ZOMBIE_AUTOMATION = "phase1a: crash flow runs that stopped sending heartbeats"
NOTIFY_AUTOMATION = "phase1a: notify when a flow run fails or crashes"


def ensure_pools(client) -> list[str]:
    from prefect.client.schemas.actions import WorkPoolCreate, WorkPoolUpdate
    from prefect.exceptions import ObjectNotFound
    from prefect.workers.process import ProcessWorker

    done = []
    for name, limit in POOLS.items():
        try:
            pool = client.read_work_pool(name)
        except ObjectNotFound:
            client.create_work_pool(WorkPoolCreate(
                name=name, type="process", concurrency_limit=limit,
                base_job_template=ProcessWorker.get_default_base_job_template()))
            done.append(f"{name}: created (process, concurrency limit {limit})")
            continue
        if pool.type != "process":
            raise SystemExit(f"work pool {name} exists with type {pool.type!r}, expected 'process'; delete it first")
        if pool.concurrency_limit != limit:
            # Only fields set explicitly are sent, so an explicit None clears a limit.
            client.update_work_pool(name, WorkPoolUpdate(concurrency_limit=limit))
            done.append(f"{name}: concurrency limit {pool.concurrency_limit} -> {limit}")
        else:
            done.append(f"{name}: exists (process, concurrency limit {limit})")
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


def ensure_automations(client, zombie_after: int, notify_block: str | None) -> list[str]:
    from prefect.blocks.core import Block

    done = [_replace(client, zombie_automation(zombie_after))]
    if notify_block:
        block = Block.load(notify_block)  # "<block type slug>/<name>", e.g. custom-webhook/phase1a-alerts
        done.append(_replace(client, notify_automation(block._block_document_id)))
    return done


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("pools", help="create the process work pools, GPU pools limited to one run")
    automations = commands.add_parser("automations", help="zombie-run detection, and failure notifications")
    automations.add_argument("--zombie-after", type=int, default=600, metavar="SECONDS",
                             help="mark a Running flow run Crashed after this long without a heartbeat")
    automations.add_argument("--notify-block", default=None, metavar="TYPE/NAME",
                             help="a notification block, e.g. slack-webhook/phase1a-alerts: notify on failure")
    args = parser.parse_args(argv)

    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        if args.command == "pools":
            lines = ensure_pools(client)
        else:
            lines = ensure_automations(client, args.zombie_after, args.notify_block)
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
