"""The GPU paths on a CUDA device: packed rows in bf16 under each attention implementation the plan can pick, a
training step that never waits for the device, compiled layers and CUDA graphs, the 4-bit (NF4) base, the 8-bit
optimizer, NVML utilisation and the train stage itself. Every test
here skips without CUDA; `make gpu-check` runs them (with test_speedups.py's CUDA tests) as `pytest -m gpu`.

Tolerances are bf16's: 8 bits of mantissa, so sums of a few hundred terms agree to about 1e-2 relative.
"""
import importlib.util
from pathlib import Path

import numpy as np
import pytest
import torch

from helpers import date_records, make_tokenizer, write_jsonl
from phase1a.config.schema import MethodConfig
from phase1a.data.tokenizing import TokenizeOptions, tokenize_dataset
from phase1a.model.build import Compilation, build_model, make_optimizer
from phase1a.train.loop import train
from phase1a.train.packing import (
    RowBudget,
    StepBatches,
    TokenRows,
    example_stream,
    pack,
    summed_loss,
    token_budget,
)
from phase1a.train.settings import TrainSettings
from phase1a.train.steps import optimizer_step

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
METHOD = MethodConfig(batch_size=8, lora={"r": 4, "alpha": 8}, learning_rate=1e-2, liger="off")
BF16 = 2e-2


def _needs(package: str):
    return pytest.mark.skipif(importlib.util.find_spec(package) is None, reason=f"needs {package}")


@pytest.fixture(scope="module")
def train_path(tmp_path_factory) -> str:
    root = tmp_path_factory.mktemp("gpu-paths")
    data = write_jsonl(root / "d.jsonl", date_records(48))
    return tokenize_dataset(data, make_tokenizer(), 256, TokenizeOptions(), root / "cache" / "fp").train_path


def _on_cuda(row):
    return row.to("cuda")


def _step(model, optimizer, batch) -> float:
    loss, _ = summed_loss(model, batch)
    (loss / batch.supervised).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.item() / batch.supervised


def _static_steps(train_path: str, count: int) -> list:
    """The first `count` steps of 8 examples in static rows, as training on a GPU packs them."""
    order, _ = example_stream(len(TokenRows.load(train_path)), 1.0, seed=0)
    batches = StepBatches(train_path, 256, order, 8, RowBudget(token_budget(4, 256), static=True))
    return [batches[k] for k in range(count)]


@pytest.mark.parametrize("attention", ["sdpa", "varlen",
                                       pytest.param("flash_attention_2", marks=_needs("flash_attn"))])
def test_packed_loss_equals_per_example_loss_in_bf16(tiny_model_dir, train_path, attention):
    """Packed rows stop at example boundaries under the implementation training runs: SDPA's block-diagonal mask,
    varlen (FlashAttention 2's varlen kernel, one call a layer, in a static row with padding segments),
    flash-attn's own kernel."""
    model = build_model(tiny_model_dir, METHOD.model_copy(update={"attention": attention}), False).eval()
    assert model.config._attn_implementation == attention and next(model.parameters()).dtype == torch.bfloat16
    rows = TokenRows.load(train_path)
    order, _ = example_stream(len(rows), 1.0, seed=0)
    step = _static_steps(train_path, 1)[0]  # the first step's 8 examples, in static rows
    assert step.padded_tokens > step.tokens
    with torch.no_grad():
        packed = sum(summed_loss(model, _on_cuda(row))[0].item() for row in step.micro_batches)
        exact = summed_loss(model, _on_cuda(pack(rows, order[:8])))[0].item()
        alone = sum(summed_loss(model, _on_cuda(pack(rows, order[i:i + 1])))[0].item() for i in range(8))
    assert packed == pytest.approx(alone, rel=BF16) and exact == pytest.approx(alone, rel=BF16)


def test_a_training_step_never_waits_for_the_device(tiny_model_dir, train_path):
    """Every micro-batch's forward and backward and the update, under CUDA's sync debug mode set to error: a host
    read of a device value inside the step raises. The progress reads the numbers after, once."""
    model = build_model(tiny_model_dir, METHOD, False)
    model.train()
    optimizer = make_optimizer(model, METHOD)
    steps = _static_steps(train_path, 3)
    optimizer_step(model, optimizer, steps[0])  # first-call set-up (cuBLAS handles, allocator) outside the check
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        outcomes = [optimizer_step(model, optimizer, step) for step in steps[1:]]
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert all(np.isfinite([o.loss.item() for o in outcomes]))


