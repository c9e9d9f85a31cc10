"""report.md: the run report a person reads, next to report.json, and the same as a Prefect markdown artifact.

`finish_report(report, run_dir)` runs at the very end of every run, whatever its outcome (flows/report.py):
it draws the plots (phase1a/plots.py) into the run directory, writes report.md with relative image links, and
publishes it as the markdown artifact `run-report` with the images inline as data: URIs (Prefect's UI renders
`data:image/...` sources in markdown artifacts: the V2 UI allows them past its sanitiser, the V1 UI renders
image tokens as they are). The markdown itself is `render_report(report, run_dir, plots)`, a pure function of
report.json's dict and the files in the run directory. A plot that cannot be drawn is logged and reported as
missing; nothing here fails a run (the lengths' histogram and artifact included).
"""
from __future__ import annotations

import base64
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from phase1a.core import layout
from phase1a.core.atomic import write_atomically
from phase1a.core.logs import run_logger
from phase1a.core.markdown import markdown_table
from phase1a.core.units import format_seconds
from phase1a.data.lengths import Outliers
from phase1a.data.staging import StagedData
from phase1a.data.tokenized import TokenizedData
from phase1a.plan.interruptions import InterruptionOutcome
from phase1a.plan.options import ranged
from phase1a.plan.result import Plan
from phase1a.run_report import FlowRunLink, RunReport
from phase1a.store.promoted import POINTER
from phase1a.train import run_files
from phase1a.train.history import ESTIMATE_BAND, RunRecord, history_path
from phase1a.train.result import StoreTraining, TrainResult

ARTIFACT_KEY = "run-report"


@dataclass
class Plot:
    file: str  # its name in the run directory
    caption: str
    missing: str | None = None  # why it is not there: nothing to draw, or the error that stopped it


# ---- plots -------------------------------------------------------------------------------------------------

def publish_length_report(data: TokenizedData, run_dir: Path) -> None:
    """Draw the lengths' histogram into the run directory and summarise lengths and waste as a Prefect artifact.
    Drawn here, not by the stage: matplotlib's import (1-2 s) would be most of a night's tokenize when one new
    shard is all it encodes, and a plot's code is no part of the stage's cache key."""
    try:
        _publish_lengths(data, run_dir)
    except Exception as error:  # noqa: BLE001 - a picture of the data never fails the run that trains on it
        run_logger().warning(f"run report: lengths.png and the lengths artifact: {type(error).__name__}: {error}")


def _publish_lengths(data: TokenizedData, run_dir: Path) -> None:
    from prefect.artifacts import create_markdown_artifact

    from phase1a.plots import save_histogram

    lengths = np.load(data.lengths_path, allow_pickle=False)
    save_histogram(lengths, data.lengths, data.max_seq_length, Path(run_dir) / "lengths.png")
    s = data.lengths
    rows = "\n".join(f"| {w.batching} | {w.sequence_length or '-'} | {w.computed_tokens} | {w.waste_fraction:.1%} |"
                     for w in data.waste)
    create_markdown_artifact(key="lengths", description="Token lengths and padding waste", markdown=(
        f"**{s.count} examples, {s.total_tokens} tokens ({s.supervised_tokens} supervised)**; "
        f"min {s.min}, p50 {s.p50:g}, p90 {s.p90:g}, p99 {s.p99:g}, p99.9 {s.p99_9:g}, max {s.max}; "
        f"max_seq_length {data.max_seq_length}\n\n"
        "| batching | length | tokens computed | padding |\n|---|---|---|---|\n"
        f"{rows}\n\nskipped: {data.skipped or 'none'}; duplicates: {data.duplicates}; "
        f"truncated: {data.truncated_examples}; dropped overlong: {data.dropped_overlong}"))


@dataclass(frozen=True)
class _Results:
    """The stages' results the report reads, each parsed once as its type (None: the stage got no result)."""

    staged: StagedData | None
    data: TokenizedData | None
    plan: Plan | None
    train: TrainResult | None

    @classmethod
    def of(cls, report: RunReport) -> "_Results":
        return cls(report.result("stage", StagedData), report.result("tokenize", TokenizedData),
                   report.result("plan", Plan), report.result("train", TrainResult))

    def train_files(self) -> tuple[Path | None, Path | None]:
        """metrics.jsonl and eval.jsonl of the run's training directory, when training got as far as a result."""
        if self.train is None:
            return None, None
        return Path(self.train.output_dir) / layout.METRICS, Path(self.train.output_dir) / layout.EVALUATIONS


