"""The whole flow in-process on Prefect's embedded server (an isolated PREFECT_HOME, see conftest)."""
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from flows.cli import main as cli_main
from flows.phase1a import phase1a
from helpers import PREPARED, date_records, without_session_server, write_jsonl
from helpers.benchmarks import write_date_tasks
from phase1a.config.schema import Phase1aConfig
from phase1a.data.staging import StagedData
from phase1a.data.tokenized import TokenizedData
from phase1a.evaluate.result import ValidationResult
from phase1a.plan.result import Plan
from phase1a.run_report import RunReport
from phase1a.train.result import TrainResult

pytestmark = pytest.mark.prefect_server  # Prefect's embedded server runs every flow here


def run_flow(tree: dict) -> tuple[object, RunReport]:
    config = Phase1aConfig.model_validate(tree)
    state = phase1a(config, return_state=True)
    reports = sorted((config.work_dir / config.name).glob("*/report.json"), key=lambda p: p.stat().st_mtime)
    return state, RunReport.load(reports[-1])


def states(report: RunReport) -> dict[str, str]:
    return {name: section.state for name, section in report.stages.items()}


@pytest.mark.slow
def test_second_run_reuses_stage_and_tokenize_and_changes_invalidate(config_tree, dataset, capsys):
    state, first = run_flow(config_tree)
    assert state.is_completed(), state.message
    ran = dict.fromkeys(["stage", "tokenize", "plan", "train", "validate"], "Completed")
    assert states(first) == {**PREPARED, **ran}
    plan, trained = first.result("plan", Plan), first.result("train", TrainResult)
    assert first.status == "passed" and first.result("validate", ValidationResult).passed
    assert plan.calibrated and first.estimate_vs_actual.actual_train_seconds > 0 and trained.tokens_per_second > 0
    # Evaluated during training by default, at each checkpoint and at the end, as many times as the plan counted.
    assert trained.evaluations == plan.estimate.evaluations_during_training == 3
    assert len((Path(trained.output_dir) / "eval.jsonl").read_text().splitlines()) == 3
    # The plan's estimate of validation (timed in calibration: teacher-forced pass and greedy steps) against the
    # stage. A validation this small (0.2 s) is mostly fixed costs, so only the order of magnitude is asserted;
    # the demo's figures are in docs/benchmarks.md.
    validation = first.validation_estimate_vs_actual
    assert validation.actual_seconds == first.stages["validate"].seconds and not validation.base_cached
    assert 0.1 < validation.estimated_over_actual < 10.0, validation
    assert plan.calibration.validation.decode_seconds_per_step > 0
    assert (Path(first.run_dir) / "lengths.png").is_file()

    _, second = run_flow(config_tree)
    assert states(second) == {**PREPARED, "stage": "Cached", "tokenize": "Cached", "plan": "Cached",
                              "train": "Completed", "validate": "Cached"}
    assert second.result("train", TrainResult).reused_completed_run
    assert second.stages["validate"].result == first.stages["validate"].result

    # Deleting the tokenized output re-runs tokenize (a cached manifest must not point at nothing).
    shutil.rmtree(first.result("tokenize", TokenizedData).dir)
    _, third = run_flow(config_tree)
    assert states(third)["stage"] == "Cached" and states(third)["tokenize"] == "Completed"
    assert Path(third.result("tokenize", TokenizedData).train_path).is_file()

    # New bytes under the same path re-run both stages.
    write_jsonl(dataset, date_records(64, seed=1))
    _, fourth = run_flow(config_tree)
    assert states(fourth)["stage"] == "Completed" and states(fourth)["tokenize"] == "Completed"
    assert fourth.result("stage", StagedData).fingerprint != first.result("stage", StagedData).fingerprint

    # The runs read back in a terminal: `phase1a runs` lists all four, `phase1a show` prints one's summary.
    config_path = Path(config_tree["work_dir"]).parent / "tiny.yaml"
    config_path.write_text(yaml.safe_dump(config_tree))
    capsys.readouterr()
    assert cli_main(["runs", "--config", str(config_path)]) == 0
    header, *rows = capsys.readouterr().out.splitlines()
    assert header.split()[:3] == ["run", "status", "wall"] and len(rows) == 4
    assert [row.split()[0] for row in rows] == [Path(r.run_dir).name for r in (first, second, third, fourth)]
    assert all(row.split()[1] == "passed" for row in rows)
    loss = first.validation.metrics["loss"].candidate
    assert f"{loss:.4f}" in rows[0] and f"{first.estimate_vs_actual.time_accuracy - 1:+.0%}" in rows[0]
    name = Path(first.run_dir).name.split("-", 1)[1]  # the flow run's name
    assert cli_main(["show", name, "--config", str(config_path)]) == 0
    shown = capsys.readouterr().out  # the run's report.md
    assert "## Validation" in shown and f"report: {first.run_dir}/report.md" in shown
    assert cli_main(["show", "no-such-run", "--config", str(config_path)]) == 2
    assert "no-such-run: no run of that name under" in capsys.readouterr().err


