"""Promote: a model that passed the gate, copied as a new version under `validation.promote_to` (a directory or
s3://bucket/prefix/), then the `promoted.json` pointer moved to it (phase1a/promote/promotion.py).

What is promoted: the adapter (or a full fine-tune's weights), with the tokenizer it was trained with when
`data.chat_template` overrode the base's template, and with `validation.promote_merged` the base with the
adapter merged in, which loads without peft.
"""
from __future__ import annotations

import shutil
from pathlib import Path

import torch

from phase1a.config.schema import Phase1aConfig
from phase1a.data.templates import apply_chat_template_setting
from phase1a.model.loading import ResolvedModel, is_adapter, load_model, load_tokenizer
from phase1a.promote.promotion import Promotion, PromotionError, PromotionOutcome, PromotionRecord, promote
from phase1a.promote.warmstart import StartPoint
from phase1a.results import TrainResult, ValidationResult
from tasks.caching import task


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
    return apply_chat_template_setting(load_tokenizer(Path(model_dir), trust_remote_code), chat_template)


def _adapter_with_template(adapter_dir: Path, model_dir: Path, chat_template: str, target: Path,
                           trust_remote_code: bool) -> Path:
    """A copy of the adapter with the tokenizer it was trained with: the overriding template must reach
    whoever serves it, or prompts would be rendered in the base tokenizer's format."""
    shutil.rmtree(target, ignore_errors=True)
    shutil.copytree(adapter_dir, target)
    _trained_tokenizer(model_dir, chat_template, trust_remote_code).save_pretrained(target)
    return target


def promote_candidate(config: Phase1aConfig, model: ResolvedModel, verdict: ValidationResult, adapter_dir: Path,
                      run_dir: Path, start: StartPoint | None = None) -> PromotionOutcome:
    """Promote the run in `run_dir` (its name is the version) whose verdict passed; `start`, where its training
    started, is recorded as the version's parent (None: the base model)."""
    settings, trust, template = config.validation, config.model.trust_remote_code, config.data.chat_template
    if not verdict.passed:  # the flow never calls this on a fail; a direct caller must not either
        raise PromotionError("refusing to promote a model that failed the gate: " + "; ".join(verdict.reasons))
    if not settings.promote_to:
        raise PromotionError("validation.promote_to is not set: nowhere to promote to")
    model_dir, run_dir = Path(model.path), Path(run_dir)
    artifacts = {"adapter": Path(adapter_dir)}
    merged_dir, templated_dir = run_dir / "merged.tmp", run_dir / "adapter.tmp"
    if template is not None:
        artifacts["adapter"] = _adapter_with_template(Path(adapter_dir), model_dir, template, templated_dir, trust)
    if settings.promote_merged and is_adapter(adapter_dir):
        artifacts["merged"] = merge_adapter(model_dir, Path(adapter_dir), merged_dir, trust, template)
    record = PromotionRecord(run=str(run_dir), adapter_sha256=verdict.adapter_sha256,
                             base_model_fingerprint=verdict.model_fingerprint,
                             sample_fingerprint=verdict.sample_fingerprint, metric_settings=verdict.metric_settings,
                             metrics=verdict.candidate.model_dump(mode="json"),
                             parent=start.version if start else None,
                             started_from=start.describe() if start else None)
    # Against a promoted baseline the pointer must still be the one the gate saw; else whatever it is now.
    expected = verdict.promoted_seen if settings.baseline == "promoted" else ...
    try:
        return promote(Promotion(artifacts, run_dir.name, record, expected), settings.promote_to,
                       endpoint_url=config.data.s3_endpoint_url)
    finally:
        for scratch in (merged_dir, templated_dir):  # copies: promoted, or not wanted
            shutil.rmtree(scratch, ignore_errors=True)


@task(name="promote")
def promote_task(config: Phase1aConfig, model: ResolvedModel, verdict: ValidationResult, trained: TrainResult,
                 run_dir: str) -> PromotionOutcome:
    return promote_candidate(config, model, verdict, Path(trained.adapter_dir), Path(run_dir), trained.start)
