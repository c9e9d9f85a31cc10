"""Where a run's files are: the names in a run directory (work_dir/<job>/<stamp>-<flow run>/, the flow's) and in
a training directory (work_dir/<job>/train-<key>/, the train stage's), for what writes them and what reads them."""

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
