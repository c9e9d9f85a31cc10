"""GPU proof in one command: what the host lacks installed from carried wheels, then, decisive numbers first, the
attention op alone, the train step on a SmolLM2-135M shape and on a Llama-3-8B shape (ours, the code before issue 34
carried beside it, and the peers, in the same run), compiled layers and CUDA graphs, the CUDA-only tests, the plan
against the clock, tokenize on the host's many cores, vLLM serving, and a summary whose first table is issue 34's
goals.

    make gpu-wheels              # once, on a machine with git and network: .gpu/ (wheels, tokenizer, before.tar)
    make gpu-check               # on the GPU host: python3 benchmarks/gpu_check.py
    make gpu-check DRY_RUN=1     # on a CPU: every part on the test suite's tiny Llama; what needs CUDA skipped

The host needs torch, transformers, peft, accelerate, pyarrow, pytest and PyYAML (a stock CUDA PyTorch image has
them); no network, no git, no Prefect, no `datasets`. Each part runs in its own process and writes each measurement
under `--results` as it finishes, with a status file `parts/<part>.json`; a re-run skips finished parts (and a part
cut off keeps the measurements it finished). A part is only started when the time left in `--budget` (540 s: one
10-minute command with a margin) covers its expected time; a part still running when the budget ends is stopped
and redone by the next run. So a host lent for short commands runs the same command two or three times. Exit
status: 0 all parts finished, 3 parts left (run the same command again), 1 a part failed (its status file holds the
end of its log).
"""
from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import tarfile
import time
import tomllib
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    from phase1a.config.schema import Phase1aConfig
    from phase1a.data.tokenized import TokenizedData
    from phase1a.model.result import ResolvedModel

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(ROOT))

# None imports a third-party package at the top: the host's bare python runs this before installing the wheels.
from step_meter import write_json

from phase1a.core.hardware import usable_cores
from phase1a.core.units import GIB, MIB

GPU_DIR = ROOT / ".gpu"  # ignored: wheels, tokenizer, the old tree, installed packages, results kept between commands
WHEELS, TOKENIZER, SITE = GPU_DIR / "wheels", GPU_DIR / "tokenizer", GPU_DIR / "site"
LOCKED_SITE = GPU_DIR / "site-lock"  # the lock's transformers and peft (and what they need), ahead of the host's
BEFORE_TAR = GPU_DIR / "before.tar"  # the code before issue 34: `git archive BEFORE phase1a tasks flows benchmarks`
BEFORE = "bec201d"  # the commit before issue 34's train step (f657d4c)
BEFORE_PATHS = ("phase1a", "tasks", "flows", "benchmarks")
CARRY_LIMIT = 64 * MIB  # what a GPU lease takes along: the working tree and the carried folder together
HOST_PYTHON = "3.12"  # the GPU hosts' interpreter: the wheels are downloaded for it
# What a stock CUDA PyTorch image has of the project's dependencies (the host's own versions are used).
ON_THE_HOST = ("torch", "transformers", "peft", "accelerate", "pyarrow", "numpy", "pyyaml", "tqdm", "tokenizers",
               "safetensors", "huggingface-hub")
# What the project imports that a stock CUDA PyTorch image lacks: versions from uv.lock, where it has them. The rest
# of the project's dependencies (Prefect, datasets, ...) the parts must not import. boto3 and what it needs are
# carried: the validate stage imports staging's S3 client (plan-smollm2 failed on a bare host without it, 2026-11-30).
FROM_LOCK = ("pydantic", "pydantic-core", "annotated-types", "typing-inspection", "gguf", "boto3", "botocore",
             "s3transfer", "jmespath", "python-dateutil", "six", "urllib3")
# The project's transformers and peft, installed where the host's version differs from the lock's (the code calls
# transformers' activation_checkpointing_* API, new in 5.23; its attention and masking interfaces move between
# releases), with what they import that may be too old or missing on the host, installed only when importing
# them says so (`install_locked`).
LOCKED = ("transformers", "peft")
LOCKED_DEPENDENCIES = ("huggingface-hub", "tokenizers", "safetensors", "regex", "httpx2", "httpcore2", "h11", "h2",
                       "hpack", "hyperframe", "anyio", "sniffio", "certifi", "idna", "typing-extensions", "filelock",
                       "fsspec", "tqdm", "packaging")
# The optional GPU packages (docs/gpu.md): liger-kernel's Triton kernels; bitsandbytes' NF4 and 8-bit Adam only with
# --with-bitsandbytes: its 42 MB wheel and the lock's transformers do not fit the 64 MiB together, and it only
# serves the QLoRA and 8-bit optimizer tests, which skip without it.
OPTIONAL = {"liger-kernel": "0.8.5"}
BITSANDBYTES = {"bitsandbytes": "0.50.2"}
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_24_x86_64", "manylinux_2_17_x86_64",
             "manylinux2014_x86_64", "manylinux1_x86_64")
GPU_TESTS = ("tests/train/test_speedups.py", "tests/train/test_gpu_paths.py")
FAMILIES = {"smollm2": "SmolLM2-135M shape", "llama3-8b": "Llama-3-8B shape (full width, 8 layers)"}


@dataclass
class Run:
    """One invocation: where results go, how much time it has, and whether it is the CPU dry run."""

    results: Path
    work: Path
    dry_run: bool
    budget: float
    retry_failed: bool
    before_tar: Path = BEFORE_TAR
    gpus: int = 1  # CUDA devices on this host
    began: float = field(default_factory=time.monotonic)

    def left(self) -> float:
        return self.budget - (time.monotonic() - self.began)

    def env(self) -> dict[str, str]:
        return {**os.environ, "PYTHONPATH": python_path(ROOT), "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1",
                "TOKENIZERS_PARALLELISM": "false"}


def python_path(tree: Path) -> str:
    """The carried packages (the lock's transformers first), then `tree`'s code, then what PYTHONPATH held."""
    paths = [str(p) for p in (LOCKED_SITE, SITE) if p.is_dir()]
    paths += [str(tree), os.environ.get("PYTHONPATH", "")]
    return os.pathsep.join(p for p in paths if p)


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


# ---------------------------------------------------------------------------------------------------- train parts

# Each family's data, model and step sizes (benchmarks/train_throughput.py `--steps`): on a GPU, 20,000 generated
# chat examples (18,050 in the train split, 125 SmolLM2 tokens on average, 491 at most); the dry run, the test
# suite's tiny Llama on 400 short ones.
TRAIN_DATA = {
    "smollm2": ["--model", "smollm2", "--examples", "20000", "--max-answer-words", "300"],
    "llama3-8b": ["--model", "llama3-8b", "--layers", "8", "--examples", "20000", "--max-answer-words", "300"],
    "dry": ["--model", "test", "--examples", "400", "--max-answer-words", "40", "--threads", "1"],
}
STEPS = {  # the demo's batch, a token-rich static step (>= 16k tokens), the 8B shape's 8k-token rows
    "smollm2": {"demo": "demo:16", "rich": "rich:t20480"},
    "llama3-8b": {"rows8k": "rows8k:t32768:r8192"},
    "dry": {"demo": "demo:16", "rich": "rich:t5000", "rows8k": "rows8k:t5000:r2048"},
}
# Steps a window (benchmarks/step_meter.py): warm-up, timed, syncs counted, profiled. Every warm-up is 2 steps, so
# the timed steps of a slower measurement (fewer of them) are among the faster ones' timed steps.
WINDOWS = {"fast": (2, 24, 2, 3), "slow": (2, 8, 1, 2), "slower": (2, 4, 1, 1), "dry": (1, 2, 1, 1)}


