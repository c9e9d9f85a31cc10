"""report.md and the plots: drawn from a report.json dict shaped as the flow writes it (the flow test in
test_flow.py checks the real one end to end), the training directory's metrics.jsonl and eval.jsonl, and the
history of earlier runs."""
from __future__ import annotations

import base64
import json
import re
from pathlib import Path

import prefect  # noqa: F401  # for its effect: it sets up logging on import, which must come before caplog
import pytest
from pydantic import BaseModel

from flows.cli import main as cli_main
from flows.report_md import finish_report, inline_images, write_report
from helpers import date_records, make_tokenizer, resolved, write_jsonl
from phase1a.config.schema import Phase1aConfig
from phase1a.data.lengths import LengthStats
from phase1a.data.staging import StagedData
from phase1a.data.tokenized import TokenizedData
from phase1a.data.tokenizing import TokenizeOptions, tokenize_dataset
from phase1a.evaluate.result import GateCheck
from phase1a.plan.planner import make_plan
from phase1a.plan.result import Plan
from phase1a.plots import by_step, smoothed, step_rates
from phase1a.run_report import (
    FlowRunLink,
    Lineage,
    MetricRow,
    PromotionSummary,
    RunReport,
    StageEstimate,
    StageRecord,
    ValidationSection,
)
from phase1a.train.history import RunRecord, append_run, history_path
from phase1a.train.result import TrainResult

PNG = b"\x89PNG\r\n\x1a\n"
CURVES = ("loss.png", "throughput.png", "estimate_vs_actual.png")


def _stage(result: BaseModel | None, state: str = "Completed", seconds: float = 1.0, **extra) -> StageRecord:
    return StageRecord(state=state, seconds=seconds, result=result.model_dump(mode="json") if result else None,
                       **extra)


@pytest.fixture(scope="module")
def results(tmp_path_factory, tiny_model_dir) -> tuple[StagedData, TokenizedData, Plan]:
    """The tiny job's real stage, tokenize and plan results (the plan calibrated within 10 s), for the report's
    stages; each test sets the numbers it reads."""
    root = tmp_path_factory.mktemp("results")
    source = write_jsonl(root / "dates.jsonl", date_records(64))
    config = Phase1aConfig.model_validate({
        "name": "tiny", "work_dir": str(root / "runs"), "cache_dir": str(root / "cache"),
        "data": {"source": str(source)}, "model": {"name_or_path": str(tiny_model_dir)},
        "method": {"batch_size": 8, "lora": {"r": 4, "alpha": 8}},
        "hardware": {"target": "cpu"},
        "plan": {"calibration_budget": "10s", "calibration_steps": 1}})
    staged = StagedData(source=str(source), path=str(source), fingerprint="f", size_bytes=source.stat().st_size,
                        copied=False)
    data = tokenize_dataset(source, make_tokenizer(), 256, TokenizeOptions(), root / "cache" / "fp")
    return staged, data, make_plan(config, resolved(config), data)


def _tokenized(data: TokenizedData) -> TokenizedData:
    lengths = LengthStats(count=600, total_tokens=33_600, supervised_tokens=5_400, min=48, p50=56.0, p90=58.0,
                          p99=60.0, p99_9=61.0, max=61)
    return data.model_copy(update=dict(
        train_examples=480, validation_examples=120, shards=3, shards_encoded=1, shards_reused=2, lengths=lengths,
        max_seq_length=64, model_max_length=8192, skipped={"no assistant turn": 2}, duplicates=4,
        duplicates_dropped=0, truncated_examples=1, dropped_overlong=0, dropped_without_labels=0, outliers=None))


