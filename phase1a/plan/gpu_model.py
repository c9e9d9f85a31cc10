"""A GPU's training speed where the plan cannot measure it (docs/plan-models.md#the-gpu-model).

A step is bound by whichever is slower, the FLOPs at a ceiling MFU or the launches of its kernels, plus what the
host spends on the step beside them:

    step seconds  = max(compute, launches) + per-step overhead
    compute       = computed tokens x FLOPs a token / (peak FLOP/s x ceiling MFU)
    launches      = kernels a step x per-kernel overhead
    tokens/s      = useful tokens a step / step seconds

The kernels a step are counted from the model's shape and the job (`GpuStep.kernels`): a decoder layer's eager
kernels for each pass over it (forward, backward, and the recomputed forward with gradient checkpointing) for each
micro-batch, the loss's per chunk, the optimizer's per step. The count is nominal; what a kernel costs on the host
and the device together is what the fit finds. A 135M model in small steps is bound by launches and per-step
overhead: on an H200 its measured steps ran at 0.05 % MFU, where a FLOP-bound model at 35 % says 680 times
faster.

The parameters are fitted (`fit`) to committed GPU measurements (benchmarks/results/gpu-check-*/), written to
`gpu_overheads.json` beside this module by benchmarks/fit_gpu_overheads.py with the measurements they rest on:

    per-kernel overhead  the largest every measurement allows (each one's step seconds over its kernels, the least
                         of them): the measurement with the least time a kernel is explained by its kernels alone
    per-step overhead    each measurement's step seconds beyond max(compute, launches) at that overhead: the low
                         and high are the least and most of them, the value their median
    ceiling MFU          `plan.assumed_mfu` where no measurement reached it (its low end half of it); never below
                         the highest MFU a measurement reached

So every measurement lies within the range the model gives for its own step on its device, and a newer code
path's measurements, refitted, replace the old ones.
"""
from __future__ import annotations

import json
import math
import statistics
from functools import lru_cache
from pathlib import Path
from typing import Literal

from pydantic import BaseModel

from phase1a.core.hardware import CATALOGUE
from phase1a.model.cost_model import ModelFacts, chunk_rows

OVERHEADS_PATH = Path(__file__).with_name("gpu_overheads.json")

# Nominal eager kernels (CUDA launches) of a Llama-style model, counted on its parts (torch 2.11 and peft; the H200
# profile of 2026-11-26 shows 1,676 matmuls a step of one micro-batch for SmolLM2 with LoRA on its 7 projections:
# 30 layers x (21 forward, the 7 base and 14 adapter matmuls counted here, + 35 backward).
LAYER_KERNELS = 32  # a decoder layer's forward apart from its projections: two RMSNorms (7 each: the fp32 cast,
# square, mean, add, rsqrt, scale, cast back), RoPE on q and k (5 each), attention with its layout copies (4),
# SiLU and the gate product (2), two residual adds (2)
PROJECTION_KERNELS = 1  # the base weight's matmul
LORA_KERNELS = 4  # an adapted projection's A and B matmuls, the scaling and the add
BACKWARD_PER_FORWARD = 2  # a backward pass launches about twice its forward's kernels (input and weight gradients)
MODEL_KERNELS = 8  # a forward's kernels outside the layers: the embedding, the rotary tables, the final norm
LOSS_CHUNK_KERNELS = 12  # one loss chunk forward and backward: logits, log-sum-exp, the target's, the gradient
OPTIMIZER_KERNELS = 8  # a step's optimizer outside its multi-tensor launches: the gradient norm and clipping
OPTIMIZER_TENSORS_PER_LAUNCH = 16  # the fused AdamW and the clipping's for-each launches take tensors in groups
LLAMA_PROJECTION_NAMES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
LLAMA_PROJECTIONS = len(LLAMA_PROJECTION_NAMES)

