"""A finished run: the adapter in peft's format with its result.json and the shards it was trained from, marked
complete last (save_final), and found again by a later run with the same training key, which reuses it
(finished_run)."""
from __future__ import annotations

from pathlib import Path

from phase1a.core import layout
from phase1a.core.atomic import atomic_path
from phase1a.core.layout import MARKER
from phase1a.start.replay import write_trained_on
from phase1a.train.result import TrainResult


def finished_run(output_dir: Path) -> TrainResult | None:
    final_dir = output_dir / layout.FINAL
    if not (final_dir / MARKER).is_file():
        return None
    summary = TrainResult.model_validate_json((final_dir / layout.RESULT).read_text())
    return summary.model_copy(update={"reused_completed_run": True})


def save_final(model, final_dir: Path, result: TrainResult, train_path: str, weights: dict | None = None) -> None:
    """The adapter in peft's own format (PeftModel.from_pretrained loads it), with the shards it was trained
    from (a later warm start replays from them), marked complete last. `weights`: the trainable tensors
    gathered whole, when the model holds only its shards (FSDP)."""
    with atomic_path(final_dir) as partial:
        model.save_pretrained(partial, **({"state_dict": weights} if weights is not None else {}))
        write_trained_on(partial, train_path)
        (partial / layout.RESULT).write_text(result.model_dump_json(indent=2))
        (partial / MARKER).write_text("ok\n")