def _plan(plan: Plan) -> Plan:
    footing = plan.calibration.footing.model_copy(update={"words": "2 measured steps, ±14%"})
    return plan.model_copy(update=dict(
        profile="balanced", target="cpu", detected="CPU (2 cores)", precision="float32", base_precision="16bit",
        optimizer="adamw_fused", attention="varlen", micro_batch_size=8, gradient_accumulation=2,
        gradient_checkpointing=False, compile=False, dataloader_workers=0, max_seq_length=64, epochs=1.0, steps=30,
        train_tokens=26_880, tokens_per_second=900.0, throughput_source="measured", estimated_train_seconds=31.0,
        estimated_total_seconds=45.0, estimated_cost_usd=None, window_seconds=None, fits_in_window=None,
        adjustments=[], notes=[], interruptions=None,
        estimate=plan.estimate.model_copy(update=dict(
            low_total_seconds=40.0, high_total_seconds=52.0, steady_seconds=30.0, eval_during_training_seconds=2.0,
            train_seconds=36.0, evaluation_seconds=6.3, first_calls_seconds=0.0,
            footing=footing.model_copy(update=dict(low=0.85, high=1.15)),
            evaluation_footing=footing.model_copy(update=dict(words="1 timed pass, ±20%", low=0.8, high=1.2)))),
        calibration=plan.calibration.model_copy(update=dict(seconds=12.4, budget_seconds=10.0,
                                                            needed_seconds=55.0, footing=footing))))


def _train(output_dir: Path) -> TrainResult:
    return TrainResult(output_dir=str(output_dir), adapter_dir=str(output_dir / "final"), steps=30,
                       resumed_from_step=None, reused_completed_run=False, wall_seconds=29.5, train_tokens=26_880,
                       tokens_per_second=911.2, final_loss=0.4321, checkpoints_written=2, checkpoint_seconds=0.8,
                       startup_seconds=1.5, checkpoint_share=0.027, micro_batch_size=8, out_of_memory_backoffs=0,
                       mean_mfu=0.123)


def _validation() -> ValidationSection:
    def row(base, candidate):
        return MetricRow(base=base, baseline=base, candidate=candidate, delta=candidate - base)

    checks = [GateCheck(metric="loss", candidate=0.61, baseline=2.5, tolerance=0.05, higher_is_better=False,
                        passed=True),
              GateCheck(metric="exact_match", candidate=0.875, baseline=0.0, tolerance=0.0, higher_is_better=True,
                        passed=True)]
    return ValidationSection(
        verdict="pass", reasons=[], baseline="base model", examples=120, answers=[],
        metrics={"loss": row(2.5, 0.61), "exact_match": row(0.0, 0.875),
                 "ece": MetricRow(base=None, baseline=None, candidate=None, delta=None)},
        checks=checks, promotion=PromotionSummary(promoted=True, version="20260101T000000Z-calm-otter",
                                                  path="/srv/promoted/versions/20260101T000000Z-calm-otter"))


def _history_record(estimated: float, actual: float, tokens_per_second: float = 900.0) -> RunRecord:
    return RunRecord(model_fingerprint="m", model_name="demo", hardware="cpu", device_name="CPU", precision="float32",
                     micro_batch_size=8, gradient_checkpointing=False, max_seq_length=64,
                     tokens_per_second=tokens_per_second, estimated_train_seconds=estimated,
                     actual_train_seconds=actual)