def draw_plots(report: RunReport, run_dir: Path) -> list[Plot]:
    """The plots of the run (lengths.png is already drawn, after tokenize); each one's failure is logged and
    becomes its `missing`, never the run's."""
    from phase1a import plots

    results = _Results.of(report)
    metrics, evaluations = results.train_files()
    cache_dir = report.config.get("cache_dir")
    history = history_path(Path(cache_dir)) if cache_dir else None
    planned = results.plan.tokens_per_second if results.plan is not None else None
    drawings: list[tuple[Plot, Callable[[Path], Path | None]]] = [
        (Plot("loss.png", "loss by step: training (raw and smoothed) and evaluation"),
         lambda path: plots.save_loss(metrics, evaluations, path) if metrics else None),
        (Plot("throughput.png", "tokens/s by step, against the plan's rate"),
         lambda path: plots.save_throughput(metrics, path, planned) if metrics else None),
        (Plot("estimate_vs_actual.png", "the plan's training estimate against the actual, last runs"),
         lambda path: plots.save_estimate_vs_actual(history, path) if history else None),
    ]
    drawn = []
    for plot, draw in drawings:
        try:
            if draw(Path(run_dir) / plot.file) is None:
                plot.missing = "nothing to draw"
        except Exception as error:  # a report must never fail the run it reports
            plot.missing = f"not drawn: {type(error).__name__}: {error}"
            run_logger().warning(f"run report: {plot.file} {plot.missing}")
        drawn.append(plot)
    lengths = Plot("lengths.png", "tokens per example")
    lengths.missing = None if (Path(run_dir) / lengths.file).is_file() else "not drawn (tokenize did not finish)"
    return [lengths, *drawn]


# ---- formatting --------------------------------------------------------------------------------------------

def _n(value, spec: str = ",") -> str:
    """A number for a table cell; '-' for none."""
    return "-" if value is None else format(value, spec)


def _table(header: tuple[str, ...], rows: list[tuple]) -> list[str]:
    return [*markdown_table(header, rows), ""]  # a blank line ends it


def _stated(stated: tuple[float, float] | None) -> str:
    return "-" if stated is None else f"{format_seconds(stated[0])} to {format_seconds(stated[1])}"


def _holds(stated: tuple[float, float] | None, actual: float) -> str:
    return "-" if stated is None else ("inside" if stated[0] <= actual <= stated[1] else "outside")


def _ratio(estimated: float | None, actual: float | None) -> str:
    if not estimated or not actual:
        return "-"
    within = "within" if abs(estimated / actual - 1) <= ESTIMATE_BAND else "outside"
    return f"{estimated / actual:.2f}x ({estimated / actual - 1:+.0%}, {within} ±{ESTIMATE_BAND:.0%})"


# ---- sections ----------------------------------------------------------------------------------------------

def _failure(report: RunReport) -> list[str]:
    """Which stage failed and its error, or the run's own error (a failed gate, a bad config); a preempted
    run says where it stopped."""
    if report.status in ("passed", "planned"):
        return []
    failed = [(name, section) for name, section in report.stages.items() if section.error]
    if failed:
        name, section = failed[0]
        ended = "Preempted in" if report.status == "preempted" else "Failed at"
        return [f"> **{ended} stage `{name}`** ({section.state}): {section.error}", ""]
    return [f"> **Failed**: {report.error or 'the run ended before any stage reported an error'}", ""]


def _header(report: RunReport) -> list[str]:
    config, flow_run = report.config, report.flow_run or FlowRunLink()
    name = flow_run.name or Path(report.run_dir).name
    run = f"[{name}]({flow_run.url})" if flow_run.url else f"`{name}`"
    rows = [("flow run", run + (f" (`{flow_run.id}`)" if flow_run.id else "")),
            ("started", report.started_at), ("finished", report.finished_at or "-"),
            ("wall", format_seconds(report.wall_seconds)),
            ("model", f"`{config.get('model', {}).get('name_or_path', '-')}`"),
            ("run directory", f"`{report.run_dir}`")]
    return [f"# Run report: {config.get('name', '?')}: {report.status or '?'}", "", *_failure(report),
            *_table(("", ""), rows)]


