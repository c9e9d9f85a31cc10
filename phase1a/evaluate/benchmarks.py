"""Benchmarks through EleutherAI's lm-evaluation-harness (`validation.benchmarks`): did the fine-tune forget?

A benchmark is an lm-eval task (a registry name, or a task YAML of the user's over local data) scored on the
first `limit` documents, the same documents for every model. Its score is cached by model, weights and the
benchmark's identity (the task's definition and data, limit, shots, precision and this code), so the base
model's is computed once. docs/validation.md says how they are gated and estimated.
"""
from __future__ import annotations

import functools
import glob
import importlib.util
import logging
import math
import os
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from phase1a.config.schema import BenchmarkConfig, ValidationConfig
from phase1a.core.fingerprint import code_fingerprint, hash_json, sha256_file
from phase1a.evaluate.result import BenchmarkScore, DecodeBatch, EvaluationWork, ValidationSpeed

_STDERR_ITERATIONS = 1000  # bootstrap draws for a metric without a closed-form standard error
# What calibration keeps for `time_harness` before it is timed: up to 0.6 s on this project's CPU host, doubled.
HARNESS_GUESS_SECONDS = 1.0


class BenchmarkError(ValueError):
    """A benchmark that cannot be loaded or scored: names the task, its file and field."""


@dataclass(frozen=True)
class Benchmark:
    """One configured benchmark, resolved: what lm-eval loads and what its score depends on."""

    spec: BenchmarkConfig
    name: str  # the lm-eval task's name
    source: str | dict[str, Any]  # a registry name, or the YAML's config with its data files made absolute
    definition: str  # a hash of the task's definition: its YAML and data files, or its name and lm-eval's version

    @property
    def key(self) -> str:
        """The benchmark's row in the validation table, report.json and the trackers."""
        return f"{self.name}/{self.spec.metric}"

    def identity(self, precision: str) -> str:
        """What a score depends on besides the model and its weights."""
        return hash_json({"definition": self.definition, "limit": self.spec.limit, "shots": self.spec.num_fewshot,
                          "chat": self.spec.apply_chat_template, "precision": precision,
                          "code": code_fingerprint(__name__)})


def load_benchmark(spec: BenchmarkConfig) -> Benchmark:
    # The plan stage loads every benchmark before training: a missing harness fails there, not after training.
    if importlib.util.find_spec("lm_eval") is None:
        raise BenchmarkError(f"validation.benchmarks: {spec.task}: EleutherAI's lm-eval is not installed: "
                             "pip install 'phase1a[eval]' (an image: build it with EXTRAS=eval)")
    if not spec.is_file:
        import lm_eval

        return Benchmark(spec, spec.task, spec.task, hash_json({"task": spec.task, "lm_eval": lm_eval.__version__}))
    path = Path(spec.task)
    if not path.is_file():
        raise BenchmarkError(f"validation.benchmarks: no such task YAML: {path}")
    config = _task_yaml(path)
    files = _data_files(config, path)
    # The data files by their names relative to the YAML: the same task in another checkout is the same benchmark.
    here = path.parent.resolve()
    definition = hash_json({"yaml": path.read_text(),
                            "data": {os.path.relpath(f, here): sha256_file(f) for f in files}})
    return Benchmark(spec, config["task"], config, definition)


def validation_key(settings: ValidationConfig) -> dict[str, Any]:
    """The validation section as a cache key reads it, the same from any checkout, work directory or host: where
    a file lies never enters. A benchmark YAML enters as its definition (its bytes and its data files'), a
    baseline file by its bytes where the verdict reads it (baseline.py: baseline_identity). Where a model is
    promoted is another section's (promotion.to): a promoted baseline enters as the version its pointer names."""
    key = settings.model_dump(mode="json", exclude={"baseline_file", "benchmarks"})
    key["benchmarks"] = [{**spec.model_dump(mode="json", exclude={"task"} if spec.is_file else None),
                          "definition": load_benchmark(spec).definition} for spec in settings.benchmarks]
    return key


def _task_yaml(path: Path) -> dict[str, Any]:
    # lm-eval's own loader: `include:` and `!function` resolve as the harness resolves them.
    from lm_eval.tasks._yaml_loader import load_yaml

    try:
        config = load_yaml(path)
    except Exception as error:  # a YAML or include error, named with its file
        raise BenchmarkError(f"validation.benchmarks: {path}: not an lm-eval task YAML: {error}") from None
    if not isinstance(config.get("task"), str):
        raise BenchmarkError(f"validation.benchmarks: {path}: no `task:` name (one task per YAML)")
    return config


