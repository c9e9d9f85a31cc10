"""Training throughput: our train step (eager, compiled, CUDA graphs, or the knobs our plan picks) beside the field
notes' "before" and "after" configurations and Hugging Face Trainer padding-free, one run, same data, same model.

    uv run python benchmarks/train_throughput.py [--model test|tiny|smollm2|llama3-8b] [--configs new hf_flattening]
        [--steps demo:16 rich:t20480 rows8k:t32768:r8192] [--cudnn off on] [--results-dir DIR] [--out FILE]

  new            our train step as the train stage runs it (phase1a/train/steps.py `optimizer_step` on
                 `StepBatches`), with fixed knobs: static rows (a few bucket lengths, phase1a/train/packing.py
                 `RowShape`), varlen attention, no checkpointing, fused AdamW, 2 loader workers on a GPU; rows of
                 the whole step, or of `:rN` tokens
  new_compiled   the same, each decoder layer compiled (fullgraph, static shapes; phase1a/model/build.py)
  new_graphs     the same, compiled layers replayed as CUDA graphs (reduce-overhead; CUDA only)
  ours           the knobs our plan picks by calibration on this machine (`--calibration-budget`, not timed)
  before         every example padded to 2048 tokens, micro-batch 2 x accumulation 8, no TF32, no dataloader
                 workers, AdamW for-each (Hugging Face Trainer's default)
  after          padded to the right-sized length (p99, at most 2048), TF32, 4 workers, gradient checkpointing,
                 micro-batch 2 x 4
  hf_flattening  Hugging Face Trainer with `DataCollatorWithFlattening` (padding-free: each micro-batch is one row
                 with restarting position_ids), fused AdamW, TF32, 4 workers on a GPU, no checkpointing: the
                 strongest setup a peer gets from the library's own parts; micro-batches of 8 at the demo batch,
                 the whole step (or `:rN` tokens of it) in one row at a token-rich one
  trl_sft        (asked for by name, with TRL and `datasets` installed beside the project) TRL's SFTTrainer with
                 `padding_free=True` on the same chat records, tokenized by TRL itself, 8 x 2

A step (`--steps NAME:SIZE[:rROW]`): SIZE examples, or `tN` for as many examples (a multiple of 16) as make the
mean step hold N tokens; `rROW`: rows of at most ROW tokens (default: the whole step in one row). `before` and
`after` are the field notes' demo-batch configurations and run at the 16-example step only.

Every measurement runs the windows of benchmarks/step_meter.py on the same examples, in order (the first of the
generated data): warm-up (every static row length, then real steps), timed (useful tokens/s, padded tokens/s,
padding share, MFU, peak memory), host syncs counted, profiled (GPU-busy fraction, the top kernels; the table beside
the result). Useful tokens are the examples' own (truncated to the configuration's length); MFU counts model FLOPs
(4N a token for LoRA plus attention, phase1a/model/cost_model.py, the same count for every configuration) of the
useful tokens over the GPU's dense bf16 peak; a CPU has no peak, so there only the achieved TFLOP/s. Every derived
number is computed from the raw numbers in the same result file (`derived`, step_meter.derive).

Each measurement runs in its own process on a GPU (its peak memory and CUDA state are its own; on a CPU, where
peak memory is the process's RSS anyway, one after another in this one), on a freshly built copy of the same
randomly initialised model (weights do not change speed), LoRA r=16 on every projection. The Llama-3-8B shape is
built on the device in bf16 from its config (`--layers`, 8 by default): no checkpoint is written. `--cudnn off on`
runs the SDPA-based peers with SDPA's cuDNN backend disabled, then enabled (cuDNN's masked backward has a NaN
regression on Hopper in torch 2.11-2.13: a run whose loss is not finite says so). `--results-dir` keeps one JSON
per measurement and skips those already there, so a run cut short continues where it stopped; the model, data and
tokenization under `--work` are reused too. Prints JSON; `--out` writes the summary.
"""
from __future__ import annotations

import argparse
import json
import math
import platform
import shutil
import sys
import tempfile
import time
from contextlib import contextmanager
from dataclasses import asdict
from datetime import datetime, timezone
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from step_meter import ON_DEVICE, Meter, Windows, builds_on_device, cudnn_sdpa, jsonable, on_device_loader, with_derived
from tokenize_throughput import _in_process, _peak_rss_mib, generate  # same data, same process runner

from phase1a.core.units import MIB