def _stages(report: RunReport) -> list[str]:
    rows = [(name, section.state, format_seconds(section.seconds), section.retries,
             "yes" if section.state == "Cached" else "no")
            for name, section in report.stages.items()]
    return ["## Stages", "", *_table(("stage", "state", "seconds", "retries", "cached"), rows)] if rows else []


def _data(report: RunReport, results: _Results) -> list[str]:
    data, staged = results.data, results.staged
    if data is None:
        return []
    lengths = data.lengths
    rows = [("examples", f"{data.train_examples:,} train, {data.validation_examples:,} held out"),
            ("tokens", f"{lengths.total_tokens:,} ({lengths.supervised_tokens:,} supervised)"),
            ("tokens per example", f"p50 {lengths.p50:g}, p99 {lengths.p99:g}, max {lengths.max:,}"),
            ("max_seq_length", f"{data.max_seq_length:,} (the model's: {data.model_max_length:,})"),
            ("shards", f"{data.shards} ({data.shards_encoded} encoded, {data.shards_reused} reused"
                       + (f", {data.shards_downloaded} from the store" if data.shards_downloaded else "")
                       + (f", {data.shards_uploaded} uploaded" if data.shards_uploaded else "") + ")"),
            *_staged(staged), *_ignored(report),
            ("skipped", ", ".join(f"{reason}: {count}" for reason, count in data.skipped.items()) or "none"),
            ("duplicates", f"{data.duplicates} ({data.duplicates_dropped} dropped)"),
            ("train/validation overlap", f"{data.validation_overlap} held-out example(s) also in train"),
            *_outliers(data.outliers),
            ("truncated", data.truncated_examples), ("dropped overlong", data.dropped_overlong),
            ("dropped without labels", data.dropped_without_labels)]
    if report.replay:
        rows.append(("replay", ", ".join(f"{k}: {v}" for k, v in report.replay.items())))
    rows += [("corrupt in the store", problem) for problem in data.shards_corrupt]
    return ["## Data", "", *_table(("", ""), rows)]


def _staged(staged: StagedData | None) -> list[tuple[str, str]]:
    if staged is None:  # the stage stage was not recorded (a report of an older run)
        return []
    return [("staged files", f"{staged.files_copied} copied, {staged.files_reused} reused" if staged.files
             else ("copied" if staged.copied else "reused"))]


def _ignored(report: RunReport) -> list[tuple[str, str]]:
    """The files of the sources that were not read as data (a NOTES.txt beside the shards): counted, the first few
    named."""
    rows = []
    for stage, label in (("stage", "ignored files"), ("stage_validation", "ignored validation files")):
        staged = report.result(stage, StagedData)
        if staged is not None and staged.files_ignored:
            named = ", ".join(f"`{name}`" for name in staged.ignored_files)
            more = staged.files_ignored - len(staged.ignored_files)
            rows.append((label, f"{staged.files_ignored}: {named}" + (f" and {more} more" if more else "")))
    return rows


def _outliers(outliers: Outliers | None) -> list[tuple[str, str]]:
    if not outliers:
        return [("outliers", "none")]
    named = ", ".join(f"`{where}` ({tokens:,} tokens)" for where, tokens in outliers.longest)
    return [("outliers", f"{outliers.count} longer than {outliers.threshold:,} tokens: {named}; the other "
                         f"examples size to {outliers.others_length:,} (the plan's profile decides)")]


def _rows(plan) -> str:
    """The packed rows training ran: exact, or padded to a few lengths, with padding's share."""
    if plan.row_tokens is None:
        return "-"
    if not plan.row_lengths:
        return f"exact, up to {plan.row_tokens:,} tokens"
    return (f"padded to {', '.join(f'{n:,}' for n in plan.row_lengths)} tokens; padding "
            f"{plan.padding_share:.1%} of the rows")


