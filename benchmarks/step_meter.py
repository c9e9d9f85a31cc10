"""What every train measurement of the GPU check records, recorded the same way for every code path measured (ours,
the code before issue 34 in its own process, the peers), and the numbers derived from what it recorded.

A measurement runs optimizer steps in four windows, each on steps (data) the windows before did not use:

  warm-up   every shape the later steps use (static rows: a row of each bucket length, twice; then real steps)
  timed     wall clock between two device synchronisations: tokens/s, peak memory
  syncs     host syncs counted (`count_host_syncs`), not timed
  profiled  torch.profiler, not timed: the GPU-busy fraction and the top kernels (`busy_profile`)

Host syncs, on CUDA: `torch.cuda.set_sync_debug_mode("warn")` makes every synchronising CUDA call (a device-to-host
copy, `.item()`, `nonzero`, a stream or device synchronize, ...) emit a warning, captured and counted: the syncs the
CUDA runtime itself reports, whichever Python or C++ code made them. On a CPU (the dry run) nothing synchronises;
there a TorchDispatchMode counts the operators that would (`HOST_READS`: `aten._local_scalar_dense` under
`.item()`/`int()`/`bool()`, `nonzero`, `masked_select`, `is_nonzero`, `equal`), so the code path is exercised.

GPU busy: the profiled window records CUDA activity only (CUPTI; no CPU-side operator recording, which would slow
the host), and busy = the union of the intervals of every kernel, memcpy and memset it recorded (overlaps on several
streams counted once) / the window's wall clock (synchronised at both ends): `busy_fraction`, what the goals read.
The span from the first kernel's start to the last kernel's end is recorded beside it, and the profiled steps'
kernel time a step over the timed (unprofiled) steps' wall a step (`busy_fraction_of_timed_step`: profiling's own
cost kept out of the wall; other steps of the same shapes). A fraction below 1 is time the GPU waited for the host.

Of the project only `phase1a.core` (byte units, atomic writes) is imported, which the code before issue 34 has too:
the process measuring that code imports its tree's `phase1a`.
"""
from __future__ import annotations

import json
import math
import time
import warnings
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Iterable

from phase1a.core.atomic import write_atomically
from phase1a.core.units import GIB

HOST_READS = ("_local_scalar_dense", "nonzero", "masked_select", "is_nonzero", "equal")
SYNC_WARNING = "synchronizing CUDA operation"
TOP_KERNELS = 15


@dataclass(frozen=True)
class Windows:
    """Steps in each window (module docstring)."""

    warmup: int
    timed: int
    syncs: int
    profiled: int

    @property
    def total(self) -> int:
        return self.warmup + self.timed + self.syncs + self.profiled

    def ranges(self) -> dict[str, range]:
        edges = [0, self.warmup, self.warmup + self.timed, self.warmup + self.timed + self.syncs, self.total]
        return {name: range(a, b) for name, a, b in zip(("warmup", "timed", "syncs", "profiled"), edges, edges[1:])}


def cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def synchronize() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


