"""Two ranks under torchrun (gloo on CPU) train the same global batch as one process, to float noise."""
from pathlib import Path

import torch
from safetensors.torch import load_file

from phase1a.config import MethodConfig
from phase1a.distributed import torchrun_command
from tasks.tokenize import TokenizeOptions, tokenize_dataset
from tasks.train import TrainSettings, run
from conftest import date_records, make_tokenizer, write_jsonl


def test_two_ranks_match_one_process(tiny_model_dir, tmp_path):
    data = tokenize_dataset(write_jsonl(tmp_path / "d.jsonl", date_records(45)), make_tokenizer(), 256,
                            TokenizeOptions(), tmp_path / "cache", "fp")

    def settings(name: str, processes: int) -> TrainSettings:
        # 45 examples in steps of 8: the last step has 5, so one rank gets 3 and the other 2.
        return TrainSettings(model_dir=str(tiny_model_dir), train_path=data.train_path,
                             output_dir=str(tmp_path / name), num_processes=processes,
                             method=MethodConfig(learning_rate=5e-3, batch_size=8, epochs=1, lora={"r": 4, "alpha": 8}),
                             micro_batch_size=2, gradient_checkpointing=False, checkpoint_interval="2steps",
                             show_progress=False)

    assert torchrun_command(2, Path("s.json"))[-4:] == ["--nproc_per_node=2", "-m", "tasks.train", "s.json"]
    one = run(settings("one", 1))
    two = run(settings("two", 2))
    assert two.steps == one.steps == 6 and two.train_tokens == one.train_tokens  # tokens summed over ranks
    assert two.checkpoints_written == one.checkpoints_written == 2
    metrics = (tmp_path / "two" / "metrics.jsonl").read_text().splitlines()
    assert len(metrics) == 6  # rank 0 alone writes
    a = load_file(Path(one.adapter_dir) / "adapter_model.safetensors")
    b = load_file(Path(two.adapter_dir) / "adapter_model.safetensors")
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(b[name], a[name], rtol=1e-4, atol=1e-5, msg=name)
