"""Training throughput: the field notes' "before" and "after" configurations, Hugging Face Trainer padding-free,
and ours, one run, same data, same model, same examples measured.

    uv run python benchmarks/train_throughput.py [--model tiny|smollm2|llama3-8b] [--measured 32] [--out FILE]
        [--configs before after hf_flattening ours] [--results-dir DIR] [--profile]

  before         every example padded to 2048 tokens, micro-batch 2 x accumulation 8, no TF32, no dataloader
                 workers, AdamW for-each (Hugging Face Trainer's default)
  after          padded to the right-sized length (p99, at most 2048), TF32, 4 workers, gradient checkpointing,
                 micro-batch 2 x 4
  hf_flattening  Hugging Face Trainer with `DataCollatorWithFlattening` (padding-free: each micro-batch of 8 is
                 one row with restarting position_ids), 8 x 2, fused AdamW, TF32, 4 workers on a GPU, no
                 checkpointing: the strongest setup a peer gets from the library's own parts
  ours           packed rows (no padding), the knobs our plan picks by calibration on this machine, fused AdamW
  trl_sft        (asked for by name, with TRL installed beside the project) TRL's SFTTrainer with
                 `padding_free=True` on the same chat records, tokenized by TRL itself, 8 x 2: its own token
                 count is its useful tokens

Each configuration runs in its own process (its peak memory is its own) on a freshly loaded copy of the same
randomly initialised model (weights do not change speed), LoRA r=16 on every projection. The peers attend with
transformers' SDPA (a padding mask, or for flattened rows the block-diagonal mask it builds from the restarting
position_ids); ours with the implementation our plan picks (`method.attention: auto`). After one warm-up
optimizer step, the same `--measured` examples are timed. Useful tokens are the examples' own (truncated to the
configuration's length); padding waste is the share of computed tokens that were padding. MFU counts model
FLOPs (4N a token for LoRA plus attention, the same count for every configuration) of the useful tokens over
the GPU's dense bf16 peak; a CPU has no peak in the catalogue, so there the achieved TFLOP/s are reported
instead.

`--results-dir` keeps one JSON per configuration and skips those already there, so a run cut short (a GPU
lease ending) continues where it stopped; the model, data and tokenization under `--work` are reused too.
`--profile` adds a torch.profiler table of a few of our steps (the kernels that bound them). Prints JSON;
`--out` writes the summary.
"""
from __future__ import annotations

import argparse
import json
import platform
import shutil
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from tokenize_throughput import _in_process, _peak_rss_mib, generate  # same data, same process runner

from phase1a.core.units import GIB, MIB

SHAPES = {  # hidden, intermediate, layers, heads, kv heads, vocabulary (None: the tokenizer's)
    "test": (64, 128, 2, 4, 2, None),  # the test suite's tiny Llama: the GPU check's dry run
    "tiny": (256, 688, 4, 4, 2, None),
    "smollm2": (576, 1536, 30, 9, 3, None),
    "llama3-8b": (4096, 14336, 32, 32, 8, 128256),
}
CONFIGS = ("before", "after", "hf_flattening", "ours")
OPTIONAL_CONFIGS = ("trl_sft",)  # a package outside the project: `uv run --with trl ...`
SMALL_VOCABULARY = ("test", "tiny")  # shapes that take the test suite's tokenizer
GLOBAL_BATCH = 16  # ours and hf_flattening; the field notes' "after" ran 8
WARMUP_EXAMPLES = 16  # one optimizer step of 16 examples warms every configuration up
PROFILED_STEPS = 3


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


