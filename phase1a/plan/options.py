"""The options table: the same training job on several hardware options, with hours and dollars for each
(docs/plan-models.md#the-options-table: the formulas and their assumptions).

Each row says where its speed comes from: `measured` (the reference GPU kind's own speed, from calibration or the
history of earlier runs there) or `modelled` (the GPU model, phase1a/plan/gpu_model.py, from kernel launches and
per-step overhead fitted to committed GPU measurements and compute at a ceiling MFU; or the plan's assumed MFU), and
gives its tokens/s, hours and dollars as a range [low, high] beside the value."""
from __future__ import annotations

import math
from typing import Literal

from pydantic import BaseModel

from phase1a.core.hardware import CATALOGUE
from phase1a.core.units import GIB
from phase1a.plan.communication import NETWORKS, StepTraffic, step_communication
from phase1a.plan.gpu_model import GpuStep, Modelled, load_overheads, modelled_speed
from phase1a.plan.interruptions import Exposure, NotExpectedToFinish, auto_interval, expected

Strategy = Literal["single", "ddp", "fsdp", "zero3", "hsdp", "auto"]
LrRule = Literal["sqrt", "linear", "none"]
Source = Literal["measured", "modelled"]
# Where the reference speed comes from: measured there (calibration, history), the plan's assumed MFU (a catalogue
# target that is not present), or the GPU model (a target that is no catalogue GPU: the rows are all modelled).
ReferenceSource = Literal["measured", "assumed", "modelled"]
SHARDED: frozenset[str] = frozenset({"fsdp", "zero3"})  # hsdp shards inside a node: memory_per_gpu over its GPUs
IMPLAUSIBLE_MFU = 0.6  # above this a dense transformer's training throughput is almost certainly mis-modelled


class OptionSpec(BaseModel):
    label: str
    gpus: int  # in all, over `nodes`
    kind: str  # catalogue key
    strategy: Strategy  # auto (several nodes): ddp where the model fits a GPU, else hsdp where a node's shard
    # fits, else fsdp
    nodes: int = 1
    network: str = "infiniband-400"  # between nodes: a phase1a.plan.communication.NETWORKS key

    @property
    def gpus_per_node(self) -> int:
        return self.gpus // self.nodes


class OptionRow(BaseModel):
    label: str
    gpus: int
    kind: str
    strategy: Strategy
    fits: bool
    memory_per_gpu_gib: float
    memory_available_gib: float
    tokens_per_second: float
    mfu: float
    hours: float
    dollars: float | None  # None where no price is known for the GPU kind
    learning_rate: float
    global_batch: int
    note: str
    nodes: int = 1
    network: str = ""  # between the nodes: a phase1a.plan.communication.NETWORKS key
    scaling_efficiency: float = 1.0  # the share of n GPUs' linear speed-up kept
    communication_seconds: float = 0.0  # a step's transfers between GPUs, hidden or not
    spot_hours: float | None = None  # with the expected interruptions; None: not expected to finish, or no spot job
    spot_dollars: float | None = None
    spot_interruptions: float | None = None  # expected over the run
    evaluation_seconds: float = 0.0  # the validate stage and evaluations during training, on one GPU of this kind
    host_seconds: float = 0.0  # start-up, warm-up, checkpoint writes: the host's, the same on every option
    # Where the speed comes from, and its range (None in plans written before the fields): measured, the
    # reference kind's own speed; modelled, the GPU model's or scaled from the reference (module docstring).
    source: Source = "measured"
    tokens_per_second_low: float | None = None
    tokens_per_second_high: float | None = None
    hours_low: float | None = None  # at the high speed
    hours_high: float | None = None
    dollars_low: float | None = None
    dollars_high: float | None = None
    basis: str = ""  # what the speed and its range rest on, in words


