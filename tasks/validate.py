"""Validate: the trained model against a baseline on a bounded held-out sample, a gate, and promotion of a pass.

The sample is the first `validation.max_examples` examples of the validation split. Every model is scored on
it the same way (phase1a/evaluation.py): eval loss, perplexity, token accuracy on response tokens, and
greedy-generated answers scored by exact match, with their expected calibration error.

The baseline (`validation.baseline`) is the base model (the same weights with the adapter switched off; its
metrics are cached on disk by model, sample and scoring, so they are computed once), a metrics file (e.g.
from a full-precision reference run), or the model the `promoted` pointer names. The gate (phase1a/gate.py)
compares each metric that has a tolerance; only a pass is promoted (phase1a/promotion.py).
"""
from __future__ import annotations

import shutil
from contextlib import nullcontext
from pathlib import Path
from typing import Callable

import numpy as np
import torch
from pydantic import BaseModel

from phase1a.config import ValidationConfig
from phase1a.evaluation import HIGHER_IS_BETTER, Metrics, evaluate, metric_settings_key, sample_fingerprint
from phase1a.fingerprint import code_version, hash_json, sha256_file, sha256_tree
from phase1a.gate import Baseline, BaselineError, GateCheck, gate, read_baseline_file, write_baseline_file
from phase1a.hardware import training_device, training_dtype
from phase1a.locks import write_atomically
from phase1a.models import load_model, load_tokenizer
from phase1a.models import model_fingerprint as fingerprint_model
from phase1a.packing import TokenRows
from phase1a.promotion import PromotedPointer, PromotionError, PromotionOutcome, PromotionRecord, promote, read_pointer
from phase1a.s3 import is_s3_url
from tasks.caching import FingerprintCache, task

_ADAPTER_FILES = ("*.safetensors", "*.json")


class ValidationResult(BaseModel):
    base: Metrics
    candidate: Metrics
    baseline: Baseline
    checks: list[GateCheck]
    passed: bool
    reasons: list[str]
    sample_fingerprint: str
    metric_settings: str
    model_fingerprint: str
    adapter_sha256: str
    base_cached: bool
    promoted_seen: str | None = None  # the pointer's version the gate compared against (baseline: promoted)


def is_adapter(weights_dir: Path) -> bool:
    return (Path(weights_dir) / "adapter_config.json").is_file()


def load_for_eval(model_dir: Path, weights_dir: Path | None, device: torch.device, trust_remote_code: bool = False):
    """The base model (weights_dir None), the base with a peft adapter, or a full fine-tune's own weights."""
    dtype = training_dtype(device)
    if weights_dir is not None and not is_adapter(weights_dir):
        return load_model(Path(weights_dir), dtype, trust_remote_code).to(device).eval()
    model = load_model(Path(model_dir), dtype, trust_remote_code).to(device).eval()
    if weights_dir is None:
        return model
    from peft import PeftModel

    return PeftModel.from_pretrained(model, weights_dir).eval()


def for_scoring(model):
    """A peft model with fp32 weights gets its adapter folded into them (in place): exact to rounding, and on
    CPU several times faster to score, since peft's separate low-rank path per layer goes away. 16-bit weights
    keep the adapter separate: merging would round W + BA to 16 bits and score a slightly different model."""
    from peft import PeftModel

    if isinstance(model, PeftModel) and next(model.parameters()).dtype == torch.float32:
        return model.merge_and_unload()
    return model


def metrics_cache_path(cache_dir: Path, model_fp: str, weights: str, sample_fp: str, settings_key: str) -> Path:
    """Where one model's metrics on one sample under one scoring are kept; `weights` is "base" or an adapter hash."""
    key = hash_json({"model": model_fp, "weights": weights, "sample": sample_fp, "settings": settings_key})
    return Path(cache_dir) / "metrics" / f"{key[:32]}.json"


