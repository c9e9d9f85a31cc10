"""How steady this host's own speed is: the same matrix product, its output preallocated (no allocation, no data,
no Python beyond the loop), timed in consecutive windows, with every core torch uses and with one thread.

    uv run python benchmarks/host_steadiness.py [--windows 12] [--seconds 8] [--size 1024] [--out FILE]

What the windows' spread shows is the floor under any estimate made from a short measurement on this host: a
plan's calibration measures for seconds and the run it prices goes on for minutes, so where identical work
moves by ±15 % from one window to the next, no estimator holds every run to ±10 % (the CPU's
range floor, phase1a/plan/footing.py). The host's steal time (/proc/stat) over the measurement is recorded too:
a hypervisor that takes the vCPU away shows there, a shared core or a moving clock does not. Prints JSON; --out
writes it.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from train_throughput import write_json  # noqa: E402 - after the folders are on the path


def steal_jiffies() -> tuple[int, int] | None:
    """(steal, all) jiffies over every CPU since boot; None where /proc/stat is missing."""
    try:
        fields = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
    except OSError:
        return None
    values = [int(value) for value in fields[:8]]
    return values[7], sum(values)


def windows(threads: int, count: int, seconds: float, size: int) -> list[float]:
    """GFLOP/s of `count` consecutive windows of `seconds`, after one untimed window."""
    torch.set_num_threads(threads)
    a, b, out = torch.randn(size, size), torch.randn(size, size), torch.empty(size, size)
    rates = []
    for window in range(count + 1):
        began, products = time.perf_counter(), 0
        while time.perf_counter() - began < seconds:
            torch.mm(a, b, out=out)
            products += 1
        if window:
            rates.append(2 * size**3 * products / (time.perf_counter() - began) / 1e9)
    return rates


def summary(rates: list[float]) -> dict:
    mean = statistics.fmean(rates)
    return {"gflops": [round(rate, 1) for rate in rates], "mean": round(mean, 1),
            "min_over_max": round(min(rates) / max(rates), 3),
            "half_range_over_mean": round((max(rates) - min(rates)) / 2 / mean, 3),
            "stdev_over_mean": round(statistics.stdev(rates) / mean, 3) if len(rates) > 1 else 0.0}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--windows", type=int, default=12)
    parser.add_argument("--seconds", type=float, default=8.0, help="a window's length")
    parser.add_argument("--size", type=int, default=1024, help="the square matrices' side")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()

    cores = torch.get_num_threads()
    result = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "machine": platform.node(),
              "processor": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
              "torch": torch.__version__, "command": " ".join(sys.argv), "window_seconds": args.seconds,
              "size": args.size}
    for threads in dict.fromkeys((cores, 1)):
        before = steal_jiffies()
        rates = windows(threads, args.windows, args.seconds, args.size)
        after = steal_jiffies()
        steal = None if before is None or after is None else round(
            (after[0] - before[0]) / max(1, after[1] - before[1]), 4)
        result[f"threads_{threads}"] = {**summary(rates), "steal_share": steal}
        print(json.dumps({"threads": threads, **result[f"threads_{threads}"]}), flush=True)
    if args.out:
        write_json(args.out, result)


if __name__ == "__main__":
    main()