@pytest.mark.parametrize("liger", ["off", pytest.param("auto", marks=_needs("liger_kernel"))])
@pytest.mark.parametrize("cuda_graphs", [False, True])
def test_compiled_layers_and_cuda_graphs_leave_the_loss_unchanged(tiny_model_dir, train_path, cuda_graphs, liger):
    """Three optimizer steps of static rows: compiled layers (and each replayed as a CUDA graph) follow the eager
    model's losses within bf16 noise. With Liger (`auto`) the eager layers run its kernels and the compiled ones
    trace the model's own forwards, whole (on 2026-11-27 Liger's RoPE broke the graph here: phase1a/model/liger.py)."""
    steps = _static_steps(train_path, 3)
    method = METHOD.model_copy(update={"liger": liger})
    curves = []
    for compile in (False, True):
        torch.manual_seed(0)
        model = build_model(tiny_model_dir, method, False, compile=Compilation(cuda_graphs) if compile else None)
        model.train()
        optimizer = make_optimizer(model, method)
        curves.append([optimizer_step(model, optimizer, step).loss.item() for step in steps])
    assert curves[1] == pytest.approx(curves[0], rel=BF16)


@_needs("bitsandbytes")
def test_a_4bit_base_trains_its_lora_adapter(tiny_model_dir, train_path):
    """QLoRA: the base's linear layers are NF4, only the adapter trains, and steps lower the loss."""
    import bitsandbytes as bnb

    model = build_model(tiny_model_dir, METHOD.model_copy(update={"base_precision": "4bit"}), False)
    assert any(isinstance(m, bnb.nn.Linear4bit) for m in model.modules())
    assert all("lora_" in name for name, p in model.named_parameters() if p.requires_grad)
    optimizer = make_optimizer(model, METHOD)
    batch = _on_cuda(pack(TokenRows.load(train_path), np.arange(8)))
    losses = [_step(model, optimizer, batch) for _ in range(6)]
    assert all(np.isfinite(losses)) and losses[-1] < losses[0]


@_needs("bitsandbytes")
def test_the_8bit_optimizer_follows_adamw(tiny_model_dir, train_path):
    """8-bit state is a memory saving, not another algorithm: its steps lower the loss as AdamW's do. Rank 64
    makes the q/o/MLP adapters 4,096 elements, the size from which bitsandbytes keeps their state in 8 bits."""
    batch = _on_cuda(pack(TokenRows.load(train_path), np.arange(8)))
    curves, states = {}, {}
    for name in ("adamw", "adamw_8bit"):
        torch.manual_seed(0)
        method = METHOD.model_validate({**METHOD.model_dump(), "optimizer": name, "lora": {"r": 64, "alpha": 128}})
        model = build_model(tiny_model_dir, method, False)
        optimizer = make_optimizer(model, method)
        curves[name] = [_step(model, optimizer, batch) for _ in range(6)]
        states[name] = {v.dtype for state in optimizer.state.values() for v in state.values() if torch.is_tensor(v)}
    assert torch.uint8 in states["adamw_8bit"] and torch.uint8 not in states["adamw"]
    assert curves["adamw_8bit"][-1] < curves["adamw_8bit"][0]
    assert curves["adamw_8bit"][-1] == pytest.approx(curves["adamw"][-1], rel=0.1)


def test_gpu_utilization_is_read_through_nvml():
    from phase1a.train.progress import _gpu_utilization

    utilization = _gpu_utilization()
    assert utilization is not None and 0 <= utilization <= 100


def test_the_train_stage_runs_in_bf16_with_tf32_and_reports_mfu(tiny_model_dir, train_path, tmp_path):
    from phase1a.core.hardware import detect

    settings = TrainSettings(model_dir=str(tiny_model_dir), train_path=train_path, output_dir=str(tmp_path / "run"),
                             method=METHOD.model_copy(update={"epochs": 1}), micro_batch_size=4,
                             gradient_checkpointing=True, dataloader_workers=2, checkpoint_interval="2steps",
                             show_progress=False, model_flops_per_token=1e6, peak_flops=detect()[1].peak_flops)
    result = train(settings)
    assert result.steps == 6 and result.final_loss is not None and np.isfinite(result.final_loss)
    assert torch.backends.cuda.matmul.allow_tf32
    assert result.checkpoints_written == 2 and Path(result.adapter_dir, "adapter_model.safetensors").is_file()
    if detect()[1].peak_flops:  # a catalogue GPU: MFU is reported
        assert result.mean_mfu is not None and result.mean_mfu > 0