def report_json(tmp_path: Path, results) -> tuple[RunReport, Path]:
    """A passed run's report and its run directory, with the files the report reads: the training directory's
    metrics.jsonl (30 steps, the last three written twice as a resume does) and eval.jsonl, and a history of six
    runs."""
    staged, data, plan = results
    run_dir, train_dir, cache_dir = tmp_path / "runs/demo/20260101T000000Z-calm-otter", tmp_path / "train", tmp_path
    run_dir.mkdir(parents=True)
    train_dir.mkdir()
    steps = [{"step": step, "loss": 2.5 / step ** 0.5, "tokens": 896, "elapsed_s": step - 0.1 * (step % 3),
              "tokens_per_s": 880.0 + 5 * (step % 4), "peak_memory_gib": 1.25} for step in [*range(1, 31), 28, 29, 30]]
    write_jsonl(train_dir / "metrics.jsonl", steps)
    write_jsonl(train_dir / "eval.jsonl", [
        {"step": step, "eval_loss": loss, "eval_token_accuracy": accuracy, "examples": 120, "tokens": 960,
         "seconds": 0.5, "best": best} for step, loss, accuracy, best in
        ((10, 0.9, 0.61, True), (20, 0.7, 0.70, True), (30, 0.72, 0.69, False))])
    for index, actual in enumerate((40.0, 35.0, 33.0, 30.0, 32.0, 29.5)):
        append_run(history_path(cache_dir), _history_record(31.0 + index, actual))
    (run_dir / "plan.json").write_text("{}")
    report = RunReport(
        started_at="2026-01-01T00:00:00+00:00", finished_at="2026-01-01T00:01:05+00:00", run_dir=str(run_dir),
        status="passed", wall_seconds=65.2,
        flow_run=FlowRunLink(id="0b5c-run-id", name="calm-otter", url="http://prefect:4200/runs/flow-run/0b5c"),
        config={"name": "demo", "cache_dir": str(cache_dir), "model": {"name_or_path": "smollm2-135m"},
                "promotion": {"to": "/srv/promoted"}},
        stages={"stage": _stage(staged, "Cached", 0.1), "tokenize": _stage(_tokenized(data)),
                "plan": _stage(_plan(plan), seconds=8.0), "train": _stage(_train(train_dir), seconds=31.2),
                "validate": _stage(None, seconds=6.0), "promote": _stage(None)},
        lineage=Lineage(init_from="base", kind="base", base_model="smollm2-135m",
                        started_from="base model smollm2-135m", promoted_as="20260101T000000Z-calm-otter"),
        estimate_vs_actual=_history_record(36.0, 29.5, tokens_per_second=1_098.0),
        validation_estimate_vs_actual=StageEstimate(estimated_seconds=6.3, actual_seconds=6.0,
                                                    estimated_over_actual=1.05),
        validation=_validation(),
        tracking={"mlflow": {"run_id": "abc123", "url": "http://mlflow:5000/#/experiments/1/runs/abc123"},
                  "wandb": {"run_id": "w1", "dir": "/tmp/wandb/run-w1"}})
    return report, run_dir


def test_a_passed_run_gets_its_plots_and_a_readable_report(tmp_path, results):
    report, run_dir = report_json(tmp_path, results)
    text = write_report(report, run_dir).read_text()
    for name in CURVES:
        data = (run_dir / name).read_bytes()
        assert data[:8] == PNG and 10_000 < len(data) < 150_000, (name, len(data))
        assert f"]({name})" in text
    assert "_lengths.png: not drawn" in text  # tokenize draws it; this run directory never had one
    for heading in ("# Run report: demo: passed", "## Stages", "## Data", "## Plan", "## Training", "## Curves",
                    "## Validation", "## Promotion", "## Links"):
        assert heading in text
    assert "| stage | Cached | 0.1 s | 0 | yes |" in text and "| train | Completed | 31.2 s | 0 | no |" in text
    assert "| examples | 480 train, 120 held out |" in text and "no assistant turn: 2" in text
    assert "| micro-batch x accumulation | 8 x 2 |" in text
    assert ("| estimated total, range | 40.0 s to 52.0 s (training: 2 measured steps, ±14%; evaluation: 1 timed "
            "pass, ±20%) |") in text
    assert "| calibration | 12 s of a 10 s budget; a whole measurement needs ~55 s |" in text
    # The plan's own range for each stage, and whether it held: the steady steps at the training speed's ±15 %, the
    # evaluations (2.0 s during training, 6.3 s validating) at evaluation's ±20 %.
    assert "| training | 36.0 s | 31.1 s to 40.9 s | 29.5 s | 1.22x (+22%, outside ±10%) | outside |" in text
    assert "| validation | 6.3 s | 5.0 s to 7.6 s | 6.0 s | 1.05x (+5%, within ±10%) | inside |" in text
    # The training miss beside the host's speed: its steps went 1.22x as fast as the plan measured
    assert ("Training's steps ran at 1,098 tokens/s (evaluations and checkpoint writes left out), 1.22x the plan's "
            "900 (measured): a host that runs at another speed") in text
    report.stages["plan"].result["throughput_source"] = "assumed"  # a speed not measured here: no host to blame
    assert "1.22x the plan's 900 (assumed).\n" in write_report(report, run_dir).read_text()
    assert "| tokens/s | 911 |" in text and "| MFU | 12.3% |" in text and "| peak memory | 1.25 GiB |" in text
    assert "3, the last at step 30: eval loss 0.7200" in text
    assert "| best evaluation | step 20: eval loss 0.7000 |" in text
    assert "**PASS** against base model" in text and "| exact_match | 0.0000 | 0.0000 | 0.8750 | +0.8750 |" in text
    assert "ece" not in text.split("## Validation")[1].split("## Promotion")[0]  # no value anywhere: no row
    assert "| version | `20260101T000000Z-calm-otter` |" in text and "`/srv/promoted/promoted.json`" in text
    assert "[calm-otter](http://prefect:4200/runs/flow-run/0b5c)" in text
    assert "- mlflow: <http://mlflow:5000/#/experiments/1/runs/abc123>" in text and "`/tmp/wandb/run-w1`" in text
    assert "[plan.json](plan.json)" in text and "candidate_metrics.json" not in text  # only the files there