def cached_evaluate(path: Path, compute: Callable[[], Metrics]) -> tuple[Metrics, bool]:
    """The metrics stored at `path`, or computed and stored there (tmp + rename). Returns (metrics, from_cache)."""
    if path.is_file():
        try:
            return Metrics.model_validate_json(path.read_text()), True
        except ValueError:  # a damaged record: compute again and overwrite it
            pass
    metrics = compute()
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomically(path, metrics.model_dump_json(indent=2) + "\n")
    return metrics, False


def base_model_metrics(model, tokenizer, rows: TokenRows, indices: np.ndarray, settings: ValidationConfig,
                       cache_dir: Path, model_fp: str) -> tuple[Metrics, bool]:
    """The base model's metrics, computed with a peft model's adapter switched off (or on a plain base model),
    once per model fingerprint, sample fingerprint and metric settings."""
    from peft import PeftModel

    parameter = next(model.parameters())
    path = metrics_cache_path(cache_dir, model_fp, "base", sample_fingerprint(rows, indices),
                              metric_settings_key(settings, parameter.device, parameter.dtype))

    def compute() -> Metrics:
        with model.disable_adapter() if isinstance(model, PeftModel) else nullcontext():
            return evaluate(model, tokenizer, rows, indices, settings)

    return cached_evaluate(path, compute)


def _promoted_pointer(settings: ValidationConfig, endpoint_url: str | None) -> PromotedPointer:
    pointer = read_pointer(settings.promote_to, endpoint_url)
    if pointer is None:
        raise BaselineError(f"validation.baseline promoted: nothing is promoted at {settings.promote_to} (no "
                            "promoted.json); promote a model first (e.g. a run with baseline: base) or choose "
                            "baseline: base or file")
    return pointer


def _fetch_promoted(pointer: PromotedPointer, staging_dir: Path | None, endpoint_url: str | None) -> Path:
    location = pointer.artifacts.get("adapter", "")
    if is_s3_url(location):
        from tasks.stage import stage_model

        return stage_model(location, Path(staging_dir or "/tmp/phase1a/staging") / "promoted", endpoint_url)
    if not Path(location).is_dir():
        raise BaselineError(f"promoted version {pointer.version}: its adapter {location!r} is missing")
    return Path(location)


def promoted_baseline(pointer: PromotedPointer, model_dir: Path, tokenizer, rows: TokenRows, indices: np.ndarray,
                      settings: ValidationConfig, cache_dir: Path, model_fp: str, device: torch.device,
                      staging_dir: Path | None = None, endpoint_url: str | None = None,
                      trust_remote_code: bool = False) -> Baseline:
    """The promoted model's metrics: from its pointer when they were computed on this sample with this
    scoring, else by scoring its weights here (cached like the base model's)."""
    sample_fp = sample_fingerprint(rows, indices)
    settings_key = metric_settings_key(settings, device, training_dtype(device))
    source = f"promoted {pointer.version}"
    if pointer.sample_fingerprint == sample_fp and pointer.metric_settings == settings_key:
        return Baseline.of(source, Metrics.model_validate(pointer.metrics), sample_fp)
    if pointer.base_model_fingerprint != model_fp:
        raise BaselineError(f"{source} was trained from another base model ({pointer.base_model_fingerprint[:12]}, "
                            f"this run's is {model_fp[:12]}) and scored on another sample; nothing to compare")
    weights = _fetch_promoted(pointer, staging_dir, endpoint_url)
    path = metrics_cache_path(cache_dir, model_fp, pointer.adapter_sha256, sample_fp, settings_key)
    metrics, _ = cached_evaluate(path, lambda: evaluate(for_scoring(load_for_eval(model_dir, weights, device,
                                                                                 trust_remote_code)),
                                                        tokenizer, rows, indices, settings))
    return Baseline.of(f"{source} (scored on this sample)", metrics, sample_fp)


