import copy
import json
import math
import random
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoTokenizer

from helpers import date_records, make_tokenizer, resolved, write_jsonl
from helpers.benchmarks import write_date_tasks
from phase1a.config.schema import (
    DataConfig,
    GateTolerances,
    MethodConfig,
    ModelConfig,
    Phase1aConfig,
    PromotionConfig,
    ValidationConfig,
)
from phase1a.data.tokenizing import TokenizeOptions, tokenize_dataset
from phase1a.evaluate.answers import extract_answer, normalise
from phase1a.evaluate.gate import BaselineError, gate, read_baseline_file, write_baseline_file
from phase1a.evaluate.generation import generate_greedy, generation_examples, stop_token_ids
from phase1a.evaluate.metrics import evaluate, expected_calibration_error, sample_fingerprint
from phase1a.evaluate.present import format_table
from phase1a.evaluate.result import HIGHER_IS_BETTER, Baseline, Metrics
from phase1a.evaluate.scoring import Scoring, base_model_metrics
from phase1a.evaluate.validation import validate
from phase1a.model.loading import for_scoring, load_for_eval
from phase1a.promote.candidate import promote_candidate
from phase1a.store.promoted import PromotionError, read_pointer
from phase1a.train.loop import train
from phase1a.train.packing import TokenRows
from phase1a.train.settings import TrainSettings

SPECIALS = ["<|im_end|>", "</s>"]


def job(model_dir: Path, cache: Path, settings: ValidationConfig, chat_template: str | None = None,
        promote_to: str | None = None):
    """A run's config for validating (and promoting, to `promote_to`) a model of `model_dir` under `settings`, and
    its model."""
    config = Phase1aConfig(data=DataConfig(source="unused", chat_template=chat_template),
                           model=ModelConfig(name_or_path=str(model_dir)), cache_dir=cache, validation=settings,
                           promotion=PromotionConfig(to=promote_to))
    return config, resolved(config)


def validated(model_dir: Path, adapter_dir, validation_path, settings: ValidationConfig, cache: Path,
              promote_to: str | None = None):
    config, model = job(model_dir, cache, settings, promote_to=promote_to)
    return validate(config, model, Path(validation_path), Path(adapter_dir))


@pytest.mark.parametrize("extractor, pattern, text, answer", [
    ("whole", None, "  03/05/2020 <|im_end|>\n", "03/05/2020"),
    ("whole", None, "March  5,\n 2020</s><|im_end|>", "March 5, 2020"),
    ("whole", None, "<|im_end|>", ""),
    ("last_number", None, "3 apples and 1,250 pears.", "1250"),
    ("last_number", None, "The total is 42.50 dollars", "42.5"),
    ("last_number", None, "so -7.0<|im_end|>", "-7"),
    ("last_number", None, "no digits here", None),
    ("regex", r"#### (\S+)", "reasoning 5 + 7 = 12\n#### 12<|im_end|>", "12"),
    ("regex", r"#### (\S+)", "reasoning without the marker", None),
    ("regex", r"answer: (.+)$", "answer:  New   York ", "New York"),
])
def test_each_extractor(extractor, pattern, text, answer):
    assert extract_answer(text, extractor, pattern, SPECIALS) == answer


def test_normalise_drops_only_trailing_special_tokens():
    assert normalise("a <|im_end|> b\t c <|im_end|> </s>", SPECIALS) == "a <|im_end|> b c"


def test_expected_calibration_error_on_hand_computed_inputs():
    # One answer per bin: ECE is the mean of |correct - confidence| = (0.05 + 0.85 + 0.25 + 0.15) / 4.
    assert expected_calibration_error(np.array([0.95, 0.85, 0.75, 0.15]), np.array([1, 0, 1, 0]), 10) == \
        pytest.approx(0.325)
    # Two answers in the bin (0.6, 0.7]: accuracy 0.5 against mean confidence 0.65 (0.7 belongs to that bin).
    assert expected_calibration_error(np.array([0.62, 0.7]), np.array([1, 0]), 10) == pytest.approx(0.16)
    # Bins weigh by their share: 3/4 * |2/3 - 0.9| + 1/4 * |0 - 0.2|.
    assert expected_calibration_error(np.array([0.9, 0.9, 0.9, 0.2]), np.array([1, 1, 0, 0]), 10) == \
        pytest.approx(0.75 * (0.9 - 2 / 3) + 0.25 * 0.2)
    # One bin: |overall accuracy - overall mean confidence|; a confidence of 0 counts in the first bin.
    assert expected_calibration_error(np.array([0.0, 1.0]), np.array([0, 0]), 1) == pytest.approx(0.5)


