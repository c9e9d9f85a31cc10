"""Packed rows: a micro-batch's examples laid end to end in one row, with their boundaries as `cu_seqlens`.

Every example restarts its position_ids at 0, and its boundaries travel beside it (`PackedRow`): the `varlen`
attention (phase1a/model/attention.py) computes each example against itself in one call per layer; transformers'
SDPA and eager paths mask the row block-diagonally from the restarting positions instead (verified in tests
against examples run alone; it needs `use_cache=False`).

Where shapes must repeat (a GPU, a compiled model), rows are static (`RowShape`): each is padded up to one of a few
lengths, padding being segments of its own without labels, and `cu_seqlens` has a fixed number of slots, so
every micro-batch of a run has one of a few shapes and the step reads nothing back from the device. On a CPU
running eagerly rows are exact: a padded token costs as much as a real one there, and shapes cost nothing.
"""
from __future__ import annotations

import bisect
import dataclasses
import multiprocessing
import multiprocessing.forkserver
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from phase1a.core.labels import IGNORE_INDEX
from phase1a.core.meter import Meter
from phase1a.data.tokenized import SplitView, read_mapped
from phase1a.model.attention import NAME as VARLEN, packed_forward
from phase1a.model.chunked_loss import TokenLoss
from phase1a.train.distributed import World, unwrap


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


# Row lengths where shapes must repeat (an accelerator, a compiled model): multiples of 64 tokens (tensor-core
# tiles), at most `BUCKETS` of them, so a compiled layer or a captured graph is built a handful of times a run,
# never once a step.
ALIGN = 64
BUCKETS = 4
# A static row's padding is split into segments of at most this many tokens: its attention costs P x 256 where a
# single padding segment would cost P squared.
PAD_SEGMENT = 256
PAD_TOKEN = 0  # any valid id: padding carries no label, and attends only to padding