def test_the_data_section_names_ignored_files_the_overlap_and_the_outliers(tmp_path, results):
    report, run_dir = report_json(tmp_path, results)
    assert "| ignored files |" not in write_report(report, run_dir).read_text()  # none ignored: no row
    assert "| outliers | none |" in write_report(report, run_dir).read_text()
    notes = [f"/data/shards/notes/{day:02d}.md" for day in range(1, 6)]
    report.stages["stage"].result.update(files_ignored=7, ignored_files=notes)
    report.stages["tokenize"].result.update(validation_overlap=3, outliers={
        "count": 1, "threshold": 172, "reference": 43, "others_length": 64,
        "longest": [["/data/shards/part-1.jsonl:12", 20037]]})
    text = write_report(report, run_dir).read_text()
    assert f"| ignored files | 7: {', '.join(f'`{name}`' for name in notes)} and 2 more |" in text
    assert "| train/validation overlap | 3 held-out example(s) also in train |" in text
    assert ("| outliers | 1 longer than 172 tokens: `/data/shards/part-1.jsonl:12` (20,037 tokens); the other "
            "examples size to 64 (the plan's profile decides) |") in text


def test_an_early_stop_and_an_s3_pointer_read_as_they_are(tmp_path, results):
    report, run_dir = report_json(tmp_path, results)
    report.config |= {"promotion": {"to": "s3://models/dates/"}, "method": {"early_stopping_patience": 1}}
    report.stages["train"].result |= {"stopped_early": True, "stopped_at_step": 30, "best_step": 20}
    text = write_report(report, run_dir).read_text()
    assert ("| steps | 30; stopped early at step 30 (no better eval loss in 1 evaluations), the adapter from "
            "step 20 |") in text
    assert "`s3://models/dates/promoted.json`" in text


def test_a_failed_run_names_the_stage_and_its_error_and_draws_what_it_can(tmp_path, results):
    report, run_dir = report_json(tmp_path, results)
    error = "DataError: dates.jsonl:65: malformed JSON"
    report.status, report.error = "failed", error
    report.stages = {"stage": report.stages["stage"], "tokenize": _stage(None, "Failed", 0.2, error=error)}
    report.estimate_vs_actual = report.validation_estimate_vs_actual = report.validation = None
    report.tracking = {}
    text = write_report(report, run_dir).read_text()
    assert text.startswith("# Run report: demo: failed")
    assert f"> **Failed at stage `tokenize`** (Failed): {error}" in text
    assert "_loss.png: nothing to draw_" in text and "_throughput.png: nothing to draw_" in text
    assert "](estimate_vs_actual.png)" in text  # the history is there whatever this run did
    assert "## Training" not in text and "## Validation" not in text
    assert "| promoted | no: the run did not get that far |" in text


def test_a_plot_that_fails_is_reported_missing_and_the_run_goes_on(tmp_path, results):
    report, run_dir = report_json(tmp_path, results)
    history = history_path(Path(report.config["cache_dir"]))
    history.unlink()
    history.mkdir()  # unreadable as a file
    path = finish_report(report, run_dir)
    text = path.read_text()
    assert "_estimate_vs_actual.png: not drawn: IsADirectoryError" in text and "](loss.png)" in text


def test_the_artifact_carries_the_images_inline(tmp_path, results):
    report, run_dir = report_json(tmp_path, results)
    text = write_report(report, run_dir).read_text()
    inlined = inline_images(text, run_dir)
    embedded = re.findall(r"data:image/png;base64,([A-Za-z0-9+/=]+)\)", inlined)
    assert [base64.b64decode(data) for data in embedded] == [(run_dir / name).read_bytes() for name in CURVES]
    assert "](loss.png)" not in inlined and "_lengths.png: not drawn" in inlined
    assert len(inlined) < 400_000  # a reasonable artifact