def test_parquet_shards_with_a_separate_validation_source(config_tree, tmp_path):
    """The flow stages both sources and holds out exactly the validation source's records."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    shards = tmp_path / "shards"
    shards.mkdir()
    records = date_records(48, seed=5)
    for index in range(2):
        pq.write_table(pa.Table.from_pylist(records[index * 24:(index + 1) * 24]), shards / f"part-{index}.parquet")
    config_tree["data"] |= {"source": str(shards / "part-*.parquet"),
                            "validation_source": str(write_jsonl(tmp_path / "held-out.jsonl", date_records(8, seed=6)))}
    state, report = run_flow(config_tree)
    assert state.is_completed(), report.stages
    assert states(report)["stage"] == states(report)["stage_validation"] == "Completed"
    tokenized = report.result("tokenize", TokenizedData)
    assert (tokenized.train_examples, tokenized.validation_examples, tokenized.shards) == (48, 8, 3)
    assert report.result("stage", StagedData).files == ["part-0.parquet", "part-1.parquet"]


def test_bad_data_fails_the_run_and_the_report_says_where(config_tree, dataset):
    dataset.write_text(dataset.read_text() + '{"messages": [oops\n')
    state, report = run_flow(config_tree)
    assert state.is_failed() and report.status == "failed"
    assert states(report)["tokenize"] == "Failed"
    staged = Path(report.result("stage", StagedData).path).name
    assert f"{staged}:65: malformed JSON" in report.stages["tokenize"].error
    readable = (Path(report.run_dir) / "report.md").read_text()
    assert "> **Failed at stage `tokenize`** (Failed): " in readable and f"{staged}:65: malformed JSON" in readable


def test_missing_data_path_fails_clearly(config_tree, tmp_path):
    config_tree["data"]["source"] = str(tmp_path / "missing.jsonl")
    state = phase1a(Phase1aConfig.model_validate(config_tree), return_state=True)
    assert state.is_failed()
    with pytest.raises(Exception, match="data.source: no such file: .*missing.jsonl"):
        state.result()


@pytest.mark.slow
def test_cli_runs_the_flow_and_prints_the_report(config_tree, tmp_path):
    config_path = tmp_path / "tiny.yaml"
    config_path.write_text(yaml.safe_dump(config_tree))
    cli = [sys.executable, "-m", "flows.cli", "run", "--config", str(config_path)]
    done = subprocess.run(cli + ["--set", "method.epochs=0.5"], capture_output=True, text=True, timeout=600,
                          env=without_session_server())  # as a user without a Prefect server runs it
    assert done.returncode == 0, done.stderr[-3000:]
    report_line = [line for line in done.stdout.splitlines() if line.startswith("report: ")][-1]
    report = RunReport.load(Path(report_line.removeprefix("report: ")))
    assert report.config["method"]["epochs"] == 0.5
    assert "token_accuracy" in done.stdout and "gate: PASS" in done.stdout
    assert re.search(r"^validate: [\d.]+ s; plan estimated [\d.]+ s$", done.stdout, re.MULTILINE)

    bad = subprocess.run(cli + ["--set", "method.batch_size=0"], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "method.batch_size: Input should be greater than or equal to 1" in bad.stderr
    assert "Traceback" not in bad.stderr and bad.stderr.startswith("phase1a: ")  # the message alone, its lines


@pytest.mark.slow
def test_cli_plan_prints_the_estimate_without_training(config_tree, tmp_path):
    config_path = tmp_path / "tiny.yaml"
    config_path.write_text(yaml.safe_dump(config_tree))
    # Two tokenize processes, forked from the thread Prefect runs the task in, beside its event loop's threads.
    done = subprocess.run([sys.executable, "-m", "flows.cli", "plan", "--config", str(config_path),
                           "--set", "data.tokenize_workers=2"], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "estimate: start-up" in done.stdout and "micro-batch" in done.stdout and "calibration (" in done.stdout
    report_path = Path([line for line in done.stdout.splitlines() if line.startswith("report: ")][-1][8:])
    report = RunReport.load(report_path)
    assert report.status == "planned" and list(report.stages) == ["model", "start", "stage", "tokenize", "plan"]
    assert report.result("tokenize", TokenizedData).workers == 2
    plan = json.loads((report_path.parent / "plan.json").read_text())
    assert plan["steps"] > 0 and plan["micro_batch_size"] * plan["gradient_accumulation"] == 8
    assert plan["calibration"]["trials"][0]["status"] == "measured" and plan["estimate"]["startup_seconds"] > 0
    assert not list((Path(config_tree["work_dir"]) / config_tree["name"]).glob("train-*"))


def assert_model_card(path: Path, report: RunReport, library: str) -> None:
    """The card parses with huggingface_hub; its metadata and validation numbers are report.json's."""
    from huggingface_hub import ModelCard

    card = ModelCard.load(path)
    section, verdict = report.validation, report.result("validate", ValidationResult)
    assert card.data.library_name == library and card.data.model_name == section.promotion.version
    scores = {r.metric_type if r.dataset_type.startswith("phase1a-held-out") else f"{r.dataset_type}/{r.metric_type}":
              r.metric_value for r in card.data.eval_results}
    assert scores == {name: row.candidate for name, row in section.metrics.items() if row.candidate is not None}
    for name, row in section.metrics.items():
        if row.candidate is not None:
            assert f"| {name} | " in card.text and f"{row.candidate:.4f}" in card.text
    assert "Gate: PASS" in card.text and verdict.baseline.source in card.text
    assert report.result("tokenize", TokenizedData).fingerprint in card.text
    assert report.flow_run.id in card.text


