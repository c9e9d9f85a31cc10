"""GPU proof in one command: what the host lacks installed from carried wheels, the CUDA-only tests, the train
benchmark on SmolLM2-135M and on a Llama-3-8B shape, the plan against the clock, tokenize on the host's many
cores, and a summary.

    make gpu-wheels              # once, on a machine with network: .gpu/wheels and .gpu/tokenizer (< 64 MiB)
    make gpu-check               # on the GPU host: python3 benchmarks/gpu_check.py
    make gpu-check DRY_RUN=1     # on a CPU: every part on the test suite's tiny Llama; what needs CUDA skipped

The host needs torch, transformers, peft, accelerate, pyarrow, pytest and PyYAML (a stock CUDA PyTorch image has
them); no network, no Prefect, no `datasets`. Each part runs in its own process, writes its result under
`--results` as it finishes and a status file `parts/<part>.json`; a re-run skips finished parts. A part is only
started when the time left in `--budget` (540 s: one 10-minute command with a margin) covers its expected
time; a part still running when the budget ends is stopped and redone by the next run. So a host lent for short
commands runs the same command two or three times. Exit status: 0 all parts finished, 3 parts left (run the
same command again), 1 a part failed (its status file holds the end of its log).
"""
from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import time
import tomllib
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    from phase1a.config.schema import Phase1aConfig
    from phase1a.data.tokenized import TokenizedData
    from phase1a.model.loading import ResolvedModel

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(ROOT))

# Neither imports a third-party package at the top: the host's bare python runs this before installing the wheels.
from train_throughput import CONFIGS as BENCH_CONFIGS, speedups, write_json

from phase1a.core.hardware import usable_cores
from phase1a.core.units import GIB, MIB

GPU_DIR = ROOT / ".gpu"  # ignored: wheels, tokenizer, installed packages, results kept between commands
WHEELS, TOKENIZER, SITE = GPU_DIR / "wheels", GPU_DIR / "tokenizer", GPU_DIR / "site"
CARRY_LIMIT = 64 * MIB  # what a GPU lease takes along: the working tree and the carried folder together
HOST_PYTHON = "3.12"  # the GPU hosts' interpreter: the wheels are downloaded for it
# What the project imports that a stock CUDA PyTorch image lacks: versions from uv.lock, where it has them.
FROM_LOCK = ("pydantic", "pydantic-core", "annotated-types", "typing-inspection")
# The optional GPU packages (docs/gpu.md): liger-kernel's Triton kernels, bitsandbytes' NF4 and 8-bit Adam.
OPTIONAL = {"liger-kernel": "0.8.5", "bitsandbytes": "0.50.2"}
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_24_x86_64", "manylinux_2_17_x86_64",
             "manylinux2014_x86_64", "manylinux1_x86_64")
GPU_TESTS = ("tests/test_speedups.py", "tests/test_gpu_paths.py")
FAMILIES = {"smollm2": "SmolLM2-135M shape", "llama3-8b": "Llama-3-8B shape"}
GOALS = {"mfu": 0.50, "speedup_vs_after": 2.0, "speedup_vs_hf_flattening": 1.25}  # the 8B shape on one H100


@dataclass
class Run:
    """One invocation: where results go, how much time it has, and whether it is the CPU dry run."""

    results: Path
    work: Path
    dry_run: bool
    budget: float
    retry_failed: bool
    gpus: int = 1  # CUDA devices on this host
    began: float = field(default_factory=time.monotonic)

    def left(self) -> float:
        return self.budget - (time.monotonic() - self.began)

    def env(self) -> dict[str, str]:
        paths = [str(SITE)] if SITE.is_dir() else []
        paths += [str(ROOT), os.environ.get("PYTHONPATH", "")]
        return {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in paths if p), "PYTHONUNBUFFERED": "1",
                "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}


@dataclass(frozen=True)
class Part:
    name: str
    what: str
    seconds: int  # expected on an H100 (docs/gpu.md's table); the budget must cover it before the part starts
    command: Callable[[Run], list[str]]
    result: str  # the file the part writes, relative to the results folder
    cuda_only: str | None = None  # why the dry run skips it
    gpus: int = 1  # a host with fewer skips it, saying so
    skip_unless: Callable[[Run], str | None] | None = None  # a reason to skip it on this host, asked before it starts


def _python(*args: str) -> list[str]:
    return [sys.executable, *args]


def _train_part(family: str, config: str, seconds: int, cuda_only: str | None = None) -> Part:
    def command(run: Run) -> list[str]:
        model = "test" if run.dry_run else family
        sizes = (["--measured", "16", "--examples", "200", "--max-answer-words", "40", "--calibration-budget", "10s"]
                 if run.dry_run else ["--measured", "256" if family == "llama3-8b" else "1024", "--examples", "20000",
                                      "--calibration-budget", "120s" if family == "llama3-8b" else "60s"])
        tokenizer = [] if run.dry_run else ["--tokenizer", str(TOKENIZER)]
        profile = ["--profile"] if config == "ours" else []
        return _python("benchmarks/train_throughput.py", "--model", model, *tokenizer, *sizes, "--configs", config,
                       *profile, "--work", str(run.work / "train"),
                       "--results-dir", str(run.results / f"train-{family}"))
    what = f"train benchmark, {FAMILIES[family]} (the test model in a dry run): {config}"
    return Part(f"train-{family}-{config}", what, seconds, command, f"train-{family}/{config}.json", cuda_only)


