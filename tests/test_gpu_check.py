"""`make gpu-check DRY_RUN=1`: every part of the GPU proof runs on the test suite's tiny Llama on this CPU, so the
script cannot rot between GPU leases. Three invocations as a short lease would see them: one with no time left
(nothing starts, the parts are left for later), one that runs a single part, and one that keeps it and runs the rest.
Every process runs as on a bare GPU host: what such a host lacks (boto3, Prefect, `datasets`) cannot be imported."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import bare_gpu_host_env

ROOT = Path(__file__).resolve().parents[1]


def gpu_check(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "benchmarks/gpu_check.py", "--dry-run", "--results", str(tmp_path / "results"),
               "--work", str(tmp_path / "work"), *args]
    return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=900,
                          env=bare_gpu_host_env(tmp_path / "bare-host"))


@pytest.mark.slow
def test_the_dry_run_runs_every_part_resumes_and_summarises(tmp_path):
    results = tmp_path / "results"
    no_time = gpu_check(tmp_path, "--budget", "1")
    assert no_time.returncode == 3, no_time.stdout + no_time.stderr
    assert "Run the same command again to continue" in no_time.stdout
    assert "| tests | not run yet |" in (results / "summary.md").read_text()

    first = gpu_check(tmp_path, "--parts", "tests")
    assert first.returncode == 0, first.stdout + first.stderr
    rest = gpu_check(tmp_path)
    assert rest.returncode == 0, rest.stdout + rest.stderr
    assert "[tests] ok earlier, kept" in rest.stdout

    summary = json.loads((results / "summary.json").read_text())
    assert summary["environment"]["device"].startswith("CPU") and summary["environment"]["commit"]
    statuses = {name: status["status"] for name, status in summary["parts"].items()}
    cuda_only = {name for name in statuses if "llama3-8b" in name or name in ("ranks-2gpu", "serve-vllm")}
    assert {statuses[name] for name in cuda_only} == {"skipped"}
    assert {s for name, s in statuses.items() if name not in cuda_only} == {"ok"}
    assert_served_up_to_cuda(summary)
    assert summary["parts"]["ranks-2gpu"]["reason"] == "needs two CUDA GPUs (NCCL)"
    assert summary["parts"]["train-llama3-8b-ours"]["reason"].startswith("needs CUDA")

    # Every GPU test ran to a skip that names what it needs; none failed or errored on a machine without CUDA.
    assert summary["tests"] and {t["outcome"] for t in summary["tests"]} == {"skipped"}
    assert all("CUDA" in t["detail"] or "needs" in t["detail"] for t in summary["tests"])

    train = {r["config"]: r for r in summary["train-smollm2"]["results"]}
    assert set(train) == {"before", "after", "hf_flattening", "ours"}
    assert all(r["useful_tokens_per_s"] > 0 and r["useful_tokens"] == train["ours"]["useful_tokens"]
               for r in train.values())  # the same examples measured by every configuration
    assert train["before"]["padding_waste"] > 0.5 and train["ours"]["padding_waste"] == 0.0
    assert train["hf_flattening"]["padding_waste"] == 0.0 and train["ours"]["profile"]
    assert summary["train-smollm2"]["speedup_vs_before"] > 1.0

    plan = summary["plan-smollm2"]
    assert plan["calibrated"] and plan["window_seconds"] == 24
    assert plan["estimated"]["train_seconds"] > 0 and plan["actual"]["train_seconds"] > 0
    assert 0.2 < plan["train_time_accuracy"] < 5.0  # a calibrated estimate, not a guess by orders of magnitude

    scaling = summary["tokenize-scaling"]
    runs = [scaling[key] for key in ("stage_jsonl_6000", "stage_jsonl_6000_w2", "stage_jsonl_6000_w1_1core")]
    assert [(r["workers"], r["cores"] == 1) for r in runs] == [(1, False), (2, False), (1, True)]
    assert len({r["train_sha256"] for r in runs}) == 1  # every process count wrote the same bytes

    markdown = (results / "summary.md").read_text()
    for section in ("## Parts", "## Tests (`pytest -m gpu`)", "## Train throughput, test model",
                    "## The plan against the clock", "## Tokenize at 1 to N processes",
                    "## Serving the adapter with vLLM"):
        assert section in markdown
    assert "| train-llama3-8b-before | skipped |" in markdown


def assert_served_up_to_cuda(summary: dict) -> None:
    """serve-vllm trained, validated and checked its adapter, then skipped serving, saying why: no vLLM here."""
    status, serve = summary["parts"]["serve-vllm"], summary["serve-vllm"]
    assert status["status"] == "skipped" and status["seconds"] > 0, status  # it ran, as far as a CPU goes
    assert status["reason"].startswith("vLLM not importable on this host: install it as docs/gpu.md says; ")
    assert status["reason"].endswith("up to serving, which needs CUDA") and status["reason"] == serve["reason"]
    assert serve["verdict"]["compatible"] and serve["verdict"]["max_lora_rank"] == 8
    assert serve["verdict_line"] == "vLLM multi-LoRA: compatible" and "vllm_exact_match" not in serve
    assert serve["validate_exact_match"] > 0.5 and serve["train_steps"] == 96  # the lookup task, learnt
    assert "no promotion: botocore is not installed" in serve["validated_by"]  # a bare GPU host lacks it


@pytest.mark.slow
def test_the_serve_vllm_part_goes_up_to_the_point_that_needs_cuda(tmp_path):
    """The part alone, as the dry run runs it (tens of seconds): the whole test above runs it among the rest."""
    done = gpu_check(tmp_path, "--parts", "serve-vllm")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "[serve-vllm] skipped in " in done.stdout and "vLLM multi-LoRA: compatible" in done.stdout
    summary = json.loads((tmp_path / "results" / "summary.json").read_text())
    assert_served_up_to_cuda(summary)
    assert summary["parts"]["tests"] == {}  # not asked for: not run
    markdown = (tmp_path / "results" / "summary.md").read_text()
    assert "| serve-vllm | skipped |" in markdown and "- vLLM multi-LoRA: compatible; max_lora_rank 8" in markdown