DEFAULT_OPTIONS: list[OptionSpec] = [
    OptionSpec(label="1x H100", gpus=1, kind="h100", strategy="single"),
    OptionSpec(label="1x H200", gpus=1, kind="h200", strategy="single"),
    OptionSpec(label="2x H100 DDP", gpus=2, kind="h100", strategy="ddp"),
    OptionSpec(label="2x H100 FSDP", gpus=2, kind="h100", strategy="fsdp"),
    OptionSpec(label="4x A100-40GB ZeRO-3", gpus=4, kind="a100-40gb", strategy="zero3"),
    OptionSpec(label="4x H200 DDP", gpus=4, kind="h200", strategy="ddp"),
    OptionSpec(label="8x H100", gpus=8, kind="h100", strategy="auto"),
    OptionSpec(label="2x8 H100 IB", gpus=16, kind="h100", strategy="auto", nodes=2),
    OptionSpec(label="4x8 H100 IB", gpus=32, kind="h100", strategy="auto", nodes=4),
    OptionSpec(label="2x8 H100 Eth", gpus=16, kind="h100", strategy="auto", nodes=2, network="ethernet-100"),
]


def with_option(spec: OptionSpec, options: list[OptionSpec]) -> list[OptionSpec]:
    """`options` with `spec` first, unless one of them already runs as many GPUs of its kind on as many nodes (over
    the same network): a plan's own hardware always has its row, whichever catalogue kind it is."""
    same = [option for option in options if (option.kind, option.gpus, option.nodes) == (spec.kind, spec.gpus,
                                                                                           spec.nodes)
            and (spec.nodes == 1 or option.network == spec.network)]
    return list(options) if same else [spec, *options]


DEFAULT_SCALING = 0.9  # per doubling, for a job without its step's traffic


def scaling_factor(gpus: int, scaling_efficiency: float = DEFAULT_SCALING) -> float:
    """Fraction of linear speed-up kept on `gpus` GPUs: `scaling_efficiency` per doubling beyond one."""
    if gpus < 1:
        raise ValueError(f"gpus must be at least 1, got {gpus}")
    return scaling_efficiency ** math.log2(gpus)


def scaled_learning_rate(learning_rate: float, batch_growth: float, lr_rule: LrRule = "sqrt") -> float:
    if lr_rule == "sqrt":
        return learning_rate * math.sqrt(batch_growth)
    if lr_rule == "linear":
        return learning_rate * batch_growth
    return learning_rate


def memory_per_gpu(memory_needed_bytes_per_gpu: float, weights_and_state_bytes: float, gpus: int,
                   strategy: Strategy) -> float:
    if strategy in SHARDED:
        return memory_needed_bytes_per_gpu - weights_and_state_bytes + weights_and_state_bytes / gpus
    return memory_needed_bytes_per_gpu


class SpotJob(BaseModel):
    """What one interruption costs, the same on any option (the same checkpoint, store and start-up)."""

    checkpoint_seconds: float  # delta: one checkpoint written and uploaded
    restart_seconds: float  # a fresh host to its first step
    startup_seconds: float  # with the option's evaluation, the part of its hours outside the train loop
    interval_seconds: float | None = None  # a configured interval's wall time; None: auto, chosen per option
    store: bool = True  # without one a fresh host starts over


class OtherWork(BaseModel):
    """What a run does besides its training steps: seconds the host spends the same on any option, and
    evaluation's work, priced on each option at that option's speed (module docstring)."""

    host_seconds: float = 0.0  # start-up, warm-up, checkpoint writes
    forward_tokens: float = 0.0  # evaluation's teacher-forced and prefill tokens: the validate stage, during training
    decode_steps: float = 0.0  # its greedy steps of generation batches
    reference_forward_seconds_per_token: float = 0.0  # on one GPU of the reference kind, measured or modelled
    reference_decode_seconds_per_step: float = 0.0

    def evaluation_seconds(self, reference: str, kind: str) -> float:
        forward = self.reference_forward_seconds_per_token * _peak(reference) / _peak(kind)
        step = self.reference_decode_seconds_per_step * _bandwidth_ratio(reference, kind)
        return self.forward_tokens * forward + self.decode_steps * step


