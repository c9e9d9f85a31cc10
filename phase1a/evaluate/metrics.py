"""Held-out metrics of one model on one sample: teacher-forced loss, perplexity and token accuracy, then
generated answers scored by exact match, with their calibration.

Calibration: the confidence of an answer is the mean probability the model gave the tokens of its own greedy
answer (stop token included), and ECE compares it with that answer's exact-match correctness. We score
answers rather than tokens because exact match is the accuracy the gate and the report speak about; per-token
max-probability on teacher-forced response tokens is dominated by template and format tokens the model
predicts almost surely, and says little about whether the answer is right.
"""
from __future__ import annotations

import math
import time
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import torch

from phase1a.config.schema import ValidationConfig
from phase1a.core.fingerprint import code_fingerprint, hash_json
from phase1a.core.meter import stage_meter
from phase1a.evaluate.answers import extract_answer
from phase1a.evaluate.generation import (
    Generated,
    GenerationExample,
    decode_batches,
    generate_greedy,
    generation_examples,
    stop_token_ids,
    time_decode_step,
)
from phase1a.evaluate.result import Answer, EvaluationWork, Metrics, ValidationSpeed
from phase1a.train.packing import TokenRows, budget_rows, teacher_forced

_SHOWN_ANSWERS = 5


def sample_fingerprint(rows: TokenRows, indices: np.ndarray) -> str:
    """The tokens and labels of the scored examples: the same sample gives the same fingerprint anywhere."""
    parts = []
    for i in indices:
        start, end = int(rows.offsets[i]), rows.end(int(i))
        parts.append([rows.input_ids[start:end].tolist(), rows.labels[start:end].tolist()])
    return hash_json(parts)


def metric_settings_key(settings: ValidationConfig, device: torch.device, dtype: torch.dtype) -> str:
    """Everything besides weights and sample that changes a metric: how answers are generated and scored, the
    precision, and this code."""
    return hash_json({
        "scoring": settings.model_dump(mode="json", include={"extractor", "answer_pattern", "max_new_tokens",
                                                             "new_tokens_margin", "ece_bins", "batch_size",
                                                             "generation_batch_size"}),
        "device": device.type, "dtype": str(dtype),
        "code": code_fingerprint(__name__),
    })


def expected_calibration_error(confidences: np.ndarray, correct: np.ndarray, bins: int) -> float:
    """Sum over equal-width confidence bins (lo, hi] of (share of answers in the bin) x |accuracy - mean
    confidence| in the bin; a confidence of exactly 0 falls in the first bin."""
    confidences = np.asarray(confidences, dtype=np.float64)
    correct = np.asarray(correct, dtype=np.float64)
    if confidences.size == 0:
        raise ValueError("no answers to calibrate")
    # Rounded first: 0.7 * 10 is 7.000000000000001 in floating point, which would put 0.7 in (0.7, 0.8].
    which = np.clip(np.ceil(np.round(confidences * bins, 9)).astype(np.int64) - 1, 0, bins - 1)
    error = 0.0
    for b in range(bins):
        members = which == b
        if members.any():
            error += members.mean() * abs(correct[members].mean() - confidences[members].mean())
    return float(error)


def evaluate(model: torch.nn.Module, tokenizer, rows: TokenRows, indices: np.ndarray,
             settings: ValidationConfig, label: str = "validate") -> Metrics:
    """`label` names the model in the progress of its two passes (`validate candidate, loss` and `, generation`)."""
    model.eval()
    with stage_meter(f"{label}, loss", math.ceil(len(indices) / settings.batch_size), "batches") as meter:
        loss_sum, correct, tokens = teacher_forced(model, rows, indices, settings.batch_size, meter=meter)
    mean = loss_sum / max(tokens, 1)
    metrics = Metrics(examples=len(indices), tokens=tokens, loss=mean, perplexity=math.exp(min(mean, 50.0)),
                      token_accuracy=correct / max(tokens, 1))

    examples = generation_examples(rows, indices)
    if isinstance(examples, str):
        metrics.unavailable = {"exact_match": examples, "ece": examples}
        return metrics
    specials = tokenizer.all_special_tokens
    references = [extract_answer(tokenizer.decode(e.reference.tolist()), settings.extractor,
                                 settings.answer_pattern, specials) for e in examples]
    if None in references:
        bad = examples[references.index(None)]
        raise ValueError(f"validation.extractor {settings.extractor}: the reference "
                         f"{tokenizer.decode(bad.reference.tolist())!r} has no answer to extract "
                         f"(pattern {settings.answer_pattern!r}); exact match would be meaningless")
    generated = _generate(model, tokenizer, examples, settings, label)

    hits, confidences, answers = [], [], []
    for reference, output in zip(references, generated):
        text = tokenizer.decode(output.tokens)
        prediction = extract_answer(text, settings.extractor, settings.answer_pattern, specials)
        hits.append(prediction is not None and prediction == reference)
        confidences.append(output.mean_prob)
        if len(answers) < _SHOWN_ANSWERS:
            answers.append(Answer(reference=reference, prediction=prediction if prediction is not None else text,
                                  correct=hits[-1], confidence=round(output.mean_prob, 4)))
    metrics.exact_match = float(np.mean(hits))
    metrics.ece = expected_calibration_error(np.array(confidences), np.array(hits), settings.ece_bins)
    metrics.mean_confidence = float(np.mean(confidences))
    metrics.generated_tokens = sum(len(output.tokens) for output in generated)
    metrics.answers = answers
    return metrics


