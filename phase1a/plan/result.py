"""The plan stage's result: the knobs training runs with, the estimate and its range, the options table and the
notes (what phase1a/plan/planner.py makes and the flow hands the train stage)."""
from __future__ import annotations

from pydantic import BaseModel

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
    evaluations_during_training: int = 0  # method.eval_interval's, the final weights' included
    eval_during_training_seconds: float = 0.0  # all of them, with early stopping's writes of best/
    train_seconds: float  # steady + warm-up + checkpoints + evaluations during training: the train stage's loop
    # Expected lost work and restarts of interruptions (Plan.interruptions); 0 on demand. Kept out of
    # train_seconds, which is one uninterrupted attempt's loop (what the history compares against).
    interruption_seconds: float = 0.0
    total_seconds: float  # startup + train + evaluation + interruption_seconds
    footing: Footing | None = None  # what the speed rests on; None: a plan written before the field
    low_total_seconds: float | None = None  # the range: the speed-bound seconds at the footing's multiples
    high_total_seconds: float | None = None

    def speed_bound_seconds(self) -> float:
        """What moves with the training speed: the steady steps, and the evaluations derived from it."""
        return self.steady_seconds + self.eval_during_training_seconds + self.evaluation_seconds

    def train_range(self) -> tuple[float, float] | None:
        """The train stage's loop at the footing's multiples of what moves with the speed (None: no footing)."""
        bound = self.steady_seconds + self.eval_during_training_seconds
        return None if self.footing is None else _ranged(self.train_seconds, bound, self.footing)

    def evaluation_range(self) -> tuple[float, float] | None:
        """The validate stage at the footing's multiples (None: no footing)."""
        return None if self.footing is None else _ranged(self.evaluation_seconds, self.evaluation_seconds,
                                                          self.footing)

    def with_range(self, footing: Footing) -> "Estimate":
        low, high = _ranged(self.total_seconds, self.speed_bound_seconds(), footing)
        return self.model_copy(update={"footing": footing, "low_total_seconds": low, "high_total_seconds": high})


def _ranged(seconds: float, bound: float, footing: Footing) -> tuple[float, float]:
    """`seconds` with the part of it that moves with the speed, `bound`, at the footing's low and high multiples."""
    return seconds - bound * (1 - footing.low), seconds + bound * (footing.high - 1)


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