def _tests(run: Run) -> list[str]:
    return _python("-m", "pytest", "-m", "gpu", "-q", "-p", "no:cacheprovider", "-rs",
                   f"--junitxml={run.results / 'tests.xml'}", *GPU_TESTS)


def _plan(run: Run) -> list[str]:
    sizes = (["--model", "test", "--minutes", "0.4", "--examples", "2000", "--max-answer-words", "40",
              "--calibration-budget", "10s", "--checkpoint-interval", "10s"] if run.dry_run
             else ["--model", "smollm2", "--tokenizer", str(TOKENIZER), "--minutes", "3"])
    return _python("benchmarks/plan_accuracy.py", *sizes, "--work", str(run.work / "plan"),
                   "--out", str(run.results / "plan-smollm2.json"))


def process_counts(cores: int) -> list[int]:
    """1, 2, 4, ... and the core count itself: 1 2 4 8 16 on a 16-core host, 1 2 4 8 16 20 on a 20-core one."""
    counts = [1 << power for power in range(cores.bit_length()) if 1 << power <= cores]
    return counts if counts[-1] == cores else [*counts, cores]


def _tokenize(run: Run) -> list[str]:
    """The tokenize stage at 1 worker process up to one per usable core (and one process on one core)."""
    counts = [str(count) for count in process_counts(usable_cores())]
    # The dry run: the default run (one process at this size), two processes and one core, the same bytes.
    sizes = (["--examples", "6000", "--workers", "2"] if run.dry_run
             else ["--tokenizer", str(TOKENIZER), "--examples", "200000", "--workers", *counts])
    return _python("benchmarks/tokenize_throughput.py", *sizes, "--one-core", "--formats", "jsonl", "--map", "0",
                   "--onthefly", "0", "--work", str(run.work / "tokenize"),
                   "--out", str(run.results / "tokenize-scaling.json"))


def _ranks(run: Run) -> list[str]:
    """Two ranks on two GPUs with NCCL: DDP and FSDP train the steps of one process (tests/test_distributed.py)."""
    return _python("-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs", f"--junitxml={run.results / 'ranks.xml'}",
                   "tests/test_distributed.py")


def _serve(run: Run) -> list[str]:
    """This script again, in the part's own process: `serve_vllm` below."""
    return _python("benchmarks/gpu_check.py", "--serve-vllm", "--work", str(run.work / "serve"),
                   "--results", str(run.results), *(["--dry-run"] if run.dry_run else []))


def _vllm_missing(run: Run) -> str | None:
    """On a GPU host without vLLM the part skips before training anything (lease time); the dry run goes on up to
    the point that needs CUDA."""
    return None if run.dry_run or importlib.util.find_spec("vllm") is not None else VLLM_MISSING


