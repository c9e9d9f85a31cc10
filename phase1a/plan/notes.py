"""The plan's notes in words: what the planner (phase1a/plan/planner.py) tells the reader about a figure's source
or a choice it made for them: the interval auto chose, the history's speed, the outliers cut, a spot run without a
store."""
from __future__ import annotations

from phase1a.data.lengths import Outliers
from phase1a.plan.interruptions import (
    BOUNDED_MAX_SECONDS,
    BOUNDED_MIN_COST_MULTIPLE,
    BOUNDED_PARTS,
    CheckpointCost,
    IntervalRule,
)
from phase1a.train.history import Remembered

NO_STORE_WARNING = (
    "WARNING: hardware.spot without a store: an interrupted host takes its disk with it, so the next host stages "
    "and tokenizes the data again and trains from step 0; each interruption loses on average half the training "
    "so far (the estimate counts that, not the re-staging). Set `store: s3://bucket/prefix/` to resume from the "
    "last uploaded checkpoint instead")


def auto_note(interval: str, rule: IntervalRule, cost: CheckpointCost, rate: float, source: str) -> str:
    delta = (f"a checkpoint costs {cost.seconds:.2f} s ({cost.write_seconds:.2f} s write, {cost.write_source}; "
             f"{cost.upload_seconds:.2f} s upload, {cost.upload_source})")
    if rule == "young-daly":
        return (f"checkpoint.interval auto: {interval}, Young/Daly sqrt(2 delta M) - delta: {delta}, one "
                f"interruption in M = {1 / rate:.1f} h ({source})")
    why = ("no interruption rate (on demand)" if not rate
           else "without a store an interruption loses the local checkpoints anyway")
    return (f"checkpoint.interval auto: {interval}, the train time in {BOUNDED_PARTS} parts, at most "
            f"{BOUNDED_MAX_SECONDS / 60:.0f} min, at least {BOUNDED_MIN_COST_MULTIPLE:g}x the checkpoint's cost: "
            f"{why}; {delta}")


def history_note(past: Remembered, hardware: str) -> str:
    where = f"this model on {hardware}"
    if past.runs == 1:
        return (f"throughput {past.tokens_per_second:.0f} tokens/s and knobs from the last run of {where} "
                f"({past.record.timestamp:%Y-%m-%d %H:%M})")
    return (f"throughput {past.tokens_per_second:.0f} tokens/s, the upper median of the last {past.runs} runs of "
            f"{where} with the knobs of the latest ({past.record.timestamp:%Y-%m-%d %H:%M}); that run measured "
            f"{past.record.tokens_per_second:.0f}")


def outlier_note(profile: str, outliers: Outliers, max_seq_length: int, truncated: int, unlabelled: int) -> str:
    where, tokens = outliers.longest[0]
    return (f"{profile}: max_seq_length {outliers.others_length} (sized from the examples other than the "
            f"{outliers.count} outlier(s), longer than {outliers.threshold} tokens; the longest {tokens} tokens at "
            f"{where}) instead of {max_seq_length}; {truncated} training example(s) truncated, {unlabelled} of them "
            "left with no trained token. plan.profile quality keeps them")