UNMEASURED_CEILING_LOW = 0.5  # where no measurement was compute-bound: the ceiling's low end, a share of the
# assumed MFU (the plan's footing for an assumed speed, phase1a/plan/footing.py, allows 2x either way)
FITTED_AT_MFU = 0.35  # the ceiling the fit prices compute at (plan.assumed_mfu's default): it matters only for a
# measurement that was compute-bound, which none has been


class GpuStep(BaseModel):
    """One optimizer step of a job as one GPU runs it: what the model counts and times."""

    layers: int
    projections: int = LLAMA_PROJECTIONS  # linear projections a decoder layer
    adapted: int = LLAMA_PROJECTIONS  # of them with a LoRA adapter; 0 for a full fine-tune
    trainable_tensors: int  # the optimizer's tensors
    micro_batches: float  # forward and backward passes a step
    loss_chunks: float  # a step's, over its micro-batches
    checkpointing: bool = False  # the forward recomputed in backward
    useful_tokens: float  # the examples' own tokens a step: what tokens/s counts
    computed_tokens: float  # what the GPU computes a step, padding included (>= useful_tokens)
    flops_per_token: float  # model FLOPs a computed token (phase1a/model/cost_model.py: flops_per_token)

    @property
    def kernels(self) -> float:
        """Kernel launches a step (module docstring)."""
        layer = LAYER_KERNELS + self.projections * PROJECTION_KERNELS + self.adapted * LORA_KERNELS
        passes = 1 + BACKWARD_PER_FORWARD + (1 if self.checkpointing else 0)
        micro_batch = self.layers * layer * passes + MODEL_KERNELS * (2 if self.checkpointing else 1)
        return (self.micro_batches * micro_batch + self.loss_chunks * LOSS_CHUNK_KERNELS + OPTIMIZER_KERNELS
                + math.ceil(self.trainable_tensors / OPTIMIZER_TENSORS_PER_LAUNCH))

    def share(self, gpus: int) -> "GpuStep":
        """One of `gpus` GPUs' part of this step, when they split it (a global batch kept): fewer micro-batches
        and tokens, the same optimizer step."""
        if gpus <= 1:
            return self
        return self.model_copy(update={"micro_batches": max(1.0, self.micro_batches / gpus),
                                       "loss_chunks": max(1.0, self.loss_chunks / gpus),
                                       "useful_tokens": self.useful_tokens / gpus,
                                       "computed_tokens": self.computed_tokens / gpus})


class StepJob(BaseModel):
    """A step's examples and how they are cut, as the plan (or a measurement's record) knows them."""

    examples: int
    mean_length: float  # the examples' own tokens
    row_tokens: int  # a micro-batch's token budget
    flops_per_token: float
    full: bool = False
    target_modules: list[str] = list(LLAMA_PROJECTION_NAMES)
    checkpointing: bool = False
    computed_length: float | None = None  # with padding; None: packed rows, the mean length
    micro_batches: float | None = None  # where the job fixes them (padded micro-batches); None: from row_tokens
    chunked_loss: bool = True  # the loss over chunks of the vocabulary's size (phase1a/model/chunked_loss.py);
    # False: one over each micro-batch's whole logits (Hugging Face models' own)


def gpu_step(facts: ModelFacts, job: StepJob) -> GpuStep:
    """`job`'s step on `facts`' model: its examples laid in micro-batches of at most `row_tokens` tokens (where the
    job does not fix them), the loss's chunks in each, the optimizer's tensors."""
    shapes = facts.projection_shapes()
    adapted = 0 if job.full else sum(1 for name in shapes if name in job.target_modules)
    computed = job.examples * (job.computed_length if job.computed_length is not None else job.mean_length)
    micro = job.micro_batches or max(1.0, math.ceil(computed / max(1, job.row_tokens)))
    chunks = micro * (math.ceil(computed / micro / chunk_rows(facts.vocab)) if job.chunked_loss else 1)
    tensors = (facts.layers * (len(shapes) + 2) + 3) if job.full else 2 * facts.layers * adapted
    return GpuStep(layers=facts.layers, projections=len(shapes), adapted=adapted, trainable_tensors=tensors,
                   micro_batches=micro, loss_chunks=chunks, checkpointing=job.checkpointing,
                   useful_tokens=job.examples * job.mean_length, computed_tokens=computed,
                   flops_per_token=job.flops_per_token)