EIGHT_B = "needs CUDA: a Llama-3-8B shape is 16 GB of bf16 weights"
PARTS = [
    Part("tests", "CUDA-only tests and GPU smokes (pytest -m gpu)", 150, _tests, "tests.xml"),
    *[_train_part("smollm2", config, 60 if config != "ours" else 150) for config in BENCH_CONFIGS],
    *[_train_part("llama3-8b", config, {"before": 200, "after": 120, "hf_flattening": 90, "ours": 270}[config], EIGHT_B)
      for config in BENCH_CONFIGS],
    Part("plan-smollm2", "the plan against the clock: calibrate, estimate, train 3 minutes", 330, _plan,
         "plan-smollm2.json"),
    Part("ranks-2gpu", "two ranks under torchrun on two GPUs (NCCL): DDP and FSDP against one process", 120,
         _ranks, "ranks.xml", cuda_only="needs two CUDA GPUs (NCCL)", gpus=2),
    Part("tokenize-scaling", "the tokenize stage at 1, 2, 4, ... processes up to the host's cores, 200k chat examples",
         240, _tokenize, "tokenize-scaling.json"),
    Part("serve-vllm", "a promoted adapter checked for vLLM multi-LoRA, served by vLLM: exact match against the "
         "validate stage's", 150, _serve, "serve-vllm.json", skip_unless=_vllm_missing),
]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true",
                        help="on a CPU: the test suite's tiny Llama; CUDA-only parts skipped")
    parser.add_argument("--prepare", action="store_true", help="download the wheels and the tokenizer into .gpu/")
    parser.add_argument("--python-version", default=HOST_PYTHON, help="--prepare: the GPU host's Python")
    parser.add_argument("--results", type=Path, help="default: benchmarks/results/gpu-check-<device>-<date>, "
                                                     "or .gpu/dry-run for --dry-run")
    parser.add_argument("--work", type=Path, default=Path("/tmp/phase1a-gpu-check"))
    parser.add_argument("--budget", type=float, default=540.0, help="seconds this command may take")
    parser.add_argument("--parts", nargs="+", help="only these parts (names as in the summary)")
    parser.add_argument("--retry-failed", action="store_true", help="run failed parts again")
    parser.add_argument("--serve-vllm", action="store_true", help=argparse.SUPPRESS)  # the serve-vllm part's process
    args = parser.parse_args()
    if args.prepare:
        return prepare(args.python_version)
    if args.serve_vllm:
        return serve_vllm(args.work, args.results / "serve-vllm.json", args.dry_run)

    began = time.monotonic()
    installed = install_missing()
    if SITE.is_dir():
        sys.path.insert(0, str(SITE))  # the environment's report sees what the parts will import
    environment = describe_environment(installed)
    cuda = environment["cuda_available"]
    if not cuda and not args.dry_run:
        print("no CUDA device here: run on a GPU host, or `make gpu-check DRY_RUN=1` for the CPU dry run")
        return 2
    results = args.results or (GPU_DIR / "dry-run" if args.dry_run else
                               ROOT / "benchmarks" / "results" / f"gpu-check-{environment['slug']}")
    (results / "parts").mkdir(parents=True, exist_ok=True)
    run = Run(results=results.resolve(), work=args.work, dry_run=args.dry_run,
              budget=args.budget - (time.monotonic() - began), retry_failed=args.retry_failed,
              gpus=environment["gpus"])
    write_json(run.results / "environment.json", environment)
    left = [part.name for part in PARTS if (not args.parts or part.name in args.parts) and not run_part(part, run)]
    summary = collect(run.results)
    write_json(run.results / "summary.json", summary)
    (run.results / "summary.md").write_text(render_summary(summary))
    failed = [p.name for p in PARTS if _status(run.results, p.name).get("status") == "failed"]
    print(f"results: {run.results}/summary.md")
    if left:
        print(f"time budget spent; left: {', '.join(left)}. Run the same command again to continue.")
        return 3
    return 1 if failed else 0


def run_part(part: Part, run: Run) -> bool:
    """Run one part unless it finished before; False when it is left for the next invocation."""
    status_file = run.results / "parts" / f"{part.name}.json"
    previous = _status(run.results, part.name)
    if previous and (previous["status"] != "failed" or not run.retry_failed):
        print(f"[{part.name}] {previous['status']} earlier, kept")
        return True
    if run.dry_run and part.cuda_only:
        write_json(status_file, {"part": part.name, "status": "skipped", "reason": part.cuda_only})
        print(f"[{part.name}] skipped: {part.cuda_only}")
        return True
    reason = part.skip_unless(run) if part.skip_unless else None
    if not run.dry_run and run.gpus < part.gpus:
        reason = f"needs {part.gpus} GPUs, this host has {run.gpus}"
    if reason:
        write_json(status_file, {"part": part.name, "status": "skipped", "reason": reason})
        print(f"[{part.name}] skipped: {reason}")
        return True
    if run.left() < (10 if run.dry_run else part.seconds):
        return False
    log = run.results / "parts" / f"{part.name}.log"
    print(f"[{part.name}] {part.what} (expected {part.seconds} s on an H100, {run.left():.0f} s left)", flush=True)
    began = time.monotonic()
    with open(log, "w") as handle:
        process = subprocess.Popen(part.command(run), cwd=ROOT, env=run.env(), stdout=handle,
                                   stderr=subprocess.STDOUT, start_new_session=True)
        try:
            code = process.wait(timeout=max(1.0, run.left()))
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)  # its DataLoader workers and spawned measurements too
            process.wait()
            print(f"[{part.name}] stopped at the end of the budget; the next run redoes it")
            return False
    seconds = round(time.monotonic() - began, 1)
    produced = (run.results / part.result).is_file()
    status = {"part": part.name, "status": "ok" if code == 0 and produced else "failed", "seconds": seconds,
              "result": part.result}
    if produced and part.result.endswith(".json"):  # a part that ran as far as this host allows says why it stopped
        reported = json.loads((run.results / part.result).read_text())
        if reported.get("status") in ("skipped", "failed"):
            status.update(status=reported["status"] if code == 0 else "failed", reason=reported.get("reason", ""))
    if status["status"] == "failed":
        status["returncode"] = code
        status["log_tail"] = log.read_text(errors="replace")[-4000:]
    write_json(status_file, status)
    print(f"[{part.name}] {status['status']} in {seconds} s" + (f": {status['reason']}" if "reason" in status else ""),
          flush=True)
    return True


def _status(results: Path, name: str) -> dict:
    path = results / "parts" / f"{name}.json"
    return json.loads(path.read_text()) if path.is_file() else {}