SHAPES = {  # hidden, intermediate, layers, heads, kv heads, vocabulary (None: the tokenizer's)
    "test": (64, 128, 2, 4, 2, None),  # the test suite's tiny Llama: the GPU check's dry run
    "tiny": (256, 688, 4, 4, 2, None),
    "smollm2": (576, 1536, 30, 9, 3, None),
    "llama3-8b": (4096, 14336, 32, 32, 8, 128256),
}
ON_DEVICE_SHAPES = ("llama3-8b",)  # built on the device from their config: no 16 GB checkpoint on disk
DEFAULT_LAYERS = {"llama3-8b": 8}  # full width, 8 of its 32 layers (--layers): the GPU check's shape
NEW_CONFIGS = ("new", "new_compiled", "new_graphs")
PEERS = ("before", "after", "hf_flattening")
CONFIGS = (*NEW_CONFIGS, "ours", *PEERS)
OPTIONAL_CONFIGS = ("trl_sft",)  # packages outside the project: `uv run --with trl ...`
SDPA_CONFIGS = (*PEERS, "trl_sft")  # attend with transformers' SDPA: measured with cuDNN's backend on and off
SMALL_VOCABULARY = ("test", "tiny")  # shapes that take the test suite's tokenizer
DEMO_BATCH = 16  # the demo's global batch
GLOBAL_BATCH = DEMO_BATCH  # the name other benchmarks import
FIELD_NOTES = {"before": (2048, 2, 8, False, 0, False), "after": (None, 2, 4, True, 4, True)}
# length (None: right-sized), micro-batch, accumulation, checkpointing, workers, TF32
HF_MICRO = 8  # hf_flattening's micro-batch at the demo batch
WINDOWS = Windows(warmup=2, timed=16, syncs=2, profiled=3)


def model_and_data(model: str, work: Path, examples: int, max_answer_words: int) -> tuple[str, Path]:
    """The demo's model (SmolLM2-135M-Instruct, `model` smollm2) or the tiny Llama (`tiny`), and a generated chat
    data file, each made once under `work` (the store's benchmarks train on them)."""
    from phase1a.config.schema import ModelConfig
    from phase1a.model.loading import resolve_model

    if model == "tiny":
        model_dir = make_model_dir("tiny", None, work / "model-tiny")
    else:
        model_dir = resolve_model(ModelConfig(name_or_path="smollm2-135m-instruct"))
    data = work / f"chat_{examples}_{max_answer_words}.jsonl"
    if not data.is_file():
        generate(data, examples, seed=1, max_answer_words=max_answer_words)
    return str(model_dir), data


def make_model_dir(shape: str, tokenizer_dir: Path | None, target: Path, layers: int | None = None,
                   on_device: bool = False) -> Path:
    """A randomly initialised Llama of `shape` (`layers` of them, default the shape's), written once and reused;
    `on_device`: its config and tokenizer only, the model built on the device when it is loaded
    (step_meter.on_device_loader). The test and tiny shapes take the test suite's 400-token BPE tokenizer (built
    from scratch, no hub): with SmolLM2's 49k vocabulary the logits alone would take a CPU minutes."""
    if (target / "COMPLETE").is_file():
        return target
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    if tokenizer_dir is None:
        sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
        from helpers import make_tokenizer  # the test suite's tokenizer

        tokenizer = make_tokenizer()
    else:
        tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    hidden, intermediate, default_layers, heads, kv_heads, vocab = SHAPES[shape]
    config = LlamaConfig(vocab_size=vocab or len(tokenizer), hidden_size=hidden, intermediate_size=intermediate,
                         num_hidden_layers=layers or default_layers, num_attention_heads=heads,
                         num_key_value_heads=kv_heads, max_position_embeddings=8192,
                         tie_word_embeddings=shape != "llama3-8b", pad_token_id=tokenizer.pad_token_id,
                         eos_token_id=tokenizer.eos_token_id)
    shutil.rmtree(target, ignore_errors=True)
    if on_device:
        target.mkdir(parents=True)
        config.save_pretrained(target)
        (target / ON_DEVICE).touch()
    else:
        torch.manual_seed(0)
        dtype = torch.bfloat16 if torch.cuda.is_available() else torch.float32
        default = torch.get_default_dtype()
        torch.set_default_dtype(dtype)  # made in bf16 directly: an 8B model in fp32 first would take 32 GB
        try:
            with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
                model = LlamaForCausalLM(config)
        finally:
            torch.set_default_dtype(default)
        model.save_pretrained(target)
    tokenizer.save_pretrained(target)
    (target / "COMPLETE").touch()  # a model cut off mid-write is written again
    return target


