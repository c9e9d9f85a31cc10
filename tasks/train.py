"""Train: LoRA (or full) fine-tuning on packed rows, sparse checkpoints, exact resume, honest progress.

Read top to bottom, `train()` is the whole recipe:
  1. a finished run is reused; otherwise build the model and optimizer the plan chose (`phase1a/modeling.py`)
  2. resume from the latest complete checkpoint of this run: weights, optimizer, scheduler, RNG, step. The
     data position is the step number itself (`StepBatches` is a pure function of the step), so nothing is
     re-iterated
  3. each optimizer step: this rank's packed rows, the loss normalised over the whole step's supervised
     tokens, clip, step. Out of memory: halve the row's token budget (accumulation doubles, the global batch
     and the gradient stay the same), restore the step's RNG, redo the step
  4. checkpoint when the interval (wall time and/or steps) fires, and on SIGTERM/SIGINT before exiting
  5. save the adapter in peft's format, with `result.json`, marked complete last

Several GPUs: `train_task` launches `torchrun` over this module's `__main__`; see `phase1a/distributed.py`.
Imports without Prefect, so the same loop runs on a bare GPU host.
"""
from __future__ import annotations

import json
import shutil
import sys
import time
from pathlib import Path
from typing import Literal

import torch
from pydantic import BaseModel

from phase1a import distributed
from phase1a.checkpoints import (TrainingState, list_checkpoints, load_checkpoint, load_optimizer_state,
                                 optimizer_state_dict, save_checkpoint, trainable_state_dict)
from phase1a.config import MethodConfig
from phase1a.fingerprint import hash_json
from phase1a.modeling import build_model, make_optimizer, make_scheduler
from phase1a.packing import StepBatches, TokenRows, example_stream, step_loader, summed_loss, token_budget
from phase1a.preemption import Preempted, StopSignals
from phase1a.locks import write_atomically
from phase1a.progress import ProgressReporter, append_event
from phase1a.units import parse_interval
from tasks.caching import task


class TrainSettings(BaseModel):
    model_dir: str
    train_path: str
    output_dir: str
    method: MethodConfig
    micro_batch_size: int  # a packed row's token budget, in examples of max_seq_length
    gradient_checkpointing: bool
    compile: bool = False
    dataloader_workers: int = 0
    max_seq_length: int | None = None  # the plan's truncation, when it is shorter than the tokenized data
    checkpoint_interval: str = "30m"
    keep_last: int = 2
    trust_remote_code: bool = False
    show_progress: bool = True
    num_processes: int = 1  # >1: torchrun, one process a GPU
    strategy: Literal["ddp", "fsdp"] = "ddp"  # with several processes
    model_flops_per_token: float | None = None  # for MFU: 4N (LoRA) or 6N plus attention, no recompute
    peak_flops: float | None = None  # the device's dense bf16 peak; None on CPUs
    planned_seconds: float | None = None  # the plan's train estimate, for "on track"


class TrainResult(BaseModel):
    adapter_dir: str
    output_dir: str
    steps: int
    resumed_from_step: int | None
    reused_completed_run: bool
    wall_seconds: float
    train_tokens: int
    tokens_per_second: float
    final_loss: float | None
    checkpoints_written: int
    checkpoint_seconds: float
    startup_seconds: float = 0.0  # model load, adapter, optimizer, resume: before the first step
    checkpoint_share: float = 0.0  # checkpoint writes as a share of the wall time
    micro_batch_size: int = 0  # at the end: smaller than planned after out-of-memory back-offs
    out_of_memory_backoffs: int = 0
    padding_tokens: int = 0  # computed tokens that were not an example's: zero when rows are packed
    mean_mfu: float | None = None


def training_key(tokenized_fingerprint: str, model_fingerprint: str, method: MethodConfig, max_seq_length: int) -> str:
    """What makes two runs the same run: same data, weights and training semantics (not micro-batching)."""
    return hash_json({"data": tokenized_fingerprint, "model": model_fingerprint, "method": method.model_dump(),
                      "max_seq_length": max_seq_length})[:16]


def train_settings(config, plan, data, model_dir: Path, model_fingerprint: str) -> TrainSettings:
    """The train stage's settings from the config and the plan: its knobs, its epochs (a window may have cut
    them), its truncation; the output directory is keyed by what makes two runs the same run."""
    from phase1a.hardware import detect

    method = config.method.model_copy(update={"epochs": plan.epochs})
    run_key = training_key(data.fingerprint, model_fingerprint, method, plan.max_seq_length)
    return TrainSettings(
        model_dir=str(model_dir), train_path=data.train_path, method=method, max_seq_length=plan.max_seq_length,
        output_dir=str(config.work_dir / config.name / f"train-{run_key}"),
        micro_batch_size=plan.micro_batch_size, gradient_checkpointing=plan.gradient_checkpointing,
        compile=plan.compile, dataloader_workers=plan.dataloader_workers,
        checkpoint_interval=config.checkpoint.interval, keep_last=config.checkpoint.keep_last,
        trust_remote_code=config.model.trust_remote_code, num_processes=config.hardware.num_gpus,
        strategy=config.hardware.strategy,
        model_flops_per_token=plan.model_flops_per_token, peak_flops=detect()[1].peak_flops,
        planned_seconds=plan.estimated_train_seconds,
    )