@dataclass(frozen=True)
class RowShape:
    """The shapes a run's packed rows take. A row holds at most `tokens`; a static row is padded up to the shortest
    of `buckets` that holds it (none: exact rows, no padding); `cu_seqlens` has `capacity` + 1 entries;
    `max_seqlen` bounds every segment (the kernel's grid), the same for every row of the run."""

    tokens: int
    buckets: tuple[int, ...]
    capacity: int
    max_seqlen: int

    @classmethod
    def of(cls, budget: int, max_length: int, examples: int, static: bool,
           step_tokens: np.ndarray | None = None) -> "RowShape":
        """`budget`: the tokens a row may hold (the memory model's micro-batch); `examples`: a rank's examples a
        step, the most a row can hold; `step_tokens`: each step's tokens on the rank (rows never span steps: the
        fullest step caps a static row, and the buckets follow how full the steps' rows are). Static: at most
        `BUCKETS` lengths, multiples of `ALIGN`; else exact rows."""
        max_seqlen = int(min(max_length, budget))
        if not static:
            return cls(tokens=int(budget), buckets=(), capacity=examples, max_seqlen=max_seqlen)
        steps = np.asarray(step_tokens if step_tokens is not None and len(step_tokens) else [budget])
        tokens = _round_up(max(min(budget, int(steps.max())), max_seqlen), ALIGN)
        buckets = _buckets(steps, tokens)
        widest = max(high - low for low, high in zip((0, *buckets), buckets))  # the most padding a row can get
        pads = -(-(widest - 1) // min(PAD_SEGMENT, max_seqlen))
        return cls(tokens=tokens, buckets=buckets, capacity=examples + pads, max_seqlen=max_seqlen)

    @property
    def static(self) -> bool:
        return bool(self.buckets)

    def length_for(self, used: int) -> int:
        """The row length that holds `used` tokens: the shortest bucket, or `used` itself for exact rows."""
        if not self.buckets:
            return used
        return self.buckets[bisect.bisect_left(self.buckets, used)]

    def lengths(self) -> list[int]:
        """Every row length a static shape allows (none for exact rows)."""
        return list(self.buckets)


def _buckets(step_tokens: np.ndarray, tokens: int) -> tuple[int, ...]:
    """At most `BUCKETS` row lengths up to `tokens`, at the quantiles of how many tokens the steps' last rows hold
    (a step's other rows are full: they take `tokens`), so that padding follows the run's own steps."""
    last = step_tokens - (np.ceil(step_tokens / tokens) - 1) * tokens
    quantiles = np.quantile(last, [k / BUCKETS for k in range(1, BUCKETS)])
    return tuple(sorted({*(min(tokens, _round_up(int(q), ALIGN)) for q in quantiles), tokens}))


def static_rows(device: torch.device, compile: bool) -> bool:
    """Rows of a few shapes where shapes matter (an accelerator's kernels and graphs, a compiled model); exact rows
    on a CPU running eagerly."""
    return device.type != "cpu" or compile


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


@dataclass(frozen=True)
class PackedRow:
    """One micro-batch: a row of examples laid end to end (batch 1), their boundaries, and what the host knows of
    it without reading the device. `cu_seqlens` is int32, starts at 0 and rises to the row's length; padding is
    segments of its own with no labels, and unused slots are zero-length segments at the end."""

    input_ids: torch.Tensor  # (1, L) int64
    labels: torch.Tensor  # (1, L) int64, IGNORE_INDEX where nothing is learnt
    position_ids: torch.Tensor  # (1, L) int64, restarting at 0 in every segment
    cu_seqlens: torch.Tensor  # (capacity + 1,) int32
    max_seqlen: int  # bounds every segment
    tokens: int  # the examples' tokens: L less the padding
    supervised: int  # labelled next-token targets in the row

    @property
    def length(self) -> int:
        return self.input_ids.size(1)

    def _map(self, fn) -> "PackedRow":
        moved = {name: fn(getattr(self, name)) for name in ("input_ids", "labels", "position_ids", "cu_seqlens")}
        return dataclasses.replace(self, **moved)

    def to(self, device, non_blocking: bool = False) -> "PackedRow":
        return self._map(lambda t: t.to(device, non_blocking=non_blocking))

    def pin_memory(self) -> "PackedRow":
        return self._map(lambda t: t.pin_memory())

    def model_inputs(self) -> dict:
        """The forward's keyword arguments; the boundaries under the names transformers' varlen paths read."""
        return {"input_ids": self.input_ids, "position_ids": self.position_ids, "cu_seq_lens_q": self.cu_seqlens,
                "cu_seq_lens_k": self.cu_seqlens, "max_length_q": self.max_seqlen, "max_length_k": self.max_seqlen}


def pack(rows: TokenRows, indices: np.ndarray, shape: RowShape | None = None, length: int | None = None
         ) -> PackedRow:
    """One row holding every example in `indices`; the first label of each example is masked so no example is
    trained to predict the start of the next one. With `shape`, padded to its length for what the row holds (or
    to `length`, one of its lengths) and to its segment capacity; without, exactly the examples."""
    ids, labels, positions, lengths = [], [], [], []
    for i in indices:
        start, end = rows.offsets[i], rows.end(i)
        ids.append(rows.input_ids[start:end])
        example_labels = rows.labels[start:end].copy()
        example_labels[0] = IGNORE_INDEX
        labels.append(example_labels)
        positions.append(np.arange(end - start))
        lengths.append(int(end - start))
    used = sum(lengths)
    longest = max(lengths)
    capacity = len(lengths)
    if shape is not None:
        if used > shape.tokens or len(lengths) > shape.capacity or longest > shape.max_seqlen:
            raise ValueError(f"{len(lengths)} examples of {used} tokens (longest {longest}) exceed the row shape "
                             f"{shape}")
        padding = (length or shape.length_for(used)) - used
        if padding < 0 or (length is not None and shape.static and length not in shape.buckets):
            raise ValueError(f"{used} tokens cannot be padded to {length} in the row shape {shape}")
        step = min(PAD_SEGMENT, shape.max_seqlen)
        pads = [step] * (padding // step) + ([padding % step] if padding % step else [])
        ids.append(np.full(padding, PAD_TOKEN, dtype=rows.input_ids.dtype))
        labels.append(np.full(padding, IGNORE_INDEX, dtype=rows.labels.dtype))
        positions.extend(np.arange(n) for n in pads)
        lengths.extend(pads)
        capacity, longest = shape.capacity, shape.max_seqlen
    bounds = np.zeros(capacity + 1, dtype=np.int32)
    bounds[1 : len(lengths) + 1] = np.cumsum(lengths)
    bounds[len(lengths) + 1 :] = bounds[len(lengths)]
    label_row = np.concatenate(labels).astype(np.int64)
    return PackedRow(
        input_ids=torch.from_numpy(np.concatenate(ids).astype(np.int64))[None],
        labels=torch.from_numpy(label_row)[None],
        position_ids=torch.from_numpy(np.concatenate(positions).astype(np.int64))[None],
        cu_seqlens=torch.from_numpy(bounds), max_seqlen=int(longest), tokens=int(used),
        supervised=int((label_row[1:] != IGNORE_INDEX).sum()))


def rows_of_every_length(rows: TokenRows, shape: RowShape, example: int) -> list[PackedRow]:
    """A row of each length a static shape allows, to build every shape before a step is timed: `example` padded
    to it, or the run's shortest example where `example` is longer than that length. A length no example fits is
    left out: no row of the run can take it (a row holds one example at least)."""
    sizes = rows.lengths()
    shortest = int(np.argmin(sizes))
    made = []
    for length in shape.lengths():
        chosen = example if sizes[example] <= length else shortest
        if sizes[chosen] <= length:
            made.append(pack(rows, np.array([chosen]), shape, length))
    return made


def summed_loss(model: torch.nn.Module, row: PackedRow) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Summed next-token cross-entropy over supervised tokens, and the count of correct argmax predictions (None
    where Liger's kernel computed the loss while training), both on the device: nothing here reads it. Sums (not
    means) let accumulation normalise over the whole step. The loss is computed in chunks from the hidden states
    (phase1a/model/chunked_loss.py), so the model must come from `phase1a.model.loading.load_model`."""
    inputs = row.model_inputs()
    if getattr(unwrap(model).config, "_attn_implementation", None) == VARLEN:
        # A mask that says "no padding" spares transformers its scan of position_ids for packed sequences (a host
        # read); inside packed_forward the varlen mask function turns it into no mask at all.
        inputs["attention_mask"] = torch.ones_like(row.input_ids, dtype=torch.bool)
    with packed_forward():
        out = model(**inputs, loss_targets=row.labels[:, 1:], use_cache=False)
    if not isinstance(out, TokenLoss):
        raise TypeError(f"{type(out).__name__} has no chunked loss: load the model with "
                        f"phase1a.model.loading.load_model")
    return out.loss, out.correct


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


@torch.no_grad()
def teacher_forced(model: torch.nn.Module, rows: TokenRows, indices: np.ndarray,
                   batch_size: int, token_budget: int | None = None, meter: Meter | None = None
                   ) -> tuple[float, int, int]:
    """Summed loss, correct arg-max predictions and supervised tokens, over packed batches of `batch_size`
    examples, or with `token_budget` over rows of at most that many tokens (training's own rows: what is known
    to fit on the device beside the optimizer state, when training evaluates); `meter` counts the batches and
    their supervised tokens."""
    device = next(model.parameters()).device
    # Summed on the device and read once at the end: a read per batch would wait for each batch in turn.
    loss_sum = torch.zeros((), dtype=torch.float64, device=device)
    correct = torch.zeros((), dtype=torch.int64, device=device)
    tokens = 0
    groups = (budget_rows(rows, indices, token_budget) if token_budget is not None
              else [indices[start : start + batch_size] for start in range(0, len(indices), batch_size)])
    for group in groups:
        row = pack(rows, group)
        loss, right = summed_loss(model, row.to(device))
        loss_sum += loss.double()
        correct += right
        tokens += row.supervised
        if meter is not None:
            meter.advance(1, tokens=row.supervised)
    return float(loss_sum), int(correct), tokens


@dataclass(frozen=True)
class RowBudget:
    """What a run's rows may hold: `tokens` at most (the memory model's micro-batch, `token_budget`), and whether
    their shapes must repeat (`static_rows`: a few lengths, `RowShape`)."""

    tokens: int
    static: bool = False


@dataclass(frozen=True)
class StepBatch:
    """One optimizer step as a rank runs it: its rows, the whole step's supervised tokens (every rank's: the loss
    is normalised over them), and the rank's loss weight (0 for a rank with nothing left to compute)."""

    micro_batches: list[PackedRow]
    supervised: int
    step_tokens: int  # the examples' tokens of the whole step, every rank's
    weight: float = 1.0

    @property
    def tokens(self) -> int:
        """The examples' tokens in this rank's rows (padding not counted)."""
        return sum(row.tokens for row in self.micro_batches)

    @property
    def padded_tokens(self) -> int:
        return sum(row.length for row in self.micro_batches)

    def pin_memory(self) -> "StepBatch":
        return dataclasses.replace(self, micro_batches=[row.pin_memory() for row in self.micro_batches])


