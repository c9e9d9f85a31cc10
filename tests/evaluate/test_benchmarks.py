"""Benchmarks through lm-evaluation-harness in the validate stage: custom task YAMLs over local JSONL, offline,
scored on the base and the candidate, cached for the base, gated, and counted in the plan's work."""
import logging
from pathlib import Path

import pytest

from helpers import date_records, make_tokenizer, resolved, write_jsonl
from helpers.benchmarks import write_date_tasks
from phase1a.config.schema import (
    BenchmarkConfig,
    DataConfig,
    ModelConfig,
    Phase1aConfig,
    PromotionConfig,
    ValidationConfig,
)
from phase1a.data.tokenizing import TokenizeOptions, tokenize_dataset
from phase1a.evaluate.benchmarks import BenchmarkError, benchmark_work, load_benchmark
from phase1a.evaluate.gate import BaselineError, gate
from phase1a.evaluate.present import format_table
from phase1a.evaluate.result import Baseline, BenchmarkScore, EvaluationWork, Metrics, ValidationSpeed
from phase1a.evaluate.validation import validate
from phase1a.train.loop import train
from phase1a.train.settings import TrainSettings


@pytest.fixture(scope="module")
def split(tmp_path_factory):
    root = tmp_path_factory.mktemp("benchmark-data")
    return tokenize_dataset(write_jsonl(root / "d.jsonl", date_records(80)), make_tokenizer(), 256,
                            TokenizeOptions(validation_fraction=0.2), root / "cache" / "fp")


@pytest.fixture(scope="module")
def date_tasks(tmp_path_factory) -> dict[str, Path]:
    return write_date_tasks(tmp_path_factory.mktemp("tasks"), date_records(24, seed=7))


def specs(tasks: dict[str, Path], limit: int = 12, tolerance: float | None = 0.0) -> list[BenchmarkConfig]:
    return [BenchmarkConfig(task=str(tasks["dates_choice"]), metric="acc", limit=limit, tolerance=tolerance),
            BenchmarkConfig(task=str(tasks["dates_written"]), metric="exact_match", limit=limit, tolerance=tolerance)]


def validated(model_dir: Path, adapter_dir, validation_path, settings: ValidationConfig, cache: Path):
    config = Phase1aConfig(data=DataConfig(source="unused"), model=ModelConfig(name_or_path=str(model_dir)),
                           cache_dir=cache, validation=settings)
    return validate(config, resolved(config), Path(validation_path), Path(adapter_dir))


