import numpy as np
import pytest
import torch

from phase1a.model.loading import load_model
from phase1a.train.packing import (
    BUCKETS,
    IGNORE_INDEX,
    RowBudget,
    RowShape,
    StepBatches,
    TokenRows,
    budget_rows,
    example_stream,
    pack,
    rows_of_every_length,
    step_indices,
    summed_loss,
)


@pytest.fixture(scope="module")
def rows() -> TokenRows:
    rng = np.random.default_rng(0)
    lengths = [5, 17, 9, 30, 12]
    ids = [rng.integers(5, 300, n) for n in lengths]
    labels = [np.where(np.arange(n) < n // 2, IGNORE_INDEX, x) for n, x in zip(lengths, ids)]
    return TokenRows(np.concatenate(ids), np.concatenate(labels), np.concatenate([[0], np.cumsum(lengths)]))


@pytest.mark.parametrize("attention", ["sdpa", "varlen", "eager"])
def test_packed_loss_equals_per_sequence_loss(tiny_model_dir, rows, attention):
    """Every CPU attention the plan can pick keeps a packed row's examples apart (FlashAttention 2 on CUDA:
    test_gpu_paths.py)."""
    import phase1a.model.attention  # noqa: F401  (registers varlen)

    model = load_model(tiny_model_dir, torch.float32, attention=attention).eval()
    indices = np.arange(len(rows))
    static = RowShape.of(128, 30, len(rows), static=True, step_tokens=np.array([73, 128]))
    packed_rows = [pack(rows, indices), pack(rows, indices, static)]  # exact, and padded to a static shape
    with torch.no_grad():
        packed = [summed_loss(model, row) for row in packed_rows]
        alone = [pack(rows, np.array([i])) for i in indices]
        alone_losses = [summed_loss(model, row) for row in alone]
    tokens = sum(row.supervised for row in alone)
    assert [row.supervised for row in packed_rows] == [tokens, tokens] and tokens == rows.supervised_tokens(indices)
    for loss, correct in packed:
        assert int(correct) == sum(int(c) for _, c in alone_losses)
        assert abs(loss.item() - sum(loss.item() for loss, _ in alone_losses)) <= 1e-5 * tokens


def test_pack_masks_boundaries_and_restarts_positions(rows):
    row = pack(rows, np.array([1, 0]))
    assert row.input_ids.shape == (1, 22) and row.tokens == 22 and row.max_seqlen == 17
    assert row.position_ids[0, 17].item() == 0 and row.position_ids[0, 16].item() == 16
    assert row.labels[0, 0].item() == IGNORE_INDEX and row.labels[0, 17].item() == IGNORE_INDEX
    assert row.cu_seqlens.tolist() == [0, 17, 22] and row.cu_seqlens.dtype == torch.int32


def test_a_static_row_pads_with_unlabelled_segments_to_one_of_its_lengths(rows):
    """73 tokens in a shape whose steps hold 40 to 128 tokens (buckets at their quartiles, multiples of 64: 64 and
    128; segments of at most 30): padded to 128 with 55 unlabelled tokens in segments of 30 and 25 whose positions
    restart, then one zero-length slot."""
    shape = RowShape.of(128, 30, 5, static=True, step_tokens=np.array([40, 50, 60, 128]))
    assert (shape.tokens, shape.buckets, shape.capacity, shape.max_seqlen) == (128, (64, 128), 8, 30)
    row = pack(rows, np.arange(5), shape)
    assert row.length == 128 and row.tokens == 73 and row.max_seqlen == 30
    assert row.cu_seqlens.tolist() == [0, 5, 22, 31, 61, 73, 103, 128, 128]
    assert (row.labels[0, 73:] == IGNORE_INDEX).all() and row.position_ids[0, 103].item() == 0
    assert row.supervised == rows.supervised_tokens(np.arange(5))
    with pytest.raises(ValueError, match="exceed the row shape"):
        pack(rows, np.arange(5), RowShape.of(64, 30, 5, static=True))


def test_a_row_of_every_length_holds_an_example_that_fits_it():
    """Warm-up rows for a static shape of 64 and 128 tokens: the asked example (100 tokens) where it fits, the
    shortest (80) where it does not, and no row where no example fits (none of the run's rows can take that length).
    A run whose first example was longer than its shortest length failed here before (GPU check, CI stop 46)."""
    lengths = [100, 80, 120]
    ids = [np.arange(5, 5 + n) for n in lengths]
    rows = TokenRows(np.concatenate(ids), np.concatenate(ids), np.concatenate([[0], np.cumsum(lengths)]))
    shape = RowShape.of(128, 120, 3, static=True, step_tokens=np.array([40, 50, 60, 128]))
    assert shape.buckets == (64, 128)
    assert [(row.length, row.tokens) for row in rows_of_every_length(rows, shape, 0)] == [(128, 100)]
    wide = RowShape.of(256, 120, 3, static=True, step_tokens=np.array([90, 100, 110, 120, 256]))
    assert wide.buckets == (128, 256)
    assert [(row.length, row.tokens) for row in rows_of_every_length(rows, wide, 2)] == [(128, 120), (256, 120)]
    short = TokenRows(np.concatenate(ids), np.concatenate(ids), np.array([0, 100, 120, 300]))  # 100, 20, 180 tokens
    assert [(row.length, row.tokens) for row in rows_of_every_length(short, wide, 0)] == [(128, 100), (256, 100)]
    assert [(row.length, row.tokens) for row in rows_of_every_length(short, shape, 0)] == [(64, 20), (128, 100)]


def test_static_buckets_follow_the_steps_rows():
    """At most BUCKETS lengths, multiples of 64, the last the fullest step (within the budget): at the quartiles of
    the steps' last rows, so padding follows the run. Steps longer than the budget fill rows of the budget first."""
    steps = np.array([900, 1000, 1100, 1200, 1300, 1400, 1500, 2900])
    shape = RowShape.of(4096, 512, 16, static=True, step_tokens=steps)
    assert shape.tokens == 2944 and shape.buckets == (1088, 1280, 1472, 2944) and shape.max_seqlen == 512
    assert shape.capacity == 16 + -(-(2944 - 1472 - 1) // 256)  # the widest gap's padding in segments of 256
    assert [shape.length_for(n) for n in (1, 1088, 1089, 2944)] == [1088, 1088, 1280, 2944]
    split = RowShape.of(1024, 512, 16, static=True, step_tokens=np.array([1500, 1600, 2100, 3000]))
    assert split.tokens == 1024 and split.buckets[-1] == 1024 and len(split.buckets) <= BUCKETS
    assert all(b % 64 == 0 for b in split.buckets)
    exact = RowShape.of(1024, 512, 16, static=False)
    assert exact.buckets == () and exact.length_for(77) == 77 and exact.capacity == 16


def test_every_micro_batch_of_an_epoch_has_one_of_a_few_shapes(tmp_path):
    """300 examples of 3 to 60 tokens, batches of 16, rows of at most 4 examples of 60 tokens: every row of the
    epoch has one of the static lengths (at most BUCKETS), the same cu_seqlens shape, and boundaries that rise from 0
    to the row's length; the examples' tokens and their supervised targets are those of the data."""
    import pyarrow as pa
    import pyarrow.feather as feather

    rng = np.random.default_rng(0)
    lengths = rng.integers(3, 61, 300)
    ids = [rng.integers(5, 300, n).tolist() for n in lengths]
    labels = [[IGNORE_INDEX] * (len(x) // 2) + x[len(x) // 2:] for x in ids]
    path = tmp_path / "train.arrow"
    feather.write_feather(pa.table({"input_ids": ids, "labels": labels}), path, compression="uncompressed")
    order, _ = example_stream(300, 1.0, seed=0)
    batches = StepBatches(path, None, order, 16, RowBudget(4 * 60, static=True))
    shapes, seen = set(), 0
    for step in range(len(batches)):
        batch = batches[step]
        for row in batch.micro_batches:
            shapes.add((tuple(row.input_ids.shape), tuple(row.cu_seqlens.shape)))
            bounds = row.cu_seqlens.numpy()
            assert row.cu_seqlens.dtype == torch.int32 and bounds[0] == 0 and bounds[-1] == row.length
            assert (np.diff(bounds) >= 0).all() and (row.labels[0, row.tokens:] == IGNORE_INDEX).all()
        seen += batch.tokens
        assert batch.step_tokens == batch.tokens  # one rank: the step is its rows
    assert seen == lengths.sum()
    assert len(shapes) <= BUCKETS and len({cu for _, cu in shapes}) == 1
    assert {length for (_, length), _ in shapes} <= set(batches.shape.lengths())
    assert 0 < batches.padding_share() < 0.25


def test_example_stream_is_deterministic_and_spans_epochs():
    order, total = example_stream(10, 2.5, seed=3)
    again, _ = example_stream(10, 2.5, seed=3)
    assert total == 25 and np.array_equal(order, again)
    assert sorted(order[:10]) == list(range(10)) and sorted(order[10:20]) == list(range(10))
    assert list(step_indices(order, 3, 8, total)) == list(order[24:25])


def test_budget_rows_bucket_by_length_within_the_budget(rows):
    indices = np.arange(len(rows))  # lengths 5, 17, 9, 30, 12
    packed = budget_rows(rows, indices, token_budget=32)
    assert sorted(int(i) for row in packed for i in row) == list(range(5))  # every example exactly once
    assert [int(sum(rows.lengths()[row])) for row in packed] == [30, 29, 14]  # first-fit, longest first
    assert [len(row) for row in budget_rows(rows, indices, token_budget=10)] == [1, 1, 1, 1, 1]  # too long: alone
    assert len(budget_rows(rows, indices, token_budget=1000)) == 1
