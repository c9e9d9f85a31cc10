"""A run's path (tokenize, the plan's calibration, train, validate) calls no deprecated API.

pyproject's `filterwarnings` makes a FutureWarning or DeprecationWarning an error when it is attributed to our
packages (its module after `stacklevel`). A library that warns with the default stacklevel attributes the warning to
itself: transformers' deprecated `gradient_checkpointing_*` aliases name transformers.modeling_utils, whoever calls
them. So this test records every such warning with its call stack, on the tiny model in this process, and fails on
each one whose caller into the warning's package is our code.
"""
from __future__ import annotations

import sys
import warnings
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Iterator

import pytest

from helpers import date_records, make_tokenizer, resolved, write_jsonl
from phase1a.config.schema import DataConfig, MethodConfig, ModelConfig, Phase1aConfig, ValidationConfig
from phase1a.data.tokenizing import TokenizeOptions, tokenize_dataset
from phase1a.evaluate.validation import validate
from phase1a.plan.calibration import CalibrationJob, calibrate
from phase1a.plan.result import Candidate
from phase1a.train.loop import train
from phase1a.train.settings import TrainSettings

OURS = {"phase1a", "tasks", "flows"}
LORA = {"r": 4, "alpha": 8}


@dataclass(frozen=True)
class Finding:
    category: str
    message: str
    caller: str | None  # file:line of our frame that called into the package that warned; None: another package

    def __str__(self) -> str:
        return f"{self.caller}: {self.category}: {self.message}"


def _package(frame: FrameType) -> str:
    return frame.f_globals.get("__name__", "").split(".")[0]


def _where(frame: FrameType) -> str:
    return f"{frame.f_code.co_filename}:{frame.f_lineno}"


def _warning_frame(frame: FrameType | None) -> FrameType | None:
    """The frame that called warnings.warn: the first one outside the warnings module."""
    while frame is not None and _package(frame) == "warnings":
        frame = frame.f_back
    return frame


def our_caller(frame: FrameType | None) -> str | None:
    """Where our code called into the package that warned, or None when another package did. The warning's own
    package is skipped whole (its deprecated alias, helpers and wrappers): peft reading transformers' deprecated
    `is_gradient_checkpointing` inside PeftModel() is peft's call, even when our code constructed the PeftModel."""
    if frame is None:
        return None
    package = _package(frame)
    if package not in OURS:
        while frame is not None and _package(frame) == package:
            frame = frame.f_back
    return _where(frame) if frame is not None and _package(frame) in OURS else None


@contextmanager
def deprecations_from_our_calls() -> Iterator[list[Finding]]:
    """Every FutureWarning and DeprecationWarning raised inside, once per message and caller; `caller` says
    whether our code caused it."""
    found: list[Finding] = []

    def record(message, category, filename, lineno, file=None, line=None):
        if issubclass(category, (FutureWarning, DeprecationWarning)):
            finding = Finding(category.__name__, str(message), our_caller(_warning_frame(sys._getframe(1))))
            if finding not in found:
                found.append(finding)

    with warnings.catch_warnings():
        warnings.simplefilter("always")  # ahead of every filter: "once", "ignore" and "error" alike
        warnings.showwarning = record  # restored by catch_warnings
        yield found


def _old_call_from_our_package(code: str, **names) -> None:
    """Runs `code` as if it were a line of phase1a: the detector's check without keeping a deprecated call in it."""
    exec(compile(code, str(Path("phase1a") / "_deprecated_probe.py"), "exec"), {"__name__": "phase1a._probe", **names})


def test_the_detector_flags_our_deprecated_call_and_not_a_library_s(tiny_model_dir):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    with deprecations_from_our_calls() as found:
        _old_call_from_our_package("model.gradient_checkpointing_disable()", model=model)
    assert [(f.category, f.caller) for f in found] == [("FutureWarning", "phase1a/_deprecated_probe.py:1")]
    assert "`gradient_checkpointing_disable` is deprecated" in found[0].message

    with deprecations_from_our_calls() as found:
        _old_call_from_our_package("get_peft_model(model, LoraConfig(r=4, target_modules=['q_proj']))",
                                   model=model, get_peft_model=get_peft_model, LoraConfig=LoraConfig)
    # peft 0.21 reads transformers' deprecated `is_gradient_checkpointing` inside PeftModel(): peft's call, not ours
    assert [f.caller for f in found if "`is_gradient_checkpointing` is deprecated" in f.message] == [None]


def _job(tiny_model_dir: Path, cache: Path) -> Phase1aConfig:
    return Phase1aConfig.model_validate({
        "work_dir": str(cache / "runs"), "cache_dir": str(cache), "data": {"source": "unused"},
        "model": {"name_or_path": str(tiny_model_dir)},
        "method": {"batch_size": 8, "lora": LORA},
        "plan": {"sweep": ["gradient_checkpointing"], "calibration_share": 1.0, "calibration_steps": 2},
    })


def _calibrate(config: Phase1aConfig, tiny_model_dir: Path, train_path: str, work_dir: Path) -> None:
    """Checkpointing off, then on: set_gradient_checkpointing both ways on one built model, as the plan does."""
    def alternatives(best: Candidate, knob: str) -> list[Candidate]:
        return [best.model_copy(update={"gradient_checkpointing": not best.gradient_checkpointing})]

    start = Candidate(micro_batch_size=8, gradient_checkpointing=False)
    calibrate(config, tiny_model_dir, CalibrationJob(train_path, 256, start, train_tokens=10**9, work_dir=work_dir,
                                                     alternatives=alternatives))


def _train(tiny_model_dir: Path, train_path: str, output_dir: Path) -> str:
    settings = TrainSettings(
        model_dir=str(tiny_model_dir), train_path=train_path, output_dir=str(output_dir),
        method=MethodConfig(learning_rate=5e-3, batch_size=8, epochs=1, lora=LORA),
        micro_batch_size=4, gradient_checkpointing=True, checkpoint_interval="2steps", show_progress=False)
    return train(settings).adapter_dir


def _validate(tiny_model_dir: Path, validation_path: str, adapter_dir: str, cache: Path) -> None:
    config = Phase1aConfig(data=DataConfig(source="unused"), model=ModelConfig(name_or_path=str(tiny_model_dir)),
                           cache_dir=cache, validation=ValidationConfig(max_examples=4))
    validate(config, resolved(config), Path(validation_path), Path(adapter_dir))


@pytest.mark.slow  # 20 s on two cores: the calibration's timed trials, a training, a validation
def test_a_run_calls_no_deprecated_api(tiny_model_dir, tmp_path):
    data = write_jsonl(tmp_path / "d.jsonl", date_records(40))
    with deprecations_from_our_calls() as found:
        split = tokenize_dataset(data, make_tokenizer(), 256, TokenizeOptions(validation_fraction=0.2),
                                 tmp_path / "cache" / "fp")
        _calibrate(_job(tiny_model_dir, tmp_path / "cache"), tiny_model_dir, split.train_path, tmp_path / "plan")
        adapter_dir = _train(tiny_model_dir, split.train_path, tmp_path / "run")
        _validate(tiny_model_dir, split.validation_path, adapter_dir, tmp_path / "cache")
    ours = [f for f in found if f.caller]
    assert not ours, "deprecated APIs called from our code:\n" + "\n".join(map(str, ours))