def step_seconds(step: GpuStep, peak_flops: float, per_kernel: float, per_step: float, mfu: float) -> float:
    compute = step.computed_tokens * step.flops_per_token / (peak_flops * mfu)
    return max(compute, step.kernels * per_kernel) + per_step


class Band(BaseModel):
    low: float
    value: float
    high: float


class Measured(BaseModel):
    """One committed GPU measurement, read from its result file (benchmarks/fit_gpu_overheads.py)."""

    file: str  # the result file, relative to the repository
    device: str  # as the run recorded it
    kind: str  # its catalogue key
    commit: str  # the code that ran
    date: str
    model: str  # the benchmark's model shape (benchmarks/train_throughput.py SHAPES)
    config: str  # ours, a peer (before, after, hf_flattening, ...)
    tokens_per_second: float  # useful tokens/s, as the result reports it
    seconds_per_step: float
    step: GpuStep


class Source(Measured):
    """A measurement as the fit used it."""

    kernels: float
    compute_seconds: float  # at FITTED_AT_MFU
    per_step_seconds: float  # the step's seconds beyond max(compute, launches) at the fitted per-kernel overhead
    mfu: float  # model FLOPs of its computed tokens over the device's peak


class GpuOverheads(BaseModel):
    """The fitted parameters and the measurements they rest on (gpu_overheads.json)."""

    per_kernel_seconds: Band
    per_step_seconds: Band
    ceiling_mfu_at_least: float  # the highest MFU a source reached: no ceiling is below it
    fitted_at_mfu: float = FITTED_AT_MFU
    sources: list[Source]
    how: str = ""  # the command that wrote it

    def ceiling(self, assumed_mfu: float) -> Band:
        """The ceiling MFU: the assumed one (plan.assumed_mfu), where no measurement reached it, half of it its low
        end; never below what a measurement reached."""
        value = max(assumed_mfu, self.ceiling_mfu_at_least)
        return Band(low=max(value * UNMEASURED_CEILING_LOW, self.ceiling_mfu_at_least), value=value, high=value)

    def basis(self) -> str:
        """What the overheads rest on, in words: each run's device, commit and date, and what each config measured."""
        runs: dict[tuple[str, str, str], list[Source]] = {}
        for source in self.sources:
            runs.setdefault((source.kind, source.commit, source.date[:10]), []).append(source)
        parts = []
        for (kind, commit, date), sources in runs.items():
            measured = ", ".join(f"{s.model} {s.config} {s.tokens_per_second:,.0f}" for s in sources)
            parts.append(f"{len(sources)} {kind} run{'s' if len(sources) != 1 else ''} of commit {commit} "
                         f"({date}; tokens/s: {measured})")
        return "; ".join(parts)

    def short_basis(self) -> str:
        kinds = sorted({s.kind for s in self.sources})
        commits = sorted({s.commit for s in self.sources})
        return f"{len(self.sources)} {'/'.join(kinds)} runs, commit {', '.join(commits)}"


@lru_cache(maxsize=4)
def load_overheads(path: Path = OVERHEADS_PATH) -> GpuOverheads:
    return GpuOverheads.model_validate(json.loads(Path(path).read_text()))


class Modelled(BaseModel):
    """One GPU's modelled speed for a step: tokens/s at the parameters' slow end, value and fast end."""

    low: float
    value: float
    high: float
    bound: Literal["overhead", "compute"]  # at the value: launches and per-step overhead, or FLOPs
    kernels: float
    step_seconds: Band  # low: the fast end's

    def words(self, overheads: GpuOverheads) -> str:
        if self.bound == "overhead":
            k = overheads.per_kernel_seconds.value
            s = overheads.per_step_seconds
            return (f"overhead-bound: {self.kernels:,.0f} kernels x {k * 1e6:.3g} us + {s.low:.2g}-{s.high:.3g} s "
                    f"a step")
        return f"compute-bound: {self.step_seconds.value:.3g} s a step at the ceiling MFU"