class OptionsJob(BaseModel):
    """The single-GPU plan's numbers that every option is scaled from."""

    train_tokens: int
    flops_per_token: float
    reference: str  # a catalogue key: the GPU kind `reference_tokens_per_second` was measured (or assumed) on
    reference_tokens_per_second: float
    memory_needed_bytes_per_gpu: float  # the unsharded job on one GPU
    weights_and_state_bytes: float  # the shardable part of it: weights, gradients, optimizer state
    global_batch: int
    learning_rate: float
    traffic: StepTraffic | None = None  # one step on one reference GPU: what several GPUs would move
    other: OtherWork = OtherWork()  # besides the training steps: the host's seconds, and evaluation's work
    spot: SpotJob | None = None  # what an interruption costs; None: no spot column
    reference_source: ReferenceSource = "measured"
    reference_basis: str = ""  # what the reference speed rests on, in words (the plan's footing)
    reference_range: tuple[float, float] = (1.0, 1.0)  # its low and high, as multiples of the reference speed
    gpu: GpuStep | None = None  # one step as a GPU runs it: the GPU model prices the other kinds; None: they are
    # scaled by peak FLOP/s
    assumed_mfu: float = 0.35  # the GPU model's ceiling where no measurement says better (plan.assumed_mfu)


class OptionsPolicy(BaseModel):
    """Which options to price and how a job scales across GPUs."""

    options: list[OptionSpec] = DEFAULT_OPTIONS
    scaling_efficiency: float | None = None  # a share kept per doubling of GPUs; None: from the job's traffic
    prices: dict[str, float] | None = None  # per GPU-hour by catalogue key, over the catalogue's
    spot_prices: dict[str, float] | None = None  # the same for spot
    interruption_rates: dict[str, float] | None = None  # per hour by catalogue key, over the catalogue's spot rate
    lr_rule: LrRule = "sqrt"
    keep_global_batch: bool = False
    memory_headroom: float = 0.0


def option_rows(job: OptionsJob, policy: OptionsPolicy | None = None) -> list[OptionRow]:
    """One row per option; the formulas are in the module docstring."""
    policy = policy or OptionsPolicy()
    for spec in policy.options:
        if spec.strategy == "single" and spec.gpus != 1:
            raise ValueError(f"option {spec.label!r}: strategy 'single' needs exactly one GPU, not {spec.gpus}")
        if spec.gpus % spec.nodes:
            raise ValueError(f"option {spec.label!r}: {spec.gpus} GPUs do not divide into {spec.nodes} nodes")
    return [_row(spec, job, policy) for spec in policy.options]


class _Speed(BaseModel):
    """One GPU's tokens/s on an option, its range, and what it rests on."""

    low: float
    value: float
    high: float
    source: Source
    basis: str
    note: str = ""
    step_ratio: float  # a whole step's seconds on this kind over the reference's: what communication hides behind


def _row(spec: OptionSpec, job: OptionsJob, policy: OptionsPolicy) -> OptionRow:
    accelerator, peak, n = CATALOGUE[spec.kind], _peak(spec.kind), spec.gpus
    available = accelerator.memory_bytes * (1 - policy.memory_headroom)
    strategy, why = _strategy(spec, job, available)
    speed = _speed(spec, job, policy)
    efficiency, communication = _efficiency(spec, strategy, job, policy, speed.step_ratio)
    tokens_per_second = speed.value * n * efficiency
    evaluation = job.other.evaluation_seconds(job.reference, spec.kind)
    price = (policy.prices or {}).get(spec.kind, accelerator.price_per_hour)
    needed = _memory(job, spec, strategy)
    mfu = tokens_per_second * job.flops_per_token / (n * peak)

    def hours_at(rate: float) -> float:  # evaluation moves with the training speed
        return (job.train_tokens / rate + job.other.host_seconds + evaluation * tokens_per_second / rate) / 3600

    hours, low, high = hours_at(tokens_per_second), speed.low * n * efficiency, speed.high * n * efficiency
    notes = [why] if why else []
    if needed > available:
        notes.append(f"needs {needed / GIB:.1f} GiB per GPU, {available / GIB:.1f} available")
    if speed.note:
        notes.append(speed.note)
    if policy.keep_global_batch or n == 1:
        batch, lr = job.global_batch, job.learning_rate
        if n > 1:
            notes.append(f"accumulation / {n}" + ("" if job.global_batch % n == 0
                                                  else f" (batch {job.global_batch} not divisible)"))
    else:
        batch, lr = n * job.global_batch, scaled_learning_rate(job.learning_rate, n, policy.lr_rule)
        notes.append(f"batch x{n}, {n}x fewer steps, lr {policy.lr_rule}")
    if mfu > IMPLAUSIBLE_MFU:
        notes.append(f"implied MFU {mfu:.0%} is implausible")
    row = OptionRow(
        label=spec.label, gpus=n, kind=spec.kind, strategy=strategy, fits=needed <= available,
        scaling_efficiency=efficiency, communication_seconds=communication, nodes=spec.nodes,
        network=spec.network,
        memory_per_gpu_gib=needed / GIB, memory_available_gib=available / GIB,
        tokens_per_second=tokens_per_second, mfu=mfu, hours=hours, evaluation_seconds=evaluation,
        host_seconds=job.other.host_seconds,
        dollars=None if price is None else n * price * hours, learning_rate=lr, global_batch=batch,
        note="; ".join(notes), source=speed.source, basis=speed.basis,
        tokens_per_second_low=low, tokens_per_second_high=high, hours_low=hours_at(high), hours_high=hours_at(low),
        dollars_low=None if price is None else n * price * hours_at(high),
        dollars_high=None if price is None else n * price * hours_at(low),
    )
    return _with_spot(row, job.spot, policy) if job.spot else row