def train_step(model, micro_batches: list[dict[str, torch.Tensor]], supervised: int, weight: float = 1.0,
               world_size: int = 1) -> tuple[float, int]:
    """Forward and backward over one rank's rows of an optimizer step; the loss is normalised over the whole
    step's supervised tokens, so accumulation (and DDP's average, undone by `world_size`) gives the gradient of
    one big batch. Gradients are all-reduced once, on the last row. Returns (this rank's loss, tokens)."""
    device = next(model.parameters()).device
    scale = weight * world_size / max(1, supervised)
    total_loss, tokens = 0.0, 0
    for index, micro in enumerate(micro_batches):
        batch = {k: v.to(device, non_blocking=True) for k, v in micro.items()}
        last = index == len(micro_batches) - 1
        with distributed.gradient_sync(model, enabled=last):
            loss, _, _ = summed_loss(model, batch)
            (loss * scale).backward()
        total_loss += loss.item() * weight
        tokens += batch["input_ids"].numel() if weight else 0
    return total_loss / max(1, supervised), tokens


def optimizer_step(model, optimizer, step_batch: dict, world_size: int = 1) -> tuple[float, int, float]:
    """One whole optimizer step as training runs it, shared with calibration so both time the same work."""
    loss, tokens = train_step(model, step_batch["micro_batches"], step_batch["supervised"],
                              step_batch.get("weight", 1.0), world_size)
    grad_norm = torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], 1.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    if hasattr(grad_norm, "full_tensor"):  # FSDP: the norm over all shards, a distributed tensor
        grad_norm = grad_norm.full_tensor()
    return loss, tokens, float(grad_norm)


