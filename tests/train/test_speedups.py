"""Every speed-up the plan may pick leaves the loss (and the gradients) unchanged on the same batch.

Tolerances are stated per test: fp32 on CPU; a different kernel order changes the last bits only.
Packing is tested in test_packing.py, accumulation (micro-batch size) in test_train.py.
"""
import copy
import importlib.util
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

from helpers import date_records, make_tokenizer, write_jsonl
from phase1a.config.schema import MethodConfig
from phase1a.data.tokenizing import TokenizeOptions, tokenize_dataset
from phase1a.model.build import build_model, compile_layers, make_optimizer, set_gradient_checkpointing
from phase1a.train.packing import (
    PackedRow,
    RowBudget,
    RowShape,
    StepBatches,
    TokenRows,
    example_stream,
    pack,
    step_loader,
    summed_loss,
)
from phase1a.train.steps import train_step

METHOD = MethodConfig(batch_size=8, lora={"r": 4, "alpha": 8}, learning_rate=1e-2)


@pytest.fixture(scope="module")
def train_path(tmp_path_factory) -> str:
    root = tmp_path_factory.mktemp("speedups")
    data = write_jsonl(root / "d.jsonl", date_records(48))
    return tokenize_dataset(data, make_tokenizer(), 256, TokenizeOptions(), root / "cache" / "fp").train_path


def packed_batch(train_path: str, count: int = 6, start: int = 0, shape: RowShape | None = None) -> PackedRow:
    rows = TokenRows.load(train_path)
    return pack(rows, torch.arange(start, start + count).numpy(), shape)


def loss_and_grads(model, batch: PackedRow) -> tuple[float, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    loss, _ = summed_loss(model, batch)
    loss.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.requires_grad}
    return loss.item(), grads


def assert_same(reference, candidate, tolerance: float) -> None:
    (loss_a, grads_a), (loss_b, grads_b) = reference, candidate
    assert loss_b == pytest.approx(loss_a, rel=tolerance)
    assert grads_a.keys() == grads_b.keys()
    for name in grads_a:
        torch.testing.assert_close(grads_b[name], grads_a[name], rtol=tolerance, atol=tolerance, msg=name)


def test_gradient_checkpointing_leaves_loss_and_gradients_unchanged(tiny_model_dir, train_path):
    model = build_model(tiny_model_dir, METHOD, gradient_checkpointing=False)
    model.train()
    batch = packed_batch(train_path)
    eager = loss_and_grads(model, batch)
    set_gradient_checkpointing(model, True)
    assert_same(eager, loss_and_grads(model, batch), tolerance=1e-6)


@pytest.mark.slow
def test_compiled_layers_leave_loss_and_gradients_unchanged_without_breaks_or_recompiles(tiny_model_dir, train_path):
    """Each decoder layer compiled whole (`fullgraph=True`: a graph break is an error) on static rows, as training
    compiles them: the loss and gradients of eager, over 5 steps of different examples with one compilation per
    row length and none after, and the state-dict keys of the eager model."""
    from torch._dynamo.utils import counters

    model = build_model(tiny_model_dir, METHOD, gradient_checkpointing=False)
    model.train()
    compiled = copy.deepcopy(model)
    torch._dynamo.reset()
    counters.clear()
    compile_layers(compiled)
    shape = RowShape.of(512, 64, 8, static=True, step_tokens=np.array([100, 200, 300, 512]))
    batches = [packed_batch(train_path, count=count, start=6 * k, shape=shape)
               for k, count in enumerate([6, 2, 6, 3, 5])]
    lengths = {batch.length for batch in batches}
    assert len(lengths) > 1
    for batch in batches:
        assert_same(loss_and_grads(model, batch), loss_and_grads(compiled, batch), tolerance=1e-5)
    # A graph a row length for the first layer (its input needs no gradient: the embeddings are frozen) and one
    # the other layers share.
    assert counters["stats"]["unique_graphs"] <= 2 * len(lengths)
    assert sum(counters["graph_break"].values()) == 0
    frames = counters["stats"]["calls_captured"]
    for batch in batches:  # a second pass over the same shapes compiles nothing more
        loss_and_grads(compiled, batch)
    assert counters["stats"]["calls_captured"] == frames
    assert list(compiled.state_dict()) == list(model.state_dict())  # checkpoints keep their keys