def _generate(model, tokenizer, examples: list[GenerationExample], settings: ValidationConfig,
              label: str) -> list[Generated]:
    """Greedy answers, one generation batch at a time (the batches `generate_greedy` makes itself), counted."""
    max_new = max_new_tokens(examples, settings)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    stop_ids, size = stop_token_ids(tokenizer, model, examples), settings.generation_batch_size
    prompts, generated = [e.prompt for e in examples], []
    with stage_meter(f"{label}, generation", math.ceil(len(prompts) / size), "batches") as meter:
        for start in range(0, len(prompts), size):
            batch = generate_greedy(model, prompts[start : start + size], max_new, stop_ids, pad_id, size)
            generated += batch
            meter.advance(1, tokens=sum(len(output.tokens) for output in batch))
    return generated


@dataclass(frozen=True)
class TimingAllowance:
    """What timing validation may spend, and a guess of a forward token's cost to size it by (a third of a
    training token's: the forward of forward and backward)."""

    seconds: float
    forward_guess: float  # seconds per token


# Timed greedy steps at each width; one more runs untimed first. At 8, qa300's batch's step moved 84-109 ms between
# runs on this project's CPU host, the generation estimates 0.88-1.07 of the actual.
_DECODE_STEPS = 16


@dataclass
class _Timing:
    """What timing validation runs, and its cost at the guessed forward speed, example by example: a warm-up
    example, the sample's first batch (teacher-forced), the first generation batch (a prefill, then a token a
    step)."""

    sample: np.ndarray
    forward_costs: np.ndarray
    warmup_cost: float
    prompts: list[GenerationExample]
    generation_costs: np.ndarray

    @classmethod
    def of(cls, rows: TokenRows, indices: np.ndarray, settings: ValidationConfig, guess: float) -> "_Timing":
        lengths, sample = rows.lengths(), indices[: settings.batch_size]
        examples = generation_examples(rows, indices[: settings.generation_batch_size])
        prompts = [] if isinstance(examples, str) else examples
        # a row's prefill, then its token in each step: the steps at the prompt's width, then with the cache widened
        return cls(sample, lengths[sample] * guess, float(lengths[sample[:1]].sum() * guess), prompts,
                   np.array([(len(e.prompt) + 2 * (1 + _DECODE_STEPS)) * guess for e in prompts]))

    def seconds(self) -> float:
        return self.warmup_cost + float(self.forward_costs.sum() + self.generation_costs.sum())

    def within(self, seconds: float) -> "_Timing":
        """The same, both parts cut by the same share to the examples that fit `seconds`."""
        share = min(1.0, seconds / max(self.seconds(), 1e-12))
        forward = _fitting(self.forward_costs, share * (self.warmup_cost + self.forward_costs.sum()) - self.warmup_cost)
        generation = _fitting(self.generation_costs, share * self.generation_costs.sum())
        return _Timing(self.sample[:forward], self.forward_costs[:forward], self.warmup_cost,
                       self.prompts[:generation], self.generation_costs[:generation])


def validation_timing_seconds(rows: TokenRows, indices: np.ndarray, settings: ValidationConfig,
                              forward_guess: float) -> float:
    """What `time_validation` takes unhurried, at a guessed forward speed (seconds per token)."""
    return _Timing.of(rows, indices, settings, forward_guess).seconds()


