"""The curves a training run writes in its directory: the trainer writes them (phase1a/progress.py); a resume
trims them (tasks/train.py); the report, the plots and the trackers read them."""

METRICS = "metrics.jsonl"  # a line per optimizer step: loss, lr, grad norm, tokens/s, MFU, memory
EVALUATIONS = "eval.jsonl"  # a line per evaluation during training
EVENTS = "events.jsonl"  # resumed, preempted, early stopping, out of memory