def train(settings: TrainSettings, on_model=None) -> TrainResult:
    """`on_model(model)` runs once the model is built: a hook for instrumentation and fault injection."""
    output_dir = Path(settings.output_dir)
    final_dir = output_dir / "final"
    if (final_dir / "COMPLETE").is_file():  # this exact run already finished: nothing to redo
        summary = TrainResult.model_validate_json((final_dir / "result.json").read_text())
        return summary.model_copy(update={"reused_completed_run": True})

    world = distributed.init_world()
    method = settings.method
    began = time.perf_counter()
    torch.manual_seed(method.seed)
    num_examples = len(TokenRows.from_arrow(settings.train_path))
    max_length = settings.max_seq_length or int(TokenRows.from_arrow(settings.train_path).lengths().max())
    order, total_examples = example_stream(num_examples, method.epochs, method.seed)
    micro = settings.micro_batch_size

    def batches_for(micro_batch_size: int) -> StepBatches:
        return StepBatches(settings.train_path, settings.max_seq_length, order, method.batch_size, total_examples,
                           token_budget(micro_batch_size, max_length), world.rank, world.size)

    total_steps = len(batches_for(micro))
    sharded = settings.strategy == "fsdp" and world.size > 1
    # torch.compile is not combined with FSDP's per-layer hooks here: the sharded run is eager.
    model = build_model(Path(settings.model_dir), method, settings.gradient_checkpointing, settings.trust_remote_code,
                        settings.compile and not sharded)
    if on_model is not None:
        on_model(model)
    model = distributed.wrap(model, world, settings.strategy)
    optimizer = make_optimizer(model, method)
    scheduler = make_scheduler(optimizer, round(method.warmup_fraction * total_steps), total_steps)

    checkpoint_root = output_dir / "checkpoints"
    start_step, resumed_from, prior_seconds = 0, None, 0.0
    if existing := list_checkpoints(checkpoint_root):
        state = load_checkpoint(existing[-1], distributed.unwrap(model))
        load_optimizer_state(distributed.unwrap(model), optimizer, state.optimizer)
        scheduler.load_state_dict(state.scheduler)
        torch.set_rng_state(state.torch_rng)
        if state.cuda_rng and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(state.cuda_rng)
        start_step = resumed_from = state.step
        prior_seconds = state.elapsed_seconds

    interval = parse_interval(settings.checkpoint_interval)
    output_dir.mkdir(parents=True, exist_ok=True)
    if world.main:
        _trim_metrics(output_dir / "metrics.jsonl", start_step)  # steps after the checkpoint are redone
    reporter = ProgressReporter(output_dir, total_steps, start_step, model_flops_per_token=settings.model_flops_per_token,
                                peak_flops=settings.peak_flops, planned_seconds=settings.planned_seconds,
                                show_progress=settings.show_progress and world.main, enabled=world.main)
    if resumed_from is not None:
        reporter.event("resumed", from_step=resumed_from, checkpoint=existing[-1].name)
    model.train()
    started = last_save = time.perf_counter()
    startup = started - began
    last_save_step, checkpoints, checkpoint_seconds, tokens_done, loss, backoffs, mfus = start_step, 0, 0.0, 0, None, 0, []

    def checkpoint(step: int) -> Path:
        nonlocal checkpoints, checkpoint_seconds
        began_save = time.perf_counter()
        path = checkpoint_root / f"step-{step:08d}"
        weights = trainable_state_dict(distributed.unwrap(model))  # every rank: FSDP gathers the shards
        optimizer_state = optimizer_state_dict(distributed.unwrap(model), optimizer)
        if world.main:
            cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []
            state = TrainingState(step, optimizer_state, scheduler.state_dict(), torch.get_rng_state(), cuda_rng,
                                  prior_seconds + began_save - started)
            path = save_checkpoint(checkpoint_root, weights, state, settings.keep_last)
        distributed.barrier(world)
        checkpoints += 1
        checkpoint_seconds += time.perf_counter() - began_save
        return path

    loader = iter(step_loader(batches_for(micro), range(start_step, total_steps), settings.dataloader_workers,
                              pin_memory=torch.cuda.is_available()))
    step = start_step
    with StopSignals() as stop:
        while step < total_steps:
            step_batch, rng = next(loader), torch.get_rng_state()
            try:
                loss, tokens, grad_norm = optimizer_step(model, optimizer, step_batch, world.size)
            except torch.OutOfMemoryError:
                if micro == 1:
                    raise  # a row of one example has nowhere to go
                if world.size > 1:
                    # One rank cannot back off alone: its peers wait in a collective. It leaves a note and fails;
                    # `run` relaunches every rank with half the budget, resuming from the last checkpoint.
                    (output_dir / f"out_of_memory.rank{world.rank}.json").write_text(json.dumps({"step": step + 1}))
                    raise
                optimizer.zero_grad(set_to_none=True)
                if torch.cuda.is_available():
                    torch.cuda.empty_cache()
                torch.set_rng_state(rng)
                micro, backoffs = micro // 2, backoffs + 1
                reporter.event("out_of_memory", step=step + 1, micro_batch_size=micro,
                               token_budget=token_budget(micro, max_length))
                loader = iter(step_loader(batches_for(micro), range(step, total_steps), settings.dataloader_workers,
                                          pin_memory=torch.cuda.is_available()))
                continue
            scheduler.step()
            step += 1
            tokens_done += tokens
            record = reporter.step(step, loss=loss, lr=scheduler.get_last_lr()[0], grad_norm=grad_norm, tokens=tokens,
                                   elapsed=time.perf_counter() - started, prior_seconds=prior_seconds)
            if record.get("mfu") is not None:
                mfus.append(record["mfu"])
            due = interval.due(time.perf_counter() - last_save, step - last_save_step)
            if distributed.any_rank(stop.requested is not None, world):
                path = checkpoint(step)
                reporter.event("preempted", signal=stop.requested or "peer", step=step, checkpoint=path.name)
                reporter.close()
                raise Preempted(stop.requested or "a signal to another rank", step, str(path))
            if step < total_steps and distributed.any_rank(due, world):
                checkpoint(step)
                last_save, last_save_step = time.perf_counter(), step
    reporter.close()
    wall = time.perf_counter() - started
    tokens_done = distributed.sum_over_ranks(tokens_done, world)

    result = TrainResult(
        adapter_dir=str(final_dir), output_dir=str(output_dir), steps=total_steps, resumed_from_step=resumed_from,
        reused_completed_run=False, wall_seconds=round(wall, 3), train_tokens=tokens_done,
        tokens_per_second=round(tokens_done / max(wall, 1e-9), 2), final_loss=loss,
        checkpoints_written=checkpoints, checkpoint_seconds=round(checkpoint_seconds, 3),
        startup_seconds=round(startup, 3), checkpoint_share=round(checkpoint_seconds / max(wall, 1e-9), 5),
        micro_batch_size=micro, out_of_memory_backoffs=backoffs,
        mean_mfu=round(sum(mfus) / len(mfus), 4) if mfus else None,
    )
    weights = trainable_state_dict(model) if sharded else None  # every rank: FSDP gathers the shards
    if world.main:
        _save_final(distributed.unwrap(model), final_dir, result, weights)
    distributed.barrier(world)
    return result