@dataclass(frozen=True)
class Train:
    """One train part: measurements of `configs` at `steps` of a family, each a result file, in one process."""

    family: str
    name: str
    configs: tuple[str, ...]
    steps: tuple[str, ...]
    windows: str
    dry_steps: tuple[str, ...] | None = None  # the dry run's subset (None: the same)

    def command(self, run: Run) -> list[str]:
        data = TRAIN_DATA["dry" if run.dry_run else self.family]
        steps = STEPS["dry" if run.dry_run else self.family]
        names = self.dry_steps if run.dry_run and self.dry_steps is not None else self.steps
        tokenizer = [] if run.dry_run else ["--tokenizer", str(TOKENIZER)]
        extra = ["--static-rows"] if run.dry_run else ["--cudnn", "off", "on"]
        if run.dry_run and {"before", "after"} & set(self.configs):
            extra += ["--padded-length", "512"]  # the field notes' 2048 costs a CPU a minute a step
        return _python("benchmarks/train_throughput.py", *data, *tokenizer, "--configs", *self.configs,
                       "--steps", *(steps[name] for name in names),
                       "--windows", *map(str, WINDOWS["dry" if run.dry_run else self.windows]), *extra,
                       "--calibration-budget", "10s" if run.dry_run else "60s", "--work", str(run.work / "train"),
                       "--results-dir", str(run.results / f"train-{self.family}"),
                       "--out", str(run.results / self.result))

    @property
    def result(self) -> str:
        return f"train-{self.family}/parts/{self.name}.json"


def _train_part(train: Train, seconds: int, what: str, cuda_only: str | None = None) -> Part:
    return Part(f"train-{train.family}-{train.name}", f"{FAMILIES[train.family]}: {what}", seconds, train.command,
                train.result, cuda_only)


def _old_part(family: str, steps: tuple[str, ...], windows: tuple[int, ...], seconds: int, what: str,
              cuda_only: str | None = None) -> Part:
    """The code before issue 34 from .gpu/before.tar, in a process of its own per step (`old_code` below)."""
    name = "old" if len(steps) == 1 and steps[0] in ("demo", "rows8k") else "old-" + "-".join(steps)

    def command(run: Run) -> list[str]:
        sizes = WINDOWS["dry"] if run.dry_run else windows
        return _python("benchmarks/gpu_check.py", "--old-code", family, "--old-steps", *steps,
                       "--old-windows", *map(str, sizes), "--work", str(run.work), "--results", str(run.results),
                       "--before-tar", str(run.before_tar), *(["--dry-run"] if run.dry_run else []))

    return Part(f"train-{family}-{name}", f"{FAMILIES[family]}: {what}", seconds, command,
                f"train-{family}/parts/{name}.json", cuda_only)


def _tests(run: Run) -> list[str]:
    return _python("-m", "pytest", "-m", "gpu", "-q", "-p", "no:cacheprovider", "-rs",
                   f"--junitxml={run.results / 'tests.xml'}", *GPU_TESTS)


def _attention(run: Run) -> list[str]:
    return _python("benchmarks/attention_op.py", "--out", str(run.results / "attention-op.json"),
                   *(["--dry-run"] if run.dry_run else []))


def _plan(run: Run) -> list[str]:
    # The dry run's window holds its start-up and validate estimates at several times their quiet size: a 24 s
    # window left nothing to train on a loaded CI machine (WindowError, 2026-11-27).
    sizes = (["--model", "test", "--minutes", "0.75", "--examples", "2000", "--max-answer-words", "40",
              "--calibration-budget", "10s", "--checkpoint-interval", "10s"] if run.dry_run
             else ["--model", "smollm2", "--tokenizer", str(TOKENIZER), "--minutes", "2.5", "--examples", "100000",
                   "--calibration-budget", "45s"])
    # Fresh runs while the part's time lasts (issue 38: the spread between runs, not one run's luck); 15 s kept
    # for the script's own exit before this check's timeout. The dry run proves one run's path.
    return _python("benchmarks/plan_accuracy.py", *sizes, "--repeats", "1" if run.dry_run else "3",
                   "--budget", f"{run.left() - 15:.0f}",
                   "--work", str(run.work / "plan"), "--out", str(run.results / "plan-smollm2.json"))


def _decode_step(run: Run) -> list[str]:
    sizes = ["--model", "test"] if run.dry_run else ["--model", "smollm2", "--tokenizer", str(TOKENIZER)]
    return _python("benchmarks/decode_step.py", *sizes, "--rounds", "2", "--work", str(run.work / "decode"),
                   "--out", str(run.results / "decode-step.json"))


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
    """Two ranks on two GPUs with NCCL: DDP and FSDP train the steps of one process
    (tests/train/test_distributed.py)."""
    return _python("-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs", f"--junitxml={run.results / 'ranks.xml'}",
                   "tests/train/test_distributed.py")


def _serve(run: Run) -> list[str]:
    """This script again, in the part's own process: `serve_vllm` below."""
    return _python("benchmarks/gpu_check.py", "--serve-vllm", "--work", str(run.work / "serve"),
                   "--results", str(run.results), *(["--dry-run"] if run.dry_run else []))


def _vllm_missing(run: Run) -> str | None:
    """On a GPU host without vLLM the part skips before training anything (lease time); the dry run goes on up to
    the point that needs CUDA."""
    return None if run.dry_run or importlib.util.find_spec("vllm") is not None else VLLM_MISSING


EIGHT_B = "needs CUDA: the Llama-3-8B shape is built on the GPU (5.6 GB of bf16 weights at 8 layers)"
GRAPHS = "needs CUDA: CUDA graphs"
COMPILE_ON_CPU = ("compiling every row length on a 2-core CPU takes minutes; tests/train/test_speedups.py compiles a "
                  "layer whole on a CPU (no graph breaks, no recompiles)")