# ------------------------------------------------------------------------------- serve-vllm: the adapter in vLLM

VLLM_MISSING = "vLLM not importable on this host: install it as docs/gpu.md says"
# vLLM's kernels and transformers' round bf16 differently, so a near tie between two tokens may go either way;
# 0.05 is 2 of the 48 answers. An adapter vLLM failed to apply scores near the base model's 0, far outside it.
SERVE_TOLERANCE = 0.05
SERVE_EXAMPLES = 48
# The task: a key word's fixed answer. A randomly initialised model (no network, no real weights here) learns it
# within seconds from its LoRA alone, so the validate stage's exact match is far above the base model's.
LOOKUP_KEYS, LOOKUP_ANSWERS = ("the", "a", "date", "rewrite"), ("answer", "european", "form", "long")


def serve_vllm(work: Path, out: Path, dry_run: bool) -> int:
    """The serve-vllm part: train an adapter, validate and promote it, check it for vLLM multi-LoRA, then (CUDA
    and vLLM here) serve it with vLLM on the validation prompts and compare the exact match with the validate
    stage's. Writes `out`; 1 when the adapter is incompatible or the two exact matches differ."""
    from phase1a.promote.serving import check_vllm_adapter

    began = time.monotonic()
    job = _serve_job(work, dry_run)
    validated = _validated(job)
    verdict = check_vllm_adapter(Path(validated["adapter"]), json.loads((Path(job.model.path) / "config.json")
                                                                         .read_text()))
    result = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "model": job.shape, **validated,
              "verdict": verdict.model_dump(), "verdict_line": verdict.describe(), "tolerance": SERVE_TOLERANCE,
              "prepare_seconds": round(time.monotonic() - began, 1)}
    reason = _serving_blocker(verdict, validated)
    if reason is not None:
        result.update(status="failed" if not verdict.compatible else "skipped", reason=reason)
    else:
        result.update(_serve_and_compare(job, validated, verdict.max_lora_rank))
    write_json(out, result)
    print(f"serve-vllm: {result['status']}" + (f": {result['reason']}" if "reason" in result else ""))
    return 1 if result["status"] == "failed" else 0


@dataclass
class ServeJob:
    """The job the part trains: its config, model and tokenized data."""

    shape: str
    config: Phase1aConfig
    model: ResolvedModel
    data: TokenizedData
    run_dir: Path


def _serve_job(work: Path, dry_run: bool) -> ServeJob:
    """The tiny shape (head size 64, which every vLLM attention backend takes) trained 12 epochs on the lookup
    task: exact match 1.0 on a CPU, where the base model scores 0. A dry run trains the test suite's tiny Llama
    6 epochs (0.7 to 0.9) on one thread: on a shared 2-core VM, two threads waiting on each other under load
    took 25 times as long. A fresh run directory each time."""
    from train_throughput import config_target, make_model_dir

    from phase1a.config.schema import Phase1aConfig
    from phase1a.model.loading import load_tokenizer, prepare_model
    from tasks.tokenize import TokenizeOptions, tokenize_dataset

    shape, epochs = ("test", 6) if dry_run else ("tiny", 12)
    if dry_run:
        import torch

        torch.set_num_threads(1)
    model_dir = make_model_dir(shape, None, work / f"model-{shape}")
    data_path = _lookup_data(work / "lookup.jsonl", 256 + SERVE_EXAMPLES)
    run_dir = work / f"run-{time.time_ns()}"
    config = Phase1aConfig.model_validate({
        "name": "serve-vllm", "work_dir": str(run_dir), "cache_dir": str(run_dir / "cache"),
        "data": {"source": str(data_path)}, "model": {"name_or_path": str(model_dir)},
        "method": {"batch_size": 16, "epochs": epochs, "learning_rate": 3e-3, "lora": {"r": 8, "alpha": 16}},
        "hardware": {"target": config_target()},
        "validation": {"max_examples": SERVE_EXAMPLES, "generation_batch_size": SERVE_EXAMPLES, "extractor": "whole",
                       "baseline": "base", "promote_to": str(run_dir / "promoted")}})
    model = prepare_model(config)
    data = tokenize_dataset(data_path, load_tokenizer(Path(model.path)), 256,
                            TokenizeOptions(validation_count=SERVE_EXAMPLES), run_dir / "cache" / "tokenized")
    return ServeJob(shape, config, model, data, run_dir)


def _lookup_data(path: Path, count: int) -> Path:
    import random

    rng, words = random.Random(0), LOOKUP_KEYS + LOOKUP_ANSWERS + ("in", "us", "with", "only", "month", "day")
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as handle:
        for _ in range(count):
            key = rng.randrange(len(LOOKUP_KEYS))
            question = " ".join([LOOKUP_KEYS[key], *(rng.choice(words) for _ in range(3))]) + "?"
            handle.write(json.dumps({"messages": [{"role": "user", "content": question},
                                                  {"role": "assistant", "content": LOOKUP_ANSWERS[key]}]}) + "\n")
    return path