def _plan(report: RunReport, results: _Results) -> list[str]:
    plan = results.plan
    if plan is None:
        return []
    rows = [("profile", plan.profile), ("hardware", f"{plan.target} (found: {plan.detected})"),
            ("precision", f"{plan.precision} (base weights {plan.base_precision})"),
            ("optimizer, attention", f"{plan.optimizer}, {plan.attention}"),
            ("micro-batch x accumulation", f"{plan.micro_batch_size} x {plan.gradient_accumulation}"),
            ("gradient checkpointing, compile, CUDA graphs",
             f"{plan.gradient_checkpointing}, {plan.compile}, {plan.cuda_graphs}"),
            ("rows", _rows(plan)),
            ("dataloader workers", plan.dataloader_workers), ("max_seq_length", plan.max_seq_length),
            ("epochs, steps", f"{plan.epochs:g}, {plan.steps:,}"), ("train tokens", f"{plan.train_tokens:,}"),
            ("tokens/s", f"{plan.tokens_per_second:,.0f} ({plan.throughput_source})"),
            ("estimated training", format_seconds(plan.estimated_train_seconds)),
            ("estimated total", format_seconds(plan.estimated_total_seconds)),
            ("estimated cost", "-" if plan.estimated_cost_usd is None else f"${plan.estimated_cost_usd:,.2f}")]
    rows += _footing(plan)
    if plan.window_seconds:
        rows.append(("window", f"{format_seconds(plan.window_seconds)}; fits: {plan.fits_in_window}"))
    train, validation = report.estimate_vs_actual, report.validation_estimate_vs_actual
    pairs = (("training", train and train.estimated_train_seconds, train and train.actual_train_seconds,
              plan.estimate.train_range()),
             ("validation", validation and validation.estimated_seconds, validation and validation.actual_seconds,
              (validation.low_seconds, validation.high_seconds) if validation and validation.low_seconds is not None
              else plan.estimate.evaluation_range()))
    compared = [(what, format_seconds(estimated), _stated(stated), format_seconds(actual), _ratio(estimated, actual),
                 _holds(stated, actual)) for what, estimated, actual, stated in pairs if actual]
    lines = ["## Plan", "", *_table(("knob", "value"), rows)]
    notes = [f"- {a.step}: {a.before} -> {a.after} (~{a.estimated_hours:.2f} h)" for a in plan.adjustments] \
        + [f"- {note}" for note in plan.notes]
    lines += [*notes, ""] if notes else []
    if compared:
        lines += ["Estimate against actual (a stage that was cached is not compared; the range is the plan's own):",
                  "", *_table(("stage", "estimated", "range", "actual", "estimated / actual", "actual in range"),
                              compared), *_host_speed(plan, train)]
    return lines + _options(plan) + _interruptions(plan, report.interruptions_vs_actual)


def _host_speed(plan: Plan, train: RunRecord | None) -> list[str]:
    """The speed the run's steps went at beside the plan's. Where the plan measured its speed on this host, a host
    that runs the steps slower or faster than then (a shared or throttled machine) moves the actual by as much,
    however the estimate was made; a speed assumed or modelled is the estimate's own."""
    if not train or not train.tokens_per_second or not plan.tokens_per_second:
        return []
    ratio = train.tokens_per_second / plan.tokens_per_second
    host = (": a host that runs at another speed than when the plan measured it moves the actual by as much"
            if plan.throughput_source == "measured" else "")
    return [f"Training's steps ran at {train.tokens_per_second:,.0f} tokens/s (evaluations and checkpoint writes "
            f"left out), {ratio:.2f}x the plan's {plan.tokens_per_second:,.0f} ({plan.throughput_source}){host}.", ""]


def _options(plan: Plan) -> list[str]:
    """The options table: each row's source (measured, modelled) and range, and what the ranges rest on."""
    if not plan.options:
        return []
    rows = [(row.label, row.source,
             ranged(row.tokens_per_second, row.tokens_per_second_low, row.tokens_per_second_high, "{:,.0f}"),
             ranged(row.hours, row.hours_low, row.hours_high, "{:.2f}"),
             "-" if row.dollars is None else ranged(row.dollars, row.dollars_low, row.dollars_high, "{:,.2f}"))
            for row in plan.options]
    bases: dict[str, list[str]] = {}
    for row in plan.options:
        if row.basis:
            bases.setdefault(row.basis, []).append(row.label)
    return ["Options (tokens/s, hours, USD: the value [low-high]; docs/plan-models.md#the-options-table):", "",
            *_table(("option", "source", "tokens/s", "hours", "USD"), rows),
            *[f"- {', '.join(labels)}: {basis}" for basis, labels in bases.items()], ""]