def _data_files(config: dict[str, Any], path: Path) -> list[Path]:
    """`dataset_kwargs.data_files` (a path, a glob, a list of them, or a dict of splits) made absolute against the
    YAML's directory (in place), each checked to name a file: the task then loads the same files from any working
    directory. Returns the files, whose bytes are the benchmark's identity."""
    kwargs = config.get("dataset_kwargs") or {}
    files = kwargs.get("data_files")
    found: list[Path] = []

    def absolute(value: str) -> str:
        pattern = Path(value).expanduser()
        pattern = pattern if pattern.is_absolute() else path.parent.resolve() / pattern
        matches = sorted(Path(p) for p in glob.glob(str(pattern))) if glob.has_magic(str(pattern)) else [pattern]
        if not matches or not all(match.is_file() for match in matches):
            raise BenchmarkError(f"validation.benchmarks: {path}: dataset_kwargs.data_files: no such file: {pattern}")
        found.extend(matches)
        return str(pattern)

    def each(value):
        return absolute(value) if isinstance(value, str) else [absolute(v) for v in value]

    if files is not None:
        kwargs["data_files"] = {k: each(v) for k, v in files.items()} if isinstance(files, dict) else each(files)
    return sorted(set(found))


@functools.cache
def _task_manager(registry: bool):
    """lm-eval's task manager; with the registry, indexing its ~27k YAMLs takes 13 to 40 s on two cores: once a
    process, however many models and benchmarks are scored."""
    from lm_eval.tasks import TaskManager

    return TaskManager(include_defaults=registry)


def build_task(benchmark: Benchmark):
    """The lm-eval Task, built anew (a Task holds its requests and their answers)."""
    _quiet()
    try:
        tasks = _task_manager(not benchmark.spec.is_file).load(benchmark.source)["tasks"]
    except KeyError:
        raise BenchmarkError(f"validation.benchmarks: lm-eval has no task {benchmark.spec.task!r} (a task of your "
                             "own is the path to its YAML)") from None
    except Exception as error:  # its dataset could not be loaded: offline, a bad file, a missing split
        raise BenchmarkError(f"validation.benchmarks: {benchmark.spec.task}: could not load the task "
                             f"({type(error).__name__}: {error})") from None
    if benchmark.name not in tasks:
        raise BenchmarkError(f"validation.benchmarks: {benchmark.spec.task} is a group of tasks "
                             f"({', '.join(sorted(tasks))}): name one task")
    task = tasks[benchmark.name]
    if benchmark.spec.num_fewshot is not None:
        task.set_config(key="num_fewshot", value=benchmark.spec.num_fewshot)
    return task


def score_benchmark(model, tokenizer, benchmark: Benchmark, batch_size: int, precision: str) -> BenchmarkScore:
    """The benchmark's metric for `model` (a transformers or peft model, in eval mode), through lm-eval's HFLM."""
    import lm_eval
    from lm_eval.models.huggingface import HFLM

    _quiet()
    spec = benchmark.spec
    lm = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=batch_size)
    results = lm_eval.simple_evaluate(
        # The task comes built: an empty manager, else the harness indexes its whole registry (seconds) again.
        model=lm, tasks=[build_task(benchmark)], task_manager=_task_manager(False), limit=spec.limit,
        apply_chat_template=spec.apply_chat_template, log_samples=False, bootstrap_iters=_STDERR_ITERATIONS,
        random_seed=0, numpy_random_seed=0, torch_random_seed=0, fewshot_random_seed=0)
    values = results["results"][benchmark.name]
    column = _column(values, spec.metric, benchmark)
    stderr = values.get(column.replace(",", "_stderr,", 1))
    return BenchmarkScore(
        task=benchmark.name, source=spec.task, metric=spec.metric, value=float(values[column]),
        stderr=float(stderr) if isinstance(stderr, (int, float)) and math.isfinite(stderr) else None,
        samples=int(results["n-samples"][benchmark.name]["effective"]),
        higher_is_better=bool(results["higher_is_better"][benchmark.name].get(spec.metric.split(",")[0], True)),
        identity=benchmark.identity(precision))


def _column(values: dict[str, Any], metric: str, benchmark: Benchmark) -> str:
    """lm-eval's results column of `metric`: "acc,none"; a metric with several filters names one
    ("exact_match,strict-match")."""
    if "," in metric:
        columns = [metric] if metric in values else []
    else:
        columns = sorted(c for c in values if c.startswith(metric + ",") and "_stderr" not in c)
        columns = [f"{metric},none"] if f"{metric},none" in columns else columns
    if len(columns) != 1:
        known = sorted(c for c in values if "," in c and "_stderr" not in c)
        why = "names several filters" if columns else "is not one of its metrics"
        raise BenchmarkError(f"validation.benchmarks: {benchmark.spec.task}: metric {metric!r} {why} "
                             f"({', '.join(known)}); name one as metric: <metric>,<filter>")
    return columns[0]