def _validated(job: ServeJob) -> dict:
    """Train, then the validate stage and promotion where they import; on a bare GPU host (no botocore, which
    promotion imports) the candidate is scored as the validate stage scores it (the same `evaluate`) instead."""
    from phase1a.evaluate.metrics import evaluate
    from phase1a.model.loading import for_scoring, load_for_eval, load_tokenizer
    from tasks.train import TrainSettings, train

    trained = train(TrainSettings(model_dir=job.model.path, train_path=job.data.train_path,
                                  output_dir=str(job.run_dir / "train"), method=job.config.method, micro_batch_size=16,
                                  gradient_checkpointing=False, show_progress=False))
    adapter = Path(trained.adapter_dir)
    try:
        from tasks.promote import promote_candidate
        from tasks.validate import validate
    except ImportError as missing:
        model = for_scoring(load_for_eval(Path(job.model.path), adapter, _device()))
        metrics = evaluate(model, load_tokenizer(Path(job.model.path)), *_sample(job), job.config.validation)
        return {"adapter": str(adapter), "validate_exact_match": metrics.exact_match, **_trained(trained),
                "validated_by": f"the validate stage's scoring of the candidate (no promotion: {missing.name} is "
                                "not installed)"}
    verdict = validate(job.config, job.model, Path(job.data.validation_path), adapter)
    if not verdict.passed:
        raise SystemExit("serve-vllm: the trained adapter failed the gate: " + "; ".join(verdict.reasons))
    pointer = promote_candidate(job.config, job.model, verdict, trained=trained, run_dir=job.run_dir).pointer
    return {"adapter": pointer.artifacts["adapter"], "validate_exact_match": verdict.candidate.exact_match,
            **_trained(trained), "validated_by": f"the validate stage; promoted as {pointer.version}"}


def _trained(trained) -> dict:
    return {"train_steps": trained.steps, "train_seconds": trained.wall_seconds, "final_loss": trained.final_loss}


def _device():
    from phase1a.core.hardware import training_device

    return training_device()


def _sample(job: ServeJob) -> tuple:
    """The validate stage's sample: the validation split's first max_examples rows."""
    import numpy as np

    from phase1a.train.packing import TokenRows

    rows = TokenRows.load(job.data.validation_path)
    return rows, np.arange(min(len(rows), job.config.validation.max_examples))


def _serving_blocker(verdict, validated: dict) -> str | None:
    """Why this host does not serve the adapter: it is incompatible, vLLM is missing, or there is no CUDA."""
    import torch

    done = (f"trained, validated (exact match {validated['validate_exact_match']:.3f}) and checked "
            f"({verdict.describe()}) up to serving, which needs CUDA")
    if not verdict.compatible:
        return verdict.describe()
    if importlib.util.find_spec("vllm") is None:
        return f"{VLLM_MISSING}; {done}"
    return None if torch.cuda.is_available() else f"needs CUDA: vLLM serves on a GPU; {done}"


def _serve_and_compare(job: ServeJob, validated: dict, max_lora_rank: int) -> dict:
    """The validation prompts through vLLM with the adapter as a LoRARequest, greedy, scored by the project's
    extractor as the validate stage scores them."""
    import torch

    # The engine in this process: training and validation already initialised CUDA here, which would make vLLM
    # spawn its engine process afresh. Without effect on a vLLM that has no such process.
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from vllm import LLM, SamplingParams, __version__
    from vllm.lora.request import LoRARequest

    from phase1a.core.hardware import training_dtype

    torch.cuda.empty_cache()  # what training and validation cached goes back before vLLM sizes its KV cache
    tokenizer, examples, stop_ids, max_tokens = _prompts(job)
    began = time.monotonic()
    llm = LLM(model=job.model.path, enable_lora=True, max_lora_rank=max_lora_rank, max_loras=1, seed=0,
              dtype=str(training_dtype(_device())).removeprefix("torch."), skip_tokenizer_init=True,
              enforce_eager=True, gpu_memory_utilization=0.5, max_model_len=1024)
    started = time.monotonic()
    outputs = llm.generate([{"prompt_token_ids": e.prompt.tolist()} for e in examples],
                           SamplingParams(temperature=0, max_tokens=max_tokens, stop_token_ids=stop_ids,
                                          detokenize=False),
                           lora_request=LoRARequest("promoted", 1, validated["adapter"]))
    served = exact_match(tokenizer, examples, [list(o.outputs[0].token_ids) for o in outputs],
                         job.config.validation)
    difference = served - validated["validate_exact_match"]
    status = "ok" if abs(difference) <= SERVE_TOLERANCE else "failed"
    return {"status": status, "vllm_exact_match": served, "difference": round(difference, 4),
            "vllm": __version__, "max_lora_rank": max_lora_rank, "examples": len(examples),
            "engine_seconds": round(started - began, 1), "generate_seconds": round(time.monotonic() - started, 1),
            **({} if status == "ok" else {"reason": f"vLLM's exact match {served:.3f} differs from the validate "
                                                    f"stage's {validated['validate_exact_match']:.3f} by more "
                                                    f"than {SERVE_TOLERANCE}"})}