@contextmanager
def project_loader(model_dir):
    """The project's model loading as the train stage has it; for a directory built on the device, the project's
    `build_model` with its `load_model` replaced by step_meter.on_device_loader (the rest of `build_model`: the
    chunked loss, LoRA, bf16 adapters, checkpointing, compilation, unchanged)."""
    if not builds_on_device(model_dir):
        yield
        return
    import phase1a.model.build as build
    from phase1a.model import chunked_loss

    original = build.load_model
    build.load_model = on_device_loader(chunked_loss.install)
    try:
        yield
    finally:
        build.load_model = original


# ------------------------------------------------------------------------------------------------ the measurements

def measure_new(model_dir: str, train_path: str, spec: dict, queue) -> None:
    """Our train step (`new`, `new_compiled`, `new_graphs`: fixed knobs; `ours`: the plan's) in the windows."""
    import numpy as np
    import torch

    from phase1a.config.schema import MethodConfig
    from phase1a.core.hardware import training_device
    from phase1a.model.build import Compilation, build_model, make_optimizer
    from phase1a.train.packing import RowBudget, StepBatch, StepBatches, rows_of_every_length, static_rows, step_loader
    from phase1a.train.steps import optimizer_step

    _threads(spec)
    config, batch, windows = spec["config"], spec["batch"], Windows(**spec["windows"])
    cuda = torch.cuda.is_available()
    knobs = _plan_knobs(model_dir, spec) if config == "ours" else {
        "max_seq_length": spec["max_seq_length"], "gradient_checkpointing": False,
        "compile": config in ("new_compiled", "new_graphs"), "cuda_graphs": config == "new_graphs",
        "dataloader_workers": 2 if cuda else 0,
        "row_tokens": spec["row_tokens"] or batch * spec["max_seq_length"]}
    if knobs["cuda_graphs"] and not cuda:
        raise SystemExit("new_graphs: CUDA graphs need CUDA")
    method = MethodConfig(batch_size=batch, lora={"r": 16, "alpha": 32}, liger=spec.get("liger", "auto"))
    began = time.perf_counter()
    with project_loader(model_dir):
        compilation = Compilation(knobs["cuda_graphs"], Path(spec["work"]) / "compile-cache")
        model = build_model(Path(model_dir), method, knobs["gradient_checkpointing"],
                            compile=compilation if knobs["compile"] else None)
    optimizer = make_optimizer(model, method)
    static = static_rows(training_device(), knobs["compile"]) or spec.get("static_rows", False)
    # An epoch of every example in file order, as training would take them: the row shape (its lengths, decided by
    # the epoch's fullest step) is the run's; the windows take its first steps.
    order = np.arange(spec["examples"])
    batches = StepBatches(train_path, knobs["max_seq_length"], order, batch, RowBudget(knobs["row_tokens"], static))
    shape = batches.shape
    model.train()
    built = time.perf_counter()
    # Every row length the timed steps can take, before they run: a row of one example padded to each length,
    # twice (three times with CUDA graphs: a warm-up, the capture, a replay).
    repeats = 3 if knobs["cuda_graphs"] else 2
    for row in rows_of_every_length(batches.rows, shape, int(order[0])):
        for _ in range(repeats):
            optimizer_step(model, optimizer, StepBatch(micro_batches=[row], supervised=row.supervised,
                                                       step_tokens=row.tokens))
    meter = Meter(windows, _table(spec))
    loader = iter(step_loader(batches, range(windows.total), knobs["dataloader_workers"], pin_memory=cuda))
    for index in range(windows.total):
        step = next(loader)
        outcome = optimizer_step(model, optimizer, step)
        meter.after(index, step.tokens, step.padded_tokens, outcome.loss)
    facts = _facts(model_dir, model)
    queue.put(_result(spec, meter, facts, {
        **knobs, "static_rows": static, "row_shape": asdict(shape), "row_lengths": shape.lengths(),
        "attention": model.config._attn_implementation, "liger": _liger(method, model), "optimizer": method.optimizer,
        "build_seconds": round(built - began, 2), "warmup_seconds": round(meter.began - built, 2)}))


def _plan_knobs(model_dir: str, spec: dict) -> dict:
    """`ours`: what make_plan picks on this machine (its calibration is not timed)."""
    from phase1a.config.schema import Phase1aConfig
    from phase1a.data.tokenized import TokenizedData
    from phase1a.model.loading import prepare_model
    from phase1a.plan.planner import make_plan
    from phase1a.train.packing import token_budget

    data = TokenizedData.model_validate_json(spec["data_json"])
    config = Phase1aConfig.model_validate({
        "work_dir": (work := tempfile.mkdtemp()), "cache_dir": work, "data": {"source": "unused"},
        "model": {"name_or_path": model_dir},
        "method": {"batch_size": spec["batch"], "lora": {"r": 16, "alpha": 32}},
        "hardware": {"target": config_target()},
        "plan": {"calibration_share": 1.0, "calibration_budget": spec["calibration_budget"]}})
    with project_loader(model_dir):
        plan = make_plan(config, prepare_model(config), data)
    return {"max_seq_length": plan.max_seq_length, "gradient_checkpointing": plan.gradient_checkpointing,
            "compile": plan.compile, "cuda_graphs": plan.cuda_graphs, "dataloader_workers": plan.dataloader_workers,
            "row_tokens": token_budget(plan.micro_batch_size, plan.max_seq_length),
            "micro_batch_size": plan.micro_batch_size, "plan_tokens_per_second": round(plan.tokens_per_second, 1)}