class Meter:
    """The windows of one measurement, driven step by step: `after(i, ...)` once step i (0-based) has run, from a
    loop or from a Trainer's callback. Records the raw numbers (`record()`); `derive` turns them into rates."""

    def __init__(self, windows: Windows, table: Path | None = None):
        if windows.timed < 1:
            raise ValueError("a measurement needs at least one timed step")
        self.windows, self.table = windows, table
        self.useful = self.padded = self.steps = 0
        self.step_tokens: list[int] = []
        self.losses: list = []
        self.seconds = 0.0
        self.peak_memory_bytes: int | None = None
        self.syncs: dict | None = None
        self.busy: dict | None = None
        self._boundary(0)

    def after(self, step: int, useful: int = 0, padded: int = 0, loss=None) -> None:
        """Step `step` ran: `useful` tokens of its examples, `padded` tokens computed (padding included), its loss
        (a tensor on the device is read at the end, never here)."""
        useful, padded = int(useful), int(padded)
        if step in self.windows.ranges()["timed"]:
            self.useful, self.padded, self.steps = self.useful + useful, self.padded + padded, self.steps + 1
            self.step_tokens.append(useful)
        if loss is not None:
            self.losses.append(loss)
        self._boundary(step + 1)

    def _boundary(self, done: int) -> None:
        w = self.windows
        timed_end, syncs_end = w.warmup + w.timed, w.warmup + w.timed + w.syncs
        if done == w.warmup:
            synchronize()
            if cuda():
                import torch

                torch.cuda.reset_peak_memory_stats()
            self.began = time.perf_counter()
        if done == timed_end:
            synchronize()
            self.seconds = time.perf_counter() - self.began
            if cuda():
                import torch

                self.peak_memory_bytes = torch.cuda.max_memory_allocated()
        if w.syncs and done == timed_end:
            self._sync_counter = SyncCounter()
            self._sync_counter.start()
        if w.syncs and done == syncs_end:
            self.syncs = {**self._sync_counter.stop(), "steps": w.syncs}
        if w.profiled and done == syncs_end:
            self._profile = BusyProfile(self.table)
            self._profile.start()
        if w.profiled and done == w.total:
            self.busy = {**self._profile.stop(), "steps": w.profiled}

    @property
    def done(self) -> bool:
        return (self.syncs is not None or not self.windows.syncs) and (self.busy is not None
                                                                       or not self.windows.profiled)

    def record(self) -> dict:
        """The raw numbers of the windows (losses read from the device here, after every window)."""
        return {"windows": asdict(self.windows), "steps": self.steps, "seconds": round(self.seconds, 6),
                "useful_tokens": self.useful, "padded_tokens": self.padded,
                "step_tokens": step_tokens(self.step_tokens), "peak_memory_bytes": self.peak_memory_bytes,
                "syncs": self.syncs, "busy": self.busy, "losses": losses(self.losses)}


class SyncCounter:
    """Host syncs between `start()` and `stop()` (module docstring): {"count", "method"}."""

    def start(self) -> None:
        import torch

        self.on_cuda = cuda()
        if self.on_cuda:
            synchronize()
            self._warnings = warnings.catch_warnings(record=True)
            self._caught = self._warnings.__enter__()
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
        else:
            self._counter = _host_read_counter()
            self._counter.__enter__()

    def stop(self) -> dict:
        import torch

        if self.on_cuda:
            torch.cuda.set_sync_debug_mode(0)
            self._warnings.__exit__(None, None, None)
            count = sum(SYNC_WARNING in str(w.message) for w in self._caught)
            return {"count": count, "method": "torch.cuda.set_sync_debug_mode('warn'): synchronising CUDA calls"}
        self._counter.__exit__(None, None, None)
        return {"count": self._counter.count, "by_op": dict(self._counter.by_op),
                "method": "TorchDispatchMode: " + ", ".join(f"aten.{op}" for op in HOST_READS) + " (a CPU: no syncs)"}


def count_host_syncs(run: Callable[[], None]) -> dict:
    counter = SyncCounter()
    counter.start()
    try:
        run()
    finally:
        result = counter.stop()
    return result


