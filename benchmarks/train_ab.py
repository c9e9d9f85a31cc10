"""The train stage against the code of an earlier commit, on the demo's data, alternating, one run.

    uv run python benchmarks/train_ab.py [--before bec201d] [--rounds 3] [--epochs 0.5] [--micro 8] [--out FILE]

The earlier commit's phase1a/ and tasks/ are extracted with `git archive` into a scratch directory; each round
trains the same steps of the same tokenized demo split (SmolLM2-135M-Instruct, LoRA r16 alpha 32 on every
projection, batch 8, the demo's learning rate, checkpointing off, rows of `--micro` examples) once with that code
and once with this checkout's, each in a process of its own (`python -c`, its tree first on sys.path), in turn,
the order reversed every other round, so that the machine's drift hits both alike. The train stage's own
`TrainResult` is the measurement: useful tokens/s over the training loop (its wall time from the first step),
and the final loss, which must agree between the two (the same steps, the same initialisation).
"""
from __future__ import annotations

import argparse
import json
import platform
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
from datetime import datetime, timezone
from io import BytesIO
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

# Run inside each tree: the train stage, its settings limited to the fields both versions know.
TRAIN = """
import json, sys
sys.path.insert(0, sys.argv[1])
from phase1a.train.loop import train
from phase1a.train.settings import TrainSettings
settings = TrainSettings.model_validate_json(sys.argv[2])
result = train(settings)
print("RESULT " + json.dumps({"tokens_per_second": result.tokens_per_second, "final_loss": result.final_loss,
                              "wall_seconds": result.wall_seconds, "steps": result.steps,
                              "train_tokens": result.train_tokens}))
"""


def extract(commit: str, into: Path) -> Path:
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", commit, "phase1a", "tasks"], check=True,
                             capture_output=True).stdout
    with tarfile.open(fileobj=BytesIO(archive)) as tar:
        tar.extractall(into, filter="data")
    return into


def run(tree: Path, settings: dict) -> dict:
    done = subprocess.run([sys.executable, "-c", TRAIN, str(tree), json.dumps(settings)], capture_output=True,
                          text=True, cwd=tree)
    if done.returncode:
        raise RuntimeError(f"training in {tree} failed:\n{done.stderr[-3000:]}")
    line = next(line for line in done.stdout.splitlines() if line.startswith("RESULT "))
    return json.loads(line.removeprefix("RESULT "))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", default="bec201d", help="the earlier commit")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--epochs", type=float, default=0.5)
    parser.add_argument("--micro", type=int, default=8, help="a row's budget, in examples of max_seq_length")
    parser.add_argument("--work", type=Path, default=Path("/tmp/phase1a-train-ab"))
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()

    import torch

    from phase1a.config.schema import ModelConfig
    from phase1a.data.tokenizing import TokenizeOptions, tokenize_dataset
    from phase1a.model.loading import load_tokenizer, resolve_model

    args.work.mkdir(parents=True, exist_ok=True)
    data_path = ROOT / "data" / "demo_dates.jsonl"
    if not data_path.is_file():
        subprocess.run([sys.executable, str(ROOT / "data" / "make_demo_dataset.py")], check=True)
    model_dir = resolve_model(ModelConfig(name_or_path="smollm2-135m-instruct"))
    data = tokenize_dataset(data_path, load_tokenizer(model_dir), 8192, TokenizeOptions(validation_fraction=0.1),
                            args.work / "cache" / "demo")
    commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    trees = {"before": extract(args.before, Path(tempfile.mkdtemp(prefix="before-", dir=args.work))), "after": ROOT}
    results: dict[str, list[dict]] = {"before": [], "after": []}
    for round_index in range(args.rounds):
        for name in ("before", "after") if round_index % 2 == 0 else ("after", "before"):
            output_dir = args.work / f"run-{name}-{round_index}"
            shutil.rmtree(output_dir, ignore_errors=True)  # a finished run there would be reused, not trained
            settings = {"model_dir": str(model_dir), "train_path": data.train_path, "output_dir": str(output_dir),
                        "method": {"kind": "lora", "lora": {"r": 16, "alpha": 32}, "learning_rate": 1e-3,
                                   "batch_size": 8, "epochs": args.epochs},
                        "micro_batch_size": args.micro, "gradient_checkpointing": False,
                        "checkpoint_interval": "1000h", "show_progress": False}
            result = run(trees[name], settings)
            results[name].append(result)
            print(json.dumps({"round": round_index + 1, "code": name, **result}), flush=True)
    speeds = {name: [r["tokens_per_second"] for r in runs] for name, runs in results.items()}
    ratios = [after / before for before, after in zip(speeds["before"], speeds["after"])]
    summary = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "machine": platform.node(),
        "cores": len(__import__("os").sched_getaffinity(0)), "torch": torch.__version__,
        "command": " ".join(["benchmarks/train_ab.py", *sys.argv[1:]]), "before": args.before, "after": commit,
        "model": "SmolLM2-135M-Instruct", "data": "data/demo_dates.jsonl (the demo's train split)",
        "steps": results["after"][0]["steps"], "train_tokens": results["after"][0]["train_tokens"],
        "tokens_per_second": speeds,
        "mean_tokens_per_second": {name: round(statistics.mean(v), 1) for name, v in speeds.items()},
        "after_over_before_per_round": [round(r, 3) for r in ratios],
        "after_over_before": round(statistics.mean(speeds["after"]) / statistics.mean(speeds["before"]), 3),
        "final_loss": {name: [r["final_loss"] for r in runs] for name, runs in results.items()},
    }
    print(json.dumps(summary, indent=2))
    if args.out:
        from train_throughput import write_json

        write_json(args.out, summary)


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    main()
