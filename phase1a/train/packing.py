"""Padding-free batches: a micro-batch's examples are concatenated into one row with restarting position_ids.

With `position_ids` that restart at 0 and no attention mask, transformers' SDPA path masks attention
block-diagonally, so each example attends only to itself (verified in tests against examples run alone;
it needs `use_cache=False`). No pad tokens are computed, whatever the length spread.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from phase1a.core.labels import IGNORE_INDEX
from phase1a.data.tokenized import SplitView, read_mapped
from phase1a.model.chunked_loss import TokenLoss
from phase1a.train.distributed import World


@dataclass
class TokenRows:
    """Zero-copy view of an Arrow dataset's `input_ids` / `labels` lists (values + offsets)."""

    input_ids: np.ndarray
    labels: np.ndarray
    offsets: np.ndarray
    max_length: int | None = None  # a plan may truncate shorter than the tokenized data

    @classmethod
    def load(cls, path: str | Path, max_length: int | None = None) -> "TokenRows":
        """A tokenized split (a SplitView, .json) or a plain Arrow file of input_ids and labels; examples are
        cut to `max_length` and to the view's own length, whichever is shorter."""
        if str(path).endswith(".json"):
            view = SplitView.read(path)
            table = view.table(path)
            max_length = min(max_length or view.max_length, view.max_length)
        else:
            table = read_mapped(path)
        ids = table.column("input_ids").combine_chunks()
        labels = table.column("labels").combine_chunks()
        return cls(
            input_ids=ids.values.to_numpy(zero_copy_only=False),
            labels=labels.values.to_numpy(zero_copy_only=False),
            offsets=ids.offsets.to_numpy(),
            max_length=max_length,
        )

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def end(self, i: int) -> int:
        end = int(self.offsets[i + 1])
        return end if self.max_length is None else min(end, int(self.offsets[i]) + self.max_length)

    def lengths(self) -> np.ndarray:
        lengths = np.diff(self.offsets)
        return lengths if self.max_length is None else np.minimum(lengths, self.max_length)

    def supervised_tokens(self, indices: np.ndarray) -> int:
        return sum(int((self.labels[self.offsets[i] + 1 : self.end(i)] != IGNORE_INDEX).sum()) for i in indices)


def pack(rows: TokenRows, indices: np.ndarray) -> dict[str, torch.Tensor]:
    """One row holding every example in `indices`; the first label of each example is masked so no example
    is trained to predict the start of the next one."""
    ids, labels, positions = [], [], []
    for i in indices:
        start, end = rows.offsets[i], rows.end(i)
        ids.append(rows.input_ids[start:end])
        example_labels = rows.labels[start:end].copy()
        example_labels[0] = IGNORE_INDEX
        labels.append(example_labels)
        positions.append(np.arange(end - start))
    return {
        "input_ids": torch.from_numpy(np.concatenate(ids).astype(np.int64))[None],
        "labels": torch.from_numpy(np.concatenate(labels).astype(np.int64))[None],
        "position_ids": torch.from_numpy(np.concatenate(positions).astype(np.int64))[None],
    }


def summed_loss(model: torch.nn.Module, batch: dict[str, torch.Tensor]
                ) -> tuple[torch.Tensor, torch.Tensor | None, int]:
    """Summed next-token cross-entropy over supervised tokens, the count of correct argmax predictions (None
    where Liger's kernel computed the loss while training), and the number of supervised tokens. Sums (not means)
    let accumulation normalise over the whole step. The loss is computed in chunks from the hidden states
    (phase1a/model/chunked_loss.py), so the model must come from `phase1a.model.loading.load_model`."""
    targets = batch["labels"][:, 1:]
    out = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], loss_targets=targets,
                use_cache=False)
    if not isinstance(out, TokenLoss):
        raise TypeError(f"{type(out).__name__} has no chunked loss: load the model with "
                        f"phase1a.model.loading.load_model")
    return out.loss, out.correct, int((targets != IGNORE_INDEX).sum())


def step_indices(order: np.ndarray, step: int, batch_size: int, total_examples: int) -> np.ndarray:
    """The examples of optimizer step `step` in the epoch-spanning stream of example indices.

    The stream is a deterministic function of the seed, so resuming at step k needs no re-iteration."""
    start = step * batch_size
    positions = np.arange(start, min(start + batch_size, total_examples))
    return order[positions]


