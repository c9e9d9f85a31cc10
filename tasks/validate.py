"""Validate: eval loss and token accuracy on held-out examples for the base and the trained model; a gate.

The trained model passes when its loss is at most the base's plus `loss_tolerance` and its token accuracy
at least the base's minus `accuracy_tolerance`. Both models see the same examples in the same batches.
"""
from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import torch
from pydantic import BaseModel

from phase1a.config import ValidationConfig
from phase1a.hardware import training_device, training_dtype
from phase1a.models import load_model
from phase1a.packing import TokenRows, pack, summed_loss
from phase1a.fingerprint import hash_json, sha256_tree
from tasks.caching import FingerprintCache, task

_EVAL_MICRO_BATCH = 16


class Metrics(BaseModel):
    examples: int
    tokens: int
    loss: float
    perplexity: float
    token_accuracy: float


class ValidationResult(BaseModel):
    base: Metrics
    trained: Metrics
    passed: bool
    reasons: list[str]


@torch.no_grad()
def evaluate(model: torch.nn.Module, rows: TokenRows, indices: np.ndarray) -> Metrics:
    device = next(model.parameters()).device
    loss_sum, correct, tokens = 0.0, 0, 0
    for start in range(0, len(indices), _EVAL_MICRO_BATCH):
        batch = {k: v.to(device) for k, v in pack(rows, indices[start : start + _EVAL_MICRO_BATCH]).items()}
        loss, right, count = summed_loss(model, batch)
        loss_sum += loss.item()
        correct += int(right)
        tokens += count
    mean = loss_sum / max(tokens, 1)
    return Metrics(examples=len(indices), tokens=tokens, loss=mean, perplexity=math.exp(min(mean, 50.0)),
                   token_accuracy=correct / max(tokens, 1))


def gate(base: Metrics, trained: Metrics, settings: ValidationConfig) -> list[str]:
    """Reasons the trained model must not be promoted; empty when it passes."""
    reasons = []
    if trained.loss > base.loss + settings.loss_tolerance:
        reasons.append(f"eval loss {trained.loss:.4f} > base {base.loss:.4f} + tolerance {settings.loss_tolerance}")
    if trained.token_accuracy < base.token_accuracy - settings.accuracy_tolerance:
        reasons.append(f"token accuracy {trained.token_accuracy:.4f} < base {base.token_accuracy:.4f} "
                       f"- tolerance {settings.accuracy_tolerance}")
    return reasons


def validate(model_dir: Path, adapter_dir: Path, validation_path: Path, settings: ValidationConfig,
             trust_remote_code: bool = False) -> ValidationResult:
    from peft import PeftModel

    device = training_device()
    rows = TokenRows.from_arrow(validation_path)
    indices = np.arange(min(len(rows), settings.max_examples))
    base_model = load_model(model_dir, training_dtype(device), trust_remote_code).to(device).eval()
    if (Path(adapter_dir) / "adapter_config.json").is_file():
        model = PeftModel.from_pretrained(base_model, adapter_dir).eval()
        with model.disable_adapter():  # the same weights with the adapter switched off
            base = evaluate(model, rows, indices)
    else:  # a full fine-tune saved whole weights
        base = evaluate(base_model, rows, indices)
        model = load_model(Path(adapter_dir), training_dtype(device), trust_remote_code).to(device).eval()
    trained = evaluate(model, rows, indices)
    reasons = gate(base, trained, settings)
    return ValidationResult(base=base, trained=trained, passed=not reasons, reasons=reasons)


def format_table(result: ValidationResult) -> str:
    rows = [("metric", "base", "trained", "delta")]
    for name in ("loss", "perplexity", "token_accuracy"):
        b, t = getattr(result.base, name), getattr(result.trained, name)
        rows.append((name, f"{b:.4f}", f"{t:.4f}", f"{t - b:+.4f}"))
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)) for row in rows]
    verdict = "PASS" if result.passed else "FAIL: " + "; ".join(result.reasons)
    return "\n".join(lines + [f"examples: {result.trained.examples}, tokens: {result.trained.tokens}, gate: {verdict}"])


def validate_fingerprint(model_fingerprint: str, adapter_dir: str, data_fingerprint: str,
                         settings: ValidationConfig) -> str:
    """The same weights on the same held-out examples with the same gate give the same verdict."""
    return hash_json({"model": model_fingerprint, "adapter": sha256_tree(Path(adapter_dir), ("*.safetensors", "*.json")),
                      "data": data_fingerprint, "settings": settings.model_dump()})


@task(name="validate", cache_policy=FingerprintCache(), persist_result=True, result_serializer="json")
def validate_task(model_dir: str, adapter_dir: str, validation_path: str, settings: ValidationConfig,
                  fingerprint: str, trust_remote_code: bool = False) -> ValidationResult:
    return validate(Path(model_dir), Path(adapter_dir), Path(validation_path), settings, trust_remote_code)