# Expected seconds on an H100: estimates, conservative (process start, model build, Liger's and the compiler's
# first kernels and CUPTI's start included; the H200 run of 2026-11-26 took 2 to 3.5 times the estimates then).
PARTS = [
    Part("attention-op", "the attention alone, 16k tokens of chat-like examples, SmolLM2 and Llama-3-8B heads: the "
         "per-example SDPA loop before issue 34 against the varlen op, ms a call, parity", 60, _attention,
         "attention-op.json"),
    _train_part(Train("smollm2", "new", ("new",), ("demo", "rich"), "fast"), 150,
                "our train step, eager, at the demo's batch and at a token-rich static step"),
    _old_part("smollm2", ("demo",), WINDOWS["slow"], 150,
              "the code before issue 34 (bec201d, from .gpu/before.tar) at the demo's batch"),
    _train_part(Train("smollm2", "hf_flattening", ("hf_flattening",), ("demo", "rich"), "fast", ("demo",)), 200,
                "peer: Hugging Face Trainer padding-free, cuDNN SDPA off and on, at both steps"),
    _train_part(Train("smollm2", "padded", ("before", "after"), ("demo",), "slow"), 240,
                "peers: the field notes' before and after, cuDNN SDPA off and on"),
    _old_part("smollm2", ("rich",), WINDOWS["slower"], 200, "the code before issue 34 at the token-rich step",
              "the dry run runs the code before issue 34 once, at the demo's batch (train-smollm2-old)"),
    _train_part(Train("llama3-8b", "new", ("new",), ("rows8k",), "slow"), 150,
                "our train step, eager, 8k-token rows", EIGHT_B),
    _old_part("llama3-8b", ("rows8k",), WINDOWS["slow"], 200, "the code before issue 34, 8k-token rows", EIGHT_B),
    _train_part(Train("llama3-8b", "hf_flattening", ("hf_flattening",), ("rows8k",), "slow"), 200,
                "peer: Hugging Face Trainer padding-free, rows of about 8k tokens, cuDNN SDPA off and on", EIGHT_B),
    _train_part(Train("smollm2", "compiled", ("new_compiled",), ("demo", "rich"), "fast"), 300,
                "our train step, each layer compiled, at both steps", COMPILE_ON_CPU),
    _train_part(Train("smollm2", "graphs", ("new_graphs",), ("demo", "rich"), "fast"), 300,
                "our train step, compiled layers as CUDA graphs, at both steps", GRAPHS),
    _train_part(Train("llama3-8b", "compiled", ("new_compiled", "new_graphs"), ("rows8k",), "slow"), 360,
                "our train step compiled, then as CUDA graphs, 8k-token rows", EIGHT_B),
    Part("tests", "CUDA-only tests and GPU smokes (pytest -m gpu)", 150, _tests, "tests.xml"),
    _train_part(Train("smollm2", "ours", ("ours",), ("demo",), "fast"), 180,
                "the knobs our plan picks by calibration (60 s, not timed), the demo's batch"),
    Part("decode-step", "a greedy step as calibration times it and as the validate stage runs it (Liger, the "
         "adapter's path, calibration's loop or generate)", 120, _decode_step, "decode-step.json"),
    Part("plan-smollm2", "the plan against the clock, fresh runs while the time lasts: calibrate, estimate, "
         "train a 2.5-minute window, validate", 260, _plan,
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
    parser.add_argument("--prepare", action="store_true",
                        help="download the wheels and the tokenizer into .gpu/, and write .gpu/before.tar")
    parser.add_argument("--python-version", default=HOST_PYTHON, help="--prepare: the GPU host's Python")
    parser.add_argument("--with-bitsandbytes", action="store_true",
                        help="--prepare: carry bitsandbytes too (it does not fit beside the lock's transformers)")
    parser.add_argument("--results", type=Path, help="default: benchmarks/results/gpu-check-<device>-<date>, "
                                                     "or .gpu/dry-run for --dry-run")
    parser.add_argument("--work", type=Path, default=Path("/tmp/phase1a-gpu-check"))
    parser.add_argument("--budget", type=float, default=540.0, help="seconds this command may take")
    parser.add_argument("--parts", nargs="+", help="only these parts (names as in the summary)")
    parser.add_argument("--archive", type=Path,
                        help="after every part, the whole results folder as one .tar.gz here, and summary.md "
                             "beside it (a lent GPU host returns a handful of files from $OUT, not a tree)")
    parser.add_argument("--retry-failed", action="store_true", help="run failed parts again")
    parser.add_argument("--before-tar", type=Path, default=BEFORE_TAR,
                        help=f"the code before issue 34 (`git archive {BEFORE}`), written by --prepare")
    parser.add_argument("--serve-vllm", action="store_true", help=argparse.SUPPRESS)  # the serve-vllm part's process
    parser.add_argument("--old-code", choices=sorted(FAMILIES), help=argparse.SUPPRESS)  # an old-code part's process
    parser.add_argument("--old-steps", nargs="+", help=argparse.SUPPRESS)
    parser.add_argument("--old-windows", nargs=4, type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.prepare:
        return prepare(args.python_version, args.with_bitsandbytes)
    if args.serve_vllm:
        return serve_vllm(args.work, args.results / "serve-vllm.json", args.dry_run)
    if args.old_code:
        return old_code(args.old_code, args.old_steps, tuple(args.old_windows), args.work, args.results,
                        args.before_tar, args.dry_run)

    began = time.monotonic()
    if args.dry_run and not args.before_tar.is_file() and shutil.which("git") and (ROOT / ".git").exists():
        write_before_tar(ROOT, BEFORE, args.before_tar)  # what `make gpu-wheels` carries to a GPU host
        print(f"wrote {args.before_tar} (git archive {BEFORE})")
    installed = install_missing() + install_locked()
    for site in (SITE, LOCKED_SITE):
        if site.is_dir():
            sys.path.insert(0, str(site))  # the environment's report sees what the parts will import
    environment = describe_environment(installed, args.before_tar)
    cuda = environment["cuda_available"]
    if not cuda and not args.dry_run:
        print("no CUDA device here: run on a GPU host, or `make gpu-check DRY_RUN=1` for the CPU dry run")
        return 2
    results = args.results or (GPU_DIR / "dry-run" if args.dry_run else
                               ROOT / "benchmarks" / "results" / f"gpu-check-{environment['slug']}")
    (results / "parts").mkdir(parents=True, exist_ok=True)
    run = Run(results=results.resolve(), work=args.work, dry_run=args.dry_run,
              budget=args.budget - (time.monotonic() - began), retry_failed=args.retry_failed,
              before_tar=args.before_tar, gpus=environment["gpus"])
    write_json(run.results / "environment.json", environment)
    left = []
    for part in PARTS:
        if args.parts and part.name not in args.parts:
            continue
        if not run_part(part, run):
            left.append(part.name)
        if args.archive:  # as it goes: a command cut off at its limit still returns what it finished
            write_summary(run.results)
            pack(run.results, args.archive)
    write_summary(run.results)
    if args.archive:
        pack(run.results, args.archive)
    failed = [p.name for p in PARTS if _status(run.results, p.name).get("status") == "failed"]
    print(f"results: {run.results}/summary.md")
    if left:
        print(f"time budget spent; left: {', '.join(left)}. Run the same command again to continue.")
        return 3
    return 1 if failed else 0


def write_summary(results: Path) -> None:
    summary = collect(results)
    write_json(results / "summary.json", summary)
    (results / "summary.md").write_text(render_summary(summary))


def pack(results: Path, archive: Path) -> None:
    """The results folder as one .tar.gz at `archive` (replaced whole, never half-written) and its summary.md
    beside it as `<archive stem>-summary.md`."""
    archive.parent.mkdir(parents=True, exist_ok=True)
    partial = archive.with_name(archive.name + ".partial")
    with tarfile.open(partial, "w:gz") as tar:
        tar.add(results, arcname=results.name)
    partial.replace(archive)
    shutil.copyfile(results / "summary.md", archive.with_name(archive.name.removesuffix(".tar.gz") + "-summary.md"))


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
            print(f"[{part.name}] stopped at the end of the budget; the next run redoes it (its finished "
                  f"measurements are kept)")
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


# --------------------------------------------------------------------------- the code before issue 34, beside ours

def old_code(family: str, steps: list[str], windows: tuple[int, ...], work: Path, results: Path, before_tar: Path,
             dry_run: bool) -> int:
    """An old-code part: extract .gpu/before.tar, prepare this checkout's benchmark (model, data, tokenization: the
    same files ours reads), then run benchmarks/old_code.py per step in a process whose `phase1a` is the old tree's.
    Writes train-<family>/old-<step>.json per step and the part's summary; skipped, saying so, without the tar."""
    name = "old" if len(steps) == 1 and steps[0] in ("demo", "rows8k") else "old-" + "-".join(steps)
    work, results = work.resolve(), results.resolve()  # the old code runs from its own tree
    out = results / f"train-{family}" / "parts" / f"{name}.json"
    if not before_tar.is_file():
        reason = f"no {before_tar}: `make gpu-wheels` writes it (git archive {BEFORE}) where git is"
        write_json(out, {"status": "skipped", "reason": reason})
        print(f"old code: skipped: {reason}")
        return 0
    tree = extract_before(before_tar, work / "before")
    bench, args = _bench(family, work, dry_run)
    steps_text = STEPS["dry" if dry_run else family]
    labels = []
    for step_name in steps:
        spec = _old_spec(bench, args, family, steps_text[step_name], windows, results, tree)
        target = results / f"train-{family}" / f"{spec['label']}.json"
        labels.append(spec["label"])
        if target.is_file():
            continue
        spec_file = work / f"old-{family}-{spec['label']}.spec.json"
        write_json(spec_file, spec)
        env = {**os.environ, "PYTHONPATH": python_path(tree), "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1",
               "TOKENIZERS_PARALLELISM": "false"}
        print(f"old code ({spec['code']}): {spec['label']}", flush=True)
        subprocess.run(_python(str(ROOT / "benchmarks" / "old_code.py"), "--tree", str(tree), "--spec",
                               str(spec_file), "--out", str(target)), cwd=tree, env=env, check=True)
    write_json(out, {"status": "ok", "labels": labels, "tree": str(tree), "code": _before_commit(tree)})
    return 0


def extract_before(tar: Path, target: Path) -> Path:
    """The tar's tree under `target`, once per tar (its size and mtime name the folder)."""
    stat = tar.stat()
    tree = target / f"{stat.st_size}-{int(stat.st_mtime)}"
    if not (tree / "EXTRACTED").is_file():
        shutil.rmtree(tree, ignore_errors=True)
        tree.mkdir(parents=True)
        with tarfile.open(tar) as archive:
            archive.extractall(tree, filter="data")
            commit = archive.pax_headers.get("comment")  # git archive writes the commit id there
        if commit:
            (tree / "BEFORE_COMMIT").write_text(commit[:12] + "\n")
        (tree / "EXTRACTED").touch()
    return tree


def _before_commit(tree: Path) -> str:
    """The commit `git archive` wrote into the tar's global header (extract_before keeps it), else BEFORE."""
    marker = tree / "BEFORE_COMMIT"
    return marker.read_text().strip() if marker.is_file() else BEFORE


def _bench(family: str, work: Path, dry_run: bool):
    """This checkout's train benchmark for the family: model directory, data, tokenization (made once, shared)."""
    from train_throughput import Bench

    parser = argparse.ArgumentParser()
    for flag, kind in (("--model", str), ("--layers", int), ("--examples", int), ("--max-answer-words", int),
                       ("--threads", int), ("--tokenizer", Path)):
        parser.add_argument(flag, type=kind)
    args = parser.parse_args(TRAIN_DATA["dry" if dry_run else family]
                             + ([] if dry_run else ["--tokenizer", str(TOKENIZER)]))
    args.work = work / "train"
    return Bench(args), args


def _old_spec(bench, args, family: str, step_text: str, windows: tuple[int, ...], results: Path, tree: Path) -> dict:
    """What benchmarks/old_code.py needs, FLOPs a token and the device's peak computed here, as ours are."""
    from transformers import AutoConfig

    from phase1a.core.hardware import detect
    from phase1a.model.cost_model import flops_per_token, model_facts

    step = bench.step(step_text)
    facts = model_facts(bench.model_dir)
    config = AutoConfig.from_pretrained(bench.model_dir)
    embeddings = 0 if getattr(config, "tie_word_embeddings", False) else config.vocab_size * config.hidden_size
    return {"label": f"old-{step['step']}", "model": args.model, "model_dir": str(bench.model_dir),
            "train_path": bench.data.train_path, "max_seq_length": bench.data.max_seq_length, **step,
            "windows": dict(zip(("warmup", "timed", "syncs", "profiled"), windows)), "threads": args.threads,
            "mean_length": bench.mean_length, "examples": bench.examples,
            "results_dir": str(results / f"train-{family}"),
            "code": _before_commit(tree), "parameters": facts.parameters, "layers": facts.layers,
            "peak_flops": detect()[1].peak_flops, "input_embedding_parameters": embeddings,
            "flops_per_token": flops_per_token(facts, False, False, bench.mean_length)}

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
    from phase1a.evaluate.serving import check_vllm_adapter

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
    from phase1a.data.tokenizing import TokenizeOptions, tokenize_dataset
    from phase1a.model.loading import load_tokenizer, prepare_model

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
                       "baseline": "base"},
        "promotion": {"to": str(run_dir / "promoted")}})
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
    """Train, then the validate stage and promotion (boto3, which promotion imports, is carried to a GPU host)."""
    from phase1a.evaluate.validation import validate
    from phase1a.promote.candidate import promote_candidate
    from phase1a.train.loop import train
    from phase1a.train.settings import TrainSettings

    trained = train(TrainSettings(model_dir=job.model.path, train_path=job.data.train_path,
                                  output_dir=str(job.run_dir / "train"), method=job.config.method, micro_batch_size=16,
                                  gradient_checkpointing=False, show_progress=False))
    adapter = Path(trained.adapter_dir)
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


