"""Promote: a model that passed the gate, copied as a new version under `promotion.to` (a directory or
s3://bucket/prefix/), then the `promoted.json` pointer moved to it (phase1a/promote/promotion.py).

What is promoted: the adapter (or a full fine-tune's weights), with the tokenizer it was trained with when
`data.chat_template` overrode the base's template; with `promotion.export` the base with the adapter merged in
(`merged`, which loads without peft) and GGUF files of it (`gguf`). Each artifact carries its model card
(phase1a/model_card.py).
"""
from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

from phase1a.config.schema import Phase1aConfig
from phase1a.data.templates import apply_chat_template_setting
from phase1a.evaluate.result import ValidationResult
from phase1a.model.gguf import write_gguf
from phase1a.model.loading import ResolvedModel, is_adapter, load_model, load_tokenizer, peft_wrapping
from phase1a.model_card import BaseModelFacts, CardFacts, RunFacts, write_card
from phase1a.promote.promotion import Promotion, PromotionOutcome, promote
from phase1a.store.promoted import PromotionError, PromotionRecord
from phase1a.train.result import TrainResult
from tasks.caching import task


def merge_adapter(model_dir: Path, adapter_dir: Path, target: Path, trust_remote_code: bool = False,
                  chat_template: str | None = None) -> Path:
    """The base with the adapter folded into its weights (in fp32, saved in the base's dtype), plus its tokenizer
    with the chat template the data was rendered with (`data.chat_template`): a model that loads without peft."""
    from peft import PeftModel
    from transformers import AutoConfig

    saved_dtype = getattr(AutoConfig.from_pretrained(model_dir, trust_remote_code=trust_remote_code), "dtype", None)
    with peft_wrapping():
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


@dataclass
class _Artifacts:
    """What one promotion builds in its scratch directory before the version is copied."""

    config: Phase1aConfig
    model_dir: Path
    adapter_dir: Path
    scratch: Path
    version: str

    def adapter(self) -> Path:
        """The adapter as promoted: its weights linked (a full fine-tune's are not copied twice), and with an
        overriding template the tokenizer it was trained with, which must reach whoever serves it, or prompts
        would be rendered in the base tokenizer's format."""
        target, template = self.scratch / "adapter", self.config.data.chat_template
        shutil.rmtree(target, ignore_errors=True)
        shutil.copytree(self.adapter_dir, target, copy_function=_link_or_copy)
        if template is not None:
            _trained_tokenizer(self.model_dir, template, self.config.model.trust_remote_code).save_pretrained(target)
        return target

    def exports(self) -> dict[str, Path]:
        """`promotion.export`: the merged model (a full fine-tune's weights already are one) and its GGUF files,
        named by the version."""
        wanted, adapter = self.config.promotion.export, self.adapter_dir
        if not wanted:
            return {}
        merged = (merge_adapter(self.model_dir, adapter, self.scratch / "merged", self.config.model.trust_remote_code,
                                self.config.data.chat_template) if is_adapter(adapter) else adapter)
        exports = {"merged": merged} if "merged" in wanted and merged != adapter else {}
        if "gguf" in wanted:
            write_gguf(merged, self.scratch / "gguf", name=self.version)
            exports["gguf"] = self.scratch / "gguf"
        return exports


def _link_or_copy(source: str, target: str) -> None:
    """Weights are linked (never rewritten in place); the rest is copied, since a tokenizer saved over a linked
    file would rewrite the training directory's."""
    if Path(source).suffix in (".safetensors", ".bin"):
        try:
            return os.link(source, target)
        except OSError:  # another file system
            pass
    shutil.copy2(source, target)


def promote_candidate(config: Phase1aConfig, model: ResolvedModel, verdict: ValidationResult, trained: TrainResult,
                      run_dir: Path, run: RunFacts | None = None) -> PromotionOutcome:
    """Promote the run in `run_dir` (its name is the version) whose verdict passed; where its training started
    (`trained.start`) is recorded as the version's parent (None: the base model). With the `run`, every
    artifact gets its model card."""
    destination, start = config.promotion.to, trained.start
    if not verdict.passed:  # the flow never calls this on a fail; a direct caller must not either
        raise PromotionError("refusing to promote a model that failed the gate: " + "; ".join(verdict.reasons))
    if not destination:
        raise PromotionError("promotion.to is not set: nowhere to promote to")
    run_dir = Path(run_dir)
    building = _Artifacts(config, Path(model.path), Path(trained.adapter_dir), run_dir / "promote.tmp", run_dir.name)
    try:
        artifacts = {"adapter": building.adapter(), **building.exports()}
        if run is not None:
            facts = _card_facts(building, verdict, trained, run, artifacts)
            for name, directory in artifacts.items():
                write_card(facts, directory, name)
        record = PromotionRecord(run=str(run_dir), adapter_sha256=verdict.adapter_sha256,
                                 base_model_fingerprint=verdict.model_fingerprint,
                                 sample_fingerprint=verdict.sample_fingerprint,
                                 metric_settings=verdict.metric_settings,
                                 metrics=verdict.candidate.model_dump(mode="json"),
                                 parent=start.version if start else None,
                                 started_from=start.describe() if start else None)
        # Against a promoted baseline the pointer must still be the one the gate saw; else whatever it is now.
        expected = verdict.promoted_seen if config.validation.baseline == "promoted" else ...
        return promote(Promotion(artifacts, run_dir.name, record, expected), destination,
                       endpoint_url=config.endpoint_for(destination))  # the store's, in its bucket
    finally:
        shutil.rmtree(building.scratch, ignore_errors=True)  # copies: promoted, or not wanted


def _card_facts(building: _Artifacts, verdict: ValidationResult, trained: TrainResult, run: RunFacts,
                artifacts: dict[str, Path]) -> CardFacts:
    config, start = building.config, trained.start
    exports = {name: sorted(p.name for p in directory.iterdir() if p.is_file())
               for name, directory in artifacts.items() if name != "adapter"}
    return CardFacts(version=building.version, parent=start.version if start else None,
                     started_from=start.describe() if start else "the base model",
                     base=BaseModelFacts.of(config.model.name_or_path, building.model_dir),
                     base_name=config.model.name_or_path, method=config.method.kind, run=run, trained=trained,
                     verdict=verdict, exports=exports)


@task(name="promote")
def promote_task(config: Phase1aConfig, model: ResolvedModel, verdict: ValidationResult, trained: TrainResult,
                 run_dir: str, run: RunFacts) -> PromotionOutcome:
    return promote_candidate(config, model, verdict, trained, Path(run_dir), run)