def test_varlen_attention_leaves_loss_and_gradients_unchanged(tiny_model_dir, train_path):
    """varlen (one op a layer over the row's boundaries) against SDPA's block-diagonal mask over the whole row."""
    batch = packed_batch(train_path)
    results = []
    for attention in ("sdpa", "varlen"):
        torch.manual_seed(0)  # the same LoRA initialisation for both
        model = build_model(tiny_model_dir, METHOD.model_copy(update={"attention": attention}), False)
        model.train()
        assert model.config._attn_implementation == attention
        results.append(loss_and_grads(model, batch))
    assert_same(*results, tolerance=1e-5)


def test_bf16_adapters_compute_without_float32_activation_copies(tiny_model_dir, train_path):
    """A bf16 base (as on a GPU): adapters with float32 weights computing in bf16 under autocast (build_model's
    choice there) against peft's default, which casts each adapted projection's input to float32: the same loss
    and gradients within bf16 noise, without those activation-sized float32 copies."""
    from peft import LoraConfig, get_peft_model
    from torch.utils._python_dispatch import TorchDispatchMode

    from phase1a.model import chunked_loss
    from phase1a.model.loading import adapters_compute_in_input_dtype, load_model

    batch = packed_batch(train_path, count=8)
    activation = batch.length * 64  # the tiny model's hidden size

    class Copies(TorchDispatchMode):
        count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if (func is torch.ops.aten._to_copy.default and isinstance(out, torch.Tensor)
                    and out.dtype == torch.float32 and out.numel() >= activation):
                self.count += 1
            return out

    results, copies = [], []
    for autocast in (False, True):
        torch.manual_seed(0)
        model = load_model(tiny_model_dir, torch.bfloat16, attention="varlen")
        model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"],
                                                 init_lora_weights=False))
        if autocast:
            chunked_loss.install(model.get_base_model(), autocast=torch.bfloat16)
            adapters_compute_in_input_dtype(model)
        assert {p.dtype for p in model.parameters() if p.requires_grad} == {torch.float32}  # the master weights
        with Copies() as counter:
            results.append(loss_and_grads(model, batch))
        copies.append(counter.count)
    (loss_a, grads_a), (loss_b, grads_b) = results
    assert loss_b == pytest.approx(loss_a, rel=1e-2)
    for name, grad in grads_a.items():  # bf16 keeps 8 bits: each gradient within 2 % of its own size
        assert (grads_b[name] - grad).norm() <= 2e-2 * grad.norm(), name
    # peft's default copies at least one activation to float32 at each of the 6 adapted projections (2 layers x 3);
    # what is left in bf16 is the base's own (its norms compute in float32).
    assert copies[0] - copies[1] >= 2 * 3


def test_fused_adamw_takes_the_same_step_as_the_for_each_one(tiny_model_dir, train_path):
    batch = packed_batch(train_path)
    weights = {}
    for optimizer_name in ("adamw", "adamw_fused"):
        torch.manual_seed(0)
        method = METHOD.model_copy(update={"optimizer": optimizer_name})
        model = build_model(tiny_model_dir, method, gradient_checkpointing=False)
        optimizer = make_optimizer(model, method)
        for _ in range(3):
            loss_and_grads(model, batch)
            optimizer.step()
        weights[optimizer_name] = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    for name, value in weights["adamw"].items():
        torch.testing.assert_close(weights["adamw_fused"][name], value, rtol=1e-5, atol=1e-6, msg=name)


def test_dataloader_workers_deliver_the_same_steps(train_path):
    """Workers only move packing to other processes: the step contents are identical, so is the training."""
    order, _ = example_stream(len(TokenRows.load(train_path)), 2.0, seed=0)
    batches = StepBatches(train_path, 48, order, 8, RowBudget(100))
    inline = list(step_loader(batches, range(2, len(batches)), workers=0, pin_memory=False))
    workers = list(step_loader(batches, range(2, len(batches)), workers=2, pin_memory=False))
    assert len(inline) == len(workers) == len(batches) - 2
    rows = inline[0].micro_batches
    assert len(rows) > 1 and all(row.length <= 100 for row in rows)  # the budget splits the step
    for a, b in zip(inline, workers):
        assert a.supervised == b.supervised and len(a.micro_batches) == len(b.micro_batches) >= 1
        for micro_a, micro_b in zip(a.micro_batches, b.micro_batches):
            assert micro_a.tokens == micro_b.tokens and micro_a.max_seqlen == micro_b.max_seqlen
            for name in ("input_ids", "labels", "position_ids", "cu_seqlens"):
                assert torch.equal(getattr(micro_a, name), getattr(micro_b, name))