def _wheel_version(wheel: Path) -> str:
    return wheel.name.split("-")[1]


def _normalised(name: str) -> str:
    return re.sub(r"[-_.]+", "_", name).lower()


def _installed_version(distribution: str) -> str | None:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def _locked_group() -> set[str]:
    return {_normalised(name) for name in LOCKED + LOCKED_DEPENDENCIES}


def wheels_to_install(wheels: list[Path], version_of: Callable[[str], str | None]) -> list[Path]:
    """Of the carried wheels: the lock's transformers and peft where the host's version differs (or is missing);
    any other wheel outside their group where its package is missing. Their dependencies are `install_locked`'s."""
    chosen = []
    for wheel in wheels:
        name = _wheel_module(wheel)
        if name in {_normalised(n) for n in LOCKED}:
            if version_of(name.replace("_", "-")) != _wheel_version(wheel):
                chosen.append(wheel)
        elif name not in _locked_group() and version_of(name.replace("_", "-")) is None:
            chosen.append(wheel)
    return chosen


def _pip_install(wheels: list[Path], target: Path) -> None:
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                    "--no-cache-dir", "--upgrade", "--target", str(target), *map(str, wheels)], check=True)


def install_missing() -> list[str]:
    """Install into .gpu/site the carried wheels (outside the lock's transformers group) whose package this
    interpreter lacks."""
    wheels = sorted(WHEELS.glob("*.whl"))
    missing = [w for w in wheels_to_install(wheels, _installed_version)
               if _wheel_module(w) not in {_normalised(n) for n in LOCKED}]
    missing = [w for w in missing if importlib.util.find_spec(_wheel_module(w)) is None]
    if not missing:
        return []
    if importlib.util.find_spec("pip") is None:  # a uv venv (the CPU dry run): it has what the project needs
        print(f"no pip in {sys.executable}: carried wheels not installed ({', '.join(w.name for w in missing)})")
        return []
    _pip_install(missing, SITE)
    print(f"installed into {SITE.relative_to(ROOT)}: {', '.join(w.name for w in missing)}")
    return [w.name for w in missing]


