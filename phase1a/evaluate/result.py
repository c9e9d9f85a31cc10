"""What the validate stage hands on, and report.json records: each model's held-out metrics (Metrics), the candidate
against its baseline, the gate's checks and verdict (ValidationResult); and what evaluation costs, measured
(ValidationSpeed) and counted (EvaluationWork), which calibration and the plan hand on. Types only, with no torch:
the flow, the report and the CLI read them without loading a model."""
from __future__ import annotations

from dataclasses import dataclass

from pydantic import BaseModel

from phase1a.evaluate.serving import ServingVerdict

# Metric name -> the direction that is better; the gate and the report read this.
HIGHER_IS_BETTER = {"loss": False, "perplexity": False, "token_accuracy": True, "exact_match": True, "ece": False}


class Answer(BaseModel):
    reference: str
    prediction: str
    correct: bool
    confidence: float


class BenchmarkScore(BaseModel):
    """One lm-eval benchmark's metric for one model (phase1a/evaluate/benchmarks.py)."""

    task: str  # the lm-eval task's name
    source: str  # as configured (`validation.benchmarks[].task`): the name, or the path of the task's YAML
    metric: str
    value: float
    stderr: float | None = None
    samples: int
    higher_is_better: bool = True
    identity: str  # what the score depends on besides the weights: comparable only where it is equal


class Metrics(BaseModel):
    examples: int
    tokens: int
    loss: float
    perplexity: float
    token_accuracy: float
    exact_match: float | None = None
    ece: float | None = None
    mean_confidence: float | None = None
    generated_tokens: int = 0
    unavailable: dict[str, str] = {}  # metric -> why it could not be computed on this sample
    answers: list[Answer] = []  # the first few, for the report
    benchmarks: dict[str, BenchmarkScore] = {}  # "task/metric" -> its score

    def value(self, metric: str) -> float | None:
        if metric in self.benchmarks:
            return self.benchmarks[metric].value
        return getattr(self, metric, None)

    def names(self) -> list[str]:
        """Every metric it can hold: the held-out sample's, then its benchmarks'."""
        return [*HIGHER_IS_BETTER, *self.benchmarks]

    def higher_is_better(self, metric: str) -> bool:
        return self.benchmarks[metric].higher_is_better if metric in self.benchmarks else HIGHER_IS_BETTER[metric]


class ValidationSpeed(BaseModel):
    """Validation's two costs, measured on the model being planned: the teacher-forced pass per token, and one
    greedy step of a generation batch (`generation_batch_size` rows) with the KV cache, each as the validate stage
    runs it (a LoRA adapter's path off where the candidate is scored merged)."""

    forward_seconds_per_token: float
    decode_seconds_per_step: float  # apart from what the step attends to, where that is priced (next field)
    # What a greedy step costs more per position it attends to (prompt width and tokens so far): the last steps of
    # a long answer cost more than its first. 0: not measured (a record written before it), steps priced flat.
    decode_seconds_per_context_token: float = 0.0
    source: str = "measured"  # how the two were found: measured, or measured on fewer rows and scaled
    # A generation batch's prefill (left-padded rows, per prompt token); None: at the teacher-forced speed.
    prefill_seconds_per_token: float | None = None
    # The teacher-forced passes timed (0: not timed, derived) and how far their seconds per token spread (half
    # the range over the mean): what the estimate's range for evaluation rests on (phase1a/plan/footing.py).
    passes: int = 0
    spread: float = 0.0
    # The teacher-forced pass as an evaluation during training runs it: the training model (a LoRA adapter's path
    # on) over rows of the training's token budget. None: at `forward_seconds_per_token`.
    training_forward_seconds_per_token: float | None = None
    # Folding a LoRA adapter into the weights before the candidate is scored (phase1a.model.loading.for_scoring):
    # its first write to weights read from disk takes 1.9 s for SmolLM2-135M on this project's CPU host, a tenth of
    # the qa300 job's validate stage. None: not measured, or the adapter is scored unmerged.
    merge_seconds: float | None = None
    # One benchmark's scoring beside its requests' passes: lm-eval's model wrapper, the task's build, its metrics.
    # None: not timed (no loglikelihood benchmark, or no time left for one).
    harness_seconds: float | None = None
    # The base model's costs where the candidate is scored with the adapter's path on (a 16-bit base: not merged):
    # that path's kernels make a launch-bound greedy step dearer, 48 ms against the base's 22 ms for SmolLM2-135M's
    # shape on an H200 (benchmarks/decode_step.py, 2026-11-30). None: the base costs what the candidate does.
    base: "ValidationSpeed | None" = None

    def for_base(self) -> "ValidationSpeed":
        """The costs the base model's share of the validate stage pays."""
        return self.base or self

    def during_training(self) -> "ValidationSpeed":
        """The costs an evaluation during training pays (its forward pass)."""
        return self.model_copy(update={
            "forward_seconds_per_token": self.training_forward_seconds_per_token or self.forward_seconds_per_token})