def _host_read_counter():
    from collections import Counter

    from torch.utils._python_dispatch import TorchDispatchMode

    class HostReads(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.count, self.by_op = 0, Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func.__name__.split(".")[0]
            if name in HOST_READS:
                self.count += 1
                self.by_op[name] += 1
            return func(*args, **(kwargs or {}))

    return HostReads()


class BusyProfile:
    """torch.profiler between `start()` and `stop()` (module docstring): the busy fraction's raw numbers and the top
    kernels; the whole key-averages table written to `table`. On a CPU: CPU operators, no busy fraction."""

    def __init__(self, table: Path | None = None):
        self.table = table

    def start(self) -> None:
        from torch.profiler import ProfilerActivity, profile

        self.on_cuda, self.error = cuda(), None
        synchronize()
        try:
            self._profiler = profile(activities=[ProfilerActivity.CUDA] if self.on_cuda else [ProfilerActivity.CPU])
            self._profiler.start()
        except Exception as error:  # a profiler that cannot start on this host: the steps run unprofiled
            self._profiler, self.error = None, f"{type(error).__name__}: {error}"
        self._began = time.perf_counter()

    def stop(self) -> dict:
        synchronize()
        wall = time.perf_counter() - self._began
        result = {"wall_s": round(wall, 6), "activity": "cuda" if self.on_cuda else "cpu"}
        if self._profiler is None:
            return {**result, "error": self.error}
        try:
            self._profiler.stop()
            result.update(self._analyse())
        except Exception as error:  # the numbers it has, and why the rest is missing
            result["error"] = f"{type(error).__name__}: {error}"[:500]
        return result

    def _analyse(self) -> dict:
        averages = self._profiler.key_averages()
        sort = _sort_key(averages, self.on_cuda)
        if self.table is not None:
            self.table.parent.mkdir(parents=True, exist_ok=True)
            self.table.write_text(averages.table(sort_by=sort, row_limit=40) + "\n")
        top = sorted(averages, key=lambda e: -_attribute(e, sort))[:TOP_KERNELS]
        result = {"top": [{"name": e.key[:120], "calls": e.count, "self_us": round(_attribute(e, sort), 1)}
                          for e in top]}
        if self.on_cuda:
            intervals = sorted((e.time_range.start, e.time_range.end) for e in self._profiler.events()
                               if _on_device(e) and e.time_range.end > e.time_range.start)
            result.update(kernel_union_s=round(_union(intervals) / 1e6, 6),
                          kernel_span_s=round((intervals[-1][1] - intervals[0][0]) / 1e6, 6) if intervals else 0.0,
                          kernels=len(intervals))
        return result


def _sort_key(averages, on_cuda: bool) -> str:
    if not on_cuda:
        return "self_cpu_time_total"
    sample = next(iter(averages), None)
    return "self_device_time_total" if sample is None or hasattr(sample, "self_device_time_total") \
        else "self_cuda_time_total"


def _attribute(event, name: str) -> float:
    return float(getattr(event, name, 0.0) or 0.0)


def _on_device(event) -> bool:
    device = getattr(event, "device_type", None)
    return device is not None and getattr(device, "name", str(device)).upper().endswith("CUDA")


def _union(intervals: list[tuple[float, float]]) -> float:
    """Total length of the union of sorted intervals."""
    total, end = 0.0, -math.inf
    for a, b in intervals:
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


@contextmanager
def cudnn_sdpa(enabled: bool | None):
    """SDPA's cuDNN backend on or off for the peers (None: torch's default, untouched)."""
    import torch

    if enabled is None or not cuda():
        yield
        return
    before = torch.backends.cuda.cudnn_sdp_enabled()
    torch.backends.cuda.enable_cudnn_sdp(enabled)
    try:
        yield
    finally:
        torch.backends.cuda.enable_cudnn_sdp(before)


def losses(values: list) -> dict:
    """The steps' losses (tensors on the device, or floats), read once after the windows: first, last, and how
    many were not finite (cuDNN's masked backward has produced NaN on Hopper: a NaN run is reported as such)."""
    if not values:
        return {"steps": 0}
    read = [float(value) for value in values]
    return {"steps": len(read), "first": read[0], "last": read[-1],
            "not_finite": sum(not math.isfinite(v) for v in read)}


# ---------------------------------------------------------------------------------------- the model on the device

def on_device_loader(install: Callable, device: str | None = None) -> Callable:
    """A stand-in for the project's `load_model(model_dir, dtype, trust_remote_code, quantization, attention)` that
    builds the model from the directory's config.json on the device, in `dtype`, with random weights: no checkpoint
    is read or written (a Llama-3-8B shape is 16 GB of bf16). `install`: the project's chunked_loss.install, so the
    model computes its loss as one loaded from disk does."""
    import torch

    def load_model(model_dir, dtype, trust_remote_code=False, quantization_config=None, attention="sdpa"):
        from transformers import AutoConfig, AutoModelForCausalLM

        if quantization_config is not None:
            raise ValueError("a model built on the device has no quantised base")
        config = AutoConfig.from_pretrained(model_dir, trust_remote_code=trust_remote_code)
        torch.manual_seed(0)
        with torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu")):
            model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=attention,
                                                     trust_remote_code=trust_remote_code)
        return install(model)

    return load_model