def validate(model_dir: Path, adapter_dir: Path, validation_path: Path, settings: ValidationConfig, cache_dir: Path,
             model_fingerprint: str | None = None, staging_dir: Path | None = None, endpoint_url: str | None = None,
             trust_remote_code: bool = False) -> ValidationResult:
    device = training_device()
    rows = TokenRows.from_arrow(validation_path)
    indices = np.arange(min(len(rows), settings.max_examples))
    sample_fp = sample_fingerprint(rows, indices)
    model_fp = model_fingerprint or fingerprint_model(Path(model_dir))
    # The baseline is read before any model loads: a missing file or pointer fails in seconds.
    file_baseline = read_baseline_file(settings.baseline_file, sample_fp) if settings.baseline == "file" else None
    pointer = _promoted_pointer(settings, endpoint_url) if settings.baseline == "promoted" else None

    tokenizer = load_tokenizer(Path(model_dir), trust_remote_code)
    if is_adapter(adapter_dir):
        model = load_for_eval(model_dir, adapter_dir, device, trust_remote_code)
        base, base_cached = base_model_metrics(model, tokenizer, rows, indices, settings, cache_dir, model_fp)
    else:  # a full fine-tune: the base is another set of weights
        base_model = load_for_eval(model_dir, None, device, trust_remote_code)
        base, base_cached = base_model_metrics(base_model, tokenizer, rows, indices, settings, cache_dir, model_fp)
        del base_model
        model = load_for_eval(model_dir, adapter_dir, device, trust_remote_code)
    candidate = evaluate(for_scoring(model), tokenizer, rows, indices, settings)
    del model

    if file_baseline is not None:
        baseline = file_baseline
    elif pointer is not None:
        baseline = promoted_baseline(pointer, Path(model_dir), tokenizer, rows, indices, settings, cache_dir, model_fp,
                                     device, staging_dir, endpoint_url, trust_remote_code)
    else:
        baseline = Baseline.of("base model" + (" (cached)" if base_cached else ""), base, sample_fp)
    checks = gate(candidate, baseline, settings.tolerances)
    reasons = [check.describe() for check in checks if not check.passed]
    return ValidationResult(
        base=base, candidate=candidate, baseline=baseline, checks=checks, passed=not reasons, reasons=reasons,
        sample_fingerprint=sample_fp, metric_settings=metric_settings_key(settings, device, training_dtype(device)),
        model_fingerprint=model_fp, adapter_sha256=sha256_tree(Path(adapter_dir), _ADAPTER_FILES), base_cached=base_cached,
        promoted_seen=pointer.version if pointer else None,
    )


def merge_adapter(model_dir: Path, adapter_dir: Path, target: Path, trust_remote_code: bool = False,
                  chat_template: str | None = None) -> Path:
    """The base with the adapter folded into its weights (in fp32, saved in the base's dtype), plus its tokenizer
    with the chat template the data was rendered with (`data.chat_template`): a model that loads without peft."""
    from peft import PeftModel
    from transformers import AutoConfig

    saved_dtype = getattr(AutoConfig.from_pretrained(model_dir, trust_remote_code=trust_remote_code), "dtype", None)
    model = PeftModel.from_pretrained(load_model(Path(model_dir), torch.float32, trust_remote_code), adapter_dir)
    merged = model.merge_and_unload()
    if isinstance(saved_dtype, torch.dtype):
        merged = merged.to(saved_dtype)
    shutil.rmtree(target, ignore_errors=True)
    merged.save_pretrained(target)
    _trained_tokenizer(model_dir, chat_template, trust_remote_code).save_pretrained(target)
    return target


def _trained_tokenizer(model_dir: Path, chat_template: str | None, trust_remote_code: bool):
    from phase1a.templates import apply_chat_template_setting

    return apply_chat_template_setting(load_tokenizer(Path(model_dir), trust_remote_code), chat_template)


