"""Reading a plan: the plan printed (`format_plan`: the knobs, the estimate and its range, interruptions,
calibration's trials, notes and the options table), plan.json in the run directory and the plan as a Prefect table
artifact where Prefect is installed (`publish_plan`); a run shows both, cached or not (`present_plan`)."""
from __future__ import annotations

from pathlib import Path

from phase1a.core import layout
from phase1a.core.atomic import write_atomically
from phase1a.plan.options import format_options, more_nodes
from phase1a.plan.result import Estimate, Plan


def present_plan(plan: Plan, run_dir: Path) -> None:
    """What a run shows of its plan, cached or not: plan.json and the plan artifact, and the plan printed."""
    publish_plan(plan, run_dir)
    print(format_plan(plan))


def publish_plan(plan: Plan, run_dir: Path) -> Path:
    """plan.json in the run directory, and the plan as a Prefect table artifact."""
    path = Path(run_dir) / layout.PLAN_JSON
    write_atomically(path, plan.model_dump_json(indent=2) + "\n")
    try:
        from prefect.artifacts import create_table_artifact
    except ImportError:
        return path
    nested = {"model", "memory", "estimate", "calibration", "options", "interruptions"}
    rows = [{"setting": key, "value": str(value)} for key, value in plan.model_dump(exclude=nested).items()]
    for section in ("memory", "estimate"):
        rows += [{"setting": f"{section}.{key}", "value": f"{value:.3f}" if isinstance(value, float) else str(value)}
                 for key, value in getattr(plan, section).model_dump(exclude={"footing", "evaluation_footing"}).items()]
    if plan.estimate.footing:
        rows.append({"setting": "estimate.footing", "value": plan.estimate.footing.words})
    if plan.estimate.evaluation_footing:
        rows.append({"setting": "estimate.evaluation_footing", "value": plan.estimate.evaluation_footing.words})
    if plan.interruptions:
        rows += [{"setting": f"interruptions.{key}", "value": str(value)}
                 for key, value in plan.interruptions.model_dump().items()]
    for trial in plan.calibration.trials if plan.calibration else []:
        rows.append({"setting": f"calibration: {trial.candidate.label()}", "value": _trial_result(trial)})
    create_table_artifact(key="plan", table=rows, description="phase1a plan: knobs, estimate, window, calibration")
    return path


def format_plan(plan: Plan) -> str:
    e = plan.estimate
    lines = [f"hardware: {plan.target} (running on {plan.detected}); throughput {plan.throughput_source}",
             f"precision {plan.precision} (base {plan.base_precision}, optimizer {plan.optimizer}), attention "
             f"{plan.attention}, micro-batch "
             f"{plan.micro_batch_size} x accumulation {plan.gradient_accumulation}, gradient checkpointing "
             f"{_on(plan.gradient_checkpointing)}, compile {_on(plan.compile)}"
             + (", CUDA graphs" if plan.cuda_graphs else "") + ", dataloader workers "
             f"{plan.dataloader_workers}, max_seq_length {plan.max_seq_length}",
             f"memory {plan.memory.total_gib:.2f} of {plan.memory.available_gib:.2f} GiB (model)"
             + (f", {plan.measured_peak_memory_gib:.2f} GiB measured" if plan.measured_peak_memory_gib else "")
             + f"; {plan.tokens_per_second:.0f} tokens/s; {plan.steps} steps, {plan.train_tokens} tokens",
             f"estimate: start-up {e.startup_seconds:.0f} s + train {e.train_seconds:.0f} s (warm-up "
             f"{e.warmup_seconds:.0f} s, {e.checkpoints} checkpoints {e.checkpoint_seconds:.0f} s, "
             f"{e.evaluations_during_training} evaluations {e.eval_during_training_seconds:.0f} s) + evaluation "
             f"{e.evaluation_seconds:.0f} s"
             + (f" + interruptions {e.interruption_seconds:.0f} s" if e.interruption_seconds else "")
             + f" = {e.total_seconds / 3600:.3f} h" + _range(e)
             + (f", ${plan.estimated_cost_usd:.2f}" if plan.estimated_cost_usd is not None else ""),
             *_interruption_lines(plan),
             f"fits window: {'n/a' if plan.fits_in_window is None else plan.fits_in_window}"]
    lines += [f"adjusted {a.step}: {a.before} -> {a.after} ({a.estimated_hours:.2f} h)" for a in plan.adjustments]
    if plan.calibration:
        calibration = plan.calibration
        needed = ("" if calibration.needed_seconds is None else
                  f"; a whole measurement needs {'up to ' if calibration.footing.warmup_only else ''}"
                  f"~{calibration.needed_seconds:.0f} s (plan.calibration_budget)")
        lines.append(f"calibration ({calibration.seconds:.0f} s of a {calibration.budget_seconds:.0f} s budget"
                     f"{needed}):")
        lines += [f"  {t.candidate.label()}: {_trial_result(t)}" for t in plan.calibration.trials]
    nodes = [f"more nodes: {line}" for line in more_nodes(plan.options)]
    return "\n".join(lines + [f"note: {note}" for note in plan.notes] + ["", format_options(plan.options), *nodes])


def _range(estimate: Estimate) -> str:
    if estimate.footing is None:
        return ""
    evaluation = estimate.evaluation_footing
    return (f" ({estimate.low_total_seconds / 3600:.3f}-{estimate.high_total_seconds / 3600:.3f} h: "
            f"{estimate.footing.words}" + (f"; evaluation {evaluation.words}" if evaluation else "") + ")")


def _interruption_lines(plan: Plan) -> list[str]:
    section = plan.interruptions
    if section is None:
        return [f"checkpoints every {plan.checkpoint_interval}"] if plan.checkpoint_interval else []
    lines = [f"checkpoints every {section.interval} ({section.interval_rule}); a checkpoint costs "
             f"{section.checkpoint.seconds:.2f} s (write {section.checkpoint.write_source}, upload "
             f"{section.checkpoint.upload_source})"]
    if section.rate_per_hour:
        x = section.expected
        lines.append(f"interruptions: {x.interruptions:.2f} expected at {section.rate_per_hour:.4g} an hour "
                     f"({section.rate_source}): lost work {x.lost_seconds:.0f} s ({x.lost_seconds_each:.0f} s each), "
                     f"restarts {x.restart_seconds:.0f} s ({x.restart_seconds_each:.0f} s each)")
    return lines


def _trial_result(trial) -> str:
    if trial.status != "measured":
        return f"{trial.status}: {trial.note}"
    peak = f", peak {trial.peak_memory_gib:.2f} GiB" if trial.peak_memory_gib else ""
    return f"{trial.tokens_per_second:.0f} tokens/s{peak}"


def _on(flag: bool) -> str:
    return "on" if flag else "off"