LOCKED_PROBE = ("import transformers, peft, transformers.masking_utils, transformers.models.llama.modeling_llama; "
                "from transformers import AttentionInterface, Trainer, DataCollatorWithFlattening; "
                "print(transformers.__version__, peft.__version__)")


def install_locked(attempts: int = 12) -> list[str]:
    """The lock's transformers and peft into .gpu/site-lock (ahead of the host's on every part's path) where the
    host's versions differ, then what importing them asks for, one carried wheel at a time: a module they cannot
    find, or a version transformers' own check refuses, named in the error. If they still do not import, the folder
    is removed and the host's versions run, the reason printed (and kept in environment.json)."""
    wheels = sorted(WHEELS.glob("*.whl"))
    chosen = [w for w in wheels_to_install(wheels, _installed_version)
              if _wheel_module(w) in {_normalised(n) for n in LOCKED}]
    done, refused = LOCKED_SITE / "INSTALLED", GPU_DIR / "site-lock.refused"
    if done.is_file():
        return json.loads(done.read_text())
    if not chosen:
        return []
    if refused.is_file():  # tried by an earlier invocation on this host: not again (each try costs seconds)
        return json.loads(refused.read_text())
    if importlib.util.find_spec("pip") is None:
        print(f"no pip in {sys.executable}: the lock's {', '.join(w.name for w in chosen)} not installed")
        return []
    shutil.rmtree(LOCKED_SITE, ignore_errors=True)
    dependencies = {_wheel_module(w): w for w in wheels if _wheel_module(w) in _locked_group()
                    and _wheel_module(w) not in {_normalised(n) for n in LOCKED}}
    _pip_install(chosen, LOCKED_SITE)
    installed = [w.name for w in chosen]
    error = ""
    for _ in range(attempts):
        probe = subprocess.run([sys.executable, "-c", LOCKED_PROBE], capture_output=True, text=True,
                               env={**os.environ, "PYTHONPATH": python_path(ROOT)})
        if probe.returncode == 0:
            print(f"the lock's transformers and peft in {LOCKED_SITE.relative_to(ROOT)}: {probe.stdout.strip()} "
                  f"(installed: {', '.join(installed)})")
            done.write_text(json.dumps(installed))
            return installed
        error = (probe.stderr.strip().splitlines() or ["no error text"])[-1]
        wanted = _named_in(error, dependencies)
        if wanted is None:
            break
        _pip_install([dependencies.pop(wanted)], LOCKED_SITE)
        installed.append(wanted)
    shutil.rmtree(LOCKED_SITE, ignore_errors=True)
    reason = f"the lock's transformers/peft do not import here ({error}); the host's run instead"
    print(reason)
    refused.write_text(json.dumps([f"not installed: {reason}"]))
    return [f"not installed: {reason}"]


def _named_in(error: str, candidates: dict[str, Path]) -> str | None:
    """The carried dependency an import error names: `No module named 'x'`, or transformers' `x>=v is required`."""
    text = _normalised(error.replace("'", " ").replace('"', " "))
    for name in candidates:
        if re.search(rf"(?<![a-z0-9_]){re.escape(name)}(?![a-z0-9_])", text):
            return name
    return None


def prepare(python_version: str, with_bitsandbytes: bool = False) -> int:
    """Download what the GPU host lacks (no network there), the lock's transformers group, SmolLM2's tokenizer, and
    the code before issue 34 as a tar (no git there); check the 64 MiB limit."""
    shutil.rmtree(WHEELS, ignore_errors=True)  # one version of each package: two would stop the install there
    WHEELS.mkdir(parents=True)
    lock = {p["name"]: p["version"] for p in tomllib.loads((ROOT / "uv.lock").read_text())["package"]}
    wanted = ({name: lock[name] for name in FROM_LOCK + LOCKED + LOCKED_DEPENDENCIES if name in lock} | OPTIONAL
              | (BITSANDBYTES if with_bitsandbytes else {}))
    platforms = [arg for platform_tag in PLATFORMS for arg in ("--platform", platform_tag)]
    for name, version in wanted.items():
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                        "--python-version", python_version, "--implementation", "cp", *platforms, "-d", str(WHEELS),
                        f"{name}=={version}"], check=True)
    sys.path.insert(0, str(ROOT))
    from phase1a.config.schema import ModelConfig
    from phase1a.model.loading import load_tokenizer, resolve_model

    load_tokenizer(resolve_model(ModelConfig(name_or_path="smollm2-135m-instruct"))).save_pretrained(TOKENIZER)
    write_before_tar(ROOT, BEFORE, BEFORE_TAR)
    commit = subprocess.run(["git", "describe", "--always", "--dirty"], cwd=ROOT, capture_output=True, text=True)
    (GPU_DIR / "COMMIT").write_text(commit.stdout.strip() + "\n")  # the GPU host has no git
    total, lines = carry_size(ROOT, [WHEELS, TOKENIZER, BEFORE_TAR])
    print("\n".join(lines))
    return 0 if total <= CARRY_LIMIT else 1