@pytest.mark.slow
def test_workers_survive_a_parent_whose_exit_hooks_fail_in_forked_children(train_path):
    """A process that ran a Prefect flow (the flow trains in-process) carries Prefect's threading exit hook,
    which fails in a forked child: forked workers then die with exit code 1 as the loader shuts them."""
    script = textwrap.dedent(f"""
        import os, threading
        from phase1a.train.packing import RowBudget, StepBatches, TokenRows, example_stream, step_loader
        parent = os.getpid()
        def drain():  # what Prefect's service does at exit in a forked child
            assert os.getpid() == parent, "a service of the parent process"
        threading._register_atexit(drain)
        order, _ = example_stream(len(TokenRows.load({train_path!r})), 1.0, seed=0)
        batches = StepBatches({train_path!r}, 48, order, 8, RowBudget(100))
        assert len(list(step_loader(batches, range(len(batches)), workers=2, pin_memory=False))) == len(batches)
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                          cwd=Path(__file__).resolve().parents[2])
    assert done.returncode == 0, done.stderr[-2000:]


def test_a_step_from_the_loader_equals_the_loss_of_its_examples(tiny_model_dir, train_path):
    """The loader's step, normalised over its supervised tokens, is the mean loss of its examples' tokens."""
    model = build_model(tiny_model_dir, METHOD, gradient_checkpointing=False)
    order, _ = example_stream(len(TokenRows.load(train_path)), 1.0, seed=0)
    for static in (False, True):
        step = StepBatches(train_path, None, order, 8, RowBudget(120, static))[0]
        loss = train_step(model, step)
        with torch.no_grad():
            whole = pack(TokenRows.load(train_path), order[:8])
            summed, _ = summed_loss(model, whole)
        assert whole.supervised == step.supervised and step.tokens == whole.tokens == step.step_tokens
        assert (step.padded_tokens > step.tokens) == static
        assert loss.item() == pytest.approx(summed.item() / whole.supervised, rel=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: TF32 exists on NVIDIA GPUs only")
def test_tf32_matmuls_stay_within_bf16_noise(tiny_model_dir, train_path):
    model = build_model(tiny_model_dir, METHOD, gradient_checkpointing=False).float()
    batch = packed_batch(train_path).to("cuda")
    torch.backends.cuda.matmul.allow_tf32 = False
    exact = loss_and_grads(model, batch)
    torch.backends.cuda.matmul.allow_tf32 = True
    assert_same(exact, loss_and_grads(model, batch), tolerance=1e-2)  # TF32 keeps 10 mantissa bits, as bf16 does 7


def test_attention_auto_is_varlen_everywhere_and_the_old_name_means_it():
    from phase1a.model.build import attention_implementation

    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    for method in (MethodConfig(), MethodConfig(attention="sdpa_packed")):
        assert attention_implementation(method, cuda, torch.bfloat16) == "varlen"
        assert attention_implementation(method, cpu, torch.float32) == "varlen"
    assert attention_implementation(MethodConfig(attention="sdpa"), cuda, torch.bfloat16) == "sdpa"
    flash = MethodConfig(attention="flash_attention_2")
    assert attention_implementation(flash, cuda, torch.bfloat16) == "flash_attention_2"


def _needs(package: str):
    missing = not torch.cuda.is_available() or importlib.util.find_spec(package) is None
    return [pytest.mark.gpu, pytest.mark.skipif(missing, reason=f"needs CUDA and {package}")]


@pytest.mark.parametrize("knob, off, on", [
    pytest.param("attention", "sdpa", "flash_attention_2", marks=_needs("flash_attn")),  # varlen over packed rows
    pytest.param("liger", "off", "on", marks=_needs("liger_kernel")),
])
def test_optional_cuda_kernels_leave_the_packed_loss_unchanged(tiny_model_dir, train_path, knob, off, on):
    batch = packed_batch(train_path).to("cuda")
    results = []
    for setting in (off, on):
        torch.manual_seed(0)  # the same LoRA initialisation for both
        model = build_model(tiny_model_dir, METHOD.model_copy(update={knob: setting}), False)
        model.train()
        results.append(loss_and_grads(model, batch))
    assert_same(*results, tolerance=2e-2)  # bf16: the kernels round differently


def test_the_workers_fork_server_starts_early_with_the_packing_module_loaded():
    """Workers fork from a server that imported the packing module once (each worker importing torch and
    transformers itself took 42 s of a 90 s calibration on an H200 host), started before the first loader."""
    import multiprocessing.forkserver as forkserver

    from phase1a.train.packing import start_fork_server

    start_fork_server()
    server = forkserver._forkserver
    assert "phase1a.train.packing" in server._preload_modules
    assert server._forkserver_pid is not None and os.path.exists(f"/proc/{server._forkserver_pid}")