def time_validation(model: torch.nn.Module, rows: TokenRows, indices: np.ndarray, settings: ValidationConfig,
                    allowance: TimingAllowance) -> ValidationSpeed | None:
    """The teacher-forced pass on the sample's first batch, then a prefill and greedy steps of its first generation
    batch, within the allowance: the forward pass sized by the guessed speed, the generation batch by the speed
    the forward pass measured, the steps by the deadline. None when not one example fits, or when a pass still
    runs past the allowance (cut at a layer): the plan then derives both from the training speed."""
    end = time.perf_counter() + allowance.seconds
    try:
        with _cut_at(model, end):
            return _timed(model, rows, indices, settings, allowance, end)
    except _OutOfTime:  # a pass ran far slower than guessed (a loaded host): cut at a layer, not timed
        return None


def _timed(model, rows: TokenRows, indices: np.ndarray, settings: ValidationConfig, allowance: TimingAllowance,
           end: float) -> ValidationSpeed | None:
    whole = _Timing.of(rows, indices, settings, allowance.forward_guess)
    timing = whole.within(allowance.seconds)
    if not len(timing.sample) or (whole.prompts and not timing.prompts):
        return None
    model.eval()
    teacher_forced(model, rows, timing.sample[:1], settings.batch_size)  # warm-up: eval mode's first pass
    passes = _time_forward(model, rows, timing.sample, settings.batch_size, allowance.forward_guess,
                           time.perf_counter() + (end - time.perf_counter()) / 3)
    forward, spread = passes.seconds_per_token, passes.spread
    if not whole.prompts:  # no generation: exact match is reported unavailable, and its time is not spent
        return ValidationSpeed(forward_seconds_per_token=forward, decode_seconds_per_step=0.0,
                               passes=passes.count, spread=spread)
    measured = _Timing.of(rows, indices, settings, forward)  # the generation batch, sized at the measured speed
    fitting = _fitting(measured.generation_costs, (end - time.perf_counter()) / 2)
    if not fitting:  # a first call in eval mode can take most of it: no generation timing fits what is left
        return None
    prompts = [e.prompt for e in whole.prompts[:fitting]]
    # Timed again with the cache as wide as the longest generation makes it: a step's cost grows with what it
    # attends to (qa300's 120-step answers: 0.089 s a step timed at their prompts, 0.100 s over the whole answer)
    decode = time_decode_step(model, prompts, pad_id=0, steps=_DECODE_STEPS, deadline=end,
                              wider=max_new_tokens(generation_examples(rows, indices), settings))
    prefill = decode.prefill_seconds / sum(len(prompt) for prompt in prompts)
    # Fewer rows than the generation batch: on a CPU a step's cost grows with its rows; on an accelerator a small
    # batch's step is bound by reading the weights, so the smaller batch's step stands (a lower bound).
    scale = len(whole.prompts) / len(prompts) if next(model.parameters()).device.type == "cpu" else 1.0
    timed_rows = f"greedy steps timed on {len(prompts)} of {len(whole.prompts)} rows"
    return ValidationSpeed(
        forward_seconds_per_token=forward, decode_seconds_per_step=decode.at_no_context() * scale,
        decode_seconds_per_context_token=decode.per_context_token() * scale, prefill_seconds_per_token=prefill,
        passes=passes.count, spread=spread,
        source="measured" if len(prompts) == len(whole.prompts) else
        timed_rows + (", scaled by rows" if scale != 1.0 else ""))


def training_rows_timing_seconds(rows: TokenRows, indices: np.ndarray, forward: float) -> float:
    """What `time_training_rows` takes unhurried at a forward speed (seconds per token)."""
    return float(rows.lengths()[indices].sum()) * forward


def time_training_rows(model: torch.nn.Module, rows: TokenRows, indices: np.ndarray, token_budget: int,
                       guess: float, deadline: float) -> float | None:
    """Seconds per token of the teacher-forced pass over `indices` in rows of at most `token_budget` tokens, as an
    evaluation during training runs it (phase1a/train/evaluation.py), row after row while the next is predicted
    (at `guess`, then at the speed so far) to end by `deadline` (perf_counter time). None: not one row fits. On
    this project's CPU host the demo's evaluation during training (rows of 512 tokens, the LoRA adapter's path on)
    took 15-19 % more a token than the validate stage's pass (batches of 16 examples, the path off): 12-15 % of it
    the adapter's path, 4-6 % the rows (three passes of each, alternating, in one process, 2026-11-29)."""
    lengths, spent, tokens = rows.lengths(), 0.0, 0
    for group in budget_rows(rows, indices, token_budget):
        cost = int(lengths[group].sum())
        if time.perf_counter() + (spent / tokens if tokens else guess) * cost > deadline:
            break
        began = time.perf_counter()
        teacher_forced(model, rows, group, len(group))
        spent, tokens = spent + time.perf_counter() - began, tokens + cost
    return spent / tokens if tokens else None