def _footing(plan: Plan) -> list[tuple[str, str]]:
    """How sure the estimate is, and what calibration spent of its budget (plans written before: nothing)."""
    estimate, calibration = plan.estimate, plan.calibration
    rows = []
    if estimate.footing:
        low, high = format_seconds(estimate.low_total_seconds), format_seconds(estimate.high_total_seconds)
        evaluation = estimate.evaluation_footing
        rows.append(("estimated total, range", f"{low} to {high} (training: {estimate.footing.words}"
                     + (f"; evaluation: {evaluation.words}" if evaluation else "") + ")"))
    if calibration is not None:
        needed = calibration.needed_seconds
        rows.append(("calibration", f"{calibration.seconds:.0f} s of a {calibration.budget_seconds:.0f} s budget"
                                    + (f"; a whole measurement needs ~{needed:.0f} s" if needed else "")))
    return rows


def _interruptions(plan: Plan, outcome: InterruptionOutcome | None) -> list[str]:
    """The checkpoint interval, the interruptions the plan expected over the whole run, and what this attempt saw:
    a run knows its own start and the host it took over from, not the attempts before that."""
    section = plan.interruptions
    if not section and not outcome:
        return []
    rows = []
    if section:
        cost, expected = section.checkpoint, section.expected
        rows += [("checkpoint interval", f"{section.interval} ({section.interval_rule}); a checkpoint "
                                         f"{format_seconds(cost.write_seconds + cost.upload_seconds)} (write "
                                         f"{cost.write_source}, upload {cost.upload_source})"),
                 ("expected (plan)", f"{expected.interruptions:.2f} interruptions at "
                                     f"{section.rate_per_hour:.4g}/h ({section.rate_source}): lost work "
                                     f"{format_seconds(expected.lost_seconds)}, restarts "
                                     f"{format_seconds(expected.restart_seconds)}")]
    if outcome:
        resumed = (f"resumed from step {outcome.resumed_from_step} in the store, after an interruption"
                   if outcome.resumed_after_interruption else
                   f"resumed from its own step {outcome.resumed_from_step}" if outcome.resumed_from_step
                   else "started from step 0")
        rows.append(("this attempt", resumed))
        if outcome.taken_over_from_step is not None:
            lost = (f"at least {_n(outcome.lost_steps)} steps lost (~{format_seconds(outcome.lost_seconds)} at this "
                    "attempt's speed)")
            rows.append(("host taken over", f"had reached step {outcome.taken_over_from_step} at its last renewal"
                                            f"{_silent(outcome.taken_over_silent_seconds)}: {lost}"))
    return ["Interruptions, the plan against this attempt:", "", *_table(("", ""), rows)]


def _evaluations(path: Path | None) -> list[tuple[str, str]]:
    """Rows from eval.jsonl (evaluation during training), when training evaluated."""
    lines = [line for line in run_files.read_lines(path) if isinstance(line.get("eval_loss"), (int, float))]
    if not lines:
        return []
    best = [line for line in lines if line.get("best")] or [min(lines, key=lambda line: line["eval_loss"])]
    last = lines[-1]
    return [("evaluations", f"{len(lines)}, the last at step {last['step']}: eval loss {last['eval_loss']:.4f}, "
                            f"token accuracy {_n(last.get('eval_token_accuracy'), '.3f')}"),
            ("best evaluation", f"step {best[-1]['step']}: eval loss {best[-1]['eval_loss']:.4f}")]


def _steps(report: RunReport, train: TrainResult, plan: Plan | None) -> str:
    steps = f"{train.steps:,}" + (f" of {plan.steps:,} planned" if plan and plan.steps != train.steps else "")
    steps += f", resumed from step {train.resumed_from_step}" if train.resumed_from_step else ""
    if train.arithmetic_from_checkpoint:  # the steps computed as before the interruption, not as this host planned
        taken = ", ".join(f"{name} {value}" for name, value in train.arithmetic_from_checkpoint.items())
        steps += f" with its checkpoint's {taken} (this host's plan chose otherwise)"
    if train.stopped_early:  # `steps` is the plan's count: where the patience ran out says how far it went
        patience = (report.config.get("method") or {}).get("early_stopping_patience")
        steps += (f"; stopped early at step {train.stopped_at_step:,} (no better eval loss in {patience} "
                  f"evaluations), the adapter from step {train.best_step:,}")
    return steps + (" (a finished run, reused)" if train.reused_completed_run else "")


