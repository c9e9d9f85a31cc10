"""Speed-ups must not cost accuracy: each one the train stage uses gives the same loss and gradients on the same
batch, within a stated tolerance. Packing has its own test (test_packing.py: packed loss == per-example loss)."""
import numpy as np
import pytest
import torch

from phase1a.config import MethodConfig
from phase1a.packing import TokenRows, pack, summed_loss
from tasks.tokenize import TokenizeOptions, tokenize_dataset
from tasks.train import build_model
from conftest import date_records, make_tokenizer, write_jsonl

# fp32 on CPU: recomputing the forward pass in the backward is the same arithmetic in the same order, so only
# rounding noise may differ.
RTOL, ATOL = 1e-5, 1e-7


@pytest.fixture(scope="module")
def batch(tmp_path_factory) -> dict[str, torch.Tensor]:
    root = tmp_path_factory.mktemp("speedups")
    data = tokenize_dataset(write_jsonl(root / "d.jsonl", date_records(24)), make_tokenizer(), 256,
                            TokenizeOptions(), root / "cache", "fp")
    return pack(TokenRows.from_arrow(data.train_path), np.arange(8))


@pytest.mark.parametrize("kind", ["lora", "full"])
def test_gradient_checkpointing_leaves_loss_and_gradients_unchanged(tiny_model_dir, batch, kind):
    outcomes = []
    for checkpointing in (False, True):
        torch.manual_seed(0)  # the same LoRA initialisation both times
        model = build_model(tiny_model_dir, MethodConfig(kind=kind, lora={"r": 4, "alpha": 8}), checkpointing)
        model.train()
        assert model.is_gradient_checkpointing == checkpointing  # really recomputing in the second pass
        loss, _, tokens = summed_loss(model, batch)
        (loss / tokens).backward()
        grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.requires_grad}
        outcomes.append((loss.item(), grads))
    (plain_loss, plain), (checkpointed_loss, checkpointed) = outcomes
    assert checkpointed_loss == pytest.approx(plain_loss, rel=RTOL)
    assert plain.keys() == checkpointed.keys() and plain
    assert any(g.abs().sum() > 0 for g in plain.values())  # a real gradient, not zeros compared with zeros
    for name in plain:
        torch.testing.assert_close(checkpointed[name], plain[name], rtol=RTOL, atol=ATOL)