def test_steps_written_twice_keep_the_last_value_and_smoothing_starts_at_the_data():
    steps, values = by_step([{"step": 1, "loss": 3.0}, {"step": 2, "loss": 2.0}, {"step": 2, "loss": 1.0},
                             {"step": 3}, {"loss": 9.0}], "loss")
    assert steps.tolist() == [1, 2] and values.tolist() == [3.0, 1.0]
    assert smoothed(values)[0] == pytest.approx(3.0)  # debiased: not pulled towards zero


def test_each_steps_rate_from_its_tokens_and_time_and_a_resumed_process_counts_from_zero():
    lines = [{"step": 1, "tokens": 100, "elapsed_s": 1.0}, {"step": 2, "tokens": 100, "elapsed_s": 3.0},
             {"step": 3, "tokens": 100, "elapsed_s": 0.5}, {"step": 4, "tokens": 300, "elapsed_s": 1.5}]
    steps, rates = step_rates(lines)
    assert steps.tolist() == [1, 2, 3, 4] and rates.tolist() == [100.0, 50.0, 200.0, 300.0]


def test_show_prints_the_report_md(tmp_path, results, capsys):
    report, run_dir = report_json(tmp_path, results)
    report.save(run_dir / "report.json")
    write_report(report, run_dir)
    assert cli_main(["show", str(run_dir)]) == 0
    shown = capsys.readouterr().out
    assert shown.startswith("# Run report: demo: passed") and shown.rstrip().endswith(f"report: {run_dir}/report.md")


def test_a_failing_closing_hook_is_a_warning_and_report_json_is_still_written_without_credentials(tmp_path, caplog):
    """Plots and trackers come after the outcome: a tracker that raises while the run closes is a warning, the
    hooks after it still run, and report.json keeps the run's status, with a URL's user:password cut out of the
    config and of the warning."""
    from pydantic import BaseModel

    from flows.report import ReportWriter

    class Config(BaseModel):
        tracking_uri: str = "http://alice:s3cret-pw@mlflow.internal:5000"

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    report, seen = ReportWriter(run_dir, Config()), []

    def tracker_down(status: str) -> None:
        raise ConnectionError(f"cannot reach http://bob:hunter2@mlflow.internal:5000 to end the run ({status})")

    report.on_closing(tracker_down)
    report.on_closing(seen.append)
    with caplog.at_level("WARNING", logger="phase1a"), report.finishing() as outcome:
        outcome.status = "passed"
    written = report.path.read_text()
    assert json.loads(written)["status"] == "passed" and seen == ["passed"]
    assert json.loads(written)["config"]["tracking_uri"] == "http://***@mlflow.internal:5000"
    assert "s3cret-pw" not in written and "hunter2" not in caplog.text
    assert "a closing hook failed: ConnectionError: cannot reach http://***@mlflow.internal:5000" in caplog.text
    assert (run_dir / "report.md").is_file()


def test_a_lengths_plot_that_cannot_be_drawn_is_a_warning_not_a_failed_run(tmp_path, caplog):
    from flows.report_md import publish_length_report
    from helpers import date_records, make_tokenizer

    data = tokenize_dataset(write_jsonl(tmp_path / "d.jsonl", date_records(20)), make_tokenizer(), 256,
                            TokenizeOptions(), tmp_path / "cache" / "fp")
    Path(data.lengths_path).unlink()  # a cache emptied under the run
    with caplog.at_level("WARNING", logger="phase1a"):
        publish_length_report(data, tmp_path)
    assert "run report: lengths.png and the lengths artifact: FileNotFoundError" in caplog.text
    assert not (tmp_path / "lengths.png").exists()


def test_a_cell_never_splits_a_markdown_row():
    from phase1a.core.markdown import markdown_table

    lines = markdown_table(("rule", "detail"), [("target_modules", "q_proj|k_proj\nv_proj")])
    assert lines == ["| rule | detail |", "|---|---|", "| target_modules | q_proj\\|k_proj v_proj |"]
