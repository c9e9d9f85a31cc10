"""benchmarks/estimate_accuracy.py's reading of a run: the host's speed over the run's own steps, beside
calibration's, and the summary of an earlier run's work directory read again; benchmarks/plan_accuracy.py's fresh
runs within a budget and its stages compared as estimate_accuracy compares them."""
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import estimate_accuracy  # noqa: E402 - after its folder is on the path


def metrics_file(path: Path, seconds: list[float], tokens: int = 400) -> Path:
    """A train stage's metrics.jsonl whose steps took `seconds` each, as the run writes it: a record's tokens/s is
    the run's so far and its elapsed seconds are cumulative."""
    elapsed, lines = 0.0, []
    for step, took in enumerate(seconds, start=1):
        elapsed += took
        lines.append(json.dumps({"step": step, "loss": 1.0, "tokens": tokens,
                                 "tokens_per_s": round(step * tokens / elapsed, 1), "elapsed_s": round(elapsed, 3)}))
    path.write_text("\n".join(lines) + "\n")
    return path


def test_the_hosts_speed_is_each_quarters_median_step_and_an_evaluation_between_steps_is_not_a_slow_step(tmp_path):
    # 12 steps: half at 2 s a step, then 4 s (the host slowed); an evaluation of 6 s after step 4 is in step 5's
    seconds = [2.0, 2.0, 2.0, 2.0, 2.0 + 6.0, 2.0, 4.0, 4.0, 4.0, 4.0, 4.0, 4.0]
    speed = estimate_accuracy.host_speed(calibrated=240.0, steady=200.0,
                                         metrics=metrics_file(tmp_path / "metrics.jsonl", seconds))
    assert speed == {"calibration_over_run": 1.2, "quarters_tokens_per_second": [200.0, 200.0, 100.0, 100.0]}
    assert estimate_accuracy.host_speed(240.0, 200.0, tmp_path / "absent.jsonl") is None


def test_reread_names_a_directory_without_a_finished_run(tmp_path):
    with pytest.raises(SystemExit, match="not a work directory of a finished run"):
        estimate_accuracy.reread(tmp_path / "qa300-20261129T135340")


def test_a_finished_runs_directory_keeps_what_reread_reads_and_loses_its_weights(tmp_path):
    work = tmp_path / "demo-20261129T192031"
    run = work / "runs" / "demo" / "20261129T192031"
    run.mkdir(parents=True)
    (run / "report.json").write_bytes(b"{" + b" " * (2 << 20) + b"}")  # over the size limit, kept by name
    metrics_file(run / "metrics.jsonl", [2.0, 2.0])
    (run / "checkpoints" / "step-10").mkdir(parents=True)
    (run / "checkpoints" / "step-10" / "adapter_model.safetensors").write_bytes(b"\0" * (3 << 20))
    (work / "cache" / "tokenized").mkdir(parents=True)
    (work / "cache" / "tokenized" / "shard-0.npy").write_bytes(b"\0" * (1 << 20))
    (work / "cache" / "small.json").write_text("{}")
    (work / "run.log").write_text("log\n")

    assert estimate_accuracy.prune(work) == (3 << 20) + (1 << 20)
    assert sorted(str(p.relative_to(work)) for p in work.rglob("*") if p.is_file()) == [
        "cache/small.json", "run.log", "runs/demo/20261129T192031/metrics.jsonl",
        "runs/demo/20261129T192031/report.json"]
    assert not (run / "checkpoints").exists() and not (work / "cache" / "tokenized").exists()


def test_a_fresh_plan_run_starts_only_where_the_last_ones_length_is_left_and_stages_compare_with_their_range():
    import plan_accuracy

    assert plan_accuracy.another_fits([], left=1.0)  # the first run always starts
    assert plan_accuracy.another_fits([{"run_seconds": 176.0}], left=194.0)
    assert not plan_accuracy.another_fits([{"run_seconds": 176.0}], left=130.0)  # the H200's third run, not started
    stage = estimate_accuracy.compared(28.1, 10.6, (23.2, 33.0))  # run 1's validate stage on the H200
    assert stage["ratio"] == 2.651 and not stage["within_10_percent"] and not stage["inside"]
    assert estimate_accuracy.compared(127.0, 127.2, None)["inside"] is False  # no range: nothing holds