def measure_padded(model_dir: str, train_path: str, spec: dict, queue) -> None:
    """The field notes' trainer: padded batches with an attention mask, the model's own mean loss."""
    import torch
    from torch.utils.data import DataLoader

    from phase1a.config.schema import MethodConfig
    from phase1a.core.labels import IGNORE_INDEX
    from phase1a.model.build import build_model
    from phase1a.train.packing import TokenRows

    _threads(spec)
    length, micro, accumulation, checkpointing, workers, tf32 = spec["padded"]
    windows = Windows(**spec["windows"])
    rows = TokenRows.load(train_path, length)
    method = MethodConfig(optimizer="adamw", liger="off", attention="sdpa")
    with project_loader(model_dir):
        model = build_model(Path(model_dir), method, checkpointing)
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = tf32  # build_model turns it on
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    pad = model.config.pad_token_id or 0
    device = next(model.parameters()).device
    lengths = rows.lengths()

    def padded(i: int) -> dict:
        start, end = int(rows.offsets[i]), rows.end(i)
        ids = torch.full((length,), pad, dtype=torch.long)
        labels = torch.full((length,), IGNORE_INDEX, dtype=torch.long)
        ids[: end - start] = torch.from_numpy(rows.input_ids[start:end].astype("int64"))
        labels[: end - start] = torch.from_numpy(rows.labels[start:end].astype("int64"))
        return {"input_ids": ids, "attention_mask": (torch.arange(length) < end - start).long(), "labels": labels}

    step_examples = micro * accumulation
    loader = iter(DataLoader([padded(i) for i in range(step_examples * windows.total)], batch_size=micro,
                             num_workers=workers, pin_memory=torch.cuda.is_available()))
    meter = Meter(windows, _table(spec))
    model.train()
    with cudnn_sdpa(spec.get("cudnn")):
        for step in range(windows.total):
            loss = torch.zeros((), device=device)
            for _ in range(accumulation):
                batch = {k: v.to(device, non_blocking=True) for k, v in next(loader).items()}
                micro_loss = model(**batch, use_cache=False).loss / accumulation
                micro_loss.backward()
                loss += micro_loss.detach()
            torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            examples = range(step * step_examples, (step + 1) * step_examples)
            meter.after(step, int(lengths[examples.start:examples.stop].sum()), step_examples * length, loss)
    queue.put(_result(spec, meter, _facts(model_dir, model), {
        "max_seq_length": length, "micro_batch_size": micro, "accumulation": accumulation,
        "gradient_checkpointing": checkpointing, "dataloader_workers": workers, "tf32": tf32,
        "attention": model.config._attn_implementation}))


def measure_hf_flattening(model_dir: str, train_path: str, spec: dict, queue) -> None:
    """Hugging Face Trainer, padding-free: `DataCollatorWithFlattening` makes each micro-batch one row whose
    position_ids restart at every example, which transformers' attention turns into per-example attention."""
    import torch
    from transformers import DataCollatorWithFlattening, Trainer, TrainingArguments

    from phase1a.config.schema import MethodConfig
    from phase1a.model.build import build_model
    from phase1a.train.packing import TokenRows

    _threads(spec)
    windows, batch, micro = Windows(**spec["windows"]), spec["batch"], spec["peer_micro"]
    rows = TokenRows.load(train_path, spec["max_seq_length"])
    with project_loader(model_dir):
        model = build_model(Path(model_dir), MethodConfig(liger="off", attention="sdpa"), gradient_checkpointing=False)
    cuda = torch.cuda.is_available()
    count = batch * windows.total
    examples = [{"input_ids": rows.input_ids[int(rows.offsets[i]):rows.end(i)].tolist(),
                 "labels": rows.labels[int(rows.offsets[i]):rows.end(i)].tolist()} for i in range(count)]
    lengths = rows.lengths()[:count]
    tokens = [int(lengths[s * batch:(s + 1) * batch].sum()) for s in range(windows.total)]
    meter = Meter(windows, _table(spec))
    workers = 4 if cuda else 0  # forked loaders on a CPU only take cores from the model
    with tempfile.TemporaryDirectory() as output_dir, cudnn_sdpa(spec.get("cudnn")):
        arguments = TrainingArguments(
            **_trainer_arguments(output_dir, micro, batch, windows.total), tf32=True if cuda else None,
            optim="adamw_torch_fused" if cuda else "adamw_torch", dataloader_num_workers=workers,
            dataloader_pin_memory=cuda, remove_unused_columns=False, max_grad_norm=1.0)
        output = _in_order(Trainer)(model=model, args=arguments, train_dataset=examples,
                                    data_collator=DataCollatorWithFlattening(),
                                    callbacks=[_windows_callback(meter, tokens)]).train()
    queue.put(_result(spec, meter, _facts(model_dir, model), {
        "max_seq_length": spec["max_seq_length"], "micro_batch_size": micro, "accumulation": batch // micro,
        "gradient_checkpointing": False, "dataloader_workers": workers, "tf32": cuda, "packed": True,
        "attention": model.config._attn_implementation}, _trainer_losses(output)))


