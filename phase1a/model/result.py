"""The model stage's result: the run's model on local disk and the fingerprints the stages key on (what
phase1a/model/loading.py `prepare_model` makes and the flow hands the later stages)."""
from __future__ import annotations

from pydantic import BaseModel


class ResolvedModel(BaseModel):
    """A model on local disk, with the fingerprints the stages key on, computed once a run."""

    path: str
    fingerprint: str  # the weights and config: plan, train and validate key on it
    tokenizer_fingerprint: str  # tokenize keys on it
    max_positions: int  # the longest sequence the model takes