def _training(report: RunReport, results: _Results) -> list[str]:
    train = results.train
    if train is None:
        return []
    metrics, evaluations = results.train_files()
    peaks = [line["peak_memory_gib"] for line in run_files.read_lines(metrics)
             if isinstance(line.get("peak_memory_gib"), (int, float))]
    rows = [("steps", _steps(report, train, results.plan)),
            ("tokens", f"{train.train_tokens:,}"), ("tokens/s", f"{train.tokens_per_second:,.0f}"),
            ("wall", f"{format_seconds(train.wall_seconds)} (start-up {format_seconds(train.startup_seconds)})"),
            ("checkpoints", f"{train.checkpoints_written} written, {format_seconds(train.checkpoint_seconds)} "
                            f"({train.checkpoint_share:.1%} of the wall time)"),
            ("MFU", "-" if train.mean_mfu is None else f"{train.mean_mfu * 100:.3g}%"),
            ("peak memory", f"{max(peaks):.2f} GiB" if peaks else "-"),
            ("micro-batch", f"{train.micro_batch_size} ({train.out_of_memory_backoffs} out-of-memory back-offs)"),
            ("final loss", _n(train.final_loss, ".4f")), *_evaluations(evaluations), *_store(train.store)]
    return ["## Training", "", f"Directory: `{train.output_dir}`", "", *_table(("", ""), rows)]


def _store(store: StoreTraining | None) -> list[tuple[str, str]]:
    """What training took from the store and put in it (phase1a/train/train_store.py)."""
    if not store:
        return []
    pulled = store.pulled
    took = {"final": "the finished adapter", "checkpoint": f"the checkpoint of step {pulled.step}",
            "nothing": "nothing"}[pulled.what]
    rows = [("store", f"`{store.location}`"),
            ("from the store", f"{took} ({format_seconds(pulled.seconds)})" if pulled.what != "nothing" else took),
            ("to the store", f"{store.checkpoint_uploads} checkpoints in the background "
                             f"({format_seconds(store.checkpoint_upload_seconds)}), the newest step "
                             f"{store.uploaded_step}" + ("; the adapter" if store.final_uploaded else ""))]
    if store.lease_waited_seconds >= 1:
        rows.append(("lease", f"waited {format_seconds(store.lease_waited_seconds)} for another host"))
    if store.taken_over_from:
        lost, step = store.lost_steps, store.taken_over_from.get("step")
        rows.append(("taken over", f"from a host whose last renewal of its lease was at step {step}"
                                   f"{_silent(store.taken_over_silent_seconds)}"
                                   + ("" if lost is None else f"; at least {lost} steps lost")))
    rows += [("upload failed", failure) for failure in store.upload_failures]
    return rows


def _silent(seconds: float | None) -> str:
    """How long a taken-over lease had gone unrenewed: the steps of that time are not counted as lost, the store
    does not know them."""
    if seconds is None:
        return ""
    return f", {format_seconds(seconds)} before this host took it over (steps after it unknown to the store)"


def _curves(plots: list[Plot]) -> list[str]:
    lines = ["## Curves", ""]
    for plot in plots:
        lines += [f"_{plot.file}: {plot.missing}_" if plot.missing else f"![{plot.caption}]({plot.file})", ""]
    return lines


def _validation(report: RunReport) -> list[str]:
    section = report.validation
    if section is None:
        return []
    header, *rows = section.table()
    rows = [(*row[:-1], row[-1].replace("FAIL", "**FAIL**", 1)) for row in rows]
    verdict = "**PASS**" if section.verdict == "pass" else "**FAIL**"
    return ["## Validation", "", f"{verdict} against {section.baseline}, on {section.examples} held-out "
            "examples.", "", *_table(header, rows),
            *[f"- {reason}" for reason in section.reasons], *([""] if section.reasons else [])]