class StepBatches(torch.utils.data.Dataset):
    """Optimizer step k -> this rank's packed rows (`StepBatch`).

    A pure function of k, so resuming at step k re-iterates nothing, and dataloader workers can pack steps
    ahead of the accelerator. Workers reopen the memory-mapped Arrow file instead of receiving a pickled copy.
    With several ranks each takes every world-th example of the step; a rank left without one (a short last
    step) computes one example with weight 0, so it still joins the gradient all-reduce. With a static budget every
    row has one of the few lengths of `shape` (`RowShape.of`)."""

    def __init__(self, train_path: str | Path, max_length: int | None, order: np.ndarray, batch_size: int,
                 budget: RowBudget, world: World = World()):
        """`order`: every example the run takes, in order (`example_stream`), `batch_size` a step."""
        self.train_path, self.max_length, self.order = str(train_path), max_length, order
        self.batch_size, self.total_examples, self.budget = batch_size, len(order), budget
        self.rank, self.world = world.rank, world.size
        self._rows: TokenRows | None = None
        self._shape: RowShape | None = None

    @property
    def rows(self) -> TokenRows:
        if self._rows is None:
            self._rows = TokenRows.load(self.train_path, self.max_length)
        return self._rows

    @property
    def shape(self) -> RowShape:
        """Decided once from the whole run's steps, so that every row of the run shares it."""
        if self._shape is None:
            lengths = self.rows.lengths()
            self._shape = RowShape.of(self.budget.tokens, int(lengths.max()), -(-self.batch_size // self.world),
                                      self.budget.static, self._step_tokens(lengths))
        return self._shape

    def _step_tokens(self, lengths: np.ndarray) -> np.ndarray:
        """Each step's tokens on this rank, from every example's length."""
        position = np.arange(len(self.order))
        mine = (position % self.batch_size) % self.world == self.rank
        return np.bincount(position[mine] // self.batch_size, weights=lengths[self.order][mine],
                           minlength=len(self)).astype(np.int64)

    def padding_share(self, samples: int = 256) -> float:
        """Padding's share of the rows' tokens, over up to `samples` steps spread over the run."""
        picked = np.unique(np.linspace(0, len(self) - 1, min(samples, len(self))).astype(int))
        lengths, padded, used = self.rows.lengths(), 0, 0
        for step in picked:
            for row in self.rows_of(int(step)):
                tokens = int(lengths[row].sum())
                used, padded = used + tokens, padded + self.shape.length_for(tokens)
        return 1.0 - used / max(padded, 1)

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_rows": None}

    def __len__(self) -> int:
        return -(-self.total_examples // self.batch_size)

    def _mine(self, step: int) -> tuple[np.ndarray, np.ndarray, float]:
        indices = step_indices(self.order, step, self.batch_size, self.total_examples)
        mine, weight = indices[self.rank :: self.world], 1.0
        if len(mine) == 0:
            mine, weight = indices[:1], 0.0
        return indices, mine, weight

    def rows_of(self, step: int) -> list[np.ndarray]:
        """Step `step`'s examples on this rank, grouped into rows."""
        return budget_rows(self.rows, self._mine(step)[1], self.shape.tokens)

    def __getitem__(self, step: int) -> StepBatch:
        indices, _, weight = self._mine(step)
        return StepBatch(micro_batches=[pack(self.rows, row, self.shape) for row in self.rows_of(step)],
                         supervised=self.rows.supervised_tokens(indices),
                         step_tokens=int(sum(self.rows.end(int(i)) - int(self.rows.offsets[i]) for i in indices)),
                         weight=weight)


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
                                       multiprocessing_context=_fork_server() if workers else None,
                                       generator=torch.Generator())


def start_fork_server() -> None:
    """Start the workers' fork server now, in the background: its one import overlaps the model's loading instead
    of the first loader's start (15 s of a calibration trial on an H200 host, whose steps take milliseconds)."""
    _fork_server()
    multiprocessing.forkserver.ensure_running()


def _fork_server() -> multiprocessing.context.BaseContext:
    """The fork server imports this module once (torch and transformers: several seconds) and each worker forks
    from it ready: a worker that imported it itself, to unpickle `StepBatches`, started in seconds, and four of
    them took 42 s of a 90 s calibration on an H200 host. Set before the server first starts; later it is kept."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["__main__", __name__])  # __main__: the server's default
    return context