def example_stream(num_examples: int, epochs: float, seed: int) -> tuple[np.ndarray, int]:
    """Concatenated per-epoch permutations, cut to `epochs` worth of examples."""
    total = max(1, round(num_examples * epochs))
    full_epochs = -(-total // num_examples)
    epochs_order = [np.random.default_rng([seed, epoch]).permutation(num_examples) for epoch in range(full_epochs)]
    order = np.concatenate(epochs_order)
    return order[:total], total


def budget_rows(rows: TokenRows, indices: np.ndarray, token_budget: int) -> list[np.ndarray]:
    """Length-aware bucketing of one step's examples into packed rows of at most `token_budget` tokens:
    first-fit decreasing, longest first, each into the first row with room (a row holds at least one example).
    Short examples share rows, so a step takes as few forward passes as the budget allows, and rows come out
    evenly full. Order within a step does not change its gradient: the loss is a sum over examples."""
    lengths = [rows.end(int(i)) - int(rows.offsets[i]) for i in indices]
    bins: list[list[int]] = []
    loads: list[int] = []
    for k in sorted(range(len(indices)), key=lambda k: -lengths[k]):
        for b, load in enumerate(loads):
            if load + lengths[k] <= token_budget:
                bins[b].append(int(indices[k]))
                loads[b] += lengths[k]
                break
        else:
            bins.append([int(indices[k])])
            loads.append(lengths[k])
    return [np.array(b) for b in bins]


class StepBatches(torch.utils.data.Dataset):
    """Optimizer step k -> this rank's packed rows, the whole step's supervised-token count, and a loss weight.

    A pure function of k, so resuming at step k re-iterates nothing, and dataloader workers can pack steps
    ahead of the accelerator. Workers reopen the memory-mapped Arrow file instead of receiving a pickled copy.
    With several ranks each takes every world-th example of the step; a rank left without one (a short last
    step) computes one example with weight 0, so it still joins the gradient all-reduce."""

    def __init__(self, train_path: str | Path, max_length: int | None, order: np.ndarray, batch_size: int,
                 token_budget: int, world: World = World()):
        """`order`: every example the run takes, in order (`example_stream`), `batch_size` a step."""
        self.train_path, self.max_length, self.order = str(train_path), max_length, order
        self.batch_size, self.total_examples, self.token_budget = batch_size, len(order), token_budget
        self.rank, self.world = world.rank, world.size
        self._rows: TokenRows | None = None

    @property
    def rows(self) -> TokenRows:
        if self._rows is None:
            self._rows = TokenRows.load(self.train_path, self.max_length)
        return self._rows

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_rows": None}

    def __len__(self) -> int:
        return -(-self.total_examples // self.batch_size)

    def __getitem__(self, step: int) -> dict:
        indices = step_indices(self.order, step, self.batch_size, self.total_examples)
        mine, weight = indices[self.rank :: self.world], 1.0
        if len(mine) == 0:
            mine, weight = indices[:1], 0.0
        rows = budget_rows(self.rows, mine, self.token_budget)
        return {"micro_batches": [pack(self.rows, row) for row in rows],
                "supervised": self.rows.supervised_tokens(indices), "weight": weight}


def token_budget(micro_batch_size: int, max_seq_length: int) -> int:
    """A packed row's token budget: `micro_batch_size` examples of the longest allowed length."""
    return micro_batch_size * max_seq_length


def step_loader(batches: StepBatches, steps, workers: int, pin_memory: bool) -> torch.utils.data.DataLoader:
    """Steps in order; with workers, two steps a worker are packed (and pinned) ahead.

    Workers start from a fork server, not a fork of this process: a process that ran a Prefect flow carries
    Prefect's exit hooks into a forked child, where they fail (exit code 1) and take the loader down when it
    shuts its workers. `StepBatches` pickles without its rows, so starting a worker this way copies nothing.

    Each iterator draws its workers' base seed from the loader's generator: without one it draws from the global
    RNG, which dropout draws from, and a loader made anew on resuming (or after an out-of-memory back-off) would
    move dropout's stream away from the uninterrupted run's. Packing a step draws no random number."""
    return torch.utils.data.DataLoader(batches, batch_size=None, sampler=steps, num_workers=workers,
                                       pin_memory=pin_memory, prefetch_factor=2 if workers else None,
                                       multiprocessing_context="forkserver" if workers else None,
                                       generator=torch.Generator())
