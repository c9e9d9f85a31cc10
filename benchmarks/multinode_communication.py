"""Two nodes against one process on this CPU, and the plan's communication model against a measurement.

    uv run python benchmarks/multinode_communication.py [--examples 160] [--max-answer-words 60] [--out FILE]

SmolLM2-135M-Instruct (the demo's model), LoRA r16 on every projection, batch 16, fp32, the same generated chat
examples, in order:
1. one process (`phase1a.train.runner.run`);
2. two "nodes": two torchrun agents on 127.0.0.1 joined by a c10d rendezvous (`phase1a/train/launch.py`'s host list),
   one rank each (gloo), the same global batch; both runs' tokens/s over their steps after the first
   (metrics.jsonl), and the two runs' final losses (the same training, to float noise);
3. under torchrun, two ranks time gloo all-reduces: a 64 MiB tensor (the loopback link's bandwidth) and a
   tensor the size of the LoRA gradients (fp32), 20 times each after 3 warm-ups.
The model's time for the gradients' all-reduce (`phase1a.plan.communication.ring` at the measured bandwidth, no
latency term) is set against the measured one; the measured all-reduce over the two-node step time is the
communication share. Not a speed claim: the two ranks share the machine's two cores. Prints JSON; `--out`
writes it.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

BIG = 64 * 1024 * 1024  # bytes: large enough that bandwidth, not latency, sets the time


def all_reduce_worker(out: Path, gradient_bytes: int) -> None:
    """A torchrun rank: time all-reduces of BIG bytes and of `gradient_bytes`; rank 0 writes the seconds."""
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    timings = {}
    for name, size in (("big", BIG), ("gradients", gradient_bytes)):
        tensor = torch.ones(size // 4, dtype=torch.float32)
        seconds = []
        for round_number in range(23):
            dist.barrier()
            began = time.perf_counter()
            dist.all_reduce(tensor)
            if round_number >= 3:
                seconds.append(time.perf_counter() - began)
        timings[name] = {"bytes": size, "median_seconds": statistics.median(seconds), "seconds": seconds}
    if dist.get_rank() == 0:
        out.write_text(json.dumps(timings))
    dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def steady(result) -> dict:
    """Tokens/s over the steps after the first (the first pays warm-up), from the run's metrics."""
    records = [json.loads(line) for line in open(Path(result.output_dir) / "metrics.jsonl")]
    later = records[1:]
    seconds = later[-1]["elapsed_s"] - records[0]["elapsed_s"]
    tokens = sum(record["tokens"] for record in later)
    return {"steps": len(records), "tokens_per_s": tokens / seconds, "seconds_per_step": seconds / len(later),
            "final_loss": records[-1]["loss"]}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--examples", type=int, default=160)
    parser.add_argument("--max-answer-words", type=int, default=60)
    parser.add_argument("--work", type=Path, default=Path("/tmp/phase1a-multinode-bench"))
    parser.add_argument("--out", type=Path)
    parser.add_argument("--all-reduce-worker", nargs=2, metavar=("OUT", "BYTES"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.all_reduce_worker:
        return all_reduce_worker(Path(args.all_reduce_worker[0]), int(args.all_reduce_worker[1]))

    from tokenize_throughput import generate

    from phase1a.config.schema import MethodConfig, ModelConfig
    from phase1a.data.tokenizing import TokenizeOptions, tokenize_dataset
    from phase1a.model.cost_model import lora_parameters, model_facts
    from phase1a.model.loading import load_tokenizer, resolve_model
    from phase1a.plan.communication import ring
    from phase1a.train.launch import Launch
    from phase1a.train.runner import run
    from phase1a.train.settings import TrainSettings

    work = args.work / datetime.now().strftime("%Y%m%dT%H%M%S")
    work.mkdir(parents=True)
    model_dir = Path(resolve_model(ModelConfig(name_or_path="smollm2-135m-instruct")))
    generate(work / "chat.jsonl", args.examples, max_answer_words=args.max_answer_words)
    data = tokenize_dataset(work / "chat.jsonl", load_tokenizer(model_dir), 2048, TokenizeOptions(), work / "cache")
    method = MethodConfig(kind="lora", learning_rate=1e-3, batch_size=16, epochs=1, lora={"r": 16, "alpha": 32})

    def settings(name: str, launch: Launch) -> TrainSettings:
        return TrainSettings(model_dir=str(model_dir), train_path=data.train_path, output_dir=str(work / name),
                             launch=launch, method=method, micro_batch_size=4, gradient_checkpointing=False,
                             checkpoint_interval="1000steps", show_progress=False)

    one = steady(run(settings("one", Launch())))
    two = steady(run(settings("two-nodes", Launch(nodes=2, hosts=["127.0.0.1", "localhost"],
                                                   rendezvous_port=free_port(), run_id="bench"))))

    trainable = lora_parameters(model_facts(model_dir), 16, method.lora.target_modules)
    timings_path = work / "all_reduce.json"
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                    __file__, "--all-reduce-worker", str(timings_path), str(trainable * 4)], check=True, cwd=ROOT,
                   env={**os.environ, "OMP_NUM_THREADS": "1"})
    timings = json.loads(timings_path.read_text())
    bandwidth = 2 * (2 - 1) / 2 * BIG / timings["big"]["median_seconds"]  # what ring() assumes, solved for it
    modelled = ring(trainable * 4, 2, bandwidth, all_reduce=True)
    measured = timings["gradients"]["median_seconds"]
    summary = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "machine": platform.node(),
        "cpus": os.cpu_count(), "command": " ".join(sys.argv), "examples": args.examples,
        "train_examples": data.train_examples, "trainable_parameters": trainable,
        "one_process": one, "two_nodes": two,
        "two_nodes_over_one": two["tokens_per_s"] / one["tokens_per_s"],
        "all_reduce": {name: {k: v for k, v in t.items() if k != "seconds"} for name, t in timings.items()},
        "loopback_bandwidth_bytes_per_s": bandwidth,
        "gradient_all_reduce_modelled_seconds": modelled, "gradient_all_reduce_measured_seconds": measured,
        "modelled_over_measured": modelled / measured,
        "communication_share_of_a_two_node_step": measured / two["seconds_per_step"],
    }
    print(json.dumps(summary, indent=2))
    if args.out:
        args.out.write_text(json.dumps(summary, indent=2) + "\n")


if __name__ == "__main__":
    main()
