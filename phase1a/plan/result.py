"""The plan stage's result: the knobs training runs with, the estimate and its range, the options table and the
notes (what phase1a/plan/planner.py makes and the flow hands the train stage), and the calibration it rests on: the
candidates tried and what each measured (phase1a/plan/calibration.py). Types only, with no torch."""
from __future__ import annotations

from typing import Literal

from pydantic import BaseModel

from phase1a.core.hardware import training_device
from phase1a.evaluate.result import ValidationSpeed
from phase1a.model.cost_model import MemoryEstimate, ModelFacts
from phase1a.plan import footing
from phase1a.plan.footing import Footing
from phase1a.plan.interruptions import InterruptionEstimate
from phase1a.plan.options import OptionRow
from phase1a.plan.window import Adjustment


class Candidate(BaseModel, frozen=True):
    micro_batch_size: int
    gradient_checkpointing: bool
    compile: bool = False
    dataloader_workers: int = 0
    cuda_graphs: bool = False

    def label(self) -> str:
        compiled = ("on, CUDA graphs" if self.cuda_graphs else "on") if self.compile else "off"
        return (f"micro {self.micro_batch_size}, checkpointing {'on' if self.gradient_checkpointing else 'off'}, "
                f"compile {compiled}, workers {self.dataloader_workers}")


class Trial(BaseModel):
    candidate: Candidate
    status: Literal["measured", "out_of_memory", "failed", "skipped"]
    tokens_per_second: float | None = None
    warmup_excess_seconds: float | None = None  # what the first steps cost beyond steady state (compilation)
    peak_memory_gib: float | None = None  # CUDA only: the allocator's peak during the trial
    seconds: float = 0.0
    note: str = ""
    measured_steps: int = 0  # after the warm-up steps
    step_cap: int | None = None  # the micro-batches each step was cut to, to fit the budget; None: whole steps
    micro_batches: float = 0.0  # run a measured step (a warm-up step, without measured ones), on average
    step_micro_batches: float = 0.0  # a whole step's, on average over those steps
    spread: float = 0.0  # half the range of the measured steps' seconds per token, over their mean
    longest_step_seconds: float = 0.0

    def footing(self) -> Footing:
        return footing.measured(self.measured_steps, self.micro_batches, self.step_micro_batches, self.spread,
                                footing.floor(training_device().type))


class Calibration(BaseModel):
    chosen: Candidate
    seconds_per_token: float
    warmup_excess_seconds: float  # the first steps' costs beyond steady state, in a fresh process
    # Of them, the process's first calls (kernels loaded, handles made): a run in the process that calibrated
    # (the flow's train stage on one device) does not pay them again. 0 for a compiled candidate measured first.
    first_calls_seconds: float = 0.0
    startup_seconds: float  # load the model, wrap it, build the optimizer
    device_setup_seconds: float = 0.0  # of it, the device's context and handles: a process's first use only
    # When the first step began. One step runs whatever is left, the least that measures a speed, so the budget
    # holds to one step past the later of itself and this (loading the model can spend a small budget).
    first_step_at_seconds: float = 0.0
    checkpoint_seconds: float | None  # one checkpoint written, measured; None: the budget had no room for it
    checkpoint_bytes: int = 0  # its size on disk
    checkpoint_upload_seconds: float | None = None  # its upload to the store, when the job asked for one
    peak_memory_gib: float | None
    trials: list[Trial]
    budget_seconds: float
    seconds: float
    validation: ValidationSpeed | None = None  # the validate stage's two costs, measured on this model
    footing: Footing  # what the chosen candidate's speed rests on
    needed_seconds: float | None = None  # a whole calibration of the first candidate, when the budget cut it short
    notes: list[str] = []  # what was not timed, and why