def _trim_metrics(path: Path, last_step: int) -> None:
    """Keep the records up to the checkpoint a run resumes from: the curve stays continuous, without repeats."""
    if not path.exists():
        return
    kept = [line for line in path.read_text().splitlines()
            if line.strip() and json.loads(line).get("step", 0) <= last_step]
    path.write_text("".join(line + "\n" for line in kept))


def _save_final(model, final_dir: Path, result: TrainResult, weights: dict | None = None) -> None:
    """The adapter in peft's own format (PeftModel.from_pretrained loads it), marked complete last. `weights`:
    the trainable tensors gathered whole, when the model holds only its shards (FSDP)."""
    partial = final_dir.with_name("final.partial")
    shutil.rmtree(partial, ignore_errors=True)
    model.save_pretrained(partial, **({"state_dict": weights} if weights is not None else {}))
    (partial / "result.json").write_text(result.model_dump_json(indent=2))
    (partial / "COMPLETE").write_text("ok\n")
    shutil.rmtree(final_dir, ignore_errors=True)
    partial.rename(final_dir)


def record_run(history: Path, plan, result: TrainResult, model_fingerprint: str, config):
    """Measured against estimated, appended to the history that the next plan of this model reads; the record."""
    from phase1a.history import RunRecord, append_run

    record = RunRecord(
        model_fingerprint=model_fingerprint, model_name=config.model.name_or_path, hardware=config.hardware.target,
        device_name=plan.detected, precision=plan.precision, method_kind=config.method.kind,
        micro_batch_size=plan.micro_batch_size, gradient_checkpointing=plan.gradient_checkpointing,
        compile=plan.compile, dataloader_workers=plan.dataloader_workers, max_seq_length=plan.max_seq_length,
        # Steady speed: checkpoint writes are estimated separately, from their own measured cost.
        tokens_per_second=result.train_tokens / max(result.wall_seconds - result.checkpoint_seconds, 1e-9),
        startup_seconds=result.startup_seconds,
        checkpoint_seconds_each=result.checkpoint_seconds / result.checkpoints_written if result.checkpoints_written else None,
        estimated_train_seconds=plan.estimated_train_seconds, actual_train_seconds=result.wall_seconds,
    )
    append_run(history, record)
    return record


def run(settings: TrainSettings) -> TrainResult:
    """One process, or `num_processes` ranks under torchrun; the result is rank 0's, read from the run."""
    if settings.num_processes <= 1:
        return train(settings)
    output_dir = Path(settings.output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    settings_path = output_dir / "settings.json"
    _out_of_memory_notes(output_dir)  # a crashed launcher's leftovers do not count for this launch
    backoffs = 0
    while True:
        settings_path.write_text(settings.model_dump_json(indent=2))
        try:
            distributed.launch(settings.num_processes, settings_path, cwd=Path(__file__).resolve().parents[1])
            break
        except RuntimeError:
            notes = _out_of_memory_notes(output_dir)
            if not notes or settings.micro_batch_size == 1:
                raise
            micro = settings.micro_batch_size // 2
            settings, backoffs = settings.model_copy(update={"micro_batch_size": micro}), backoffs + 1
            # The ranks are gone: the launcher records it.
            append_event(output_dir, "out_of_memory", step=min(notes), micro_batch_size=micro, relaunched=True)
    result_path = output_dir / "final" / "result.json"
    result = TrainResult.model_validate_json(result_path.read_text())
    if backoffs:
        result = result.model_copy(update={"out_of_memory_backoffs": result.out_of_memory_backoffs + backoffs})
        write_atomically(result_path, result.model_dump_json(indent=2))
    return result


def _out_of_memory_notes(output_dir: Path) -> list[int]:
    """The steps at which ranks ran out of memory in the launch that just failed; the notes are consumed."""
    steps = []
    for note in output_dir.glob("out_of_memory.rank*.json"):
        steps.append(json.loads(note.read_text())["step"])
        note.unlink()
    return steps


@task(name="train")
def train_task(settings: TrainSettings) -> TrainResult:
    # Two runs with the same training key share output_dir (a duplicate manual run, or one during the nightly
    # run): training side by side would interleave metrics, race on checkpoint renames and write one
    # final.partial. The second waits, then reuses the finished run, or resumes if the first one died. The
    # launching process holds the lock for all its torchrun ranks.
    from phase1a.locks import exclusive

    with exclusive(Path(settings.output_dir + ".lock"), f"training directory {settings.output_dir}"):
        return run(settings)


if __name__ == "__main__":  # a torchrun rank: python -m tasks.train SETTINGS.json
    rank_world = distributed.init_world()
    try:
        train(TrainSettings.model_validate_json(Path(sys.argv[1]).read_text()))
    finally:
        distributed.finish(rank_world)