def _adapter_with_template(adapter_dir: Path, model_dir: Path, chat_template: str, target: Path,
                           trust_remote_code: bool) -> Path:
    """A copy of the adapter with the tokenizer it was trained with: the overriding template must reach
    whoever serves it, or prompts would be rendered in the base tokenizer's format."""
    shutil.rmtree(target, ignore_errors=True)
    shutil.copytree(adapter_dir, target)
    _trained_tokenizer(model_dir, chat_template, trust_remote_code).save_pretrained(target)
    return target


def promote_candidate(verdict: ValidationResult, adapter_dir: Path, model_dir: Path, settings: ValidationConfig,
                      version: str, run: str, work_dir: Path, endpoint_url: str | None = None,
                      trust_remote_code: bool = False, chat_template: str | None = None) -> PromotionOutcome:
    if not verdict.passed:  # the flow never calls this on a fail; a direct caller must not either
        raise PromotionError("refusing to promote a model that failed the gate: " + "; ".join(verdict.reasons))
    if not settings.promote_to:
        raise PromotionError("validation.promote_to is not set: nowhere to promote to")
    artifacts = {"adapter": Path(adapter_dir)}
    merged_dir, templated_dir = Path(work_dir) / "merged.tmp", Path(work_dir) / "adapter.tmp"
    if chat_template is not None:
        artifacts["adapter"] = _adapter_with_template(Path(adapter_dir), Path(model_dir), chat_template, templated_dir,
                                                      trust_remote_code)
    if settings.promote_merged and is_adapter(adapter_dir):
        artifacts["merged"] = merge_adapter(Path(model_dir), Path(adapter_dir), merged_dir, trust_remote_code,
                                            chat_template)
    record = PromotionRecord(run=run, adapter_sha256=verdict.adapter_sha256,
                             base_model_fingerprint=verdict.model_fingerprint,
                             sample_fingerprint=verdict.sample_fingerprint, metric_settings=verdict.metric_settings,
                             metrics=verdict.candidate.model_dump(mode="json"))
    # Against a promoted baseline the pointer must still be the one the gate saw; else whatever it is now.
    expected = verdict.promoted_seen if settings.baseline == "promoted" else ...
    try:
        return promote(artifacts, settings.promote_to, version, record, endpoint_url=endpoint_url,
                       expected_version=expected)
    finally:
        for scratch in (merged_dir, templated_dir):  # copies: promoted, or not wanted
            shutil.rmtree(scratch, ignore_errors=True)


def format_table(verdict: ValidationResult) -> str:
    tolerances = {check.metric: check for check in verdict.checks}
    rows = [("metric", "base", "baseline", "candidate", "delta", "gate")]
    for name in HIGHER_IS_BETTER:
        base, baseline, candidate = verdict.base.value(name), verdict.baseline.metrics.get(name), verdict.candidate.value(name)
        if base is None and baseline is None and candidate is None:
            continue
        cell = lambda value: "-" if value is None else f"{value:.4f}"  # noqa: E731
        delta = "-" if candidate is None or baseline is None else f"{candidate - baseline:+.4f}"
        check = tolerances.get(name)
        status = "-" if check is None else ("pass" if check.passed else "FAIL") + \
            f" ({'>=' if check.higher_is_better else '<='} baseline {'-' if check.higher_is_better else '+'} {check.tolerance:g})"
        rows.append((name, cell(base), cell(baseline), cell(candidate), delta, status))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip() for row in rows]
    verdict_text = "PASS" if verdict.passed else "FAIL: " + "; ".join(verdict.reasons)
    return "\n".join(lines + [f"baseline: {verdict.baseline.source}; examples: {verdict.candidate.examples}, "
                              f"tokens: {verdict.candidate.tokens}; gate: {verdict_text}"])