def _prompts(job: ServeJob) -> tuple:
    """(tokenizer, examples, stop ids, max new tokens) as the validate stage's generation takes them
    (phase1a/evaluate/metrics.py _generate)."""
    from types import SimpleNamespace

    from transformers import GenerationConfig

    from phase1a.evaluate.generation import generation_examples, stop_token_ids
    from phase1a.model.loading import load_tokenizer

    tokenizer, settings = load_tokenizer(Path(job.model.path)), job.config.validation
    examples = generation_examples(*_sample(job))
    model = SimpleNamespace(generation_config=GenerationConfig.from_pretrained(job.model.path))
    longest = max(len(e.reference) for e in examples)
    return (tokenizer, examples, stop_token_ids(tokenizer, model, examples),
            min(settings.max_new_tokens, longest + settings.new_tokens_margin))


def exact_match(tokenizer, examples: list, generated: list[list[int]], settings) -> float:
    """Generated token ids scored as phase1a/evaluate/metrics.py scores the validate stage's: both sides through
    the project's extractor (phase1a/evaluate/answers.py), special tokens stripped."""
    from phase1a.evaluate.answers import extract_answer

    specials = tokenizer.all_special_tokens
    hits = []
    for example, tokens in zip(examples, generated, strict=True):
        reference = extract_answer(tokenizer.decode(example.reference.tolist()), settings.extractor,
                                   settings.answer_pattern, specials)
        answer = extract_answer(tokenizer.decode(tokens), settings.extractor, settings.answer_pattern, specials)
        hits.append(answer is not None and answer == reference)
    return sum(hits) / len(hits)


# ---------------------------------------------------------------------------------------------- install, prepare

def _wheel_module(wheel: Path) -> str:
    return wheel.name.split("-")[0].lower()  # distribution names in wheel files are normalised to underscores


def install_missing() -> list[str]:
    """Install into .gpu/site the carried wheels whose package this interpreter cannot import."""
    missing = [w for w in sorted(WHEELS.glob("*.whl")) if importlib.util.find_spec(_wheel_module(w)) is None]
    if not missing:
        return []
    if importlib.util.find_spec("pip") is None:  # a uv venv (the CPU dry run): it has what the project needs
        print(f"no pip in {sys.executable}: carried wheels not installed ({', '.join(w.name for w in missing)})")
        return []
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                    "--no-cache-dir", "--upgrade", "--target", str(SITE), *map(str, missing)], check=True)
    print(f"installed into {SITE.relative_to(ROOT)}: {', '.join(w.name for w in missing)}")
    return [w.name for w in missing]


def prepare(python_version: str) -> int:
    """Download what the GPU host lacks (no network there), and SmolLM2's tokenizer; check the 64 MiB limit."""
    shutil.rmtree(WHEELS, ignore_errors=True)  # one version of each package: two would stop the install there
    WHEELS.mkdir(parents=True)
    lock = {p["name"]: p["version"] for p in tomllib.loads((ROOT / "uv.lock").read_text())["package"]}
    wanted = {name: lock[name] for name in FROM_LOCK} | OPTIONAL
    platforms = [arg for platform_tag in PLATFORMS for arg in ("--platform", platform_tag)]
    for name, version in wanted.items():
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                        "--python-version", python_version, "--implementation", "cp", *platforms, "-d", str(WHEELS),
                        f"{name}=={version}"], check=True)
    sys.path.insert(0, str(ROOT))
    from phase1a.config.schema import ModelConfig
    from phase1a.model.loading import load_tokenizer, resolve_model

    load_tokenizer(resolve_model(ModelConfig(name_or_path="smollm2-135m-instruct"))).save_pretrained(TOKENIZER)
    carried = sum(p.stat().st_size for folder in (WHEELS, TOKENIZER) for p in folder.rglob("*") if p.is_file())
    tracked = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    tree = sum((ROOT / name).stat().st_size for name in tracked.decode().split("\0")
               if name and (ROOT / name).is_file())
    total = carried + tree
    print(f"{WHEELS.relative_to(ROOT)} and {TOKENIZER.relative_to(ROOT)}: {carried / MIB:.1f} MiB; "
          f"with the tracked tree {total / MIB:.1f} MiB of the {CARRY_LIMIT / MIB:.0f} MiB a lease carries")
    return 0 if total <= CARRY_LIMIT else 1


# ------------------------------------------------------------------------------------------- environment, summary