def measure_trl_sft(model_dir: str, data_path: str, spec: dict, queue) -> None:
    """TRL's SFTTrainer, padding-free, on the chat records in order: the peer most users start from."""
    from datasets import load_dataset
    from trl import SFTConfig, SFTTrainer

    from phase1a.config.schema import MethodConfig
    from phase1a.model.build import build_model
    from phase1a.model.loading import load_tokenizer

    _threads(spec)
    windows, batch, micro = Windows(**spec["windows"]), spec["batch"], HF_MICRO
    with project_loader(model_dir):
        model = build_model(Path(model_dir), MethodConfig(liger="off", attention="sdpa"), gradient_checkpointing=False)
    accumulation = batch // micro
    records = load_dataset("json", data_files=data_path, split="train").select(range(batch * windows.total))
    meter, tokens = Meter(windows, _table(spec)), []
    with tempfile.TemporaryDirectory() as output_dir, cudnn_sdpa(spec.get("cudnn")):
        # TRL refuses max_length with padding-free rows unless it packs; the records are within it anyway.
        arguments = SFTConfig(**_trainer_arguments(output_dir, micro, batch, windows.total), padding_free=True,
                              max_length=None, dataloader_num_workers=0)
        step_tokens = _CollatedTokens(tokens, accumulation)
        trainer = _in_order(SFTTrainer)(model=model, args=arguments, train_dataset=records,
                                        processing_class=load_tokenizer(Path(model_dir)),
                                        callbacks=[_windows_callback(meter, step_tokens)])
        collate = trainer.data_collator

        def counting(features):  # in this process: no loader workers
            collated = collate(features)
            tokens.append(int(collated["input_ids"].numel()))
            return collated

        trainer.data_collator = counting
        output = trainer.train()
    queue.put(_result(spec, meter, _facts(model_dir, model), {
        "micro_batch_size": micro, "accumulation": accumulation, "gradient_checkpointing": False,
        "dataloader_workers": 0, "packed": True}, _trainer_losses(output)))


class _CollatedTokens:
    """Step k's tokens, as TRL's collator counted them (its own tokenization: its token count is its useful one)."""

    def __init__(self, tokens: list[int], accumulation: int):
        self.tokens, self.accumulation = tokens, accumulation

    def __getitem__(self, step: int) -> int:
        return sum(self.tokens[step * self.accumulation:(step + 1) * self.accumulation])