def validation_section(verdict: ValidationResult, promotion: PromotionOutcome | None = None) -> dict:
    """report.json's `validation`: base, baseline and candidate side by side, deltas, checks and the verdict."""
    rows = {}
    for name in HIGHER_IS_BETTER:
        candidate, baseline = verdict.candidate.value(name), verdict.baseline.metrics.get(name)
        rows[name] = {"base": verdict.base.value(name), "baseline": baseline, "candidate": candidate,
                      "delta": None if candidate is None or baseline is None else candidate - baseline}
    section = {"verdict": "pass" if verdict.passed else "fail", "reasons": verdict.reasons,
               "baseline": verdict.baseline.source, "examples": verdict.candidate.examples, "metrics": rows,
               "checks": [check.model_dump() for check in verdict.checks],
               "answers": [answer.model_dump() for answer in verdict.candidate.answers]}
    if promotion is not None:
        section["promotion"] = {"promoted": promotion.promoted, "version": promotion.pointer.version,
                                "path": promotion.pointer.path}
    return section


def publish_validation(verdict: ValidationResult, run_dir: Path) -> Path:
    """candidate_metrics.json in the run directory (usable as another run's baseline_file) and a table artifact."""
    path = write_baseline_file(Path(run_dir) / "candidate_metrics.json", verdict.candidate, verdict.sample_fingerprint,
                               source=f"run {Path(run_dir).name}")
    try:
        from prefect.artifacts import create_table_artifact
    except ImportError:
        return path
    table = [{"metric": name, **{k: "-" if v is None else f"{v:.4f}" for k, v in row.items()}}
             for name, row in validation_section(verdict)["metrics"].items()]
    create_table_artifact(key="validation", table=table,
                          description=f"phase1a validation against {verdict.baseline.source}: "
                                      + ("PASS" if verdict.passed else "FAIL: " + "; ".join(verdict.reasons)))
    return path


def baseline_identity(settings: ValidationConfig, endpoint_url: str | None = None) -> str:
    """What the verdict depends on besides the candidate: the baseline file's bytes or the pointer's version."""
    if settings.baseline == "file":
        path = Path(settings.baseline_file)
        return sha256_file(path) if path.is_file() else f"missing {path}"
    if settings.baseline == "promoted":
        pointer = read_pointer(settings.promote_to, endpoint_url)
        return f"promoted {pointer.version if pointer else None}"
    return "base"


def validate_fingerprint(model_fingerprint: str, adapter_dir: str, data_fingerprint: str,
                         settings: ValidationConfig, endpoint_url: str | None = None) -> str:
    """The same weights on the same held-out examples against the same baseline give the same verdict."""
    return hash_json({"model": model_fingerprint, "adapter": sha256_tree(Path(adapter_dir), _ADAPTER_FILES),
                      "data": data_fingerprint, "settings": settings.model_dump(mode="json"),
                      "baseline": baseline_identity(settings, endpoint_url),
                      "code": code_version("phase1a/evaluation.py", "phase1a/generation.py", "phase1a/answers.py",
                                           "phase1a/gate.py")})


@task(name="validate", cache_policy=FingerprintCache(), persist_result=True, result_serializer="json")
def validate_task(model_dir: str, adapter_dir: str, validation_path: str, settings: ValidationConfig, fingerprint: str,
                  cache_dir: str, model_fingerprint: str | None = None, staging_dir: str | None = None,
                  endpoint_url: str | None = None, trust_remote_code: bool = False) -> ValidationResult:
    return validate(Path(model_dir), Path(adapter_dir), Path(validation_path), settings, Path(cache_dir),
                    model_fingerprint, Path(staging_dir) if staging_dir else None, endpoint_url, trust_remote_code)


@task(name="promote")
def promote_task(verdict: ValidationResult, adapter_dir: str, model_dir: str, settings: ValidationConfig,
                 version: str, run: str, work_dir: str, endpoint_url: str | None = None,
                 trust_remote_code: bool = False, chat_template: str | None = None) -> PromotionOutcome:
    return promote_candidate(verdict, Path(adapter_dir), Path(model_dir), settings, version, run, Path(work_dir),
                             endpoint_url, trust_remote_code, chat_template)
