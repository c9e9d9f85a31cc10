"""Where a run's files are: the names in a run directory (work_dir/<job>/<stamp>-<flow run>/, the flow's) and in
a training directory (work_dir/<job>/train-<key>/, the train stage's), for what writes them and what reads them;
which of a training directory's checkpoints are complete."""
import re
from pathlib import Path

# A run directory
REPORT_JSON = "report.json"  # phase1a/run_report.py: RunReport
REPORT_MD = "report.md"
ERROR_LOG = "error.log"  # flows/cli.py: the traceback of an input error, printed as one line
PLAN_JSON = "plan.json"
CANDIDATE_METRICS = "candidate_metrics.json"  # usable as another run's validation.baseline_file

# A cache directory (cache_dir)
COMPILE_CACHE = "compile"  # torch.compile's code: the plan's calibration compiles it, the train stage reuses it

# A training directory
METRICS = "metrics.jsonl"  # a line per optimizer step: loss, lr, grad norm, tokens/s, MFU, memory
EVALUATIONS = "eval.jsonl"  # a line per evaluation during training
EVENTS = "events.jsonl"  # resumed, preempted, early stopping, out of memory
SETTINGS = "settings.json"  # the TrainSettings every torchrun rank reads
FINAL = "final"  # the finished adapter (or weights), written whole
RESULT = "result.json"  # in FINAL: the TrainResult

# A checkpoint in a training directory's checkpoints/: step-00000042/, complete once it holds MARKER
MARKER = "COMPLETE"
ARITHMETIC = "arithmetic.json"  # in a checkpoint: the knobs its steps were computed with (StepArithmetic)
RUN_FILES = "run"  # in a checkpoint that travels to another host: the run's curves and best weights as they were
_STEP_DIR = re.compile(r"^step-(\d{8})$")


def checkpoint_step(path: Path) -> int:
    return int(Path(path).name.removeprefix("step-"))


def list_checkpoints(root: Path) -> list[Path]:
    """Complete checkpoints, oldest first; half-written ones (no marker) are ignored."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if _STEP_DIR.match(p.name) and (p / MARKER).is_file()]
    return sorted(found, key=lambda p: p.name)
