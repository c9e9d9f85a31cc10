"""What the tokenize stage hands the plan, train and validate stages: where the tokenized dataset is and what it
holds. Its own module, light on imports: tokenize's cache key covers the code it imports (phase1a/fingerprint.py),
and a dataset should not be tokenized again because the plan's or validation's code changed."""
from __future__ import annotations

from typing import Literal

from pydantic import BaseModel

from phase1a.lengths import LengthStats, Outliers, WasteRow


class TokenizedData(BaseModel):
    fingerprint: str
    dir: str
    train_path: str
    validation_path: str
    histogram_path: str
    train_examples: int
    validation_examples: int
    shards: int  # data files read, the validation source's included
    workers: int = 1  # processes that encoded the records
    template: Literal["chat_template", "fallback"]
    lengths: LengthStats
    outliers: Outliers | None = None  # examples far longer than the rest, named by file and line
    max_seq_length: int
    model_max_length: int
    waste: list[WasteRow]
    skipped: dict[str, int]
    skipped_examples: list[str]
    duplicates: int
    duplicates_dropped: int
    truncated_examples: int
    dropped_overlong: int
    dropped_without_labels: int
