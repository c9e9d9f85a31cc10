"""Two ranks under torchrun (gloo on CPU) train the same global batch as one process, to float noise: with DDP
(a whole model a rank) and FSDP (a shard a rank). Checkpoints hold whole tensors by name, so a sharded run's
checkpoint resumes in one process and ends where the sharded run ended."""
import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from helpers import date_records, make_tokenizer, write_jsonl
from phase1a.config.schema import MethodConfig
from phase1a.core.layout import list_checkpoints
from phase1a.data.tokenizing import TokenizeOptions, tokenize_dataset
from phase1a.train.launch import Launch, torchrun_command
from phase1a.train.result import TrainResult
from phase1a.train.runner import run
from phase1a.train.settings import EvalSettings, TrainSettings

# On CUDA the ranks join with NCCL, which takes one GPU a rank: a one-GPU host runs this on neither backend.
pytestmark = pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.device_count() < 2,
                                reason="needs two GPUs: NCCL takes one a rank")


@pytest.fixture(scope="module")
def one_process(tiny_model_dir, tmp_path_factory) -> tuple[callable, TrainResult]:
    root = tmp_path_factory.mktemp("distributed")
    data = tokenize_dataset(write_jsonl(root / "d.jsonl", date_records(45)), make_tokenizer(), 256,
                            TokenizeOptions(), root / "cache" / "fp")

    def settings(name: str, processes: int, strategy: str = "ddp", evaluate: bool = False) -> TrainSettings:
        # 45 examples in steps of 8: the last step has 5, so one rank gets 3 and the other 2.
        # Evaluating at each checkpoint with a patience never spent: every rank evaluates, best/ is gathered
        # from the shards at each improvement, and the weights stay those of a run without it.
        evaluation = EvalSettings(validation_path=data.validation_path, patience=100) if evaluate else None
        return TrainSettings(model_dir=str(tiny_model_dir), train_path=data.train_path,
                             output_dir=str(root / name), launch=Launch(processes=processes), strategy=strategy,
                             method=MethodConfig(learning_rate=5e-3, batch_size=8, epochs=1, lora={"r": 4, "alpha": 8}),
                             micro_batch_size=2, gradient_checkpointing=False, checkpoint_interval="2steps",
                             keep_last=3, show_progress=False, evaluation=evaluation)

    return settings, run(settings("one", 1))


def assert_same_adapter(a: TrainResult, b: TrainResult) -> None:
    weights_a = load_file(Path(a.adapter_dir) / "adapter_model.safetensors")
    weights_b = load_file(Path(b.adapter_dir) / "adapter_model.safetensors")
    assert weights_a.keys() == weights_b.keys()
    for name in weights_a:
        torch.testing.assert_close(weights_b[name], weights_a[name], rtol=1e-4, atol=1e-5, msg=name)


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_two_ranks_match_one_process(one_process, strategy):
    settings, one = one_process
    command = torchrun_command(Launch(processes=2, entry=["-m", "phase1a.train.rank"]), Path("s.json"))
    assert command[-5:] == ["--standalone", "--nproc_per_node=2", "-m", "phase1a.train.rank", "s.json"]
    two = run(settings(f"two-{strategy}", 2, strategy, evaluate=True))
    assert two.steps == one.steps == 6 and two.train_tokens == one.train_tokens  # tokens summed over ranks
    assert two.checkpoints_written == one.checkpoints_written == 2
    metrics = (Path(two.output_dir) / "metrics.jsonl").read_text().splitlines()
    assert len(metrics) == 6  # rank 0 alone writes
    points = [json.loads(line) for line in open(Path(two.output_dir) / "eval.jsonl")]
    assert [(p["step"], p["best"]) for p in points] == [(2, True), (4, True), (6, True)]  # the final one is best
    assert two.evaluations == 3 and two.best_step == 6 and (Path(two.output_dir) / "best").is_dir()
    assert_same_adapter(one, two)
    if strategy == "fsdp":  # the sharded run's step-2 checkpoint, resumed by one process, ends at the same weights
        resumed = Path(one.output_dir).with_name("fsdp-resumed")
        shutil.copytree(Path(two.output_dir) / "checkpoints", resumed / "checkpoints")
        for later in list_checkpoints(resumed / "checkpoints")[1:]:
            shutil.rmtree(later)
        result = run(settings(resumed.name, 1))
        assert result.resumed_from_step == 2
        assert_same_adapter(one, result)