def benchmark_work(benchmark: Benchmark, tokenizer, batch_size: int) -> EvaluationWork:
    """The benchmark's requests as the harness will run them: the loglikelihood rows its forward passes compute
    (`_scored_rows`), each rolling loglikelihood's whole text, and each generation a prefill of its context and,
    per batch, up to `max_gen_toks` greedy steps (an upper bound: a batch stops early when every row has met a
    stop sequence)."""
    task = build_task(benchmark)
    task.build_all_requests(limit=benchmark.spec.limit, rank=0, world_size=1)
    generations = [i for i in task.instances if i.request_type == "generate_until"]
    pairs = ["".join(i.args) for i in task.instances if i.request_type == "loglikelihood"]
    rolling = ["".join(i.args) for i in task.instances if i.request_type == "loglikelihood_rolling"]
    longest = max((int(i.args[1].get("max_gen_toks", 256)) for i in generations), default=0)
    contexts = _lengths(tokenizer, [i.args[0] for i in generations])
    batches = [DecodeBatch(width=max(contexts[start : start + batch_size]), steps=longest)
               for start in range(0, len(contexts), batch_size)]
    return EvaluationWork(forward_tokens=_scored_rows(tokenizer, pairs, batch_size) + sum(_lengths(tokenizer, rolling)),
                          prefill_tokens=sum(contexts), harness_runs=1) + EvaluationWork.decoding(batches)


def time_harness(model, tokenizer, benchmarks: list[Benchmark], batch_size: int, speed: ValidationSpeed,
                 deadline: float) -> float | None:
    """Seconds one benchmark's scoring costs beside its requests' passes (lm-eval's model wrapper, the task's
    build, its metrics): the first benchmark without generation scored on its first document, less that document's
    work at `speed`. On this project's CPU host the demo's general-knowledge task timed 0.20-0.25 s so; in the
    validate stage its scorings took 0.3-0.6 s beside its 83 rows' passes. None: only generation benchmarks (a
    document's greedy steps would swamp it), or it would not end by `deadline` (perf_counter time)."""
    for benchmark in benchmarks:
        first = replace(benchmark, spec=benchmark.spec.model_copy(update={"limit": 1}))
        work = benchmark_work(first, tokenizer, batch_size)
        if work.decode_steps:
            continue
        passes = work.seconds(speed.model_copy(update={"harness_seconds": 0.0}))
        if time.perf_counter() + passes + HARNESS_GUESS_SECONDS > deadline:
            return None
        began = time.perf_counter()
        score_benchmark(model, tokenizer, first, batch_size, "timing")
        return max(0.0, time.perf_counter() - began - passes)
    return None


def _scored_rows(tokenizer, pairs: list[str], batch_size: int) -> int:
    """The tokens lm-eval's loglikelihood passes compute for these (context + continuation) texts, padding
    included: a row is the text's tokens but the last, rows that are the same computed once (its logits cache:
    the choices of a multiple-choice question one token long share one), longest first, each batch padded to its
    first. The general-knowledge benchmark's 160 requests are 83 rows: priced a request each, its time was 1.5-1.7x
    what it took on this project's CPU host (2026-11-29)."""
    texts = tokenizer(pairs, add_special_tokens=False)["input_ids"] if pairs else []
    rows = sorted({tuple(ids[:-1]) for ids in texts}, key=lambda row: (-len(row), row))
    return sum(len(rows[start : start + batch_size]) * len(rows[start]) for start in range(0, len(rows), batch_size))


def _lengths(tokenizer, texts: list[str]) -> list[int]:
    """Tokens of each of `texts`, in one batched call (a fast tokenizer encodes them in parallel)."""
    return [len(ids) for ids in tokenizer(texts)["input_ids"]] if texts else []


# What HFLM warns each time it is handed a loaded model, which the gate does on purpose (two lines a scoring).
_HANDED_A_MODEL = ("`pretrained` model kwarg is not of type `str`",
                   "Passed an already-initialized model through `pretrained`")


class _HandedAModel(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(_HANDED_A_MODEL)


def _quiet() -> None:
    """The harness logs every request batch at INFO; a run shows its own progress. Its two warnings about being
    handed a loaded model are dropped, by their text, and nothing else it warns."""
    for name in ("lm-eval", "lm_eval"):
        logging.getLogger(name).setLevel(logging.WARNING)
    models = logging.getLogger("lm_eval.models.huggingface")
    if not any(isinstance(f, _HandedAModel) for f in models.filters):
        models.addFilter(_HandedAModel())