def _windows_callback(meter: Meter, tokens):
    """Drives the meter's windows at the Trainer's optimizer-step boundaries; padding-free: computed = useful."""
    from transformers import TrainerCallback

    class Windowed(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            step = state.global_step - 1
            meter.after(step, tokens[step], tokens[step])

    return Windowed()


def _trainer_losses(output) -> dict:
    """The Trainer's mean training loss over every step (its NaN filter off, so a NaN step shows)."""
    loss = float(output.training_loss)
    return {"mean_over_run": loss, "not_finite": int(not math.isfinite(loss))}


def _in_order(trainer_class):
    """The Trainer feeding examples in order: the same steps of the same examples as the other configurations."""
    from torch.utils.data import SequentialSampler

    class InOrder(trainer_class):
        def _get_train_sampler(self, *args, **kwargs):
            return SequentialSampler(self.train_dataset)

    return InOrder


def _trainer_arguments(output_dir: str, micro: int, batch: int, steps: int) -> dict:
    """What both Trainer-based peers share: `batch` examples a step in micro-batches of `micro`, `steps` steps, a
    constant learning rate, bf16 on a GPU, no logging, checkpoints or trackers, no NaN filter on the loss."""
    import torch

    return {"output_dir": output_dir, "per_device_train_batch_size": micro,
            "gradient_accumulation_steps": batch // micro, "max_steps": steps, "learning_rate": 1e-4,
            "lr_scheduler_type": "constant", "bf16": torch.cuda.is_available(), "logging_strategy": "no",
            "save_strategy": "no", "report_to": "none", "disable_tqdm": True, "seed": 0,
            "logging_nan_inf_filter": False}


def _threads(spec: dict) -> None:
    if spec.get("threads"):
        import torch

        torch.set_num_threads(spec["threads"])


def _table(spec: dict) -> Path | None:
    return Path(spec["results_dir"]) / f"{spec['label']}.profile.txt" if spec.get("results_dir") else None


def _facts(model_dir: str, model) -> dict:
    """Parameters, FLOPs a token (4N + attention at the data's mean length: the same for every configuration) and
    the device's dense bf16 peak, recorded raw beside the measurement."""
    from phase1a.core.hardware import detect
    from phase1a.model.cost_model import model_facts

    facts = model_facts(Path(model_dir))
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    embeddings = base.get_input_embeddings().weight
    tied = embeddings is base.get_output_embeddings().weight
    return {"parameters": facts.parameters, "layers": facts.layers, "peak_flops": detect()[1].peak_flops,
            "input_embedding_parameters": 0 if tied else embeddings.numel()}


def _result(spec: dict, meter: Meter, facts: dict, knobs: dict, trainer_losses: dict | None = None) -> dict:
    """The measurement's record: what ran, the windows' raw numbers, and the numbers derived from them."""
    import torch

    from phase1a.model.cost_model import flops_per_token, model_facts

    record = meter.record()
    if trainer_losses is not None:
        record["losses"] = trainer_losses
    if record["peak_memory_bytes"] is None:  # a CPU: the process's peak RSS
        record["peak_rss_bytes"] = int(_peak_rss_mib() * MIB)
    per_token = flops_per_token(model_facts(Path(spec["model_dir"])), False, False, spec["mean_length"])
    return with_derived({
        "label": spec["label"], "config": spec["config"], "model": spec["model"], "code": "this tree",
        "step": spec["step"], "batch": spec["batch"], "cudnn_sdpa": _cudnn_label(spec.get("cudnn")),
        "torch": torch.__version__, **knobs, **facts, "flops_per_token": per_token,
        "mean_example_tokens": spec["mean_length"], **record,
        "profile_table": f"{spec['label']}.profile.txt" if spec.get("results_dir") else None})


def _cudnn_label(cudnn: bool | None) -> str | None:
    return None if cudnn is None else ("on" if cudnn else "off")


def _liger(method, model) -> str:
    from phase1a.model import liger

    where = "in the layers" if liger.applied(model) else "not in the layers (compiled, off or not installed)"
    return f"{method.liger} ({where})"


# ------------------------------------------------------------------------------------------------------- the bench

class Bench:
    """What every configuration shares: the model directory, the tokenized data and the steps' sizes."""

    def __init__(self, args: argparse.Namespace):
        from phase1a.config.schema import ModelConfig
        from phase1a.data.lengths import right_size
        from phase1a.data.tokenizing import TokenizeOptions, tokenize_dataset
        from phase1a.model.loading import load_tokenizer, resolve_model
        from phase1a.train.packing import TokenRows

        args.work.mkdir(parents=True, exist_ok=True)
        tokenizer_dir = args.tokenizer
        if tokenizer_dir is None and args.model not in SMALL_VOCABULARY:
            tokenizer_dir = resolve_model(ModelConfig(name_or_path="smollm2-135m-instruct"))
        layers = args.layers or DEFAULT_LAYERS.get(args.model)
        on_device = args.model in ON_DEVICE_SHAPES
        name = f"model-{args.model}" + (f"-{layers}l" if layers else "") + ("-on-device" if on_device else "")
        self.model_dir = make_model_dir(args.model, tokenizer_dir, args.work / name, layers, on_device)
        self.data_path = data_path = args.work / f"chat_{args.examples}_{args.max_answer_words}.jsonl"
        if not data_path.is_file():
            generate(data_path, args.examples, seed=1, max_answer_words=args.max_answer_words)
        # One fingerprint per model and data: a re-run (or the next configuration's part) reuses the tokenization.
        self.data = tokenize_dataset(data_path, load_tokenizer(self.model_dir), 8192, TokenizeOptions(),
                                     args.work / "cache" / f"bench-{args.model}-{data_path.stem}")
        lengths = TokenRows.load(self.data.train_path).lengths()
        self.examples = len(lengths)
        self.mean_length = float(lengths.mean())
        # "after" right-sizes as the field notes did: to the p99 length (truncating the longest 1 %), within 2048.
        self.right_sized = min(2048, right_size(lengths, 99.0, 8192, None))

    def step(self, text: str) -> dict:
        """`NAME:SIZE[:rROW]` (module docstring) -> name, examples a step, a row's tokens (0: the whole step)."""
        name, size, *rest = text.split(":")
        if size.startswith("t"):
            batch = DEMO_BATCH * max(1, math.ceil(int(size[1:]) / self.mean_length / DEMO_BATCH))
        else:
            batch = int(size)
        row = int(rest[0].removeprefix("r")) if rest else 0
        return {"step": name, "batch": batch, "row_tokens": row}

    def spec(self, config: str, step: dict, cudnn: bool | None, args: argparse.Namespace) -> dict:
        label = f"{config}-{step['step']}" + (f"-cudnn_{_cudnn_label(cudnn)}" if cudnn is not None else "")
        if config in NEW_CONFIGS and args.liger == "off":
            label += "-liger_off"
        windows = Windows(*args.windows)
        if step["batch"] * windows.total > self.examples:
            raise SystemExit(f"{label}: {windows.total} steps of {step['batch']} examples need "
                             f"{step['batch'] * windows.total} examples; the data has {self.examples} "
                             f"(--examples)")
        return {"label": label, "config": config, "model": args.model, "model_dir": str(self.model_dir),
                **step, "cudnn": cudnn, "windows": asdict(windows), "max_seq_length": self.data.max_seq_length,
                "mean_length": self.mean_length, "examples": self.examples, "work": str(args.work),
                "threads": args.threads,
                "results_dir": str(args.results_dir) if args.results_dir else None,
                "static_rows": args.static_rows, "calibration_budget": args.calibration_budget, "liger": args.liger,
                "data_json": self.data.model_dump_json() if config == "ours" else None,
                "peer_micro": _peer_micro(step, self.mean_length),
                "padded": _padded_knobs(config, self.right_sized, args.padded_length)}

    def run(self, spec: dict, separate: bool) -> dict:
        """One measurement: in a process of its own (`separate`), or in this one."""
        call = _in_process if separate else _here
        model, train, config = str(self.model_dir), self.data.train_path, spec["config"]
        if config in FIELD_NOTES:
            if spec["batch"] != DEMO_BATCH:
                raise SystemExit(f"{config} is the field notes' demo-batch configuration: --steps NAME:16 only")
            return call(measure_padded, model, train, spec)
        if config == "hf_flattening":
            return call(measure_hf_flattening, model, train, spec)
        if config == "trl_sft":  # TRL tokenizes the records itself: the first ones of the file, as many
            return call(measure_trl_sft, model, str(self.data_path), spec)
        return call(measure_new, model, train, spec)


def _peer_micro(step: dict, mean_length: float) -> int:
    """hf_flattening's micro-batch: 8 at the demo batch; otherwise the whole step in one row, or the divisor of the
    step nearest the examples that fill a row of `row_tokens` on average (its rows hold about as many tokens)."""
    batch, row = step["batch"], step["row_tokens"]
    if batch == DEMO_BATCH:
        return HF_MICRO
    if not row:
        return batch
    fits = row / mean_length
    return min((d for d in range(1, batch + 1) if batch % d == 0), key=lambda d: (abs(d - fits), d))


def _padded_knobs(config: str, right_sized: int, before_length: int) -> tuple | None:
    if config not in FIELD_NOTES:
        return None
    length, *rest = FIELD_NOTES[config]
    return (before_length if length else right_sized, *rest)


class _Box:
    """The queue a measurement puts its result on, when it runs in this process."""

    def put(self, value: dict) -> None:
        self.value = value


def _here(target, *args) -> dict:
    box = _Box()
    target(*args, box)
    return box.value


def config_target() -> str:
    """This machine's catalogue key where the config accepts it as `hardware.target` (so the plan calibrates
    here), else cpu."""
    from typing import get_args

    from phase1a.config.schema import HardwareConfig
    from phase1a.core.hardware import detect

    key = detect()[0]
    return key if key in get_args(HardwareConfig.model_fields["target"].annotation) else "cpu"


def write_json(path: Path, value: dict) -> None:
    """Written whole or not at all: a re-run trusts a result file that is there."""
    from phase1a.core.atomic import write_atomically

    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomically(path, json.dumps(value, indent=2, default=jsonable) + "\n")


def speedups(results: list[dict], ours: str = "new") -> dict[str, float]:
    """`ours` (a config) over each other configuration at the same step, in useful tokens/s (derived)."""
    by_step: dict[str, dict[str, dict]] = {}
    for result in results:
        by_step.setdefault(result["step"], {})[result["label"]] = result
    ratios = {}
    for step, measured in by_step.items():
        mine = measured.get(f"{ours}-{step}")
        if mine is None:
            continue
        for label, other in measured.items():
            if label != mine["label"]:
                ratios[f"{mine['label']}_vs_{label}"] = round(
                    mine["derived"]["useful_tokens_per_s"] / other["derived"]["useful_tokens_per_s"], 3)
    return ratios


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=sorted(SHAPES), default="tiny")
    parser.add_argument("--layers", type=int, help="decoder layers (default: the shape's; llama3-8b: 8)")
    parser.add_argument("--tokenizer", type=Path, help="a tokenizer directory; default: SmolLM2-135M-Instruct's, "
                                                       "or for --model test and tiny the test suite's small BPE")
    parser.add_argument("--examples", type=int, default=2000, help="examples generated (the plan's length analysis)")
    parser.add_argument("--max-answer-words", type=int, default=300)
    parser.add_argument("--configs", nargs="+", choices=CONFIGS + OPTIONAL_CONFIGS, default=["new", *PEERS])
    parser.add_argument("--steps", nargs="+", default=[f"demo:{DEMO_BATCH}"], help="NAME:SIZE[:rROW] (docstring)")
    parser.add_argument("--cudnn", nargs="+", choices=("off", "on"), default=["off"],
                        help="SDPA peers: cuDNN's SDPA backend off and/or on (a CUDA host)")
    parser.add_argument("--windows", nargs=4, type=int, metavar=("WARMUP", "TIMED", "SYNCS", "PROFILED"),
                        default=[WINDOWS.warmup, WINDOWS.timed, WINDOWS.syncs, WINDOWS.profiled],
                        help="steps in each window (benchmarks/step_meter.py)")
    parser.add_argument("--liger", choices=("auto", "off"), default="auto",
                        help="ours: Liger's kernels as the product picks them (auto), or off")
    parser.add_argument("--static-rows", action="store_true",
                        help="static rows on a CPU too (a GPU always has them): the dry run's path")
    parser.add_argument("--threads", type=int, help="torch threads in each measurement")
    parser.add_argument("--padded-length", type=int, default=2048,
                        help="before: the length every example is padded to (the field notes': 2048)")
    parser.add_argument("--calibration-budget", default="60s", help="ours: the plan's calibration budget")
    parser.add_argument("--work", type=Path, default=Path("/tmp/phase1a-train-bench"))
    parser.add_argument("--results-dir", type=Path, help="one JSON per measurement; those present are kept")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()

    import torch

    bench = Bench(args)
    cuda = torch.cuda.is_available()
    cudnn_modes = [mode == "on" for mode in args.cudnn] if cuda else [None]
    specs = [bench.spec(config, bench.step(step), cudnn, args)
             for step in args.steps for config in args.configs
             for cudnn in (cudnn_modes if config in SDPA_CONFIGS else [None])
             if config not in FIELD_NOTES or bench.step(step)["batch"] == DEMO_BATCH]
    results, failed = [], {}
    while specs:
        spec = specs.pop(0)
        done = args.results_dir / f"{spec['label']}.json" if args.results_dir else None
        if done is not None and done.is_file():
            result = json.loads(done.read_text())
        else:
            try:
                result = bench.run(spec, separate=cuda)
            except Exception as error:  # the next measurement still runs; this one is retried next time
                failed[spec["label"]] = f"{type(error).__name__}: {error}"[:1000]
                print(f"{spec['label']} failed: {failed[spec['label']]}", flush=True)
                continue
            if done is not None:
                write_json(done, result)
        results.append(result)
        print(json.dumps({k: result[k] for k in ("label", "derived", "losses")}), flush=True)
    summary = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "device": _device(),
               "machine": platform.node(), "torch": torch.__version__, "command": " ".join(sys.argv),
               "model": args.model, "model_dir": str(bench.model_dir), "examples": bench.examples,
               "mean_example_tokens": round(bench.mean_length, 1), "right_sized_max_seq_length": bench.right_sized,
               "labels": [r["label"] for r in results], **speedups(results)}
    if failed:
        summary.update(status="failed", failed=failed, reason="; ".join(f"{k}: {v}" for k, v in failed.items()))
    print(json.dumps(summary, indent=2))
    if args.out:
        write_json(args.out, {**summary, "results": results})
    if failed:
        sys.exit(1)


def _device() -> str:
    from phase1a.core.hardware import detect

    return detect()[1].name


if __name__ == "__main__":
    main()