class Estimate(BaseModel):
    startup_seconds: float
    steady_seconds: float  # train tokens at the measured steady-state speed
    warmup_seconds: float
    # What a train stage in a process that did not calibrate (a plan from the cache) pays beyond warmup_seconds:
    # the process's first calls. Within the range's high end, not the estimate.
    first_calls_seconds: float = 0.0
    checkpoints: int
    checkpoint_seconds: float  # all checkpoints together
    evaluation_seconds: float  # the validate stage
    # The plan found the base model's scores of the sample cached on this device: the validate stage scores the
    # candidate only. `base_evaluation_seconds` is the base's share of the work (included unless cached).
    base_cached: bool = False
    base_evaluation_seconds: float = 0.0
    evaluations_during_training: int = 0  # method.eval_interval's, the final weights' included
    eval_during_training_seconds: float = 0.0  # all of them, with early stopping's writes of best/
    train_seconds: float  # steady + warm-up + checkpoints + evaluations during training: the train stage's loop
    # Expected lost work and restarts of interruptions (Plan.interruptions); 0 on demand. Kept out of
    # train_seconds, which is one uninterrupted attempt's loop (what the history compares against).
    interruption_seconds: float = 0.0
    total_seconds: float  # startup + train + evaluation + interruption_seconds
    footing: Footing | None = None  # what the training speed rests on; None: a plan written before the field
    # What evaluation's speed rests on (the validate stage and the evaluations during training): timed passes, or
    # derived from the training speed. None: the training speed's footing (a plan written before the field).
    evaluation_footing: Footing | None = None
    evaluation_speed: ValidationSpeed | None = None  # what evaluation was estimated at (the history keeps it)
    low_total_seconds: float | None = None  # the range: the speed-bound seconds at their footing's multiples
    high_total_seconds: float | None = None

    def train_range(self) -> tuple[float, float] | None:
        """The train stage's loop: the steady steps at the training speed's footing, the evaluations during
        training at evaluation's (None: no footing)."""
        return self._ranged(self.train_seconds, self.steady_seconds, self.eval_during_training_seconds,
                            self.first_calls_seconds)

    def evaluation_range(self) -> tuple[float, float] | None:
        """The validate stage at evaluation's footing (None: no footing)."""
        return self.evaluation_for(self.base_cached)[1]

    def evaluation_for(self, base_cached: bool) -> tuple[float, tuple[float, float] | None]:
        """The validate stage's seconds and range with the base model's scores cached or not, as the stage found
        them: a cached plan may have been made before (or after) another run cached them."""
        seconds = self.evaluation_seconds
        if base_cached != self.base_cached:
            seconds += -self.base_evaluation_seconds if base_cached else self.base_evaluation_seconds
        return seconds, self._ranged(seconds, 0.0, seconds)

    def with_range(self, footing: Footing, evaluation: Footing | None = None) -> "Estimate":
        ranged = self.model_copy(update={"footing": footing, "evaluation_footing": evaluation})
        low, high = ranged._ranged(self.total_seconds, self.steady_seconds,
                                   self.eval_during_training_seconds + self.evaluation_seconds,
                                   self.first_calls_seconds)
        return ranged.model_copy(update={"low_total_seconds": low, "high_total_seconds": high})

    def _ranged(self, seconds: float, training: float, evaluation: float,
                more: float = 0.0) -> tuple[float, float] | None:
        """`seconds`, of which `training` moves with the training speed and `evaluation` with evaluation's, each
        at its footing's low and high multiples; `more` seconds that may be paid on top (the high end only)."""
        if self.footing is None:
            return None
        parts = ((training, self.footing), (evaluation, self.evaluation_footing or self.footing))
        return (seconds - sum(bound * (1 - f.low) for bound, f in parts),
                seconds + sum(bound * (f.high - 1) for bound, f in parts) + more)


class Plan(BaseModel):
    profile: str
    epochs: float
    adjustments: list[Adjustment]
    target: str
    detected: str
    calibrated: bool
    precision: str
    base_precision: str
    optimizer: str
    attention: str = "sdpa"  # the implementation training runs (phase1a/model/build.py: attention_implementation)
    micro_batch_size: int
    gradient_accumulation: int
    gradient_checkpointing: bool
    compile: bool
    dataloader_workers: int
    max_seq_length: int
    cuda_graphs: bool = False  # each compiled layer replayed as a CUDA graph
    # The packed rows training runs (phase1a/train/packing.py: RowShape): the most tokens a row holds, the lengths
    # rows are padded to (None: exact rows, no padding), and padding's share of the rows' tokens.
    row_tokens: int | None = None
    row_lengths: list[int] | None = None
    padding_share: float = 0.0
    model: ModelFacts
    trainable_parameters: int
    memory: MemoryEstimate
    measured_peak_memory_gib: float | None
    flops_per_token: float  # what a step computes, recompute included
    model_flops_per_token: float  # what MFU counts: no recompute
    tokens_per_second: float
    steps: int
    train_tokens: int
    estimate: Estimate
    estimated_train_seconds: float
    estimated_total_seconds: float
    estimated_cost_usd: float | None
    window_seconds: float | None
    fits_in_window: bool | None
    throughput_source: str
    calibration: Calibration | None
    options: list[OptionRow]
    notes: list[str]
    # The interval training checkpoints at: checkpoint.interval, or auto's choice (e.g. '754s'). None: a plan
    # written before the field, whose training used checkpoint.interval.
    checkpoint_interval: str | None = None
    interruptions: InterruptionEstimate | None = None  # with spot, an interruption rate, or checkpoint.interval auto