ON_DEVICE = "ON_DEVICE"  # a model directory holding this marker has config and tokenizer only: built on the device


def builds_on_device(model_dir) -> bool:
    return (Path(model_dir) / ON_DEVICE).is_file()


# ------------------------------------------------------------------------------------------ results, derived numbers

def derive(record: dict) -> dict:
    """The numbers a result reports, each from raw numbers recorded in the same result: `seconds` and `steps` of the
    timed window, its `useful_tokens` (the examples' own) and `padded_tokens` (what the rows computed, padding
    included), `flops_per_token` (4N + attention, phase1a/model/cost_model.py) and `peak_flops` (the device's
    dense bf16 peak; None on a CPU), the sync window's count and steps, the profiled window's kernel time and wall."""
    seconds, steps = record["seconds"], max(1, record["steps"])
    useful, padded = record["useful_tokens"], record["padded_tokens"]
    derived = {
        "seconds_per_step": seconds / steps,
        "useful_tokens_per_s": useful / seconds,
        "padded_tokens_per_s": padded / seconds,
        "padding_share": 1 - useful / padded if padded else 0.0,
        "useful_tokens_per_step": useful / steps,
    }
    per_token, peak = record.get("flops_per_token"), record.get("peak_flops")
    if per_token:
        derived["model_tflops_per_s"] = derived["useful_tokens_per_s"] * per_token / 1e12
        derived["mfu"] = derived["useful_tokens_per_s"] * per_token / peak if peak else None
        embeddings = record.get("input_embedding_parameters")
        if embeddings and peak:  # an untied input embedding is a lookup, yet 4N counts it as 4 FLOPs a parameter
            derived["mfu_without_embedding_lookup"] = derived["mfu"] * (per_token - 4 * embeddings) / per_token
    if record.get("peak_memory_bytes") is not None:
        derived["peak_memory_gib"] = record["peak_memory_bytes"] / GIB
    syncs = record.get("syncs")
    if syncs and syncs.get("steps"):
        derived["syncs_per_step"] = syncs["count"] / syncs["steps"]
    busy = record.get("busy")
    if busy and busy.get("kernel_union_s") is not None and busy.get("wall_s"):
        derived["busy_fraction"] = busy["kernel_union_s"] / busy["wall_s"]
        derived["kernel_span_fraction"] = busy["kernel_span_s"] / busy["wall_s"]
        if busy.get("steps"):  # the profiled steps' kernel time against the unprofiled timed steps' wall
            derived["busy_fraction_of_timed_step"] = busy["kernel_union_s"] / busy["steps"] / (seconds / steps)
    return {key: _round(value) for key, value in derived.items()}


def _round(value):
    return value if value is None or isinstance(value, int) else float(f"{value:.4g}")


def with_derived(record: dict) -> dict:
    return {**record, "derived": derive(record)}


def write_json(path: Path, value: dict) -> None:
    """Written whole or not at all: a re-run trusts a result file that is there."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomically(path, json.dumps(value, indent=2, default=jsonable) + "\n")


def jsonable(value):
    if hasattr(value, "item"):
        return value.item()
    if hasattr(value, "__dataclass_fields__"):
        return asdict(value)
    return str(value)


def step_tokens(counts: Iterable[int]) -> dict:
    counts = list(counts)
    return {"min": min(counts), "mean": round(sum(counts) / len(counts), 1), "max": max(counts)} if counts else {}