def _speed(spec: OptionSpec, job: OptionsJob, policy: OptionsPolicy) -> _Speed:
    """One GPU of the option: the reference kind's own speed (measured, or assumed); another kind's from the GPU
    model, directly where the reference is the model's too, else as the reference's times the model's ratio
    between the kinds; without a GPU step, the reference's scaled by peak FLOP/s (its range down to the same speed:
    a step bound by overhead runs no faster on a faster GPU)."""
    reference, kind, ref = job.reference, spec.kind, job.reference_tokens_per_second
    lo, hi = job.reference_range
    own = kind == reference
    if job.gpu is None:
        if own:
            return _Speed(low=ref * lo, value=ref, high=ref * hi, step_ratio=1.0, basis=job.reference_basis,
                          source="measured" if job.reference_source == "measured" else "modelled")
        r = _peak(kind) / _peak(reference)
        return _Speed(low=ref * lo * min(1.0, r), value=ref * r, high=ref * hi * max(1.0, r), step_ratio=1 / r,
                      source="modelled", note=f"throughput scaled from {reference} by peak FLOP/s",
                      basis=f"{reference}'s speed ({job.reference_basis or job.reference_source}) scaled by peak "
                            f"FLOP/s, down to the same speed where overhead bounds the step")
    overheads = load_overheads()
    step = job.gpu.share(spec.gpus) if policy.keep_global_batch else job.gpu
    on_kind = modelled_speed(step, kind, job.assumed_mfu)
    at_reference = modelled_speed(job.gpu, reference, job.assumed_mfu)
    whole = on_kind if step is job.gpu else modelled_speed(job.gpu, kind, job.assumed_mfu)
    ratio = at_reference.value / whole.value  # step seconds on kind over the reference's
    if job.reference_source == "modelled":  # the reference is the model's: every kind straight from it
        return _Speed(low=on_kind.low, value=on_kind.value, high=on_kind.high, step_ratio=ratio, source="modelled",
                      basis=f"GPU model: {on_kind.words(overheads)}; overheads {overheads.basis()}",
                      note=f"{on_kind.words(overheads)} ({overheads.short_basis()})")
    ratios = _ratios(on_kind, at_reference)
    value = ref * on_kind.value / at_reference.value
    low, high = ref * lo * min(ratios), ref * hi * max(ratios)
    if own and step is job.gpu:
        speed = _Speed(low=ref * lo, value=ref, high=ref * hi, step_ratio=1.0, basis=job.reference_basis,
                       source="measured" if job.reference_source == "measured" else "modelled")
        if job.reference_source == "assumed" and at_reference.high < ref * lo:
            speed.note = (f"the GPU model gives {at_reference.low:,.0f}-{at_reference.high:,.0f} tok/s "
                          f"({at_reference.words(overheads)}; {overheads.short_basis()})")
        return speed
    what = f"{reference}'s speed ({job.reference_basis or job.reference_source})"
    return _Speed(low=low, value=value, high=high, step_ratio=ratio, source="modelled",
                  basis=f"{what} x the GPU model's {kind}/{reference} ratio ({on_kind.words(overheads)}; overheads "
                        f"{overheads.basis()})",
                  note=f"throughput scaled from {reference} by the GPU model ({on_kind.bound}-bound)")


