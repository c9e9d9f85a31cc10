"""The train step of the code before issue 34 (commit bec201d, carried to a GPU host as .gpu/before.tar), measured
in the windows of benchmarks/step_meter.py on the same data, model and step sizes as ours.

    python3 benchmarks/old_code.py --tree /tmp/before --spec spec.json --out old-demo.json

Run by `benchmarks/gpu_check.py --old-code` in a process whose PYTHONPATH holds the extracted tree and not this
checkout: `phase1a` here is that tree's. Only this file's own folder comes from this checkout (Python puts it on the
path first), for step_meter, which imports nothing of the project. The step is the old train stage's:
`build_model` (its attention `auto`: the per-example SDPA loop `sdpa_packed`), `StepBatches` of exact rows (no
padding: a new row length every step, which is its cost), `step_loader`, `optimizer_step` (which reads the loss
and the gradient norm back every step). The spec (written by gpu_check from this checkout's benchmark) names the
model directory, the tokenized data (the same file ours reads), the examples a step, a row's token budget, the
windows, FLOPs a token and the device's peak, so the result's derived numbers are computed as ours are.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tree", type=Path, required=True, help="the extracted old tree")
    parser.add_argument("--spec", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    sys.path.insert(0, str(args.tree))  # before this checkout, wherever PYTHONPATH put it
    spec = json.loads(args.spec.read_text())

    import numpy as np
    import torch
    from step_meter import Meter, Windows, builds_on_device, on_device_loader, with_derived, write_json

    import phase1a

    if not Path(phase1a.__file__).resolve().is_relative_to(args.tree.resolve()):
        raise SystemExit(f"phase1a imported from {phase1a.__file__}, not from the old tree {args.tree}")
    import phase1a.model.build as build
    from phase1a.config.schema import MethodConfig
    from phase1a.model import chunked_loss
    from phase1a.train.packing import StepBatches, step_loader
    from phase1a.train.steps import optimizer_step

    if spec.get("threads"):
        torch.set_num_threads(spec["threads"])
    if builds_on_device(spec["model_dir"]):
        build.load_model = on_device_loader(chunked_loss.install)
    cuda = torch.cuda.is_available()
    batch, windows = spec["batch"], Windows(**spec["windows"])
    method = MethodConfig(batch_size=batch, lora={"r": 16, "alpha": 32})
    began = time.perf_counter()
    model = build.build_model(Path(spec["model_dir"]), method, False)
    optimizer = build.make_optimizer(model, method)
    order = np.arange(spec["examples"])  # an epoch in file order, as ours takes it (exact rows: only the steps)
    budget = spec["row_tokens"] or batch * spec["max_seq_length"]
    batches = StepBatches(spec["train_path"], spec["max_seq_length"], order, batch, budget)
    model.train()
    built = time.perf_counter()
    meter = Meter(windows, Path(spec["results_dir"]) / f"{spec['label']}.profile.txt")
    workers = 2 if cuda else 0
    loader = iter(step_loader(batches, range(windows.total), workers, pin_memory=cuda))
    for index in range(windows.total):
        step = next(loader)
        loss, _, _ = optimizer_step(model, optimizer, step)  # the old step: a float, read back every step
        tokens = sum(int(row["input_ids"].numel()) for row in step["micro_batches"])
        meter.after(index, tokens, tokens, loss)
    record = meter.record()
    if record["peak_memory_bytes"] is None:
        import resource

        from phase1a.core.units import KIB

        record["peak_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * KIB
    write_json(args.out, with_derived({
        "label": spec["label"], "config": "old", "model": spec["model"], "code": spec["code"], "step": spec["step"],
        "batch": batch, "cudnn_sdpa": None, "torch": torch.__version__, "max_seq_length": spec["max_seq_length"],
        "gradient_checkpointing": False, "compile": False, "cuda_graphs": False, "dataloader_workers": workers,
        "row_tokens": budget, "static_rows": False, "attention": model.config._attn_implementation,
        "liger": method.liger, "optimizer": method.optimizer, "build_seconds": round(built - began, 2),
        "warmup_seconds": round(meter.began - built, 2), "parameters": spec["parameters"],
        "layers": spec["layers"], "peak_flops": spec["peak_flops"],
        "input_embedding_parameters": spec["input_embedding_parameters"], "flops_per_token": spec["flops_per_token"],
        "mean_example_tokens": spec["mean_length"], **record, "profile_table": f"{spec['label']}.profile.txt"}))
    print(json.dumps({"label": spec["label"], **{k: v for k, v in record.items() if k in ("steps", "seconds")}}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