def metrics(**values) -> Metrics:
    defaults = dict(examples=10, tokens=100, loss=1.0, perplexity=math.e, token_accuracy=0.8, exact_match=0.6, ece=0.1)
    return Metrics(**{**defaults, **values})


ALL_GATED = ValidationConfig(tolerances=GateTolerances(loss=0.02, perplexity=0.05, token_accuracy=0.01,
                                                      exact_match=0.01, ece=0.02))


def test_gate_passes_within_every_tolerance():
    baseline = Baseline.of("base model", metrics())
    candidate = metrics(loss=1.02, perplexity=math.e + 0.05, token_accuracy=0.79, exact_match=0.59, ece=0.12)
    checks = gate(candidate, baseline, ALL_GATED)
    assert [c.metric for c in checks] == list(HIGHER_IS_BETTER) and all(c.passed for c in checks)


@pytest.mark.parametrize("metric, worse", [("loss", 1.03), ("perplexity", math.e + 0.06), ("token_accuracy", 0.78),
                                           ("exact_match", 0.58), ("ece", 0.13)])
def test_gate_fails_on_each_metric_and_says_by_how_much(metric, worse):
    checks = gate(metrics(**{metric: worse}), Baseline.of("base model", metrics()), ALL_GATED)
    failed = [c for c in checks if not c.passed]
    assert [c.metric for c in failed] == [metric]
    tolerance = getattr(ALL_GATED.tolerances, metric)
    baseline_value = getattr(metrics(), metric)
    sign = "-" if HIGHER_IS_BETTER[metric] else "+"
    relation = "<" if HIGHER_IS_BETTER[metric] else ">"
    expected = f"{metric} {worse:.4f} {relation} baseline {baseline_value:.4f} {sign} tolerance {tolerance:g}"
    assert failed[0].describe() == expected


def test_gate_fails_a_diverged_candidate():
    checks = gate(metrics(loss=float("nan")), Baseline.of("base model", metrics()), ValidationConfig())
    assert not next(c for c in checks if c.metric == "loss").passed


def test_a_gated_metric_missing_on_either_side_is_an_error_not_a_pass():
    no_answers = metrics(exact_match=None, ece=None, unavailable={"exact_match": "no prompt to generate from"})
    with pytest.raises(BaselineError, match="exact_match: no value for the candidate \\(no prompt to generate from\\)"):
        gate(no_answers, Baseline.of("base model", metrics()), ValidationConfig())
    partial = Baseline(source="file ref.json", metrics={"loss": 1.0, "token_accuracy": 0.8})
    with pytest.raises(BaselineError, match="exact_match: the baseline \\(file ref.json\\) has no value"):
        gate(metrics(), partial, ValidationConfig())
    # Left out of the gate, a missing metric is only missing from the report.
    assert all(c.passed for c in gate(metrics(), partial, ValidationConfig(tolerances={"exact_match": None})))


def test_baseline_file_round_trip_and_clear_errors(tmp_path):
    path = write_baseline_file(tmp_path / "ref.json", metrics(), "sample-a", source="fp32 reference")
    baseline = read_baseline_file(path, "sample-a")
    assert baseline.metrics["exact_match"] == 0.6 and "fp32 reference" in baseline.source
    with pytest.raises(BaselineError, match="computed on another held-out sample"):
        read_baseline_file(path, "sample-b")
    with pytest.raises(BaselineError, match=f"no such file: {tmp_path / 'missing.json'}"):
        read_baseline_file(tmp_path / "missing.json", "sample-a")
    (tmp_path / "typo.json").write_text(json.dumps({"metrics": {"accuracy": 0.9}}))
    with pytest.raises(BaselineError, match="unknown metrics \\['accuracy'\\]"):
        read_baseline_file(tmp_path / "typo.json", "sample-a")