def _promotion(report: RunReport) -> list[str]:
    promotion = report.validation.promotion if report.validation else None
    promote_to = (report.config.get("promotion") or {}).get("to")
    rows = [("started from", report.lineage.started_from if report.lineage else "-")]
    if promotion:
        rows += [("version", f"`{promotion.version}`" + ("" if promotion.promoted
                                                          else " (already the promoted model: nothing copied)")),
                 ("path", f"`{promotion.path}`"), ("pointer", f"`{promote_to.rstrip('/')}/{POINTER}`"),
                 ("artifacts", ", ".join(promotion.artifacts) + " (each with its model card, README.md)")]
    elif promote_to:
        failed = report.validation is not None and report.validation.verdict == "fail"
        rows.append(("promoted", "no: " + ("the gate failed" if failed else "the run did not get that far")))
    else:
        rows.append(("promoted", "no: promotion.to is not set"))
    serving = report.validation.serving if report.validation else None
    if serving is not None:
        rows.append(("serving", serving.describe()))
    return ["## Promotion", "", *_table(("", ""), rows)]


def _links(report: RunReport, results: _Results, run_dir: Path) -> list[str]:
    flow_run = report.flow_run or FlowRunLink()
    lines = ["## Links", ""]
    if flow_run.url:
        lines.append(f"- Prefect flow run: <{flow_run.url}>")
    elif flow_run.id:
        lines.append(f"- Prefect flow run: `{flow_run.id}` (no PREFECT_UI_URL set)")
    for name, section in report.tracking.items():
        where = section.get("url") or section.get("dir")
        if where:
            lines.append(f"- {name}: <{where}>" if "://" in str(where) else f"- {name}: `{where}`")
    files = [name for name in (layout.REPORT_JSON, layout.PLAN_JSON, layout.CANDIDATE_METRICS)
             if (run_dir / name).is_file()]
    lines.append("- files: " + ", ".join(f"[{name}]({name})" for name in files))
    metrics, evaluations = results.train_files()
    lines += [f"- training: `{path}`" for path in (metrics, evaluations) if path and path.is_file()]
    return lines + [""]

def render_report(report: RunReport, run_dir: Path, plots: list[Plot]) -> str:
    """report.md's text from report.json, the files in the run directory and what became of the plots."""
    results = _Results.of(report)
    sections = [_header(report), _stages(report), _data(report, results), _plan(report, results),
                _training(report, results), _curves(plots), _validation(report), _promotion(report),
                _links(report, results, Path(run_dir))]
    return "\n".join(line for section in sections for line in section).rstrip() + "\n"


# ---- the end of a run --------------------------------------------------------------------------------------

def write_report(report: RunReport, run_dir: Path, plots: list[Plot] | None = None) -> Path:
    """Write report.md into the run directory, with the plots drawn already or drawn now; returns its path."""
    run_dir = Path(run_dir)
    path = run_dir / layout.REPORT_MD
    write_atomically(path, render_report(report, run_dir, draw_plots(report, run_dir) if plots is None else plots))
    return path


def inline_images(markdown: str, run_dir: Path) -> str:
    """The markdown with each relative PNG link replaced by the image itself, as a data: URI: Prefect's UI cannot
    reach the run directory, it can show what the artifact carries."""
    def embed(match: re.Match) -> str:
        png = Path(run_dir) / match.group(2)
        if not png.is_file():
            return match.group(0)
        return f"![{match.group(1)}](data:image/png;base64,{base64.b64encode(png.read_bytes()).decode()})"

    return re.sub(r"!\[([^\]]*)\]\(([\w.-]+\.png)\)", embed, markdown)


def publish_report(path: Path) -> None:
    """report.md as the Prefect markdown artifact `run-report`, images inline; only inside a flow run."""
    from prefect.artifacts import create_markdown_artifact
    from prefect.context import FlowRunContext

    if FlowRunContext.get() is None:
        return
    create_markdown_artifact(key=ARTIFACT_KEY, markdown=inline_images(path.read_text(), path.parent),
                             description="phase1a run report: stages, plan, curves, validation, promotion")


def finish_report(report: RunReport, run_dir: Path, plots: list[Plot] | None = None) -> Path | None:
    """report.md and its artifact, at the end of every run. Whatever goes wrong here is logged, never raised: the
    run's outcome is already decided and written (report.json)."""
    try:
        path = write_report(report, run_dir, plots)
    except Exception as error:
        run_logger().warning(f"run report: report.md not written: {type(error).__name__}: {error}")
        return None
    try:
        publish_report(path)
    except Exception as error:
        run_logger().warning(f"run report: the {ARTIFACT_KEY} artifact not published: {type(error).__name__}: {error}")
    return path