@pytest.mark.slow
def test_a_rank_out_of_memory_relaunches_every_rank_with_half_the_budget(one_process, tmp_path, monkeypatch):
    """Rank 1 runs on a simulated 150-token device: rows of four examples (~180 tokens) fail there. Every rank
    is relaunched with rows of two, and the run ends where the one-process run with rows of two ended."""
    (tmp_path / "sitecustomize.py").write_text(textwrap.dedent('''
        import os
        if os.environ.get("RANK") == "1":  # only the second training rank, not torchrun's own process
            import torch

            def small_device(module, args):
                if isinstance(module, torch.nn.Embedding) and args[0].numel() > 150:
                    raise torch.OutOfMemoryError("CUDA out of memory (a 150-token device, simulated)")

            torch.nn.modules.module.register_module_forward_pre_hook(small_device)
    '''))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")])))
    settings, one = one_process
    result = run(settings("two-out-of-memory", 2).model_copy(update={"micro_batch_size": 4}))
    assert result.out_of_memory_backoffs == 1 and result.micro_batch_size == 2
    events = [json.loads(line) for line in open(Path(result.output_dir) / "events.jsonl")]
    assert [(e["event"], e["step"], e["micro_batch_size"]) for e in events] == [("out_of_memory", 1, 2)]
    assert not list(Path(result.output_dir).glob("out_of_memory.rank*.json"))
    assert result.train_tokens == one.train_tokens
    assert_same_adapter(one, result)


@pytest.mark.parametrize("body, code", [("print('trained', flush=True)", 0), ("raise ValueError('bad row')", 1)])
def test_a_rank_exits_with_its_outcome_and_without_the_interpreter_shutdown(tmp_path, body, code):
    """`run_rank` ends the process with os._exit after the entry: gloo threads freeing a finished collective's
    tensors during the interpreter's shutdown aborted a finished rank. An atexit hook shows the shutdown was
    skipped; a failed entry still prints its traceback and exits 1."""
    script = textwrap.dedent(f'''
        import atexit
        from phase1a.train.distributed import run_rank

        def entry():
            {body}

        atexit.register(lambda: print("interpreter shutdown", flush=True))
        run_rank(entry)
        print("after run_rank", flush=True)
    ''')
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK")}
    done = subprocess.run([sys.executable, "-c", script], cwd=Path(__file__).resolve().parents[2], env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == code, done.stderr
    assert "interpreter shutdown" not in done.stdout and "after run_rank" not in done.stdout
    if code:
        assert "ValueError: bad row" in done.stderr
    else:
        assert done.stdout == "trained\n"


@pytest.mark.slow
def test_the_ranks_show_progress_as_the_config_says(one_process, capfd):
    """The ranks are other processes, where the flow's `progress` settings were never applied: they come in the
    train settings. Lines an hour apart: the first and the last step only, from rank 0 alone; off: none."""
    from phase1a.config.schema import ProgressConfig

    settings, _ = one_process
    shown = {"show_progress": True, "progress": ProgressConfig(display="lines", interval="1h")}
    run(settings("two-lines", 2).model_copy(update=shown))
    steps = [line for line in capfd.readouterr().err.splitlines() if line.startswith("train: step")]
    assert [line.split(" (")[0] for line in steps] == ["train: step 1 of 6", "train: step 6 of 6"], steps
    off = {"show_progress": True, "progress": ProgressConfig(display="off")}
    run(settings("two-off", 2).model_copy(update=off))
    assert not [line for line in capfd.readouterr().err.splitlines() if line.startswith("train:")]