@pytest.fixture(scope="module")
def split(tmp_path_factory):
    root = tmp_path_factory.mktemp("validate-data")
    return tokenize_dataset(write_jsonl(root / "d.jsonl", date_records(80)), make_tokenizer(), 256,
                            TokenizeOptions(validation_fraction=0.2), root / "cache" / "fp")


def test_prompt_ends_where_the_answer_starts_and_the_reference_is_the_answer(split):
    rows = TokenRows.load(split.validation_path)
    tokenizer = make_tokenizer()
    examples = generation_examples(rows, np.arange(4))
    for example in examples:
        assert tokenizer.decode(example.prompt.tolist()).endswith("<|im_start|>assistant\n")
        answer = extract_answer(tokenizer.decode(example.reference.tolist()), "whole", None,
                                tokenizer.all_special_tokens)
        assert len(answer) == len("MM/DD/YYYY") and answer.count("/") == 2


def test_train_on_inputs_leaves_no_prompt_and_says_so(tmp_path):
    data = tokenize_dataset(write_jsonl(tmp_path / "d.jsonl", date_records(20)), make_tokenizer(), 256,
                            TokenizeOptions(validation_fraction=0.2, train_on_inputs=True), tmp_path / "cache" / "fp")
    reason = generation_examples(TokenRows.load(data.validation_path), np.arange(2))
    assert isinstance(reason, str) and "no prompt" in reason


def test_batched_left_padded_generation_matches_one_at_a_time(tiny_model_dir, split):
    model = load_for_eval(tiny_model_dir, None, torch.device("cpu"))
    tokenizer = make_tokenizer()
    rows = TokenRows.load(split.validation_path)
    # Prompts of different lengths, so the batch really is padded.
    prompts = [e.prompt[: len(e.prompt) - k] for k, e in enumerate(generation_examples(rows, np.arange(4)))]
    assert len({len(p) for p in prompts}) == 4
    stop = stop_token_ids(tokenizer, model)
    batched = generate_greedy(model, prompts, 6, stop, tokenizer.pad_token_id, batch_size=4)
    alone = [generate_greedy(model, [p], 6, stop, tokenizer.pad_token_id, batch_size=1)[0] for p in prompts]
    assert [b.tokens for b in batched] == [a.tokens for a in alone]
    for b, a in zip(batched, alone):
        np.testing.assert_allclose(b.token_probs, a.token_probs, rtol=1e-4)


def test_base_model_metrics_are_computed_once_per_model_sample_and_settings(tiny_model_dir, split, tmp_path):
    from peft import LoraConfig, get_peft_model

    model = load_for_eval(tiny_model_dir, None, torch.device("cpu"))
    model = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False)).eval()
    forwards = []
    model.get_base_model().model.embed_tokens.register_forward_hook(lambda *args: forwards.append(1))
    tokenizer = make_tokenizer()
    rows = TokenRows.load(split.validation_path)
    settings = ValidationConfig(max_examples=6, batch_size=4)
    indices = np.arange(6)

    first, cached = base_model_metrics(model, Scoring(tokenizer, rows, indices, settings, tmp_path, "model-fp"))
    assert not cached and forwards and list((tmp_path / "metrics").glob("*.json"))
    calls = len(forwards)
    again, cached = base_model_metrics(model, Scoring(tokenizer, rows, indices, settings, tmp_path, "model-fp"))
    assert cached and again == first and len(forwards) == calls  # not one forward pass

    # The adapter really was off: the same numbers as the bare base model.
    bare, _ = base_model_metrics(load_for_eval(tiny_model_dir, None, torch.device("cpu")),
                                 Scoring(tokenizer, rows, indices, settings, tmp_path / "other", "model-fp"))
    assert bare.loss == pytest.approx(first.loss, rel=1e-5) and bare.exact_match == first.exact_match

    # Another sample or other scoring is another entry.
    base_model_metrics(model, Scoring(tokenizer, rows, np.arange(5), settings, tmp_path, "model-fp"))
    rescored = settings.model_copy(update={"ece_bins": 5})
    base_model_metrics(model, Scoring(tokenizer, rows, indices, rescored, tmp_path, "model-fp"))
    assert len(list((tmp_path / "metrics").glob("*.json"))) == 3
    assert sample_fingerprint(rows, indices) != sample_fingerprint(rows, np.arange(5))