def _ratios(on_kind: Modelled, at_reference: Modelled) -> tuple[float, float, float]:
    return (on_kind.low / at_reference.low, on_kind.value / at_reference.value, on_kind.high / at_reference.high)


def _memory(job: OptionsJob, spec: OptionSpec, strategy: Strategy) -> float:
    """A GPU's bill: hsdp shards over a node's GPUs, fsdp and zero3 over all of them."""
    shards = spec.gpus_per_node if strategy == "hsdp" else spec.gpus
    return memory_per_gpu(job.memory_needed_bytes_per_gpu, job.weights_and_state_bytes, shards,
                          "fsdp" if strategy == "hsdp" else strategy)


def _strategy(spec: OptionSpec, job: OptionsJob, available: float) -> tuple[Strategy, str]:
    """`auto`: ddp where the whole model fits a GPU (the least traffic), else hsdp where a node's shard fits
    (gathers stay on NVLink), else fsdp over every GPU; and why."""
    if spec.strategy != "auto":
        return spec.strategy, ""
    for strategy, why in (("ddp", "ddp: the model fits a GPU"),
                          ("hsdp", "hsdp: too big for one GPU, a node's shard fits"),
                          ("fsdp", "fsdp: a node's shard does not fit, sharded over every GPU")):
        if spec.nodes == 1 and strategy == "hsdp":
            continue
        if _memory(job, spec, strategy) <= available:
            return strategy, why
    return "fsdp", "fsdp: sharded over every GPU, and still too big"