def describe_environment(installed: list[str]) -> dict:
    """Device, driver, CUDA and package versions, date, command and commit: what every result is read against."""
    import torch

    from phase1a.core.hardware import detect

    versions = {}  # by distribution: liger_kernel has no __version__
    for name in ("torch", "transformers", "peft", "accelerate", "pyarrow", "pydantic", "liger-kernel",
                 "bitsandbytes", "flash-attn", "triton"):
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = None
    cuda = torch.cuda.is_available()
    device = detect()[1].name
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    return {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "command": " ".join(sys.argv),
        "device": device, "cuda_available": cuda, "driver": _driver() if cuda else None,
        "cuda": torch.version.cuda, "cudnn": torch.backends.cudnn.version() if cuda else None,
        "gpu_memory_gib": round(torch.cuda.get_device_properties(0).total_memory / GIB, 1) if cuda else None,
        "gpus": torch.cuda.device_count() if cuda else 0,
        "python": platform.python_version(), "machine": platform.node(), "versions": versions,
        "installed_from_wheels": installed, "commit": commit.stdout.strip() or None,
        "slug": f"{_slug(device)}-{datetime.now(timezone.utc):%Y-%m-%d}",
    }


def _driver() -> str | None:
    if shutil.which("nvidia-smi") is None:
        return None
    query = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                           capture_output=True, text=True)
    return query.stdout.strip().splitlines()[0] if query.returncode == 0 and query.stdout.strip() else None


def _slug(device: str) -> str:
    words = device.lower().replace("nvidia", "").replace("(", " ").replace(")", " ").split()
    return "-".join(words)[:40] or "device"


def collect(results: Path) -> dict:
    """Every part's status and result in one document."""
    summary = {"environment": json.loads((results / "environment.json").read_text()),
               "parts": {part.name: _status(results, part.name) for part in PARTS}}
    summary["tests"] = _junit(results / "tests.xml")
    summary["ranks"] = _junit(results / "ranks.xml")
    for family in FAMILIES:
        files = [results / f"train-{family}" / f"{config}.json" for config in BENCH_CONFIGS]
        rows = [json.loads(path.read_text()) for path in files if path.is_file()]
        summary[f"train-{family}"] = {"results": rows, **speedups(rows)}
    for name in ("plan-smollm2", "tokenize-scaling", "serve-vllm"):
        path = results / f"{name}.json"
        summary[name] = json.loads(path.read_text()) if path.is_file() else None
    return summary


