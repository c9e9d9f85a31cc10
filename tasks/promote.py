"""Promote: a model that passed the gate, copied as a new version under `promotion.to` (a directory or
s3://bucket/prefix/), then the `promoted.json` pointer moved to it. The work: phase1a/promote/candidate.py.

What is promoted: the adapter (or a full fine-tune's weights), with the tokenizer it was trained with when
`data.chat_template` overrode the base's template; with `promotion.export` the base with the adapter merged in
(`merged`, which loads without peft) and GGUF files of it (`gguf`).

The recipe, `promote_candidate`, in named phases:
  1. artifacts  built in the run's scratch directory (phase1a/promote/artifacts.py)
  2. cards      each artifact's model card, from the run's results (phase1a/promote/card.py)
  3. promote    every file of the version copied and verified, then the pointer moved in one atomic step, only if
                it is still the one the gate compared against (phase1a/promote/promotion.py)

No cache key: promoting the adapter the pointer already names copies nothing (PromotionOutcome.promoted: False).
"""
from __future__ import annotations

from pathlib import Path

from phase1a.config.schema import Phase1aConfig
from phase1a.evaluate.result import ValidationResult
from phase1a.model.result import ResolvedModel
from phase1a.promote.candidate import promote_candidate
from phase1a.promote.card import RunFacts
from phase1a.promote.result import PromotionOutcome
from phase1a.train.result import TrainResult
from tasks.caching import task


@task(name="promote")
def promote_task(config: Phase1aConfig, model: ResolvedModel, verdict: ValidationResult, trained: TrainResult,
                 run_dir: str, run: RunFacts) -> PromotionOutcome:
    return promote_candidate(config, model, verdict, trained, Path(run_dir), run)  # the three phases