def test_custom_tasks_are_scored_on_base_and_candidate_offline_and_the_base_is_cached(
        tiny_model_dir, split, date_tasks, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.chdir(tmp_path)  # the YAMLs' relative data_files resolve against the YAMLs, not here
    adapter = train(TrainSettings(
        model_dir=str(tiny_model_dir), train_path=split.train_path, output_dir=str(tmp_path / "run"),
        method={"learning_rate": 1e-2, "batch_size": 8, "epochs": 1, "lora": {"r": 4, "alpha": 8}},
        micro_batch_size=8, gradient_checkpointing=False, show_progress=False)).adapter_dir
    settings = ValidationConfig(max_examples=8, tolerances={"loss": None, "token_accuracy": None, "exact_match": None},
                                benchmarks=specs(date_tasks, tolerance=None))
    verdict = validated(tiny_model_dir, adapter, split.validation_path, settings, tmp_path / "cache")

    keys = ["dates_choice/acc", "dates_written/exact_match"]
    for metrics in (verdict.base, verdict.candidate):
        assert list(metrics.benchmarks) == keys
        assert all(score.samples == 12 and 0.0 <= score.value <= 1.0 for score in metrics.benchmarks.values())
    assert [verdict.baseline.metrics[key] for key in keys] == [verdict.base.value(key) for key in keys]
    table = format_table(verdict)
    assert all(key in table for key in keys) and "gate: PASS" in table
    cached = sorted((tmp_path / "cache" / "benchmarks").glob("*.json"))
    assert len(cached) == 2  # the base's two scores; the candidate's are the verdict's

    again = validated(tiny_model_dir, adapter, split.validation_path, settings, tmp_path / "cache")
    assert again.base.benchmarks == verdict.base.benchmarks
    assert again.candidate.benchmarks == verdict.candidate.benchmarks
    assert sorted((tmp_path / "cache" / "benchmarks").glob("*.json")) == cached


def test_a_changed_data_file_or_limit_is_another_benchmark(date_tasks, tmp_path):
    spec = specs(date_tasks)[0]
    first = load_benchmark(spec)
    assert first.name == "dates_choice" and first.key == "dates_choice/acc"
    copy = tmp_path / "copy"
    changed = write_date_tasks(copy, date_records(24, seed=8))
    assert load_benchmark(spec.model_copy(update={"task": str(changed["dates_choice"])})).definition != first.definition
    assert first.identity("cpu/float32") != load_benchmark(spec.model_copy(update={"limit": 5})).identity("cpu/float32")


def test_data_files_may_be_a_glob_relative_to_the_yaml(date_tasks, tmp_path):
    globbed = tmp_path / "globbed.yaml"
    globbed.write_text(Path(date_tasks["dates_choice"]).read_text().replace("dates.jsonl", "dat*.jsonl"))
    (tmp_path / "dates.jsonl").write_text((Path(date_tasks["dates_choice"]).parent / "dates.jsonl").read_text())
    benchmark = load_benchmark(BenchmarkConfig(task=str(globbed), metric="acc"))
    assert benchmark.source["dataset_kwargs"]["data_files"] == {"test": str(tmp_path.resolve() / "dat*.jsonl")}
    (tmp_path / "dates.jsonl").write_text("")
    assert load_benchmark(BenchmarkConfig(task=str(globbed), metric="acc")).definition != benchmark.definition


def test_plan_work_counts_each_request(date_tasks):
    tokenizer = make_tokenizer()
    choice, written = (load_benchmark(spec) for spec in specs(date_tasks, limit=6))
    choice_work = benchmark_work(choice, tokenizer, batch_size=4)
    assert choice_work.forward_tokens > 0 and choice_work.decode_steps == 0
    written_work = benchmark_work(written, tokenizer, batch_size=4)
    assert written_work.forward_tokens == 0 and written_work.prefill_tokens > 0
    assert written_work.decode_steps == 2 * 12  # two batches of up to max_gen_toks greedy steps


@pytest.mark.parametrize("choices", ["answers", "letters"])
def test_the_plan_counts_the_tokens_lm_eval_computes(tiny_model_dir, date_tasks, choices):
    """Against the harness itself: the tokens its forward passes take, padding included; choices whose texts
    differ in their last token only (letters) share one row."""
    import torch
    import yaml
    from transformers import AutoModelForCausalLM

    from phase1a.evaluate.benchmarks import score_benchmark

    task = date_tasks["dates_choice"]
    if choices == "letters":
        letters = {**yaml.safe_load(task.read_text()), "task": "dates_letter", "doc_to_choice": ["A", "B", "C", "D"],
                   "target_delimiter": " "}
        task = task.with_name("dates_letter.yaml")
        task.write_text(yaml.safe_dump(letters, sort_keys=False))
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    computed = []

    def count(module, args, kwargs):
        computed.append((kwargs.get("input_ids") if kwargs.get("input_ids") is not None else args[0]).numel())

    model.register_forward_pre_hook(count, with_kwargs=True)
    benchmark = load_benchmark(BenchmarkConfig(task=str(task), metric="acc", limit=10))
    with torch.no_grad():
        score_benchmark(model, make_tokenizer(), benchmark, 4, "cpu/float32")
    requests = make_tokenizer()(["".join(i.args) for i in _instances(benchmark)], add_special_tokens=False)
    each = sum(len(ids) - 1 for ids in requests["input_ids"])  # a forward pass a request, unpadded
    assert benchmark_work(benchmark, make_tokenizer(), batch_size=4).forward_tokens == sum(computed)
    assert sum(computed) < each / 3 if choices == "letters" else sum(computed) >= each


def test_the_harness_is_timed_beside_its_passes_on_a_loglikelihood_benchmark(tiny_model_dir, date_tasks):
    """lm-eval's own seconds (its wrapper, the task's build, metrics), timed on the first choice benchmark's first
    document; a generation-only list, or a deadline it would pass, is not timed; the plan prices one a scoring."""
    import time

    import torch
    from transformers import AutoModelForCausalLM

    from phase1a.evaluate.benchmarks import time_harness

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    choice, written = (load_benchmark(spec) for spec in specs(date_tasks))
    speed = ValidationSpeed(forward_seconds_per_token=1e-5, decode_seconds_per_step=1e-3)
    scored = []
    hook = model.register_forward_pre_hook(lambda module, args: scored.append(1))
    with torch.no_grad():
        harness = time_harness(model, make_tokenizer(), [written, choice], 4, speed, time.perf_counter() + 600)
        assert harness is not None and harness > 0 and len(scored) == 1  # one document's rows: one batch
        assert time_harness(model, make_tokenizer(), [written], 4, speed, time.perf_counter() + 600) is None
        assert time_harness(model, make_tokenizer(), [choice], 4, speed, time.perf_counter()) is None
    hook.remove()
    work = benchmark_work(choice, make_tokenizer(), 4)
    priced = speed.model_copy(update={"harness_seconds": 0.5})
    assert work.harness_runs == 1 and work.seconds(priced) == pytest.approx(work.seconds(speed) + 0.5)


def _instances(benchmark):
    from phase1a.evaluate.benchmarks import build_task

    task = build_task(benchmark)
    task.build_all_requests(limit=benchmark.spec.limit, rank=0, world_size=1)
    return task.instances


def test_a_bad_benchmark_is_named(tmp_path, date_tasks):
    with pytest.raises(BenchmarkError, match=f"no such task YAML: {tmp_path / 'nope.yaml'}"):
        load_benchmark(BenchmarkConfig(task=str(tmp_path / "nope.yaml"), metric="acc"))
    broken = tmp_path / "broken.yaml"
    broken.write_text(Path(date_tasks["dates_choice"]).read_text().replace("dates.jsonl", "missing.jsonl"))
    with pytest.raises(BenchmarkError, match=f"{broken}: dataset_kwargs.data_files: no such file: "
                                             f"{tmp_path / 'missing.jsonl'}"):
        load_benchmark(BenchmarkConfig(task=str(broken), metric="acc"))


def score(value: float, higher: bool = True) -> BenchmarkScore:
    return BenchmarkScore(task="dates_choice", source="/t/dates_choice.yaml", metric="acc", value=value, samples=10,
                          higher_is_better=higher, identity="x")


def metrics(value: float) -> Metrics:
    return Metrics(examples=10, tokens=100, loss=1.0, perplexity=2.7, token_accuracy=0.8,
                   benchmarks={"dates_choice/acc": score(value)})


def test_the_gate_holds_each_benchmark_to_its_tolerance():
    settings = ValidationConfig(tolerances={"loss": None, "token_accuracy": None, "exact_match": None},
                                benchmarks=[{"task": "/t/dates_choice.yaml", "metric": "acc", "tolerance": 0.05}])
    baseline = Baseline.of("base model", metrics(0.60))
    assert all(check.passed for check in gate(metrics(0.56), baseline, settings))
    failed = [check for check in gate(metrics(0.54), baseline, settings) if not check.passed]
    assert [check.describe() for check in failed] == ["dates_choice/acc 0.5400 < baseline 0.6000 - tolerance 0.05"]
    with pytest.raises(BaselineError, match=r"dates_choice/acc: the baseline \(file x\) has no value for it .*"
                                            r"validation.benchmarks\[0\].tolerance: null"):
        gate(metrics(0.6), Baseline(source="file x", metrics={"loss": 1.0}), settings)


def test_the_plan_prices_the_benchmarks_for_each_model_scored(tiny_model_dir, split, date_tasks, tmp_path):
    from phase1a.plan.planner import _Planner

    def work(benchmarks, baseline="base"):
        config = Phase1aConfig(data=DataConfig(source="unused"), model=ModelConfig(name_or_path=str(tiny_model_dir)),
                               cache_dir=tmp_path / "cache", validation=ValidationConfig(
                                   max_examples=8, benchmarks=benchmarks, baseline=baseline),
                               promotion=PromotionConfig(to=str(tmp_path / "promoted")))
        planner = _Planner(config, resolved(config), split)
        return planner._scored_work() + planner._base_work()

    one = sum((benchmark_work(load_benchmark(spec), make_tokenizer(), 16) for spec in specs(date_tasks)),
              EvaluationWork())
    assert work(specs(date_tasks)) == work([]) + one * 2  # the candidate and the base
    assert work(specs(date_tasks), "promoted") == work([], "promoted") + one * 3  # and the promoted model


def test_a_metric_the_task_does_not_report_is_named_with_the_ones_it_does(tiny_model_dir, date_tasks, caplog):
    from transformers import AutoModelForCausalLM

    from phase1a.evaluate.benchmarks import score_benchmark

    caplog.set_level("WARNING")
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    spec = BenchmarkConfig(task=str(date_tasks["dates_choice"]), metric="f1", limit=2)
    with pytest.raises(BenchmarkError, match=r"metric 'f1' is not one of its metrics \(acc,none\)"):
        score_benchmark(model, make_tokenizer(), load_benchmark(spec), 4, "cpu/float32")
    # lm-eval's warnings about being handed a loaded model are dropped; its other warnings are not.
    assert not [r for r in caplog.records if "`pretrained`" in r.getMessage()]
    logging.getLogger("lm_eval.models.huggingface").warning("another warning")
    assert [r.getMessage() for r in caplog.records if r.name == "lm_eval.models.huggingface"] == ["another warning"]