def test_a_pass_is_promoted_and_a_failed_gate_fails_the_run_and_promotes_nothing(config_tree, tmp_path, caplog):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId, ArtifactFilterKey

    promoted = tmp_path / "promoted"
    tasks = write_date_tasks(tmp_path / "tasks", date_records(16, seed=5))
    config_tree["promotion"] = {"to": str(promoted), "export": ["merged", "gguf"]}
    config_tree["validation"]["benchmarks"] = [
        {"task": str(tasks["dates_choice"]), "metric": "acc", "limit": 8, "tolerance": None}]
    caplog.set_level("WARNING")
    state, first = run_flow(config_tree)
    assert state.is_completed(), state.message
    assert "`pretrained`" not in caplog.text  # lm-eval's warnings about the loaded model the gate hands it
    section = first.validation
    assert section.verdict == "pass" and section.promotion.promoted
    assert set(section.metrics) == {"loss", "perplexity", "token_accuracy", "exact_match", "ece", "dates_choice/acc"}
    loss = section.metrics["loss"]
    assert loss.delta == loss.candidate - loss.baseline
    pointer = (promoted / "promoted.json").read_bytes()
    assert json.loads(pointer)["version"] == section.promotion.version == Path(first.run_dir).name
    version = promoted / "versions" / section.promotion.version
    assert (version / "adapter" / "adapter_config.json").is_file() and (version / "merged" / "config.json").is_file()
    assert sorted(p.suffix for p in (version / "gguf").iterdir()) == [".gguf", ".gguf", ".md"]
    assert not (Path(first.run_dir) / "promote.tmp").exists()  # the exports live only in the promoted version
    assert_model_card(version / "adapter" / "README.md", first, "peft")
    assert_model_card(version / "merged" / "README.md", first, "transformers")
    with get_client(sync_client=True) as client:
        artifacts = client.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=["validation"])))
        reports = client.read_artifacts(artifact_filter=ArtifactFilter(
            key=ArtifactFilterKey(any_=["run-report"]),
            flow_run_id=ArtifactFilterFlowRunId(any_=[first.flow_run.id])))
        progress = client.read_artifacts(artifact_filter=ArtifactFilter(
            key=ArtifactFilterKey(any_=["train-progress"]),
            flow_run_id=ArtifactFilterFlowRunId(any_=[first.flow_run.id])))
    steps = first.result("train", TrainResult).steps
    assert [(a.type, a.data) for a in progress] == [("progress", 100.0)]  # training's progress, done
    assert progress[0].description.startswith(f"train: step {steps} of {steps} (100.0 %)")
    assert artifacts and {row["metric"] for row in json.loads(artifacts[0].data)} >= {"loss", "exact_match"}
    # The run report: report.md beside report.json, its plots, and the same report as an artifact, images inline.
    run_dir = Path(first.run_dir)
    readable = (run_dir / "report.md").read_text()
    for png in ("lengths.png", "loss.png", "throughput.png", "estimate_vs_actual.png"):
        assert (run_dir / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and f"]({png})" in readable
    assert readable.startswith("# Run report: tiny: passed")
    assert f"| version | `{section.promotion.version}`" in readable
    assert [report.type for report in reports] == ["markdown"]
    assert reports[0].data.count("](data:image/png;base64,") == 4 and "## Validation" in reports[0].data

    # A stored reference no model of this size can meet: the same weights now fail against it.
    reference = tmp_path / "reference.json"
    reference.write_text(json.dumps({"source": "unreachable", "metrics": {"loss": 0.0, "token_accuracy": 1.0,
                                                                          "exact_match": 1.0}}))
    config_tree["validation"].update({"baseline": "file", "baseline_file": str(reference)})
    state, second = run_flow(config_tree)
    assert state.is_failed() and second.status == "failed" and second.validation.verdict == "fail"
    loss = second.validation.metrics["loss"].candidate
    with pytest.raises(Exception, match=f"validation gate failed against file {reference}.*: loss {loss:.4f} > "
                                        "baseline 0.0000 \\+ tolerance 0.05"):
        state.result()
    assert "promote" not in second.stages and (promoted / "promoted.json").read_bytes() == pointer
    readable = (Path(second.run_dir) / "report.md").read_text()
    assert "> **Failed**: GateFailed: validation gate failed against file" in readable
    assert "**FAIL** against file" in readable and "| promoted | no: the gate failed |" in readable
