"""A run in one process, or over the launch's torchrun ranks (phase1a/train/launch.py; each rank:
phase1a/train/rank.py): a rank out of memory starts the launch again with half the row budget, a lost node starts
the group again from its latest checkpoint, and a stop request reaches the ranks as SIGTERM does."""
from __future__ import annotations

import json
from pathlib import Path

from phase1a.core import layout
from phase1a.core.atomic import write_atomically
from phase1a.core.layout import checkpoint_step, list_checkpoints
from phase1a.core.logs import run_logger
from phase1a.train.launch import LaunchError, LaunchStopped, run_agents
from phase1a.train.loop import train
from phase1a.train.preemption import Preempted, StopRequest
from phase1a.train.rank import ENTRY
from phase1a.train.result import TrainResult
from phase1a.train.run_files import append_event
from phase1a.train.settings import TrainSettings


def run(settings: TrainSettings, stops: tuple[StopRequest, ...] = ()) -> TrainResult:
    """One process, or the launch's ranks under torchrun; the result is rank 0's, read from the run. `stops` reach
    torchrun's ranks as SIGTERM does: the launch stops its agents, which pass it on (phase1a/train/launch.py)."""
    if not settings.launch.several:
        return train(settings, stops=stops)
    output_dir = Path(settings.output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    settings_path = output_dir / layout.SETTINGS
    _out_of_memory_notes(output_dir)  # a crashed launcher's leftovers do not count for this launch
    backoffs, restarts, launch = 0, 0, settings.launch
    while True:
        write_atomically(settings_path, settings.model_dump_json(indent=2))
        try:  # each launch its own rendezvous: a lost node's stale state never joins the next group
            run_id = f"{launch.run_id}-{backoffs + restarts}"
            run_agents(launch.model_copy(update={"run_id": run_id, "entry": ENTRY}), settings_path,
                       cwd=Path(__file__).resolve().parents[2], stop=lambda: any(s.requested for s in stops))
            break
        except LaunchStopped:
            raise _launch_preempted(output_dir, stops) from None
        except LaunchError as failed:
            notes = _out_of_memory_notes(output_dir)
            if notes and settings.micro_batch_size > 1:
                micro = settings.micro_batch_size // 2
                settings = settings.model_copy(update={"micro_batch_size": micro, "arithmetic_from_checkpoint": False})
                backoffs += 1
                # The ranks are gone: the launcher records it.
                append_event(output_dir, "out_of_memory", step=min(notes), micro_batch_size=micro, relaunched=True)
            elif launch.nodes > 1 and restarts < launch.max_restarts:  # a node lost: the group from its checkpoint
                restarts += 1
                append_event(output_dir, "group_restarted", failure=str(failed), restart=restarts)
                run_logger().warning(f"{failed}: starting every node's agent again from the latest checkpoint "
                                     f"({restarts} of {launch.max_restarts} restarts)")
            else:
                raise
    result_path = output_dir / layout.FINAL / layout.RESULT
    result = TrainResult.model_validate_json(result_path.read_text())
    if backoffs:
        result = result.model_copy(update={"out_of_memory_backoffs": result.out_of_memory_backoffs + backoffs})
        write_atomically(result_path, result.model_dump_json(indent=2))
    return result


def _launch_preempted(output_dir: Path, stops: tuple[StopRequest, ...]) -> Preempted:
    """The ranks' stop, as the launcher sees it: what asked, and the checkpoint they wrote at their last step."""
    request = next(stop for stop in stops if stop.requested)
    checkpoints = list_checkpoints(output_dir / "checkpoints")
    if not checkpoints:  # stopped before the first step ended
        return Preempted(request.requested, 0, "(none: stopped before the first step)", request.at)
    return Preempted(request.requested, checkpoint_step(checkpoints[-1]), str(checkpoints[-1]), request.at)


def _out_of_memory_notes(output_dir: Path) -> list[int]:
    """The steps at which ranks ran out of memory in the launch that just failed; the notes are consumed."""
    steps = []
    for note in output_dir.glob("out_of_memory.rank*.json"):
        steps.append(json.loads(note.read_text())["step"])
        note.unlink()
    return steps
