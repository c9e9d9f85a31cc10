"""Evaluation during training: the eval loss and token accuracy of the weights being trained, on a small fixed
held-out sample, at an interval, and early stopping's bookkeeping, without changing training (docs/validation.md,
"Evaluation during training": when, what, how training stays the same, early stopping across a resume)."""
from __future__ import annotations

import json
import math
import shutil
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from pydantic import BaseModel
from safetensors.torch import save_file

from phase1a.core.atomic import atomic_path, write_atomically
from phase1a.train import distributed
from phase1a.train.checkpoints import load_trainable, trainable_state_dict
from phase1a.train.packing import TokenRows, teacher_forced
from phase1a.train.settings import EvalSettings


class EvalPoint(BaseModel):
    """One line of `eval.jsonl`."""

    step: int
    eval_loss: float
    eval_token_accuracy: float
    examples: int
    tokens: int
    seconds: float
    best: bool  # the best eval loss so far (by more than min_delta)


@dataclass
class EarlyStopping:
    patience: int | None
    min_delta: float = 0.0
    best_step: int | None = None
    best_loss: float | None = None
    since_best: int = 0  # evaluations since the best

    def update(self, step: int, loss: float) -> bool:
        """Whether `loss` at `step` is the new best."""
        improved = not math.isnan(loss) and (self.best_loss is None or loss < self.best_loss - self.min_delta)
        if improved:
            self.best_step, self.best_loss, self.since_best = step, loss, 0
        else:
            self.since_best += 1
        return improved

    @property
    def exhausted(self) -> bool:
        return self.patience is not None and self.since_best >= self.patience

    def state(self) -> dict:
        return {"best_step": self.best_step, "best_loss": self.best_loss, "since_best": self.since_best}

    def restore(self, state: dict | None) -> None:
        if state:
            self.best_step, self.best_loss, self.since_best = (state["best_step"], state["best_loss"],
                                                               state["since_best"])


@contextmanager
def evaluating(model: torch.nn.Module):
    """Eval mode, uncompiled (compiled layers run eagerly: evaluation's rows have shapes of their own), and on exit
    train mode (as it was), compilation and the RNG states as they were."""
    training = model.training
    cpu_rng = torch.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    model.eval()
    try:
        with torch.compiler.set_stance("force_eager"):
            yield model
    finally:
        model.train(training)
        torch.set_rng_state(cpu_rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state_all(cuda_rng)


class Evaluator:
    """The train stage's evaluations: the fixed sample, early stopping, and `best/` in the run's directory."""

    def __init__(self, settings: EvalSettings, output_dir: Path, world: distributed.World, max_length: int) -> None:
        """`max_length`: training's, which its token budget is made of."""
        self.settings, self.world = settings, world
        self.rows = TokenRows.load(settings.validation_path, max_length)
        self.indices = settings.sample(self.rows)
        self.stopping = EarlyStopping(settings.patience, settings.min_delta)
        self.best_dir = Path(output_dir) / "best"
        self.saved_best: int | None = None  # the best step the latest checkpoint (or final adapter) names
        self.count, self.seconds = 0, 0.0

    def __call__(self, model: torch.nn.Module, step: int, token_budget: int) -> EvalPoint:
        """Evaluate the weights after `step`; with early stopping, keep them when they are the best."""
        began = time.perf_counter()
        inner = distributed.unwrap(model)
        with evaluating(inner):
            loss_sum, correct, tokens = teacher_forced(inner, self.rows, self.indices, batch_size=len(self.indices),
                                                       token_budget=token_budget)
        loss, accuracy = distributed.from_main([loss_sum / max(tokens, 1), correct / max(tokens, 1)], self.world)
        best = self.stopping.update(step, loss)
        if best and self.settings.patience is not None:
            self._keep_best(inner, step, loss)
        seconds = time.perf_counter() - began
        self.count, self.seconds = self.count + 1, self.seconds + seconds
        return EvalPoint(step=step, eval_loss=round(loss, 6), eval_token_accuracy=round(accuracy, 6),
                         examples=len(self.indices), tokens=tokens, seconds=round(seconds, 3), best=best)

    def weights_path(self, step: int) -> Path:
        return self.best_dir / f"step-{step:08d}.safetensors"

    def _keep_best(self, model: torch.nn.Module, step: int, loss: float) -> None:
        weights = trainable_state_dict(model)  # every rank: FSDP gathers the shards
        if self.world.main:
            with atomic_path(self.weights_path(step)) as partial:
                save_file(weights, partial)
            self._name_best()
        distributed.barrier(self.world)

    def _name_best(self) -> None:
        """`best/evaluation.json` names the best so far, whose weights are there; the other weights go but for
        the ones the latest checkpoint names, to which a resume from it goes back."""
        step, loss = self.stopping.best_step, self.stopping.best_loss
        write_atomically(self.best_dir / "evaluation.json", json.dumps({"step": step, "eval_loss": loss}) + "\n")
        keep = {self.weights_path(s).name for s in (step, self.saved_best) if s is not None} | {"evaluation.json"}
        for path in self.best_dir.iterdir():
            if path.name not in keep:  # older bests, and scratch files of a write a crash interrupted
                path.unlink()

    def saved(self) -> None:
        """A checkpoint, or the final adapter, was written: it names the best so far, so nothing needs an older
        best's weights any more."""
        self.saved_best = self.stopping.best_step
        if self.world.main and self.settings.patience is not None and self.saved_best is not None:
            self._name_best()

    def restore(self, state: dict | None) -> None:
        """Early stopping's state from the checkpoint a run resumes from (None: none, the run starts afresh), and
        `best/` as it was then: the weights the state names (kept by `_name_best`), none written after it. A
        later best was evaluated on steps being redone: it is earned again or not at all, as eval.jsonl's
        lines after the checkpoint are written again or not."""
        self.stopping.restore(state)
        self.saved_best = step = self.stopping.best_step
        if not self.world.main or self.settings.patience is None:
            return
        if step is None:
            shutil.rmtree(self.best_dir, ignore_errors=True)
            return
        before = self.best_dir / "trainable.safetensors"  # best/ as runs before per-step weights left it
        if before.is_file() and json.loads((self.best_dir / "evaluation.json").read_text())["step"] == step:
            before.rename(self.weights_path(step))
        self._name_best()

    def restore_best(self, model: torch.nn.Module) -> dict | None:
        """Early stopping: the best weights back into `model` for the final save; returns their record."""
        if self.settings.patience is None or not (self.best_dir / "evaluation.json").is_file():
            return None
        record = json.loads((self.best_dir / "evaluation.json").read_text())
        if not self.weights_path(record["step"]).is_file():  # a run from before per-step weights, resumed
            return None
        load_trainable(self.weights_path(record["step"]), distributed.unwrap(model))
        return record
