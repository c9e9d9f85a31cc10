"""A greedy step's seconds as calibration times it and as the validate stage runs it, on one model shape.

    uv run python benchmarks/decode_step.py [--model test|smollm2] [--tokenizer DIR] [--out FILE]

Calibration prices the validate stage's generation by timing greedy steps on the training model
(`time_decode_step`: a manual loop over the KV cache, Liger's kernels as training left them, the adapter's path on);
the validate stage generates with transformers' `generate` on a model loaded for scoring (`load_for_eval`: no
Liger), the base with its adapter off and the candidate with it on. On a GPU whose steps are bound by kernel
launches those differ. Each row: the model (training's or validation's), Liger on or off, the adapter on or off,
the loop (calibration's or `generate`), seconds a step (generate: the difference between two lengths, so the
prefill cancels), and dispatcher ops a step. Rounds alternate the rows; the spread is reported.
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from contextlib import contextmanager, nullcontext
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from train_throughput import SHAPES, make_model_dir, write_json  # noqa: E402

STEPS = 16  # calibration's timed steps (phase1a/evaluate/metrics.py _DECODE_STEPS)
SHORT, LONG = 8, 40  # generate's two lengths: their difference is LONG - SHORT steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=sorted(SHAPES), default="test")
    parser.add_argument("--tokenizer", type=Path)
    parser.add_argument("--prompts", type=int, default=16, help="rows in the generation batch")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--work", type=Path, default=Path("/tmp/phase1a-decode-step"))
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()

    import numpy as np
    import torch

    from phase1a.config.schema import MethodConfig
    from phase1a.core.hardware import detect, training_device
    from phase1a.evaluate.generation import generate_greedy, time_decode_step
    from phase1a.model import liger
    from phase1a.model.build import attention_implementation, build_model
    from phase1a.model.loading import adapter_off, load_for_eval, training_dtype

    model_dir = make_model_dir(args.model, args.tokenizer, args.work / f"model-{args.model}")
    device = training_device()
    method = MethodConfig(lora={"r": 16, "alpha": 32})
    trained = build_model(model_dir, method, False)  # as calibration holds it after its trials
    adapter_dir = args.work / "adapter"
    trained.save_pretrained(adapter_dir)
    attention = attention_implementation(method, device, training_dtype(device))
    scored = load_for_eval(model_dir, adapter_dir, device, attention=attention)  # as the validate stage loads it
    base = load_for_eval(model_dir, None, device, attention=attention)
    rng = np.random.default_rng(0)
    vocabulary = trained.get_input_embeddings().num_embeddings
    prompts = [rng.integers(10, vocabulary, size=int(rng.integers(50, 90))) for _ in range(args.prompts)]

    def manual(model, steps: int = STEPS) -> float:
        return time_decode_step(model, prompts, pad_id=0, steps=steps).seconds_per_step

    def generated(model) -> float:
        seconds = []
        for new in (SHORT, LONG):
            began = time.perf_counter()
            generate_greedy(model, prompts, new, [-1], 0, len(prompts))  # no stop token: every step runs
            seconds.append(time.perf_counter() - began)
        return (seconds[1] - seconds[0]) / (LONG - SHORT)

    @contextmanager
    def training(kernels: bool = True, adapter: bool = True):
        """Training's model as calibration holds it, or with Liger's kernels or the adapter's path off."""
        with (nullcontext() if kernels else liger.kernels_off(trained),
              nullcontext() if adapter else adapter_off(trained)):
            yield trained

    rows = {  # name: (what, the model as a context, calibration's loop or generate)
        "calibration": ("training's model, Liger as trained, adapter on, calibration's loop", training, manual),
        "calibration-no-liger": ("training's model, Liger off, adapter on, calibration's loop",
                                 lambda: training(kernels=False), manual),
        "calibration-adapter-off": ("training's model, Liger as trained, adapter off, calibration's loop",
                                    lambda: training(adapter=False), manual),
        "training-generate": ("training's model, Liger as trained, adapter on, generate", training, generated),
        "candidate-manual": ("validation's candidate (adapter on), calibration's loop",
                             lambda: nullcontext(scored), manual),
        "candidate": ("validation's candidate (adapter on), generate", lambda: nullcontext(scored), generated),
        "base-manual": ("validation's base, calibration's loop", lambda: nullcontext(base), manual),
        "base": ("validation's base, generate", lambda: nullcontext(base), generated),
    }
    for model in (trained, scored, base):
        model.eval()
    seconds: dict[str, list[float]] = {name: [] for name in rows}
    first: dict[str, list[float]] = {name: [] for name in rows}  # the two warm-up calls' whole seconds
    ops: dict[str, float] = {}

    def report() -> dict:
        results = {
            "date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "device": detect()[1].name,
            "machine": platform.node(), "torch": torch.__version__, "command": " ".join(sys.argv),
            "model": args.model, "prompts": args.prompts, "liger_installed": liger.installed(),
            "rows": {name: {"what": what, "seconds_per_step": statistics.median(seconds[name]) if seconds[name]
                            else None, "all": [round(s, 6) for s in seconds[name]], "ops_per_step": ops.get(name),
                            # a process's first greedy call: on the H200 the validate stage's first generate took
                            # 5.4 s where the same batch took 1.8 s in the next run
                            "warmup_call_seconds": [round(s, 3) for s in first[name]]}
                     for name, (what, _, _) in rows.items()},
        }
        calibration = results["rows"]["calibration"]["seconds_per_step"]
        for row in results["rows"].values():
            row["vs_calibration"] = (round(row["seconds_per_step"] / calibration, 3)
                                     if calibration and row["seconds_per_step"] else None)
        if args.out:  # after every round: a run cut by its timeout keeps what it measured
            write_json(args.out, results)
        return results

    with torch.no_grad():
        for _ in range(2):  # not in the median: each row's first calls (kernels chosen, caches grown)
            for name, (_, held, loop) in rows.items():
                with held() as model:
                    began = time.perf_counter()
                    loop(model)
                    first[name].append(time.perf_counter() - began)
        for _ in range(args.rounds):
            for name, (_, held, loop) in rows.items():
                with held() as model:
                    seconds[name].append(loop(model))
            report()
        for name, (_, held, loop) in rows.items():
            if loop is manual:
                with held() as model:
                    ops[name] = _ops_per_step(lambda steps, model=model: manual(model, steps))
    print(json.dumps(report(), indent=2))


def _ops_per_step(call) -> float:
    """Dispatcher ops a greedy step of calibration's loop: runs of 4 and 8 steps, differenced."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        ops = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops += 1
            return func(*args, **(kwargs or {}))

    counts = []
    for steps in (4, 8):
        with Count() as counter:
            call(steps)
        counts.append(counter.ops)
    return (counts[1] - counts[0]) / 4


if __name__ == "__main__":
    main()
