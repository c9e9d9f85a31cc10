import numpy as np
import pytest
import torch

from phase1a.model.loading import load_model
from phase1a.train.packing import IGNORE_INDEX, TokenRows, budget_rows, example_stream, pack, step_indices, summed_loss


@pytest.fixture(scope="module")
def rows() -> TokenRows:
    rng = np.random.default_rng(0)
    lengths = [5, 17, 9, 30, 12]
    ids = [rng.integers(5, 300, n) for n in lengths]
    labels = [np.where(np.arange(n) < n // 2, IGNORE_INDEX, x) for n, x in zip(lengths, ids)]
    return TokenRows(np.concatenate(ids), np.concatenate(labels), np.concatenate([[0], np.cumsum(lengths)]))


@pytest.mark.parametrize("attention", ["sdpa", "sdpa_packed", "eager"])
def test_packed_loss_equals_per_sequence_loss(tiny_model_dir, rows, attention):
    """Every CPU attention the plan can pick keeps a packed row's examples apart (FlashAttention 2 on CUDA:
    test_gpu_paths.py)."""
    import phase1a.model.attention  # noqa: F401  (registers sdpa_packed)

    model = load_model(tiny_model_dir, torch.float32, attention=attention).eval()
    indices = np.arange(len(rows))
    with torch.no_grad():
        packed_loss, packed_correct, packed_tokens = summed_loss(model, pack(rows, indices))
        alone = [summed_loss(model, pack(rows, np.array([i]))) for i in indices]
    assert packed_tokens == sum(t for _, _, t in alone) == rows.supervised_tokens(indices)
    assert int(packed_correct) == sum(int(c) for _, c, _ in alone)
    assert abs(packed_loss.item() - sum(loss.item() for loss, _, _ in alone)) <= 1e-5 * packed_tokens


def test_pack_masks_boundaries_and_restarts_positions(rows):
    batch = pack(rows, np.array([1, 0]))
    assert batch["input_ids"].shape == (1, 22)
    assert batch["position_ids"][0, 17].item() == 0 and batch["position_ids"][0, 16].item() == 16
    assert batch["labels"][0, 0].item() == IGNORE_INDEX and batch["labels"][0, 17].item() == IGNORE_INDEX


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