def _junit(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    import xml.etree.ElementTree as ElementTree

    cases = []
    for case in ElementTree.parse(path).getroot().iter("testcase"):
        outcome, detail = "passed", ""
        for tag in ("failure", "error", "skipped"):
            element = case.find(tag)
            if element is not None:
                outcome, detail = tag, (element.get("message") or "")[:300]
        cases.append({"test": f"{case.get('classname', '').split('.')[-1]}::{case.get('name')}", "outcome": outcome,
                      "seconds": float(case.get("time") or 0), "detail": detail})
    return cases


def render_summary(summary: dict) -> str:
    env = summary["environment"]
    lines = [f"# GPU check: {env['device']}, {env['date'][:10]}", "",
             f"- command: `{env['command']}` (commit {env['commit']})",
             f"- device: {env['device']}" + (f", {env['gpu_memory_gib']} GiB, driver {env['driver']}, CUDA "
                                             f"{env['cuda']}, cuDNN {env['cudnn']}" if env["cuda_available"] else "")
             + f"; Python {env['python']}; installed from carried wheels: "
             + (", ".join(env["installed_from_wheels"]) or "nothing"),
             "- packages: " + ", ".join(f"{k} {v}" for k, v in env["versions"].items() if v),
             "- not installed: " + (", ".join(k for k, v in env["versions"].items() if not v) or "none"), "",
             "## Parts", "", "| part | status | seconds | note |", "|---|---|---|---|"]
    for name, status in summary["parts"].items():
        note = status.get("reason") or (f"exit {status['returncode']}" if "returncode" in status else "")
        lines.append(f"| {name} | {status.get('status', 'not run yet')} | {status.get('seconds', '')} | {note} |")
    if summary["tests"]:
        lines += ["", "## Tests (`pytest -m gpu`)", "", "| test | outcome | seconds | detail |", "|---|---|---|---|"]
        lines += [f"| {t['test']} | {t['outcome']} | {t['seconds']:.1f} | {t['detail']} |" for t in summary["tests"]]
    for family in FAMILIES:
        lines += _train_section(summary[f"train-{family}"])
    lines += _goals_section(summary["train-llama3-8b"])
    lines += _plan_section(summary["plan-smollm2"])
    lines += _tokenize_section(summary.get("tokenize-scaling"))
    lines += _serve_section(summary.get("serve-vllm"))
    return "\n".join(lines) + "\n"


def _train_section(train: dict) -> list[str]:
    if not train["results"]:
        return []
    model = train["results"][0]["model"]
    title = f"{FAMILIES.get(model, model + ' model (the dry run)')}, randomly initialised"
    lines = ["", f"## Train throughput, {title}; LoRA r=16 on every projection", "",
             "| config | rows | micro x accum | checkpointing | useful tokens/s | MFU | TFLOP/s | peak GiB | padding |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in train["results"]:
        rows = f"packed, {r['max_seq_length']}" if r.get("packed") else f"padded to {r['max_seq_length']}"
        mfu = f"{r['mfu'] * 100:.3g}%" if r.get("mfu") is not None else "n/a"
        lines.append(f"| {r['config']} | {rows} | {r['micro_batch_size']} x {r['accumulation']} | "
                     f"{'on' if r['gradient_checkpointing'] else 'off'} | {r['useful_tokens_per_s']:,.0f} | {mfu} | "
                     f"{r['model_tflops_per_s']:.3g} | {r['peak_memory_gib']:.2f} | {r['padding_waste']:.0%} |")
    speedups = [f"{train[k]}x {k.removeprefix('speedup_vs_')}" for k in train if k.startswith("speedup_vs_")]
    if speedups:
        lines += ["", "Ours against: " + ", ".join(speedups) + "."]
    return lines


def _goals_section(train: dict) -> list[str]:
    ours = next((r for r in train["results"] if r["config"] == "ours"), None)
    if ours is None:
        return []
    measured = {"mfu": ours.get("mfu"), **{k: train.get(k) for k in GOALS if k.startswith("speedup")}}
    lines = ["", "## Goals, Llama-3-8B shape", "", "| goal | target | measured | met |", "|---|---|---|---|"]
    for key, target in GOALS.items():
        value = measured.get(key)
        met = "n/a" if value is None else ("yes" if value >= target else "no")
        lines.append(f"| {key} | {target:g} | {value if value is not None else 'n/a'} | {met} |")
    if ours.get("profile") and any(measured.get(k) is not None and measured[k] < t for k, t in GOALS.items()):
        lines += ["", "A goal is missed; where our steps spend their time (torch.profiler, 3 steps):", "", "```",
                  ours["profile"].rstrip(), "```"]
    return lines


def _plan_section(plan: dict | None) -> list[str]:
    if plan is None:
        return []
    est, act = plan["estimated"], plan["actual"]
    return ["", f"## The plan against the clock ({plan['model']}, window {plan['window_seconds']:.0f} s)", "",
            "| | estimated | actual |", "|---|---|---|",
            f"| startup s | {est['startup_seconds']} | {act['startup_seconds']} |",
            f"| train s | {est['train_seconds']} | {act['train_seconds']} |",
            f"| checkpoints | {est['checkpoints']} | {act['checkpoints']} |",
            f"| tokens/s | {est['tokens_per_second']} | {act['tokens_per_second']} |", "",
            f"Train time estimated/actual: {plan['train_time_accuracy']}; knobs: {plan['knobs']}; "
            f"planning took {plan['plan_seconds']} s."]



def _tokenize_section(scaling: dict | None) -> list[str]:
    if scaling is None:
        return []
    runs = {key: value for key, value in scaling.items() if key.startswith("stage_") and isinstance(value, dict)}
    one_core = next((v for k, v in runs.items() if k.endswith("_1core")), None)
    lines = ["", f"## Tokenize at 1 to N processes ({scaling['cpus']} usable cores)", "",
             "| run | processes | cores | seconds | tokens/s | vs one core | CPU s: parent, workers | peak PSS, all "
             "processes (MiB) |", "|---|---|---|---|---|---|---|---|"]
    for key, r in runs.items():
        ratio = f"{r['tokens_per_s'] / one_core['tokens_per_s']:.2f}x" if one_core else "n/a"
        lines.append(f"| {key} | {r['workers']} | {r['cores']} | {r['seconds']:.1f} | {r['tokens_per_s']:,.0f} | "
                     f"{ratio} | {r['parent_cpu_s']:.1f}, {r['workers_cpu_s']:.1f} | {r['peak_tree_pss_mib']:.0f} |")
    return lines


def _serve_section(serve: dict | None) -> list[str]:
    if serve is None:
        return []
    served = serve.get("vllm_exact_match")
    lines = ["", f"## Serving the adapter with vLLM ({serve['model']} model, randomly initialised, LoRA r=8)", "",
             f"- adapter: `{serve['adapter']}`, {serve['train_steps']} steps; validated by {serve['validated_by']}",
             f"- {serve['verdict_line']}" + (f"; max_lora_rank {serve['verdict']['max_lora_rank']}"
                                             if serve["verdict"]["max_lora_rank"] else ""),
             f"- exact match: validate stage {serve['validate_exact_match']:.3f}, vLLM "
             + (f"{served:.3f} (vLLM {serve['vllm']}; difference {serve['difference']:+.3f}, tolerance "
                f"{serve['tolerance']}; engine {serve['engine_seconds']} s, generation {serve['generate_seconds']} s)"
                if served is not None else "not served"),
             f"- {serve['status']}" + (f": {serve['reason']}" if serve.get("reason") else "")]
    return lines


if __name__ == "__main__":
    sys.exit(main())