def write_before_tar(repository: Path, commit: str, target: Path) -> Path:
    """`git archive COMMIT phase1a tasks flows benchmarks` without benchmarks/results (1.1 MB): the code before
    issue 34, run beside ours on a GPU host without git (`old_code`)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    subprocess.run(["git", "archive", "--format=tar", "-o", str(target), commit, *BEFORE_PATHS,
                    ":(exclude)benchmarks/results"], cwd=repository, check=True)
    return target


def carry_size(repository: Path, carried: list[Path]) -> tuple[int, list[str]]:
    """Bytes a lease carries: the carried folders and files, and the repository's tracked files; and the lines
    that say so, folder by folder."""
    def size(path: Path) -> int:
        if path.is_file():
            return path.stat().st_size
        return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if path.is_dir() else 0

    tracked = subprocess.run(["git", "ls-files", "-z"], cwd=repository, capture_output=True, check=True).stdout
    tree = sum((repository / name).stat().st_size for name in tracked.decode().split("\0")
               if name and (repository / name).is_file())
    sizes = {path: size(path) for path in carried}
    total = tree + sum(sizes.values())
    lines = [f"  {path.relative_to(repository) if path.is_relative_to(repository) else path}: "
             f"{value / MIB:.1f} MiB" for path, value in sizes.items()]
    lines += [f"  the tracked tree: {tree / MIB:.1f} MiB",
              f"carried: {total / MIB:.1f} MiB of the {CARRY_LIMIT / MIB:.0f} MiB a lease carries"
              + ("" if total <= CARRY_LIMIT else " - OVER THE LIMIT")]
    return total, lines


# ------------------------------------------------------------------------------------------- environment, summary

def describe_environment(installed: list[str], before_tar: Path = BEFORE_TAR) -> dict:
    """Device, driver, CUDA and package versions, date, command and commit: what every result is read against."""
    import torch

    from phase1a.core.hardware import detect

    versions = {}  # by distribution: liger_kernel has no __version__
    for name in ("torch", "transformers", "peft", "accelerate", "pyarrow", "pydantic", "huggingface-hub",
                 "tokenizers", "liger-kernel", "bitsandbytes", "flash-attn", "triton"):
        versions[name] = _installed_version(name)
    lock = {p["name"]: p["version"] for p in tomllib.loads((ROOT / "uv.lock").read_text())["package"]}
    cuda = torch.cuda.is_available()
    device = detect()[1].name
    return {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "command": " ".join(sys.argv),
        "device": device, "cuda_available": cuda, "driver": _driver() if cuda else None,
        "cuda": torch.version.cuda, "cudnn": torch.backends.cudnn.version() if cuda else None,
        "gpu_memory_gib": round(torch.cuda.get_device_properties(0).total_memory / GIB, 1) if cuda else None,
        "gpus": torch.cuda.device_count() if cuda else 0,
        "python": platform.python_version(), "machine": platform.node(), "versions": versions,
        "lock": {name: lock.get(name) for name in LOCKED},
        "installed_from_wheels": installed, "commit": checkout_commit(),
        "prepared_commit": prepared_commit(),
        "before": {"tar": str(before_tar), "present": before_tar.is_file(), "commit": BEFORE},
        "slug": f"{_slug(device)}-{datetime.now(timezone.utc):%Y-%m-%d}",
    }


def checkout_commit() -> str | None:
    """The checkout's commit: from git where the checkout is a repository, else the COMMIT file `make gpu-wheels`
    writes. Only the checkout's own .git counts: a GPU host's copy of the tree can sit inside another repository,
    whose HEAD git would report (it answered bec201d on an H200 host, 2026-11-27)."""
    if (ROOT / ".git").exists():
        git = subprocess.run(["git", "describe", "--always", "--dirty"], cwd=ROOT, capture_output=True, text=True)
        if git.returncode == 0 and git.stdout.strip():
            return git.stdout.strip()
    return prepared_commit()


def prepared_commit() -> str | None:
    """The commit `make gpu-wheels` prepared .gpu/ at (its COMMIT file: the GPU host has no git)."""
    marker = GPU_DIR / "COMMIT"
    return marker.read_text().strip() if marker.is_file() else None


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
    """Every part's status and result in one document, and issue 34's goals computed from the recorded numbers."""
    summary = {"environment": json.loads((results / "environment.json").read_text()),
               "parts": {part.name: _status(results, part.name) for part in PARTS}}
    summary["tests"] = _junit(results / "tests.xml")
    summary["ranks"] = _junit(results / "ranks.xml")
    for name in ("attention-op", "decode-step", "plan-smollm2", "tokenize-scaling", "serve-vllm"):
        path = results / f"{name}.json"
        summary[name] = json.loads(path.read_text()) if path.is_file() else None
    for family in FAMILIES:
        folder = results / f"train-{family}"
        rows = [json.loads(path.read_text()) for path in sorted(folder.glob("*.json"))] if folder.is_dir() else []
        summary[f"train-{family}"] = sorted((r for r in rows if "label" in r), key=_label_order)
    summary["goals"] = goals(summary)
    return summary


_ORDER = ("new", "new_compiled", "new_graphs", "ours", "old", "hf_flattening", "trl_sft", "before", "after")
OURS = ("new", "new_compiled", "new_graphs", "ours")
PEER_CONFIGS = ("hf_flattening", "trl_sft", "before", "after")


def _label_order(result: dict) -> tuple:
    return (result["step"], _ORDER.index(result["config"]) if result["config"] in _ORDER else 99, result["label"])


def _finite(result: dict) -> bool:
    return not result.get("losses", {}).get("not_finite")


def _rate(result: dict | None) -> float | None:
    return None if result is None else result["derived"]["useful_tokens_per_s"]


def _best(results: list[dict], configs: tuple[str, ...], step: str) -> dict | None:
    """The fastest finite-loss measurement of `configs` at `step` (a NaN run is reported, never the best)."""
    candidates = [r for r in results if r["config"] in configs and r["step"] == step and _finite(r)]
    return max(candidates, key=_rate, default=None)


def goals(summary: dict) -> list[dict]:
    """Issue 34's goals, each from the recorded results: the measured value, its source, and whether it is met
    (None: not measured here, or not applicable on this device)."""
    small, large = summary["train-smollm2"], summary["train-llama3-8b"]
    cuda = summary["environment"]["cuda_available"]
    rows = []

    def row(goal: str, target: str, value, met, source: str) -> None:
        rows.append({"goal": goal, "target": target, "measured": value, "met": met, "source": source})

    def at_least(value, threshold):
        return None if value is None or not cuda else value >= threshold

    demo, rich = _best(small, OURS, "demo"), _best(small, OURS, "rich")
    old_demo = next((r for r in small if r["config"] == "old" and r["step"] == "demo"), None)
    row("SmolLM2-135M LoRA r16, demo batch (16 examples a step): useful tokens/s", ">= 30,000", _rate(demo),
        at_least(_rate(demo), 30_000), _source(demo))
    ratio = _ratio(demo, old_demo)
    row("... against the code before issue 34, same run", "ratio (30,000 was 32x the 938 of 2026-11-26)", ratio,
        None, f"{_source(demo)} / {_source(old_demo)}")
    mean_tokens = rich["step_tokens"].get("mean") if rich else None
    row("SmolLM2-135M, token-rich static step: useful tokens/s", ">= 150,000", _rate(rich),
        at_least(_rate(rich), 150_000) if not cuda or mean_tokens is None or mean_tokens >= 16_384 else False,
        _source(rich) + (f"; {mean_tokens:,.0f} tokens a step on average" if mean_tokens else ""))
    peer = _best(small, PEER_CONFIGS, "demo")
    ratio = _ratio(demo, peer)
    row("SmolLM2-135M, demo batch, against the best peer (same run)", ">= 3x", ratio, at_least(ratio, 3.0),
        f"{_source(demo)} / {_source(peer)}")
    big = _best(large, OURS, "rows8k")
    mfu = big["derived"].get("mfu") if big else None
    row("Llama-3-8B shape, LoRA r16, bf16: MFU (4N + attention)", ">= 40 %", mfu, at_least(mfu, 0.40), _source(big))
    busy = big["derived"].get("busy_fraction") if big else None
    row("Llama-3-8B shape: GPU busy (kernel time / wall)", ">= 90 %", busy, at_least(busy, 0.90), _source(big))
    big_peer = _best(large, PEER_CONFIGS, "rows8k")
    ratio = _ratio(big, big_peer)
    row("Llama-3-8B shape: against the best peer (same run)", ">= 1.3x", ratio, at_least(ratio, 1.3),
        f"{_source(big)} / {_source(big_peer)}")
    ours = [r for r in small + large if r["config"] in OURS and r["derived"].get("syncs_per_step") is not None]
    worst = max(ours, key=lambda r: r["derived"]["syncs_per_step"], default=None)
    syncs = worst["derived"]["syncs_per_step"] if worst else None
    row("Host syncs a step of ours on CUDA (micro-batches and update)", "0", syncs,
        None if syncs is None or not cuda else syncs == 0,
        f"the most of {len(ours)} measurements: {_source(worst)}" if worst else "not measured")
    runs = (summary.get("plan-smollm2") or {}).get("runs", [])
    for label, measured in (("Calibrated speed", lambda r: r["estimated"]["tokens_per_second"]
                             / r["actual"]["tokens_per_second"] if r["actual"]["tokens_per_second"] else None),
                            ("Train time", lambda r: r["train"]["ratio"]),
                            ("Validate time", lambda r: r["validate"]["ratio"])):
        ratios = [ratio for ratio in map(measured, runs) if ratio is not None]
        worst = max(ratios, key=lambda ratio: abs(ratio - 1), default=None)  # every run must meet it
        row(f"{label} estimated within 10 % (plan-smollm2, issue 38)", "0.9 to 1.1", worst,
            None if worst is None or not cuda else 0.9 <= worst <= 1.1,
            f"estimated / actual, the furthest of {len(ratios)} fresh runs: {', '.join(f'{r:.3f}' for r in ratios)}"
            if ratios else "not measured")
    row("The plan's H100/H200 rows contain these results", "within their range", None, None,
        "not measured by this check: the plan's options table against these results (docs/benchmarks.md)")
    return rows


def _ratio(a: dict | None, b: dict | None) -> float | None:
    return None if a is None or b is None else round(_rate(a) / _rate(b), 3)


def _source(result: dict | None) -> str:
    return "not measured" if result is None else f"{result['model']}/{result['label']}"


def _format(value) -> str:
    if value is None:
        return "n/a"
    if isinstance(value, float):
        return f"{value:,.0f}" if value >= 1000 else f"{value:.3g}"
    return str(value)


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
    lines = [f"# GPU check: {env['device']}, {env['date'][:10]}", ""]
    lines += _goals_section(summary["goals"], env["cuda_available"])
    lines += ["", "## Environment", "",
              f"- command: `{env['command']}` (commit {env['commit']}; .gpu/ prepared at {env.get('prepared_commit')})",
              f"- device: {env['device']}" + (f", {env['gpu_memory_gib']} GiB, driver {env['driver']}, CUDA "
                                              f"{env['cuda']}, cuDNN {env['cudnn']}" if env["cuda_available"] else "")
              + f"; Python {env['python']}; installed from carried wheels: "
              + (", ".join(env["installed_from_wheels"]) or "nothing"),
              "- packages: " + ", ".join(f"{k} {v}" for k, v in env["versions"].items() if v)
              + "; the lock's: " + ", ".join(f"{k} {v}" for k, v in env.get("lock", {}).items()),
              "- not installed: " + (", ".join(k for k, v in env["versions"].items() if not v) or "none"),
              f"- the code before issue 34: {env['before']['commit']} from `{env['before']['tar']}`"
              + ("" if env["before"]["present"] else " (absent: its parts skip)"),
              "", "## Parts", "", "| part | status | seconds | note |", "|---|---|---|---|"]
    for name, status in summary["parts"].items():
        note = status.get("reason") or (f"exit {status['returncode']}" if "returncode" in status else "")
        lines.append(f"| {name} | {status.get('status', 'not run yet')} | {status.get('seconds', '')} | {note} |")
    lines += _attention_section(summary.get("attention-op"))
    for family in FAMILIES:
        lines += _train_section(family, summary[f"train-{family}"])
    if summary["tests"]:
        lines += ["", "## Tests (`pytest -m gpu`)", "", "| test | outcome | seconds | detail |", "|---|---|---|---|"]
        lines += [f"| {t['test']} | {t['outcome']} | {t['seconds']:.1f} | {t['detail']} |" for t in summary["tests"]]
    lines += _decode_section(summary.get("decode-step"))
    lines += _plan_section(summary["plan-smollm2"])
    lines += _tokenize_section(summary.get("tokenize-scaling"))
    lines += _serve_section(summary.get("serve-vllm"))
    return "\n".join(lines) + "\n"


def _goals_section(rows: list[dict], cuda: bool) -> list[str]:
    lines = ["## Goals (issue 34), from the results below", "",
             "| goal | target | measured | met | from |", "|---|---|---|---|---|"]
    for r in rows:
        value = r["measured"]
        shown = (f"{value:.1%}" if isinstance(value, float) and "%" in r["target"] and value <= 1.5
                 else f"{value:.3g}x" if isinstance(value, float) and "x" in r["target"] else _format(value))
        met = {True: "yes", False: "**no**", None: "n/a"}[r["met"]]
        lines.append(f"| {r['goal']} | {r['target']} | {shown} | {met} | {r['source']} |")
    if not cuda:
        lines += ["", "A CPU (the dry run): no goal applies; the table shows the code path only."]
    return lines


def _attention_section(attention: dict | None) -> list[str]:
    if not attention or not attention.get("shapes"):
        return []
    lines = ["", f"## Attention alone, forward and backward ({attention['device']}, torch {attention['torch']})", "",
             "| heads (q, kv, dim) | tokens | examples | dtype | old loop ms | new ms | op alone ms | old / new | "
             "max relative difference: new from old; new, old from float32 | kernel |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for s in attention["shapes"]:
        checks = s["parity"].values()
        worst = [max(c.get(key, 0.0) for c in checks) for key in ("relative", "new_vs_float32", "old_vs_float32")]
        verdict = "ok" if s["parity_ok"] else f"**over {s['tolerance']:g}**"
        lines.append(f"| {s['shape']} ({s['heads']}, {s['kv_heads']}, {s['head_dim']}) | {s['tokens']:,} | "
                     f"{s['examples']} | {s['dtype']} | {s['old_ms']:.3g} | {s['new_ms']:.3g} | {s['op_ms']:.3g} | "
                     f"{s['speedup']:.3g}x | {worst[0]:.2g}; {worst[1]:.2g}, {worst[2]:.2g} ({verdict}) | "
                     f"{s.get('new_kernel', '')} |")
    return lines


def _train_section(family: str, results: list[dict]) -> list[str]:
    if not results:
        return []
    model = results[0]["model"]
    title = FAMILIES[family] if model != "test" else "the test model (the dry run)"
    lines = ["", f"## Train step, {title}, randomly initialised, LoRA r16 on every projection", "",
             "Every number from the result files in `train-" + family + "/` (raw numbers and `derived`); timed "
             "steps after warm-up on every row length; busy = kernel time / wall in the profiled (unseen) steps.", "",
             "| measurement | code | step: examples, mean tokens | rows | useful tok/s | padded tok/s | padding | "
             "MFU | peak GiB | GPU busy | syncs/step | s/step | loss (not finite) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        d = r["derived"]
        rows = (f"static {r['row_shape']['tokens']:,} ({len(r['row_lengths'])} lengths)" if r.get("static_rows")
                else f"padded to {r['max_seq_length']:,}" if r["config"] in ("before", "after")
                else "exact" + (f", <= {r['row_tokens']:,}" if r.get("row_tokens") else ""))
        if r["config"] in ("new_compiled", "new_graphs") or r.get("compile"):
            rows += ", compiled" + (", CUDA graphs" if r.get("cuda_graphs") else "")
        peak = d.get("peak_memory_gib")
        losses = r.get("losses", {})
        loss = (f"{losses['last']:.3f}" if "last" in losses else f"{losses.get('mean_over_run', float('nan')):.3f}"
                ) + (f" (**{losses['not_finite']}**)" if losses.get("not_finite") else "")
        lines.append(
            f"| {r['label']} | {r['code']} | {r['batch']}, {r['step_tokens'].get('mean', 0):,.0f} | {rows} | "
            f"{d['useful_tokens_per_s']:,.0f} | {d['padded_tokens_per_s']:,.0f} | {d['padding_share']:.1%} | "
            f"{_percent(d.get('mfu'))} | {'n/a' if peak is None else f'{peak:.2f}'} | "
            f"{_percent(d.get('busy_fraction'))} | {_format(d.get('syncs_per_step'))} | "
            f"{d['seconds_per_step']:.3g} | {loss} |")
    lines += _ratios(results)
    best = max((r for r in results if r["config"] in OURS and r.get("busy")), key=_rate, default=None)
    if best is not None and best["busy"].get("top"):
        kind = "CUDA kernels" if best["busy"]["activity"] == "cuda" else "CPU operators"
        lines += ["", f"Top {kind} of `{best['label']}` over {best['busy']['steps']} profiled steps it had not seen "
                      f"(self time; the whole table: `train-{family}/{best['profile_table']}`):", "",
                  "| kernel | calls | self ms |", "|---|---|---|"]
        lines += [f"| `{k['name'][:90]}` | {k['calls']} | {k['self_us'] / 1e3:.3g} |" for k in best["busy"]["top"][:10]]
    return lines


def _ratios(results: list[dict]) -> list[str]:
    lines = []
    for step in dict.fromkeys(r["step"] for r in results):
        mine = _best(results, OURS, step)
        others = [r for r in results if r["step"] == step and r["config"] not in OURS]
        if mine and others:
            lines.append(f"- {step}: {mine['label']} against " + ", ".join(
                f"{r['label']} {_rate(mine) / _rate(r):.3g}x" for r in others))
    return ["", *lines] if lines else []


def _percent(value) -> str:
    return "n/a" if value is None else f"{value:.3g}" if value < 0.001 else f"{value:.1%}"

def _decode_section(decode: dict | None) -> list[str]:
    if not decode:
        return []
    lines = ["", f"## A greedy step ({decode['model']}, {decode['prompts']} prompts)", "",
             "| row | ms a step | vs calibration's | dispatcher ops a step | the two first calls, s |",
             "|---|---|---|---|---|"]
    for row in decode["rows"].values():
        ops = "" if row["ops_per_step"] is None else f"{row['ops_per_step']:,.0f}"
        lines.append(f"| {row['what']} | {1000 * row['seconds_per_step']:.1f} | {row['vs_calibration']} | {ops} | "
                     f"{', '.join(map(str, row['warmup_call_seconds']))} |")
    return lines


def _plan_section(plan: dict | None) -> list[str]:
    if not plan or not plan.get("runs"):
        return []
    first = plan["runs"][0]
    lines = ["", f"## The plan against the clock ({first['model']}, window {first['window_seconds']:.0f} s, "
                 f"{len(plan['runs'])} fresh runs)", "",
             "| run | knobs | tokens/s est / actual | startup s est / actual | train s est (range) / actual | "
             "validate s est (range) / actual | planning s |", "|---|---|---|---|---|---|---|"]

    def stage(r: dict) -> str:  # estimate_accuracy.compared's fields
        if r["low"] is None:
            return f"{r['estimated']} / {r['actual']}: {r['ratio']}x, no range"
        return (f"{r['estimated']} ({r['low']}-{r['high']}) / {r['actual']}: {r['ratio']}x, "
                + ("inside" if r["inside"] else "**outside**"))

    for number, run in enumerate(plan["runs"], 1):
        est, act, knobs = run["estimated"], run["actual"], run["knobs"]
        lines.append(f"| {number} | micro {knobs['micro_batch_size']}, checkpointing "
                     f"{knobs['gradient_checkpointing']}, compile {knobs['compile']}, workers "
                     f"{knobs['dataloader_workers']} | {est['tokens_per_second']} / {act['tokens_per_second']} | "
                     f"{est['startup_seconds']} / {act['startup_seconds']} | {stage(run['train'])} | "
                     f"{stage(run['validate'])} | {run['plan_seconds']} |")
    return lines


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