def test_scoring_with_the_adapter_merged_gives_the_metrics_of_the_separate_adapter(tiny_model_dir, split):
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(1)
    model = get_peft_model(load_for_eval(tiny_model_dir, None, torch.device("cpu")),
                           LoraConfig(r=4, target_modules=["q_proj", "v_proj", "down_proj"], init_lora_weights=False))
    rows, indices, settings = TokenRows.load(split.validation_path), np.arange(8), ValidationConfig()
    separate = evaluate(model.eval(), make_tokenizer(), rows, indices, settings)
    merged_model = for_scoring(model)
    assert not any("lora" in name for name, _ in merged_model.named_parameters())
    merged = evaluate(merged_model, make_tokenizer(), rows, indices, settings)
    assert merged.loss == pytest.approx(separate.loss, rel=1e-5)
    assert (merged.token_accuracy, merged.exact_match) == (separate.token_accuracy, separate.exact_match)
    assert [a.prediction for a in merged.answers] == [a.prediction for a in separate.answers]
    assert merged.ece == pytest.approx(separate.ece, abs=1e-5)


def test_scoring_with_trainings_attention_gives_the_metrics_of_sdpas(tiny_model_dir, split):
    """The validate stage loads its models with training's attention (varlen: a packed batch in one call a layer,
    each example attending to itself), the speed-up over SDPA's dense mask; the metrics are SDPA's."""
    from phase1a.model.attention import NAME as VARLEN

    rows, indices, settings = TokenRows.load(split.validation_path), np.arange(8), ValidationConfig(batch_size=4)
    scored = {attention: evaluate(load_for_eval(tiny_model_dir, None, torch.device("cpu"), attention=attention),
                                  make_tokenizer(), rows, indices, settings) for attention in ("sdpa", VARLEN)}
    dense, packed = scored["sdpa"], scored[VARLEN]
    assert packed.loss == pytest.approx(dense.loss, rel=1e-5) and packed.tokens == dense.tokens > 0
    assert (packed.token_accuracy, packed.exact_match) == (dense.token_accuracy, dense.exact_match)
    assert [a.prediction for a in packed.answers] == [a.prediction for a in dense.answers]


def test_trained_adapter_beats_the_base_on_held_out_data(tiny_model_dir, split, tmp_path):
    result = train(TrainSettings(
        model_dir=str(tiny_model_dir), train_path=split.train_path, output_dir=str(tmp_path / "run"),
        method=MethodConfig(learning_rate=1e-2, batch_size=8, epochs=3, lora={"r": 8, "alpha": 16}),
        micro_batch_size=8, gradient_checkpointing=False, show_progress=False,
    ))
    settings = ValidationConfig(max_examples=8)
    verdict = validated(tiny_model_dir, result.adapter_dir, split.validation_path, settings, tmp_path / "cache")
    assert verdict.base.examples == verdict.candidate.examples == 8 and not verdict.base_cached
    assert verdict.candidate.loss < verdict.base.loss and verdict.passed
    assert verdict.candidate.exact_match is not None and verdict.candidate.ece is not None
    assert [c.metric for c in verdict.checks] == ["loss", "token_accuracy", "exact_match"]
    table = format_table(verdict)
    assert "exact_match" in table and "gate: PASS" in table

    again = validated(tiny_model_dir, result.adapter_dir, split.validation_path, settings, tmp_path / "cache")
    assert again.base_cached and again.base == verdict.base and again.candidate == verdict.candidate


def test_a_missing_baseline_is_a_clear_error_before_any_model_loads(tiny_model_dir, split, tmp_path):
    missing_file = ValidationConfig(baseline="file", baseline_file=tmp_path / "reference.json")
    with pytest.raises(BaselineError, match=f"no such file: {tmp_path / 'reference.json'}"):
        validated(tiny_model_dir, tmp_path / "no-adapter", split.validation_path, missing_file, tmp_path / "cache")
    nothing_promoted = ValidationConfig(baseline="promoted")
    with pytest.raises(BaselineError, match=f"nothing is promoted at {tmp_path / 'promoted'}"):
        validated(tiny_model_dir, tmp_path / "no-adapter", split.validation_path, nothing_promoted, tmp_path / "cache",
                  promote_to=str(tmp_path / "promoted"))


