"""The plan stage's result: the knobs training runs with, the estimate and its range, the options table and the
notes (what phase1a/plan/planner.py makes and the flow hands the train stage)."""
from __future__ import annotations

from pydantic import BaseModel

from phase1a.evaluate.metrics import ValidationSpeed
from phase1a.model.cost_model import MemoryEstimate, ModelFacts
from phase1a.plan.calibration import Calibration
from phase1a.plan.footing import Footing
from phase1a.plan.interruptions import InterruptionEstimate
from phase1a.plan.options import OptionRow
from phase1a.plan.window import Adjustment


class Estimate(BaseModel):
    startup_seconds: float
    steady_seconds: float  # train tokens at the measured steady-state speed
    warmup_seconds: float
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
        return self._ranged(self.train_seconds, self.steady_seconds, self.eval_during_training_seconds)

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
                                   self.eval_during_training_seconds + self.evaluation_seconds)
        return ranged.model_copy(update={"low_total_seconds": low, "high_total_seconds": high})

    def _ranged(self, seconds: float, training: float, evaluation: float) -> tuple[float, float] | None:
        """`seconds`, of which `training` moves with the training speed and `evaluation` with evaluation's, each
        at its footing's low and high multiples."""
        if self.footing is None:
            return None
        parts = ((training, self.footing), (evaluation, self.evaluation_footing or self.footing))
        return (seconds - sum(bound * (1 - f.low) for bound, f in parts),
                seconds + sum(bound * (f.high - 1) for bound, f in parts))


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