def modelled_speed(step: GpuStep, kind: str, assumed_mfu: float, overheads: GpuOverheads | None = None) -> Modelled:
    """`step`'s tokens/s on one GPU of catalogue kind `kind` (module docstring)."""
    overheads = overheads or load_overheads()
    peak = CATALOGUE[kind].peak_flops
    if peak is None:
        raise ValueError(f"no peak FLOP/s is known for {kind}: the GPU model needs one")
    k, s, ceiling = overheads.per_kernel_seconds, overheads.per_step_seconds, overheads.ceiling(assumed_mfu)
    fast = step_seconds(step, peak, k.low, s.low, ceiling.high)
    value = step_seconds(step, peak, k.value, s.value, ceiling.value)
    slow = step_seconds(step, peak, k.high, s.high, ceiling.low)
    compute = step.computed_tokens * step.flops_per_token / (peak * ceiling.value)
    tokens = step.useful_tokens
    return Modelled(low=tokens / slow, value=tokens / value, high=tokens / fast,
                    bound="compute" if compute >= step.kernels * k.value else "overhead", kernels=step.kernels,
                    step_seconds=Band(low=fast, value=value, high=slow))


def fit(measurements: list[Measured], how: str = "", mfu: float = FITTED_AT_MFU) -> GpuOverheads:
    """The parameters every measurement allows (module docstring); each rounded outward at 4 significant figures,
    so that each measurement stays within the range of its own step."""
    if not measurements:
        raise ValueError("no GPU measurement to fit the overheads on")
    peaks = [_peak(m.kind) for m in measurements]
    least = min(m.seconds_per_step / m.step.kernels for m in measurements)
    per_kernel = min(_down(least), least)
    sources = []
    for m, peak in zip(measurements, peaks):
        compute = m.step.computed_tokens * m.step.flops_per_token / (peak * mfu)
        residual = max(0.0, m.seconds_per_step - max(compute, m.step.kernels * per_kernel))
        sources.append(Source(**m.model_dump(), kernels=m.step.kernels, compute_seconds=compute,
                              per_step_seconds=residual,
                              mfu=m.step.computed_tokens * m.step.flops_per_token / m.seconds_per_step / peak))
    residuals = [s.per_step_seconds for s in sources]
    return GpuOverheads(
        per_kernel_seconds=Band(low=per_kernel, value=per_kernel, high=per_kernel),
        per_step_seconds=Band(low=min(_down(min(residuals)), min(residuals)),
                              value=_round(statistics.median(residuals)),
                              high=max(_up(max(residuals)), max(residuals))),
        ceiling_mfu_at_least=_down(max(s.mfu for s in sources)), fitted_at_mfu=mfu, sources=sources, how=how)


def _peak(kind: str) -> float:
    peak = CATALOGUE[kind].peak_flops if kind in CATALOGUE else None
    if peak is None:
        raise ValueError(f"{kind!r}: a GPU measurement needs a catalogue GPU with a peak FLOP/s")
    return peak


def _round(value: float, digits: int = 4) -> float:
    return float(f"{value:.{digits}g}")


def _down(value: float, digits: int = 4) -> float:
    """`value` rounded down at `digits` significant figures."""
    if value <= 0:
        return 0.0
    scale = 10 ** (math.floor(math.log10(value)) - digits + 1)
    return _round(math.floor(value / scale) * scale, digits)


def _up(value: float, digits: int = 4) -> float:
    if value <= 0:
        return 0.0
    scale = 10 ** (math.floor(math.log10(value)) - digits + 1)
    return _round(math.ceil(value / scale) * scale, digits)