@dataclass(frozen=True)
class DecodeBatch:
    """A generation batch's greedy steps and its prompt width (rows are left-padded to its longest prompt)."""

    width: int
    steps: int

    @property
    def context_tokens(self) -> int:
        """What its steps attend to, summed: step j (from 1) reads the prompt, j - 1 generated tokens and its own."""
        return self.steps * self.width + self.steps * (self.steps + 1) // 2


class EvaluationWork(BaseModel):
    """What evaluation computes, apart from any device's speed: forward tokens (teacher-forced and prefill),
    greedy steps of generation batches, and the benchmark scorings the harness runs."""

    forward_tokens: float = 0.0  # teacher-forced
    prefill_tokens: float = 0.0  # generation batches' prompts
    decode_steps: float = 0.0
    decode_context_tokens: float = 0.0  # what those steps attend to, summed (DecodeBatch.context_tokens)
    harness_runs: float = 0.0  # benchmarks scored, each at `ValidationSpeed.harness_seconds` beside its passes

    def seconds(self, speed: ValidationSpeed) -> float:
        prefill = speed.prefill_seconds_per_token or speed.forward_seconds_per_token
        return (self.forward_tokens * speed.forward_seconds_per_token + self.prefill_tokens * prefill
                + self.decode_seconds(speed) + self.harness_runs * (speed.harness_seconds or 0.0))

    @classmethod
    def decoding(cls, batches: list[DecodeBatch]) -> "EvaluationWork":
        """The greedy steps of these generation batches, and what they attend to."""
        return cls(decode_steps=sum(b.steps for b in batches),
                   decode_context_tokens=sum(b.context_tokens for b in batches))

    def decode_seconds(self, speed: ValidationSpeed) -> float:
        return (self.decode_steps * speed.decode_seconds_per_step
                + self.decode_context_tokens * speed.decode_seconds_per_context_token)

    def __add__(self, other: "EvaluationWork") -> "EvaluationWork":
        return EvaluationWork(**{name: getattr(self, name) + getattr(other, name) for name in _WORK})

    def __mul__(self, times: float) -> "EvaluationWork":
        return EvaluationWork(**{name: getattr(self, name) * times for name in _WORK})


_WORK = tuple(EvaluationWork.model_fields)


class Baseline(BaseModel):
    source: str  # what it is, for the report: "base model", "file /x.json", "promoted 2026...-run"
    metrics: dict[str, float | None]
    unavailable: dict[str, str] = {}
    sample_fingerprint: str | None = None

    @classmethod
    def of(cls, source: str, metrics: Metrics, sample_fingerprint: str | None = None) -> "Baseline":
        values = {name: metrics.value(name) for name in metrics.names()}
        return cls(source=source, metrics=values, unavailable=metrics.unavailable,
                   sample_fingerprint=sample_fingerprint)


class GateCheck(BaseModel):
    metric: str
    candidate: float
    baseline: float
    tolerance: float
    higher_is_better: bool
    passed: bool

    def describe(self) -> str:
        if self.higher_is_better:
            relation, bound = (">=" if self.passed else "<"), f"- tolerance {self.tolerance:g}"
        else:
            relation, bound = ("<=" if self.passed else ">"), f"+ tolerance {self.tolerance:g}"
        return f"{self.metric} {self.candidate:.4f} {relation} baseline {self.baseline:.4f} {bound}"


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
    serving: ServingVerdict | None = None  # whether vLLM's multi-LoRA serves the adapter (reported, not gated)