def make_model_dir(shape: str, tokenizer_dir: Path | None, target: Path) -> Path:
    """A randomly initialised Llama of `shape`, written once and reused. The test and tiny shapes take the test
    suite's 400-token BPE tokenizer (built from scratch, no hub): with SmolLM2's 49k vocabulary the logits alone
    would take a CPU minutes."""
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
    hidden, intermediate, layers, heads, kv_heads, vocab = SHAPES[shape]
    config = LlamaConfig(vocab_size=vocab or len(tokenizer), hidden_size=hidden, intermediate_size=intermediate,
                         num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                         max_position_embeddings=8192, tie_word_embeddings=shape != "llama3-8b",
                         pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(0)
    shutil.rmtree(target, ignore_errors=True)
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
    (target / "COMPLETE").touch()  # 16 GB for the 8B shape: a part cut off mid-write is written again
    return target


def measure_padded(name: str, model_dir: str, train_path: str, indices: list[int], length: int, micro: int,
                   accumulation: int, checkpointing: bool, workers: int, tf32: bool, queue) -> None:
    """The field notes' trainer: padded batches with an attention mask, the model's own mean loss."""
    import torch
    from torch.utils.data import DataLoader

    from phase1a.config.schema import MethodConfig
    from phase1a.core.labels import IGNORE_INDEX
    from phase1a.model.build import build_model
    from phase1a.train.packing import TokenRows

    rows = TokenRows.load(train_path, length)
    method = MethodConfig(optimizer="adamw", liger="off", attention="sdpa")
    model = build_model(Path(model_dir), method, checkpointing)
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = tf32  # build_model turns it on
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    pad = model.config.pad_token_id or 0
    device = next(model.parameters()).device

    def padded(i: int) -> dict:
        start, end = int(rows.offsets[i]), rows.end(i)
        ids = torch.full((length,), pad, dtype=torch.long)
        labels = torch.full((length,), IGNORE_INDEX, dtype=torch.long)
        ids[: end - start] = torch.from_numpy(rows.input_ids[start:end].astype("int64"))
        labels[: end - start] = torch.from_numpy(rows.labels[start:end].astype("int64"))
        return {"input_ids": ids, "attention_mask": (torch.arange(length) < end - start).long(), "labels": labels}

    # The first optimizer step's examples warm up (kernels chosen, optimizer state allocated), as for the others.
    warmup_batches = WARMUP_EXAMPLES // micro
    loader = DataLoader([padded(i) for i in indices], batch_size=micro, num_workers=workers,
                        pin_memory=torch.cuda.is_available())
    model.train()
    began, computed = None, 0
    for step, batch in enumerate(loader):
        if step == warmup_batches:
            began = _start_clock()
        batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
        (model(**batch, use_cache=False).loss / accumulation).backward()
        computed += batch["input_ids"].numel() if began is not None else 0
        if (step + 1) % accumulation == 0:
            torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    _sync()
    useful = int(rows.lengths()[indices[WARMUP_EXAMPLES:]].sum())
    queue.put(_summary(name, time.perf_counter() - began, useful, computed, {
        "max_seq_length": length, "micro_batch_size": micro, "accumulation": accumulation,
        "gradient_checkpointing": checkpointing, "dataloader_workers": workers, "tf32": tf32}))


def measure_hf_flattening(model_dir: str, train_path: str, indices: list[int], length: int, micro: int,
                          workers: int, queue) -> None:
    """Hugging Face Trainer, padding-free: `DataCollatorWithFlattening` makes each micro-batch one row whose
    position_ids restart at every example, which transformers' attention turns into per-example attention."""
    import torch
    from transformers import DataCollatorWithFlattening, Trainer, TrainingArguments

    from phase1a.config.schema import MethodConfig
    from phase1a.model.build import build_model
    from phase1a.train.packing import TokenRows

    rows = TokenRows.load(train_path, length)
    model = build_model(Path(model_dir), MethodConfig(liger="off", attention="sdpa"), gradient_checkpointing=False)
    cuda = torch.cuda.is_available()
    examples = [{"input_ids": rows.input_ids[int(rows.offsets[i]):rows.end(i)].tolist(),
                 "labels": rows.labels[int(rows.offsets[i]):rows.end(i)].tolist()} for i in indices]

    accumulation = GLOBAL_BATCH // micro
    clock = _step_clock()
    with tempfile.TemporaryDirectory() as output_dir:
        arguments = TrainingArguments(
            **_trainer_arguments(output_dir, micro, len(indices)), tf32=True if cuda else None,
            optim="adamw_torch_fused" if cuda else "adamw_torch", dataloader_num_workers=workers,
            dataloader_pin_memory=cuda, remove_unused_columns=False, max_grad_norm=1.0)
        _in_order(Trainer)(model=model, args=arguments, train_dataset=examples,
                           data_collator=DataCollatorWithFlattening(), callbacks=[clock]).train()
    _sync()
    useful = int(rows.lengths()[indices[WARMUP_EXAMPLES:]].sum())
    queue.put(_summary("hf_flattening", time.perf_counter() - clock.began, useful, useful, {
        "max_seq_length": length, "micro_batch_size": micro, "accumulation": accumulation,
        "gradient_checkpointing": False, "dataloader_workers": workers, "tf32": cuda, "packed": True}))


def measure_trl_sft(model_dir: str, data_path: str, count: int, length: int, micro: int, queue) -> None:
    """TRL's SFTTrainer, padding-free, on the first `count` chat records in order: the peer most users start from."""
    from datasets import load_dataset
    from trl import SFTConfig, SFTTrainer

    from phase1a.config.schema import MethodConfig
    from phase1a.model.build import build_model
    from phase1a.model.loading import load_tokenizer

    model = build_model(Path(model_dir), MethodConfig(liger="off", attention="sdpa"), gradient_checkpointing=False)
    accumulation = GLOBAL_BATCH // micro
    records = load_dataset("json", data_files=data_path, split="train").select(range(count))
    clock, tokens = _step_clock(), []
    with tempfile.TemporaryDirectory() as output_dir:
        # TRL refuses max_length with padding-free rows unless it packs; the records are within it anyway.
        arguments = SFTConfig(**_trainer_arguments(output_dir, micro, count), padding_free=True, max_length=None,
                              dataloader_num_workers=0)
        trainer = _in_order(SFTTrainer)(model=model, args=arguments, train_dataset=records,
                                        processing_class=load_tokenizer(Path(model_dir)), callbacks=[clock])
        collate = trainer.data_collator

        def counting(features):  # in this process: no loader workers
            batch = collate(features)
            tokens.append(int(batch["input_ids"].numel()))
            return batch

        trainer.data_collator = counting
        trainer.train()
    _sync()
    useful = sum(tokens[accumulation:])  # the first optimizer step's micro-batches warm up
    queue.put(_summary("trl_sft", time.perf_counter() - clock.began, useful, useful, {
        "max_seq_length": length, "micro_batch_size": micro, "accumulation": accumulation,
        "gradient_checkpointing": False, "dataloader_workers": 0, "packed": True}))


def _in_order(trainer_class):
    """The Trainer feeding examples in order: the same steps of the same examples as the other configurations."""
    from torch.utils.data import SequentialSampler

    class InOrder(trainer_class):
        def _get_train_sampler(self, *args, **kwargs):
            return SequentialSampler(self.train_dataset)

    return InOrder


def _step_clock():
    """Starts the clock after the first optimizer step, as the other configurations warm up on one."""
    from transformers import TrainerCallback

    class Clock(TrainerCallback):
        began: float | None = None

        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == 1:
                self.began = _start_clock()

    return Clock()


def _trainer_arguments(output_dir: str, micro: int, examples: int) -> dict:
    """What both Trainer-based peers share: global batch 16 in micro-batches of `micro`, one pass over
    `examples`, a constant learning rate, bf16 on a GPU, no logging, checkpoints or trackers."""
    import torch

    return {"output_dir": output_dir, "per_device_train_batch_size": micro,
            "gradient_accumulation_steps": GLOBAL_BATCH // micro, "max_steps": examples // GLOBAL_BATCH,
            "learning_rate": 1e-4, "lr_scheduler_type": "constant", "bf16": torch.cuda.is_available(),
            "logging_strategy": "no", "save_strategy": "no", "report_to": "none", "disable_tqdm": True, "seed": 0}


def measure_ours(model_dir: str, data_json: str, indices: list[int], calibration_budget: str, profile: bool,
                 queue) -> None:
    """Our train stage's step on the knobs our plan picks here (its calibration is not timed)."""
    import numpy as np
    import torch

    from phase1a.config.schema import Phase1aConfig
    from phase1a.data.tokenized import TokenizedData
    from phase1a.model.build import build_model, make_optimizer
    from phase1a.model.loading import prepare_model
    from phase1a.train.packing import StepBatches, step_loader, token_budget
    from phase1a.train.steps import optimizer_step
    from tasks.plan import make_plan

    data = TokenizedData.model_validate_json(data_json)
    config = Phase1aConfig.model_validate({
        "work_dir": (work := tempfile.mkdtemp()), "cache_dir": work, "data": {"source": "unused"},
        "model": {"name_or_path": model_dir},
        "method": {"batch_size": GLOBAL_BATCH, "lora": {"r": 16, "alpha": 32}},
        "hardware": {"target": config_target()},
        "plan": {"calibration_share": 1.0, "calibration_budget": calibration_budget}})
    plan = make_plan(config, prepare_model(config), data)
    model = build_model(Path(model_dir), config.method, plan.gradient_checkpointing, compile=plan.compile)
    optimizer = make_optimizer(model, config.method)
    order = np.array(indices)
    batches = StepBatches(data.train_path, plan.max_seq_length, order, GLOBAL_BATCH,
                          token_budget(plan.micro_batch_size, plan.max_seq_length))
    model.train()
    began, computed = None, 0
    for step, step_batch in enumerate(step_loader(batches, range(len(batches)), plan.dataloader_workers,
                                                  pin_memory=torch.cuda.is_available())):
        if step == WARMUP_EXAMPLES // GLOBAL_BATCH:
            began = _start_clock()
        optimizer_step(model, optimizer, step_batch)
        computed += sum(row["input_ids"].numel() for row in step_batch["micro_batches"]) if began is not None else 0
    _sync()
    seconds = time.perf_counter() - began
    useful = int(batches.rows.lengths()[order[WARMUP_EXAMPLES:]].sum())
    result = _summary("ours", seconds, useful, computed, {
        "max_seq_length": plan.max_seq_length, "micro_batch_size": plan.micro_batch_size,
        "accumulation": plan.gradient_accumulation, "gradient_checkpointing": plan.gradient_checkpointing,
        "dataloader_workers": plan.dataloader_workers, "compile": plan.compile, "packed": True,
        "attention": model.config._attn_implementation, "plan_tokens_per_second": round(plan.tokens_per_second, 1)})
    if profile:
        result["profile"] = _profile(model, optimizer, batches)
    queue.put(result)


def _profile(model, optimizer, batches) -> str:
    """The operators that take our steps' time, heaviest first: what bounds the throughput."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from phase1a.train.steps import optimizer_step

    cuda = torch.cuda.is_available()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as profiler:
        for step in range(min(PROFILED_STEPS, len(batches))):
            optimizer_step(model, optimizer, batches[step])
        _sync()
    return profiler.key_averages().table(sort_by="cuda_time_total" if cuda else "cpu_time_total", row_limit=20)


def _summary(name: str, seconds: float, useful: int, computed: int, knobs: dict) -> dict:
    import torch

    peak = torch.cuda.max_memory_allocated() / GIB if torch.cuda.is_available() else _peak_rss_mib() * MIB / GIB
    return {"config": name, **knobs, "seconds": round(seconds, 3), "useful_tokens": useful, "computed_tokens": computed,
            "useful_tokens_per_s": round(useful / seconds, 1), "padding_waste": round(1 - useful / computed, 4),
            "peak_memory_gib": round(peak, 3)}


def _start_clock() -> float:
    """Synchronise, zero the peak-memory counter, and return the start time of the measured steps."""
    import torch

    _sync()
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    return time.perf_counter()


def _sync() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


class Bench:
    """What every configuration shares: the model directory, the tokenized data and the examples measured."""

    def __init__(self, args: argparse.Namespace):
        from phase1a.config.schema import ModelConfig
        from phase1a.data.lengths import right_size
        from phase1a.model.loading import load_tokenizer, resolve_model
        from phase1a.train.packing import TokenRows
        from tasks.tokenize import TokenizeOptions, tokenize_dataset

        args.work.mkdir(parents=True, exist_ok=True)
        tokenizer_dir = args.tokenizer
        if tokenizer_dir is None and args.model not in SMALL_VOCABULARY:
            tokenizer_dir = resolve_model(ModelConfig(name_or_path="smollm2-135m-instruct"))
        self.model_dir = make_model_dir(args.model, tokenizer_dir, args.work / f"model-{args.model}")
        self.data_path = data_path = args.work / f"chat_{args.examples}_{args.max_answer_words}.jsonl"
        if not data_path.is_file():
            generate(data_path, args.examples, seed=1, max_answer_words=args.max_answer_words)
        # One fingerprint per model and data: a re-run (or the next configuration's part) reuses the tokenization.
        self.data = tokenize_dataset(data_path, load_tokenizer(self.model_dir), 8192, TokenizeOptions(),
                                     args.work / "cache" / f"bench-{args.model}-{data_path.stem}")
        self.indices = list(range(WARMUP_EXAMPLES + args.measured))
        # "after" right-sizes as the field notes did: to the p99 length (truncating the longest 1 %), within 2048.
        self.right_sized = min(2048, right_size(TokenRows.load(self.data.train_path).lengths(), 99.0, 8192, None))

    def run(self, config: str, args: argparse.Namespace) -> dict:
        """Several configurations: each in a process of its own; one (a part of the GPU check): in this one."""
        model, train = str(self.model_dir), self.data.train_path
        call = _in_process if len(args.configs) > 1 else _here
        if config == "before":
            return call(measure_padded, "before", model, train, self.indices, 2048, 2, 8, False, 0, False)
        if config == "after":
            return call(measure_padded, "after", model, train, self.indices, self.right_sized, 2, 4, True, 4, True)
        if config == "hf_flattening":  # forked loaders on a CPU only take cores from the model
            return call(measure_hf_flattening, model, train, self.indices, self.data.max_seq_length, 8,
                        4 if _cuda() else 0)
        if config == "trl_sft":  # TRL tokenizes the records itself: the first ones of the file, as many
            return call(measure_trl_sft, model, str(self.data_path), len(self.indices), self.data.max_seq_length, 8)
        return call(measure_ours, model, self.data.model_dump_json(), self.indices, args.calibration_budget,
                    args.profile)


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
    write_atomically(path, json.dumps(value, indent=2) + "\n")


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def with_mfu(result: dict, model_dir: Path, mean_length: float) -> dict:
    """Model TFLOP/s of the useful tokens (4N + attention for LoRA, the same count for every configuration)."""
    from phase1a.core.hardware import detect
    from phase1a.model.cost_model import flops_per_token, mfu, model_facts

    per_token = flops_per_token(model_facts(model_dir), False, False, mean_length)
    peak = detect()[1].peak_flops
    return {**result, "model_tflops_per_s": round(result["useful_tokens_per_s"] * per_token / 1e12, 4),
            "mfu": mfu(result["useful_tokens_per_s"], per_token, peak) if peak else None}


def speedups(results: list[dict]) -> dict[str, float]:
    """Ours over each other configuration present, in useful tokens/s."""
    by_name = {r["config"]: r for r in results}
    if "ours" not in by_name:
        return {}
    ours = by_name["ours"]["useful_tokens_per_s"]
    return {f"speedup_vs_{peer}": round(ours / by_name[peer]["useful_tokens_per_s"], 2)
            for peer in CONFIGS + OPTIONAL_CONFIGS if peer != "ours" and peer in by_name}


def summarise(args: argparse.Namespace, bench: Bench, results: list[dict]) -> dict:
    import torch

    from phase1a.core.hardware import detect
    from phase1a.model.cost_model import model_facts

    return {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "device": detect()[1].name,
        "machine": platform.node(), "torch": torch.__version__, "command": " ".join(sys.argv), "model": args.model,
        "parameters": model_facts(bench.model_dir).parameters, "examples_measured": args.measured,
        "right_sized_max_seq_length": bench.right_sized, "results": results, **speedups(results),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=sorted(SHAPES), default="tiny")
    parser.add_argument("--tokenizer", type=Path, help="a tokenizer directory; default: SmolLM2-135M-Instruct's, "
                                                       "or for --model test and tiny the test suite's small BPE")
    parser.add_argument("--measured", type=int, default=16, help="examples timed (a multiple of 16)")
    parser.add_argument("--examples", type=int, default=2000, help="examples generated (the plan's length analysis)")
    parser.add_argument("--max-answer-words", type=int, default=300)
    parser.add_argument("--configs", nargs="+", choices=CONFIGS + OPTIONAL_CONFIGS, default=list(CONFIGS))
    parser.add_argument("--calibration-budget", default="60s", help="ours: the plan's calibration budget")
    parser.add_argument("--profile", action="store_true", help="ours: a profiler table of a few steps")
    parser.add_argument("--work", type=Path, default=Path("/tmp/phase1a-train-bench"))
    parser.add_argument("--results-dir", type=Path, help="one JSON per configuration; those present are kept")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if args.measured % GLOBAL_BATCH:
        parser.error(f"--measured must be a multiple of {GLOBAL_BATCH}")

    bench = Bench(args)
    mean_length = bench.data.lengths.total_tokens / bench.data.lengths.count
    results = []
    for config in args.configs:
        done = args.results_dir / f"{config}.json" if args.results_dir else None
        if done is not None and done.is_file():
            result = json.loads(done.read_text())
        else:
            result = {"model": args.model, **with_mfu(bench.run(config, args), bench.model_dir, mean_length)}
            if done is not None:
                write_json(done, result)
        results.append(result)
        print(json.dumps({k: v for k, v in result.items() if k != "profile"}), flush=True)
    summary = summarise(args, bench, results)
    print(json.dumps({k: v for k, v in summary.items() if k != "results"}, indent=2))
    if args.out:
        write_json(args.out, summary)


if __name__ == "__main__":
    main()
