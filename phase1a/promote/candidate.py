"""A candidate that passed the gate promoted (`promote_candidate`), in named phases:
  1. artifacts  built in the run's scratch directory (artifacts.py): the adapter, and the exports asked for
  2. cards      each artifact's model card (card.py), with what the flow knows of the run
  3. promote    the version copied under `promotion.to`, then the pointer moved (promotion.py), its record naming
                the version it was trained from as its parent
"""
from __future__ import annotations

import shutil
from pathlib import Path

from phase1a.config.schema import Phase1aConfig
from phase1a.evaluate.result import ValidationResult
from phase1a.model.result import ResolvedModel
from phase1a.promote.artifacts import VersionArtifacts
from phase1a.promote.card import BaseModelFacts, CardFacts, RunFacts, write_card
from phase1a.promote.promotion import Promotion, promote
from phase1a.promote.result import PromotionOutcome
from phase1a.store.promoted import PromotionError, PromotionRecord, read_pointer
from phase1a.train.result import TrainResult


def promote_candidate(config: Phase1aConfig, model: ResolvedModel, verdict: ValidationResult, trained: TrainResult,
                      run_dir: Path, run: RunFacts | None = None) -> PromotionOutcome:
    """Promote the run in `run_dir` (its name is the version) whose verdict passed; where its training started
    (`trained.start`) is recorded as the version's parent (None: the base model). With the `run`, every
    artifact gets its model card."""
    destination, start = config.promotion.to, trained.start
    if not verdict.passed:  # the flow never calls this on a fail; a direct caller must not either
        raise PromotionError("refusing to promote a model that failed the gate: " + "; ".join(verdict.reasons))
    if not destination:
        raise PromotionError("promotion.to is not set: nowhere to promote to")
    # The adapter the pointer names already (a second run of the same job): nothing to build, export or copy.
    current = read_pointer(destination, endpoint_url=config.endpoint_for(destination))
    if current and current.adapter_sha256 == verdict.adapter_sha256:
        return PromotionOutcome(pointer=current, promoted=False)
    run_dir = Path(run_dir)
    building = VersionArtifacts(config, Path(model.path), Path(trained.adapter_dir), run_dir / "promote.tmp",
                                run_dir.name)
    try:
        artifacts = {"adapter": building.adapter(), **building.exports()}  # 1. artifacts
        if run is not None:  # 2. cards
            facts = _card_facts(building, verdict, trained, run, artifacts)
            for name, directory in artifacts.items():
                write_card(facts, directory, name)
        record = PromotionRecord(run=str(run_dir), adapter_sha256=verdict.adapter_sha256,
                                 base_model_fingerprint=verdict.model_fingerprint,
                                 sample_fingerprint=verdict.sample_fingerprint,
                                 metric_settings=verdict.metric_settings,
                                 metrics=verdict.candidate.model_dump(mode="json"),
                                 parent=start.version if start else None,
                                 started_from=start.describe() if start else None)
        # 3. promote. Against a promoted baseline the pointer must still be the one the gate saw; else whatever it
        # is now.
        expected = verdict.promoted_seen if config.validation.baseline == "promoted" else ...
        return promote(Promotion(artifacts, run_dir.name, record, expected), destination,
                       endpoint_url=config.endpoint_for(destination))  # the store's, in its bucket
    finally:
        shutil.rmtree(building.scratch, ignore_errors=True)  # copies: promoted, or not wanted


def _card_facts(building: VersionArtifacts, verdict: ValidationResult, trained: TrainResult, run: RunFacts,
                artifacts: dict[str, Path]) -> CardFacts:
    config, start = building.config, trained.start
    exports = {name: sorted(p.name for p in directory.iterdir() if p.is_file())
               for name, directory in artifacts.items() if name != "adapter"}
    return CardFacts(version=building.version, parent=start.version if start else None,
                     started_from=start.describe() if start else "the base model",
                     base=BaseModelFacts.of(config.model.name_or_path, building.model_dir),
                     base_name=config.model.name_or_path, method=config.method.kind, run=run, trained=trained,
                     verdict=verdict, exports=exports)