class _OutOfTime(Exception):
    pass


@contextmanager
def _cut_at(model: torch.nn.Module, deadline: float):
    """Raises _OutOfTime at the first transformer layer (a ModuleList's child) that starts past `deadline`
    (perf_counter time): the soft deadlines size the work by a guessed or measured speed, and one call can
    still run many times slower than either on a host whose cores are shared."""
    def check(module, args):
        if time.perf_counter() > deadline:
            raise _OutOfTime

    handles = [layer.register_forward_pre_hook(check) for layers in model.modules()
               if isinstance(layers, torch.nn.ModuleList) for layer in layers]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


@dataclass(frozen=True)
class _Passes:
    """Timed teacher-forced passes: their seconds per token over all, and how far the passes spread."""

    seconds_per_token: float
    count: int
    spread: float  # half the range of the passes' seconds per token, over their mean


def _time_forward(model, rows: TokenRows, sample: np.ndarray, batch_size: int, guess: float,
                  deadline: float) -> _Passes:
    """Seconds per token of the teacher-forced pass in packed batches as the validate stage runs them (an example
    a token costs several times more on its own), batch after batch until the next would end past the deadline
    (one at least); the batch halved while the guessed speed says it would not end by the deadline. A sample of
    one batch is timed twice where the deadline allows: one pass says nothing of how much the host's speed moves."""
    lengths = rows.lengths()
    while batch_size > 1 and time.perf_counter() + guess * lengths[sample[:batch_size]].sum() > deadline:
        batch_size //= 2
    groups = [sample[start : start + batch_size] for start in range(0, len(sample), batch_size)]
    if len(groups) == 1:
        groups *= 2
    spent, tokens, speeds = 0.0, 0, []
    for group in groups:
        cost = int(lengths[group].sum())
        if tokens and time.perf_counter() + spent / tokens * cost > deadline:
            break
        began = time.perf_counter()
        teacher_forced(model, rows, group, len(group))
        seconds = time.perf_counter() - began
        spent, tokens = spent + seconds, tokens + cost
        speeds.append(seconds / max(1, cost))
    mean = float(np.mean(speeds))
    spread = (max(speeds) - min(speeds)) / 2 / mean if mean > 0 else 0.0
    return _Passes(seconds_per_token=spent / max(1, tokens), count=len(speeds), spread=spread)


def _fitting(costs: np.ndarray, seconds: float) -> int:
    """How many of `costs`, from the first, add up to at most `seconds`."""
    return int(np.searchsorted(np.cumsum(costs), seconds, side="right"))


def validation_work(rows: TokenRows, indices: np.ndarray, settings: ValidationConfig, models: int,
                    untuned: int = 0) -> EvaluationWork:
    """Validation as `evaluate` runs it, for each of `models` models: the teacher-forced pass over the sample,
    then per generation batch a prefill of its prompts and greedy steps. A fine-tuned model stops after its longest
    answer (the reference and its stop token); `untuned` more, the base model, rarely stops where the references
    do, so its batches run to `max_new_tokens` (the longest reference plus `new_tokens_margin`)."""
    forward = float(rows.lengths()[indices].sum())
    examples = generation_examples(rows, indices)
    if isinstance(examples, str):  # no generation: exact match is reported unavailable
        return EvaluationWork(forward_tokens=forward) * (models + untuned)
    max_new = max_new_tokens(examples, settings)
    read = EvaluationWork(forward_tokens=forward, prefill_tokens=sum(len(e.prompt) for e in examples))
    tuned, base = (EvaluationWork.decoding(decode_batches(examples, max_new, settings.generation_batch_size, to_max))
                   for to_max in (False, True))
    return read * (models + untuned) + tuned * models + base * untuned


def max_new_tokens(examples: list[GenerationExample], settings: ValidationConfig) -> int:
    """The most tokens a generation runs to: the longest reference and a margin, at most `max_new_tokens`."""
    longest = max((len(e.reference) for e in examples), default=0)
    return min(settings.max_new_tokens, longest + settings.new_tokens_margin)