def with_shuffled_answers(records: list[dict], seed: int) -> list[dict]:
    """The same prompts with the answers permuted across examples: every label is a real date, and wrong."""
    answers = [r["messages"][-1]["content"] for r in records]
    random.Random(seed).shuffle(answers)
    shuffled = copy.deepcopy(records)
    for record, answer in zip(shuffled, answers):
        record["messages"][-1]["content"] = answer
    return shuffled


@pytest.mark.slow
def test_a_model_trained_on_shuffled_labels_is_refused_and_the_good_one_stays_promoted(tiny_model_dir, tmp_path):
    records = date_records(160, seed=3)
    options = TokenizeOptions(validation_fraction=0.1)
    good = tokenize_dataset(write_jsonl(tmp_path / "good.jsonl", records), make_tokenizer(), 256, options,
                            tmp_path / "tok" / "good")
    bad = tokenize_dataset(write_jsonl(tmp_path / "bad.jsonl", with_shuffled_answers(records, seed=0)),
                           make_tokenizer(), 256, options, tmp_path / "tok" / "bad")
    # All weights train: the tiny random-init model learns to copy date digits only with full fine-tuning.
    method = MethodConfig(kind="full", learning_rate=3e-3, batch_size=8, epochs=12)
    runs = {name: train(TrainSettings(model_dir=str(tiny_model_dir), train_path=data.train_path, method=method,
                                      output_dir=str(tmp_path / name), micro_batch_size=8,
                                      gradient_checkpointing=False, show_progress=False))
            for name, data in (("good", good), ("shuffled", bad))}
    # Benchmarks too (lm-eval task YAMLs over local JSONL): the right US date among four, and written out.
    tasks = write_date_tasks(tmp_path / "tasks", date_records(24, seed=11))
    benchmarks = [{"task": str(tasks["dates_choice"]), "metric": "acc", "limit": 16, "tolerance": 0.0},
                  {"task": str(tasks["dates_written"]), "metric": "exact_match", "limit": 16, "tolerance": 0.0}]
    settings = ValidationConfig(max_examples=16, benchmarks=benchmarks)
    cache, promoted_to = tmp_path / "cache", str(tmp_path / "promoted")

    last_night = validated(tiny_model_dir, runs["good"].adapter_dir, good.validation_path, settings, cache)
    assert last_night.passed
    # Trained on data rendered with an overriding template (data.chat_template): the promoted model carries it.
    template = tmp_path / "template.jinja"
    template.write_text("{% for m in messages %}<|im_start|>{{ m['role'] }}: {{ m['content'] }}<|im_end|>{% endfor %}")
    config, model = job(tiny_model_dir, cache, settings, chat_template=str(template), promote_to=promoted_to)
    promoted = promote_candidate(config, model, last_night, runs["good"], tmp_path / "good")
    stored = Path(promoted.pointer.artifacts["adapter"])
    assert AutoTokenizer.from_pretrained(stored).chat_template == template.read_text()
    assert not (tmp_path / "good" / "promote.tmp").exists()

    # Tonight's run trained on shuffled labels, held out on the same (correct) validation examples.
    nightly = settings.model_copy(update={"baseline": "promoted"})
    tonight = validated(tiny_model_dir, runs["shuffled"].adapter_dir, good.validation_path, nightly, cache,
                        promote_to=promoted_to)
    assert tonight.baseline.source == "promoted good" and tonight.base_cached
    assert not tonight.passed
    failed = {check.metric for check in tonight.checks if not check.passed}
    assert {"loss", "token_accuracy", "dates_choice/acc"} <= failed, format_table(tonight)
    assert any(reason.startswith("dates_choice/acc ") for reason in tonight.reasons)
    assert "dates_choice/acc" in format_table(tonight).split("FAIL: ")[1]
    # Against the untrained base it would have looked like progress: the promoted baseline is what catches it.
    assert tonight.candidate.loss < tonight.base.loss
    with pytest.raises(PromotionError, match="failed the gate: loss"):
        promote_candidate(*job(tiny_model_dir, cache, nightly, promote_to=promoted_to), tonight, runs["shuffled"],
                          tmp_path / "shuffled")
    assert read_pointer(promoted_to).version == "good"