def _efficiency(spec: OptionSpec, strategy: Strategy, job: OptionsJob, policy: OptionsPolicy,
                step_ratio: float) -> tuple[float, float]:
    """The share of linear speed-up kept, and a step's communication seconds (module docstring); `step_ratio`: a
    step's seconds on the option's kind over the reference's."""
    if spec.gpus == 1:
        return 1.0, 0.0
    if policy.scaling_efficiency is not None or job.traffic is None:
        return scaling_factor(spec.gpus, policy.scaling_efficiency or DEFAULT_SCALING), 0.0
    traffic, shrink = job.traffic, (spec.gpus if policy.keep_global_batch else 1)
    on_this_gpu = traffic.model_copy(update={
        "compute_seconds": traffic.compute_seconds * step_ratio / shrink,
        "micro_batches": max(1, traffic.micro_batches // shrink)})
    spread = "fsdp" if strategy in SHARDED else strategy
    moved = step_communication(on_this_gpu, spread, spec.kind, spec.gpus_per_node, spec.nodes, spec.network)
    return moved.efficiency, moved.seconds


def _bandwidth_ratio(reference: str, kind: str) -> float:
    """How much faster a greedy step (bound by reading the weights) is on `reference` than on `kind`."""
    ours, theirs = CATALOGUE[reference].memory_bandwidth, CATALOGUE[kind].memory_bandwidth
    return ours / theirs if ours and theirs else _peak(reference) / _peak(kind)


def _with_spot(row: OptionRow, spot: SpotJob, policy: OptionsPolicy) -> OptionRow:
    """The row's spot columns: its hours with the interruptions expected at its speed, at the spot price."""
    accelerator = CATALOGUE[row.kind]
    rate = (policy.interruption_rates or {}).get(row.kind, accelerator.spot_interruptions_per_hour) or 0.0
    price = (policy.spot_prices or {}).get(row.kind, accelerator.spot_price_per_hour)
    run = row.hours * 3600
    train = max(0.0, run - spot.startup_seconds - row.evaluation_seconds)
    interval = spot.interval_seconds or auto_interval(rate, spot.checkpoint_seconds, train, spot.store)[0]
    try:
        cost = expected(rate, Exposure(run, train, interval, spot.checkpoint_seconds, spot.restart_seconds,
                                       spot.store))
    except NotExpectedToFinish:
        return row.model_copy(update={"note": "; ".join(filter(None, [row.note, "spot: not expected to finish"]))})
    hours = (run + cost.extra_seconds) / 3600
    return row.model_copy(update={"spot_hours": hours, "spot_interruptions": cost.interruptions,
                                  "spot_dollars": None if price is None else row.gpus * price * hours})


def _peak(kind: str) -> float:
    if kind not in CATALOGUE:
        raise ValueError(f"{kind!r} is not in the hardware catalogue ({', '.join(CATALOGUE)}); "
                         "the options table scales throughput by catalogue peak FLOP/s")
    peak = CATALOGUE[kind].peak_flops
    if peak is None:
        raise ValueError(f"no peak FLOP/s is known for {kind}")
    return peak


def format_options(rows: list[OptionRow]) -> str:
    """A plain-text table, one line per option, columns padded to their widest cell; a range [low-high] beside a
    value where the row has one."""
    header = ["option", "fits", "GiB/GPU", "source", "tok/s", "scaling", "MFU", "hours", "USD", "spot h", "spot USD",
              "lr", "batch", "note"]
    cells = [header] + [[
        row.label, "yes" if row.fits else "NO", f"{row.memory_per_gpu_gib:.1f}/{row.memory_available_gib:.0f}",
        row.source, ranged(row.tokens_per_second, row.tokens_per_second_low, row.tokens_per_second_high, "{:,.0f}"),
        "-" if row.gpus == 1 else f"{row.scaling_efficiency:.0%}", _percent(row.mfu),
        ranged(row.hours, row.hours_low, row.hours_high, "{:.2f}"),
        _dollars(row.dollars) if row.dollars is None else ranged(row.dollars, row.dollars_low, row.dollars_high,
                                                                  "{:,.2f}"),
        "-" if row.spot_hours is None else f"{row.spot_hours:.2f}",
        "-" if row.spot_hours is None else _dollars(row.spot_dollars),
        f"{row.learning_rate:.3g}", str(row.global_batch), row.note,
    ] for row in rows]
    widths = [max(len(line[i]) for line in cells) for i in range(len(header) - 1)]
    lines = ["  ".join(cell.ljust(width) for cell, width in zip(line, widths)) + "  " + line[-1] for line in cells]
    return "\n".join(line.rstrip() for line in lines)


def ranged(value: float, low: float | None, high: float | None, spec: str) -> str:
    """`value`, and its range [low-high] where it has one that reads differently (`spec`: a format string)."""
    text = spec.format(value)
    if low is None or high is None:
        return text
    low_text, high_text = spec.format(low), spec.format(high)
    return text if low_text == high_text == text else f"{text} [{low_text}-{high_text}]"


def _percent(share: float) -> str:
    """A share as a percentage, to two significant figures below 1 %."""
    return f"{share:.0%}" if share >= 0.01 or share == 0 else f"{share * 100:.2g}%"


def more_nodes(rows: list[OptionRow]) -> list[str]:
    """Each row of several nodes against the same GPUs on fewer nodes (one, or fewer on its network): the time it
    saves and the money it adds, so the plan shows where more nodes stop paying."""
    lines = []
    for row in sorted((row for row in rows if row.nodes > 1), key=lambda row: (row.kind, row.network, row.nodes)):
        fewer = [other for other in rows if other.kind == row.kind and other.nodes < row.nodes
                 and other.gpus // other.nodes == row.gpus // row.nodes
                 and (other.nodes == 1 or other.network == row.network)]
        if not fewer or row.dollars is None:
            continue
        before = max(fewer, key=lambda other: other.nodes)
        if before.dollars is None:
            continue
        lines.append(f"{before.label} -> {row.label} ({NETWORKS[row.network].name}): time "
                     f"{_change(row.hours / before.hours)}, cost {_change(row.dollars / before.dollars)}, "
                     f"scaling {before.scaling_efficiency:.0%} -> {row.scaling_efficiency:.0%}")
    return lines


def _change(ratio: float) -> str:
    """A ratio as a signed percentage change; under half a percent either way reads +0%."""
    change = ratio - 1
    return "+0%" if abs(change) < 0.005 else f"{change:+.0%}"


def _dollars(value: float | None) -> str:
    return "?" if value is None else f"{value:,.2f}"
